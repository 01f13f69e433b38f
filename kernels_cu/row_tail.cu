// row_tail.cu -- the tails of models 55, 56 and 98: pool, activate and reduce
// each row of a GEMM output z (rows x ldz, fp32, row-major) to one number.
//
// One launch, deterministic, no float atomics:
//   * block b owns `windows_per_block` consecutive pooling windows of one row
//     (row b / nchunks, chunk b % nchunks). Each thread walks windows
//     w = w0 + tid, w0 + tid + blockDim, ... (for k = 1 a warp reads 32
//     consecutive floats: coalesced), folds them into a private accumulator, and
//     the block reduces its threads in a fixed order (common.cuh) into
//     partial[row * nchunks + chunk].
//   * the last block of a row to finish (an integer atomic on done[row], which
//     the host zeroes before the launch) folds that row's partials in chunk
//     order -- so the result does not depend on which block came last -- and
//     writes out[row] = (acc + z[row, extra_col] + *extra_bias + add) * mul
//     (the extra column is optional).
// With row_flags != nullptr only the flagged rows are processed (the others
// return at once): the direct recomputation of guarded rows, decided on the
// device with no host synchronisation.
#include "epilogue.cuh"

// Guard of the exact-algebra shortcuts (AvgPool fold, pair-difference), fused in
// the same launch when x != nullptr: for a row of x with K values every Linear
// output obeys |y_n| <= ||x||_1 max|W| + max|b|. Chunk c of a row also sums |x|
// over its 1/nchunks share of the row; the row's last block adds the shares in
// order and sets flags[row] = 1 unless ||x||_1 * bounds[0] + bounds[1] <= limit
// (bounds = (max|W|, max|b|) on the device, NaN there flags every row; a NaN or
// infinite x gives a NaN or infinite norm and is flagged). The host picks `limit`
// so that every intermediate of the shortcut and of the direct path stays finite;
// flagged rows are recomputed directly afterwards (gemm_rows_simt.cu, then this
// kernel again with row_flags set and x == nullptr).
template <class Pool, class Act, class Red>
__device__ __forceinline__ void row_tail_impl(
    const float* __restrict__ z, long long ldz, const float* __restrict__ bias, int nwin, int k,
    float act_param, int windows_per_block, int nchunks, const int* __restrict__ row_flags,
    typename Red::acc_t* partial, unsigned int* done, int extra_col,
    const float* __restrict__ extra_bias, double add, double mul, float* __restrict__ out,
    const float* __restrict__ x, long long ldx, int K, const float* __restrict__ bounds,
    float limit, int* __restrict__ flags, double* partial_l1) {
    typedef typename Red::acc_t acc_t;
    __shared__ acc_t scratch[32];
    __shared__ double scratch_l1[32];
    __shared__ bool is_last;
    const long long row = blockIdx.x / nchunks;
    const int chunk = blockIdx.x % nchunks;
    if (row_flags != nullptr && row_flags[row] == 0) return;
    const float* zrow = z + row * ldz;
    const int w0 = chunk * windows_per_block;
    const int w1 = min(nwin, w0 + windows_per_block);
    const int bd = blockDim.x;
    acc_t acc = Red::identity();
    int w = w0 + threadIdx.x;
    for (; w + 3 * bd < w1; w += 4 * bd) {
        float v0 = Act::apply(Pool::window(zrow + (long long)w * k, bias ? bias + (long long)w * k : nullptr, k), act_param);
        float v1 = Act::apply(Pool::window(zrow + (long long)(w + bd) * k, bias ? bias + (long long)(w + bd) * k : nullptr, k), act_param);
        float v2 = Act::apply(Pool::window(zrow + (long long)(w + 2 * bd) * k, bias ? bias + (long long)(w + 2 * bd) * k : nullptr, k), act_param);
        float v3 = Act::apply(Pool::window(zrow + (long long)(w + 3 * bd) * k, bias ? bias + (long long)(w + 3 * bd) * k : nullptr, k), act_param);
        acc = Red::combine(acc, Red::combine(Red::combine((acc_t)v0, (acc_t)v1), Red::combine((acc_t)v2, (acc_t)v3)));
    }
    for (; w < w1; w += bd) {
        float v = Act::apply(Pool::window(zrow + (long long)w * k, bias ? bias + (long long)w * k : nullptr, k), act_param);
        acc = Red::combine(acc, (acc_t)v);
    }
    acc = cf_block_reduce<Red>(acc, scratch);
    double l1 = 0.0;
    if (x != nullptr) {
        const int kc = (K + nchunks - 1) / nchunks;
        const int k0 = chunk * kc, k1 = min(K, k0 + kc);
        const float* xr = x + row * ldx;
        float s0 = 0.f, s1 = 0.f;
        int i = k0 + threadIdx.x;
        for (; i + bd < k1; i += 2 * bd) { s0 += fabsf(xr[i]); s1 += fabsf(xr[i + bd]); }
        for (; i < k1; i += bd) s0 += fabsf(xr[i]);
        l1 = cf_block_reduce<CfSum>((double)(s0 + s1), scratch_l1);
    }
    if (threadIdx.x == 0) {
        if (nchunks == 1) {
            is_last = true;
        } else {
            partial[row * nchunks + chunk] = acc;
            if (x != nullptr) partial_l1[row * nchunks + chunk] = l1;
            __threadfence();  // publish the partials before counting this block as done
            is_last = atomicAdd(&done[row], 1u) == (unsigned int)(nchunks - 1);
        }
    }
    __syncthreads();
    if (!is_last || threadIdx.x != 0) return;
    if (nchunks > 1) {
        __threadfence();
        acc = Red::identity();
        l1 = 0.0;
        for (int c = 0; c < nchunks; ++c) {
            acc = Red::combine(acc, __ldcg(&partial[row * nchunks + c]));
            if (x != nullptr) l1 += __ldcg(&partial_l1[row * nchunks + c]);
        }
    }
    double v = (double)acc;
    if (extra_col >= 0) v += (double)zrow[extra_col] + (extra_bias ? (double)*extra_bias : 0.0);
    v = (v + add) * mul;
    out[row] = (float)v;
    if (x != nullptr) {
        // 1.0001: margin for the float rounding of the per-thread sums.
        const double bound = l1 * 1.0001 * (double)bounds[0] + (double)bounds[1];
        flags[row] = (bound <= (double)limit) ? 0 : 1;
    }
}

#define CF_ROW_TAIL(NAME, POOL, ACT, RED)                                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                      \
        const float* __restrict__ z, long long ldz, const float* __restrict__ bias, int nwin,    \
        int k, float act_param, int windows_per_block, int nchunks,                              \
        const int* __restrict__ row_flags, RED::acc_t* partial, unsigned int* done,              \
        int extra_col, const float* __restrict__ extra_bias, double add, double mul,             \
        float* __restrict__ out, const float* __restrict__ x, long long ldx, int K,              \
        const float* __restrict__ bounds, float limit, int* __restrict__ flags,                  \
        double* partial_l1) {                                                                    \
        row_tail_impl<POOL, ACT, RED>(z, ldz, bias, nwin, k, act_param, windows_per_block,       \
                                      nchunks, row_flags, partial, done, extra_col, extra_bias,  \
                                      add, mul, out, x, ldx, K, bounds, limit, flags,            \
                                      partial_l1);                                               \
    }

// 55 direct (any kernel_size): sum over windows of max(z + b).
CF_ROW_TAIL(row_tail_maxpool_sum, PoolMax, ActIdentity, CfSum)
// 55 pair-difference (k = 1 over the difference columns): sum of |z + b_diff|.
CF_ROW_TAIL(row_tail_abs_sum, PoolAvg, ActAbs, CfSum)
// 56: sum of sigmoid(z + b).
CF_ROW_TAIL(row_tail_sigmoid_sum, PoolAvg, ActSigmoid, CfSum)
// 98 (k = pool size for the direct path, k = 1 after the AvgPool fold):
// max over windows of gelu(mean(z + b)) * scale.
CF_ROW_TAIL(row_tail_avgpool_gelu_max, PoolAvg, ActGeluScale, CfMax)
