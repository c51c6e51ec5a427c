// kernels/cpu/cpu_elementwise.c — residual add: y (n) += x (n), fp32; scaling x (n) *= s.
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
