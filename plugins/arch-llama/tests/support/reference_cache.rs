//! A test-only reference [`KvCache`]: plain per-sequence, per-layer vectors cut into small pages
//! (so the model's multi-page path is exercised), no sharing, no prefix tree, no checkpoints.
//! The real cache is `u-cache-kv`; this exists so the architecture's tests do not depend on it.

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RSlice, RStr, RString, RVec},
};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};
use u_sdk::{KvCache, KvCache_TO, KvCacheBox, KvLayout, KvPage, PrefixMatch, SeqId, UError};

/// A transform of appended KV data (`data`, row length), e.g. an int8 round trip.
pub type Transform = fn(&[f32], usize) -> Vec<f32>;

/// One layer's keys and values (tokens × row each).
type LayerKv = (Vec<f32>, Vec<f32>);

#[derive(Default)]
struct State {
    layout: Option<KvLayout>,
    next: SeqId,
    /// Per sequence, per layer: keys and values (tokens × row).
    seqs: HashMap<SeqId, Vec<LayerKv>>,
}

/// The reference cache; `page_tokens` tokens per page.
#[derive(Clone)]
pub struct ReferenceCache {
    state: Arc<Mutex<State>>,
    page_tokens: usize,
    /// Applied to appended keys and values (`data`, row length), e.g. an int8 round trip.
    transform: Option<Transform>,
    /// Snapshot storage keeping lent pages alive for the cache's lifetime.
    lent: Arc<Mutex<Vec<Arc<Vec<f32>>>>>,
}

impl ReferenceCache {
    /// A boxed cache with `page_tokens` tokens per page.
    pub fn new_box(page_tokens: usize) -> KvCacheBox {
        Self::with_transform(page_tokens, None)
    }

    /// A boxed cache that stores `transform(keys/values, row)` instead of what is appended.
    pub fn with_transform(page_tokens: usize, transform: Option<Transform>) -> KvCacheBox {
        KvCache_TO::from_value(
            ReferenceCache {
                state: Arc::default(),
                page_tokens,
                transform,
                lent: Arc::default(),
            },
            TD_Opaque,
        )
    }

    fn row(&self) -> usize {
        let s = self.state.lock().unwrap();
        let l = s.layout.as_ref().expect("configured");
        (l.kv_heads * l.head_dim) as usize
    }
}

fn missing(seq: SeqId) -> UError {
    UError::not_found(format!("no sequence {seq}"))
}

impl KvCache for ReferenceCache {
    fn configure(&self, layout: KvLayout) -> RResult<(), UError> {
        self.state.lock().unwrap().layout = Some(layout);
        RResult::ROk(())
    }

    fn create(&self) -> RResult<SeqId, UError> {
        let mut s = self.state.lock().unwrap();
        let layers = s.layout.as_ref().map_or(0, |l| l.layers as usize);
        s.next += 1;
        let id = s.next;
        s.seqs.insert(id, vec![(Vec::new(), Vec::new()); layers]);
        RResult::ROk(id)
    }

    fn fork(&self, seq: SeqId) -> RResult<SeqId, UError> {
        let mut s = self.state.lock().unwrap();
        let Some(data) = s.seqs.get(&seq).cloned() else {
            return RResult::RErr(missing(seq));
        };
        s.next += 1;
        let id = s.next;
        s.seqs.insert(id, data);
        RResult::ROk(id)
    }

    fn release(&self, seq: SeqId) -> RResult<(), UError> {
        self.state.lock().unwrap().seqs.remove(&seq);
        RResult::ROk(())
    }

    fn len(&self, seq: SeqId) -> RResult<u64, UError> {
        let row = self.row();
        let s = self.state.lock().unwrap();
        match s.seqs.get(&seq) {
            Some(layers) => RResult::ROk((layers[0].0.len() / row) as u64),
            None => RResult::RErr(missing(seq)),
        }
    }

    fn truncate(&self, seq: SeqId, len: u64) -> RResult<(), UError> {
        let row = self.row();
        let mut s = self.state.lock().unwrap();
        match s.seqs.get_mut(&seq) {
            Some(layers) => {
                for (k, v) in layers {
                    k.truncate(len as usize * row);
                    v.truncate(len as usize * row);
                }
                RResult::ROk(())
            }
            None => RResult::RErr(missing(seq)),
        }
    }

    fn append(
        &self,
        seq: SeqId,
        layer: u32,
        keys: RSlice<'_, f32>,
        values: RSlice<'_, f32>,
    ) -> RResult<(), UError> {
        let row = self.row();
        let mut s = self.state.lock().unwrap();
        let Some(layers) = s.seqs.get_mut(&seq) else {
            return RResult::RErr(missing(seq));
        };
        if keys.len() != values.len() || !keys.len().is_multiple_of(row) {
            return RResult::RErr(UError::invalid("append: bad lengths"));
        }
        let (k, v) = &mut layers[layer as usize];
        match self.transform {
            Some(f) => {
                k.extend(f(&keys, row));
                v.extend(f(&values, row));
            }
            None => {
                k.extend_from_slice(&keys);
                v.extend_from_slice(&values);
            }
        }
        RResult::ROk(())
    }

    fn pages<'a>(&'a self, seq: SeqId, layer: u32) -> RResult<RVec<KvPage<'a>>, UError> {
        let row = self.row();
        let (k, v) = {
            let s = self.state.lock().unwrap();
            let Some(layers) = s.seqs.get(&seq) else {
                return RResult::RErr(missing(seq));
            };
            let (k, v) = &layers[layer as usize];
            (Arc::new(k.clone()), Arc::new(v.clone()))
        };
        // Keep the snapshot alive as long as the cache (test-only: memory grows).
        let mut lent = self.lent.lock().unwrap();
        lent.push(k.clone());
        lent.push(v.clone());
        drop(lent);
        // SAFETY: the Arcs are kept in `self.lent` until the cache is dropped, and their
        // contents are never mutated.
        let (k, v): (&'a [f32], &'a [f32]) = unsafe {
            (
                std::slice::from_raw_parts(k.as_ptr(), k.len()),
                std::slice::from_raw_parts(v.as_ptr(), v.len()),
            )
        };
        let per = self.page_tokens * row;
        let pages = k
            .chunks(per)
            .zip(v.chunks(per))
            .map(|(k, v)| KvPage::f32((k.len() / row) as u32, k, v))
            .collect();
        RResult::ROk(pages)
    }

    fn lookup_prefix(&self, _tokens: RSlice<'_, u32>) -> RResult<PrefixMatch, UError> {
        RResult::RErr(UError::unsupported("reference cache: no prefix tree"))
    }

    fn insert_prefix(&self, _tokens: RSlice<'_, u32>, _seq: SeqId) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported("reference cache: no prefix tree"))
    }

    fn save_checkpoint(&self, _name: RStr<'_>, _seq: SeqId) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported("reference cache: no checkpoints"))
    }

    fn load_checkpoint(&self, _name: RStr<'_>) -> RResult<SeqId, UError> {
        RResult::RErr(UError::unsupported("reference cache: no checkpoints"))
    }

    fn checkpoints(&self) -> RResult<RVec<RString>, UError> {
        RResult::ROk(RVec::new())
    }

    fn delete_checkpoint(&self, _name: RStr<'_>) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported("reference cache: no checkpoints"))
    }
}
