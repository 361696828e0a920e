//! Architecture plugins: build a runnable [`Model`] from a weight set, a backend and (for models
//! that keep per-sequence state) a cache.
//!
//! One interface for every kind of model ([`ModelKind`]): a batch is a list of [`SeqChunk`]s,
//! each a sequence's input — segments of token ids, embedding rows or images — the output it asks
//! for ([`Output`]: logits, the hidden state after a layer, a pooled vector) and its
//! per-sequence extras ([`SeqExtras`]: adapters, steering vectors, a cross-attention context,
//! conditioning). Sequences with different extras share one forward pass.

use crate::abi::{
    backend::{AttentionMask, BackendBox},
    cache::{KvCacheBox, SeqId},
    error::UError,
    loader::WeightSetBox,
    train::{TrainSpec, TrainerBox},
};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, ROption, RResult, RSlice, RSliceMut, RStr, RString, RVec},
};

/// What kind of model a plugin built.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// A causal language model: tokens in, next-token logits out, a KV cache per sequence.
    Decoder,
    /// A bidirectional encoder (BERT, ViT, CLIP): input rows in, hidden states or a pooled
    /// vector out; no state between passes.
    Encoder,
    /// A decoder that also attends to a context computed once per request (Whisper's text
    /// decoder over the audio encoder's output: static cross-attention KV).
    CrossDecoder,
    /// A denoiser of diffusion latents (UNet, DiT, MMDiT): latent rows and conditioning in,
    /// the prediction out; no tokens. Reads [`Segment::Planes`], writes [`Output::Planes`].
    Denoiser,
    /// A variational autoencoder's encoder or decoder (images ↔ latents); no tokens. Reads
    /// [`Segment::Planes`], writes [`Output::Planes`].
    Autoencoder,
}

/// How a pooled output summarises a chunk's rows.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pooling {
    /// Mean over the rows (sentence-transformers' default).
    Mean,
    /// The first row (BERT's `[CLS]`, ViT's class token).
    First,
    /// The last row (decoder embeddings).
    Last,
    /// The checkpoint's own pooling head over the final rows (ViT's tanh dense layer on the
    /// class row, CLIP's norm of the class row, SigLIP's attention pooling): what transformers
    /// calls `pooler_output`.
    Head,
}

impl Pooling {
    /// One vector of `hidden` floats summarising `rows` (each `hidden` wide, at least one) into
    /// `out`, the mean accumulated in f64; an error for [`Pooling::Head`], which only a model
    /// with such a head computes.
    pub fn pool(self, rows: &[f32], hidden: usize, out: &mut [f32]) -> Result<(), UError> {
        let n = rows.len() / hidden.max(1);
        if n == 0 || out.len() != hidden {
            return Err(UError::invalid(format!(
                "pooling {} values into {} as rows of {hidden}",
                rows.len(),
                out.len()
            )));
        }
        match self {
            Pooling::First => out.copy_from_slice(&rows[..hidden]),
            Pooling::Last => out.copy_from_slice(&rows[(n - 1) * hidden..n * hidden]),
            Pooling::Mean => {
                let mut sum = vec![0f64; hidden];
                for row in rows.chunks_exact(hidden) {
                    sum.iter_mut()
                        .zip(row)
                        .for_each(|(s, &v)| *s += f64::from(v));
                }
                out.iter_mut()
                    .zip(sum)
                    .for_each(|(o, s)| *o = (s / n as f64) as f32);
            }
            Pooling::Head => {
                return Err(UError::unsupported(
                    "this model has no pooling head (ask for the mean, first or last row)",
                ));
            }
        }
        Ok(())
    }
}

/// What a server needs to know about a built model.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// What kind of model this is.
    pub kind: ModelKind,
    /// The family the architecture built (`"llama"`, `"qwen3"`, `"bert"`…).
    pub family: RString,
    /// Token ids the model reads and length of one logits row; 0 for a model without tokens.
    pub vocab_size: u32,
    /// Width of an embedding row, a hidden state and a pooled vector.
    pub hidden: u32,
    /// Layers (blocks); [`Output::Hidden`] takes `0..=layers`.
    pub layers: u32,
    /// Longest sequence the model supports.
    pub context_length: u32,
    /// Experts per MoE layer (0 for dense models).
    pub experts: u32,
    /// How the model's self-attention masks keys.
    pub attention: AttentionMask,
    /// How the model summarises a sequence when asked for [`Output::Pooled`] without a
    /// preference (the checkpoint's own recipe where it states one).
    pub pooling: Pooling,
    /// The cross-attention context a [`ModelKind::CrossDecoder`] reads
    /// ([`CrossContext::rows`]): `[rows, width]` floats, row-major (Whisper: its log-mel
    /// spectrogram, `[n_mels, 3000]`); `[0, 0]` for other kinds.
    pub context_shape: [u32; 2],
    /// What an image input ([`Segment::Image`]) must be, for models that read images (vision
    /// encoders, image-chat models); `RNone` for the rest.
    pub image: ROption<ImageSpec>,
    /// For a model that reads images through an image encoder: the token id that stands for an
    /// image in its prompts (`<image>`). A [`ModelKind::Decoder`] (LLaVA) reads each such token
    /// as [`ImageSpec::rows`] embedding rows the encoder makes; a [`ModelKind::CrossDecoder`]
    /// (IDEFICS, Flamingo-style) keeps the token and cross-attends, from it on, to the rows
    /// the encoder makes as its context ([`ModelConfig::context_shape`]). [`NO_IMAGE_TOKEN`]
    /// for the rest.
    pub image_token: u32,
    /// For a model that maps feature maps to feature maps (a [`ModelKind::Denoiser`] or
    /// [`ModelKind::Autoencoder`]): what it reads and writes; `RNone` for the rest.
    pub planes: ROption<PlaneSpec>,
}

/// The feature maps a denoiser or autoencoder reads ([`Segment::Planes`]) and writes
/// ([`Output::Planes`]): channels-first floats of a size the caller picks, within the model's
/// step ([`PlaneSpec::multiple`]).
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlaneSpec {
    /// Channels of an input map (a VAE decoder: its latent channels).
    pub in_channels: u32,
    /// Channels of the output map (a VAE encoder: twice its latent channels, mean then log
    /// variance).
    pub out_channels: u32,
    /// The output's side over the input's, `[numerator, denominator]`: `[8, 1]` for a VAE
    /// decoder, `[1, 8]` for its encoder, `[1, 1]` for a denoiser.
    pub scale: [u32; 2],
    /// Input height and width must be multiples of this (the model's total downsampling).
    pub multiple: u32,
    /// The side of the square input map the model was trained at (diffusers' `sample_size`),
    /// a caller's default size; 0 where the checkpoint states none.
    pub sample_size: u32,
}

impl PlaneSpec {
    /// Output height and width for an input `height × width`, or why that input does not fit.
    pub fn out_size(&self, height: u32, width: u32) -> Result<(u32, u32), UError> {
        let step = self.multiple.max(1);
        if height == 0 || width == 0 || !height.is_multiple_of(step) || !width.is_multiple_of(step)
        {
            return Err(UError::invalid(format!(
                "a {height}×{width} map does not fit this model: height and width must be \
                 positive multiples of {step}"
            )));
        }
        let [num, den] = self.scale;
        let side = |v: u32| {
            u64::from(v)
                .checked_mul(u64::from(num))
                .map(|v| v / u64::from(den.max(1)))
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| UError::invalid(format!("a {height}×{width} map is too large")))
        };
        Ok((side(height)?, side(width)?))
    }
}

/// [`ModelConfig::image_token`] of a model that reads no images among tokens.
pub const NO_IMAGE_TOKEN: u32 = u32::MAX;

/// How an image is resampled when resized.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Resample {
    /// Nearest neighbour.
    Nearest,
    /// Triangle filter (PIL's `BILINEAR`).
    Bilinear,
    /// Keys cubic filter, a = −0.5 (PIL's `BICUBIC`).
    Bicubic,
}

/// What an image-reading model takes, and the preprocessing (the checkpoint's image processor:
/// `preprocessor_config.json`) a caller applies to a decoded image to make it: resize, centre
/// crop, rescale, normalise per channel.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq)]
pub struct ImageSpec {
    /// Channels of the pixels (3: RGB).
    pub channels: u32,
    /// Height of the pixels the model takes.
    pub height: u32,
    /// Width of the pixels the model takes.
    pub width: u32,
    /// Rows (positions) one image becomes: patches plus class and register tokens.
    pub rows: u32,
    /// Resize so the shorter edge is this many pixels, keeping the aspect ratio, then centre
    /// crop to `height × width`; 0: resize to `height × width` directly.
    pub shortest_edge: u32,
    /// The resampling filter of that resize.
    pub resample: Resample,
    /// Factor taking 8-bit values to the model's range (1/255).
    pub rescale: f32,
    /// Per-channel mean subtracted after rescaling.
    pub mean: [f32; 3],
    /// Per-channel standard deviation divided by after the mean.
    pub std: [f32; 3],
}

/// Which rows of a chunk an output covers.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rows {
    /// Only the chunk's last row.
    Last,
    /// Every row of the chunk.
    All,
}

/// What a chunk asks the pass to produce, written to the output buffer in batch order.
#[repr(C, u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Output {
    /// Nothing (a prefill chunk that is not the last).
    Nothing,
    /// Logits: `vocab_size` floats per row.
    Logits(Rows),
    /// The hidden state after block `layer` (`layer == layers`: after the final norm):
    /// `hidden` floats per row.
    Hidden {
        /// Block index, `0..=layers`.
        layer: u32,
        /// Which rows.
        rows: Rows,
    },
    /// One vector of `hidden` floats over the chunk's rows (after the final norm), pooled as
    /// asked.
    Pooled(Pooling),
    /// The output map of a model that maps [`Segment::Planes`] to planes: [`PlaneSpec`]'s
    /// `out_channels` planes of the input's size times its `scale`, channels first.
    Planes,
}

impl Output {
    /// Floats this output takes for a chunk of `rows` rows of a model with `config`.
    pub fn floats(&self, rows: usize, config: &ModelConfig) -> usize {
        let count = |r: &Rows| match r {
            Rows::Last => usize::from(rows > 0),
            Rows::All => rows,
        };
        match self {
            Output::Nothing => 0,
            Output::Logits(r) => count(r) * config.vocab_size as usize,
            Output::Hidden { rows: r, .. } => count(r) * config.hidden as usize,
            Output::Pooled(_) => usize::from(rows > 0) * config.hidden as usize,
            Output::Planes => config.planes.as_ref().map_or(0, |p| {
                let [num, den] = p.scale;
                let den = den.max(1) as usize;
                p.out_channels as usize * rows * (num as usize).pow(2) / den.pow(2)
            }),
        }
    }
}

/// Part of a chunk's input: token ids, or rows of `hidden` floats that stand where token
/// embeddings would (soft prompts, image patches, audio frames, latents).
#[repr(C, u8)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub enum Segment<'a> {
    /// Token ids, embedded by the model.
    Tokens(RSlice<'a, u32>),
    /// Embedding rows, `hidden` floats each, used as they are.
    Embeddings(RSlice<'a, f32>),
    /// An image, preprocessed as the model's [`ModelConfig::image`] says, that the model
    /// encodes into [`ImageSpec::rows`] rows.
    Image(ImageInput<'a>),
    /// A feature map for a denoiser or autoencoder ([`ModelConfig::planes`]): diffusion
    /// latents, an image's pixels.
    Planes(Planes<'a>),
}

/// A feature map, `channels × height × width` floats, channels first (PyTorch's layout of one
/// batch entry). It counts as `height × width` rows.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct Planes<'a> {
    /// The values.
    pub values: RSlice<'a, f32>,
    /// Channels.
    pub channels: u32,
    /// Height.
    pub height: u32,
    /// Width.
    pub width: u32,
}

impl Planes<'_> {
    /// Checks that the values hold `channels × height × width` floats and that the map fits
    /// `spec`, giving the output's height and width.
    pub fn check(&self, spec: &PlaneSpec) -> Result<(u32, u32), UError> {
        if self.channels != spec.in_channels {
            return Err(UError::invalid(format!(
                "a map of {} channels given to a model that reads {}",
                self.channels, spec.in_channels
            )));
        }
        let want = [self.channels, self.height, self.width]
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d as usize));
        if want != Some(self.values.len()) {
            return Err(UError::invalid(format!(
                "a {}×{}×{} map given as {} floats",
                self.channels,
                self.height,
                self.width,
                self.values.len()
            )));
        }
        spec.out_size(self.height, self.width)
    }
}

/// One preprocessed image: `channels × height × width` floats, channels first (the layout of
/// PyTorch's `pixel_values`), and the rows it stands for — [`ImageSpec::rows`], stated so a
/// caller can lay out positions without the model; a model refuses any other count.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct ImageInput<'a> {
    /// The pixels.
    pub pixels: RSlice<'a, f32>,
    /// Rows the image becomes.
    pub rows: u32,
}

impl Segment<'_> {
    /// Rows (positions) this segment adds, for a model of width `hidden`.
    pub fn rows(&self, hidden: usize) -> usize {
        match self {
            Segment::Tokens(t) => t.len(),
            Segment::Embeddings(e) => e.len() / hidden.max(1),
            Segment::Image(i) => i.rows as usize,
            Segment::Planes(p) => p.height as usize * p.width as usize,
        }
    }
}

/// A low-rank adapter applied to this sequence, by the name the model knows it under.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct AdapterScale<'a> {
    /// The adapter's name.
    pub name: RStr<'a>,
    /// Multiplier of its low-rank delta.
    pub scale: f32,
}

/// A steering (control) vector added to the residual stream after each block of a range.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct Steering<'a> {
    /// First block it applies after.
    pub first_layer: u32,
    /// Last block it applies after (inclusive).
    pub last_layer: u32,
    /// Multiplier of `vector`.
    pub strength: f32,
    /// `hidden` floats.
    pub vector: RSlice<'a, f32>,
}

/// A context this sequence cross-attends to, computed once per request (e.g. the audio
/// encoder's output for Whisper's decoder): the model encodes `rows` on the first pass and keeps
/// the keys and values of every cross-attention layer in the cache sequence `kv` for every later
/// pass (and for every sequence that names the same `kv`, such as beams).
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct CrossContext<'a> {
    /// The cache sequence holding (or receiving) the context's static KV.
    pub kv: SeqId,
    /// The context, shaped as [`ModelConfig::context_shape`] says; empty once `kv` holds its
    /// keys and values.
    pub rows: RSlice<'a, f32>,
}

/// Per-sequence extras of a chunk. Sequences with different extras share one pass: a model
/// applies each to its own sequence's rows only.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, Default)]
pub struct SeqExtras<'a> {
    /// Low-rank adapters and their scales.
    pub adapters: RSlice<'a, AdapterScale<'a>>,
    /// Steering vectors.
    pub steering: RSlice<'a, Steering<'a>>,
    /// A cross-attention context.
    pub cross: ROption<CrossContext<'a>>,
    /// A conditioning vector (a diffusion timestep embedding input, a class label, a pooled
    /// text embedding), as the model documents it.
    pub conditioning: RSlice<'a, f32>,
}

/// One sequence's part of a batched forward pass.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    /// The sequence: its KV lives in the model's cache, and new positions continue from its
    /// current length. Models without a cache ignore it.
    pub seq: SeqId,
    /// The input, in order.
    pub input: RSlice<'a, Segment<'a>>,
    /// What to produce.
    pub output: Output,
    /// Adapters, steering, cross-attention context, conditioning.
    pub extras: SeqExtras<'a>,
}

impl<'a> SeqChunk<'a> {
    /// A chunk of one token segment with no extras.
    pub fn tokens(seq: SeqId, input: &'a [Segment<'a>], output: Output) -> Self {
        Self {
            seq,
            input: RSlice::from_slice(input),
            output,
            extras: SeqExtras::default(),
        }
    }

    /// Rows (positions) of the chunk's input.
    pub fn rows(&self, hidden: usize) -> usize {
        self.input.iter().map(|s| s.rows(hidden)).sum()
    }
}

/// What a model says of a low-rank adapter it holds.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct AdapterInfo {
    /// The name sequences ask for it by ([`AdapterScale::name`]).
    pub name: RString,
    /// Its rank (the largest where modules differ).
    pub rank: u32,
    /// The factor its deltas are multiplied by before a sequence's scale (`alpha / rank`, or
    /// `alpha / √rank` for rank-stabilised LoRA).
    pub scaling: f32,
    /// The projections it adapts, in the model's own names (`attn_q`, `ffn_down`…).
    pub targets: RVec<RString>,
    /// Bytes its matrices take in memory.
    pub bytes: u64,
}

/// A number a model reports about its own work (its MoE expert cache's hits and misses, say),
/// for `u-runner bench --json` and `GET /metrics`.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct ModelCounter {
    /// A Prometheus-safe name (`[a-z_]+`), without the `u_model_` prefix the host adds.
    pub name: RString,
    /// One line on what it counts.
    pub help: RString,
    /// The value now.
    pub value: f64,
    /// Whether it is a level that goes up and down (bytes resident) rather than a running
    /// total (pages read).
    pub gauge: bool,
}

/// What an architecture builds a model from.
#[repr(C)]
#[derive(StableAbi)]
pub struct BuildContext {
    /// The weights, as the loader presents them (its format's own names and metadata).
    pub weights: WeightSetBox,
    /// The family the host matched the weights to (one the plugin's manifest declares).
    pub family: RString,
    /// Where to compute.
    pub backend: BackendBox,
    /// Where to run the ops `backend` lacks (the CPU beside a GPU), if anywhere.
    pub fallback: ROption<BackendBox>,
    /// Where to keep per-sequence KV (for models that keep any).
    pub cache: ROption<KvCacheBox>,
}

impl BuildContext {
    /// The backend to build on: `backend`, or with a fallback a [`crate::split::Split`] of the
    /// two that runs each op where it is supported.
    pub fn compute_backend(&self) -> BackendBox {
        match &self.fallback {
            ROption::RSome(fallback) => BackendBox::new(crate::split::Split::new(
                self.backend.clone(),
                fallback.clone(),
            )),
            ROption::RNone => self.backend.clone(),
        }
    }
}

/// Entry interface of an `architecture` plugin. The families it builds are declared in its
/// signed manifest (`families = […]`).
#[sabi_trait]
pub trait Architecture: Send + Sync + Clone {
    /// Builds a model.
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError>;

    /// The weights of `family` as a GGUF file of it holds them — llama.cpp's tensor names,
    /// shapes, row order and hyper-parameter keys, as its converter writes them — so that a
    /// host can write GGUF from any format the architecture reads (`u-runner quantize`). GGUF
    /// weights come back as they are; a format or family it cannot convert is an error that
    /// says so.
    fn gguf_view(&self, weights: WeightSetBox, family: RString) -> RResult<WeightSetBox, UError>;
}

/// A built model.
#[sabi_trait]
pub trait Model: Send + Sync {
    /// What it is.
    fn config(&self) -> RResult<ModelConfig, UError>;

    /// The cache its per-sequence KV lives in (to create, fork and release sequences), if any.
    fn cache(&self) -> RResult<ROption<KvCacheBox>, UError>;

    /// Runs every chunk of `batch` in one pass, appending their KV, and writes the outputs they
    /// ask for into `out` in batch order (see [`Output::floats`]). On error no sequence has
    /// advanced.
    fn forward(
        &self,
        batch: RSlice<'_, SeqChunk<'_>>,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError>;

    /// Appends positions `from..from + count` of `src`'s cached state to the end of `dst`, as
    /// if computed there: position-dependent parts (RoPE-rotated keys) are moved to their new
    /// positions. The cache only stores; the model owns this math.
    fn graft(&self, dst: SeqId, src: SeqId, from: u64, count: u64) -> RResult<(), UError>;

    /// Makes a low-rank adapter known as `name` (replacing one of that name) for sequences to
    /// ask for in [`SeqExtras::adapters`]: `weights` as a loader read them (PEFT's
    /// `adapter_model.safetensors`, a llama.cpp GGUF LoRA) and `config` (PEFT's
    /// `adapter_config.json` text; empty for GGUF, whose metadata carries it). An adapter that
    /// does not fit this model — another base's shapes, unknown modules, non-finite values — is
    /// an error that says why, and the adapters already held stay. Models that take no
    /// adapters keep this default.
    fn load_adapter(
        &self,
        name: RStr<'_>,
        weights: WeightSetBox,
        config: RStr<'_>,
    ) -> RResult<AdapterInfo, UError> {
        let _ = (weights, config);
        RResult::RErr(UError::unsupported(format!(
            "this model takes no low-rank adapters (asked to load `{name}`)"
        )))
    }

    /// Forgets adapter `name`; `false` if it held none of that name. Sequences that asked for it
    /// in a pass already begun finish that pass with it.
    fn unload_adapter(&self, name: RStr<'_>) -> RResult<bool, UError> {
        let _ = name;
        RResult::ROk(false)
    }

    /// The adapters it holds, by name.
    fn adapters(&self) -> RResult<RVec<AdapterInfo>, UError> {
        RResult::ROk(RVec::new())
    }

    /// Counters of the model's own work (see [`ModelCounter`]); none by default.
    fn counters(&self) -> RResult<RVec<ModelCounter>, UError> {
        RResult::ROk(RVec::new())
    }

    /// A trainer of what `spec` asks for over this model, the model itself frozen (see
    /// [`crate::Trainer`]). Models that cannot train it say so.
    fn trainer(&self, spec: TrainSpec) -> RResult<TrainerBox, UError> {
        let _ = spec;
        RResult::RErr(UError::unsupported("this model cannot be trained"))
    }
}

/// An owned architecture object.
pub type ArchitectureBox = Architecture_TO<'static, RBox<()>>;
/// An owned model object.
pub type ModelBox = Model_TO<'static, RBox<()>>;

#[cfg(test)]
mod tests {
    use super::*;

    const DECODER: PlaneSpec = PlaneSpec {
        in_channels: 4,
        out_channels: 3,
        scale: [8, 1],
        multiple: 1,
        sample_size: 64,
    };
    const ENCODER: PlaneSpec = PlaneSpec {
        in_channels: 3,
        out_channels: 8,
        scale: [1, 8],
        multiple: 8,
        sample_size: 512,
    };

    #[test]
    fn a_plane_spec_sizes_the_output_and_refuses_what_does_not_fit() {
        assert_eq!(DECODER.out_size(64, 96).ok(), Some((512, 768)));
        assert_eq!(ENCODER.out_size(512, 768).ok(), Some((64, 96)));
        for (h, w) in [(0, 8), (8, 0), (12, 8), (8, 100)] {
            let e = ENCODER.out_size(h, w).unwrap_err();
            assert!(e.message.contains("multiples of 8"), "{}", e.message);
        }
        let e = DECODER.out_size(u32::MAX, 8).unwrap_err();
        assert!(e.message.contains("too large"), "{}", e.message);
    }

    #[test]
    fn planes_are_checked_and_counted_as_rows() {
        let values = vec![0.0; 3 * 16 * 24];
        let planes = |channels, height, width| Planes {
            values: RSlice::from_slice(&values),
            channels,
            height,
            width,
        };
        assert_eq!(planes(3, 16, 24).check(&ENCODER).ok(), Some((2, 3)));
        assert!(planes(4, 16, 18).check(&ENCODER).is_err(), "channels");
        assert!(planes(3, 16, 16).check(&ENCODER).is_err(), "length");
        assert!(planes(3, u32::MAX, u32::MAX).check(&ENCODER).is_err());
        let segment = Segment::Planes(planes(3, 16, 24));
        assert_eq!(segment.rows(1), 16 * 24);

        let mut config = ModelConfig {
            kind: ModelKind::Autoencoder,
            family: "AutoencoderKL.encoder".into(),
            vocab_size: 0,
            hidden: 3,
            layers: 4,
            context_length: 0,
            experts: 0,
            attention: AttentionMask::Bidirectional,
            pooling: Pooling::Mean,
            context_shape: [0, 0],
            image: ROption::RNone,
            image_token: NO_IMAGE_TOKEN,
            planes: ROption::RSome(ENCODER),
        };
        assert_eq!(Output::Planes.floats(16 * 24, &config), 8 * 2 * 3);
        config.planes = ROption::RSome(DECODER);
        assert_eq!(Output::Planes.floats(2 * 3, &config), 3 * 16 * 24);
        config.planes = ROption::RNone;
        assert_eq!(Output::Planes.floats(16, &config), 0);
    }
}
