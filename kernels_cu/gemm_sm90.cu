// gemm_sm90.cu -- C = A B^T on Hopper tensor cores: A (M x K) and B (N x K) fp32,
// both K-major (row-major), C (M x N) fp32; tf32 wgmma, one pass or three.
//
// Precision: PASSES == 3 is 3xTF32. The host splits every operand v into
// big = tf32(v) and small = tf32(v - big) (split_tf32 below; weights once, as a
// cached derived weight) -- or, in the _splitb variant, the consumers split the fp32
// B box in shared memory each K block (half the B traffic, for skinny M). The kernel accumulates big*big in one set of registers
// and big*small + small*big in another, adds the two in fp32 at the end: float32-
// class accuracy at tensor-core speed. PASSES == 1 is plain TF32 (A and B as given).
//
// Work split: a persistent grid; work item w -> (tile, K split); tiles of
// 128 x 128 outputs in grouped order (cf_tile_origin: operands reused through L2).
// 384 threads = 3 warpgroups:
//   WG0, one thread: the producer. For each K block of 32 it waits until the
//     ring slot is free (`empty`), then has the TMA engine copy the A and B boxes
//     (128 rows x 32 floats each, 128-byte swizzle; 4 boxes for 3xTF32) into the
//     slot, completing on the slot's `full` mbarrier.
//   WG1, WG2: consumers, rows 0-63 and 64-127 of the tile. For each K block they
//     wait on `full`, issue 4 k8 steps of wgmma m64n128k8 (x3 for 3xTF32) from the
//     shared-memory descriptors, wait for them, and release the slot. At the end
//     of a work item each thread writes its 64 (or 2 x 64, summed) accumulators.
// Out-of-range rows/columns/K arrive as zeros from TMA and are not stored.
// Split K (for grids with fewer tiles than SMs) writes partial products to
// C + split * split_stride; the caller sums them.
#include "sm90.cuh"

#define G_BM 128
#define G_BN 128
#define G_BK 32
#define G_TILE_BYTES (G_BM * G_BK * 4)  // 16 KB, one box

// Ring slot contents (16 KB boxes): PASSES 1: [A][B]; PASSES 3: [A big][B big][A small]
// [B small]; PASSES 3 with SPLIT_B: [A big][B as fp32][A small], and after the ring one
// working pair [B big][B small] that the consumers fill from the fp32 box.
// PASSES 3 with HYB 1: [A big][B big][A small][A bf16 | B small bf16]; with HYB 2:
// [A big][B big][A small bf16 | B big bf16][A bf16 | B small bf16]. A 16 KB box split
// in two holds two 8 KB boxes of 32 bf16 (64 bytes) per row, 64-byte swizzle.
// HYB 4 ("skinny": tiles of 64 x 256, both consumer warpgroups on the same 64 rows of A,
// one 128-column half of B each): [A big 8K][A small 8K][A bf16 4K][B 32K][B small bf16 16K],
// B's small half made in shared memory as for HYB 3: 32 KB of weight per slot in flight.
template <int PASSES, bool SPLIT_B, int HYB = 0>
struct GemmCfg {
    static constexpr bool skinny = HYB == 4;
    static constexpr int bm = skinny ? 64 : G_BM;
    static constexpr int bn = skinny ? 256 : G_BN;
    static constexpr int boxes = PASSES == 1 ? 2 : (HYB ? 4 : (SPLIT_B ? 3 : 4));
    static constexpr int stage_bytes = skinny ? 68 * 1024 : boxes * G_TILE_BYTES;
    static constexpr int stages = PASSES == 1 ? 6 : 3;
    static constexpr int work_bytes = SPLIT_B ? 2 * G_TILE_BYTES : 0;
    static constexpr int smem_bytes = stages * stage_bytes + work_bytes + 1024;
    // byte offsets in a slot: A big, B big, A small, A bf16, B small bf16
    static constexpr int off_ab = 0;
    static constexpr int off_bb = skinny ? 20 * 1024 : G_TILE_BYTES;
    static constexpr int off_as = skinny ? 8 * 1024 : 2 * G_TILE_BYTES;
    static constexpr int off_ah = skinny ? 16 * 1024 : 3 * G_TILE_BYTES;
    static constexpr int off_bsh = skinny ? 52 * 1024 : 3 * G_TILE_BYTES + G_TILE_BYTES / 2;
    // what is made in shared memory instead of loaded (HYB 3, 4: B's small half), and
    // whether the producer warpgroup's warps 1-3 make it (HYB 3) or the consumers (HYB 4:
    // each warpgroup its own 128 rows of B, while its MMAs of the previous K block run)
    static constexpr int made_bytes = HYB == 3 ? G_TILE_BYTES / 2 : (skinny ? 16 * 1024 : 0);
    static constexpr bool producer_converts = HYB == 3;
};

__device__ __forceinline__ void cf_consumers_sync() {
    asm volatile("bar.sync 1, 256;" ::: "memory");  // the two consumer warpgroups only
}
__device__ __forceinline__ void cf_wg_sync(int cw) {
    // one consumer warpgroup's 128 threads (named barriers 2 and 3)
    asm volatile("bar.sync %0, 128;" ::"r"(2 + cw) : "memory");
}
__device__ __forceinline__ void cf_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// HYB 3: B's small half made in shared memory. Warps 1-3 of the producer warpgroup (96
// threads at 40 registers) wait for each ring slot's TMA boxes, read the fp32 B box (which
// is also B's big half: the tensor cores truncate it), write bf16(B - trunc(B)) into the
// slot's B-small box and signal `conv`. The weight then streams 4 bytes per element, and
// needs no cached copy. Layouts: the fp32 box has 128-byte rows with the 16-byte chunk c
// of row n at chunk c ^ (n % 8); the bf16 box 64-byte rows, chunk c at c ^ ((n / 2) % 4)
// (the TMA/wgmma 128- and 64-byte swizzles of a 1024-byte aligned box).
#define CF_CONVERTERS 96

__device__ __forceinline__ unsigned cf_small_bf16x2(float a, float b) {
    const float ba = cf_tf32_trunc(a), bb = cf_tf32_trunc(b);
    const float da = isfinite(ba) ? a - ba : 0.f;
    const float db = isfinite(bb) ? b - bb : 0.f;
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(db), "f"(da));  // a in the low half
    return r;
}

// bf16(B - trunc(B)) for 8 values of row n (16-byte chunk j of the bf16 box) from the fp32
// box: the 128-byte swizzle on the way in, the 64-byte swizzle on the way out.
__device__ __forceinline__ void cf_convert_chunk(const unsigned char* braw, unsigned char* bsh,
                                                 int n, int j) {
    const float4 lo = *reinterpret_cast<const float4*>(braw + n * 128 + (((2 * j) ^ (n & 7)) << 4));
    const float4 hi =
        *reinterpret_cast<const float4*>(braw + n * 128 + (((2 * j + 1) ^ (n & 7)) << 4));
    uint4 o;
    o.x = cf_small_bf16x2(lo.x, lo.y);
    o.y = cf_small_bf16x2(lo.z, lo.w);
    o.z = cf_small_bf16x2(hi.x, hi.y);
    o.w = cf_small_bf16x2(hi.z, hi.w);
    *reinterpret_cast<uint4*>(bsh + n * 64 + ((j ^ ((n >> 1) & 3)) << 4)) = o;
}

template <class Cfg>
__device__ __forceinline__ void cf_convert_small_b(unsigned char* smem, unsigned long long* full_bar,
                                                   unsigned long long* conv_bar, int splits,
                                                   int tiles_m, int tiles_n, int kblocks, int total) {
    constexpr int STAGES = Cfg::stages, STAGE_BYTES = Cfg::stage_bytes;
    const int t = threadIdx.x - 32;
    int stage = 0;
    unsigned phase = 0;
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
        int m0, n0, kb0, kb1, split;
        cf_work_item(w, splits, tiles_m, tiles_n, Cfg::bm, Cfg::bn, kblocks, m0, n0, kb0, kb1,
                     split);
        for (int kb = kb0; kb < kb1; ++kb) {
            cf_mbar_wait(&full_bar[stage], phase);
            const unsigned char* braw = smem + stage * STAGE_BYTES + Cfg::off_bb;
            unsigned char* bsh = smem + stage * STAGE_BYTES + Cfg::off_bsh;
            for (int task = t; task < Cfg::bn * 4; task += CF_CONVERTERS)
                cf_convert_chunk(braw, bsh, task >> 2, task & 3);
            cf_fence_proxy_async();  // generic-proxy stores, read next by wgmma
            cf_mbar_arrive(&conv_bar[stage]);
            if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
    }
}

template <int PASSES, bool SPLIT_B, int HYB = 0>
__device__ __forceinline__ void gemm_sm90_impl(
    const CfTensorMap* ta, const CfTensorMap* tb, const CfTensorMap* tas, const CfTensorMap* tbs,
    const CfTensorMap* tah, const CfTensorMap* tbh,
    float* __restrict__ C, int M, int N, int K, long long ldc, int splits, long long split_stride) {
    typedef GemmCfg<PASSES, SPLIT_B, HYB> Cfg;
    constexpr int HALF_TILE = G_TILE_BYTES / 2;
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full_bar[Cfg::stages];
    __shared__ __align__(8) unsigned long long empty_bar[Cfg::stages];
    __shared__ __align__(8) unsigned long long conv_bar[Cfg::producer_converts ? Cfg::stages : 1];
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);

    const int tiles_m = (M + Cfg::bm - 1) / Cfg::bm;
    const int tiles_n = (N + Cfg::bn - 1) / Cfg::bn;
    const int kblocks = (K + G_BK - 1) / G_BK;
    const int total = tiles_m * tiles_n * splits;
    const int wg = threadIdx.x / 128;

#ifdef CF_GEMM_DEBUG
    if (threadIdx.x == 0 && blockIdx.x == 0)
        printf("gemm_sm90: M %d N %d K %d ldc %lld splits %d total %d C %p smem %p\n", M, N, K, ldc,
               splits, total, C, smem);
#endif
    if (threadIdx.x == 0) {
        for (int s = 0; s < Cfg::stages; ++s) {
            cf_mbar_init(&full_bar[s], 1);
            cf_mbar_init(&empty_bar[s], 2);
            if (Cfg::producer_converts) cf_mbar_init(&conv_bar[s], CF_CONVERTERS);
        }
        cf_fence_mbar_init();
    }
    __syncthreads();

    if (wg == 0) {
        cf_setmaxnreg_dec<40>();
        if (Cfg::producer_converts && threadIdx.x >= 32) {
            cf_convert_small_b<Cfg>(smem, full_bar, conv_bar, splits, tiles_m, tiles_n, kblocks,
                                    total);
            return;
        }
        if (threadIdx.x != 0) return;
        cf_prefetch_tensormap(ta);
        cf_prefetch_tensormap(tb);
        if (PASSES == 3) {
            cf_prefetch_tensormap(tas);
            cf_prefetch_tensormap(tbs);
        }
        if (HYB) cf_prefetch_tensormap(tah);
        constexpr unsigned tx_bytes = Cfg::stage_bytes - Cfg::made_bytes;
        if (HYB == 2) cf_prefetch_tensormap(tbh);
        int stage = 0;
        unsigned phase = 0;
        for (int w = blockIdx.x; w < total; w += gridDim.x) {
            int m0, n0, kb0, kb1, split;
            cf_work_item(w, splits, tiles_m, tiles_n, Cfg::bm, Cfg::bn, kblocks, m0, n0, kb0, kb1,
                         split);
            for (int kb = kb0; kb < kb1; ++kb) {
                cf_mbar_wait(&empty_bar[stage], phase ^ 1);
                cf_mbar_arrive_expect_tx(&full_bar[stage], tx_bytes);
                unsigned char* base = smem + stage * Cfg::stage_bytes;
                if (Cfg::skinny) {
                    cf_tma_load_2d(base + Cfg::off_ab, ta, &full_bar[stage], kb * G_BK, m0);
                    cf_tma_load_2d(base + Cfg::off_as, tas, &full_bar[stage], kb * G_BK, m0);
                    cf_tma_load_2d(base + Cfg::off_ah, tah, &full_bar[stage], kb * G_BK, m0);
                    cf_tma_load_2d(base + Cfg::off_bb, tb, &full_bar[stage], kb * G_BK, n0);
                    if (++stage == Cfg::stages) { stage = 0; phase ^= 1; }
                    continue;
                }
                cf_tma_load_2d(base, ta, &full_bar[stage], kb * G_BK, m0);
                cf_tma_load_2d(base + G_TILE_BYTES, tb, &full_bar[stage], kb * G_BK, n0);
                if (PASSES == 3) {
                    cf_tma_load_2d(base + 2 * G_TILE_BYTES, tas, &full_bar[stage], kb * G_BK, m0);
                    if (HYB == 2)
                        cf_tma_load_2d(base + 2 * G_TILE_BYTES + HALF_TILE, tbh, &full_bar[stage],
                                       kb * G_BK, n0);
                    if (HYB) {
                        cf_tma_load_2d(base + 3 * G_TILE_BYTES, tah, &full_bar[stage], kb * G_BK, m0);
                        if (!Cfg::made_bytes)  // HYB 3: the converter warps make B's small half
                            cf_tma_load_2d(base + 3 * G_TILE_BYTES + HALF_TILE, tbs,
                                           &full_bar[stage], kb * G_BK, n0);
                    } else if (!SPLIT_B) {
                        cf_tma_load_2d(base + 3 * G_TILE_BYTES, tbs, &full_bar[stage], kb * G_BK, n0);
                    }
                }
                if (++stage == Cfg::stages) { stage = 0; phase ^= 1; }
            }
        }
#ifdef CF_GEMM_DEBUG
        if (blockIdx.x == 0) printf("producer done\n");
#endif
        return;
    }

    cf_setmaxnreg_inc<232>();
    const int cw = wg - 1;                     // consumer warpgroup: tile rows 64*cw ..
    const int warp = (threadIdx.x % 128) / 32;
    const int lane = threadIdx.x % 32;
    int stage = 0;
    unsigned phase = 0;
    // Hopper's tensor cores add wgmma products into the accumulator with less care than
    // an IEEE fp32 add (the error grows linearly with K: measured 12x SGEMM's at K=32768).
    // So each K block of 32 goes into a fresh `part`, which is then added to `acc` in
    // ordinary fp32 -- the "promotion" of the big*big products. The small cross terms
    // (2^-11 smaller) stay in one wgmma accumulator, `acc2`.
    float acc[64];
    float part[64];
    float acc2[64];  // unused (and optimised away) when PASSES == 1
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
        int m0, n0, kb0, kb1, split;
        cf_work_item(w, splits, tiles_m, tiles_n, Cfg::bm, Cfg::bn, kblocks, m0, n0, kb0, kb1,
                     split);
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
        if (PASSES == 3) {
#pragma unroll
            for (int i = 0; i < 64; ++i) acc2[i] = 0.f;
        }
        // HYB 4: this warpgroup makes the small half of its own 128 rows of B, for the slot
        // it will use next, while the MMAs of the current one run.
        auto convert_own = [&](int st) {
            const unsigned char* braw = smem + st * Cfg::stage_bytes + Cfg::off_bb + cw * 128 * 128;
            unsigned char* bsh = smem + st * Cfg::stage_bytes + Cfg::off_bsh + cw * 128 * 64;
            const int t = threadIdx.x % 128;
#pragma unroll
            for (int q = 0; q < 4; ++q) cf_convert_chunk(braw, bsh, (t >> 2) + 32 * q, t & 3);
            cf_fence_proxy_async();  // generic-proxy stores, read next by wgmma
        };
        if (Cfg::skinny && kb0 < kb1) {
            cf_mbar_wait(&full_bar[stage], phase);
            convert_own(stage);
            cf_wg_sync(cw);
        }
        for (int kb = kb0; kb < kb1; ++kb) {
            if (!Cfg::skinny) cf_mbar_wait(&full_bar[stage], phase);
            if (Cfg::producer_converts) cf_mbar_wait(&conv_bar[stage], phase);
#ifdef CF_GEMM_DEBUG
            if (blockIdx.x == 0 && (threadIdx.x == 128 || threadIdx.x == 256))
                printf("consumer %d: w %d kb %d stage %d passed full wait\n", threadIdx.x, w, kb, stage);
#endif
            const unsigned base = cf_smem_addr(smem + stage * Cfg::stage_bytes);
            // this warpgroup's 64 rows of A (skinny: the tile's only 64) and 128 rows of B
            const int a_rows = Cfg::skinny ? 0 : cw * 64;
            const int b_rows = Cfg::skinny ? cw * 128 : 0;
            const unsigned a_big = base + Cfg::off_ab + a_rows * 128;
            unsigned b_big = base + Cfg::off_bb + b_rows * 128;
            unsigned b_small = base + 3 * G_TILE_BYTES;
            if (SPLIT_B) {
                // Split the fp32 B box into the working big/small pair, element by element
                // (same offsets, so the 128-byte swizzle carries over). Both consumer
                // warpgroups finished reading the pair for the previous K block (each
                // waited for its wgmmas) before anyone writes it again.
                unsigned char* work = smem + Cfg::stages * Cfg::stage_bytes;
                const float4* src = reinterpret_cast<const float4*>(
                    smem + stage * Cfg::stage_bytes + G_TILE_BYTES);
                float4* wb = reinterpret_cast<float4*>(work);
                float4* wsm = reinterpret_cast<float4*>(work + G_TILE_BYTES);
                const int ctid = threadIdx.x - 128;
                cf_consumers_sync();
#pragma unroll
                for (int q = 0; q < G_TILE_BYTES / 16 / 256; ++q) {
                    const int i = ctid + q * 256;
                    const float4 v = src[i];
                    float4 big, sm;
                    big.x = cf_tf32_big(v.x); sm.x = isfinite(big.x) ? cf_tf32_rna(v.x - big.x) : 0.f;
                    big.y = cf_tf32_big(v.y); sm.y = isfinite(big.y) ? cf_tf32_rna(v.y - big.y) : 0.f;
                    big.z = cf_tf32_big(v.z); sm.z = isfinite(big.z) ? cf_tf32_rna(v.z - big.z) : 0.f;
                    big.w = cf_tf32_big(v.w); sm.w = isfinite(big.w) ? cf_tf32_rna(v.w - big.w) : 0.f;
                    wb[i] = big;
                    wsm[i] = sm;
                }
                cf_fence_proxy_async();  // generic-proxy stores, read next by wgmma
                cf_consumers_sync();
                b_big = cf_smem_addr(work);
                b_small = cf_smem_addr(work + G_TILE_BYTES);
            }
            cf_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const unsigned long long da = cf_desc_sw128(a_big + kk * 32);
                const unsigned long long db = cf_desc_sw128(b_big + kk * 32);
                cf_wgmma_m64n128k8_tf32(part, da, db, kk > 0 ? 1 : 0);
                if (PASSES == 3 && HYB != 2) {
                    const unsigned long long das =
                        cf_desc_sw128(base + Cfg::off_as + a_rows * 128 + kk * 32);
                    if (!HYB) {
                        const unsigned long long dbs = cf_desc_sw128(b_small + kk * 32);
                        cf_wgmma_m64n128k8_tf32(acc2, da, dbs, 1);
                    }
                    cf_wgmma_m64n128k8_tf32(acc2, das, db, 1);
                }
            }
            if (HYB) {
                // big(A) * small(B) in bf16: A's bf16 copy (rows of 64 bytes, this warpgroup's
                // 64 rows at 64 * 64 bytes) times B's small half as bf16, two k16 steps; with
                // HYB 2 also small(A) * big(B): A's small half times B's bf16 copy.
                const unsigned a_h = base + Cfg::off_ah + a_rows * 64;
                const unsigned b_h = base + Cfg::off_bsh + b_rows * 64;
                const unsigned a_sh = base + 2 * G_TILE_BYTES + cw * 64 * 64;
                const unsigned b_bh = base + 2 * G_TILE_BYTES + HALF_TILE;
#pragma unroll
                for (int kh = 0; kh < 2; ++kh) {
                    cf_wgmma_m64n128k16_bf16(acc2, cf_desc_sw64(a_h + kh * 32),
                                             cf_desc_sw64(b_h + kh * 32), 1);
                    if (HYB == 2)
                        cf_wgmma_m64n128k16_bf16(acc2, cf_desc_sw64(a_sh + kh * 32),
                                                 cf_desc_sw64(b_bh + kh * 32), 1);
                }
            }
            cf_wgmma_commit();
            int nstage = stage + 1;
            unsigned nphase = phase;
            if (nstage == Cfg::stages) { nstage = 0; nphase ^= 1; }
            if (Cfg::skinny && kb + 1 < kb1) {
                cf_mbar_wait(&full_bar[nstage], nphase);
                convert_own(nstage);
            }
            cf_wgmma_wait<0>();
            if (Cfg::skinny) cf_wg_sync(cw);  // the next slot's small half is complete
            if ((threadIdx.x % 128) == 0) cf_mbar_arrive(&empty_bar[stage]);
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[i] += part[i];
            stage = nstage;
            phase = nphase;
        }
        // Accumulator layout of wgmma m64nN f32: warp w owns rows 16w..16w+15 of the
        // warpgroup's 64; lane l holds rows (l/4) and (l/4 + 8), columns 8j + 2(l%4) + {0,1}.
        float* Cs = C + (long long)split * split_stride;
#ifdef CF_GEMM_DEBUG
        if (blockIdx.x == 0 && (threadIdx.x == 128 || threadIdx.x == 256))
            printf("consumer %d: epilogue w %d acc0 %f\n", threadIdx.x, w, acc[0]);
#endif
        const int r0 = m0 + (Cfg::skinny ? 0 : cw * 64) + warp * 16 + (lane >> 2);
        const int cbase = n0 + (Cfg::skinny ? cw * 128 : 0) + (lane & 3) * 2;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int c = cbase + j * 8;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = r0 + h * 8;
                if (r >= M) continue;
                float v0 = acc[j * 4 + h * 2 + 0];
                float v1 = acc[j * 4 + h * 2 + 1];
                if (PASSES == 3) {
                    // Where big*big is already NaN/inf (an infinite operand), the small
                    // cross terms only add spurious infinities of other signs: skip them,
                    // so the result is the one fp32 arithmetic gives (PyTorch's).
                    const float s0 = acc2[j * 4 + h * 2 + 0], s1 = acc2[j * 4 + h * 2 + 1];
                    v0 = isfinite(v0) ? v0 + s0 : v0;
                    v1 = isfinite(v1) ? v1 + s1 : v1;
                }
                float* p = Cs + (long long)r * ldc + c;
                if (c + 1 < N) {
                    p[0] = v0;
                    p[1] = v1;
                } else if (c < N) {
                    p[0] = v0;
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(384, 1) gemm_sm90_tf32x3(
    const __grid_constant__ CfTensorMap ta, const __grid_constant__ CfTensorMap tb,
    const __grid_constant__ CfTensorMap tas, const __grid_constant__ CfTensorMap tbs,
    float* __restrict__ C, int M, int N, int K, long long ldc, int splits, long long split_stride) {
    gemm_sm90_impl<3, false>(&ta, &tb, &tas, &tbs, nullptr, nullptr, C, M, N, K, ldc, splits,
                             split_stride);
}

// 3xTF32 with the big(A) * small(B) term in bf16 ("hybrid"): B's small half is cached as
// bf16 (2 bytes instead of 4: the weight streams 6 bytes per element instead of 8) and
// multiplied by a bf16 copy of A (`tah`). That term is ~2^-11 of the product, so bf16's
// 2^-9 relative rounding of both factors costs ~2^-19.5 of a product, below the fp32
// accumulation error; the other two products stay tf32. `tbs` maps the bf16 small half.
extern "C" __global__ void __launch_bounds__(384, 1) gemm_sm90_tf32x3h(
    const __grid_constant__ CfTensorMap ta, const __grid_constant__ CfTensorMap tb,
    const __grid_constant__ CfTensorMap tas, const __grid_constant__ CfTensorMap tbs,
    const __grid_constant__ CfTensorMap tah,
    float* __restrict__ C, int M, int N, int K, long long ldc, int splits, long long split_stride) {
    gemm_sm90_impl<3, false, 1>(&ta, &tb, &tas, &tbs, &tah, nullptr, C, M, N, K, ldc, splits,
                                split_stride);
}

// The hybrid kernel for skinny batches (memory-bound on the weight): B (the weight) is
// read once as fp32, its small half made in shared memory (cf_convert_small_b above).
// `ta` A as it is, `tb` B as it is, `tas` A's small half (tf32), `tah` bf16(A); `tbs` unused.
extern "C" __global__ void __launch_bounds__(384, 1) gemm_sm90_tf32x3hs(
    const __grid_constant__ CfTensorMap ta, const __grid_constant__ CfTensorMap tb,
    const __grid_constant__ CfTensorMap tas, const __grid_constant__ CfTensorMap tbs,
    const __grid_constant__ CfTensorMap tah,
    float* __restrict__ C, int M, int N, int K, long long ldc, int splits, long long split_stride) {
    gemm_sm90_impl<3, false, 3>(&ta, &tb, &tas, &tbs, &tah, nullptr, C, M, N, K, ldc, splits,
                                split_stride);
}

// The hybrid kernel with skinny tiles (64 x 256) and B's small half made in shared memory,
// for batches of few rows: per ring slot 32 KB of the weight in flight instead of 16.
// Maps: `ta` A as it is (64-row boxes), `tas` A's small half (tf32), `tah` bf16(A) (64-row
// boxes), `tb` B as it is (256-row boxes); `tbs` unused.
extern "C" __global__ void __launch_bounds__(384, 1) gemm_sm90_tf32x3hk(
    const __grid_constant__ CfTensorMap ta, const __grid_constant__ CfTensorMap tb,
    const __grid_constant__ CfTensorMap tas, const __grid_constant__ CfTensorMap tbs,
    const __grid_constant__ CfTensorMap tah,
    float* __restrict__ C, int M, int N, int K, long long ldc, int splits, long long split_stride) {
    gemm_sm90_impl<3, false, 4>(&ta, &tb, &tas, &tbs, &tah, nullptr, C, M, N, K, ldc, splits,
                                split_stride);
}

// 3xTF32 with both cross products in bf16 ("hybrid 2"): big(A) * big(B) in tf32;
// small(A) * big(B) as bf16(A - A big) * bf16(B) and big(A) * small(B) as bf16(A) *
// bf16(B - B big). Each cross term costs ~2^-19.5 of a product (as in gemm_sm90_tf32x3h)
// and runs at bf16's double rate: 2 tf32-pass equivalents of tensor work instead of 3
// (2.5 for _tf32x3h), for compute-bound shapes; the weight streams 8 bytes per element.
// `tas`/`tbs` map the bf16 small halves, `tah`/`tbh` the bf16 copies of A and B.
extern "C" __global__ void __launch_bounds__(384, 1) gemm_sm90_tf32x3h2(
    const __grid_constant__ CfTensorMap ta, const __grid_constant__ CfTensorMap tb,
    const __grid_constant__ CfTensorMap tas, const __grid_constant__ CfTensorMap tbs,
    const __grid_constant__ CfTensorMap tah, const __grid_constant__ CfTensorMap tbh,
    float* __restrict__ C, int M, int N, int K, long long ldc, int splits, long long split_stride) {
    gemm_sm90_impl<3, false, 2>(&ta, &tb, &tas, &tbs, &tah, &tbh, C, M, N, K, ldc, splits,
                                split_stride);
}

// 3xTF32 with B (the weight) loaded once as fp32 and split in shared memory: half the
// B traffic of the pre-split kernel, for the memory-bound skinny-M shapes. `tbs` unused.
extern "C" __global__ void __launch_bounds__(384, 1) gemm_sm90_tf32x3_splitb(
    const __grid_constant__ CfTensorMap ta, const __grid_constant__ CfTensorMap tb,
    const __grid_constant__ CfTensorMap tas, const __grid_constant__ CfTensorMap tbs,
    float* __restrict__ C, int M, int N, int K, long long ldc, int splits, long long split_stride) {
    gemm_sm90_impl<3, true>(&ta, &tb, &tas, &tbs, nullptr, nullptr, C, M, N, K, ldc, splits,
                            split_stride);
}

extern "C" __global__ void __launch_bounds__(384, 1) gemm_sm90_tf32(
    const __grid_constant__ CfTensorMap ta, const __grid_constant__ CfTensorMap tb,
    const __grid_constant__ CfTensorMap tas, const __grid_constant__ CfTensorMap tbs,
    float* __restrict__ C, int M, int N, int K, long long ldc, int splits, long long split_stride) {
    gemm_sm90_impl<1, false>(&ta, &tb, &tas, &tbs, nullptr, nullptr, C, M, N, K, ldc, splits,
                             split_stride);
}

// big = tf32(v) (cf_tf32_big: never inf for a finite v), small = tf32(v - big) for n
// floats (small = 0 where big is not finite, so an infinite input stays one infinity
// rather than inf - inf = NaN).
extern "C" __global__ void __launch_bounds__(256) split_tf32(
    const float* __restrict__ v, long long n, float* __restrict__ big, float* __restrict__ small) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float x = v[i];
        const float b = cf_tf32_big(x);
        big[i] = b;
        small[i] = isfinite(b) ? cf_tf32_rna(x - b) : 0.0f;
    }
}

// The operand copies of the hybrid 3xTF32 kernel, for a rows x cols fp32 matrix v (row
// stride ld_in; cols a multiple of 4), one thread per 4 columns:
//   big     = tf32(v) (cf_tf32_big), fp32, row stride cols          (if big != 0)
//   small   = tf32(v - big), fp32, row stride cols                  (if small != 0)
//   small_h = bf16(v - big), row stride ld_h                        (if small_h != 0)
//   half    = bf16(v), row stride ld_h                              (if half != 0)
// The small halves are 0 where big is not finite (one infinity stays one infinity).
// ld_h is cols rounded up to a multiple of 8; the bf16 padding columns are zeroed.
//
// trunc_big != 0: big is tf32 by truncation (the low 13 bits cleared) -- what the tensor
// cores read from the fp32 bits of v themselves, so v can be the big operand as it is and
// `big` may be null. (Truncation never overflows; small is then up to 2^-10 of v.)
extern "C" __global__ void __launch_bounds__(256) split_hybrid(
    const float* __restrict__ v, long long rows, int cols, long long ld_in,
    float* __restrict__ big, float* __restrict__ small, unsigned short* __restrict__ small_h,
    unsigned short* __restrict__ half, long long ld_h, int trunc_big) {
    const long long groups = ld_h / 4;
    const long long total = rows * groups;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long r = i / groups;
        const int c0 = (int)(i - r * groups) * 4;
        ushort4 sh = make_ushort4(0, 0, 0, 0), hh = make_ushort4(0, 0, 0, 0);
        if (c0 < cols) {
            const float4 x = *reinterpret_cast<const float4*>(v + r * ld_in + c0);
            float4 b, d;
            if (trunc_big) {
                b.x = cf_tf32_trunc(x.x); b.y = cf_tf32_trunc(x.y);
                b.z = cf_tf32_trunc(x.z); b.w = cf_tf32_trunc(x.w);
            } else {
                b.x = cf_tf32_big(x.x); b.y = cf_tf32_big(x.y);
                b.z = cf_tf32_big(x.z); b.w = cf_tf32_big(x.w);
            }
            d.x = isfinite(b.x) ? x.x - b.x : 0.f;
            d.y = isfinite(b.y) ? x.y - b.y : 0.f;
            d.z = isfinite(b.z) ? x.z - b.z : 0.f;
            d.w = isfinite(b.w) ? x.w - b.w : 0.f;
            if (big) *reinterpret_cast<float4*>(big + r * cols + c0) = b;
            if (small)
                *reinterpret_cast<float4*>(small + r * cols + c0) = make_float4(
                    cf_tf32_rna(d.x), cf_tf32_rna(d.y), cf_tf32_rna(d.z), cf_tf32_rna(d.w));
            sh = make_ushort4(cf_bf16_bits(d.x), cf_bf16_bits(d.y), cf_bf16_bits(d.z),
                              cf_bf16_bits(d.w));
            hh = make_ushort4(cf_bf16_bits(x.x), cf_bf16_bits(x.y), cf_bf16_bits(x.z),
                              cf_bf16_bits(x.w));
        }
        if (small_h) *reinterpret_cast<ushort4*>(small_h + r * ld_h + c0) = sh;
        if (half) *reinterpret_cast<ushort4*>(half + r * ld_h + c0) = hh;
    }
}

// C[i] = sum over s < splits of P[s * split_stride + i], for i < M x N (row stride ld):
// the fixed-order reduction of split-K partial products.
extern "C" __global__ void __launch_bounds__(256) splitk_sum(
    const float* __restrict__ P, int splits, long long split_stride, int M, int N, long long ld,
    float* __restrict__ C, long long ldc) {
    const long long total = (long long)M * N;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long r = i / N, c = i % N;
        float s = 0.f;
        for (int k = 0; k < splits; ++k) s += P[k * split_stride + r * ld + c];
        C[r * ldc + c] = s;
    }
}
