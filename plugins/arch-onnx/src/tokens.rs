//! A graph that maps token ids to rows (an exported text encoder, such as a diffusers ONNX
//! pipeline's `text_encoder/model.onnx`): input `[batch, sequence]` integers, first output
//! `[batch, sequence, width]` (the last hidden state, after the final norm), and optionally a
//! second output `[batch, width]` (the pooled row). It is one layer deep as the ABI sees it:
//! only the graph's own outputs exist.

use crate::graph::{Dim, Graph};
use crate::model::dims_of;
use crate::value::{Array, Value};
use u_sdk::{
    AttentionMask, ModelConfig, ModelKind, Output, Pooling, Result, Rows, Segment, SeqChunk,
    UError, nn::Device,
};

/// A token graph's signature.
pub struct Tokens {
    /// Width of its rows.
    width: usize,
    /// Whether its second output is the pooled row.
    pooled: bool,
    /// The sequence length the graph fixes (0: free).
    positions: usize,
}

impl Tokens {
    /// Reads the signature of `graph`, whose first input is integers.
    pub fn new(graph: &Graph) -> Result<Tokens> {
        let bad = |why: String| {
            UError::unsupported(format!(
                "arch-onnx runs token graphs of ids [batch, sequence] to rows [batch, sequence, \
                 width]: {why}"
            ))
        };
        let input = &graph.inputs[0];
        let [_, sequence] = &dims_of(input)?[..] else {
            return Err(bad(format!(
                "the input `{}` is not [batch, sequence]",
                input.name
            )));
        };
        if graph.inputs.len() > 1 {
            return Err(bad(format!(
                "it has further inputs ({}), which a chunk of tokens does not give",
                graph.inputs[1..]
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let rows = &graph.outputs[0];
        let [_, _, Dim::Fixed(width)] = dims_of(rows)?[..] else {
            return Err(bad(format!(
                "the output `{}` is not [batch, sequence, width] with a fixed width",
                rows.name
            )));
        };
        let pooled = match graph.outputs.get(1).map(dims_of).transpose()? {
            Some(d) => matches!(d[..], [_, Dim::Fixed(w)] if w == width),
            None => false,
        };
        Ok(Tokens {
            width,
            pooled,
            positions: match sequence {
                Dim::Fixed(n) => *n,
                _ => 0,
            },
        })
    }

    /// What the ABI says of it, from the fields `base` leaves.
    pub fn model_config(&self, base: ModelConfig) -> ModelConfig {
        ModelConfig {
            kind: ModelKind::Encoder,
            hidden: self.width as u32,
            layers: 1,
            context_length: self.positions as u32,
            attention: AttentionMask::Causal,
            pooling: Pooling::Head,
            ..base
        }
    }

    /// Runs each chunk's ids through the graph and writes what it asks for.
    pub fn forward(
        &self,
        graph: &Graph,
        device: &Device,
        batch: &[SeqChunk<'_>],
        out: &mut [f32],
    ) -> Result<()> {
        let mut written = 0;
        for chunk in batch {
            let bad =
                |why: String| UError::invalid(format!("arch-onnx (sequence {}): {why}", chunk.seq));
            let [Segment::Tokens(ids)] = chunk.input.as_slice() else {
                return Err(bad(
                    "a chunk of a token graph is one run of token ids".into()
                ));
            };
            let n = ids.len();
            if n == 0 || (self.positions != 0 && n != self.positions) {
                return Err(bad(format!(
                    "{n} token ids, where the graph reads {}",
                    match self.positions {
                        0 => "at least one".to_string(),
                        p => p.to_string(),
                    }
                )));
            }
            let x = &chunk.extras;
            if !x.adapters.is_empty() || !x.steering.is_empty() || x.cross.is_some() {
                return Err(UError::unsupported(
                    "arch-onnx: adapters, steering and contexts are not applied to token graphs",
                ));
            }
            // The graph's output index and the rows of it (the pooled row is one).
            let (output, rows) = match chunk.output {
                Output::Nothing => continue,
                Output::Hidden { layer: 1, rows } => (0, rows),
                Output::Pooled(Pooling::Head) if self.pooled => (1, Rows::All),
                other => {
                    return Err(UError::unsupported(format!(
                        "arch-onnx: a token graph gives its last layer's rows (`Hidden` at layer \
                         1){}, not {other:?}",
                        match self.pooled {
                            true => " and its pooled row (`Pooled(Head)`)",
                            false => "",
                        }
                    )));
                }
            };
            let feed = Array::new(vec![1, n], ids.iter().map(|&t| i64::from(t)).collect())?;
            let made = graph.run(device, vec![Value::I64(feed)])?;
            let all = &made[output].floats("the graph's output")?.data;
            let values = match rows {
                Rows::All => &all[..],
                Rows::Last => &all[all.len().saturating_sub(self.width)..],
            };
            let floats = values.len();
            let expected = match (output, rows) {
                (0, Rows::All) => n * self.width,
                _ => self.width,
            };
            if floats != expected || out.len() < written + floats {
                return Err(bad(format!(
                    "the graph made {floats} values where {expected} were asked for, or the \
                     output buffer is short"
                )));
            }
            out[written..written + floats].copy_from_slice(values);
            written += floats;
        }
        if written != out.len() {
            return Err(UError::invalid(format!(
                "arch-onnx: the output buffer holds {} floats, the chunks asked for {written}",
                out.len()
            )));
        }
        Ok(())
    }
}
