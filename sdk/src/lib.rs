//! # u-sdk — the one crate a U plugin depends on
//!
//! U is a plugin microkernel: the host (`u-runner`) verifies each plugin's signed manifest,
//! grants it only what the deployment allows, loads it through this crate's stable ABI and wires
//! the plugins together. This crate is that contract:
//!
//! - [`abi`]: the `#[repr(C)]`, [`abi_stable`]-checked surface — the root module every plugin
//!   exports, one interface per plugin kind (loader, kernels, architecture, tokenizer, cache,
//!   transport), the host services a plugin may call, tensor views, dtypes and errors. Every file
//!   in `src/abi/` is fingerprinted at build time into [`ABI_HASH`]; the host refuses a plugin
//!   built against another fingerprint *before* loading it.
//! - [`manifest`]: the plugin manifest (name, version, kind, requested capabilities) and the
//!   closed set of capabilities.
//! - [`meta`]: the fixed-size `.u.meta` ELF section that carries the manifest, the ABI
//!   fingerprint and — once signed by `u-attest` — the publisher key, code hash and signature.
//! - [`export_plugin!`]: the single macro that exports a plugin and embeds its manifest.
//! - [`boxed`]: every interface object is boxed through a `new` there, which guards each of its
//!   methods against panics.
//! - [`nn`]: tensors on a backend with the operations models are written in.
//! - [`convert`], [`quant`], [`files`], [`settings`] and [`weights`]: helpers linked statically, outside the
//!   ABI — decoding of stored values to `f32`, granted and size-limited file access, and the
//!   adapter that serves a loader's parsed model as a [`WeightSet`].
//!
//! Design choice: interfaces are `#[sabi_trait]` objects rather than raw vtables so that layout
//! mismatches are caught by `abi_stable` as a second line of defence, while the signed ABI
//! fingerprint lets the host refuse mismatches without running any of the plugin's code.
//!
#![doc = include_str!("guide.md")]
#![deny(missing_docs)]
// `#[sabi_trait]` expands to impls inside a const block, which this lint flags; the expansion is
// abi_stable's, not ours.
#![allow(non_local_definitions)]

pub mod abi;
pub mod boxed;
pub mod convert;
pub mod encoder;
pub mod files;
mod guard;
pub mod manifest;
pub mod meta;
pub mod nn;
pub mod pages;
#[cfg(feature = "json")]
pub mod preprocessor;
pub mod quant;
pub mod settings;
pub mod split;
pub mod subtitles;
pub mod weights;

pub use abi::*;
pub use guard::{guard, guard_infallible};

/// Re-exported so that plugins use exactly the `abi_stable` version the SDK was built with.
pub use abi_stable;
