//! A loader's parsed model as the ABI's [`WeightSet`], and the loader itself as its [`Loader`].
//!
//! A loader implements [`WeightSource`] (and [`OpenWeights`]) in plain Rust; [`SharedWeights`]
//! and [`FileLoader`] add what every loader would otherwise repeat: the panic guard on each
//! call, the conversions to ABI types, and opening files through the host's grants. Linked
//! statically, outside the ABI fingerprint.

use crate::{
    abi::{
        error::UError,
        host::HostBox,
        loader::{Loader, Loader_TO, LoaderBox, WeightSet, WeightSet_TO, WeightSetBox},
        tensor::{MetaValue, TensorInfo, TensorView},
    },
    files::{FileOpener, HostFiles},
    guard::{guard, guard_infallible},
};
use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{ROption, RResult, RSlice, RStr, RString, RVec},
};
use std::{marker::PhantomData, path::Path, sync::Arc};

/// What a loaded model offers, in plain Rust; [`SharedWeights`] serves it over the ABI.
pub trait WeightSource: Send + Sync + 'static {
    /// The file format, e.g. `"gguf"` (also names the loader in error messages).
    const FORMAT: &'static str;
    /// The architecture family as the file names it, if known.
    fn architecture(&self) -> Option<&str>;
    /// All metadata keys, in file order.
    fn metadata_keys(&self) -> Vec<&str>;
    /// One metadata value.
    fn metadata(&self, key: &str) -> Option<MetaValue>;
    /// Every tensor's name, dtype and shape.
    fn tensors(&self) -> Vec<TensorInfo>;
    /// A zero-copy view of one tensor's bytes.
    fn tensor(&self, name: &str) -> crate::Result<TensorView<'_>>;
}

/// A shared [`WeightSource`] as a [`WeightSet`]; cloning shares the source.
pub struct SharedWeights<S>(pub Arc<S>);

impl<S> Clone for SharedWeights<S> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<S> std::ops::Deref for SharedWeights<S> {
    type Target = S;

    fn deref(&self) -> &S {
        &self.0
    }
}

impl<S: WeightSource> SharedWeights<S> {
    /// Shares `source`.
    pub fn new(source: S) -> Self {
        Self(Arc::new(source))
    }

    /// This weight set as an ABI object.
    pub fn into_box(self) -> WeightSetBox {
        WeightSet_TO::from_value(self, TD_Opaque)
    }
}

impl<S: WeightSource> WeightSet for SharedWeights<S> {
    fn format(&self) -> RString {
        S::FORMAT.into()
    }

    fn architecture(&self) -> ROption<RString> {
        guard_infallible(
            || self.0.architecture().map(RString::from).into(),
            || ROption::RNone,
        )
    }

    fn metadata_keys(&self) -> RVec<RString> {
        guard_infallible(
            || {
                self.0
                    .metadata_keys()
                    .into_iter()
                    .map(RString::from)
                    .collect()
            },
            RVec::new,
        )
    }

    fn metadata(&self, key: RStr<'_>) -> ROption<MetaValue> {
        guard_infallible(|| self.0.metadata(key.as_str()).into(), || ROption::RNone)
    }

    fn tensors(&self) -> RVec<TensorInfo> {
        guard_infallible(|| self.0.tensors().into(), RVec::new)
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        guard(&format!("loader-{}.tensor", S::FORMAT), || {
            self.0.tensor(name.as_str())
        })
    }
}

/// A [`WeightSource`] a loader opens from files.
pub trait OpenWeights: WeightSource + Sized {
    /// Whether the file at `path`, whose first bytes (at most 4 KiB) are `head`, is one this
    /// loader reads.
    fn sniff(path: &str, head: &[u8]) -> bool;
    /// Opens the model at `path`, reading every file through `files`.
    fn open(files: &dyn FileOpener, path: &Path) -> crate::Result<Self>;
}

/// The `loader` entry object of a loader whose models are `S`: files are opened through the
/// host (so the deployment's `fs.read` grant applies), models served as [`SharedWeights`].
pub struct FileLoader<S> {
    host: HostBox,
    source: PhantomData<fn() -> S>,
}

impl<S> Clone for FileLoader<S> {
    fn clone(&self) -> Self {
        Self {
            host: self.host.clone(),
            source: PhantomData,
        }
    }
}

impl<S: OpenWeights> FileLoader<S> {
    /// A loader that opens files through `host`.
    pub fn new(host: HostBox) -> Self {
        Self {
            host,
            source: PhantomData,
        }
    }

    /// This loader as an ABI object.
    pub fn into_box(self) -> LoaderBox {
        Loader_TO::from_value(self, TD_Opaque)
    }
}

impl<S: OpenWeights> Loader for FileLoader<S> {
    fn formats(&self) -> RVec<RString> {
        RVec::from(vec![RString::from(S::FORMAT)])
    }

    fn can_open(&self, path: RStr<'_>, head: RSlice<'_, u8>) -> bool {
        guard_infallible(|| S::sniff(path.as_str(), head.as_slice()), || false)
    }

    fn open(&self, path: RStr<'_>) -> RResult<WeightSetBox, UError> {
        guard(&format!("loader-{}.open", S::FORMAT), || {
            let source = S::open(&HostFiles(&self.host), Path::new(path.as_str()))?;
            Ok(SharedWeights::new(source).into_box())
        })
    }
}
