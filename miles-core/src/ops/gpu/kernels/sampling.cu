// Sampling on the device: one block of SAMPLE_THREADS threads per draw, reading one row of
// fp32 logits. The rule is the host sampler's (miles-infer's `sample_token`):
//   - greedy (temperature 0): the most likely token, ties to the lowest id;
//   - else p_i = exp((x_i - max) / T); kept are the tokens at least as likely as the top_k-th
//     (top_k 0: all), then the most likely of those whose mass reaches top_p of theirs (ties at
//     either cut stay in); the draw walks the kept tokens in id order to u * (kept mass);
//   - u is 53 bits of SplitMix64 over (seed, prompt, sample, token index), the host's
//     `draw_uniform`;
//   - the log-prob is of the temperature-scaled distribution before the cuts.
// The cuts are found by bisection over an order-preserving 32-bit key of the logits (32 block
// reductions each), so nothing is sorted and nothing of the row is written.
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

// Larger floats get larger keys (NaN aside).
__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ double block_sum_double(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
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

// The largest key with at least `want` tokens at or above it, searched in [lo, hi].
__device__ unsigned int top_k_key(const float* x, int vocab, unsigned int lo, unsigned int hi,
                                  unsigned int want, unsigned int* scratch) {
    while (lo < hi) {
        const unsigned int mid = lo + (unsigned int)(((unsigned long long)hi - lo + 1) / 2);
        unsigned int count = 0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) count += order_key(x[i]) >= mid;
        if (block_sum_uint(count, scratch) >= want) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Mass of the tokens whose key is at least `key`.
__device__ double mass_from(const float* x, int vocab, float m, float t, unsigned int key,
                            double* scratch) {
    double mass = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        if (order_key(v) >= key) mass += (double)expf((v - m) / t);
    }
    return block_sum_double(mass, scratch);
}

extern "C" __global__ void sample_rows(unsigned int* tokens, float* logprobs, const float* logits,
                                       const unsigned int* draws, const unsigned int* rule,
                                       int vocab) {
    const float temperature = __uint_as_float(rule[0]), top_p = __uint_as_float(rule[1]);
    const int top_k = (int)rule[2];
    const unsigned long long seed = (unsigned long long)rule[3] | ((unsigned long long)rule[4] << 32);
    __shared__ double dscratch[32];
    __shared__ unsigned int uscratch[32];
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    __shared__ double prefix[SAMPLE_THREADS];
    __shared__ int chosen, fallback;
    const unsigned int* d = draws + 4 * (long long)blockIdx.x;
    const float* x = logits + (long long)d[0] * vocab;
    const float t = temperature > 0.0f ? temperature : 1.0f;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

    // The maximum and its lowest index.
    float best = NEG_INF;
    int index = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        if (v > best) { best = v; index = i; }
    }
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
    const float m = best;

    double sum = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += (double)expf((x[i] - m) / t);
    sum = block_sum_double(sum, dscratch);

    int pick = index;
    if (temperature > 0.0f) {
        unsigned int key = 0;
        const unsigned int top = order_key(m);
        if (top_k > 0 && top_k < vocab) key = top_k_key(x, vocab, 0, top, (unsigned int)top_k, uscratch);
        if (top_p < 1.0f) {
            const double target = (double)top_p * mass_from(x, vocab, m, t, key, dscratch);
            unsigned int lo = key, hi = top;
            while (lo < hi) {
                const unsigned int mid = lo + (unsigned int)(((unsigned long long)hi - lo + 1) / 2);
                if (mass_from(x, vocab, m, t, mid, dscratch) >= target) lo = mid; else hi = mid - 1;
            }
            key = lo;
        }
        // Each thread owns a run of ids; a scan of the runs' kept mass finds the run holding
        // u * total, and its thread walks it.
        const int run = (vocab + blockDim.x - 1) / blockDim.x;
        const int begin = min(vocab, (int)threadIdx.x * run), end = min(vocab, begin + run);
        double own = 0.0;
        int last = -1;
        for (int i = begin; i < end; ++i) {
            const float v = x[i];
            if (order_key(v) >= key) { own += (double)expf((v - m) / t); last = i; }
        }
        prefix[threadIdx.x] = own;
        __syncthreads();
        for (int o = 1; o < (int)blockDim.x; o <<= 1) {
            const double add = (int)threadIdx.x >= o ? prefix[threadIdx.x - o] : 0.0;
            __syncthreads();
            prefix[threadIdx.x] += add;
            __syncthreads();
        }
        const double before = threadIdx.x > 0 ? prefix[threadIdx.x - 1] : 0.0;
        const double through = prefix[threadIdx.x];
        const double target = sample_uniform(seed, d) * prefix[blockDim.x - 1];
        if (last >= 0) atomicMax(&fallback, last);
        if (last >= 0 && before <= target && target < through) {
            double acc = before;
            int found = last;
            for (int i = begin; i < end; ++i) {
                const float v = x[i];
                if (order_key(v) < key) continue;
                acc += (double)expf((v - m) / t);
                if (target < acc) { found = i; break; }
            }
            atomicMin(&chosen, found);
        }
        __syncthreads();
        pick = chosen != 0x7fffffff ? chosen : fallback;
    }
    if (threadIdx.x == 0) {
        tokens[blockIdx.x] = (unsigned int)pick;
        logprobs[blockIdx.x] = (float)((double)((x[pick] - m) / t) - log(sum));
    }
}
