// kernels/cpu/cpu_sum_squares.c — sum of squares for global gradient-norm clipping.
#include "kernels/cpu/cpu_ops.h"

// *out += sum x[i]^2 over n fp32 elements. The sum runs in double over eight lanes (vectorizable without
// reassociating one running sum): a model's gradient has up to billions of elements, far past what a
// float accumulator can add without losing the small ones.
void cpu_sum_squares(float *out, const float *x, size_t n) {
    double acc[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += (double)x[i + j] * x[i + j];
    double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += (double)x[i] * x[i];
    *out = (float)((double)*out + s);
}
