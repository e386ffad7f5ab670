//! `miles model init` and `miles model score`: make a checkpoint from a preset, score text with one.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use miles_core::DeviceChoice;
use miles_core::device::Gpu;
use miles_core::model::{
    ByteTokenizer, LlamaConfig, ParamLayout, Transformer, init_params, load_checkpoint,
    save_checkpoint, score_tokens, scoring_batch,
};

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
    /// Checkpoint directory to write (config.json and model.safetensors).
    #[arg(long)]
    pub out: PathBuf,
}

/// `miles model score`.
#[derive(Args, Debug)]
pub struct ScoreArgs {
    /// Checkpoint directory (config.json and model.safetensors).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The text to score; BOS is put in front of its bytes.
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
    }
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
    save_checkpoint(&args.out, &config, &layout, &params)
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
    let mut trainer = miles_core::model::standalone_gpu_trainer(gpu, config, params, batch.seq)?;
    Ok(trainer.logprobs(&batch)?)
}

fn score(args: ScoreArgs) -> anyhow::Result<()> {
    let (config, params) = load_checkpoint(&args.checkpoint)
        .with_context(|| format!("loading checkpoint {}", args.checkpoint.display()))?;
    let tokenizer = ByteTokenizer::from_config(&config)?;
    let tokens = tokenizer.encode(&args.text, true);
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
        let shown = match u8::try_from(id) {
            Ok(b) => std::ascii::escape_default(b).to_string(),
            Err(_) => format!("<{id}>"),
        };
        writeln!(out, "{:>5}  {id:>6}  {shown:<8}  {lp:.6}", i + 1)?;
    }
    writeln!(
        out,
        "mean loss {mean_loss:.6} over {} tokens",
        logprobs.len()
    )?;
    Ok(())
}
