// tail_seqred.cu -- reductions over the sequence of a (batch, seq, features) value, the
// "seqred" nodes of generated programs (cupyfuse/codegen.py, fused._seq_reduce).
//
// seq_reduce: `in` holds batch * seq rows of `width` features (row r, feature f at
//   in[r * sb + f * sf]: any strides, an input read in place); the rows of batch element
//   b are b * seq .. b * seq + seq - 1. One thread per (b, f), grid-stride: it combines
//   in[(b * seq + s) * sb + f * sf] for s = 0, 1, ..., seq - 1 in that order and writes
//   out[b * width + f] (a contiguous (batch, width) value). op 0: the sum, accumulated in
//   double from +0.0 (as the row reductions of the generated kernels: NaN and opposite
//   infinities give NaN); op 1 / 2: max / min in float, NaN propagating (torch.amax /
//   amin); op 3: position k of the sequence (h[:, k]). A warp reads 32 consecutive
//   features of one row at a time (coalesced for unit feature stride). No atomics, no
//   shared partial sums: the same bits every run, whatever the launch shape.
#include "tail_ops.cuh"

extern "C" __global__ void __launch_bounds__(256) seq_reduce(
    const float* __restrict__ in, long long sb, long long sf, long long seq, long long width,
    long long batch, int op, long long k, float* __restrict__ out) {
    const long long total = batch * width;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const long long b = i / width, f = i - b * width;
        const float* p = in + b * seq * sb + f * sf;
        float r;
        if (op == 0) {
            double acc = 0.0;
            for (long long s = 0; s < seq; ++s) acc += (double)p[s * sb];
            r = (float)acc;
        } else if (op == 1) {
            float m = -CF_INF;
            for (long long s = 0; s < seq; ++s) m = cf_nanmax(m, p[s * sb]);
            r = m;
        } else if (op == 2) {
            float m = CF_INF;
            for (long long s = 0; s < seq; ++s) m = cf_nanmin(m, p[s * sb]);
            r = m;
        } else {
            r = p[k * sb];
        }
        out[i] = r;
    }
}
