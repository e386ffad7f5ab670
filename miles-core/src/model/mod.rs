//! The Llama-style transformer: config, parameter and activation tables, forward and backward,
//! AdamW training, KV-cache decoding, the byte tokenizer and Hugging Face checkpoints.

mod checkpoint;
mod config;
mod decode;
mod error;
#[cfg(test)]
mod family_tests;
mod gpu;
mod hf_tokenizer;
mod init;
mod layout;
mod passes;
#[cfg(test)]
mod tests;
mod tokenizer;
mod train;
mod transformer;

pub use checkpoint::{
    CONFIG_FILE, DEFAULT_SHARD_BYTES, INDEX_FILE, MASTER_FILE, SaveOptions, TOKENIZER_FILES,
    WEIGHTS_FILE, WeightsSummary, alloc_params, copy_tokenizer_files, export_hf,
    inspect_hf_weights, load_checkpoint, load_config, load_hf_checkpoint, load_hf_params,
    load_params, save_checkpoint, sync_file, sync_tree, write_hf,
};
pub use config::{LlamaConfig, ModelFamily};
pub use decode::{ContiguousKvCache, DecodeScratch, KvCache};
pub use error::ModelError;
#[cfg(any(test, feature = "testing"))]
pub use gpu::testing as gpu_testing;
pub use gpu::{
    ForwardMode, GpuActivationLayout, GpuActivations, GpuTrainer, GpuTrainerSpec, GpuTransformer,
    GradUnits, GroupComm, MomentStream, OptimizerShard, StepTimes, TrainerGroup, WeightUnits,
    WholeGrads, WholeWeights, standalone_gpu_trainer,
};
pub use hf_tokenizer::{TOKENIZER_FILE, Tokenizer};
pub use init::init_params;
pub use layout::{ActivationLayout, ParamKind, ParamLayout, TensorSpec};
pub use tokenizer::ByteTokenizer;
pub use train::{
    ModelBuffers, StepBuffers, StepReport, Trainer, score_tokens, scoring_batch, train_step,
};
pub use transformer::{TrainBatch, Transformer};
