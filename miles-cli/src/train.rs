//! `miles train`: the colocated RL loop (DESIGN section 8) on the backend named by
//! `--train-backend` and the rollout engine, with a progress bar on a terminal and log lines
//! otherwise; Ctrl-C stops it after the phase in progress.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use miles_core::config::{AdvantageEstimator, Settings};
use miles_core::model::{ByteTokenizer, LlamaConfig};
use miles_core::orchestrator::{Critic, LmCritic, LoopConfig, Orchestrator, RolloutEngine};
use miles_core::{StepMetrics, backend::TrainBackend};

use crate::settings_args::SettingsArgs;

/// `miles train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Every setting, as flags or from `--config`.
    #[command(flatten)]
    pub settings: SettingsArgs,
}

/// Runs the loop and prints where its metrics went.
///
/// # Errors
/// Bad settings (exit status 2), or what the loop hit.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let settings = args.settings.load()?;
    let model = LlamaConfig::preset(&settings.preset)
        .with_context(|| format!("cannot build model preset `{}`", settings.preset))?;
    let tokenizer = ByteTokenizer::from_config(&model)?;
    let engine = build_engine(&settings, &model)?;
    let actor = build_actor(&settings)?;
    let critic = build_critic(&settings, tokenizer.pad)?;
    let stop = Arc::new(AtomicBool::new(false));
    let handler_flag = Arc::clone(&stop);
    ctrlc::set_handler(move || {
        handler_flag.store(true, Ordering::SeqCst);
        tracing::warn!("ctrl-c: stopping after the phase in progress");
    })
    .context("cannot install the ctrl-c handler")?;
    let mut orchestrator = Orchestrator::new(
        LoopConfig::from_settings(&settings),
        actor,
        engine,
        tokenizer,
    )
    .with_stop_flag(stop);
    if let Some(critic) = critic {
        orchestrator = orchestrator.with_critic(critic);
    }
    let mut progress = Progress::new(settings.steps);
    let summary = orchestrator.run(&mut |m| progress.step(m))?;
    progress.finish();
    let mut out = std::io::stdout().lock();
    let (first, last) = (
        summary.reward_means.first().copied().unwrap_or_default(),
        summary.reward_means.last().copied().unwrap_or_default(),
    );
    writeln!(
        out,
        "{} after step {} of {}: mean reward {first:.3} at step 1, {last:.3} at the last",
        if summary.interrupted {
            "stopped"
        } else {
            "finished"
        },
        summary.steps,
        settings.steps
    )?;
    if let Some(path) = &settings.metrics {
        writeln!(out, "metrics: {}", path.display())?;
    }
    if let Some(path) = &settings.memory_timeline {
        writeln!(out, "memory timeline: {}", path.display())?;
    }
    Ok(())
}

/// The rollout engine of `model` on the device `settings` name, behind its controller.
///
/// # Errors
/// The GPU cannot be opened, or what the engine hit allocating.
fn build_engine(
    settings: &Settings,
    model: &LlamaConfig,
) -> anyhow::Result<Box<dyn RolloutEngine>> {
    // Every onload of the weights is followed by a full weight sync: backing them up on offload
    // would only carry stale bytes across the host link.
    let config = miles_infer::EngineConfig {
        weights_policy: miles_core::BackupPolicy::None,
        ..miles_infer::EngineConfig::from_settings(settings)
    };
    let engine = crate::generate::build_engine(settings, model, config)?;
    Ok(Box::new(miles_infer::InferenceController::from_settings(
        engine, settings,
    )))
}

/// The actor: the `--train-backend` backend, built without `--load` (the loop resolves the
/// checkpoint it names and restores the actor itself).
///
/// # Errors
/// As [`build_backend`](crate::backends::build_backend).
fn build_actor(settings: &Settings) -> anyhow::Result<Box<dyn TrainBackend>> {
    let fresh = Settings {
        load: None,
        ..settings.clone()
    };
    crate::backends::build_backend(&fresh)
}

/// The PPO critic (none under GRPO): a second backend of the same kind, its language model
/// read as the value head.
///
/// # Errors
/// As [`build_actor`].
fn build_critic(settings: &Settings, pad: u32) -> anyhow::Result<Option<Box<dyn Critic>>> {
    match settings.advantage_estimator {
        AdvantageEstimator::Grpo => Ok(None),
        AdvantageEstimator::Ppo => {
            let backend = build_actor(settings).context("cannot build the critic")?;
            Ok(Some(Box::new(LmCritic::new(backend, pad))))
        }
    }
}

/// A progress bar on a terminal, one log line per step otherwise.
struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    fn new(steps: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(steps);
            if let Ok(style) =
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        });
        Self { bar }
    }

    fn step(&mut self, m: &StepMetrics) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(m.step);
                bar.set_message(format!(
                    "reward {:.3} ± {:.3}  loss {:.4}  peak {:.1} MiB",
                    m.reward_mean,
                    m.reward_std,
                    m.loss,
                    m.peak_device_memory_bytes as f64 / f64::from(1u32 << 20)
                ));
            }
            None => tracing::info!(
                step = m.step,
                reward_mean = m.reward_mean,
                reward_std = m.reward_std,
                loss = m.loss,
                switch_seconds = m.switch_seconds(),
                peak_device_memory_bytes = m.peak_device_memory_bytes,
                "rl step"
            ),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}
