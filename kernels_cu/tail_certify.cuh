// tail_certify.cuh -- certified row maxima over a one-pass TF32 GEMM (cupyfuse/certify.py).
//
// A tail whose only use of the GEMM output z = x W^T is m_r = max_n f(z_rn) (f a chain of
// elementwise ops, monotone between known turning points) needs z accurately only where the
// maximum can be. So the GEMM runs one TF32 pass on the fp32 operands (a third of 3xTF32's
// tensor-core work; x is not split), and this kernel, one block per row, certifies it:
//
// 1. the row's norms, bounded above (float sums, then double): X = ||x_r||,
//    DX = ||ulp13(x_r)|| (ulp13(v): the spacing of the tf32 grid at v, so
//    |tf32(v) - v| <= ulp13(v) for any rounding mode, flushed subnormals included), and
//    max|x_r| for the guard (below);
// 2. each column's error bound, from the weight's cached per-row norms Wn_n = ||W_n||,
//    DW_n = ||ulp13(W_n)|| (Cauchy-Schwarz on each error term, and gamma for the tensor
//    cores' fp32 accumulation and the split-K sum, see certify.gamma):
//      |zhat - z| <= e = 1.01 (DX (Wn + DW) + X DW + gamma (X + DX)(Wn + DW)) + 1e-30
//    then the chain's range over [zhat - e, zhat + e] (+ bias): lo_n <= f(z_n) <= hi_n;
// 3. L = max_n lo_n; column n is a candidate unless hi_n < L - margin (margin: 2^-12 of
//    the magnitudes involved, for f's own float32 rounding), or where its range is not
//    known (a NaN, a pole inside the interval, a non-finite operand);
// 4. each candidate's z is recomputed as a float32 dot product summed in double (the
//    block on 4 candidates at a time) and written over zhat. A non-candidate's f(zhat) <= hi_n < L <= f(z) of the column
//    that set L, so the tail's max over the patched row is the max over the candidates'
//    fp32 values: the maximum a float32 GEMM would give.
//
// The row is finished here: with a bias (a folded GEMM's, rewrite.py) every value is
// written as fl(z + b), as tail_rewrite.cu's fold_rows adds it.
//
// Guard rows (a non-finite x, or K max|x_r| max|W| >= 1e37, where the bound itself could
// overflow): after a folded GEMM (`fw`, the original weight, given) the row is computed
// directly as fold_rows does (rewrite_rows.cuh); after a plain GEMM every column of such a
// row is a candidate, recomputed here (NaN and inf land where a float32 GEMM puts them).
#pragma once
#include "common.cuh"
#include "rewrite_rows.cuh"

// threads per block (one block per row; the generated source may set it first:
// certify.THREADS)
#ifndef CF_CERT_THREADS
#define CF_CERT_THREADS 256
#endif
// blocks of 256 threads resident per SM (the generated source may set it first;
// certify.MIN_BLOCKS): 4 gives 64 registers, no spills; 5 gives 48 with a few bytes
// spilled in some chains; 8 gives 32 registers, 152 bytes spilled
#ifndef CF_CERT_MIN_BLOCKS
#define CF_CERT_MIN_BLOCKS 4
#endif

// the spacing of the tf32 grid (10 explicit mantissa bits) at v: 2^(E - 10) for a normal
// v in [2^E, 2^(E+1)); |v| itself for zero and subnormals (a flush to zero at worst)
__device__ __forceinline__ float cf_ulp13(float v) {
    const unsigned int e = __float_as_uint(v) & 0x7f800000u;
    return e == 0u ? fabsf(v) : __uint_as_float(e) * 0x1p-10f;
}

__device__ __forceinline__ unsigned int cf_umax(unsigned int a, unsigned int b) {
    return a > b ? a : b;
}

// z of up to 4 candidate columns n[0..nc) at once, x_r . W_n over the block: float32 FMAs
// (as a float32 GEMM accumulates: the 1e-4 references are met with float32 arithmetic;
// float64 FMAs cost a float64 conversion per element, 16 per clock per SM), each thread's
// sums then the warps' in double in a fixed order; written to hr[n] (plus bias[n] where
// given), and given to on_value(n, value) (by threads 0..nc-1). The candidates' loads in
// flight together (a loop of one candidate at a time, each a chain of L2 round trips, was
// the kernel's main latency). xr: global or shared memory; scratch: 4 x 32.
template <class OnValue>
__device__ __forceinline__ void cf_cert_dots(const float* __restrict__ xr,
                                             const float* __restrict__ w, long long ldw,
                                             const int* n, int nc, int K, int vec,
                                             double* scratch, float* hr,
                                             const float* __restrict__ bias, OnValue on_value) {
    const float* w0 = w + (long long)n[0] * ldw;
    const float* w1 = w + (long long)n[nc > 1 ? 1 : 0] * ldw;
    const float* w2 = w + (long long)n[nc > 2 ? 2 : 0] * ldw;
    const float* w3 = w + (long long)n[nc > 3 ? 3 : 0] * ldw;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    auto dot = [](float4 p, float4 q, float acc) {
        return fmaf(p.w, q.w, fmaf(p.z, q.z, fmaf(p.y, q.y, fmaf(p.x, q.x, acc))));
    };
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
#pragma unroll 1
        for (int q = threadIdx.x; q < (K >> 2); q += CF_CERT_THREADS) {
            const float4 v = x4[q];
            a0 = dot(v, __ldg(reinterpret_cast<const float4*>(w0) + q), a0);
            if (nc > 1) a1 = dot(v, __ldg(reinterpret_cast<const float4*>(w1) + q), a1);
            if (nc > 2) a2 = dot(v, __ldg(reinterpret_cast<const float4*>(w2) + q), a2);
            if (nc > 3) a3 = dot(v, __ldg(reinterpret_cast<const float4*>(w3) + q), a3);
        }
    } else {
        for (int k = threadIdx.x; k < K; k += CF_CERT_THREADS) {
            const float v = xr[k];
            a0 = fmaf(v, __ldg(w0 + k), a0);
            if (nc > 1) a1 = fmaf(v, __ldg(w1 + k), a1);
            if (nc > 2) a2 = fmaf(v, __ldg(w2 + k), a2);
            if (nc > 3) a3 = fmaf(v, __ldg(w3 + k), a3);
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const double d0 = cf_warp_sum((double)a0), d1 = cf_warp_sum((double)a1);
    const double d2 = cf_warp_sum((double)a2), d3 = cf_warp_sum((double)a3);
    if (lane == 0) {
        scratch[warp] = d0;
        scratch[32 + warp] = d1;
        scratch[64 + warp] = d2;
        scratch[96 + warp] = d3;
    }
    __syncthreads();
    if (threadIdx.x < nc) {
        double t = 0.0;
        for (int i = 0; i < CF_CERT_THREADS / 32; ++i) t += scratch[32 * threadIdx.x + i];
        const int c = n[threadIdx.x];
        const float v = bias != nullptr ? (float)t + bias[c] : (float)t;
        hr[c] = v;
        on_value(c, v);
    }
    __syncthreads();
}

// zhat of column n: the fixed-order sum of its split-K partials, as splitk_sum adds them
// (the engine splits K at most CF_CERT_MAX_SPLITS ways); the loads unrolled, in flight
// together (a loop of dependent loads was the kernel's main latency), evict-first (read
// once: the candidates' weight rows keep L2)
#define CF_CERT_MAX_SPLITS 16
__device__ __forceinline__ float cf_cert_zhat(const float* pr, int splits, long long sstride,
                                              int n) {
    float s = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < CF_CERT_MAX_SPLITS; k0 += 8) {   // 8 loads at a time
        if (k0 >= splits) break;
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = k0 + k < splits ? __ldcs(pr + (k0 + k) * sstride + n) : 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k)
            if (k0 + k < splits) s += v[k];
    }
    return s;
}

// candidates per pass over K in cf_cert_recompute (1-4)
#ifndef CF_CERT_BATCH
#define CF_CERT_BATCH 4
#endif

// The columns of `mask` recomputed, CF_CERT_BATCH at a time (every thread walks the mask alike; cand:
// 4 ints of shared memory); counts[r] = how many, where counts is given.
template <class OnValue>
__device__ __forceinline__ void cf_cert_recompute(const float* __restrict__ xr,
                                                  const float* __restrict__ w, long long ldw,
                                                  const unsigned int* mask, int words, int K,
                                                  int vec, double* scratch, int* cand,
                                                  float* hr, const float* __restrict__ bias,
                                                  int* __restrict__ counts, long long r,
                                                  OnValue on_value) {
    int cnt = 0, nc = 0;
    for (int i = 0; i < words; ++i) {
        unsigned int bits = mask[i];
        while (bits) {
            if (threadIdx.x == 0) cand[nc] = (i << 5) + __ffs(bits) - 1;
            bits &= bits - 1u;
            ++nc;
            if (nc == CF_CERT_BATCH) {
                __syncthreads();
                cf_cert_dots(xr, w, ldw, cand, CF_CERT_BATCH, K, vec, scratch, hr, bias,
                             on_value);
                cnt += CF_CERT_BATCH;
                nc = 0;
            }
        }
    }
    if (nc) {
        __syncthreads();
        cf_cert_dots(xr, w, ldw, cand, nc, K, vec, scratch, hr, bias, on_value);
        cnt += nc;
    }
    if (threadIdx.x == 0 && counts != nullptr) counts[r] = cnt;
}

// The row's reduction red_out[r] = max_n (min_n where red_min) f(hr[n]), value(n, t) = f(t)
// (the chain's ops at a point), over every column: a folded GEMM's guard rows (the
// certified rows reduce over their candidates, cf_cert_row). NaN-propagating, as the tail
// kernels' cf_nanmax / cf_nanmin; each thread's columns in order, then the warps', then
// the warps' partials in order.
template <class Value>
__device__ __forceinline__ void cf_cert_reduce_row(const float* hr, int N, Value value,
                                                   int red_min, float* __restrict__ red_out,
                                                   long long r, float* scratch) {
    __syncthreads();   // hr's columns were written by other threads of the block
    const float inf = __int_as_float(0x7f800000);
    float m = red_min ? inf : -inf;
    for (int n = threadIdx.x; n < N; n += CF_CERT_THREADS) {
        const float v = value(n, hr[n]);
        m = red_min ? cf_nanmin(m, v) : cf_nanmax(m, v);
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(CF_FULL_MASK, m, o);
        m = red_min ? cf_nanmin(m, u) : cf_nanmax(m, u);
    }
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = scratch[0];
        for (int i = 1; i < CF_CERT_THREADS / 32; ++i)
            t = red_min ? cf_nanmin(t, scratch[i]) : cf_nanmax(t, scratch[i]);
        red_out[r] = t;
    }
}

// One row (blockIdx.x). zhat: the GEMM's split-K partials (P + s * sstride, row stride
// ldp; sstride 0 and splits 1 for a single pass), written to h as their fixed-order sum
// (the engine's splitk_sum), patched, then the bias added. chain(n, lo, hi, mag) maps
// [lo, hi] through the tail's elementwise chain (false where the range is unknown) and
// raises mag to the largest magnitude it met. fw (a folded GEMM's original weight,
// W[n, k] at fw[n * fldn + k * fldk]), fa, fc, fk, fst: fold_rows's direct recomputation
// of guard rows (rw_fold_direct); null fw: a plain GEMM. red_out (where given): the row's
// max (min where red_min) of value(n, h_n), the tail's reduction, written too: over the
// recomputed candidates (every other column's value is provably below theirs), over every
// column of a folded GEMM's guard row. Dynamic shared memory: x_r (K
// floats rounded up to 4) where staged & 1, zhat (N floats rounded up to 4) where
// staged & 2, then the candidate mask ((N + 31) / 32 words).
template <class Chain, class Value>
__device__ __forceinline__ void cf_cert_row(
    const float* __restrict__ x, long long ldx, int K, int vec,
    const float* __restrict__ w, long long ldw,
    const float* __restrict__ wnorm, const float* __restrict__ wulp, double gamma,
    double wmax, const float* __restrict__ bias,
    const float* P, int splits, long long sstride, long long ldp,
    float* h, long long ldh, int N, int* __restrict__ counts, int staged,
    const float* __restrict__ fw, long long fldn, long long fldk, const float* __restrict__ fa,
    const float* __restrict__ fc, int fk, int fst, float* __restrict__ red_out, int red_min,
    Chain chain, Value value) {
    __shared__ double sd[128];
    __shared__ float sf[32], sg[32];
    __shared__ unsigned int su[32];
    __shared__ int cand[4];
    extern __shared__ __align__(16) unsigned int cf_cert_smem[];
    const int tid = threadIdx.x;
    const long long r = blockIdx.x;
    const float* xr = x + r * ldx;
    const float* pr = P + r * ldp;
    float* hr = h + r * ldh;
    // the reduction of the recomputed columns' values: threads 0-3 (cf_cert_dots), then
    // warp 0's shuffles
    const float rinit = red_min ? __int_as_float(0x7f800000) : -__int_as_float(0x7f800000);
    float racc = rinit;
    auto on_value = [&](int n, float v) {
        if (red_out == nullptr) return;
        const float f = value(n, v);
        racc = red_min ? cf_nanmin(racc, f) : cf_nanmax(racc, f);
    };
    auto write_red = [&]() {
        if (red_out == nullptr || tid >= 32) return;
        for (int o = 16; o > 0; o >>= 1) {
            const float u = __shfl_xor_sync(CF_FULL_MASK, racc, o);
            racc = red_min ? cf_nanmin(racc, u) : cf_nanmax(racc, u);
        }
        if (tid == 0) red_out[r] = racc;
    };
    // staged & 4 (the caller sets it only with staged & 2 and red_out): h is not read
    // after this kernel, so certified rows write only their candidates' values to it (the
    // zhat and bias stores of every element saved); guard rows still build theirs there.
    // Tested where used (a kept flag costs a register).
    const bool xs_on = staged & 1, zs_on = staged & 2;
    float* xs = reinterpret_cast<float*>(cf_cert_smem);
    float* zs = xs + (xs_on ? ((K + 3) & ~3) : 0);
    unsigned int* mask = reinterpret_cast<unsigned int*>(zs + (zs_on ? ((N + 3) & ~3) : 0));

    // 1. the norms of x_r (staged in shared memory for the candidates' dot products where
    //    xs_on), then zhat (to h, and to shared memory where staged)
    float s2f = 0.f, u2f = 0.f;
    unsigned int m = 0u;
    auto add = [&](float v) {
        s2f = fmaf(v, v, s2f);
        const float u = cf_ulp13(v);
        u2f = fmaf(u, u, u2f);
        m = cf_umax(m, __float_as_uint(fabsf(v)));
    };
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
#pragma unroll 8   // loads in flight (4: 0.3 us slower on 98, 2: 2 us; 16 spills)
        for (int q = tid; q < (K >> 2); q += CF_CERT_THREADS) {
            // staged: read once, evict first (the candidates' weight rows keep L2)
            const float4 v = xs_on ? __ldcs(x4 + q) : __ldg(x4 + q);
            if (xs_on) reinterpret_cast<float4*>(xs)[q] = v;
            add(v.x);
            add(v.y);
            add(v.z);
            add(v.w);
        }
    } else {
        for (int k = tid; k < K; k += CF_CERT_THREADS) {
            const float v = xs_on ? __ldcs(xr + k) : xr[k];
            if (xs_on) xs[k] = v;
            add(v);
        }
    }
    // Float sums of nonnegative terms, one rounding each (fmaf): with t terms, the true sum
    // is at most (s + t 2^-126) (1 + 2 t 2^-24) (relative 2^-24 per step; 2^-126 absolute
    // for an underflow, flushed or not). A sum that overflowed (a finite |v| >= 2^64: not
    // a guard row for every weight; NaN and inf rows are) is redone in double. (Float sums
    // over float64 ones: the certification 0.3-0.4 us faster on 98, ENGINE_NOTES v31; a
    // row of |v| < 2^-63 gets a loose bound -- more candidates, the same answer.)
    double s2, u2;
    {
        const double t = vec ? 4.0 * ((K >> 2) / CF_CERT_THREADS + 1) + 4.0
                             : (double)(K / CF_CERT_THREADS + 1);
        if (s2f <= 3.4028234663852886e38f && u2f <= 3.4028234663852886e38f) {
            s2 = ((double)s2f + t * 0x1p-126) * (1.0 + 2.0 * t * 0x1p-24);
            u2 = ((double)u2f + t * 0x1p-126) * (1.0 + 2.0 * t * 0x1p-24);
        } else {
            s2 = 0.0;
            u2 = 0.0;
            auto addd = [&](float v) {
                s2 = fma((double)v, (double)v, s2);
                const double u = (double)cf_ulp13(v);
                u2 = fma(u, u, u2);
            };
            if (vec) {
                for (int q = tid; q < (K >> 2); q += CF_CERT_THREADS) {
                    const float4 v = reinterpret_cast<const float4*>(xs_on ? xs : xr)[q];
                    addd(v.x);
                    addd(v.y);
                    addd(v.z);
                    addd(v.w);
                }
            } else {
                for (int k = tid; k < K; k += CF_CERT_THREADS) addd(xs_on ? xs[k] : xr[k]);
            }
        }
    }
    // Launched as a programmatic dependent of the GEMM (runtime.launch_dependent), this
    // kernel may have started before the GEMM finished: x's pass above reads only x; the
    // GEMM's output is read (and h written) after the wait. A no-op otherwise.
    cf_grid_dependency_wait();
    for (int n = tid; n < N; n += CF_CERT_THREADS) {
        const float z = cf_cert_zhat(pr, splits, sstride, n);
        if (!(staged & 4)) hr[n] = z;
        if (zs_on) zs[n] = z;
    }
    // the three row reductions through one barrier: each warp's, then every thread adds
    // the warps' in order (fixed order: deterministic); the max of the bits of |v|: a
    // NaN's (0x7fc00000 and above) beat inf's
    s2 = cf_warp_sum(s2);
    u2 = cf_warp_sum(u2);
    for (int o = 16; o > 0; o >>= 1) m = cf_umax(m, __shfl_xor_sync(CF_FULL_MASK, m, o));
    if ((tid & 31) == 0) {
        sd[tid >> 5] = s2;
        sd[32 + (tid >> 5)] = u2;
        su[tid >> 5] = m;
    }
    __syncthreads();
    double S2 = 0.0, U2 = 0.0;
    unsigned int M = 0u;
    for (int i = 0; i < CF_CERT_THREADS / 32; ++i) {
        S2 += sd[i];
        U2 += sd[32 + i];
        M = cf_umax(M, su[i]);
    }
    const float mx = __uint_as_float(M);
    const int words = (N + 31) >> 5;
    const bool guard = !(mx <= 3.4028234663852886e38f) || (double)K * (double)mx * wmax >= 1e37;
    if (guard && fw != nullptr) {   // fold_rows's direct row (NaN for a NaN in x_r)
        rw_fold_direct(hr, mx != mx, xr, K, fw, fldn, fldk, fa, fc, fk, fst, N,
                       CF_CERT_THREADS);
        if (tid == 0 && counts != nullptr) counts[r] = -1;
        if (red_out != nullptr) cf_cert_reduce_row(hr, N, value, red_min, red_out, r, sf);
        return;
    }
    const double X = sqrt(S2), DX = sqrt(U2);
    // e = 1.01 (DX (Wn + DW) + X DW + gamma (X + DX)(Wn + DW)) = ca (Wn + DW) + cb DW
    const double ca = 1.01 * (DX + gamma * (X + DX)), cb = 1.01 * X;

    // (each thread reads back the zhat it wrote: no barrier needed before)
    auto range = [&](int n, float& lo, float& hi, float& mag) -> bool {
        const float z = zs_on ? zs[n] : hr[n];
        const double wu = (double)wulp[n];
        const double e = ca * ((double)wnorm[n] + wu) + cb * wu + 1e-30;
        lo = __double2float_rd((double)z - e);
        hi = __double2float_ru((double)z + e);
        if (bias != nullptr) {   // fl(z + b) is monotone in z
            lo = lo + bias[n];
            hi = hi + bias[n];
        }
        mag = fmaxf(fabsf(lo), fabsf(hi));
        return chain(n, lo, hi, mag);
    };

    if (guard) {   // a plain GEMM's: every column
        for (int i = tid; i < words; i += CF_CERT_THREADS)
            mask[i] = (i + 1) * 32 <= N ? 0xffffffffu : (1u << (N & 31)) - 1u;
        __syncthreads();
        cf_cert_recompute(xs_on ? xs : xr, w, ldw, mask, words, K, vec, sd, cand, hr, bias,
                          counts, r, on_value);
        write_red();
        return;
    }

    // 2. the largest lower bound
    float lmax = -__int_as_float(0x7f800000), gmag = 0.f;
    for (int n = tid; n < N; n += CF_CERT_THREADS) {
        float lo, hi, mag;
        if (range(n, lo, hi, mag)) {
            lmax = fmaxf(lmax, lo);
            gmag = fmaxf(gmag, mag);
        }
    }
    // both maxima through one barrier (as above), the mask cleared before it
    lmax = cf_warp_nanmax(lmax);
    gmag = cf_warp_nanmax(gmag);
    if ((tid & 31) == 0) {
        sf[tid >> 5] = lmax;
        sg[tid >> 5] = gmag;
    }
    for (int i = tid; i < words; i += CF_CERT_THREADS) mask[i] = 0u;
    __syncthreads();
    float L = -__int_as_float(0x7f800000), G = -__int_as_float(0x7f800000);
    for (int i = 0; i < CF_CERT_THREADS / 32; ++i) {
        L = cf_nanmax(L, sf[i]);
        G = cf_nanmax(G, sg[i]);
    }

    // 3. candidates
    for (int n = tid; n < N; n += CF_CERT_THREADS) {
        float lo, hi, mag;
        const bool ok = range(n, lo, hi, mag);
        const float margin = 0x1p-12f * (fabsf(L) + fabsf(hi) + mag + G) + 1e-30f;
        if (!ok || !(hi < L - margin)) atomicOr(mask + (n >> 5), 1u << (n & 31));
    }
    __syncthreads();

    // 4. z in fp32 for the candidates (+ bias), then the others' bias
    cf_cert_recompute(xs_on ? xs : xr, w, ldw, mask, words, K, vec, sd, cand,
                      hr, bias, counts, r, on_value);
    write_red();
    if (bias != nullptr && !(staged & 4)) {
        for (int n = tid; n < N; n += CF_CERT_THREADS)
            if (!((mask[n >> 5] >> (n & 31)) & 1u)) hr[n] = (zs_on ? zs[n] : hr[n]) + bias[n];
    }
}
