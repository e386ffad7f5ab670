//! RMSNorm in fp32: `out = x * rsqrt(mean(x²) + eps) * weight`, as Hugging Face's `LlamaRMSNorm`.

use rayon::prelude::*;

/// `out (N, C)` and `rstd (N)` from `inp (N, C)` and `weight (C)`.
pub fn rmsnorm_forward(out: &mut [f32], rstd: &mut [f32], inp: &[f32], weight: &[f32], eps: f32) {
    let c = weight.len();
    out.par_chunks_mut(c)
        .zip(rstd.par_iter_mut())
        .zip(inp.par_chunks(c))
        .for_each(|((o, r), x)| {
            let ms = x.iter().map(|v| v * v).sum::<f32>() / c as f32;
            let s = 1.0 / (ms + eps).sqrt();
            *r = s;
            for ((o, x), w) in o.iter_mut().zip(x).zip(weight) {
                *o = (x * s) * w;
            }
        });
}

/// Backward of [`rmsnorm_forward`]: `dinp (N, C) +=`, `dweight (C) +=`.
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
) {
    let c = weight.len();
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c))
        .zip(rstd.par_iter())
        .for_each(|(((dx, dy), x), &r)| {
            // d/dx_i of x_i * r: r on the diagonal, minus r³/C * x_i * x_j through the mean.
            let dot: f32 = dy
                .iter()
                .zip(weight)
                .zip(x)
                .map(|((d, w), x)| d * w * x)
                .sum();
            let k = r * r * r * dot / c as f32;
            for (((dx, dy), w), x) in dx.iter_mut().zip(dy).zip(weight).zip(x) {
                *dx += r * w * dy - k * x;
            }
        });
    for ((dy, x), &r) in dout.chunks(c).zip(inp.chunks(c)).zip(rstd) {
        for ((dw, dy), x) in dweight.iter_mut().zip(dy).zip(x) {
            *dw += dy * x * r;
        }
    }
}
