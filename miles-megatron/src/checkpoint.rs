//! The optimizer part of a Megatron checkpoint: one safetensors file per rank under
//! `<dir>/megatron/`, holding the Adam moments of the rank's owned slice (`exp_avg`,
//! `exp_avg_sq`) and, in its metadata, the step and the parallel layout it was written with.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use miles_core::BackendError;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

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

/// A rank's saved optimizer state.
#[derive(Debug)]
pub(crate) struct SavedOptimizer {
    /// Steps taken.
    pub step: u64,
    /// First moments of the owned slice.
    pub m: Vec<f32>,
    /// Second moments of the owned slice.
    pub v: Vec<f32>,
}

/// Reads rank `rank`'s step and moments; `None` when the checkpoint has no optimizer files.
pub(crate) fn read_optimizer(
    dir: &Path,
    rank: usize,
    tp: usize,
    dp: usize,
) -> Result<Option<SavedOptimizer>, BackendError> {
    if !dir.join(OPTIMIZER_DIR).is_dir() {
        return Ok(None);
    }
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
    let (saved_tp, saved_dp) = (
        number("tensor_model_parallel_size")?,
        number("data_parallel_size")?,
    );
    if (saved_tp, saved_dp) != (tp as u64, dp as u64) {
        return Err(bad(
            &path,
            format!(
                "written with tensor parallel {saved_tp} x data parallel {saved_dp}, this trainer runs {tp} x {dp}; load it with the same sizes"
            ),
        ));
    }
    let step = number("step")?;
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
    Ok(Some(SavedOptimizer {
        step,
        m: read("exp_avg")?,
        v: read("exp_avg_sq")?,
    }))
}
