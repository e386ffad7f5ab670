//! Errors of settings: a file that cannot be read or parsed, and settings that break a rule.

use std::fmt;
use std::path::PathBuf;

use crate::choice::did_you_mean;

/// Why settings could not be loaded or resolved. Every variant means bad settings (exit status 2).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The `--config` file cannot be read.
    #[error("cannot read config file {}: {source}; check the path given to --config", path.display())]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// The `--config` file has a key that no setting has.
    #[error(
        "unknown key `{key}` in config file {} at line {line}: remove it or fix its spelling (keys are the flag names with underscores){}",
        origin.display(), did_you_mean(.suggestion.as_deref())
    )]
    UnknownKey {
        /// The file (or `<string>` for text parsed directly).
        origin: PathBuf,
        /// The key.
        key: String,
        /// 1-based line of the key.
        line: usize,
        /// The valid key nearest to it.
        suggestion: Option<String>,
    },
    /// The `--config` file is not valid TOML or a value has the wrong type.
    #[error("invalid config file {} at line {line}: {message}", origin.display())]
    Parse {
        /// The file (or `<string>` for text parsed directly).
        origin: PathBuf,
        /// 1-based line of the problem (0 when the parser gave no position).
        line: usize,
        /// What the parser said.
        message: String,
    },
    /// The settings break one or more rules.
    #[error(transparent)]
    Invalid(#[from] InvalidSettings),
}

/// Every rule the settings break, reported together. Displays one violation per line.
#[derive(Debug, thiserror::Error)]
pub struct InvalidSettings {
    /// The violations, in rule order.
    pub violations: Vec<SettingsError>,
}

impl fmt::Display for InvalidSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, violation) in self.violations.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{violation}")?;
        }
        Ok(())
    }
}

/// One broken rule of DESIGN section 3 (or a value out of its range). Messages name the flags and
/// the fix.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// Rule 1: `--colocate` with one of the offloads turned off.
    #[error(
        "--colocate requires --{switch}, but it was turned off (--no-{switch}, or false in the config file): colocated training and rollout share the devices and must move out of each other's way; drop --no-{switch} or --colocate"
    )]
    ColocateWithoutOffload {
        /// `offload-train` or `offload-rollout`.
        switch: &'static str,
    },
    /// Rule 2: disk target while training is not offloaded.
    #[error(
        "--offload-train-target disk requires --offload-train: nothing would go to disk; add --offload-train (or --colocate), or drop --offload-train-target disk"
    )]
    DiskTargetWithoutOffloadTrain,
    /// Rule 3: disk target without a directory.
    #[error(
        "--offload-train-target disk requires --offload-train-disk-dir DIR: give a directory on a local disk (one subdirectory per rank goes there)"
    )]
    DiskTargetWithoutDir,
    /// Rule 3: a host budget for disk writes with another target.
    #[error(
        "--offload-train-host-budget-gb is the host memory a disk offload copies into before its write to disk (and the optimizer stream reads ahead into); with --offload-train-target {target} and no --stream-optimizer-state-to-disk nothing goes to disk: add --offload-train-target disk or drop the budget"
    )]
    HostBudgetWithoutDiskTarget {
        /// The target given.
        target: super::OffloadTarget,
    },
    /// Rule 3: a disk chunk size of zero.
    #[error(
        "--offload-train-disk-chunk-mb must be at least 1 when offloading to disk (got 0); 64 is the default"
    )]
    ZeroDiskChunk,
    /// Rule 3: the disk directory cannot be created or written.
    #[error(
        "--offload-train-disk-dir {} is not usable: cannot {action}: {source}; choose a directory you can write to",
        dir.display()
    )]
    DiskDirNotWritable {
        /// The directory.
        dir: PathBuf,
        /// What failed (`create it`, `write a probe file in it`).
        action: &'static str,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// Rule 4: streaming optimizer state while training goes to the CPU.
    #[error(
        "--stream-optimizer-state-to-disk with --offload-train requires --offload-train-target disk (got {target}); add --offload-train-target disk or drop --stream-optimizer-state-to-disk"
    )]
    StreamNeedsDiskTarget {
        /// The target given.
        target: super::OffloadTarget,
    },
    /// Rule 4: streaming optimizer state without a directory.
    #[error(
        "--stream-optimizer-state-to-disk requires --offload-train-disk-dir DIR: the optimizer state lives there"
    )]
    StreamWithoutDiskDir,
    /// Rule 4: master weights streamed without the optimizer state.
    #[error(
        "--stream-optimizer-master-weights streams the master weights with the optimizer state: add --stream-optimizer-state-to-disk or drop it"
    )]
    MasterStreamWithoutStream,
    /// Rule 5: an unknown rollout offload level.
    #[error(
        "--offload-rollout-level has unknown value `{value}` (valid: {}){}",
        super::RolloutOffloadLevel::names().join(", "), did_you_mean(*.suggestion)
    )]
    UnknownRolloutLevel {
        /// The value given.
        value: String,
        /// The nearest valid value.
        suggestion: Option<&'static str>,
    },
    /// Rule 5: rollout offload on with no level named, so nothing would leave the device.
    #[error(
        "--offload-rollout-level names no level while rollout offload is on, so nothing would leave the device; give at least one of {} or turn rollout offload off with --no-offload-rollout",
        super::RolloutOffloadLevel::names().join(", ")
    )]
    EmptyRolloutLevel,
    /// Rule 3: the disk directory holds a file where the offload directory goes.
    #[error(
        "--offload-train-disk-dir {}: {} is not a directory; move that file away or choose another directory",
        dir.display(),
        dir.join("offload").display()
    )]
    OffloadDirIsAFile {
        /// The disk directory.
        dir: PathBuf,
    },
    /// Rule 7: FSDP's native CPU offload asked of the megatron backend.
    #[error(
        "--fsdp-cpu-offload requires --train-backend fsdp (got megatron); drop --fsdp-cpu-offload or use --train-backend fsdp"
    )]
    FsdpCpuOffloadWithMegatron,
    /// Rule 9: bf16 gradient reduction where nothing reduces gradients that way.
    #[error(
        "--grad-reduce-in-bf16 reduces the gradients of data-parallel gpus (got the {device} device, --data-parallel-size {ranks}); drop it, or add --device cuda and --data-parallel-size N with N processes"
    )]
    GradReduceInBf16 {
        /// The device the settings resolve to.
        device: String,
        /// The data-parallel size.
        ranks: usize,
    },
    /// Rule 10: gradients summed behind the backward pass where no data-parallel trainer on
    /// GPUs sums them.
    #[error(
        "--overlap-grad-reduce sums the gradients of data-parallel gpus in fp32 behind the backward pass ({why}); drop it, or {fix}"
    )]
    OverlapGradReduce {
        /// What stands in the way.
        why: String,
        /// The flags that would make it run.
        fix: &'static str,
    },
    /// A number outside its range.
    #[error("--{flag} must be {expected} (got {value})")]
    OutOfRange {
        /// The flag, without its leading dashes.
        flag: String,
        /// The value given.
        value: String,
        /// The range it must lie in, in words.
        expected: String,
    },
    /// The samples of one rollout do not split into whole training batches.
    #[error(
        "--rollout-batch-size {rollout_batch_size} x --n-samples-per-prompt {n_samples_per_prompt} = {samples} samples per rollout, not a multiple of --global-batch-size {global_batch_size}; change one so the samples split into whole batches"
    )]
    BatchNotDivisible {
        /// Prompts per rollout.
        rollout_batch_size: usize,
        /// Samples per prompt.
        n_samples_per_prompt: usize,
        /// Their product.
        samples: usize,
        /// Samples per optimizer step.
        global_batch_size: usize,
    },
    /// Settings of the data, reward or loss that cannot run together or lie out of range; the
    /// message names the flags and the fix.
    #[error("{0}")]
    Algorithm(String),
}
