//! The ABI side: [`u_sdk::KvCache`] over a [`Store`], with page leases for sound borrowing.

use crate::{
    disk::Disk,
    page::{Page, View},
    store::{Config, Store},
};
use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RSlice, RStr, RString, RVec},
};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};
use u_sdk::{
    DType, HostBox, KvCache, KvCache_TO, KvCacheBox, KvLayout, KvPage, KvStats, PrefixMatch,
    RopeParams, SeqId, UError, guard,
};

/// A handle to a cache. Clones share the cache; each handle keeps the pages it handed out
/// through [`KvCache::pages`] (its *leases*) until it is dropped, which is what makes the
/// returned slices valid for the handle's lifetime: a leased page is never freed, and since the
/// lease counts as a reference, nobody rewinds it either (writers copy it instead).
pub struct KvCachePlugin {
    store: Arc<Store>,
    leases: Mutex<HashMap<usize, Arc<Page>>>,
}

impl Clone for KvCachePlugin {
    fn clone(&self) -> Self {
        Self::from_store(self.store.clone())
    }
}

impl KvCachePlugin {
    /// A cache configured by `config`; the disk tier (if `config.dir` is set) goes through `host`.
    pub fn new(config: Config, host: Option<HostBox>) -> Self {
        let disk = match (&config.dir, host) {
            (Some(dir), Some(host)) => Some(Disk::open(host, dir)),
            _ => None,
        };
        Self::from_store(Arc::new(Store::new(config, disk)))
    }

    fn from_store(store: Arc<Store>) -> Self {
        Self {
            store,
            leases: Mutex::new(HashMap::new()),
        }
    }

    /// The engine (for tests and benchmarks).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Pages leased by this handle.
    pub fn leased(&self) -> usize {
        self.leases.lock().map(|l| l.len()).unwrap_or(0)
    }

    /// Releases this handle's leases; `&mut self` proves no slice from it is still borrowed.
    pub fn reclaim(&mut self) {
        self.leases
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// This handle as an ABI object.
    pub fn into_box(self) -> KvCacheBox {
        KvCache_TO::from_value(self, TD_Opaque)
    }

    /// `layer`'s pages of `seq`, leased to this handle.
    pub fn pages_of(&self, seq: SeqId, layer: u32) -> u_sdk::Result<Vec<KvPage<'_>>> {
        let pages = self.store.pages(seq, layer)?;
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::with_capacity(pages.len());
        for (page, n) in pages {
            let ptr = Arc::as_ptr(&page);
            leases.entry(ptr as usize).or_insert(page);
            // SAFETY: the lease map holds a strong reference to this page until `self` is
            // dropped or reclaimed through `&mut self`, neither of which can happen while the
            // returned borrow of `self` lives; slots `0..n` are published and, the page being
            // shared with the lease, never written again (see `page`).
            let page: &Page = unsafe { &*ptr };
            out.push(match page.view(n) {
                View::F32 { keys, values } => KvPage::f32(n as u32, keys, values),
                View::I8 {
                    keys,
                    values,
                    key_scales,
                    value_scales,
                } => KvPage {
                    tokens: n as u32,
                    keys: RSlice::default(),
                    values: RSlice::default(),
                    dtype: DType::I8,
                    keys_i8: keys.into(),
                    values_i8: values.into(),
                    key_scales: key_scales.into(),
                    value_scales: value_scales.into(),
                },
            });
        }
        Ok(out)
    }
}

impl KvCache for KvCachePlugin {
    fn configure(&self, layout: KvLayout) -> RResult<(), UError> {
        guard("cache-kv.configure", || self.store.configure(layout))
    }

    fn create(&self) -> RResult<SeqId, UError> {
        guard("cache-kv.create", || self.store.create())
    }

    fn fork(&self, seq: SeqId) -> RResult<SeqId, UError> {
        guard("cache-kv.fork", || self.store.fork(seq))
    }

    fn release(&self, seq: SeqId) -> RResult<(), UError> {
        guard("cache-kv.release", || self.store.release(seq))
    }

    fn len(&self, seq: SeqId) -> RResult<u64, UError> {
        guard("cache-kv.len", || self.store.len(seq))
    }

    fn truncate(&self, seq: SeqId, len: u64) -> RResult<(), UError> {
        guard("cache-kv.truncate", || self.store.truncate(seq, len))
    }

    fn append(
        &self,
        seq: SeqId,
        layer: u32,
        keys: RSlice<'_, f32>,
        values: RSlice<'_, f32>,
    ) -> RResult<(), UError> {
        guard("cache-kv.append", || {
            self.store
                .append(seq, layer, keys.as_slice(), values.as_slice())
        })
    }

    fn pages<'a>(&'a self, seq: SeqId, layer: u32) -> RResult<RVec<KvPage<'a>>, UError> {
        guard("cache-kv.pages", || {
            self.pages_of(seq, layer).map(RVec::from)
        })
    }

    fn lookup_prefix(&self, tokens: RSlice<'_, u32>) -> RResult<PrefixMatch, UError> {
        guard("cache-kv.lookup_prefix", || {
            let (seq, matched) = self.store.lookup_prefix(tokens.as_slice())?;
            Ok(PrefixMatch { seq, matched })
        })
    }

    fn insert_prefix(&self, tokens: RSlice<'_, u32>, seq: SeqId) -> RResult<(), UError> {
        guard("cache-kv.insert_prefix", || {
            self.store.insert_prefix(tokens.as_slice(), seq)
        })
    }

    fn save_checkpoint(&self, name: RStr<'_>, seq: SeqId) -> RResult<(), UError> {
        guard("cache-kv.save_checkpoint", || {
            self.store.save_checkpoint(name.as_str(), seq)
        })
    }

    fn load_checkpoint(&self, name: RStr<'_>) -> RResult<SeqId, UError> {
        guard("cache-kv.load_checkpoint", || {
            self.store.load_checkpoint(name.as_str())
        })
    }

    fn checkpoints(&self) -> RResult<RVec<RString>, UError> {
        guard("cache-kv.checkpoints", || {
            Ok(self
                .store
                .checkpoints()?
                .into_iter()
                .map(RString::from)
                .collect())
        })
    }

    fn delete_checkpoint(&self, name: RStr<'_>) -> RResult<(), UError> {
        guard("cache-kv.delete_checkpoint", || {
            self.store.delete_checkpoint(name.as_str())
        })
    }

    fn set_dtype(&self, seq: SeqId, dtype: DType) -> RResult<(), UError> {
        guard("cache-kv.set_dtype", || self.store.set_dtype(seq, dtype))
    }

    fn graft(
        &self,
        dst: SeqId,
        src: SeqId,
        from: u64,
        count: u64,
        rope: &RopeParams,
    ) -> RResult<(), UError> {
        guard("cache-kv.graft", || {
            self.store.graft(dst, src, from, count, rope)
        })
    }

    fn stats(&self) -> RResult<KvStats, UError> {
        guard("cache-kv.stats", || Ok(self.store.stats()))
    }
}
