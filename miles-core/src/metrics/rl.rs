//! The RL algorithm's scalars of one step: what the rollout looked like and what the policy
//! loss measured.

use serde_json::{Map, Value, json};

/// Rollout and policy-loss scalars of one RL step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RlMetrics {
    /// Mean generated tokens per sample (the stop token included).
    pub response_len_mean: f32,
    /// Most generated tokens of a sample.
    pub response_len_max: usize,
    /// Share of samples that ran out of `--rollout-max-response-len` before a stop token.
    pub truncated_fraction: f32,
    /// Mean surrogate `-min(r A, clip(r) A)` over the trained tokens.
    pub pg_loss: f32,
    /// Mean KL estimate to the reference model (0 without `--use-kl-loss`).
    pub kl: f32,
    /// Share of the trained tokens whose importance ratio the clip held.
    pub clip_fraction: f32,
    /// Mean entropy of the policy over the trained (response) tokens, before each update;
    /// `None` where the actor does not measure it (the cuda trainers), and then left out of
    /// the line rather than written as 0.
    pub entropy: Option<f32>,
    /// Largest gradient norm, before clipping, of the step's optimizer steps.
    pub grad_norm: f32,
    /// Learning rate of the step's optimizer steps.
    pub lr: f64,
    /// Generated tokens per second of the rollout (the reward included).
    pub rollout_tokens_per_second: f64,
    /// Token positions per second of the actor's training passes.
    pub train_tokens_per_second: f64,
    /// Mean reward of the evaluation pass run after this step, when one ran.
    pub eval_reward_mean: Option<f32>,
    /// What the actor's optimizer steps read and wrote of state streamed through the disk, and
    /// the seconds they waited for it, when it streams.
    pub optimizer_stream: Option<crate::store::StreamStats>,
}

impl RlMetrics {
    /// The scalars as JSON keys of a step's line (`entropy` only where measured,
    /// `eval_reward_mean` only when one ran).
    pub fn json_fields(&self) -> Map<String, Value> {
        let mut fields = Map::new();
        for (key, value) in [
            ("response_len_mean", json!(self.response_len_mean)),
            ("response_len_max", json!(self.response_len_max)),
            ("truncated_fraction", json!(self.truncated_fraction)),
            ("pg_loss", json!(self.pg_loss)),
            ("kl", json!(self.kl)),
            ("clip_fraction", json!(self.clip_fraction)),
            ("grad_norm", json!(self.grad_norm)),
            ("lr", json!(self.lr)),
            (
                "rollout_tokens_per_second",
                json!(self.rollout_tokens_per_second),
            ),
            (
                "train_tokens_per_second",
                json!(self.train_tokens_per_second),
            ),
        ] {
            fields.insert(key.to_owned(), value);
        }
        if let Some(entropy) = self.entropy {
            fields.insert("entropy".to_owned(), json!(entropy));
        }
        if let Some(eval) = self.eval_reward_mean {
            fields.insert("eval_reward_mean".to_owned(), json!(eval));
        }
        if let Some(stream) = &self.optimizer_stream {
            for (key, value) in [
                ("optimizer_stream_read_bytes", json!(stream.bytes_read)),
                (
                    "optimizer_stream_written_bytes",
                    json!(stream.bytes_written),
                ),
                ("optimizer_stream_wait_seconds", json!(stream.wait_seconds)),
                ("optimizer_stream_disk_seconds", json!(stream.disk_seconds)),
            ] {
                fields.insert(key.to_owned(), value);
            }
        }
        fields
    }
}

/// `x` with three significant digits (`0.0113`, `4.70`, `470`, `10.7k`, `1.23M`).
pub fn three_digits(x: f64) -> String {
    if !x.is_finite() {
        return x.to_string();
    }
    let (value, suffix) = match x.abs() {
        a if a >= 1e9 => (x / 1e9, "G"),
        a if a >= 1e6 => (x / 1e6, "M"),
        a if a >= 1e4 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    if value == 0.0 {
        return "0".to_owned();
    }
    let digits = value.abs().log10().floor() as i32;
    let decimals = (2 - digits).max(0) as usize;
    format!("{value:.decimals$}{suffix}")
}

/// Bytes in binary units with three significant digits (`512 B`, `1.50 KiB`, `86.0 MiB`).
pub fn human_bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < units.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{} {}", three_digits(value), units[unit])
    }
}

/// Seconds as milliseconds below one second, else seconds, three significant digits.
pub fn human_seconds(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{} ms", three_digits(seconds * 1e3))
    } else {
        format!("{} s", three_digits(seconds))
    }
}

impl super::StepMetrics {
    /// The step in one console line: reward, lengths, KL, clip share, gradient norm, loss,
    /// throughputs, the seconds waited for moves and the bytes moved, the memory peak, and the
    /// entropy where
    /// it was measured.
    pub fn summary(&self) -> String {
        let rl = &self.rl;
        let moved: u64 = self.bytes_moved.iter().sum();
        let mut line = format!(
            "reward {} ± {}  len {} (max {}, {}% cut)  kl {}  clip {}%  |g| {}  loss {}  rollout {} tok/s  train {} tok/s  switch {}  moved {}  peak {}",
            three_digits(f64::from(self.reward_mean)),
            three_digits(f64::from(self.reward_std)),
            three_digits(f64::from(rl.response_len_mean)),
            rl.response_len_max,
            three_digits(f64::from(rl.truncated_fraction) * 100.0),
            three_digits(f64::from(rl.kl)),
            three_digits(f64::from(rl.clip_fraction) * 100.0),
            three_digits(f64::from(rl.grad_norm)),
            three_digits(f64::from(self.loss)),
            three_digits(rl.rollout_tokens_per_second),
            three_digits(rl.train_tokens_per_second),
            human_seconds(self.exposed_switch_seconds()),
            human_bytes(moved),
            human_bytes(self.peak_device_memory_bytes),
        );
        if let Some(entropy) = rl.entropy {
            line.push_str(&format!("  entropy {}", three_digits(f64::from(entropy))));
        }
        if let Some(eval) = rl.eval_reward_mean {
            line.push_str(&format!("  eval {}", three_digits(f64::from(eval))));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_numbers_have_three_significant_digits_and_binary_units() {
        assert_eq!(three_digits(0.011310654), "0.0113");
        assert_eq!(three_digits(4.7), "4.70");
        assert_eq!(three_digits(469.52), "470");
        assert_eq!(three_digits(10690.07), "10.7k");
        assert_eq!(three_digits(-0.0524), "-0.0524");
        assert_eq!(three_digits(0.0), "0");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(90_177_536), "86.0 MiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
        assert_eq!(human_seconds(0.00637), "6.37 ms");
        assert_eq!(human_seconds(2.5), "2.50 s");
    }

    #[test]
    fn the_entropy_is_a_key_and_on_the_console_only_where_measured() {
        let mut step = super::super::StepMetrics::default();
        assert!(!step.rl.json_fields().contains_key("entropy"));
        assert!(!step.summary().contains("entropy"));
        step.rl.entropy = Some(1.5);
        assert_eq!(step.rl.json_fields()["entropy"], json!(1.5));
        assert!(
            step.summary().contains("entropy 1.50"),
            "{}",
            step.summary()
        );
    }
}
