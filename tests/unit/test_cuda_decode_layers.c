// tests/unit/test_cuda_decode_layers.c — ops_decode_layers_fwd (a batch-1 decode step's stack of layers; on CUDA
// with TANDEM_DECODE_LAYERS=1, which this test sets, one persistent kernel, kernels/cuda/cuda_decode_layers.cu)
// against
//   (a) the CPU twin (the op's sequence of ops on the CPU backend, from the same bf16 values): the residual stream
//       after the last layer and every layer's stored k / v row within TOL of max_i |gpu - cpu| / (|cpu| +
//       rms(cpu)) — each layer rounds h, q|k|v, att, xmid, act and x to bf16 where the sequence stores them (the
//       CPU keeps fp32), and the sums run in other orders, so the differences pass through the layers (1-3e-2 after
//       two or three random layers, as the GPU sequence of ops shows too) — and x no further from the CPU than
//       twice the GPU sequence's distance + 5e-3;
//   (b) the same sequence of ops run one by one on the GPU (the path the op replaces): the same measure;
//   (c) itself: a second run from the same inputs gives the same bits (no atomics on data);
//   and every cache row other than the token's slot is left as it was, bit for bit.
// Shapes: the Qwen2.5-0.5B and 1.5B layers (head dims 64 / 128, groups of 7 / 6 query heads, q/k/v bias), a
// Llama-style layer without bias, and the Qwen2.5-3B group of 8; contexts from the first position to 2,000
// (one attention item to 32 of them, items that end mid-block), block tables scattered over the pool, a token
// whose slot is -1 (stores nothing). Without a CUDA device it prints "SKIP: no CUDA device" and returns 77.
#define _POSIX_C_SOURCE 200809L  // setenv
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "kernels_testlib.h"
#include "ops_testlib.h"
#include "paged_testlib.h"

static OpsCtx *cpu, *gpu;
static int failures, n_cases;
static double worst_err;
static const double TOL = 5e-2;

static int irand(int n) { return kt_randint(0, n); }

static float *randv(size_t n, float center, float spread) {
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = kt_round_bf16(center + spread * (float)kt_uniform());
    return h;
}

static double scaled_err(const float *g, const float *c, size_t n) {
    double ss = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++) ss += (double)c[i] * c[i];
    const double rms = sqrt(ss / (double)n);
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)g[i] - c[i]) / (fabs(c[i]) + rms + 1e-30);
        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

typedef struct {
    int L, C, I, Hq, Hkv, D, bias;
} Shape;

// One backend's copy of a case: weights, caches, inputs, scratch.
typedef struct {
    OpsDecodeLayer *layers;
    void *x, *pos, *slot, *seq, *tables, *inv_freq;
    void *h, *qkv, *q, *att, *xmid, *gu, *act, *x_alt;
    OpsDecodeLayers d;
} Side;

typedef struct {
    Shape s;
    int n_slots, max_blocks, block_size, pos, slot;
    float **w[7];        // per layer host values: ln1, wqkv, bqkv, wo, ln2, wgu, wdown
    float **kc, **vc;    // per layer caches (n_slots, Hkv, D)
    float *x, *inv_freq;
    int32_t *tables;
} Case;

static const size_t *tensor_sizes(const Shape *s, size_t n[7]) {
    const size_t QD = (size_t)s->Hq * s->D, QKV = QD + 2 * (size_t)s->Hkv * s->D;
    n[0] = s->C, n[1] = QKV * s->C, n[2] = QKV, n[3] = (size_t)s->C * QD, n[4] = s->C, n[5] = 2 * (size_t)s->I * s->C,
    n[6] = (size_t)s->C * s->I;
    return n;
}

static void side_make(Side *sd, OpsCtx *o, const Case *k) {
    const Shape *s = &k->s;
    size_t n[7];
    tensor_sizes(s, n);
    const size_t QD = (size_t)s->Hq * s->D, QKV = QD + 2 * (size_t)s->Hkv * s->D, KVD = (size_t)s->Hkv * s->D;
    sd->layers = calloc((size_t)s->L, sizeof *sd->layers);
    for (int l = 0; l < s->L; l++) {
        OpsDecodeLayer *y = &sd->layers[l];
        y->ln1 = kt_upload(o, k->w[0][l], n[0]);
        y->wqkv = kt_upload(o, k->w[1][l], n[1]);
        y->bqkv = s->bias ? kt_upload(o, k->w[2][l], n[2]) : NULL;
        y->wo = kt_upload(o, k->w[3][l], n[3]);
        y->ln2 = kt_upload(o, k->w[4][l], n[4]);
        y->wgu = kt_upload(o, k->w[5][l], n[5]);
        y->wdown = kt_upload(o, k->w[6][l], n[6]);
        y->k_cache = kt_upload(o, k->kc[l], (size_t)k->n_slots * KVD);
        y->v_cache = kt_upload(o, k->vc[l], (size_t)k->n_slots * KVD);
    }
    const int32_t pos = k->pos, slot = k->slot, seq = 0;
    sd->x = kt_upload(o, k->x, (size_t)s->C);
    sd->pos = kt_upload_words(o, &pos, 1);
    sd->slot = kt_upload_words(o, &slot, 1);
    sd->seq = kt_upload_words(o, &seq, 1);
    sd->tables = kt_upload_words(o, k->tables, (size_t)k->max_blocks);
    sd->inv_freq = ops_malloc(o, (size_t)s->D / 2 * 4);
    ops_copy_to_device(o, sd->inv_freq, k->inv_freq, (size_t)s->D / 2 * 4);
    const size_t es = ops_dtype_size(o);
    sd->h = ops_malloc(o, s->C * es);
    sd->qkv = ops_malloc(o, QKV * es);
    sd->q = ops_malloc(o, QD * es);
    sd->att = ops_malloc(o, QD * es);
    sd->xmid = ops_malloc(o, s->C * es);
    sd->gu = ops_malloc(o, 2 * (size_t)s->I * es);
    sd->act = ops_malloc(o, (size_t)s->I * es);
    sd->x_alt = ops_malloc(o, s->C * es);
    sd->d = (OpsDecodeLayers){.n_layers = s->L, .C = s->C, .I = s->I, .Hq = s->Hq, .Hkv = s->Hkv, .D = s->D,
                              .eps = 1e-6f, .scale = 1.0f / sqrtf((float)s->D), .layers = sd->layers,
                              .positions = sd->pos, .slot_mapping = sd->slot, .token_seq = sd->seq,
                              .block_tables = sd->tables, .inv_freq = sd->inv_freq, .block_size = k->block_size,
                              .max_blocks = k->max_blocks, .h = sd->h, .qkv = sd->qkv, .q = sd->q, .att = sd->att,
                              .xmid = sd->xmid, .gu = sd->gu, .act = sd->act, .x_alt = sd->x_alt};
}

static void side_free(Side *sd, OpsCtx *o, int L) {
    for (int l = 0; l < L; l++) {
        OpsDecodeLayer *y = &sd->layers[l];
        ops_free(o, (void *)y->ln1), ops_free(o, (void *)y->wqkv), ops_free(o, (void *)y->bqkv);
        ops_free(o, (void *)y->wo), ops_free(o, (void *)y->ln2), ops_free(o, (void *)y->wgu);
        ops_free(o, (void *)y->wdown), ops_free(o, y->k_cache), ops_free(o, y->v_cache);
    }
    void *bufs[] = {sd->x, sd->pos, sd->slot, sd->seq, sd->tables, sd->inv_freq, sd->h, sd->qkv,
                    sd->q, sd->att, sd->xmid, sd->gu, sd->act, sd->x_alt};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) ops_free(o, bufs[i]);
    free(sd->layers);
}

// The op's sequence, call by call (shared/model_layer.c layer_decode_small), on backend o.
static void run_sequence(OpsCtx *o, Side *sd) {
    const OpsDecodeLayers *d = &sd->d;
    const int C = d->C, I = d->I, QD = d->Hq * d->D, QKV = QD + 2 * d->Hkv * d->D;
    void *cur = sd->x, *other = sd->x_alt;
    for (int l = 0; l < d->n_layers; l++) {
        const OpsDecodeLayer *y = &d->layers[l];
        ops_matmul_fused_fwd(o, d->q, cur, y->wqkv, y->bqkv, 1, C, QKV,
                             &(OpsProjFusion){.norm_w = y->ln1, .eps = d->eps, .h = d->h, .rope_store = 1,
                                              .qkv = d->qkv, .positions = d->positions,
                                              .slot_mapping = d->slot_mapping, .inv_freq = d->inv_freq,
                                              .k_cache = y->k_cache, .v_cache = y->v_cache, .Hq = d->Hq,
                                              .Hkv = d->Hkv, .D = d->D});
        ops_attention_paged_fwd(o, d->att, d->q, y->k_cache, y->v_cache, d->block_tables, d->token_seq, d->positions,
                                1, d->Hq, d->Hkv, d->D, d->block_size, d->max_blocks, d->scale);
        ops_matmul_fused_fwd(o, d->xmid, d->att, y->wo, NULL, 1, QD, C, &(OpsProjFusion){.residual = cur});
        ops_matmul_fused_fwd(o, d->act, d->xmid, y->wgu, NULL, 1, C, 2 * I,
                             &(OpsProjFusion){.norm_w = y->ln2, .eps = d->eps, .h = d->h, .swiglu = 1, .gu = d->gu});
        ops_matmul_fused_fwd(o, other, d->act, y->wdown, NULL, 1, I, C, &(OpsProjFusion){.residual = d->xmid});
        void *t = cur;
        cur = other;
        other = t;
    }
    if (cur != sd->x) ops_copy(o, sd->x, cur, (size_t)C * ops_dtype_size(o));
}

// Results of one run: x (C) and the caches of every layer (L, n_slots * KVD), k then v.
typedef struct {
    float *x, **kc, **vc;
} Result;

static Result collect(OpsCtx *o, const Side *sd, const Case *k) {
    const size_t KVD = (size_t)k->s.Hkv * k->s.D, n = (size_t)k->n_slots * KVD;
    Result r = {kt_download(o, sd->x, (size_t)k->s.C), calloc((size_t)k->s.L, sizeof(float *)),
                calloc((size_t)k->s.L, sizeof(float *))};
    for (int l = 0; l < k->s.L; l++) {
        r.kc[l] = kt_download(o, sd->layers[l].k_cache, n);
        r.vc[l] = kt_download(o, sd->layers[l].v_cache, n);
    }
    return r;
}
static void result_free(Result *r, int L) {
    for (int l = 0; l < L; l++) free(r->kc[l]), free(r->vc[l]);
    free(r->kc), free(r->vc), free(r->x);
}

// want vs got: x and the token's k / v rows by the scaled error, every other cache row bit for bit as stored.
static double compare(const char *what, const char *against, const Result *got, const Result *want, const Case *k) {
    const size_t KVD = (size_t)k->s.Hkv * k->s.D;
    double e = scaled_err(got->x, want->x, (size_t)k->s.C);
    size_t other_bad = 0;
    for (int l = 0; l < k->s.L; l++) {
        if (k->slot >= 0) {
            const double ek = scaled_err(got->kc[l] + (size_t)k->slot * KVD, want->kc[l] + (size_t)k->slot * KVD, KVD);
            const double ev = scaled_err(got->vc[l] + (size_t)k->slot * KVD, want->vc[l] + (size_t)k->slot * KVD, KVD);
            e = fmax(e, fmax(ek, ev));
        }
        for (int s = 0; s < k->n_slots; s++) {
            if (s == k->slot) continue;
            other_bad += memcmp(got->kc[l] + (size_t)s * KVD, k->kc[l] + (size_t)s * KVD, KVD * 4) != 0;
            other_bad += memcmp(got->vc[l] + (size_t)s * KVD, k->vc[l] + (size_t)s * KVD, KVD * 4) != 0;
        }
    }
    if (!(e <= TOL) || other_bad) {
        printf("FAIL %s vs %s: error %.3g (tolerance %.0e), %zu other cache rows changed\n", what, against, e, TOL,
               other_bad);
        failures++;
    }
    if (e > worst_err) worst_err = e;
    printf("  %-34s vs %-13s error %.2e\n", what, against, e);
    return e;
}

static void run_case(const char *name, Shape s, int pos, int store) {
    Case k = {.s = s, .block_size = 16, .pos = pos};
    char what[96];
    snprintf(what, sizeof what, "%s pos %d%s", name, pos, store ? "" : " (slot -1)");
    const int ctx = pos + 1;
    k.max_blocks = (ctx + k.block_size - 1) / k.block_size + 2;
    int n_blk = 0;
    char err[256];
    k.tables = kt_paged_tables(1, &ctx, k.block_size, k.max_blocks, 3, -1, irand, &n_blk, err, sizeof err);
    if (!k.tables) {
        printf("FAIL %s: %s\n", what, err);
        failures++;
        return;
    }
    k.n_slots = n_blk * k.block_size;
    k.slot = store ? k.tables[pos / k.block_size] * k.block_size + pos % k.block_size : -1;
    size_t n[7];
    tensor_sizes(&s, n);
    const float center[7] = {1.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f};
    const float spread[7] = {0.2f, 0.06f, 0.5f, 0.06f, 0.2f, 0.06f, 0.04f};
    for (int t = 0; t < 7; t++) {
        k.w[t] = calloc((size_t)s.L, sizeof(float *));
        for (int l = 0; l < s.L; l++) k.w[t][l] = randv(n[t], center[t], spread[t]);
    }
    const size_t KVD = (size_t)s.Hkv * s.D;
    k.kc = calloc((size_t)s.L, sizeof(float *));
    k.vc = calloc((size_t)s.L, sizeof(float *));
    for (int l = 0; l < s.L; l++) {
        k.kc[l] = randv((size_t)k.n_slots * KVD, 0.0f, 1.0f);
        k.vc[l] = randv((size_t)k.n_slots * KVD, 0.0f, 1.0f);
    }
    k.x = randv((size_t)s.C, 0.0f, 1.0f);
    k.inv_freq = malloc((size_t)s.D / 2 * sizeof(float));
    for (int i = 0; i < s.D / 2; i++) k.inv_freq[i] = powf(10000.0f, -2.0f * i / (float)s.D);

    Side c, g1, g2, gs;
    side_make(&c, cpu, &k);
    ops_decode_layers_fwd(cpu, c.x, &c.d);
    side_make(&g1, gpu, &k);
    ops_decode_layers_fwd(gpu, g1.x, &g1.d);
    side_make(&g2, gpu, &k);
    ops_decode_layers_fwd(gpu, g2.x, &g2.d);
    side_make(&gs, gpu, &k);
    run_sequence(gpu, &gs);
    ops_synchronize(gpu);
    if (ops_status(cpu) || ops_status(gpu)) {
        printf("FAIL %s: %s\n", what, ops_status(cpu) ? ops_error(cpu) : ops_error(gpu));
        exit(1);
    }
    Result rc = collect(cpu, &c, &k), r1 = collect(gpu, &g1, &k), r2 = collect(gpu, &g2, &k),
           rs = collect(gpu, &gs, &k);
    const double e_cpu = compare(what, "the CPU twin", &r1, &rc, &k);
    compare(what, "the GPU ops", &r1, &rs, &k);
    // No further from the CPU than the sequence it replaces is (both round to bf16 where the CPU keeps fp32).
    const double e_ops = scaled_err(rs.x, rc.x, (size_t)s.C);
    if (!(e_cpu <= 2.0 * e_ops + 5e-3)) {
        printf("FAIL %s: %.3g from the CPU twin, the GPU ops %.3g\n", what, e_cpu, e_ops);
        failures++;
    }
    size_t diff = memcmp(r1.x, r2.x, (size_t)s.C * 4) != 0;
    for (int l = 0; l < s.L; l++)
        diff += memcmp(r1.kc[l], r2.kc[l], (size_t)k.n_slots * KVD * 4) != 0 ||
                memcmp(r1.vc[l], r2.vc[l], (size_t)k.n_slots * KVD * 4) != 0;
    if (diff) {
        printf("FAIL %s: a second run gave other bits (%zu buffers differ)\n", what, diff);
        failures++;
    }
    n_cases++;
    result_free(&rc, s.L), result_free(&r1, s.L), result_free(&r2, s.L), result_free(&rs, s.L);
    side_free(&c, cpu, s.L), side_free(&g1, gpu, s.L), side_free(&g2, gpu, s.L), side_free(&gs, gpu, s.L);
    for (int t = 0; t < 7; t++) {
        for (int l = 0; l < s.L; l++) free(k.w[t][l]);
        free(k.w[t]);
    }
    for (int l = 0; l < s.L; l++) free(k.kc[l]), free(k.vc[l]);
    free(k.kc), free(k.vc), free(k.x), free(k.inv_freq), free(k.tables);
}

int main(void) {
    kt_seed(0x2F1B5E7A90C3D481ull);
    setenv("TANDEM_DECODE_LAYERS", "1", 1);   // the kernel is opt-in; this test is about it
    const int opened = kt_open_cpu_gpu(&cpu, &gpu);
    if (opened) return opened;
    const Shape q05 = {3, 896, 4864, 14, 2, 64, 1}, q15 = {2, 1536, 8960, 12, 2, 128, 1};
    const Shape llama = {3, 256, 512, 4, 2, 64, 0}, q3b = {1, 2048, 11008, 16, 2, 128, 1};
    const int positions[] = {0, 63, 64, 100, 511, 2000};
    for (size_t i = 0; i < sizeof positions / sizeof positions[0]; i++) {
        run_case("qwen2.5-0.5b x3", q05, positions[i], 1);
        run_case("qwen2.5-1.5b x2", q15, positions[i], 1);
    }
    run_case("qwen2.5-0.5b x3", q05, 77, 0);
    run_case("llama no bias x3", llama, 0, 1);
    run_case("llama no bias x3", llama, 300, 1);
    run_case("qwen2.5-3b group 8", q3b, 700, 1);
    printf("test_cuda_decode_layers: %d cases, worst error %.2e (tolerance %.0e), %d failure(s)\n", n_cases,
           worst_err, TOL, failures);
    ops_destroy(cpu);
    ops_destroy(gpu);
    return failures ? 1 : 0;
}
