// Forward kernels shared by training and inference. Row-major tensors; `n` rows (tokens) of
// `c` columns unless said otherwise.

// out[i] = bf16(x[i]), i < n.
extern "C" __global__ void cast_f32_to_bf16(bf16* out, const float* x, long long n) {
    grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = f2bf(x[i]);
    }
}

// out[i] = float(x[i]), i < n.
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16* x, long long n) {
    grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = bf2f(x[i]);
    }
}

// out[i] += x[i], i < n, in fp32.
extern "C" __global__ void add_f32(float* out, const float* x, long long n) {
    grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] += x[i];
    }
}

// out = x * r * w over one row of c (a row's norm once its reciprocal RMS r is known), 8 values a
// read where `wide`; each thread writes the values it alone reads.
__device__ __forceinline__ void rmsnorm_scale_row(bf16* o, const bf16* xr, const bf16* w, float r,
                                                  int c, bool wide) {
    if (wide) {
        float f[8], g[8];
        for (int v = threadIdx.x; v < c / 8; v += blockDim.x) {
            unpack8(((const uint4*)xr)[v], f);
            unpack8(((const uint4*)w)[v], g);
#pragma unroll
            for (int i = 0; i < 8; i++) f[i] = f[i] * r * g[i];
            ((uint4*)o)[v] = pack8(f);
        }
    } else {
        for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = f2bf(bf2f(xr[j]) * r * bf2f(w[j]));
    }
}

// o = xr / rms(xr) * w over one row of c by the block's threads, *rstd = 1 / rms(xr) where
// given; `scratch` is 32 floats of shared. o may be xr (each thread writes only the values it
// alone reads after the block's sum).
__device__ void rmsnorm_row(bf16* o, float* rstd, const bf16* xr, const bf16* w, int c, float eps,
                            float* scratch) {
    // 8 values a read where the rows allow it (the common case), one at a time otherwise.
    const bool wide = (c & 7) == 0 && aligned16(xr) && aligned16(o) && aligned16(w);
    float ss = 0.0f, f[8];
    if (wide) {
        for (int v = threadIdx.x; v < c / 8; v += blockDim.x) {
            unpack8(((const uint4*)xr)[v], f);
#pragma unroll
            for (int i = 0; i < 8; i++) ss += f[i] * f[i];
        }
    } else {
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            const float v = bf2f(xr[j]);
            ss += v * v;
        }
    }
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)c + eps);
    if (threadIdx.x == 0 && rstd) *rstd = r;
    rmsnorm_scale_row(o, xr, w, r, c, wide);
}

// out = x / rms(x) * w per row, rstd[row] = 1 / rms(x); one block a row.
extern "C" __global__ void rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* w,
                                           int c, float eps) {
    grid_begin();
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    rmsnorm_row(out + row * c, rstd ? rstd + row : nullptr, x + row * c, w, c, eps, scratch);
}

// out (n, c) = table[id of row] (rows of c); one block a row. A row's id is ids[row], or where
// feed is given and feed[row] is not FEED_HOST, picked[feed[row]]: a token drawn on the device
// by the pass before, never read back by the host first. Where `normed` is given, it gets the
// row's rmsnorm_forward with weight w (c), the first norm of a model fused with its lookup.
#define FEED_HOST 0xffffffffu
extern "C" __global__ void embedding_forward(bf16* out, const unsigned int* ids,
                                             const unsigned int* feed, const unsigned int* picked,
                                             const bf16* table, int c, bf16* normed,
                                             const bf16* w, float eps) {
    grid_begin();
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const unsigned int from = feed ? feed[row] : FEED_HOST;
    const unsigned int id = from == FEED_HOST ? ids[row] : picked[from];
    const bf16* src = table + (long long)id * c;
    bf16* dst = out + row * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) dst[j] = src[j];
    if (!normed) return;
    __syncthreads();  // the row's values, stored by every thread of the block
    rmsnorm_row(normed + row * c, nullptr, dst, w, c, eps, scratch);
}

// The sum, in order, of word v (8 values) of a row's `parts` fp32 partials, `part_stride` apart:
// four partials' loads in flight at once.
__device__ __forceinline__ void sum_partials8(float* sum, const float* pr, long long part_stride,
                                              int parts, int v) {
#pragma unroll
    for (int i = 0; i < 8; i++) sum[i] = 0.0f;
    for (int p0 = 0; p0 < parts; p0 += 4) {
        float4 a[4], b[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (p0 + j < parts) {
                const float4* q = (const float4*)(pr + (p0 + j) * part_stride) + 2 * v;
                a[j] = q[0];
                b[j] = q[1];
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (p0 + j < parts) {
                sum[0] += a[j].x, sum[1] += a[j].y, sum[2] += a[j].z, sum[3] += a[j].w;
                sum[4] += b[j].x, sum[5] += b[j].y, sum[6] += b[j].z, sum[7] += b[j].w;
            }
        }
    }
}

// Word v of row xr (its bf16 values xv) plus the sum of its partials, rounded to bf16 once:
// stored back into xr, left in f, its squares added to ss.
__device__ __forceinline__ void add_partials8(float* f, float& ss, bf16* xr, uint4 xv,
                                              const float* pr, long long part_stride, int parts,
                                              int v) {
    float sum[8];
    sum_partials8(sum, pr, part_stride, parts, v);
    unpack8(xv, f);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        f[i] = bf2f(f2bf(sum[i] + f[i]));
        ss += f[i] * f[i];
    }
    ((uint4*)xr)[v] = pack8(f);
}

// Most threads of a residual_rmsnorm block (the launch bound keeps its registers within them).
#define RESIDUAL_NORM_THREADS 512

// x (rows, c) += the sum of `parts` fp32 partial products (parts, rows, c) (a product split
// along its inner dimension), the partials added in order, then to x, rounded to bf16 once; then
// out = x / rms(x) * w as rmsnorm_forward, over the stored (rounded) x. The residual add of a
// split product fused with the norm after it; one block a row (of at least c / 8 threads where
// the row fits RESIDUAL_NORM_THREADS words, so each holds one), 32 floats of shared.
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS)
    residual_rmsnorm(bf16* out, bf16* x, const float* partials, int parts, long long rows,
                     const bf16* w, int c, float eps) {
    grid_begin();
    // The decode step's SwiGLU product behind it fetches its first weights meanwhile.
    grid_release();
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    bf16* xr = x + row * c;
    bf16* o = out + row * c;
    const float* pr = partials + row * c;
    const long long part_stride = rows * c;
    const bool wide =
        (c & 7) == 0 && aligned16(xr) && aligned16(o) && aligned16(w) && aligned16(pr);
    float ss = 0.0f, f[8];
    if (wide && c / 8 <= (int)blockDim.x) {
        // A word of the row a thread (the launch gives a row's width in threads): the word
        // stays in registers from the sum to the scaling, and its weights are read with it.
        const int v = threadIdx.x;
        const bool mine = v < c / 8;
        float g[8];
        if (mine) {
            const uint4 xv = ((const uint4*)xr)[v], wv = ((const uint4*)w)[v];
            unpack8(wv, g);
            add_partials8(f, ss, xr, xv, pr, part_stride, parts, v);
        }
        ss = block_sum(ss, scratch);
        const float r = rsqrtf(ss / (float)c + eps);
        if (mine) {
#pragma unroll
            for (int i = 0; i < 8; i++) f[i] = f[i] * r * g[i];
            ((uint4*)o)[v] = pack8(f);
        }
        return;
    }
    // Each thread reads back only the values it wrote itself.
    if (wide) {
        for (int v = threadIdx.x; v < c / 8; v += blockDim.x) {
            add_partials8(f, ss, xr, ((const uint4*)xr)[v], pr, part_stride, parts, v);
        }
    } else {
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            float sum = 0.0f;
            for (int p = 0; p < parts; p++) sum += pr[p * part_stride + j];
            const float v = bf2f(f2bf(sum + bf2f(xr[j])));
            xr[j] = f2bf(v);
            ss += v * v;
        }
    }
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)c + eps);
    rmsnorm_scale_row(o, xr, w, r, c, wide);
}

// x (rows, c) += b (c) on every row, elementwise over the n = rows * c values (the q, k and v
// biases).
extern "C" __global__ void bias_add(bf16* x, const bf16* b, long long n, int c) {
    grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] = f2bf(bf2f(x[i]) + bf2f(b[i % c]));
    }
}

// Rotary embedding in place on x (n, heads, d), rotate-half convention (Hugging Face Llama):
// pair (i, i + d/2) of each head turns by positions[row] * inv_freq[i], by the angle's negative
// with `back` (the backward pass). cos/sin tables are (max_pos, d/2) fp32. A block a row (grid-
// stride over rows), its threads over the row's pairs, so no index divides in 64 bits.
__device__ __forceinline__ void rope_rows(bf16* x, const unsigned int* positions,
                                          const float* cos_t, const float* sin_t, long long n,
                                          int heads, int d, bool back) {
    const int half = d / 2, pairs = heads * half;
    for (long long row = blockIdx.x; row < n; row += gridDim.x) {
        const float* cs_row = cos_t + (long long)positions[row] * half;
        const float* sn_row = sin_t + (long long)positions[row] * half;
        bf16* xr = x + row * heads * d;
        for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
            const int head = i / half, p = i - head * half;
            const float cs = cs_row[p], sn = back ? -sn_row[p] : sn_row[p];
            bf16* h = xr + head * d;
            const float a = bf2f(h[p]), b = bf2f(h[p + half]);
            h[p] = f2bf(a * cs - b * sn);
            h[p + half] = f2bf(b * cs + a * sn);
        }
    }
}

extern "C" __global__ void rope_forward(bf16* x, const unsigned int* positions, const float* cos_t,
                                        const float* sin_t, long long n, int heads, int d) {
    grid_begin();
    rope_rows(x, positions, cos_t, sin_t, n, heads, d, false);
}

// out = silu(gate) * up, elementwise over n values.
extern "C" __global__ void swiglu_forward(bf16* out, const bf16* gate, const bf16* up, long long n,
                                          int wide) {
    grid_begin();
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (wide) {
        for (long long i = first; i < n / 8; i += stride) {
            float g[8], u[8];
            unpack8(((const uint4*)gate)[i], g);
            unpack8(((const uint4*)up)[i], u);
#pragma unroll
            for (int j = 0; j < 8; j++) g[j] = g[j] / (1.0f + __expf(-g[j])) * u[j];
            ((uint4*)out)[i] = pack8(g);
        }
        return;
    }
    for (long long i = first; i < n; i += stride) {
        const float g = bf2f(gate[i]);
        out[i] = f2bf(g / (1.0f + __expf(-g)) * bf2f(up[i]));
    }
}

// out (n, f) = silu(gate) * up from the fused product gu (n, 2f), a row holding the gate's f
// values, then the up's. A grid-stride loop over rows (y) and columns (x), so no index is
// divided; with `wide` (f a multiple of 8, both buffers 16-byte aligned) each thread takes 8
// columns at a time.
extern "C" __global__ void swiglu_rows(bf16* out, const bf16* gu, long long n, int f, int wide) {
    grid_begin();
    grid_release();
    const int step = wide ? 8 : 1;
    for (long long row = blockIdx.y; row < n; row += gridDim.y) {
        const bf16* g = gu + row * 2 * f;
        bf16* o = out + row * f;
        for (int j = (blockIdx.x * blockDim.x + threadIdx.x) * step; j < f;
             j += gridDim.x * blockDim.x * step) {
            if (wide) {
                float a[8], b[8];
                unpack8(*(const uint4*)(g + j), a);
                unpack8(*(const uint4*)(g + j + f), b);
#pragma unroll
                for (int i = 0; i < 8; i++) a[i] = a[i] / (1.0f + __expf(-a[i])) * b[i];
                *(uint4*)(o + j) = pack8(a);
            } else {
                const float x = bf2f(g[j]);
                o[j] = f2bf(x / (1.0f + __expf(-x)) * bf2f(g[j + f]));
            }
        }
    }
}

// x += y, elementwise over n values (the residual stream); with `wide`, 8 at a time.
extern "C" __global__ void residual_add(bf16* x, const bf16* y, long long n, int wide) {
    grid_begin();
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (wide) {
        for (long long i = first; i < n / 8; i += stride) {
            float a[8], b[8];
            unpack8(((const uint4*)x)[i], a);
            unpack8(((const uint4*)y)[i], b);
#pragma unroll
            for (int j = 0; j < 8; j++) a[j] += b[j];
            ((uint4*)x)[i] = pack8(a);
        }
        return;
    }
    for (long long i = first; i < n; i += stride) x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}
