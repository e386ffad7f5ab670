//! Tensor-parallel sharding of the parameter table: `miles_core::model`'s, with this backend's
//! settings error.

use miles_core::BackendError;
use miles_core::model::LlamaConfig;
pub(crate) use miles_core::model::{Split, gather_tensor, scatter, split_of};

use crate::error::invalid;

/// The config of one tensor-parallel rank's shard of `config` (see
/// [`miles_core::model::shard_config`]).
///
/// # Errors
/// [`BackendError::Settings`] when `tp` is zero or does not divide the query heads, the
/// key/value heads or the MLP width.
pub fn shard_config(config: &LlamaConfig, tp: usize) -> Result<LlamaConfig, BackendError> {
    miles_core::model::shard_config(config, tp).map_err(|error| match error {
        miles_core::model::ModelError::Config(reason) => invalid(reason),
        other => invalid(other.to_string()),
    })
}
