// row_tail.cu -- the tails of models 55, 56 and 98: pool, activate and reduce
// each row of a GEMM output z (rows x ldz, fp32, row-major) to one number.
//
// One launch, deterministic, no float atomics:
//   * block b owns `windows_per_block` consecutive pooling windows of one row
//     (row slot b / nchunks, chunk b % nchunks). Each thread walks windows
//     w = w0 + tid, w0 + tid + blockDim, ... (for k = 1 a warp reads 32
//     consecutive floats: coalesced), folds them into a private accumulator, and
//     the block reduces its threads in a fixed order (common.cuh) into
//     partial[slot * nchunks + chunk].
//   * the last block of a row to finish (an integer atomic on done[slot], which
//     the host zeroes before the launch) folds that row's partials in chunk
//     order -- so the result does not depend on which block came last -- and
//     writes out[row] = (acc + z[row, extra_col] + *extra_bias + add) * mul
//     (the extra column is optional).
// Row slots map to rows directly, or through row_index[] when only the rows
// flagged by row_guard.cu are recomputed (row_count then lives on the device,
// so the launch needs no host synchronisation; blocks past it return at once).
#include "epilogue.cuh"

template <class Pool, class Act, class Red>
__device__ __forceinline__ void row_tail_impl(
    const float* __restrict__ z, long long ldz, const float* __restrict__ bias, int nwin, int k,
    float act_param, int windows_per_block, int nchunks, const int* __restrict__ row_index,
    const int* __restrict__ row_count, typename Red::acc_t* partial, unsigned int* done,
    int extra_col, const float* __restrict__ extra_bias, double add, double mul,
    float* __restrict__ out) {
    typedef typename Red::acc_t acc_t;
    __shared__ acc_t scratch[32];
    __shared__ bool is_last;
    const long long slot = blockIdx.x / nchunks;
    const int chunk = blockIdx.x % nchunks;
    if (row_count != nullptr && slot >= (long long)(*row_count)) return;
    const float* zrow = z + slot * ldz;
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
    if (threadIdx.x == 0) {
        if (nchunks == 1) {
            is_last = true;
        } else {
            partial[slot * nchunks + chunk] = acc;
            __threadfence();  // publish the partial before counting this block as done
            is_last = atomicAdd(&done[slot], 1u) == (unsigned int)(nchunks - 1);
        }
    }
    __syncthreads();
    if (!is_last || threadIdx.x != 0) return;
    if (nchunks > 1) {
        __threadfence();
        acc = Red::identity();
        for (int c = 0; c < nchunks; ++c) acc = Red::combine(acc, __ldcg(&partial[slot * nchunks + c]));
    }
    double v = (double)acc;
    if (extra_col >= 0) v += (double)zrow[extra_col] + (extra_bias ? (double)*extra_bias : 0.0);
    v = (v + add) * mul;
    const long long row = row_index != nullptr ? row_index[slot] : slot;
    out[row] = (float)v;
}

#define CF_ROW_TAIL(NAME, POOL, ACT, RED)                                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                      \
        const float* __restrict__ z, long long ldz, const float* __restrict__ bias, int nwin,    \
        int k, float act_param, int windows_per_block, int nchunks,                              \
        const int* __restrict__ row_index, const int* __restrict__ row_count,                    \
        RED::acc_t* partial, unsigned int* done, int extra_col,                                  \
        const float* __restrict__ extra_bias, double add, double mul, float* __restrict__ out) { \
        row_tail_impl<POOL, ACT, RED>(z, ldz, bias, nwin, k, act_param, windows_per_block,       \
                                      nchunks, row_index, row_count, partial, done, extra_col,   \
                                      extra_bias, add, mul, out);                                \
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
