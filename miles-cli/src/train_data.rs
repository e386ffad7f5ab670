//! What `miles train` reads of the user's task before any work: the prompt data and the
//! reward.

use std::path::Path;
use std::time::Duration;

use miles_core::config::RmType;
use miles_core::model::Tokenizer;
use miles_core::orchestrator::{
    BuiltinReward, CommandReward, DataOptions, PlainPrompt, PromptDataset, Reward,
};
use miles_core::{DeviceKind, Settings};

use crate::settings_args::BadSettings;

/// The rows of `path` (`--prompt-data` or `--eval-prompt-data`), rendered as plain prompts and
/// counted in the loop's tokens; `None` without a path.
///
/// # Errors
/// A file that cannot be read, holds no usable row, or a prompt over the limit under
/// `--rollout-long-prompt error`: bad settings (exit status 2).
pub fn load_prompt_data(
    path: Option<&Path>,
    settings: &Settings,
    tokenizer: &Tokenizer,
) -> anyhow::Result<Option<PromptDataset>> {
    let Some(path) = path else {
        return Ok(None);
    };
    // Only the length counts here; a prompt the tokenizer cannot encode fails at its rollout,
    // naming the error.
    let encode = |text: &str| tokenizer.encode(text, true).unwrap_or_default();
    PromptDataset::load(
        path,
        &DataOptions::from_settings(settings),
        &PlainPrompt,
        &encode,
    )
    .map(Some)
    .map_err(|error| BadSettings(error.to_string()).into())
}

/// The reward of the run: the `--custom-rm-command` process (started now), else the
/// `--rm-type` built-in, else the task's; every label of `dataset` is checked against it.
///
/// # Errors
/// A label the reward cannot score (bad settings, naming its line), or a command that cannot
/// start.
pub fn build_reward(
    settings: &Settings,
    tokenizer: Tokenizer,
    datasets: &[Option<&PromptDataset>],
) -> anyhow::Result<Box<dyn Reward>> {
    let builtin = BuiltinReward::new(settings.rm_type.unwrap_or(RmType::Task), tokenizer);
    if let Some(command) = &settings.custom_rm_command {
        if let Some(rm) = settings.rm_type {
            tracing::warn!(
                "--custom-rm-command replaces --rm-type {rm}: the command's rewards train the model"
            );
        }
        let timeout = Duration::from_secs_f64(settings.custom_rm_timeout);
        return Ok(Box::new(CommandReward::spawn(command, timeout)?));
    }
    for dataset in datasets.iter().flatten() {
        for row in &dataset.rows {
            builtin.check_label(&row.problem.answer).map_err(|error| {
                BadSettings(format!(
                    "{error}; fix line {} of {}",
                    row.line,
                    dataset.path.display()
                ))
            })?;
        }
    }
    Ok(Box::new(builtin))
}

/// What the loop runs on the cpu device only, refused on cuda naming the flag, and what it runs
/// on cuda only (`--offload-when-needed`: trainer and engine share a device there; on the cpu
/// device each has its own), refused on the cpu device.
///
/// # Errors
/// Bad settings (exit status 2).
pub fn check_device(settings: &Settings) -> anyhow::Result<()> {
    if miles_core::device::resolve(settings.device) != DeviceKind::Cuda {
        if settings.offload_when_needed {
            return Err(BadSettings(
                "--offload-when-needed weighs the memory of a device that trainer and engine share, which they do on cuda only (the cpu device gives each its own); drop it or pass --device cuda".into(),
            )
            .into());
        }
        return Ok(());
    }
    if settings.use_kl_loss {
        return Err(BadSettings(
            "--use-kl-loss runs its reference model on the cpu device only; drop --use-kl-loss or pass --device cpu".into(),
        )
        .into());
    }
    if settings.entropy_coef != 0.0 {
        return Err(BadSettings(format!(
            "--entropy-coef {}: the entropy bonus runs on the cpu device only (the cuda trainers' fused cross-entropy keeps no full distribution to differentiate); drop --entropy-coef or pass --device cpu",
            settings.entropy_coef
        ))
        .into());
    }
    if let Some(n) = settings.micro_batch_size {
        return Err(BadSettings(format!(
            "--micro-batch-size {n}: the cuda trainers cut their own micro-batches to fit their activation budget and do not take a size; drop --micro-batch-size or pass --device cpu"
        ))
        .into());
    }
    if miles_core::orchestrator::LrSchedule::from_settings(settings).varies() {
        return Err(BadSettings(
            "the gpu trainers keep one learning rate; drop --lr-warmup-iters and --lr-decay-style, or pass --device cpu".into(),
        )
        .into());
    }
    Ok(())
}
