// bench/bench_attention.c — throughput of the training attention (ops_attention_fwd / ops_attention_bwd) on
// the CUDA backend: `batch` packed sequences of `seq` tokens, causal, Hq query / Hkv kv heads of head_dim D.
//
//   bench_attention [--hq 14] [--hkv 2] [--d 64] [--seq 1024] [--batch 8] [--iters 20]
//
// Prints one JSON object: milliseconds per call and TFLOP/s with the causal FLOP count
// fwd = 4 * T^2 / 2 * D * Hq per sequence (the two products, half the T x T scores), bwd = 2.5 x fwd
// (the five products of the backward), as flash-attention papers and PyTorch's benchmarks count them.
// Exits 77 when no CUDA device is visible.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "kernels/ops.h"

static void *rand_buf(OpsCtx *ctx, size_t n, float lo, float hi, unsigned *seed) {
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = lo + (hi - lo) * (float)rand_r(seed) / (float)RAND_MAX;
    void *d = ops_malloc(ctx, n * ops_dtype_size(ctx));
    if (d) ops_upload_f32(ctx, d, h, n);
    free(h);
    return d;
}

int main(int argc, char **argv) {
    int Hq = 14, Hkv = 2, D = 64, T = 1024, B = 8, iters = 20;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i];
        const int val = atoi(argv[i + 1]);
        if (!strcmp(a, "--hq")) Hq = val;
        else if (!strcmp(a, "--hkv")) Hkv = val;
        else if (!strcmp(a, "--d")) D = val;
        else if (!strcmp(a, "--seq")) T = val;
        else if (!strcmp(a, "--batch")) B = val;
        else if (!strcmp(a, "--iters")) iters = val;
        else {
            fprintf(stderr, "unknown option %s\n", a);
            return 2;
        }
    }
    if (Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || T <= 0 || B <= 0 || iters <= 0) {
        fprintf(stderr, "bad shape\n");
        return 2;
    }
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        printf("SKIP: no CUDA device\n");
        return 77;
    }
    char err[256];
    OpsCtx *ctx;
    if (ops_create(&ctx, OPS_BACKEND_CUDA, 0, err, sizeof err) != 0) {
        fprintf(stderr, "cannot create the CUDA context: %s\n", err);
        return 1;
    }
    const int N = B * T;
    const size_t nq = (size_t)N * Hq * D, nk = (size_t)N * Hkv * D;
    unsigned seed = 1;
    void *q = rand_buf(ctx, nq, -2, 2, &seed), *k = rand_buf(ctx, nk, -2, 2, &seed);
    void *v = rand_buf(ctx, nk, -1, 1, &seed), *dout = rand_buf(ctx, nq, -1, 1, &seed);
    void *out = ops_malloc(ctx, nq * 2), *dq = ops_malloc(ctx, nq * 2);
    void *dk = ops_malloc(ctx, nk * 2), *dv = ops_malloc(ctx, nk * 2);
    float *lse = ops_malloc(ctx, (size_t)N * Hq * 4);
    int32_t *cu_h = malloc(((size_t)B + 1) * sizeof *cu_h);
    for (int b = 0; b <= B; b++) cu_h[b] = b * T;
    int32_t *cu = ops_malloc(ctx, ((size_t)B + 1) * 4);
    if (cu) ops_copy_to_device(ctx, cu, cu_h, ((size_t)B + 1) * 4);
    free(cu_h);
    const float scale = 1.0f / sqrtf((float)D);

    // Warm-up (also grows the backend's scratch to its final size), then timed loops.
    ops_attention_fwd(ctx, out, lse, q, k, v, cu, B, N, Hq, Hkv, D, scale);
    ops_attention_bwd(ctx, dq, dk, dv, dout, q, k, v, out, lse, cu, B, N, Hq, Hkv, D, scale);
    ops_synchronize(ctx);
    double t0 = bench_now_s();
    for (int i = 0; i < iters; i++) ops_attention_fwd(ctx, out, lse, q, k, v, cu, B, N, Hq, Hkv, D, scale);
    ops_synchronize(ctx);
    const double fwd_s = (bench_now_s() - t0) / iters;
    t0 = bench_now_s();
    for (int i = 0; i < iters; i++)
        ops_attention_bwd(ctx, dq, dk, dv, dout, q, k, v, out, lse, cu, B, N, Hq, Hkv, D, scale);
    ops_synchronize(ctx);
    const double bwd_s = (bench_now_s() - t0) / iters;
    if (ops_status(ctx)) {
        fprintf(stderr, "attention failed: %s\n", ops_error(ctx));
        return 1;
    }
    const double fwd_flop = 4.0 * T * (double)T / 2.0 * D * Hq * B;
    printf("{\"hq\": %d, \"hkv\": %d, \"d\": %d, \"seq\": %d, \"batch\": %d, \"fwd_ms\": %.4f, \"bwd_ms\": %.4f, "
           "\"fwd_tflops\": %.2f, \"bwd_tflops\": %.2f}\n",
           Hq, Hkv, D, T, B, fwd_s * 1e3, bwd_s * 1e3, fwd_flop / fwd_s * 1e-12, 2.5 * fwd_flop / bwd_s * 1e-12);
    ops_free(ctx, q), ops_free(ctx, k), ops_free(ctx, v), ops_free(ctx, dout), ops_free(ctx, out);
    ops_free(ctx, dq), ops_free(ctx, dk), ops_free(ctx, dv), ops_free(ctx, lse), ops_free(ctx, cu);
    ops_destroy(ctx);
    return 0;
}
