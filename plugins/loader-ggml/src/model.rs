//! The byte layout of a whisper.cpp GGML model file and the model it holds.
//!
//! One little-endian stream with no padding:
//!
//! | field | bytes |
//! | --- | --- |
//! | magic `0x67676d6c` (`"lmgg"`) | `u32` |
//! | hyper-parameters: [`HPARAMS`] in order | `i32` each |
//! | mel filters: `n_mel`, `n_fft`, then `n_mel × n_fft` values | `i32`, `i32`, `f32`… |
//! | vocabulary: `n_vocab`, then per token its length and bytes | `i32`, (`u32`, bytes)… |
//! | tensors, to the end: rank, name length, ggml type, the dimensions innermost first, the name, the data | `i32` ×3, `i32` × rank, bytes, bytes |
//!
//! ggml types 0 (F32), 1 (F16), 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1) and 8 (Q8_0) are read;
//! their data is `elements / block × block bytes`, the innermost dimension a whole number of
//! blocks.

use crate::error::{Error, Result};
use std::{collections::HashMap, ops::Range, sync::Arc};
use u_sdk::{DType, MetaValue, TensorInfo, TensorView};

/// The file's first four bytes.
pub const MAGIC: u32 = 0x6767_6d6c;

/// The hyper-parameters after the magic, in file order (`whisper.<name>` metadata).
pub const HPARAMS: [&str; 11] = [
    "n_vocab",
    "n_audio_ctx",
    "n_audio_state",
    "n_audio_head",
    "n_audio_layer",
    "n_text_ctx",
    "n_text_state",
    "n_text_head",
    "n_text_layer",
    "n_mels",
    "ftype",
];

/// The most dimensions a tensor has (ggml's limit).
const MAX_DIMS: usize = 4;
/// The longest tensor name read.
const MAX_NAME: usize = 1024;
/// The most tokens a vocabulary holds.
const MAX_VOCAB: usize = 1 << 22;
/// The alignment, in bytes, of every tensor's data as the loader hands it out.
pub const ALIGN: usize = 16;

/// Bytes a model's tensors point into: a memory map, or a buffer for in-memory use.
pub type Backing = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// The dtype of ggml type `id`.
fn dtype_of(id: i32) -> Option<DType> {
    Some(match id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        _ => return None,
    })
}

/// One tensor as the file holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// The name as stored (openai-whisper's: `encoder.blocks.0.attn.query.weight`).
    pub name: String,
    /// Element type as stored.
    pub dtype: DType,
    /// Dimensions, outermost first (the file's reversed).
    pub shape: Vec<u64>,
    /// Where its bytes are: in the file when aligned, else in the aligned copy.
    bytes: Range<usize>,
    mapped: bool,
}

impl Tensor {
    /// The tensor's description for the ABI.
    pub fn info(&self) -> TensorInfo {
        TensorInfo {
            name: self.name.as_str().into(),
            dtype: self.dtype,
            shape: self.shape.clone().into(),
            byte_len: self.bytes.len() as u64,
        }
    }

    /// Whether its bytes are a view of the file (`false`: of the aligned copy).
    pub fn is_mapped(&self) -> bool {
        self.mapped
    }
}

/// A little-endian reader over the file that fails, naming the field, past its end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| Error::Truncated {
                what: what.to_string(),
                offset: self.at as u64,
            })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn i32(&mut self, what: &str) -> Result<i32> {
        let b = self.take(4, what)?;
        Ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A count or size: a non-negative `i32` at most `max`.
    fn count(&mut self, what: &str, max: usize) -> Result<usize> {
        let at = self.at as u64;
        let v = self.i32(what)?;
        usize::try_from(v)
            .ok()
            .filter(|&n| n <= max)
            .ok_or_else(|| Error::Format {
                offset: at,
                reason: format!("{what} is {v} (0 to {max} are read)"),
            })
    }

    fn done(&self) -> bool {
        self.at == self.bytes.len()
    }
}

/// A loaded whisper.cpp model.
pub struct GgmlModel {
    file: Backing,
    copy: Vec<u8>,
    copy_start: usize,
    tensors: Vec<Tensor>,
    by_name: HashMap<String, usize>,
    metadata: Vec<(String, MetaValue)>,
}

impl std::fmt::Debug for GgmlModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgmlModel")
            .field("tensors", &self.tensors.len())
            .field("copied_bytes", &(self.copy.len() - self.copy_start))
            .finish()
    }
}

impl GgmlModel {
    /// Parses the file held in `file` (a memory map, or bytes for tests and fuzzing).
    pub fn parse(file: Backing) -> Result<Self> {
        let bytes: &[u8] = (*file).as_ref();
        let mut r = Reader { bytes, at: 0 };
        let magic = r.i32("the magic")? as u32;
        if magic != MAGIC {
            return Err(Error::Format {
                offset: 0,
                reason: format!(
                    "not a whisper.cpp GGML file (magic {magic:#010x}, expected {MAGIC:#010x})"
                ),
            });
        }
        let mut metadata = Vec::new();
        for name in HPARAMS {
            let v = r.count(&format!("hyper-parameter {name}"), i32::MAX as usize)?;
            metadata.push((format!("whisper.{name}"), MetaValue::Int(v as i64)));
        }
        let n_mel = r.count("the mel filters' count", 1024)?;
        let n_fft = r.count("the mel filters' width", 1 << 16)?;
        let filters = r.take(n_mel * n_fft * 4, "the mel filters")?;
        metadata.push((
            "whisper.mel_filters".into(),
            MetaValue::FloatArray(
                filters
                    .chunks_exact(4)
                    .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                    .collect(),
            ),
        ));
        metadata.push((
            "whisper.mel_filters_shape".into(),
            MetaValue::IntArray(vec![n_mel as i64, n_fft as i64].into()),
        ));
        let n_vocab = r.count("the vocabulary's size", MAX_VOCAB)?;
        let mut tokens = Vec::with_capacity(n_vocab.min(1 << 16));
        for i in 0..n_vocab {
            let len = r.count(&format!("token {i}'s length"), 1 << 16)?;
            let token = r.take(len, &format!("token {i}"))?;
            tokens.push(String::from_utf8_lossy(token).into_owned());
        }
        metadata.push((
            "whisper.vocab".into(),
            MetaValue::StrArray(tokens.into_iter().map(Into::into).collect()),
        ));

        let mut tensors = Vec::new();
        let mut by_name = HashMap::new();
        let mut unaligned = Vec::new();
        while !r.done() {
            let start = r.at as u64;
            let rank = r.count("a tensor's rank", MAX_DIMS)?;
            let name_len = r.count("a tensor's name length", MAX_NAME)?;
            let type_id = r.i32("a tensor's type")?;
            let mut dims = Vec::with_capacity(rank);
            for _ in 0..rank {
                dims.push(r.count("a tensor dimension", i32::MAX as usize)? as u64);
            }
            let name =
                String::from_utf8(r.take(name_len, "a tensor's name")?.to_vec()).map_err(|_| {
                    Error::Format {
                        offset: start,
                        reason: "a tensor name that is not UTF-8".into(),
                    }
                })?;
            let bad = |reason: String| Error::Tensor {
                name: name.clone(),
                reason,
            };
            let dtype =
                dtype_of(type_id).ok_or_else(|| bad(format!("ggml type {type_id} is not read")))?;
            if rank == 0 || dims.contains(&0) {
                return Err(bad(format!("dimensions {dims:?}")));
            }
            let elements = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
            let block = dtype.block_size() as u64;
            if dims[0] % block != 0 {
                return Err(bad(format!(
                    "the innermost dimension {} is not a whole number of {dtype} blocks of {block}",
                    dims[0]
                )));
            }
            let len = dtype
                .bytes_for(elements)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
            let at = r.at;
            r.take(len, &format!("tensor {name}'s data"))?;
            if by_name.contains_key(&name) {
                return Err(bad("a second tensor of this name".into()));
            }
            let mapped = (bytes.as_ptr().addr() + at).is_multiple_of(ALIGN);
            if !mapped {
                unaligned.push(tensors.len());
            }
            by_name.insert(name.clone(), tensors.len());
            dims.reverse();
            tensors.push(Tensor {
                name,
                dtype,
                shape: dims,
                bytes: at..at + len,
                mapped,
            });
        }
        // Tensors the file leaves unaligned are copied once into one aligned buffer.
        let need: usize = unaligned
            .iter()
            .map(|&i| tensors[i].bytes.len().next_multiple_of(ALIGN))
            .sum();
        let mut copy = vec![0u8; need + ALIGN - 1];
        let copy_start = (ALIGN - copy.as_ptr().addr() % ALIGN) % ALIGN;
        let mut at = copy_start;
        for &i in &unaligned {
            let t = &mut tensors[i];
            let len = t.bytes.len();
            copy[at..at + len].copy_from_slice(&bytes[t.bytes.clone()]);
            t.bytes = at..at + len;
            at += len.next_multiple_of(ALIGN);
        }
        Ok(GgmlModel {
            file,
            copy,
            copy_start,
            tensors,
            by_name,
            metadata,
        })
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A view of a tensor's bytes (aligned to [`ALIGN`]).
    pub fn view(&self, name: &str) -> Result<TensorView<'_>> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::NoTensor(name.to_string()))?;
        let bytes = match t.mapped {
            true => &(*self.file).as_ref()[t.bytes.clone()],
            false => &self.copy[t.bytes.clone()],
        };
        Ok(TensorView {
            dtype: t.dtype,
            shape: t.shape.clone().into(),
            data: bytes.into(),
        })
    }

    /// Metadata: the hyper-parameters (`whisper.n_vocab` …), the mel filters
    /// (`whisper.mel_filters`, `[n_mel, n_fft]` as `whisper.mel_filters_shape`) and the
    /// vocabulary's tokens (`whisper.vocab`, bytes as UTF-8 with invalid sequences replaced).
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }
}
