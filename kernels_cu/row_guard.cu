// row_guard.cu -- decide, per input row, whether an exact-algebra shortcut
// (AvgPool fold, MaxPool pair-difference) is safe for that row.
//
// The shortcuts are identities of real arithmetic; in float32 they hold up to
// rounding as long as nothing overflows and no input is NaN or infinite. For a
// row x of K values, every Linear output obeys |y_n| <= ||x||_1 max|W| + max|b|.
// One block owns one row: its threads sum |x| over the row (16-byte loads when
// the row is 16-byte aligned), the block reduces in a fixed order, and thread 0
// flags the row unless  ||x||_1 * bounds[0] + bounds[1] <= limit,  where
// bounds = (max|W|, max|b|) lives on the device (NaN there flags every row) and
// `limit` is chosen by the host so every intermediate of both the shortcut and
// the direct computation stays finite. A NaN or infinite x gives a NaN or
// infinite norm and is flagged too. Flagged rows are appended to row_index
// (order of appends varies, the results per row do not) and counted in *count,
// which the host zeroes before the launch.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) row_guard(
    const float* __restrict__ x, long long ldx, int K, const float* __restrict__ bounds,
    float limit, int* __restrict__ row_index, int* __restrict__ count) {
    __shared__ double scratch[32];
    const long long row = blockIdx.x;
    const float* xr = x + row * ldx;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    if ((((unsigned long long)xr) & 15ull) == 0 && (K & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const int K4 = K >> 2;
        for (int i = threadIdx.x; i < K4; i += blockDim.x) {
            float4 v = x4[i];
            s0 += fabsf(v.x); s1 += fabsf(v.y); s2 += fabsf(v.z); s3 += fabsf(v.w);
        }
    } else {
        for (int i = threadIdx.x; i < K; i += blockDim.x) s0 += fabsf(xr[i]);
    }
    double l1 = cf_block_reduce<CfSum>((double)((s0 + s1) + (s2 + s3)), scratch);
    if (threadIdx.x == 0) {
        // 1.0001: margin for the float rounding of the per-thread sums.
        double bound = l1 * 1.0001 * (double)bounds[0] + (double)bounds[1];
        if (!(bound <= (double)limit)) {
            int pos = atomicAdd(count, 1);
            row_index[pos] = (int)row;
        }
    }
}
