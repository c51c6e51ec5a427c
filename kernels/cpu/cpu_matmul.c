// kernels/cpu/cpu_matmul.c — the Linear layer through OpenBLAS sgemm, row-major, weight (OC, IC) as PyTorch
// stores it. GEMMs are where CPU training spends its time, so every product here is one cblas call on the
// caller's buffers (no copies, no transposed scratch).
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
// After cpu_ops.h: OpenBLAS's cblas.h pulls in <complex.h>, whose macro I would rewrite the parameter
// named I in cpu_ops.h's prototypes.
#include <cblas.h>

// out (N, OC) = in (N, IC) @ w^T (IC, OC) + bias (OC).
void cpu_matmul_fwd(float *out, const float *in, const float *w, const float *bias, int N, int IC, int OC) {
    if (N <= 0 || OC <= 0) return;
    if (IC <= 0) { // an empty inner product: out is just the bias (or zero)
        for (int n = 0; n < N; n++) {
            if (bias) memcpy(out + (size_t)n * OC, bias, (size_t)OC * sizeof(float));
            else memset(out + (size_t)n * OC, 0, (size_t)OC * sizeof(float));
        }
        return;
    }
    float beta = 0.0f;
    if (bias) { // seed every row with the bias and let the GEMM add onto it
        for (int n = 0; n < N; n++) memcpy(out + (size_t)n * OC, bias, (size_t)OC * sizeof(float));
        beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, IC, 1.0f, in, IC, w, IC, beta, out, OC);
}

// din (N, IC) = dout (N, OC) @ w (OC, IC)          (+= with din_accumulate; skipped when din is NULL)
// dw (OC, IC) += dout^T (OC, N) @ in (N, IC)       (fp32, skipped when NULL)
// dbias (OC) += sum over rows of dout              (skipped when NULL)
void cpu_matmul_bwd(float *din, float *dw, float *dbias, const float *dout, const float *in, const float *w,
                    int N, int IC, int OC, int din_accumulate) {
    if (N <= 0 || IC < 0 || OC < 0) return;
    if (din && IC > 0) {
        if (OC > 0)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, IC, OC, 1.0f, dout, OC, w, IC,
                        din_accumulate ? 1.0f : 0.0f, din, IC);
        else if (!din_accumulate)
            memset(din, 0, (size_t)N * IC * sizeof(float));
    }
    if (dw && IC > 0 && OC > 0)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, IC, N, 1.0f, dout, OC, in, IC, 1.0f, dw, IC);
    if (dbias) {
        // Column sums over N rows (N = all tokens of a batch, thousands) accumulate in double, a chunk of
        // columns at a time so the accumulators stay on the stack.
        enum { CHUNK = 256 };
        double acc[CHUNK];
        for (int o0 = 0; o0 < OC; o0 += CHUNK) {
            const int len = OC - o0 < CHUNK ? OC - o0 : CHUNK;
            for (int o = 0; o < len; o++) acc[o] = 0.0;
            for (int n = 0; n < N; n++) {
                const float *restrict row = dout + (size_t)n * OC + o0;
                for (int o = 0; o < len; o++) acc[o] += row[o];
            }
            for (int o = 0; o < len; o++) dbias[o0 + o] += (float)acc[o];
        }
    }
}
