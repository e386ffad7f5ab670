// Paged KV cache kernels of the rollout engine: store new tokens' keys and values through a
// block table, and attend over a sequence's cached positions read through it.
//
// Cache layout (bf16): (blocks, L, 2, P, K*D). A block holds P positions of every layer's keys
// (half 0) and values (half 1); position t of a sequence lives in block table[t / P] at slot
// t % P. A block is contiguous, so copy-on-write of a shared block is one copy; it is the
// layout of the engine's CPU cache, in bf16.
//
// A step's tokens come as index arrays built on the host: slots[i] = block * P + t % P of token
// i's position t, seq_rows[i] = the row of `tables` (S, max_blocks) holding its sequence's
// blocks, positions[i] = t.
//
// paged_kv_write(bf16* cache, const bf16* k, const bf16* v, const unsigned* slots,
//                long long n, int layer, int layers, int block_size, int kv_dim,
//                long long num_blocks)                           grid-stride over n * kv_dim
// paged_attention(bf16* out, const bf16* q, const bf16* cache, const unsigned* tables,
//                 const unsigned* seq_rows, const unsigned* positions, long long n, int heads,
//                 int kv_heads, int d, int layer, int layers, int block_size, int max_blocks,
//                 float scale)                       one warp per (token, head), 4 warps a block

// Largest head dim the attention kernel takes: each lane keeps d / 32 outputs in registers.
#define PAGED_MAX_D 128
#define PAGED_WARPS 4

// The first element of `layer`'s keys (half 0) or values (half 1) at `slot` of `block`.
__device__ __forceinline__ long long paged_offset(long long block, int layer, int layers, int half,
                                                  int slot, int block_size, int kv_dim) {
    return ((block * layers + layer) * 2 + half) * (long long)block_size * kv_dim +
           (long long)slot * kv_dim;
}

// cache[slot of token i] = k[i], v[i] (rows of kv_dim) for `layer`. A slot outside the cache
// (a bookkeeping bug) is skipped rather than written over another tensor.
extern "C" __global__ void paged_kv_write(bf16* cache, const bf16* k, const bf16* v,
                                          const unsigned int* slots, long long n, int layer,
                                          int layers, int block_size, int kv_dim,
                                          long long num_blocks) {
    const long long total = n * kv_dim;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long token = i / kv_dim;
        const int j = (int)(i % kv_dim);
        const long long slot = slots[token];
        const long long block = slot / block_size;
        if (block >= num_blocks) continue;
        const int within = (int)(slot % block_size);
        cache[paged_offset(block, layer, layers, 0, within, block_size, kv_dim) + j] = k[i];
        cache[paged_offset(block, layer, layers, 1, within, block_size, kv_dim) + j] = v[i];
    }
}

// out[token, h] = softmax(q[token, h] . K[0..=p] * scale) V[0..=p] over the positions of the
// token's sequence up to its own position p, with K, V of kv head h / (heads / kv_heads) read
// through the block table. Online softmax in fp32 over tiles of 32 positions: lane j scores
// position u0 + j, then every lane accumulates its channels (lane, lane + 32, ...) of the
// tile's values. Nothing of size T x T is stored. Each warp touches only its own row of the
// shared query array, so warps never wait for each other.
extern "C" __global__ void paged_attention(bf16* out, const bf16* q, const bf16* cache,
                                           const unsigned int* tables,
                                           const unsigned int* seq_rows,
                                           const unsigned int* positions, long long n, int heads,
                                           int kv_heads, int d, int layer, int layers,
                                           int block_size, int max_blocks, float scale) {
    __shared__ float qs[PAGED_WARPS][PAGED_MAX_D];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long item = (long long)blockIdx.x * PAGED_WARPS + warp;
    if (item >= n * heads) return;  // the whole warp leaves together
    const long long token = item / heads;
    const int h = (int)(item % heads);
    const int kvh = h / (heads / kv_heads);
    const int kv_dim = kv_heads * d;
    const int pos = (int)positions[token];
    const unsigned int* table = tables + (long long)seq_rows[token] * max_blocks;
    const bf16* qh = q + item * d;
    for (int c = lane; c < d; c += 32) qs[warp][c] = bf2f(qh[c]) * scale;
    __syncwarp();

    float m = NEG_INF, l = 0.0f;
    float acc[PAGED_MAX_D / 32];
#pragma unroll
    for (int i = 0; i < PAGED_MAX_D / 32; ++i) acc[i] = 0.0f;

    for (int u0 = 0; u0 <= pos; u0 += 32) {
        const int u = u0 + lane;
        float s = NEG_INF;
        if (u <= pos) {
            const bf16* krow = cache +
                               paged_offset(table[u / block_size], layer, layers, 0,
                                            u % block_size, block_size, kv_dim) +
                               (long long)kvh * d;
            float dot = 0.0f;
            for (int c = 0; c < d; ++c) dot += qs[warp][c] * bf2f(krow[c]);
            s = dot;
        }
        // Lane 0's position u0 <= pos is always scored, so m_new is finite.
        const float m_new = fmaxf(m, warp_max(s));
        const float correction = expf(m - m_new);  // 0 on the first tile (m = -inf)
        const float p = u <= pos ? expf(s - m_new) : 0.0f;
        l = l * correction + warp_sum(p);
#pragma unroll
        for (int i = 0; i < PAGED_MAX_D / 32; ++i) acc[i] *= correction;
        const int count = min(32, pos - u0 + 1);
        for (int j = 0; j < count; ++j) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const int uj = u0 + j;
            const bf16* vrow = cache +
                               paged_offset(table[uj / block_size], layer, layers, 1,
                                            uj % block_size, block_size, kv_dim) +
                               (long long)kvh * d;
#pragma unroll
            for (int i = 0; i < PAGED_MAX_D / 32; ++i) {
                const int c = lane + 32 * i;
                if (c < d) acc[i] += pj * bf2f(vrow[c]);
            }
        }
        m = m_new;
    }

    bf16* o = out + item * d;
    const float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < PAGED_MAX_D / 32; ++i) {
        const int c = lane + 32 * i;
        if (c < d) o[c] = f2bf(acc[i] * inv);
    }
}
