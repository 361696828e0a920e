//! A test-only reference [`KvCache`]: plain per-sequence, per-layer vectors cut into small pages
//! (so the model's multi-page path is exercised), no sharing, no prefix tree, no checkpoints.
//! The real cache is `u-cache-kv`; this exists so the architecture's tests do not depend on it.

use abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut, RStr, RVec};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};
use u_sdk::{
    BackendBox, DType, KvCache, KvCacheBox, KvLayout, KvPage, KvStats, PrefixMatch, SeqId, Shape,
    TensorDesc, UError,
};

/// A transform of appended KV data (`data`, row length), e.g. an int8 round trip.
pub type Transform = fn(&[f32], usize) -> Vec<f32>;

/// One layer's keys and values (tokens × row each).
type LayerKv = (Vec<f32>, Vec<f32>);

#[derive(Default)]
struct State {
    layout: Option<KvLayout>,
    backend: Option<BackendBox>,
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
}

impl ReferenceCache {
    /// A boxed cache with `page_tokens` tokens per page.
    pub fn new_box(page_tokens: usize) -> KvCacheBox {
        Self::with_transform(page_tokens, None)
    }

    /// A boxed cache that stores `transform(keys/values, row)` instead of what is appended.
    pub fn with_transform(page_tokens: usize, transform: Option<Transform>) -> KvCacheBox {
        KvCacheBox::new(ReferenceCache {
            state: Arc::default(),
            page_tokens,
            transform,
        })
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

/// A tensor's f32 values, read back from its buffer.
fn read(t: &TensorDesc) -> Result<Vec<f32>, UError> {
    let mut bytes = vec![0u8; t.shape.elements() as usize * 4];
    t.buffer
        .read(t.offset, RSliceMut::from_mut_slice(&mut bytes))
        .into_result()?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// `keys` then `values` of `tokens` rows in one new buffer of `backend`, as a page.
fn page(
    backend: &BackendBox,
    tokens: usize,
    row: usize,
    keys: &[f32],
    values: &[f32],
) -> Result<KvPage, UError> {
    let bytes: Vec<u8> = keys
        .iter()
        .chain(values)
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let buffer = backend.alloc(bytes.len().max(1) as u64).into_result()?;
    buffer.write(0, RSlice::from_slice(&bytes)).into_result()?;
    let tensor = |offset: usize| TensorDesc {
        buffer: buffer.clone(),
        offset: offset as u64,
        dtype: DType::F32,
        shape: Shape::new(&[tokens as u64, row as u64]),
    };
    Ok(KvPage {
        tokens: tokens as u32,
        dtype: DType::F32,
        keys: tensor(0),
        values: tensor(keys.len() * 4),
        key_scales: ROption::RNone,
        value_scales: ROption::RNone,
    })
}

impl KvCache for ReferenceCache {
    fn configure(&self, layout: KvLayout, backend: BackendBox) -> RResult<(), UError> {
        let mut s = self.state.lock().unwrap();
        s.layout = Some(layout);
        s.backend = Some(backend);
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
        keys: &TensorDesc,
        values: &TensorDesc,
    ) -> RResult<(), UError> {
        let row = self.row();
        let (keys, values) = match (read(keys), read(values)) {
            (Ok(k), Ok(v)) => (k, v),
            (Err(e), _) | (_, Err(e)) => return RResult::RErr(e),
        };
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

    fn pages(&self, seq: SeqId, layer: u32) -> RResult<RVec<KvPage>, UError> {
        let row = self.row();
        let (k, v, backend) = {
            let s = self.state.lock().unwrap();
            let Some(layers) = s.seqs.get(&seq) else {
                return RResult::RErr(missing(seq));
            };
            let (k, v) = &layers[layer as usize];
            (k.clone(), v.clone(), s.backend.clone().expect("configured"))
        };
        let per = self.page_tokens * row;
        k.chunks(per)
            .zip(v.chunks(per))
            .map(|(k, v)| page(&backend, k.len() / row, row, k, v))
            .collect::<Result<RVec<_>, UError>>()
            .into()
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

    fn checkpoints(&self) -> RResult<RVec<u_sdk::CheckpointInfo>, UError> {
        RResult::ROk(RVec::new())
    }

    fn delete_checkpoint(&self, _name: RStr<'_>) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported("reference cache: no checkpoints"))
    }

    fn set_dtype(&self, _seq: SeqId, _dtype: DType) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported("reference cache: f32 only"))
    }

    fn stats(&self) -> RResult<KvStats, UError> {
        RResult::RErr(UError::unsupported("reference cache: no statistics"))
    }

    fn flush_prefixes(&self) -> RResult<u64, UError> {
        RResult::RErr(UError::unsupported("reference cache: no prefixes"))
    }
}
