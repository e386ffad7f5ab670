//! Checkpoints as Hugging Face writes them: `config.json` plus `model.safetensors` (or shards
//! named by `model.safetensors.index.json`) with the family's tensor names, so
//! `transformers.AutoModelForCausalLM.from_pretrained(dir)` loads them unchanged; the tokenizer
//! files beside; a trainer's fp32 master weights in a folder of their own.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use super::{LlamaConfig, ModelError, ParamLayout, TensorSpec};
use crate::config::SaveDtype;
use crate::device::MappedFile;

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ModelError + 'a {
    move |source| ModelError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// The config file of a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";
/// The weights file of a checkpoint directory that holds one.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of a checkpoint whose weights are sharded over several files.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Where a trainer's checkpoint keeps its fp32 master weights (beside the Hugging Face files, in
/// a folder that transformers, vLLM and SGLang do not look into), so that `--load` resumes
/// bit for bit whatever dtype the Hugging Face weights were saved in.
pub const MASTER_FILE: &str = "miles_state/master.safetensors";
/// The tokenizer files of a Hugging Face directory, copied into every checkpoint saved from it.
pub const TOKENIZER_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
];

/// How weights of each save dtype are stored.
impl SaveDtype {
    /// The `torch_dtype` of config.json.
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::Bf16 => "bfloat16",
            Self::Fp32 => "float32",
        }
    }

    fn dtype(self) -> Dtype {
        match self {
            Self::Bf16 => Dtype::BF16,
            Self::Fp32 => Dtype::F32,
        }
    }

    fn bytes(self) -> usize {
        match self {
            Self::Bf16 => 2,
            Self::Fp32 => 4,
        }
    }

    fn encode(self, values: &[f32]) -> Encoded<'_> {
        match self {
            Self::Bf16 => Encoded::Bf16(values.iter().map(|&x| half::bf16::from_f32(x)).collect()),
            Self::Fp32 => Encoded::Fp32(values),
        }
    }
}

// safetensors files are little-endian, and the writers hand them values' memory as it is.
#[cfg(not(target_endian = "little"))]
compile_error!("miles writes safetensors files from memory, which must be little-endian");

/// A tensor's values in the dtype a file stores: fp32 as they are (no copy), or rounded to bf16.
enum Encoded<'a> {
    Fp32(&'a [f32]),
    Bf16(Vec<half::bf16>),
}

impl Encoded<'_> {
    /// The bytes a safetensors file holds for them.
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Fp32(values) => bytemuck::cast_slice(values),
            Self::Bf16(values) => bytemuck::cast_slice(values),
        }
    }
}

/// How a checkpoint's Hugging Face weights are written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaveOptions {
    /// The dtype of the weights.
    pub dtype: SaveDtype,
    /// Bytes per safetensors file at most (a larger tensor gets a file of its own); above it
    /// the weights are sharded with an index, as transformers shards them.
    pub shard_bytes: u64,
    /// A Hugging Face directory whose tokenizer files are copied beside the weights.
    pub tokenizer_from: Option<PathBuf>,
}

/// The default shard size of transformers' `save_pretrained`: 5 GB.
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            dtype: SaveDtype::Bf16,
            shard_bytes: DEFAULT_SHARD_BYTES,
            tokenizer_from: None,
        }
    }
}

/// Writes a trainer's checkpoint of `params` (laid out by `layout`) and `config` into `dir`,
/// creating it: the Hugging Face files (config.json and bf16 safetensors, sharded above 5 GB)
/// and the fp32 master weights in [`MASTER_FILE`]. [`export_hf`] rewrites the Hugging Face
/// files in another dtype or shard size.
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
    let master = dir.join(MASTER_FILE);
    if let Some(parent) = master.parent() {
        std::fs::create_dir_all(parent).map_err(io("create", parent))?;
    }
    write_specs(&master, layout, params, SaveDtype::Fp32)?;
    write_hf(dir, config, layout, params, &SaveOptions::default())
}

/// Writes `params` as a Hugging Face directory `dir` (created if missing) under `options`:
/// config.json with the dtype, the weights in one file or sharded with an index (stale weight
/// files of the other form removed), and the tokenizer files of `options.tokenizer_from`; then
/// syncs `dir` to the disk ([`sync_tree`]).
///
/// # Errors
/// As [`save_checkpoint`].
pub fn write_hf(
    dir: &Path,
    config: &LlamaConfig,
    layout: &ParamLayout,
    params: &[f32],
    options: &SaveOptions,
) -> Result<(), ModelError> {
    layout.check("params", params)?;
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    let element = options.dtype.bytes() as u64;
    let mut shards: Vec<Vec<&TensorSpec>> = vec![Vec::new()];
    let mut bytes = 0u64;
    for spec in layout.specs() {
        let size = spec.numel() as u64 * element;
        let current = shards.last().map_or(0, Vec::len);
        if current > 0 && bytes + size > options.shard_bytes {
            shards.push(Vec::new());
            bytes = 0;
        }
        bytes += size;
        if let Some(last) = shards.last_mut() {
            last.push(spec);
        }
    }
    remove_weight_files(dir)?;
    if shards.len() == 1 {
        write_specs(&dir.join(WEIGHTS_FILE), layout, params, options.dtype)?;
    } else {
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        for (i, shard) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            let sub = ParamLayout::subset(shard);
            write_specs(&dir.join(&name), &sub, params, options.dtype)?;
            for spec in shard {
                weight_map.insert(spec.name.clone(), serde_json::Value::String(name.clone()));
            }
        }
        let total = layout.len() as u64 * element;
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let path = dir.join(INDEX_FILE);
        let text = serde_json::to_string_pretty(&index).unwrap_or_default();
        std::fs::write(&path, text + "\n").map_err(io("write", &path))?;
    }
    let config_path = dir.join(CONFIG_FILE);
    std::fs::write(
        &config_path,
        config.to_json_string_in(options.dtype.torch_name()),
    )
    .map_err(io("write", &config_path))?;
    if let Some(from) = &options.tokenizer_from {
        copy_tokenizer_files(from, dir)?;
    }
    sync_tree(dir, &|action, path, source| io(action, path)(source))
}

/// Rewrites the Hugging Face files of the trainer's checkpoint `dir` (made by
/// [`save_checkpoint`]) under `options`, from its fp32 master weights; the master weights stay.
///
/// # Errors
/// As [`load_config`], [`save_checkpoint`].
pub fn export_hf(dir: &Path, options: &SaveOptions) -> Result<(), ModelError> {
    let config = load_config(dir)?;
    let layout = ParamLayout::new(&config);
    let mut params = alloc_params(layout.len())?;
    load_params(dir, &layout, &mut params)?;
    write_hf(dir, &config, &layout, &params, options)
}

/// Flushes the file or directory `path` to the disk.
///
/// # Errors
/// The system's error.
pub fn sync_file(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all())
}

/// Flushes every file and directory under `dir`, and `dir` itself, to the disk (safetensors
/// and `std::fs::write` leave what they write in the page cache), reporting a failure as
/// `error(action, path, cause)`.
///
/// # Errors
/// `error`'s, for the entry that could not be listed, inspected or synced.
pub fn sync_tree<E>(
    dir: &Path,
    error: &impl Fn(&'static str, &Path, std::io::Error) -> E,
) -> Result<(), E> {
    for entry in std::fs::read_dir(dir).map_err(|e| error("list", dir, e))? {
        let path = entry.map_err(|e| error("list", dir, e))?.path();
        let kind = std::fs::symlink_metadata(&path).map_err(|e| error("inspect", &path, e))?;
        if kind.is_dir() {
            sync_tree(&path, error)?;
        } else if kind.is_file() {
            sync_file(&path).map_err(|e| error("sync", &path, e))?;
        }
    }
    sync_file(dir).map_err(|e| error("sync", dir, e))
}

/// Copies every tokenizer file of `from` that exists into `to`.
///
/// # Errors
/// [`ModelError::Io`] naming the file.
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<(), ModelError> {
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.is_file() && from != to {
            std::fs::copy(&src, to.join(name)).map_err(io("copy", &src))?;
        }
    }
    Ok(())
}

/// Removes `dir`'s Hugging Face weight files (one file, an index and its shards).
fn remove_weight_files(dir: &Path) -> Result<(), ModelError> {
    let entries = std::fs::read_dir(dir).map_err(io("list", dir))?;
    for entry in entries {
        let entry = entry.map_err(io("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let shard = name.starts_with("model-") && name.ends_with(".safetensors");
        if shard || name == WEIGHTS_FILE || name == INDEX_FILE {
            std::fs::remove_file(entry.path()).map_err(io("remove", &entry.path()))?;
        }
    }
    Ok(())
}

/// Writes the tensors `layout` lists (their offsets index `params`) into one safetensors file.
fn write_specs(
    path: &Path,
    layout: &ParamLayout,
    params: &[f32],
    dtype: SaveDtype,
) -> Result<(), ModelError> {
    let encoded: Vec<Encoded<'_>> = layout
        .specs()
        .iter()
        .map(|s| dtype.encode(&params[s.range()]))
        .collect();
    let st_err = |e: safetensors::SafeTensorError| ModelError::Safetensors {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let mut views = Vec::with_capacity(encoded.len());
    for (spec, data) in layout.specs().iter().zip(&encoded) {
        views.push((
            spec.name.clone(),
            TensorView::new(dtype.dtype(), spec.shape.clone(), data.bytes()).map_err(st_err)?,
        ));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(st_err)
}

/// A zeroed parameter buffer of `len` elements, or an error when the machine cannot hold it.
///
/// # Errors
/// [`ModelError::OutOfMemory`].
pub fn alloc_params(len: usize) -> Result<Vec<f32>, ModelError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| ModelError::OutOfMemory {
            what: "the parameters",
            bytes: (len as u64).saturating_mul(4),
        })?;
    v.resize(len, 0.0);
    Ok(v)
}

/// Reads the `config.json` of checkpoint `dir`.
///
/// # Errors
/// As [`LlamaConfig::from_file`].
pub fn load_config(dir: &Path) -> Result<LlamaConfig, ModelError> {
    LlamaConfig::from_file(&dir.join(CONFIG_FILE))
}

/// Reads the weights of checkpoint `dir` into `params`, laid out by `layout`: the fp32 master
/// weights of a trainer's checkpoint when it has them ([`MASTER_FILE`]), else its Hugging Face
/// weights ([`load_hf_params`]).
///
/// # Errors
/// As [`load_hf_params`].
pub fn load_params(dir: &Path, layout: &ParamLayout, params: &mut [f32]) -> Result<(), ModelError> {
    let master = dir.join(MASTER_FILE);
    if master.exists() {
        layout.check("params", params)?;
        return read_files(&[master], layout, Some(params), None).map(|_| ());
    }
    load_hf_params(dir, layout, params)
}

/// Reads the Hugging Face weights of `dir` (`model.safetensors`, or the shards that
/// `model.safetensors.index.json` names) into `params`, laid out by `layout`; each file is
/// memory-mapped and only its tensors' bytes are read, after its header has been checked
/// against the file's size.
///
/// Every tensor of the layout must be present once with its shape, and no other tensor may be
/// (an `lm_head.weight` of a tied model and rotary `inv_freq` buffers are skipped, as
/// transformers skips them); float32, bfloat16 and float16 tensors are read (the last two
/// widened to float32).
///
/// # Errors
/// [`ModelError::CheckpointMismatch`] listing every missing, unexpected, misshapen or
/// wrongly typed tensor by name with both shapes; [`ModelError::Io`] or
/// [`ModelError::Safetensors`] for a missing or unreadable file; [`ModelError::Config`] for
/// an index naming a file outside `dir`.
pub fn load_hf_params(
    dir: &Path,
    layout: &ParamLayout,
    params: &mut [f32],
) -> Result<(), ModelError> {
    layout.check("params", params)?;
    read_hf(dir, layout, Some(params)).map(|_| ())
}

/// What the Hugging Face weights of `dir` hold, checked against `layout` from the files'
/// headers alone (no tensor is read).
///
/// # Errors
/// As [`load_hf_params`].
pub fn inspect_hf_weights(dir: &Path, layout: &ParamLayout) -> Result<WeightsSummary, ModelError> {
    read_hf(dir, layout, None)
}

/// The weight files of a Hugging Face directory and the dtypes of their tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightsSummary {
    /// The safetensors files, in the order read.
    pub files: Vec<PathBuf>,
    /// Tensors of each dtype (`BF16`, `F32`, ...).
    pub dtypes: BTreeMap<String, usize>,
}

/// Checks (and, given `params`, reads) the Hugging Face weights of `dir`.
fn read_hf(
    dir: &Path,
    layout: &ParamLayout,
    params: Option<&mut [f32]>,
) -> Result<WeightsSummary, ModelError> {
    let index_path = dir.join(INDEX_FILE);
    if !index_path.exists() {
        let files = vec![dir.join(WEIGHTS_FILE)];
        let dtypes = read_files(&files, layout, params, None)?;
        return Ok(WeightsSummary { files, dtypes });
    }
    let text = super::config::read_small_file(&index_path, 64 << 20)?;
    let index: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: index_path.clone(),
            source,
        })?;
    let Some(map) = index.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(ModelError::Config(format!(
            "{} has no weight_map object",
            index_path.display()
        )));
    };
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            return Err(ModelError::Config(format!(
                "{}: weight_map.{tensor} is not a file name",
                index_path.display()
            )));
        };
        let plain = !file.is_empty()
            && !file.contains('/')
            && !file.contains('\\')
            && file != "."
            && file != "..";
        if !plain {
            return Err(ModelError::Config(format!(
                "{}: weight_map.{tensor} = \"{file}\" is not a file name inside the checkpoint",
                index_path.display()
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
    let dtypes = read_files(&paths, layout, params, Some(&index_path))?;
    Ok(WeightsSummary {
        files: paths,
        dtypes,
    })
}

/// Checks the tensors of `files` against `layout` and, given `params`, reads them into it;
/// returns the count of tensors of each dtype. `index` names the index file in messages.
fn read_files(
    files: &[PathBuf],
    layout: &ParamLayout,
    mut params: Option<&mut [f32]>,
    index: Option<&Path>,
) -> Result<BTreeMap<String, usize>, ModelError> {
    let mut dtypes = BTreeMap::new();
    let by_name: HashMap<&str, &TensorSpec> = layout
        .specs()
        .iter()
        .map(|s| (s.name.as_str(), s))
        .collect();
    let tied = !layout
        .specs()
        .iter()
        .any(|s| s.kind == super::ParamKind::LmHead);
    let mut seen: HashMap<&str, &Path> = HashMap::new();
    let mut problems = Vec::new();
    for path in files {
        let map = MappedFile::open(path).map_err(io("read", path))?;
        let st = SafeTensors::deserialize(map.bytes()).map_err(|e| ModelError::Safetensors {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let mut names = st.names();
        names.sort_unstable();
        for name in names {
            let Some(spec) = by_name.get(name) else {
                let skipped =
                    (tied && name == "lm_head.weight") || name.ends_with("rotary_emb.inv_freq");
                if !skipped {
                    problems.push(format!("unexpected tensor {name} in {}", path.display()));
                }
                continue;
            };
            if let Some(first) = seen.insert(&spec.name, path) {
                problems.push(format!(
                    "tensor {name} is in both {} and {}",
                    first.display(),
                    path.display()
                ));
                continue;
            }
            let Ok(t) = st.tensor(name) else {
                continue;
            };
            if t.shape() != spec.shape.as_slice() {
                problems.push(format!(
                    "{name} has shape {:?} in the file, the config needs {:?}",
                    t.shape(),
                    spec.shape
                ));
                continue;
            }
            *dtypes.entry(format!("{:?}", t.dtype())).or_insert(0) += 1;
            let Some(params) = params.as_deref_mut() else {
                if !matches!(t.dtype(), Dtype::F32 | Dtype::BF16 | Dtype::F16) {
                    problems.push(format!(
                        "{name} has dtype {:?}, expected F32, BF16 or F16",
                        t.dtype()
                    ));
                }
                continue;
            };
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
                    "{name} has dtype {other:?}, expected F32, BF16 or F16"
                )),
            }
        }
    }
    for spec in layout.specs() {
        if !seen.contains_key(spec.name.as_str()) {
            problems.push(format!(
                "missing tensor {} of shape {:?}",
                spec.name, spec.shape
            ));
        }
    }
    if !problems.is_empty() {
        return Err(ModelError::CheckpointMismatch {
            path: index.map_or_else(|| files[0].clone(), Path::to_path_buf),
            problems: problems.join("; "),
        });
    }
    Ok(dtypes)
}

/// Reads a whole checkpoint: its config and a fresh parameter buffer (its master weights when
/// it has them, as [`load_params`]).
///
/// # Errors
/// As [`load_config`] and [`load_params`]; [`ModelError::OutOfMemory`].
pub fn load_checkpoint(dir: &Path) -> Result<(LlamaConfig, Vec<f32>), ModelError> {
    let config = load_config(dir)?;
    let layout = ParamLayout::new(&config);
    let mut params = alloc_params(layout.len())?;
    load_params(dir, &layout, &mut params)?;
    Ok((config, params))
}

/// Reads a Hugging Face directory as transformers would: its config and its Hugging Face
/// weights (never master weights beside them).
///
/// # Errors
/// As [`load_config`] and [`load_hf_params`]; [`ModelError::OutOfMemory`].
pub fn load_hf_checkpoint(dir: &Path) -> Result<(LlamaConfig, Vec<f32>), ModelError> {
    let config = load_config(dir)?;
    let layout = ParamLayout::new(&config);
    let mut params = alloc_params(layout.len())?;
    load_hf_params(dir, &layout, &mut params)?;
    Ok((config, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::init_params;

    #[test]
    fn sync_tree_flushes_a_nested_checkpoint_and_names_a_directory_it_cannot_list() {
        let save = tempfile::tempdir().unwrap();
        let actor = save.path().join("step-00000001").join("actor");
        std::fs::create_dir_all(actor.join("optimizer")).unwrap();
        std::fs::write(actor.join(WEIGHTS_FILE), b"weights").unwrap();
        std::fs::write(
            actor.join("optimizer").join("rank-0.safetensors"),
            b"moments",
        )
        .unwrap();
        let error = |action, path: &Path, _| (action, path.to_path_buf());
        sync_tree(save.path(), &error).unwrap();
        let gone = save.path().join("step-00000002");
        assert_eq!(sync_tree(&gone, &error), Err(("list", gone.clone())));
    }

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
        let err = load_hf_params(dir.path(), &layout, &mut buf)
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
        let (c2, loaded) = load_hf_checkpoint(dir.path()).unwrap();
        assert_eq!(c, c2);
        for (a, b) in params.iter().zip(&loaded) {
            assert_eq!(half::bf16::from_f32(*a).to_f32().to_bits(), b.to_bits());
        }
    }

    fn family_params(family: &str) -> (LlamaConfig, ParamLayout, Vec<f32>) {
        let c = crate::model::family_tests::family_config(family);
        let layout = ParamLayout::new(&c);
        let params: Vec<f32> = (0..layout.len())
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1.37e-3)
            .collect();
        (c, layout, params)
    }

    #[test]
    fn sharded_bf16_save_then_load_is_bit_exact_in_bf16_for_every_family() {
        for family in ["llama", "qwen2", "qwen3", "mistral"] {
            let dir = tempfile::tempdir().unwrap();
            let (c, layout, params) = family_params(family);
            // 60% of the bf16 bytes: two files.
            let half_size = (layout.len() * 2 * 6 / 10) as u64;
            let options = SaveOptions {
                shard_bytes: half_size,
                ..SaveOptions::default()
            };
            write_hf(dir.path(), &c, &layout, &params, &options).unwrap();
            assert!(dir.path().join(INDEX_FILE).exists(), "{family}");
            assert!(
                dir.path().join("model-00002-of-00002.safetensors").exists(),
                "{family}"
            );
            assert!(!dir.path().join(WEIGHTS_FILE).exists(), "{family}");
            let (c2, loaded) = load_hf_checkpoint(dir.path()).unwrap();
            assert_eq!(c, c2, "{family}");
            for (a, b) in params.iter().zip(&loaded) {
                assert_eq!(half::bf16::from_f32(*a).to_f32().to_bits(), b.to_bits());
            }
            let text = std::fs::read_to_string(dir.path().join(CONFIG_FILE)).unwrap();
            assert!(text.contains("\"torch_dtype\": \"bfloat16\""), "{text}");
            // Saving what was loaded gives the same bytes again.
            let again = tempfile::tempdir().unwrap();
            write_hf(again.path(), &c2, &layout, &loaded, &options).unwrap();
            for name in [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
            ] {
                let a = std::fs::read(dir.path().join(name)).unwrap();
                let b = std::fs::read(again.path().join(name)).unwrap();
                assert!(a == b, "{family}: {name} differs");
            }
        }
    }

    #[test]
    fn a_trainer_checkpoint_resumes_from_fp32_master_weights_and_exports_fp32_on_request() {
        let dir = tempfile::tempdir().unwrap();
        let (c, layout, params) = family_params("qwen3");
        save_checkpoint(dir.path(), &c, &layout, &params).unwrap();
        let (_, resumed) = load_checkpoint(dir.path()).unwrap();
        assert!(
            params
                .iter()
                .zip(&resumed)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        let (_, hf) = load_hf_checkpoint(dir.path()).unwrap();
        assert_ne!(hf, params, "the hugging face weights are bf16");
        let options = SaveOptions {
            dtype: SaveDtype::Fp32,
            ..SaveOptions::default()
        };
        export_hf(dir.path(), &options).unwrap();
        let (_, hf) = load_hf_checkpoint(dir.path()).unwrap();
        assert!(
            params
                .iter()
                .zip(&hf)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }

    #[test]
    fn a_weights_file_that_is_a_device_or_a_sparse_file_is_refused_without_reading_it() {
        let dir = tempfile::tempdir().unwrap();
        let (c, layout, params) = family_params("llama");
        write_hf(dir.path(), &c, &layout, &params, &SaveOptions::default()).unwrap();
        let weights = dir.path().join(WEIGHTS_FILE);
        std::fs::remove_file(&weights).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &weights).unwrap();
        let mut buf = vec![0.0; layout.len()];
        let start = std::time::Instant::now();
        let err = load_hf_params(dir.path(), &layout, &mut buf)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a regular file"), "{err}");
        std::fs::remove_file(&weights).unwrap();
        let sparse = std::fs::File::create(&weights).unwrap();
        sparse.set_len(8 << 30).unwrap();
        let err = load_hf_params(dir.path(), &layout, &mut buf)
            .unwrap_err()
            .to_string();
        assert!(err.contains("model.safetensors"), "{err}");
        assert!(start.elapsed().as_secs() < 5, "took {:?}", start.elapsed());
    }

    #[test]
    fn an_index_naming_a_file_outside_the_checkpoint_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (c, layout, params) = family_params("qwen2");
        write_hf(
            dir.path(),
            &c,
            &layout,
            &params,
            &SaveOptions {
                shard_bytes: 1,
                ..SaveOptions::default()
            },
        )
        .unwrap();
        let index = dir.path().join(INDEX_FILE);
        let text = std::fs::read_to_string(&index).unwrap();
        std::fs::write(&index, text.replacen("model-00001", "../model-00001", 1)).unwrap();
        let mut buf = vec![0.0; layout.len()];
        let err = load_hf_params(dir.path(), &layout, &mut buf)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not a file name inside the checkpoint"),
            "{err}"
        );
    }
}
