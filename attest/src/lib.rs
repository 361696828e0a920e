//! # u-attest — signing, verification and the capability proof
//!
//! Every U component carries a `.u.meta` ELF section (see [`u_sdk::meta`]) holding its manifest
//! and ABI identity. This crate:
//!
//! - [`keys`]: makes and reads ed25519 publisher keys;
//! - [`signing`]: signs a component in place and verifies a signature against trusted keys;
//! - [`elf`]: finds the section and checks the file's ELF sanity (no writable+executable segment,
//!   no text relocations);
//! - [`surface`]: observes what a component can do — imported symbols such as `socket`,
//!   `connect`, `fork`, `execve`, `open`, and raw `syscall` instructions in its code — and compares
//!   that with what its manifest declares ([`syscalls`] finds the raw system calls, small
//!   enough for the host);
//! - [`admission`]: whether a deployment entry may be loaded, the host's checks in one place;
//! - [`deployment`]: the deployment manifest (trusted keys, plugins, grants) that the host loads;
//! - [`runner_form`]: the deployment the Safebox runner form `u-runner <model> <socket>` serves.
//!
//! The host (`u-runner`) uses this library to verify every plugin before it is loaded; operators
//! use the `u-attest` CLI to check a deployment offline.

pub mod admission;
pub mod deployment;
pub mod elf;
pub mod keys;
pub mod report;
pub mod runner_form;
pub mod signing;
pub mod surface;
pub mod syscalls;

pub use deployment::{Deployment, DeploymentError, Grants, PluginEntry};
pub use keys::{PublicKey, SecretKey};
pub use signing::{Verified, VerifyError, sign_bytes, verify_bytes};
pub use surface::{Surface, SurfaceReport, inspect_bytes};
