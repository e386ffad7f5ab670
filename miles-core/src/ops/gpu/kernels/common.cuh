// Shared by every kernel file: bf16 as raw 16-bit words (no headers needed under NVRTC), and
// warp/block reductions. Activations and parameters are bf16; arithmetic is fp32.

typedef unsigned short bf16;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf2f(bf16 x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

// Round to nearest even; NaN stays NaN (quietened), infinities stay infinite.
__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// The low and the high bf16 of a 32-bit word, as floats.
__device__ __forceinline__ float bf_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// Two floats rounded to nearest even as bf16 in one word, `lo` first in memory, in one
// instruction: f2bf's bits for every value but NaN (the canonical one, whatever the payload).
__device__ __forceinline__ unsigned int cvt_pack2(float lo, float hi) {
    unsigned int w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}

// Two floats rounded to bf16 (as f2bf, NaN payloads kept) in one word, `lo` first in memory:
// the instruction, and f2bf's integer steps only for a NaN.
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
    if (lo != lo || hi != hi) return (unsigned int)f2bf(lo) | ((unsigned int)f2bf(hi) << 16);
    return cvt_pack2(lo, hi);
}

// The 8 bf16 of a 16-byte word as floats, in memory order.
__device__ __forceinline__ void unpack8(uint4 u, float* f) {
    f[0] = bf_lo(u.x); f[1] = bf_hi(u.x); f[2] = bf_lo(u.y); f[3] = bf_hi(u.y);
    f[4] = bf_lo(u.z); f[5] = bf_hi(u.z); f[6] = bf_lo(u.w); f[7] = bf_hi(u.w);
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// Whether 8 bf16 at a time can be read at p: a 16-byte aligned address.
__device__ __forceinline__ bool aligned16(const void* p) {
    return ((unsigned long long)p & 15ull) == 0;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` is 32 floats of shared memory; the call ends with the block synchronised.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}
