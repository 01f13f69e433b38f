// common.cuh -- small building blocks shared by every cupyfuse kernel.
//
// Activation functions follow PyTorch's float32 CUDA formulas so that NaN and
// infinity come out where PyTorch puts them:
//   sigmoid(v) = 1 / (1 + exp(-v))           (-inf -> 0, +inf -> 1, NaN -> NaN)
//   gelu(v)    = 0.5 v (1 + erf(v / sqrt 2)) (exact erf form; -inf -> NaN as in PyTorch)
// Reductions are deterministic: warp shuffles then a fixed-order pass over the
// warps of a block; no floating-point atomics anywhere.
#pragma once

#define CF_FULL_MASK 0xffffffffu

// Programmatic dependent launch (sm_90; runtime.launch_dependent): a kernel launched as a
// dependent waits here until the stream's previous kernel has finished and its writes are
// visible (a no-op in a kernel launched plainly); a kernel lets its dependents start
// launching with cf_grid_launch_dependents.
__device__ __forceinline__ void cf_grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void cf_grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// NaN-propagating maximum: the result is NaN when either side is NaN
// (torch.max and MaxPool1d propagate NaN the same way).
__device__ __forceinline__ float cf_nanmax(float a, float b) {
    return (a != a || a > b) ? a : b;
}

__device__ __forceinline__ float cf_sigmoid(float v) {
    return 1.0f / (1.0f + expf(-v));
}

__device__ __forceinline__ float cf_gelu(float v) {
    return 0.5f * v * (1.0f + erff(v * 0.70710678118654752440f));
}

__device__ __forceinline__ double cf_warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(CF_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float cf_warp_nanmax(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = cf_nanmax(v, __shfl_xor_sync(CF_FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float cf_warp_sum_f(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(CF_FULL_MASK, v, o);
    return v;
}

// Reduction operators: identity, combine, and the block-wide reduction in a
// fixed order. T is the accumulator type (double for sums, float for max).
struct CfSum {
    typedef double acc_t;
    static __device__ __forceinline__ acc_t identity() { return 0.0; }
    static __device__ __forceinline__ acc_t combine(acc_t a, acc_t b) { return a + b; }
    static __device__ __forceinline__ acc_t warp(acc_t v) { return cf_warp_sum(v); }
};

struct CfMax {
    typedef float acc_t;
    static __device__ __forceinline__ acc_t identity() { return -__int_as_float(0x7f800000); }
    static __device__ __forceinline__ acc_t combine(acc_t a, acc_t b) { return cf_nanmax(a, b); }
    static __device__ __forceinline__ acc_t warp(acc_t v) { return cf_warp_nanmax(v); }
};

// Block-wide reduction for blocks of up to 1024 threads (a multiple of 32).
// Every thread gets the result. `scratch` holds at least 32 accumulators.
template <class Red>
__device__ __forceinline__ typename Red::acc_t cf_block_reduce(typename Red::acc_t v,
                                                               typename Red::acc_t* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = Red::warp(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        typename Red::acc_t t = lane < nwarps ? scratch[lane] : Red::identity();
        t = Red::warp(t);
        if (lane == 0) scratch[0] = t;
    }
    __syncthreads();
    typename Red::acc_t r = scratch[0];
    __syncthreads();
    return r;
}
