// batchnorm.cu -- the tail of model 39: y = (z + q) * p per column (q the Linear
// bias, p the `scale` parameter, in PyTorch's order, on the GEMM output z),
// then BatchNorm1d over the batch: batch statistics in training mode, running
// statistics in eval mode.
//
// bn_stats_partial: a block owns 32 consecutive columns and one chunk of rows.
//   Its 256 threads are 8 row-lanes x 32 columns, so each warp reads one row's
//   32 columns (128 contiguous bytes). Each thread accumulates, in double, the
//   sums of d = y - shift and d^2 with shift = y[0, col] (the shift keeps the
//   variance accurate for data with a large offset; 0 when y[0, col] is NaN/inf, so
//   an infinite column still has an infinite mean, as in PyTorch), then the 8 lanes of a
//   column are added in a fixed order into partial_sum/partial_sq[chunk][col].
// bn_finalize: one thread per column adds the chunks in order, forms the mean
//   and the biased variance, writes mean[col] and a[col] = gamma * rsqrt(var + eps)
//   for bn_apply, and updates running_mean / running_var with `momentum` and the
//   unbiased variance, like torch.nn.BatchNorm1d. In eval mode it only turns the
//   running statistics into mean[] and a[].
// bn_apply: elementwise out = (y - mean) * a + beta with y = (z + q) * p; 16-byte
//   accesses when the row length allows; out may alias z.
#include "common.cuh"

#define BN_COLS 32

__device__ __forceinline__ float cf_finite_or_zero(float v) { return isfinite(v) ? v : 0.0f; }

// One normalised element: y = (z + q) * p in float (PyTorch's (Linear + bias) * scale),
// then (y - mean) * a + beta in double, so a column spanning +-3e38 does not overflow
// in the subtraction.
__device__ __forceinline__ float bn_norm(float z, float p, float q, float mean, float a, float beta) {
    const float y = (z + q) * p;
    return (float)(((double)y - (double)mean) * (double)a + (double)beta);
}
#define BN_LANES 8

extern "C" __global__ void __launch_bounds__(256) bn_stats_partial(
    const float* __restrict__ z, long long ldz, int M, int N, const float* __restrict__ p,
    const float* __restrict__ q, int rows_per_chunk, double* __restrict__ partial_sum,
    double* __restrict__ partial_sq) {
    __shared__ double ssum[BN_LANES][BN_COLS];
    __shared__ double ssq[BN_LANES][BN_COLS];
    const int tx = threadIdx.x % BN_COLS, ty = threadIdx.x / BN_COLS;
    const int col = blockIdx.x * BN_COLS + tx;
    const int chunk = blockIdx.y;
    const int r0 = chunk * rows_per_chunk;
    const int r1 = min(M, r0 + rows_per_chunk);
    double s = 0.0, sq = 0.0;
    if (col < N) {
        const float pc = p[col], qc = q[col];
        const float shift = cf_finite_or_zero(((z[col] + qc) * pc));
        int r = r0 + ty;
        for (; r + 3 * BN_LANES < r1; r += 4 * BN_LANES) {
            const float y0 = ((z[(long long)r * ldz + col] + qc) * pc);
            const float y1 = ((z[(long long)(r + BN_LANES) * ldz + col] + qc) * pc);
            const float y2 = ((z[(long long)(r + 2 * BN_LANES) * ldz + col] + qc) * pc);
            const float y3 = ((z[(long long)(r + 3 * BN_LANES) * ldz + col] + qc) * pc);
            const double d0 = (double)y0 - shift, d1 = (double)y1 - shift;
            const double d2 = (double)y2 - shift, d3 = (double)y3 - shift;
            s += (d0 + d1) + (d2 + d3);
            sq += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
        }
        for (; r < r1; r += BN_LANES) {
            const double d = (double)((z[(long long)r * ldz + col] + qc) * pc) - shift;
            s += d;
            sq += d * d;
        }
    }
    ssum[ty][tx] = s;
    ssq[ty][tx] = sq;
    __syncthreads();
    if (ty == 0 && col < N) {
        double ts = 0.0, tq = 0.0;
#pragma unroll
        for (int l = 0; l < BN_LANES; ++l) { ts += ssum[l][tx]; tq += ssq[l][tx]; }
        partial_sum[(long long)chunk * N + col] = ts;
        partial_sq[(long long)chunk * N + col] = tq;
    }
}

extern "C" __global__ void bn_finalize(
    const double* __restrict__ partial_sum, const double* __restrict__ partial_sq, int nchunks,
    const float* __restrict__ z, int M, int N, const float* __restrict__ p,
    const float* __restrict__ q, const float* __restrict__ gamma, float eps, int training,
    float momentum, float* __restrict__ running_mean, float* __restrict__ running_var,
    float* __restrict__ mean_out, float* __restrict__ a_out) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= N) return;
    const float g = gamma ? gamma[col] : 1.0f;
    if (!training) {
        mean_out[col] = running_mean[col];
        a_out[col] = (float)((double)g / sqrt((double)running_var[col] + (double)eps));
        return;
    }
    double s = 0.0, sq = 0.0;
    for (int c = 0; c < nchunks; ++c) {
        s += partial_sum[(long long)c * N + col];
        sq += partial_sq[(long long)c * N + col];
    }
    const double shift = (double)cf_finite_or_zero(((z[col] + q[col]) * p[col]));
    const double md = s / (double)M;
    double var = sq / (double)M - md * md;
    if (var < 0.0) var = 0.0;
    if (sq != sq) var = sq;  // keep NaN visible (the clamp above would hide it)
    const double mean = shift + md;
    mean_out[col] = (float)mean;
    a_out[col] = (float)((double)g / sqrt(var + (double)eps));
    if (running_mean != nullptr) {
        const double unbiased = M > 1 ? var * (double)M / (double)(M - 1) : var;
        running_mean[col] = (float)((1.0 - (double)momentum) * (double)running_mean[col] + (double)momentum * mean);
        running_var[col] = (float)((1.0 - (double)momentum) * (double)running_var[col] + (double)momentum * unbiased);
    }
}

extern "C" __global__ void __launch_bounds__(256) bn_apply(
    const float* __restrict__ z, long long ldz, int M, int N, const float* __restrict__ p,
    const float* __restrict__ q, const float* __restrict__ mean, const float* __restrict__ a,
    const float* __restrict__ beta, float* out, long long ldo) {
    // Not __restrict__ on out: it may alias z (in-place normalisation).
    const long long total = (long long)M * N;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vec = (N & 3) == 0 && (ldz & 3) == 0 && (ldo & 3) == 0 &&
                     ((((unsigned long long)z) | ((unsigned long long)out)) & 15ull) == 0;
    if (vec) {
        const long long total4 = total >> 2;
        const int N4 = N >> 2;
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total4; i += stride) {
            const long long r = i / N4;
            const int c = (int)(i % N4) * 4;
            const float4 zv = *reinterpret_cast<const float4*>(z + r * ldz + c);
            float4 o;
            o.x = bn_norm(zv.x, p[c + 0], q[c + 0], mean[c + 0], a[c + 0], beta ? beta[c + 0] : 0.f);
            o.y = bn_norm(zv.y, p[c + 1], q[c + 1], mean[c + 1], a[c + 1], beta ? beta[c + 1] : 0.f);
            o.z = bn_norm(zv.z, p[c + 2], q[c + 2], mean[c + 2], a[c + 2], beta ? beta[c + 2] : 0.f);
            o.w = bn_norm(zv.w, p[c + 3], q[c + 3], mean[c + 3], a[c + 3], beta ? beta[c + 3] : 0.f);
            *reinterpret_cast<float4*>(out + r * ldo + c) = o;
        }
    } else {
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
            const long long r = i / N;
            const int c = (int)(i % N);
            out[r * ldo + c] = bn_norm(z[r * ldz + c], p[c], q[c], mean[c], a[c], beta ? beta[c] : 0.f);
        }
    }
}
