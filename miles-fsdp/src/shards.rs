//! Where one rank's shards, gradient shards and AdamW moments live: in memory-manager regions of
//! the device (core offload moves them between steps), or in host memory under native CPU
//! offload, where only the unit being computed visits the device.
//!
//! The shards are the fp32 master weights: there is no separate low-precision copy, the CPU
//! device computes in fp32 on the gathered shards directly.

use miles_core::memory::{Buffer, MemoryError};
use miles_core::ops::{AdamWConfig, adamw_step};
use miles_core::{BackendError, Communicator};

use crate::units::Unit;

/// One rank's share of the optimizer's state, by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StatePart {
    /// The parameter shards (fp32 master weights).
    Params,
    /// AdamW's first moment.
    ExpAvg,
    /// AdamW's second moment.
    ExpAvgSq,
}

/// A rank's shards, gradient shards and moments, each one flat buffer laid out by the
/// [`UnitPlan`](crate::UnitPlan).
#[derive(Debug)]
pub(crate) enum ShardStore {
    /// In device regions: `params` under `Params`, `m` and `v` under `Optimizer`, `grads` under
    /// `Grads`; a later micro-batch's reduced gradient lands in `staging` (the gather region)
    /// before it is added to `grads`.
    Device {
        params: Buffer,
        grads: Buffer,
        m: Buffer,
        v: Buffer,
        staging: Buffer,
    },
    /// Native CPU offload: in host memory; a unit's shard crosses to the device through
    /// `staging` before the all-gather, and its reduced gradient comes back through it.
    Host {
        params: Vec<f32>,
        grads: Vec<f32>,
        m: Vec<f32>,
        v: Vec<f32>,
        staging: Buffer,
    },
}

impl ShardStore {
    /// All-gathers `unit`'s parameters from every rank's shard into `out` (its padded length).
    pub(crate) fn gather(
        &mut self,
        comm: &dyn Communicator,
        unit: &Unit,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        match self {
            ShardStore::Device { params, .. } => {
                let shards = params.view::<f32>()?;
                comm.all_gather(&shards[unit.shard_range()], out)?;
            }
            ShardStore::Host {
                params, staging, ..
            } => {
                let n = unit.shard_len;
                staging.view_mut::<f32>()?[..n].copy_from_slice(&params[unit.shard_range()]);
                comm.all_gather(&staging.view::<f32>()?[..n], out)?;
            }
        }
        Ok(())
    }

    /// Sums `unit`'s full gradient `full` (its padded length) over the ranks and keeps this
    /// rank's shard of the sum; with `accumulate`, adds it to the shard's gradient instead (a
    /// later micro-batch of the step).
    pub(crate) fn reduce_grads(
        &mut self,
        comm: &dyn Communicator,
        unit: &Unit,
        full: &[f32],
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let n = unit.shard_len;
        match self {
            ShardStore::Device { grads, staging, .. } => {
                let mut shards = grads.view_mut::<f32>()?;
                let shard = &mut shards[unit.shard_range()];
                if accumulate {
                    let mut part = staging.view_mut::<f32>()?;
                    comm.reduce_scatter_sum(full, &mut part[..n])?;
                    add_into(shard, &part[..n]);
                } else {
                    comm.reduce_scatter_sum(full, shard)?;
                }
            }
            ShardStore::Host { grads, staging, .. } => {
                let mut part = staging.view_mut::<f32>()?;
                comm.reduce_scatter_sum(full, &mut part[..n])?;
                let shard = &mut grads[unit.shard_range()];
                if accumulate {
                    add_into(shard, &part[..n]);
                } else {
                    shard.copy_from_slice(&part[..n]);
                }
            }
        }
        Ok(())
    }

    /// AdamW step `step` over the local shards with global-norm clipping: the squared norm of
    /// every rank's gradient shards is summed over the ranks, the clip factor applied to the
    /// local gradients, then AdamW runs (rayon) on the shards alone. Returns the global norm.
    pub(crate) fn optimizer_step(
        &mut self,
        comm: &dyn Communicator,
        adamw: &AdamWConfig,
        step: u64,
    ) -> Result<f32, BackendError> {
        match self {
            ShardStore::Device {
                params,
                grads,
                m,
                v,
                ..
            } => {
                let (mut p, mut g) = (params.view_mut::<f32>()?, grads.view_mut::<f32>()?);
                let (mut m, mut v) = (m.view_mut::<f32>()?, v.view_mut::<f32>()?);
                clipped_step(comm, adamw, step, &mut p, &mut g, &mut m, &mut v)
            }
            ShardStore::Host {
                params,
                grads,
                m,
                v,
                ..
            } => clipped_step(comm, adamw, step, params, grads, m, v),
        }
    }

    /// A copy of `part`'s shard of `unit`.
    pub(crate) fn shard(&self, part: StatePart, unit: &Unit) -> Result<Vec<f32>, MemoryError> {
        let range = unit.shard_range();
        Ok(match (self, part) {
            (ShardStore::Device { params, .. }, StatePart::Params) => {
                params.view::<f32>()?[range].to_vec()
            }
            (ShardStore::Device { m, .. }, StatePart::ExpAvg) => m.view::<f32>()?[range].to_vec(),
            (ShardStore::Device { v, .. }, StatePart::ExpAvgSq) => v.view::<f32>()?[range].to_vec(),
            (ShardStore::Host { params, .. }, StatePart::Params) => params[range].to_vec(),
            (ShardStore::Host { m, .. }, StatePart::ExpAvg) => m[range].to_vec(),
            (ShardStore::Host { v, .. }, StatePart::ExpAvgSq) => v[range].to_vec(),
        })
    }

    /// Overwrites the whole flat buffer of `part` with `shards`.
    pub(crate) fn set_all(&mut self, part: StatePart, shards: &[f32]) -> Result<(), MemoryError> {
        match (self, part) {
            (ShardStore::Device { params: b, .. }, StatePart::Params)
            | (ShardStore::Device { m: b, .. }, StatePart::ExpAvg)
            | (ShardStore::Device { v: b, .. }, StatePart::ExpAvgSq) => {
                b.view_mut::<f32>()?.copy_from_slice(shards);
            }
            (ShardStore::Host { params: b, .. }, StatePart::Params)
            | (ShardStore::Host { m: b, .. }, StatePart::ExpAvg)
            | (ShardStore::Host { v: b, .. }, StatePart::ExpAvgSq) => b.copy_from_slice(shards),
        }
        Ok(())
    }
}

/// `dst += src`, element by element.
fn add_into(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}

/// Global-norm clipping over the ranks, then AdamW over the local shard.
///
/// The clip factor multiplies the gradients here and AdamW runs without clipping, which is the
/// same f32 product `adamw_step` forms when it clips itself.
fn clipped_step(
    comm: &dyn Communicator,
    adamw: &AdamWConfig,
    step: u64,
    params: &mut [f32],
    grads: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
) -> Result<f32, BackendError> {
    let local: f64 = grads.iter().map(|&g| f64::from(g) * f64::from(g)).sum();
    // The f64 partial sum travels as two f32s (high and low parts) so the global sum keeps
    // close to f64 precision over an f32 collective.
    let high = local as f32;
    let mut parts = [high, (local - f64::from(high)) as f32];
    comm.all_reduce_sum(&mut parts)?;
    let grad_norm = (f64::from(parts[0]) + f64::from(parts[1])).sqrt() as f32;
    if let Some(max) = adamw.max_grad_norm {
        let clip_scale = (max / (grad_norm + 1e-6)).min(1.0);
        if clip_scale < 1.0 {
            grads.iter_mut().for_each(|g| *g *= clip_scale);
        }
    }
    let unclipped = AdamWConfig {
        max_grad_norm: None,
        ..*adamw
    };
    adamw_step(params, grads, m, v, step, &unclipped);
    Ok(grad_norm)
}
