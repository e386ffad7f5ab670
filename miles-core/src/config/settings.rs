//! The resolved settings and where each value came from.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::validate::{parse_rollout_levels, resolve_fsdp_cpu_offload, validate};
use super::{ConfigError, InvalidSettings, OffloadTarget, RawSettings, Settings, SettingsError};

/// Where a resolved value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Nothing set it.
    Default,
    /// The `--config` file.
    File,
    /// A flag.
    Flag,
    /// Left unset, turned on by `--colocate`.
    ImpliedByColocate,
    /// Set, then turned off because core training offload wins over it (rule 6).
    DisabledByOffloadTrain,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Default => "default",
            Source::File => "file",
            Source::Flag => "flag",
            Source::ImpliedByColocate => "implied by --colocate",
            Source::DisabledByOffloadTrain => "disabled: --offload-train wins over it",
        })
    }
}

/// The [`Source`] of every resolved setting, by TOML key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sources(BTreeMap<&'static str, Source>);

impl Sources {
    /// Where the setting `key` came from; `None` for a key no setting has.
    pub fn get(&self, key: &str) -> Option<Source> {
        self.0.get(key).copied()
    }

    /// Every key with its source, sorted by key.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, Source)> + '_ {
        self.0.iter().map(|(&key, &source)| (key, source))
    }

    pub(crate) fn set(&mut self, key: &'static str, source: Source) {
        self.0.insert(key, source);
    }

    /// The value of the flag layer, else of the file layer, else `default`, noting which.
    pub(crate) fn pick<T>(
        &mut self,
        key: &'static str,
        flag: Option<T>,
        file: Option<T>,
        default: T,
    ) -> T {
        let (value, source) = match (flag, file) {
            (Some(value), _) => (value, Source::Flag),
            (None, Some(value)) => (value, Source::File),
            (None, None) => (default, Source::Default),
        };
        self.set(key, source);
        value
    }

    /// As [`Sources::pick`] for a setting whose default is "none".
    pub(crate) fn pick_optional<T>(
        &mut self,
        key: &'static str,
        flag: Option<T>,
        file: Option<T>,
        default: Option<T>,
    ) -> Option<T> {
        self.pick(key, flag.map(Some), file.map(Some), default)
    }
}

/// Resolves one offload switch (`offload_train` or `offload_rollout`): the flag layer wins over
/// the file; within a layer the explicit switch wins over the `offload` shorthand; left unset it
/// is on with `--colocate` and off without.
///
/// `explicit` and `shorthand` are the (flag, file) values of the switch and of `offload`.
fn resolve_offload_switch(
    explicit: (Option<bool>, Option<bool>),
    shorthand: (Option<bool>, Option<bool>),
    colocate: bool,
) -> (bool, Source) {
    let from_flags = explicit.0.or(shorthand.0);
    let from_file = explicit.1.or(shorthand.1);
    match (from_flags, from_file) {
        (Some(on), _) => (on, Source::Flag),
        (None, Some(on)) => (on, Source::File),
        (None, None) if colocate => (true, Source::ImpliedByColocate),
        (None, None) => (false, Source::Default),
    }
}

impl Settings {
    /// Reads the `--config` file (when given) under the flag layer and resolves both.
    ///
    /// # Errors
    /// The file's [`ConfigError`]s, or [`ConfigError::Invalid`] with every broken rule.
    pub fn load(flags: RawSettings, config: Option<&Path>) -> Result<Settings, ConfigError> {
        let file = config.map(RawSettings::from_toml_file).transpose()?;
        Ok(Settings::resolve(flags, file.unwrap_or_default())?)
    }

    /// Resolves the flag layer over the file layer over the defaults, then checks every rule of
    /// DESIGN section 3.
    ///
    /// Rule 3 creates the disk directory and writes a probe file in it; rule 6 and a disk
    /// directory on tmpfs log a warning.
    ///
    /// # Errors
    /// [`InvalidSettings`] with every broken rule, not only the first.
    pub fn resolve(flags: RawSettings, file: RawSettings) -> Result<Settings, InvalidSettings> {
        let mut s = Sources::default();
        let mut settings = Settings::pick_layers(&flags, &file, &mut s);
        let (offload_train, source) = resolve_offload_switch(
            (flags.offload_train, file.offload_train),
            (flags.offload, file.offload),
            settings.colocate,
        );
        s.set("offload_train", source);
        let (offload_rollout, source) = resolve_offload_switch(
            (flags.offload_rollout, file.offload_rollout),
            (flags.offload, file.offload),
            settings.colocate,
        );
        s.set("offload_rollout", source);
        let level_names = s.pick(
            "offload_rollout_level",
            flags.offload_rollout_level,
            file.offload_rollout_level,
            settings
                .offload_rollout_level
                .iter()
                .map(|l| l.as_str().to_owned())
                .collect(),
        );
        let (offload_rollout_level, mut violations) = parse_rollout_levels(&level_names);
        // Rule 5: a list naming nothing (`""`) would move nothing.
        if offload_rollout && offload_rollout_level.is_empty() && violations.is_empty() {
            violations.push(SettingsError::EmptyRolloutLevel);
        }
        settings.offload_train = offload_train;
        settings.offload_rollout = offload_rollout;
        settings.offload_rollout_level = offload_rollout_level;
        settings.sources = s;
        resolve_fsdp_cpu_offload(&mut settings);
        violations.extend(validate(&settings));
        if violations.is_empty() {
            Ok(settings)
        } else {
            Err(InvalidSettings { violations })
        }
    }

    /// Capacity of the CPU device in bytes.
    pub fn device_memory_bytes(&self) -> u64 {
        (self.device_memory_gib * (1u64 << 30) as f64) as u64
    }

    /// The global gradient norm the optimizer clips to (`--clip-grad`), `None` when it never
    /// clips (0).
    pub fn max_grad_norm(&self) -> Option<f32> {
        (self.clip_grad > 0.0).then_some(self.clip_grad as f32)
    }

    /// Whether any training state goes to disk (disk target, or streamed optimizer state).
    pub fn uses_disk(&self) -> bool {
        self.offload_train_target == OffloadTarget::Disk || self.stream_optimizer_state_to_disk
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offload_switch_resolves_flag_over_file_explicit_over_shorthand_then_colocate() {
        let (on, off, unset) = (Some(true), Some(false), None);
        // (explicit flag, explicit file), (shorthand flag, shorthand file), colocate -> result
        let table = [
            (
                (unset, unset),
                (unset, unset),
                false,
                (false, Source::Default),
            ),
            (
                (unset, unset),
                (unset, unset),
                true,
                (true, Source::ImpliedByColocate),
            ),
            ((off, unset), (unset, unset), true, (false, Source::Flag)),
            ((unset, off), (unset, unset), true, (false, Source::File)),
            ((unset, off), (on, unset), false, (true, Source::Flag)),
            ((off, unset), (on, unset), false, (false, Source::Flag)),
            ((unset, unset), (unset, on), false, (true, Source::File)),
            ((on, off), (unset, unset), false, (true, Source::Flag)),
            ((unset, on), (unset, off), false, (true, Source::File)),
        ];
        for (explicit, shorthand, colocate, expected) in table {
            assert_eq!(
                resolve_offload_switch(explicit, shorthand, colocate),
                expected,
                "{explicit:?} {shorthand:?} colocate={colocate}"
            );
        }
    }

    #[test]
    fn device_memory_bytes_follow_the_gib_setting() {
        let settings = Settings {
            device_memory_gib: 1.5,
            ..Settings::default()
        };
        assert_eq!(settings.device_memory_bytes(), 3 << 29);
    }
}
