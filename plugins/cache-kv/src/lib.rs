//! # u-cache-kv — the KV memory of U
//!
//! A `cache` plugin: the keys and values of running sequences, shared as much as exactness
//! allows.
//!
//! - `page`: fixed pages of 64 tokens per layer, their memory a buffer of the model's backend
//!   (so attention reads them in place), refcounted through `Arc`, **append-only**:
//!   forking copies no data, the first writer past a shared page's frontier appends in place and
//!   any other writer copies that one page (copy on write). Borrowed page slices therefore never
//!   change or move; each cache handle keeps the pages it lent until it is dropped.
//! - `radix`: a radix tree over token ids with compressed edges; lookup forks the deepest
//!   cached prefix, pins it while the sequence lives, and LRU eviction keeps the cache under
//!   `max_bytes`.
//! - [`quant`]: int8 KV per sequence, or for all with `kv_dtype = "int8"` (group 32, one f32
//!   scale each), handed out as int8 pages that attention reads in place.
//! - `disk` ([`FormatError`]): crash-safe, checksummed, model-bound checkpoint and prefix-tree
//!   files, restored with `mmap`; the prefix tree is written through to disk and rebuilt from it
//!   when a cache opens the directory again (see `store`).
//!
//! Configuration (`[plugins.config]` of the deployment):
//!
//! ```toml
//! max_bytes = 8_589_934_592  # evict prefix-tree entries past this many bytes of heap KV
//!                            # (pages mapped from `dir` are the page cache's, not counted)
//! dir = "/srv/kv"            # persist checkpoints here (needs an fs.write grant)
//! max_checkpoints = 4096     # named checkpoints kept in memory
//! persist_prefixes = true    # persist the prefix tree under `dir` too (the default)
//! max_disk_bytes = 34_359_738_368  # delete least recently used prefix segments past this many
//!                            # bytes of segment files (default 4 × max_bytes; checkpoints are
//!                            # not counted nor deleted)
//! ```
#![deny(missing_docs)]

mod disk;
mod page;
mod plugin;
pub mod quant;
mod radix;
mod store;

pub use disk::{FileKind, FormatError, MAGIC, PREFIX_MAGIC, VERSION, check_file};
pub use page::{Alloc, PAGE_TOKENS};
pub use plugin::KvCachePlugin;
pub use store::{Config, DEFAULT_DISK_BUDGET_MULTIPLE, KvDtype, SegmentStats, Store};

use abi_stable::std_types::RVec;
use u_sdk::{HostBox, PluginInfo, PluginInstance};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "paged copy-on-write KV cache: radix prefix tree, int8 KV, checkpoints, disk tier"
            .into(),
        details: RVec::from(vec![
            format!("page_tokens={}", page::PAGE_TOKENS).into(),
            format!("int8_group={}", quant::GROUP).into(),
            format!("disk_format=v{}", disk::VERSION).into(),
        ]),
    }
}

/// Creates the plugin's cache object from the host's config (the root module's `instantiate`).
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let config = Config::parse(host.config().as_str())?;
    let cache = KvCachePlugin::new(config, Some(host));
    Ok(PluginInstance::Cache(cache.into_box()))
}

u_sdk::export_plugin! {
    manifest: "plugin.toml",
    describe: describe,
    instantiate: instantiate,
}
