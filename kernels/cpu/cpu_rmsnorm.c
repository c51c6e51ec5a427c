// kernels/cpu/cpu_rmsnorm.c — RMSNorm as Hugging Face's LlamaRMSNorm computes it in fp32:
//   r = 1 / sqrt(mean(x^2) + eps),  out = w * (x * r).
#include <math.h>

#include "kernels/cpu/cpu_ops.h"

// Sum of a[c] * b[c] over one row, accumulated in double: a row of a few thousand squares summed in float
// would lose digits that the reference (pairwise float sums in PyTorch) keeps. Eight independent lanes
// let the compiler vectorize the loop without reassociating a single running sum.
static double row_dot(const float *restrict a, const float *restrict b, int C) {
    double acc[8] = {0};
    int c = 0;
    for (; c + 8 <= C; c += 8)
        for (int j = 0; j < 8; j++) acc[j] += (double)a[c + j] * b[c + j];
    double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; c < C; c++) s += (double)a[c] * b[c];
    return s;
}

// out, x (N, C); w (C); rstd (N) or NULL.
void cpu_rmsnorm_fwd(float *out, float *rstd, const float *x, const float *w, int N, int C, float eps) {
    for (int n = 0; n < N; n++) {
        const float *restrict xr = x + (size_t)n * C;
        float *restrict yr = out + (size_t)n * C;
        float variance = (float)(row_dot(xr, xr, C) / C);
        float r = 1.0f / sqrtf(variance + eps);
        for (int c = 0; c < C; c++) yr[c] = w[c] * (xr[c] * r);
        if (rstd) rstd[n] = r;
    }
}

// With g = dout and r = rstd[n], for one row:
//   dx_i += r * w_i * g_i - x_i * r^3 / C * sum_j g_j w_j x_j      (r depends on every x_j)
//   dw_i += g_i * x_i * r
// dx, dout, x (N, C); w, dw (C); rstd (N).
void cpu_rmsnorm_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w, const float *rstd,
                     int N, int C) {
    for (int n = 0; n < N; n++) {
        const float *restrict xr = x + (size_t)n * C;
        const float *restrict gr = dout + (size_t)n * C;
        float *restrict dxr = dx + (size_t)n * C;
        const float r = rstd[n];
        double acc[8] = {0};
        int c = 0;
        for (; c + 8 <= C; c += 8)
            for (int j = 0; j < 8; j++) acc[j] += (double)gr[c + j] * w[c + j] * xr[c + j];
        double gwx = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; c < C; c++) gwx += (double)gr[c] * w[c] * xr[c];
        const float k = (float)(gwx * r * r * r / C);
        for (int i = 0; i < C; i++) dxr[i] += r * w[i] * gr[i] - xr[i] * k;
        if (dw)
            for (int i = 0; i < C; i++) dw[i] += gr[i] * xr[i] * r;
    }
}
