//! The graph as the loader hands it over (`onnx.graph`, JSON): checked once at build into
//! numbered value slots, the initializers it reads loaded as constants (the large operands of
//! `Conv`, `Gemm` and `MatMul` as backend tensors), every node's operator parsed with its
//! attributes ([`crate::ops::Op`]), and for every node the slots no later node reads, freed
//! as soon as it has run.

use crate::ops::{Binary, Op, Unary};
use crate::value::{Array, Value};
use serde_json::Value as Json;
use std::collections::HashMap;
use std::sync::Arc;
use u_sdk::{DType, MetaValue, Result, UError, WeightSetBox, nn::Device};

/// The metadata key loader-onnx keeps the graph under.
pub const GRAPH_KEY: &str = "onnx.graph";

/// A dimension of a graph input or output.
#[derive(Clone, Debug, PartialEq)]
pub enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// A size the caller picks, by its symbol (`batch`).
    Named(String),
    /// Not stated.
    Unknown,
}

/// A graph input or output.
#[derive(Clone, Debug)]
pub struct Port {
    /// Its name.
    pub name: String,
    /// Its dimensions, when the graph states them.
    pub dims: Option<Vec<Dim>>,
    /// Whether its elements are integers (INT64, INT32: token ids) rather than floats.
    pub integer: bool,
    /// Its slot.
    pub slot: usize,
}

/// One operator call.
struct Node {
    /// The node's name (or its operator and index), for errors.
    label: String,
    op: Op,
    inputs: Vec<Option<usize>>,
    outputs: Vec<usize>,
    /// Slots read for the last time here.
    frees: Vec<usize>,
    /// Whether the result may be written over the first input (read for the last time here,
    /// and by no other input of this node).
    overwrite: bool,
}

/// A graph ready to run.
pub struct Graph {
    /// The inputs a caller feeds, in order.
    pub inputs: Vec<Port>,
    /// The outputs, in order.
    pub outputs: Vec<Port>,
    nodes: Vec<Node>,
    constants: Vec<(usize, Arc<Value>)>,
    slots: usize,
}

/// Reads an initializer as a value.
fn initializer(weights: &WeightSetBox, stored: &str, transposed: bool) -> Result<Value> {
    let view = weights.tensor(stored.into()).into_result()?;
    let dims: Vec<usize> = view.shape.iter().map(|&d| d as usize).collect();
    let bytes = view.data.as_slice();
    let value = match view.dtype {
        DType::I64 => Value::I64(Array::new(
            dims,
            bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        )?),
        DType::I32 => Value::I64(Array::new(
            dims,
            bytes
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes(c.try_into().expect("4 bytes"))))
                .collect(),
        )?),
        dtype => Value::F32(Array::new(dims, u_sdk::convert::to_f32(dtype, bytes)?)?),
    };
    match (transposed, value) {
        (true, Value::F32(a)) if a.dims.len() == 2 => {
            Ok(Value::F32(crate::value::permute(&a, &[1, 0])?))
        }
        (true, _) => Err(UError::invalid(format!(
            "{stored}: a transposed initializer that is not a float matrix"
        ))),
        (false, v) => Ok(v),
    }
}

/// A tensor attribute (`Constant`'s and `ConstantOfShape`'s `value`) as a value.
pub fn tensor_attribute(json: &Json) -> Result<Value> {
    let bad = || UError::invalid(format!("a tensor attribute the graph cannot use: {json}"));
    if let Some(e) = json.get("error") {
        return Err(UError::unsupported(format!("a tensor attribute: {e}")));
    }
    let dims: Vec<usize> = json
        .get("dims")
        .and_then(Json::as_array)
        .ok_or_else(bad)?
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize).ok_or_else(bad))
        .collect::<Result<_>>()?;
    let values = json
        .get("values")
        .and_then(Json::as_array)
        .ok_or_else(bad)?;
    if json.get("integer").and_then(Json::as_bool) == Some(true) {
        let data = values
            .iter()
            .map(|v| v.as_i64().ok_or_else(bad))
            .collect::<Result<_>>()?;
        Ok(Value::I64(Array::new(dims, data)?))
    } else {
        let float = |v: &Json| match (v.as_f64(), v.as_str()) {
            (Some(f), _) => Some(f as f32),
            (None, Some("inf")) => Some(f32::INFINITY),
            (None, Some("-inf")) => Some(f32::NEG_INFINITY),
            (None, Some("nan")) => Some(f32::NAN),
            _ => None,
        };
        let data = values
            .iter()
            .map(|v| float(v).ok_or_else(bad))
            .collect::<Result<_>>()?;
        Ok(Value::F32(Array::new(dims, data)?))
    }
}

fn strings(json: &Json, key: &str) -> Result<Vec<String>> {
    json.get(key)
        .and_then(Json::as_array)
        .ok_or_else(|| UError::invalid(format!("onnx.graph: no `{key}` list")))?
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| UError::invalid(format!("onnx.graph: `{key}` holds a non-string")))
        })
        .collect()
}

/// Who reads and who writes each slot, for the fusions.
struct Wiring<'a> {
    /// Readers per slot.
    readers: HashMap<usize, usize>,
    /// The node writing each slot.
    writer: HashMap<usize, usize>,
    /// The graph's outputs, which no fusion may swallow.
    kept: &'a std::collections::HashSet<usize>,
}

impl<'a> Wiring<'a> {
    fn of(nodes: &[Node], kept: &'a std::collections::HashSet<usize>) -> Self {
        let mut readers: HashMap<usize, usize> = HashMap::new();
        for s in nodes.iter().flat_map(|n| n.inputs.iter().flatten()) {
            *readers.entry(*s).or_default() += 1;
        }
        let writer = nodes
            .iter()
            .enumerate()
            .flat_map(|(i, n)| n.outputs.iter().map(move |&o| (o, i)))
            .collect();
        Self {
            readers,
            writer,
            kept,
        }
    }

    /// The node writing `slot`.
    fn writer(&self, slot: usize) -> Option<usize> {
        self.writer.get(&slot).copied()
    }

    /// Whether one node reads `slot` and it is no graph output (a fusion may swallow it).
    fn only_reader(&self, slot: usize) -> bool {
        self.readers.get(&slot) == Some(&1) && !self.kept.contains(&slot)
    }
}

/// Removes the nodes at the indices in `dropped` (a fusion's swallowed ones).
fn drop_nodes(nodes: &mut Vec<Node>, dropped: &std::collections::HashSet<usize>) {
    let mut index = 0;
    nodes.retain(|_| {
        index += 1;
        !dropped.contains(&(index - 1))
    });
}

/// Fuses each `Einsum(bct,bcs→bts)` → `Softmax(−1)` → `Einsum(bts,bcs→bct)` chain whose
/// intermediate values nothing else reads into one [`Op::Attention`]: the backend's attention
/// never writes the `t × s` scores out.
fn fuse_attention(nodes: &mut Vec<Node>, kept: &std::collections::HashSet<usize>) {
    let wiring = Wiring::of(nodes, kept);
    let mut dropped = std::collections::HashSet::new();
    for mix in 0..nodes.len() {
        let Op::Einsum(c) = &nodes[mix].op else {
            continue;
        };
        let Some(Some(weights)) = nodes[mix].inputs.first().copied() else {
            continue;
        };
        let Some(soft) = wiring.writer(weights) else {
            continue;
        };
        let Some(Some(scores_slot)) = nodes[soft].inputs.first().copied() else {
            continue;
        };
        let Some(scores) = wiring.writer(scores_slot) else {
            continue;
        };
        let chain = c.is_mix()
            && matches!(nodes[soft].op, Op::Softmax { axis: -1 | 2 })
            && matches!(&nodes[scores].op, Op::Einsum(s) if s.is_scores())
            && wiring.only_reader(weights)
            && wiring.only_reader(scores_slot)
            && nodes[mix].inputs.len() == 2
            && nodes[scores].inputs.len() == 2;
        if !chain {
            continue;
        }
        let (q, k, v) = (
            nodes[scores].inputs[0],
            nodes[scores].inputs[1],
            nodes[mix].inputs[1],
        );
        nodes[mix].op = Op::Attention;
        nodes[mix].inputs = vec![q, k, v];
        dropped.extend([soft, scores]);
    }
    drop_nodes(nodes, &dropped);
}

/// Fuses each `MatMul(q, kᵀ)` → `Softmax` → `MatMul(·, v)` chain of computed operands whose
/// intermediate values nothing else reads (an exported scaled-dot-product attention) into one
/// [`Op::MatMulAttention`]: the `n × m` scores are never written out where the backend's
/// attention takes the shapes.
fn fuse_matmul_attention(nodes: &mut Vec<Node>, kept: &std::collections::HashSet<usize>) {
    let wiring = Wiring::of(nodes, kept);
    let mut dropped = std::collections::HashSet::new();
    for mix in 0..nodes.len() {
        let (Op::BatchedMatMul, &[Some(weights), Some(v)]) =
            (&nodes[mix].op, nodes[mix].inputs.as_slice())
        else {
            continue;
        };
        let Some(soft) = wiring.writer(weights) else {
            continue;
        };
        let Op::Softmax { axis } = nodes[soft].op else {
            continue;
        };
        let Some(Some(scores_slot)) = nodes[soft].inputs.first().copied() else {
            continue;
        };
        let Some(scores) = wiring.writer(scores_slot) else {
            continue;
        };
        let (Op::BatchedMatMul, &[Some(q), Some(kt)]) =
            (&nodes[scores].op, nodes[scores].inputs.as_slice())
        else {
            continue;
        };
        if !(wiring.only_reader(weights) && wiring.only_reader(scores_slot)) {
            continue;
        }
        nodes[mix].op = Op::MatMulAttention { axis };
        nodes[mix].inputs = vec![Some(q), Some(kt), Some(v)];
        dropped.extend([soft, scores]);
    }
    drop_nodes(nodes, &dropped);
}

/// Fuses each `Sigmoid(x)` whose only reader is a `Mul` of it and `x` into one SiLU
/// ([`Unary::Silu`]): one pass and one value fewer.
fn fuse_silu(nodes: &mut Vec<Node>, kept: &std::collections::HashSet<usize>) {
    let wiring = Wiring::of(nodes, kept);
    let mut dropped = std::collections::HashSet::new();
    for mul in 0..nodes.len() {
        let (Op::Binary(Binary::Mul), &[Some(a), Some(b)]) =
            (&nodes[mul].op, nodes[mul].inputs.as_slice())
        else {
            continue;
        };
        let sigmoid = [(a, b), (b, a)].into_iter().find_map(|(x, s)| {
            let w = wiring.writer(s)?;
            let node = &nodes[w];
            (matches!(node.op, Op::Unary(Unary::Sigmoid))
                && node.inputs[..] == [Some(x)]
                && wiring.only_reader(s))
            .then_some((w, x))
        });
        if let Some((w, x)) = sigmoid {
            nodes[mul].op = Op::Unary(Unary::Silu);
            nodes[mul].inputs = vec![Some(x)];
            dropped.insert(w);
        }
    }
    drop_nodes(nodes, &dropped);
}

impl Graph {
    /// Reads the graph of `weights` (loader-onnx's `onnx.graph`) and prepares it on `device`.
    pub fn load(weights: &WeightSetBox, device: &Device) -> Result<Graph> {
        let text = match weights
            .metadata(GRAPH_KEY.into())
            .into_result()?
            .into_option()
        {
            Some(MetaValue::Json(t)) => t,
            _ => {
                return Err(UError::invalid(format!(
                    "the weights carry no ONNX graph (`{GRAPH_KEY}`): arch-onnx runs graphs \
                     that loader-onnx reads"
                )));
            }
        };
        let json: Json = serde_json::from_str(&text)
            .map_err(|e| UError::invalid(format!("{GRAPH_KEY}: {e}")))?;
        let stored: HashMap<String, DType> = weights
            .tensors()
            .into_result()?
            .into_iter()
            .map(|t| (t.name.to_string(), t.dtype))
            .collect();
        let renamed = json.get("renamed").and_then(Json::as_object);

        let mut slots: HashMap<String, usize> = HashMap::new();
        let mut slot_of = |name: &str| {
            let next = slots.len();
            *slots.entry(name.to_string()).or_insert(next)
        };
        let ports = |key: &str, slot_of: &mut dyn FnMut(&str) -> usize| -> Result<Vec<Port>> {
            json.get(key)
                .and_then(Json::as_array)
                .ok_or_else(|| UError::invalid(format!("{GRAPH_KEY}: no `{key}`")))?
                .iter()
                .map(|p| {
                    let name = p.get("name").and_then(Json::as_str).unwrap_or_default();
                    let dims = p.get("shape").and_then(Json::as_array).map(|dims| {
                        dims.iter()
                            .map(|d| match (d.as_u64(), d.as_str()) {
                                (Some(n), _) => Dim::Fixed(n as usize),
                                (None, Some(s)) => Dim::Named(s.to_string()),
                                _ => Dim::Unknown,
                            })
                            .collect()
                    });
                    Ok(Port {
                        name: name.to_string(),
                        dims,
                        integer: matches!(p.get("elem_type").and_then(Json::as_i64), Some(6 | 7)),
                        slot: slot_of(name),
                    })
                })
                .collect()
        };
        let inputs = ports("inputs", &mut slot_of)?;
        let outputs = ports("outputs", &mut slot_of)?;
        let fed: std::collections::HashSet<usize> = inputs.iter().map(|p| p.slot).collect();

        let nodes_json = json
            .get("nodes")
            .and_then(Json::as_array)
            .ok_or_else(|| UError::invalid(format!("{GRAPH_KEY}: no `nodes`")))?;
        let mut constants: HashMap<usize, Arc<Value>> = HashMap::new();
        let mut written: std::collections::HashSet<usize> = fed.clone();
        let mut nodes = Vec::with_capacity(nodes_json.len());
        for (index, n) in nodes_json.iter().enumerate() {
            let op_type = n.get("op").and_then(Json::as_str).unwrap_or_default();
            let name = n.get("name").and_then(Json::as_str).unwrap_or_default();
            let label = if name.is_empty() {
                format!("{op_type} (node {index})")
            } else {
                format!("{op_type} `{name}`")
            };
            let domain = n.get("domain").and_then(Json::as_str).unwrap_or_default();
            if !domain.is_empty() && domain != "ai.onnx" {
                return Err(UError::unsupported(format!(
                    "{label}: operators of the domain `{domain}` are not implemented"
                )));
            }
            let empty = serde_json::Map::new();
            let attributes = n
                .get("attributes")
                .and_then(Json::as_object)
                .unwrap_or(&empty);
            let input_names = strings(n, "inputs")?;
            let output_names = strings(n, "outputs")?;

            let mut input_slots = Vec::with_capacity(input_names.len());
            let mut operands: Vec<Option<Arc<Value>>> = Vec::new();
            for input in &input_names {
                if input.is_empty() {
                    input_slots.push(None);
                    operands.push(None);
                    continue;
                }
                let slot = slot_of(input);
                if !written.contains(&slot) && !constants.contains_key(&slot) {
                    let (stored_name, transposed) = match renamed.and_then(|r| r.get(input)) {
                        Some(r) => (
                            r.get("name")
                                .and_then(Json::as_str)
                                .unwrap_or(input)
                                .to_string(),
                            r.get("transposed").and_then(Json::as_bool) == Some(true),
                        ),
                        None => (input.clone(), false),
                    };
                    if !stored.contains_key(&stored_name) {
                        return Err(UError::invalid(format!(
                            "{label} reads `{input}`, which no earlier node writes and no \
                             initializer holds"
                        )));
                    }
                    constants.insert(
                        slot,
                        Arc::new(initializer(weights, &stored_name, transposed)?),
                    );
                }
                input_slots.push(Some(slot));
                operands.push(constants.get(&slot).cloned());
            }
            let op = Op::parse(op_type, attributes, &operands, device)
                .map_err(|e| UError::new(e.kind, format!("{label}: {}", e.message)))?;
            let output_slots: Vec<usize> = output_names.iter().map(|o| slot_of(o)).collect();
            if op_type == "Constant" {
                let value = attributes
                    .get("value")
                    .ok_or_else(|| UError::unsupported(format!("{label}: only `value` constants")))
                    .and_then(tensor_attribute)?;
                constants.insert(output_slots[0], Arc::new(value));
                continue;
            }
            written.extend(output_slots.iter().copied());
            nodes.push(Node {
                label,
                op,
                inputs: input_slots,
                outputs: output_slots,
                frees: Vec::new(),
                overwrite: false,
            });
        }
        for o in &outputs {
            if !written.contains(&o.slot) && !constants.contains_key(&o.slot) {
                return Err(UError::invalid(format!(
                    "the graph's output `{}` is written by no node",
                    o.name
                )));
            }
        }
        let kept: std::collections::HashSet<usize> = outputs.iter().map(|o| o.slot).collect();
        fuse_attention(&mut nodes, &kept);
        fuse_matmul_attention(&mut nodes, &kept);
        fuse_silu(&mut nodes, &kept);
        // Free every computed slot after its last reader, keeping the graph's outputs.
        let mut last: HashMap<usize, usize> = HashMap::new();
        for (i, node) in nodes.iter().enumerate() {
            for s in node.inputs.iter().flatten() {
                last.insert(*s, i);
            }
        }
        for (slot, i) in last {
            if !kept.contains(&slot) && !constants.contains_key(&slot) {
                nodes[i].frees.push(slot);
            }
        }
        for node in &mut nodes {
            node.overwrite = match node.inputs.split_first() {
                Some((Some(first), rest)) => {
                    node.op.can_overwrite()
                        && node.frees.contains(first)
                        && !rest.contains(&Some(*first))
                }
                _ => false,
            };
        }
        Ok(Graph {
            inputs,
            outputs,
            nodes,
            constants: constants.into_iter().collect(),
            slots: slots.len(),
        })
    }

    /// The input channels of the first `Conv` that reads input `index` directly: what a
    /// graph exported with its channel axis left free takes.
    pub fn conv_channels(&self, index: usize) -> Option<usize> {
        let slot = self.inputs.get(index)?.slot;
        self.nodes
            .iter()
            .find_map(|n| match (&n.op, n.inputs.first()) {
                (Op::Conv { weight, .. }, Some(&Some(s))) if s == slot => {
                    weight.dims().get(1).map(|&c| c as usize)
                }
                _ => None,
            })
    }

    /// Runs the graph on `feeds` (one per input, in order), giving the outputs in order.
    pub fn run(&self, device: &Device, feeds: Vec<Value>) -> Result<Vec<Value>> {
        let mut slots: Vec<Option<Arc<Value>>> = vec![None; self.slots];
        for (slot, value) in &self.constants {
            slots[*slot] = Some(Arc::clone(value));
        }
        for (port, value) in self.inputs.iter().zip(feeds) {
            slots[port.slot] = Some(Arc::new(value));
        }
        for node in &self.nodes {
            // A first input no later node reads, held by nothing else: the result's buffer.
            let owned = match (node.overwrite, node.inputs.first()) {
                (true, Some(&Some(s))) => match slots[s].take().map(Arc::try_unwrap) {
                    Some(Ok(Value::F32(a))) => Some(a),
                    Some(Ok(other)) => {
                        slots[s] = Some(Arc::new(other));
                        None
                    }
                    Some(Err(shared)) => {
                        slots[s] = Some(shared);
                        None
                    }
                    None => None,
                },
                _ => None,
            };
            let inputs: Vec<Option<&Value>> = node
                .inputs
                .iter()
                .map(|s| s.and_then(|s| slots[s].as_deref()))
                .collect();
            let results = match owned {
                Some(first) => node.op.run_over(first, &inputs[1..]).map(|v| vec![v]),
                None => node.op.run(device, &inputs),
            }
            .map_err(|e| UError::new(e.kind, format!("{}: {}", node.label, e.message)))?;
            if results.len() != node.outputs.len() {
                return Err(UError::invalid(format!(
                    "{}: {} outputs made, {} named",
                    node.label,
                    results.len(),
                    node.outputs.len()
                )));
            }
            for (slot, value) in node.outputs.iter().zip(results) {
                slots[*slot] = Some(Arc::new(value));
            }
            for slot in &node.frees {
                slots[*slot] = None;
            }
        }
        self.outputs
            .iter()
            .map(|o| {
                slots[o.slot]
                    .take()
                    .map(|v| Arc::try_unwrap(v).unwrap_or_else(|shared| (*shared).clone()))
                    .ok_or_else(|| UError::invalid(format!("output `{}` was not made", o.name)))
            })
            .collect()
    }
}
