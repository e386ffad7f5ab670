//! Table-driven checks of settings resolution and the rules of DESIGN section 3. Every case runs
//! twice: once as the `--config` file layer and once as the flag layer.

// Helpers of a test crate are test code: they may unwrap and panic (clippy.toml covers only
// `#[test]` functions and `#[cfg(test)]` modules).
#![allow(clippy::unwrap_used, clippy::panic)]

use std::path::Path;

use miles_core::config::{
    MomentDtype, OffloadTarget, RawSettings, RolloutOffloadLevel, Settings, SettingsError, Source,
    TrainBackendKind,
};

/// A short, exact name for each error variant (with the fields that tell cases apart).
fn label(error: &SettingsError) -> String {
    match error {
        SettingsError::ColocateWithoutOffload { switch } => format!("rule1:{switch}"),
        SettingsError::DiskTargetWithoutOffloadTrain => "rule2".into(),
        SettingsError::DiskTargetWithoutDir => "rule3:dir".into(),
        SettingsError::ZeroDiskChunk => "rule3:chunk".into(),
        SettingsError::HostBudgetWithoutDiskTarget { .. } => "rule3:budget".into(),
        SettingsError::DiskDirNotWritable { .. } => "rule3:writable".into(),
        SettingsError::StreamNeedsDiskTarget { .. } => "rule4:target".into(),
        SettingsError::StreamWithoutDiskDir => "rule4:dir".into(),
        SettingsError::MasterStreamWithoutStream => "rule4:master".into(),
        SettingsError::UnknownRolloutLevel { value, suggestion } => {
            format!("rule5:{value}->{}", suggestion.unwrap_or("none"))
        }
        SettingsError::FsdpCpuOffloadWithMegatron => "rule7".into(),
        SettingsError::GradReduceInBf16 { device, ranks } => format!("rule9:{device}:{ranks}"),
        SettingsError::OverlapGradReduce { fix, .. } => {
            let flag = [
                "--device",
                "--train-backend",
                "--tensor-model-parallel-size",
            ]
            .into_iter()
            .find(|flag| fix.contains(flag))
            .unwrap_or("?");
            format!("rule10:{flag}")
        }
        SettingsError::EmptyRolloutLevel => "rule5:empty".into(),
        SettingsError::OffloadDirIsAFile { .. } => "rule3:file".into(),
        SettingsError::OutOfRange { flag, .. } => format!("range:{flag}"),
        SettingsError::BatchNotDivisible { .. } => "batch".into(),
        SettingsError::Algorithm(message) => format!("algorithm:{message}"),
    }
}

type Check = fn(&Settings);

/// What a case must give.
enum Expect {
    Valid(Check),
    Invalid(&'static [&'static str]),
}

/// `{dir}` in a case's TOML stands for a fresh writable directory, `{file}` for a regular file.
const CASES: &[(&str, &str, Expect)] = &[
    (
        "defaults leave offload off",
        "",
        Expect::Valid(|s| {
            assert!(!s.colocate && !s.offload_train && !s.offload_rollout);
            assert_eq!(s.train_backend, TrainBackendKind::Megatron);
            assert_eq!(s.offload_train_disk_chunk_mb, 64);
            assert_eq!(s.train_memory_margin_bytes, 1 << 30);
        }),
    ),
    (
        "colocate implies both offloads and the default level",
        "colocate = true",
        Expect::Valid(|s| {
            assert!(s.offload_train && s.offload_rollout);
            assert_eq!(
                s.sources.get("offload_train"),
                Some(Source::ImpliedByColocate)
            );
            assert_eq!(
                s.sources.get("offload_rollout"),
                Some(Source::ImpliedByColocate)
            );
            assert_eq!(
                s.offload_rollout_level,
                [RolloutOffloadLevel::KvCache, RolloutOffloadLevel::Weight]
            );
        }),
    ),
    (
        "offload sets both without colocate (rule 8)",
        "offload = true",
        Expect::Valid(|s| {
            assert!(s.offload_train && s.offload_rollout && !s.colocate);
        }),
    ),
    (
        "offload train alone leaves rollout on the device",
        "offload_train = true",
        Expect::Valid(|s| {
            assert!(s.offload_train && !s.offload_rollout);
        }),
    ),
    (
        "the explicit switch wins over the shorthand in one layer",
        "offload = true\noffload_train = false",
        Expect::Valid(|s| {
            assert!(!s.offload_train && s.offload_rollout);
        }),
    ),
    (
        "colocate with a disk target and a directory",
        "colocate = true\noffload_train_target = \"disk\"\noffload_train_disk_dir = \"{dir}\"",
        Expect::Valid(|s| {
            assert_eq!(s.offload_train_target, OffloadTarget::Disk);
            assert!(
                s.offload_train_disk_dir
                    .as_deref()
                    .is_some_and(Path::is_dir)
            );
        }),
    ),
    (
        "streamed optimizer state on disk in bf16",
        "colocate = true\noffload_train_target = \"disk\"\noffload_train_disk_dir = \"{dir}\"\n\
         stream_optimizer_state_to_disk = true\nstream_optimizer_state_moment_dtype = \"bf16\"",
        Expect::Valid(|s| {
            assert!(s.stream_optimizer_state_to_disk);
            assert_eq!(s.stream_optimizer_state_moment_dtype, MomentDtype::Bf16);
        }),
    ),
    (
        "streamed optimizer state without training offload needs only a directory",
        "stream_optimizer_state_to_disk = true\noffload_train_disk_dir = \"{dir}\"",
        Expect::Valid(|s| assert!(s.stream_optimizer_state_to_disk && !s.offload_train)),
    ),
    (
        "fsdp native cpu offload yields to colocated offload (rule 6)",
        "train_backend = \"fsdp\"\nfsdp_cpu_offload = true\ncolocate = true",
        Expect::Valid(|s| {
            assert!(!s.fsdp_cpu_offload && s.offload_train);
            assert_eq!(
                s.sources.get("fsdp_cpu_offload"),
                Some(Source::DisabledByOffloadTrain)
            );
        }),
    ),
    (
        "fsdp native cpu offload yields to offload train without colocate (rule 6)",
        "train_backend = \"fsdp\"\nfsdp_cpu_offload = true\noffload_train = true",
        Expect::Valid(|s| assert!(!s.fsdp_cpu_offload)),
    ),
    (
        "fsdp native cpu offload stays on without core offload",
        "train_backend = \"fsdp\"\nfsdp_cpu_offload = true",
        Expect::Valid(|s| {
            assert!(s.fsdp_cpu_offload);
        }),
    ),
    (
        "one rollout level",
        "colocate = true\noffload_rollout_level = [\"weight\"]",
        Expect::Valid(|s| assert_eq!(s.offload_rollout_level, [RolloutOffloadLevel::Weight])),
    ),
    (
        "levels split on spaces and repeats drop",
        "offload_rollout_level = [\"kv_cache weight\", \"cuda_graph\", \"weight\"]",
        Expect::Valid(|s| assert_eq!(s.offload_rollout_level, RolloutOffloadLevel::ALL)),
    ),
    (
        "run knobs",
        "device = \"cpu\"\nsteps = 3\nlr = 0.001\nseed = 7\nrollout_batch_size = 4\n\
        n_samples_per_prompt = 2\nglobal_batch_size = 4\nadvantage_estimator = \"ppo\"",
        Expect::Valid(|s| {
            assert_eq!((s.steps, s.seed, s.global_batch_size), (3, 7, 4));
            assert_eq!(s.advantage_estimator.as_str(), "ppo");
            assert_eq!(s.device.as_str(), "cpu");
        }),
    ),
    (
        "colocate without training offload",
        "colocate = true\noffload_train = false",
        Expect::Invalid(&["rule1:offload-train"]),
    ),
    (
        "colocate without rollout offload",
        "colocate = true\noffload_rollout = false",
        Expect::Invalid(&["rule1:offload-rollout"]),
    ),
    (
        "colocate without either offload",
        "colocate = true\noffload_train = false\noffload_rollout = false",
        Expect::Invalid(&["rule1:offload-train", "rule1:offload-rollout"]),
    ),
    (
        "disk target without training offload or directory",
        "offload_train_target = \"disk\"",
        Expect::Invalid(&["rule2", "rule3:dir"]),
    ),
    (
        "a host budget for disk writes without the disk target",
        "offload_train = true\noffload_train_host_budget_gb = 4.0",
        Expect::Invalid(&["rule3:budget"]),
    ),
    (
        "a host budget with the disk target",
        "offload_train = true\noffload_train_target = \"disk\"\noffload_train_disk_dir = \"{dir}\"\noffload_train_host_budget_gb = 2.5",
        Expect::Valid(|s| assert_eq!(s.offload_train_host_budget_gb, 2.5)),
    ),
    (
        "disk target without training offload",
        "offload_train_target = \"disk\"\noffload_train_disk_dir = \"{dir}\"",
        Expect::Invalid(&["rule2"]),
    ),
    (
        "colocated disk target without directory",
        "colocate = true\noffload_train_target = \"disk\"",
        Expect::Invalid(&["rule3:dir"]),
    ),
    (
        "colocated with an empty rollout offload level",
        "colocate = true\noffload_rollout_level = [\"\"]",
        Expect::Invalid(&["rule5:empty"]),
    ),
    (
        "colocated disk target with a zero chunk",
        "colocate = true\noffload_train_target = \"disk\"\noffload_train_disk_dir = \"{dir}\"\n\
         offload_train_disk_chunk_mb = 0",
        Expect::Invalid(&["range:offload-train-disk-chunk-mb"]),
    ),
    (
        "disk directory under a regular file",
        "colocate = true\noffload_train_target = \"disk\"\noffload_train_disk_dir = \"{file}/sub\"",
        Expect::Invalid(&["rule3:writable"]),
    ),
    (
        "streamed optimizer state with a cpu target and no directory",
        "colocate = true\nstream_optimizer_state_to_disk = true",
        Expect::Invalid(&["rule4:target", "rule4:dir"]),
    ),
    (
        "streamed optimizer state with a cpu target",
        "offload_train = true\nstream_optimizer_state_to_disk = true\n\
         offload_train_disk_dir = \"{dir}\"",
        Expect::Invalid(&["rule4:target"]),
    ),
    (
        "streamed optimizer state on a disk target without directory",
        "colocate = true\nstream_optimizer_state_to_disk = true\noffload_train_target = \"disk\"",
        Expect::Invalid(&["rule3:dir"]),
    ),
    (
        "streamed master weights without the streamed optimizer state",
        "stream_optimizer_master_weights = true",
        Expect::Invalid(&["rule4:master"]),
    ),
    (
        "streamed master weights with the optimizer state",
        "stream_optimizer_state_to_disk = true\nstream_optimizer_master_weights = true\n\
         offload_train_disk_dir = \"{dir}\"",
        Expect::Valid(|s| assert!(s.stream_optimizer_master_weights)),
    ),
    (
        "plural rollout level",
        "colocate = true\noffload_rollout_level = [\"weights\"]",
        Expect::Invalid(&["rule5:weights->weight"]),
    ),
    (
        "several unknown rollout levels",
        "offload_rollout_level = [\"kv_cache\", \"kvcache\", \"cuda_graphs\", \"qqqqqqqqqqqqqqq\"]",
        Expect::Invalid(&[
            "rule5:kvcache->kv_cache",
            "rule5:cuda_graphs->cuda_graph",
            "rule5:qqqqqqqqqqqqqqq->none",
        ]),
    ),
    (
        "fsdp cpu offload with megatron",
        "fsdp_cpu_offload = true",
        Expect::Invalid(&["rule7"]),
    ),
    (
        "fsdp cpu offload with megatron and colocate",
        "train_backend = \"megatron\"\nfsdp_cpu_offload = true\ncolocate = true",
        Expect::Invalid(&["rule7"]),
    ),
    (
        "bf16 gradient reduction on the cpu device",
        "grad_reduce_in_bf16 = true\ndevice = \"cpu\"\ndata_parallel_size = 2",
        Expect::Invalid(&["rule9:cpu:2"]),
    ),
    (
        "bf16 gradient reduction on one gpu",
        "grad_reduce_in_bf16 = true\ndevice = \"cuda\"",
        Expect::Invalid(&["rule9:cuda:1"]),
    ),
    (
        "gradient sums behind the backward pass on one gpu",
        "overlap_grad_reduce = true\ndevice = \"cuda\"",
        Expect::Invalid(&["rule10:--device"]),
    ),
    (
        "gradient sums behind the backward pass on the cpu device",
        "overlap_grad_reduce = true\ndevice = \"cpu\"\ndata_parallel_size = 2",
        Expect::Invalid(&["rule10:--device"]),
    ),
    (
        "gathers ahead and gradient sums behind the passes with fsdp",
        "overlap_grad_reduce = true\ndevice = \"cuda\"\ndata_parallel_size = 2\ntrain_backend = \"fsdp\"",
        Expect::Valid(|s| assert!(s.overlap_grad_reduce)),
    ),
    (
        "gradient sums behind the backward pass with tensor parallelism",
        "overlap_grad_reduce = true\ndevice = \"cuda\"\ndata_parallel_size = 2\ntensor_model_parallel_size = 2",
        Expect::Invalid(&["rule10:--tensor-model-parallel-size"]),
    ),
    (
        "gradient sums behind the backward pass over data-parallel gpus with megatron",
        "overlap_grad_reduce = true\ndevice = \"cuda\"\ndata_parallel_size = 2",
        Expect::Valid(|s| assert!(s.overlap_grad_reduce)),
    ),
    (
        "bf16 gradient reduction over data-parallel gpus with megatron",
        "grad_reduce_in_bf16 = true\ndevice = \"cuda\"\ndata_parallel_size = 2",
        Expect::Valid(|s| {
            assert!(s.grad_reduce_in_bf16);
            assert_eq!(s.train_backend, TrainBackendKind::Megatron);
        }),
    ),
    (
        "bf16 gradient reduction over data-parallel gpus with fsdp",
        "grad_reduce_in_bf16 = true\ndevice = \"cuda\"\ndata_parallel_size = 2\ntrain_backend = \"fsdp\"",
        Expect::Valid(|s| {
            assert!(s.grad_reduce_in_bf16);
            assert_eq!(s.train_backend, TrainBackendKind::Fsdp);
        }),
    ),
    (
        "every broken rule is reported at once",
        "colocate = true\noffload_train = false\noffload_rollout_level = [\"weights\"]\n\
         fsdp_cpu_offload = true\nsteps = 0",
        Expect::Invalid(&[
            "rule5:weights->weight",
            "rule1:offload-train",
            "rule7",
            "range:steps",
        ]),
    ),
    ("zero steps", "steps = 0", Expect::Invalid(&["range:steps"])),
    (
        "rollout memory fraction above one",
        "rollout_mem_fraction = 1.5",
        Expect::Invalid(&["range:rollout-mem-fraction"]),
    ),
    (
        "zero device memory and tensor parallel size",
        "device_memory_gib = 0.0\ntensor_model_parallel_size = 0",
        Expect::Invalid(&[
            "range:device-memory-gib",
            "range:tensor-model-parallel-size",
        ]),
    ),
    (
        "samples that do not split into batches",
        "rollout_batch_size = 3\nn_samples_per_prompt = 1\nglobal_batch_size = 2",
        Expect::Invalid(&["batch"]),
    ),
];

/// Runs one case with its TOML as the layer `as_flags` says.
fn run(name: &str, toml: &str, expect: &Expect, as_flags: bool) {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("offload");
    let file = scratch.path().join("plain-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let text = toml
        .replace("{dir}", &dir.display().to_string())
        .replace("{file}", &file.display().to_string());
    let layer = RawSettings::from_toml_str(&text, Path::new("case.toml")).unwrap();
    let (flags, file_layer, expected_source) = if as_flags {
        (layer, RawSettings::default(), Source::Flag)
    } else {
        (RawSettings::default(), layer, Source::File)
    };
    let via = if as_flags { "flags" } else { "file" };
    match (Settings::resolve(flags, file_layer), expect) {
        (Ok(settings), Expect::Valid(check)) => {
            check(&settings);
            if text.contains("colocate = true") {
                assert_eq!(
                    settings.sources.get("colocate"),
                    Some(expected_source),
                    "{name}"
                );
            }
        }
        (Err(errors), Expect::Invalid(labels)) => {
            let got: Vec<String> = errors.violations.iter().map(label).collect();
            assert_eq!(got, *labels, "{name} via {via}: {errors}");
            assert_eq!(
                errors.to_string().lines().count(),
                labels.len(),
                "{name}: one per line"
            );
        }
        (Ok(settings), Expect::Invalid(labels)) => {
            panic!("{name} via {via}: expected {labels:?}, got valid {settings:?}")
        }
        (Err(errors), Expect::Valid(_)) => panic!("{name} via {via}: unexpected errors:\n{errors}"),
    }
}

#[test]
fn every_case_resolves_as_expected_from_the_file_and_from_flags() {
    assert!(CASES.len() >= 25);
    for (name, toml, expect) in CASES {
        run(name, toml, expect, false);
        run(name, toml, expect, true);
    }
}

fn layer(toml: &str) -> RawSettings {
    RawSettings::from_toml_str(toml, Path::new("layer.toml")).unwrap()
}

#[test]
fn flags_override_the_file_value_by_value() {
    let file = layer(
        "train_backend = \"fsdp\"\nsteps = 5\nlr = 0.5\noffload_train_disk_chunk_mb = 8\n\
         offload_rollout_level = [\"kv_cache\"]\nseed = 9",
    );
    let flags =
        layer("steps = 6\noffload_rollout_level = [\"weight\"]\ntrain_backend = \"megatron\"");
    let s = Settings::resolve(flags, file).unwrap();
    assert_eq!(s.steps, 6);
    assert_eq!(s.train_backend, TrainBackendKind::Megatron);
    assert_eq!(s.offload_rollout_level, [RolloutOffloadLevel::Weight]);
    assert_eq!(s.lr, 0.5);
    assert_eq!(s.offload_train_disk_chunk_mb, 8);
    for (key, source) in [
        ("steps", Source::Flag),
        ("train_backend", Source::Flag),
        ("offload_rollout_level", Source::Flag),
        ("lr", Source::File),
        ("seed", Source::File),
        ("global_batch_size", Source::Default),
    ] {
        assert_eq!(s.sources.get(key), Some(source), "{key}");
    }
}

#[test]
fn offload_flag_overrides_switches_turned_off_in_the_file() {
    let file = layer("offload_train = false\noffload_rollout = false\ncolocate = true");
    let s = Settings::resolve(layer("offload = true"), file).unwrap();
    assert!(s.offload_train && s.offload_rollout);
    assert_eq!(s.sources.get("offload_train"), Some(Source::Flag));
}

#[test]
fn a_switch_turned_off_in_the_file_breaks_rule_one_under_colocate_from_flags() {
    let errors =
        Settings::resolve(layer("colocate = true"), layer("offload_rollout = false")).unwrap_err();
    let got: Vec<String> = errors.violations.iter().map(label).collect();
    assert_eq!(got, ["rule1:offload-rollout"]);
}

#[test]
fn every_serialised_setting_has_a_source() {
    let s = Settings::resolve(layer("colocate = true"), RawSettings::default()).unwrap();
    let json = serde_json::to_value(&s).unwrap();
    let keys: Vec<&String> = json.as_object().unwrap().keys().collect();
    let sourced: Vec<&str> = s.sources.iter().map(|(key, _)| key).collect();
    assert_eq!(keys, sourced);
    assert_eq!(
        json["offload_rollout_level"],
        serde_json::json!(["kv_cache", "weight"])
    );
}

#[test]
fn resolved_settings_round_trip_through_json() {
    let s = Settings::resolve(layer("colocate = true\nsteps = 3"), RawSettings::default()).unwrap();
    let back: Settings = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
    assert_eq!(
        Settings {
            sources: s.sources.clone(),
            ..back
        },
        s
    );
}

#[test]
fn messages_name_the_flags_and_the_fix() {
    let errors = Settings::resolve(
        layer("colocate = true\noffload_train = false\noffload_rollout_level = [\"weights\"]"),
        RawSettings::default(),
    )
    .unwrap_err();
    let text = errors.to_string();
    assert!(
        text.contains("--colocate") && text.contains("--offload-train"),
        "{text}"
    );
    assert!(text.contains("did you mean `weight`?"), "{text}");
    assert!(!text.lines().any(|line| line.ends_with('.')), "{text}");
}
