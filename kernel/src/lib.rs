//! # u-runner — the U host
//!
//! A small host that knows interfaces, never model math. For a deployment manifest it:
//!
//! 1. verifies every plugin with `u-attest` **before** `dlopen` — signature, trusted publisher,
//!    ABI fingerprint, granted capabilities, ELF sanity ([`loading`]);
//! 2. maps the verified bytes from a sealed memfd, so the file cannot change between check and
//!    load;
//! 3. opens the listeners the deployment grants ([`listeners`]) and then locks the process down
//!    to the union of all grants — Landlock for files and TCP ports, seccomp for sockets, fork and
//!    exec — before any plugin object exists, so every thread a plugin starts is confined
//!    ([`sandbox`]);
//! 4. instantiates each plugin with host services bound to its own grants ([`services`]) and
//!    runs the transports ([`serve`]).
//!
//! A loader the deployment isolates (`isolation = "worker"`) runs in a worker process of its
//! own instead, forked before lock-down and confined to its own grants ([`worker`]).
//!
//! [`inspect`] reads a model file through the deployment's loaders, for `u-runner inspect`;
//! [`wiring`] opens a model, builds it with the architecture plugin that declares its family
//! and hands it to the runner plugin for its task, for `u-runner generate`, `tokenize`, `bench`
//! and the deployment's `[model]` under `u-runner serve`; [`oneline`] builds the deployment of
//! `u-runner serve --model FILE` in memory; [`single_file`] reads a diffusion pipeline from a
//! single-file checkpoint; [`progress`] draws the load progress bar.
//! Scheduling, sampling and chat templates are the runner plugins' (`runner-text`), not the
//! host's.

pub mod compute;
pub mod inspect;
pub mod listeners;
pub mod loading;
pub mod oneline;
pub mod progress;
pub mod sandbox;
pub mod serve;
pub mod services;
pub mod single_file;
pub mod wiring;
pub mod worker;

pub use loading::{
    LoadReport, LoadedPlugin, OpenReport, OpenedPlugin, Refusal, instantiate, load_deployment,
    open_deployment,
};
