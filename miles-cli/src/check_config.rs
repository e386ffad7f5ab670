//! `miles check-config`: the resolved settings, each with where its value came from.

use std::io::Write;

use clap::Args;
use miles_core::config::{Settings, Source};

use crate::settings_args::SettingsArgs;

/// Arguments of `miles check-config`.
#[derive(Args, Debug)]
pub struct CheckConfigArgs {
    /// Print the resolved settings as one JSON object (keys as in the TOML file)
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    settings: SettingsArgs,
}

/// Resolves the settings and prints them.
///
/// # Errors
/// Bad settings, or stdout gone.
pub fn run(args: CheckConfigArgs) -> anyhow::Result<()> {
    let settings = args.settings.load()?;
    let text = if args.json {
        serde_json::to_string_pretty(&settings)?
    } else {
        describe(&settings)?
    };
    writeln!(std::io::stdout().lock(), "{text}")?;
    Ok(())
}

/// The settings as a TOML file (so the output can serve as a `--config` file), each line with its
/// source as a comment; settings without a value are listed as comments at the end.
fn describe(settings: &Settings) -> anyhow::Result<String> {
    let toml = toml::to_string(settings)?;
    let lines: Vec<(&str, &str)> = toml
        .lines()
        .filter_map(|line| Some((line.split_once(" = ")?.0, line)))
        .collect();
    let width = lines.iter().map(|(_, line)| line.len()).max().unwrap_or(0);
    let source = |key: &str| settings.sources.get(key).unwrap_or(Source::Default);
    let mut out = String::from("# resolved settings; after each: where its value came from\n");
    for (key, line) in &lines {
        out.push_str(&format!("{line:<width$}  # {}\n", source(key)));
    }
    for (key, from) in settings.sources.iter() {
        if !lines.iter().any(|(k, _)| *k == key) {
            out.push_str(&format!("# {key} = none  ({from})\n"));
        }
    }
    Ok(out.trim_end().to_owned())
}
