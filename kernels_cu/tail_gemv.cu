// tail_gemv.cu -- a row sum straight after a Linear, as a GEMV (the rewrite in rewrite.py):
//   out[r] = sum_n (a_n (x_r . W_n) + c_n) = x_r . u + C,   u = a^T W and C = sum c in float64.
//
// gemv_rows: one block per row. The dot product x_r . u and ||x_r||_1 are summed in double,
// each thread over a fixed stride of k, then the block in a fixed order (deterministic).
// Guard, without a host synchronisation: the identity is exact in float only where the direct
// path stays finite, |h_n| <= ||x_r||_1 max|W| < 1e37, and x_r is finite. A row failing it is
// computed directly by the same block (slow, but only for such rows; W[n, k] at
// w[n * ldwn + k * ldwk], so a transposed weight source needs no copy):
//   h_n = x_r . W_n as a float32 dot product (warp w takes columns w, w + 8, ...),
//   v_n = h_n * a_n + c_n rounded as float32 (no contraction), summed in double.
// A row holding a NaN gives NaN without that work (every h_n is NaN, as in any fp32 GEMM).
// The host sends a weight with a non-finite element (every row would fail) to the direct path.
#include "common.cuh"

#define GV_THREADS 256

extern "C" __global__ void __launch_bounds__(GV_THREADS) gemv_rows(
    const float* __restrict__ x, long long ldx, int K, const double* __restrict__ u, double C,
    double wmax, const float* __restrict__ w, long long ldwn, long long ldwk, int N,
    const float* __restrict__ a, const float* __restrict__ c, float* __restrict__ out,
    long long ldo, int vec) {
    __shared__ double scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * ldx;
    const int tid = threadIdx.x;
    double dot = 0.0, asum = 0.0;
    if (vec) {   // x_r and K multiples of 4 floats: float4 loads
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const double2* u2 = reinterpret_cast<const double2*>(u);
        for (int q = tid; q < (K >> 2); q += GV_THREADS) {
            const float4 v = __ldg(x4 + q);
            const double2 u0 = __ldg(u2 + 2 * q), u1 = __ldg(u2 + 2 * q + 1);
            dot = fma((double)v.x, u0.x, dot);
            dot = fma((double)v.y, u0.y, dot);
            dot = fma((double)v.z, u1.x, dot);
            dot = fma((double)v.w, u1.y, dot);
            asum += (double)fabsf(v.x) + (double)fabsf(v.y) + (double)fabsf(v.z) +
                    (double)fabsf(v.w);
        }
    } else {
        for (int k = tid; k < K; k += GV_THREADS) {
            const float v = __ldg(xr + k);
            dot = fma((double)v, __ldg(u + k), dot);
            asum += (double)fabsf(v);
        }
    }
    dot = cf_block_reduce<CfSum>(dot, scratch);
    asum = cf_block_reduce<CfSum>(asum, scratch);
    if (asum != asum) {   // a NaN in x_r
        if (tid == 0) out[r * ldo] = __int_as_float(0x7fffffff);
        return;
    }
    const double bound = asum * wmax;
    if (bound < 1e37) {   // false for inf and NaN too
        if (tid == 0) out[r * ldo] = (float)(dot + C);
        return;
    }
    const int lane = tid & 31, warp = tid >> 5;
    double s = 0.0;
    for (int n = warp; n < N; n += GV_THREADS / 32) {
        const float* wn = w + (long long)n * ldwn;
        float h = 0.f;
        for (int k = lane; k < K; k += 32) h = fmaf(xr[k], wn[k * ldwk], h);
        h = cf_warp_sum_f(h);
        if (lane == 0) s += (double)__fadd_rn(__fmul_rn(h, a[n]), c[n]);
    }
    s = cf_block_reduce<CfSum>(s, scratch);
    if (tid == 0) out[r * ldo] = (float)s;
}
