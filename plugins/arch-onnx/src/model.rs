//! A graph as a model of the ABI. The graph's signature says what it is: a first input
//! `[batch, c, h, w]` (a feature map: [`Segment::Planes`]) and a first output
//! `[batch, c′, h′, w′]` (written as [`Output::Planes`]); its further inputs, each `[batch]`
//! or `[batch, k]` floats, are the chunk's conditioning, in the graph's order (a terrain
//! denoiser's noise level σ, then its difficulty). With such inputs it is a
//! [`ModelKind::Denoiser`], without them an [`ModelKind::Autoencoder`]. Chunks of one size run
//! as one batch when the graph's batch axis is free.

use crate::graph::{Dim, Graph, Port};
use crate::value::{Array, Value};
use abi_stable::std_types::ROption;
use u_sdk::{
    AttentionMask, ModelConfig, ModelKind, Output, PlaneSpec, Pooling, Result, Segment, SeqChunk,
    UError, nn::Device,
};

/// The largest map a pass reads, in pixels: a bound on the memory one request can ask for.
pub const MAX_PIXELS: u64 = 4096 * 4096;

/// A graph and what its signature means.
pub struct GraphModel {
    graph: Graph,
    device: Device,
    spec: PlaneSpec,
    /// Floats of conditioning each further input takes, in order.
    conditioning: Vec<usize>,
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

impl GraphModel {
    /// Reads what `graph`'s signature means.
    pub fn new(graph: Graph, device: Device) -> Result<GraphModel> {
        let signature = |why: String| {
            UError::unsupported(format!(
                "arch-onnx runs graphs that map a feature map [batch, c, h, w] and conditioning \
                 values [batch] or [batch, k] to a feature map: {why}"
            ))
        };
        let dims_of = |p: &Port| {
            p.dims
                .clone()
                .ok_or_else(|| signature(format!("`{}` has no stated shape", p.name)))
        };
        let (Some(map), Some(result)) = (graph.inputs.first(), graph.outputs.first()) else {
            return Err(signature("the graph has no input or no output".into()));
        };
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
        let (Some(c), Some(c_out)) = (fixed(c), fixed(c_out)) else {
            return Err(signature("the channels are not fixed".into()));
        };
        let scale = match (fixed(h), fixed(h_out), fixed(w), fixed(w_out)) {
            (Some(h), Some(ho), Some(w), Some(wo)) if ho * w == wo * h => {
                let (n, d) = (ho as u32, h as u32);
                let g = gcd(n, d).max(1);
                [n / g, d / g]
            }
            _ if h == h_out && w == w_out => [1, 1],
            _ => {
                return Err(signature(format!(
                    "the output's size ({h_out:?} × {w_out:?}) does not follow from the \
                     input's ({h:?} × {w:?})"
                )));
            }
        };
        let conditioning = graph.inputs[1..]
            .iter()
            .map(|p| match dims_of(p)?.as_slice() {
                [_] => Ok(1),
                [_, Dim::Fixed(k)] => Ok(*k),
                other => Err(signature(format!("the input `{}` is {other:?}", p.name))),
            })
            .collect::<Result<Vec<_>>>()?;
        let fixed_size = fixed(h).zip(fixed(w)).map(|(h, w)| (h as u32, w as u32));
        Ok(GraphModel {
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
            batched: !matches!(batch, Dim::Fixed(1)),
            graph,
            device,
            conditioning,
            fixed: fixed_size,
        })
    }

    /// The graph's input names, in order (the map, then the conditioning).
    pub fn input_names(&self) -> Vec<&str> {
        self.graph.inputs.iter().map(|p| p.name.as_str()).collect()
    }

    /// What the ABI says of it.
    pub fn model_config(&self) -> ModelConfig {
        let kind = match self.conditioning.is_empty() {
            true => ModelKind::Autoencoder,
            false => ModelKind::Denoiser,
        };
        ModelConfig {
            kind,
            family: crate::FAMILY.into(),
            vocab_size: 0,
            hidden: self.spec.in_channels,
            layers: 0,
            context_length: 0,
            experts: 0,
            attention: AttentionMask::Bidirectional,
            pooling: Pooling::Mean,
            context_shape: [0, 0],
            image: ROption::RNone,
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: ROption::RSome(self.spec),
        }
    }

    /// Runs every chunk (one map each) and writes the maps asked for into `out`.
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let width: usize = self.conditioning.iter().sum();
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
            if !x.adapters.is_empty() || !x.steering.is_empty() || x.cross.is_some() {
                return Err(UError::unsupported(
                    "arch-onnx: adapters, steering and cross-attention contexts are not applied \
                     to graphs",
                ));
            }
            if x.conditioning.len() != width || x.conditioning.iter().any(|v| !v.is_finite()) {
                return Err(bad(format!(
                    "the conditioning is {width} finite values (the graph's inputs {}), given {}",
                    self.input_names()[1..].join(", "),
                    x.conditioning.len()
                )));
            }
            jobs.push((planes, out_size, wanted, x.conditioning.as_slice()));
        }
        let need: usize = jobs
            .iter()
            .filter(|j| j.2)
            .map(|j| self.spec.out_channels as usize * j.1.0 as usize * j.1.1 as usize)
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
            let size = (jobs[start].0.height, jobs[start].0.width);
            let mut end = start + 1;
            while self.batched
                && end < jobs.len()
                && (jobs[end].0.height, jobs[end].0.width) == size
            {
                end += 1;
            }
            let group = &jobs[start..end];
            let n = group.len();
            let c = self.spec.in_channels as usize;
            let (h, w) = (size.0 as usize, size.1 as usize);
            let mut feeds = vec![Value::F32(Array::new(
                vec![n, c, h, w],
                group
                    .iter()
                    .flat_map(|j| j.0.values.iter().copied())
                    .collect(),
            )?)];
            let mut offset = 0;
            for &k in &self.conditioning {
                let data: Vec<f32> = group
                    .iter()
                    .flat_map(|j| j.3[offset..offset + k].iter().copied())
                    .collect();
                let dims = if k == 1
                    && self.graph.inputs[feeds.len()]
                        .dims
                        .as_ref()
                        .is_some_and(|d| d.len() == 1)
                {
                    vec![n]
                } else {
                    vec![n, k]
                };
                feeds.push(Value::F32(Array::new(dims, data)?));
                offset += k;
            }
            let result = self.graph.run(&self.device, feeds)?;
            let map = result[0].floats("the graph's output")?;
            let each = map.data.len() / n;
            let (oh, ow) = group[0].1;
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
                if job.2 {
                    out[written..written + each]
                        .copy_from_slice(&map.data[i * each..(i + 1) * each]);
                    written += each;
                }
            }
            start = end;
        }
        Ok(())
    }
}
