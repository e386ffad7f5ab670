//! Prompt datasets a user brings: a JSON-lines file with one prompt per line, read once before
//! any work, and the order the loop draws its rows in.
//!
//! Each line is one JSON object; `--input-key` names the prompt field, `--label-key` the
//! answer a reward compares against (a string or a number), `--metadata-key` any JSON value
//! passed along to the reward. A line that is not such an object (invalid JSON, a missing key,
//! a value of the wrong type) is skipped and reported with its line number; a prompt longer
//! than `--rollout-max-prompt-len` tokens is skipped and counted, or stops the load, per
//! [`LongPrompt`]. A file without one usable row is an error.
//!
//! The rows are drawn in epochs: each epoch is a permutation of every row keyed by the seed
//! and the epoch's index, and step `s` of `B` prompts takes positions `(s - 1) * B ..` of the
//! epochs laid end to end, so a resumed run draws what the uninterrupted run drew.

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;
use serde_json::Value;

use super::task::{Problem, ProblemSource, Stream, stream_seed};
use crate::config::{LongPrompt, Settings};

/// Which fields of a row hold what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataKeys {
    /// The prompt's field (`--input-key`).
    pub input: String,
    /// The label's field (`--label-key`); rows carry no label without it.
    pub label: Option<String>,
    /// The metadata's field (`--metadata-key`); a row without it gets `null`.
    pub metadata: String,
}

/// Turns a row's input value into the prompt text the tokenizer encodes: the seam where a chat
/// template plugs in (a list of messages rendered by the model's template).
pub trait PromptRenderer {
    /// The prompt text of `input`.
    ///
    /// # Errors
    /// Why the value cannot be rendered (its type, a bad message), as a sentence naming the fix.
    fn render(&self, input: &Value) -> Result<String, String>;
}

/// The renderer without a chat template: the input must be a string and is the prompt as is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlainPrompt;

impl PromptRenderer for PlainPrompt {
    fn render(&self, input: &Value) -> Result<String, String> {
        match input {
            Value::String(text) => Ok(text.clone()),
            Value::Array(_) => Err(
                "is a list (chat messages?); without a chat template the prompt must be a string"
                    .into(),
            ),
            other => Err(format!("is {}, not a string", json_type(other))),
        }
    }
}

/// One usable row of a dataset.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptRow {
    /// 1-based line in the file.
    pub line: usize,
    /// The row as a problem: rendered prompt text, label (empty without a label key),
    /// metadata.
    pub problem: Problem,
    /// Prompt tokens, as the loop feeds them to the engine.
    pub tokens: usize,
}

/// A row that was skipped, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadRow {
    /// 1-based line in the file.
    pub line: usize,
    /// What is wrong with it.
    pub reason: String,
}

/// A dataset read from a JSON-lines file.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptDataset {
    /// The file.
    pub path: PathBuf,
    /// The usable rows, in file order.
    pub rows: Vec<PromptRow>,
    /// Rows that were not usable, in file order.
    pub bad: Vec<BadRow>,
    /// Rows skipped for a prompt longer than the limit.
    pub too_long: usize,
}

/// What stops a dataset from loading. Every variant is bad input: the run exits 2 before any
/// work.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file cannot be read.
    #[error("cannot read prompt data {}: {source}; check the path given to --prompt-data", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// No row of the file can be used.
    #[error(
        "no usable row in prompt data {}: {bad} bad rows, {too_long} prompts longer than --rollout-max-prompt-len{}; each line must be a json object with a string under --input-key `{input}`",
        path.display(), first.as_ref().map(|r| format!(" (first: line {}: {})", r.line, r.reason)).unwrap_or_default()
    )]
    NoUsableRow {
        /// The file.
        path: PathBuf,
        /// Rows that were not usable.
        bad: usize,
        /// Rows whose prompts were too long.
        too_long: usize,
        /// The first bad row.
        first: Option<BadRow>,
        /// The input key.
        input: String,
    },
    /// A prompt is longer than the limit and the policy is to stop.
    #[error(
        "prompt at line {line} of {} has {tokens} tokens, over --rollout-max-prompt-len {max}; raise the limit or pass --rollout-long-prompt skip",
        path.display()
    )]
    PromptTooLong {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// Its prompt tokens.
        tokens: usize,
        /// The limit.
        max: usize,
    },
}

/// How a dataset is read: the keys, the limit on prompt tokens and what a longer prompt does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataOptions {
    /// Which fields hold what.
    pub keys: DataKeys,
    /// Prompt tokens at most (`--rollout-max-prompt-len`).
    pub max_prompt_len: Option<usize>,
    /// What a longer prompt does.
    pub long_prompt: LongPrompt,
}

impl DataOptions {
    /// The options of `--prompt-data` in `settings`.
    pub fn from_settings(s: &Settings) -> Self {
        Self {
            keys: DataKeys {
                input: s.input_key.clone(),
                label: s.label_key.clone(),
                metadata: s.metadata_key.clone(),
            },
            max_prompt_len: s.rollout_max_prompt_len,
            long_prompt: s.rollout_long_prompt,
        }
    }
}

impl PromptDataset {
    /// Reads `path`: renders each row's input with `renderer`, counts its tokens with
    /// `encode` (the loop's prompt encoding), and keeps the rows that fit. Logs a warning for
    /// each bad row (the first ten, then a count).
    ///
    /// # Errors
    /// [`DataError::Read`], [`DataError::NoUsableRow`], or [`DataError::PromptTooLong`] under
    /// [`LongPrompt::Error`].
    pub fn load(
        path: &Path,
        options: &DataOptions,
        renderer: &dyn PromptRenderer,
        encode: &dyn Fn(&str) -> Vec<u32>,
    ) -> Result<PromptDataset, DataError> {
        let text = std::fs::read_to_string(path).map_err(|source| DataError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut dataset = PromptDataset {
            path: path.to_path_buf(),
            rows: Vec::new(),
            bad: Vec::new(),
            too_long: 0,
        };
        for (index, line) in text.lines().enumerate() {
            let line_no = index + 1;
            if line.trim().is_empty() {
                continue;
            }
            let problem = match parse_row(line, &options.keys, renderer) {
                Ok(problem) => problem,
                Err(reason) => {
                    dataset.bad.push(BadRow {
                        line: line_no,
                        reason,
                    });
                    continue;
                }
            };
            let tokens = encode(&problem.text).len();
            if let Some(max) = options.max_prompt_len
                && tokens > max
            {
                if options.long_prompt == LongPrompt::Error {
                    return Err(DataError::PromptTooLong {
                        path: path.to_path_buf(),
                        line: line_no,
                        tokens,
                        max,
                    });
                }
                dataset.too_long += 1;
                continue;
            }
            dataset.rows.push(PromptRow {
                line: line_no,
                problem,
                tokens,
            });
        }
        for bad in dataset.bad.iter().take(10) {
            tracing::warn!(file = %path.display(), line = bad.line, "skipped a bad row: {}", bad.reason);
        }
        if dataset.bad.len() > 10 {
            tracing::warn!(
                file = %path.display(),
                more = dataset.bad.len() - 10,
                "skipped more bad rows"
            );
        }
        if dataset.too_long > 0 {
            tracing::warn!(
                file = %path.display(),
                skipped = dataset.too_long,
                "skipped prompts longer than --rollout-max-prompt-len"
            );
        }
        if dataset.rows.is_empty() {
            return Err(DataError::NoUsableRow {
                path: path.to_path_buf(),
                bad: dataset.bad.len(),
                too_long: dataset.too_long,
                first: dataset.bad.first().cloned(),
                input: options.keys.input.clone(),
            });
        }
        tracing::info!(
            file = %path.display(),
            rows = dataset.rows.len(),
            bad = dataset.bad.len(),
            too_long = dataset.too_long,
            "prompt data"
        );
        Ok(dataset)
    }

    /// `count` rows from position `start` of the epochs of `stream` laid end to end, each
    /// epoch a permutation of every row keyed by `seed` and its index.
    pub fn problems(&self, seed: u64, stream: Stream, start: u64, count: usize) -> Vec<Problem> {
        let len = self.rows.len() as u64;
        let mut order: Option<(u64, Vec<usize>)> = None;
        (start..start + count as u64)
            .map(|position| {
                let epoch = position / len;
                if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    let mut rows: Vec<usize> = (0..self.rows.len()).collect();
                    rows.shuffle(&mut ChaCha20Rng::seed_from_u64(stream_seed(
                        seed, stream, epoch,
                    )));
                    order = Some((epoch, rows));
                }
                let row = order
                    .as_ref()
                    .map_or(0, |(_, rows)| rows[(position % len) as usize]);
                self.rows[row].problem.clone()
            })
            .collect()
    }
}

/// Where the loop's problems come from: a synthetic task or a dataset.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptSource {
    /// Generated problems of `--task`.
    Task(ProblemSource),
    /// Rows of `--prompt-data`, drawn in seeded epochs.
    Data {
        /// The dataset.
        dataset: PromptDataset,
        /// The run's seed.
        seed: u64,
    },
}

impl PromptSource {
    /// The `count` problems of step `index` (1-based) of `stream`: the same arguments always
    /// give the same problems.
    pub fn problems(&self, stream: Stream, index: u64, count: usize) -> Vec<Problem> {
        match self {
            PromptSource::Task(source) => source.problems(stream, index, count),
            PromptSource::Data { dataset, seed } => {
                dataset.problems(*seed, stream, index.saturating_sub(1) * count as u64, count)
            }
        }
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// The problem of one line, or why the line cannot be used.
fn parse_row(
    line: &str,
    keys: &DataKeys,
    renderer: &dyn PromptRenderer,
) -> Result<Problem, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not valid json ({e})"))?;
    let Value::Object(mut row) = value else {
        return Err(format!("is {}, not a json object", json_type(&value)));
    };
    let input = row
        .remove(&keys.input)
        .ok_or_else(|| format!("has no input key `{}` (--input-key)", keys.input))?;
    let text = renderer
        .render(&input)
        .map_err(|reason| format!("input key `{}` {reason}", keys.input))?;
    let answer = match &keys.label {
        None => String::new(),
        Some(key) => match row.remove(key) {
            Some(Value::String(label)) => label,
            Some(Value::Number(label)) => label.to_string(),
            Some(other) => {
                return Err(format!(
                    "label key `{key}` is {}, not a string or a number",
                    json_type(&other)
                ));
            }
            None => return Err(format!("has no label key `{key}` (--label-key)")),
        },
    };
    let metadata = row.remove(&keys.metadata).unwrap_or(Value::Null);
    Ok(Problem {
        text,
        answer,
        metadata,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(label: Option<&str>, max: Option<usize>, long: LongPrompt) -> DataOptions {
        DataOptions {
            keys: DataKeys {
                input: "q".into(),
                label: label.map(str::to_owned),
                metadata: "meta".into(),
            },
            max_prompt_len: max,
            long_prompt: long,
        }
    }

    fn bytes(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn load(text: &str, options: &DataOptions) -> Result<PromptDataset, DataError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.jsonl");
        std::fs::write(&path, text).unwrap();
        PromptDataset::load(&path, options, &PlainPrompt, &bytes)
    }

    #[test]
    fn bad_rows_are_skipped_and_reported_with_their_line_numbers() {
        let text = "{\"q\": \"1+1=\", \"a\": \"2\", \"meta\": {\"id\": 1}}\n\
                    not json\n\
                    \n\
                    {\"a\": \"3\"}\n\
                    {\"q\": 5, \"a\": \"3\"}\n\
                    {\"q\": \"2+2=\", \"a\": 4}\n\
                    {\"q\": \"3+3=\", \"a\": [6]}\n\
                    {\"q\": \"4+4=\"}\n\
                    [1, 2]\n\
                    {\"q\": [{\"role\": \"user\"}], \"a\": \"1\"}\n";
        let data = load(text, &options(Some("a"), None, LongPrompt::Skip)).unwrap();
        let lines: Vec<usize> = data.rows.iter().map(|r| r.line).collect();
        assert_eq!(lines, [1, 6]);
        assert_eq!(data.rows[0].problem.answer, "2");
        assert_eq!(data.rows[0].problem.metadata, serde_json::json!({"id": 1}));
        assert_eq!(data.rows[1].problem.answer, "4");
        assert_eq!(data.rows[1].problem.metadata, Value::Null);
        let bad: Vec<(usize, &str)> = data
            .bad
            .iter()
            .map(|b| (b.line, b.reason.as_str()))
            .collect();
        let expect = [
            (2, "not valid json"),
            (4, "has no input key `q`"),
            (5, "input key `q` is a number, not a string"),
            (7, "label key `a` is a list, not a string or a number"),
            (8, "has no label key `a`"),
            (9, "is a list, not a json object"),
            (10, "chat template"),
        ];
        assert_eq!(bad.len(), expect.len(), "{bad:?}");
        for ((line, reason), (want_line, want)) in bad.iter().zip(expect) {
            assert_eq!(*line, want_line, "{reason}");
            assert!(reason.contains(want), "line {line}: {reason} lacks {want}");
        }
    }

    #[test]
    fn a_file_without_a_usable_row_is_an_error_naming_the_first_bad_line() {
        let error = load(
            "{\"x\": 1}\n{\"y\": 2}\n",
            &options(None, None, LongPrompt::Skip),
        )
        .unwrap_err();
        let message = error.to_string();
        assert!(
            matches!(error, DataError::NoUsableRow { bad: 2, .. }),
            "{message}"
        );
        assert!(
            message.contains("line 1: has no input key `q`"),
            "{message}"
        );
        let missing = PromptDataset::load(
            Path::new("/nonexistent/data.jsonl"),
            &options(None, None, LongPrompt::Skip),
            &PlainPrompt,
            &bytes,
        )
        .unwrap_err();
        assert!(matches!(missing, DataError::Read { .. }), "{missing}");
    }

    #[test]
    fn long_prompts_are_skipped_and_counted_or_stop_the_load() {
        let text = "{\"q\": \"short\"}\n{\"q\": \"a much longer prompt\"}\n";
        let data = load(text, &options(None, Some(8), LongPrompt::Skip)).unwrap();
        assert_eq!((data.rows.len(), data.too_long), (1, 1));
        assert_eq!(data.rows[0].tokens, 5);
        let error = load(text, &options(None, Some(8), LongPrompt::Error)).unwrap_err();
        assert!(
            matches!(
                error,
                DataError::PromptTooLong {
                    line: 2,
                    tokens: 20,
                    max: 8,
                    ..
                }
            ),
            "{error}"
        );
        let error = load(text, &options(None, Some(2), LongPrompt::Skip)).unwrap_err();
        assert!(
            matches!(error, DataError::NoUsableRow { too_long: 2, .. }),
            "{error}"
        );
    }

    #[test]
    fn every_epoch_visits_each_row_once_in_a_seeded_order() {
        let text: String = (0..10).map(|i| format!("{{\"q\": \"p{i}\"}}\n")).collect();
        let data = load(&text, &options(None, None, LongPrompt::Skip)).unwrap();
        let source = |seed| PromptSource::Data {
            dataset: data.clone(),
            seed,
        };
        // Steps of 4 prompts: steps 1-5 cover two epochs.
        let drawn: Vec<String> = (1..=5)
            .flat_map(|step| source(7).problems(Stream::Rollout, step, 4))
            .map(|p| p.text)
            .collect();
        for epoch in drawn.chunks(10) {
            let mut sorted = epoch.to_vec();
            sorted.sort();
            let mut all: Vec<String> = (0..10).map(|i| format!("p{i}")).collect();
            all.sort();
            assert_eq!(sorted, all, "an epoch must hold every row once");
        }
        assert_ne!(drawn[..10], drawn[10..], "epochs are shuffled afresh");
        let file_order: Vec<String> = (0..10).map(|i| format!("p{i}")).collect();
        assert_ne!(drawn[..10], file_order[..], "the first epoch is shuffled");
        let again: Vec<String> = (1..=5)
            .flat_map(|step| source(7).problems(Stream::Rollout, step, 4))
            .map(|p| p.text)
            .collect();
        assert_eq!(drawn, again, "the same seed draws the same rows");
        let other: Vec<String> = source(8)
            .problems(Stream::Rollout, 1, 10)
            .into_iter()
            .map(|p| p.text)
            .collect();
        assert_ne!(drawn[..10], other[..], "another seed draws another order");
    }
}
