// kernels/cpu/cpu_elementwise.c — residual add: y (n) += x (n), fp32.
#include "kernels/cpu/cpu_ops.h"

void cpu_add_inplace(float *restrict y, const float *restrict x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

void cpu_add_f32(float *restrict y, const float *restrict x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}
