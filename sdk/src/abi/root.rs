//! The root module every plugin exports, and the instance it creates.

use crate::abi::{
    backend::BackendBox, cache::KvCacheBox, error::UError, host::HostBox, loader::LoaderBox,
    model::ArchitectureBox, runner::RunnerBox, tokenizer::TokenizerFactoryBox,
    transport::TransportBox,
};
use abi_stable::{
    StableAbi, declare_root_module_statics,
    library::RootModule,
    package_version_strings,
    sabi_types::VersionStrings,
    std_types::{RResult, RString, RVec},
};

/// A plugin's entry object: one variant per plugin kind.
#[repr(C, u8)]
#[derive(StableAbi)]
pub enum PluginInstance {
    /// A weight loader.
    Loader(LoaderBox),
    /// A compute backend.
    Kernels(BackendBox),
    /// A model architecture.
    Architecture(ArchitectureBox),
    /// A tokenizer factory.
    Tokenizer(TokenizerFactoryBox),
    /// A KV cache.
    Cache(KvCacheBox),
    /// A transport.
    Transport(TransportBox),
    /// A task runner.
    Runner(RunnerBox),
}

impl PluginInstance {
    /// The kind name matching the manifest's `kind` field.
    pub fn kind_name(&self) -> &'static str {
        match self {
            PluginInstance::Loader(_) => "loader",
            PluginInstance::Kernels(_) => "kernels",
            PluginInstance::Architecture(_) => "architecture",
            PluginInstance::Tokenizer(_) => "tokenizer",
            PluginInstance::Cache(_) => "cache",
            PluginInstance::Transport(_) => "transport",
            PluginInstance::Runner(_) => "runner",
        }
    }
}

/// What a plugin says about itself at run time (the signed manifest says the rest).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct PluginInfo {
    /// Short description of what this build does.
    pub summary: RString,
    /// Run-time facts worth reporting, e.g. `["isa=avx2+fma", "threads=2"]`.
    pub details: RVec<RString>,
}

/// The root module: the functions the host calls right after loading a plugin.
///
/// A prefix type: fields after `instantiate` are optional, so plugins built before they were
/// added still load (the host treats a missing fork hook as "no threads to stop").
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(panic))]
pub struct PluginMod {
    /// The plugin's own `.u.meta` section, read at run time (for self-checks and diagnostics).
    pub meta_section: extern "C" fn() -> RVec<u8>,

    /// Run-time self-description.
    pub describe: extern "C" fn() -> PluginInfo,

    /// Creates the plugin's entry object, giving it its host services.
    #[sabi(last_prefix_field)]
    pub instantiate: extern "C" fn(host: HostBox) -> RResult<PluginInstance, UError>,

    /// Stops (joins) every thread the plugin started, leaving their work ready to restart, so
    /// the process can fork with no lock held by a thread the child will not have
    /// ([`Host::prepare_fork`](crate::abi::host::Host::prepare_fork)). Plugins without threads
    /// do nothing.
    #[sabi(missing_field(option))]
    pub before_fork: extern "C" fn(),

    /// Restarts what `before_fork` stopped: in the parent (`in_child` false) or in the forked
    /// child, which has only the forking thread.
    #[sabi(missing_field(option))]
    pub after_fork: extern "C" fn(in_child: bool),
}

impl RootModule for PluginModRef {
    declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "u_plugin";
    const NAME: &'static str = "u_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}
