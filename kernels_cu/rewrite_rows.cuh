// rewrite_rows.cuh -- the direct recomputation of a row that a rewrite's guard rejects
// (tail_rewrite.cu's kernels, and tail_certify.cuh when it finishes a folded GEMM).
#pragma once
#include "common.cuh"

// the direct v_n = h_n * a_n + c_n of one column, in lane 0 of the calling warp
__device__ __forceinline__ float rw_direct(const float* __restrict__ xr, int K,
                                           const float* __restrict__ w, long long ldwn,
                                           long long ldwk, const float* __restrict__ a,
                                           const float* __restrict__ c, int n) {
    const int lane = threadIdx.x & 31;
    const float* wn = w + (long long)n * ldwn;
    float h = 0.f;
    for (int k = lane; k < K; k += 32) h = fmaf(xr[k], wn[k * ldwk], h);
    h = cf_warp_sum_f(h);
    return __fadd_rn(__fmul_rn(h, a[n]), c[n]);
}

// A folded row (average pooling, window k, stride st, wo outputs) computed directly by
// the block (`threads` threads): hr[o] = NaN everywhere when nan (a NaN in x_r: every
// pooled value is NaN), else each window's k values v_n summed in float32, then divided
// (avg_pool1d); warp w takes outputs w, w + threads / 32, ...
__device__ __forceinline__ void rw_fold_direct(float* __restrict__ hr, bool nan,
                                               const float* __restrict__ xr, int K,
                                               const float* __restrict__ w, long long ldwn,
                                               long long ldwk, const float* __restrict__ a,
                                               const float* __restrict__ c, int k, int st,
                                               int wo, int threads) {
    const int tid = threadIdx.x;
    if (nan) {
        for (int o = tid; o < wo; o += threads) hr[o] = __int_as_float(0x7fffffff);
        return;
    }
    for (int o = tid >> 5; o < wo; o += threads / 32) {
        float s = 0.f;
        for (int j = 0; j < k; ++j) s += rw_direct(xr, K, w, ldwn, ldwk, a, c, o * st + j);
        if ((tid & 31) == 0) hr[o] = s / (float)k;
    }
}
