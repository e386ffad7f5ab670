//! Settings: every flag of DESIGN section 3 plus the run knobs, loaded from a TOML file,
//! overridden by flags, resolved and checked in one step.
//!
//! A [`RawSettings`] is one layer as typed or read, every value optional. [`Settings::resolve`]
//! stacks the flag layer over the file layer over the defaults, derives the tri-state offload
//! switches (unset: on with `--colocate`), records the [`Source`] of every value, and checks the
//! rules, returning all broken rules at once as [`InvalidSettings`]. Both structs, the flags,
//! the defaults, the ranges and the docs come from one table ([`FIELDS`], in `table.rs`).

mod algorithm;
mod error;
mod plan;
mod raw;
mod settings;
mod table;
mod validate;

pub use crate::choice::{
    AdvantageEstimator, DeviceChoice, KlLossType, LongPrompt, LrDecayStyle, MomentDtype,
    OffloadTarget, RmType, RolloutOffloadLevel, SaveDtype, Task, TrainBackendKind, UnknownChoice,
};
pub use error::{ConfigError, InvalidSettings, SettingsError};
pub use plan::{MAX_DISK_CHUNK_MB, OptimizerStream, RolloutOffload, TrainOffload};
pub use settings::{Source, Sources};
pub use table::{FIELDS, Field, FieldKind, Range, RawSettings, Settings, text_of};
pub(crate) use validate::probe_writable;
