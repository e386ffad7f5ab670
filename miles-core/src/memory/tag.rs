//! Tags, region states and offload reports.

use std::borrow::Cow;
use std::fmt;

use crate::choice::BackupPolicy;

/// What a region holds; each tag owns its own address arena.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum MemoryTag {
    /// Rollout model weights.
    Weights,
    /// The rollout engine's paged KV cache.
    KvCache,
    /// Captured CUDA graphs of the rollout engine.
    CudaGraph,
    /// Training parameters.
    Params,
    /// Training gradients.
    Grads,
    /// Optimizer state (master weights, moments).
    Optimizer,
    /// Activations kept for the backward pass.
    Activations,
    /// Any other region; the name must be lowercase letters, digits, `_` or `-`.
    Named(String),
}

impl MemoryTag {
    /// The tag's name, as used in logs and directory names (`kv_cache`, ...).
    pub fn name(&self) -> &str {
        match self {
            MemoryTag::Weights => "weights",
            MemoryTag::KvCache => "kv_cache",
            MemoryTag::CudaGraph => "cuda_graph",
            MemoryTag::Params => "params",
            MemoryTag::Grads => "grads",
            MemoryTag::Optimizer => "optimizer",
            MemoryTag::Activations => "activations",
            MemoryTag::Named(name) => name,
        }
    }

    /// The tag's directory name in a disk store: a built-in tag's name (`params`), a named
    /// tag's name after `named-` (`named-params`). No built-in name begins with `named-`, so a
    /// named tag never shares a built-in tag's directory, whatever its name.
    pub fn dir_name(&self) -> Cow<'_, str> {
        match self {
            MemoryTag::Named(name) => Cow::Owned(format!("named-{name}")),
            builtin => Cow::Borrowed(builtin.name()),
        }
    }
}

impl fmt::Display for MemoryTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a region stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionState {
    /// On the device; buffers can be used.
    Active,
    /// A pause is in progress (waiting for views, or copying out).
    Pausing,
    /// Off the device; buffers keep their addresses but cannot be used.
    Paused,
    /// A resume is in progress.
    Resuming,
}

impl fmt::Display for RegionState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RegionState::Active => "active",
            RegionState::Pausing => "pausing",
            RegionState::Paused => "paused",
            RegionState::Resuming => "resuming",
        })
    }
}

/// What one pause or resume did.
#[derive(Clone, Debug, PartialEq)]
pub struct OffloadReport {
    /// The region.
    pub tag: MemoryTag,
    /// Where the region's bytes go when paused: with [`BackupPolicy::None`] a pause dropped
    /// them and a resume brought back memory of unspecified contents, nothing was copied.
    pub policy: BackupPolicy,
    /// Bytes of device memory released (pause) or committed (resume).
    pub bytes: u64,
    /// Wall time of the operation, from its start (for a pause, once the tag's views are gone)
    /// until the memory is freed or restored; the two free-memory readings for this report
    /// are not counted.
    pub seconds: f64,
    /// `bytes / seconds`, in 10^9 bytes per second.
    pub gbps: f64,
    /// Free device memory before.
    pub free_before: u64,
    /// Free device memory after.
    pub free_after: u64,
}

impl OffloadReport {
    pub(crate) fn new(
        tag: MemoryTag,
        policy: BackupPolicy,
        bytes: u64,
        seconds: f64,
        free_before: u64,
        free_after: u64,
    ) -> OffloadReport {
        let gbps = if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        };
        OffloadReport {
            tag,
            policy,
            bytes,
            seconds,
            gbps,
            free_before,
            free_after,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUILT_IN: [MemoryTag; 7] = [
        MemoryTag::Weights,
        MemoryTag::KvCache,
        MemoryTag::CudaGraph,
        MemoryTag::Params,
        MemoryTag::Grads,
        MemoryTag::Optimizer,
        MemoryTag::Activations,
    ];

    #[test]
    fn a_named_tag_spelling_a_built_in_name_gets_its_own_directory() {
        for builtin in BUILT_IN {
            let named = MemoryTag::Named(builtin.name().to_string());
            assert_eq!(named.name(), builtin.name());
            assert_ne!(named.dir_name(), builtin.dir_name(), "{builtin}");
            for other in BUILT_IN {
                assert_ne!(
                    named.dir_name(),
                    other.dir_name(),
                    "{named:?} and {other:?}"
                );
            }
        }
    }
}
