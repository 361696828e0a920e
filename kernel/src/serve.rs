//! Running the transports of a loaded deployment inside the sandbox.

use crate::{OpenReport, instantiate, listeners, sandbox};
use abi_stable::std_types::{RResult, RVec};
use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};
use u_sdk::{
    Engine, EngineBox, ErrorKind, GenerateRequest, GenerateSummary, PluginInstance, Shutdown,
    ShutdownBox, TokenSinkBox, TransportContext, UError,
};

static SHUTDOWN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
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

/// The engine the host offers transports. Until an architecture plugin is part of the
/// deployment it serves no model and says so on every request.
#[derive(Clone)]
struct HostEngine {
    models: Vec<String>,
}

impl Engine for HostEngine {
    fn models(&self) -> RVec<abi_stable::std_types::RString> {
        self.models.iter().map(|m| m.as_str().into()).collect()
    }

    fn generate(
        &self,
        request: &GenerateRequest,
        _sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError> {
        RResult::RErr(UError::new(
            ErrorKind::NotFound,
            format!(
                "model `{}` is not served: this deployment loads no architecture plugin",
                request.model
            ),
        ))
    }
}

/// Opens listeners, locks the process down, then instantiates the plugins and runs every
/// transport until they return or a signal asks for shutdown. Returns the sandbox status and the
/// number of plugins refused (at verification or at instantiation).
pub fn run(opened: OpenReport, threads: u32) -> anyhow::Result<(sandbox::Status, usize)> {
    let mut plan = sandbox::Plan::default();
    let mut sockets_by_plugin = std::collections::BTreeMap::new();
    for plugin in &opened.opened {
        plan.add(&plugin.grants);
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
    // SAFETY: installs an async-signal-safe handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let status = sandbox::lock_down(&plan);
    let report = instantiate(opened, threads);
    let refused = report.refused.len();
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
    let engine = EngineBox::from_value(
        HostEngine { models: vec![] },
        abi_stable::sabi_trait::TD_Opaque,
    );
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
