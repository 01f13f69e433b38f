// gemm_sm90.cuh -- the Hopper 3xTF32 GEMM mainloop, C = A B^T, with the epilogue as a
// template parameter: A (M x K) and B (N x K) fp32, both K-major (row-major).
//
// Precision: 3xTF32. Every operand v is split into big = tf32(v) and small =
// tf32(v - big) (split_hybrid in gemm_sm90.cu; weights once, as a cached derived
// weight). The kernel accumulates big*big in one set of registers and the cross terms in
// another, adds the two in fp32 at the end: float32-class accuracy at tensor-core speed.
// The cross term big(A) * small(B) runs in bf16 (B's small half as bf16: the weight
// streams 6 bytes per element instead of 8); small(A) * big(B) is tf32.
//
// Work split: a persistent grid; work item w -> (tile, K split); tiles of
// 128 x 128 outputs in grouped order (cf_tile_origin: operands reused through L2).
// 384 threads = 3 warpgroups:
//   WG0, one thread: the producer. For each K block of 32 it waits until the
//     ring slot is free (`empty`), then has the TMA engine copy the A and B boxes
//     (128 rows x 32 floats each, 128-byte swizzle; 4 boxes of 16 KB) into the
//     slot, completing on the slot's `full` mbarrier.
//   WG1, WG2: consumers, rows 0-63 and 64-127 of the tile. For each K block they
//     wait on `full`, issue 4 k8 steps of wgmma m64n128k8 (two tf32 products each)
//     and 2 k16 steps of bf16 wgmma from the shared-memory descriptors, wait for
//     them, and release the slot. At the end of a work item each thread hands its
//     2 x 64 outputs to the epilogue, in registers.
// Out-of-range rows/columns/K arrive as zeros from TMA and never reach the epilogue.
//
// The epilogue (a type Epi, one object per thread):
//   Acc                     a thread's accumulators for one row (empty without reductions)
//   begin_tile(split)       before a tile's elements (split: its K split)
//   reset(acc)              acc := the identities
//   elem(r, c, v, acc)      every output element (r < M, c < N): write it, or what the tail
//                           makes of it, and/or fold it into row r's acc
//   kRows                   true: row reductions across the N tiles. Then after each tile
//     combine_lanes(acc)    combines a row's acc over the 4 lanes holding it (xor 1, 2),
//     partial(r, tn, tiles_n, acc)  stores the tile's part (tile column tn),
//     counters[m-tile]      counts finished tiles per 128-row block; the CTA finishing the
//                           last one re-arms the counter to 0 and calls
//     row_final(r, tiles_n) for each row of the block (combine the parts in tile order,
//                           finish the row's values): deterministic, one launch.
// With kRows the grid must not split K (splits == 1).
#pragma once
#include "sm90.cuh"

#define G_BM 128
#define G_BN 128
#define G_BK 32
#define G_TILE_BYTES (G_BM * G_BK * 4)  // 16 KB, one box

// the two consumer warpgroups (threads 128-383) only: named barrier 1
__device__ __forceinline__ void cf_consumers_sync() {
    asm volatile("bar.sync 1, 256;" ::: "memory");
}

// Ring slot contents (16 KB boxes): [A big][B big][A small][A bf16 | B small bf16]. The
// last 16 KB box split in two holds two 8 KB boxes of 32 bf16 (64 bytes) per row, 64-byte
// swizzle.
struct GemmCfg {
    static constexpr int boxes = 4;
    static constexpr int stage_bytes = boxes * G_TILE_BYTES;
    static constexpr int stages = 3;
    static constexpr int smem_bytes = stages * stage_bytes + 1024;
    // byte offsets in a slot: A big, B big, A small (tf32), A bf16, B small bf16
    static constexpr int off_ab = 0;
    static constexpr int off_bb = G_TILE_BYTES;
    static constexpr int off_as = 2 * G_TILE_BYTES;
    static constexpr int off_ah = 3 * G_TILE_BYTES;
    static constexpr int off_bsh = 3 * G_TILE_BYTES + G_TILE_BYTES / 2;
};

template <class Epi>
__device__ __forceinline__ void gemm_sm90_impl(
    const CfTensorMap* ta, const CfTensorMap* tb, const CfTensorMap* tas, const CfTensorMap* tbs,
    const CfTensorMap* tah, int M, int N, int K, int splits, Epi& epi) {
    typedef GemmCfg Cfg;
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full_bar[Cfg::stages];
    __shared__ __align__(8) unsigned long long empty_bar[Cfg::stages];
    __shared__ int last_tile;   // kRows: this CTA finished a row block's last tile
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);

    const int tiles_m = (M + G_BM - 1) / G_BM;
    const int tiles_n = (N + G_BN - 1) / G_BN;
    const int kblocks = (K + G_BK - 1) / G_BK;
    const int total = tiles_m * tiles_n * splits;
    const int wg = threadIdx.x / 128;

#ifdef CF_GEMM_DEBUG
    if (threadIdx.x == 0 && blockIdx.x == 0)
        printf("gemm_sm90: M %d N %d K %d splits %d total %d smem %p\n", M, N, K, splits, total,
               smem);
#endif
    if (threadIdx.x == 0) {
        for (int s = 0; s < Cfg::stages; ++s) {
            cf_mbar_init(&full_bar[s], 1);
            cf_mbar_init(&empty_bar[s], 2);
        }
        cf_fence_mbar_init();
    }
    __syncthreads();

    if (wg == 0) {
        cf_setmaxnreg_dec<40>();
        if (threadIdx.x != 0) return;
        cf_prefetch_tensormap(ta);
        cf_prefetch_tensormap(tb);
        cf_prefetch_tensormap(tas);
        cf_prefetch_tensormap(tbs);
        cf_prefetch_tensormap(tah);
        int stage = 0;
        unsigned phase = 0;
        for (int w = blockIdx.x; w < total; w += gridDim.x) {
            int m0, n0, kb0, kb1, split;
            cf_work_item(w, splits, tiles_m, tiles_n, G_BM, G_BN, kblocks, m0, n0, kb0, kb1, split);
            for (int kb = kb0; kb < kb1; ++kb) {
                cf_mbar_wait(&empty_bar[stage], phase ^ 1);
                cf_mbar_arrive_expect_tx(&full_bar[stage], Cfg::stage_bytes);
                unsigned char* base = smem + stage * Cfg::stage_bytes;
                cf_tma_load_2d(base + Cfg::off_ab, ta, &full_bar[stage], kb * G_BK, m0);
                cf_tma_load_2d(base + Cfg::off_bb, tb, &full_bar[stage], kb * G_BK, n0);
                cf_tma_load_2d(base + Cfg::off_as, tas, &full_bar[stage], kb * G_BK, m0);
                cf_tma_load_2d(base + Cfg::off_ah, tah, &full_bar[stage], kb * G_BK, m0);
                cf_tma_load_2d(base + Cfg::off_bsh, tbs, &full_bar[stage], kb * G_BK, n0);
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
    unsigned phase = 0;  // (declared before `stage`: keeps the SASS byte-identical to
    int stage = 0;       // the kernels of tag engine-variants-v13)
    // Hopper's tensor cores add wgmma products into the accumulator with less care than
    // an IEEE fp32 add (the error grows linearly with K: measured 12x SGEMM's at K=32768).
    // So each K block of 32 goes into a fresh `part`, which is then added to `acc` in
    // ordinary fp32 -- the "promotion" of the big*big products. The small cross terms
    // (2^-11 smaller) stay in one wgmma accumulator, `acc2`.
    float acc[64];
    float part[64];
    float acc2[64];
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
        int m0, n0, kb0, kb1, split;
        cf_work_item(w, splits, tiles_m, tiles_n, G_BM, G_BN, kblocks, m0, n0, kb0, kb1, split);
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
#pragma unroll
        for (int i = 0; i < 64; ++i) acc2[i] = 0.f;
        for (int kb = kb0; kb < kb1; ++kb) {
            cf_mbar_wait(&full_bar[stage], phase);
#ifdef CF_GEMM_DEBUG
            if (blockIdx.x == 0 && (threadIdx.x == 128 || threadIdx.x == 256))
                printf("consumer %d: w %d kb %d stage %d passed full wait\n", threadIdx.x, w, kb, stage);
#endif
            const unsigned base = cf_smem_addr(smem + stage * Cfg::stage_bytes);
            // this warpgroup's 64 rows of A and all 128 rows of B
            const int a_rows = cw * 64;
            const unsigned a_big = base + Cfg::off_ab + a_rows * 128;
            const unsigned b_big = base + Cfg::off_bb;
            cf_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const unsigned long long da = cf_desc_sw128(a_big + kk * 32);
                const unsigned long long db = cf_desc_sw128(b_big + kk * 32);
                cf_wgmma_m64n128k8_tf32(part, da, db, kk > 0 ? 1 : 0);
                const unsigned long long das =
                    cf_desc_sw128(base + Cfg::off_as + a_rows * 128 + kk * 32);
                cf_wgmma_m64n128k8_tf32(acc2, das, db, 1);
            }
            {
                // big(A) * small(B) in bf16: A's bf16 copy (rows of 64 bytes, this warpgroup's
                // 64 rows at 64 * 64 bytes) times B's small half as bf16, two k16 steps.
                const unsigned a_h = base + Cfg::off_ah + a_rows * 64;
                const unsigned b_h = base + Cfg::off_bsh;
#pragma unroll
                for (int kh = 0; kh < 2; ++kh)
                    cf_wgmma_m64n128k16_bf16(acc2, cf_desc_sw64(a_h + kh * 32),
                                             cf_desc_sw64(b_h + kh * 32), 1);
            }
            cf_wgmma_commit();
            int nstage = stage + 1;
            unsigned nphase = phase;
            if (nstage == Cfg::stages) { nstage = 0; nphase ^= 1; }
            cf_wgmma_wait<0>();
            if ((threadIdx.x % 128) == 0) cf_mbar_arrive(&empty_bar[stage]);
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[i] += part[i];
            stage = nstage;
            phase = nphase;
        }
        // Accumulator layout of wgmma m64nN f32: warp w owns rows 16w..16w+15 of the
        // warpgroup's 64; lane l holds rows (l/4) and (l/4 + 8), columns 8j + 2(l%4) + {0,1}.
        epi.begin_tile(split);
#ifdef CF_GEMM_DEBUG
        if (blockIdx.x == 0 && (threadIdx.x == 128 || threadIdx.x == 256))
            printf("consumer %d: epilogue w %d acc0 %f\n", threadIdx.x, w, acc[0]);
#endif
        const int r0 = m0 + cw * 64 + warp * 16 + (lane >> 2);
        const int cbase = n0 + (lane & 3) * 2;
        typename Epi::Acc racc[2];
        epi.reset(racc[0]);
        epi.reset(racc[1]);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int c = cbase + j * 8;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = r0 + h * 8;
                if (r >= M) continue;
                float v0 = acc[j * 4 + h * 2 + 0];
                float v1 = acc[j * 4 + h * 2 + 1];
                {
                    // Where big*big is already NaN/inf (an infinite operand), the small
                    // cross terms only add spurious infinities of other signs: skip them,
                    // so the result is the one fp32 arithmetic gives (PyTorch's).
                    const float s0 = acc2[j * 4 + h * 2 + 0], s1 = acc2[j * 4 + h * 2 + 1];
                    v0 = isfinite(v0) ? v0 + s0 : v0;
                    v1 = isfinite(v1) ? v1 + s1 : v1;
                }
                if (c + 1 < N) {
                    epi.elem(r, c, v0, racc[h]);
                    epi.elem(r, c + 1, v1, racc[h]);
                } else if (c < N) {
                    epi.elem(r, c, v0, racc[h]);
                }
            }
        }
        if constexpr (Epi::kRows) {
            // this tile's part of each row: the 4 lanes holding a row combine (fixed
            // order), lane 4q writes it; the CTA finishing the row block's last tile
            // combines the parts of its rows in tile order
            const int tn = n0 / G_BN;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                epi.combine_lanes(racc[h]);
                if ((lane & 3) == 0 && r0 + h * 8 < M) epi.partial(r0 + h * 8, tn, tiles_n, racc[h]);
            }
            __threadfence();
            cf_consumers_sync();
            if (threadIdx.x == 128) {
                const unsigned done = atomicAdd(&epi.counters[m0 / G_BM], 1u);
                last_tile = done == (unsigned)(tiles_n - 1);
                if (last_tile) epi.counters[m0 / G_BM] = 0u;   // re-armed for the next launch
            }
            cf_consumers_sync();
            if (last_tile) {
                __threadfence();
                for (int i = threadIdx.x - 128; i < G_BM && m0 + i < M; i += 256)
                    epi.row_final(m0 + i, tiles_n);
            }
        }
    }
}
