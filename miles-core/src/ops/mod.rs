//! Kernels of the transformer: on the CPU, `<op>_forward` / `<op>_backward` pairs over plain
//! slices (this module); on the GPU, CUDA kernels and their launch wrappers ([`gpu`]).
//!
//! Outputs come first, gradients carry a `d` prefix and are accumulated with `+=`. CPU matrix
//! products run on the `gemm` crate; everything else on rayon.

mod adamw;
mod attention;
mod bias;
mod crossentropy;
mod embedding;
pub mod gpu;
mod matmul;
mod matmul_rows;
mod moments;
mod residual;
mod rmsnorm;
mod rope;
mod swiglu;
#[cfg(test)]
pub(crate) mod testing;

pub use adamw::{
    AdamWConfig, AdamWScalars, AdamWStepStats, adamw_step, adamw_update, clip_scale,
    global_grad_norm,
};
pub use attention::{
    AttentionShape, attention_backward, attention_backward_naive, attention_forward,
    attention_forward_naive,
};
pub use bias::{bias_backward, bias_forward};
pub use crossentropy::{crossentropy_backward, crossentropy_forward, entropy_backward};
pub use embedding::{embedding_backward, embedding_forward, embedding_rows};
pub use matmul::{
    GemmCall, MatmulProfile, matmul_backward, matmul_backward_naive, matmul_forward,
    matmul_forward_naive,
};
pub use matmul_rows::matmul_rows_forward;
pub use moments::{decode_moments, encode_moments, moment_bytes};
pub use residual::residual_forward;
pub use rmsnorm::{rmsnorm_backward, rmsnorm_forward};
pub use rope::{RopeScaling, RopeTable, rope_backward, rope_forward};
pub use swiglu::{swiglu_backward, swiglu_forward};
