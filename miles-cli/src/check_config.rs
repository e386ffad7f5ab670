//! `miles check-config`: the resolved settings, each with where its value came from.

use std::io::Write;

use clap::Args;
use miles_core::config::{FIELDS, FieldKind, Settings};

use crate::settings_args::SettingsArgs;

/// Arguments of `miles check-config`.
#[derive(Args, Debug)]
pub struct CheckConfigArgs {
    /// Print the resolved settings as one JSON object (keys as in the TOML file)
    #[arg(long)]
    json: bool,
    /// Print the table of every setting (flag, default, meaning) as the README shows it
    #[arg(long, conflicts_with = "json")]
    table: bool,
    #[command(flatten)]
    settings: SettingsArgs,
}

/// Resolves the settings and prints them.
///
/// # Errors
/// Bad settings, or stdout gone.
pub fn run(args: CheckConfigArgs) -> anyhow::Result<()> {
    if args.table {
        writeln!(std::io::stdout().lock(), "{}", settings_table())?;
        return Ok(());
    }
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
    let mut lines = Vec::new();
    let mut unset = Vec::new();
    for field in FIELDS.iter().filter(|f| f.kind != FieldKind::Shorthand) {
        let value = settings.value_of(field);
        let source = settings.source_of(field);
        if value.is_null() {
            unset.push(format!("# {} = none  ({source})", field.key));
        } else {
            let value: toml::Value = serde_json::from_value(value)?;
            lines.push((format!("{} = {value}", field.key), source));
        }
    }
    let width = lines.iter().map(|(line, _)| line.len()).max().unwrap_or(0);
    let mut out = String::from("# resolved settings; after each: where its value came from\n");
    for (line, source) in &lines {
        out.push_str(&format!("{line:<width$}  # {source}\n"));
    }
    for line in unset {
        out.push_str(&line);
        out.push('\n');
    }
    Ok(out.trim_end().to_owned())
}

/// Every setting as a Markdown table: the flag with its value, the default, the meaning and the
/// range. The README's settings table is this output.
pub fn settings_table() -> String {
    let mut out = String::from("| flag | default | meaning |\n|---|---|---|\n");
    for field in FIELDS {
        let flag = match field.kind {
            FieldKind::Switch | FieldKind::Shorthand => format!("`--{}`", field.flag()),
            FieldKind::Toggle => format!("`--{0}` / `--no-{0}`", field.flag()),
            FieldKind::Value | FieldKind::Optional => {
                format!(
                    "`--{} {}`",
                    field.flag(),
                    field.value_name.replace('|', "\\|")
                )
            }
            FieldKind::List | FieldKind::Many => {
                format!("`--{} {}...`", field.flag(), field.value_name)
            }
        };
        let default = match field.kind {
            FieldKind::Shorthand => "—".to_owned(),
            FieldKind::Toggle => "on with `--colocate`, else off".to_owned(),
            _ => field.default_text(),
        };
        let range = field
            .range
            .describe()
            .map(|range| format!(" ({range})"))
            .unwrap_or_default();
        out.push_str(&format!(
            "| {flag} | {default} | {}{range} |\n",
            field.help()
        ));
    }
    out.trim_end().to_owned()
}
