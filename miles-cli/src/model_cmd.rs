//! `miles model init`, `score` and `inspect`: make a checkpoint from a preset, score text with a
//! Hugging Face directory, say what a directory holds and what miles does not support in it.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use miles_core::DeviceChoice;
use miles_core::Settings;
use miles_core::config::SaveDtype;
use miles_core::device::Gpu;
use miles_core::model::{
    CONFIG_FILE, LlamaConfig, ModelError, ParamLayout, SaveOptions, Tokenizer, Transformer,
    alloc_params, init_params, inspect_hf_weights, load_hf_params, score_tokens, scoring_batch,
    write_hf,
};

use crate::settings_args::BadSettings;

/// `miles model ...`.
#[derive(Args, Debug)]
pub struct ModelArgs {
    /// What to do with a model.
    #[command(subcommand)]
    pub command: ModelCommand,
}

/// The model subcommands.
#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Initialise a model from a preset and write it as a Hugging Face checkpoint directory.
    Init(InitArgs),
    /// Print the log-prob of each token of a text under a checkpoint, and the mean loss.
    Score(ScoreArgs),
    /// Say what a Hugging Face directory holds: family, sizes, parameter count, weight dtypes,
    /// tokenizer and special tokens, chat template; exit 2 naming what miles does not support.
    Inspect(InspectArgs),
}

/// `miles model inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The Hugging Face directory.
    pub dir: PathBuf,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    pub json: bool,
}

/// `miles model init`.
#[derive(Args, Debug)]
pub struct InitArgs {
    /// Preset config: tiny, small, 0.5b, 1b or 3b.
    #[arg(long, default_value = "tiny", value_parser = parse_preset)]
    pub preset: LlamaConfig,
    /// Seed of the initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Standard deviation of the weight matrices (default: the preset's `initializer_range`);
    /// a large one gives sharp next-token distributions, useful to compare implementations.
    #[arg(long)]
    pub init_std: Option<f32>,
    /// Checkpoint directory to write (config.json and an fp32 model.safetensors).
    #[arg(long)]
    pub out: PathBuf,
}

/// `miles model score`.
#[derive(Args, Debug)]
pub struct ScoreArgs {
    /// Hugging Face directory: config.json, model.safetensors or its shards, and tokenizer.json
    /// (without one, the byte tokenizer of the config's special ids).
    #[arg(
        long = "hf-checkpoint",
        visible_alias = "checkpoint",
        value_name = "DIR"
    )]
    pub checkpoint: PathBuf,
    /// The text to score, with the tokenizer's special tokens (BOS first where it adds one).
    #[arg(long)]
    pub text: String,
    /// Print one JSON object: `tokens`, `logprobs`, `mean_loss`.
    #[arg(long)]
    pub json: bool,
    /// Which device scores: fp32 on the cpu, bf16 compute on cuda.
    #[arg(long, value_name = "auto|cpu|cuda", default_value = "cpu")]
    pub device: DeviceChoice,
}

/// Turns a preset name into its config, so an unknown name is a usage error (exit 2).
pub fn parse_preset(name: &str) -> Result<LlamaConfig, String> {
    LlamaConfig::preset(name).map_err(|e| e.to_string())
}

/// Runs a model subcommand.
///
/// # Errors
/// Any failure to build, read, write or score the model, with its context.
pub fn run(args: ModelArgs) -> anyhow::Result<()> {
    match args.command {
        ModelCommand::Init(a) => init(a),
        ModelCommand::Score(a) => score(a),
        ModelCommand::Inspect(a) => inspect(a),
    }
}

/// A model error that is the input's fault (a config miles does not compute, a checkpoint or
/// tokenizer that does not match it) as bad settings (exit 2); others stay failures.
pub fn bad_model(dir: &std::path::Path) -> impl Fn(ModelError) -> anyhow::Error + '_ {
    move |e| match e {
        ModelError::Config(_)
        | ModelError::Json { .. }
        | ModelError::CheckpointMismatch { .. }
        | ModelError::Tokenizer { .. }
        | ModelError::Safetensors { .. }
        | ModelError::Io { .. } => BadSettings(format!("{}: {e}", dir.display())).into(),
        other => anyhow::Error::new(other).context(format!("loading {}", dir.display())),
    }
}

/// The model a run computes ([`LlamaConfig::from_settings`]), a refused config being bad
/// settings (exit 2).
///
/// # Errors
/// [`BadSettings`] naming the flag and the field.
pub fn model_config(settings: &Settings) -> anyhow::Result<LlamaConfig> {
    LlamaConfig::from_settings(settings).map_err(|e| BadSettings(e.to_string()).into())
}

/// The config, tokenizer and Hugging Face weights of `dir`, every input problem bad settings.
///
/// # Errors
/// [`BadSettings`] for a config, tokenizer or weights miles refuses; a failure otherwise.
pub fn load_hf_dir(dir: &std::path::Path) -> anyhow::Result<(LlamaConfig, Tokenizer, Vec<f32>)> {
    let config = LlamaConfig::from_file(&dir.join(CONFIG_FILE)).map_err(bad_model(dir))?;
    let tokenizer = Tokenizer::from_dir(dir, &config).map_err(bad_model(dir))?;
    let layout = ParamLayout::new(&config);
    let mut params = alloc_params(layout.len())?;
    load_hf_params(dir, &layout, &mut params).map_err(bad_model(dir))?;
    Ok((config, tokenizer, params))
}

fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let dir = &args.dir;
    let config = LlamaConfig::from_file(&dir.join(CONFIG_FILE)).map_err(|e| {
        BadSettings(format!(
            "{}: miles does not support this model: {e}",
            dir.display()
        ))
    })?;
    let layout = ParamLayout::new(&config);
    let weights = inspect_hf_weights(dir, &layout).map_err(bad_model(dir))?;
    let tokenizer = Tokenizer::from_dir(dir, &config).map_err(bad_model(dir))?;
    let value = serde_json::json!({
        "dir": dir.display().to_string(),
        "model_type": config.family.model_type(),
        "architecture": config.family.architecture(),
        "parameters": config.param_count(),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": format!("{:?}", config.rope_scaling),
        "qkv_bias": config.qkv_bias,
        "qk_norm": config.qk_norm,
        "tie_word_embeddings": config.tie_word_embeddings,
        "weight_files": weights.files.len(),
        "dtypes": weights.dtypes,
        "tokenizer": tokenizer.kind_name(),
        "bos_token_id": tokenizer.bos(),
        "stop_token_ids": tokenizer.stop_tokens(),
        "pad_token_id": tokenizer.pad(),
        "chat_template": tokenizer.has_chat_template(),
        "cuda": config.check_gpu_support().err().map(|e| e.to_string()),
    });
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{value}")?;
        return Ok(());
    }
    if let serde_json::Value::Object(fields) = value {
        for (key, v) in fields {
            writeln!(out, "{key:<24} {v}")?;
        }
    }
    Ok(())
}

fn init(args: InitArgs) -> anyhow::Result<()> {
    let config = match args.init_std {
        Some(std) if std.is_finite() && std > 0.0 => args.preset.with_initializer_range(std),
        Some(std) => bail!("--init-std {std} must be positive and finite"),
        None => args.preset,
    };
    let layout = ParamLayout::new(&config);
    let mut params = vec![0.0; layout.len()];
    init_params(&layout, &config, args.seed, &mut params)?;
    // fp32, so that other implementations score exactly these weights.
    let options = SaveOptions {
        dtype: SaveDtype::Fp32,
        ..SaveOptions::default()
    };
    write_hf(&args.out, &config, &layout, &params, &options)
        .with_context(|| format!("writing checkpoint {}", args.out.display()))?;
    writeln!(
        std::io::stdout().lock(),
        "wrote {} ({} parameters, seed {})",
        args.out.display(),
        layout.len(),
        args.seed
    )?;
    Ok(())
}

/// [`score_tokens`] on the GPU: the checkpoint in a trainer's regions (bf16 weights, fp32
/// master copy), one forward pass.
fn score_on_gpu(
    gpu: Arc<Gpu>,
    config: LlamaConfig,
    params: &[f32],
    tokens: &[u32],
) -> anyhow::Result<(Vec<f32>, f32)> {
    let weights = vec![1.0; tokens.len().saturating_sub(1)];
    let batch = scoring_batch(tokens, &weights)?;
    let mut trainer = miles_core::model::standalone_gpu_trainer(
        gpu,
        config,
        params,
        batch.seq,
        miles_core::model::OptimizerShard::WHOLE,
    )?;
    Ok(trainer.logprobs(&batch)?)
}

fn score(args: ScoreArgs) -> anyhow::Result<()> {
    let (config, tokenizer, params) = load_hf_dir(&args.checkpoint)?;
    let tokens = tokenizer.encode(&args.text, true)?;
    if tokens.len() < 2 {
        return Err(BadSettings(format!(
            "--text {:?} is {} token(s); scoring needs at least two",
            args.text,
            tokens.len()
        ))
        .into());
    }
    let (logprobs, mean_loss) = match crate::gpu::gpu_for(args.device)? {
        None => score_tokens(&Transformer::new(config), &params, &tokens)?,
        Some(gpu) => score_on_gpu(gpu, config, &params, &tokens)?,
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        let value = serde_json::json!({
            "tokens": tokens,
            "logprobs": logprobs.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
            "mean_loss": f64::from(mean_loss),
        });
        writeln!(out, "{value}")?;
        return Ok(());
    }
    writeln!(out, "{:>5}  {:>6}  {:<8}  logprob", "pos", "id", "token")?;
    for (i, (&id, lp)) in tokens.iter().skip(1).zip(&logprobs).enumerate() {
        let shown = format!("{:?}", tokenizer.decode(&[id]));
        writeln!(out, "{:>5}  {id:>6}  {shown:<8}  {lp:.6}", i + 1)?;
    }
    writeln!(
        out,
        "mean loss {mean_loss:.6} over {} tokens",
        logprobs.len()
    )?;
    Ok(())
}
