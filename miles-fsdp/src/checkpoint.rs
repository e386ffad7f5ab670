//! The optimizer part of a checkpoint, beside the Hugging Face weights: `optimizer.safetensors`
//! (full, unsharded fp32 AdamW moments named `exp_avg.<hf name>` and `exp_avg_sq.<hf name>`)
//! and `trainer_state.json` (`{"step": N}`). Full tensors, so a checkpoint loads under any
//! data-parallel size and in the megatron backend.

use std::collections::HashMap;
use std::path::Path;

use miles_core::BackendError;
use miles_core::model::ParamLayout;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// The optimizer-state file of a checkpoint directory.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The trainer-state file (the step) of a checkpoint directory.
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";

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

fn bad(path: &Path, reason: String) -> BackendError {
    BackendError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    }
}

/// Writes `state` into `dir` (which must exist).
///
/// # Errors
/// [`BackendError::Io`] or [`BackendError::Checkpoint`] when a file cannot be written.
pub fn save_optimizer(
    dir: &Path,
    layout: &ParamLayout,
    state: &OptimizerState,
) -> Result<(), BackendError> {
    let path = dir.join(OPTIMIZER_FILE);
    let mut named = Vec::new();
    for (prefix, data) in [
        ("exp_avg", &state.exp_avg),
        ("exp_avg_sq", &state.exp_avg_sq),
    ] {
        for spec in layout.specs() {
            let bytes: Vec<u8> = data[spec.range()]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            named.push((format!("{prefix}.{}", spec.name), spec.shape.clone(), bytes));
        }
    }
    let mut views = Vec::with_capacity(named.len());
    for (name, shape, bytes) in &named {
        let view = TensorView::new(Dtype::F32, shape.clone(), bytes)
            .map_err(|e| bad(&path, e.to_string()))?;
        views.push((name.clone(), view));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &path)
        .map_err(|e| bad(&path, e.to_string()))?;
    let state_path = dir.join(TRAINER_STATE_FILE);
    let json = serde_json::json!({ "step": state.step });
    std::fs::write(&state_path, format!("{json}\n")).map_err(io("write", &state_path))
}

/// Reads the optimizer state of `dir`, or `None` when it holds no optimizer file (a plain
/// Hugging Face checkpoint).
///
/// # Errors
/// [`BackendError::Io`] for unreadable files; [`BackendError::Checkpoint`] naming every
/// missing or misshapen moment, or a bad trainer state.
pub fn load_optimizer(
    dir: &Path,
    layout: &ParamLayout,
) -> Result<Option<OptimizerState>, BackendError> {
    let path = dir.join(OPTIMIZER_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let bytes = std::fs::read(&path).map_err(io("read", &path))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(&path, e.to_string()))?;
    let mut problems = Vec::new();
    let mut read = |prefix: &str| {
        let mut out = vec![0.0f32; layout.len()];
        for spec in layout.specs() {
            let name = format!("{prefix}.{}", spec.name);
            match st.tensor(&name) {
                Ok(t) if t.dtype() == Dtype::F32 && t.shape() == spec.shape.as_slice() => {
                    for (d, b) in out[spec.range()].iter_mut().zip(t.data().chunks_exact(4)) {
                        *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
                Ok(t) => problems.push(format!(
                    "{name} is {:?} {:?}, expected F32 {:?}",
                    t.dtype(),
                    t.shape(),
                    spec.shape
                )),
                Err(_) => problems.push(format!("missing {name}")),
            }
        }
        out
    };
    let (exp_avg, exp_avg_sq) = (read("exp_avg"), read("exp_avg_sq"));
    if !problems.is_empty() {
        return Err(bad(&path, problems.join("; ")));
    }
    let state_path = dir.join(TRAINER_STATE_FILE);
    let text = std::fs::read_to_string(&state_path).map_err(io("read", &state_path))?;
    let step = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
        .ok_or_else(|| bad(&state_path, "expected {\"step\": <count>}".into()))?;
    Ok(Some(OptimizerState {
        exp_avg,
        exp_avg_sq,
        step,
    }))
}
