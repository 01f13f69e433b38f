// tail_colstat.cu -- batch statistics of a (rows x cols) fp32 matrix z, per column, for
// BatchNorm in training mode (the T4 tails of generated programs).
//
// colstat_partial: block (bx, chunk) owns 32 consecutive columns and rows
//   [chunk * rows_per_chunk, ...). Its 256 threads are 8 row-lanes x 32 columns (a warp
//   reads 128 contiguous bytes of one row). Each thread sums, in double, d = z - shift
//   and d^2 with shift = z[0, col] (0 when that is NaN/inf, so an infinite column still
//   has an infinite mean): the shift keeps the variance accurate under a large offset.
//   The 8 lanes of a column are added in a fixed order into psum/psq[chunk][col].
//   With num_batches != NULL, block (0, 0) adds one to it (BatchNorm's
//   num_batches_tracked: counted on the device, before colstat_finalize reads it).
// colstat_finalize: one thread per column adds the chunks in order, forms the mean and
//   the biased variance, writes mean[col] and invstd[col] = 1 / sqrt(var + eps) (both
//   double: the tail normalises in double, so y - mean cannot overflow and a huge
//   variance's invstd is not subnormal), and,
//   if running_mean != NULL, updates running_mean / running_var with the momentum (or
//   1 / num_batches_tracked when momentum < 0: the cumulative average) and the unbiased
//   variance, as torch.nn.BatchNorm1d does. Deterministic: no atomics.
#include "common.cuh"

#define CS_COLS 32
#define CS_LANES 8

extern "C" __global__ void __launch_bounds__(256) colstat_partial(
    const float* __restrict__ z, long long rows, int cols, long long rows_per_chunk,
    double* __restrict__ psum, double* __restrict__ psq, long long* __restrict__ num_batches) {
    __shared__ double ss[CS_LANES][CS_COLS];
    if (num_batches != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
        num_batches[0] += 1;
    __shared__ double sq[CS_LANES][CS_COLS];
    const int tx = threadIdx.x % CS_COLS, ty = threadIdx.x / CS_COLS;
    const int col = blockIdx.x * CS_COLS + tx;
    const long long r0 = (long long)blockIdx.y * rows_per_chunk;
    const long long r1 = min(rows, r0 + rows_per_chunk);
    double s = 0.0, q = 0.0;
    if (col < cols) {
        const float z0 = z[col];
        const double shift = isfinite(z0) ? (double)z0 : 0.0;
        for (long long r = r0 + ty; r < r1; r += CS_LANES) {
            const double d = (double)z[r * cols + col] - shift;
            s += d;
            q += d * d;
        }
    }
    ss[ty][tx] = s;
    sq[ty][tx] = q;
    __syncthreads();
    if (ty == 0 && col < cols) {
        double a = 0.0, b = 0.0;
        for (int l = 0; l < CS_LANES; ++l) { a += ss[l][tx]; b += sq[l][tx]; }
        psum[(long long)blockIdx.y * cols + col] = a;
        psq[(long long)blockIdx.y * cols + col] = b;
    }
}

extern "C" __global__ void __launch_bounds__(256) colstat_finalize(
    const float* __restrict__ z, const double* __restrict__ psum, const double* __restrict__ psq,
    int chunks, long long rows, int cols, float eps, double momentum,
    double* __restrict__ mean, double* __restrict__ invstd, float* __restrict__ running_mean,
    float* __restrict__ running_var, const long long* __restrict__ num_batches) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    double s = 0.0, q = 0.0;
    for (int c = 0; c < chunks; ++c) {
        s += psum[(long long)c * cols + col];
        q += psq[(long long)c * cols + col];
    }
    const float z0 = z[col];
    const double shift = isfinite(z0) ? (double)z0 : 0.0;
    const double n = (double)rows;
    const double dm = s / n;
    double var = q / n - dm * dm;
    if (var < 0.0) var = 0.0;
    if (!(q == q) || !(s == s)) var = s - s + q;  // NaN/inf columns: NaN, as torch gives
    const double m = shift + dm;
    mean[col] = m;
    invstd[col] = 1.0 / sqrt(var + (double)eps);
    if (running_mean != nullptr) {
        const double f = momentum < 0.0 ? 1.0 / (double)num_batches[0] : momentum;
        const double unbiased = rows > 1 ? var * n / (n - 1.0) : var;
        running_mean[col] = (float)((1.0 - f) * (double)running_mean[col] + f * m);
        running_var[col] = (float)((1.0 - f) * (double)running_var[col] + f * unbiased);
    }
}
