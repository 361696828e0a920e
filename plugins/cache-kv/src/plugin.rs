//! The ABI side: [`u_sdk::KvCache`] over a [`Store`], with page leases for sound borrowing.

use crate::{
    disk::Disk,
    page::{Alloc, Kind, Page},
    store::{Config, Store},
};
use abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut, RStr, RVec};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};
use u_sdk::{
    BackendBox, CheckpointInfo, DType, HostBox, KvCache, KvCacheBox, KvLayout, KvPage, KvStats,
    PrefixMatch, SeqId, Shape, TensorDesc, UError,
};

/// A handle to a cache. Clones share the cache; each handle keeps the pages it handed out
/// through [`KvCache::pages`] (its *leases*) until it is dropped, which is what keeps the
/// returned tensors unchanged for the handle's lifetime: since the lease counts as a reference,
/// nobody rewinds a leased page (writers copy it instead). The tensors' buffers keep the memory
/// itself alive.
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
        KvCacheBox::new(self)
    }

    /// `layer`'s pages of `seq` as tensors in their buffers, leased to this handle.
    pub fn pages_of(&self, seq: SeqId, layer: u32) -> u_sdk::Result<Vec<KvPage>> {
        let g = self.store.geometry()?;
        let (row, groups) = (g.shape.row as u64, g.shape.groups as u64);
        let pages = self.store.pages(seq, layer)?;
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::with_capacity(pages.len());
        for (page, n) in pages {
            let (buffer, [k, v, ks, vs]) = page.buffer();
            let tensor = |offset: usize, dtype: DType, width: u64| TensorDesc {
                buffer: buffer.clone(),
                offset: offset as u64,
                dtype,
                shape: Shape::new(&[n as u64, width]),
            };
            out.push(match page.kind() {
                Kind::F32 => KvPage {
                    tokens: n as u32,
                    dtype: DType::F32,
                    keys: tensor(k, DType::F32, row),
                    values: tensor(v, DType::F32, row),
                    key_scales: ROption::RNone,
                    value_scales: ROption::RNone,
                },
                Kind::I8 => KvPage {
                    tokens: n as u32,
                    dtype: DType::I8,
                    keys: tensor(k, DType::I8, row),
                    values: tensor(v, DType::I8, row),
                    key_scales: ROption::RSome(tensor(ks, DType::F32, groups)),
                    value_scales: ROption::RSome(tensor(vs, DType::F32, groups)),
                },
            });
            // The lease keeps the page (not only its memory) referenced, so no writer rewinds
            // and overwrites the slots just handed out while this handle lives.
            leases.entry(Arc::as_ptr(&page) as usize).or_insert(page);
        }
        Ok(out)
    }
}

/// `t`'s f32 values: borrowed from host memory, or read back from a device buffer.
fn host_rows(t: &TensorDesc) -> u_sdk::Result<std::borrow::Cow<'_, [f32]>> {
    if t.dtype != DType::F32 {
        return Err(UError::invalid(format!(
            "cache-kv: appended KV must be F32, not {:?}",
            t.dtype
        )));
    }
    let n = t.shape.elements() as usize;
    let end = t.offset as usize + 4 * n;
    if end as u64 > t.buffer.byte_len() {
        return Err(UError::invalid(format!(
            "cache-kv: appended {t:?} runs past its buffer"
        )));
    }
    let base = t.buffer.host_address();
    if base != 0 && (base + t.offset as usize).is_multiple_of(4) {
        // SAFETY: in bounds (checked), aligned, host memory the op that produced it finished
        // writing; plain f32s, only read while this call runs.
        let rows =
            unsafe { std::slice::from_raw_parts((base + t.offset as usize) as *const f32, n) };
        return Ok(std::borrow::Cow::Borrowed(rows));
    }
    let mut rows = vec![0f32; n];
    // SAFETY: f32 is plain bytes; same memory, same length in bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(rows.as_mut_ptr() as *mut u8, 4 * n) };
    t.buffer
        .read(t.offset, RSliceMut::from_mut_slice(bytes))
        .into_result()?;
    Ok(std::borrow::Cow::Owned(rows))
}

impl KvCache for KvCachePlugin {
    /// Pages come from the model's backend when its buffers are host memory (attention reads
    /// them in place); a device backend's are not, so the pages are this plugin's heap and the
    /// backend copies what an op reads.
    fn configure(&self, layout: KvLayout, backend: BackendBox) -> RResult<(), UError> {
        let configure = || {
            let alloc = match backend.buffer_type().into_result()?.host {
                true => Alloc::Backend(backend),
                false => Alloc::Heap,
            };
            self.store.configure(layout, alloc)
        };
        configure().into()
    }

    fn create(&self) -> RResult<SeqId, UError> {
        self.store.create().into()
    }

    fn fork(&self, seq: SeqId) -> RResult<SeqId, UError> {
        self.store.fork(seq).into()
    }

    fn release(&self, seq: SeqId) -> RResult<(), UError> {
        self.store.release(seq).into()
    }

    fn len(&self, seq: SeqId) -> RResult<u64, UError> {
        self.store.len(seq).into()
    }

    fn truncate(&self, seq: SeqId, len: u64) -> RResult<(), UError> {
        self.store.truncate(seq, len).into()
    }

    fn append(
        &self,
        seq: SeqId,
        layer: u32,
        keys: &TensorDesc,
        values: &TensorDesc,
    ) -> RResult<(), UError> {
        (|| {
            let (k, v) = (host_rows(keys)?, host_rows(values)?);
            self.store.append(seq, layer, &k, &v)
        })()
        .into()
    }

    fn pages(&self, seq: SeqId, layer: u32) -> RResult<RVec<KvPage>, UError> {
        self.pages_of(seq, layer).map(RVec::from).into()
    }

    fn lookup_prefix(&self, tokens: RSlice<'_, u32>) -> RResult<PrefixMatch, UError> {
        self.store
            .lookup_prefix(tokens.as_slice())
            .map(|(seq, matched)| PrefixMatch { seq, matched })
            .into()
    }

    fn insert_prefix(&self, tokens: RSlice<'_, u32>, seq: SeqId) -> RResult<(), UError> {
        self.store.insert_prefix(tokens.as_slice(), seq).into()
    }

    fn save_checkpoint(&self, name: RStr<'_>, seq: SeqId) -> RResult<(), UError> {
        self.store.save_checkpoint(name.as_str(), seq).into()
    }

    fn load_checkpoint(&self, name: RStr<'_>) -> RResult<SeqId, UError> {
        self.store.load_checkpoint(name.as_str()).into()
    }

    fn checkpoints(&self) -> RResult<RVec<CheckpointInfo>, UError> {
        self.store
            .checkpoints()
            .map(|c| {
                c.into_iter()
                    .map(|(name, tokens)| CheckpointInfo {
                        name: name.into(),
                        tokens,
                    })
                    .collect()
            })
            .into()
    }

    fn delete_checkpoint(&self, name: RStr<'_>) -> RResult<(), UError> {
        self.store.delete_checkpoint(name.as_str()).into()
    }

    fn set_dtype(&self, seq: SeqId, dtype: DType) -> RResult<(), UError> {
        self.store.set_dtype(seq, dtype).into()
    }

    fn stats(&self) -> RResult<KvStats, UError> {
        RResult::ROk(self.store.stats())
    }

    fn flush_prefixes(&self) -> RResult<u64, UError> {
        RResult::ROk(self.store.flush_prefixes())
    }
}
