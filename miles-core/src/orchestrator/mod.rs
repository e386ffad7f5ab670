//! The colocated RL loop (DESIGN section 8): rollout on an inference engine, rewards from a
//! verifiable task, advantages, training on a backend, and the offload sequence that lets both
//! share the devices.
//!
//! Start: the engine releases all its memory; the trainer (after an optional supervised
//! warm-up) goes to sleep; the engine's weights come back; weights sync from the trainer; the KV
//! cache comes back. Each step: generate; offload the rollout (per level); the trainer wakes and
//! trains (actor, and critic under PPO); save if due; the trainer offloads to its target; the
//! engine's weights come back; weight sync in buckets; the KV cache comes back. Every offload
//! and onload happens only when its switch is on.
//!
//! When the actor shows its bf16 weights on a device ([`TrainBackend::device_weights`]) and the
//! engine takes them from there ([`RolloutEngine::accepts_device_weights`]), the tail after
//! training (and the start, after the warm-up) runs: the engine's weights come back; the sync
//! copies the trainer's weights on the device, nothing exported; the trainer sleeps; the KV
//! cache comes back.
//!
//! [`TrainBackend::device_weights`]: crate::backend::TrainBackend::device_weights

mod advantage;
mod batch;
mod critic;
mod data;
mod error;
#[cfg(test)]
mod learning_tests;
mod loss;
mod options;
mod reference;
mod reward;
mod run;
mod schedule;
mod state;
mod stop;
mod task;
#[cfg(test)]
mod tests;

pub use advantage::{
    GRPO_EPS, grpo_advantages, mean_std, ppo_advantages, reinforce_plus_plus_advantages,
};
pub use batch::{Sequence, build_batch};
pub use critic::LmCritic;
pub use data::{
    BadRow, DataError, DataKeys, DataOptions, PlainPrompt, PromptDataset, PromptRenderer,
    PromptRow, PromptSource,
};
pub use error::OrchestratorError;
pub use loss::{PolicyLoss, TokenLoss, kl_estimate};
pub use options::{DATA_RESPONSE_LEN, RlOptions};
pub use reference::{ReferenceModel, ref_tag};
pub use reward::{BuiltinReward, CommandReward, Reward, RewardError, RewardRequest, final_answer};
pub use run::{
    FitAgreement, LoopConfig, Orchestrator, Patience, RolloutShare, RunSummary, StopAgreement,
};
pub use schedule::LrSchedule;
pub use state::{LATEST_FILE, LoopState, STATE_FILE, mark_latest, resolve_checkpoint, step_dir};
pub use task::{Problem, ProblemSource, Stream, stream_seed};
