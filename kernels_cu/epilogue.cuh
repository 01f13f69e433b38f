// epilogue.cuh -- the "cheap tail" pieces that follow a Linear layer, as
// functors a kernel is composed from (template parameters).
//
// A tail is: window pooling over `k` consecutive columns of y = z + bias
// (Pool), an activation applied to each pooled value (Act), and a reduction
// over the pooled values of a row (Red, from common.cuh).
#pragma once
#include "common.cuh"

// Max over a window of k columns, NaN-propagating (MaxPool1d semantics).
struct PoolMax {
    static __device__ __forceinline__ float window(const float* z, const float* bias, int k) {
        float m = z[0] + (bias ? bias[0] : 0.0f);
        for (int i = 1; i < k; ++i) m = cf_nanmax(m, z[i] + (bias ? bias[i] : 0.0f));
        return m;
    }
};

// Mean over a window of k columns (AvgPool1d: sum in float, then divide by k).
// With k == 1 this is the identity, which the k=1 tails use.
struct PoolAvg {
    static __device__ __forceinline__ float window(const float* z, const float* bias, int k) {
        if (k == 1) return z[0] + (bias ? bias[0] : 0.0f);
        float s = 0.0f;
        for (int i = 0; i < k; ++i) s += z[i] + (bias ? bias[i] : 0.0f);
        return s / (float)k;
    }
};

struct ActIdentity {
    static __device__ __forceinline__ float apply(float v, float) { return v; }
};
struct ActAbs {
    static __device__ __forceinline__ float apply(float v, float) { return fabsf(v); }
};
struct ActSigmoid {
    static __device__ __forceinline__ float apply(float v, float) { return cf_sigmoid(v); }
};
// gelu(v) * scale, the order of model 98 (scale after the activation).
struct ActGeluScale {
    static __device__ __forceinline__ float apply(float v, float scale) { return cf_gelu(v) * scale; }
};
