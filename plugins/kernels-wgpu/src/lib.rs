//! # u-kernels-wgpu — the GPU compute plugin of U
//!
//! A `kernels` plugin implementing the [`u_sdk::Backend`] interface with WGSL compute shaders
//! through `wgpu`, so one build runs on any GPU with a Vulkan, Metal or DX12 driver (and on
//! Mesa's lavapipe, a CPU Vulkan driver, which is how it is tested without a GPU):
//!
//! - [`gpu`]: the device, its queue, the pending command encoder, read-back that blocks on the
//!   device's fence rather than spinning, and clear errors for a missing adapter, a lost
//!   device or memory running out.
//! - [`buffer`]: device buffers; weights are uploaded once at import and stay resident.
//! - [`backend`]: the ops — matmul and row lookup on F32, F16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K
//!   weights in their compressed blocks, RMSNorm, LayerNorm, RoPE, softmax, flash attention
//!   (f32 or f16 KV, causal or bidirectional, GQA, sliding window, soft-capping), elementwise
//!   and gated activations, 1-D/2-D convolution, group norm, upsampling, f32↔f16 copies.
//!   What it lacks ([`u_sdk::Backend::supports`] says so) the host runs on the CPU plugin.
//! - [`shaders`]: the kernels' WGSL sources.
#![deny(missing_docs)]

pub mod backend;
pub mod buffer;
pub mod gpu;
pub mod shaders;

pub use backend::WgpuBackend;
pub use gpu::Gpu;

use abi_stable::std_types::RVec;
use std::sync::Arc;
use u_sdk::{BackendBox, HostBox, PluginInfo, PluginInstance};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "GPU kernels in WGSL through wgpu: device-resident weights, quantized matmul"
            .into(),
        details: RVec::from(vec![
            "matmul=F32,F16,Q8_0,Q4_0,Q4_1,Q4_K,Q6_K (in their blocks)".into(),
            "attention=flash,causal|bidirectional,gqa,window,kv=F32|F16".into(),
            "backends=vulkan,metal,dx12".into(),
        ]),
    }
}

/// Opens the GPU the deployment's `[plugins.config] adapter = "…"` names (a part of the
/// adapter's name, e.g. `"llvmpipe"` or `"RTX"`), else the high-performance one, holding at
/// most `memory_limit_mb = N` MiB of buffers when that is set.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let config = configured(host.config().as_str())?;
    let gpu = Gpu::open(config.adapter.as_deref(), config.memory_limit)?;
    host.info(&format!(
        "kernels-wgpu: {} ({:?}, {})",
        gpu.adapter.name, gpu.adapter.backend, gpu.adapter.driver
    ));
    Ok(PluginInstance::Kernels(BackendBox::new(WgpuBackend::new(
        Arc::new(gpu),
    ))))
}

/// The plugin's settings.
#[derive(Debug, Default, PartialEq)]
struct Config {
    /// Part of the adapter's name.
    adapter: Option<String>,
    /// Bytes of buffers it may hold.
    memory_limit: Option<u64>,
}

/// The plugin's config table (TOML): `adapter` and `memory_limit_mb`; any other key is an error.
fn configured(text: &str) -> u_sdk::Result<Config> {
    let bad = |why: String| u_sdk::UError::invalid(format!("kernels-wgpu config: {why}"));
    let table: toml::Table = text.parse().map_err(|e| bad(format!("{e}")))?;
    let mut config = Config::default();
    for (key, value) in &table {
        match (key.as_str(), value) {
            ("adapter", toml::Value::String(name)) => config.adapter = Some(name.clone()),
            ("memory_limit_mb", toml::Value::Integer(mb)) if *mb > 0 => {
                config.memory_limit = Some(*mb as u64 * 1024 * 1024);
            }
            ("adapter", other) => {
                return Err(bad(format!("`adapter` must be a string, got {other}")));
            }
            ("memory_limit_mb", other) => {
                return Err(bad(format!(
                    "`memory_limit_mb` must be a positive whole number, got {other}"
                )));
            }
            (other, _) => {
                return Err(bad(format!(
                    "unknown key `{other}` (only `adapter`, `memory_limit_mb`)"
                )));
            }
        }
    }
    Ok(config)
}

/// The exported root module and `.u.meta` section.
#[allow(missing_docs)]
mod export {
    u_sdk::export_plugin! {
        manifest: "plugin.toml",
        describe: super::describe,
        instantiate: super::instantiate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_names_the_adapter_and_a_memory_limit_and_nothing_else() {
        assert_eq!(configured("").unwrap(), Config::default());
        assert_eq!(
            configured("adapter = \"llvmpipe\"\nmemory_limit_mb = 2").unwrap(),
            Config {
                adapter: Some("llvmpipe".into()),
                memory_limit: Some(2 << 20),
            }
        );
        for (bad, says) in [
            ("adapter = 1", "must be a string"),
            ("memory_limit_mb = 0", "positive whole number"),
            ("memory_limit_mb = \"1G\"", "positive whole number"),
            ("device = \"x\"", "unknown key"),
            ("adapter = ", "kernels-wgpu config"),
        ] {
            let e = configured(bad).expect_err(bad);
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }
}
