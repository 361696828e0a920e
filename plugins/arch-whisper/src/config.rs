//! The typed hyper-parameters of a Whisper model, from `config.json` (`config.*` metadata, as
//! the Hugging Face loaders present it), from a CTranslate2 `WhisperSpec` (its scalar
//! variables as `ctranslate2.*` metadata, the rest read off the tensor shapes), or from a
//! whisper.cpp GGML file's hyper-parameters (`whisper.*`).

use crate::naming::Layout;
use u_sdk::{MetaValue, Result, UError, WeightSetBox};

/// Everything the model needs besides the weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Token ids (rows of the decoder's embedding table, tied to the output projection).
    pub vocab_size: usize,
    /// Width of every hidden state (`d_model`).
    pub hidden: usize,
    /// Mel bins of the input spectrogram (80, or 128 for large-v3).
    pub n_mels: usize,
    /// Encoder blocks.
    pub encoder_layers: usize,
    /// Decoder blocks.
    pub decoder_layers: usize,
    /// Encoder attention heads.
    pub encoder_heads: usize,
    /// Decoder attention heads (self and cross).
    pub decoder_heads: usize,
    /// Feed-forward width of the encoder blocks.
    pub encoder_ffn: usize,
    /// Feed-forward width of the decoder blocks.
    pub decoder_ffn: usize,
    /// Encoder positions (1500: 30 s after the stride-2 convolution).
    pub audio_positions: usize,
    /// Decoder positions (448): the longest token sequence.
    pub text_positions: usize,
}

/// LayerNorm epsilon of every Whisper checkpoint (PyTorch's default).
pub const LAYER_NORM_EPS: f32 = 1e-5;

fn get(w: &WeightSetBox, key: &str) -> Option<MetaValue> {
    w.metadata(key.into()).into_result().ok()?.into_option()
}

fn shape(w: &WeightSetBox, name: &str) -> Result<Vec<u64>> {
    let view = w
        .tensor(name.into())
        .into_result()
        .map_err(|e| UError::invalid(format!("arch-whisper: {}", e.message)))?;
    Ok(view.shape.to_vec())
}

impl Config {
    /// Reads the configuration of the Whisper model in `w`, whose tensors `layout` names.
    pub fn from_weights(w: &WeightSetBox, layout: Layout) -> Result<Config> {
        let cfg = match layout {
            Layout::HuggingFace { .. } => Config::from_hf(w)?,
            Layout::CTranslate2 => Config::from_ct2(w)?,
            Layout::OpenAi => Config::from_ggml(w)?,
        };
        cfg.check()?;
        Ok(cfg)
    }

    fn from_hf(w: &WeightSetBox) -> Result<Config> {
        let need = |k: &str| {
            get(w, &format!("config.{k}"))
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| UError::invalid(format!("arch-whisper: config.json lacks `{k}`")))
        };
        let act = get(w, "config.activation_function")
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| "gelu".into());
        if act != "gelu" {
            return Err(UError::unsupported(format!(
                "arch-whisper: activation `{act}` is not Whisper's exact GELU"
            )));
        }
        if get(w, "config.scale_embedding").is_some_and(|v| matches!(v, MetaValue::Bool(true))) {
            return Err(UError::unsupported(
                "arch-whisper: `scale_embedding` is not part of Whisper",
            ));
        }
        Ok(Config {
            vocab_size: need("vocab_size")?,
            hidden: need("d_model")?,
            n_mels: need("num_mel_bins")?,
            encoder_layers: need("encoder_layers")?,
            decoder_layers: need("decoder_layers")?,
            encoder_heads: need("encoder_attention_heads")?,
            decoder_heads: need("decoder_attention_heads")?,
            encoder_ffn: need("encoder_ffn_dim")?,
            decoder_ffn: need("decoder_ffn_dim")?,
            audio_positions: need("max_source_positions")?,
            text_positions: need("max_target_positions")?,
        })
    }

    fn from_ct2(w: &WeightSetBox) -> Result<Config> {
        let scalar = |k: &str| {
            get(w, &format!("ctranslate2.{k}"))
                .and_then(|v| match v {
                    MetaValue::Int(i) => u64::try_from(i).ok(),
                    v => v.as_u64(),
                })
                .ok_or_else(|| {
                    UError::invalid(format!("arch-whisper: the CTranslate2 model lacks `{k}`"))
                })
        };
        for (key, want, what) in [
            ("decoder/activation", 3, "the exact GELU activation"),
            ("decoder/pre_norm", 1, "pre-norm blocks"),
            ("decoder/scale_embeddings", 0, "unscaled embeddings"),
            ("decoder/alibi", 0, "learned positions (no ALiBi)"),
        ] {
            if let Ok(v) = scalar(key)
                && v != want
            {
                return Err(UError::unsupported(format!(
                    "arch-whisper: `{key}` = {v}; Whisper has {what}"
                )));
            }
        }
        let count = |stack: &str| {
            (0..)
                .take_while(|i| {
                    w.tensor(
                        format!("{stack}/layer_{i}/ffn/linear_0/weight")
                            .as_str()
                            .into(),
                    )
                    .into_result()
                    .is_ok()
                })
                .count()
        };
        let conv = shape(w, "encoder/conv1/weight")?;
        let embed = shape(w, "decoder/embeddings/weight")?;
        let ffn = |stack: &str| -> Result<usize> {
            Ok(shape(w, &format!("{stack}/layer_0/ffn/linear_0/weight"))?[0] as usize)
        };
        let rows = |name: &str| -> Result<usize> { Ok(shape(w, name)?[0] as usize) };
        let [hidden, n_mels, _] = conv[..] else {
            return Err(UError::invalid(format!(
                "arch-whisper: encoder/conv1/weight has shape {conv:?}, expected [d, mels, 3]"
            )));
        };
        Ok(Config {
            vocab_size: embed[0] as usize,
            hidden: hidden as usize,
            n_mels: n_mels as usize,
            encoder_layers: count("encoder"),
            decoder_layers: count("decoder"),
            encoder_heads: scalar("encoder/num_heads")? as usize,
            decoder_heads: scalar("decoder/num_heads")? as usize,
            encoder_ffn: ffn("encoder")?,
            decoder_ffn: ffn("decoder")?,
            audio_positions: rows("encoder/position_encodings/encodings")?,
            text_positions: rows("decoder/position_encodings/encodings")?,
        })
    }

    /// From a whisper.cpp GGML file's hyper-parameters (`whisper.*`, as loader-ggml presents
    /// them); the feed-forward widths off the first blocks' shapes.
    fn from_ggml(w: &WeightSetBox) -> Result<Config> {
        let need = |k: &str| {
            get(w, &format!("whisper.{k}"))
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| {
                    UError::invalid(format!("arch-whisper: the GGML file lacks `whisper.{k}`"))
                })
        };
        let (audio, text) = (need("n_audio_state")?, need("n_text_state")?);
        if audio != text {
            return Err(UError::unsupported(format!(
                "arch-whisper: encoder width {audio} and decoder width {text} differ"
            )));
        }
        let ffn = |stack: &str| -> Result<usize> {
            Ok(shape(w, &format!("{stack}.blocks.0.mlp.0.weight"))?[0] as usize)
        };
        Ok(Config {
            vocab_size: need("n_vocab")?,
            hidden: audio,
            n_mels: need("n_mels")?,
            encoder_layers: need("n_audio_layer")?,
            decoder_layers: need("n_text_layer")?,
            encoder_heads: need("n_audio_head")?,
            decoder_heads: need("n_text_head")?,
            encoder_ffn: ffn("encoder")?,
            decoder_ffn: ffn("decoder")?,
            audio_positions: need("n_audio_ctx")?,
            text_positions: need("n_text_ctx")?,
        })
    }

    fn check(&self) -> Result<()> {
        let bad = |why: String| Err(UError::invalid(format!("arch-whisper: {why}")));
        for (heads, what) in [
            (self.encoder_heads, "encoder"),
            (self.decoder_heads, "decoder"),
        ] {
            if heads == 0 || !self.hidden.is_multiple_of(heads) {
                return bad(format!(
                    "{what} width {} does not split into {heads} heads",
                    self.hidden
                ));
            }
        }
        if self.encoder_layers == 0 || self.decoder_layers == 0 {
            return bad("a model without encoder or decoder blocks".into());
        }
        if [
            self.vocab_size,
            self.text_positions,
            self.audio_positions,
            self.hidden,
            self.n_mels,
        ]
        .contains(&0)
            || self.encoder_ffn == 0
            || self.decoder_ffn == 0
        {
            return bad("an empty vocabulary, position table, width or feed-forward".into());
        }
        let window = [self.audio_positions, 2, self.n_mels, self.hidden]
            .into_iter()
            .try_fold(1usize, usize::checked_mul);
        if window.is_none_or(|w| w > 1 << 40) {
            return bad("an implausibly large audio window".into());
        }
        Ok(())
    }

    /// Spectrogram frames the encoder reads: two per audio position (the second convolution
    /// has stride 2), 3000 for 30 s.
    pub fn frames(&self) -> usize {
        2 * self.audio_positions
    }
}
