// gemm_skinny.cu -- the skinny-batch GEMM's entry points (the kernel body and its notes:
// gemm_skinny.cuh, which generated tails include to run in the same launch).
#include "gemm_skinny.cuh"

// One entry point per row-tile height MT (SK_WARPS warps x SK_CPW columns per block); tiles
// of 16 rows run on the tensor cores (gemm_skinny_16wg).
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, SK_MINB) gemm_skinny_1(
    const float* __restrict__ x, long long ldx, const float* __restrict__ w, long long ldw,
    int M, int N, int K, int kspan, float* __restrict__ y, long long ldy,
    float* __restrict__ part, unsigned int* __restrict__ counters, int vec) {
    if (vec) skinny_tile<1, SK_CPW, 1>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
    else skinny_tile<1, SK_CPW, 0>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, SK_MINB) gemm_skinny_2(
    const float* __restrict__ x, long long ldx, const float* __restrict__ w, long long ldw,
    int M, int N, int K, int kspan, float* __restrict__ y, long long ldy,
    float* __restrict__ part, unsigned int* __restrict__ counters, int vec) {
    if (vec) skinny_tile<2, SK_CPW, 1>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
    else skinny_tile<2, SK_CPW, 0>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, SK_MINB) gemm_skinny_4(
    const float* __restrict__ x, long long ldx, const float* __restrict__ w, long long ldw,
    int M, int N, int K, int kspan, float* __restrict__ y, long long ldy,
    float* __restrict__ part, unsigned int* __restrict__ counters, int vec) {
    if (vec) skinny_tile<4, SK_CPW, 1>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
    else skinny_tile<4, SK_CPW, 0>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, SK_MINB) gemm_skinny_8(
    const float* __restrict__ x, long long ldx, const float* __restrict__ w, long long ldw,
    int M, int N, int K, int kspan, float* __restrict__ y, long long ldy,
    float* __restrict__ part, unsigned int* __restrict__ counters, int vec) {
    if (vec) skinny_tile<8, SK_CPW, 1>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
    else skinny_tile<8, SK_CPW, 0>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
}

// The 16-row tile on wgmma (skinny_tile_wg: SKW_WG x 64 columns per block).
extern "C" __global__ void __launch_bounds__(SKW_WG * 128, SKW_MINB) gemm_skinny_16wg(
    const float* __restrict__ x, long long ldx, const float* __restrict__ w, long long ldw,
    int M, int N, int K, int kspan, float* __restrict__ y, long long ldy,
    float* __restrict__ part, unsigned int* __restrict__ counters, int vec) {
    if (vec) skinny_tile_wg<1>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
    else skinny_tile_wg<0>(x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, nullptr, 0);
}
