//! Token embedding lookup.

use rayon::prelude::*;

/// `out (N, C)` = rows `ids (N)` of `table (V, C)`; ids were checked against `V` by the caller.
pub fn embedding_forward(out: &mut [f32], ids: &[u32], table: &[f32], c: usize) {
    out.par_chunks_mut(c)
        .zip(ids.par_iter())
        .for_each(|(o, &id)| {
            let start = id as usize * c;
            o.copy_from_slice(&table[start..start + c]);
        });
}

/// Backward of [`embedding_forward`]: `dtable (V, C) +=` each row of `dout (N, C)` at its id.
pub fn embedding_backward(dtable: &mut [f32], dout: &[f32], ids: &[u32], c: usize) {
    for (d, &id) in dout.chunks(c).zip(ids) {
        let start = id as usize * c;
        for (t, d) in dtable[start..start + c].iter_mut().zip(d) {
            *t += d;
        }
    }
}
