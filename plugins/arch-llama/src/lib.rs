//! # u-arch-llama — the Llama family as a U architecture plugin
//!
//! One decoder-only transformer, varied through its configuration and the tensors present:
//!
//! - **Llama** (Touvron et al. 2023, *LLaMA*, arXiv:2302.13971; *Llama 2*, arXiv:2307.09288;
//!   *The Llama 3 Herd of Models*, arXiv:2407.21783): pre-norm RMSNorm (Zhang & Sennrich 2019),
//!   rotary position embedding (Su et al., *RoFormer*, arXiv:2104.09864) with Llama 3.1's
//!   frequency scaling, grouped-query attention (Ainslie et al., arXiv:2305.13245), SwiGLU
//!   feed-forward (Shazeer, arXiv:2002.05202); tied embeddings when `output.weight` is absent.
//! - **Mistral** (arXiv:2310.06825): a sliding attention window.
//! - **Qwen2** (arXiv:2407.10671): biases on Q, K and V. **Qwen3** (arXiv:2505.09388): RMSNorm
//!   on each query and key head before RoPE.
//! - **Mixture of experts**: Mixtral (Jiang et al., arXiv:2401.04088; softmax router, top-k,
//!   renormalised gates), Qwen2-MoE (a shared expert gated by a sigmoid), Qwen3-MoE, OLMoE
//!   (Muennighoff et al., arXiv:2409.02060; Q/K RMSNorm over the whole projection, Q/K/V clamp).
//!   Whether a layer is dense or sparse is read from its tensors (a router `ffn_gate_inp`), and
//!   experts may be stacked (`ffn_gate_exps`, GGUF) or stored one tensor each (HF).
//! - **GPT-2** (Radford et al. 2019, *Language Models are Unsupervised Multitask Learners*):
//!   learned absolute positions, LayerNorm (Ba et al., arXiv:1607.06450), biases on every
//!   projection, a plain GELU feed-forward (Hendrycks & Gimpel, arXiv:1606.08415), fused Q/K/V
//!   (HF Conv1D weights stored `[in, out]`, transposed at load).
//! - **Phi-3** (Abdin et al., arXiv:2404.14219): fused Q/K/V and gate/up projections, viewed in
//!   place as separate ones.
//! - **Gemma 2** (Gemma Team 2024, arXiv:2408.00118): soft caps `c·tanh(s/c)` on attention
//!   scores (in the backend's attention) and on logits, norms before and after attention and
//!   FFN, RMSNorm with `1 + γ`, local (sliding window) and global layers alternating, GeGLU,
//!   embeddings scaled by `√hidden`, scores by `query_pre_attn_scalar^-½`.
//! - **StableLM** (Stability AI's StableLM 2, arXiv:2402.17834; GPT-NeoX style, Black et al.,
//!   arXiv:2204.06745): LayerNorm, RoPE over part of each head, Q/K/V biases, and the parallel
//!   residual of GPT-J (one norm feeding attention and FFN, both added to the input).
//! - **GPT-NeoX** (Pythia, Biderman et al., arXiv:2304.01373): the parallel residual with two
//!   input norms, Q/K/V fused per head in HF checkpoints (reordered at load, as llama.cpp's
//!   converter does), RoPE over part of each head, biases, exact GELU.
//! - **OLMo 2** (OLMo Team 2024, arXiv:2501.00656): RMSNorm after attention and FFN (no
//!   pre-norms), Q/K RMSNorm over the whole projection.
//! - **Granite** (IBM Granite 3.0): multipliers of the embeddings, of each block's outputs, of
//!   the attention scores, and a divisor of the logits.
//! - **Cohere Command-R**: parallel block, LayerNorm without bias, adjacent-pair RoPE in its own
//!   checkpoints, a logit scale.
//! - **Falcon** (Almazrouei et al., arXiv:2311.16867): parallel attention and MLP on one
//!   LayerNorm with multi-query fused Q/K/V (7B), or on two LayerNorms with Q/K/V fused per KV
//!   group (40B/180B, reordered at load from HF checkpoints), exact GELU.
//! - **Nemotron** (`NemotronForCausalLM`, Nemotron-4, arXiv:2402.16819): squared-ReLU MLP
//!   without gate, LayerNorm with `1 + γ` and bias, RoPE over half of each head.
//! - **BitNet b1.58** (Ma et al., arXiv:2402.17764), as llama.cpp's `bitnet` graph builds it:
//!   ternary weights (stored as such, or in TQ1_0/TQ2_0 blocks) with an optional per-tensor
//!   output scale (`{name}.scale`), an RMSNorm of the attention output before its projection
//!   and of the SwiGLU hidden values before `ffn_down` (sub-layer norms), tied embeddings.
//! - **LLaVA** (Liu et al. 2023, arXiv:2304.08485): the language model of a checkpoint whose
//!   `model_type` is `llava` (family `llava`), read through [`llava::LlavaText`]; images come in
//!   as the rows its image encoder (family `llava.vision`, another plugin) made, embedding rows
//!   where the prompt's image tokens stand.
//! - **IDEFICS** (Laurençon et al. 2023, arXiv:2306.16527; Flamingo, Alayrac et al. 2022,
//!   arXiv:2204.14198): the text side of a checkpoint whose `model_type` is `idefics` (family
//!   `idefics`), a cross decoder: a Llama read through [`idefics::IdeficsText`], with Flamingo's
//!   gated cross-attention blocks ([`idefics::GatedCrossAttention`]) before every
//!   `cross_layer_interval`-th block attending to one image's features, the cross-attention
//!   context its image encoder (another plugin) made.
//!
//! The variations are layer interfaces, not copies: a norm is RMS or Layer (with a `1 + γ`
//! shift where the checkpoint stores `γ − 1`), positions rotary (all or part of each head) or
//! learned, a block sequential or parallel with optional pre- and post-norms, a feed-forward
//! gated or plain with its activation, projections fused or separate, with or without biases
//! and per-tensor scales, sub-layer norms inside attention and FFN or not;
//! [`config`] chooses them from the metadata and the tensors present.
//!
//! The plugin owns its names ([`naming`]): GGUF files are read in llama.cpp's names, HF
//! checkpoints mapped to them, `config.json` hyper-parameters to GGUF keys (`{arch}.block_count`…),
//! and the RoPE pairing follows from the format. The families it builds are declared in its
//! signed manifest (`plugin.toml`).
//!
//! Reference implementation: Hugging Face `transformers` (`modeling_llama.py`,
//! `modeling_mistral.py`, `modeling_qwen2.py`, `modeling_qwen3.py`, `modeling_mixtral.py`,
//! `modeling_qwen2_moe.py`, `modeling_qwen3_moe.py`, `modeling_olmoe.py`, `modeling_gpt2.py`,
//! `modeling_phi3.py`, `modeling_gemma2.py`, `modeling_stablelm.py`, `modeling_olmo2.py`,
//! `modeling_granite.py`, `modeling_cohere.py`, `modeling_falcon.py`, `modeling_nemotron.py`,
//! `modeling_gpt_neox.py`),
//! against which `tests/` checks logits on tiny random-weight models (BitNet against llama.cpp
//! itself, whose graph differs from transformers'); the
//! tensor naming and GGUF conventions are llama.cpp's (`convert_hf_to_gguf.py` writes the GGUF
//! fixtures of the other architectures).
//!
//! Layout: [`naming`] (tensor names and hyper-parameter keys), [`config`] (typed
//! hyper-parameters from metadata), [`weights`] (metadata access, the linear layer, norms),
//! [`model`] (`Attention`, `Mlp`, `MoE`, `Block`, `Llama`), [`llava`] (LLaVA's language model
//! as a bare causal LM), [`idefics`] (IDEFICS' text side and its gated cross-attention blocks),
//! and the plugin glue below. Compute goes through the backend interface
//! (`u_sdk::nn` tensors), KV through the `KvCache` interface; this crate does no math a backend
//! offers.
#![deny(missing_docs)]

pub mod config;
pub mod experts;
pub mod gguf_view;
pub mod idefics;
pub mod llava;
pub mod lora;
pub mod model;
pub mod naming;
pub mod train;
pub mod weights;

pub use config::Config;
pub use model::Llama;
pub use weights::Weights;

use abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut, RStr, RString, RVec};
use experts::ExpertPolicy;
use std::sync::Arc;
use u_sdk::{
    AdapterInfo, Architecture, ArchitectureBox, BackendBox, BuildContext, HostBox, KvCacheBox,
    Model, ModelBox, ModelConfig, ModelCounter, PluginInfo, PluginInstance, SeqChunk, SeqId,
    TrainSpec, TrainerBox, UError, WeightSetBox, nn::Device,
};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "Llama-family decoder: Llama 2/3, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE, OLMoE, \
                  GPT-2, Phi-3, Gemma 2, StableLM, GPT-NeoX, OLMo 2, Granite, Command-R, Falcon, \
                  Nemotron, BitNet b1.58; the decoders of LLaVA and IDEFICS"
            .into(),
        details: RVec::new(),
    }
}

/// Creates the architecture object (the `instantiate` entry of the root module), configured by
/// the deployment's `[plugins.config]` (see [`LlamaArchitecture::from_config`]).
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let arch = LlamaArchitecture::from_config(host.config().as_str())?;
    Ok(PluginInstance::Architecture(ArchitectureBox::new(arch)))
}

/// The exported root module and embedded manifest (in a private module: the macro's items are
/// the plugin's ABI, not this crate's Rust API).
mod export {
    u_sdk::export_plugin! {
        manifest: "plugin.toml",
        describe: super::describe,
        instantiate: super::instantiate,
    }
}

/// The `architecture` entry object.
#[derive(Clone, Copy, Debug, Default)]
pub struct LlamaArchitecture {
    /// What MoE models' expert cache does (see [`experts`]).
    pub experts: ExpertPolicy,
}

impl LlamaArchitecture {
    /// From the plugin's config table (TOML), the expert cache's settings:
    /// `expert_prefetch` (bool, on: under a budget, ask for a routed expert's pages when they
    /// are out), `expert_lookahead` (bool, on: under a budget, ask for the next layer's
    /// predicted experts ahead),
    /// `expert_budget_mb` (a positive integer: keep at most this many MiB of experts in memory,
    /// evicting the least recently routed; unset: no limit) and `expert_pin_share` (a number
    /// ≥ 0: pin experts routed this many times their fair share or more, up to half the
    /// budget, `mlock`ed where allowed; 0, the default, pins none). Any other key, or another type, is an error.
    pub fn from_config(config: &str) -> u_sdk::Result<Self> {
        let bad = |why: String| UError::invalid(format!("arch-llama config: {why}"));
        let table: toml::Table = config.parse().map_err(|e| bad(format!("{e}")))?;
        let mut p = ExpertPolicy::default();
        for (key, value) in table {
            match (key.as_str(), value) {
                ("expert_prefetch", toml::Value::Boolean(on)) => p.prefetch = on,
                ("expert_lookahead", toml::Value::Boolean(on)) => p.lookahead = on,
                ("expert_budget_mb", toml::Value::Integer(mb)) if mb > 0 => {
                    p.budget = Some((mb as u64).saturating_mul(1 << 20));
                }
                ("expert_pin_share", toml::Value::Float(x)) if x >= 0.0 && x.is_finite() => {
                    p.pin_share = x;
                }
                ("expert_pin_share", toml::Value::Integer(x)) if x >= 0 => {
                    p.pin_share = x as f64;
                }
                (key @ ("expert_prefetch" | "expert_lookahead"), v) => {
                    return Err(bad(format!("{key} must be true or false, not {v}")));
                }
                ("expert_budget_mb", v) => {
                    return Err(bad(format!(
                        "expert_budget_mb must be a positive whole number of MiB, not {v}"
                    )));
                }
                ("expert_pin_share", v) => {
                    return Err(bad(format!(
                        "expert_pin_share must be a number of at least 0, not {v}"
                    )));
                }
                (other, _) => {
                    return Err(bad(format!(
                        "unknown key `{other}` (the settings are expert_prefetch, \
                         expert_lookahead, expert_budget_mb and expert_pin_share)"
                    )));
                }
            }
        }
        Ok(Self { experts: p })
    }
}

impl LlamaArchitecture {
    /// Builds a model from `weights` on `backend` with its KV in `cache` (what
    /// [`Architecture::build`] does, for Rust callers such as tests and benchmarks).
    pub fn load(
        &self,
        weights: WeightSetBox,
        backend: BackendBox,
        cache: KvCacheBox,
    ) -> u_sdk::Result<ModelBox> {
        // A LLaVA checkpoint: its language model, reading images as rows its encoder made.
        let (weights, images) = match llava::is_llava(&weights) {
            true => (
                llava::LlavaText::new(weights.clone())?.into_box(),
                Some(weights),
            ),
            false => (weights, None),
        };
        // An IDEFICS checkpoint: its text side, a Llama with gated cross-attention blocks.
        let weights = match idefics::is_idefics(&weights) {
            true => idefics::IdeficsText::new(weights)?.into_box(),
            false => weights,
        };
        let weights = Weights::new(weights)?;
        let device = Device::new(backend)?;
        let mut model = Llama::load(weights, device, cache, self)?;
        if let Some(checkpoint) = images {
            let slots = llava::image_input(&checkpoint, model.cfg.vocab_size)?;
            model.read_images(llava::FAMILY, slots);
        }
        Ok(ModelBox::new(LlamaModel(Arc::new(model))))
    }
}

impl Architecture for LlamaArchitecture {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        let backend = context.compute_backend();
        match context.cache.into_option() {
            Some(cache) => self.load(context.weights, backend, cache).into(),
            None => RResult::RErr(UError::invalid(
                "arch-llama: a decoder needs a KV cache (the deployment loads no cache plugin)",
            )),
        }
    }

    fn gguf_view(&self, weights: WeightSetBox, _family: RString) -> RResult<WeightSetBox, UError> {
        if idefics::is_idefics(&weights) {
            return RResult::RErr(UError::unsupported(
                "arch-llama: IDEFICS' gated cross-attention blocks have no GGUF form",
            ));
        }
        // A LLaVA checkpoint's language model converts as the causal LM it is.
        let weights = match llava::is_llava(&weights) {
            true => match llava::LlavaText::new(weights) {
                Ok(text) => text.into_box(),
                Err(e) => return RResult::RErr(e),
            },
            false => weights,
        };
        gguf_view::gguf_view(weights).into()
    }
}

/// The built model, shared with the trainers made over it.
struct LlamaModel(Arc<Llama>);

impl Model for LlamaModel {
    fn config(&self) -> RResult<ModelConfig, UError> {
        RResult::ROk(self.0.model_config())
    }

    fn cache(&self) -> RResult<ROption<KvCacheBox>, UError> {
        RResult::ROk(ROption::RSome(self.0.cache().clone()))
    }

    fn forward(
        &self,
        batch: RSlice<'_, SeqChunk<'_>>,
        mut out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        self.0.forward(batch.as_slice(), out.as_mut_slice()).into()
    }

    fn graft(&self, dst: SeqId, src: SeqId, from: u64, count: u64) -> RResult<(), UError> {
        self.0.graft(dst, src, from, count).into()
    }

    fn load_adapter(
        &self,
        name: RStr<'_>,
        weights: WeightSetBox,
        config: RStr<'_>,
    ) -> RResult<AdapterInfo, UError> {
        self.0
            .load_adapter(name.as_str(), &weights, config.as_str())
            .into()
    }

    fn unload_adapter(&self, name: RStr<'_>) -> RResult<bool, UError> {
        self.0.unload_adapter(name.as_str()).into()
    }

    fn adapters(&self) -> RResult<RVec<AdapterInfo>, UError> {
        RResult::ROk(self.0.adapters().into())
    }

    fn counters(&self) -> RResult<RVec<ModelCounter>, UError> {
        RResult::ROk(self.0.counters().into())
    }

    fn trainer(&self, spec: TrainSpec) -> RResult<TrainerBox, UError> {
        if self.0.is_cross_decoder() {
            return RResult::RErr(UError::unsupported(
                "arch-llama: training a cross decoder (IDEFICS) is not implemented",
            ));
        }
        train::LlamaTrainer::new(self.0.clone(), spec)
            .map(TrainerBox::new)
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host picks this plugin by the families its manifest declares: every architecture
    /// the plugin builds is declared, and every declared family (GGUF architecture or HF
    /// `model_type`) is one it builds.
    #[test]
    fn the_manifest_declares_exactly_the_architectures_built() {
        let manifest: toml::Table = include_str!("../plugin.toml").parse().expect("plugin.toml");
        let families: Vec<&str> = manifest["families"]
            .as_array()
            .expect("families")
            .iter()
            .map(|f| f.as_str().expect("a family name"))
            .collect();
        for arch in config::SUPPORTED {
            assert!(families.contains(arch), "{arch} is not declared");
        }
        for family in families {
            // LLaVA's and IDEFICS' decoders are Llamas, read through `llava::LlavaText` and
            // `idefics::IdeficsText`.
            if family == llava::FAMILY || family == idefics::FAMILY {
                continue;
            }
            let arch = naming::hf_architecture(family);
            assert!(
                config::SUPPORTED.contains(&arch.as_ref()),
                "{family} is not built"
            );
        }
    }

    #[test]
    fn the_config_sets_the_expert_cache_and_nothing_else() {
        assert_eq!(
            LlamaArchitecture::from_config("").unwrap().experts,
            ExpertPolicy::default()
        );
        let p = LlamaArchitecture::from_config(
            "expert_prefetch = false\nexpert_lookahead = false\nexpert_budget_mb = 512\n\
             expert_pin_share = 0",
        )
        .unwrap()
        .experts;
        assert_eq!(
            p,
            ExpertPolicy {
                prefetch: false,
                lookahead: false,
                budget: Some(512 << 20),
                pin_share: 0.0,
            }
        );
        for (bad, says) in [
            ("expert_prefetch = 1", "must be true or false"),
            ("expert_lookahead = \"yes\"", "must be true or false"),
            ("expert_budget_mb = 0", "positive whole number"),
            ("expert_budget_mb = 1.5", "positive whole number"),
            ("expert_pin_share = -1", "at least 0"),
            ("expert_pin_share = nan", "at least 0"),
            ("prefetch = false", "unknown key `prefetch`"),
            ("expert_prefetch =", "arch-llama config"),
        ] {
            let e = LlamaArchitecture::from_config(bad).expect_err(bad);
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }
}
