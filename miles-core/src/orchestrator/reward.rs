//! Rewards of completions: the built-ins that need no model (`--rm-type math|exact|task`) and a
//! user's long-lived reward process (`--custom-rm-command`), behind one [`Reward`] trait that
//! library users implement too.
//!
//! The reward process reads one JSON object per line on its stdin,
//! `{"prompt", "response", "label", "metadata"}`, and answers each with one line
//! `{"reward": R}` on its stdout, in order. The loop sends a rollout's requests at once and
//! waits for all the answers within the timeout; a process that exits, answers something
//! else, or runs out of time stops the run with the tail of its stderr (never a silent zero).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::task::Problem;
use crate::config::RmType;
use crate::model::{ModelError, Tokenizer};

/// One completion to score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RewardRequest<'a> {
    /// The prompt text.
    pub prompt: &'a str,
    /// The completion's text, without its stop token.
    pub response: &'a str,
    /// The row's label (the task's answer); empty without one.
    pub label: &'a str,
    /// The row's metadata (`null` without).
    pub metadata: &'a Value,
    /// The completion's ids, the stop token included when it stopped on one.
    pub tokens: &'a [u32],
}

/// What went wrong scoring completions.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The task reward could not decode a response.
    #[error(transparent)]
    Task(#[from] ModelError),
    /// The reward process could not be started.
    #[error("cannot start the reward command `{command}`: {source}; check --custom-rm-command")]
    Spawn {
        /// The command line.
        command: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The reward process exited or closed its pipes.
    #[error(
        "the reward command `{command}` stopped ({status}) after answering {answered} of {asked} requests; its stderr ended with:\n{stderr}"
    )]
    Crashed {
        /// The command line.
        command: String,
        /// Its exit status, as the system tells it.
        status: String,
        /// Answers received of this batch.
        answered: usize,
        /// Requests of this batch.
        asked: usize,
        /// The tail of its stderr.
        stderr: String,
    },
    /// The reward process did not answer a batch in time; it was killed.
    #[error(
        "the reward command `{command}` answered {answered} of {asked} requests in {seconds} s (--custom-rm-timeout); it was stopped; its stderr ended with:\n{stderr}"
    )]
    Timeout {
        /// The command line.
        command: String,
        /// The timeout.
        seconds: f64,
        /// Answers received.
        answered: usize,
        /// Requests sent.
        asked: usize,
        /// The tail of its stderr.
        stderr: String,
    },
    /// The reward process answered a line that is not `{"reward": <finite number>}`.
    #[error(
        "the reward command `{command}` answered `{line}` to request {index}: {reason}; each answer must be one line {{\"reward\": <number>}}; its stderr ended with:\n{stderr}"
    )]
    Malformed {
        /// The command line.
        command: String,
        /// 0-based request of the batch.
        index: usize,
        /// The line it wrote (cut at 200 characters).
        line: String,
        /// What is wrong with it.
        reason: String,
        /// The tail of its stderr.
        stderr: String,
    },
    /// A label the reward cannot compare against.
    #[error("label `{label}` cannot be scored by --rm-type {rm_type}: {reason}")]
    Label {
        /// The reward type.
        rm_type: RmType,
        /// The label.
        label: String,
        /// Why.
        reason: String,
    },
    /// A reward returned another count of scores than requests.
    #[error("reward `{name}` returned {got} scores for {expected} completions")]
    Count {
        /// The reward's name.
        name: String,
        /// Scores returned.
        got: usize,
        /// Completions asked.
        expected: usize,
    },
}

/// Scores completions: what the loop calls once per rollout with every sample.
pub trait Reward: Send {
    /// The reward's name in logs (`math`, the command line).
    fn name(&self) -> &str;

    /// The reward of each request, in order.
    ///
    /// # Errors
    /// [`RewardError`] when the reward cannot be computed; the run stops.
    fn score(&mut self, requests: &[RewardRequest<'_>]) -> Result<Vec<f32>, RewardError>;

    /// Whether `label` can be scored at all, checked on every row before any work.
    ///
    /// # Errors
    /// [`RewardError::Label`] naming why not.
    fn check_label(&self, label: &str) -> Result<(), RewardError> {
        let _ = label;
        Ok(())
    }
}

/// A built-in reward (`--rm-type`).
#[derive(Clone, Debug)]
pub struct BuiltinReward {
    rm_type: RmType,
    tokenizer: Tokenizer,
}

impl BuiltinReward {
    /// The reward `rm_type`; the tokenizer serves the task reward's stop token.
    pub fn new(rm_type: RmType, tokenizer: impl Into<Tokenizer>) -> Self {
        Self {
            rm_type,
            tokenizer: tokenizer.into(),
        }
    }

    fn one(&self, request: &RewardRequest<'_>) -> Result<f32, RewardError> {
        Ok(match self.rm_type {
            RmType::Math => {
                let label = self.label_value(request.label)?;
                match final_answer(request.response) {
                    Some(answer) if same_number(answer, label) => 1.0,
                    _ => 0.0,
                }
            }
            RmType::Exact => f32::from(u8::from(request.response.trim() == request.label.trim())),
            RmType::Task => Problem {
                text: request.prompt.to_owned(),
                answer: request.label.to_owned(),
                metadata: Value::Null,
            }
            .reward(request.tokens, &self.tokenizer)?,
        })
    }

    fn label_value(&self, label: &str) -> Result<f64, RewardError> {
        final_answer(label).ok_or_else(|| RewardError::Label {
            rm_type: self.rm_type,
            label: label.to_owned(),
            reason: "it holds no number".into(),
        })
    }
}

impl Reward for BuiltinReward {
    fn name(&self) -> &str {
        self.rm_type.as_str()
    }

    fn score(&mut self, requests: &[RewardRequest<'_>]) -> Result<Vec<f32>, RewardError> {
        requests.iter().map(|r| self.one(r)).collect()
    }

    fn check_label(&self, label: &str) -> Result<(), RewardError> {
        match self.rm_type {
            RmType::Math => self.label_value(label).map(|_| ()),
            RmType::Exact | RmType::Task => Ok(()),
        }
    }
}

/// The final answer of a math completion: the number in the last `\boxed{...}`, else the last
/// number of the text. Numbers may carry a sign, a decimal point, thousands commas (`1,000`)
/// and be fractions (`3/4`, `\frac{3}{4}`).
pub fn final_answer(text: &str) -> Option<f64> {
    if let Some(boxed) = last_boxed(text) {
        return parse_number(boxed.trim()).or_else(|| last_number(boxed));
    }
    last_number(text)
}

/// Two answers are the same number: equal within a relative `1e-6`.
fn same_number(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

/// The contents of the last `\boxed{...}`, braces balanced.
fn last_boxed(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..start + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// A whole string as one number: `-12`, `3.5`, `1,000`, `3/4`, `\frac{3}{4}`, `\dfrac{3}{4}`.
fn parse_number(text: &str) -> Option<f64> {
    let text = text.trim().trim_end_matches('.');
    for prefix in ["\\frac{", "\\dfrac{", "\\tfrac{"] {
        if let Some(rest) = text.strip_prefix(prefix) {
            let (num, den) = rest.strip_suffix('}')?.split_once("}{")?;
            return divide(parse_plain(num)?, parse_plain(den)?);
        }
    }
    if let Some((num, den)) = text.split_once('/') {
        return divide(parse_plain(num)?, parse_plain(den)?);
    }
    parse_plain(text)
}

fn divide(num: f64, den: f64) -> Option<f64> {
    (den != 0.0).then(|| num / den)
}

/// A decimal number with an optional sign and thousands commas.
fn parse_plain(text: &str) -> Option<f64> {
    let text = text.trim();
    let cleaned: String = text.chars().filter(|&c| c != ',').collect();
    let digits = cleaned.trim_start_matches(['-', '+']);
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return None;
    }
    cleaned.parse().ok().filter(|v: &f64| v.is_finite())
}

/// The last number in `text`: a run of digits with an optional leading `-`, commas between
/// digit groups, one decimal point, and an optional `/digits` denominator.
fn last_number(text: &str) -> Option<f64> {
    let bytes = text.as_bytes();
    let mut end = bytes.len();
    while end > 0 {
        let last = bytes[..end].iter().rposition(u8::is_ascii_digit)?;
        let mut start = last;
        while start > 0 {
            let b = bytes[start - 1];
            let inner =
                matches!(b, b',' | b'.' | b'/') && start >= 2 && bytes[start - 2].is_ascii_digit();
            if b.is_ascii_digit() || inner {
                start -= 1;
            } else {
                break;
            }
        }
        if start > 0 && bytes[start - 1] == b'-' {
            start -= 1;
        }
        if let Some(value) = parse_number(&text[start..=last]) {
            return Some(value);
        }
        end = start;
    }
    None
}

/// Bytes of the reward process's stderr kept for error messages.
const STDERR_TAIL: usize = 4096;

/// A user's reward process (`--custom-rm-command`), started once and fed every rollout.
pub struct CommandReward {
    command: String,
    child: Child,
    stdin: Option<ChildStdin>,
    answers: Receiver<std::io::Result<String>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    stderr_done: Receiver<()>,
    timeout: Duration,
}

impl CommandReward {
    /// Starts `command` under `sh -c`, its stdin and stdout piped to the loop and its stderr
    /// kept (the last 4 KiB) for error messages; `timeout` bounds each batch.
    ///
    /// # Errors
    /// [`RewardError::Spawn`] when the shell cannot be started.
    pub fn spawn(command: &str, timeout: Duration) -> Result<Self, RewardError> {
        let spawn_error = |source| RewardError::Spawn {
            command: command.to_owned(),
            source,
        };
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_error)?;
        let missing = || spawn_error(std::io::Error::other("a pipe of the child is missing"));
        let stdin = child.stdin.take().ok_or_else(missing)?;
        let stdout = child.stdout.take().ok_or_else(missing)?;
        let mut stderr_pipe = child.stderr.take().ok_or_else(missing)?;
        let (send, answers) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let failed = line.is_err();
                if send.send(line).is_err() || failed {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let tail = Arc::clone(&stderr);
        let (done, stderr_done) = channel();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 1024];
            while let Ok(n) = stderr_pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                if let Ok(mut kept) = tail.lock() {
                    kept.extend_from_slice(&chunk[..n]);
                    let extra = kept.len().saturating_sub(STDERR_TAIL);
                    kept.drain(..extra);
                }
            }
            let _ = done.send(());
        });
        tracing::info!(command, "started the reward command");
        Ok(Self {
            command: command.to_owned(),
            child,
            stdin: Some(stdin),
            answers,
            stderr,
            stderr_done,
            timeout,
        })
    }

    /// The tail of the process's stderr, after waiting briefly for it to close.
    fn stderr_tail(&self, wait: Duration) -> String {
        let _ = self.stderr_done.recv_timeout(wait);
        let kept = self.stderr.lock().map(|k| k.clone()).unwrap_or_default();
        let text = String::from_utf8_lossy(&kept).trim_end().to_owned();
        if text.is_empty() {
            "(nothing)".to_owned()
        } else {
            text
        }
    }

    /// The error of a process that stopped answering.
    fn crashed(&mut self, answered: usize, asked: usize) -> RewardError {
        self.stdin = None;
        let deadline = Instant::now() + Duration::from_secs(1);
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break status.to_string(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    break "closed its stdout, still running; stopped".to_owned();
                }
                Err(error) => break format!("status unknown: {error}"),
            }
        };
        RewardError::Crashed {
            command: self.command.clone(),
            status,
            answered,
            asked,
            stderr: self.stderr_tail(Duration::from_millis(500)),
        }
    }
}

impl Reward for CommandReward {
    fn name(&self) -> &str {
        &self.command
    }

    fn score(&mut self, requests: &[RewardRequest<'_>]) -> Result<Vec<f32>, RewardError> {
        let started = Instant::now();
        let mut lines = String::new();
        for r in requests {
            let request = json!({
                "prompt": r.prompt,
                "response": r.response,
                "label": r.label,
                "metadata": r.metadata,
            });
            lines.push_str(&request.to_string());
            lines.push('\n');
        }
        let written = match self.stdin.as_mut() {
            Some(stdin) => stdin
                .write_all(lines.as_bytes())
                .and_then(|()| stdin.flush()),
            None => Err(std::io::Error::other("stdin closed")),
        };
        if written.is_err() {
            return Err(self.crashed(0, requests.len()));
        }
        let mut rewards = Vec::with_capacity(requests.len());
        while rewards.len() < requests.len() {
            let left = self.timeout.saturating_sub(started.elapsed());
            match self.answers.recv_timeout(left) {
                Ok(Ok(line)) => {
                    let index = rewards.len();
                    rewards.push(
                        parse_answer(&line).map_err(|reason| RewardError::Malformed {
                            command: self.command.clone(),
                            index,
                            line: line.chars().take(200).collect(),
                            reason,
                            stderr: self.stderr_tail(Duration::from_millis(100)),
                        })?,
                    );
                }
                Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.crashed(rewards.len(), requests.len()));
                }
                Err(RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    return Err(RewardError::Timeout {
                        command: self.command.clone(),
                        seconds: self.timeout.as_secs_f64(),
                        answered: rewards.len(),
                        asked: requests.len(),
                        stderr: self.stderr_tail(Duration::from_millis(500)),
                    });
                }
            }
        }
        Ok(rewards)
    }
}

impl Drop for CommandReward {
    fn drop(&mut self) {
        // Closing stdin lets a well-behaved process finish on its own.
        self.stdin = None;
        if let Err(error) = self.child.kill() {
            tracing::debug!(%error, "reward command already gone");
        }
        let _ = self.child.wait();
    }
}

/// The reward of one answer line: `{"reward": <finite number>}`.
fn parse_answer(line: &str) -> Result<f32, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not json ({e})"))?;
    let reward = value
        .get("reward")
        .ok_or_else(|| "no `reward` key".to_owned())?
        .as_f64()
        .ok_or_else(|| "`reward` is not a number".to_owned())?;
    if reward.is_finite() {
        Ok(reward as f32)
    } else {
        Err("`reward` is not finite".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> crate::model::ByteTokenizer {
        crate::model::ByteTokenizer {
            bos: 256,
            eos: 257,
            pad: 258,
        }
    }

    fn score(rm: RmType, response: &str, label: &str) -> f32 {
        let t = tokenizer();
        let mut tokens = t.encode(response, false);
        tokens.push(t.eos);
        let request = RewardRequest {
            prompt: "p",
            response,
            label,
            metadata: &Value::Null,
            tokens: &tokens,
        };
        BuiltinReward::new(rm, t).score(&[request]).unwrap()[0]
    }

    #[test]
    fn math_takes_the_boxed_answer_or_the_last_number_and_compares_numerically() {
        let cases = [
            ("so the answer is \\boxed{42}", "42", 1.0),
            ("\\boxed{41} no wait 42", "42", 0.0),
            ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
            ("it is 3/4", "0.75", 1.0),
            ("first 3 then 7", "7", 1.0),
            ("first 7 then 3", "7", 0.0),
            ("total: 1,000 apples.", "1000", 1.0),
            ("-5", "-5", 1.0),
            ("2.50", "2.5", 1.0),
            ("no number here", "3", 0.0),
            ("12", "\\boxed{12}", 1.0),
            ("5 - 3 = 2", "2", 1.0),
        ];
        for (response, label, want) in cases {
            assert_eq!(
                score(RmType::Math, response, label),
                want,
                "{response} vs {label}"
            );
        }
    }

    #[test]
    fn math_refuses_a_label_without_a_number() {
        let reward = BuiltinReward::new(RmType::Math, tokenizer());
        assert!(reward.check_label("seven").is_err());
        assert!(reward.check_label("7").is_ok());
        assert!(
            BuiltinReward::new(RmType::Exact, tokenizer())
                .check_label("seven")
                .is_ok()
        );
    }

    #[test]
    fn exact_compares_trimmed_text_and_task_gives_partial_credit() {
        assert_eq!(score(RmType::Exact, " yes ", "yes"), 1.0);
        assert_eq!(score(RmType::Exact, "yes!", "yes"), 0.0);
        assert_eq!(score(RmType::Task, "321", "321"), 1.0);
        assert!((score(RmType::Task, "322", "321") - 0.5 * 2.0 / 3.0).abs() < 1e-6);
    }

    /// A reward script written by the test into `dir`.
    fn script(dir: &tempfile::TempDir, body: &str) -> String {
        let path = dir.path().join("rm.py");
        std::fs::write(&path, body).unwrap();
        format!("python3 {}", path.display())
    }

    fn python() -> bool {
        let found = Command::new("python3").arg("--version").output().is_ok();
        if !found {
            println!("skipped: no python3");
        }
        found
    }

    fn requests<'a>(texts: &'a [&'a str], meta: &'a Value) -> Vec<RewardRequest<'a>> {
        texts
            .iter()
            .map(|t| RewardRequest {
                prompt: "q",
                response: t,
                label: "4",
                metadata: meta,
                tokens: &[],
            })
            .collect()
    }

    #[test]
    fn the_command_answers_every_request_of_each_batch_in_order() {
        if !python() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let cmd = script(
            &dir,
            "import json, sys\n\
             for line in sys.stdin:\n\
             \x20   r = json.loads(line)\n\
             \x20   ok = r['response'] == r['label'] and r['prompt'] == 'q' and r['metadata']['k'] == 1\n\
             \x20   print(json.dumps({'reward': 1.0 if ok else 0.25}), flush=True)\n",
        );
        let mut rm = CommandReward::spawn(&cmd, Duration::from_secs(20)).unwrap();
        let meta = json!({"k": 1});
        for _ in 0..2 {
            let texts = ["4", "5", "4"];
            assert_eq!(
                rm.score(&requests(&texts, &meta)).unwrap(),
                [1.0, 0.25, 1.0]
            );
        }
    }

    #[test]
    fn a_crashing_command_is_an_error_with_its_stderr() {
        if !python() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let cmd = script(
            &dir,
            "import sys\nsys.stdin.readline()\nprint('{\"reward\": 1}', flush=True)\n\
             sys.stderr.write('boom: bad reward model\\n')\nsys.exit(3)\n",
        );
        let mut rm = CommandReward::spawn(&cmd, Duration::from_secs(20)).unwrap();
        let error = rm.score(&requests(&["a", "b"], &Value::Null)).unwrap_err();
        let message = error.to_string();
        assert!(
            matches!(
                error,
                RewardError::Crashed {
                    answered: 1,
                    asked: 2,
                    ..
                }
            ),
            "{message}"
        );
        assert!(
            message.contains("boom: bad reward model") && message.contains('3'),
            "{message}"
        );
    }

    #[test]
    fn malformed_answers_are_errors_naming_the_line() {
        if !python() {
            return;
        }
        for (answer, reason) in [
            ("hello", "not json"),
            ("{\"score\": 1}", "no `reward` key"),
            ("{\"reward\": \"high\"}", "not a number"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let cmd = script(
                &dir,
                &format!("import sys\nfor line in sys.stdin:\n    print({answer:?}, flush=True)\n"),
            );
            let mut rm = CommandReward::spawn(&cmd, Duration::from_secs(20)).unwrap();
            let error = rm.score(&requests(&["a"], &Value::Null)).unwrap_err();
            let message = error.to_string();
            assert!(
                matches!(error, RewardError::Malformed { index: 0, .. }),
                "{message}"
            );
            assert!(
                message.contains(reason) && message.contains(answer),
                "{message}"
            );
        }
    }

    #[test]
    fn a_command_slower_than_the_timeout_is_stopped_with_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slow.sh");
        std::fs::write(&path, "read line\necho waiting >&2\nexec sleep 30\n").unwrap();
        let cmd = format!("sh {}", path.display());
        // Long enough for the shell to start and write its line on a loaded machine.
        let mut rm = CommandReward::spawn(&cmd, Duration::from_secs(3)).unwrap();
        let started = Instant::now();
        let error = rm.score(&requests(&["a"], &Value::Null)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(20));
        let message = error.to_string();
        assert!(
            matches!(
                error,
                RewardError::Timeout {
                    answered: 0,
                    asked: 1,
                    ..
                }
            ),
            "{message}"
        );
        assert!(message.contains("waiting"), "{message}");
    }
}
