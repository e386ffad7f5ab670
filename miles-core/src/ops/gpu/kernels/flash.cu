// Causal attention for training, flash-style: tiles of 64 queries and 64 keys through shared
// memory, products on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate), the
// softmax online in registers; no (T, T) matrix is ever written. q is (B, T, H, D), k and v
// (B, T, K, D) with K dividing H (grouped-query attention), rows as the model keeps them.
//
// The forward pass writes the output and each row's log-sum-exp (in base 2, of the scores
// times log2(e) / sqrt(D)). The backward pass recomputes the probabilities from it in two
// kernels, neither with an atomic, so gradients repeat bit for bit: `flash_backward_dq` (one
// block per 64 queries of a head; it also writes delta = rowsum(dO * O)) and
// `flash_backward_dkv` (one block per 64 keys of a kv head, walking every query of its group).
//
// Head dims are padded with zeros in shared memory to DP, 16, 32, 64 or 128 (one instance of
// each kernel per DP). A block is 4 warps, each owning 16 rows of the block's tile.
//
// Fragments (PTX ISA, mma.m16n8k16 with .bf16): lane = 4 g + t. A (16 x 16, row major) is 4
// words: (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..). B (16 x 8, column major) is 2
// words: rows 2t..2t+1 and 2t+8..2t+9 of column g. C (16 x 8 fp32) is (g, 2t), (g, 2t+1),
// (g+8, 2t), (g+8, 2t+1). A row-major tile X[r][SD] gives A words at X[r][c..c+1] and the B
// words of X^T; a transposed tile Xt[d][FA_TS] gives the B words of X.

#define FA_TILE 64
#define FA_TS (FA_TILE + 8)

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned word_at(const bf16* p) { return *(const unsigned*)p; }

// The A fragment of rows r0..r0+15, columns c0..c0+15 of a row-major tile of stride `sd`.
__device__ __forceinline__ void a_frag(unsigned* a, const bf16* x, int sd, int r0, int c0) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const bf16* p = x + (r0 + g) * sd + c0 + 2 * t;
    a[0] = word_at(p);
    a[1] = word_at(p + 8 * sd);
    a[2] = word_at(p + 8);
    a[3] = word_at(p + 8 * sd + 8);
}

// The A fragment of a 16 x 16 block from two C fragments (columns 0..7 and 8..15), rounded.
__device__ __forceinline__ void a_from_c(unsigned* a, const float* lo, const float* hi) {
    a[0] = pack2(lo[0], lo[1]);
    a[1] = pack2(lo[2], lo[3]);
    a[2] = pack2(hi[0], hi[1]);
    a[3] = pack2(hi[2], hi[3]);
}

// acc (16 x 8n) += A (16 x 16k, fragments a[k]) times the B words of tile rows n0.., columns
// of `b` (stride `sb`): acc[n] += a[k] * b[(n*8 + g) * sb + k*16 + 2t ...].
template <int N, int K>
__device__ __forceinline__ void mma_rows(float (*acc)[4], const unsigned (*a)[4], const bf16* b, int sb) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int n = 0; n < N; n++) {
        const bf16* p = b + (n * 8 + g) * sb + 2 * t;
#pragma unroll
        for (int k = 0; k < K; k++) mma_bf16(acc[n], a[k], word_at(p + k * 16), word_at(p + k * 16 + 8));
    }
}

// Rows row0.. (64 of them) of head `h` of x (B, T, NH, D) into tile[64][DP + 8], zero past T
// and past D; `vec` when rows can be read 8 values at a time.
template <int DP>
__device__ void load_tile(bf16* tile, const bf16* x, int b, int T, int NH, int h, int D, int row0,
                          bool vec) {
    constexpr int SD = DP + 8, CH = DP / 8;
    for (int i = threadIdx.x; i < FA_TILE * CH; i += blockDim.x) {
        const int r = i / CH, d0 = (i % CH) * 8, t = row0 + r;
        uint4 w = make_uint4(0, 0, 0, 0);
        if (t < T && d0 < D) {
            const bf16* src = x + ((size_t)(b * T + t) * NH + h) * D + d0;
            if (vec) {
                w = *(const uint4*)src;
            } else {
                unsigned e[4];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const unsigned lo = d0 + 2 * j < D ? src[2 * j] : 0;
                    const unsigned hi = d0 + 2 * j + 1 < D ? src[2 * j + 1] : 0;
                    e[j] = lo | (hi << 16);
                }
                w = make_uint4(e[0], e[1], e[2], e[3]);
            }
        }
        *(uint4*)(tile + r * SD + d0) = w;
    }
}

// A loaded tile transposed: dst[d][FA_TS] = src[r][d], from shared memory to shared memory.
template <int DP>
__device__ void transpose_tile(bf16* dst, const bf16* src) {
    constexpr int SD = DP + 8;
    for (int i = threadIdx.x; i < FA_TILE * DP / 2; i += blockDim.x) {
        const int r = i % FA_TILE, d = (i / FA_TILE) * 2;
        const unsigned w = word_at(src + r * SD + d);
        dst[d * FA_TS + r] = (bf16)(w & 0xffffu);
        dst[(d + 1) * FA_TS + r] = (bf16)(w >> 16);
    }
}

// Writes rows of a C-fragment set (16 x DP of this warp at rows r0..) times `scale` to y (B, T,
// NH, D) at head h, columns below D.
template <int DP>
__device__ void store_rows(bf16* y, const float (*acc)[4], float scale_a, float scale_b, int b, int T,
                           int NH, int h, int D, int r0) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = r0 + g + 8 * half;
        if (row >= T) continue;
        const float s = half ? scale_b : scale_a;
        bf16* dst = y + ((size_t)(b * T + row) * NH + h) * D;
#pragma unroll
        for (int n = 0; n < DP / 8; n++) {
            const int c = n * 8 + 2 * t;
            if (c < D) dst[c] = f2bf(acc[n][2 * half] * s);
            if (c + 1 < D) dst[c + 1] = f2bf(acc[n][2 * half + 1] * s);
        }
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The query and key of C element j of n-tile n: rows are queries (forward, dq) or keys (dkv).
__device__ __forceinline__ int c_row(int j) { return ((threadIdx.x & 31) >> 2) + (j >= 2 ? 8 : 0); }
__device__ __forceinline__ int c_col(int n, int j) { return n * 8 + 2 * (threadIdx.x & 3) + (j & 1); }

// Grid (T/64 query tiles, H, B); the last query tiles (the most keys) first.
template <int DP>
__device__ void flash_forward_tile(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                                   int T, int H, int KH, int D, float scale_log2) {
    constexpr int SD = DP + 8, KD = DP / 16;
    extern __shared__ uint4 fa_shared[];
    bf16* qs = (bf16*)fa_shared;
    bf16* ks = qs + FA_TILE * SD;
    bf16* vt = ks + FA_TILE * SD;
    const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KH), warp = threadIdx.x >> 5;
    const int q0 = qt * FA_TILE, wr = warp * 16;
    const bool v8 = D % 8 == 0, vk = v8 && aligned16(k), vv = v8 && aligned16(v);
    load_tile<DP>(qs, q, b, T, H, h, D, q0, v8 && aligned16(q));
    __syncthreads();
    unsigned qa[KD][4];
#pragma unroll
    for (int kk = 0; kk < KD; kk++) a_frag(qa[kk], qs, SD, wr, kk * 16);
    float o[DP / 8][4] = {};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();
        load_tile<DP>(ks, k, b, T, KH, kvh, D, kt * FA_TILE, vk);
        load_tile<DP>(qs, v, b, T, KH, kvh, D, kt * FA_TILE, vv);  // q is in registers now
        __syncthreads();
        transpose_tile<DP>(vt, qs);
        __syncthreads();
        float s[8][4] = {};
        mma_rows<8, KD>(s, qa, ks, SD);
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int key = kt * FA_TILE + c_col(n, j), query = q0 + wr + c_row(j);
                s[n][j] = key <= query ? s[n][j] * scale_log2 : NEG_INF;
                mx[j >> 1] = fmaxf(mx[j >> 1], s[n][j]);
            }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float next = fmaxf(m[r], quad_max(mx[r]));
            alpha[r] = exp2f(m[r] - next);
            m[r] = next;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                s[n][j] = exp2f(s[n][j] - m[j >> 1]);
                l[j >> 1] += s[n][j];
            }
#pragma unroll
        for (int n = 0; n < DP / 8; n++)
#pragma unroll
            for (int j = 0; j < 4; j++) o[n][j] *= alpha[j >> 1];
        unsigned pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) a_from_c(pa[kk], s[2 * kk], s[2 * kk + 1]);
        mma_rows<DP / 8, 4>(o, pa, vt, FA_TS);
    }
    const float la = quad_sum(l[0]), lb = quad_sum(l[1]);
    store_rows<DP>(out, o, 1.0f / la, 1.0f / lb, b, T, H, h, D, q0 + wr);
    if ((threadIdx.x & 3) == 0) {
        const int ra = q0 + wr + c_row(0), rb = ra + 8;
        if (ra < T) lse[((size_t)b * H + h) * T + ra] = m[0] + log2f(la);
        if (rb < T) lse[((size_t)b * H + h) * T + rb] = m[1] + log2f(lb);
    }
}

// Grid (T/64 query tiles, H, B): dq of 64 queries, and delta = rowsum(dO * O) of them.
template <int DP>
__device__ void flash_dq_tile(bf16* dq, float* delta, const bf16* q, const bf16* k, const bf16* v,
                              const bf16* o, const bf16* dout, const float* lse, int T, int H, int KH,
                              int D, float scale_log2, float scale) {
    constexpr int SD = DP + 8, KD = DP / 16;
    extern __shared__ uint4 fa_shared[];
    bf16* ks = (bf16*)fa_shared;
    bf16* vs = ks + FA_TILE * SD;
    bf16* kt_s = vs + FA_TILE * SD;
    float* rows = (float*)(kt_s + DP * FA_TS);  // lse, then delta, of the tile's queries
    const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KH), warp = threadIdx.x >> 5;
    const int q0 = qt * FA_TILE, wr = warp * 16;
    const bool v8 = D % 8 == 0;
    load_tile<DP>(ks, q, b, T, H, h, D, q0, v8 && aligned16(q));
    load_tile<DP>(vs, dout, b, T, H, h, D, q0, v8 && aligned16(dout));
    __syncthreads();
    unsigned qa[KD][4], da[KD][4];
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
        a_frag(qa[kk], ks, SD, wr, kk * 16);
        a_frag(da[kk], vs, SD, wr, kk * 16);
    }
    {
        const int r = threadIdx.x >> 1, query = q0 + r;
        float sum = 0.0f;
        if (query < T) {
            const bf16* orow = o + ((size_t)(b * T + query) * H + h) * D;
            for (int d = threadIdx.x & 1; d < D; d += 2) sum += bf2f(vs[r * SD + d]) * bf2f(orow[d]);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        if ((threadIdx.x & 1) == 0) {
            const size_t at = ((size_t)b * H + h) * T + query;
            rows[r] = query < T ? lse[at] : 0.0f;
            rows[FA_TILE + r] = sum;
            if (query < T) delta[at] = sum;
        }
    }
    __syncthreads();
    const float lse_r[2] = {rows[wr + c_row(0)], rows[wr + c_row(2)]};
    const float delta_r[2] = {rows[FA_TILE + wr + c_row(0)], rows[FA_TILE + wr + c_row(2)]};
    const bool vk = v8 && aligned16(k), vv = v8 && aligned16(v);
    float acc[DP / 8][4] = {};
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();
        load_tile<DP>(ks, k, b, T, KH, kvh, D, kt * FA_TILE, vk);
        load_tile<DP>(vs, v, b, T, KH, kvh, D, kt * FA_TILE, vv);
        __syncthreads();
        transpose_tile<DP>(kt_s, ks);
        __syncthreads();
        float s[8][4] = {}, dp[8][4] = {};
        mma_rows<8, KD>(s, qa, ks, SD);
        mma_rows<8, KD>(dp, da, vs, SD);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int key = kt * FA_TILE + c_col(n, j), query = q0 + wr + c_row(j);
                const float p = key <= query ? exp2f(s[n][j] * scale_log2 - lse_r[j >> 1]) : 0.0f;
                s[n][j] = p * (dp[n][j] - delta_r[j >> 1]);
            }
        unsigned dsa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) a_from_c(dsa[kk], s[2 * kk], s[2 * kk + 1]);
        mma_rows<DP / 8, 4>(acc, dsa, kt_s, FA_TS);
    }
    store_rows<DP>(dq, acc, scale, scale, b, T, H, h, D, q0 + wr);
}

// Grid (T/64 key tiles, KH, B): dk and dv of 64 keys, summed over every query head of the
// group and every query at or after them.
template <int DP>
__device__ void flash_dkv_tile(bf16* dk, bf16* dv, const bf16* q, const bf16* k, const bf16* v,
                               const bf16* dout, const float* lse, const float* delta, int T, int H,
                               int KH, int D, float scale_log2, float scale) {
    constexpr int SD = DP + 8, KD = DP / 16;
    extern __shared__ uint4 fa_shared[];
    bf16* ks = (bf16*)fa_shared;
    bf16* vs = ks + FA_TILE * SD;
    bf16* qs = vs + FA_TILE * SD;
    bf16* dos = qs + FA_TILE * SD;
    bf16* qt_s = dos + FA_TILE * SD;
    bf16* dt_s = qt_s + DP * FA_TS;
    float* rows = (float*)(dt_s + DP * FA_TS);  // lse, then delta, of the tile's queries
    const int kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, group = H / KH;
    const int warp = threadIdx.x >> 5, k0 = kt * FA_TILE, wr = warp * 16;
    const bool v8 = D % 8 == 0, vq = v8 && aligned16(q), vd = v8 && aligned16(dout);
    load_tile<DP>(ks, k, b, T, KH, kvh, D, k0, v8 && aligned16(k));
    load_tile<DP>(vs, v, b, T, KH, kvh, D, k0, v8 && aligned16(v));
    float gk[DP / 8][4] = {}, gv[DP / 8][4] = {};
    const int tiles = (T + FA_TILE - 1) / FA_TILE;
    for (int hq = kvh * group; hq < (kvh + 1) * group; hq++) {
        for (int qt = kt; qt < tiles; qt++) {
            const int q0 = qt * FA_TILE;
            __syncthreads();
            load_tile<DP>(qs, q, b, T, H, hq, D, q0, vq);
            load_tile<DP>(dos, dout, b, T, H, hq, D, q0, vd);
            if (threadIdx.x < FA_TILE) {
                const int query = q0 + threadIdx.x;
                const size_t at = ((size_t)b * H + hq) * T + query;
                rows[threadIdx.x] = query < T ? lse[at] : 0.0f;
                rows[FA_TILE + threadIdx.x] = query < T ? delta[at] : 0.0f;
            }
            __syncthreads();
            transpose_tile<DP>(qt_s, qs);
            transpose_tile<DP>(dt_s, dos);
            __syncthreads();
            unsigned ka[KD][4], va[KD][4];
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                a_frag(ka[kk], ks, SD, wr, kk * 16);
                a_frag(va[kk], vs, SD, wr, kk * 16);
            }
            float s[8][4] = {}, dp[8][4] = {};
            mma_rows<8, KD>(s, ka, qs, SD);
            mma_rows<8, KD>(dp, va, dos, SD);
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int col = c_col(n, j), key = k0 + wr + c_row(j), query = q0 + col;
                    const float p = key <= query && query < T
                                        ? exp2f(s[n][j] * scale_log2 - rows[col])
                                        : 0.0f;
                    s[n][j] = p;
                    dp[n][j] = p * (dp[n][j] - rows[FA_TILE + col]);
                }
            unsigned pa[4][4], dsa[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                a_from_c(pa[kk], s[2 * kk], s[2 * kk + 1]);
                a_from_c(dsa[kk], dp[2 * kk], dp[2 * kk + 1]);
            }
            mma_rows<DP / 8, 4>(gv, pa, dt_s, FA_TS);
            mma_rows<DP / 8, 4>(gk, dsa, qt_s, FA_TS);
        }
    }
    store_rows<DP>(dk, gk, scale, scale, b, T, KH, kvh, D, k0 + wr);
    store_rows<DP>(dv, gv, 1.0f, 1.0f, b, T, KH, kvh, D, k0 + wr);
}

#define FLASH_KERNELS(DP)                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        flash_forward_##DP(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,     \
                           int T, int H, int KH, int D, float scale_log2) {                        \
        flash_forward_tile<DP>(out, lse, q, k, v, T, H, KH, D, scale_log2);                        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        flash_backward_dq_##DP(bf16* dq, float* delta, const bf16* q, const bf16* k,               \
                               const bf16* v, const bf16* o, const bf16* dout, const float* lse,   \
                               int T, int H, int KH, int D, float scale_log2, float scale) {       \
        flash_dq_tile<DP>(dq, delta, q, k, v, o, dout, lse, T, H, KH, D, scale_log2, scale);       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        flash_backward_dkv_##DP(bf16* dk, bf16* dv, const bf16* q, const bf16* k, const bf16* v,   \
                                const bf16* dout, const float* lse, const float* delta, int T,     \
                                int H, int KH, int D, float scale_log2, float scale) {             \
        flash_dkv_tile<DP>(dk, dv, q, k, v, dout, lse, delta, T, H, KH, D, scale_log2, scale);     \
    }

FLASH_KERNELS(16)
FLASH_KERNELS(32)
FLASH_KERNELS(64)
FLASH_KERNELS(128)
