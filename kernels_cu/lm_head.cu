// lm_head.cu -- the row statistics and the gradient of a cross entropy over transposed
// logits, for cupyfuse.lmhead (a Linear head and its loss, the logits stored at most once).
//
// The logits are stored transposed: Lt (V rows of classes x T tokens, row pitch ld), so a
// thread owns VEC adjacent tokens and walks down the classes, and a warp's loads are
// contiguous. Element kinds: 0 float32, 1 bfloat16, 2 float16 (16-bit values are raw bits;
// conversions by cvt, rounding to nearest even). Arithmetic is float32, in the log2 domain
// (z2 = z * log2(e), exp2).
//
// lse_partial_*: for one split of the classes (blockIdx.y), per token: the running maximum
//   m2 (log2 domain) and the sum s of 2^(z2 - m2), the target's logit (when the target is a
//   class of this split, else 0), and (want_sz) the class-weighted sum of the logits.
//   cupyfuse.lmhead combines the splits' partials in a fixed order. NaN logits make s NaN;
//   equal infinities count 1 (no inf - inf), so an all -inf column gives lse = -inf as
//   torch.logsumexp does.
// ce_grad_*: in place, Lt[v, t] <- A[t] p - C[t] w[v] - (y[t] == v ? B[t] : 0), where
//   p = 2^(z2 - lse2[t]) is the softmax, w the class weights (1 without them): the
//   derivative of cross entropy with class weights and label smoothing, scaled by the
//   incoming gradient (cupyfuse.lmhead makes A, B, C per token).
// Deterministic: no atomics; each output is written by one thread.
#define CF_LOG2E 1.4426950408889634f
#define CF_NEG_INF (__int_as_float(0xff800000u))

template <int KIND> struct CfElem;
template <> struct CfElem<0> {
    typedef float T;
    static __device__ __forceinline__ float get(float v) { return v; }
    static __device__ __forceinline__ float put(float v) { return v; }
};
template <> struct CfElem<1> {
    typedef unsigned short T;
    static __device__ __forceinline__ float get(unsigned short h) {
        return __uint_as_float(((unsigned)h) << 16);
    }
    static __device__ __forceinline__ unsigned short put(float v) {
        unsigned short h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    }
};
template <> struct CfElem<2> {
    typedef unsigned short T;
    static __device__ __forceinline__ float get(unsigned short h) {
        float v;
        asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(h));
        return v;
    }
    static __device__ __forceinline__ unsigned short put(float v) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    }
};

// VEC adjacent elements (VEC = 2 only for 16-bit kinds: one 4-byte access)
template <int KIND, int VEC>
__device__ __forceinline__ void cf_load(const typename CfElem<KIND>::T* p, float* out) {
    if (VEC == 2) {
        unsigned u = *reinterpret_cast<const unsigned*>(p);
        out[0] = CfElem<KIND>::get((unsigned short)(u & 0xffffu));
        out[1] = CfElem<KIND>::get((unsigned short)(u >> 16));
    } else {
        out[0] = CfElem<KIND>::get(p[0]);
    }
}
template <int KIND, int VEC>
__device__ __forceinline__ void cf_store(typename CfElem<KIND>::T* p, const float* v) {
    if (VEC == 2) {
        unsigned u = (unsigned)CfElem<KIND>::put(v[0]) | ((unsigned)CfElem<KIND>::put(v[1]) << 16);
        *reinterpret_cast<unsigned*>(p) = u;
    } else {
        p[0] = CfElem<KIND>::put(v[0]);
    }
}

// 2^(a - b) where a == b (both infinite, or both equal) counts 1
__device__ __forceinline__ float cf_exp2_diff(float a, float b) {
    return a == b ? 1.0f : exp2f(a - b);
}

template <int KIND, int VEC>
__device__ __forceinline__ void cf_lse_partial(
        const typename CfElem<KIND>::T* Lt, long long ld, int rows, int ntok, int v0,
        const float* bias, const float* cw, const long long* y, int rows_per_split,
        int want_sz, float* pm, float* ps, float* pzy, float* psz, int slot0) {
    const int t0 = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (t0 >= ntok) return;
    const int r0 = blockIdx.y * rows_per_split;
    const int r1 = min(rows, r0 + rows_per_split);
    float m[VEC], s[VEC], sz[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) { m[j] = CF_NEG_INF; s[j] = 0.0f; sz[j] = 0.0f; }
    int r = r0;
    for (; r + 8 <= r1; r += 8) {
        float z[8][VEC];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            cf_load<KIND, VEC>(Lt + (long long)(r + i) * ld + t0, z[i]);
            const float b = bias ? bias[v0 + r + i] : 0.0f;
            const float w = cw ? cw[v0 + r + i] : 1.0f;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                z[i][j] += b;
                if (want_sz) sz[j] = fmaf(w, z[i][j], sz[j]);
                z[i][j] *= CF_LOG2E;
            }
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float g = z[0][j];
#pragma unroll
            for (int i = 1; i < 8; ++i) g = fmaxf(g, z[i][j]);
            const float mn = fmaxf(m[j], g);
            float acc = s[j] * cf_exp2_diff(m[j], mn);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc += cf_exp2_diff(z[i][j], mn);
            s[j] = acc;
            m[j] = mn;
        }
    }
    for (; r < r1; ++r) {
        float z[VEC];
        cf_load<KIND, VEC>(Lt + (long long)r * ld + t0, z);
        const float b = bias ? bias[v0 + r] : 0.0f;
        const float w = cw ? cw[v0 + r] : 1.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float zz = z[j] + b;
            if (want_sz) sz[j] = fmaf(w, zz, sz[j]);
            const float z2 = zz * CF_LOG2E;
            const float mn = fmaxf(m[j], z2);
            s[j] = s[j] * cf_exp2_diff(m[j], mn) + cf_exp2_diff(z2, mn);
            m[j] = mn;
        }
    }
    const long long slot = (long long)(slot0 + blockIdx.y) * ntok;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const int t = t0 + j;
        if (t >= ntok) break;
        const long long yt = y[t] - v0;
        float zy = 0.0f;
        if (yt >= r0 && yt < r1) {
            zy = CfElem<KIND>::get(Lt[yt * ld + t]) + (bias ? bias[v0 + yt] : 0.0f);
        }
        pm[slot + t] = m[j];
        ps[slot + t] = s[j];
        pzy[slot + t] = zy;
        psz[slot + t] = sz[j];
    }
}

template <int KIND, int VEC>
__device__ __forceinline__ void cf_ce_grad(
        typename CfElem<KIND>::T* Lt, long long ld, int rows, int ntok, int v0,
        const float* bias, const float* cw, const long long* y, const float* lse2,
        const float* A, const float* B, const float* C, int rows_per_split) {
    const int t0 = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (t0 >= ntok) return;
    const int r0 = blockIdx.y * rows_per_split;
    const int r1 = min(rows, r0 + rows_per_split);
    float a[VEC], bb[VEC], c[VEC], l2[VEC];
    long long yy[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        a[j] = A[t0 + j]; bb[j] = B[t0 + j]; c[j] = C[t0 + j]; l2[j] = lse2[t0 + j];
        yy[j] = y[t0 + j] - v0;
    }
#pragma unroll 4
    for (int r = r0; r < r1; ++r) {
        typename CfElem<KIND>::T* p = Lt + (long long)r * ld + t0;
        float z[VEC];
        cf_load<KIND, VEC>(p, z);
        const float b = bias ? bias[v0 + r] : 0.0f;
        const float w = cw ? cw[v0 + r] : 1.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float pr = exp2f(fmaf(z[j] + b, CF_LOG2E, -l2[j]));
            float d = fmaf(a[j], pr, -c[j] * w);
            if (yy[j] == r) d -= bb[j];
            z[j] = d;
        }
        cf_store<KIND, VEC>(p, z);
    }
}

#define CF_LMHEAD_LSE(name, KIND, VEC)                                                      \
extern "C" __global__ void name(const void* Lt, long long ld, int rows, int ntok, int v0,     \
        const float* bias, const float* cw, const long long* y, int rows_per_split,          \
        int want_sz, float* pm, float* ps, float* pzy, float* psz, int slot0) {              \
    cf_lse_partial<KIND, VEC>((const typename CfElem<KIND>::T*)Lt, ld, rows, ntok, v0, bias, \
                              cw, y, rows_per_split, want_sz, pm, ps, pzy, psz, slot0);      \
}
#define CF_LMHEAD_GRAD(name, KIND, VEC)                                                     \
extern "C" __global__ void name(void* Lt, long long ld, int rows, int ntok, int v0,           \
        const float* bias, const float* cw, const long long* y, const float* lse2,           \
        const float* A, const float* B, const float* C, int rows_per_split) {                \
    cf_ce_grad<KIND, VEC>((typename CfElem<KIND>::T*)Lt, ld, rows, ntok, v0, bias, cw, y,    \
                          lse2, A, B, C, rows_per_split);                                     \
}

CF_LMHEAD_LSE(lse_partial_f32, 0, 1)
CF_LMHEAD_LSE(lse_partial_bf16, 1, 1)
CF_LMHEAD_LSE(lse_partial_bf16x2, 1, 2)
CF_LMHEAD_LSE(lse_partial_f16, 2, 1)
CF_LMHEAD_LSE(lse_partial_f16x2, 2, 2)
CF_LMHEAD_GRAD(ce_grad_f32, 0, 1)
CF_LMHEAD_GRAD(ce_grad_bf16, 1, 1)
CF_LMHEAD_GRAD(ce_grad_bf16x2, 1, 2)
CF_LMHEAD_GRAD(ce_grad_f16, 2, 1)
CF_LMHEAD_GRAD(ce_grad_f16x2, 2, 2)

// lse_fold: per token, fold nsplit partials (in split order) into the running state
// (rm, rs, rzy, rsz); first = 1 starts it. One thread a token.
extern "C" __global__ void lse_fold(const float* pm, const float* ps, const float* pzy,
                                    const float* psz, int nsplit, int ntok, float* rm,
                                    float* rs, float* rzy, float* rsz, int first) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= ntok) return;
    float m = first ? CF_NEG_INF : rm[t];
    float s = first ? 0.0f : rs[t];
    float zy = first ? 0.0f : rzy[t];
    float sz = first ? 0.0f : rsz[t];
    for (int k = 0; k < nsplit; ++k) {
        const long long i = (long long)k * ntok + t;
        const float mk = pm[i];
        const float mn = fmaxf(m, mk);
        s = s * cf_exp2_diff(m, mn) + ps[i] * cf_exp2_diff(mk, mn);
        m = mn;
        zy += pzy[i];
        sz += psz[i];
    }
    rm[t] = m;
    rs[t] = s;
    rzy[t] = zy;
    rsz[t] = sz;
}
