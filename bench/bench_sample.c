// bench/bench_sample.c — GPU time of the rollout server's fused sampling op (ops_sample_rows) per decode step:
// B rows of V bf16 logits (one row per sample, as a decode step has), for the parameter sets a server meets.
//
//   bench_sample [--v 151936] [--batches 1,64,256,512] [--iters 50]
//
// Modes: greedy; t1 (temperature 1, no filter: GRPO's rollouts); topp (T 0.7, top_p 0.9); topk (T 0.7, top_k 50);
// pen (T 1, repetition penalty 1.1 over a 256-token history). One JSON object per line: microseconds per call
// (host clock over --iters back-to-back calls after a warm-up, then a synchronize), and the logits bytes read once
// per call divided by that time. Logits are random normal (scale 3), like an untrained model's. Exits 77 when no
// CUDA device is visible.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "kernels/ops.h"

static unsigned long long rng_state = 0x9e3779b97f4a7c15ull;
static double unit(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1.0p-53;
}
static float normal(void) {
    const double a = unit() + 1e-12, b = unit();
    return (float)(sqrt(-2.0 * log(a)) * cos(6.283185307179586 * b));
}

enum { MODES = 5, HIST = 256 };
static const char *const MODE_NAME[MODES] = {"greedy", "t1", "topp", "topk", "pen"};

static OpsSampleParams mode_params(int mode, int row) {
    OpsSampleParams p = {.u = unit(), .temperature = 1.0f, .top_p = 1.0f, .min_p = 0.0f,
                         .repetition_penalty = 1.0f, .top_k = 0, .logits_row = row};
    if (mode == 0) p.temperature = 0.0f;
    if (mode == 2) p.temperature = 0.7f, p.top_p = 0.9f;
    if (mode == 3) p.temperature = 0.7f, p.top_k = 50;
    if (mode == 4) p.repetition_penalty = 1.1f;
    return p;
}

int main(int argc, char **argv) {
    int V = 151936, iters = 50, batches[16] = {1, 64, 256, 512}, n_batches = 4;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--v") && i + 1 < argc) V = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batches") && i + 1 < argc) n_batches = bench_parse_list(argv[++i], batches, 16);
        else {
            fprintf(stderr, "usage: bench_sample [--v 151936] [--batches 1,64,256,512] [--iters 50]\n");
            return 2;
        }
    }
    if (V < 1 || iters < 1 || n_batches < 1) {
        fprintf(stderr, "bench_sample: bad --v, --iters or --batches\n");
        return 2;
    }
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        fprintf(stderr, "bench_sample: no CUDA device visible; skipped\n");
        return 77;
    }
    char err[512];
    OpsCtx *ctx = NULL;
    if (ops_create(&ctx, OPS_BACKEND_CUDA, 0, err, sizeof err) != 0) {
        fprintf(stderr, "bench_sample: %s\n", err);
        return 1;
    }
    int max_b = 0;
    for (int i = 0; i < n_batches; i++) max_b = batches[i] > max_b ? batches[i] : max_b;
    const size_t n_logits = (size_t)max_b * V;
    float *host = malloc(n_logits * sizeof *host);
    OpsSampleParams *params = malloc((size_t)max_b * sizeof *params);
    int32_t *hist = malloc((size_t)max_b * HIST * sizeof *hist);
    int32_t *offsets = malloc(((size_t)max_b + 1) * sizeof *offsets);
    if (!host || !params || !hist || !offsets) {
        fprintf(stderr, "bench_sample: out of host memory\n");
        return 1;
    }
    for (size_t i = 0; i < n_logits; i++) host[i] = 3.0f * normal();
    for (int s = 0; s <= max_b; s++) offsets[s] = s * HIST;
    for (size_t i = 0; i < (size_t)max_b * HIST; i++) hist[i] = (int32_t)(unit() * V);
    void *d_logits = ops_malloc(ctx, n_logits * ops_dtype_size(ctx));
    OpsSampleParams *d_params = ops_malloc(ctx, (size_t)max_b * sizeof *d_params);
    int32_t *d_hist = ops_malloc(ctx, (size_t)max_b * HIST * sizeof *d_hist);
    int32_t *d_off = ops_malloc(ctx, ((size_t)max_b + 1) * sizeof *d_off);
    int32_t *d_tok = ops_malloc(ctx, (size_t)max_b * sizeof *d_tok);
    float *d_lp = ops_malloc(ctx, (size_t)max_b * sizeof *d_lp);
    if (ops_status(ctx)) {
        fprintf(stderr, "bench_sample: %s (try fewer --batches or a smaller --v)\n", ops_error(ctx));
        return 1;
    }
    ops_upload_f32(ctx, d_logits, host, n_logits);
    ops_copy_to_device(ctx, d_hist, hist, (size_t)max_b * HIST * sizeof *hist);
    ops_copy_to_device(ctx, d_off, offsets, ((size_t)max_b + 1) * sizeof *offsets);
    for (int bi = 0; bi < n_batches; bi++) {
        const int B = batches[bi];
        for (int mode = 0; mode < MODES; mode++) {
            for (int s = 0; s < B; s++) params[s] = mode_params(mode, s);
            ops_copy_to_device(ctx, d_params, params, (size_t)B * sizeof *params);
            const int32_t *h = mode == 4 ? d_hist : NULL, *o = mode == 4 ? d_off : NULL;
            const int nh = mode == 4 ? B * HIST : 0;
            for (int w = 0; w < 3; w++) ops_sample_rows(ctx, d_tok, d_lp, d_logits, d_params, h, o, B, B, V, nh);
            ops_synchronize(ctx);
            const double t0 = bench_now_s();
            for (int it = 0; it < iters; it++) ops_sample_rows(ctx, d_tok, d_lp, d_logits, d_params, h, o, B, B, V, nh);
            ops_synchronize(ctx);
            const double us = (bench_now_s() - t0) / iters * 1e6;
            if (ops_status(ctx)) {
                fprintf(stderr, "bench_sample: %s\n", ops_error(ctx));
                return 1;
            }
            printf("{\"mode\": \"%s\", \"batch\": %d, \"v\": %d, \"us\": %.2f, \"logits_gbs\": %.1f}\n",
                   MODE_NAME[mode], B, V, us, (double)B * V * ops_dtype_size(ctx) / (us * 1e-6) / 1e9);
            fflush(stdout);
        }
    }
    ops_destroy(ctx);
    free(host);
    free(params);
    free(hist);
    free(offsets);
    return 0;
}
