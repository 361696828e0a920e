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
//!
//! Hyper-parameters come from canonical metadata (`{arch}.block_count`…, see
//! `u_sdk::naming`), RoPE pairing from `u.rope.pairing` (absent: llama.cpp's per-architecture
//! rule, "normal" for `llama`, "neox" otherwise).
//!
//! Reference implementation: Hugging Face `transformers` (`modeling_llama.py`,
//! `modeling_mistral.py`, `modeling_qwen2.py`, `modeling_qwen3.py`, `modeling_mixtral.py`,
//! `modeling_qwen2_moe.py`, `modeling_qwen3_moe.py`, `modeling_olmoe.py`), against which `tests/` checks logits on
//! tiny random-weight models; the tensor naming and GGUF conventions are llama.cpp's.
//!
//! Layout: [`config`] (typed hyper-parameters from metadata), [`weights`] (metadata access and
//! the linear layer), [`model`] (`Attention`, `Mlp`, `MoE`, `Block`, `Llama`), and the plugin
//! glue below. Compute goes through the `Kernels` interface, KV through the `KvCache`
//! interface; this crate does no math a kernel offers.
#![deny(missing_docs)]

pub mod config;
pub mod model;
pub mod weights;

pub use config::Config;
pub use model::Llama;
pub use weights::Weights;

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{ROption, RResult, RSlice, RSliceMut, RString, RVec},
};
use u_sdk::{
    Architecture, Architecture_TO, ArchitectureBox, HostBox, KernelsBox, KvCacheBox, Model,
    Model_TO, ModelBox, ModelConfig, PluginInfo, PluginInstance, RopeParams, SeqChunk, UError,
    WeightSetBox, guard, guard_infallible,
};

/// The families this plugin builds (metadata architectures and HF model types).
pub const FAMILIES: [&str; 10] = [
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2moe",
    "qwen3moe",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
];

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "Llama-family decoder: Llama 2/3, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE, OLMoE"
            .into(),
        details: RVec::from(vec![RString::from(format!(
            "families={}",
            FAMILIES.join(",")
        ))]),
    }
}

/// Creates the architecture object (the `instantiate` entry of the root module), configured by
/// the deployment's `[plugins.config]` (see [`LlamaArchitecture::from_config`]).
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let arch = LlamaArchitecture::from_config(host.config().as_str())?;
    Ok(PluginInstance::Architecture(arch.into_box()))
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
#[derive(Clone, Copy, Debug)]
pub struct LlamaArchitecture {
    /// Whether MoE layers ask for the routed experts' pages (`madvise(MADV_WILLNEED)`) before
    /// their FFN runs.
    pub expert_prefetch: bool,
}

impl Default for LlamaArchitecture {
    fn default() -> Self {
        Self {
            expert_prefetch: true,
        }
    }
}

impl LlamaArchitecture {
    /// From the plugin's config table (TOML): `expert_prefetch = false` turns the expert
    /// prefetch off (it is on by default: useful where weights are paged in from disk, pure
    /// overhead where they are resident). Any other key, or another type, is an error.
    pub fn from_config(config: &str) -> u_sdk::Result<Self> {
        let bad = |why: String| UError::invalid(format!("arch-llama config: {why}"));
        let table: toml::Table = config.parse().map_err(|e| bad(format!("{e}")))?;
        let mut arch = Self::default();
        for (key, value) in table {
            match (key.as_str(), value) {
                ("expert_prefetch", toml::Value::Boolean(on)) => arch.expert_prefetch = on,
                ("expert_prefetch", v) => {
                    return Err(bad(format!(
                        "expert_prefetch must be true or false, not {v}"
                    )));
                }
                (other, _) => {
                    return Err(bad(format!(
                        "unknown key `{other}` (the only setting is expert_prefetch)"
                    )));
                }
            }
        }
        Ok(arch)
    }

    /// As an ABI object.
    pub fn into_box(self) -> ArchitectureBox {
        Architecture_TO::from_value(self, TD_Opaque)
    }
}

impl Architecture for LlamaArchitecture {
    fn families(&self) -> RVec<RString> {
        guard_infallible(
            || FAMILIES.iter().map(|&f| RString::from(f)).collect(),
            RVec::new,
        )
    }

    fn build(
        &self,
        weights: WeightSetBox,
        kernels: KernelsBox,
        cache: KvCacheBox,
    ) -> RResult<ModelBox, UError> {
        guard("arch-llama.build", || {
            let model = Llama::load(Weights::new(weights), kernels, cache, self)?;
            Ok(Model_TO::from_value(model, TD_Opaque))
        })
    }
}

impl Model for Llama {
    fn config(&self) -> ModelConfig {
        let c = &self.cfg;
        let moe = c.moe.map_or(0, |m| m.experts);
        ModelConfig {
            family: c.family.as_str().into(),
            vocab_size: c.vocab_size as u32,
            context_length: c.context_length as u32,
            layers: c.layers as u32,
            hidden: c.hidden as u32,
            experts: moe as u32,
        }
    }

    fn cache(&self) -> KvCacheBox {
        Llama::cache(self).clone()
    }

    fn key_rope(&self) -> ROption<RopeParams> {
        ROption::RSome(Llama::key_rope(self))
    }

    fn embed(&self, tokens: RSlice<'_, u32>) -> RResult<RVec<f32>, UError> {
        guard("arch-llama.embed", || {
            Llama::embed(self, tokens.as_slice()).map(RVec::from)
        })
    }

    fn forward(
        &self,
        batch: RSlice<'_, SeqChunk<'_>>,
        mut logits: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        guard("arch-llama.forward", || {
            Llama::forward(self, batch.as_slice(), logits.as_mut_slice())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_may_turn_the_expert_prefetch_off_and_nothing_else() {
        assert!(LlamaArchitecture::from_config("").unwrap().expert_prefetch);
        assert!(
            !LlamaArchitecture::from_config("expert_prefetch = false")
                .unwrap()
                .expert_prefetch
        );
        for (bad, says) in [
            ("expert_prefetch = 1", "must be true or false"),
            ("prefetch = false", "unknown key `prefetch`"),
            ("expert_prefetch =", "arch-llama config"),
        ] {
            let e = LlamaArchitecture::from_config(bad).expect_err(bad);
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }
}
