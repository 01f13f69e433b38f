// gemm_rows_simt.cu -- y[r, n] = sum_k x[r, k] * W[n, k] for the rows r with
// flags[r] != 0: the direct Linear for the few rows the guard in row_tail.cu
// flagged, without a host synchronisation (the flags stay on the device).
//
// Tiling: a block owns 32 rows x 64 output columns; K advances 32 at a time
// through shared memory (x tile 32x32, W tile 64x32, stored k-major with one
// word of padding). 256 threads: thread (ty, tx) = (tid / 16, tid % 16)
// accumulates rows 2ty, 2ty+1 and columns tx + 16j (j < 4) in registers with
// plain float FMAs, so NaN and infinities propagate as in any fp32 GEMM.
// A block none of whose 32 rows is flagged returns at once: when no row was
// flagged the whole launch costs a few microseconds.
#define RS_BM 32
#define RS_BN 64
#define RS_BK 32

extern "C" __global__ void __launch_bounds__(256) gemm_rows_simt(
    const float* __restrict__ x, long long ldx, const float* __restrict__ w, long long ldw,
    int M, int N, int K, const int* __restrict__ flags, float* __restrict__ y, long long ldy) {
    __shared__ float xs[RS_BK][RS_BM + 1];
    __shared__ float ws[RS_BK][RS_BN + 1];
    const int r0 = blockIdx.y * RS_BM;
    const int n0 = blockIdx.x * RS_BN;
    const int tid = threadIdx.x;
    const int mine = (tid < RS_BM && r0 + tid < M) ? flags[r0 + tid] : 0;
    if (!__syncthreads_or(mine)) return;
    const int ty = tid / 16, tx = tid % 16;
    float acc[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

    for (int k0 = 0; k0 < K; k0 += RS_BK) {
        // x tile: 32 rows x 32 k, 4 loads per thread (consecutive threads -> consecutive k).
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int e = tid + t * 256;
            const int r = e / RS_BK, kk = e % RS_BK;
            const int row = r0 + r, k = k0 + kk;
            xs[kk][r] = (row < M && k < K) ? x[(long long)row * ldx + k] : 0.f;
        }
        // W tile: 64 columns x 32 k, 8 loads per thread.
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const int e = tid + t * 256;
            const int c = e / RS_BK, kk = e % RS_BK;
            const int n = n0 + c, k = k0 + kk;
            ws[kk][c] = (n < N && k < K) ? w[(long long)n * ldw + k] : 0.f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < RS_BK; ++kk) {
            const float a0 = xs[kk][2 * ty], a1 = xs[kk][2 * ty + 1];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float b = ws[kk][tx + 16 * j];
                acc[0][j] = fmaf(a0, b, acc[0][j]);
                acc[1][j] = fmaf(a1, b, acc[1][j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = r0 + 2 * ty + i;
        if (row >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + tx + 16 * j;
            if (n < N) y[(long long)row * ldy + n] = acc[i][j];
        }
    }
}
