//! The optimizer part of a Megatron checkpoint: one safetensors file per rank under
//! `<dir>/megatron/`, holding the Adam moments of the rank's owned slice (`exp_avg`,
//! `exp_avg_sq`) and, in its metadata, the step and the parallel layout it was written with.
//!
//! Rank `d * tp + t` owns slice `d` of tensor-parallel shard `t`, laid out by that shard's
//! [`ParamLayout`] and padded with zeros to a multiple of the data-parallel size. Reading joins
//! every rank's slice into the full moments (laid out as the full model's parameters), so a
//! checkpoint loads at any tensor- and data-parallel size: each rank then cuts its own slice with
//! [`own_slice`]. Adam's moments are per element, so re-slicing them changes no value.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use miles_core::BackendError;
use miles_core::model::{LlamaConfig, ParamLayout};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::shard::{gather_tensor, scatter, shard_config};

/// The subdirectory of a checkpoint that holds the optimizer files.
pub const OPTIMIZER_DIR: &str = "megatron";

fn file_of(dir: &Path, rank: usize) -> PathBuf {
    dir.join(OPTIMIZER_DIR)
        .join(format!("optimizer-rank-{rank:05}.safetensors"))
}

fn bad(path: &Path, reason: impl Into<String>) -> BackendError {
    BackendError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Writes rank `rank`'s moments and the step.
pub(crate) fn write_optimizer(
    dir: &Path,
    rank: usize,
    tp: usize,
    dp: usize,
    step: u64,
    m: &[f32],
    v: &[f32],
) -> Result<(), BackendError> {
    let path = file_of(dir, rank);
    let parent = dir.join(OPTIMIZER_DIR);
    std::fs::create_dir_all(&parent).map_err(|source| BackendError::Io {
        action: "create",
        path: parent,
        source,
    })?;
    let bytes = |x: &[f32]| -> Vec<u8> { x.iter().flat_map(|f| f.to_le_bytes()).collect() };
    let (mb, vb) = (bytes(m), bytes(v));
    let st_err = |e: safetensors::SafeTensorError| bad(&path, e.to_string());
    let tensors = vec![
        (
            "exp_avg",
            TensorView::new(Dtype::F32, vec![m.len()], &mb).map_err(st_err)?,
        ),
        (
            "exp_avg_sq",
            TensorView::new(Dtype::F32, vec![v.len()], &vb).map_err(st_err)?,
        ),
    ];
    let metadata = HashMap::from([
        ("step".to_string(), step.to_string()),
        ("tensor_model_parallel_size".to_string(), tp.to_string()),
        ("data_parallel_size".to_string(), dp.to_string()),
    ]);
    safetensors::serialize_to_file(tensors, Some(metadata), &path)
        .map_err(|e| bad(&path, e.to_string()))
}

/// The full optimizer state of a checkpoint, whatever layout wrote it.
#[derive(Debug)]
pub(crate) struct FullOptimizer {
    /// Steps taken.
    pub step: u64,
    /// First moments, laid out as the full model's parameters.
    pub m: Vec<f32>,
    /// Second moments, laid out as the full model's parameters.
    pub v: Vec<f32>,
}

/// One rank file's metadata and moments.
struct RankFile {
    tp: u64,
    dp: u64,
    step: u64,
    m: Vec<f32>,
    v: Vec<f32>,
}

fn read_rank(dir: &Path, rank: usize) -> Result<RankFile, BackendError> {
    let path = file_of(dir, rank);
    let bytes = std::fs::read(&path).map_err(|source| BackendError::Io {
        action: "read",
        path: path.clone(),
        source,
    })?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(&path, e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let number = |key: &str| -> Result<u64, BackendError> {
        meta.get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(&path, format!("metadata lacks a numeric `{key}`")))
    };
    let (tp, dp, step) = (
        number("tensor_model_parallel_size")?,
        number("data_parallel_size")?,
        number("step")?,
    );
    let tensors = SafeTensors::deserialize(&bytes).map_err(|e| bad(&path, e.to_string()))?;
    let read = |name: &str| -> Result<Vec<f32>, BackendError> {
        let t = tensors
            .tensor(name)
            .map_err(|e| bad(&path, e.to_string()))?;
        if t.dtype() != Dtype::F32 {
            return Err(bad(&path, format!("`{name}` is not float32")));
        }
        Ok(t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    };
    Ok(RankFile {
        tp,
        dp,
        step,
        m: read("exp_avg")?,
        v: read("exp_avg_sq")?,
    })
}

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
) -> Result<Option<FullOptimizer>, BackendError> {
    if !dir.join(OPTIMIZER_DIR).is_dir() {
        return Ok(None);
    }
    let first = read_rank(dir, 0)?;
    let (tp, dp, step) = (first.tp, first.dp, first.step);
    let first_path = file_of(dir, 0);
    let (Ok(tp), Ok(dp)) = (usize::try_from(tp), usize::try_from(dp)) else {
        return Err(bad(&first_path, "parallel sizes do not fit this machine"));
    };
    if tp == 0 || dp == 0 {
        return Err(bad(&first_path, "says a parallel size of zero"));
    }
    let saved_layout = ParamLayout::new(&shard_config(config, tp).map_err(|_| {
        bad(
            &first_path,
            format!("written with tensor parallel {tp}, which does not divide this model's heads and MLP width; the checkpoint is of another model"),
        )
    })?);
    let local_len = saved_layout.len();
    let slice = local_len.div_ceil(dp);
    // Shard `t` of the saved tensor-parallel group, joined over its data-parallel slices.
    let mut shards_m = vec![Vec::with_capacity(slice * dp); tp];
    let mut shards_v = vec![Vec::with_capacity(slice * dp); tp];
    let mut file = Some(first);
    for rank in 0..tp * dp {
        let saved = match file.take() {
            Some(saved) => saved,
            None => read_rank(dir, rank)?,
        };
        let path = file_of(dir, rank);
        if (saved.tp, saved.dp, saved.step) != (tp as u64, dp as u64, step) {
            return Err(bad(
                &path,
                format!(
                    "says tensor parallel {} x data parallel {} at step {}, rank 0 says {tp} x {dp} at step {step}; the rank files are of different checkpoints",
                    saved.tp, saved.dp, saved.step
                ),
            ));
        }
        if saved.m.len() != slice || saved.v.len() != slice {
            return Err(bad(
                &path,
                format!(
                    "holds {} and {} optimizer elements, this model needs {slice} per rank of {tp} x {dp}; the checkpoint is of another model",
                    saved.m.len(),
                    saved.v.len()
                ),
            ));
        }
        shards_m[rank % tp].extend_from_slice(&saved.m);
        shards_v[rank % tp].extend_from_slice(&saved.v);
    }
    let mut m = vec![0.0; full_layout.len()];
    let mut v = vec![0.0; full_layout.len()];
    for (f, l) in full_layout.specs().iter().zip(saved_layout.specs()) {
        gather_tensor(f, l, &shards_m, &mut m[f.range()]);
        gather_tensor(f, l, &shards_v, &mut v[f.range()]);
    }
    Ok(Some(FullOptimizer { step, m, v }))
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
            write_optimizer(dir, rank, tp, dp, 7, &cut(m), &cut(v)).unwrap();
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
        std::fs::copy(file_of(stray.path(), 1), file_of(dir.path(), 1)).unwrap();
        let err = read_full_optimizer(dir.path(), &config, &layout)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("optimizer-rank-00001") && err.contains("different checkpoints"),
            "{err}"
        );
        std::fs::remove_file(file_of(dir.path(), 2)).unwrap();
        write_as(stray.path(), &config, 1, 3, &m, &v);
        std::fs::copy(file_of(stray.path(), 1), file_of(dir.path(), 1)).unwrap();
        let err = read_full_optimizer(dir.path(), &config, &layout)
            .unwrap_err()
            .to_string();
        assert!(err.contains("optimizer-rank-00002"), "{err}");
    }
}
