// gemm_sm90.cu -- the engine's plain kernel, C = A B^T in "hybrid" 3xTF32 on Hopper
// tensor cores (gemm_sm90_tf32x3h: the mainloop of gemm_sm90.cuh with an epilogue that
// stores C), the operand split it reads (split_hybrid) and the fixed-order sum of split-K
// partial products (splitk_sum). Generated kernels (cupyfuse/codegen.py) instantiate the
// same mainloop with a tail program as the epilogue.
//
// Split K (for grids with fewer tiles than SMs) writes partial products to
// C + split * split_stride; the caller sums them.
//
// Variants measured slower (split B in shared memory, HYB 2/3/4; the all-tf32 3xTF32 and
// the 128 x 128 one-pass TF32 kernels) were removed; their code is in git history (tags
// engine-variants-v13 and engine-variants-v14), their numbers in docs/ENGINE_NOTES.md.
#include "gemm_sm90.cuh"

// The plain epilogue: every element to C (row stride ldc), split s at C + s * split_stride.
struct CfStoreC {
    struct Acc {};
    static constexpr bool kRows = false;
    float* C;
    long long ldc, split_stride;
    float* Cs;
    unsigned int* counters;
    __device__ __forceinline__ void begin_tile(int split) { Cs = C + (long long)split * split_stride; }
    __device__ __forceinline__ void reset(Acc&) const {}
    __device__ __forceinline__ void elem(int r, int c, float v, Acc&) const {
        Cs[(long long)r * ldc + c] = v;
    }
    __device__ __forceinline__ void combine_lanes(Acc&) const {}
    __device__ __forceinline__ void partial(int, int, int, const Acc&) const {}
    __device__ __forceinline__ void row_final(int, int) const {}
};

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
    CfStoreC epi{C, ldc, split_stride, C, nullptr};
    gemm_sm90_impl<CfStoreC>(&ta, &tb, &tas, &tbs, &tah, M, N, K, splits, epi);
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
//
// rowmax != 0: also each row's max |v| as float bits (atomicMax into rowmax, which must
// hold zeros: order-independent, so bitwise the same run to run; a NaN's bits exceed
// +inf's, so a row holding a NaN gets a NaN). tail_rewrite.cu's guards read it instead
// of reading v again.
extern "C" __global__ void __launch_bounds__(256) split_hybrid(
    const float* __restrict__ v, long long rows, int cols, long long ld_in,
    float* __restrict__ big, float* __restrict__ small, unsigned short* __restrict__ small_h,
    unsigned short* __restrict__ half, long long ld_h, int trunc_big,
    unsigned int* __restrict__ rowmax) {
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
            if (rowmax != nullptr) {
                // a warp whose lanes are on one row combines them: one atomic
                const unsigned int m = max(
                    max(__float_as_uint(x.x) & 0x7fffffffu, __float_as_uint(x.y) & 0x7fffffffu),
                    max(__float_as_uint(x.z) & 0x7fffffffu, __float_as_uint(x.w) & 0x7fffffffu));
                // (rows are usually wider than a warp's 128 columns: one row per warp)
                const unsigned int act = __activemask();
                const int lead = __ffs(act) - 1;
                const long long r0 = __shfl_sync(act, r, lead);
                if (__all_sync(act, r == r0)) {
                    const unsigned int mm = __reduce_max_sync(act, m);
                    if ((int)(threadIdx.x & 31) == lead) atomicMax(rowmax + r, mm);
                } else {
                    atomicMax(rowmax + r, m);
                }
            }
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
