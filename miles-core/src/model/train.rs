//! The training step and scoring over owned buffers.
//!
//! [`ModelBuffers`] is the seam to the memory manager: parameters, gradients and both AdamW
//! moments are four flat buffers of one [`ParamLayout`](super::ParamLayout); the kernels only
//! ever see them as slices.

use super::{ActivationLayout, ModelError, TrainBatch, Transformer};
use crate::ops::{AdamWConfig, AdamWStepStats, adamw_step};

/// Parameters (fp32 master weights), gradients and AdamW moments, each one flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelBuffers {
    /// Parameters.
    pub params: Vec<f32>,
    /// Gradients.
    pub grads: Vec<f32>,
    /// AdamW first moment.
    pub m: Vec<f32>,
    /// AdamW second moment.
    pub v: Vec<f32>,
}

impl ModelBuffers {
    /// Buffers around `params`, with zero gradients and moments of the same length.
    pub fn from_params(params: Vec<f32>) -> Self {
        let n = params.len();
        Self {
            params,
            grads: vec![0.0; n],
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }
}

/// The buffers one training step works on, as slices: `Vec`s today, views of memory-manager
/// regions (which deref to slices) when the tensors live in tagged regions.
#[derive(Debug)]
pub struct StepBuffers<'a> {
    /// Parameters (fp32 master weights), updated in place.
    pub params: &'a mut [f32],
    /// Gradients, zeroed then filled.
    pub grads: &'a mut [f32],
    /// AdamW first moment.
    pub m: &'a mut [f32],
    /// AdamW second moment.
    pub v: &'a mut [f32],
    /// Activations, laid out by the step's [`ActivationLayout`].
    pub acts: &'a mut [f32],
}

/// One training step over `bufs`: zero the gradients, forward, backward, AdamW step `step`
/// (counting from 1).
///
/// # Errors
/// As [`Transformer::forward`], and [`ModelError::BufferLength`] for moments of the wrong length.
pub fn train_step(
    model: &Transformer,
    bufs: StepBuffers<'_>,
    al: &ActivationLayout,
    batch: &TrainBatch<'_>,
    adamw: &AdamWConfig,
    step: u64,
) -> Result<StepReport, ModelError> {
    let StepBuffers {
        params,
        grads,
        m,
        v,
        acts,
    } = bufs;
    model.layout().check("adamw m", m)?;
    model.layout().check("adamw v", v)?;
    grads.fill(0.0);
    let loss = model.forward(params, acts, al, batch)?;
    let entropy = batch.entropy_sum(Transformer::entropies(al, acts));
    model.backward(params, grads, acts, al, batch)?;
    let optimizer = adamw_step(params, grads, m, v, step, adamw);
    Ok(StepReport {
        loss,
        optimizer,
        optimizer_stream: None,
        entropy,
    })
}

/// What one training step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The loss of the batch before the update.
    pub loss: f32,
    /// The optimizer step.
    pub optimizer: AdamWStepStats,
    /// What the step read and wrote of optimizer state streamed through the disk, and how long
    /// it waited for it; `None` when the state is resident.
    pub optimizer_stream: Option<crate::store::StreamStats>,
    /// The batch's `Σ mask_t H_t / normaliser` before the update
    /// ([`TrainBatch::entropy_mask`]); `None` without a mask or where it is not measured.
    pub entropy: Option<f32>,
}

/// A model with its own `Vec` buffers and optimizer: forward, backward and AdamW, one step at a
/// time (a backend whose tensors live in memory-manager regions calls [`train_step`] itself).
#[derive(Clone, Debug)]
pub struct Trainer {
    model: Transformer,
    buffers: ModelBuffers,
    acts: Vec<f32>,
    act_layout: Option<ActivationLayout>,
    adamw: AdamWConfig,
    step: u64,
}

impl Trainer {
    /// A trainer for `model` starting from `params`.
    ///
    /// # Errors
    /// [`ModelError::BufferLength`] when `params` does not fit the model's layout.
    pub fn new(
        model: Transformer,
        params: Vec<f32>,
        adamw: AdamWConfig,
    ) -> Result<Self, ModelError> {
        model.layout().check("params", &params)?;
        Ok(Self {
            model,
            buffers: ModelBuffers::from_params(params),
            acts: Vec::new(),
            act_layout: None,
            adamw,
            step: 0,
        })
    }

    /// The model.
    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// The buffers.
    pub fn buffers(&self) -> &ModelBuffers {
        &self.buffers
    }

    /// One step: zero the gradients, forward, backward, AdamW.
    ///
    /// # Errors
    /// As [`Transformer::forward`].
    pub fn train_step(&mut self, batch: &TrainBatch<'_>) -> Result<StepReport, ModelError> {
        let al = self.activations_for(batch.batch, batch.seq)?;
        let ModelBuffers {
            params,
            grads,
            m,
            v,
        } = &mut self.buffers;
        grads.fill(0.0);
        let loss = self.model.forward(params, &mut self.acts, &al, batch)?;
        let entropy = batch.entropy_sum(Transformer::entropies(&al, &self.acts));
        self.model
            .backward(params, grads, &mut self.acts, &al, batch)?;
        self.step += 1;
        let optimizer = adamw_step(params, grads, m, v, self.step, &self.adamw);
        Ok(StepReport {
            loss,
            optimizer,
            optimizer_stream: None,
            entropy,
        })
    }

    /// The forward pass alone: the loss, with the per-token log-probs `(B, T)` in `logprobs`.
    ///
    /// # Errors
    /// As [`Transformer::forward`].
    pub fn evaluate(
        &mut self,
        batch: &TrainBatch<'_>,
        logprobs: &mut Vec<f32>,
    ) -> Result<f32, ModelError> {
        let al = self.activations_for(batch.batch, batch.seq)?;
        let loss = self
            .model
            .forward(&self.buffers.params, &mut self.acts, &al, batch)?;
        logprobs.clear();
        logprobs.extend_from_slice(Transformer::logprobs(&al, &self.acts));
        Ok(loss)
    }

    fn activations_for(
        &mut self,
        batch: usize,
        seq: usize,
    ) -> Result<ActivationLayout, ModelError> {
        if let Some(al) = &self.act_layout
            && al.batch == batch
            && al.seq == seq
        {
            return Ok(al.clone());
        }
        let al = self.model.activation_layout(batch, seq)?;
        self.acts = vec![0.0; al.len()];
        self.act_layout = Some(al.clone());
        Ok(al)
    }
}

/// The batch that scores `tokens` (BOS first): one sequence whose inputs are all but the last
/// token and whose targets are all but the first, each target weighted by `weights` (one per
/// target), the loss their mean.
///
/// # Errors
/// [`ModelError::Batch`] for fewer than two tokens or a weight count that differs from the
/// targets'.
pub fn scoring_batch<'a>(
    tokens: &'a [u32],
    weights: &'a [f32],
) -> Result<TrainBatch<'a>, ModelError> {
    if tokens.len() < 2 {
        return Err(ModelError::Batch(
            "scoring needs at least two tokens (BOS and one more)".into(),
        ));
    }
    let t = tokens.len() - 1;
    if weights.len() != t {
        return Err(ModelError::Batch(format!(
            "{} weights for {t} scored tokens; give one per token after the first",
            weights.len()
        )));
    }
    Ok(TrainBatch {
        batch: 1,
        seq: t,
        inputs: &tokens[..t],
        targets: &tokens[1..],
        weights,
        normaliser: t as f32,
        entropy_mask: None,
        entropy_coef: 0.0,
    })
}

/// Log p of each token after the first given those before it, for one sequence `tokens`
/// (BOS first), and the mean negative log-prob.
///
/// # Errors
/// [`ModelError::Batch`] for fewer than two tokens or more than the model's positions; as
/// [`Transformer::forward`].
pub fn score_tokens(
    model: &Transformer,
    params: &[f32],
    tokens: &[u32],
) -> Result<(Vec<f32>, f32), ModelError> {
    let weights = vec![1.0; tokens.len().saturating_sub(1)];
    let batch = scoring_batch(tokens, &weights)?;
    let al = model.activation_layout(1, batch.seq)?;
    let mut acts = vec![0.0; al.len()];
    let loss = model.forward(params, &mut acts, &al, &batch)?;
    Ok((Transformer::logprobs(&al, &acts).to_vec(), loss))
}
