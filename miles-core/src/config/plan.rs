//! Typed plans resolved from the settings: what the code below the config runs on, so that no
//! rule is derived twice from raw fields.

use std::path::PathBuf;

use super::{MomentDtype, OffloadTarget, RolloutOffloadLevel, Settings, SettingsError};
use crate::memory::{BackupPolicy, DiskSettings};

/// Largest `--offload-train-disk-chunk-mb`: 4 GiB, past which a chunk is no longer a staging
/// buffer but a copy of the state.
pub const MAX_DISK_CHUNK_MB: u64 = 4096;

/// Where the trainer's parameters and optimizer state go when it offloads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TrainOffload {
    /// Host RAM (pinned on CUDA).
    Host,
    /// Checksummed chunk files under `dir` (`--offload-train-disk-dir`), one directory a rank.
    Disk {
        /// The job's offload directory.
        dir: PathBuf,
        /// Bytes per chunk.
        chunk_bytes: usize,
        /// Host memory a pause may copy into while its write to disk goes on behind it.
        host_budget_bytes: u64,
    },
}

impl TrainOffload {
    /// The plan `settings` describe (rules 3 and the chunk's range).
    ///
    /// # Errors
    /// [`SettingsError::DiskTargetWithoutDir`] or [`SettingsError::OutOfRange`] for the chunk:
    /// only for settings that did not go through [`Settings::resolve`], which reports the same.
    pub fn of(settings: &Settings) -> Result<TrainOffload, SettingsError> {
        match settings.offload_train_target {
            OffloadTarget::Host => Ok(TrainOffload::Host),
            OffloadTarget::Disk => Ok(TrainOffload::Disk {
                dir: disk_dir(settings)?,
                chunk_bytes: disk_chunk_bytes(settings)?,
                host_budget_bytes: host_budget_bytes(settings),
            }),
        }
    }

    /// The `--offload-train-target` this plan stands for.
    pub fn target(&self) -> OffloadTarget {
        match self {
            TrainOffload::Host => OffloadTarget::Host,
            TrainOffload::Disk { .. } => OffloadTarget::Disk,
        }
    }

    /// The backup policy of the regions that keep their contents (parameters, optimizer state).
    pub fn policy(&self) -> BackupPolicy {
        match self {
            TrainOffload::Host => BackupPolicy::Host,
            TrainOffload::Disk { .. } => BackupPolicy::Disk,
        }
    }

    /// The disk store of rank `rank`'s memory manager, for the disk target.
    pub fn disk(&self, rank: usize) -> Option<DiskSettings> {
        match self {
            TrainOffload::Host => None,
            TrainOffload::Disk {
                dir,
                chunk_bytes,
                host_budget_bytes,
            } => Some(DiskSettings {
                host_budget_bytes: *host_budget_bytes,
                ..rank_disk(dir, rank, *chunk_bytes)
            }),
        }
    }
}

/// Optimizer state that lives on disk and streams through the step
/// (`--stream-optimizer-state-to-disk`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptimizerStream {
    /// Storage type of the moments.
    pub dtype: MomentDtype,
    /// The fp32 master weights stream too (`--stream-optimizer-master-weights`, cuda).
    pub master_weights: bool,
    /// The job's offload directory.
    pub dir: PathBuf,
    /// Bytes per bucket (the disk chunk).
    pub bucket_bytes: usize,
    /// Host memory the stream reads ahead into and writes behind from
    /// (`--offload-train-host-budget-gb`); at least a few buckets' worth either way.
    pub host_budget_bytes: u64,
}

impl OptimizerStream {
    /// The stream `settings` ask for, `None` when off.
    ///
    /// # Errors
    /// As [`TrainOffload::of`].
    pub fn of(settings: &Settings) -> Result<Option<OptimizerStream>, SettingsError> {
        if !settings.stream_optimizer_state_to_disk {
            return Ok(None);
        }
        Ok(Some(OptimizerStream {
            dtype: settings.stream_optimizer_state_moment_dtype,
            master_weights: settings.stream_optimizer_master_weights,
            dir: disk_dir(settings)?,
            bucket_bytes: disk_chunk_bytes(settings)?,
            host_budget_bytes: host_budget_bytes(settings),
        }))
    }

    /// The disk store of rank `rank`'s streamed optimizer state.
    pub fn disk(&self, rank: usize) -> DiskSettings {
        DiskSettings {
            host_budget_bytes: self.host_budget_bytes,
            ..rank_disk(&self.dir, rank, self.bucket_bytes)
        }
    }
}

/// Which rollout tags leave the device between rollouts: `--offload-rollout-level`, all off
/// without `--offload-rollout`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RolloutOffload {
    /// The paged KV cache.
    pub kv_cache: bool,
    /// The engine's weights.
    pub weights: bool,
    /// Captured CUDA graphs.
    pub cuda_graph: bool,
}

impl RolloutOffload {
    /// The plan `settings` describe.
    pub fn of(settings: &Settings) -> RolloutOffload {
        if settings.offload_rollout {
            RolloutOffload::from_levels(&settings.offload_rollout_level)
        } else {
            RolloutOffload::default()
        }
    }

    /// The tags `levels` name.
    pub fn from_levels(levels: &[RolloutOffloadLevel]) -> RolloutOffload {
        RolloutOffload {
            kv_cache: levels.contains(&RolloutOffloadLevel::KvCache),
            weights: levels.contains(&RolloutOffloadLevel::Weight),
            cuda_graph: levels.contains(&RolloutOffloadLevel::CudaGraph),
        }
    }
}

/// Rank `rank`'s disk store under the job's directory `dir`, writing in line: the store keeps
/// every backend's files in the one per-rank layout, `<dir>/offload/rank-<rank>/<tag>/`
/// ([`RankDir`](crate::store::RankDir)).
fn rank_disk(dir: &std::path::Path, rank: usize, chunk_bytes: usize) -> DiskSettings {
    DiskSettings {
        dir: dir.to_path_buf(),
        rank,
        chunk_bytes,
        host_budget_bytes: 0,
    }
}

fn host_budget_bytes(settings: &Settings) -> u64 {
    (settings.offload_train_host_budget_gb * 1e9) as u64
}

fn disk_dir(settings: &Settings) -> Result<PathBuf, SettingsError> {
    settings
        .offload_train_disk_dir
        .clone()
        .ok_or(SettingsError::DiskTargetWithoutDir)
}

/// `--offload-train-disk-chunk-mb` in bytes, checked against its range.
pub(crate) fn disk_chunk_bytes(settings: &Settings) -> Result<usize, SettingsError> {
    let mb = settings.offload_train_disk_chunk_mb;
    if mb == 0 {
        return Err(SettingsError::ZeroDiskChunk);
    }
    (mb <= MAX_DISK_CHUNK_MB)
        .then(|| usize::try_from(mb << 20).ok())
        .flatten()
        .ok_or_else(|| SettingsError::OutOfRange {
            flag: "offload-train-disk-chunk-mb".to_owned(),
            value: mb.to_string(),
            expected: format!("between 1 and {MAX_DISK_CHUNK_MB} (MiB)"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk_settings(chunk_mb: u64) -> Settings {
        Settings {
            offload_train: true,
            offload_train_target: OffloadTarget::Disk,
            offload_train_disk_dir: Some("/tmp/x".into()),
            offload_train_disk_chunk_mb: chunk_mb,
            ..Settings::default()
        }
    }

    #[test]
    fn the_disk_plan_maps_to_disk_backups_in_one_rank_layout() {
        let plan = TrainOffload::of(&disk_settings(8)).unwrap();
        assert_eq!(plan.policy(), BackupPolicy::Disk);
        assert_eq!(plan.target(), OffloadTarget::Disk);
        let disk = plan.disk(3).unwrap();
        assert_eq!(disk.dir, PathBuf::from("/tmp/x"));
        assert_eq!((disk.rank, disk.chunk_bytes), (3, 8 << 20));
        assert_eq!(disk.host_budget_bytes, 0, "writes in line by default");
        let budgeted = Settings {
            offload_train_host_budget_gb: 1.5,
            ..disk_settings(8)
        };
        let disk = TrainOffload::of(&budgeted).unwrap().disk(0).unwrap();
        assert_eq!(disk.host_budget_bytes, 1_500_000_000);
        let host = TrainOffload::of(&Settings::default()).unwrap();
        assert_eq!((host.policy(), host.disk(0)), (BackupPolicy::Host, None));
    }

    #[test]
    fn chunks_outside_their_range_are_refused_naming_the_flag_not_wrapped() {
        for mb in [
            0,
            MAX_DISK_CHUNK_MB + 1,
            1 << 20,
            17_592_186_044_416,
            (1 << 44) + 1,
        ] {
            let error = TrainOffload::of(&disk_settings(mb)).unwrap_err();
            assert!(
                error.to_string().contains("--offload-train-disk-chunk-mb"),
                "{mb}: {error}"
            );
        }
        let no_dir = Settings {
            offload_train_disk_dir: None,
            ..disk_settings(8)
        };
        assert!(matches!(
            TrainOffload::of(&no_dir),
            Err(SettingsError::DiskTargetWithoutDir)
        ));
    }
}
