// kernels/cpu/cpu_elementwise.c — residual add: y (n) += x (n), fp32; scaling x (n) *= s; seeded dropout.
#include <math.h>

#include "kernels/cpu/cpu_ops.h"

void cpu_add_inplace(float *restrict y, const float *restrict x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

void cpu_add_f32(float *restrict y, const float *restrict x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

void cpu_scale_inplace(float *restrict x, float s, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

void cpu_dropout(float *out, const float *in, size_t n, float p, uint64_t seed) {
    const uint32_t threshold = (uint32_t)lrint((double)p * 16777216.0);
    const float scale = 1.0f / (1.0f - p);
    for (size_t i = 0; i < n; i++) out[i] = cpu_dropout_keep(seed, i, threshold) ? in[i] * scale : 0.0f;
}
