// kernels/cpu/cpu_rmsnorm.c — RMSNorm as Hugging Face's LlamaRMSNorm computes it in fp32:
//   r = 1 / sqrt(mean(x^2) + eps),  out = w * (x * r),
// alone or with the residual add that precedes it in a decoder layer fused in (x_out = x + residual, then the
// norm of x_out). The plain ops are the fused ones without a residual, so both give the same bits.
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

// One row: out = w * (xr * r), returns r.
static float norm_row(float *restrict out, const float *restrict xr, const float *restrict w, int C, float eps) {
    const float variance = (float)(row_dot(xr, xr, C) / C);
    const float r = 1.0f / sqrtf(variance + eps);
    for (int c = 0; c < C; c++) out[c] = w[c] * (xr[c] * r);
    return r;
}

// x_out, out, x, residual (N, C); w (C); rstd (N) or NULL. x_out may alias x or residual: each element is read
// before it is written, by the same loop iteration. residual NULL: out = rmsnorm(x), x_out untouched.
void cpu_residual_rmsnorm_fwd(float *x_out, float *out, float *rstd, const float *x, const float *residual,
                              const float *w, int N, int C, float eps) {
    for (int n = 0; n < N; n++) {
        const size_t off = (size_t)n * C;
        const float *xr = x + off;
        if (residual) {
            float *xo = x_out + off;
            const float *rr = residual + off;
            for (int c = 0; c < C; c++) xo[c] = xr[c] + rr[c];
            xr = xo; // the norm reads the stored sum (still in cache), as the unfused pair would
        }
        const float r = norm_row(out + off, xr, w, C, eps);
        if (rstd) rstd[n] = r;
    }
}

void cpu_rmsnorm_fwd(float *out, float *rstd, const float *x, const float *w, int N, int C, float eps) {
    cpu_residual_rmsnorm_fwd(NULL, out, rstd, x, NULL, w, N, C, eps);
}

// With g = dout, x = x_out and r = rstd[n], for one row:
//   dres_i = dres_in_i + r * w_i * g_i - x_i * r^3 / C * sum_j g_j w_j x_j      (r depends on every x_j)
//   dw_i  += g_i * x_i * r
// dres_out, dres_in, dout, x_out (N, C); w, dw (C); rstd (N). dres_in NULL counts as zero; dres_out may alias it.
void cpu_residual_rmsnorm_bwd(float *dres_out, float *dw, const float *dres_in, const float *dout, const float *x_out,
                              const float *w, const float *rstd, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float *restrict xr = x_out + (size_t)n * C;
        const float *restrict gr = dout + (size_t)n * C;
        const float *dinr = dres_in ? dres_in + (size_t)n * C : NULL;
        float *dxr = dres_out + (size_t)n * C;
        const float r = rstd[n];
        double acc[8] = {0};
        int c = 0;
        for (; c + 8 <= C; c += 8)
            for (int j = 0; j < 8; j++) acc[j] += (double)gr[c + j] * w[c + j] * xr[c + j];
        double gwx = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; c < C; c++) gwx += (double)gr[c] * w[c] * xr[c];
        const float k = (float)(gwx * r * r * r / C);
        if (dinr)
            for (int i = 0; i < C; i++) dxr[i] = dinr[i] + (r * w[i] * gr[i] - xr[i] * k);
        else
            for (int i = 0; i < C; i++) dxr[i] = r * w[i] * gr[i] - xr[i] * k;
        if (dw)
            for (int i = 0; i < C; i++) dw[i] += gr[i] * xr[i] * r;
    }
}

void cpu_rmsnorm_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w, const float *rstd,
                     int N, int C) {
    cpu_residual_rmsnorm_bwd(dx, dw, dx, dout, x, w, rstd, N, C);
}
