// Paged KV cache kernels of the rollout engine: prepare a layer's queries and store its new
// keys and values through a block table, and attend over a sequence's cached positions read
// through it.
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
// qkv_rotary_cache(bf16* q_out, bf16* cache, const bf16* qkv, const bf16* bias,
//                  const bf16* q_norm, const bf16* k_norm, const unsigned* positions,
//                  const float* cos_t, const float* sin_t, const unsigned* slots, long long n,
//                  int heads, int kv_heads, int d, float eps, int layer, int layers,
//                  int block_size, long long num_blocks)
//                                      one warp per (token, q or kv head), 4 warps a block
// paged_attention(bf16* out, const bf16* q, const bf16* cache, const unsigned* tables,
//                 const unsigned* seq_rows, const unsigned* positions, long long n, int heads,
//                 int kv_heads, int d, int layer, int layers, int block_size, int max_blocks,
//                 float scale)
//                 one block of 4 warps per (token, kv head, up to 8 of its query heads),
//                 dynamic shared memory of 4 * (64 * (d + 4) + 8 * (d + 64)) bytes

// Largest head dim the attention kernel takes: each lane keeps d / 32 outputs in registers.
#define PAGED_MAX_D 128
#define PAGED_WARPS 4
// Query heads one attention block serves.
#define PAGED_HEADS 8

// The first element of `layer`'s keys (half 0) or values (half 1) at `slot` of `block`.
__device__ __forceinline__ long long paged_offset(long long block, int layer, int layers, int half,
                                                  int slot, int block_size, int kv_dim) {
    return ((block * layers + layer) * 2 + half) * (long long)block_size * kv_dim +
           (long long)slot * kv_dim;
}

// out[token, h] = softmax(q[token, h] . K[0..=p] * scale) V[0..=p] over the positions of the
// token's sequence up to its own position p, with K, V of kv head h / (heads / kv_heads) read
// through the block table. Nothing of size T x T is stored. d is a multiple of 8.
//
// One block serves a token, a kv head and up to PAGED_HEADS of the query heads sharing it, so
// each key and value row is read once for all of them. The block walks the positions in tiles
// of PAGED_TILE: its threads start copying every 16-byte chunk of the tile's key and value rows
// into shared memory at once (cp.async; rows past the sequence are zeros), so a tile costs one
// trip to memory, then each warp takes its own heads (warp,
// warp + PAGED_WARPS): lane j scores positions j and j + 32 of the tile, and every lane adds
// its channel pairs (2 lane, 2 lane + 1, then 64 further) of the value rows, with an online
// softmax in fp32 per head. Shared memory is read 16 bytes at a time where it can be: the key
// rows are padded to d/2 + 4 words, so 8 lanes reading 16 bytes of 8 different rows fall in
// different banks. Dynamic shared memory: the key rows, the value rows, the queries and the
// tile's probabilities, 4 * (PAGED_TILE * (d + 4) + PAGED_HEADS * (d + PAGED_TILE)) bytes.
#define PAGED_TILE 64
#define PAGED_OWN (PAGED_HEADS / PAGED_WARPS)  // heads a warp owns at most
#define PAGED_PAIRS (PAGED_MAX_D / 64)         // channel pairs a lane owns at most


// Starts copying 16 bytes from global `src` to shared `dst` (cp.async), or zeros where not
// `inside` (then nothing is read, though `src` must still be a valid address).
__device__ __forceinline__ void paged_copy16(void* dst, const bf16* src, bool inside) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
                 "l"(src), "r"(inside ? 16 : 0));
}

extern "C" __global__ void paged_attention(bf16* out, const bf16* q, const bf16* cache,
                                           const unsigned int* tables,
                                           const unsigned int* seq_rows,
                                           const unsigned int* positions, long long n, int heads,
                                           int kv_heads, int d, int layer, int layers,
                                           int block_size, int max_blocks, float scale) {
    extern __shared__ uint4 shared4[];
    const int pairs = d / 2, stride = pairs + 4;
    unsigned int* ks = (unsigned int*)shared4;             // [PAGED_TILE][stride]
    unsigned int* vs = ks + PAGED_TILE * stride;           // [PAGED_TILE][pairs]
    float* qs = (float*)(vs + PAGED_TILE * pairs);         // [PAGED_HEADS][d]
    float* ps = qs + PAGED_HEADS * d;                      // [PAGED_HEADS][PAGED_TILE]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = heads / kv_heads;
    const int chunks = (group + PAGED_HEADS - 1) / PAGED_HEADS;
    const int chunk = (int)(blockIdx.x % chunks);
    const int kvh = (int)((blockIdx.x / chunks) % kv_heads);
    const long long token = (long long)blockIdx.x / chunks / kv_heads;
    const int h0 = kvh * group + chunk * PAGED_HEADS;
    const int hn = min(PAGED_HEADS, group - chunk * PAGED_HEADS);
    const int kv_dim = kv_heads * d;
    const long long half_stride = (long long)block_size * kv_dim;  // keys to values
    const int pos = (int)positions[token];
    const unsigned int* table = tables + (long long)seq_rows[token] * max_blocks;
    for (int i = threadIdx.x; i < hn * d; i += blockDim.x) {
        qs[i] = bf2f(q[(token * heads + h0) * d + i]) * scale;
    }

    float m[PAGED_OWN], l[PAGED_OWN], acc[PAGED_OWN][PAGED_PAIRS][2];
#pragma unroll
    for (int k = 0; k < PAGED_OWN; ++k) {
        m[k] = NEG_INF;
        l[k] = 0.0f;
#pragma unroll
        for (int i = 0; i < PAGED_PAIRS; ++i) acc[k][i][0] = acc[k][i][1] = 0.0f;
    }

    const int row_chunks = d / 8;  // 16-byte chunks of a key or value row
    for (int u0 = 0; u0 <= pos; u0 += PAGED_TILE) {
        const int rows = min(PAGED_TILE, pos - u0 + 1);
        __syncthreads();  // the last tile's readers are done (and the queries are in)
        // Every chunk of the tile's key and value rows is copied at once (cp.async), rows past
        // the sequence as zeros, so the tile costs one trip to memory.
        for (int i = threadIdx.x; i < PAGED_TILE * row_chunks; i += blockDim.x) {
            const int r = i / row_chunks, c = i - r * row_chunks;
            const bool inside = r < rows;
            const long long at =
                inside ? paged_offset(table[(u0 + r) / block_size], layer, layers, 0,
                                      (u0 + r) % block_size, block_size, kv_dim) +
                             (long long)kvh * d + c * 8
                       : 0;
            paged_copy16(ks + r * stride + c * 4, cache + at, inside);
            paged_copy16(vs + r * pairs + c * 4, cache + at + half_stride, inside);
        }
        commit_tiles();
        wait_tiles(0);
        __syncthreads();
        const int rows4 = (rows + 3) & ~3;  // rows past the sequence: p 0 and values 0
#pragma unroll
        for (int k = 0; k < PAGED_OWN; ++k) {
            const int g = warp + PAGED_WARPS * k;
            if (g >= hn) continue;  // the same for the whole warp
            const float4* q4 = (const float4*)(qs + g * d);
            float s[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int j = lane + 32 * half;
                float dot = NEG_INF;
                if (j < rows) {
                    const uint4* key = (const uint4*)(ks + j * stride);
                    dot = 0.0f;
                    for (int w4 = 0; w4 < pairs / 4; ++w4) {
                        const uint4 kk = key[w4];
                        const float4 qa = q4[2 * w4], qb = q4[2 * w4 + 1];
                        dot += qa.x * bf_lo(kk.x) + qa.y * bf_hi(kk.x) + qa.z * bf_lo(kk.y) +
                               qa.w * bf_hi(kk.y) + qb.x * bf_lo(kk.z) + qb.y * bf_hi(kk.z) +
                               qb.z * bf_lo(kk.w) + qb.w * bf_hi(kk.w);
                    }
                }
                s[half] = dot;
            }
            // Position u0 (lane 0's first) is always scored, so m_new is finite.
            const float m_new = fmaxf(m[k], warp_max(fmaxf(s[0], s[1])));
            const float correction = expf(m[k] - m_new);  // 0 on the first tile
            const float p0 = lane < rows ? expf(s[0] - m_new) : 0.0f;
            const float p1 = lane + 32 < rows ? expf(s[1] - m_new) : 0.0f;
            l[k] = l[k] * correction + warp_sum(p0 + p1);
            m[k] = m_new;
            float* pg = ps + g * PAGED_TILE;
            pg[lane] = p0;
            pg[lane + 32] = p1;
            __syncwarp();
            const float4* p4 = (const float4*)pg;
#pragma unroll
            for (int i = 0; i < PAGED_PAIRS; ++i) {
                const int w = lane + 32 * i;
                if (w >= pairs) continue;
                float a0 = acc[k][i][0] * correction, a1 = acc[k][i][1] * correction;
                for (int j = 0; j < rows4; j += 4) {
                    const float4 pj = p4[j / 4];
                    const unsigned int v0 = vs[j * pairs + w], v1 = vs[(j + 1) * pairs + w];
                    const unsigned int v2 = vs[(j + 2) * pairs + w], v3 = vs[(j + 3) * pairs + w];
                    a0 += pj.x * bf_lo(v0) + pj.y * bf_lo(v1) + pj.z * bf_lo(v2) + pj.w * bf_lo(v3);
                    a1 += pj.x * bf_hi(v0) + pj.y * bf_hi(v1) + pj.z * bf_hi(v2) + pj.w * bf_hi(v3);
                }
                acc[k][i][0] = a0;
                acc[k][i][1] = a1;
            }
            __syncwarp();
        }
    }

#pragma unroll
    for (int k = 0; k < PAGED_OWN; ++k) {
        const int g = warp + PAGED_WARPS * k;
        if (g >= hn) continue;
        const float inv = 1.0f / l[k];
        unsigned int* o = (unsigned int*)(out + (token * heads + h0 + g) * d);
#pragma unroll
        for (int i = 0; i < PAGED_PAIRS; ++i) {
            const int w = lane + 32 * i;
            if (w < pairs) {
                o[w] = (unsigned int)f2bf(acc[k][i][0] * inv) |
                       ((unsigned int)f2bf(acc[k][i][1] * inv) << 16);
            }
        }
    }
}

// The q, k and v heads of `layer` from the fused product qkv (n, (heads + 2 kv_heads) d), a row
// holding the q heads, then the k heads, then the v heads: adds the biases (bias, of one row's
// width, or null), normalises each q and k head by its RMS times q_norm / k_norm (d each, or
// null), turns q and k by the token's position (rotate-half, as rope_forward, with cos/sin
// tables (max_pos, d/2)), and writes q into q_out (n, heads d) and k, v into the cache at the
// token's slot (a slot past the cache is skipped, as in paged_kv_write). Every step rounds to
// bf16 where the separate kernels do. One warp per (token, head) over heads + kv_heads heads: a
// kv head's warp does its key and its value.
extern "C" __global__ void qkv_rotary_cache(bf16* q_out, bf16* cache, const bf16* qkv,
                                            const bf16* bias, const bf16* q_norm,
                                            const bf16* k_norm, const unsigned int* positions,
                                            const float* cos_t, const float* sin_t,
                                            const unsigned int* slots, long long n, int heads,
                                            int kv_heads, int d, float eps, int layer, int layers,
                                            int block_size, long long num_blocks) {
    __shared__ float row[PAGED_WARPS][PAGED_MAX_D];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long item = (long long)blockIdx.x * PAGED_WARPS + warp;
    if (item >= n * (heads + kv_heads)) return;  // the whole warp leaves together
    const long long token = item / (heads + kv_heads);
    const int h = (int)(item % (heads + kv_heads));
    const bool is_q = h < heads;
    const int kvh = h - heads, kv_dim = kv_heads * d, half = d / 2;
    const long long width = (long long)(heads + 2 * kv_heads) * d;
    const int first = is_q ? h * d : heads * d + kvh * d;  // the head's column in a row
    const bf16* src = qkv + token * width + first;
    const bf16* norm = is_q ? q_norm : k_norm;
    float ss = 0.0f;
    for (int c = lane; c < d; c += 32) {
        float x = bf2f(src[c]);
        if (bias) x = bf2f(f2bf(x + bf2f(bias[first + c])));
        row[warp][c] = x;
        ss += x * x;
    }
    if (norm) {
        const float r = rsqrtf(warp_sum(ss) / (float)d + eps);
        for (int c = lane; c < d; c += 32) row[warp][c] = bf2f(f2bf(row[warp][c] * r * bf2f(norm[c])));
    }
    __syncwarp();
    const long long pos = positions[token];
    const long long slot = slots[token];
    const long long block = slot / block_size;
    const int within = (int)(slot % block_size);
    bf16* dst = is_q ? q_out + (token * heads + h) * d
                     : cache + paged_offset(block, layer, layers, 0, within, block_size, kv_dim) +
                           (long long)kvh * d;
    if (!is_q && block >= num_blocks) return;
    for (int p = lane; p < half; p += 32) {
        const float cs = cos_t[pos * half + p], sn = sin_t[pos * half + p];
        const float a = row[warp][p], b = row[warp][p + half];
        dst[p] = f2bf(a * cs - b * sn);
        dst[p + half] = f2bf(b * cs + a * sn);
    }
    if (is_q) return;
    const int vfirst = heads * d + kv_dim + kvh * d;
    const bf16* vsrc = qkv + token * width + vfirst;
    bf16* vdst = cache + paged_offset(block, layer, layers, 1, within, block_size, kv_dim) +
                 (long long)kvh * d;
    for (int c = lane; c < d; c += 32) {
        float x = bf2f(vsrc[c]);
        if (bias) x = bf2f(f2bf(x + bf2f(bias[vfirst + c])));
        vdst[c] = f2bf(x);
    }
}
