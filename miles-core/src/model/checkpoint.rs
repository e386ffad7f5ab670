//! Checkpoints as Hugging Face writes them: `config.json` plus `model.safetensors` with Llama
//! tensor names, so `transformers.LlamaForCausalLM.from_pretrained(dir)` loads them unchanged.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use super::{LlamaConfig, ModelError, ParamLayout};

/// The config file of a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";
/// The weights file of a checkpoint directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ModelError + 'a {
    move |source| ModelError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `params` (laid out by `layout`) and `config` into `dir`, creating it.
///
/// Tensors are float32; the safetensors header carries `format: pt` as transformers expects.
///
/// # Errors
/// [`ModelError::BufferLength`], [`ModelError::Io`] or [`ModelError::Safetensors`].
pub fn save_checkpoint(
    dir: &Path,
    config: &LlamaConfig,
    layout: &ParamLayout,
    params: &[f32],
) -> Result<(), ModelError> {
    layout.check("params", params)?;
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    let bytes: Vec<Vec<u8>> = layout
        .specs()
        .iter()
        .map(|s| {
            params[s.range()]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect()
        })
        .collect();
    let weights_path = dir.join(WEIGHTS_FILE);
    let st_err = |e: safetensors::SafeTensorError| ModelError::Safetensors {
        path: weights_path.clone(),
        reason: e.to_string(),
    };
    let mut views = Vec::with_capacity(bytes.len());
    for (spec, data) in layout.specs().iter().zip(&bytes) {
        views.push((
            spec.name.clone(),
            TensorView::new(Dtype::F32, spec.shape.clone(), data).map_err(st_err)?,
        ));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &weights_path).map_err(st_err)?;
    let config_path = dir.join(CONFIG_FILE);
    std::fs::write(&config_path, config.to_json_string()).map_err(io("write", &config_path))
}

/// Reads the `config.json` of checkpoint `dir`.
///
/// # Errors
/// As [`LlamaConfig::from_file`].
pub fn load_config(dir: &Path) -> Result<LlamaConfig, ModelError> {
    LlamaConfig::from_file(&dir.join(CONFIG_FILE))
}

/// Reads `model.safetensors` of `dir` into `params`, laid out by `layout`.
///
/// Every tensor of the layout must be present with its shape, and no other tensor may be;
/// float32, bfloat16 and float16 tensors are read (the last two widened to float32).
///
/// # Errors
/// [`ModelError::CheckpointMismatch`] listing every missing, unexpected, misshapen or
/// wrongly typed tensor by name; [`ModelError::Io`] or [`ModelError::Safetensors`] for an
/// unreadable file.
pub fn load_params(dir: &Path, layout: &ParamLayout, params: &mut [f32]) -> Result<(), ModelError> {
    layout.check("params", params)?;
    let path: PathBuf = dir.join(WEIGHTS_FILE);
    let bytes = std::fs::read(&path).map_err(io("read", &path))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let mut problems = Vec::new();
    for spec in layout.specs() {
        let Ok(t) = st.tensor(&spec.name) else {
            problems.push(format!(
                "missing tensor {} of shape {:?}",
                spec.name, spec.shape
            ));
            continue;
        };
        if t.shape() != spec.shape.as_slice() {
            problems.push(format!(
                "{} has shape {:?} in the file, the config needs {:?}",
                spec.name,
                t.shape(),
                spec.shape
            ));
            continue;
        }
        let dst = &mut params[spec.range()];
        let data = t.data();
        match t.dtype() {
            Dtype::F32 => {
                for (d, b) in dst.iter_mut().zip(data.chunks_exact(4)) {
                    *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::BF16 => {
                for (d, b) in dst.iter_mut().zip(data.chunks_exact(2)) {
                    *d = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Dtype::F16 => {
                for (d, b) in dst.iter_mut().zip(data.chunks_exact(2)) {
                    *d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            other => problems.push(format!(
                "{} has dtype {other:?}, expected F32, BF16 or F16",
                spec.name
            )),
        }
    }
    let mut unexpected: Vec<&str> = st
        .names()
        .into_iter()
        .filter(|n| !layout.specs().iter().any(|s| s.name == *n))
        .collect();
    unexpected.sort_unstable();
    problems.extend(unexpected.iter().map(|n| format!("unexpected tensor {n}")));
    if !problems.is_empty() {
        return Err(ModelError::CheckpointMismatch {
            path,
            problems: problems.join("; "),
        });
    }
    Ok(())
}

/// Reads a whole checkpoint: its config and a fresh parameter buffer.
///
/// # Errors
/// As [`load_config`] and [`load_params`].
pub fn load_checkpoint(dir: &Path) -> Result<(LlamaConfig, Vec<f32>), ModelError> {
    let config = load_config(dir)?;
    let layout = ParamLayout::new(&config);
    let mut params = vec![0.0; layout.len()];
    load_params(dir, &layout, &mut params)?;
    Ok((config, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::init_params;

    fn tiny_checkpoint(dir: &Path) -> (LlamaConfig, ParamLayout, Vec<f32>) {
        let c = LlamaConfig::preset("tiny").unwrap();
        let layout = ParamLayout::new(&c);
        let mut params = vec![0.0; layout.len()];
        init_params(&layout, &c, 7, &mut params).unwrap();
        save_checkpoint(dir, &c, &layout, &params).unwrap();
        (c, layout, params)
    }

    #[test]
    fn save_then_load_gives_identical_parameters_and_config() {
        let dir = tempfile::tempdir().unwrap();
        let (c, _, params) = tiny_checkpoint(dir.path());
        let (c2, loaded) = load_checkpoint(dir.path()).unwrap();
        assert_eq!(c, c2);
        assert!(
            params
                .iter()
                .zip(&loaded)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }

    #[test]
    fn wrong_shape_and_missing_tensor_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let (_, layout, params) = tiny_checkpoint(dir.path());
        let path = dir.path().join(WEIGHTS_FILE);
        // Rewrite the file with k_proj of layer 1 misshapen and the final norm left out.
        let mut bytes = Vec::new();
        let mut entries = Vec::new();
        for s in layout.specs() {
            if s.name == "model.norm.weight" {
                continue;
            }
            let shape = if s.name == "model.layers.1.self_attn.k_proj.weight" {
                vec![s.shape[1], s.shape[0]]
            } else {
                s.shape.clone()
            };
            let data: Vec<u8> = params[s.range()]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            bytes.push(data);
            entries.push((s.name.clone(), shape));
        }
        let views: Vec<_> = entries
            .into_iter()
            .zip(&bytes)
            .map(|((n, shape), d)| (n, TensorView::new(Dtype::F32, shape, d).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let mut buf = vec![0.0; layout.len()];
        let err = load_params(dir.path(), &layout, &mut buf)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing tensor model.norm.weight"), "{err}");
        assert!(
            err.contains("model.layers.1.self_attn.k_proj.weight has shape [64, 32]"),
            "{err}"
        );
    }

    #[test]
    fn bfloat16_tensors_load_widened_to_float32() {
        let dir = tempfile::tempdir().unwrap();
        let (c, layout, params) = tiny_checkpoint(dir.path());
        let bytes: Vec<Vec<u8>> = layout
            .specs()
            .iter()
            .map(|s| {
                params[s.range()]
                    .iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect()
            })
            .collect();
        let views: Vec<_> = layout
            .specs()
            .iter()
            .zip(&bytes)
            .map(|(s, d)| {
                (
                    s.name.clone(),
                    TensorView::new(Dtype::BF16, s.shape.clone(), d).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.path().join(WEIGHTS_FILE)).unwrap();
        let (c2, loaded) = load_checkpoint(dir.path()).unwrap();
        assert_eq!(c, c2);
        for (a, b) in params.iter().zip(&loaded) {
            assert_eq!(half::bf16::from_f32(*a).to_f32().to_bits(), b.to_bits());
        }
    }
}
