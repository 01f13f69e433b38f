#pragma once
// gemm_skinny.cuh -- y = x @ W.T for few rows of x, reading each weight element once per
// launch: the GEMM of small batches, which is bound by streaming the weight (the engine's
// 3xTF32 would stream 1.5x its bytes, its pre-split copies, for nothing). Row tiles of up
// to 8 rows run in plain fp32 FMAs (skinny_tile); tiles of 16 rows in 3xTF32 on mma.sync
// with the weight split in registers (skinny_tile_tc, at the end of this file).
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
// The tensor-core form for tiles of 16 rows (13-16 rows of a large weight): 3xTF32 on
// mma.sync.m16n8k8, each fp32 weight element still read once (split into its tf32 big
// half and the tf32 of the remainder in registers), x split the same way per K step.
// Products big*big + big*small + small*big; each K step of 32 sums big*big in a fresh
// fragment and adds it to the row's fp32 sum (the tensor cores' own adds truncate), the
// two cross terms (2^-11 of a product) run in one fragment. Where the big*big sum is not
// finite (an infinite or NaN operand, or an overflow) the cross terms are dropped, so the
// result is what fp32 arithmetic gives.
//
// Block: SKT_WARPS warps; warp w owns the SKT_NG groups of 8 columns n0 + 8j (j < SKT_NG)
// and the tile's 16 rows. mma's fragments pair lane (g = lane / 4, t = lane % 4) with
// row g (and g + 8), column g of a group, and k = t, t + 4 of a k8 step. K's order inside
// a step is free, so lane (g, t) reads the 8 contiguous floats kc + 8t .. kc + 8t + 7 of
// its rows and columns (float4 pairs: a warp reads whole 128-byte rows) and step s takes
// its elements 2s and 2s + 1 as the step's k = t and k = t + 4.
// Knobs (H100, tools/skinny_tc_probe.py): SKT_WARPS warps per block, SKT_NG column groups
// per warp, SKT_AHEAD K steps of the weight loaded ahead into registers, SKT_MINB blocks
// per SM in the launch bounds of every kernel holding the tile (128 registers: 2 blocks of
// 8 warps are resident, which engine.skinny_plan's grid counts on).
#ifndef SKT_WARPS
#define SKT_WARPS 8
#endif
#ifndef SKT_NG
#define SKT_NG 2
#endif
#ifndef SKT_AHEAD
#define SKT_AHEAD 1
#endif
#ifndef SKT_MINB
#define SKT_MINB 2
#endif
#ifndef SKT_PF
#define SKT_PF 0
#endif

__device__ __forceinline__ unsigned sk_tf32(float v) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}

// d = a * b + c on one m16n8k8 tf32 fragment
__device__ __forceinline__ void sk_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                       unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// v's tf32 halves: big = tf32(v) (round to nearest), small = tf32(v - big) (v - big is
// exact; NaN where v is not finite, dropped with the big*big sum's non-finite value)
__device__ __forceinline__ void sk_split(float v, unsigned& big, unsigned& small) {
    big = sk_tf32(v);
    small = sk_tf32(v - __uint_as_float(big));
}

// A float4 of the weight; with SK_W256 the L2 fetches the whole 256-byte block around it
// from memory (the tiles' warps read only 64-128 bytes of a row per instruction)
#ifndef SK_W256
#define SK_W256 0
#endif
template <int HINT>
__device__ __forceinline__ float4 sk_ld4(const float* p) {
    float4 v;
    if (HINT == 256)
        asm("ld.global.nc.L2::256B.v4.f32 {%0, %1, %2, %3}, [%4];"
            : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    else if (HINT == 128)
        asm("ld.global.nc.L2::128B.v4.f32 {%0, %1, %2, %3}, [%4];"
            : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    else
        v = __ldg(reinterpret_cast<const float4*>(p));
    return v;
}

// 8 floats p[k .. k+7] of a row, zeros past k1 (VEC: k1 and k multiples of 4, 16-byte
// aligned rows)
template <int VEC, int HINT = 0>
__device__ __forceinline__ void sk_load8(const float* __restrict__ p, int k, int k1, bool ok,
                                         float4& lo, float4& hi) {
    if (VEC) {
        lo = ok && k < k1 ? sk_ld4<HINT>(p + k) : make_float4(0.f, 0.f, 0.f, 0.f);
        hi = ok && k + 4 < k1 ? sk_ld4<HINT>(p + k + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
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

// Lanes 0-15 pull the 128-byte line at k of rows r0 .. r0 + 15 (ld apart, clamped to
// the last row) into L2 ahead of their loads: more of the weight in flight than the
// registers hold (SKT_PF / SKW_PF K steps of 32 ahead; 0: none).
__device__ __forceinline__ void sk_prefetch_rows(const float* __restrict__ w, long long ldw, int r0,
                                                 int N, int k, int k1, int lane) {
    if (lane < 16 && k < k1) {
        const float* p = w + (long long)min(r0 + lane, N - 1) * ldw + k;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
}

// One K step of 32 for a warp: its NG column groups' weight floats (wl, wh: lane (g, t)'s 8
// of column n0 + 8j + g) and x's (rows g and g + 8) -> acc (big*big, promoted) and acc2
template <int NG>
__device__ __forceinline__ void sk_tc_step(float (&acc)[NG][4], float (&acc2)[NG][4],
                                           const float4 (&wl)[NG], const float4 (&wh)[NG],
                                           const float4& xal, const float4& xah,
                                           const float4& xbl, const float4& xbh) {
    float pt[NG][4];
#pragma unroll
    for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) pt[j][i] = 0.f;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        unsigned ab[4], as[4];
        sk_split(sk_elem(xal, xah, 2 * s), ab[0], as[0]);
        sk_split(sk_elem(xbl, xbh, 2 * s), ab[1], as[1]);
        sk_split(sk_elem(xal, xah, 2 * s + 1), ab[2], as[2]);
        sk_split(sk_elem(xbl, xbh, 2 * s + 1), ab[3], as[3]);
#pragma unroll
        for (int j = 0; j < NG; ++j) {
            unsigned b0, b1, s0, s1;
            sk_split(sk_elem(wl[j], wh[j], 2 * s), b0, s0);
            sk_split(sk_elem(wl[j], wh[j], 2 * s + 1), b1, s1);
            sk_mma(pt[j], ab, b0, b1);
            sk_mma(acc2[j], ab, s0, s1);
            sk_mma(acc2[j], as, b0, b1);
        }
    }
#pragma unroll
    for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] += pt[j][i];
}

template <int VEC>
__device__ __forceinline__ int skinny_tile_tc(
    const float* __restrict__ x, long long ldx, const float* __restrict__ w, long long ldw,
    int M, int N, int K, int kspan, float* __restrict__ y, long long ldy,
    float* __restrict__ part, unsigned int* __restrict__ counters,
    unsigned int* __restrict__ done, int ntail) {
    constexpr int NG = SKT_NG;
    constexpr int kCols = SKT_WARPS * 8 * NG;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int rtiles = (M + 15) / 16;
    const int ctile = blockIdx.x / rtiles;
    const int m0 = (blockIdx.x - ctile * rtiles) * 16;
    const int n0 = ctile * kCols + warp * 8 * NG;
    const int k0 = blockIdx.y * kspan;
    const int k1 = min(K, k0 + kspan);
    const int splits = gridDim.y;
    const int ra = m0 + g, rb = m0 + g + 8;
    const float* xa = x + (long long)min(ra, M - 1) * ldx;
    const float* xb = x + (long long)min(rb, M - 1) * ldx;
    // columns past the edge read column n0 + g's row (valid memory) and are never stored
    const float* wb = w + (long long)min(n0 + g, N - 1) * ldw;
    int woff[NG];
#pragma unroll
    for (int j = 0; j < NG; ++j) woff[j] = n0 + 8 * j + g < N ? 8 * j * (int)ldw : 0;
    float acc[NG][4], acc2[NG][4];
#pragma unroll
    for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = acc2[j][i] = 0.f;
    {
        // the weight's raw floats SKT_AHEAD K steps ahead in registers (wq[0]: this step's),
        // x's one step ahead
        constexpr int D = SKT_AHEAD;
        float4 wq[D + 1][NG][2], xal, xah, xbl, xbh;
#pragma unroll
        for (int q = 0; q < D; ++q)
#pragma unroll
            for (int j = 0; j < NG; ++j)
                sk_load8<VEC, SK_W256>(wb + woff[j], k0 + 32 * q + 8 * t, k1, true, wq[q][j][0], wq[q][j][1]);
        sk_load8<VEC>(xa, k0 + 8 * t, k1, ra < M, xal, xah);
        sk_load8<VEC>(xb, k0 + 8 * t, k1, rb < M, xbl, xbh);
        for (int kc = k0; kc < k1; kc += 32) {
#if SKT_PF > 0
            // the warp's NG groups: rows n0 .. n0 + 8 NG - 1
#pragma unroll
            for (int j = 0; j < NG; j += 2)
                sk_prefetch_rows(w, ldw, n0 + 8 * j, N, kc + 32 * SKT_PF, k1, lane);
#endif
            float4 nxal, nxah, nxbl, nxbh;
            const int kw = kc + 32 * D + 8 * t, kn = kc + 32 + 8 * t;
#pragma unroll
            for (int j = 0; j < NG; ++j)
                sk_load8<VEC, SK_W256>(wb + woff[j], kw, k1, kc + 32 * D < k1, wq[D][j][0], wq[D][j][1]);
            sk_load8<VEC>(xa, kn, k1, kc + 32 < k1 && ra < M, nxal, nxah);
            sk_load8<VEC>(xb, kn, k1, kc + 32 < k1 && rb < M, nxbl, nxbh);
            float4 wl[NG], wh[NG];
#pragma unroll
            for (int j = 0; j < NG; ++j) {
                wl[j] = wq[0][j][0];
                wh[j] = wq[0][j][1];
            }
            sk_tc_step<NG>(acc, acc2, wl, wh, xal, xah, xbl, xbh);
#pragma unroll
            for (int q = 0; q < D; ++q)
#pragma unroll
                for (int j = 0; j < NG; ++j) {
                    wq[q][j][0] = wq[q + 1][j][0];
                    wq[q][j][1] = wq[q + 1][j][1];
                }
            xal = nxal; xah = nxah; xbl = nxbl; xbh = nxbh;
        }
    }
    float* dst = splits == 1 ? y : part + (long long)blockIdx.y * M * N;
    const long long ld = splits == 1 ? ldy : N;
#pragma unroll
    for (int j = 0; j < NG; ++j) {
        const int c = n0 + 8 * j + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = h ? rb : ra;
            if (r >= M) continue;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float v = acc[j][2 * h + e];
                if (c + e < N) dst[(long long)r * ld + c + e] = isfinite(v) ? v + acc2[j][2 * h + e] : v;
            }
        }
    }
    return skinny_finish(M, N, m0, 16, ctile * kCols, kCols, y, ldy, part, counters, done, ntail);
}

// ---------------------------------------------------------------------------------------
// The warpgroup form of the 16-row tile (skinny_tile_wg): the same 3xTF32 products as
// skinny_tile_tc, on wgmma with the roles turned round -- the weight is the m64 operand
// (64 columns of y per warpgroup, A from registers: each fp32 weight element read once
// from memory and split in registers), x the n16 operand, read by the tensor cores from
// shared memory. x's 16 rows of a chunk of SKW_KC K are loaded once per block (one float4
// per thread and 64 K, a chunk ahead in registers), split into tf32 big and small halves
// and stored in the 128-byte swizzled K-major layout of a wgmma descriptor; the warps
// then read no x at all (skinny_tile_tc's warps each load every x row: as many bytes
// through L1 as the weight's). K's order inside a step of 8 is free, so lane (g, t) reads
// the 8 contiguous floats kc + 8t .. + 7 of its two weight rows (whole 128-byte rows per
// warp) and x is stored permuted to match (skw_xpos). Each K step of 32 sums big*big in a
// fresh accumulator added to the fp32 sum (the tensor cores' adds truncate); the cross
// terms run in one accumulator, dropped where the big*big sum is not finite.
// Knobs: SKW_WG warpgroups per block, SKW_AHEAD K steps of 32 of the weight in flight
// ahead in registers, SKW_MINB blocks per SM in the launch bounds.
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
#ifndef SKW_CHAINS
#define SKW_CHAINS 2
#endif
#ifndef SKW_PF
#define SKW_PF 0
#endif
#ifndef SKW_WSPLIT
#define SKW_WSPLIT 0
#endif
#ifndef SKW_DIAG
#define SKW_DIAG 0
#endif

#include "sm90.cuh"

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
    float acc[8], acc2[8], pt[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = acc2[i] = pt[i] = 0.f;
#if SKW_CHAINS == 3
    float acc3[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc3[i] = 0.f;
#endif
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
        sk_load8<VEC, SK_W256>(wa, k0 + 32 * q + 8 * t, k1, true, wq[q][0], wq[q][1]);
        sk_load8<VEC, SK_W256>(wb, k0 + 32 * q + 8 * t, k1, true, wq[q][2], wq[q][3]);
    }
    load_x(k0);
    for (int kc = k0; kc < k1; kc += SKW_KC) {
        __syncthreads();   // every warpgroup's MMAs on the last chunk are complete
#pragma unroll
        for (int u = 0; u < (SKW_DIAG == 2 && kc > k0 ? 0 : kXU); ++u) {
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
#if SKW_PF > 0
            sk_prefetch_rows(w, ldw, nw, N, ks + 32 * SKW_PF, k1, lane);
#endif
            const int kw = ks + 32 * D + 8 * t;
            sk_load8<VEC, SK_W256>(wa, kw, k1, ks + 32 * D < k1, wq[D][0], wq[D][1]);
            sk_load8<VEC, SK_W256>(wb, kw, k1, ks + 32 * D < k1, wq[D][2], wq[D][3]);
            unsigned ab[4][4], as[4][4];
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const float v[4] = {sk_elem(wq[0][0], wq[0][1], 2 * s), sk_elem(wq[0][2], wq[0][3], 2 * s),
                                    sk_elem(wq[0][0], wq[0][1], 2 * s + 1),
                                    sk_elem(wq[0][2], wq[0][3], 2 * s + 1)};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
#if SKW_WSPLIT == 1
                    // the tensor cores read v's tf32 truncation: big = v as it is, small = the
                    // rest (exact), rounded to tf32
                    ab[s][i] = __float_as_uint(v[i]);
                    as[s][i] = __float_as_uint(cf_tf32_rna(v[i] - cf_tf32_trunc(v[i])));
#else
                    const float big = cf_tf32_big(v[i]);
                    ab[s][i] = __float_as_uint(big);
                    as[s][i] = __float_as_uint(cf_tf32_rna(v[i] - big));
#endif
                }
            }
            const unsigned xb = xs_addr + sub * 2048, xsmall = xb + kSub * 2048;
            cf_wgmma_fence();
#pragma unroll
            for (int s = 0; s < 4; ++s) cf_wgmma_m64n16k8_tf32_rs(pt, ab[s], cf_desc_sw128(xb + 32 * s), s);
#if SKW_DIAG != 1
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                cf_wgmma_m64n16k8_tf32_rs(acc2, ab[s], cf_desc_sw128(xsmall + 32 * s), 1);
#if SKW_CHAINS == 3
                cf_wgmma_m64n16k8_tf32_rs(acc3, as[s], cf_desc_sw128(xb + 32 * s), 1);
#else
                cf_wgmma_m64n16k8_tf32_rs(acc2, as[s], cf_desc_sw128(xb + 32 * s), 1);
#endif
            }
#endif
            cf_wgmma_commit();
            cf_wgmma_wait<0>();
            cf_keep(pt);
            cf_keep(acc2);
#if SKW_CHAINS == 3
            cf_keep(acc3);
#endif
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
    float* dst = splits == 1 ? y : part + (long long)blockIdx.y * M * N;
    const long long ld = splits == 1 ? ldy : N;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = m0 + 8 * j + 2 * t + e, n = nw + g + 8 * h;
                const float v = acc[4 * j + 2 * h + e];
#if SKW_CHAINS == 3
                const float v2 = acc2[4 * j + 2 * h + e] + acc3[4 * j + 2 * h + e];
#else
                const float v2 = acc2[4 * j + 2 * h + e];
#endif
                if (m < M && n < N) dst[(long long)m * ld + n] = isfinite(v) ? v + v2 : v;
            }
    return skinny_finish(M, N, m0, 16, ctile * kCols, kCols, y, ldy, part, counters, done, ntail);
}
