#pragma once
// gemm_skinny.cuh -- y = x @ W.T for few rows of x, reading each weight element once per
// launch: the GEMM of small batches, which is bound by streaming the weight (the engine's
// 3xTF32 would stream 1.5x its bytes, its pre-split copies, for nothing). Row tiles of up
// to 8 rows run in plain fp32 FMAs (skinny_tile); tiles of 16 rows in 3xTF32 on wgmma
// with the weight split in registers (skinny_tile_wg, at the end of this file).
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
// Without counters (nullptr) the partial sums are left for the next kernel to add.
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
    // the tile's loads are done: a tail kernel launched as a programmatic dependent may
    // start launching (it waits for this grid's end before it reads y; common.cuh's
    // cf_grid_launch_dependents, written out: this header is pasted expanded into the
    // fused tails' sources, which include common.cuh themselves)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const int splits = gridDim.y;
    if (splits > 1) {
        // no counters: the partial sums are the result (the next kernel adds them in the
        // same order, tail_ops.cuh's cf_ksum: prepared launches whose tail is y's only reader)
        if (counters == nullptr) return -1;
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
    if (VEC) {
        // SK_UNROLL K steps in flight, except at 16 rows (the registers are full: it would
        // spill)
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


// ---------------------------------------------------------------------------------------
// The 16-row tile (9-16 rows of a large weight) on wgmma: 3xTF32 with the roles turned
// round -- the weight is the m64 operand (64 columns of y per warpgroup, A from registers:
// each fp32 weight element read once from memory and split in registers), x the n16
// operand, read by the tensor cores from shared memory. x's 16 rows of a chunk of SKW_KC
// K are loaded once per block (a chunk ahead in registers), split into tf32 big and small
// halves and stored in the 128-byte swizzled K-major layout of a wgmma descriptor; the
// warps read no x themselves. K's order inside a step of 8 is free, so lane (g, t) reads
// the 8 contiguous floats kc + 8t .. + 7 of its two weight rows and x is stored permuted
// to match (skw_xpos).
//
// Products: big*big + big*small + small*big. The weight's big half is the weight itself
// (the tensor cores read an fp32 operand's tf32 truncation), its small half the exact
// rest rounded to tf32 (error <= 2^-21 of the element); x splits by rounding (its small
// half within 2^-11, read exactly). Each K step of 32 sums big*big in a fresh accumulator
// added to an fp32 sum (the tensor cores' adds truncate); the two cross terms run in
// accumulators of their own (three independent wgmma chains), dropped where the big*big
// sum is not finite, so NaN and infinite operands give what fp32 arithmetic gives.
//
// The weight's loads carry the L2::256B prefetch-size hint: a warp's instruction reads
// 64 bytes of each of 8 rows, and without the hint memory serves the tile at ~1.15x its
// floor; with it 1.05-1.08x (ENGINE_NOTES v29, tools/skinny_stream_probe.py).
// Knobs (H100, tools/skinny_wg_probe.py): SKW_WG warpgroups per block, SKW_AHEAD K steps
// of 32 of the weight loaded ahead into registers, SKW_MINB blocks per SM in the launch
// bounds of every kernel holding the tile (engine.skinny_plan's grid counts on 2).
#ifndef SKW_WG
#define SKW_WG 2
#endif
#ifndef SKW_AHEAD
#define SKW_AHEAD 1
#endif
#ifndef SKW_MINB
#define SKW_MINB 2
#endif
#ifndef SKW_KC
#define SKW_KC 128
#endif

#include "sm90.cuh"

// A float4 of the weight, with the L2::256B prefetch-size hint: L2 fetches the whole
// 256-byte block around it from memory (the FMA tiles' warps read 512 contiguous bytes
// of a row per instruction and gain nothing from it: 1-4 rows equal, 6-8 rows 1.06 ->
// 1.12x the floor at 16384^2)
__device__ __forceinline__ float4 sk_ldw4(const float* p) {
    float4 v;
    asm("ld.global.nc.L2::256B.v4.f32 {%0, %1, %2, %3}, [%4];"
        : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// 8 floats p[k .. k+7] of a weight row, zeros past k1 (VEC: k1 and k multiples of 4,
// 16-byte aligned rows); float4 loads carry the hint
template <int VEC>
__device__ __forceinline__ void sk_load8(const float* __restrict__ p, int k, int k1, bool ok,
                                         float4& lo, float4& hi) {
    if (VEC) {
        lo = ok && k < k1 ? sk_ldw4(p + k) : make_float4(0.f, 0.f, 0.f, 0.f);
        hi = ok && k + 4 < k1 ? sk_ldw4(p + k + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
        float e[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) e[i] = ok && k + i < k1 ? __ldg(p + k + i) : 0.f;
        lo = make_float4(e[0], e[1], e[2], e[3]);
        hi = make_float4(e[4], e[5], e[6], e[7]);
    }
}

__device__ __forceinline__ float sk_elem(const float4& lo, const float4& hi, int e) {
    return e == 0 ? lo.x : e == 1 ? lo.y : e == 2 ? lo.z : e == 3 ? lo.w
         : e == 4 ? hi.x : e == 5 ? hi.y : e == 6 ? hi.z : hi.w;
}

// Byte offset of x's element (row r, K offset o of a 32-wide sub-tile) in the sub-tile's
// swizzled 16 x 128-byte rows: o = 8t + 2s + h is step s's logical column 8s + 4h + t.
__device__ __forceinline__ int skw_xpos(int r, int o) {
    const int t = o >> 3, s = (o >> 1) & 3, h = o & 1;
    const int L = 8 * s + 4 * h + t;
    return r * 128 + (((L >> 2) ^ (r & 7)) << 4) + ((L & 3) << 2);
}

// x's chunk in shared memory: [big, small][sub-tile of 32 K] of 2 KB each, 1024-byte
// aligned (the swizzle's period); one buffer per kernel, whichever VEC form runs
__device__ __forceinline__ unsigned char* skw_xsmem() {
    __shared__ __align__(1024) unsigned char raw[2 * (SKW_KC / 32) * 2048 + 1024];
    return raw + ((1024 - (cf_smem_addr(raw) & 1023)) & 1023);
}

// 4 floats of x's row (zeros past k1 or for a row past the batch)
template <int VEC>
__device__ __forceinline__ float4 skw_load4(const float* __restrict__ p, int k, int k1, bool ok) {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (VEC) {
        if (ok && k < k1) r = __ldg(reinterpret_cast<const float4*>(p + k));
    } else {
        float e[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) e[i] = ok && k + i < k1 ? __ldg(p + k + i) : 0.f;
        r = make_float4(e[0], e[1], e[2], e[3]);
    }
    return r;
}

template <int VEC>
__device__ __forceinline__ int skinny_tile_wg(
    const float* __restrict__ x, long long ldx, const float* __restrict__ w, long long ldw,
    int M, int N, int K, int kspan, float* __restrict__ y, long long ldy,
    float* __restrict__ part, unsigned int* __restrict__ counters,
    unsigned int* __restrict__ done, int ntail) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    // wgmma is sm_90a's: the library runs the skinny kernels on compute capability 9.0 only
    // (gemm.engine_for); this stub keeps the file building for older targets
    __trap();
    return -1;
#else
    constexpr int kCols = 64 * SKW_WG, kThreads = 128 * SKW_WG;
    constexpr int kSub = SKW_KC / 32;                       // sub-tiles of 32 K per chunk
    constexpr int kXU = 16 * SKW_KC / 4 / kThreads;         // x float4s per thread per chunk
    static_assert(kXU * kThreads * 4 == 16 * SKW_KC, "x chunk / threads");
    unsigned char* xsm = skw_xsmem();
    const unsigned xs_addr = cf_smem_addr(xsm);
    const int tid = threadIdx.x;
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int rtiles = (M + 15) / 16;
    const int ctile = blockIdx.x / rtiles;
    const int m0 = (blockIdx.x - ctile * rtiles) * 16;
    const int nw = ctile * kCols + wg * 64 + warp * 16;     // this warp's first column
    const int k0 = blockIdx.y * kspan;
    const int k1 = min(K, k0 + kspan);
    const int splits = gridDim.y;
    // weight rows nw + g and nw + g + 8 (past the edge: row N - 1, never stored)
    const float* wa = w + (long long)min(nw + g, N - 1) * ldw;
    const float* wb = w + (long long)min(nw + g + 8, N - 1) * ldw;
    float acc[8], pt[8], c1[8], c2[8];   // fp32 sum, big*big of a step, the cross terms
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = pt[i] = c1[i] = c2[i] = 0.f;
    // x's chunk in registers: thread tid holds float4 slots tid + kThreads * u, slot f =
    // row f / (SKW_KC / 4), K offset 4 (f % (SKW_KC / 4))
    float4 xr[kXU];
    auto load_x = [&](int kc) {
#pragma unroll
        for (int u = 0; u < kXU; ++u) {
            const int f = tid + kThreads * u, r = f / (SKW_KC / 4), o = 4 * (f % (SKW_KC / 4));
            const float* p = x + (long long)min(m0 + r, M - 1) * ldx;
            xr[u] = skw_load4<VEC>(p, kc + o, k1, m0 + r < M);
        }
    };
    constexpr int D = SKW_AHEAD;
    float4 wq[D + 1][4];   // [step][row a lo, row a hi, row b lo, row b hi]
#pragma unroll
    for (int q = 0; q < D; ++q) {
        sk_load8<VEC>(wa, k0 + 32 * q + 8 * t, k1, true, wq[q][0], wq[q][1]);
        sk_load8<VEC>(wb, k0 + 32 * q + 8 * t, k1, true, wq[q][2], wq[q][3]);
    }
    load_x(k0);
    for (int kc = k0; kc < k1; kc += SKW_KC) {
        __syncthreads();   // every warpgroup's MMAs on the last chunk are complete
#pragma unroll
        for (int u = 0; u < kXU; ++u) {
            const int f = tid + kThreads * u, r = f / (SKW_KC / 4), o = 4 * (f % (SKW_KC / 4));
            const int sub = o >> 5;
            const float e[4] = {xr[u].x, xr[u].y, xr[u].z, xr[u].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float big = cf_tf32_big(e[i]);
                const int pos = sub * 2048 + skw_xpos(r, (o & 31) + i);
                *reinterpret_cast<float*>(xsm + pos) = big;
                *reinterpret_cast<float*>(xsm + kSub * 2048 + pos) = cf_tf32_rna(e[i] - big);
            }
        }
        cf_fence_proxy_async_smem();
        __syncthreads();
        if (kc + SKW_KC < k1) load_x(kc + SKW_KC);
#pragma unroll 1
        for (int sub = 0; sub < kSub; ++sub) {
            const int ks = kc + 32 * sub;
            if (ks >= k1) break;
            const int kw = ks + 32 * D + 8 * t;
            sk_load8<VEC>(wa, kw, k1, ks + 32 * D < k1, wq[D][0], wq[D][1]);
            sk_load8<VEC>(wb, kw, k1, ks + 32 * D < k1, wq[D][2], wq[D][3]);
            // step s's fragment: rows g, g + 8 at its k = t (element 2s), k = t + 4 (2s + 1)
            unsigned ab[4][4], as[4][4];
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const float v[4] = {sk_elem(wq[0][0], wq[0][1], 2 * s), sk_elem(wq[0][2], wq[0][3], 2 * s),
                                    sk_elem(wq[0][0], wq[0][1], 2 * s + 1),
                                    sk_elem(wq[0][2], wq[0][3], 2 * s + 1)};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    ab[s][i] = __float_as_uint(v[i]);
                    as[s][i] = __float_as_uint(cf_tf32_rna(v[i] - cf_tf32_trunc(v[i])));
                }
            }
            const unsigned xb = xs_addr + sub * 2048, xsmall = xb + kSub * 2048;
            cf_wgmma_fence();
#pragma unroll
            for (int s = 0; s < 4; ++s) cf_wgmma_m64n16k8_tf32_rs(pt, ab[s], cf_desc_sw128(xb + 32 * s), s);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                cf_wgmma_m64n16k8_tf32_rs(c1, ab[s], cf_desc_sw128(xsmall + 32 * s), 1);
                cf_wgmma_m64n16k8_tf32_rs(c2, as[s], cf_desc_sw128(xb + 32 * s), 1);
            }
            cf_wgmma_commit();
            cf_wgmma_wait<0>();
            cf_keep(pt);
            cf_keep(c1);
            cf_keep(c2);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                cf_keep(ab[s]);
                cf_keep(as[s]);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] += pt[i];
#pragma unroll
            for (int q = 0; q < D; ++q)
#pragma unroll
                for (int i = 0; i < 4; ++i) wq[q][i] = wq[q + 1][i];
        }
    }
    // d[4j + 2h + e] is (column nw + g + 8h, row m0 + 8j + 2t + e)
    float* dst = splits == 1 ? y : part + (long long)blockIdx.y * M * N;
    const long long ld = splits == 1 ? ldy : N;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = 4 * j + 2 * h + e, m = m0 + 8 * j + 2 * t + e, n = nw + g + 8 * h;
                const float v = acc[i];
                if (m < M && n < N) dst[(long long)m * ld + n] = isfinite(v) ? v + (c1[i] + c2[i]) : v;
            }
    return skinny_finish(M, N, m0, 16, ctile * kCols, kCols, y, ldy, part, counters, done, ntail);
#endif
}
