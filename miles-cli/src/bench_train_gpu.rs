//! `miles bench train --device cuda`: the GPU trainer's forward + backward + AdamW tokens/s next
//! to a PyTorch eager implementation of the same shapes (fp32 master weights, bf16 autocast)
//! run in the same call, with matmul-softmax-matmul attention (`eager`, the same arithmetic as
//! ours) and with PyTorch's fused attention (`sdpa`).

use std::io::Write;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};
use miles_core::DeviceChoice;
use miles_core::model::{ByteTokenizer, ParamLayout, init_params};
use serde_json::Value;

use crate::bench_train::{BenchTrainArgs, text_batch};

/// Runs the GPU benchmark and its baselines and prints the figures and ratios.
///
/// # Errors
/// No GPU, a failure of the trainer, or a baseline that fails or prints no figure.
pub fn run(args: &BenchTrainArgs) -> anyhow::Result<()> {
    let config = args.preset.clone();
    let Some(gpu) = crate::gpu::gpu_for(DeviceChoice::Cuda)? else {
        bail!("--device cuda found no gpu");
    };
    let tokenizer = ByteTokenizer::from_config(&config)?;
    let (b, t) = (args.batch, args.seq);
    let owned = text_batch(&tokenizer, b, t);
    let batch = owned.view();
    let layout = ParamLayout::new(&config);
    let mut params = vec![0.0; layout.len()];
    init_params(&layout, &config, 0, &mut params)?;
    let mut trainer = crate::gpu::standalone_trainer(gpu, config.clone(), &params, b * t)?;
    drop(params);
    let mut step = 0;
    for _ in 0..args.warmup {
        step += 1;
        trainer.train_step(&batch, step).context("warmup step")?;
    }
    let start = Instant::now();
    let mut loss = 0.0;
    for _ in 0..args.steps {
        step += 1;
        loss = trainer.train_step(&batch, step)?.loss;
    }
    let seconds = start.elapsed().as_secs_f64();
    let ours = (args.steps * b * t) as f64 / seconds;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "bench train: {} parameters, batch {b} x seq {t}, {} timed steps on cuda, last loss {loss:.4}",
        layout.len(),
        args.steps
    )?;
    writeln!(
        out,
        "  miles forward+backward+AdamW: {ours:.0} tokens/s ({:.3} s/step)",
        seconds / args.steps as f64
    )?;
    drop(trainer);
    if args.no_baseline {
        return Ok(());
    }
    let config_file =
        std::env::temp_dir().join(format!("miles-bench-train-{}.json", std::process::id()));
    std::fs::write(&config_file, config.to_json_string())
        .with_context(|| format!("cannot write {}", config_file.display()))?;
    let baselines: anyhow::Result<Vec<Value>> = ["eager", "sdpa"]
        .iter()
        .map(|attn| torch_baseline(args, &config_file, attn))
        .collect();
    if let Err(error) = std::fs::remove_file(&config_file) {
        tracing::warn!(%error, file = %config_file.display(), "cannot remove the baseline's config");
    }
    for torch in baselines? {
        let attn = torch["attn"].as_str().unwrap_or("?").to_string();
        let theirs = torch["tokens_per_s"]
            .as_f64()
            .context("the baseline printed no tokens_per_s")?;
        writeln!(
            out,
            "  pytorch {} eager, attention {attn}: {theirs:.0} tokens/s ({:.3} s/step, loss {:.4}); ratio miles / pytorch {:.2}x",
            torch["torch"].as_str().unwrap_or("?"),
            torch["step_s"].as_f64().unwrap_or(f64::NAN),
            torch["loss"].as_f64().unwrap_or(f64::NAN),
            ours / theirs
        )?;
    }
    Ok(())
}

/// Runs the PyTorch script on the same shapes and returns its JSON figures.
fn torch_baseline(
    args: &BenchTrainArgs,
    config: &std::path::Path,
    attn: &str,
) -> anyhow::Result<Value> {
    let output = Command::new(&args.python)
        .arg(&args.torch_script)
        .arg("--config")
        .arg(config)
        .args(["--batch", &args.batch.to_string()])
        .args(["--seq", &args.seq.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--warmup", &args.warmup.max(1).to_string()])
        .args(["--attn", attn])
        .output()
        .with_context(|| {
            format!(
                "cannot run {} {}; give --python, or --no-baseline",
                args.python,
                args.torch_script.display()
            )
        })?;
    if !output.status.success() {
        bail!(
            "the pytorch baseline ({attn}) failed: {}",
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .unwrap_or("no output")
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("the baseline printed {line:?}"))
}
