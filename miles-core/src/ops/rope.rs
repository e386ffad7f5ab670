//! Rotary position embedding in Hugging Face's rotate-half convention.
//!
//! For a head of `D` channels, channel `i < D/2` pairs with channel `i + D/2` and the pair is
//! rotated by `pos * theta^(-2i/D)`. The tables are computed in fp32 exactly as
//! `LlamaRotaryEmbedding` does, so angles at long positions round the same way.

use rayon::prelude::*;

/// How the rotary frequencies are rescaled for long contexts, as Hugging Face's
/// `ROPE_INIT_FUNCTIONS` do it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// The plain frequencies `theta^(-2i/D)`.
    Default,
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        /// The divisor.
        factor: f32,
    },
    /// Llama 3's: low frequencies divided by `factor`, high ones kept, a smooth blend between.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f32,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are divided.
        low_freq_factor: f32,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f32,
        /// The context length the model was pretrained on.
        original_max_position_embeddings: f32,
    },
}

/// Cosines and sines of every position's rotation angles.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>, // (P, D/2)
    sin: Vec<f32>, // (P, D/2)
}

impl RopeTable {
    /// Tables for positions `0..max_positions` and heads of `head_dim` channels.
    pub fn new(head_dim: usize, theta: f64, max_positions: usize) -> Self {
        Self::scaled(head_dim, theta, max_positions, RopeScaling::Default)
    }

    /// Tables as [`new`](Self::new) makes them, with the frequencies rescaled by `scaling`
    /// (in fp32, in the order of operations of transformers).
    pub fn scaled(head_dim: usize, theta: f64, max_positions: usize, scaling: RopeScaling) -> Self {
        let half = head_dim / 2;
        let base = theta as f32;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| scale_frequency(1.0 / base.powf((2 * i) as f32 / head_dim as f32), scaling))
            .collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in &inv_freq {
                let angle = f * p as f32;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Self { half, cos, sin }
    }

    /// Positions the table covers.
    pub fn max_positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Cosines `(P, D/2)`, position-major.
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// Sines `(P, D/2)`, position-major.
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }

    fn at(&self, pos: usize) -> (&[f32], &[f32]) {
        let r = pos * self.half..(pos + 1) * self.half;
        (&self.cos[r.clone()], &self.sin[r])
    }
}

/// One inverse frequency rescaled by `scaling`.
fn scale_frequency(inv_freq: f32, scaling: RopeScaling) -> f32 {
    match scaling {
        RopeScaling::Default => inv_freq,
        RopeScaling::Linear { factor } => inv_freq / factor,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
            let scaled = if wavelen > old / low_freq_factor {
                inv_freq / factor
            } else {
                inv_freq
            };
            // Wavelengths are positive and finite: neither comparison meets a NaN.
            let medium = wavelen >= old / high_freq_factor && wavelen <= old / low_freq_factor;
            if medium {
                let smooth =
                    (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * scaled / factor + smooth * scaled
            } else {
                scaled
            }
        }
    }
}

/// Rotates `x (N, heads, D)` in place, row `i` at position `positions[i]`.
pub fn rope_forward(x: &mut [f32], positions: &[usize], heads: usize, table: &RopeTable) {
    rotate(x, positions, heads, table, 1.0);
}

/// Backward of [`rope_forward`]: rotates the gradient `dx (N, heads, D)` back, in place.
pub fn rope_backward(dx: &mut [f32], positions: &[usize], heads: usize, table: &RopeTable) {
    rotate(dx, positions, heads, table, -1.0);
}

fn rotate(x: &mut [f32], positions: &[usize], heads: usize, table: &RopeTable, sign: f32) {
    let half = table.half;
    let row = heads * 2 * half;
    x.par_chunks_mut(row)
        .zip(positions.par_iter())
        .for_each(|(r, &pos)| {
            let (cos, sin) = table.at(pos);
            for head in r.chunks_mut(2 * half) {
                let (x1, x2) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    let s = sign * sin[i];
                    x1[i] = a * cos[i] - b * s;
                    x2[i] = b * cos[i] + a * s;
                }
            }
        });
}
