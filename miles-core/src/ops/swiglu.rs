//! The SwiGLU gate of the MLP: `out = silu(gate) * up`, with `silu(x) = x * sigmoid(x)`.

use rayon::prelude::*;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `out (N, F)` from `gate (N, F)` and `up (N, F)`.
pub fn swiglu_forward(out: &mut [f32], gate: &[f32], up: &[f32]) {
    out.par_iter_mut()
        .zip(gate.par_iter().zip(up.par_iter()))
        .for_each(|(o, (&g, &u))| *o = g * sigmoid(g) * u);
}

/// Backward of [`swiglu_forward`]: `dgate +=`, `dup +=`.
pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dout: &[f32], gate: &[f32], up: &[f32]) {
    dgate
        .par_iter_mut()
        .zip(dup.par_iter_mut())
        .zip(dout.par_iter().zip(gate.par_iter().zip(up.par_iter())))
        .for_each(|((dg, du), (&d, (&g, &u)))| {
            let s = sigmoid(g);
            *du += d * g * s;
            *dg += d * u * s * (1.0 + g * (1.0 - s));
        });
}
