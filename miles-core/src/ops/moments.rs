//! The storage of AdamW moments streamed to disk (`--stream-optimizer-state-moment-dtype`):
//! little-endian fp32, bf16 or IEEE half, each rounded to nearest even from fp32.

use half::{bf16, f16};

use crate::choice::MomentDtype;

/// Bytes per stored moment element.
pub fn moment_bytes(dtype: MomentDtype) -> usize {
    match dtype {
        MomentDtype::Fp32 => 4,
        MomentDtype::Bf16 | MomentDtype::Fp16 => 2,
    }
}

/// Writes `src` into `dst` (`src.len() * moment_bytes(dtype)` bytes) in `dtype`.
pub fn encode_moments(dtype: MomentDtype, src: &[f32], dst: &mut [u8]) {
    match dtype {
        MomentDtype::Fp32 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        MomentDtype::Bf16 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                d.copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
            }
        }
        MomentDtype::Fp16 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                d.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
            }
        }
    }
}

/// Reads `dst.len()` moments in `dtype` from `src`, widened to fp32.
pub fn decode_moments(dtype: MomentDtype, src: &[u8], dst: &mut [f32]) {
    match dtype {
        MomentDtype::Fp32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        MomentDtype::Bf16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        MomentDtype::Fp16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp32_moments_round_trip_exactly_and_half_types_within_their_precision() {
        let src: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 1.37e-3).collect();
        for (dtype, tol) in [
            (MomentDtype::Fp32, 0.0),
            (MomentDtype::Bf16, 1.0 / 256.0),
            (MomentDtype::Fp16, 1.0 / 2048.0),
        ] {
            let mut bytes = vec![0u8; src.len() * moment_bytes(dtype)];
            encode_moments(dtype, &src, &mut bytes);
            let mut back = vec![0.0f32; src.len()];
            decode_moments(dtype, &bytes, &mut back);
            let worst = src
                .iter()
                .zip(&back)
                .map(|(a, b)| ((a - b) / a).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst <= tol,
                "{dtype:?}: worst relative difference {worst} > {tol}"
            );
        }
    }
}
