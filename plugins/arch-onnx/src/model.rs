//! A graph as a model of the ABI. The graph's signature says what it is:
//!
//! - **Maps.** A first input `[batch, c, h, w]` (a feature map: [`Segment::Planes`]) and a
//!   first output `[batch, c′, h′, w′]` (written as [`Output::Planes`]). Its further float
//!   inputs are, in the graph's order, the chunk's conditioning when `[batch]` or
//!   `[batch, k]` (a terrain denoiser's noise level σ, then its difficulty; a UNet's timestep)
//!   and its cross-attention context when `[batch, rows, width]` (a UNet's
//!   `encoder_hidden_states`, the chunk's [`u_sdk::CrossContext`]). With such inputs it is a
//!   [`ModelKind::Denoiser`], without them an [`ModelKind::Autoencoder`]. Where the export
//!   left the channels free, the first `Conv` reading the map says them; where it left the
//!   output's size or channels free, one pass over an 8×8 map at build measures them.
//! - **Tokens** ([`crate::tokens`]). A first input of integers `[batch, sequence]` (token ids)
//!   and a first output `[batch, sequence, width]`: a text encoder, its rows the
//!   [`Output::Hidden`] of its last layer, its second output `[batch, width]` (when there is
//!   one) the [`Output::Pooled`] row.
//!
//! Chunks of one size run as one batch when the graph's batch axis is free.

use crate::graph::{Dim, Graph, Port};
use crate::tokens::Tokens;
use crate::value::{Array, Value};
use abi_stable::std_types::ROption;
use u_sdk::{
    AttentionMask, ModelConfig, ModelKind, Output, PlaneSpec, Planes, Pooling, Result, Segment,
    SeqChunk, UError, nn::Device,
};

/// The largest map a pass reads, in pixels: a bound on the memory one request can ask for.
pub const MAX_PIXELS: u64 = 4096 * 4096;

/// The side of the map a graph with free sizes is measured on at build.
const PROBE_SIDE: usize = 8;

/// A graph and what its signature means.
pub struct GraphModel {
    graph: Graph,
    device: Device,
    signature: Signature,
}

/// What the graph's inputs and outputs are.
enum Signature {
    Maps(Maps),
    Tokens(Tokens),
}

/// What one of a map graph's further inputs takes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Further {
    /// This many conditioning values per chunk, fed `[batch]` (`rank1`) or `[batch, k]`.
    Values { k: usize, rank1: bool },
    /// The cross-attention context, rows of this width.
    Context(usize),
}

/// A map-to-map graph's signature.
struct Maps {
    spec: PlaneSpec,
    further: Vec<Further>,
    /// The map size the graph states, if it fixes one.
    fixed: Option<(u32, u32)>,
    /// Whether the graph's batch axis is free (else chunks run one at a time).
    batched: bool,
}

fn fixed(d: &Dim) -> Option<usize> {
    match d {
        Dim::Fixed(n) => Some(*n),
        _ => None,
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The refusal of a graph whose signature says nothing this plugin runs.
fn signature(why: String) -> UError {
    UError::unsupported(format!(
        "arch-onnx runs graphs that map a feature map [batch, c, h, w] (with conditioning \
         values [batch] or [batch, k] and a context [batch, rows, width]) to a feature map, \
         and graphs that map token ids [batch, sequence] to rows: {why}"
    ))
}

/// A port's stated dimensions.
pub(crate) fn dims_of(p: &Port) -> Result<Vec<Dim>> {
    p.dims
        .clone()
        .ok_or_else(|| signature(format!("`{}` has no stated shape", p.name)))
}

impl GraphModel {
    /// Reads what `graph`'s signature means.
    pub fn new(graph: Graph, device: Device) -> Result<GraphModel> {
        let Some(first) = graph.inputs.first() else {
            return Err(signature("the graph has no input".into()));
        };
        if graph.outputs.is_empty() {
            return Err(signature("the graph has no output".into()));
        }
        let signature = match first.integer {
            true => Signature::Tokens(Tokens::new(&graph)?),
            false => Signature::Maps(Maps::new(&graph, &device)?),
        };
        Ok(GraphModel {
            graph,
            device,
            signature,
        })
    }

    /// The graph's input names, in order (the map, then the conditioning).
    pub fn input_names(&self) -> Vec<&str> {
        self.graph.inputs.iter().map(|p| p.name.as_str()).collect()
    }

    /// What the ABI says of it.
    pub fn model_config(&self) -> ModelConfig {
        let base = ModelConfig {
            kind: ModelKind::Autoencoder,
            family: crate::FAMILY.into(),
            vocab_size: 0,
            hidden: 0,
            layers: 0,
            context_length: 0,
            experts: 0,
            attention: AttentionMask::Bidirectional,
            pooling: Pooling::Mean,
            context_shape: [0, 0],
            image: ROption::RNone,
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: ROption::RNone,
        };
        match &self.signature {
            Signature::Tokens(t) => t.model_config(base),
            Signature::Maps(m) => {
                let context = m.further.iter().find_map(|f| match f {
                    Further::Context(w) => Some(*w as u32),
                    Further::Values { .. } => None,
                });
                ModelConfig {
                    kind: match m.further.is_empty() {
                        true => ModelKind::Autoencoder,
                        false => ModelKind::Denoiser,
                    },
                    hidden: m.spec.in_channels,
                    context_shape: [0, context.unwrap_or(0)],
                    planes: ROption::RSome(m.spec),
                    ..base
                }
            }
        }
    }

    /// Runs every chunk and writes the outputs asked for into `out`.
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        match &self.signature {
            Signature::Tokens(t) => t.forward(&self.graph, &self.device, batch, out),
            Signature::Maps(m) => m.forward(self, batch, out),
        }
    }
}

impl Maps {
    fn new(graph: &Graph, device: &Device) -> Result<Maps> {
        let (map, result) = (&graph.inputs[0], &graph.outputs[0]);
        let (input, output) = (dims_of(map)?, dims_of(result)?);
        let [batch, c, h, w] = input.as_slice() else {
            return Err(signature(format!("the input `{}` is {input:?}", map.name)));
        };
        let [_, c_out, h_out, w_out] = output.as_slice() else {
            return Err(signature(format!(
                "the output `{}` is {output:?}",
                result.name
            )));
        };
        let further = graph.inputs[1..]
            .iter()
            .map(|p| match dims_of(p)?.as_slice() {
                [_] if !p.integer => Ok(Further::Values { k: 1, rank1: true }),
                [_, Dim::Fixed(k)] if !p.integer => Ok(Further::Values {
                    k: *k,
                    rank1: false,
                }),
                [_, _, Dim::Fixed(width)] if !p.integer => Ok(Further::Context(*width)),
                other => Err(signature(format!("the input `{}` is {other:?}", p.name))),
            })
            .collect::<Result<Vec<_>>>()?;
        if further
            .iter()
            .filter(|f| matches!(f, Further::Context(_)))
            .count()
            > 1
        {
            return Err(signature("it reads two cross-attention contexts".into()));
        }
        let c = fixed(c)
            .or_else(|| graph.conv_channels(0))
            .ok_or_else(|| signature("the input's channels are not fixed".into()))?;
        let stated = match (fixed(h), fixed(h_out), fixed(w), fixed(w_out), fixed(c_out)) {
            (Some(h), Some(ho), Some(w), Some(wo), Some(co)) if ho * w == wo * h => {
                let (n, d) = (ho as u32, h as u32);
                let g = gcd(n, d).max(1);
                Some(([n / g, d / g], co))
            }
            (.., Some(co)) if h == h_out && w == w_out => Some(([1, 1], co)),
            _ => None,
        };
        let (scale, c_out) = match stated {
            Some(s) => s,
            None => probe(graph, device, c, &further)?,
        };
        let fixed_size = fixed(h).zip(fixed(w)).map(|(h, w)| (h as u32, w as u32));
        Ok(Maps {
            spec: PlaneSpec {
                in_channels: c as u32,
                out_channels: c_out as u32,
                scale,
                multiple: 1,
                sample_size: match fixed_size {
                    Some((h, w)) if h == w => h,
                    _ => 0,
                },
            },
            further,
            batched: !matches!(batch, Dim::Fixed(1)),
            fixed: fixed_size,
        })
    }

    /// Checks every chunk, runs those of one size (and one context length) as one batch, and
    /// writes the maps asked for into `out`.
    fn forward(&self, model: &GraphModel, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let width: usize = self
            .further
            .iter()
            .map(|f| match f {
                Further::Values { k, .. } => *k,
                Further::Context(_) => 0,
            })
            .sum();
        let context = self.further.iter().find_map(|f| match f {
            Further::Context(w) => Some(*w),
            Further::Values { .. } => None,
        });
        let mut jobs = Vec::with_capacity(batch.len());
        for chunk in batch {
            let bad =
                |why: String| UError::invalid(format!("arch-onnx (sequence {}): {why}", chunk.seq));
            let [Segment::Planes(planes)] = chunk.input.as_slice() else {
                return Err(bad("a chunk is one feature map (`Segment::Planes`)".into()));
            };
            let wanted = match chunk.output {
                Output::Planes => true,
                Output::Nothing => false,
                other => {
                    return Err(UError::unsupported(format!(
                        "arch-onnx writes feature maps (`Output::Planes`), not {other:?}"
                    )));
                }
            };
            let out_size = planes
                .check(&self.spec)
                .map_err(|e| bad(e.message.to_string()))?;
            if let Some((h, w)) = self.fixed
                && (planes.height, planes.width) != (h, w)
            {
                return Err(bad(format!(
                    "the graph takes {h}×{w} maps, not {}×{}",
                    planes.height, planes.width
                )));
            }
            if u64::from(planes.height) * u64::from(planes.width) > MAX_PIXELS {
                return Err(bad(format!("a map larger than {MAX_PIXELS} pixels")));
            }
            let x = &chunk.extras;
            if !x.adapters.is_empty() || !x.steering.is_empty() {
                return Err(UError::unsupported(
                    "arch-onnx: adapters and steering are not applied to graphs",
                ));
            }
            let rows = match (context, x.cross.as_ref()) {
                (Some(w), ROption::RSome(cross))
                    if !cross.rows.is_empty() && cross.rows.len() % w == 0 =>
                {
                    cross.rows.as_slice()
                }
                (Some(w), _) => {
                    return Err(bad(format!(
                        "the graph cross-attends to a context of rows of {w} values; give one"
                    )));
                }
                (None, ROption::RSome(_)) => {
                    return Err(UError::unsupported(
                        "arch-onnx: this graph reads no cross-attention context",
                    ));
                }
                (None, ROption::RNone) => &[][..],
            };
            if x.conditioning.len() != width || x.conditioning.iter().any(|v| !v.is_finite()) {
                return Err(bad(format!(
                    "the conditioning is {width} finite values (the graph's inputs {}), given {}",
                    model.input_names()[1..].join(", "),
                    x.conditioning.len()
                )));
            }
            jobs.push(Job {
                planes,
                out_size,
                wanted,
                conditioning: x.conditioning.as_slice(),
                context: rows,
            });
        }
        let need: usize = jobs
            .iter()
            .filter(|j| j.wanted)
            .map(|j| {
                self.spec.out_channels as usize * j.out_size.0 as usize * j.out_size.1 as usize
            })
            .sum();
        if out.len() != need {
            return Err(UError::invalid(format!(
                "arch-onnx: the output buffer holds {} floats, the maps asked for {need}",
                out.len()
            )));
        }
        let mut written = 0;
        let mut start = 0;
        while start < jobs.len() {
            let alike = |j: &Job<'_>| {
                (j.planes.height, j.planes.width, j.context.len())
                    == (
                        jobs[start].planes.height,
                        jobs[start].planes.width,
                        jobs[start].context.len(),
                    )
            };
            let mut end = start + 1;
            while self.batched && end < jobs.len() && alike(&jobs[end]) {
                end += 1;
            }
            let group = &jobs[start..end];
            let map = self.run(model, group)?;
            let n = group.len();
            let each = map.data.len() / n;
            let (oh, ow) = group[0].out_size;
            if map.dims.len() != 4
                || map.dims[0] != n
                || each != self.spec.out_channels as usize * oh as usize * ow as usize
            {
                return Err(UError::invalid(format!(
                    "arch-onnx: the graph made a {:?} output where {n}×{}×{oh}×{ow} was stated",
                    map.dims, self.spec.out_channels
                )));
            }
            for (i, job) in group.iter().enumerate() {
                if job.wanted {
                    out[written..written + each]
                        .copy_from_slice(&map.data[i * each..(i + 1) * each]);
                    written += each;
                }
            }
            start = end;
        }
        Ok(())
    }

    /// One pass over `group` (chunks of one map size and context length) as one batch.
    fn run(&self, model: &GraphModel, group: &[Job<'_>]) -> Result<Array<f32>> {
        let n = group.len();
        let c = self.spec.in_channels as usize;
        let (h, w) = (
            group[0].planes.height as usize,
            group[0].planes.width as usize,
        );
        let mut feeds = vec![Value::F32(Array::new(
            vec![n, c, h, w],
            group
                .iter()
                .flat_map(|j| j.planes.values.iter().copied())
                .collect(),
        )?)];
        let mut offset = 0;
        for f in &self.further {
            feeds.push(Value::F32(match *f {
                Further::Values { k, rank1 } => {
                    let data: Vec<f32> = group
                        .iter()
                        .flat_map(|j| j.conditioning[offset..offset + k].iter().copied())
                        .collect();
                    offset += k;
                    let dims = if rank1 && k == 1 { vec![n] } else { vec![n, k] };
                    Array::new(dims, data)?
                }
                Further::Context(width) => Array::new(
                    vec![n, group[0].context.len() / width, width],
                    group
                        .iter()
                        .flat_map(|j| j.context.iter().copied())
                        .collect(),
                )?,
            }));
        }
        let mut result = model.graph.run(&model.device, feeds)?;
        match result.swap_remove(0) {
            Value::F32(map) => Ok(map),
            Value::I64(_) => Err(UError::invalid(
                "arch-onnx: the graph's output is integers, not a map",
            )),
        }
    }
}

/// One chunk of a map graph's batch, checked.
struct Job<'a> {
    planes: &'a Planes<'a>,
    out_size: (u32, u32),
    wanted: bool,
    conditioning: &'a [f32],
    context: &'a [f32],
}

/// The scale and output channels of a graph whose export left them free, measured by one
/// pass over a [`PROBE_SIDE`]-square map of zeros (zero conditioning, one context row of
/// zeros).
fn probe(
    graph: &Graph,
    device: &Device,
    c: usize,
    further: &[Further],
) -> Result<([u32; 2], usize)> {
    let side = PROBE_SIDE;
    let mut feeds = vec![Value::F32(Array::new(
        vec![1, c, side, side],
        vec![0.0; c * side * side],
    )?)];
    for f in further {
        feeds.push(Value::F32(match *f {
            Further::Values { k, rank1 } if rank1 && k == 1 => Array::new(vec![1], vec![0.0])?,
            Further::Values { k, .. } => Array::new(vec![1, k], vec![0.0; k])?,
            Further::Context(width) => Array::new(vec![1, 1, width], vec![0.0; width])?,
        }));
    }
    let made = graph.run(device, feeds).map_err(|e| {
        signature(format!(
            "its output's size is not stated, and a pass over a {side}×{side} map to measure \
             it failed: {}",
            e.message
        ))
    })?;
    match made[0].dims() {
        &[1, c_out, oh, ow] if oh == ow && oh > 0 => {
            let g = gcd(oh as u32, side as u32).max(1);
            Ok(([oh as u32 / g, side as u32 / g], c_out))
        }
        other => Err(signature(format!(
            "a {side}×{side} map made a {other:?} output"
        ))),
    }
}
