//! Running the transports of a loaded deployment inside the sandbox.
//!
//! When the deployment names a `[model]`, the model path is granted to the loader and tokenizer
//! plugins, and after lock-down the model is built (as for `u-runner generate`) and handed to
//! the runner plugin for its task, whose engine every transport shares. Without a model the
//! transports get an engine that serves nothing and says so.

use crate::{OpenReport, instantiate, listeners, sandbox, wiring};
use abi_stable::std_types::{RResult, RSlice, RStr, RVec};
use nix::sys::signal::{SigHandler, Signal, signal};
use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};
use u_attest::Deployment;
use u_sdk::{
    CheckpointInfo, CheckpointRequest, Engine, EngineBox, EngineStats, ErrorKind, GenerateRequest,
    GenerateSummary, PluginInstance, Shutdown, ShutdownBox, TokenSinkBox, TokenizeRequest,
    TransportContext, UError,
};

static SHUTDOWN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: std::ffi::c_int) {
    SHUTDOWN.store(true, Ordering::SeqCst);
}

/// Shutdown signal raised by SIGINT or SIGTERM.
#[derive(Clone)]
struct SignalShutdown;

impl Shutdown for SignalShutdown {
    fn requested(&self) -> bool {
        SHUTDOWN.load(Ordering::SeqCst)
    }

    fn wait(&self, timeout_ms: u64) -> bool {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        while !self.requested() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }
}

/// The engine the host offers transports when the deployment names no model: it serves nothing
/// and says so on every request.
#[derive(Clone)]
struct HostEngine {
    models: Vec<String>,
}

impl HostEngine {
    fn not_served(model: &str) -> UError {
        UError::new(
            ErrorKind::NotFound,
            format!("model `{model}` is not served: this deployment names no [model]"),
        )
    }
}

impl Engine for HostEngine {
    fn models(&self) -> RResult<RVec<abi_stable::std_types::RString>, UError> {
        RResult::ROk(self.models.iter().map(|m| m.as_str().into()).collect())
    }

    fn generate(
        &self,
        request: &GenerateRequest,
        _sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError> {
        RResult::RErr(Self::not_served(&request.model))
    }

    fn stats(&self) -> RResult<EngineStats, UError> {
        RResult::ROk(EngineStats::default())
    }

    fn checkpoint(&self, request: &CheckpointRequest) -> RResult<RVec<CheckpointInfo>, UError> {
        RResult::RErr(Self::not_served(&request.model))
    }

    fn flush_cache(&self, model: RStr<'_>) -> RResult<u64, UError> {
        RResult::RErr(Self::not_served(model.as_str()))
    }

    fn embed(&self, model: RStr<'_>, _input: RStr<'_>) -> RResult<RVec<f32>, UError> {
        RResult::RErr(Self::not_served(model.as_str()))
    }

    fn tokenize(&self, request: &TokenizeRequest) -> RResult<RVec<u32>, UError> {
        RResult::RErr(Self::not_served(&request.model))
    }

    fn detokenize(&self, model: RStr<'_>, _tokens: RSlice<'_, u32>) -> RResult<RVec<u8>, UError> {
        RResult::RErr(Self::not_served(model.as_str()))
    }

    fn embed_tokens(&self, model: RStr<'_>, _: RSlice<'_, u32>) -> RResult<RVec<f32>, UError> {
        RResult::RErr(Self::not_served(model.as_str()))
    }

    fn embed_image(&self, model: RStr<'_>, _: RSlice<'_, u8>) -> RResult<RVec<f32>, UError> {
        RResult::RErr(Self::not_served(model.as_str()))
    }
}

/// Opens listeners, grants `model` (if any) to the loaders and tokenizers, locks the process
/// down, then instantiates the plugins, wires the model into an engine and runs every transport
/// until they return or a signal asks for shutdown. Returns the sandbox status and the number of
/// plugins refused (at verification or at instantiation).
pub fn run(
    mut opened: OpenReport,
    threads: u32,
    deployment: &Deployment,
) -> anyhow::Result<(sandbox::Status, usize)> {
    let model = deployment.model.as_deref();
    let mut plan = sandbox::Plan::default();
    if let Some(model) = model {
        if !model.exists() {
            anyhow::bail!("the deployment's model {} does not exist", model.display());
        }
        plan.read.extend(wiring::grant_model(&mut opened, model));
        plan.read
            .extend(wiring::grant_extras(&mut opened, deployment));
    }
    crate::loading::start_workers(&mut opened, threads);
    let mut sockets_by_plugin = std::collections::BTreeMap::new();
    for plugin in &opened.opened {
        if !plugin.in_worker() {
            plan.add(&plugin.grants);
        }
        let name = plugin.verified.manifest.name.clone();
        for address in &plugin.grants.net_listen {
            let l = listeners::open(address)
                .map_err(|e| anyhow::anyhow!("plugin `{name}`: cannot listen on {address}: {e}"))?;
            tracing::info!(plugin = %name, "listening on {address}");
            sockets_by_plugin
                .entry(name.clone())
                .or_insert_with(Vec::new)
                .push(l);
        }
    }
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: installs an async-signal-safe handler that only stores to an atomic.
        unsafe { signal(sig, SigHandler::Handler(on_signal)) }
            .map_err(|e| anyhow::anyhow!("cannot handle {sig}: {e}"))?;
    }
    let status = sandbox::lock_down(&plan);
    let report = instantiate(opened, threads);
    for r in &report.refused {
        tracing::error!(plugin = %r.plugin, "refused: {}", r.reason);
    }
    let refused = report.refused.len();
    let engine = match model {
        Some(model) => {
            let name = wiring::served_name(model);
            let built = wiring::build(
                &report,
                model,
                wiring::Want::Engine,
                status.clone(),
                deployment,
                &name,
            )?;
            let (runner, engine) = built
                .engine
                .ok_or_else(|| anyhow::anyhow!("no engine was started for {}", model.display()))?;
            let (arch, kind) = built
                .built
                .map(|(a, c)| (a, format!("{:?}", c.kind)))
                .unwrap_or_default();
            tracing::info!(
                model = %name,
                loader = %built.loader,
                architecture = %arch,
                kind = %kind,
                runner = %runner,
                device = %built.backend.map(|b| b.device.into_string()).unwrap_or_default(),
                "serving {}",
                model.display()
            );
            engine
        }
        None => EngineBox::new(HostEngine { models: vec![] }),
    };
    let mut transports = Vec::new();
    for plugin in report.loaded {
        if let PluginInstance::Transport(t) = plugin.instance {
            let name = plugin.verified.manifest.name;
            let sockets = sockets_by_plugin.remove(&name).unwrap_or_default();
            transports.push((name, t, sockets));
        }
    }
    if transports.is_empty() {
        anyhow::bail!("the deployment loads no transport plugin: nothing to serve");
    }
    let shutdown = ShutdownBox::from_value(SignalShutdown, abi_stable::sabi_trait::TD_Opaque);
    let handles: Vec<_> = transports
        .into_iter()
        .map(|(name, transport, sockets)| {
            let context = TransportContext {
                engine: engine.clone(),
                shutdown: shutdown.clone(),
                listeners: sockets.into(),
            };
            let thread_name = name.clone();
            let handle = std::thread::Builder::new()
                .name(format!("transport:{thread_name}"))
                .spawn(move || transport.serve(context).into_result())
                .map_err(|e| anyhow::anyhow!("cannot start transport `{name}`: {e}"));
            (name, handle)
        })
        .collect();
    for (name, handle) in handles {
        match handle?.join() {
            Ok(Ok(())) => tracing::info!(plugin = %name, "transport finished"),
            Ok(Err(e)) => tracing::error!(plugin = %name, "transport failed: {e}"),
            Err(_) => tracing::error!(plugin = %name, "transport thread panicked"),
        }
    }
    Ok((status, refused))
}
