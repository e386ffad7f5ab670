// Decode-step products on Hopper's warpgroup MMA (wgmma) with the tensor memory accelerator
// (TMA): y (m <= 128, n) = x (m, k) w (n, k)^T, bf16 in, fp32 accumulate; out either bf16 (m, n)
// or, split along k into `gridDim.y` slices, fp32 partials (slices, m, n) that the kernel after
// sums (residual_rmsnorm), or, where w is gate's rows then up's (2f, k), swiglu's bf16 (m, f):
// silu(g) u of g and u rounded to bf16, as swiglu_rows computes it after a bf16 product.
// A block owns 64 or 128 columns of y (64 of gate and the same 64 of up) and one slice of k:
// warpgroup 0's first thread fetches k tiles of 64 of x (all 128 rows, zeros past m) and of w
// into a ring of stages through TMA (128-byte swizzle); warpgroups 1 and 2 multiply rows 0..63
// and 64..127 of x by the stage's w as each arrives and hand the stage back. The weights of the
// first stages are fetched before the kernel waits for the one ahead of it (no kernel writes
// weights), so where that one lets it start early (paged_decode, swiglu_rows and the SwiGLU
// product itself: grid_release) they arrive while it finishes.

// A TMA descriptor (CUtensorMap): 128 opaque bytes the host encodes, passed by value.
struct __align__(64) TensorMap {
    unsigned long long words[16];
};

// Bytes of shared memory a product block's stages take.
#define PRODUCT_RING_BYTES (192 * 1024)

__device__ __forceinline__ void barrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)),
                 "r"(count));
}

__device__ __forceinline__ void barrier_expect_bytes(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                     shared_address(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void barrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar))
                 : "memory");
}

// Waits for the completion of the barrier's phase of parity `parity`.
__device__ __forceinline__ void barrier_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(shared_address(bar)),
        "r"(parity)
        : "memory");
}

// Fetches the box at (inner, row) of `map` into `dst`, counted on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, unsigned long long* bar,
                                         int inner, int row) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%3, %4}], [%2];" ::"r"(shared_address(dst)),
        "l"((unsigned long long)map), "r"(shared_address(bar)), "r"(inner), "r"(row)
        : "memory");
}

// A wgmma operand descriptor: rows of 64 bf16 (128 bytes, swizzled in 128-byte mode), groups of
// eight rows 1024 bytes apart, starting at `p` (its tile 1024-byte aligned).
__device__ __forceinline__ unsigned long long operand(const void* p) {
    const unsigned long long a = shared_address(p);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

// d (64 x 64 fp32, the accumulator fragment) += a (64 x 16) b (64 x 16)^T, both in shared
// memory, named by their descriptors.
__device__ __forceinline__ void wgmma_n64(float (&d)[32], unsigned long long a,
                                           unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(1));
}

// d (64 x 128 fp32, the accumulator fragment) += a (64 x 16) b (128 x 16)^T, both in shared
// memory, named by their descriptors.
__device__ __forceinline__ void wgmma_n128(float (&d)[64], unsigned long long a,
                                           unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(1));
}

template <int BN>
__device__ __forceinline__ void wgmma_tile(float (&d)[BN / 2], unsigned long long a,
                                           unsigned long long b);
template <>
__device__ __forceinline__ void wgmma_tile<64>(float (&d)[32], unsigned long long a,
                                               unsigned long long b) {
    wgmma_n64(d, a, b);
}
template <>
__device__ __forceinline__ void wgmma_tile<128>(float (&d)[64], unsigned long long a,
                                                unsigned long long b) {
    wgmma_n128(d, a, b);
}

// The product's body (see the top of this file). `k_tiles`: tiles of 64 of k in one slice;
// `out_f32`: write the fp32 partials of slice blockIdx.y, else bf16; `n`: y's columns. With
// SWIGLU (BN 128), w's rows 64 b.. (gate) and n + 64 b.. (up) make block b's tile, its map's box
// 64 rows.
template <int BN, bool SWIGLU>
__device__ __forceinline__ void product_body(const TensorMap* wmap, const TensorMap* xmap,
                                             void* out, int out_f32, int m, int n, int k_tiles) {
    constexpr int X_BYTES = 128 * 64 * 2;
    constexpr int W_BYTES = BN * 64 * 2;
    constexpr int STAGE = X_BYTES + W_BYTES;
    constexpr int STAGES = PRODUCT_RING_BYTES / STAGE;
    extern __shared__ unsigned char shared_raw[];
    unsigned char* ring =
        (unsigned char*)(((unsigned long long)shared_raw + 1023) & ~1023ull);
    unsigned long long* full = (unsigned long long*)(ring + STAGES * STAGE);
    unsigned long long* empty = full + STAGES;
    const int group = threadIdx.x / 128;
    const int n0 = blockIdx.x * (SWIGLU ? 64 : BN);
    const int k0 = blockIdx.y * k_tiles;
    // Tile t of w (all BN rows) into `dst`, counted on `bar`.
    auto fetch_w = [&](unsigned char* dst, unsigned long long* bar, int t) {
        if constexpr (SWIGLU) {
            tma_load(dst, wmap, bar, (k0 + t) * 64, n0);
            tma_load(dst + 64 * 128, wmap, bar, (k0 + t) * 64, n + n0);
        } else {
            tma_load(dst, wmap, bar, (k0 + t) * 64, n0);
        }
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            barrier_init(&full[s], 1);
            barrier_init(&empty[s], 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (group == 0) {
        if (threadIdx.x == 0) {
            // The first stages' weights before the kernel ahead has finished (no kernel writes
            // them), x once it has.
            const int ahead = k_tiles < STAGES ? k_tiles : STAGES;
            for (int t = 0; t < ahead; t++) {
                barrier_expect_bytes(&full[t], STAGE);
                fetch_w(ring + t * STAGE + X_BYTES, &full[t], t);
            }
            grid_begin();
            for (int t = 0; t < ahead; t++) {
                tma_load(ring + t * STAGE, xmap, &full[t], (k0 + t) * 64, 0);
            }
            for (int t = ahead; t < k_tiles; t++) {
                const int s = t % STAGES;
                barrier_wait(&empty[s], ((t / STAGES) - 1) & 1);
                barrier_expect_bytes(&full[s], STAGE);
                tma_load(ring + s * STAGE, xmap, &full[s], (k0 + t) * 64, 0);
                fetch_w(ring + s * STAGE + X_BYTES, &full[s], t);
            }
        }
        return;
    }
    const int half = group - 1;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0.0f;
    for (int t = 0; t < k_tiles; t++) {
        const int s = t % STAGES;
        barrier_wait(&full[s], (t / STAGES) & 1);
        const unsigned char* x = ring + s * STAGE + half * (64 * 128);
        const unsigned char* w = ring + s * STAGE + X_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wgmma_tile<BN>(d, operand(x + kk * 32), operand(w + kk * 32));
        wgmma_commit();
        wgmma_wait_all();
        // Each of the eight multiplying warps hands the stage back once its part is done.
        if (threadIdx.x % 32 == 0) barrier_arrive(&empty[s]);
    }
    // Nothing is written before the kernel ahead has finished.
    grid_begin();
    // The accumulator fragment: warp q of the group holds rows 16q + lane / 4 (and 8 below), at
    // columns 8j + 2 (lane % 4) and the next, of each 8-column block j.
    const int lane = threadIdx.x % 32, q = (threadIdx.x % 128) / 32;
    const int r0 = half * 64 + q * 16 + lane / 4, r1 = r0 + 8;
    if constexpr (SWIGLU) {
        // Gate's column c of the block is accumulator column c, up's c + 64: fragment j + 8.
        unsigned* p = (unsigned*)out;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int col = n0 + j * 8 + (lane % 4) * 2;
            float y[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float g = bf2f(f2bf(d[4 * j + i])), u = bf2f(f2bf(d[4 * (j + 8) + i]));
                y[i] = g / (1.0f + __expf(-g)) * u;
            }
            if (r0 < m) p[((long long)r0 * n + col) / 2] = pack2(y[0], y[1]);
            if (r1 < m) p[((long long)r1 * n + col) / 2] = pack2(y[2], y[3]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            const int col = n0 + j * 8 + (lane % 4) * 2;
            if (out_f32) {
                float* p = (float*)out + (long long)blockIdx.y * m * n;
                if (r0 < m)
                    *(float2*)&p[(long long)r0 * n + col] = make_float2(d[4 * j], d[4 * j + 1]);
                if (r1 < m)
                    *(float2*)&p[(long long)r1 * n + col] =
                        make_float2(d[4 * j + 2], d[4 * j + 3]);
            } else {
                unsigned* p = (unsigned*)out;
                if (r0 < m) p[((long long)r0 * n + col) / 2] = pack2(d[4 * j], d[4 * j + 1]);
                if (r1 < m) p[((long long)r1 * n + col) / 2] = pack2(d[4 * j + 2], d[4 * j + 3]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(384, 1)
    decode_product_64(const __grid_constant__ TensorMap wmap,
                      const __grid_constant__ TensorMap xmap, void* out, int out_f32, int m,
                      int n, int k_tiles) {
    grid_begin_later();
    product_body<64, false>(&wmap, &xmap, out, out_f32, m, n, k_tiles);
}

extern "C" __global__ void __launch_bounds__(384, 1)
    decode_product_128(const __grid_constant__ TensorMap wmap,
                       const __grid_constant__ TensorMap xmap, void* out, int out_f32, int m,
                       int n, int k_tiles) {
    grid_begin_later();
    product_body<128, false>(&wmap, &xmap, out, out_f32, m, n, k_tiles);
}

extern "C" __global__ void __launch_bounds__(384, 1)
    decode_product_swiglu(const __grid_constant__ TensorMap wmap,
                          const __grid_constant__ TensorMap xmap, void* out, int out_f32, int m,
                          int n, int k_tiles) {
    grid_begin_later();
    // The down product behind it fetches its first weights on the SMs this one leaves.
    grid_release();
    product_body<128, true>(&wmap, &xmap, out, out_f32, m, n, k_tiles);
}
