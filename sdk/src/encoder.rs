//! A stateless encoder as a [`Model`]: BERT, CLIP's towers, ViT and the image encoders keep no
//! per-sequence state, so what makes them a model of the ABI is the same for all — their
//! config, a forward pass over a batch, no cache, nothing to graft. An architecture implements
//! [`Encoder`] and hands out [`EncoderModel`]. Linked statically, outside the ABI.

use crate::abi::{
    cache::{KvCacheBox, SeqId},
    error::UError,
    model::{Model, ModelBox, ModelConfig, SeqChunk},
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
