//! Megatron's tensor-parallel sharding of the parameter table, used by this backend's CPU
//! trainer, its GPU tensor-parallel group ([`crate::gpu_parallel`]) and its checkpoint's re-join
//! of shards.
//!
//! Rank `r` of `tp` holds heads `[r*H/tp, (r+1)*H/tp)` and key/value heads `[r*K/tp, ...)`
//! (contiguous, so each query head finds its grouped KV head on the same rank), and MLP columns
//! `[r*F/tp, ...)`. Its weights are those of a Llama model with `H/tp`, `K/tp` and `F/tp`:
//! q, k, v, gate and up are row blocks of the full `(out, in)` matrices (column-parallel), o and
//! down are column blocks (row-parallel). Embedding, norms and LM head are replicated (the
//! vocabulary of the presets is small; a vocabulary-parallel head is future work).

use miles_core::BackendError;
use miles_core::model::{LlamaConfig, ParamKind, ParamLayout, TensorSpec};

use crate::error::invalid;

/// How a tensor is cut over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Each rank holds a block of rows (column-parallel linear layers).
    Rows,
    /// Each rank holds a block of columns (row-parallel linear layers).
    Cols,
}

/// How `kind` is cut.
pub fn split_of(kind: ParamKind) -> Split {
    match kind {
        ParamKind::QProj
        | ParamKind::KProj
        | ParamKind::VProj
        | ParamKind::GateProj
        | ParamKind::UpProj
        | ParamKind::QBias
        | ParamKind::KBias
        | ParamKind::VBias => Split::Rows,
        ParamKind::OProj | ParamKind::DownProj => Split::Cols,
        _ => Split::Replicated,
    }
}

/// The config of one tensor-parallel rank's shard of `config`.
///
/// # Errors
/// [`BackendError::Settings`] when `tp` is zero or does not divide the query heads, the key/value
/// heads or the MLP width, naming `--tensor-model-parallel-size`.
pub fn shard_config(config: &LlamaConfig, tp: usize) -> Result<LlamaConfig, BackendError> {
    if tp == 0 {
        return Err(invalid(
            "--tensor-model-parallel-size must be at least 1".to_string(),
        ));
    }
    for (what, n) in [
        ("attention heads", config.num_heads),
        ("key/value heads", config.num_kv_heads),
        ("intermediate size", config.intermediate_size),
    ] {
        if n % tp != 0 {
            return Err(invalid(format!(
                "--tensor-model-parallel-size {tp} does not divide the model's {n} {what}; pick a divisor of {}",
                gcd3(
                    config.num_heads,
                    config.num_kv_heads,
                    config.intermediate_size
                )
            )));
        }
    }
    let mut local = config.clone();
    local.num_heads /= tp;
    local.num_kv_heads /= tp;
    local.intermediate_size /= tp;
    Ok(local)
}

fn gcd3(a: usize, b: usize, c: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    gcd(gcd(a, b), c)
}

/// Copies rank `rank`'s shard of each full tensor into `local`.
pub fn scatter(
    full_layout: &ParamLayout,
    local_layout: &ParamLayout,
    full: &[f32],
    local: &mut [f32],
    rank: usize,
) {
    for (f, l) in full_layout.specs().iter().zip(local_layout.specs()) {
        let (src, dst) = (&full[f.range()], &mut local[l.range()]);
        match split_of(f.kind) {
            Split::Replicated => dst.copy_from_slice(src),
            Split::Rows => {
                let n = dst.len();
                dst.copy_from_slice(&src[rank * n..(rank + 1) * n]);
            }
            Split::Cols => {
                let (full_cols, cols) = (f.shape[1], l.shape[1]);
                for (drow, srow) in dst.chunks_exact_mut(cols).zip(src.chunks_exact(full_cols)) {
                    drow.copy_from_slice(&srow[rank * cols..(rank + 1) * cols]);
                }
            }
        }
    }
}

/// Assembles the full tensor `full_spec` from every tensor-parallel rank's local buffer
/// (`locals[r]` laid out by `local_layout`) into `out`.
pub fn gather_tensor(
    full_spec: &TensorSpec,
    local_spec: &TensorSpec,
    locals: &[Vec<f32>],
    out: &mut [f32],
) {
    match split_of(full_spec.kind) {
        Split::Replicated => out.copy_from_slice(&locals[0][local_spec.range()]),
        Split::Rows => {
            let n = local_spec.numel();
            for (block, local) in out.chunks_exact_mut(n).zip(locals) {
                block.copy_from_slice(&local[local_spec.range()]);
            }
        }
        Split::Cols => {
            let (full_cols, cols) = (full_spec.shape[1], local_spec.shape[1]);
            for (rank, local) in locals.iter().enumerate() {
                let src = &local[local_spec.range()];
                for (orow, srow) in out.chunks_exact_mut(full_cols).zip(src.chunks_exact(cols)) {
                    orow[rank * cols..(rank + 1) * cols].copy_from_slice(srow);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_then_gather_rebuilds_every_tensor() {
        let config = LlamaConfig::preset("tiny").unwrap();
        let full_layout = ParamLayout::new(&config);
        let full: Vec<f32> = (0..full_layout.len())
            .map(|i| i as f32 * 0.5 + 1.0)
            .collect();
        let tp = 2;
        let local_layout = ParamLayout::new(&shard_config(&config, tp).unwrap());
        let locals: Vec<Vec<f32>> = (0..tp)
            .map(|r| {
                let mut local = vec![0.0; local_layout.len()];
                scatter(&full_layout, &local_layout, &full, &mut local, r);
                local
            })
            .collect();
        let mut rebuilt = vec![0.0; full_layout.len()];
        for (f, l) in full_layout.specs().iter().zip(local_layout.specs()) {
            gather_tensor(f, l, &locals, &mut rebuilt[f.range()]);
        }
        assert_eq!(rebuilt, full);
        assert_ne!(locals[0], locals[1]);
    }

    #[test]
    fn a_tensor_parallel_size_that_does_not_divide_the_heads_is_a_clear_error() {
        let config = LlamaConfig::preset("tiny").unwrap();
        let err = shard_config(&config, 3).unwrap_err().to_string();
        assert!(
            err.contains("does not divide") && err.contains("heads"),
            "{err}"
        );
    }
}
