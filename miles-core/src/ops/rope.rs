//! Rotary position embedding in Hugging Face's rotate-half convention.
//!
//! For a head of `D` channels, channel `i < D/2` pairs with channel `i + D/2` and the pair is
//! rotated by `pos * theta^(-2i/D)`. The tables are computed in fp32 exactly as
//! `LlamaRotaryEmbedding` does, so angles at long positions round the same way.

use rayon::prelude::*;

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
        let half = head_dim / 2;
        let base = theta as f32;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
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
