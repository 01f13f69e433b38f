// tail_ops.cuh -- the device functions behind cupyfuse/vocab.py's CUDA fragments.
//
// Each follows PyTorch's float32 formula so NaN and infinities land where PyTorch
// puts them (relu/clamp/max of NaN is NaN; gelu is the erf form, gelu_tanh the tanh
// approximation; softplus switches to the identity above `threshold`; mish is
// v * tanh(softplus(v)) with threshold 20).
#pragma once
#include "common.cuh"

#define CF_INF __int_as_float(0x7f800000)
#define CF_NAN __int_as_float(0x7fffffff)

// A split-K GEMM's value read from its partial products (prepared launches, where the
// tail kernel is the GEMM's only reader: no splitk_sum launch). The same fixed-order sum
// as gemm_sm90.cu's splitk_sum, so the value is bitwise the same.
__device__ __forceinline__ float cf_ksum(const float* p, int splits, long long split_stride) {
    float s = 0.f;
    for (int k = 0; k < splits; ++k) s += p[k * split_stride];
    return s;
}

__device__ __forceinline__ float cf_nanmin(float a, float b) { return (a != a || a < b) ? a : b; }
__device__ __forceinline__ double cf_add_d(double a, double b) { return a + b; }
__device__ __forceinline__ float cf_relu(float v) { return v > 0.0f ? v : (v != v ? v : 0.0f); }
__device__ __forceinline__ float cf_clamp(float v, float lo, float hi) {
    return v != v ? v : fminf(fmaxf(v, lo), hi);
}
__device__ __forceinline__ float cf_square(float v) { return v * v; }
__device__ __forceinline__ float cf_pow(float a, float b) { return b == 2.0f ? a * a : powf(a, b); }
__device__ __forceinline__ float cf_gelu_tanh(float v) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
}
__device__ __forceinline__ float cf_silu(float v) { return v / (1.0f + expf(-v)); }
__device__ __forceinline__ float cf_softplus(float v, float beta, float threshold) {
    return v * beta > threshold ? v : log1pf(expf(v * beta)) / beta;
}
__device__ __forceinline__ float cf_mish(float v) { return v * tanhf(cf_softplus(v, 1.0f, 20.0f)); }
__device__ __forceinline__ float cf_hardsigmoid(float v) { return cf_clamp(v + 3.0f, 0.0f, 6.0f) / 6.0f; }
__device__ __forceinline__ float cf_hardswish(float v) { return v * cf_clamp(v + 3.0f, 0.0f, 6.0f) / 6.0f; }
__device__ __forceinline__ float cf_leaky_relu(float v, float s) { return v > 0.0f ? v : v * s; }
__device__ __forceinline__ float cf_elu(float v, float a) { return v > 0.0f ? v : a * expm1f(v); }
__device__ __forceinline__ float cf_finite_or_zero(float v) { return isinf(v) ? 0.0f : v; }
// torch.logaddexp: equal infinities give themselves; else max + log1p(exp(-|a - b|)) (NaN
// propagates through the difference)
__device__ __forceinline__ float cf_logaddexp(float a, float b) {
    if (isinf(a) && a == b) return a;
    return fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
}

// argmax / argmin (torch's rules: the first position of the maximum / minimum; a NaN
// counts as beyond every number, so the first NaN wins; -0.0 equals +0.0). Each candidate
// (value v at position f) is one 64-bit key, the best candidate the largest key: the high
// 32 bits order the values (v's bits made monotone in v -- reversed for argmin -- and NaN
// above them all), the low 32 bits hold 0xffffffff - f (the lowest position highest). So
// the combine is the max of unsigned integers: associative and commutative, any order of
// a block's reduction gives the same key. The identity is 0 (below every candidate: the
// value part of a number's key lies in [0x007fffff, 0xff800000]).
__device__ __forceinline__ unsigned long long cf_argkey(float v, int f, bool is_min) {
    unsigned int k;
    if (v != v) {
        k = 0xffffffffu;
    } else {
        const unsigned int u = __float_as_uint(v == 0.0f ? 0.0f : v);   // (-0.0 as +0.0)
        k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);                 // increasing in v
        if (is_min) k = ~k;                                              // decreasing in v
    }
    return ((unsigned long long)k << 32) | (unsigned long long)(0xffffffffu - (unsigned int)f);
}
__device__ __forceinline__ unsigned long long cf_argmax_key(float v, int f) { return cf_argkey(v, f, false); }
__device__ __forceinline__ unsigned long long cf_argmin_key(float v, int f) { return cf_argkey(v, f, true); }
__device__ __forceinline__ unsigned long long cf_umax64(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}
// the position a key holds, as a float32 number (exact: positions below 2^24)
__device__ __forceinline__ float cf_argkey_pos(unsigned long long k) {
    return (float)(0xffffffffu - (unsigned int)(k & 0xffffffffull));
}

// A block's value with a combine function, fixed order (warp shuffles, then warp 0 over
// the warps' results), left in scratch[slot] by warp 0 (`scratch` holds 32 values; warp
// 0 has read them all before it writes the slot). The caller synchronises before reading.
template <class T, class Op>
__device__ __forceinline__ void cf_block_publish(T v, T ident, Op op, T* scratch, int slot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T t = lane < nwarps ? scratch[lane] : ident;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) t = op(t, __shfl_xor_sync(0xffffffffu, t, o));
        if (lane == 0) scratch[slot] = t;
    }
}
// Block-wide reduction: every thread gets the block's value.
template <class T, class Op>
__device__ __forceinline__ T cf_block_combine(T v, T ident, Op op, T* scratch) {
    cf_block_publish<T>(v, ident, op, scratch, 0);
    __syncthreads();
    T r = scratch[0];
    __syncthreads();
    return r;
}

// A row split over the CTAs of a thread-block cluster (a level kernel's `_cl` entry,
// codegen.SPLIT_PARTS blocks per row: a wide row at a small batch spread over several
// SMs). cf_row_part() is this block's rank in its cluster, cf_row_parts() the cluster's
// size: 0 and 1 in any launch without clusters (and in the CPU emulation), so a kernel
// launched plainly strides over the row in one block as before.
__device__ __forceinline__ int cf_row_part() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return (int)r;
#else
    return 0;
#endif
}
__device__ __forceinline__ int cf_row_parts() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned n;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return (int)n;
#else
    return 1;
#endif
}
// A row's features over the row's threads: a loop `for (f = CF_F0; f < width; f += CF_FS)`
// strides over the block's threads, and over the blocks of the cluster in the `_cl`
// entry (read in the loop itself: a variable live across the kernel's phases made ptxas
// spill)
#define CF_F0 (cf_row_part() * (int)blockDim.x + (int)threadIdx.x)
#define CF_FS (cf_row_parts() * (int)blockDim.x)
// the `_cl` entry's cluster shape (sm_90 and later; elsewhere the entry is a plain kernel
// that no launch uses)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CF_ROW_CLUSTER(n) __cluster_dims__(n, 1, 1)
#else
#define CF_ROW_CLUSTER(n)
#endif

// A value of another block of the cluster (address from mapa), by type (no union: a local
// union costs a stack frame)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cf_dsmem_load(unsigned a, float& v) {
    unsigned b;
    asm volatile("ld.shared::cluster.b32 %0, [%1];" : "=r"(b) : "r"(a) : "memory");
    v = __uint_as_float(b);
}
__device__ __forceinline__ void cf_dsmem_load(unsigned a, double& v) {
    unsigned long long b;
    asm volatile("ld.shared::cluster.b64 %0, [%1];" : "=l"(b) : "r"(a) : "memory");
    v = __longlong_as_double((long long)b);
}
__device__ __forceinline__ void cf_dsmem_load(unsigned a, unsigned long long& v) {
    asm volatile("ld.shared::cluster.b64 %0, [%1];" : "=l"(v) : "r"(a) : "memory");
}
#endif

// A row reduction over the row's blocks. In a cluster: the block's value (warp shuffles,
// then warp 0 over the warps, as cf_block_combine), published in its scratch; one
// cluster barrier; then lane q of every warp reads block q's value (DSMEM: all blocks'
// values in one round trip) and every lane folds them in rank order 0, 1, ... (a fixed
// order: bitwise the same run to run, and the same bits as reading them one by one).
// Every thread gets the result. A scratch serves one combine per launch, and no block
// exits before every block has read it: the `_cl` entry ends in cf_row_end (one barrier
// per combine, not two). Without a cluster: cf_block_combine.
// H100, 16 rows x 16384 GELU + softmax, tail kernel us (docs/measured/
// tail_combine_h100_2026-11-26.txt): values read one by one and two barriers per combine
// 10.7; all at once, two 10.6; all at once, one plus one at the end 9.7. Arriving after
// the reads and waiting only before the next combine (no barrier at the end) lost:
// tail_floor_split_barrier_h100_2026-11-26.txt, the generated kernel 6.8 -> 7.8 us.
template <class T, class Op>
__device__ __forceinline__ T cf_row_combine(T v, T ident, Op op, T* scratch) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int parts = cf_row_parts();
    if (parts > 1) {
        const int lane = threadIdx.x & 31;
        cf_block_publish<T>(v, ident, op, scratch, 1);   // (the barrier below synchronises)
        asm volatile("barrier.cluster.arrive.release.aligned;\n"
                     "barrier.cluster.wait.acquire.aligned;" ::: "memory");
        T pq = ident;
        if (lane < parts) {
            unsigned remote;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote)
                         : "r"((unsigned)__cvta_generic_to_shared(scratch + 1)), "r"(lane));
            cf_dsmem_load(remote, pq);
        }
        T t = ident;
        for (int q = 0; q < parts; ++q) t = op(t, __shfl_sync(0xffffffffu, pq, q));
        return t;
    }
#endif
    return cf_block_combine<T>(v, ident, op, scratch);
}
// The end of a `_cl` entry: the cluster's blocks wait for each other before they exit,
// so no block's scratch goes while another may still read it (cf_row_combine)
__device__ __forceinline__ void cf_row_end() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cf_row_parts() > 1)
        asm volatile("barrier.cluster.arrive.release.aligned;\n"
                     "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

template <class T, class Op>
__device__ __forceinline__ T cf_warp_combine(T v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
