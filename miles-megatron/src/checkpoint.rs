//! The Megatron backend's side of the shared optimizer checkpoint format
//! ([`miles_core::backend::optimizer`]): re-joining the tensor-parallel shards of saved moments
//! into the full moments, and cutting a rank's own slice of them, so that a checkpoint loads
//! at any tensor- and data-parallel size.

use std::path::Path;

use miles_core::BackendError;
use miles_core::backend::SavedOptimizer;
use miles_core::backend::optimizer::{optimizer_file, read_optimizer_shards};
use miles_core::model::{LlamaConfig, ParamLayout};

use crate::shard::{gather_tensor, scatter, shard_config};

/// Reads every rank file of checkpoint `dir` and joins them into the full moments of the model
/// `config` (whose full layout is `full_layout`); `None` when the checkpoint has no optimizer
/// files.
///
/// # Errors
/// [`BackendError::Io`] naming a missing or unreadable rank file; [`BackendError::Checkpoint`]
/// naming the file whose metadata or moments are malformed, disagree with rank 0's, or do not
/// fit this model.
pub(crate) fn read_full_optimizer(
    dir: &Path,
    config: &LlamaConfig,
    full_layout: &ParamLayout,
) -> Result<Option<SavedOptimizer>, BackendError> {
    let mut saved_layout = None;
    let shards = read_optimizer_shards(dir, |tp| {
        let layout = ParamLayout::new(&shard_config(config, tp).map_err(|_| BackendError::Checkpoint {
            path: optimizer_file(dir, 0),
            reason: format!("written with tensor parallel {tp}, which does not divide this model's heads and MLP width; the checkpoint is of another model"),
        })?);
        let len = layout.len();
        saved_layout = Some(layout);
        Ok(len)
    })?;
    let (Some(shards), Some(saved_layout)) = (shards, saved_layout) else {
        return Ok(None);
    };
    let mut m = vec![0.0; full_layout.len()];
    let mut v = vec![0.0; full_layout.len()];
    for (f, l) in full_layout.specs().iter().zip(saved_layout.specs()) {
        gather_tensor(f, l, &shards.m, &mut m[f.range()]);
        gather_tensor(f, l, &shards.v, &mut v[f.range()]);
    }
    Ok(Some(SavedOptimizer {
        step: shards.step,
        m,
        v,
    }))
}

/// The slice of `full` (laid out by `full_layout`) that data-parallel rank `dp_rank` of
/// tensor-parallel rank `tp_rank` owns: its shard laid out by `local_layout`, padded with
/// zeros to `shard_len * dp`, slice `dp_rank`.
pub(crate) fn own_slice(
    full_layout: &ParamLayout,
    local_layout: &ParamLayout,
    full: &[f32],
    tp_rank: usize,
    dp_rank: usize,
    shard_len: usize,
) -> Vec<f32> {
    let mut local = vec![0.0; local_layout.len()];
    scatter(full_layout, local_layout, full, &mut local, tp_rank);
    let start = (dp_rank * shard_len).min(local.len());
    let end = (start + shard_len).min(local.len());
    let mut out = local[start..end].to_vec();
    out.resize(shard_len, 0.0);
    out
}

#[cfg(test)]
mod tests {
    use miles_core::backend::optimizer::write_optimizer_rank;

    use super::*;

    /// Distinct, non-zero moments for every parameter of `layout`.
    fn moments(layout: &ParamLayout, phase: f32) -> Vec<f32> {
        (0..layout.len())
            .map(|i| (i as f32 * 0.37 + phase).sin() + 1.5)
            .collect()
    }

    /// Writes `m` and `v` as the ranks of a `tp` x `dp` trainer would at step `step`.
    fn write_as(dir: &Path, config: &LlamaConfig, tp: usize, dp: usize, m: &[f32], v: &[f32]) {
        let full_layout = ParamLayout::new(config);
        let local_layout = ParamLayout::new(&shard_config(config, tp).unwrap());
        let shard_len = local_layout.len().div_ceil(dp);
        for rank in 0..tp * dp {
            let (t, d) = (rank % tp, rank / tp);
            let cut = |x: &[f32]| own_slice(&full_layout, &local_layout, x, t, d, shard_len);
            write_optimizer_rank(dir, rank, tp, dp, 7, &cut(m), &cut(v)).unwrap();
        }
    }

    #[test]
    fn moments_written_at_any_layout_read_back_whole_and_exact() {
        let config = LlamaConfig::preset("tiny").unwrap();
        let layout = ParamLayout::new(&config);
        let (m, v) = (moments(&layout, 0.5), moments(&layout, 2.0));
        for (tp, dp) in [(1, 1), (1, 5), (2, 2), (2, 9)] {
            let local_len = ParamLayout::new(&shard_config(&config, tp).unwrap()).len();
            // DP=5 and DP=9 pad the last slice: the read must trim the padding.
            assert!(
                dp < 5 || !local_len.is_multiple_of(dp),
                "tp {tp} x dp {dp} pads nothing"
            );
            let dir = tempfile::tempdir().unwrap();
            write_as(dir.path(), &config, tp, dp, &m, &v);
            let full = read_full_optimizer(dir.path(), &config, &layout)
                .unwrap()
                .unwrap();
            assert_eq!(full.step, 7);
            assert!(full.m == m && full.v == v, "tp {tp} x dp {dp}");
        }
        let plain = tempfile::tempdir().unwrap();
        assert!(
            read_full_optimizer(plain.path(), &config, &layout)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn rank_files_that_disagree_or_are_missing_are_refused_naming_the_file() {
        let config = LlamaConfig::preset("tiny").unwrap();
        let layout = ParamLayout::new(&config);
        let (m, v) = (moments(&layout, 0.5), moments(&layout, 2.0));
        let dir = tempfile::tempdir().unwrap();
        write_as(dir.path(), &config, 1, 3, &m, &v);
        let stray = tempfile::tempdir().unwrap();
        write_as(stray.path(), &config, 1, 2, &m, &v);
        std::fs::copy(
            optimizer_file(stray.path(), 1),
            optimizer_file(dir.path(), 1),
        )
        .unwrap();
        let err = read_full_optimizer(dir.path(), &config, &layout)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("optimizer-rank-00001") && err.contains("different checkpoints"),
            "{err}"
        );
        std::fs::remove_file(optimizer_file(dir.path(), 2)).unwrap();
        write_as(stray.path(), &config, 1, 3, &m, &v);
        std::fs::copy(
            optimizer_file(stray.path(), 1),
            optimizer_file(dir.path(), 1),
        )
        .unwrap();
        let err = read_full_optimizer(dir.path(), &config, &layout)
            .unwrap_err()
            .to_string();
        assert!(err.contains("optimizer-rank-00002"), "{err}");
    }
}
