//! # u-kernels-cpu — the CPU compute plugin of U
//!
//! A `kernels` plugin implementing the [`u_sdk::Backend`] interface on the CPU ([`CpuBackend`]:
//! host buffers from a reusing pool, weights imported from the loader's map in place, op lists
//! run in order). The instruction-set path is
//! chosen once at instantiation ([`Isa::detect`]: AVX-512 VNNI, AVX-512, AVX2+FMA+F16C, NEON,
//! scalar) and every kernel's function pointer is fixed then. Work runs on the plugin's own
//! threads, sized from the host's thread grant: a [`team`] in which the calling thread works
//! alongside helpers (matmul, attention: decode-sized ops), and a rayon pool for the rest.
//!
//! - [`matmul`]: `y = x · Wᵀ` with weights used as stored — f32/f16/bf16, and Q8_0, Q4_0, Q4_1,
//!   Q5_0, Q4_K, Q5_K, Q6_K, TQ1_0, TQ2_0 in their compressed blocks against activations quantized on
//!   the fly to int8 ([`act`]); other ggml types fall back to per-row dequantization.
//! - [`attention`]: flash attention (online softmax over key tiles) with causal mask, GQA,
//!   sliding window, f32 or f16 KV.
//! - [`ops`]: RMSNorm, LayerNorm, RoPE, activations, softmax, embedding rows;
//!   [`elementwise`]: add, multiply, scale, gated activations; [`routing`]: top-k and the
//!   scatter of MoE expert outputs; [`conv`]: 1-D/2-D convolution, group norm, upsampling.
//! - [`quantize`]: f32 into Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, TQ1_0 and TQ2_0
//!   blocks byte-identical to ggml's reference quantizers (the backend's `Copy` to those types).
//!
//! The scalar path is the reference every SIMD path is tested against; the scalar path itself is
//! tested against [`u_sdk::quant`]'s bit-exact dequantizers.
#![deny(missing_docs)]

pub mod act;
pub mod attention;
mod backend;
pub mod conv;
pub mod elementwise;
mod engine;
mod exp;
pub mod grad;
pub mod isa;
pub mod low_rank;
pub mod matmul;
pub mod ops;
pub mod quantize;
pub mod routing;
pub mod team;
#[doc(hidden)]
pub mod testutil;
pub mod vecops;

pub use backend::CpuBackend;
pub use engine::{CpuKernels, Engine};
pub use isa::Isa;

use abi_stable::std_types::RVec;
use u_sdk::{HostBox, PluginInfo, PluginInstance};

fn describe() -> PluginInfo {
    let isa = Isa::detect();
    PluginInfo {
        summary: "CPU kernels: SIMD quantized matmul on compressed ggml blocks, flash attention"
            .into(),
        details: RVec::from(vec![
            format!("isa={}", isa.name()).into(),
            format!("features={}", isa::features().join(",")).into(),
            "matmul=F32,F16,BF16,Q8_0,Q4_0,Q4_1,Q5_0,Q4_K,Q5_K,Q6_K,TQ1_0,TQ2_0 (others dequantized per row)"
                .into(),
            "attention=flash,causal|bidirectional,gqa,window,kv=F32|F16|I8".into(),
            "copy=any to F32,F16,BF16,Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q4_K,Q5_K,Q6_K,TQ1_0,TQ2_0 (ggml's reference quantizers)".into(),
        ]),
    }
}

/// Creates the kernels object with a pool of `host.threads()` threads, on the best ISA of this
/// CPU or the one the deployment's `[plugins.config] isa = "…"` names (`scalar`, `avx2`,
/// `avx512`, `vnni`, `neon`, `neondot`; e.g. to measure the AVX2 path on an AVX-512 machine).
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let threads = host.threads().max(1) as usize;
    let k = match configured_isa(host.config().as_str())? {
        Some(isa) => CpuKernels::with_isa(isa, threads)?,
        None => CpuKernels::new(threads)?,
    };
    host.info(&format!(
        "kernels-cpu: isa {}, {threads} threads",
        k.isa().name()
    ));
    Ok(PluginInstance::Kernels(k.into_box()))
}

/// The `isa` of the plugin's config table (TOML), if set; any other key is an error.
fn configured_isa(config: &str) -> u_sdk::Result<Option<Isa>> {
    let bad = |why: String| u_sdk::UError::invalid(format!("kernels-cpu config: {why}"));
    let table: toml::Table = config.parse().map_err(|e| bad(format!("{e}")))?;
    let mut isa = None;
    for (key, value) in &table {
        match (key.as_str(), value) {
            ("isa", toml::Value::String(name)) => {
                isa = Some(Isa::from_short(name).ok_or_else(|| {
                    bad(format!(
                        "unknown isa {name:?} (scalar, avx2, avx512, vnni, neon, neondot)"
                    ))
                })?);
            }
            ("isa", other) => return Err(bad(format!("`isa` must be a string, got {other}"))),
            (other, _) => return Err(bad(format!("unknown key `{other}` (only `isa`)"))),
        }
    }
    Ok(isa)
}

/// The exported root module and `.u.meta` section (in a module so the macro's items need no
/// docs on every target: on aarch64 `missing_docs` fires on its static).
#[allow(missing_docs)]
mod export {
    u_sdk::export_plugin! {
        manifest: "plugin.toml",
        describe: super::describe,
        instantiate: super::instantiate,
        before_fork: crate::engine::stop_threads,
        after_fork: crate::engine::start_threads,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_may_name_the_isa_and_nothing_else() {
        assert_eq!(configured_isa("").unwrap(), None);
        assert_eq!(configured_isa("isa = \"avx2\"").unwrap(), Some(Isa::Avx2));
        assert_eq!(
            configured_isa("isa = \"scalar\"").unwrap(),
            Some(Isa::Scalar)
        );
        for (bad, says) in [
            ("isa = \"sse9\"", "unknown isa"),
            ("isa = 2", "must be a string"),
            ("threads = 4", "unknown key"),
            ("isa = ", "kernels-cpu config"),
        ] {
            let e = configured_isa(bad).expect_err(bad);
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }
}
