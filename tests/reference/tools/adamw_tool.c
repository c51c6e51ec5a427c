// tests/reference/tools/adamw_tool.c — runs ops_adamw_step (CPU backend, through kernels/ops.h) for
// tests/reference/test_kernel_adamw.py, which compares it with torch.optim.AdamW.
//   adamw_tool N STEPS LR BETA1 BETA2 EPS WEIGHT_DECAY GRAD_SCALE
//   stdin : N float32 initial parameters, then STEPS x N float32 gradients (little-endian, raw)
//   stdout: STEPS x N float32 parameters after each step, then N float32 exp_avg and N exp_avg_sq after the last
// Errors go to stderr with exit status 1.
#include <stdio.h>
#include <stdlib.h>

#include "kernels/ops.h"

static int read_all(float *dst, size_t n) { return fread(dst, sizeof(float), n, stdin) == n ? 0 : -1; }

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: %s N STEPS LR BETA1 BETA2 EPS WEIGHT_DECAY GRAD_SCALE\n", argv[0]);
        return 1;
    }
    const long n = strtol(argv[1], NULL, 10), steps = strtol(argv[2], NULL, 10);
    if (n <= 0 || steps <= 0 || n > (1L << 26) || steps > 100000) {
        fprintf(stderr, "N and STEPS must be positive (N <= 2^26), got %s %s\n", argv[1], argv[2]);
        return 1;
    }
    const float lr = strtof(argv[3], NULL), beta1 = strtof(argv[4], NULL), beta2 = strtof(argv[5], NULL);
    const float eps = strtof(argv[6], NULL), wd = strtof(argv[7], NULL), grad_scale = strtof(argv[8], NULL);
    OpsCtx *ctx;
    char err[256];
    if (ops_create(&ctx, OPS_BACKEND_CPU, 0, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    const size_t bytes = (size_t)n * sizeof(float);
    float *host = malloc(bytes);
    float *master = ops_malloc(ctx, bytes), *m = ops_malloc(ctx, bytes), *v = ops_malloc(ctx, bytes);
    float *grad = ops_malloc(ctx, bytes);
    void *param = ops_malloc(ctx, (size_t)n * ops_dtype_size(ctx));
    if (!host || ops_status(ctx)) {
        fprintf(stderr, "out of memory for N=%ld\n", n);
        return 1;
    }
    if (read_all(host, (size_t)n)) {
        fprintf(stderr, "stdin ended before the %ld initial parameters\n", n);
        return 1;
    }
    ops_copy_to_device(ctx, master, host, bytes);
    for (long s = 1; s <= steps; s++) {
        if (read_all(host, (size_t)n)) {
            fprintf(stderr, "stdin ended before the gradient of step %ld\n", s);
            return 1;
        }
        ops_copy_to_device(ctx, grad, host, bytes);
        ops_adamw_step(ctx, master, m, v, grad, param, (size_t)n, lr, beta1, beta2, eps, wd, (int)s, grad_scale);
        ops_download_f32(ctx, host, param, (size_t)n);
        fwrite(host, sizeof(float), (size_t)n, stdout);
    }
    ops_copy_to_host(ctx, host, m, bytes);
    fwrite(host, sizeof(float), (size_t)n, stdout);
    ops_copy_to_host(ctx, host, v, bytes);
    fwrite(host, sizeof(float), (size_t)n, stdout);
    if (ops_status(ctx)) {
        fprintf(stderr, "%s\n", ops_error(ctx));
        return 1;
    }
    ops_free(ctx, master), ops_free(ctx, m), ops_free(ctx, v), ops_free(ctx, grad), ops_free(ctx, param);
    ops_destroy(ctx);
    free(host);
    return fflush(stdout) == 0 ? 0 : 1;
}
