// bench/bench_gemm.c — every GEMM of one training step (ops_matmul_fwd / ops_matmul_bwd on the CUDA backend),
// with the shapes, kinds and call counts that shared/model_layer.c and shared/model_train.c issue.
//
//   bench_gemm [--shape 0.5b|1.5b] [--tokens 8192] [--chunk-rows R] [--no-checkpoint] [--lm-only] [--fused-qkv]
//              [--min-ms 40] [--variant NAME:AUTOTUNE:WORKSPACE_MB]...
//
// A step (model_forward + model_backward_entropy over N tokens, activation checkpointing on as the trainer runs
// it) issues, per layer: the q / k / v projections (bias, k and v of one shape), o, gate|up and down forwards
// (twice with checkpointing: once in the forward, once recomputed in the backward); in the backward, din and dw
// of each (din of k and v accumulates onto din of q); and for the lm_head, in row chunks of R = 2^28 / V rows
// (model_train.c's GPU chunk): the chunk forward in the forward and again in the backward, then its din and dw.
// dw is fp32 += (cuBLASLt beta 1); din and the forwards write bf16. --fused-qkv lists one [q | k | v]
// projection instead (what fusing them would give); --lm-only only the lm_head GEMMs.
//
// Each --variant is a CUDA context made with those settings (OpsSettings gemm_autotune 0|1|2 as
// ops_gemm_autotune_parse reads it, gemm_workspace_mib; default one, "default:1:32"); every GEMM is timed on all of them in alternation (see time_gemm). Prints one JSON line per
// distinct GEMM: name, kind (fwd, fwd+bias, din, din+=, dw+=), N (rows of the activation), IC, OC, calls per
// step, milliseconds per call per variant; then a "step" line with the GEMM time per step per variant (every
// GEMM weighted by its calls) and the step's GEMM TFLOP (2 N IC OC per call). bench/bench_gemm_gpu.py runs it
// beside PyTorch. Exits 77 when no CUDA device is visible.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "kernels/ops.h"

typedef struct {
    const char *name;
    int hidden, inter, heads, kv_heads, head_dim, vocab, layers;
} Shape;

// Qwen2.5 shapes (tied embeddings: the lm_head is the embedding table, its dw lands in the embedding's gradient).
static const Shape SHAPES[] = {
    {"0.5b", 896, 4864, 14, 2, 64, 151936, 24},
    {"1.5b", 1536, 8960, 12, 2, 128, 151936, 28},
};

enum { K_FWD, K_FWD_BIAS, K_DIN, K_DIN_ACC, K_DW };
static const char *const KIND[] = {"fwd", "fwd+bias", "din", "din+=", "dw+="};

typedef struct {
    const char *name;
    int kind, N, IC, OC;
    long calls;  // per step
} Gemm;

// Uniform [-1, 1) values, bf16-rounded on upload: one 1 Mi block uploaded, then copied on the device to fill n
// (the values only set the tensor cores' power draw, which random data keeps realistic; zeros run faster).
static int fill_random(OpsCtx *ctx, void *dst, size_t n, int f32, unsigned *seed) {
    enum { BLOCK = 1 << 20 };
    static float host[BLOCK];
    const size_t first = n < BLOCK ? n : BLOCK, es = f32 ? 4 : ops_dtype_size(ctx);
    for (size_t i = 0; i < first; i++) host[i] = 2.0f * (float)rand_r(seed) / (float)RAND_MAX - 1.0f;
    if (f32) ops_copy_to_device(ctx, dst, host, first * 4);
    else ops_upload_f32(ctx, dst, host, first);
    for (size_t done = first; done < n;) {
        const size_t len = n - done < done ? n - done : done;
        ops_copy(ctx, (char *)dst + done * es, dst, len * es);
        done += len;
    }
    return ops_status(ctx);
}

static void run_once(OpsCtx *ctx, const Gemm *g, void *in, void *w, void *bias, void *out, float *dw) {
    switch (g->kind) {
    case K_FWD: ops_matmul_fwd(ctx, out, in, w, NULL, g->N, g->IC, g->OC); break;
    case K_FWD_BIAS: ops_matmul_fwd(ctx, out, in, w, bias, g->N, g->IC, g->OC); break;
    // din (N, IC) = dout (N, OC) @ w: `out` holds dout, `in` receives din.
    case K_DIN: ops_matmul_bwd(ctx, in, NULL, NULL, out, in, w, g->N, g->IC, g->OC, 0); break;
    case K_DIN_ACC: ops_matmul_bwd(ctx, in, NULL, NULL, out, in, w, g->N, g->IC, g->OC, 1); break;
    default: ops_matmul_bwd(ctx, NULL, dw, NULL, out, in, w, g->N, g->IC, g->OC, 0); break;
    }
}

typedef struct {
    char name[32];
    OpsCtx *ctx;
} Variant;

enum { MAX_VARIANTS = 6, ROUNDS = 5 };

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double batch_ms(OpsCtx *ctx, const Gemm *g, long iters, void *in, void *w, void *bias, void *out, float *dw) {
    const double t0 = bench_now_s();
    for (long i = 0; i < iters; i++) run_once(ctx, g, in, w, bias, out, dw);
    ops_synchronize(ctx);
    return (bench_now_s() - t0) * 1e3 / iters;
}

// ms[v] = median milliseconds per call on variant v. Buffers live on the first variant's context (one device,
// one process: every context can use them). Two warm-up calls per variant (the first builds and tunes the plan),
// then ROUNDS rounds that time each variant for about min_ms / ROUNDS, rotating the order, so that clock and
// temperature drifts hit every variant alike. Returns 0, or -1 with the failing context's error printed.
static int time_gemm(const Variant *vs, int nv, const Gemm *g, double min_ms, unsigned *seed, double *ms) {
    OpsCtx *c0 = vs[0].ctx;
    const size_t n_in = (size_t)g->N * g->IC, n_w = (size_t)g->OC * g->IC, n_out = (size_t)g->N * g->OC;
    void *in = ops_malloc(c0, n_in * 2), *w = ops_malloc(c0, n_w * 2), *out = ops_malloc(c0, n_out * 2);
    void *bias = ops_malloc(c0, (size_t)g->OC * 2);
    float *dw = g->kind == K_DW ? ops_malloc(c0, n_w * 4) : NULL;
    int rc = -1;
    OpsCtx *bad = c0;
    if (ops_status(c0) || fill_random(c0, in, n_in, 0, seed) || fill_random(c0, w, n_w, 0, seed) ||
        fill_random(c0, out, n_out, 0, seed) || fill_random(c0, bias, g->OC, 0, seed) ||
        (dw && fill_random(c0, dw, n_w, 1, seed)))
        goto done;
    ops_synchronize(c0);
    for (int v = 0; v < nv; v++) {
        for (int i = 0; i < 2; i++) run_once(vs[v].ctx, g, in, w, bias, out, dw);
        ops_synchronize(vs[v].ctx);
        if (ops_status(vs[v].ctx)) {
            bad = vs[v].ctx;
            goto done;
        }
    }
    const double est = batch_ms(c0, g, 3, in, w, bias, out, dw);
    long iters = (long)(min_ms / ROUNDS / (est > 1e-3 ? est : 1e-3));
    iters = iters < 3 ? 3 : iters > 5000 ? 5000 : iters;
    double t[MAX_VARIANTS][ROUNDS];
    for (int r = 0; r < ROUNDS; r++)
        for (int j = 0; j < nv; j++) {
            const int v = (j + r) % nv;
            t[v][r] = batch_ms(vs[v].ctx, g, iters, in, w, bias, out, dw);
            if (ops_status(vs[v].ctx)) {
                bad = vs[v].ctx;
                goto done;
            }
        }
    for (int v = 0; v < nv; v++) {
        qsort(t[v], ROUNDS, sizeof t[v][0], cmp_double);
        ms[v] = t[v][ROUNDS / 2];
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "bench_gemm: %s %s N=%d IC=%d OC=%d failed: %s\n", g->name, KIND[g->kind], g->N, g->IC,
                    g->OC, ops_error(bad));
    ops_free(c0, in), ops_free(c0, w), ops_free(c0, out), ops_free(c0, bias);
    if (dw) ops_free(c0, dw);
    return rc;
}

// "NAME:AUTOTUNE:WORKSPACE_MB" -> a context created with those settings.
static int variant_create(Variant *v, const char *spec) {
    char tune[8];
    OpsSettings settings = {0};
    if (sscanf(spec, "%31[^:]:%7[^:]:%d", v->name, tune, &settings.gemm_workspace_mib) != 3 ||
        ops_gemm_autotune_parse(tune, &settings.gemm_autotune) != 0) {
        fprintf(stderr, "bench_gemm: bad --variant %s (NAME:AUTOTUNE:WORKSPACE_MB)\n", spec);
        return -1;
    }
    char err[256];
    if (ops_create_with_settings(&v->ctx, OPS_BACKEND_CUDA, 0, &settings, err, sizeof err) != 0) {
        fprintf(stderr, "bench_gemm: cannot create the CUDA context: %s\n", err);
        v->ctx = NULL;
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    const Shape *s = &SHAPES[1];
    int N = 8192, chunk_rows = 0, checkpoint = 1, lm_only = 0, fused_qkv = 0, nv = 0;
    const char *specs[MAX_VARIANTS];
    double min_ms = 40;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--no-checkpoint")) checkpoint = 0;
        else if (!strcmp(a, "--lm-only")) lm_only = 1;
        else if (!strcmp(a, "--fused-qkv")) fused_qkv = 1;
        else if (i + 1 < argc && !strcmp(a, "--shape")) {
            const char *v = argv[++i];
            s = NULL;
            for (size_t k = 0; k < sizeof SHAPES / sizeof SHAPES[0]; k++)
                if (!strcmp(v, SHAPES[k].name)) s = &SHAPES[k];
            if (!s) {
                fprintf(stderr, "bench_gemm: unknown shape %s (0.5b, 1.5b)\n", v);
                return 2;
            }
        } else if (i + 1 < argc && !strcmp(a, "--tokens")) N = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(a, "--chunk-rows")) chunk_rows = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(a, "--min-ms")) min_ms = atof(argv[++i]);
        else if (i + 1 < argc && !strcmp(a, "--variant") && nv < MAX_VARIANTS) specs[nv++] = argv[++i];
        else {
            fprintf(stderr, "usage: bench_gemm [--shape 0.5b|1.5b] [--tokens 8192] [--chunk-rows R] [--no-checkpoint] "
                            "[--lm-only] [--fused-qkv] [--min-ms 40] [--variant NAME:AUTOTUNE:WORKSPACE_MB]...\n");
            return 2;
        }
    }
    if (N <= 0 || chunk_rows < 0 || min_ms <= 0) {
        fprintf(stderr, "bench_gemm: bad --tokens / --chunk-rows / --min-ms\n");
        return 2;
    }
    if (!nv) specs[nv++] = "default:1:32";
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        printf("SKIP: no CUDA device\n");
        return 77;
    }
    const int C = s->hidden, I = s->inter, QD = s->heads * s->head_dim, KVD = s->kv_heads * s->head_dim;
    const int V = s->vocab, L = s->layers, f = checkpoint ? 2 : 1;
    if (!chunk_rows) chunk_rows = (int)((1u << 28) / (unsigned)V);  // model_train.c: LOGIT_CHUNK_ELEMS_GPU / V
    if (chunk_rows > N) chunk_rows = N;
    const int n_full = N / chunk_rows, tail = N % chunk_rows;

    Gemm list[32];
    int n = 0;
#define ADD(nm, k, rows, ic, oc, c) list[n++] = (Gemm){nm, k, rows, ic, oc, c}
    if (!lm_only) {
        if (fused_qkv) {  // one [q | k | v] projection instead of three (what fusing them would give)
            ADD("qkv", K_FWD_BIAS, N, C, QD + 2 * KVD, (long)f * L);
        } else {
            ADD("q", K_FWD_BIAS, N, C, QD, (long)f * L);
            ADD("k,v", K_FWD_BIAS, N, C, KVD, 2L * f * L);
        }
        ADD("o", K_FWD, N, QD, C, (long)f * L);
        ADD("gate|up", K_FWD, N, C, 2 * I, (long)f * L);
        ADD("down", K_FWD, N, I, C, (long)f * L);
        ADD("down", K_DIN, N, I, C, L);
        ADD("down", K_DW, N, I, C, L);
        ADD("gate|up", K_DIN, N, C, 2 * I, L);
        ADD("gate|up", K_DW, N, C, 2 * I, L);
        ADD("o", K_DIN, N, QD, C, L);
        ADD("o", K_DW, N, QD, C, L);
        if (fused_qkv) {
            ADD("qkv", K_DIN, N, C, QD + 2 * KVD, L);
            ADD("qkv", K_DW, N, C, QD + 2 * KVD, L);
        } else {
            ADD("q", K_DIN, N, C, QD, L);
            ADD("q", K_DW, N, C, QD, L);
            ADD("k,v", K_DIN_ACC, N, C, KVD, 2L * L);
            ADD("k,v", K_DW, N, C, KVD, 2L * L);
        }
    }
    ADD("lm_head", K_FWD, chunk_rows, C, V, 2L * n_full);
    ADD("lm_head", K_DIN, chunk_rows, C, V, n_full);
    ADD("lm_head", K_DW, chunk_rows, C, V, n_full);
    if (tail) {
        ADD("lm_head tail", K_FWD, tail, C, V, 2);
        ADD("lm_head tail", K_DIN, tail, C, V, 1);
        ADD("lm_head tail", K_DW, tail, C, V, 1);
    }
#undef ADD

    Variant vs[MAX_VARIANTS];
    memset(vs, 0, sizeof vs);
    int rc = 0, made = 0;
    for (; made < nv && rc == 0; made++) rc = variant_create(&vs[made], specs[made]);
    unsigned seed = 1;
    double step_ms[MAX_VARIANTS] = {0}, step_flop = 0;
    const double t_start = bench_now_s();
    for (int i = 0; i < n && rc == 0; i++) {
        const Gemm *g = &list[i];
        double ms[MAX_VARIANTS];
        if ((rc = time_gemm(vs, nv, g, min_ms, &seed, ms)) != 0) break;
        const double flop = 2.0 * g->N * (double)g->IC * g->OC;
        step_flop += flop * g->calls;
        printf("{\"name\": \"%s\", \"kind\": \"%s\", \"N\": %d, \"IC\": %d, \"OC\": %d, \"calls\": %ld, \"ms\": {",
               g->name, KIND[g->kind], g->N, g->IC, g->OC, g->calls);
        for (int v = 0; v < nv; v++) {
            step_ms[v] += ms[v] * g->calls;
            printf("%s\"%s\": %.5f", v ? ", " : "", vs[v].name, ms[v]);
        }
        printf("}}\n");
        fflush(stdout);
    }
    if (rc == 0) {
        printf("{\"step\": true, \"shape\": \"%s\", \"tokens\": %d, \"chunk_rows\": %d, \"checkpoint\": %d, "
               "\"fused_qkv\": %d, \"gemm_tflop\": %.4f, \"wall_s\": %.1f, \"gemm_ms\": {",
               s->name, N, chunk_rows, checkpoint, fused_qkv, step_flop * 1e-12, bench_now_s() - t_start);
        for (int v = 0; v < nv; v++) printf("%s\"%s\": %.4f", v ? ", " : "", vs[v].name, step_ms[v]);
        printf("}}\n");
    }
    for (int v = 0; v < made; v++)
        if (vs[v].ctx) ops_destroy(vs[v].ctx);
    return rc ? 1 : 0;
}
