//! The settings flags, shared by every command that runs with [`Settings`] (flattened into its
//! arguments with `#[command(flatten)]`). Every flag comes from the settings table
//! ([`FIELDS`]): its name, help, heading, value name and parser.

use std::fmt;
use std::path::PathBuf;

use clap::{Arg, ArgAction, ArgMatches, Command};
use miles_core::TrainBackendKind;
use miles_core::config::{ConfigError, FIELDS, Field, FieldKind, RawSettings, Settings};
use miles_core::device::{self, DeviceKind};
use miles_core::model::{CONFIG_FILE, LlamaConfig};
use miles_core::orchestrator::{LoopState, STATE_FILE, resolve_checkpoint};

/// `--config FILE` and every setting's flag. A flag left out leaves the value to the
/// `--config` file, then to the default.
#[derive(Debug, Default, Clone)]
pub struct SettingsArgs {
    /// TOML file with the same keys (underscores); flags override it.
    pub config: Option<PathBuf>,
    /// The flag layer.
    raw: RawSettings,
}

/// The id of a toggle's negation (`--no-offload-train`).
fn negation(field: &Field) -> String {
    format!("no_{}", field.key)
}

impl clap::Args for SettingsArgs {
    fn augment_args(cmd: Command) -> Command {
        let mut cmd = cmd.arg(
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .value_parser(clap::value_parser!(PathBuf))
                .help("TOML file with the same keys (underscores); flags override it")
                .help_heading("Settings"),
        );
        for field in FIELDS {
            let arg = Arg::new(field.key)
                .long(field.flag())
                .help(help_line(field))
                .help_heading(field.heading);
            cmd = match field.kind {
                FieldKind::Switch | FieldKind::Shorthand => cmd.arg(arg.action(ArgAction::SetTrue)),
                FieldKind::Toggle => {
                    let no = negation(field);
                    cmd.arg(arg.action(ArgAction::SetTrue).overrides_with(no.clone()))
                        .arg(
                            Arg::new(no)
                                .long(format!("no-{}", field.flag()))
                                .action(ArgAction::SetTrue)
                                .overrides_with(field.key)
                                .help(format!("Turn --{} off", field.flag()))
                                .help_heading(field.heading),
                        )
                }
                FieldKind::Value | FieldKind::Optional | FieldKind::List | FieldKind::Many => {
                    let parse = move |text: &str| field.parse(text);
                    let arg = arg
                        .value_name(field.value_name)
                        .allow_negative_numbers(true)
                        .value_parser(parse);
                    cmd.arg(if matches!(field.kind, FieldKind::List | FieldKind::Many) {
                        arg.num_args(1..)
                    } else {
                        arg
                    })
                }
            };
        }
        cmd
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

/// A flag's help: the table's line, then its default and range.
fn help_line(field: &Field) -> String {
    let mut help = field.help().to_owned();
    let default = field.default_text();
    if !default.is_empty() && default != "none" {
        help.push_str(&format!(" [default: {default}]"));
    }
    if let Some(range) = field.range.describe() {
        help.push_str(&format!(" [range: {range}]"));
    }
    help
}

impl clap::FromArgMatches for SettingsArgs {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut args = SettingsArgs::default();
        args.update_from_arg_matches(matches)?;
        Ok(args)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        use serde_json::Value;
        if let Some(config) = matches.get_one::<PathBuf>("config") {
            self.config = Some(config.clone());
        }
        let mut layer = serde_json::Map::new();
        for field in FIELDS {
            let given = |id: &str| {
                matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
                    && matches.get_flag(id)
            };
            let value = match field.kind {
                FieldKind::Switch | FieldKind::Shorthand => {
                    given(field.key).then_some(Value::Bool(true))
                }
                FieldKind::Toggle => {
                    if given(field.key) {
                        Some(Value::Bool(true))
                    } else if given(&negation(field)) {
                        Some(Value::Bool(false))
                    } else {
                        None
                    }
                }
                FieldKind::Value | FieldKind::Optional => {
                    matches.get_one::<Value>(field.key).cloned()
                }
                FieldKind::List | FieldKind::Many => matches
                    .get_many::<Value>(field.key)
                    .map(|values| Value::Array(values.cloned().collect())),
            };
            if let Some(value) = value {
                layer.insert(field.key.to_owned(), value);
            }
        }
        self.raw = serde_json::from_value(Value::Object(layer))
            .map_err(|error| clap::Error::raw(clap::error::ErrorKind::ValueValidation, error))?;
        Ok(())
    }
}

impl SettingsArgs {
    /// Reads `--config`, lays the flags over it, and resolves and checks the settings.
    ///
    /// # Errors
    /// A [`ConfigError`] for a bad file or broken rules, or [`BackendNotBuilt`]; both are bad
    /// settings (see [`is_bad_settings`]).
    pub fn load(&self) -> anyhow::Result<Settings> {
        let settings = Settings::load(self.to_raw(), self.config.as_deref())?;
        let built = match settings.train_backend {
            TrainBackendKind::Megatron => cfg!(feature = "megatron"),
            TrainBackendKind::Fsdp => cfg!(feature = "fsdp"),
        };
        if !built {
            return Err(BackendNotBuilt(settings.train_backend).into());
        }
        let problems = knowable_problems(&settings);
        if !problems.is_empty() {
            return Err(BadSettings(problems.join("\n  ")).into());
        }
        Ok(settings)
    }

    /// The flag layer: a switch left out is `None`, so the file can set it.
    pub fn to_raw(&self) -> RawSettings {
        self.raw.clone()
    }
}

/// Ranks the CPU device runs as threads of one process, at most: four a core, and no fewer than
/// 16, so a typo (`--data-parallel-size 1000`) is refused before a thread starts.
fn cpu_rank_limit() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    (4 * cores).max(16)
}

/// What the files and the machine tell about the settings before any work: an unknown preset,
/// more ranks than the CPU device runs, a margin no resume can meet, a `--load` that is not a
/// checkpoint. Each line names the flag and the fix.
fn knowable_problems(settings: &Settings) -> Vec<String> {
    let mut problems = Vec::new();
    let load = settings
        .load
        .as_deref()
        .and_then(|dir| load_problem(dir, settings.steps));
    match (&load, LlamaConfig::from_settings(settings)) {
        (None, Err(error)) if settings.hf_checkpoint.is_none() && settings.load.is_none() => {
            problems.push(format!("--preset {}: {error}", settings.preset))
        }
        (None, Err(error)) => problems.push(error.to_string()),
        _ => {}
    }
    if device::resolve(settings.device) == DeviceKind::Cpu {
        let ranks = settings
            .tensor_model_parallel_size
            .saturating_mul(settings.data_parallel_size);
        let limit = cpu_rank_limit();
        if ranks > limit {
            problems.push(format!(
                "--tensor-model-parallel-size {} x --data-parallel-size {} = {ranks} ranks; the cpu device runs at most {limit} here (four a core): lower them",
                settings.tensor_model_parallel_size, settings.data_parallel_size
            ));
        }
        if settings.train_memory_margin_bytes >= settings.device_memory_bytes() {
            problems.push(format!(
                "--train-memory-margin-bytes {} is not below the cpu device's capacity (--device-memory-gib {} = {} bytes), so no resume could ever run: lower the margin or raise the capacity",
                settings.train_memory_margin_bytes,
                settings.device_memory_gib,
                settings.device_memory_bytes()
            ));
        }
    }
    problems.extend(load);
    problems
}

/// Why `--load DIR` cannot start the run, if it cannot.
fn load_problem(dir: &std::path::Path, steps: u64) -> Option<String> {
    let at = |reason: String| Some(format!("--load {}: {reason}", dir.display()));
    if !dir.is_dir() {
        return at("no such directory; point --load at a directory written by --save or a Hugging Face checkpoint".into());
    }
    let checkpoint = match resolve_checkpoint(dir) {
        Ok(checkpoint) => checkpoint,
        Err(error) => return at(error.to_string()),
    };
    if checkpoint.join(STATE_FILE).exists() {
        return match LoopState::read(&checkpoint) {
            Ok(state) if state.step > steps => at(format!(
                "its checkpoint is at step {}, beyond --steps {steps}; raise --steps",
                state.step
            )),
            Ok(_) => None,
            Err(error) => at(error.to_string()),
        };
    }
    if !checkpoint.join(CONFIG_FILE).exists() {
        return at(format!(
            "{} holds neither loop state nor a model ({CONFIG_FILE}); point --load at a directory written by --save",
            checkpoint.display()
        ));
    }
    None
}

/// `--train-backend` names a backend this binary was built without.
#[derive(Debug)]
pub struct BackendNotBuilt(pub TrainBackendKind);

impl fmt::Display for BackendNotBuilt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "--train-backend {0} is not built into this binary; rebuild with `--features {0}` or choose another backend",
            self.0
        )
    }
}

impl std::error::Error for BackendNotBuilt {}

/// Flags of a command that cannot run together, with the fix in the message; exit status 2.
#[derive(Debug)]
pub struct BadSettings(pub String);

impl fmt::Display for BadSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadSettings {}

impl BadSettings {
    /// The first of `counts` (a flag and its value) that is 0, as "FLAG must be at least 1".
    ///
    /// # Errors
    /// That refusal.
    pub fn refuse_zero(counts: &[(&str, usize)]) -> Result<(), BadSettings> {
        match counts.iter().find(|(_, value)| *value == 0) {
            Some((flag, _)) => Err(BadSettings(format!("{flag} must be at least 1"))),
            None => Ok(()),
        }
    }
}

/// Whether an error means bad settings (exit status 2) rather than a failure (exit status 1);
/// an offload directory refused as not ours or in use counts, wherever it shows in the chain.
pub fn is_bad_settings(error: &anyhow::Error) -> bool {
    error.downcast_ref::<ConfigError>().is_some()
        || error.downcast_ref::<BadSettings>().is_some()
        || error.downcast_ref::<BackendNotBuilt>().is_some()
        || error.chain().any(|cause| {
            cause
                .downcast_ref::<miles_core::StoreError>()
                .is_some_and(miles_core::StoreError::is_bad_settings)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Probe {
        #[command(flatten)]
        settings: SettingsArgs,
    }

    fn raw(args: &[&str]) -> RawSettings {
        let mut argv = vec!["miles"];
        argv.extend_from_slice(args);
        Probe::try_parse_from(argv).unwrap().settings.to_raw()
    }

    #[test]
    fn switches_left_out_stay_unset_for_the_file() {
        let layer = raw(&[]);
        assert_eq!(layer, RawSettings::default());
    }

    #[test]
    fn the_last_of_a_switch_and_its_negation_wins() {
        assert_eq!(
            raw(&["--offload-train", "--no-offload-train"]).offload_train,
            Some(false)
        );
        assert_eq!(
            raw(&["--no-offload-train", "--offload-train"]).offload_train,
            Some(true)
        );
        assert_eq!(raw(&["--no-offload-rollout"]).offload_rollout, Some(false));
    }

    #[test]
    fn every_config_key_has_a_flag_of_the_same_name() {
        use clap::{Args, CommandFactory};
        let command = SettingsArgs::augment_args(Probe::command());
        let longs: Vec<&str> = command
            .get_arguments()
            .filter_map(|a| a.get_long())
            .collect();
        for field in FIELDS {
            let flag = field.flag();
            assert!(longs.contains(&flag.as_str()), "--{flag} missing");
        }
        for (text, key) in [("--offload-train-disk-chunk-mb", "8"), ("--lr", "0.1")] {
            let layer = raw(&[text, key]);
            let value = serde_json::to_value(&layer).unwrap();
            let set = value
                .as_object()
                .unwrap()
                .iter()
                .filter(|(_, v)| !v.is_null())
                .count();
            assert_eq!(set, 1, "{text} {key}: {value}");
        }
        assert_eq!(RawSettings::keys().len(), FIELDS.len());
    }

    #[test]
    fn bad_enum_names_are_usage_errors() {
        let error = Probe::try_parse_from(["miles", "--train-backend", "fsdpp"])
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("did you mean `fsdp`?"), "{error}");
    }
}
