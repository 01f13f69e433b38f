// tail_rewrite.cu -- the GPU side of the exact rewrites of rewrite.py, each with its guard
// on the device (no host synchronisation).
//
// Guard: a rewrite is exact in float only where the direct path stays finite,
// |h_n| <= ||x_r||_1 max|W| < 1e37, and x_r is finite. ||x_r||_1 is summed in double by
// the row's block, or bounded by K max|x_r| where the GEMM's x split has left max|x_r|
// in `rowmax` (float bits; a NaN row's are NaN): then x is read only for failing rows,
// and the row's entry is set back to 0 (the x split's atomicMax needs zeros: a kept
// workspace stays ready for the next call). A row failing it is computed directly by the same block (slow, but
// only for such rows): h_n = x_r . W_n as a float32 dot product (warp w takes the columns
// it needs, w, w + 8, ...), v_n = h_n * a_n + c_n rounded as float32 (no contraction).
// W[n, k] is at w[n * ldwn + k * ldwk], so a transposed weight source needs no copy. A row
// holding a NaN gives NaN without that work (every h_n is NaN, as in any fp32 GEMM). The
// host sends a weight with a non-finite element (every row would fail) to torch's path.
//
// gemv_rows: a row sum straight after a Linear, out[r] = sum_n (a_n h_n + c_n) = x_r . u + C
//   (u = a^T W and C = sum c, float64): the dot product in double, one block per row,
//   fixed-order sums (deterministic).
// fold_rows: average pooling (window k, stride st) of a_n h_n + c_n straight after a Linear,
//   run as the smaller GEMM with the window-averaged weight; this kernel finishes it: adds
//   the folded bias to the GEMM's rows h[r, :wo], or recomputes a failing row directly.
// pairdiff_rows: the sum over max-pooled pairs (window 2, stride 2) of v_n = a_n h_n + c_n
//   straight after a Linear, run as the GEMM z = x W'^T on the pair differences (rows
//   d_0 .. d_{h-1}, then the summed row s); this kernel finishes each row,
//   out[r] = ((z[r, h] + S) + sum_j |z[r, j] + e_j|) / 2 (the sum in double, fixed order),
//   or sums max(v_2j, v_2j+1) directly for a failing row (NaN-propagating max, as torch's
//   max pooling). Its guard bound is ||x_r||_1 * wmax < 5e36 (rewrite.PAIR_LIMIT).
#include "rewrite_rows.cuh"

#define RW_THREADS 256

// The guard's ||x_r||_1: K max|x_r| from the x split's row maxima where given (an upper
// bound: NaN for a row with a NaN, inf with an inf), else summed in double over the block
// in a fixed order.
__device__ __forceinline__ double rw_row_bound(const float* __restrict__ xr, int K, int vec,
                                              unsigned int* rowmax, long long r,
                                              double* scratch);

// sum_k |x_r[k]| (and, with u != NULL, x_r . u) in double over the block, fixed order
__device__ __forceinline__ void rw_row_sums(const float* __restrict__ xr, int K,
                                            const double* __restrict__ u, int vec,
                                            double* scratch, double& dot, double& asum) {
    const int tid = threadIdx.x;
    double d = 0.0, s = 0.0;
    if (vec) {   // x_r and K multiples of 4 floats: float4 loads
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const double2* u2 = reinterpret_cast<const double2*>(u);
        for (int q = tid; q < (K >> 2); q += RW_THREADS) {
            const float4 v = __ldg(x4 + q);
            if (u != nullptr) {
                const double2 u0 = __ldg(u2 + 2 * q), u1 = __ldg(u2 + 2 * q + 1);
                d = fma((double)v.x, u0.x, d);
                d = fma((double)v.y, u0.y, d);
                d = fma((double)v.z, u1.x, d);
                d = fma((double)v.w, u1.y, d);
            }
            s += (double)fabsf(v.x) + (double)fabsf(v.y) + (double)fabsf(v.z) +
                 (double)fabsf(v.w);
        }
    } else {
        for (int k = tid; k < K; k += RW_THREADS) {
            const float v = __ldg(xr + k);
            if (u != nullptr) d = fma((double)v, __ldg(u + k), d);
            s += (double)fabsf(v);
        }
    }
    dot = u != nullptr ? cf_block_reduce<CfSum>(d, scratch) : 0.0;
    asum = cf_block_reduce<CfSum>(s, scratch);
}

__device__ __forceinline__ double rw_row_bound(const float* __restrict__ xr, int K, int vec,
                                              unsigned int* rowmax, long long r,
                                              double* scratch) {
    if (rowmax != nullptr) {   // (a plain load: this kernel writes the entry back)
        const double b = (double)K * (double)__uint_as_float(rowmax[r]);
        __syncthreads();
        if (threadIdx.x == 0) rowmax[r] = 0u;
        return b;
    }
    double dot, asum;
    rw_row_sums(xr, K, nullptr, vec, scratch, dot, asum);
    return asum;
}

extern "C" __global__ void __launch_bounds__(RW_THREADS) gemv_rows(
    const float* __restrict__ x, long long ldx, int K, const double* __restrict__ u, double C,
    double wmax, const float* __restrict__ w, long long ldwn, long long ldwk, int N,
    const float* __restrict__ a, const float* __restrict__ c, float* __restrict__ out,
    long long ldo, int vec) {
    __shared__ double scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * ldx;
    double dot, asum;
    rw_row_sums(xr, K, u, vec, scratch, dot, asum);
    const int tid = threadIdx.x;
    if (asum != asum) {   // a NaN in x_r
        if (tid == 0) out[r * ldo] = __int_as_float(0x7fffffff);
        return;
    }
    if (asum * wmax < 1e37) {   // false for inf and NaN too
        if (tid == 0) out[r * ldo] = (float)(dot + C);
        return;
    }
    double s = 0.0;
    for (int n = tid >> 5; n < N; n += RW_THREADS / 32) {
        const float v = rw_direct(xr, K, w, ldwn, ldwk, a, c, n);
        if ((tid & 31) == 0) s += (double)v;
    }
    s = cf_block_reduce<CfSum>(s, scratch);
    if (tid == 0) out[r * ldo] = (float)s;
}

extern "C" __global__ void __launch_bounds__(RW_THREADS) fold_rows(
    const float* __restrict__ x, long long ldx, int K, double wmax,
    const float* __restrict__ w, long long ldwn, long long ldwk,
    const float* __restrict__ a, const float* __restrict__ c, int k, int st, int wo,
    const float* __restrict__ bf, float* __restrict__ h, long long ldh, int vec,
    unsigned int* rowmax) {
    __shared__ double scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * ldx;
    float* hr = h + r * ldh;
    const double asum = rw_row_bound(xr, K, vec, rowmax, r, scratch);
    const int tid = threadIdx.x;
    if (asum * wmax < 1e37) {   // false for inf and NaN too
        for (int o = tid; o < wo; o += RW_THREADS) hr[o] += bf[o];
        return;
    }
    rw_fold_direct(hr, asum != asum, xr, K, w, ldwn, ldwk, a, c, k, st, wo, RW_THREADS);
}

extern "C" __global__ void __launch_bounds__(RW_THREADS) pairdiff_rows(
    const float* __restrict__ x, long long ldx, int K, double wmax,
    const float* __restrict__ w, long long ldwn, long long ldwk,
    const float* __restrict__ a, const float* __restrict__ c, int h,
    const float* __restrict__ e, const float* __restrict__ z, long long ldz,
    float* __restrict__ out, long long ldo, int vec, unsigned int* rowmax) {
    __shared__ double scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * ldx;
    const float* zr = z + r * ldz;
    const double asum = rw_row_bound(xr, K, vec, rowmax, r, scratch);
    const int tid = threadIdx.x;
    if (asum != asum) {   // a NaN in x_r: every pair's max is NaN
        if (tid == 0) out[r * ldo] = __int_as_float(0x7fffffff);
        return;
    }
    double s = 0.0;
    if (asum * wmax < 5e36) {
        for (int j = tid; j < h; j += RW_THREADS) s += (double)fabsf(zr[j] + e[j]);
        s = cf_block_reduce<CfSum>(s, scratch);
        if (tid == 0) out[r * ldo] = (float)(((double)zr[h] + (double)e[h] + s) * 0.5);
        return;
    }
    for (int j = tid >> 5; j < h; j += RW_THREADS / 32) {
        const float u = rw_direct(xr, K, w, ldwn, ldwk, a, c, 2 * j);
        const float v = rw_direct(xr, K, w, ldwn, ldwk, a, c, 2 * j + 1);
        if ((tid & 31) == 0) s += (double)((u > v || u != u) ? u : v);
    }
    s = cf_block_reduce<CfSum>(s, scratch);
    if (tid == 0) out[r * ldo] = (float)s;
}
