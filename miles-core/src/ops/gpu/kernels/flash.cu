// Causal attention for training, flash-style: tiles of 64 queries and 64 keys through shared
// memory, products on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate), the
// softmax online in registers; no (T, T) matrix is ever written. q is (B, T, H, D), k and v
// (B, T, K, D) with K dividing H (grouped-query attention), rows as the model keeps them.
//
// The forward pass writes the output and each row's log-sum-exp (in base 2, of the scores
// times log2(e) / sqrt(D)). The backward pass recomputes the probabilities from it in two
// kernels, neither with an atomic, so gradients repeat bit for bit: `flash_backward_dq`
// (one block per 64 queries of a head; it also writes delta = rowsum(dO * O)) and
// `flash_backward_dkv` (a block per two tiles of 64 keys and one kv head, walking the queries
// at or after them of each query head of its group in order, summing in registers; where that
// grid is small, a block per piece of the group, whose fp32 partials `flash_dkv_reduce` sums).
// The tiles a loop walks are double-buffered: the next one is copied in (cp.async, where rows
// are 16-byte aligned) while the tensor cores work on this one.
//
// Head dims are padded with zeros in shared memory to DP, 16, 32, 64 or 128 (one instance of
// each kernel per DP). A block is 4 warps, each owning 16 rows of the block's tile (in the
// forward up to DP 64, two tiles of 16 rows: 128 queries a block).
//
// Fragments (PTX ISA, mma.m16n8k16 with .bf16): lane = 4 g + t. A (16 x 16, row major) is 4
// words: (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..). B (16 x 8, column major) is 2
// words: rows 2t..2t+1 and 2t+8..2t+9 of column g. C (16 x 8 fp32) is (g, 2t), (g, 2t+1),
// (g+8, 2t), (g+8, 2t+1). A row-major tile X[r][SD] gives A words at X[r][c..c+1] and the B
// words of X^T (both through ldmatrix); the B words of X itself come through ldmatrix.trans.

#define FA_TILE 64
#define FA_THREADS 128  // a block: 4 warps (flash.rs's THREADS)

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of rows r0..r0+15, columns c0..c0+15 of a row-major tile in shared memory of
// stride `sd` (rows 16-byte aligned), through one ldmatrix.x4 (matrix j of lane l's row:
// X[r0 + (j & 1)*8 + l % 8][c0 + (j >> 1)*8]).
__device__ __forceinline__ void a_frag(unsigned* a, const bf16* x, int sd, int r0, int c0) {
    const int lane = threadIdx.x & 31, j = lane >> 3;
    const bf16* p = x + (r0 + (j & 1) * 8 + (lane & 7)) * sd + c0 + (j >> 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(shared_address(p)));
}

// The A fragment of a 16 x 16 block from two C fragments (columns 0..7 and 8..15), rounded.
__device__ __forceinline__ void a_from_c(unsigned* a, const float* lo, const float* hi) {
    a[0] = cvt_pack2(lo[0], lo[1]);
    a[1] = cvt_pack2(lo[2], lo[3]);
    a[2] = cvt_pack2(hi[0], hi[1]);
    a[3] = cvt_pack2(hi[2], hi[3]);
}

// acc (M row tiles of 16 x 8N) += A (M row tiles of 16 x 16K, fragments a[m][k]) times X^T, X
// a row-major tile in shared memory (stride `sx`, rows 16-byte aligned) whose rows are the
// product's columns, N even: B words at X[n*8 + g][k*16 + 2t ...], each pair of column tiles'
// through one ldmatrix.x4 (matrix j of lane l's row: X[n*8 + (j >> 1)*8 + l % 8][k*16 + (j &
// 1)*8]) and used for every row tile.
template <int M, int N, int K>
__device__ __forceinline__ void mma_xt_rows(float (*acc)[N][4], const unsigned (*a)[K][4], const bf16* x,
                                            int sx) {
    const int lane = threadIdx.x & 31, j = lane >> 3;
    const bf16* row = x + ((j >> 1) * 8 + (lane & 7)) * sx + (j & 1) * 8;
#pragma unroll
    for (int n = 0; n < N; n += 2) {
#pragma unroll
        for (int k = 0; k < K; k++) {
            unsigned b[4];
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                         : "r"(shared_address(row + n * 8 * sx + k * 16)));
#pragma unroll
            for (int m = 0; m < M; m++) {
                mma_bf16(acc[m][n], a[m][k], b[0], b[1]);
                mma_bf16(acc[m][n + 1], a[m][k], b[2], b[3]);
            }
        }
    }
}

// mma_xt_rows of one row tile.
template <int N, int K>
__device__ __forceinline__ void mma_xt(float (*acc)[4], const unsigned (*a)[4], const bf16* x, int sx) {
    mma_xt_rows<1, N, K>((float(*)[N][4])acc, (const unsigned(*)[K][4])a, x, sx);
}

// acc (M row tiles of 16 x 8N) += A (M row tiles of 16 x 16K) times X, X a row-major tile
// (stride `sx`) whose rows are the product's inner dimension: each pair of column tiles' B
// words through one ldmatrix.x4.trans (matrix j of lane l's row: X[k*16 + (j & 1)*8 + l %
// 8][n*8 + (j >> 1)*8]), used for every row tile.
template <int M, int N, int K>
__device__ __forceinline__ void mma_x_rows(float (*acc)[N][4], const unsigned (*a)[K][4], const bf16* x,
                                           int sx) {
    const int lane = threadIdx.x & 31, j = lane >> 3;
    const bf16* row = x + ((j & 1) * 8 + (lane & 7)) * sx + (j >> 1) * 8;
#pragma unroll
    for (int n = 0; n < N; n += 2) {
#pragma unroll
        for (int k = 0; k < K; k++) {
            unsigned b[4];
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                         : "r"(shared_address(row + k * 16 * sx + n * 8)));
#pragma unroll
            for (int m = 0; m < M; m++) {
                mma_bf16(acc[m][n], a[m][k], b[0], b[1]);
                mma_bf16(acc[m][n + 1], a[m][k], b[2], b[3]);
            }
        }
    }
}

// mma_x_rows of one row tile.
template <int N, int K>
__device__ __forceinline__ void mma_x(float (*acc)[4], const unsigned (*a)[4], const bf16* x, int sx) {
    mma_x_rows<1, N, K>((float(*)[N][4])acc, (const unsigned(*)[K][4])a, x, sx);
}

// Starts copying rows row0.. (64 of them) of head `h` of x (B, T, NH, D) into tile[64][DP + 8],
// zero past T and past D: with cp.async where `vec` (rows 16-byte aligned, D a multiple of 8),
// else with plain loads and stores. Either way the tile is whole once the block has waited
// (`wait_tiles`) and synchronised. A thread copies the same 8 columns of every STEP-th row.
template <int DP>
__device__ void load_tile(bf16* tile, const bf16* x, int b, int T, int NH, int h, int D, int row0,
                          bool vec) {
    constexpr int SD = DP + 8, CH = DP / 8, STEP = FA_THREADS / CH;
    const int r0 = threadIdx.x / CH, d0 = (threadIdx.x % CH) * 8;
    const bf16* first = x + ((size_t)(b * T + row0 + r0) * NH + h) * D + d0;
#pragma unroll
    for (int i = 0; i < FA_TILE / STEP; i++) {
        const int r = r0 + i * STEP;
        const bf16* src = first + (size_t)i * STEP * NH * D;
        bf16* dst = tile + r * SD + d0;
        const bool inside = row0 + r < T && d0 < D;
        if (vec) {
            // Outside, cp.async reads nothing (source size 0) but still takes a valid address.
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
                         "l"(inside ? src : x), "r"(inside ? 16 : 0));
            continue;
        }
        unsigned e[4] = {0, 0, 0, 0};
        if (inside) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const unsigned lo = d0 + 2 * j < D ? src[2 * j] : 0;
                const unsigned hi = d0 + 2 * j + 1 < D ? src[2 * j + 1] : 0;
                e[j] = lo | (hi << 16);
            }
        }
        *(uint4*)dst = make_uint4(e[0], e[1], e[2], e[3]);
    }
}

// Closes the group of copies started since the last call.
__device__ __forceinline__ void commit_tiles() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits for every group of copies but the newest `pending` (0 or 1).
__device__ __forceinline__ void wait_tiles(int pending) {
    if (pending) {
        asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
        asm volatile("cp.async.wait_group 0;\n" ::);
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

// The row and column within a warp's 16 x 64 block of C element j of column tile n: rows are
// queries (forward, dq) or keys (dkv).
__device__ __forceinline__ int c_row(int j) { return ((threadIdx.x & 31) >> 2) + (j >= 2 ? 8 : 0); }
__device__ __forceinline__ int c_col(int n, int j) { return n * 8 + 2 * (threadIdx.x & 3) + (j & 1); }

// 2^x, flushing results below the normal range to 0: one instruction (exp2f adds the subnormal
// range's scaling around it).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Sets to -inf the scores of a warp's 16 x 64 block (C fragments; rows from position row0,
// columns from col0) that causality hides: a key past its query, and with `rows_are_keys` a
// query at or past T too. Only the tiles on the diagonal (and the last) need it.
__device__ __forceinline__ void mask_causal(float (*s)[4], int row0, int col0, int T, bool rows_are_keys) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int row = row0 + c_row(j), col = col0 + c_col(n, j);
            if (rows_are_keys ? row > col || col >= T : col > row) s[n][j] = NEG_INF;
        }
}

// Query rows of a forward block: 4 warps of M row tiles of 16, each B fragment read
// once for all of a warp's row tiles. Two where the registers allow (head dims up to 64), one at
// 128 (flash.rs's `forward_rows`).
template <int DP>
struct Forward {
    static constexpr int M = DP <= 64 ? 2 : 1;
    static constexpr int ROWS = 4 * 16 * M;
};

// Grid (T/ROWS query blocks, H, B); the last query blocks (the most keys) first.
template <int DP>
__device__ void flash_forward_tile(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                                   int T, int H, int KH, int D, float scale_log2) {
    constexpr int SD = DP + 8, KD = DP / 16, TILE = FA_TILE * SD, M = Forward<DP>::M;
    extern __shared__ uint4 fa_shared[];
    bf16* qs = (bf16*)fa_shared;  // M tiles of 64 queries
    bf16* ks = qs + M * TILE;     // two buffers each of k and v
    bf16* vs = ks + 2 * TILE;
    const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KH), warp = threadIdx.x >> 5;
    const int q0 = qb * Forward<DP>::ROWS, wr = warp * 16 * M, first = q0 + wr;
    const int last_kt = min(q0 + Forward<DP>::ROWS - 1, T - 1) / FA_TILE;
    const bool v8 = D % 8 == 0, vk = v8 && aligned16(k), vv = v8 && aligned16(v);
#pragma unroll
    for (int i = 0; i < M; i++) {
        load_tile<DP>(qs + i * TILE, q, b, T, H, h, D, q0 + i * FA_TILE, v8 && aligned16(q));
    }
    load_tile<DP>(ks, k, b, T, KH, kvh, D, 0, vk);
    load_tile<DP>(vs, v, b, T, KH, kvh, D, 0, vv);
    commit_tiles();
    float o[M][DP / 8][4] = {};
    float m[M][2], l[M][2] = {};
    unsigned qa[M][KD][4];
#pragma unroll
    for (int i = 0; i < M; i++) m[i][0] = m[i][1] = NEG_INF;
    for (int kt = 0; kt <= last_kt; kt++) {
        const int buf = kt & 1, k0 = kt * FA_TILE;
        if (kt < last_kt) {
            load_tile<DP>(ks + (buf ^ 1) * TILE, k, b, T, KH, kvh, D, k0 + FA_TILE, vk);
            load_tile<DP>(vs + (buf ^ 1) * TILE, v, b, T, KH, kvh, D, k0 + FA_TILE, vv);
        }
        commit_tiles();
        wait_tiles(1);
        __syncthreads();
        if (kt == 0) {
#pragma unroll
            for (int i = 0; i < M; i++)
#pragma unroll
                for (int kk = 0; kk < KD; kk++) a_frag(qa[i][kk], qs, SD, wr + 16 * i, kk * 16);
        }
        // A warp whose rows all come before the tile's keys skips it (warp-uniform); a tile
        // reaching past the warp's first row is masked. Every row of a warp that runs sees
        // the tile's first key (k0 <= first), so its max is finite from the first tile on.
        if (k0 <= first + 16 * M - 1) {
            float s[M][8][4] = {};
            mma_xt_rows<M, 8, KD>(s, qa, ks + buf * TILE, SD);
            unsigned pa[M][4][4];
#pragma unroll
            for (int i = 0; i < M; i++) {
                if (k0 + FA_TILE - 1 > first) mask_causal(s[i], first + 16 * i, k0, T, false);
                // m is in the scaled units (scale_log2 > 0: the max commutes with the scaling).
                float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int j = 0; j < 4; j++) mx[j >> 1] = fmaxf(mx[j >> 1], s[i][n][j]);
                float alpha[2];
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const float next = fmaxf(m[i][r], quad_max(mx[r]) * scale_log2);
                    alpha[r] = exp2_ftz(m[i][r] - next);
                    m[i][r] = next;
                    l[i][r] *= alpha[r];
                }
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        s[i][n][j] = exp2_ftz(fmaf(s[i][n][j], scale_log2, -m[i][j >> 1]));
                        l[i][j >> 1] += s[i][n][j];
                    }
#pragma unroll
                for (int n = 0; n < DP / 8; n++)
#pragma unroll
                    for (int j = 0; j < 4; j++) o[i][n][j] *= alpha[j >> 1];
#pragma unroll
                for (int kk = 0; kk < 4; kk++) a_from_c(pa[i][kk], s[i][2 * kk], s[i][2 * kk + 1]);
            }
            mma_x_rows<M, DP / 8, 4>(o, pa, vs + buf * TILE, SD);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < M; i++) {
        const float la = quad_sum(l[i][0]), lb = quad_sum(l[i][1]);
        const int r0 = first + 16 * i;
        store_rows<DP>(out, o[i], 1.0f / la, 1.0f / lb, b, T, H, h, D, r0);
        if ((threadIdx.x & 3) == 0) {
            const int ra = r0 + c_row(0), rb = ra + 8;
            if (ra < T) lse[((size_t)b * H + h) * T + ra] = m[i][0] + log2f(la);
            if (rb < T) lse[((size_t)b * H + h) * T + rb] = m[i][1] + log2f(lb);
        }
    }
}

// Grid (T/64 query tiles, H, B): dq of 64 queries, and delta = rowsum(dO * O) of them.
template <int DP>
__device__ void flash_dq_tile(bf16* dq, float* delta, const bf16* q, const bf16* k, const bf16* v,
                              const bf16* o, const bf16* dout, const float* lse, int T, int H, int KH,
                              int D, float scale_log2, float scale) {
    constexpr int SD = DP + 8, KD = DP / 16, TILE = FA_TILE * SD;
    extern __shared__ uint4 fa_shared[];
    bf16* qs = (bf16*)fa_shared;
    bf16* ds = qs + TILE;    // dO
    bf16* ks = ds + TILE;    // two buffers each of k and v
    bf16* vs = ks + 2 * TILE;
    float* rows = (float*)(vs + 2 * TILE);  // lse, then delta, of the tile's queries
    const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KH), warp = threadIdx.x >> 5;
    const int q0 = qt * FA_TILE, wr = warp * 16;
    const bool v8 = D % 8 == 0, vk = v8 && aligned16(k), vv = v8 && aligned16(v);
    load_tile<DP>(qs, q, b, T, H, h, D, q0, v8 && aligned16(q));
    load_tile<DP>(ds, dout, b, T, H, h, D, q0, v8 && aligned16(dout));
    load_tile<DP>(ks, k, b, T, KH, kvh, D, 0, vk);
    load_tile<DP>(vs, v, b, T, KH, kvh, D, 0, vv);
    commit_tiles();
    wait_tiles(0);
    __syncthreads();
    unsigned qa[KD][4], da[KD][4];
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
        a_frag(qa[kk], qs, SD, wr, kk * 16);
        a_frag(da[kk], ds, SD, wr, kk * 16);
    }
    {
        const int r = threadIdx.x >> 1, query = q0 + r;
        float sum = 0.0f;
        if (query < T) {
            const bf16* orow = o + ((size_t)(b * T + query) * H + h) * D;
            for (int d = threadIdx.x & 1; d < D; d += 2) sum += bf2f(ds[r * SD + d]) * bf2f(orow[d]);
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
    float acc[DP / 8][4] = {};
    for (int kt = 0; kt <= qt; kt++) {
        const int buf = kt & 1;
        if (kt < qt) {
            load_tile<DP>(ks + (buf ^ 1) * TILE, k, b, T, KH, kvh, D, (kt + 1) * FA_TILE, vk);
            load_tile<DP>(vs + (buf ^ 1) * TILE, v, b, T, KH, kvh, D, (kt + 1) * FA_TILE, vv);
        }
        commit_tiles();
        wait_tiles(1);
        __syncthreads();
        float s[8][4] = {}, dp[8][4] = {};
        mma_xt<8, KD>(s, qa, ks + buf * TILE, SD);
        mma_xt<8, KD>(dp, da, vs + buf * TILE, SD);
        if (kt == qt) mask_causal(s, q0 + wr, kt * FA_TILE, T, false);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float p = exp2_ftz(fmaf(s[n][j], scale_log2, -lse_r[j >> 1]));
                s[n][j] = p * (dp[n][j] - delta_r[j >> 1]);
            }
        unsigned dsa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) a_from_c(dsa[kk], s[2 * kk], s[2 * kk + 1]);
        mma_x<DP / 8, 4>(acc, dsa, ks + buf * TILE, SD);
        __syncthreads();
    }
    store_rows<DP>(dq, acc, scale, scale, b, T, H, h, D, q0 + wr);
}

// Starts copying query tile q0's q and dO rows of head hq (and their lse and delta).
template <int DP>
__device__ void load_query_tiles(bf16* qs, bf16* ds, float* rows, const bf16* q, const bf16* dout,
                                 const float* lse, const float* delta, int b, int T, int H, int D,
                                 int hq, int q0, bool vq, bool vd) {
    load_tile<DP>(qs, q, b, T, H, hq, D, q0, vq);
    load_tile<DP>(ds, dout, b, T, H, hq, D, q0, vd);
    if (threadIdx.x < FA_TILE) {
        const int query = q0 + threadIdx.x;
        const size_t at = ((size_t)b * H + hq) * T + query;
        rows[threadIdx.x] = query < T ? lse[at] : 0.0f;
        rows[FA_TILE + threadIdx.x] = query < T ? delta[at] : 0.0f;
    }
}

// Writes a warp's 16 rows of fp32 partial gradients (times `scale`) to part (B, T, KH, D) at kv
// head kvh.
template <int DP>
__device__ void store_partial(float* part, const float (*acc)[4], float scale, int b, int T, int KH,
                              int kvh, int D, int r0) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = r0 + g + 8 * half;
        if (row >= T) continue;
        float* dst = part + ((size_t)(b * T + row) * KH + kvh) * D;
#pragma unroll
        for (int n = 0; n < DP / 8; n++) {
            const int c = n * 8 + 2 * t;
            if (c < D) dst[c] = acc[n][2 * half] * scale;
            if (c + 1 < D) dst[c + 1] = acc[n][2 * half + 1] * scale;
        }
    }
}

// The dk and dv of key tile kt from the queries at or after its keys of piece `piece` of kv head
// kvh's query group (split into `split` pieces of consecutive heads; the heads in order, each
// walking its query tiles in order), summed in registers. One piece (split 1) is the whole
// group: written as bf16. Otherwise as fp32 partials at part (2, split, B, T, KH, D), which
// `flash_dkv_reduce` sums in order. No atomics either way.
template <int DP>
__device__ void flash_dkv_key_tile(bf16* dk, bf16* dv, float* part, int split, const bf16* q,
                                   const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                   const float* delta, int b, int kt, int kvh, int piece, int T,
                                   int H, int KH, int D, float scale_log2, float scale) {
    constexpr int SD = DP + 8, KD = DP / 16, TILE = FA_TILE * SD;
    extern __shared__ uint4 fa_shared[];
    bf16* ks = (bf16*)fa_shared;
    bf16* vs = ks + TILE;
    bf16* qs = vs + TILE;     // two buffers each of q and dO
    bf16* ds = qs + 2 * TILE;
    float* rows = (float*)(ds + 2 * TILE);  // per buffer: lse, then delta, of its queries
    const int heads = H / KH / split, first_hq = (kvh * split + piece) * heads;
    const int warp = threadIdx.x >> 5, k0 = kt * FA_TILE, wr = warp * 16;
    const bool v8 = D % 8 == 0, vq = v8 && aligned16(q), vd = v8 && aligned16(dout);
    __syncthreads();  // the block's previous key tile is done with every buffer
    load_tile<DP>(ks, k, b, T, KH, kvh, D, k0, v8 && aligned16(k));
    load_tile<DP>(vs, v, b, T, KH, kvh, D, k0, v8 && aligned16(v));
    load_query_tiles<DP>(qs, ds, rows, q, dout, lse, delta, b, T, H, D, first_hq, k0, vq, vd);
    commit_tiles();
    float gk[DP / 8][4] = {}, gv[DP / 8][4] = {};
    unsigned ka[KD][4], va[KD][4];
    // Item i is query tile q0 of a head; next_q0 of next_hq is copied in while it runs.
    const int items = heads * ((T + FA_TILE - 1) / FA_TILE - kt);
    int q0 = k0, next_q0 = k0, next_hq = first_hq;
    for (int i = 0; i < items; i++, q0 = next_q0) {
        const int buf = i & 1;
        next_q0 += FA_TILE;
        if (next_q0 >= T) {
            next_q0 = k0;
            next_hq++;
        }
        if (i + 1 < items) {
            load_query_tiles<DP>(qs + (buf ^ 1) * TILE, ds + (buf ^ 1) * TILE,
                                 rows + (buf ^ 1) * 2 * FA_TILE, q, dout, lse, delta, b, T, H, D,
                                 next_hq, next_q0, vq, vd);
        }
        commit_tiles();
        wait_tiles(1);
        __syncthreads();
        // At 128 the k and v fragments are read again for each tile, one set live at a time:
        // kept in registers they would spill.
        const bool frags = i == 0 || DP > 64;
        const bf16* qb = qs + buf * TILE;
        const bf16* db = ds + buf * TILE;
        const float* rb = rows + buf * 2 * FA_TILE;
        float s[8][4] = {}, dp[8][4] = {};
#pragma unroll
        for (int kk = 0; kk < KD && frags; kk++) a_frag(ka[kk], ks, SD, wr, kk * 16);
        mma_xt<8, KD>(s, ka, qb, SD);
#pragma unroll
        for (int kk = 0; kk < KD && frags; kk++) a_frag(va[kk], vs, SD, wr, kk * 16);
        mma_xt<8, KD>(dp, va, db, SD);
        if (q0 == k0 || q0 + FA_TILE > T) mask_causal(s, k0 + wr, q0, T, true);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int col = c_col(n, j);
                const float p = exp2_ftz(fmaf(s[n][j], scale_log2, -rb[col]));
                s[n][j] = p;
                dp[n][j] = p * (dp[n][j] - rb[FA_TILE + col]);
            }
        unsigned pa[4][4], dsa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            a_from_c(pa[kk], s[2 * kk], s[2 * kk + 1]);
            a_from_c(dsa[kk], dp[2 * kk], dp[2 * kk + 1]);
        }
        mma_x<DP / 8, 4>(gv, pa, db, SD);
        mma_x<DP / 8, 4>(gk, dsa, qb, SD);
        __syncthreads();
    }
    if (split == 1) {
        store_rows<DP>(dk, gk, scale, scale, b, T, KH, kvh, D, k0 + wr);
        store_rows<DP>(dv, gv, 1.0f, 1.0f, b, T, KH, kvh, D, k0 + wr);
        return;
    }
    const size_t n = (size_t)gridDim.z * T * KH * D;
    store_partial<DP>(part + piece * n, gk, scale, b, T, KH, kvh, D, k0 + wr);
    store_partial<DP>(part + (split + piece) * n, gv, 1.0f, b, T, KH, kvh, D, k0 + wr);
}

// Grid (ceil(tiles / 2), KH * split, B): key tiles x and tiles - 1 - x (one walks many query
// tiles, the other few, so every block does the same work), for one piece of a kv head's group.
template <int DP>
__device__ void flash_dkv_tiles(bf16* dk, bf16* dv, float* part, int split, const bf16* q,
                                const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                const float* delta, int T, int H, int KH, int D, float scale_log2,
                                float scale) {
    const int tiles = (T + FA_TILE - 1) / FA_TILE, first = blockIdx.x, last = tiles - 1 - blockIdx.x;
    const int kvh = blockIdx.y / split, piece = blockIdx.y % split;
    flash_dkv_key_tile<DP>(dk, dv, part, split, q, k, v, dout, lse, delta, blockIdx.z, first, kvh,
                           piece, T, H, KH, D, scale_log2, scale);
    if (last != first) {
        flash_dkv_key_tile<DP>(dk, dv, part, split, q, k, v, dout, lse, delta, blockIdx.z, last, kvh,
                               piece, T, H, KH, D, scale_log2, scale);
    }
}

// dk and dv (n values each, as (B, T, KH, D)) from the dk/dv kernel's `split` fp32 partials of
// each (part (2, split, n)), summed in order and rounded once. One thread a value.
extern "C" __global__ void flash_dkv_reduce(bf16* dk, bf16* dv, const float* part, int split,
                                            long long n) {
    grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float sk = 0.0f, sv = 0.0f;
        for (int j = 0; j < split; j++) {
            sk += part[j * n + i];
            sv += part[(split + j) * n + i];
        }
        dk[i] = f2bf(sk);
        dv[i] = f2bf(sv);
    }
}

#define FLASH_KERNELS(DP)                                                                          \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                       \
        flash_forward_##DP(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,     \
                           int T, int H, int KH, int D, float scale_log2) {                        \
        grid_begin();                                                                              \
        flash_forward_tile<DP>(out, lse, q, k, v, T, H, KH, D, scale_log2);                        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                       \
        flash_backward_dq_##DP(bf16* dq, float* delta, const bf16* q, const bf16* k,               \
                               const bf16* v, const bf16* o, const bf16* dout, const float* lse,   \
                               int T, int H, int KH, int D, float scale_log2, float scale) {       \
        grid_begin();                                                                              \
        flash_dq_tile<DP>(dq, delta, q, k, v, o, dout, lse, T, H, KH, D, scale_log2, scale);       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                       \
        flash_backward_dkv_##DP(bf16* dk, bf16* dv, float* part, int split, const bf16* q,         \
                                const bf16* k, const bf16* v, const bf16* dout, const float* lse,  \
                                const float* delta, int T, int H, int KH, int D, float scale_log2, \
                                float scale) {                                                     \
        grid_begin();                                                                              \
        flash_dkv_tiles<DP>(dk, dv, part, split, q, k, v, dout, lse, delta, T, H, KH, D,          \
                            scale_log2, scale);                                                    \
    }

FLASH_KERNELS(16)
FLASH_KERNELS(32)
FLASH_KERNELS(64)
FLASH_KERNELS(128)
