//! What the RL loop measures: seconds and bytes moved per phase, device memory at every phase
//! boundary, one JSON line per step, and a memory timeline drawn as SVG.
//!
//! A metrics file is JSON lines: each run starts with a header line, `{"header": {"run_id":
//! ..., "version": ...}}`, then writes one line per step. A resumed run appends its own header
//! and steps to the same file; a file that does not start with a header is not a metrics file
//! and is refused.

mod rl;
mod timeline;

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

pub use rl::{RlMetrics, human_bytes, human_seconds, three_digits};
pub use timeline::{MemoryTimeline, MoveSpan, TimelineSample};

/// A phase of one RL step, in the order the loop runs them (DESIGN section 8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The engine generates the rollout.
    Generate,
    /// The engine's KV cache and weights leave the device (per `--offload-rollout-level`).
    OffloadRollout,
    /// The trainer's tensors come back.
    OnloadTrain,
    /// The optimizer steps (actor, and critic under PPO).
    Train,
    /// A checkpoint is written, when due.
    Save,
    /// The trainer's tensors leave the device for the offload target.
    OffloadTrain,
    /// The engine's weights come back.
    OnloadWeights,
    /// The trainer's weights go to the engine, in buckets.
    Sync,
    /// The engine's KV cache comes back.
    OnloadKv,
}

impl Phase {
    /// Every phase, in loop order.
    pub const ALL: [Phase; 9] = [
        Phase::Generate,
        Phase::OffloadRollout,
        Phase::OnloadTrain,
        Phase::Train,
        Phase::Save,
        Phase::OffloadTrain,
        Phase::OnloadWeights,
        Phase::Sync,
        Phase::OnloadKv,
    ];

    /// The phase's key in the metrics (`offload_rollout`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Generate => "generate",
            Phase::OffloadRollout => "offload_rollout",
            Phase::OnloadTrain => "onload_train",
            Phase::Train => "train",
            Phase::Save => "save",
            Phase::OffloadTrain => "offload_train",
            Phase::OnloadWeights => "onload_weights",
            Phase::Sync => "sync",
            Phase::OnloadKv => "onload_kv",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The figures of one RL step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepMetrics {
    /// The RL step (1 for the first).
    pub step: u64,
    /// Mean reward of the rollout's samples.
    pub reward_mean: f32,
    /// Population standard deviation of the rewards.
    pub reward_std: f32,
    /// Mean training loss of the step's optimizer steps.
    pub loss: f32,
    /// Whether a stop signal ended the step after training, before its last phases.
    pub interrupted: bool,
    /// Wall seconds the loop spent in each phase, indexed like [`Phase::ALL`] (0 for a phase
    /// that did not run); for a move that ran behind other work, the time waited for it.
    pub phase_seconds: [f64; 9],
    /// Seconds of the moves that ran behind other work (the actor's offload and onload on the
    /// mover's thread), their own time, counted in the step that waited for them.
    pub behind_seconds: [f64; 9],
    /// Bytes each phase moved (offloaded, onloaded or synchronised), indexed like [`Phase::ALL`].
    pub bytes_moved: [u64; 9],
    /// Device memory in use at each phase boundary: `step_start`, then `after_<phase>`.
    pub device_memory_bytes: Vec<(String, u64)>,
    /// The largest of [`device_memory_bytes`](Self::device_memory_bytes).
    pub peak_device_memory_bytes: u64,
    /// The rollout's and the policy loss's scalars.
    pub rl: RlMetrics,
}

impl StepMetrics {
    /// Adds a phase's seconds and bytes.
    pub fn add(&mut self, phase: Phase, seconds: f64, bytes: u64) {
        self.phase_seconds[phase.index()] += seconds;
        self.bytes_moved[phase.index()] += bytes;
    }

    /// Records device memory in use at boundary `name`, raising the peak.
    pub fn boundary(&mut self, name: String, bytes: u64) {
        self.peak_device_memory_bytes = self.peak_device_memory_bytes.max(bytes);
        self.device_memory_bytes.push((name, bytes));
    }

    /// Adds a move that ran behind other work: its own seconds and its bytes.
    pub fn add_behind(&mut self, phase: Phase, seconds: f64, bytes: u64) {
        self.behind_seconds[phase.index()] += seconds;
        self.bytes_moved[phase.index()] += bytes;
    }

    /// Seconds the loop waited for moves, not hidden behind work: the loop's seconds in
    /// `offload_rollout`, `onload_train` and the switch ([`switch_seconds`](Self::switch_seconds)).
    pub fn exposed_switch_seconds(&self) -> f64 {
        self.seconds(Phase::OffloadRollout)
            + self.seconds(Phase::OnloadTrain)
            + self.switch_seconds()
    }

    /// Seconds `phase`'s moves ran behind other work.
    pub fn behind(&self, phase: Phase) -> f64 {
        self.behind_seconds[phase.index()]
    }

    /// Seconds of `phase`.
    pub fn seconds(&self, phase: Phase) -> f64 {
        self.phase_seconds[phase.index()]
    }

    /// Bytes `phase` moved.
    pub fn bytes(&self, phase: Phase) -> u64 {
        self.bytes_moved[phase.index()]
    }

    /// The loop's seconds in the switch from training to rollout: `offload_train +
    /// onload_weights + sync + onload_kv`, what the GPU sits without work of either side.
    pub fn switch_seconds(&self) -> f64 {
        [
            Phase::OffloadTrain,
            Phase::OnloadWeights,
            Phase::Sync,
            Phase::OnloadKv,
        ]
        .iter()
        .map(|&p| self.seconds(p))
        .sum()
    }

    /// The step as one JSON object with the keys `step`, `reward_mean`, `reward_std`, `loss`,
    /// `interrupted`, `phase_seconds`, `behind_seconds`, `bytes_moved`, `switch_seconds`,
    /// `exposed_switch_seconds`, `device_memory_bytes`,
    /// `peak_device_memory_bytes`, and the keys of [`RlMetrics::json_fields`].
    pub fn to_json(&self) -> Value {
        let by_phase = |value: &dyn Fn(Phase) -> Value| -> Map<String, Value> {
            Phase::ALL
                .iter()
                .map(|&p| (p.name().to_owned(), value(p)))
                .collect()
        };
        let memory: Map<String, Value> = self
            .device_memory_bytes
            .iter()
            .map(|(name, bytes)| (name.clone(), json!(bytes)))
            .collect();
        let mut line = json!({
            "step": self.step,
            "reward_mean": self.reward_mean,
            "reward_std": self.reward_std,
            "loss": self.loss,
            "interrupted": self.interrupted,
            "phase_seconds": by_phase(&|p| json!(self.seconds(p))),
            "behind_seconds": by_phase(&|p| json!(self.behind(p))),
            "bytes_moved": by_phase(&|p| json!(self.bytes(p))),
            "switch_seconds": self.switch_seconds(),
            "exposed_switch_seconds": self.exposed_switch_seconds(),
            "device_memory_bytes": memory,
            "peak_device_memory_bytes": self.peak_device_memory_bytes,
        });
        if let Value::Object(fields) = &mut line {
            fields.extend(self.rl.json_fields());
        }
        line
    }
}

/// What went wrong writing metrics.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The metrics or timeline file could not be written.
    #[error("cannot write {path}; check that its directory can be created and written")]
    Write {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// An existing file that this version did not write as metrics; nothing was appended.
    #[error(
        "{path} is not a miles metrics file ({reason}); point --metrics at a new file or at one a run wrote"
    )]
    NotMetrics {
        /// The file.
        path: PathBuf,
        /// What it holds instead.
        reason: String,
    },
    /// The timeline could not be drawn.
    #[error("cannot draw the memory timeline {path}: {reason}")]
    Draw {
        /// The SVG file.
        path: PathBuf,
        /// What the plotting library said.
        reason: String,
    },
}

/// Creates the directory `path` goes in, when missing.
fn create_parent(path: &Path) -> Result<(), MetricsError> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|source| MetricsError::Write {
                path: path.to_path_buf(),
                source,
            })
        }
        _ => Ok(()),
    }
}

/// The first line of each run in a metrics file.
#[derive(Clone, Debug, PartialEq)]
pub struct RunHeader {
    /// Names this run among the runs of the file (random, 16 hex digits).
    pub run_id: String,
    /// The version of miles that wrote it.
    pub version: String,
}

impl RunHeader {
    /// The header of a new run.
    pub fn new() -> RunHeader {
        RunHeader {
            run_id: format!("{:016x}", rand::random::<u64>()),
            version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    /// The header as its JSON line's object.
    pub fn to_json(&self) -> Value {
        json!({"header": {"run_id": self.run_id, "version": self.version}})
    }
}

impl Default for RunHeader {
    fn default() -> RunHeader {
        RunHeader::new()
    }
}

/// The longest first line read to recognise a metrics file, in bytes.
const MAX_HEADER_LINE: u64 = 64 << 10;

/// Checks that `path`, if it exists, is a metrics file (empty, or starting with a header line)
/// that can be appended to, and that its directory can be created; changes nothing else.
///
/// # Errors
/// [`MetricsError::NotMetrics`] for another file or a directory, [`MetricsError::Write`] when
/// it cannot be opened or its directory cannot be created.
pub fn check_metrics_file(path: &Path) -> Result<(), MetricsError> {
    let write_error = |source| MetricsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let not_metrics = |reason: &str| MetricsError::NotMetrics {
        path: path.to_path_buf(),
        reason: reason.to_owned(),
    };
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() => return Err(not_metrics("not a regular file")),
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            create_parent(path)?;
            return probe_dir(path);
        }
        Err(error) => return Err(write_error(error)),
    }
    let file = File::options()
        .read(true)
        .append(true)
        .open(path)
        .map_err(write_error)?;
    let mut first = String::new();
    BufReader::new(file.take(MAX_HEADER_LINE))
        .read_line(&mut first)
        .map_err(|_| not_metrics("its first line is not text"))?;
    if first.is_empty() {
        return Ok(());
    }
    let header = serde_json::from_str::<Value>(&first).ok();
    if header.as_ref().and_then(|v| v.get("header")).is_none() {
        return Err(not_metrics("its first line is not a run header"));
    }
    Ok(())
}

/// Creates and removes a probe file beside `path`: its directory takes new files.
fn probe_dir(path: &Path) -> Result<(), MetricsError> {
    let probe = path.with_file_name(format!(".miles-write-probe-{}", std::process::id()));
    File::create(&probe)
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|source| MetricsError::Write {
            path: path.to_path_buf(),
            source,
        })
}

/// Appends one JSON line per step to a metrics file, after the run's header line, flushed
/// after each line so that a stopped run keeps every finished step.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl MetricsWriter {
    /// Opens `path` for appending (a resumed run continues the same file) and writes `header`;
    /// a last line cut short (a run killed mid-write) is ended first.
    ///
    /// # Errors
    /// As [`check_metrics_file`]; [`MetricsError::Write`] when the header cannot be written.
    pub fn append(path: &Path, header: &RunHeader) -> Result<Self, MetricsError> {
        check_metrics_file(path)?;
        let wrap = |source| MetricsError::Write {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::options()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .map_err(wrap)?;
        let len = file.metadata().map_err(wrap)?.len();
        let mut last = [b'\n'];
        if len > 0 {
            file.seek(SeekFrom::Start(len - 1))
                .and_then(|_| file.read_exact(&mut last))
                .map_err(wrap)?;
        }
        let mut writer = Self {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        };
        if last[0] != b'\n' {
            writeln!(writer.out).map_err(wrap)?;
        }
        writer.line(&header.to_json())?;
        Ok(writer)
    }

    /// Writes `metrics` as one line.
    ///
    /// # Errors
    /// [`MetricsError::Write`].
    pub fn write(&mut self, metrics: &StepMetrics) -> Result<(), MetricsError> {
        self.line(&metrics.to_json())
    }

    fn line(&mut self, value: &Value) -> Result<(), MetricsError> {
        let wrap = |source| MetricsError::Write {
            path: self.path.clone(),
            source,
        };
        writeln!(self.out, "{value}").map_err(wrap)?;
        self.out.flush().map_err(wrap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_json_has_exactly_the_documented_keys_and_every_phase() {
        let mut m = StepMetrics {
            step: 3,
            reward_mean: 0.25,
            reward_std: 0.5,
            loss: 1.5,
            ..StepMetrics::default()
        };
        m.add(Phase::OffloadRollout, 0.5, 4096);
        m.add(Phase::Sync, 0.25, 1024);
        m.add_behind(Phase::OffloadTrain, 0.75, 2048);
        m.boundary("step_start".into(), 10);
        m.boundary("after_generate".into(), 30);
        m.boundary("after_offload_rollout".into(), 5);
        let v = m.to_json();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "behind_seconds",
                "bytes_moved",
                "clip_fraction",
                "device_memory_bytes",
                "exposed_switch_seconds",
                "grad_norm",
                "interrupted",
                "kl",
                "loss",
                "lr",
                "peak_device_memory_bytes",
                "pg_loss",
                "phase_seconds",
                "response_len_max",
                "response_len_mean",
                "reward_mean",
                "reward_std",
                "rollout_tokens_per_second",
                "step",
                "switch_seconds",
                "train_tokens_per_second",
                "truncated_fraction"
            ]
        );
        for phase in Phase::ALL {
            assert!(v["phase_seconds"][phase.name()].is_number(), "{phase:?}");
            assert!(v["bytes_moved"][phase.name()].is_u64(), "{phase:?}");
        }
        assert_eq!(v["bytes_moved"]["offload_rollout"], 4096);
        assert_eq!(v["phase_seconds"]["sync"], 0.25);
        assert_eq!(v["switch_seconds"], m.switch_seconds());
        assert_eq!(v["exposed_switch_seconds"], m.exposed_switch_seconds());
        assert_eq!(
            m.exposed_switch_seconds(),
            0.75,
            "offload_rollout and sync, not the move behind"
        );
        assert_eq!(v["behind_seconds"]["offload_train"], 0.75);
        assert_eq!(v["bytes_moved"]["offload_train"], 2048);
        assert_eq!(v["device_memory_bytes"]["after_generate"], 30);
        assert_eq!(v["peak_device_memory_bytes"], 30);
        assert_eq!(v["step"], 3);
    }

    #[test]
    fn each_run_appends_its_header_then_one_parseable_line_per_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("new").join("m.jsonl");
        let headers = [RunHeader::new(), RunHeader::new()];
        for (step, header) in (1..=2).zip(&headers) {
            let mut w = MetricsWriter::append(&path, header).unwrap();
            w.write(&StepMetrics {
                step,
                ..StepMetrics::default()
            })
            .unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_ne!(headers[0].run_id, headers[1].run_id);
        for (at, header) in [(0, &headers[0]), (2, &headers[1])] {
            assert_eq!(lines[at]["header"]["run_id"], header.run_id.as_str());
            assert_eq!(lines[at]["header"]["version"], env!("CARGO_PKG_VERSION"));
        }
        assert_eq!(lines[1]["step"], 1);
        assert_eq!(lines[3]["step"], 2);
    }

    #[test]
    fn a_file_that_is_not_a_metrics_file_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notes.txt");
        std::fs::write(&path, "my notes\n").unwrap();
        let error = MetricsWriter::append(&path, &RunHeader::new()).unwrap_err();
        assert!(matches!(error, MetricsError::NotMetrics { .. }), "{error}");
        assert!(error.to_string().contains("notes.txt"), "{error}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "my notes\n");
        let error = check_metrics_file(dir.path()).unwrap_err();
        assert!(matches!(error, MetricsError::NotMetrics { .. }), "{error}");
    }

    #[test]
    fn a_line_cut_short_is_ended_before_the_next_run_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        std::fs::write(&path, "{\"header\": {}}\n{\"step\": 1, \"lo").unwrap();
        MetricsWriter::append(&path, &RunHeader::new()).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert!(last.get("header").is_some(), "{text}");
    }
}
