//! The forward and backward passes one unit at a time (embedding, each decoder layer, head), for
//! backends that hold only one unit's weights at once (fully sharded data parallelism).
//!
//! Each pass takes the unit's own weights, laid out as in the parameter buffer, so a backend can
//! hand it a buffer gathered from shards. Run in order (embedding, layers `0..L`, head; then head,
//! layers `L-1..0`, embedding) they compute what [`Transformer::forward`] and
//! [`Transformer::backward`] compute, bit for bit: those run the same passes over the whole
//! buffer.

use super::{ActivationLayout, ModelError, ParamKind, TrainBatch, Transformer};

impl Transformer {
    /// The forward pass of the token embedding alone: fills the residual stream entering layer 0.
    ///
    /// With [`layer_forward`](Self::layer_forward) and [`head_forward`](Self::head_forward) it
    /// runs the forward pass one unit at a time (as a sharded backend does, holding one unit's
    /// weights at once); embedding, layers `0..L` in order, then the head compute exactly what
    /// [`forward`](Self::forward) computes, bit for bit.
    ///
    /// # Errors
    /// As [`forward`](Self::forward), with `embedding` checked against its tensor's length.
    pub fn embed_forward(
        &self,
        embedding: &[f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<(), ModelError> {
        let need = self.layout().range(ParamKind::Embedding, 0).len();
        check_len("embedding", embedding, need)?;
        al.check(acts)?;
        self.check_batch(al, batch)?;
        self.embed_forward_unchecked(embedding, acts, al, batch);
        Ok(())
    }

    /// The forward pass of decoder layer `layer` alone, whose weights are `weights`: the layer's
    /// tensors as they sit in the parameter buffer ([`ParamLayout::layer_range`]). Reads the
    /// residual stream entering the layer from `acts` and writes the one leaving it.
    ///
    /// # Errors
    /// [`ModelError::Config`] for a layer the model does not have; as
    /// [`embed_forward`](Self::embed_forward).
    pub fn layer_forward(
        &self,
        layer: usize,
        weights: &[f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<(), ModelError> {
        self.check_layer(layer, "layer weights", weights)?;
        al.check(acts)?;
        self.check_batch(al, batch)?;
        let w = self.layer_weights_in(weights, layer);
        self.layer_forward_unchecked(layer, &w, acts, al, batch, None)
    }

    /// The forward pass of the final norm and the LM head (`head`: the embedding when tied), and
    /// the loss; logits, probabilities and per-token log-probs are left in `acts`.
    ///
    /// # Errors
    /// As [`embed_forward`](Self::embed_forward).
    pub fn head_forward(
        &self,
        norm: &[f32],
        head: &[f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<f32, ModelError> {
        self.check_head(norm, head)?;
        al.check(acts)?;
        self.check_batch(al, batch)?;
        self.head_forward_unchecked(norm, head, acts, al, batch)
    }

    /// The backward pass of the head (see [`head_forward`](Self::head_forward)) after the
    /// forward pass of the same batch: accumulates (`+=`) into `d_norm` and `d_head` and leaves
    /// the gradient of the residual stream leaving the last layer in `acts`.
    ///
    /// With [`layer_backward`](Self::layer_backward) for layers `L-1..0` and
    /// [`embed_backward`](Self::embed_backward) it computes what [`backward`](Self::backward)
    /// computes, bit for bit (a tied head accumulates into the embedding's gradient before the
    /// embedding does, as there).
    ///
    /// # Errors
    /// As [`head_forward`](Self::head_forward).
    #[allow(clippy::too_many_arguments)]
    pub fn head_backward(
        &self,
        norm: &[f32],
        head: &[f32],
        d_norm: &mut [f32],
        d_head: &mut [f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<(), ModelError> {
        self.check_head(norm, head)?;
        check_len("final norm gradient", d_norm, norm.len())?;
        check_len("head gradient", d_head, head.len())?;
        al.check(acts)?;
        self.check_batch(al, batch)?;
        self.head_backward_unchecked(norm, head, d_norm, d_head, acts, al, batch)
    }

    /// The backward pass of decoder layer `layer` (weights as for
    /// [`layer_forward`](Self::layer_forward)): accumulates (`+=`) into `d_weights`, laid out as
    /// `weights`, and turns the residual-stream gradient in `acts` into the one entering the
    /// layer.
    ///
    /// # Errors
    /// As [`layer_forward`](Self::layer_forward).
    pub fn layer_backward(
        &self,
        layer: usize,
        weights: &[f32],
        d_weights: &mut [f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<(), ModelError> {
        self.check_layer(layer, "layer weights", weights)?;
        self.check_layer(layer, "layer gradient", d_weights)?;
        al.check(acts)?;
        self.check_batch(al, batch)?;
        let w = self.layer_weights_in(weights, layer);
        self.layer_backward_unchecked(layer, &w, d_weights, acts, al, batch, None)
    }

    /// The backward pass of the token embedding: accumulates (`+=`) the residual-stream gradient
    /// that the layers left in `acts` into `d_embedding`.
    ///
    /// # Errors
    /// As [`embed_forward`](Self::embed_forward).
    pub fn embed_backward(
        &self,
        d_embedding: &mut [f32],
        acts: &[f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<(), ModelError> {
        let need = self.layout().range(ParamKind::Embedding, 0).len();
        check_len("embedding gradient", d_embedding, need)?;
        al.check(acts)?;
        self.check_batch(al, batch)?;
        self.embed_backward_unchecked(d_embedding, acts, al, batch);
        Ok(())
    }

    /// Checks `buf` against layer `layer`'s block of the parameter layout.
    fn check_layer(
        &self,
        layer: usize,
        buffer: &'static str,
        buf: &[f32],
    ) -> Result<(), ModelError> {
        if layer >= self.config().num_layers {
            return Err(ModelError::Config(format!(
                "layer {layer} does not exist: the model has {} layers",
                self.config().num_layers
            )));
        }
        check_len(buffer, buf, self.layout().layer_range(layer).len())
    }

    fn check_head(&self, norm: &[f32], head: &[f32]) -> Result<(), ModelError> {
        check_len(
            "final norm",
            norm,
            self.layout().range(ParamKind::FinalNorm, 0).len(),
        )?;
        check_len(
            "head",
            head,
            self.layout().range(ParamKind::LmHead, 0).len(),
        )
    }
}

/// Checks that `buf` holds `need` elements.
fn check_len(buffer: &'static str, buf: &[f32], need: usize) -> Result<(), ModelError> {
    if buf.len() != need {
        return Err(ModelError::BufferLength {
            buffer,
            len: buf.len(),
            need,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::model::{LlamaConfig, init_params};

    fn config(tied: bool) -> LlamaConfig {
        let mut v: serde_json::Value =
            serde_json::from_str(include_str!("../../presets/tiny.json")).unwrap();
        v["tie_word_embeddings"] = serde_json::Value::Bool(tied);
        LlamaConfig::from_json_str(&v.to_string()).unwrap()
    }

    /// Runs the whole-model passes and the unit passes on the same seeded batch and compares
    /// losses, log-probs and gradients bit for bit.
    fn unit_passes_match_the_whole_model(tied: bool) {
        let model = Transformer::new(config(tied));
        let lay = model.layout().clone();
        let mut params = vec![0.0; lay.len()];
        init_params(&lay, model.config(), 3, &mut params).unwrap();
        let (b, t) = (3, 5);
        let v = model.config().vocab_size as u32;
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let inputs: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..v)).collect();
        let targets: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..v)).collect();
        let weights: Vec<f32> = (0..b * t).map(|_| rng.random::<f32>() + 0.25).collect();
        let batch = TrainBatch {
            batch: b,
            seq: t,
            inputs: &inputs,
            targets: &targets,
            weights: &weights,
            normaliser: 7.0,
            entropy_mask: None,
            entropy_coef: 0.0,
        };
        let al = model.activation_layout(b, t).unwrap();

        let mut acts = vec![0.0; al.len()];
        let mut grads = vec![0.0; lay.len()];
        let loss = model.forward(&params, &mut acts, &al, &batch).unwrap();
        let logprobs = Transformer::logprobs(&al, &acts).to_vec();
        model
            .backward(&params, &mut grads, &mut acts, &al, &batch)
            .unwrap();

        // Each unit's weights copied out on their own, as a sharded backend gathers them.
        let own = |r: std::ops::Range<usize>| params[r].to_vec();
        let emb_r = lay.range(ParamKind::Embedding, 0);
        let (norm_r, head_r) = (
            lay.range(ParamKind::FinalNorm, 0),
            lay.range(ParamKind::LmHead, 0),
        );
        let mut unit_acts = vec![0.0; al.len()];
        let mut unit_grads = vec![0.0; lay.len()];
        model
            .embed_forward(&own(emb_r.clone()), &mut unit_acts, &al, &batch)
            .unwrap();
        for l in 0..model.config().num_layers {
            let w = own(lay.layer_range(l));
            model
                .layer_forward(l, &w, &mut unit_acts, &al, &batch)
                .unwrap();
        }
        let (norm, head) = (own(norm_r.clone()), own(head_r.clone()));
        let unit_loss = model
            .head_forward(&norm, &head, &mut unit_acts, &al, &batch)
            .unwrap();
        let mut d_norm = vec![0.0; norm.len()];
        let mut d_head = vec![0.0; head.len()];
        model
            .head_backward(
                &norm,
                &head,
                &mut d_norm,
                &mut d_head,
                &mut unit_acts,
                &al,
                &batch,
            )
            .unwrap();
        unit_grads[norm_r].copy_from_slice(&d_norm);
        unit_grads[head_r.clone()]
            .iter_mut()
            .zip(&d_head)
            .for_each(|(g, d)| *g += d);
        for l in (0..model.config().num_layers).rev() {
            let w = own(lay.layer_range(l));
            let mut d_w = vec![0.0; w.len()];
            model
                .layer_backward(l, &w, &mut d_w, &mut unit_acts, &al, &batch)
                .unwrap();
            unit_grads[lay.layer_range(l)].copy_from_slice(&d_w);
        }
        // A tied head accumulated into the embedding's gradient first, as in `backward`.
        let mut d_emb = if tied { d_head } else { vec![0.0; emb_r.len()] };
        model
            .embed_backward(&mut d_emb, &unit_acts, &al, &batch)
            .unwrap();
        unit_grads[emb_r].copy_from_slice(&d_emb);

        assert_eq!(loss.to_bits(), unit_loss.to_bits(), "{loss} vs {unit_loss}");
        assert_eq!(logprobs, Transformer::logprobs(&al, &unit_acts));
        let differ = grads
            .iter()
            .zip(&unit_grads)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differ, 0, "{differ} gradient elements differ");
    }

    #[test]
    fn unit_passes_in_order_equal_the_whole_model_passes_bit_for_bit_tied() {
        unit_passes_match_the_whole_model(true);
    }

    #[test]
    fn unit_passes_in_order_equal_the_whole_model_passes_bit_for_bit_untied() {
        unit_passes_match_the_whole_model(false);
    }

    #[test]
    fn unit_passes_refuse_a_missing_layer_and_misshapen_weights() {
        let model = Transformer::new(config(true));
        let al = model.activation_layout(1, 2).unwrap();
        let mut acts = vec![0.0; al.len()];
        let batch = TrainBatch {
            batch: 1,
            seq: 2,
            inputs: &[1, 2],
            targets: &[2, 3],
            weights: &[1.0, 1.0],
            normaliser: 2.0,
            entropy_mask: None,
            entropy_coef: 0.0,
        };
        let w = vec![0.5; model.layout().layer_range(0).len()];
        let err = model.layer_forward(2, &w, &mut acts, &al, &batch);
        assert!(matches!(err, Err(ModelError::Config(m)) if m.contains("layer 2")));
        let err = model.layer_forward(0, &w[1..], &mut acts, &al, &batch);
        assert!(
            matches!(err, Err(ModelError::BufferLength { .. })),
            "{err:?}"
        );
    }
}
