//! A weight set crossing from a worker to the host: the worker writes every tensor (aligned)
//! and then a [`Header`] into a memfd and seals it ([`share`]); the host checks the seals and
//! the header's bounds and serves views from a read-only mapping ([`SharedWeights`]).

use super::{
    messages::{Header, Placed},
    wire,
};
use abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
use nix::{
    fcntl::{FcntlArg, SealFlag, fcntl},
    sys::memfd::{MFdFlags, memfd_create},
};
use std::{
    ffi::CString,
    io::Write,
    os::fd::{AsRawFd, OwnedFd},
    sync::Arc,
};
use u_sdk::{MetaValue, TensorInfo, TensorView, UError, WeightSet, WeightSetBox};

/// Where tensors start in a shared weight set: cache-line (and SIMD) alignment.
const TENSOR_ALIGN: u64 = 64;

/// A read-only mapping of a sealed memfd.
struct Mapping {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only and its memfd is sealed against writes, so the bytes never
// change while it is shared.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes until `drop`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `SharedWeights::map` mapped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A weight set a worker shared: tensor views into the mapped memfd, metadata from its header.
#[derive(Clone)]
pub(super) struct SharedWeights {
    map: Arc<Mapping>,
    header: Arc<Header>,
}

impl SharedWeights {
    /// Maps `memfd` after checking that it is sealed against change and that its header
    /// describes tensors inside it, each once.
    pub(super) fn map(memfd: OwnedFd, header_at: u64) -> Result<SharedWeights, UError> {
        let bad = |why: String| UError::invalid(format!("weights from the worker: {why}"));
        let needed = SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW;
        let seals = fcntl(&memfd, FcntlArg::F_GET_SEALS).map_err(|e| bad(e.to_string()))?;
        if !SealFlag::from_bits_truncate(seals).contains(needed) {
            return Err(bad("the memfd is not sealed against writes".into()));
        }
        let len = std::fs::File::from(memfd.try_clone().map_err(|e| bad(e.to_string()))?)
            .metadata()
            .map_err(|e| bad(e.to_string()))?
            .len();
        if header_at >= len {
            return Err(bad(format!("header at {header_at} of {len} bytes")));
        }
        // SAFETY: maps the whole sealed memfd read-only; it cannot shrink under the mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(bad(format!("mmap: {}", std::io::Error::last_os_error())));
        }
        let map = Mapping {
            ptr: ptr as *const u8,
            len: len as usize,
        };
        let header: Header = wire::decode(&map.bytes()[header_at as usize..])
            .map_err(|e| bad(format!("header: {e}")))?;
        check_placement(&header.tensors, header_at).map_err(bad)?;
        Ok(SharedWeights {
            map: Arc::new(map),
            header: Arc::new(header),
        })
    }
}

/// Every tensor aligned, inside `[0, end)`, and named once.
fn check_placement(tensors: &[Placed], end: u64) -> Result<(), String> {
    let mut names = std::collections::BTreeSet::new();
    for t in tensors {
        let name = t.info.name.as_str();
        let inside = t
            .offset
            .checked_add(t.info.byte_len)
            .is_some_and(|e| e <= end);
        if !inside || t.offset % TENSOR_ALIGN != 0 {
            return Err(format!(
                "tensor `{name}` at {} ({} bytes) is misplaced",
                t.offset, t.info.byte_len
            ));
        }
        if !names.insert(name) {
            return Err(format!("tensor `{name}` is listed twice"));
        }
    }
    Ok(())
}

impl WeightSet for SharedWeights {
    fn format(&self) -> RResult<RString, UError> {
        RResult::ROk(self.header.format.as_str().into())
    }

    fn architecture(&self) -> RResult<ROption<RString>, UError> {
        RResult::ROk(self.header.architecture.clone().map(RString::from).into())
    }

    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        let keys = self.header.metadata.iter();
        RResult::ROk(keys.map(|(k, _)| RString::from(k.as_str())).collect())
    }

    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
        let found = self.header.metadata.iter().find(|(k, _)| k == key.as_str());
        RResult::ROk(found.map(|(_, v)| v.clone()).into())
    }

    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        RResult::ROk(self.header.tensors.iter().map(|t| t.info.clone()).collect())
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        let Some(t) = self.header.tensors.iter().find(|t| t.info.name == name) else {
            return RResult::RErr(UError::not_found(format!("no tensor `{name}`")));
        };
        let start = t.offset as usize;
        let data = &self.map.bytes()[start..start + t.info.byte_len as usize];
        RResult::ROk(TensorView {
            dtype: t.info.dtype,
            shape: t.info.shape.clone(),
            data: data.into(),
        })
    }
}

/// Writes `weights` into a sealed memfd: tensors, aligned, then the header. Returns the memfd
/// and where the header starts.
pub(super) fn share(name: &str, weights: &WeightSetBox) -> Result<(OwnedFd, u64), UError> {
    let io = |e: std::io::Error| UError::io("sharing the weights", e);
    let mut metadata = Vec::new();
    for key in weights.metadata_keys().into_result()? {
        if let Some(value) = weights.metadata(key.as_rstr()).into_result()?.into_option() {
            metadata.push((key.into_string(), value));
        }
    }
    let cname = CString::new(format!("u-weights:{name}"))
        .map_err(std::io::Error::other)
        .map_err(io)?;
    let memfd = memfd_create(
        cname.as_c_str(),
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(|e| io(e.into()))?;
    let mut file = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::from(memfd));
    let mut at = 0u64;
    let mut tensors = Vec::new();
    for info in weights.tensors().into_result()? {
        let view = weights.tensor(info.name.as_rstr()).into_result()?;
        let pad = at.next_multiple_of(TENSOR_ALIGN) - at;
        file.write_all(&[0; TENSOR_ALIGN as usize][..pad as usize])
            .map_err(io)?;
        at += pad;
        tensors.push(Placed {
            info: TensorInfo {
                name: info.name,
                dtype: view.dtype,
                shape: view.shape.clone(),
                byte_len: view.data.len() as u64,
            },
            offset: at,
        });
        file.write_all(&view.data).map_err(io)?;
        at += view.data.len() as u64;
    }
    let header = Header {
        format: weights.format().into_result()?.into_string(),
        architecture: weights
            .architecture()
            .into_result()?
            .into_option()
            .map(RString::into_string),
        metadata,
        tensors,
    };
    file.write_all(&wire::encode(&header)).map_err(io)?;
    let file = file.into_inner().map_err(|e| io(e.into_error()))?;
    crate::loading::seal(&file).map_err(io)?;
    Ok((file.into(), at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use u_sdk::DType;

    fn placed(name: &str, offset: u64, byte_len: u64) -> Placed {
        Placed {
            info: TensorInfo {
                name: name.into(),
                dtype: DType::F32,
                shape: vec![byte_len / 4].into(),
                byte_len,
            },
            offset,
        }
    }

    #[test]
    fn tensors_must_lie_aligned_inside_the_data_and_be_named_once() {
        let good = [placed("a", 0, 64), placed("b", 64, 8)];
        assert_eq!(check_placement(&good, 72), Ok(()));
        let past_end = [placed("a", 0, 64), placed("b", 64, 16)];
        assert!(check_placement(&past_end, 72).unwrap_err().contains("`b`"));
        let overflow = [placed("a", u64::MAX - 3, 8)];
        assert!(check_placement(&overflow, 72).is_err());
        let unaligned = [placed("a", 4, 8)];
        assert!(check_placement(&unaligned, 72).is_err());
        let twice = [placed("a", 0, 8), placed("a", 64, 8)];
        assert!(check_placement(&twice, 72).unwrap_err().contains("twice"));
    }
}
