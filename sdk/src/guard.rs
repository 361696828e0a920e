//! Keeps panics on the plugin's side of the boundary.
//!
//! A panic that unwinds through an `extern "C"` frame aborts the whole process. Every interface
//! object made with the box constructors of [`crate::boxed`] runs each method under
//! `catch_unwind`; [`guard`] does the same for code of the plugin's own (the root module's
//! entry points, helper closures), turning a panic into an [`UError`] of kind
//! [`ErrorKind::Panicked`].

use crate::abi::error::{ErrorKind, UError};
use abi_stable::std_types::RResult;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs `body`, converting both its error and any panic into an ABI-safe result.
///
/// `what` names the operation for the error message (e.g. `"loader.open"`).
pub fn guard<T>(what: &str, body: impl FnOnce() -> Result<T, UError>) -> RResult<T, UError> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result.into(),
        Err(payload) => RResult::RErr(panic_error(what, payload.as_ref())),
    }
}

/// Runs an infallible `body`; a panic yields `fallback` instead of aborting the process.
pub fn guard_infallible<T>(body: impl FnOnce() -> T, fallback: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| fallback())
}

/// The error for a caught panic of `what`, with the panic's message.
pub(crate) fn panic_error(what: &str, payload: &(dyn std::any::Any + Send)) -> UError {
    let detail = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_string());
    UError::new(
        ErrorKind::Panicked,
        format!("{what} panicked inside the plugin: {detail}"),
    )
}
