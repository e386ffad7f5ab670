//! The closed sets of values a setting can take, each spelled once: the same names serve flags,
//! TOML, JSON and messages. A leaf module: the settings ([`crate::config`]) and the devices
//! ([`crate::device`]) both name their choices from here.

use std::fmt;
use std::str::FromStr;

/// A value outside a closed set, with the nearest valid value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{value}`: expected one of {}{}", .expected.join(", "), did_you_mean(*.suggestion))]
pub struct UnknownChoice {
    /// What the value was meant to be (`train backend`).
    pub what: &'static str,
    /// The value given.
    pub value: String,
    /// Every valid value.
    pub expected: Vec<&'static str>,
    /// The valid value nearest to the one given, by edit distance.
    pub suggestion: Option<&'static str>,
}

/// `; did you mean `x`?` or nothing.
pub(crate) fn did_you_mean(suggestion: Option<&str>) -> String {
    suggestion
        .map(|s| format!("; did you mean `{s}`?"))
        .unwrap_or_default()
}

/// The candidate nearest to `value` by Levenshtein distance (ties go to the earlier candidate);
/// `None` when even the nearest needs more edits than half the value's length, plus one.
pub(crate) fn nearest<'a>(value: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let limit = value.chars().count() / 2 + 1;
    candidates
        .iter()
        .map(|&candidate| (edit_distance(value, candidate), candidate))
        .filter(|&(distance, _)| distance <= limit)
        .min_by_key(|&(distance, _)| distance)
        .map(|(_, candidate)| candidate)
}

/// Levenshtein distance between two strings, over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            let substitute = previous[j] + usize::from(ca != cb);
            current[j + 1] = substitute.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
}

/// Declares an enum over a closed set of names with `ALL`, `as_str`, `Display`, `FromStr` (whose
/// error suggests the nearest name) and serde through the same names.
macro_rules! choice {
    (
        $(#[$meta:meta])*
        pub enum $name:ident ($what:literal) {
            $( $(#[$vmeta:meta])* $variant:ident => $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[serde(try_from = "String", into = "&'static str")]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The name used by flags, TOML and JSON.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }

            /// Every name, in declaration order.
            pub fn names() -> Vec<&'static str> {
                Self::ALL.iter().map(|v| v.as_str()).collect()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownChoice;

            fn from_str(value: &str) -> Result<Self, UnknownChoice> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|v| v.as_str() == value)
                    .ok_or_else(|| {
                        let expected = Self::names();
                        UnknownChoice {
                            what: $what,
                            value: value.to_owned(),
                            suggestion: nearest(value, &expected),
                            expected,
                        }
                    })
            }
        }

        impl TryFrom<String> for $name {
            type Error = UnknownChoice;

            fn try_from(value: String) -> Result<Self, UnknownChoice> {
                value.parse()
            }
        }

        impl From<$name> for &'static str {
            fn from(value: $name) -> &'static str {
                value.as_str()
            }
        }
    };
}

choice! {
    /// Which training backend crate runs (`--train-backend`).
    pub enum TrainBackendKind ("train backend") {
        /// Tensor parallelism and a distributed optimizer (miles-megatron).
        Megatron => "megatron",
        /// Fully sharded data parallelism (miles-fsdp).
        Fsdp => "fsdp",
    }
}

choice! {
    /// Where training tensors go when training is offloaded (`--offload-train-target`).
    pub enum OffloadTarget ("offload target") {
        /// Host RAM (pinned on CUDA); spelled `cpu` as the reference system's flag does.
        Host => "cpu",
        /// Files under `--offload-train-disk-dir`.
        Disk => "disk",
    }
}

choice! {
    /// Where a memory region's bytes go while it is paused.
    pub enum BackupPolicy ("backup policy") {
        /// Nowhere: the contents are dropped (gradients, KV cache); resume gives unspecified bytes.
        None => "none",
        /// A host buffer from the memory manager's pool (pinned on CUDA).
        Host => "host",
        /// Checksummed chunk files in the memory manager's disk directory.
        Disk => "disk",
    }
}

choice! {
    /// A rollout memory tag that leaves the device between rollouts (`--offload-rollout-level`).
    pub enum RolloutOffloadLevel ("offload rollout level") {
        /// The paged KV cache.
        KvCache => "kv_cache",
        /// The inference engine's weights.
        Weight => "weight",
        /// Captured CUDA graphs, where the engine has them.
        CudaGraph => "cuda_graph",
    }
}

choice! {
    /// Storage type of Adam moments streamed to disk (`--stream-optimizer-state-moment-dtype`).
    pub enum MomentDtype ("moment dtype") {
        /// 32-bit float: exact.
        Fp32 => "fp32",
        /// bfloat16: half the bytes, fp32's range.
        Bf16 => "bf16",
        /// IEEE half: half the bytes, narrower range.
        Fp16 => "fp16",
    }
}

choice! {
    /// Which device runs (`--device`).
    pub enum DeviceChoice ("device") {
        /// CUDA when the driver loads and sees a GPU, else the CPU device.
        Auto => "auto",
        /// The CPU device: host memory standing in for device memory.
        Cpu => "cpu",
        /// An NVIDIA GPU through the CUDA driver.
        Cuda => "cuda",
    }
}

choice! {
    /// How advantages are estimated from rewards (`--advantage-estimator`).
    pub enum AdvantageEstimator ("advantage estimator") {
        /// Group-relative: rewards normalised within each prompt's samples; no critic.
        Grpo => "grpo",
        /// Proximal policy optimisation with a learned critic.
        Ppo => "ppo",
        /// REINFORCE++: rewards normalised over the whole rollout; no critic.
        ReinforcePlusPlus => "reinforce_plus_plus",
    }
}

choice! {
    /// The synthetic task with a verifiable reward that the RL loop trains on (`--task`).
    pub enum Task ("task") {
        /// Repeat one digit (`r7=` -> `7`): the easiest, for a small run to show learning.
        Repeat => "repeat",
        /// Reverse a string of 2 to 4 digits (`v123=` -> `321`).
        Reverse => "reverse",
        /// Add two numbers below 50 (`12+7=` -> `19`).
        Add => "add",
    }
}

choice! {
    /// The dtype of the Hugging Face weights `--save` writes (`--save-dtype`).
    pub enum SaveDtype ("save dtype") {
        /// bfloat16, as released checkpoints are.
        Bf16 => "bf16",
        /// 32-bit float: every bit of the fp32 master weights.
        Fp32 => "fp32",
    }
}

choice! {
    /// How the learning rate falls after the warm-up (`--lr-decay-style`).
    pub enum LrDecayStyle ("lr decay style") {
        /// It stays at `--lr`.
        Constant => "constant",
        /// Half a cosine from `--lr` to `--min-lr` over the decay iterations.
        Cosine => "cosine",
        /// A straight line from `--lr` to `--min-lr` over the decay iterations.
        Linear => "linear",
    }
}

choice! {
    /// The estimator of the KL penalty to the reference model (`--kl-loss-type`).
    pub enum KlLossType ("kl loss type") {
        /// `log p - log p_ref`.
        K1 => "k1",
        /// `(log p - log p_ref)^2 / 2`.
        K2 => "k2",
        /// `exp(log p_ref - log p) - (log p_ref - log p) - 1`: unbiased and never negative.
        K3 => "k3",
    }
}

choice! {
    /// A built-in reward that needs no model (`--rm-type`).
    pub enum RmType ("reward type") {
        /// The final answer (the last `\boxed{}`, else the last number) equals the label's
        /// number: 1, else 0.
        Math => "math",
        /// The response, trimmed, equals the label, trimmed: 1, else 0.
        Exact => "exact",
        /// The toy tasks' reward: 1 for the label then EOS, else half the share of characters
        /// right at their position.
        Task => "task",
    }
}

choice! {
    /// What a prompt longer than `--rollout-max-prompt-len` does (`--rollout-long-prompt`).
    pub enum LongPrompt ("long prompt policy") {
        /// The row is skipped and counted.
        Skip => "skip",
        /// Loading the data stops with an error naming the line.
        Error => "error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        assert_eq!(edit_distance("weights", "weight"), 1);
        assert_eq!(edit_distance("kv-cache", "kv_cache"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn nearest_suggests_the_closest_name_and_nothing_for_gibberish() {
        let names = RolloutOffloadLevel::names();
        assert_eq!(nearest("weights", &names), Some("weight"));
        assert_eq!(nearest("kvcache", &names), Some("kv_cache"));
        assert_eq!(nearest("cudagraph", &names), Some("cuda_graph"));
        assert_eq!(nearest("zzzzzzzzzzzzzzzzzz", &names), None);
    }

    #[test]
    fn names_round_trip_through_from_str_and_serde() {
        for level in RolloutOffloadLevel::ALL {
            assert_eq!(level.as_str().parse::<RolloutOffloadLevel>(), Ok(*level));
            let json = serde_json::to_string(level).unwrap();
            assert_eq!(json, format!("\"{}\"", level.as_str()));
            assert_eq!(
                serde_json::from_str::<RolloutOffloadLevel>(&json).unwrap(),
                *level
            );
        }
        assert_eq!(
            "fsdp".parse::<TrainBackendKind>(),
            Ok(TrainBackendKind::Fsdp)
        );
        assert_eq!("bf16".parse::<MomentDtype>(), Ok(MomentDtype::Bf16));
    }

    #[test]
    fn unknown_names_are_rejected_with_a_suggestion() {
        let error = "fsdpp".parse::<TrainBackendKind>().unwrap_err();
        assert_eq!(error.suggestion, Some("fsdp"));
        assert_eq!(
            error.to_string(),
            "unknown train backend `fsdpp`: expected one of megatron, fsdp; did you mean `fsdp`?"
        );
    }
}
