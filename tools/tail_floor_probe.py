"""What a split-row tail costs at its floor: hand-written kernels over 16 rows x 16384 (a
row over a cluster of 8 blocks of 512 threads, tail_ops.cuh's cf_row_combine), GPU us
per launch (profiler, warm L2), beside the generated GELU + softmax level kernel:
  empty   the cluster launch alone (every thread reads its row index);
  sum     one phase: 4 loads per thread, a double sum, one combine (56's tail);
  2pass   GELU + softmax as the level kernel computes it, the row's 4 values per thread
          kept in registers: max, combine, sum of exp, combine, write;
  online  the same with max and sum in one pass (pairs (max, sum) combined): one combine.
Usage: PYTHONPATH=. python tools/tail_floor_probe.py"""
import cupy
import torch
from torch.profiler import ProfilerActivity, profile

from cupyfuse import runtime

SRC = r'''
#include "tail_ops.cuh"
#define W 16384
#define PER 4
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(512) k_empty(
    const float* h, float* out) {
    const int row = blockIdx.x / 8;
    if (threadIdx.x == 0 && cf_row_part() == 0) out[row * W] = (float)row;
    cf_row_end();
}
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(512) k_sum(
    const float* h, float* out) {
    __shared__ double scr[32];
    const long long row = blockIdx.x / 8;
    double acc = 0.0;
#pragma unroll
    for (int j = 0; j < PER; ++j) acc += (double)cf_sigmoid(h[row * W + CF_F0 + j * CF_FS]);
    acc = cf_row_combine<double>(acc, 0.0, [](double p, double q) { return p + q; }, scr);
    if (threadIdx.x == 0 && cf_row_part() == 0) out[row * W] = (float)acc;
    cf_row_end();
}
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(512) k_2pass(
    const float* h, float* out) {
    __shared__ float scr0[32];
    __shared__ double scr1[32];
    const long long row = blockIdx.x / 8;
    float v[PER];
    float m = -CF_INF;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        v[j] = cf_gelu(h[row * W + CF_F0 + j * CF_FS]);
        m = cf_nanmax(m, v[j]);
    }
    m = cf_row_combine<float>(m, -CF_INF, [](float p, float q) { return cf_nanmax(p, q); }, scr0);
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < PER; ++j) { v[j] = expf(v[j] - m); s += (double)v[j]; }
    s = cf_row_combine<double>(s, 0.0, [](double p, double q) { return p + q; }, scr1);
    const float sf = (float)s;
#pragma unroll
    for (int j = 0; j < PER; ++j) out[row * W + CF_F0 + j * CF_FS] = v[j] / sf;
    cf_row_end();
}
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(512) k_2reload(
    const float* h, float* out) {
    __shared__ float scr0[32];
    __shared__ double scr1[32];
    const long long row = blockIdx.x / 8;
    float m = -CF_INF;
#pragma unroll
    for (int j = 0; j < PER; ++j) m = cf_nanmax(m, cf_gelu(h[row * W + CF_F0 + j * CF_FS]));
    m = cf_row_combine<float>(m, -CF_INF, [](float p, float q) { return cf_nanmax(p, q); }, scr0);
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < PER; ++j) s += (double)expf(cf_gelu(h[row * W + CF_F0 + j * CF_FS]) - m);
    s = cf_row_combine<double>(s, 0.0, [](double p, double q) { return p + q; }, scr1);
    const float sf = (float)s;
#pragma unroll
    for (int j = 0; j < PER; ++j)
        out[row * W + CF_F0 + j * CF_FS] = expf(cf_gelu(h[row * W + CF_F0 + j * CF_FS]) - m) / sf;
    cf_row_end();
}
// a (max, sum) pair's combine: the sums rescaled to the larger max (a side of max -inf
// holds no value: sum 0)
__device__ __forceinline__ void pair_op(float& m, double& s, float m2, double s2) {
    const float mm = cf_nanmax(m, m2);
    const double a = m == -CF_INF ? 0.0 : s * (double)expf(m - mm);
    const double b = m2 == -CF_INF ? 0.0 : s2 * (double)expf(m2 - mm);
    m = mm;
    s = a + b;
}
__device__ __forceinline__ void pair_combine(float& m, double& s, float* sm, double* ss) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        pair_op(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) { sm[warp] = m; ss[warp] = s; }
    __syncthreads();
    if (warp == 0) {
        float tm = lane < nwarps ? sm[lane] : -CF_INF;
        double ts = lane < nwarps ? ss[lane] : 0.0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            pair_op(tm, ts, __shfl_xor_sync(0xffffffffu, tm, o), __shfl_xor_sync(0xffffffffu, ts, o));
        if (lane == 0) { sm[1] = tm; ss[1] = ts; }
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
    float pm = -CF_INF;
    double ps = 0.0;
    if (lane < cf_row_parts()) {
        unsigned a, b;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a)
                     : "r"((unsigned)__cvta_generic_to_shared(sm + 1)), "r"(lane));
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(b)
                     : "r"((unsigned)__cvta_generic_to_shared(ss + 1)), "r"(lane));
        cf_dsmem_load(a, pm);
        cf_dsmem_load(b, ps);
    }
    m = -CF_INF;
    s = 0.0;
    for (int q = 0; q < cf_row_parts(); ++q)
        pair_op(m, s, __shfl_sync(0xffffffffu, pm, q), __shfl_sync(0xffffffffu, ps, q));
}
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(512) k_online(
    const float* h, float* out) {
    __shared__ float scr0[32];
    __shared__ double scr1[32];
    const long long row = blockIdx.x / 8;
    float v[PER];
    float m = -CF_INF;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        v[j] = cf_gelu(h[row * W + CF_F0 + j * CF_FS]);
        m = cf_nanmax(m, v[j]);
    }
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < PER; ++j) s += (double)expf(v[j] - m);
    pair_combine(m, s, scr0, scr1);
    const float sf = (float)s;
#pragma unroll
    for (int j = 0; j < PER; ++j) out[row * W + CF_F0 + j * CF_FS] = expf(v[j] - m) / sf;
    cf_row_end();
}
'''


def timed(fn, rows, args, name, out, ref):
    """Three warm-up launches, then 20 under the profiler: prints the median and minimum
    GPU us and, with ``ref``, the result's error against float64."""
    for _ in range(3):
        fn((rows * 8,), (512,), args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn((rows * 8,), (512,), args)
        torch.cuda.synchronize()
    us = sorted(e.device_time_total for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and name in e.name)
    err = (out.double() - ref).abs().max().item() if ref is not None else 0.0
    return f"median {us[len(us) // 2]:.2f} us, min {us[0]:.2f} (n {len(us)}); max err vs float64 {err:.1e}"


def main():
    mod = cupy.RawModule(code=runtime.expand_text(SRC), options=("-std=c++17", "-arch=sm_90a"))
    rows = 16
    h = torch.randn(rows, 16384, device="cuda")
    out = torch.empty_like(h)
    ref = torch.softmax(torch.nn.functional.gelu(h.double()), dim=1)
    for name in ("k_empty", "k_sum", "k_2pass", "k_2reload", "k_online"):
        check = None if name in ("k_empty", "k_sum") else ref
        print(f"{name}: " + timed(mod.get_function(name), rows,
                                  (cupy.from_dlpack(h), cupy.from_dlpack(out)), name, out, check),
              flush=True)
    generated(h, out, ref)


def generated(h, out, ref):
    """The generated level kernel of GELU + softmax (its `_cl` entry), as codegen writes it
    and without parts of it (the bias load, the dependent-launch wait)."""
    import cupyfuse
    from cupyfuse import bench_sweep, codegen

    f = cupyfuse.from_model(bench_sweep.GeluSoftmax(1024, 16384))
    (lv,) = [lv for lv in codegen.compile_program(f.program(torch.rand(2, 1024))).levels if lv.kernel]
    rows = h.shape[0]
    bias = torch.zeros(16384, device="cuda")
    k = lv.kernel
    args = (cupy.int64(rows), cupy.from_dlpack(h), cupy.from_dlpack(bias), cupy.int64(1),
            cupy.from_dlpack(out), cupy.int64(16384), cupy.int64(1))
    for label, text in (("generated", k),
                        ("generated, no bias load", k.replace("p2[(long long)f * p2_sf]", "0.0f")),
                        ("generated, no griddepcontrol.wait", k.replace("cf_grid_dependency_wait();", "")),
                        ("generated, neither", k.replace("p2[(long long)f * p2_sf]", "0.0f")
                         .replace("cf_grid_dependency_wait();", ""))):
        mod = cupy.RawModule(code=runtime.expand_text(text), options=("-std=c++17", "-arch=sm_90a"))
        print(f"{label}: " + timed(mod.get_function(lv.name + "_cl"), rows, args, lv.name, out, ref),
              flush=True)


if __name__ == "__main__":
    main()
