//! The optimizer part of a checkpoint, one format for every backend on every device, so that
//! checkpoints are interchangeable: beside the Hugging Face weights (`model.safetensors`,
//! `config.json`), one safetensors file per rank under `<dir>/megatron/`
//! (`optimizer-rank-00000.safetensors`, ...) holding `exp_avg` and `exp_avg_sq` of the rank's
//! slice, with the step and the parallel layout it was written with in its metadata
//! (`step`, `tensor_model_parallel_size`, `data_parallel_size`).
//!
//! Rank `d * tp + t` owns slice `d` of tensor-parallel shard `t`, laid out by that shard's
//! parameter table and padded with zeros to a multiple of the data-parallel size: what
//! Megatron's distributed optimizer owns. At tensor parallel 1 a rank's slice is block `rank` of
//! the full flat moments (laid out as the parameters). [`write_optimizer`] writes full moments
//! that way over any number of ranks; [`read_optimizer`] reads them back whole at any
//! data-parallel size. A tensor-parallel checkpoint is read as [`OptimizerShards`]
//! ([`read_optimizer_shards`]), which the Megatron backend re-joins into the full moments.
//! Adam's moments are per element, so re-slicing them changes no value.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use super::BackendError;
use crate::device::MappedFile;

/// The folder of the optimizer files inside a checkpoint.
pub const OPTIMIZER_DIR: &str = "megatron";

/// Full AdamW moments and the step they were saved at.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedOptimizer {
    /// Optimizer steps taken.
    pub step: u64,
    /// First moment (`exp_avg`), laid out as the parameters.
    pub m: Vec<f32>,
    /// Second moment (`exp_avg_sq`), laid out as the parameters.
    pub v: Vec<f32>,
}

/// The saved moments of a checkpoint, per tensor-parallel shard: shard `t`'s data-parallel
/// slices joined in rank order, the padding dropped.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerShards {
    /// Optimizer steps taken.
    pub step: u64,
    /// The tensor-parallel size the checkpoint was written at.
    pub tensor_parallel: usize,
    /// The data-parallel size the checkpoint was written at.
    pub data_parallel: usize,
    /// First moment of each shard, laid out by the shard's parameter table.
    pub m: Vec<Vec<f32>>,
    /// Second moment of each shard.
    pub v: Vec<Vec<f32>>,
}

/// The file of rank `rank` in the checkpoint `dir`.
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

/// Writes rank `rank`'s file of a checkpoint written at tensor parallel `tp` and data parallel
/// `dp`: its slices `m` and `v` (padded already) and the step.
///
/// # Errors
/// [`BackendError::Io`] when the folder cannot be created; [`BackendError::Checkpoint`] when
/// the file cannot be written.
pub fn write_optimizer_rank(
    dir: &Path,
    rank: usize,
    tp: usize,
    dp: usize,
    step: u64,
    m: &[f32],
    v: &[f32],
) -> Result<(), BackendError> {
    let parent = dir.join(OPTIMIZER_DIR);
    std::fs::create_dir_all(&parent).map_err(io("create", &parent))?;
    let path = optimizer_file(dir, rank);
    // Little-endian memory, as safetensors stores it (`model::checkpoint` refuses other targets).
    let (mb, vb): (&[u8], &[u8]) = (bytemuck::cast_slice(m), bytemuck::cast_slice(v));
    let st_err = |e: safetensors::SafeTensorError| bad(&path, e.to_string());
    let tensors = vec![
        (
            "exp_avg",
            TensorView::new(Dtype::F32, vec![m.len()], mb).map_err(st_err)?,
        ),
        (
            "exp_avg_sq",
            TensorView::new(Dtype::F32, vec![v.len()], vb).map_err(st_err)?,
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

/// Writes the full moments of `saved` at tensor parallel 1 over `ranks` files (at least one),
/// each a block of the flat moments, the last padded with zeros.
///
/// # Errors
/// As [`write_optimizer_rank`].
pub fn write_optimizer(
    dir: &Path,
    saved: &SavedOptimizer,
    ranks: usize,
) -> Result<(), BackendError> {
    let ranks = ranks.max(1);
    let slice = saved.m.len().div_ceil(ranks);
    for rank in 0..ranks {
        let (m, v) = (block(&saved.m, rank, slice), block(&saved.v, rank, slice));
        write_optimizer_rank(dir, rank, 1, ranks, saved.step, &m, &v)?;
    }
    Ok(())
}

/// Block `rank` of `slice` elements of `full`, padded with zeros past its end. A whole block
/// is `full`'s own memory; only a short last one is copied to be padded (the moments of a large
/// model are gigabytes).
fn block(full: &[f32], rank: usize, slice: usize) -> Cow<'_, [f32]> {
    let start = (rank * slice).min(full.len());
    let end = (start + slice).min(full.len());
    if end - start == slice {
        return Cow::Borrowed(&full[start..end]);
    }
    let mut out = full[start..end].to_vec();
    out.resize(slice, 0.0);
    Cow::Owned(out)
}

/// One rank's file: its layout's metadata and its slices.
struct RankFile {
    tp: u64,
    dp: u64,
    step: u64,
    m: Vec<f32>,
    v: Vec<f32>,
}

/// Rank 0's layout and step, and the slice length they imply, that every rank file must match.
struct Expected {
    tp: usize,
    dp: usize,
    step: u64,
    slice: usize,
}

/// Rank `rank`'s file mapped (its moments are converted from the page cache, never read into a
/// buffer of their own first), and its path.
fn map_rank_file(dir: &Path, rank: usize) -> Result<(MappedFile, PathBuf), BackendError> {
    let path = optimizer_file(dir, rank);
    let map = MappedFile::open(&path).map_err(io("read", &path))?;
    Ok((map, path))
}

/// Parses a rank file's `bytes` (read from `path`): its metadata alone without `expect`; with
/// it, also its slices, after checking that the metadata matches and that the slices are
/// float32 of the length.
fn parse_rank(
    path: &Path,
    bytes: &[u8],
    expect: Option<&Expected>,
) -> Result<RankFile, BackendError> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| bad(path, e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let number = |key: &str| -> Result<u64, BackendError> {
        meta.get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(path, format!("metadata lacks a numeric `{key}`")))
    };
    let (tp, dp, step) = (
        number("tensor_model_parallel_size")?,
        number("data_parallel_size")?,
        number("step")?,
    );
    let Some(expect) = expect else {
        return Ok(RankFile {
            tp,
            dp,
            step,
            m: Vec::new(),
            v: Vec::new(),
        });
    };
    let (etp, edp, estep, slice) = (expect.tp, expect.dp, expect.step, expect.slice);
    if (tp, dp, step) != (etp as u64, edp as u64, estep) {
        return Err(bad(
            path,
            format!(
                "says tensor parallel {tp} x data parallel {dp} at step {step}, rank 0 says {etp} x {edp} at step {estep}; the rank files are of different checkpoints"
            ),
        ));
    }
    let tensors = SafeTensors::deserialize(bytes).map_err(|e| bad(path, e.to_string()))?;
    let read = |name: &str| -> Result<Vec<f32>, BackendError> {
        let t = tensors.tensor(name).map_err(|e| bad(path, e.to_string()))?;
        if t.dtype() != Dtype::F32 || t.shape() != [slice] {
            return Err(bad(
                path,
                format!(
                    "`{name}` is {:?} {:?}, this model needs F32 [{slice}] per rank of {tp} x {dp}; the checkpoint is of another model",
                    t.dtype(),
                    t.shape(),
                ),
            ));
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

/// The saved moments of the checkpoint `dir` per tensor-parallel shard, or `None` when it
/// holds weights only. `shard_len` gives the length of one shard's moments (its parameter
/// table's) at the saved tensor-parallel size, or refuses that size.
///
/// # Errors
/// What `shard_len` returns; [`BackendError::Io`] for a rank file missing;
/// [`BackendError::Checkpoint`] for a file that does not parse, says a parallel size of zero,
/// disagrees with rank 0's layout or step ("different checkpoints"), or holds slices of
/// another length ("another model"), naming the file.
pub fn read_optimizer_shards(
    dir: &Path,
    shard_len: impl FnOnce(usize) -> Result<usize, BackendError>,
) -> Result<Option<OptimizerShards>, BackendError> {
    if !dir.join(OPTIMIZER_DIR).is_dir() {
        return Ok(None);
    }
    let (first_map, first_path) = map_rank_file(dir, 0)?;
    let first = parse_rank(&first_path, first_map.bytes(), None)?;
    let (Ok(tp), Ok(dp)) = (usize::try_from(first.tp), usize::try_from(first.dp)) else {
        return Err(bad(&first_path, "parallel sizes do not fit this machine"));
    };
    if tp == 0 || dp == 0 {
        return Err(bad(&first_path, "says a parallel size of zero"));
    }
    let step = first.step;
    let len = shard_len(tp)?;
    let slice = len.div_ceil(dp);
    let expect = Expected {
        tp,
        dp,
        step,
        slice,
    };
    let (mut m, mut v) = (vec![Vec::new(); tp], vec![Vec::new(); tp]);
    let mut first_map = Some(first_map);
    for rank in 0..tp * dp {
        // Rank 0's file is mapped once: it can hold the whole model's moments.
        let (map, path) = match first_map.take() {
            Some(map) => (map, optimizer_file(dir, 0)),
            None => map_rank_file(dir, rank)?,
        };
        let saved = parse_rank(&path, map.bytes(), Some(&expect))?;
        for (shards, part) in [(&mut m, saved.m), (&mut v, saved.v)] {
            // A shard's first block is moved in (at data parallel 1 the whole shard), the
            // others appended.
            let shard = &mut shards[rank % tp];
            if shard.is_empty() {
                *shard = part;
                shard.reserve_exact(slice * (dp - 1));
            } else {
                shard.extend_from_slice(&part);
            }
        }
    }
    for shard in m.iter_mut().chain(v.iter_mut()) {
        shard.truncate(len);
    }
    Ok(Some(OptimizerShards {
        step,
        tensor_parallel: tp,
        data_parallel: dp,
        m,
        v,
    }))
}

/// The full moments of `len` elements saved in the checkpoint `dir` at tensor parallel 1 (any
/// data-parallel size), or `None` when it holds weights only.
///
/// # Errors
/// [`BackendError::Checkpoint`] for a checkpoint written at a tensor-parallel size above 1
/// (only the Megatron backend re-joins those); as [`read_optimizer_shards`].
pub fn read_optimizer(dir: &Path, len: usize) -> Result<Option<SavedOptimizer>, BackendError> {
    let shards = read_optimizer_shards(dir, |tp| match tp {
        1 => Ok(len),
        tp => Err(bad(
            &optimizer_file(dir, 0),
            format!(
                "written with tensor parallel {tp}; this backend reads optimizer state of tensor parallel 1 (resume with --train-backend megatron, or load the weights alone by removing {OPTIMIZER_DIR}/)"
            ),
        )),
    })?;
    Ok(shards.map(|mut shards| SavedOptimizer {
        step: shards.step,
        m: shards.m.swap_remove(0),
        v: shards.v.swap_remove(0),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(len: usize, step: u64) -> SavedOptimizer {
        SavedOptimizer {
            m: (0..len).map(|i| i as f32 * 0.25 + 1.0).collect(),
            v: (0..len).map(|i| i as f32 * 0.5 + 2.0).collect(),
            step,
        }
    }

    #[test]
    fn state_written_at_one_rank_count_reads_back_whole_at_any() {
        for ranks in [1, 3, 4] {
            let dir = tempfile::tempdir().unwrap();
            let saved = state(1001, 7);
            write_optimizer(dir.path(), &saved, ranks).unwrap();
            assert!(optimizer_file(dir.path(), ranks - 1).exists());
            let loaded = read_optimizer(dir.path(), 1001).unwrap().unwrap();
            assert_eq!(loaded, saved, "{ranks} ranks");
        }
        let plain = tempfile::tempdir().unwrap();
        assert_eq!(read_optimizer(plain.path(), 10).unwrap(), None);
    }

    #[test]
    fn state_of_another_model_or_of_tensor_parallel_ranks_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        write_optimizer(dir.path(), &state(100, 1), 2).unwrap();
        let err = read_optimizer(dir.path(), 90).unwrap_err().to_string();
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
        let err = read_optimizer(dir.path(), 4).unwrap_err().to_string();
        assert!(err.contains("tensor parallel 2"), "{err}");
    }
}
