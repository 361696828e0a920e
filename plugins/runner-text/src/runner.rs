//! The plugin glue: [`TextRunner`] starts an [`EngineHandle`] for the model the host built.

use crate::fork::{self, ForkSettings};
use crate::{EngineHandle, Generator, ImageSettings, Limits, Speculation, owner::Sharing};
use abi_stable::std_types::{RResult, RVec};
use std::sync::Arc;
use u_sdk::{
    EngineBox, HostBox, PluginInfo, PluginInstance, Runner, RunnerBox, RunnerContext, UError,
};

/// The `runner` entry object, with its plugin settings.
#[derive(Clone, Default)]
pub struct TextRunner {
    /// Which clients share cached prompt prefixes (`share_prefixes`).
    pub sharing: Sharing,
    /// Prompt-lookup speculative decoding (`draft_tokens`, `draft_max_running`).
    pub speculation: Speculation,
    /// How images are read (`max_image_pixels`, `image_cache_bytes`).
    pub images: ImageSettings,
    /// Fork isolation (`isolation = "fork"`), with the host that stops and restarts the
    /// plugins' threads around each fork.
    pub fork: Option<(ForkSettings, HostBox)>,
}

impl Runner for TextRunner {
    fn start(&self, context: RunnerContext) -> RResult<EngineBox, UError> {
        let defaults = Limits::default();
        let pick = |v: u32, d: usize| if v == 0 { d } else { v as usize };
        let l = context.limits;
        let limits = Limits {
            max_running: pick(l.max_running, defaults.max_running),
            max_queued: pick(l.max_queued, defaults.max_queued),
            step_tokens: pick(l.step_tokens, defaults.step_tokens),
        };
        (|| {
            let generator = Generator::new(context.model, context.tokenizer.into_option())?
                .with_speculation(self.speculation)
                .with_draft_model(context.draft_model.into_option())?;
            let aliases = context.aliases.iter().map(|a| a.to_string()).collect();
            let extras = context.extras.into_vec();
            Ok(
                EngineHandle::with_limits(context.name.as_str(), Arc::new(generator), limits)
                    .with_aliases(aliases)
                    .with_device(context.device.as_str())
                    .with_sharing(self.sharing.clone())
                    .with_extras(extras)?
                    .with_adapter_loading(
                        context.adapter_opener.into_option(),
                        context.limits.adapter_bytes,
                    )
                    .with_images(context.image_encoder.into_option(), self.images)?
                    .into_box(),
            )
        })()
        .map_err(|e: crate::Error| e.to_uerror())
        .and_then(|engine| match &self.fork {
            Some((settings, host)) => {
                let settings = ForkSettings {
                    max_running: limits.max_running,
                    max_queued: limits.max_queued,
                    ..settings.clone()
                };
                fork::start(engine, host.clone(), settings)
            }
            None => Ok(engine),
        })
        .into()
    }
}

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "text generation: continuous batching, sampling, chat templates, prompt cache"
            .into(),
        details: RVec::new(),
    }
}

/// Creates the runner (the root module's `instantiate`) from its settings: `share_prefixes =
/// "all" | "client" | "none"` (default `client`: see [`Sharing`]); `draft_tokens = N` (most
/// tokens a prompt-lookup draft proposes per pass, 0 turns speculation off; default 4),
/// `draft_max_running = N` (drafts run while a pass decodes at most N requests; default 4),
/// for a model that reads images `max_image_pixels = N` (default PIL's limit) and
/// `image_cache_bytes = N` (encoder outputs kept for repeated images; default 256 MiB); and
/// `isolation = "thread" | "fork"` (default `thread`; `fork` runs each request in its own
/// process, see [`crate::fork`], and needs `process.fork` granted) with `fork_pool = N`
/// (sessions forked ahead, default 2), `warm_prompt = "…"`, `session_memory_mb = N` and
/// `session_cpu_seconds = N` ([`ForkSettings`]).
fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let config: toml::Table = host
        .config()
        .as_str()
        .parse()
        .map_err(|e| UError::invalid(format!("runner-text config: {e}")))?;
    let mut runner = TextRunner::default();
    let mut fork = ForkSettings {
        pool: 2,
        ..ForkSettings::default()
    };
    let mut isolated = false;
    for (key, value) in &config {
        let count = || match value.as_integer() {
            Some(n @ 0..=64) => Ok(n as usize),
            _ => Err(UError::invalid(format!(
                "runner-text config: {key} must be a whole number from 0 to 64, not {value}"
            ))),
        };
        let bytes = || match value.as_integer() {
            Some(n) if n >= 0 => Ok(n as u64),
            _ => Err(UError::invalid(format!(
                "runner-text config: {key} must be a whole number, not {value}"
            ))),
        };
        match (key.as_str(), value.as_str().and_then(Sharing::parse)) {
            ("max_image_pixels", _) => runner.images.limits.max_pixels = bytes()?.max(1),
            ("image_cache_bytes", _) => runner.images.cache_bytes = bytes()? as usize,
            ("draft_tokens", _) => runner.speculation.draft_tokens = count()?,
            ("draft_max_running", _) => runner.speculation.max_running = count()?,
            ("share_prefixes", Some(sharing)) => runner.sharing = sharing,
            ("isolation", _) => {
                isolated = match value.as_str() {
                    Some("fork") => true,
                    Some("thread") => false,
                    _ => {
                        return Err(UError::invalid(
                            "runner-text config: isolation must be \"thread\" or \"fork\"",
                        ));
                    }
                }
            }
            ("fork_pool", _) => fork.pool = count()?.max(1),
            ("warm_prompt", _) => {
                fork.warm_prompt = value
                    .as_str()
                    .ok_or_else(|| {
                        UError::invalid("runner-text config: warm_prompt must be a string")
                    })?
                    .to_string()
            }
            ("session_memory_mb", _) => fork.memory_mb = bytes()?,
            ("session_cpu_seconds", _) => fork.cpu_seconds = bytes()?,
            ("share_prefixes", None) => {
                return Err(UError::invalid(
                    "runner-text config: share_prefixes must be \"all\", \"client\" or \"none\"",
                ));
            }
            _ => {
                return Err(UError::invalid(format!(
                    "runner-text config: unknown key `{key}` (batch sizes are set under [model])"
                )));
            }
        }
    }
    if isolated {
        runner.fork = Some((fork, host));
    } else if !fork.warm_prompt.is_empty() || fork.memory_mb != 0 || fork.cpu_seconds != 0 {
        return Err(UError::invalid(
            "runner-text config: warm_prompt and session limits apply only with isolation = \"fork\"",
        ));
    }
    Ok(PluginInstance::Runner(RunnerBox::new(runner)))
}

/// The exported root module and embedded manifest.
mod export {
    u_sdk::export_plugin! {
        manifest: "plugin.toml",
        describe: super::describe,
        instantiate: super::instantiate,
        before_fork: crate::scheduler::stop_threads,
        after_fork: crate::scheduler::start_threads,
    }
}
