//! Weight updates by name: tensors as the trainer sends them (Hugging Face name, shape, dtype,
//! data), checked all together against the parameter table, then written in buckets.

use std::collections::HashMap;
use std::time::Instant;

use half::{bf16, f16};
use miles_core::model::ParamLayout;
pub use safetensors::Dtype;

use crate::{Engine, InferError};

/// The elements of a [`NamedTensor`].
#[derive(Clone, Copy, Debug)]
pub enum TensorData<'a> {
    /// float32 elements.
    F32(&'a [f32]),
    /// Little-endian bytes of the tensor's dtype.
    Raw(&'a [u8]),
}

/// One tensor of a weight update.
#[derive(Clone, Copy, Debug)]
pub struct NamedTensor<'a> {
    /// Its Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: &'a str,
    /// Its shape, as Hugging Face stores it.
    pub shape: &'a [usize],
    /// The dtype of `data`: float32, or bfloat16 / float16 (widened exactly).
    pub dtype: Dtype,
    /// Its elements.
    pub data: TensorData<'a>,
}

impl<'a> NamedTensor<'a> {
    /// A float32 tensor.
    pub fn f32(name: &'a str, shape: &'a [usize], data: &'a [f32]) -> Self {
        Self {
            name,
            shape,
            dtype: Dtype::F32,
            data: TensorData::F32(data),
        }
    }
}

/// What one weight update did.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct WeightUpdateReport {
    /// Tensors written.
    pub tensors: usize,
    /// Bytes written into the weights buffer.
    pub bytes: u64,
    /// Buckets the tensors went in.
    pub buckets: usize,
    /// Wall time.
    pub seconds: f64,
    /// `bytes / seconds` in 10^9 bytes per second.
    pub gbps: f64,
}

/// Checks every tensor against `layout`; returns each tensor's index in the table, or every
/// mismatch.
fn check(layout: &ParamLayout, tensors: &[NamedTensor<'_>]) -> Result<Vec<usize>, InferError> {
    let by_name: HashMap<&str, usize> = layout
        .specs()
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    let mut problems = Vec::new();
    let mut seen = vec![false; layout.specs().len()];
    let mut indices = Vec::with_capacity(tensors.len());
    for t in tensors {
        let Some(&index) = by_name.get(t.name) else {
            problems.push(format!("{}: no such tensor in the model", t.name));
            continue;
        };
        indices.push(index);
        let spec = &layout.specs()[index];
        if std::mem::replace(&mut seen[index], true) {
            problems.push(format!("{}: sent twice", t.name));
        }
        if t.shape != spec.shape.as_slice() {
            problems.push(format!(
                "{}: shape {:?}, the model has {:?}",
                t.name, t.shape, spec.shape
            ));
            continue;
        }
        let numel = spec.numel();
        let fault = match (t.dtype, t.data) {
            (Dtype::F32, TensorData::F32(d)) if d.len() == numel => None,
            (Dtype::F32 | Dtype::BF16 | Dtype::F16, TensorData::Raw(b))
                if b.len() == numel * t.dtype.bitsize() / 8 =>
            {
                None
            }
            (Dtype::F32 | Dtype::BF16 | Dtype::F16, TensorData::Raw(b)) => Some(format!(
                "{} bytes of {:?}, the shape needs {}",
                b.len(),
                t.dtype,
                numel * t.dtype.bitsize() / 8
            )),
            (Dtype::F32, TensorData::F32(d)) => {
                Some(format!("{} elements, the shape needs {numel}", d.len()))
            }
            (dtype, TensorData::F32(_)) => Some(format!(
                "dtype {dtype:?} with float32 data; label float32 data F32"
            )),
            (dtype, TensorData::Raw(_)) => Some(format!(
                "dtype {dtype:?}, the engine takes F32, BF16 or F16"
            )),
        };
        if let Some(fault) = fault {
            problems.push(format!("{}: {fault}", t.name));
        }
    }
    if problems.is_empty() {
        Ok(indices)
    } else {
        Err(InferError::WeightMismatch { problems })
    }
}

/// The elements of `t` as float32, widened into `staging` when they are not float32 already.
fn elements<'a>(t: &NamedTensor<'a>, staging: &'a mut Vec<f32>) -> &'a [f32] {
    match t.data {
        TensorData::F32(d) => d,
        TensorData::Raw(bytes) => {
            staging.clear();
            match t.dtype {
                Dtype::BF16 => staging.extend(
                    bytes
                        .chunks_exact(2)
                        .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                ),
                Dtype::F16 => staging.extend(
                    bytes
                        .chunks_exact(2)
                        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
                ),
                _ => staging.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                ),
            }
            staging
        }
    }
}

/// Checks every tensor, then writes them in buckets of at most `bucket_bytes` of float32 (a
/// larger tensor goes alone); nothing changes on a mismatch.
///
/// # Errors
/// [`InferError::WeightMismatch`] listing every unknown name, wrong shape, dtype or length;
/// [`InferError::Offloaded`] while the weights are offloaded.
pub(crate) fn update_weights(
    engine: &mut Engine,
    tensors: &[NamedTensor<'_>],
    bucket_bytes: u64,
) -> Result<WeightUpdateReport, InferError> {
    let start = Instant::now();
    engine.check_resident("update weights", false)?;
    let indices = check(engine.layout(), tensors)?;
    let mut buckets = 0;
    let mut bytes = 0u64;
    let mut first = 0;
    while first < tensors.len() {
        let mut end = first;
        let mut size = 0u64;
        while end < tensors.len() {
            let len = engine.layout().specs()[indices[end]].numel() as u64 * 4;
            if end > first && size + len > bucket_bytes {
                break;
            }
            size += len;
            end += 1;
        }
        let mut staging: Vec<Vec<f32>> = vec![Vec::new(); end - first];
        let mut bucket = Vec::with_capacity(end - first);
        for ((t, &index), stage) in tensors[first..end]
            .iter()
            .zip(&indices[first..end])
            .zip(staging.iter_mut())
        {
            bucket.push((index, elements(t, stage)));
        }
        engine.write_tensors(&bucket)?;
        tracing::debug!(tensors = end - first, bytes = size, "weight bucket written");
        buckets += 1;
        bytes += size;
        first = end;
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(WeightUpdateReport {
        tensors: tensors.len(),
        bytes,
        buckets,
        seconds,
        gbps: if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        },
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use miles_core::model::LlamaConfig;
    use miles_core::{BackupPolicy, CpuDevice, Device, ManagerSettings, MemoryManager};

    use super::*;
    use crate::{EngineConfig, KvCapacity};

    fn engine() -> Engine {
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new(64 << 20));
        let settings = ManagerSettings {
            margin_bytes: 0,
            disk: None,
        };
        let memory = Arc::new(MemoryManager::new(device, settings).unwrap());
        let config = EngineConfig {
            block_size: 4,
            max_batch: 2,
            kv_capacity: KvCapacity::Blocks(8),
            weights_policy: BackupPolicy::Host,
            share_prompt_blocks: true,
            cuda_graphs: true,
            max_positions: None,
        };
        Engine::new(memory, LlamaConfig::preset("tiny").unwrap(), config).unwrap()
    }

    #[test]
    fn buckets_never_exceed_the_buffer_except_for_a_lone_large_tensor() {
        let mut engine = engine();
        let layout = engine.layout().clone();
        let params: Vec<f32> = (0..layout.len())
            .map(|i| (i % 97) as f32 * 0.01 + 0.5)
            .collect();
        let tensors: Vec<NamedTensor<'_>> = layout
            .specs()
            .iter()
            .map(|s| NamedTensor::f32(&s.name, &s.shape, &params[s.range()]))
            .collect();
        let sizes: Vec<u64> = layout
            .specs()
            .iter()
            .map(|s| s.numel() as u64 * 4)
            .collect();
        let largest = *sizes.iter().max().unwrap();
        // A bucket of the largest tensor: greedy packing in order, as the update does it.
        let mut want = 0;
        let mut fill = 0;
        for &size in &sizes {
            if fill == 0 || fill + size > largest {
                want += 1;
                fill = 0;
            }
            fill += size;
        }
        let report = update_weights(&mut engine, &tensors, largest).unwrap();
        assert_eq!(report.buckets, want);
        assert_eq!(report.bytes, sizes.iter().sum::<u64>());
        let one_each = update_weights(&mut engine, &tensors, 1).unwrap();
        assert_eq!(
            one_each.buckets,
            tensors.len(),
            "a tensor over the buffer goes alone"
        );
    }
}
