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
// paged_attention_DP(bf16* out, const bf16* q, const bf16* cache, const unsigned* tables,
//                    const unsigned* seq_rows, const unsigned* positions, long long n, int heads,
//                    int kv_heads, int d, int layer, int layers, int block_size,
//                    int max_blocks, float scale_log2)      for DP 16, 32, 64, 128 (d <= DP)
//                 one block of 4 warps per (16 / min(8, H / K) consecutive tokens, kv head, up
//                 to 8 of its query heads), dynamic shared memory of (16 + 2 * 64) * (DP + 8) * 2
//                 bytes
// paged_decode_DP(bf16* out, bf16* cache, const bf16* qkv, const bf16* bias,
//                 const bf16* q_norm, const bf16* k_norm, const float* cos_t, const float* sin_t,
//                 const unsigned* slots, const unsigned* tables, const unsigned* seq_rows,
//                 const unsigned* positions, long long n, int heads, int kv_heads, int d,
//                 float eps, int layer, int layers, int block_size, int max_blocks,
//                 long long num_blocks, float scale_log2)              the two above in one, for
//                 a pass of one token a sequence; one block per (token, kv head, up to 8 of its
//                 query heads), as paged_attention_DP's shared memory

// Largest head dim the kernels take (qkv_rotary_cache keeps a row of it per warp).
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
// through the block table. Nothing of size T x T is stored. d is a multiple of 8, padded with
// zeros to DP (16, 32, 64 or 128: one instance each).
//
// One block serves a kv head, up to PAGED_HEADS of the query heads sharing it (hn) and the
// consecutive tokens whose heads fill the 16 rows of a product (16 / min(PAGED_HEADS, H / K);
// the decode instance one token), so each key and value row is read once for all of them:
// query row r holds token r / hn's head r % hn. The block walks its tokens' sequences one at
// a time (a prefill's neighbouring tokens share one but where a prompt ends), each's positions
// up to its last token's in tiles of PAGED_TILE: its threads start copying every 16-byte chunk
// of the tile's key and value rows into shared memory at once (cp.async; rows past the
// sequence's last token are zeros), the queries with the first tile, so a tile costs one trip
// to memory. The products run on the tensor cores (mma.sync m16n8k16, with the training
// attention's helpers): the query rows are the 16 rows of A (zeros past them), and warp w takes
// positions 16 w .. 16 w + 15 of every tile with its own online softmax (fp32, base 2) and its
// own output, each row masked past its token's position and where the sequence is another's;
// at the end the warps' maxima, sums and outputs are merged through shared memory. The
// probabilities are rounded to bf16 for the second product, as in training. A row's sums are
// those of a block serving its token alone: a masked position adds exact zeros.
//
// Dynamic shared memory (`attention_shared_bytes` in the wrapper): the queries (16 rows), a tile
// of keys and one of values (PAGED_TILE rows each), bf16 rows of DP + 8; once the tiles are
// done, their space (the decode instance's from the keys on, its new key and value kept) holds
// each warp's outputs, maximum and sum of the rows in use (fp32 rows of DP + 8) and the merge's
// weights.
#define PAGED_TILE 64

// Starts copying 16 bytes from global `src` to shared `dst` (cp.async), or zeros where not
// `inside` (then nothing is read, though `src` must still be a valid address).
__device__ __forceinline__ void paged_copy16(void* dst, const void* src, bool inside) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
                 "l"(src), "r"(inside ? 16 : 0));
}


// One head of a fused q/k/v row made ready by one warp in `dst` (d bf16, shared memory): `src`
// (which may be `dst`) plus `bias` (or null) rounded to bf16, normalised by its RMS times `norm`
// (or null) and rounded, then turned by the token's rotary row (cos_p, sin_p: d/2 each,
// rotate-half as rope_forward; null for a value head) and rounded. Every value between the
// steps is a bf16, so `dst` holds them exactly.
__device__ void ready_head(bf16* dst, const bf16* src, const bf16* bias, const bf16* norm,
                           const float* cos_p, const float* sin_p, int d, float eps) {
    const int lane = threadIdx.x & 31;
    float ss = 0.0f;
    for (int c = lane; c < d; c += 32) {
        float x = bf2f(src[c]);
        if (bias) x = bf2f(f2bf(x + bf2f(bias[c])));
        dst[c] = f2bf(x);
        ss += x * x;
    }
    if (norm) {
        const float r = rsqrtf(warp_sum(ss) / (float)d + eps);
        for (int c = lane; c < d; c += 32) dst[c] = f2bf(bf2f(dst[c]) * r * bf2f(norm[c]));
    }
    if (!cos_p) return;
    __syncwarp();  // a lane turns pairs of columns other lanes wrote
    const int half = d / 2;
    for (int p = lane; p < half; p += 32) {
        const float cs = cos_p[p], sn = sin_p[p];
        const float a = bf2f(dst[p]), b = bf2f(dst[p + half]);
        dst[p] = f2bf(a * cs - b * sn);
        dst[p + half] = f2bf(b * cs + a * sn);
    }
}

// What the decode instance reads and writes besides the attention's own arguments: the fused
// q/k/v product and what turns it into the token's queries, key and value (as qkv_rotary_cache),
// and where the key and value go.
struct PagedNew {
    bf16* cache;
    const bf16* qkv;
    const bf16* bias;
    const bf16* q_norm;
    const bf16* k_norm;
    const float* cos_t;
    const float* sin_t;
    const unsigned int* slots;
    float eps;
    long long num_blocks;
};

template <int DP, bool DECODE>
__device__ void paged_attention_tile(bf16* out, const bf16* q, const bf16* cache,
                                     const unsigned int* tables, const unsigned int* seq_rows,
                                     const unsigned int* positions, long long n, int heads,
                                     int kv_heads, int d, int layer, int layers, int block_size,
                                     int max_blocks, float scale_log2, PagedNew fresh) {
    constexpr int SD = DP + 8, KD = DP / 16, MD = DP + 8;
    // Query rows a thread keeps softmax state for (g and g + 8 of its mma pair): the decode
    // instance's at most PAGED_HEADS rows are all first rows. Rows the merge holds.
    constexpr int ROWS = DECODE ? 1 : 2, MERGED = 8 * ROWS;
    static_assert(PAGED_HEADS <= 8, "a decode block's heads sit in the first row of each pair");
    extern __shared__ uint4 shared4[];
    bf16* qs = (bf16*)shared4;                      // [16][SD]
    bf16* ks = qs + 16 * SD;                        // [PAGED_TILE][SD]
    bf16* vs = ks + PAGED_TILE * SD;                // [PAGED_TILE][SD]
    // DECODE only, in query rows no head of the block fills (their outputs are never read,
    // and the products and the softmax keep rows apart): the new key and value, and the
    // position's rotary row (cos, then sin).
    static_assert(PAGED_HEADS <= 12, "rows 12 to 15 of the queries hold the new key and value");
    bf16* kv_new = qs + 14 * SD;            // [2][SD]
    float* rotary = (float*)(qs + 12 * SD);  // [2][DP / 2], within 2 rows of SD bf16
    // Over the tiles once they are done: each warp's outputs, maximum and sum of the rows in
    // use ([PAGED_WARPS][MERGED][MD]), then each row's weights of the warps and total
    // ([MERGED][PAGED_WARPS + 1]).
    float* merge = DECODE ? (float*)ks : (float*)qs;
    // The grid is (runs of per_block tokens, kv heads, chunks of PAGED_HEADS query heads): a
    // decode block finds its place without a division. Index arithmetic is unsigned where it
    // divides by a power of two.
    const unsigned int warp = threadIdx.x >> 5;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const int kvh = (int)blockIdx.y, chunk = (int)blockIdx.z;
    const int group = heads / kv_heads;
    const int h0 = kvh * group + chunk * PAGED_HEADS;
    const int hn = min(PAGED_HEADS, group - chunk * PAGED_HEADS);
    const long long per_block = DECODE ? 1 : 16 / min(PAGED_HEADS, group);
    const long long token = blockIdx.x * per_block;  // the block's first
    const int count = DECODE ? 1 : (int)min(per_block, n - token);  // the block's tokens
    const int rows = count * hn;                                     // query rows in use
    // The sequence the block walks now: its tokens token + [from, to), the last one's
    // position, its block table, and each of the thread's rows' last position there (-1 for a
    // row of another sequence or none; the decode instance's rows are all its token's, at pos).
    int from = 0, to = 0, pos = 0;
    const unsigned int* table = tables;
    int lim[ROWS];
    auto next_sequence = [&]() {
        from = to;
        const unsigned int row = seq_rows[token + from];
        pos = (int)positions[token + from];
        table = tables + (long long)row * max_blocks;
        to = from + 1;
        if constexpr (!DECODE) {
            for (; to < count && seq_rows[token + to] == row; to++)
                pos = max(pos, (int)positions[token + to]);
#pragma unroll
            for (int k = 0; k < ROWS; k++) {
                const int mine = (g + 8 * k) / hn;
                const bool here = g + 8 * k < rows && mine >= from && mine < to;
                lim[k] = here ? (int)positions[token + mine] : -1;
            }
        }
    };
    next_sequence();
    const int kv_dim = kv_heads * d;
    const long long half_stride = (long long)block_size * kv_dim;  // keys to values
    const int row_chunks = d / 8;  // 16-byte chunks of a key or value row holding data
    constexpr unsigned int THREADS = 32 * PAGED_WARPS, CHUNKS = DP / 8;

    // Starts copying tile u0's key and value rows, DP columns each: zeros past d (which the
    // products must read as zeros, not stale bits) and past the sequence. In DECODE the token's
    // own position is left alone: its row comes from the prologue (`put_new`).
    // A thread copies chunk c of rows r0, r0 + THREADS / CHUNKS, ... of every tile: the key's
    // element (block, layer, 0, within) + kvh d + 8 c is `blocks * block + start + within kv_dim`.
    const unsigned int c = threadIdx.x % CHUNKS, r0 = threadIdx.x / CHUNKS;
    const long long blocks = (long long)layers * 2 * half_stride;
    const long long start = (long long)layer * 2 * half_stride + (long long)kvh * d + c * 8;
    auto load = [&](int u0) {
        const int held = min(PAGED_TILE, pos - u0 + 1);
#pragma unroll 1  // unrolled, the copies' table entries outgrow 64 registers at DP 64
        for (unsigned int r = r0; r < PAGED_TILE; r += THREADS / CHUNKS) {
            if (DECODE && u0 + (int)r == pos) continue;
            const bool inside = (int)r < held && (int)c < row_chunks;
            const unsigned int p = u0 + r;
            const long long at =
                inside ? blocks * table[p / block_size] + start +
                             (long long)(p % block_size) * kv_dim
                       : 0;
            paged_copy16(ks + r * SD + c * 8, cache + at, inside);
            paged_copy16(vs + r * SD + c * 8, cache + at + half_stride, inside);
        }
        commit_tiles();
    };
    if constexpr (DECODE) {
        // The prologue: the block's query heads (zero rows past them up to kv_new), the kv
        // head's key and value and the position's rotary row start travelling at once, ahead
        // of the first tile, each row zero past d; once here they are made ready in place (as
        // qkv_rotary_cache makes them).
        const bf16* row = fresh.qkv + token * (long long)(heads + 2 * kv_heads) * d;
#pragma unroll
        for (unsigned int r = r0; r < 12; r += THREADS / CHUNKS) {
            const bool inside = (int)r < hn && (int)c < row_chunks;
            paged_copy16(qs + r * SD + c * 8, row + (inside ? (h0 + r) * d + c * 8 : 0), inside);
        }
        for (unsigned int i = threadIdx.x; i < 2 * CHUNKS; i += THREADS) {
            const unsigned int r = i / CHUNKS, k = i % CHUNKS;  // r: 0 the key, 1 the value
            const bool inside = (int)k < row_chunks;
            paged_copy16(kv_new + r * SD + k * 8,
                         row + (inside ? (heads + r * kv_heads + kvh) * d + k * 8 : 0), inside);
        }
        for (unsigned int i = threadIdx.x; i < 2 * CHUNKS; i += THREADS) {  // 4 floats a copy
            const unsigned int which = i / CHUNKS, k = i % CHUNKS;  // 0 cos, 1 sin
            if ((int)k < row_chunks)
                paged_copy16(rotary + which * (DP / 2) + k * 4,
                             (which ? fresh.sin_t : fresh.cos_t) + (long long)pos * (d / 2) + k * 4,
                             true);
        }
        commit_tiles();
        load(0);
        wait_tiles(1);  // all but the first tile
        __syncthreads();
        for (int r = warp; r < hn + 2; r += PAGED_WARPS) {
            const bool query = r < hn, value = r == hn + 1;
            bf16* dst = query ? qs + r * SD : kv_new + (r - hn) * SD;
            const int first = query ? (h0 + r) * d : (heads + (value ? kv_heads : 0) + kvh) * d;
            ready_head(dst, dst, fresh.bias ? fresh.bias + first : nullptr,
                       value ? nullptr : (query ? fresh.q_norm : fresh.k_norm),
                       value ? nullptr : rotary, rotary + DP / 2, d, fresh.eps);
        }
        __syncthreads();
    } else {
        // The queries go with the first tile: zeros past the rows in use and past d.
#pragma unroll
        for (unsigned int r = r0; r < 16; r += THREADS / CHUNKS) {
            const bool inside = (int)r < rows && (int)c < row_chunks;
            const long long at = (token + r / hn) * heads + h0 + r % hn;
            paged_copy16(qs + r * SD + c * 8, q + (inside ? at * d + c * 8 : 0), inside);
        }
        load(0);
    }

    float o[DP / 8][4] = {};
    // The running maxima and sums of the thread's rows g and g + 8.
    float m[ROWS], l[ROWS];
#pragma unroll
    for (int k = 0; k < ROWS; k++) m[k] = NEG_INF, l[k] = 0.0f;
    bool loaded = true;  // the first sequence's first tile is on its way
    for (;;) {
        for (int u0 = 0; u0 <= pos; u0 += PAGED_TILE) {
            if (!loaded) {
                __syncthreads();  // every warp is done with the last tile
                load(u0);
            }
            loaded = false;
            if (DECODE && pos - u0 < PAGED_TILE) {  // put_new: the token's key and value
                for (unsigned int k = threadIdx.x; k < DP; k += THREADS) {
                    ks[(pos - u0) * SD + k] = kv_new[k];
                    vs[(pos - u0) * SD + k] = kv_new[SD + k];
                }
            }
            wait_tiles(0);
            __syncthreads();
            const int first = u0 + warp * 16;  // this warp's first position of the tile
            if (first > pos) continue;         // the same for the whole warp
            // The query fragments are read again for each tile rather than held: the registers
            // they would take keep 8 blocks on a multiprocessor (`PAGED_BLOCKS_PER_SM`).
            unsigned qa[KD][4];
#pragma unroll
            for (int kk = 0; kk < KD; kk++) a_frag(qa[kk], qs, SD, 0, kk * 16);
            float s[2][4] = {};
            mma_xt<2, KD>(s, qa, ks + warp * 16 * SD, SD);
            // Scores s[n][0..1] are row g's, s[n][2..3] row g + 8's. In the decode instance only
            // row g holds a head: row g + 8's scores are dropped and its probabilities multiplied
            // as zeros, so o[n][2..3] stay zero, never read.
            float mx[ROWS];
#pragma unroll
            for (int k = 0; k < ROWS; k++) mx[k] = NEG_INF;
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int j = 0; j < 2 * ROWS; j++) {
                    const int last = DECODE ? pos : lim[j >> 1];
                    s[n][j] = first + c_col(n, j) <= last ? s[n][j] * scale_log2 : NEG_INF;
                    mx[j >> 1] = fmaxf(mx[j >> 1], s[n][j]);
                }
            float alpha[ROWS];
#pragma unroll
            for (int k = 0; k < ROWS; k++) {
                const float next = fmaxf(m[k], quad_max(mx[k]));
                // A decode block's warp scores its first position, so the new maximum is finite; a
                // row of several tokens' blocks may have nothing scored yet, and stays as it is.
                alpha[k] = DECODE || next != NEG_INF ? exp2f(m[k] - next) : 1.0f;  // 0 at first
                m[k] = next;
                l[k] *= alpha[k];
            }
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int j = 0; j < 2 * ROWS; j++) {
                    const int k = j >> 1;
                    s[n][j] = DECODE || m[k] != NEG_INF ? exp2f(s[n][j] - m[k]) : 0.0f;
                    l[k] += s[n][j];
                }
#pragma unroll
            for (int n = 0; n < DP / 8; n++)
#pragma unroll
                for (int j = 0; j < 2 * ROWS; j++) o[n][j] *= alpha[j >> 1];
            unsigned pa[1][4] = {cvt_pack2(s[0][0], s[0][1]), 0u, cvt_pack2(s[1][0], s[1][1]), 0u};
            if constexpr (ROWS == 2) {
                pa[0][1] = cvt_pack2(s[0][2], s[0][3]);
                pa[0][3] = cvt_pack2(s[1][2], s[1][3]);
            }
            mma_x<DP / 8, 1>(o, pa, vs + warp * 16 * SD, SD);
        }
        if (to == count) break;  // every sequence of the block walked
        next_sequence();
    }

    // Merge the warps. Each writes the outputs of its rows in use, their maximum and sum (a
    // warp that saw no position of a row keeps a maximum of -inf and adds nothing). One thread
    // a row then finds the warps' weights exp2(maximum - the row's) and the row's total once,
    // where every output element did; then each thread takes output elements. The same sums
    // in the same order as element by element, so the same bits.
    float* mine = merge + warp * MERGED * MD;
    float* weights = merge + PAGED_WARPS * MERGED * MD;
    // DECODE: where the new key and value go, asked for now so that the trip overlaps the merge.
    const unsigned int slot = DECODE ? fresh.slots[token] : 0;
    float sum[ROWS];
#pragma unroll
    for (int k = 0; k < ROWS; k++) sum[k] = quad_sum(l[k]);
    __syncthreads();  // every warp is done with the tiles
#pragma unroll
    for (int k = 0; k < ROWS; k++) {
        const int r = g + 8 * k;
        if (r >= rows) continue;
        if (t == 0) {
            mine[r * MD + DP] = m[k];
            mine[r * MD + DP + 1] = sum[k];
        }
#pragma unroll
        for (int n = 0; n < DP / 8; n++)
#pragma unroll
            for (int j = 0; j < 2; j++) mine[r * MD + c_col(n, j)] = o[n][2 * k + j];
    }
    __syncthreads();
    if ((int)threadIdx.x < rows) {
        const unsigned int r = threadIdx.x;
        float top = NEG_INF;
#pragma unroll
        for (int w = 0; w < PAGED_WARPS; w++) top = fmaxf(top, merge[(w * MERGED + r) * MD + DP]);
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < PAGED_WARPS; w++) {
            const float* row = merge + (w * MERGED + r) * MD;
            float f = -1.0f;  // no weight can be negative: the warp adds nothing
            if (row[DP] != NEG_INF) {
                f = exp2f(row[DP] - top);
                total += row[DP + 1] * f;
            }
            weights[r * (PAGED_WARPS + 1) + w] = f;
        }
        weights[r * (PAGED_WARPS + 1) + PAGED_WARPS] = total;
    }
    __syncthreads();
    for (unsigned int i = threadIdx.x; i < rows * DP; i += THREADS) {
        const unsigned int r = i / DP, k = i % DP;
        if ((int)k >= d) continue;
        const float* w_r = weights + r * (PAGED_WARPS + 1);
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < PAGED_WARPS; w++)
            if (w_r[w] >= 0.0f) acc += merge[(w * MERGED + r) * MD + k] * w_r[w];
        const long long at =
            DECODE ? token * heads + h0 + r : (token + r / hn) * heads + h0 + r % hn;
        out[at * d + k] = f2bf(acc / w_r[PAGED_WARPS]);
    }
    if constexpr (DECODE) {
        // Chunk 0 stores the new key and value (kv_new is untouched by the merge) off the
        // attention's path; no block of the pass reads them. A slot past the cache is skipped.
        const unsigned int block = slot / block_size;
        if (chunk == 0 && block < fresh.num_blocks) {
            const long long at =
                paged_offset(block, layer, layers, 0, (int)(slot % block_size), block_size, kv_dim) +
                (long long)kvh * d;
            for (unsigned int i = threadIdx.x; i < 2 * DP; i += THREADS) {
                const unsigned int half = i / DP, k = i % DP;
                if ((int)k < d) fresh.cache[at + half * half_stride + k] = kv_new[half * SD + k];
            }
        }
    }
}

// Blocks a multiprocessor keeps at once for head dims up to 64: with a tile's shared memory
// (about 21 KB at 64) and at most 64 registers a thread, 8 fit, so a decode step's blocks
// (tokens x kv heads) run in one wave where 6 took 1.3 (measured, 1B at batch 128).
#define PAGED_BLOCKS_PER_SM(DP) ((DP) <= 64 ? 8 : 1)

// The prefill instances keep two rows' softmax a thread (several tokens a block): 7 blocks a
// multiprocessor leave them the registers (72 at 64) that 8 would make spill.
#define PAGED_PREFILL_BLOCKS_PER_SM(DP) ((DP) <= 64 ? 7 : 1)

#define PAGED_ATTENTION(DP)                                                                      \
    extern "C" __global__ void                                                                    \
        __launch_bounds__(32 * PAGED_WARPS, PAGED_PREFILL_BLOCKS_PER_SM(DP))                      \
        paged_attention_##DP(bf16* out, const bf16* q, const bf16* cache,                         \
                             const unsigned int* tables, const unsigned int* seq_rows,            \
                             const unsigned int* positions, long long n, int heads, int kv_heads, \
                             int d, int layer, int layers, int block_size, int max_blocks,        \
                             float scale_log2) {                                                  \
        grid_begin();                                                                             \
        paged_attention_tile<DP, false>(out, q, cache, tables, seq_rows, positions, n, heads,     \
                                        kv_heads, d, layer, layers, block_size, max_blocks,       \
                                        scale_log2, PagedNew{});                                  \
    }
PAGED_ATTENTION(16)
PAGED_ATTENTION(32)
PAGED_ATTENTION(64)
PAGED_ATTENTION(128)

// The decode instances: qkv_rotary_cache and paged_attention_DP in one kernel, for a pass of one
// token each of distinct sequences (only then is the one position a block did not read from the
// cache its own token's, which no other block of the pass reads). The bits are those of the two
// kernels where each token's slot is its table's place for its position, inside the cache.
#define PAGED_DECODE(DP)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * PAGED_WARPS, PAGED_BLOCKS_PER_SM(DP))       \
        paged_decode_##DP(bf16* out, bf16* cache, const bf16* qkv, const bf16* bias,              \
                          const bf16* q_norm, const bf16* k_norm, const float* cos_t,             \
                          const float* sin_t, const unsigned int* slots,                          \
                          const unsigned int* tables, const unsigned int* seq_rows,               \
                          const unsigned int* positions, long long n, int heads, int kv_heads,    \
                          int d, float eps, int layer, int layers, int block_size,                \
                          int max_blocks, long long num_blocks, float scale_log2) {               \
        grid_begin();                                                                             \
        grid_release();                                                                           \
        const PagedNew fresh{cache, qkv, bias, q_norm, k_norm, cos_t, sin_t, slots, eps,          \
                             num_blocks};                                                         \
        paged_attention_tile<DP, true>(out, nullptr, cache, tables, seq_rows, positions, n,       \
                                       heads, kv_heads, d, layer, layers, block_size, max_blocks, \
                                       scale_log2, fresh);                                        \
    }
PAGED_DECODE(16)
PAGED_DECODE(32)
PAGED_DECODE(64)
PAGED_DECODE(128)

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
    grid_begin();
    __shared__ bf16 rows[PAGED_WARPS][PAGED_MAX_D];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long item = (long long)blockIdx.x * PAGED_WARPS + warp;
    if (item >= n * (heads + kv_heads)) return;  // the whole warp leaves together
    const long long token = item / (heads + kv_heads);
    const int h = (int)(item % (heads + kv_heads));
    const bool is_q = h < heads;
    const int kvh = h - heads, kv_dim = kv_heads * d;
    const long long width = (long long)(heads + 2 * kv_heads) * d;
    const int first = is_q ? h * d : heads * d + kvh * d;  // the head's column in a row
    const long long pos = positions[token];
    const long long slot = slots[token];
    const long long block = slot / block_size;
    const int within = (int)(slot % block_size);
    if (!is_q && block >= num_blocks) return;
    bf16* row = rows[warp];
    const bf16* src = qkv + token * width;
    ready_head(row, src + first, bias ? bias + first : nullptr, is_q ? q_norm : k_norm,
               cos_t + pos * (d / 2), sin_t + pos * (d / 2), d, eps);
    __syncwarp();
    bf16* dst = is_q ? q_out + (token * heads + h) * d
                     : cache + paged_offset(block, layer, layers, 0, within, block_size, kv_dim) +
                           (long long)kvh * d;
    for (int c = lane; c < d; c += 32) dst[c] = row[c];
    if (is_q) return;
    const int vfirst = heads * d + kv_dim + kvh * d;
    ready_head(row, src + vfirst, bias ? bias + vfirst : nullptr, nullptr, nullptr, nullptr, d,
               eps);
    __syncwarp();
    bf16* vdst = cache + paged_offset(block, layer, layers, 1, within, block_size, kv_dim) +
                 (long long)kvh * d;
    for (int c = lane; c < d; c += 32) vdst[c] = row[c];
}
