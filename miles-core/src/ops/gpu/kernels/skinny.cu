// Products of few rows (a decode step's tokens) with a whole weight: y (n, N) = x (n, K) W^T for
// an HF weight W (N, K), bf16 in, fp32 accumulate, n at most SK_BM. Such a product is a stream
// of the weight through the SMs; cuBLAS's tiles (128 x 128 and up) leave most SMs idle on the
// narrow ones (N 2048: 16 tiles), so here a block takes SK_BN columns and, where that still
// leaves SMs idle, a slice of K ("split K"): its fp32 partial sums go to `part` (splits, n, N)
// and a second kernel adds the slices in order (split_sum, or split_sum_rmsnorm, which also adds
// the residual and normalises the result for the next product). Sums run in a fixed order, so a
// step repeats bit for bit.
//
// skinny_gemm(float* yf, bf16* yb, const bf16* x, const bf16* w, int n, int N, int K,
//             int k_tiles_per_split, int accumulate)
//     grid (N / SK_BN rounded up, splits), SK_THREADS threads, SK_SHARED bytes of dynamic
//     shared memory. yf non-null: fp32 out, slice s of K into yf + s * n * N (with one slice,
//     the product itself); otherwise bf16 into yb, added to what yb holds where `accumulate`.
//     K a multiple of 8, x, w 16-byte aligned, N even.
// split_sum(bf16* y, const float* part, int splits, long long count, int accumulate)
//     elementwise: y = sum over the slices (+ y where accumulate), rounded to bf16.
// split_sum_rmsnorm(bf16* x, bf16* ln, const float* part, const bf16* w, int splits, int c,
//                   float eps)
//     one block a row: x += the slices' sum (rounded to bf16), then ln = rmsnorm(x) * w as
//     rmsnorm_forward computes it.
//
// The tiles: each block holds SK_STAGES stages of x (SK_BM x SK_BK) and W (SK_BN x SK_BK) in
// shared memory, copied in with cp.async while the tensor cores work on an earlier stage. Rows
// of 64 bf16 are 8 chunks of 16 bytes; chunk c of row r sits at c ^ (r & 7), so the 8 rows an
// ldmatrix reads at one chunk fall in 8 different banks. Each of 8 warps multiplies 32 rows by
// 64 of the block's columns (mma.sync m16n8k16), reading the next 16-wide slice's fragments
// while the current slice's products run; a warp whose rows are past n only copies.

#define SK_BM 128
#define SK_BN 128
#define SK_BK 64
#define SK_STAGES 3
#define SK_THREADS 256
#define SK_TILE_X (SK_BM * SK_BK)  // bf16 of a stage's x tile
#define SK_TILE_W (SK_BN * SK_BK)
#define SK_SHARED (SK_STAGES * (SK_TILE_X + SK_TILE_W) * 2)

// Copies of one thread: rows SK_ROW0 + 32 u (u < 4) of a 128-row tile, at one chunk.
#define SK_COPIES 4

__device__ __forceinline__ void sk_ldmatrix4(unsigned* d, unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(address));
}

// A thread's share of copying one k tile of a 128-row operand (rows row0.. of src, row
// stride K) into a stage: SK_COPIES 16-byte chunks, at fixed places, the source moving by
// SK_BK elements a tile.
struct SkCopies {
    const bf16* src[SK_COPIES];
    unsigned dst[SK_COPIES];  // byte offsets in the tile
    bool inside[SK_COPIES];
    int col;                  // the chunk's first column in the tile

    __device__ __forceinline__ void init(const bf16* base, int row0, int limit, int K) {
        const int r = threadIdx.x >> 3, c = threadIdx.x & 7;
        col = c * 8;
#pragma unroll
        for (int u = 0; u < SK_COPIES; ++u) {
            const int row = r + 32 * u;
            inside[u] = row0 + row < limit;
            src[u] = inside[u] ? base + (long long)(row0 + row) * K + col : base;
            // Chunk c of row `row` sits at c ^ (row & 7); 32 u keeps row & 7.
            dst[u] = row * 128 + ((c ^ (r & 7)) << 4);
        }
    }

    __device__ __forceinline__ void start(unsigned tile, int kt, int K) {
        const int k = kt * SK_BK;
        const bool in_k = k + col < K;
#pragma unroll
        for (int u = 0; u < SK_COPIES; ++u) {
            const bool copy = inside[u] && in_k;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tile + dst[u]),
                         "l"(copy ? src[u] + k : src[u]), "r"(copy ? 16 : 0));
        }
    }
};

extern "C" __global__ void __launch_bounds__(SK_THREADS)
    skinny_gemm(float* yf, bf16* yb, const bf16* x, const bf16* w, int n, int N, int K,
                int k_tiles_per_split, int accumulate) {
    extern __shared__ uint4 sk_shared[];
    const unsigned base = shared_address(sk_shared);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Warp (wm, wn) multiplies rows 32 wm .. + 31 by the block's columns 64 wn .. + 63.
    const int wm = warp & 3, wn = warp >> 2;
    const int col0 = blockIdx.x * SK_BN;
    const int k_tiles = (K + SK_BK - 1) / SK_BK;
    const int kt0 = blockIdx.y * k_tiles_per_split;
    const int count = max(0, min(k_tiles_per_split, k_tiles - kt0));
    const bool active = wm * 32 < n;  // the same for the whole warp

    float acc[2][8][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;

    SkCopies xc, wc;
    xc.init(x, 0, n, K);
    wc.init(w, col0, N, K);
    constexpr unsigned STAGE = (SK_TILE_X + SK_TILE_W) * 2;
    auto load = [&](int i) {
        if (i < count) {
            const unsigned stage = base + (i % SK_STAGES) * STAGE;
            xc.start(stage, kt0 + i, K);
            wc.start(stage + SK_TILE_X * 2, kt0 + i, K);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
#pragma unroll
    for (int i = 0; i < SK_STAGES - 1; ++i) load(i);

    // ldmatrix.x4: lane l gives the address of row l & 7 of matrix l >> 3. For x: rows 0-7 /
    // 8-15 (q & 1) at chunks 2 k16 / 2 k16 + 1 (q >> 1); for W: columns 16 j.. / 16 j + 8..
    // (q >> 1) at chunks 2 k16 / + 1 (q & 1). Every row read has row & 7 = i8.
    const int q = lane >> 3, i8 = lane & 7;
    unsigned a_row[2], b_row[4];
#pragma unroll
    for (int m = 0; m < 2; ++m) a_row[m] = (wm * 32 + m * 16 + (q & 1) * 8 + i8) * 128;
#pragma unroll
    for (int j = 0; j < 4; ++j) b_row[j] = (wn * 64 + j * 16 + (q >> 1) * 8 + i8) * 128;
    const int a_half = q >> 1, b_half = q & 1;

    for (int i = 0; i < count; ++i) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(SK_STAGES - 2));
        __syncthreads();  // tile i is in, and every warp is done with tile i - 1's stage
        load(i + SK_STAGES - 1);
        if (!active) continue;
        const unsigned xs = base + (i % SK_STAGES) * STAGE;
        const unsigned ws = xs + SK_TILE_X * 2;
        // The next slice's fragments are read while this slice's products run.
        unsigned a[2][2][4], b[2][4][4];
#pragma unroll
        for (int k16 = 0; k16 <= SK_BK / 16; ++k16) {
            if (k16 < SK_BK / 16) {
                const unsigned ca = ((2 * k16 + a_half) ^ i8) << 4;
                const unsigned cb = ((2 * k16 + b_half) ^ i8) << 4;
#pragma unroll
                for (int m = 0; m < 2; ++m) sk_ldmatrix4(a[k16 & 1][m], xs + a_row[m] + ca);
#pragma unroll
                for (int j = 0; j < 4; ++j) sk_ldmatrix4(b[k16 & 1][j], ws + b_row[j] + cb);
            }
            if (k16 == 0) continue;
            const int now = (k16 - 1) & 1;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    mma_bf16(acc[m][2 * j], a[now][m], b[now][j][0], b[now][j][1]);
                    mma_bf16(acc[m][2 * j + 1], a[now][m], b[now][j][2], b[now][j][3]);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    if (!active) return;

    // C fragment: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
    const int g = lane >> 2, t = lane & 3;
    float* out_f = yf ? yf + (long long)blockIdx.y * n * N : nullptr;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = wm * 32 + m * 16 + g + half * 8;
            if (row >= n) continue;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int col = col0 + wn * 64 + j * 8 + 2 * t;
                if (col >= N) continue;
                const float v0 = acc[m][j][2 * half], v1 = acc[m][j][2 * half + 1];
                const long long at = (long long)row * N + col;
                if (out_f) {
                    *(float2*)(out_f + at) = make_float2(v0, v1);
                } else {
                    unsigned* o = (unsigned*)(yb + at);
                    float a0 = v0, a1 = v1;
                    if (accumulate) {
                        const unsigned old = *o;
                        a0 += bf_lo(old);
                        a1 += bf_hi(old);
                    }
                    *o = pack2(a0, a1);
                }
            }
        }
    }
}

extern "C" __global__ void split_sum(bf16* y, const float* part, int splits, long long count,
                                     int accumulate) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        float s = accumulate ? bf2f(y[i]) : 0.0f;
        float sum = 0.0f;
        for (int k = 0; k < splits; ++k) sum += part[k * count + i];
        y[i] = f2bf(s + sum);
    }
}

// 8 values a thread a pass; c a multiple of 8, rows 16-byte aligned (checked by the wrapper).
extern "C" __global__ void split_sum_rmsnorm(bf16* x, bf16* ln, const float* part, const bf16* w,
                                             int splits, int c, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const long long count = (long long)gridDim.x * c;
    uint4* xr = (uint4*)(x + row * c);
    float f[8], ss = 0.0f;
    for (int v = threadIdx.x; v < c / 8; v += blockDim.x) {
        float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < splits; ++k) {
            const float4* p = (const float4*)(part + k * count + row * c + v * 8);
            const float4 lo = p[0], hi = p[1];
            sum[0] += lo.x; sum[1] += lo.y; sum[2] += lo.z; sum[3] += lo.w;
            sum[4] += hi.x; sum[5] += hi.y; sum[6] += hi.z; sum[7] += hi.w;
        }
        unpack8(xr[v], f);
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] += sum[i];
        const uint4 rounded = pack8(f);
        xr[v] = rounded;
        unpack8(rounded, f);
#pragma unroll
        for (int i = 0; i < 8; i++) ss += f[i] * f[i];
    }
    ss = block_sum(ss, scratch);  // ends synchronised: every thread's x words are written
    const float r = rsqrtf(ss / (float)c + eps);
    float gw[8];
    for (int v = threadIdx.x; v < c / 8; v += blockDim.x) {
        unpack8(xr[v], f);
        unpack8(((const uint4*)w)[v], gw);
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] = f[i] * r * gw[i];
        ((uint4*)(ln + row * c))[v] = pack8(f);
    }
}
