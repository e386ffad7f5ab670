// Sampling on the device: one block of SAMPLE_THREADS threads per draw, reading one row of
// fp32 logits. The rule is the host sampler's (miles-infer's `sample_token`):
//   - greedy (temperature 0): the most likely token, ties to the lowest id;
//   - else p_i = exp((x_i - max) / T); kept are the tokens at least as likely as the top_k-th
//     (top_k 0: all), then the most likely of those whose mass reaches top_p of theirs (ties at
//     either cut stay in); the draw walks the kept tokens in id order to u * (kept mass);
//   - u is 53 bits of SplitMix64 over (seed, prompt, sample, token index), the host's
//     `draw_uniform`;
//   - the log-prob is of the temperature-scaled distribution before the cuts (without cuts,
//     the row's mass is the walk's kept mass: one pass less).
// The cuts are found by bisection over an order-preserving 32-bit key of the logits (32 block
// reductions each), so nothing is sorted and nothing of the row is written. The draw's walk
// goes by pieces: each lane sums the kept mass of its own run of consecutive ids, scans over
// the lanes and the warps find the piece holding the target, and its lane walks it alone.
//
// The rule is read from device memory, not passed by value, so that a captured CUDA graph
// replays with the rule and seed of each call: rule = [temperature bits, top_p bits, top_k,
// seed low word, seed high word].
//
// sample_rows(unsigned* tokens, float* logprobs, const float* logits, const unsigned* draws,
//             const unsigned* rule, int vocab)
//     one block per draw; draws is (D, 4): logit row, prompt, sample, token index

#define SAMPLE_THREADS 1024
#define SAMPLE_GOLDEN 0x9e3779b97f4a7c15ull

__device__ __forceinline__ unsigned long long sample_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ double sample_uniform(unsigned long long seed, const unsigned int* d) {
    unsigned long long h = sample_mix(seed + SAMPLE_GOLDEN);
    for (int i = 1; i < 4; ++i) h = sample_mix(h ^ ((unsigned long long)d[i] + SAMPLE_GOLDEN));
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

// exp((x - m) / t), the unnormalised probability of a logit x of a row of maximum m, (x - m) / t
// as the host computes it; a temperature of 1 skips the division (the same bits).
__device__ __forceinline__ double weight_of(float x, float m, float t) {
    return (double)expf(t == 1.0f ? x - m : (x - m) / t);
}

// Larger floats get larger keys (NaN aside), and equal floats equal keys: -0 takes +0's, as the
// host's `>=` keeps both at a cut.
__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int u = x == 0.0f ? 0u : __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ double warp_sum_double(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Lane l gets the sum of lanes 0..=l's values.
__device__ __forceinline__ double warp_scan_double(double v) {
    const int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        const double add = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += add;
    }
    return v;
}

__device__ __forceinline__ double block_sum_double(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum_double(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ unsigned int block_sum_uint(unsigned int v, unsigned int* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0u;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Calls f(i, x[i]) for the ids of [begin, end) that thread `at` of `threads` takes, in
// increasing order: ids 4j to 4j + 3 for j = begin / 4 + at, + threads, ... (16-byte reads)
// where the range allows, else ids begin + at, + threads, ...
template <typename F>
__device__ __forceinline__ void each_logit(const float* x, int begin, int end, int at, int threads,
                                           F f) {
    if (((begin | end) & 3) == 0 && aligned16(x)) {
        for (int j = begin / 4 + at; j < end / 4; j += threads) {
            const float4 v = ((const float4*)x)[j];
            f(4 * j, v.x);
            f(4 * j + 1, v.y);
            f(4 * j + 2, v.z);
            f(4 * j + 3, v.w);
        }
    } else {
        for (int i = begin + at; i < end; i += threads) f(i, x[i]);
    }
}

// each_logit over the whole row, by the block's threads.
template <typename F>
__device__ __forceinline__ void each_logit_of_row(const float* x, int vocab, F f) {
    each_logit(x, 0, vocab, threadIdx.x, blockDim.x, f);
}

// The largest key with at least `want` tokens at or above it, searched in [lo, hi].
__device__ unsigned int top_k_key(const float* x, int vocab, unsigned int lo, unsigned int hi,
                                  unsigned int want, unsigned int* scratch) {
    while (lo < hi) {
        const unsigned int mid = lo + (unsigned int)(((unsigned long long)hi - lo + 1) / 2);
        unsigned int count = 0;
        each_logit_of_row(x, vocab, [&](int, float v) { count += order_key(v) >= mid; });
        if (block_sum_uint(count, scratch) >= want) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Mass of the tokens whose key is at least `key`.
__device__ double mass_from(const float* x, int vocab, float m, float t, unsigned int key,
                            double* scratch) {
    double mass = 0.0;
    each_logit_of_row(x, vocab, [&](int, float v) {
        if (order_key(v) >= key) mass += weight_of(v, m, t);
    });
    return block_sum_double(mass, scratch);
}

extern "C" __global__ void sample_rows(unsigned int* tokens, float* logprobs, const float* logits,
                                       const unsigned int* draws, const unsigned int* rule,
                                       int vocab) {
    grid_begin();
    const float temperature = __uint_as_float(rule[0]), top_p = __uint_as_float(rule[1]);
    const int top_k = (int)rule[2];
    const unsigned long long seed = (unsigned long long)rule[3] | ((unsigned long long)rule[4] << 32);
    __shared__ double dscratch[32];
    __shared__ unsigned int uscratch[32];
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    __shared__ double run_mass[32];
    __shared__ int run_last[32];
    __shared__ int chosen, fallback;
    const unsigned int* d = draws + 4 * (long long)blockIdx.x;
    const float* x = logits + (long long)d[0] * vocab;
    const float t = temperature > 0.0f ? temperature : 1.0f;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

    // The maximum and its lowest index.
    float best = NEG_INF;
    int index = 0x7fffffff;
    each_logit_of_row(x, vocab, [&](int i, float v) {
        if (v > best) { best = v; index = i; }
    });
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, index, o);
        if (ov > best || (ov == best && oi < index)) { best = ov; index = oi; }
    }
    if (lane == 0) { best_value[warp] = best; best_index[warp] = index; }
    if (threadIdx.x == 0) { chosen = 0x7fffffff; fallback = -1; }
    __syncthreads();
    best = lane < warps ? best_value[lane] : NEG_INF;
    index = lane < warps ? best_index[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, index, o);
        if (ov > best || (ov == best && oi < index)) { best = ov; index = oi; }
    }
    // No logit above -inf (all -inf or NaN): id 0, as the host's fold gives.
    if (index == 0x7fffffff) index = 0;
    const float m = best;

    // The row's mass, for the log-prob. A draw without cuts keeps every token, so its walk's
    // kept mass is the row's: no pass of its own then.
    const bool cut_k = top_k > 0 && top_k < vocab, cut_p = top_p < 1.0f, cut = cut_k || cut_p;
    double sum = 0.0;
    if (temperature <= 0.0f || cut) {
        each_logit_of_row(x, vocab, [&](int, float v) { sum += weight_of(v, m, t); });
        sum = block_sum_double(sum, dscratch);
    }

    int pick = index;
    if (temperature > 0.0f) {
        unsigned int key = 0;
        const unsigned int top = order_key(m);
        if (cut_k) key = top_k_key(x, vocab, 0, top, (unsigned int)top_k, uscratch);
        if (cut_p) {
            const double target = (double)top_p * mass_from(x, vocab, m, t, key, dscratch);
            unsigned int lo = key, hi = top;
            while (lo < hi) {
                const unsigned int mid = lo + (unsigned int)(((unsigned long long)hi - lo + 1) / 2);
                if (mass_from(x, vocab, m, t, mid, dscratch) >= target) lo = mid; else hi = mid - 1;
            }
            key = lo;
        }
        // Each warp owns a run of ids (a multiple of 128) and each of its lanes a piece of
        // run / 32 consecutive ids (a multiple of 4, read 16 bytes at a time), whose kept mass
        // it sums in id order. Scans over the lanes, then over the runs, find the piece
        // holding u * total, and its lane walks it.
        const int run = (vocab + warps * 128 - 1) / (warps * 128) * 128, piece = run / 32;
        const int begin = min(vocab, warp * run), end = min(vocab, begin + run);
        const int lo = min(end, begin + lane * piece), hi = min(end, lo + piece);
        double mine = 0.0;
        int last = -1;
        each_logit(x, lo, hi, 0, 1, [&](int i, float v) {
            if (order_key(v) >= key) { mine += weight_of(v, m, t); last = i; }
        });
        // The lanes' inclusive scan: lane l's piece starts at before + ahead of the walk,
        // before being the runs' ahead of this one.
        const double through = warp_scan_double(mine);
        const double up = __shfl_up_sync(0xffffffffu, through, 1);
        const double ahead = lane > 0 ? up : 0.0;
        const double own = __shfl_sync(0xffffffffu, through, 31);
        int run_end = last;
        for (int o = 16; o > 0; o >>= 1) {
            run_end = max(run_end, __shfl_xor_sync(0xffffffffu, run_end, o));
        }
        if (lane == 0) { run_mass[warp] = own; run_last[warp] = run_end; }
        __syncthreads();
        // Every warp scans the runs' masses the same way, so all agree on the total and on the
        // run holding the target.
        const double runs = warp_scan_double(lane < warps ? run_mass[lane] : 0.0);
        const double total = __shfl_sync(0xffffffffu, runs, 31);
        if (!cut) sum = total;
        // Lane w: where run w starts in the walk.
        const double runs_up = __shfl_up_sync(0xffffffffu, runs, 1);
        const double run_start = lane > 0 ? runs_up : 0.0;
        const double before = __shfl_sync(0xffffffffu, run_start, warp);
        const double target = sample_uniform(seed, d) * total;
        if (threadIdx.x == 0) {
            for (int w = 0; w < warps; ++w) fallback = max(fallback, run_last[w]);
        }
        // The run holding the target is the last with a kept id that starts at or before it,
        // and in it the piece: a rounding of the scans that leaves a sliver of mass to a run
        // or piece with no kept id gives the target to the one before, whose walk then ends at
        // its last kept id. None (no kept id, or a NaN mass): the row's last kept id.
        const unsigned runs_from = __ballot_sync(
            0xffffffffu, lane < warps && run_last[lane] >= 0 && run_start <= target);
        const unsigned pieces_from =
            __ballot_sync(0xffffffffu, last >= 0 && before + ahead <= target);
        if (runs_from != 0 && warp == 31 - __clz(runs_from) && lane == 31 - __clz(pieces_from)) {
            int found = last;
            double acc = before + ahead;
            for (int i = lo; i < hi; i++) {
                const float v = x[i];
                if (order_key(v) < key) continue;
                const double p = weight_of(v, m, t);
                if (p > 0.0 && target < acc + p) {
                    found = i;
                    break;
                }
                acc += p;
            }
            chosen = found;
        }
        __syncthreads();
        pick = chosen != 0x7fffffff ? chosen : fallback;
    }
    if (threadIdx.x == 0) {
        tokens[blockIdx.x] = (unsigned int)pick;
        logprobs[blockIdx.x] = (float)((double)((x[pick] - m) / t) - log(sum));
    }
}
