// Training kernels (attention is `flash.cu`'s): backward passes, the fused cross-entropy and
// AdamW on fp32 master weights. The argument order and C types of each kernel are those its
// wrapper in `train.rs` passes (pointers as 64-bit addresses, `int` for i32,
// `long long` for i64, `float` for f32).
//
// rmsnorm_backward(bf16* dx, const bf16* dout, const bf16* x, const bf16* w, const float* rstd,
//                  int c)                                                      one block a row
// column_partials(float* partial, const bf16* a, const bf16* b_or_null,
//                 const float* scale_or_null, long long rows, int cols,
//                 long long rows_per_chunk)       blocks of (32, COLUMN_ROWS): 32 columns, a chunk
// column_reduce(float* out, const float* partial, int chunks, int cols, int add)
//                                                                        one thread a column
// rope_backward(bf16* dx, const unsigned* positions, const float* cos, const float* sin,
//               long long n, int heads, int d)                                one block a row
// swiglu_backward(bf16* gate, bf16* up, bf16* dout, long long n, int wide)
//                                                   one thread a value (8 with `wide`)
// embedding_backward(float* dtable, const bf16* dout, const unsigned* ids,
//                    const unsigned* order, const unsigned* starts, int c)
//                                                   blocks of (an id, ROW_THREADS columns)
// crossentropy(float* logprobs, bf16* dlogits_or_null, const float* logits,
//              const unsigned* targets, const float* weights, int v, float normaliser)
//                                                                             one block a row
// square_partials(float* partial, const float* x, long long n)   SQUARE_BLOCKS blocks, grid-stride
// sum_partials(float* acc, const float* partial, int count)                  one block
// adamw_update(float* master, bf16* params, float* m, float* v, const float* grads,
//              long long n, float step_size, float bias2_sqrt, float decay, float beta1,
//              float beta2, float eps, float grad_scale)      grid-stride, 4 elements a thread
// adamw_update_bf16_moments, adamw_update_f16_moments: the same with m and v stored as bf16 or
//              IEEE half (unsigned short*)                                    grid-stride

// One row of c columns a block: dx += r*w*dout - r^3/c * sum(dout*w*x) * x (bf16, read-modify-
// write). The weight's gradient, a column sum over the rows, is column_partials' work.
extern "C" __global__ void rmsnorm_backward(bf16* dx, const bf16* dout, const bf16* x,
                                           const bf16* w, const float* rstd, int c) {
    grid_begin();
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const bf16* xr = x + row * c;
    const bf16* dyr = dout + row * c;
    bf16* dxr = dx + row * c;
    const float r = rstd[row];
    // 8 values a read where the rows allow it (the common case), one at a time otherwise.
    const bool wide =
        (c & 7) == 0 && aligned16(xr) && aligned16(dyr) && aligned16(dxr) && aligned16(w);
    float dot = 0.0f, a[8], b[8], g[8], o[8];
    if (wide) {
        for (int v = threadIdx.x; v < c / 8; v += blockDim.x) {
            unpack8(((const uint4*)dyr)[v], a);
            unpack8(((const uint4*)w)[v], g);
            unpack8(((const uint4*)xr)[v], b);
#pragma unroll
            for (int i = 0; i < 8; i++) dot += a[i] * g[i] * b[i];
        }
    } else {
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            dot += bf2f(dyr[j]) * bf2f(w[j]) * bf2f(xr[j]);
        }
    }
    dot = block_sum(dot, scratch);
    const float k = r * r * r * dot / (float)c;
    if (wide) {
        for (int v = threadIdx.x; v < c / 8; v += blockDim.x) {
            unpack8(((const uint4*)dyr)[v], a);
            unpack8(((const uint4*)w)[v], g);
            unpack8(((const uint4*)xr)[v], b);
            unpack8(((const uint4*)dxr)[v], o);
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = o[i] + (r * g[i] * a[i] - k * b[i]);
            ((uint4*)dxr)[v] = pack8(o);
        }
        return;
    }
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const float dy = bf2f(dyr[j]), xv = bf2f(xr[j]);
        dxr[j] = f2bf(bf2f(dxr[j]) + (r * bf2f(w[j]) * dy - k * xv));
    }
}

// Rows a block of column_partials strides over at once (its blockDim.y).
#define COLUMN_ROWS 8

// Deterministic column sums, without atomics, in two kernels. column_partials: block (x, k) sums
// columns 32x .. 32x + 31 over chunk k of the rows (rows k * rows_per_chunk .. , fewer in the
// last, none past the end) of a[r, j] * b[r, j] * scale[r] (a null b or scale counts as 1):
// thread (lane, y) adds rows y, y + COLUMN_ROWS, ... in order, then lane's column adds the
// COLUMN_ROWS sums in order into partial[k * cols + j] (overwritten, 0 for an empty chunk).
extern "C" __global__ void column_partials(float* partial, const bf16* a, const bf16* b,
                                           const float* scale, long long rows, int cols,
                                           long long rows_per_chunk) {
    grid_begin();
    __shared__ float sums[COLUMN_ROWS][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    const long long first = (long long)blockIdx.y * rows_per_chunk;
    const long long end = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
    float s = 0.0f;
    if (j < cols) {
        for (long long r = first + threadIdx.y; r < end; r += COLUMN_ROWS) {
            float v = bf2f(a[r * cols + j]);
            if (b) v *= bf2f(b[r * cols + j]);
            if (scale) v *= scale[r];
            s += v;
        }
    }
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
        float t = 0.0f;
        for (int y = 0; y < COLUMN_ROWS; ++y) t += sums[y][threadIdx.x];
        partial[(long long)blockIdx.y * cols + j] = t;
    }
}

// out[j] (+)= sum over k < chunks, in order, of partial[k * cols + j] (added to what out holds
// with `add`, written over it without); one thread a column.
extern "C" __global__ void column_reduce(float* out, const float* partial, int chunks, int cols,
                                         int add) {
    grid_begin();
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < cols;
         j += (long long)gridDim.x * blockDim.x) {
        float t = 0.0f;
        for (int k = 0; k < chunks; ++k) t += partial[(long long)k * cols + j];
        out[j] = add ? out[j] + t : t;
    }
}

// The forward rotation with the sine negated, in place on dx (n, heads, d); one block a row.
extern "C" __global__ void rope_backward(bf16* dx, const unsigned int* positions,
                                         const float* cos_t, const float* sin_t, long long n,
                                         int heads, int d) {
    grid_begin();
    rope_rows(dx, positions, cos_t, sin_t, n, heads, d, true);
}

// One value of swiglu's backward: the gate's and up's gradients from dout, and the output
// recomputed with swiglu_forward's own expression (the same bits).
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float* dg, float* du,
                                            float* sw) {
    const float s = 1.0f / (1.0f + expf(-g));
    *du = d * g * s;
    *dg = d * u * s * (1.0f + g * (1.0f - s));
    *sw = g / (1.0f + __expf(-g)) * u;
}

// In place: gate becomes dgate = dout * up * s * (1 + g * (1 - s)), up becomes dup = dout * g * s
// with s = sigmoid(g), and dout becomes swiglu(gate, up) recomputed, for the down product's
// weight gradient. Each thread reads its values before it writes them; with `wide` (n a
// multiple of 8, every buffer 16-byte aligned) a thread takes 8 values at a time, in registers.
extern "C" __global__ void swiglu_backward(bf16* gate, bf16* up, bf16* dout, long long n,
                                           int wide) {
    grid_begin();
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (wide) {
        for (long long i = first; i < n / 8; i += stride) {
            float g[8], u[8], d[8], dg[8], du[8], sw[8];
            unpack8(((const uint4*)gate)[i], g);
            unpack8(((const uint4*)up)[i], u);
            unpack8(((const uint4*)dout)[i], d);
#pragma unroll
            for (int j = 0; j < 8; j++) swiglu_grad(g[j], u[j], d[j], &dg[j], &du[j], &sw[j]);
            ((uint4*)up)[i] = pack8(du);
            ((uint4*)gate)[i] = pack8(dg);
            ((uint4*)dout)[i] = pack8(sw);
        }
        return;
    }
    for (long long i = first; i < n; i += stride) {
        float dg, du, sw;
        swiglu_grad(bf2f(gate[i]), bf2f(up[i]), bf2f(dout[i]), &dg, &du, &sw);
        up[i] = f2bf(du);
        gate[i] = f2bf(dg);
        dout[i] = f2bf(sw);
    }
}

// dtable[id] += the sum of dout over the rows of that id, in row order, without atomics: block
// (s, y) takes columns y * blockDim.x .. of the rows order[starts[s]] .. order[starts[s + 1] - 1]
// (all of one id, ascending), one column a thread, so a frequent id's rows spread over the
// blocks of its columns; a block whose range is empty (past the last distinct id) does nothing.
extern "C" __global__ void embedding_backward(float* dtable, const bf16* dout,
                                              const unsigned int* ids, const unsigned int* order,
                                              const unsigned int* starts, int c) {
    grid_begin();
    const unsigned int first = starts[blockIdx.x], end = starts[blockIdx.x + 1];
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (first == end || j >= c) return;
    float s = 0.0f;
#pragma unroll 4
    for (unsigned int i = first; i < end; ++i) s += bf2f(dout[(long long)order[i] * c + j]);
    dtable[(long long)ids[order[first]] * c + j] += s;
}

// Adds logit x to a running (max, sum of exp(logit - max)): the online softmax. A NaN makes the
// sum NaN for good; a -inf logit adds nothing.
__device__ __forceinline__ void online_add(float x, float* m, float* s) {
    if (x > *m) {
        *s = *s * expf(*m - x) + 1.0f;
        *m = x;
    } else if (x != NEG_INF) {
        *s += expf(x - *m);
    }
}

// logprobs[row] = log softmax(logits[row])[targets[row]] over v fp32 logits; when dlogits is not
// null, dlogits[row] = weights[row] / normaliser * (softmax - onehot(target)) (bf16, overwritten).
// A target outside the vocabulary yields NaN, never a silent value. One block a row, two passes
// over it: the online max and sum, then the gradient; 4 logits a read (2 gradients a write)
// where the rows allow it.
extern "C" __global__ void crossentropy(float* logprobs, bf16* dlogits, const float* logits,
                                        const unsigned int* targets, const float* weights, int v,
                                        float normaliser) {
    grid_begin();
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const float* x = logits + row * v;
    const unsigned int y = targets[row];
    const bool valid = y < (unsigned int)v;
    bf16* d = dlogits ? dlogits + row * v : nullptr;
    const bool wide = (v & 3) == 0 && aligned16(x) && (!d || ((unsigned long long)d & 7) == 0);
    float mx = NEG_INF, sum = 0.0f;
    if (wide) {
        for (int j = threadIdx.x; j < v / 4; j += blockDim.x) {
            const float4 f = ((const float4*)x)[j];
            online_add(f.x, &mx, &sum);
            online_add(f.y, &mx, &sum);
            online_add(f.z, &mx, &sum);
            online_add(f.w, &mx, &sum);
        }
    } else {
        for (int j = threadIdx.x; j < v; j += blockDim.x) online_add(x[j], &mx, &sum);
    }
    const float row_max = block_max(mx, scratch);
    sum = block_sum(mx == NEG_INF ? sum : sum * expf(mx - row_max), scratch);
    mx = row_max;
    const float nan = __int_as_float(0x7fc00000);
    if (threadIdx.x == 0) logprobs[row] = valid ? x[y] - mx - logf(sum) : nan;
    if (!d) return;
    const float scale = valid ? weights[row] / normaliser : nan;
    const float inv = 1.0f / sum;
    const auto grad = [&](float logit, int j) {
        const float onehot = (unsigned int)j == y ? 1.0f : 0.0f;
        return scale * (expf(logit - mx) * inv - onehot);
    };
    if (wide) {
        for (int j = threadIdx.x; j < v / 4; j += blockDim.x) {
            const float4 f = ((const float4*)x)[j];
            const int c = 4 * j;
            ((uint2*)d)[j] = make_uint2(pack2(grad(f.x, c), grad(f.y, c + 1)),
                                        pack2(grad(f.z, c + 2), grad(f.w, c + 3)));
        }
        return;
    }
    for (int j = threadIdx.x; j < v; j += blockDim.x) d[j] = f2bf(grad(x[j], j));
}

// partial[block] = the sum of x^2 over the block's grid-stride elements. The grid and block are
// fixed (the wrapper's SQUARE_BLOCKS), so every run adds in the same order.
extern "C" __global__ void square_partials(float* partial, const float* x, long long n) {
    grid_begin();
    __shared__ float scratch[32];
    float s = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        s += x[i] * x[i];
    }
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// acc[0] += the sum of partial[0 .. count), count <= blockDim.x; one block.
extern "C" __global__ void sum_partials(float* acc, const float* partial, int count) {
    grid_begin();
    __shared__ float scratch[32];
    const float v = (int)threadIdx.x < count ? partial[threadIdx.x] : 0.0f;
    const float s = block_sum(v, scratch);
    if (threadIdx.x == 0) acc[0] += s;
}

// IEEE half as a raw 16-bit word, converted by the hardware (round to nearest even, as the
// `half` crate's `f16::from_f32`): no header needed under NVRTC.
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// One element of an AdamW step with ops::adamw_update's arithmetic, operation for operation
// (explicitly rounded so the compiler fuses nothing into FMAs): the moments `mi`, `vi` update
// in place; returns the new master weight.
__device__ __forceinline__ float adamw_element(float master, float grad, float* mi, float* vi,
                                               float step_size, float bias2_sqrt, float decay,
                                               float beta1, float beta2, float eps,
                                               float grad_scale) {
    const float one_minus_b1 = __fsub_rn(1.0f, beta1), one_minus_b2 = __fsub_rn(1.0f, beta2);
    const float g = __fmul_rn(grad, grad_scale);
    float p = __fmul_rn(master, decay);
    const float m = __fadd_rn(__fmul_rn(beta1, *mi), __fmul_rn(one_minus_b1, g));
    const float v = __fadd_rn(__fmul_rn(beta2, *vi), __fmul_rn(__fmul_rn(one_minus_b2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bias2_sqrt), eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(step_size, m), denom));
    *mi = m;
    *vi = v;
    return p;
}

// One AdamW step on fp32 master weights and moments; params get the master weights rounded to
// bf16. Four elements a thread where every array allows it (16-byte words, params 8-byte), the
// rest one at a time.
extern "C" __global__ void adamw_update(float* master, bf16* params, float* m, float* v,
                                        const float* grads, long long n, float step_size,
                                        float bias2_sqrt, float decay, float beta1, float beta2,
                                        float eps, float grad_scale) {
    grid_begin();
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool wide = aligned16(master) && aligned16(m) && aligned16(v) && aligned16(grads) &&
                      ((unsigned long long)params & 7ull) == 0;
    const long long quads = wide ? n / 4 : 0;
    for (long long q = first; q < quads; q += stride) {
        float4 w = ((const float4*)master)[q], mq = ((const float4*)m)[q];
        float4 vq = ((const float4*)v)[q];
        const float4 g = ((const float4*)grads)[q];
        w.x = adamw_element(w.x, g.x, &mq.x, &vq.x, step_size, bias2_sqrt, decay, beta1, beta2,
                            eps, grad_scale);
        w.y = adamw_element(w.y, g.y, &mq.y, &vq.y, step_size, bias2_sqrt, decay, beta1, beta2,
                            eps, grad_scale);
        w.z = adamw_element(w.z, g.z, &mq.z, &vq.z, step_size, bias2_sqrt, decay, beta1, beta2,
                            eps, grad_scale);
        w.w = adamw_element(w.w, g.w, &mq.w, &vq.w, step_size, bias2_sqrt, decay, beta1, beta2,
                            eps, grad_scale);
        ((float4*)m)[q] = mq;
        ((float4*)v)[q] = vq;
        ((float4*)master)[q] = w;
        ((uint2*)params)[q] = make_uint2(pack2(w.x, w.y), pack2(w.z, w.w));
    }
    for (long long i = quads * 4 + first; i < n; i += stride) {
        float mi = m[i], vi = v[i];
        const float p = adamw_element(master[i], grads[i], &mi, &vi, step_size, bias2_sqrt,
                                      decay, beta1, beta2, eps, grad_scale);
        m[i] = mi;
        v[i] = vi;
        master[i] = p;
        params[i] = f2bf(p);
    }
}

// The fp32 step on moments stored as bf16 (streamed optimizer state): each moment widened,
// updated in fp32, rounded back to nearest even, as the host's codec of the disk bytes does.
extern "C" __global__ void adamw_update_bf16_moments(float* master, bf16* params, bf16* m,
                                                     bf16* v, const float* grads, long long n,
                                                     float step_size, float bias2_sqrt,
                                                     float decay, float beta1, float beta2,
                                                     float eps, float grad_scale) {
    grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float mi = bf2f(m[i]), vi = bf2f(v[i]);
        const float p = adamw_element(master[i], grads[i], &mi, &vi, step_size, bias2_sqrt,
                                      decay, beta1, beta2, eps, grad_scale);
        m[i] = f2bf(mi);
        v[i] = f2bf(vi);
        master[i] = p;
        params[i] = f2bf(p);
    }
}

// As `adamw_update_bf16_moments`, the moments stored as IEEE half.
extern "C" __global__ void adamw_update_f16_moments(float* master, bf16* params,
                                                    unsigned short* m, unsigned short* v,
                                                    const float* grads, long long n,
                                                    float step_size, float bias2_sqrt,
                                                    float decay, float beta1, float beta2,
                                                    float eps, float grad_scale) {
    grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float mi = h2f(m[i]), vi = h2f(v[i]);
        const float p = adamw_element(master[i], grads[i], &mi, &vi, step_size, bias2_sqrt,
                                      decay, beta1, beta2, eps, grad_scale);
        m[i] = f2h(mi);
        v[i] = f2h(vi);
        master[i] = p;
        params[i] = f2bf(p);
    }
}
