//! The optimizer part of a checkpoint, in the megatron backend's format so that checkpoints are
//! interchangeable: beside the Hugging Face weights (`model.safetensors`, `config.json`), one
//! safetensors file per rank under `<dir>/megatron/` (`optimizer-rank-00000.safetensors`, ...)
//! holding `exp_avg` and `exp_avg_sq` of the rank's slice, with the step and the parallel sizes
//! in its metadata.
//!
//! At tensor parallel 1 a rank's slice is the block `rank` of the full flat moments (laid out as
//! the parameters), padded with zeros to a multiple of the data-parallel size: what the megatron
//! backend's distributed optimizer owns. This backend writes that layout (tensor parallel 1)
//! and reads it at any data-parallel size, since it reassembles the full moments first.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use miles_core::BackendError;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// The subdirectory of a checkpoint that holds the optimizer files (the megatron backend's).
pub const OPTIMIZER_DIR: &str = "megatron";

/// The full AdamW state of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerState {
    /// First moment, laid out as the parameters.
    pub exp_avg: Vec<f32>,
    /// Second moment, laid out as the parameters.
    pub exp_avg_sq: Vec<f32>,
    /// Optimizer steps taken.
    pub step: u64,
}

/// The optimizer file of rank `rank` in checkpoint `dir`.
pub fn optimizer_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(OPTIMIZER_DIR)
        .join(format!("optimizer-rank-{rank:05}.safetensors"))
}

fn bad(path: &Path, reason: impl Into<String>) -> BackendError {
    BackendError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn io<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> BackendError + 'a {
    move |source| BackendError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `state` into `dir` as `ranks` data-parallel slices (tensor parallel 1).
///
/// # Errors
/// [`BackendError::Io`] or [`BackendError::Checkpoint`] when a file cannot be written.
pub fn save_optimizer(
    dir: &Path,
    state: &OptimizerState,
    ranks: usize,
) -> Result<(), BackendError> {
    let parent = dir.join(OPTIMIZER_DIR);
    std::fs::create_dir_all(&parent).map_err(io("create", &parent))?;
    let ranks = ranks.max(1);
    let slice = state.exp_avg.len().div_ceil(ranks);
    let bytes_of = |full: &[f32], rank: usize| -> Vec<u8> {
        let mut out = vec![0u8; slice * 4];
        let start = (rank * slice).min(full.len());
        let end = (start + slice).min(full.len());
        for (dst, x) in out.chunks_exact_mut(4).zip(&full[start..end]) {
            dst.copy_from_slice(&x.to_le_bytes());
        }
        out
    };
    for rank in 0..ranks {
        let path = optimizer_file(dir, rank);
        let (m, v) = (
            bytes_of(&state.exp_avg, rank),
            bytes_of(&state.exp_avg_sq, rank),
        );
        let view = |data| {
            TensorView::new(Dtype::F32, vec![slice], data).map_err(|e| bad(&path, e.to_string()))
        };
        let tensors = vec![("exp_avg", view(&m)?), ("exp_avg_sq", view(&v)?)];
        let metadata = HashMap::from([
            ("step".to_string(), state.step.to_string()),
            ("tensor_model_parallel_size".to_string(), "1".to_string()),
            ("data_parallel_size".to_string(), ranks.to_string()),
        ]);
        safetensors::serialize_to_file(tensors, Some(metadata), &path)
            .map_err(|e| bad(&path, e.to_string()))?;
    }
    Ok(())
}

/// Reads the full optimizer state (`len` elements per moment) of checkpoint `dir`, whatever
/// data-parallel size wrote it, or `None` when it holds no optimizer files (a plain Hugging
/// Face checkpoint).
///
/// # Errors
/// [`BackendError::Io`] for unreadable files; [`BackendError::Checkpoint`] for state written
/// with tensor parallelism (its slices are of tensor-parallel shards), ranks that disagree, or
/// slices that do not add up to `len`.
pub fn load_optimizer(dir: &Path, len: usize) -> Result<Option<OptimizerState>, BackendError> {
    if !dir.join(OPTIMIZER_DIR).is_dir() {
        return Ok(None);
    }
    let mut exp_avg = Vec::with_capacity(len);
    let mut exp_avg_sq = Vec::with_capacity(len);
    let (mut ranks, mut step, mut rank) = (1, 0, 0);
    while rank < ranks {
        let path = optimizer_file(dir, rank);
        let bytes = std::fs::read(&path).map_err(io("read", &path))?;
        let (_, header) =
            SafeTensors::read_metadata(&bytes).map_err(|e| bad(&path, e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let number = |key: &str| -> Result<u64, BackendError> {
            meta.get(key)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(&path, format!("metadata lacks a numeric `{key}`")))
        };
        let (tp, dp, rank_step) = (
            number("tensor_model_parallel_size")?,
            number("data_parallel_size")?,
            number("step")?,
        );
        if tp != 1 {
            return Err(bad(
                &path,
                format!(
                    "written with tensor parallel {tp}; the fsdp backend reads optimizer state of tensor parallel 1 (load the weights alone by removing {OPTIMIZER_DIR}/)"
                ),
            ));
        }
        if rank == 0 {
            (ranks, step) = (usize::try_from(dp).unwrap_or(0).max(1), rank_step);
        } else if (dp, rank_step) != (ranks as u64, step) {
            return Err(bad(
                &path,
                format!(
                    "says data parallel {dp} at step {rank_step}, rank 0 says {ranks} at step {step}"
                ),
            ));
        }
        let tensors = SafeTensors::deserialize(&bytes).map_err(|e| bad(&path, e.to_string()))?;
        for (name, out) in [("exp_avg", &mut exp_avg), ("exp_avg_sq", &mut exp_avg_sq)] {
            let t = tensors
                .tensor(name)
                .map_err(|e| bad(&path, e.to_string()))?;
            if t.dtype() != Dtype::F32 || t.shape() != [len.div_ceil(ranks)] {
                return Err(bad(
                    &path,
                    format!(
                        "`{name}` is {:?} {:?}, this model needs F32 [{}] per rank of {ranks}; the checkpoint is of another model",
                        t.dtype(),
                        t.shape(),
                        len.div_ceil(ranks)
                    ),
                ));
            }
            out.extend(
                t.data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
        }
        rank += 1;
    }
    exp_avg.truncate(len);
    exp_avg_sq.truncate(len);
    Ok(Some(OptimizerState {
        exp_avg,
        exp_avg_sq,
        step,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(len: usize, step: u64) -> OptimizerState {
        OptimizerState {
            exp_avg: (0..len).map(|i| i as f32 * 0.25 + 1.0).collect(),
            exp_avg_sq: (0..len).map(|i| i as f32 * 0.5 + 2.0).collect(),
            step,
        }
    }

    #[test]
    fn state_written_at_one_rank_count_reads_back_whole_at_any() {
        for ranks in [1, 3, 4] {
            let dir = tempfile::tempdir().unwrap();
            let saved = state(1001, 7);
            save_optimizer(dir.path(), &saved, ranks).unwrap();
            assert!(optimizer_file(dir.path(), ranks - 1).exists());
            let loaded = load_optimizer(dir.path(), 1001).unwrap().unwrap();
            assert_eq!(loaded, saved, "{ranks} ranks");
        }
        let plain = tempfile::tempdir().unwrap();
        assert_eq!(load_optimizer(plain.path(), 10).unwrap(), None);
    }

    #[test]
    fn state_of_another_model_or_of_tensor_parallel_ranks_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        save_optimizer(dir.path(), &state(100, 1), 2).unwrap();
        let err = load_optimizer(dir.path(), 90).unwrap_err().to_string();
        assert!(err.contains("another model"), "{err}");
        let path = optimizer_file(dir.path(), 0);
        let data = vec![0u8; 8];
        let view = TensorView::new(Dtype::F32, vec![2], &data).unwrap();
        let metadata = HashMap::from([
            ("step".to_string(), "1".to_string()),
            ("tensor_model_parallel_size".to_string(), "2".to_string()),
            ("data_parallel_size".to_string(), "1".to_string()),
        ]);
        safetensors::serialize_to_file(vec![("exp_avg", view)], Some(metadata), &path).unwrap();
        let err = load_optimizer(dir.path(), 4).unwrap_err().to_string();
        assert!(err.contains("tensor parallel 2"), "{err}");
    }
}
