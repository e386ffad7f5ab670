//! Synthetic tasks with verifiable rewards: prompts, answers and the reward of a completion.
//!
//! A prompt is `BOS` then the problem text ending in `=` (`r7=`, `v123=`, `12+7=`); the answer
//! is the result's digits followed by `EOS`. Every prompt of a step comes from a generator keyed
//! by `(seed, step)`, so a run resumed at step `s` draws exactly the prompts the uninterrupted
//! run drew there.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde_json::Value;

use crate::config::Task;
use crate::model::{ModelError, Tokenizer};

/// One problem of a task.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    /// The problem text (`12+7=`).
    pub text: String,
    /// The expected answer text (`19`); a dataset row's label, empty without `--label-key`.
    pub answer: String,
    /// What a reward gets along with the answer (`null` for the tasks).
    pub metadata: Value,
}

impl Problem {
    /// The prompt ids: the problem text with the tokenizer's special tokens (`BOS` first).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] when the tokenizer fails.
    pub fn prompt(&self, tokenizer: &Tokenizer) -> Result<Vec<u32>, ModelError> {
        tokenizer.encode(&self.text, true)
    }

    /// The ids a perfect completion holds: the answer, then `EOS`.
    ///
    /// # Errors
    /// As [`prompt`](Self::prompt).
    pub fn answer_tokens(&self, tokenizer: &Tokenizer) -> Result<Vec<u32>, ModelError> {
        let mut ids = tokenizer.encode(&self.answer, false)?;
        ids.push(tokenizer.eos());
        Ok(ids)
    }

    /// The reward of `completion` (ids, `EOS` included when it stopped).
    ///
    /// 1.0 for the exact answer followed by `EOS`. Anything else earns partial credit:
    /// half the share of answer characters right at their position, over the longer of the
    /// answer and the completion's text, so that a right but unterminated or padded answer
    /// earns less than an exact one and a wrong one nothing.
    ///
    /// # Errors
    /// As [`prompt`](Self::prompt).
    pub fn reward(&self, completion: &[u32], tokenizer: &Tokenizer) -> Result<f32, ModelError> {
        let end = completion
            .iter()
            .position(|id| tokenizer.stop_tokens().contains(id))
            .unwrap_or(completion.len());
        let stopped = end < completion.len();
        let text: Vec<u32> = completion[..end].to_vec();
        let answer = tokenizer.encode(&self.answer, false)?;
        if stopped && text == answer {
            return Ok(1.0);
        }
        let right = text.iter().zip(&answer).filter(|(a, b)| a == b).count();
        let longer = text.len().max(answer.len()).max(1);
        Ok(0.5 * right as f32 / longer as f32)
    }
}

/// The task's problem generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProblemSource {
    task: Task,
    seed: u64,
}

/// Keeps the prompts of RL steps and of supervised warm-up steps apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// Prompts of RL step `n`.
    Rollout,
    /// Problems of supervised warm-up step `n`.
    Warmup,
    /// Sampling seed of RL step `n`.
    Sampling,
}

/// A 64-bit key of `(seed, stream, index)`, mixed so that near keys give unrelated generators.
pub fn stream_seed(seed: u64, stream: Stream, index: u64) -> u64 {
    let tag = match stream {
        Stream::Rollout => 0x5254_4f4c,
        Stream::Warmup => 0x5746_5441,
        Stream::Sampling => 0x534d_504c,
    };
    splitmix(splitmix(splitmix(seed) ^ tag) ^ index)
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl ProblemSource {
    /// Problems of `task`, keyed by the run's `seed`.
    pub fn new(task: Task, seed: u64) -> Self {
        Self { task, seed }
    }

    /// `count` problems of step `index` of `stream`: the same arguments always give the same
    /// problems.
    pub fn problems(&self, stream: Stream, index: u64, count: usize) -> Vec<Problem> {
        let mut rng = ChaCha20Rng::seed_from_u64(stream_seed(self.seed, stream, index));
        (0..count).map(|_| self.draw(&mut rng)).collect()
    }

    /// Generated tokens a perfect answer of this task needs at most, `EOS` included.
    pub fn max_answer_tokens(&self) -> usize {
        match self.task {
            Task::Repeat => 2,
            Task::Reverse => 5,
            Task::Add => 3,
        }
    }

    fn draw(&self, rng: &mut ChaCha20Rng) -> Problem {
        match self.task {
            Task::Repeat => {
                let digit = rng.random_range(0..10u32);
                Problem {
                    text: format!("r{digit}="),
                    answer: digit.to_string(),
                    metadata: Value::Null,
                }
            }
            Task::Reverse => {
                let len = rng.random_range(2..=4usize);
                let digits: String = (0..len)
                    .map(|_| char::from(b'0' + rng.random_range(0..10u8)))
                    .collect();
                Problem {
                    text: format!("v{digits}="),
                    answer: digits.chars().rev().collect(),
                    metadata: Value::Null,
                }
            }
            Task::Add => {
                let (a, b) = (rng.random_range(0..50u32), rng.random_range(0..50u32));
                Problem {
                    text: format!("{a}+{b}="),
                    answer: (a + b).to_string(),
                    metadata: Value::Null,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        crate::model::ByteTokenizer {
            bos: 256,
            eos: 257,
            pad: 258,
        }
        .into()
    }

    #[test]
    fn problems_are_determined_by_seed_stream_and_step() {
        for task in Task::ALL {
            let source = ProblemSource::new(*task, 7);
            let a = source.problems(Stream::Rollout, 3, 16);
            assert_eq!(a, source.problems(Stream::Rollout, 3, 16), "{task}");
            assert_ne!(a, source.problems(Stream::Rollout, 4, 16), "{task}");
            assert_ne!(a, source.problems(Stream::Warmup, 3, 16), "{task}");
            assert_ne!(
                a,
                ProblemSource::new(*task, 8).problems(Stream::Rollout, 3, 16)
            );
        }
    }

    #[test]
    fn answers_solve_their_problems() {
        let source = |task| ProblemSource::new(task, 11);
        for p in source(Task::Repeat).problems(Stream::Rollout, 0, 20) {
            assert_eq!(p.text, format!("r{}=", p.answer));
        }
        for p in source(Task::Reverse).problems(Stream::Rollout, 0, 20) {
            let digits = &p.text[1..p.text.len() - 1];
            assert_eq!(p.answer, digits.chars().rev().collect::<String>());
            assert!((2..=4).contains(&digits.len()), "{}", p.text);
        }
        for p in source(Task::Add).problems(Stream::Rollout, 0, 20) {
            let (a, b) = p.text.trim_end_matches('=').split_once('+').unwrap();
            let sum: u32 = a.parse::<u32>().unwrap() + b.parse::<u32>().unwrap();
            assert_eq!(p.answer, sum.to_string());
        }
    }

    #[test]
    fn every_answer_fits_the_task_token_budget() {
        let t = tokenizer();
        for task in Task::ALL {
            let source = ProblemSource::new(*task, 5);
            for p in source.problems(Stream::Rollout, 1, 200) {
                assert!(p.answer_tokens(&t).unwrap().len() <= source.max_answer_tokens());
            }
        }
    }

    #[test]
    fn exact_answer_with_eos_earns_one_and_near_misses_earn_less() {
        let t = tokenizer();
        let p = Problem {
            text: "v123=".into(),
            answer: "321".into(),
            metadata: Value::Null,
        };
        let reward = |ids: &[u32]| p.reward(ids, &t).unwrap();
        let encode = |text: &str| t.encode(text, false).unwrap();
        assert_eq!(reward(&p.answer_tokens(&t).unwrap()), 1.0);
        assert_eq!(
            p.prompt(&t).unwrap(),
            vec![256, b'v' as u32, 49, 50, 51, b'=' as u32]
        );
        // Right digits, no EOS: half credit.
        assert_eq!(reward(&encode("321")), 0.5);
        // Two of three digits right, then EOS.
        let mut two = encode("322");
        two.push(t.eos());
        assert!((reward(&two) - 0.5 * 2.0 / 3.0).abs() < 1e-6);
        // Right answer followed by junk before EOS: over the longer text.
        let mut long = encode("3219");
        long.push(t.eos());
        assert!((reward(&long) - 0.5 * 3.0 / 4.0).abs() < 1e-6);
        assert_eq!(reward(&[t.eos()]), 0.0);
        assert_eq!(reward(&encode("999")), 0.0);
    }
}
