//! Settings: every flag of DESIGN section 3 plus the run knobs, loaded from a TOML file,
//! overridden by flags, resolved and checked in one step.
//!
//! A [`RawSettings`] is one layer as typed or read, every value optional. [`Settings::resolve`]
//! stacks the flag layer over the file layer over the defaults, derives the tri-state offload
//! switches (unset: on with `--colocate`), records the [`Source`] of every value, and checks the
//! rules, returning all broken rules at once as [`InvalidSettings`].

mod algorithm;
mod choice;
mod error;
mod raw;
mod settings;
mod validate;

pub use choice::{
    AdvantageEstimator, DeviceChoice, KlLossType, LongPrompt, LrDecayStyle, MomentDtype,
    OffloadTarget, RmType, RolloutOffloadLevel, Task, TrainBackendKind, UnknownChoice,
};
pub use error::{ConfigError, InvalidSettings, SettingsError};
pub use raw::RawSettings;
pub use settings::{Settings, Source, Sources};
