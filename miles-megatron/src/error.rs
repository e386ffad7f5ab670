//! Errors of the Megatron backend: its own are settings it cannot run with; everything else is
//! the core's [`BackendError`].

use miles_core::BackendError;

/// A setting the Megatron backend cannot run with, as the core's error.
pub(crate) fn invalid(reason: String) -> BackendError {
    BackendError::Settings {
        backend: "megatron",
        reason,
    }
}
