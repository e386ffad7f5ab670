// CUDA on the CPU, for `check.py`: the features kernels/flash.cu and kernels/paged.cu use, so
// that their attention kernels run as plain C++. A block's threads are OS threads; a warp's collective instructions (ldmatrix,
// mma.sync, shfl) exchange through the warp's scratch, one barrier each; cp.async copies at
// once. check.py rewrites the kernels' inline assembly into the emu_ functions below.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cfloat>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <math.h>

#define __device__ static inline
#define __forceinline__
#define __global__
#define __launch_bounds__(...)
// Static shared arrays become each thread's own: only qkv_rotary_cache has one, and it is not run.
#define __shared__

struct dim3e { unsigned x = 0, y = 0, z = 0; };
thread_local dim3e threadIdx, blockIdx, blockDim, gridDim;
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(unsigned u) { return __uint_as_float(u); }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }

// A warp's scratch for its collective instructions: two of it, used in turn, so that one barrier
// an instruction suffices (a lane writes one while the slowest may still read the other, and
// cannot write that one again before every lane has passed the next barrier).
struct Scratch {
    unsigned words[32][6];  // a lane's mma operands: A (4 words), then B (2)
    float f[32];
    const unsigned char* addr[32];
};
struct Warp {
    std::barrier<> bar{32};
    Scratch turn[2];
};
struct Block {
    std::barrier<> bar;
    std::vector<std::unique_ptr<Warp>> warps;
    explicit Block(int threads) : bar(threads) {
        for (int i = 0; i < threads / 32; i++) warps.emplace_back(new Warp);
    }
};
thread_local Block* emu_block;
thread_local unsigned char* emu_smem;
thread_local unsigned emu_collectives;  // a lane's collective instructions so far

// This lane's warp and the scratch of its next collective instruction.
static inline Warp& my_warp() { return *emu_block->warps[threadIdx.x >> 5]; }
static inline Scratch& next_scratch() { return my_warp().turn[emu_collectives++ & 1]; }
static inline void __syncthreads() { emu_block->bar.arrive_and_wait(); }
static inline void __syncwarp() { my_warp().bar.arrive_and_wait(); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

static inline float __shfl_xor_sync(unsigned, float v, int m) {
    Scratch& w = next_scratch();
    const int lane = threadIdx.x & 31;
    w.f[lane] = v;
    my_warp().bar.arrive_and_wait();
    return w.f[lane ^ m];
}

static inline unsigned __cvta_generic_to_shared(const void* p) {
    return (unsigned)((const unsigned char*)p - emu_smem);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives row l % 8 of matrix l / 8.
static inline void emu_ldmatrix(bool trans, unsigned* o0, unsigned* o1, unsigned* o2, unsigned* o3,
                                unsigned saddr) {
    Scratch& w = next_scratch();
    const int lane = threadIdx.x & 31;
    w.addr[lane] = emu_smem + saddr;
    my_warp().bar.arrive_and_wait();
    unsigned* out[4] = {o0, o1, o2, o3};
    for (int j = 0; j < 4; j++) {
        if (!trans) {
            const uint16_t* row = (const uint16_t*)w.addr[8 * j + lane / 4];
            *out[j] = row[2 * (lane % 4)] | ((unsigned)row[2 * (lane % 4) + 1] << 16);
        } else {
            const uint16_t* r0 = (const uint16_t*)w.addr[8 * j + 2 * (lane % 4)];
            const uint16_t* r1 = (const uint16_t*)w.addr[8 * j + 2 * (lane % 4) + 1];
            *out[j] = r0[lane / 4] | ((unsigned)r1[lane / 4] << 16);
        }
    }
}

static inline float lo16(unsigned w) { return __uint_as_float(w << 16); }
static inline float hi16(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, c += A B.
static inline void emu_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    Scratch& w = next_scratch();
    const int lane = threadIdx.x & 31;
    for (int i = 0; i < 4; i++) w.words[lane][i] = a[i];
    w.words[lane][4] = b0;
    w.words[lane][5] = b1;
    my_warp().bar.arrive_and_wait();
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; L++) {
        const int g = L / 4, t = L % 4;
        const unsigned* x = w.words[L];
        A[g][2 * t] = lo16(x[0]); A[g][2 * t + 1] = hi16(x[0]);
        A[g + 8][2 * t] = lo16(x[1]); A[g + 8][2 * t + 1] = hi16(x[1]);
        A[g][2 * t + 8] = lo16(x[2]); A[g][2 * t + 9] = hi16(x[2]);
        A[g + 8][2 * t + 8] = lo16(x[3]); A[g + 8][2 * t + 9] = hi16(x[3]);
        B[2 * t][g] = lo16(x[4]); B[2 * t + 1][g] = hi16(x[4]);
        B[2 * t + 8][g] = lo16(x[5]); B[2 * t + 9][g] = hi16(x[5]);
    }
    const int g = lane / 4, t = lane % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; i++) {
        float s = c[i];
        for (int k = 0; k < 16; k++) s += A[rows[i]][k] * B[k][cols[i]];
        c[i] = s;
    }
}

// cp.async.cg.shared.global [dst], [src], 16, n: n bytes copied, the rest of the 16 zeroed.
static inline void emu_cp_async(unsigned saddr, const void* src, int n) {
    memset(emu_smem + saddr, 0, 16);
    memcpy(emu_smem + saddr, src, n);
}

static inline float emu_ex2_ftz(float x) {
    const float y = exp2f(x);
    return y < FLT_MIN ? 0.0f : y;
}

static inline void grid_begin() {}
static inline void grid_release() {}
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }

// Runs f on every thread of every block, a block at a time.
static void launch(dim3e grid, int threads, size_t shared, const std::function<void()>& f) {
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                std::vector<uint4> smem(shared / 16 + 1);
                memset(smem.data(), 0xcd, smem.size() * 16);  // garbage, as on a device
                Block block(threads);
                std::vector<std::thread> ts;
                for (int t = 0; t < threads; t++) {
                    ts.emplace_back([&, t] {
                        threadIdx = {(unsigned)t, 0, 0};
                        blockIdx = {bx, by, bz};
                        blockDim = {(unsigned)threads, 1, 1};
                        gridDim = grid;
                        emu_block = &block;
                        emu_collectives = 0;
                        emu_smem = (unsigned char*)smem.data();
                        f();
                    });
                }
                for (auto& t : ts) t.join();
            }
}
