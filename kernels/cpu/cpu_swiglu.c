// kernels/cpu/cpu_swiglu.c — the SwiGLU gate of the Llama MLP on the fused [gate | up] projection:
// out = silu(gate) * up, silu(g) = g * sigmoid(g) = g / (1 + exp(-g)) (PyTorch's formula).
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_vecmath.h"

// gu (N, 2I): row n is [gate (I) | up (I)]; out (N, I).
void cpu_swiglu_fwd(float *out, const float *gu, int N, int I) {
    for (int n = 0; n < N; n++) {
        const float *restrict g = gu + (size_t)n * 2 * I;
        const float *restrict u = g + I;
        float *restrict o = out + (size_t)n * I;
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.0f + cpu_vexp(-g[i])) * u[i];
    }
}

// With s = sigmoid(g):  d silu(g) / dg = s * (1 + g * (1 - s)), so
//   dgate = dout * up * s * (1 + g (1 - s)),   dup = dout * g * s.
// dgu (N, 2I) is overwritten; dout (N, I).
void cpu_swiglu_bwd(float *dgu, const float *dout, const float *gu, int N, int I) {
    for (int n = 0; n < N; n++) {
        const float *restrict g = gu + (size_t)n * 2 * I;
        const float *restrict u = g + I;
        const float *restrict d = dout + (size_t)n * I;
        float *restrict dg = dgu + (size_t)n * 2 * I;
        float *restrict du = dg + I;
        for (int i = 0; i < I; i++) {
            const float s = 1.0f / (1.0f + cpu_vexp(-g[i]));
            dg[i] = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
            du[i] = d[i] * g[i] * s;
        }
    }
}
