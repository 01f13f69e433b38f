#pragma once
// gemm_skinny.cuh -- y = x @ W.T for few rows of x, in plain fp32 FMAs, reading each
// weight element once per launch: the GEMM of small batches, which is bound by streaming
// the weight (3xTF32 on the tensor cores would stream 1.5x its bytes for nothing).
//
//   x (M, K) row stride ldx, W (N, K) row stride ldw, y (M, N) row stride ldy; fp32.
//
// Grid (column tiles x row tiles, K splits): blockIdx.x = column tile * row tiles + row
// tile (a column tile's row tiles run side by side and share its weight rows through L2).
// A block is SK_WARPS warps; warp w owns the CPW columns n0 + w*CPW ... of its column tile
// and the MT rows m0 ... of its row tile. Its lanes
// stride over the block's K range four elements at a time (float4 loads: 32 lanes read
// 512 contiguous bytes of one weight row), each lane keeping MT x CPW partial sums;
// a butterfly of shuffles then adds the lanes in a fixed order. x is read through L1
// (its rows are shared by the block's warps and by every block of the row tile).
//
// K split over gridDim.y blocks: each writes its partial sums to `part` (splits, M, N)
// and takes a ticket on its tile's counter; the block that draws the last ticket adds
// the splits in order 0..splits-1 into y and re-arms the counter (0) for the next launch.
// Results are therefore bitwise identical run to run. NaN and infinities propagate as in
// any fp32 GEMM (no zero-padding enters a product).
//
// Tuning knobs (defaults measured best on the H100, tools/skinny_variants.py): SK_WARPS
// warps per block, SK_CPW columns per warp, SK_UNROLL K steps in flight per lane, SK_MINB
// the launch bounds' blocks per SM.
//
// VEC = 1 needs K, ldx, ldw multiples of 4 and 16-byte aligned x and W; VEC = 0 reads
// single floats (lane stride 1) and takes any shape.

#ifndef SK_WARPS
#define SK_WARPS 4
#endif
#ifndef SK_UNROLL
#define SK_UNROLL 2
#endif
#ifndef SK_CPW
#define SK_CPW 4
#endif
#ifndef SK_MINB
#define SK_MINB 1
#endif
// SK_STAGES > 0: row tiles of at least SK_STAGED_MT rows stage the weight through shared
// memory with cp.async (see skinny_tile); 0: plain __ldg loads. Measured (H100,
// tools/skinny_forms_probe.py): the 16-row tile (254 registers, the fewest bytes in
// flight) 1.35-1.37x -> 1.30-1.33x the floor at 13-16 rows of 16384^2; shorter tiles
// slower staged (4-row: 1.22 -> 1.49x at 12 rows), so only 16-row tiles stage.
#ifndef SK_STAGES
#define SK_STAGES 4
#endif
#ifndef SK_STAGED_MT
#define SK_STAGED_MT 16
#endif

__device__ __forceinline__ void sk_cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void sk_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void sk_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// After a block has stored its tile (rows m0 .. m0+mt-1, columns nb .. nb+cols-1) into y,
// or with K split into its slice of `part`: the last split of the tile adds the parts in
// order 0..splits-1 into y and re-arms the tile's counter. With `done` (two counters at
// zero) and `ntail` (1 .. tiles): the last ntail blocks to finish a tile get their index
// 0 .. ntail-1 back, once every tile of y is written and visible to them; the others (and
// every block without `done`) get -1. A generated tail then runs in those blocks: the
// GEMM and its tail in one launch.
__device__ __forceinline__ int skinny_finish(
    int M, int N, int m0, int mt, int nb, int cols, float* __restrict__ y, long long ldy,
    const float* __restrict__ part, unsigned int* __restrict__ counters,
    unsigned int* __restrict__ done, int ntail) {
    __shared__ unsigned int ticket;
    const int splits = gridDim.y;
    if (splits > 1) {
        __threadfence();
        __syncthreads();
        const unsigned int tile = blockIdx.x;
        if (threadIdx.x == 0) ticket = atomicAdd(&counters[tile], 1u);
        __syncthreads();
        if (ticket != (unsigned int)(splits - 1)) return -1;
        __threadfence();
        // the last block of this tile: y = part[0] + part[1] + ... in this order
        for (int i = threadIdx.x; i < mt * cols; i += blockDim.x) {
            const int m = m0 + i / cols, n = nb + i % cols;
            if (m >= M || n >= N) continue;
            float s = 0.f;
            for (int p = 0; p < splits; ++p) s += __ldcg(part + ((long long)p * M + m) * N + n);
            y[(long long)m * ldy + n] = s;
        }
        if (threadIdx.x == 0) counters[tile] = 0u;
    }
    if (done == nullptr) return -1;
    // The last `ntail` blocks to finish a tile run the tail, rows j, j + ntail, ... for
    // j = 0 .. ntail-1: each waits until every tile is done (done[0] == tiles). They are
    // resident already and every other block has finished or is running, so the wait ends.
    const unsigned int tiles = gridDim.x;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(&done[0], 1u);
    __syncthreads();
    const unsigned int first = tiles - (unsigned int)ntail;
    if (ticket < first) return -1;
    if (threadIdx.x == 0) {
        while (atomicAdd(&done[0], 0u) < tiles) __nanosleep(32);
        // the last tail block past the wait re-arms both counters for the next launch
        if (atomicAdd(&done[1], 1u) == (unsigned int)ntail - 1) {
            done[1] = 0u;
            done[0] = 0u;
        }
    }
    __syncthreads();
    __threadfence();
    return (int)(ticket - first);
}

// acc[m][c] += x[row m, k .. k+3] . w[column c, k .. k+3] for the tile's rows (x read
// through L1 as float4s; the CPW weight float4s of this K step in wv)
template <int MT, int CPW>
__device__ __forceinline__ void sk_fma_rows(float (&acc)[MT][CPW], const float* __restrict__ xb,
                                            const int (&xoff)[MT], int k, const float4 (&wv)[CPW]) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        const float4 xv = __ldg(reinterpret_cast<const float4*>(xb + xoff[m] + k));
#pragma unroll
        for (int c = 0; c < CPW; ++c) {
            float a = acc[m][c];
            a = fmaf(xv.x, wv[c].x, a);
            a = fmaf(xv.y, wv[c].y, a);
            a = fmaf(xv.z, wv[c].z, a);
            a = fmaf(xv.w, wv[c].w, a);
            acc[m][c] = a;
        }
    }
}

// The FMA form (rows m0 .. m0+MT-1 of one row tile, SK_WARPS x CPW columns): returns
// skinny_finish's value.
template <int MT, int CPW, int VEC>
__device__ __forceinline__ int skinny_tile(
    const float* __restrict__ x, long long ldx, const float* __restrict__ w, long long ldw,
    int M, int N, int K, int kspan, float* __restrict__ y, long long ldy,
    float* __restrict__ part, unsigned int* __restrict__ counters,
    unsigned int* __restrict__ done, int ntail) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // blockIdx.x = column tile * row tiles + row tile: the row tiles of one column tile
    // are neighbours in launch order, so their weight rows come from L2 after the first
    const int rtiles = (M + MT - 1) / MT;
    const int ctile = blockIdx.x / rtiles;
    const int n0 = (ctile * SK_WARPS + warp) * CPW;
    const int m0 = (blockIdx.x - ctile * rtiles) * MT;
    const int k0 = blockIdx.y * kspan;
    const int k1 = min(K, k0 + kspan);
    const int splits = gridDim.y;
    float acc[MT][CPW];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < CPW; ++c) acc[m][c] = 0.f;
    // rows/columns past the edge read row 0 / column 0 (valid memory) and are never
    // stored; offsets from one base pointer keep the register count down
    const float* wb = w + (long long)min(n0, N - 1) * ldw;
    int woff[CPW];
#pragma unroll
    for (int c = 0; c < CPW; ++c) woff[c] = n0 + c < N ? c * (int)ldw : 0;
    const float* xb = x + (long long)m0 * ldx;
    int xoff[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) xoff[m] = m0 + m < M ? m * (int)ldx : 0;
    if (VEC && SK_STAGES > 0 && MT >= SK_STAGED_MT) {
        // the weight through shared memory, SK_STAGES - 1 K steps ahead (cp.async: bytes in
        // flight without registers). Each lane copies, and later reads back, only its own
        // float4 of each column's row: cp.async.wait_group is the only synchronisation.
        constexpr int kStages = SK_STAGES > 0 ? SK_STAGES : 1;
        __shared__ __align__(16) float4 wst[kStages][SK_WARPS][CPW][32];
        const int nk = (k1 - k0 + 127) / 128;   // K steps of 128 (the warp's, uniform)
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s) {
            const int k = k0 + s * 128 + lane * 4;
#pragma unroll
            for (int c = 0; c < CPW; ++c)
                if (s < nk && k < k1) sk_cp_async16(&wst[s][warp][c][lane], wb + woff[c] + k);
            sk_cp_async_commit();
        }
        for (int it = 0; it < nk; ++it) {
            {
                const int s = it + kStages - 1;
                const int k = k0 + s * 128 + lane * 4;
#pragma unroll
                for (int c = 0; c < CPW; ++c)
                    if (s < nk && k < k1)
                        sk_cp_async16(&wst[s % kStages][warp][c][lane], wb + woff[c] + k);
                sk_cp_async_commit();
            }
            sk_cp_async_wait<kStages - 1>();
            const int k = k0 + it * 128 + lane * 4;
            if (k < k1) {
                float4 wv[CPW];
#pragma unroll
                for (int c = 0; c < CPW; ++c) wv[c] = wst[it % kStages][warp][c][lane];
                sk_fma_rows<MT, CPW>(acc, xb, xoff, k, wv);
            }
        }
        sk_cp_async_wait<0>();
    } else if (VEC) {
        // two K steps in flight, except at 16 rows (the registers are full: it would spill)
        constexpr int kUnroll = MT >= 16 ? 1 : SK_UNROLL;
#pragma unroll kUnroll
        for (int k = k0 + lane * 4; k < k1; k += 128) {
            float4 wv[CPW];
#pragma unroll
            for (int c = 0; c < CPW; ++c) wv[c] = __ldg(reinterpret_cast<const float4*>(wb + woff[c] + k));
            sk_fma_rows<MT, CPW>(acc, xb, xoff, k, wv);
        }
    } else {
        constexpr int kUnrollScalar = MT >= 16 ? 1 : 4;
#pragma unroll kUnrollScalar
        for (int k = k0 + lane; k < k1; k += 32) {
            float wv[CPW];
#pragma unroll
            for (int c = 0; c < CPW; ++c) wv[c] = __ldg(wb + woff[c] + k);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const float xv = __ldg(xb + xoff[m] + k);
#pragma unroll
                for (int c = 0; c < CPW; ++c) acc[m][c] = fmaf(xv, wv[c], acc[m][c]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < CPW; ++c) {
            float v = acc[m][c];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            acc[m][c] = v;
        }
    // lane (m * CPW + c) % 32 stores element (m, c)
    float* dst = splits == 1 ? y : part + (long long)blockIdx.y * M * N;
    const long long ld = splits == 1 ? ldy : N;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < CPW; ++c)
            if (lane == ((m * CPW + c) & 31) && m0 + m < M && n0 + c < N)
                dst[(long long)(m0 + m) * ld + n0 + c] = acc[m][c];
    return skinny_finish(M, N, m0, MT, ctile * (SK_WARPS * CPW), SK_WARPS * CPW, y, ldy, part,
                         counters, done, ntail);
}

