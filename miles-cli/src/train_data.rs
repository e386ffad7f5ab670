//! What `miles train` reads of the user's task before any work: the prompt data and the
//! reward.

use miles_core::Settings;
use miles_core::model::ByteTokenizer;
use miles_core::orchestrator::{DataOptions, PlainPrompt, PromptDataset};

use crate::settings_args::BadSettings;

/// The rows of `--prompt-data`, rendered as plain prompts and counted in the loop's tokens;
/// `None` without it.
///
/// # Errors
/// A file that cannot be read, holds no usable row, or a prompt over the limit under
/// `--rollout-long-prompt error`: bad settings (exit status 2).
pub fn load_prompt_data(
    settings: &Settings,
    tokenizer: &ByteTokenizer,
) -> anyhow::Result<Option<PromptDataset>> {
    let Some(path) = &settings.prompt_data else {
        return Ok(None);
    };
    let encode = |text: &str| tokenizer.encode(text, true);
    PromptDataset::load(
        path,
        &DataOptions::from_settings(settings),
        &PlainPrompt,
        &encode,
    )
    .map(Some)
    .map_err(|error| BadSettings(error.to_string()).into())
}
