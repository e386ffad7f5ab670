//! The bias of a linear layer: `out (N, C) += bias (C)`, row by row.

use rayon::prelude::*;

/// Adds `bias (C)` to every row of `out (N, C)` in place.
pub fn bias_forward(out: &mut [f32], bias: &[f32]) {
    out.par_chunks_mut(bias.len()).for_each(|row| {
        for (o, b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    });
}

/// Backward of [`bias_forward`]: `dbias (C) +=` the sum of the rows of `dout (N, C)`.
pub fn bias_backward(dbias: &mut [f32], dout: &[f32]) {
    for row in dout.chunks(dbias.len()) {
        for (d, g) in dbias.iter_mut().zip(row) {
            *d += g;
        }
    }
}
