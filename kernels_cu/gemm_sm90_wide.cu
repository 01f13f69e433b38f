// gemm_sm90_wide.cu -- one-pass C = A B^T on Hopper tensor cores with wide tiles:
// precision "high" (tf32 operands: the fp32 inputs as given) and "medium" (bf16
// operands, converted beforehand by to_bf16 below). A (M x K) and B (N x K) K-major,
// C (M x N) fp32 row-major; fp32 accumulation.
//
// Why a second kernel: a single pass needs no second accumulator set and no fp32
// promotion (the 3xTF32 kernel in gemm_sm90.cu keeps three 64-register sets), so each
// consumer warpgroup can hold a 64 x 256 tile (128 accumulators per thread):
// wgmma m64n256 reads twice the MACs per shared-memory byte of A that m64n128 does, and
// the per-K-block pipeline is kept full with wait_group 1 (the slot of K block kb-1 is
// released once the wgmmas of block kb are issued) instead of draining every block.
//
// Work split: a persistent grid walking work items (tile, K split) in the grouped order
// of cf_work_item (sm90.cuh); tiles of 128 x 256. (Clusters of two along M with the B box
// multicast, and 192-row tiles, measured no faster: docs/ENGINE_NOTES.md v27, v28.)
// 384 threads = 3 warpgroups:
//   WG0, one thread: the producer -- per K block it waits for a free ring slot and has
//     the TMA engine copy an A box (128 rows x 128 bytes) and a B box (256 rows x 128
//     bytes), 128-byte swizzle, completing on the slot's `full` mbarrier.
//   WG1, WG2: consumers for tile rows 0-63 / 64-127; 4 k-steps (k8 tf32 / k16 bf16, 32
//     bytes of K each) of wgmma m64n256 per K block, fp32 accumulators in registers,
//     written straight to global memory at the end of the work item.
// A K block is 128 bytes of K: 32 tf32 or 64 bf16 elements. Out-of-range rows, columns
// and K arrive as zeros from TMA and are not stored. Split K (small grids) writes partial
// products to C + split * split_stride for the caller to sum (splitk_sum in gemm_sm90.cu).
#include "common.cuh"
#include "sm90.cuh"

#define W_BM 128
#define W_BN 256
#define W_A_BYTES (W_BM * 128)            // 16 KB
#define W_B_BYTES (W_BN * 128)            // 32 KB
#define W_STAGE_BYTES (W_A_BYTES + W_B_BYTES)
#define W_STAGES 4
// 4 x 48 KB ring + 1 KB for aligning it to 1024 bytes (the swizzle atom): 197,632 bytes.

template <bool BF16>
__device__ __forceinline__ void gemm_wide_impl(const CfTensorMap* ta, const CfTensorMap* tb,
                                               float* __restrict__ C, int M, int N, int K,
                                               long long ldc, int splits, long long split_stride) {
    extern __shared__ unsigned char smem_raw[];
    // a dependent launched after this kernel (the certification's) may start on SMs as
    // they free up; it waits for this grid's end before reading what it writes
    cf_grid_launch_dependents();
    __shared__ __align__(8) unsigned long long full_bar[W_STAGES];
    __shared__ __align__(8) unsigned long long empty_bar[W_STAGES];
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);

    const int bk = BF16 ? 64 : 32;  // elements per K block
    const int tiles_m = (M + W_BM - 1) / W_BM;
    const int tiles_n = (N + W_BN - 1) / W_BN;
    const int kblocks = (K + bk - 1) / bk;
    const int total = tiles_m * tiles_n * splits;
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < W_STAGES; ++s) {
            cf_mbar_init(&full_bar[s], 1);
            cf_mbar_init(&empty_bar[s], 2);   // both consumer warpgroups
        }
        cf_fence_mbar_init();
    }
    __syncthreads();

    if (wg == 0) {
        cf_setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            cf_prefetch_tensormap(ta);
            cf_prefetch_tensormap(tb);
            int stage = 0;
            unsigned phase = 0;
            for (int w = blockIdx.x; w < total; w += gridDim.x) {
                int m0, n0, kb0, kb1, split;
                cf_work_item(w, splits, tiles_m, tiles_n, W_BM, W_BN, kblocks, m0, n0, kb0,
                             kb1, split);
                for (int kb = kb0; kb < kb1; ++kb) {
                    cf_mbar_wait(&empty_bar[stage], phase ^ 1);
                    cf_mbar_arrive_expect_tx(&full_bar[stage], W_STAGE_BYTES);
                    unsigned char* base = smem + stage * W_STAGE_BYTES;
                    cf_tma_load_2d(base, ta, &full_bar[stage], kb * bk, m0);
                    cf_tma_load_2d(base + W_A_BYTES, tb, &full_bar[stage], kb * bk, n0);
                    if (++stage == W_STAGES) { stage = 0; phase ^= 1; }
                }
            }
        }
        return;
    }

    cf_setmaxnreg_inc<232>();
    const int cw = wg - 1;
    const int warp = (threadIdx.x % 128) / 32;
    const int lane = threadIdx.x % 32;
    const bool leader = (threadIdx.x % 128) == 0;
    int stage = 0;
    unsigned phase = 0;
    float acc[128];
    auto release = [&](int s) {
        if (leader) cf_mbar_arrive(&empty_bar[s]);
    };
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
        int m0, n0, kb0, kb1, split;
        cf_work_item(w, splits, tiles_m, tiles_n, W_BM, W_BN, kblocks, m0, n0, kb0, kb1, split);
        int prev = -1;  // the slot whose wgmmas may still be reading it
        for (int kb = kb0; kb < kb1; ++kb) {
            cf_mbar_wait(&full_bar[stage], phase);
            const unsigned base = cf_smem_addr(smem + stage * W_STAGE_BYTES);
            const unsigned a = base + cw * 64 * 128;
            const unsigned b = base + W_A_BYTES;
            cf_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const unsigned long long da = cf_desc_sw128(a + kk * 32);
                const unsigned long long db = cf_desc_sw128(b + kk * 32);
                const int accumulate = (kb > kb0 || kk > 0) ? 1 : 0;
                if (BF16)
                    cf_wgmma_m64n256k16_bf16(acc, da, db, accumulate);
                else
                    cf_wgmma_m64n256k8_tf32(acc, da, db, accumulate);
            }
            cf_wgmma_commit();
            // Keep this block's wgmmas in flight; the previous block's are done now.
            cf_wgmma_wait<1>();
            if (prev >= 0) release(prev);
            prev = stage;
            if (++stage == W_STAGES) { stage = 0; phase ^= 1; }
        }
        cf_wgmma_wait<0>();
        if (prev >= 0) release(prev);
        if (kb1 <= kb0) {
#pragma unroll
            for (int i = 0; i < 128; ++i) acc[i] = 0.f;  // empty K range (K == 0 is not launched)
        }
        // Accumulator layout of wgmma m64nN f32: warp w owns rows 16w..16w+15 of the
        // warpgroup's 64; lane l holds rows (l/4) and (l/4 + 8), columns 8j + 2(l%4) + {0,1}.
        float* Cs = C + (long long)split * split_stride;
        const int r0 = m0 + cw * 64 + warp * 16 + (lane >> 2);
        const int cbase = n0 + (lane & 3) * 2;
        const bool pairs = (ldc % 2) == 0 && (((unsigned long long)Cs) % 8) == 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + h * 8;
            if (r >= M) continue;
            float* row = Cs + (long long)r * ldc;
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const int c = cbase + j * 8;
                const float v0 = acc[j * 4 + h * 2 + 0];
                const float v1 = acc[j * 4 + h * 2 + 1];
                if (c + 1 < N) {
                    if (pairs) {
                        *reinterpret_cast<float2*>(row + c) = make_float2(v0, v1);
                    } else {
                        row[c] = v0;
                        row[c + 1] = v1;
                    }
                } else if (c < N) {
                    row[c] = v0;
                }
            }
        }
    }
}

#define CF_WIDE_KERNEL(name, bf16)                                                            \
    extern "C" __global__ void __launch_bounds__(384, 1) name(                                \
        const __grid_constant__ CfTensorMap ta, const __grid_constant__ CfTensorMap tb,       \
        float* __restrict__ C, int M, int N, int K, long long ldc, int splits,                \
        long long split_stride) {                                                             \
        gemm_wide_impl<bf16>(&ta, &tb, C, M, N, K, ldc, splits, split_stride);                \
    }
CF_WIDE_KERNEL(gemm_sm90_wide_tf32, false)
CF_WIDE_KERNEL(gemm_sm90_wide_bf16, true)

// out[r, c] = bf16(v[r, c]) for a rows x cols fp32 matrix (row strides ld_in, ld_out in
// elements; ld_out a multiple of 8), round to nearest even (cf_bf16_bits: NaN and +-inf
// carry over, finite values stay finite). Columns cols..ld_out-1 of each output row (the
// padding that keeps TMA row strides 16-byte multiples) are zeroed. One thread per 4
// columns: float4 loads and 8-byte stores where cols, ld_in and v allow (vec4 != 0).
extern "C" __global__ void __launch_bounds__(256) to_bf16(
    const float* __restrict__ v, long long rows, int cols, long long ld_in,
    unsigned short* __restrict__ out, long long ld_out, int vec4) {
    const long long groups = ld_out / 4;
    const long long total = rows * groups;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long r = i / groups;
        const int c0 = (int)(i - r * groups) * 4;
        const float* src = v + r * ld_in + c0;
        float x[4];
        if (vec4 && c0 + 4 <= cols) {
            const float4 q = *reinterpret_cast<const float4*>(src);
            x[0] = q.x; x[1] = q.y; x[2] = q.z; x[3] = q.w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) x[j] = c0 + j < cols ? src[j] : 0.f;
        }
        ushort4 h;
        h.x = cf_bf16_bits(x[0]);
        h.y = cf_bf16_bits(x[1]);
        h.z = cf_bf16_bits(x[2]);
        h.w = cf_bf16_bits(x[3]);
        *reinterpret_cast<ushort4*>(out + r * ld_out + c0) = h;
    }
}
