// gemm_sm90.cu -- C = A B^T on Hopper tensor cores: A (M x K) and B (N x K) fp32,
// both K-major (row-major), C (M x N) fp32; "hybrid" 3xTF32 wgmma (gemm_sm90_tf32x3h).
//
// Precision: 3xTF32. Every operand v is split into big = tf32(v) and small =
// tf32(v - big) (split_hybrid below; weights once, as a cached derived weight). The
// kernel accumulates big*big in one set of registers and the cross terms in another,
// adds the two in fp32 at the end: float32-class accuracy at tensor-core speed. The
// cross term big(A) * small(B) runs in bf16 on copies split_hybrid makes (B's small half
// as bf16: the weight streams 6 bytes per element instead of 8); small(A) * big(B) is tf32.
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
//     them, and release the slot. At the end of a work item each thread writes its
//     2 x 64 accumulators, summed.
// Out-of-range rows/columns/K arrive as zeros from TMA and are not stored.
// Split K (for grids with fewer tiles than SMs) writes partial products to
// C + split * split_stride; the caller sums them.
//
// Variants measured slower (split B in shared memory, HYB 2/3/4; the all-tf32 3xTF32 and
// the 128 x 128 one-pass TF32 kernels) were removed; their code is in git history (tags
// engine-variants-v13 and engine-variants-v14), their numbers in docs/ENGINE_NOTES.md.
#include "sm90.cuh"

#define G_BM 128
#define G_BN 128
#define G_BK 32
#define G_TILE_BYTES (G_BM * G_BK * 4)  // 16 KB, one box

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

__device__ __forceinline__ void gemm_sm90_impl(
    const CfTensorMap* ta, const CfTensorMap* tb, const CfTensorMap* tas, const CfTensorMap* tbs,
    const CfTensorMap* tah,
    float* __restrict__ C, int M, int N, int K, long long ldc, int splits, long long split_stride) {
    typedef GemmCfg Cfg;
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full_bar[Cfg::stages];
    __shared__ __align__(8) unsigned long long empty_bar[Cfg::stages];
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);

    const int tiles_m = (M + G_BM - 1) / G_BM;
    const int tiles_n = (N + G_BN - 1) / G_BN;
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
        float* Cs = C + (long long)split * split_stride;
#ifdef CF_GEMM_DEBUG
        if (blockIdx.x == 0 && (threadIdx.x == 128 || threadIdx.x == 256))
            printf("consumer %d: epilogue w %d acc0 %f\n", threadIdx.x, w, acc[0]);
#endif
        const int r0 = m0 + cw * 64 + warp * 16 + (lane >> 2);
        const int cbase = n0 + (lane & 3) * 2;
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
    gemm_sm90_impl(&ta, &tb, &tas, &tbs, &tah, C, M, N, K, ldc, splits, split_stride);
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
