//! The rules of DESIGN section 3, checked on resolved settings. Every check runs, so a user sees
//! every broken rule at once.

use std::io::Write;
use std::path::Path;

use super::{
    FIELDS, OffloadTarget, RolloutOffloadLevel, Settings, SettingsError, Source, TrainBackendKind,
    text_of,
};
use crate::choice::nearest;
use crate::device::probe::filesystem;

/// Rule 5: parses rollout offload levels (each value may hold several names separated by spaces
/// or commas), dropping repeats; unknown names become errors with the nearest valid name.
pub(crate) fn parse_rollout_levels(
    names: &[String],
) -> (Vec<RolloutOffloadLevel>, Vec<SettingsError>) {
    let valid = RolloutOffloadLevel::names();
    let mut levels = Vec::new();
    let mut errors = Vec::new();
    let words = names
        .iter()
        .flat_map(|name| name.split(|c: char| c == ',' || c.is_whitespace()))
        .filter(|word| !word.is_empty());
    for word in words {
        match word.parse::<RolloutOffloadLevel>() {
            Ok(level) if !levels.contains(&level) => levels.push(level),
            Ok(_) => {}
            Err(_) => errors.push(SettingsError::UnknownRolloutLevel {
                value: word.to_owned(),
                suggestion: nearest(word, &valid),
            }),
        }
    }
    (levels, errors)
}

/// Rule 6: FSDP's native CPU offload yields to core training offload, with one warning.
pub(crate) fn resolve_fsdp_cpu_offload(settings: &mut Settings) {
    if settings.train_backend == TrainBackendKind::Fsdp
        && settings.fsdp_cpu_offload
        && settings.offload_train
    {
        tracing::warn!(
            "--fsdp-cpu-offload is disabled because --offload-train is on: core offload moves the \
             training state off the device, and native CPU offload would move the same bytes twice"
        );
        settings.fsdp_cpu_offload = false;
        settings
            .sources
            .set("fsdp_cpu_offload", Source::DisabledByOffloadTrain);
    }
}

/// Every rule the resolved settings break (rules 1-4 and 7; rule 5 is checked while parsing and
/// rule 6 is a warning; rule 8 allows offload without `--colocate`), then the ranges of the numbers.
pub(crate) fn validate(s: &Settings) -> Vec<SettingsError> {
    let mut errors = Vec::new();
    // Rule 1.
    if s.colocate && !s.offload_train {
        errors.push(SettingsError::ColocateWithoutOffload {
            switch: "offload-train",
        });
    }
    if s.colocate && !s.offload_rollout {
        errors.push(SettingsError::ColocateWithoutOffload {
            switch: "offload-rollout",
        });
    }
    let disk_target = s.offload_train_target == OffloadTarget::Disk;
    // Rule 2.
    if disk_target && !s.offload_train {
        errors.push(SettingsError::DiskTargetWithoutOffloadTrain);
    }
    // Rule 3.
    if disk_target && s.offload_train_disk_dir.is_none() {
        errors.push(SettingsError::DiskTargetWithoutDir);
    }
    // Rule 3: the host budget serves the disk target and the optimizer stream only.
    if s.offload_train_host_budget_gb > 0.0 && !disk_target && !s.stream_optimizer_state_to_disk {
        errors.push(SettingsError::HostBudgetWithoutDiskTarget {
            target: s.offload_train_target,
        });
    }
    // Rule 4.
    if s.stream_optimizer_state_to_disk {
        if s.offload_train && !disk_target {
            errors.push(SettingsError::StreamNeedsDiskTarget {
                target: s.offload_train_target,
            });
        }
        if !disk_target && s.offload_train_disk_dir.is_none() {
            errors.push(SettingsError::StreamWithoutDiskDir);
        }
    } else if s.stream_optimizer_master_weights {
        errors.push(SettingsError::MasterStreamWithoutStream);
    }
    // Rule 3, for every use of the disk (the chunk's range is checked with every range).
    if s.uses_disk()
        && let Some(dir) = &s.offload_train_disk_dir
        && let Err(error) = check_disk_dir(dir)
    {
        errors.push(error);
    }
    // Rule 7.
    if s.fsdp_cpu_offload && s.train_backend == TrainBackendKind::Megatron {
        errors.push(SettingsError::FsdpCpuOffloadWithMegatron);
    }
    // Rule 9.
    if s.grad_reduce_in_bf16 {
        let device = crate::device::resolve(s.device);
        if device != crate::DeviceKind::Cuda || s.data_parallel_size == 1 {
            errors.push(SettingsError::GradReduceInBf16 {
                device: device.to_string(),
                ranks: s.data_parallel_size,
            });
        }
    }
    // Rule 10.
    if s.overlap_grad_reduce {
        let device = crate::device::resolve(s.device);
        let refused = if device != crate::DeviceKind::Cuda || s.data_parallel_size == 1 {
            Some((
                format!(
                    "got the {device} device, --data-parallel-size {}",
                    s.data_parallel_size
                ),
                "add --device cuda and --data-parallel-size N with N processes",
            ))
        } else if s.tensor_model_parallel_size > 1 || s.grad_reduce_in_bf16 {
            Some((
                "not with tensor parallelism or --grad-reduce-in-bf16".into(),
                "drop --tensor-model-parallel-size and --grad-reduce-in-bf16",
            ))
        } else {
            None
        };
        if let Some((why, fix)) = refused {
            errors.push(SettingsError::OverlapGradReduce { why, fix });
        }
    }
    errors.extend(check_ranges(s));
    errors.extend(super::algorithm::check(s));
    errors
}

/// Creates `dir` when missing, then writes and removes a probe file in it: whether a run can
/// put its files there. The error names the step that failed (`create it`, ...).
pub(crate) fn probe_writable(dir: &Path) -> Result<(), (&'static str, std::io::Error)> {
    std::fs::create_dir_all(dir).map_err(|source| ("create it", source))?;
    let probe = dir.join(format!(".miles-write-probe-{}", std::process::id()));
    std::fs::File::create(&probe)
        .and_then(|mut file| file.write_all(b"miles"))
        .map_err(|source| ("write a probe file in it", source))?;
    std::fs::remove_file(&probe).map_err(|source| ("remove its probe file", source))
}

/// Rule 3: the disk directory can be created and written; a warning when it is on tmpfs.
fn check_disk_dir(dir: &Path) -> Result<(), SettingsError> {
    let unusable =
        |action: &'static str, source: std::io::Error| SettingsError::DiskDirNotWritable {
            dir: dir.to_path_buf(),
            action,
            source,
        };
    probe_writable(dir).map_err(|(action, source)| unusable(action, source))?;
    let offload = dir.join("offload");
    if offload.exists() && !offload.is_dir() {
        return Err(SettingsError::OffloadDirIsAFile {
            dir: dir.to_path_buf(),
        });
    }
    match filesystem(dir) {
        Ok(stats) if stats.is_tmpfs() => tracing::warn!(
            dir = %dir.display(),
            "--offload-train-disk-dir is on tmpfs: offloaded training state stays in RAM, not on disk"
        ),
        Ok(_) => {}
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "cannot tell the filesystem type")
        }
    }
    Ok(())
}

/// The numbers outside their ranges (each field's range in the table), and batch sizes that do
/// not split.
fn check_ranges(s: &Settings) -> Vec<SettingsError> {
    let mut errors = Vec::new();
    for field in FIELDS {
        let value = s.value_of(field);
        let Some(number) = value.as_f64() else {
            continue;
        };
        if let Some(expected) = field.range.describe()
            && !field.range.contains(number)
        {
            errors.push(SettingsError::OutOfRange {
                flag: field.flag(),
                value: text_of(&value),
                expected,
            });
        }
    }
    if !s.device_memory_gib.is_finite() {
        errors.push(SettingsError::OutOfRange {
            flag: "device-memory-gib".to_owned(),
            value: s.device_memory_gib.to_string(),
            expected: "a finite number".to_owned(),
        });
    }
    let samples = s.rollout_batch_size.saturating_mul(s.n_samples_per_prompt);
    if s.global_batch_size > 0 && !samples.is_multiple_of(s.global_batch_size) {
        errors.push(SettingsError::BatchNotDivisible {
            rollout_batch_size: s.rollout_batch_size,
            n_samples_per_prompt: s.n_samples_per_prompt,
            samples,
            global_batch_size: s.global_batch_size,
        });
    }
    errors
}
