//! A stateless encoder as a [`Model`]: BERT, CLIP's towers, ViT and the image encoders keep no
//! per-sequence state, so what makes them a model of the ABI is the same for all — their
//! config, a forward pass over a batch, no cache, nothing to graft. An architecture implements
//! [`Encoder`] and hands out [`EncoderModel`]; a text encoder reads its batch through
//! [`TextBatch`]. Linked statically, outside the ABI.

use crate::abi::{
    cache::{KvCacheBox, SeqId},
    error::{ErrorKind, UError},
    model::{Model, ModelBox, ModelConfig, Output, Pooling, Rows, Segment, SeqChunk},
};
use abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut};

/// What a stateless encoder does.
pub trait Encoder: Send + Sync + 'static {
    /// The plugin's name, for error messages (`"arch-vit"`).
    const PLUGIN: &'static str;

    /// What it is, as the ABI says it.
    fn model_config(&self) -> ModelConfig;

    /// Runs every chunk of `batch` and writes the outputs they ask for into `out` in batch
    /// order (see [`Model::forward`]).
    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> crate::Result<()>;
}

/// An [`Encoder`] as a [`Model`].
pub struct EncoderModel<T>(pub T);

impl<T: Encoder> EncoderModel<T> {
    /// The encoder, boxed for the ABI.
    pub fn boxed(encoder: T) -> ModelBox {
        ModelBox::new(EncoderModel(encoder))
    }
}

impl<T: Encoder> Model for EncoderModel<T> {
    fn config(&self) -> RResult<ModelConfig, UError> {
        RResult::ROk(self.0.model_config())
    }

    fn cache(&self) -> RResult<ROption<KvCacheBox>, UError> {
        RResult::ROk(ROption::RNone)
    }

    fn forward(
        &self,
        batch: RSlice<'_, SeqChunk<'_>>,
        mut out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        self.0.encode(batch.as_slice(), out.as_mut_slice()).into()
    }

    fn graft(&self, _dst: SeqId, _src: SeqId, _from: u64, _count: u64) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported(format!(
            "{}: an encoder keeps no per-sequence state to graft",
            T::PLUGIN
        )))
    }
}

/// Where one text's rows lie in a batch's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TextSpan {
    /// Its first row.
    pub offset: usize,
    /// Its rows (tokens).
    pub len: usize,
}

/// A batch of whole texts, one a chunk, as a text encoder (CLIP's text tower, T5) reads it:
/// each chunk's token ids, checked; where each text's rows lie; and the floats its outputs
/// take. Its rows run through the encoder together; [`TextBatch::write`] hands each chunk what
/// it asked for.
pub struct TextBatch {
    /// Each chunk's token ids.
    pub texts: Vec<Vec<u32>>,
    /// Where each text's rows lie.
    pub spans: Vec<TextSpan>,
    /// Floats the outputs take.
    pub floats: usize,
}

impl TextBatch {
    /// Reads `batch` for the encoder `config` (of `plugin`, in errors), whose texts are at most
    /// `positions` tokens and which has a pooling head (`Pooled(Head)`) when `head`. Refused,
    /// each with a clear error: input other than token ids, ids outside the vocabulary,
    /// adapters, steering, cross-attention or conditioning, logits or feature maps, a layer
    /// past the last, `Pooled(Head)` without a head, output of no input, a text too long, and
    /// an `out` of another length than the outputs take.
    pub fn read(
        plugin: &str,
        batch: &[SeqChunk<'_>],
        config: &ModelConfig,
        (positions, head): (usize, bool),
        out: &[f32],
    ) -> crate::Result<TextBatch> {
        let bad = |why: String| UError::invalid(format!("{plugin}: {why}"));
        let (vocab, layers) = (config.vocab_size as usize, config.layers);
        let mut texts = Vec::with_capacity(batch.len());
        let mut spans = Vec::with_capacity(batch.len());
        let (mut offset, mut floats) = (0, 0);
        for chunk in batch {
            let mut ids = Vec::new();
            for segment in chunk.input.iter() {
                match segment {
                    Segment::Tokens(t) => ids.extend_from_slice(t.as_slice()),
                    _ => {
                        return Err(UError::unsupported(format!(
                            "{plugin}: a text encoder reads token ids only"
                        )));
                    }
                }
            }
            if let Some(&id) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(bad(format!(
                    "token {id} is outside the vocabulary of {vocab}"
                )));
            }
            let x = &chunk.extras;
            if !x.adapters.is_empty()
                || !x.steering.is_empty()
                || x.cross.is_some()
                || !x.conditioning.is_empty()
            {
                return Err(UError::unsupported(format!(
                    "{plugin}: the encoder applies no adapters, steering, cross-attention or \
                     conditioning"
                )));
            }
            match chunk.output {
                Output::Nothing => {}
                Output::Logits(_) | Output::Planes => {
                    return Err(UError::unsupported(format!(
                        "{plugin}: an encoder produces embeddings, not logits or feature maps"
                    )));
                }
                Output::Pooled(Pooling::Head) if !head => {
                    return Err(UError::unsupported(format!(
                        "{plugin}: the encoder has no pooling head; it gives its rows or their \
                         mean, first or last"
                    )));
                }
                Output::Hidden { layer, .. } if layer > layers => {
                    return Err(bad(format!(
                        "layer {layer} asked for; the encoder has {layers} blocks"
                    )));
                }
                _ if ids.is_empty() => return Err(bad("asks for output of no input".into())),
                _ => {}
            }
            if ids.len() > positions {
                return Err(UError::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "{plugin}: a text of {} tokens is longer than the encoder's {positions}",
                        ids.len()
                    ),
                ));
            }
            floats += chunk.output.floats(ids.len(), config);
            spans.push(TextSpan {
                offset,
                len: ids.len(),
            });
            offset += ids.len();
            texts.push(ids);
        }
        if out.len() != floats {
            return Err(bad(format!(
                "the output buffer holds {} floats, the batch asks for {floats}",
                out.len()
            )));
        }
        Ok(TextBatch {
            texts,
            spans,
            floats,
        })
    }

    /// Whether a chunk of `batch` asks for the rows after `layer` blocks.
    pub fn wants_layer(batch: &[SeqChunk<'_>], layer: usize) -> bool {
        batch
            .iter()
            .any(|c| matches!(c.output, Output::Hidden { layer: l, .. } if l as usize == layer))
    }

    /// Writes each chunk's output into `out`, in batch order: `Hidden` at a layer kept in
    /// `states` (the rows after that many blocks) from there, any other from `last` (the final
    /// rows); `Pooled(Head)` the row `head` picks from a text's ids, other poolings over its
    /// final rows. Rows are `config.hidden` wide.
    pub fn write(
        &self,
        batch: &[SeqChunk<'_>],
        (last, states): (&[f32], &[(usize, Vec<f32>)]),
        config: &ModelConfig,
        head: &dyn Fn(&[u32]) -> usize,
        out: &mut [f32],
    ) -> crate::Result<()> {
        let width = config.hidden as usize;
        let mut at = 0;
        for ((chunk, span), ids) in batch.iter().zip(&self.spans).zip(&self.texts) {
            let rows_of = |x: &'_ [f32]| -> Vec<f32> {
                x[span.offset * width..(span.offset + span.len) * width].to_vec()
            };
            let kept = |layer: u32| states.iter().find(|(l, _)| *l == layer as usize);
            let rows = match chunk.output {
                Output::Hidden { layer, .. } if kept(layer).is_some() => {
                    rows_of(&kept(layer).expect("found above").1)
                }
                _ => rows_of(last),
            };
            let n = chunk.output.floats(span.len, config);
            let dst = &mut out[at..at + n];
            at += n;
            match chunk.output {
                Output::Hidden {
                    rows: Rows::All, ..
                } => dst.copy_from_slice(&rows),
                Output::Hidden {
                    rows: Rows::Last, ..
                } => dst.copy_from_slice(&rows[rows.len() - width..]),
                Output::Pooled(Pooling::Head) => {
                    let row = head(ids);
                    dst.copy_from_slice(&rows[row * width..(row + 1) * width]);
                }
                Output::Pooled(p) => p.pool(&rows, width, dst)?,
                Output::Nothing | Output::Logits(_) | Output::Planes => {}
            }
        }
        Ok(())
    }
}
