//! A loader's parsed model as the ABI's [`WeightSet`].
//!
//! A loader implements [`WeightSource`] in plain Rust and hands out [`SharedWeights`]; the
//! adapter adds what every loader would otherwise repeat: the panic guard on each call and the
//! conversions to ABI types. Linked statically, outside the ABI fingerprint.

use crate::{
    abi::{
        error::UError,
        loader::{WeightSet, WeightSet_TO, WeightSetBox},
        tensor::{MetaValue, TensorInfo, TensorView},
    },
    guard::{guard, guard_infallible},
};
use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{ROption, RResult, RStr, RString, RVec},
};
use std::sync::Arc;

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
