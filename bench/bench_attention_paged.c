// bench/bench_attention_paged.c — throughput of the rollout server's decode attention (ops_attention_paged_fwd)
// on the CUDA backend: `batch` sequences of `ctx` cached positions each, one decode token per sequence at the
// last position, block tables scattered over the pool like the server's (blocks of 16).
//
//   bench_attention_paged [--hq 14 --hkv 2 --d 64] [--batch B] [--ctx C] [--max-len 4096] [--iters 50]
//
// Without a shape it runs the Qwen2.5-0.5B (14/2 heads, head_dim 64) and 1.5B (12/2, 128) heads; without
// --batch / --ctx it runs batch 1, 64, 256, 512 x context 128, 1024, 4096. Tables are sized for --max-len
// positions, as the server sizes them for its longest sequence (the split decision depends on it, never on
// the actual lengths). One JSON object per line: microseconds per call, and the K/V bytes the call has to
// read (batch * ctx * Hkv * D * 2 tensors * 2 bytes) divided by that time. The roofline of this op is the
// device's memory bandwidth (about 4.3 TB/s on an H200, 3.35 on an H100 SXM).
//
// Successive calls read different blocks of the pool (up to 64 table sets, "table_sets"), as the layers of a
// decode step do, so that the smaller cases are not timed out of L2.
// Times are host clock over `iters` back-to-back calls after a warm-up: the GPU time per call when it exceeds
// the launch cost (a few microseconds), which the smallest cases do not. Exits 77 when no CUDA device is visible.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "kernels/ops.h"

enum { BLOCK = 16, FILL_CHUNK = 1 << 20 };

// n bf16 values in [lo, hi): one random chunk uploaded over and over (the values do not matter for timing,
// only that they are finite).
static void *fill_buf(OpsCtx *ctx, size_t n, float lo, float hi, unsigned *seed) {
    char *d = ops_malloc(ctx, n * ops_dtype_size(ctx));
    if (!d) return NULL;
    const size_t chunk = n < FILL_CHUNK ? n : FILL_CHUNK;
    float *h = malloc(chunk * sizeof *h);
    if (!h) {
        ops_free(ctx, d);
        return NULL;
    }
    for (size_t i = 0; i < chunk; i++) h[i] = lo + (hi - lo) * (float)rand_r(seed) / (float)RAND_MAX;
    for (size_t off = 0; off < n; off += chunk)
        ops_upload_f32(ctx, d + off * ops_dtype_size(ctx), h, n - off < chunk ? n - off : chunk);
    free(h);
    return d;
}

// Times one (batch, ctx) configuration; 0 or -1 after printing the error.
static int run_one(OpsCtx *ctx, void *k_cache, void *v_cache, int n_pool, int Hq, int Hkv, int D, int B, int C,
                   int max_blocks, int iters, unsigned *seed) {
    const int nb = (C + BLOCK - 1) / BLOCK;
    if (C < 1 || nb > max_blocks || (long long)B * nb > n_pool) {
        fprintf(stderr, "batch %d x context %d does not fit (max_blocks %d, pool %d blocks)\n", B, C, max_blocks,
                n_pool);
        return -1;
    }
    // Scattered tables: a random permutation of the pool, as a long-running server's free list would give.
    // Up to 64 sets of tables over disjoint blocks, one per call in turn (like the model's layers, each with its
    // own cache), so that small cases are not served from L2 by the call before.
    const size_t per_set = (size_t)B * nb;
    const int n_sets = n_pool / per_set < 64 ? (int)(n_pool / per_set) : 64;
    const size_t set_len = (size_t)B * max_blocks;
    int32_t *perm = malloc((size_t)n_pool * sizeof *perm), *tables = malloc(n_sets * set_len * 4);
    int32_t *tseq = malloc((size_t)B * 4), *tpos = malloc((size_t)B * 4);
    for (int i = 0; i < n_pool; i++) perm[i] = i;
    for (int i = n_pool - 1; i > 0; i--) {
        const int j = rand_r(seed) % (i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int k = 0; k < n_sets; k++)
        for (int s = 0; s < B; s++)
            for (int b = 0; b < max_blocks; b++)
                tables[k * set_len + (size_t)s * max_blocks + b] = b < nb ? perm[k * per_set + (size_t)s * nb + b] : -1;
    for (int s = 0; s < B; s++) {
        tseq[s] = s;
        tpos[s] = C - 1;
    }
    int32_t *bt = ops_malloc(ctx, n_sets * set_len * 4), *ts = ops_malloc(ctx, (size_t)B * 4);
    int32_t *tp = ops_malloc(ctx, (size_t)B * 4);
    unsigned qseed = *seed;
    void *q = fill_buf(ctx, (size_t)B * Hq * D, -2, 2, &qseed), *out = ops_malloc(ctx, (size_t)B * Hq * D * ops_dtype_size(ctx));
    if (bt && ts && tp) {
        ops_copy_to_device(ctx, bt, tables, n_sets * set_len * 4);
        ops_copy_to_device(ctx, ts, tseq, (size_t)B * 4);
        ops_copy_to_device(ctx, tp, tpos, (size_t)B * 4);
    }
    free(perm), free(tables), free(tseq), free(tpos);
    const float scale = 1.0f / sqrtf((float)D);
    for (int w = 0; w < 3; w++)  // warm-up (also sizes the backend's scratch)
        ops_attention_paged_fwd(ctx, out, q, k_cache, v_cache, bt, ts, tp, B, Hq, Hkv, D, BLOCK, max_blocks, scale);
    ops_synchronize(ctx);
    const double t0 = bench_now_s();
    for (int it = 0; it < iters; it++)
        ops_attention_paged_fwd(ctx, out, q, k_cache, v_cache, bt + (it % n_sets) * set_len, ts, tp, B, Hq, Hkv, D,
                                BLOCK, max_blocks, scale);
    ops_synchronize(ctx);
    const double dt = (bench_now_s() - t0) / iters;
    ops_free(ctx, bt), ops_free(ctx, ts), ops_free(ctx, tp), ops_free(ctx, q), ops_free(ctx, out);
    if (ops_status(ctx)) {
        fprintf(stderr, "attention_paged_fwd failed: %s\n", ops_error(ctx));
        return -1;
    }
    const double kv_bytes = (double)B * C * Hkv * D * 2.0 * ops_dtype_size(ctx);
    printf("{\"hq\": %d, \"hkv\": %d, \"d\": %d, \"batch\": %d, \"ctx\": %d, \"max_len\": %d, "
           "\"table_sets\": %d, \"us\": %.2f, \"kv_mb\": %.2f, \"kv_gbs\": %.1f}\n",
           Hq, Hkv, D, B, C, max_blocks * BLOCK, n_sets,
           dt * 1e6, kv_bytes / 1e6, kv_bytes / dt / 1e9);
    fflush(stdout);
    return 0;
}

// All (batch, ctx) pairs of one head shape over one pool sized for the largest.
static int run_shape(OpsCtx *ctx, int Hq, int Hkv, int D, const int *batches, int nbat, const int *ctxs, int nctx,
                     int max_len, int iters) {
    int max_b = 0, max_c = 0;
    for (int i = 0; i < nbat; i++) max_b = batches[i] > max_b ? batches[i] : max_b;
    for (int i = 0; i < nctx; i++) max_c = ctxs[i] > max_c ? ctxs[i] : max_c;
    const int max_blocks = (max_len + BLOCK - 1) / BLOCK;
    const long long pool = (long long)max_b * ((max_c + BLOCK - 1) / BLOCK);
    const size_t n = (size_t)pool * BLOCK * Hkv * D;
    unsigned seed = 1;
    void *k_cache = fill_buf(ctx, n, -1, 1, &seed), *v_cache = fill_buf(ctx, n, -1, 1, &seed);
    if (!k_cache || !v_cache || ops_status(ctx)) {
        fprintf(stderr, "cannot allocate a %zu-element cache: %s\n", n, ops_error(ctx));
        return -1;
    }
    int rc = 0;
    for (int b = 0; b < nbat && !rc; b++)
        for (int c = 0; c < nctx && !rc; c++)
            rc = run_one(ctx, k_cache, v_cache, (int)pool, Hq, Hkv, D, batches[b], ctxs[c], max_blocks, iters, &seed);
    ops_free(ctx, k_cache), ops_free(ctx, v_cache);
    return rc;
}

int main(int argc, char **argv) {
    int Hq = 0, Hkv = 0, D = 0, B = 0, C = 0, max_len = 4096, iters = 50;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i];
        const int val = atoi(argv[i + 1]);
        if (!strcmp(a, "--hq")) Hq = val;
        else if (!strcmp(a, "--hkv")) Hkv = val;
        else if (!strcmp(a, "--d")) D = val;
        else if (!strcmp(a, "--batch")) B = val;
        else if (!strcmp(a, "--ctx")) C = val;
        else if (!strcmp(a, "--max-len")) max_len = val;
        else if (!strcmp(a, "--iters")) iters = val;
        else {
            fprintf(stderr, "unknown option %s\n", a);
            return 2;
        }
    }
    if (argc % 2 == 0) {
        fprintf(stderr, "option %s needs a value\n", argv[argc - 1]);
        return 2;
    }
    const int custom = Hq || Hkv || D;
    if ((custom && (Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0)) || B < 0 || C < 0 || iters <= 0 || max_len <= 0) {
        fprintf(stderr, "bad shape (--hq, --hkv, --d all given, Hq a multiple of Hkv; positive sizes)\n");
        return 2;
    }
    if (C > max_len || (!C && max_len < 4096)) {
        fprintf(stderr, "the contexts (up to %d) exceed --max-len %d\n", C ? C : 4096, max_len);
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
    const int all_b[] = {1, 64, 256, 512}, all_c[] = {128, 1024, 4096};
    const int *bats = B ? &B : all_b, *ctxs = C ? &C : all_c;
    const int nbat = B ? 1 : 4, nctx = C ? 1 : 3;
    int rc = 0;
    if (custom) {
        rc = run_shape(ctx, Hq, Hkv, D, bats, nbat, ctxs, nctx, max_len, iters);
    } else {
        rc = run_shape(ctx, 14, 2, 64, bats, nbat, ctxs, nctx, max_len, iters);            // Qwen2.5-0.5B
        if (!rc) rc = run_shape(ctx, 12, 2, 128, bats, nbat, ctxs, nctx, max_len, iters);  // Qwen2.5-1.5B
    }
    ops_destroy(ctx);
    return rc ? 1 : 0;
}
