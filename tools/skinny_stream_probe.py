"""Is the 16-row skinny tiles' 1.15x the weight's access pattern? Pure weight streams (no
math but a sum), the same grid shape as the skinny launches (blocks of 8 warps, 2 per SM,
K split into whole waves), in different patterns: each warp reads R rows of the weight,
S bytes of each row per step (float4 loads, lane l takes float4s l, l + 32, ... of the
step's R x S bytes), U steps of loads in flight. The 16-row tiles read R = 16, S = 128;
the 1-8-row FMA tiles R = 4, S = 512 (two steps in flight). Cold-L2 medians, ratio to
the fp32-weight floor at 3.0 TB/s.
Usage: PYTHONPATH=.:tools python tools/skinny_stream_probe.py"""
import cupy
import torch

from cupyfuse import engine, interop
from skinny_probe import t_ms

SRC = r"""
template <int H>
__device__ __forceinline__ float4 ld4(const float* p) {
    float4 v;
    if (H == 256)
        asm("ld.global.nc.L2::256B.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    else
        v = __ldg(reinterpret_cast<const float4*>(p));
    return v;
}
template <int R, int S, int U, int H>
__device__ void stream(const float* __restrict__ w, long long ldw, int N, int K, int kspan,
                       float* __restrict__ out) {
    constexpr int F4 = R * S / 16;          // float4s per warp per step
    constexpr int PER = (F4 + 31) / 32;     // per lane
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * 8 + warp) * R;
    const int k0 = blockIdx.y * kspan, k1 = min(K, k0 + kspan);
    float acc = 0.f;
    for (int k = k0; k < k1; k += U * (S / 4)) {
        float4 v[U][PER];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int p = 0; p < PER; ++p) {
                const int f = lane + 32 * p, row = r0 + f / (S / 16), c = k + u * (S / 4) + 4 * (f % (S / 16));
                v[u][p] = (f < F4 && row < N && c < k1)
                    ? ld4<H>(w + (long long)row * ldw + c) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int p = 0; p < PER; ++p) acc += v[u][p].x + v[u][p].y + v[u][p].z + v[u][p].w;
    }
    if (acc == 12345.678f) out[0] = acc;   // keeps the loads
}
#define ENTRY(R, S, U, H) extern "C" __global__ void __launch_bounds__(256, 2) stream_##R##_##S##_##U##_##H( \
    const float* w, long long ldw, int N, int K, int kspan, float* out) { stream<R, S, U, H>(w, ldw, N, K, kspan, out); }
ENTRY(16, 128, 1, 0) ENTRY(16, 128, 2, 0) ENTRY(16, 256, 1, 0) ENTRY(4, 512, 2, 0)
ENTRY(16, 64, 1, 0) ENTRY(16, 64, 2, 0)
ENTRY(16, 128, 1, 256) ENTRY(16, 128, 2, 256) ENTRY(16, 64, 1, 256) ENTRY(16, 64, 2, 256)
"""
# (R, S, U, L2 prefetch-size hint)
PATTERNS = [(16, 128, 1, 0), (16, 128, 2, 0), (16, 256, 1, 0), (4, 512, 2, 0), (16, 64, 1, 0),
            (16, 64, 2, 0), (16, 128, 1, 256), (16, 128, 2, 256), (16, 64, 1, 256),
            (16, 64, 2, 256)]


def main():
    mod = cupy.RawModule(code=SRC, options=("-std=c++17", "-arch=sm_90a"))
    out = torch.zeros(1, device="cuda")
    print("| N | K | " + " | ".join(f"R{r} S{s} U{u}" + (f" L2:{h}" if h else "") for r, s, u, h in PATTERNS) + " |")
    print("|---" * (2 + len(PATTERNS)) + "|")
    for N, K in ((16384, 16384), (32768, 8192), (8192, 8192), (4096, 4096)):
        w = torch.randn(N, K, device="cuda")
        floor = N * K * 4 / 3.0e12 * 1e3
        cells = []
        for R, S, U, H in PATTERNS:
            fn = mod.get_function(f"stream_{R}_{S}_{U}_{H}")
            tiles = -(-N // (8 * R))
            splits = engine._whole_waves(tiles, max(1, min(K // 512, 64)), 2 * 132)
            kspan = -(-(-(-K // splits)) // 512) * 512
            splits = -(-K // kspan)
            args = (cupy.uint64(w.data_ptr()), cupy.int64(K), cupy.int32(N), cupy.int32(K),
                    cupy.int32(kspan), cupy.uint64(out.data_ptr()))
            t = t_ms(lambda: fn((tiles, splits), (256,), args))
            cells.append(f"{t / floor:.2f}")
        print(f"| {N} | {K} | " + " | ".join(cells) + " |", flush=True)
        del w


if __name__ == "__main__":
    with interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg=""):
        main()
