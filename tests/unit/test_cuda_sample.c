// test_cuda_sample.c — the fused sampling op on CUDA (kernels/cuda/cuda_sample.cu) against its CPU twin
// (kernels/cpu/cpu_sample.c, itself held to the host sampler by test_rollout_sampler_ops.c), on the same bf16
// logits. Exit 77 (skipped) without a GPU.
//   - the parameter grid (greedy, T 0.3 / 1 / 1.7, top_k 0 / 1 / 5 / 50, top_p 1 / 0.9 / 0.3, min_p 0 / 0.1,
//     penalty 1 / 1.3) plus random top_p / top_k / min_p, over V = 1 .. 151936 and one V = 300000 (the history
//     bitmap then needs opted-in shared memory), rows full of ties, -inf entries and signed zeros, histories
//     with repeats and out-of-range ids, and a few very long histories: the same token, except where the
//     uniform lies within 1e-6 of a CDF boundary (the CPU op is asked at nearby uniforms to prove it; such
//     cases are counted and must stay rare), and logprobs within 2e-3;
//   - edge parameters, a bad logits_row (-1 / NaN), a row of only -inf (id 0);
//   - draws without filters or penalty (one read of the row) at uniforms 0 and just below 1, rows with NaN / +inf;
//   - masks (allow lists, bans of the likeliest ids, repeats and out-of-range ids) over the grid: the same token as
//     the CPU twin (CDF-boundary rule as above), never a forbidden id;
//   - batch independence: each of 256 samples (a third of them masked) run alone equals its result in the batch
//     of 256 (bit for bit), and the batch run twice is identical;
//   - the time of one call for 256 samples at V = 151936 (printed, not checked).
// On a mismatch it prints the sample's parameters, both tokens with their raw and scaled logits, weights,
// ranks and tie counts, the CPU's tokens at u -/+ 1e-6, and which filters were on.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/ops.h"
#include "tests/unit/check_macros.h"
#include "tests/unit/sample_testlib.h"
#include "tests/unit/testlib.h"

static OpsCtx *cpu, *gpu;

static void check_ctx(OpsCtx *ctx, const char *what) {
    if (ops_status(ctx)) {
        fprintf(stderr, "%s: %s\n", what, ops_error(ctx));
        exit(1);
    }
}

typedef struct {
    int V, n, n_rows;
    float *logits;              // (n_rows, V), bf16-exact
    int *kind;                  // (n_rows)
    OpsSampleParams *params;    // (n)
    int32_t *offsets, *history; // (n + 1), (offsets[n])
    int32_t *mask_ids;          // the samples' mask ids (host), params[s].mask pointing in; NULL: no masks
} SBatch;

static void batch_free(SBatch *b) {
    free(b->logits);
    free(b->kind);
    free(b->params);
    free(b->offsets);
    free(b->history);
    free(b->mask_ids);
}

// Gives every `every`-th sample of b a mask of up to max_len ids (st_make_mask).
static void add_masks(SBatch *b, int max_len, int every) {
    b->mask_ids = xmalloc((size_t)b->n * 2 * max_len * sizeof *b->mask_ids);
    for (int s = 0, at = 0; s < b->n; s += every) {
        OpsSampleParams *p = &b->params[s];
        p->mask = b->mask_ids + at;
        p->n_mask = st_make_mask(b->mask_ids + at, max_len, b->logits + (size_t)p->logits_row * b->V, b->V,
                                 &p->mask_mode);
        at += p->n_mask;
    }
}

// Samples cycle through the grid from combo c0; every other sample gets random top_p / top_k / min_p instead.
static SBatch make_batch(int V, int n, int n_rows, int c0, int max_hist, int randomise) {
    SBatch b = {.V = V, .n = n, .n_rows = n_rows};
    b.logits = xmalloc((size_t)n_rows * V * sizeof *b.logits);
    b.kind = xmalloc((size_t)n_rows * sizeof *b.kind);
    b.params = xmalloc((size_t)n * sizeof *b.params);
    b.offsets = xmalloc((size_t)(n + 1) * sizeof *b.offsets);
    b.history = xmalloc((size_t)n * max_hist * sizeof *b.history + 4);
    for (int r = 0; r < n_rows; r++) {
        b.kind[r] = (r + c0) % ST_KINDS;
        st_make_row(b.logits + (size_t)r * V, V, b.kind[r], 1);
    }
    b.offsets[0] = 0;
    for (int s = 0; s < n; s++) {
        OpsSampleParams *p = &b.params[s];
        st_combo((c0 + s) % ST_N_COMBOS, p);
        if (randomise && s % 2) {
            p->top_p = st_unit() < 0.2 ? 1.0f : (float)st_unit();
            p->top_k = st_unit() < 0.6 ? 0 : st_int(1, V + 2);
            p->min_p = st_unit() < 0.6 ? 0.0f : (float)(0.3 * st_unit());
        }
        p->logits_row = st_int(0, n_rows);
        p->u = st_unit();
        b.offsets[s + 1] = b.offsets[s] + st_make_history(b.history + b.offsets[s], max_hist, V);
    }
    return b;
}

// The batch on the GPU: logits uploaded as bf16 (exact: the values are bf16 already), params, history and mask ids
// copied (each sample's mask pointer moved to its ids' device copy).
static void run_gpu(const SBatch *b, int32_t *tok, float *lp) {
    const size_t nh = (size_t)b->offsets[b->n];
    size_t nm = 0;
    for (int s = 0; s < b->n; s++) nm += b->params[s].mask ? (size_t)b->params[s].n_mask : 0;
    int32_t *d_mask = ops_malloc(gpu, nm * 4 + 4), *h_mask = xmalloc(nm * 4 + 4);
    OpsSampleParams *h_params = xmalloc((size_t)b->n * sizeof *h_params);
    memcpy(h_params, b->params, (size_t)b->n * sizeof *h_params);
    for (int s = 0, at = 0; s < b->n; s++) {
        if (!h_params[s].mask) continue;
        memcpy(h_mask + at, h_params[s].mask, (size_t)h_params[s].n_mask * 4);
        h_params[s].mask = d_mask + at;
        at += h_params[s].n_mask;
    }
    if (nm) ops_copy_to_device(gpu, d_mask, h_mask, nm * 4);
    void *d_logits = ops_malloc(gpu, (size_t)b->n_rows * b->V * ops_dtype_size(gpu));
    OpsSampleParams *d_params = ops_malloc(gpu, (size_t)b->n * sizeof *d_params);
    int32_t *d_off = ops_malloc(gpu, (size_t)(b->n + 1) * 4), *d_hist = ops_malloc(gpu, nh * 4 + 4);
    int32_t *d_tok = ops_malloc(gpu, (size_t)b->n * 4);
    float *d_lp = ops_malloc(gpu, (size_t)b->n * 4);
    check_ctx(gpu, "gpu alloc");
    ops_upload_f32(gpu, d_logits, b->logits, (size_t)b->n_rows * b->V);
    ops_copy_to_device(gpu, d_params, h_params, (size_t)b->n * sizeof *d_params);
    ops_copy_to_device(gpu, d_off, b->offsets, (size_t)(b->n + 1) * 4);
    if (nh) ops_copy_to_device(gpu, d_hist, b->history, nh * 4);
    ops_sample_rows(gpu, d_tok, d_lp, d_logits, d_params, d_hist, d_off, b->n, b->n_rows, b->V, (int)nh);
    ops_copy_to_host(gpu, tok, d_tok, (size_t)b->n * 4);
    ops_copy_to_host(gpu, lp, d_lp, (size_t)b->n * 4);
    check_ctx(gpu, "gpu ops_sample_rows");
    ops_free(gpu, d_mask);
    free(h_mask);
    free(h_params);
    ops_free(gpu, d_logits);
    ops_free(gpu, d_params);
    ops_free(gpu, d_off);
    ops_free(gpu, d_hist);
    ops_free(gpu, d_tok);
    ops_free(gpu, d_lp);
}

static void run_cpu(const SBatch *b, int32_t *tok, float *lp) {
    ops_sample_rows(cpu, tok, lp, b->logits, b->params, b->history, b->offsets, b->n, b->n_rows, b->V,
                    b->offsets[b->n]);
    check_ctx(cpu, "cpu ops_sample_rows");
}

// The CPU op's token for sample s at uniform u.
static int32_t cpu_token_at(const SBatch *b, int s, double u, float *lp) {
    OpsSampleParams p = b->params[s];
    p.u = u;
    const int32_t off[2] = {0, b->offsets[s + 1] - b->offsets[s]};
    int32_t t;
    float l;
    ops_sample_rows(cpu, &t, &l, b->logits, &p, b->history + b->offsets[s], off, 1, b->n_rows, b->V, off[1]);
    check_ctx(cpu, "cpu ops_sample_rows");
    if (lp) *lp = l;
    return t;
}

// Is `want` the CPU op's token at some uniform within 1e-6 of the sample's u? The CPU token is non-decreasing in
// u (inverse CDF in id order), so bisection finds where it passes `want`. *u_at: that uniform; *lp_at: the CPU's
// logprob of `want` there.
static int near_boundary(const SBatch *b, int s, int32_t want, double *u_at, float *lp_at) {
    const double u = b->params[s].u;
    double lo = u - 1e-6 < 0.0 ? 0.0 : u - 1e-6, hi = u + 1e-6 > 0.9999999999999999 ? 0.9999999999999999 : u + 1e-6;
    const int32_t tl = cpu_token_at(b, s, lo, NULL), th = cpu_token_at(b, s, hi, NULL);
    if (want < tl || want > th) return 0;
    for (int it = 0; it < 64; it++) {
        const double mid = 0.5 * (lo + hi);
        float l;
        const int32_t t = cpu_token_at(b, s, mid, &l);
        if (t == want) {
            *u_at = mid;
            *lp_at = l;
            return 1;
        }
        if (t < want) lo = mid;
        else hi = mid;
    }
    return 0;
}

// Everything about sample s that helps to find why CUDA and CPU differ.
static void explain(const SBatch *b, int s, int32_t tg, float lg, int32_t tc, float lc) {
    const OpsSampleParams *p = &b->params[s];
    const int V = b->V, r = p->logits_row;
    const float *row = b->logits + (size_t)r * V;
    const int32_t *h = b->history + b->offsets[s];
    const int nh = b->offsets[s + 1] - b->offsets[s];
    const int greedy = p->temperature < OPS_SAMPLE_GREEDY_BELOW;
    const float inv_t = greedy ? 1.0f : 1.0f / p->temperature;
    float *z = xmalloc((size_t)V * sizeof *z);
    for (int i = 0; i < V; i++) z[i] = row[i];
    if (p->repetition_penalty != 1.0f) {
        char *seen = calloc((size_t)V, 1);
        for (int j = 0; j < nh; j++) {
            const int32_t t = h[j];
            if (t < 0 || t >= V || seen[t]) continue;
            seen[t] = 1;
            z[t] = z[t] > 0 ? z[t] / p->repetition_penalty : z[t] * p->repetition_penalty;
        }
        free(seen);
    }
    float zm = -INFINITY;
    for (int i = 0; i < V; i++) {
        z[i] *= inv_t;
        if (z[i] > zm) zm = z[i];
    }
    fprintf(stderr, "  sample %d: V=%d row %d (%s), history %d ids, ", s, V, r, st_kind_name[b->kind[r]], nh);
    st_print_params(stderr, p);
    fprintf(stderr, "\n    filters: %s%s%s%s%s; max scaled logit %.9g\n", greedy ? "greedy " : "",
            p->min_p > 0 ? "min-p " : "", p->top_k > 0 && p->top_k < V ? "top-k " : "", p->top_p < 1.0f ? "top-p " : "",
            p->repetition_penalty != 1.0f && nh > 0 ? "penalty" : "", zm);
    const int32_t who[2] = {tg, tc};
    const char *name[2] = {"cuda", "cpu"};
    const float lps[2] = {lg, lc};
    for (int k = 0; k < 2; k++) {
        const int32_t t = who[k];
        if (t < 0 || t >= V) {
            fprintf(stderr, "    %s token %d (outside the vocabulary), logprob %.9g\n", name[k], t, lps[k]);
            continue;
        }
        int above = 0, ties = 0;
        for (int i = 0; i < V; i++) {
            above += z[i] > z[t];
            ties += z[i] == z[t];
        }
        fprintf(stderr, "    %s token %d: raw %.9g scaled %.9g weight exp(z - max) %.9g, %d ids above, %d tied; "
                "logprob %.9g (p = %.6g)\n", name[k], t, row[t], z[t], exp((double)z[t] - zm), above, ties, lps[k],
                exp(lps[k]));
    }
    const double u = p->u;
    fprintf(stderr, "    cpu token at u - 1e-6: %d, at u + 1e-6: %d\n",
            cpu_token_at(b, s, u - 1e-6 < 0 ? 0 : u - 1e-6, NULL),
            cpu_token_at(b, s, u + 1e-6 >= 1 ? 0.9999999999999999 : u + 1e-6, NULL));
    free(z);
}

typedef struct {
    int samples, boundary, bad;
    double max_lp_diff, max_boundary_du;
} Tally;

static void compare(const SBatch *b, Tally *t) {
    int32_t *tg = xmalloc((size_t)b->n * 4), *tc = xmalloc((size_t)b->n * 4);
    float *lg = xmalloc((size_t)b->n * 4), *lc = xmalloc((size_t)b->n * 4);
    run_gpu(b, tg, lg);
    run_cpu(b, tc, lc);
    for (int s = 0; s < b->n; s++) {
        t->samples++;
        float want_lp = lc[s];
        if (tg[s] != tc[s]) {
            double u_at;
            if (tg[s] >= 0 && tg[s] < b->V && near_boundary(b, s, tg[s], &u_at, &want_lp)) {
                t->boundary++;
                if (fabs(u_at - b->params[s].u) > t->max_boundary_du) t->max_boundary_du = fabs(u_at - b->params[s].u);
            } else {
                if (t->bad++ < 3) {
                    fprintf(stderr, "MISMATCH (not a CDF-boundary case):\n");
                    explain(b, s, tg[s], lg[s], tc[s], lc[s]);
                }
                continue;
            }
        }
        const int same = (isnan(lg[s]) && isnan(want_lp)) || lg[s] == want_lp;
        const double d = same ? 0.0 : fabs((double)lg[s] - want_lp);
        if (!(d <= 2e-3)) {
            if (t->bad++ < 3) {
                fprintf(stderr, "LOGPROB differs by %.3g:\n", d);
                explain(b, s, tg[s], lg[s], tc[s], lc[s]);
            }
        } else if (d > t->max_lp_diff) {
            t->max_lp_diff = d;
        }
    }
    free(tg);
    free(tc);
    free(lg);
    free(lc);
}

static void test_grid(void) {
    // (V, samples, rows, max history)
    static const int plan[][4] = {{1, 192, 4, 8},        {2, 768, 16, 8},      {5, 768, 16, 20},
                                  {64, 1152, 32, 40},    {300, 1152, 32, 40},  {1000, 1152, 32, 40},
                                  {4096, 768, 24, 40},   {32000, 576, 16, 64}, {151936, 384, 16, 64},
                                  {300000, 96, 4, 64},   {50000, 64, 8, 6000}};
    Tally t = {0};
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        SBatch b = make_batch(plan[i][0], plan[i][1], plan[i][2], (int)i * 5, plan[i][3], 1);
        const int before = t.bad;
        compare(&b, &t);
        CHECK(t.bad == before, "V=%d: %d samples differ beyond the CDF-boundary rule", b.V, t.bad - before);
        batch_free(&b);
    }
    printf("grid: %d samples; %d differ only at a CDF boundary (|u' - u| <= %.2g); %d real mismatches; max "
           "|logprob diff| %.3g\n", t.samples, t.boundary, t.max_boundary_du, t.bad, t.max_lp_diff);
    // Weights and sums are double on both sides (float weights in unfiltered draws, within ~3e-7): a boundary case
    // needs u within ~1e-12 (~3e-7) of a boundary.
    CHECK(t.boundary <= 2 + t.samples / 1000, "%d CDF-boundary cases in %d samples: too many to be rounding",
          t.boundary, t.samples);
}

// Is id allowed by p's mask?
static int mask_allows(const OpsSampleParams *p, int32_t id) {
    int listed = 0;
    for (int k = 0; p->mask && k < p->n_mask && !listed; k++) listed = p->mask[k] == id;
    return p->mask_mode == OPS_SAMPLE_MASK_ALLOW ? listed : p->mask_mode == OPS_SAMPLE_MASK_BAN ? !listed : 1;
}

static void test_masks(void) {
    // (V, samples, rows, max mask ids)
    static const int plan[][4] = {{1, 192, 4, 2},      {5, 576, 16, 4},     {300, 768, 32, 8},
                                  {4096, 384, 24, 8},  {151936, 192, 8, 4}, {300000, 48, 4, 4}};
    Tally t = {0};
    int forbidden = 0;
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        SBatch b = make_batch(plan[i][0], plan[i][1], plan[i][2], (int)i * 3, 20, 1);
        add_masks(&b, plan[i][3], 1);
        const int before = t.bad;
        compare(&b, &t);
        CHECK(t.bad == before, "masked V=%d: %d samples differ beyond the CDF-boundary rule", b.V, t.bad - before);
        int32_t *tok = xmalloc((size_t)b.n * 4);
        float *lp = xmalloc((size_t)b.n * 4);
        run_gpu(&b, tok, lp);
        for (int s = 0; s < b.n; s++) {
            const OpsSampleParams *p = &b.params[s];
            int any = 0; // an allowed id with a logit above -inf
            for (int j = 0; j < b.V && !any; j++)
                any = mask_allows(p, j) && b.logits[(size_t)p->logits_row * b.V + j] > -INFINITY;
            if (any && !mask_allows(p, tok[s]) && forbidden++ < 3)
                fprintf(stderr, "masked V=%d sample %d: cuda drew forbidden id %d\n", b.V, s, tok[s]);
        }
        free(tok);
        free(lp);
        batch_free(&b);
    }
    printf("masks: %d samples; %d differ only at a CDF boundary; %d real mismatches; %d forbidden ids drawn; max "
           "|logprob diff| %.3g\n", t.samples, t.boundary, t.bad, forbidden, t.max_lp_diff);
    CHECK(forbidden == 0, "%d samples drew an id their mask forbids", forbidden);
    CHECK(t.boundary <= 2 + t.samples / 1000, "%d CDF-boundary cases in %d samples: too many to be rounding",
          t.boundary, t.samples);
}

static void test_edges(void) {
    const int V = 4099;
    const OpsSampleParams edge[] = {
        {.temperature = 1.0f, .top_k = V, .top_p = 1.0f, .repetition_penalty = 1.0f},
        {.temperature = 1.0f, .top_k = V - 1, .top_p = 1.0f, .repetition_penalty = 1.0f},
        {.temperature = 0.8f, .top_k = -1, .top_p = 1e-6f, .repetition_penalty = 1.0f},
        {.temperature = 0.8f, .top_k = 0, .top_p = 0.0f, .repetition_penalty = 1.0f},
        {.temperature = 1.2f, .top_k = 0, .top_p = 1.0f, .min_p = 1.0f, .repetition_penalty = 1.0f},
        {.temperature = 1.2f, .top_k = 0, .top_p = 1.0f, .min_p = 2.0f, .repetition_penalty = 1.0f},
        {.temperature = 2e-5f, .top_k = 3, .top_p = 0.5f, .min_p = 0.5f, .repetition_penalty = 0.7f},
        {.temperature = 1e-6f, .top_k = 0, .top_p = 1.0f, .repetition_penalty = 2.0f},
        {.temperature = 50.0f, .top_k = 0, .top_p = 0.999f, .repetition_penalty = 1.0f},
        {.temperature = 1.0f, .top_k = 2000, .top_p = 0.99f, .min_p = 0.001f, .repetition_penalty = 1.1f},
    };
    const int n_edge = sizeof edge / sizeof edge[0];
    SBatch b = make_batch(V, n_edge * ST_KINDS * 3, ST_KINDS, 0, 30, 0);
    for (int s = 0; s < b.n; s++) {
        const double u = b.params[s].u;
        b.params[s] = edge[s % n_edge];
        b.params[s].u = u;
        b.params[s].logits_row = (s / n_edge) % ST_KINDS;
    }
    b.params[7].logits_row = b.n_rows; // outside the rows
    b.params[8].logits_row = -3;
    Tally t = {0};
    int32_t *tg = xmalloc((size_t)b.n * 4);
    float *lg = xmalloc((size_t)b.n * 4);
    run_gpu(&b, tg, lg);
    CHECK(tg[7] == -1 && isnan(lg[7]) && tg[8] == -1 && isnan(lg[8]), "bad logits_row: %d %g, %d %g", tg[7], lg[7],
          tg[8], lg[8]);
    b.params[7].logits_row = 0;
    b.params[8].logits_row = 1;
    compare(&b, &t);
    CHECK(t.bad == 0, "edge parameters: %d mismatches", t.bad);
    free(tg);
    free(lg);
    // A row of only -inf: id 0 on both.
    for (int i = 0; i < V; i++) b.logits[i] = -INFINITY;
    b.n = n_edge;
    for (int s = 0; s < b.n; s++) b.params[s].logits_row = 0;
    int32_t tok[16];
    float lp[16];
    run_gpu(&b, tok, lp);
    int ok = 1;
    for (int s = 0; s < b.n; s++) ok &= tok[s] == 0;
    CHECK(ok, "a row of only -inf gives id 0");
    batch_free(&b);
}

// The CPU twin's weights of sample s's row (z = raw * (1 / T) in float, w = exp(z - max z) in double): is id `tok`
// one with a positive weight whose later ids hold at most `frac` of the total?
static int in_cdf_tail(const SBatch *b, int s, int32_t tok, double frac) {
    const OpsSampleParams *p = &b->params[s];
    const float *row = b->logits + (size_t)p->logits_row * b->V, inv_t = 1.0f / p->temperature;
    if (tok < 0 || tok >= b->V) return 0;
    float zm = -INFINITY;
    for (int i = 0; i < b->V; i++) zm = fmaxf(zm, row[i] * inv_t);
    double total = 0.0, after = 0.0;
    for (int i = 0; i < b->V; i++) {
        const double w = exp((double)(row[i] * inv_t) - zm);
        total += w;
        if (i > tok) after += w;
    }
    return exp((double)(row[tok] * inv_t) - zm) > 0.0 && after <= frac * total;
}

// Samples without filters or penalty (the GRPO default), which draw in one read of the row (draw_one_pass):
// temperatures 0.7 / 1 / 1.3 over every row kind at V = 151936 and 32000, uniform 0 included (the first id with a
// positive weight). Their weights are float exponentials (~3e-7 from the CPU twin's), so a token may differ from
// the CPU's where u lies that close to a CDF boundary (compare's rule certifies such cases within 1e-6). At
// u = 1 - 2^-53 the running sum may stay at or below u * total (the answer is then the last id with a positive
// weight) and which id crosses depends on those roundings: there the token must lie in the last 1e-6 of the CPU
// twin's mass. Then rows with a NaN logit (the general path answers, NaN logprob on
// both) and with a +inf logit (id 0 on both).
static void test_unfiltered_draws(void) {
    static const float temps[] = {0.7f, 1.0f, 1.3f};
    static const int sizes[] = {151936, 32000};
    Tally t = {0};
    int tail_bad = 0;
    for (int k = 0; k < 2; k++) {
        SBatch b = make_batch(sizes[k], 384, 2 * ST_KINDS, 3 + k, 0, 0);
        for (int s = 0; s < b.n; s++) {
            OpsSampleParams *p = &b.params[s];
            *p = (OpsSampleParams){.temperature = temps[s % 3], .top_k = s % 7 == 0 ? -1 : 0, .top_p = 1.0f,
                                   .repetition_penalty = 1.0f, .logits_row = s % b.n_rows, .u = st_unit()};
            if (s % 11 == 0) p->u = 0.0;
        }
        compare(&b, &t);
        for (int s = 0; s < b.n; s++) b.params[s].u = nextafter(1.0, 0.0);
        b.n = 2 * ST_KINDS * 3;
        int32_t tg[2 * ST_KINDS * 3];
        float lg[2 * ST_KINDS * 3];
        run_gpu(&b, tg, lg);
        for (int s = 0; s < b.n; s++)
            if (!in_cdf_tail(&b, s, tg[s], 1e-6) && tail_bad++ < 3)
                fprintf(stderr, "u = 1 - 2^-53, V=%d sample %d: token %d is not in the last 1e-6 of the mass\n", b.V, s,
                        tg[s]);
        batch_free(&b);
    }
    CHECK(tail_bad == 0, "unfiltered draws at u = 1 - 2^-53: %d tokens outside the CDF's tail", tail_bad);
    printf("unfiltered draws: %d samples; %d at a CDF boundary; %d real mismatches; max |logprob diff| %.3g\n",
           t.samples, t.boundary, t.bad, t.max_lp_diff);
    CHECK(t.bad == 0, "unfiltered draws: %d mismatches", t.bad);
    CHECK(t.boundary <= 2 + t.samples / 1000, "unfiltered draws: %d CDF-boundary cases", t.boundary);

    const int V = 4096;
    SBatch b = make_batch(V, 24, 2, 0, 0, 0);
    b.logits[37] = NAN;
    b.logits[(size_t)V + 1000] = INFINITY;
    for (int s = 0; s < b.n; s++)
        b.params[s] = (OpsSampleParams){.temperature = temps[s % 3], .top_p = 1.0f, .repetition_penalty = 1.0f,
                                        .logits_row = s % 2, .u = st_unit()};
    int32_t tg[24], tc[24];
    float lg[24], lc[24];
    run_gpu(&b, tg, lg);
    run_cpu(&b, tc, lc);
    for (int s = 0; s < b.n; s++) {
        CHECK(tg[s] == tc[s], "row with a %s logit, sample %d: token %d on the GPU, %d on the CPU",
              s % 2 ? "+inf" : "NaN", s, tg[s], tc[s]);
        if (s % 2 == 0) CHECK(isnan(lg[s]) && isnan(lc[s]), "row with a NaN logit: logprobs %g / %g", lg[s], lc[s]);
    }
    batch_free(&b);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// 256 samples at V = 151936 each over its own row: alone == in the batch, run twice == identical; and timing.
static void test_batch_independence(void) {
    const int V = 151936, n = 256;
    SBatch b = make_batch(V, n, n, 11, 200, 1);
    for (int s = 0; s < n; s++) b.params[s].logits_row = s;
    add_masks(&b, 6, 3);
    int32_t *t1 = xmalloc(n * 4), *t2 = xmalloc(n * 4);
    float *l1 = xmalloc(n * 4), *l2 = xmalloc(n * 4);
    run_gpu(&b, t1, l1);
    run_gpu(&b, t2, l2);
    CHECK(memcmp(t1, t2, n * 4) == 0 && memcmp(l1, l2, n * 4) == 0, "two runs of the same batch differ");
    // Each sample alone: its own logits row only, its own history from offset 0.
    SBatch one = {.V = V, .n = 1, .n_rows = 1};
    int differ = 0;
    for (int s = 0; s < n; s++) {
        one.logits = b.logits + (size_t)s * V;
        one.kind = &b.kind[s];
        one.params = &b.params[s];
        int32_t off[2] = {0, b.offsets[s + 1] - b.offsets[s]};
        one.offsets = off;
        one.history = b.history + b.offsets[s];
        OpsSampleParams p = b.params[s];
        p.logits_row = 0;
        one.params = &p;
        int32_t t;
        float l;
        run_gpu(&one, &t, &l);
        if (t != t1[s] || memcmp(&l, &l1[s], 4) != 0) {
            if (differ++ < 3) {
                fprintf(stderr, "sample %d alone: token %d logprob %.9g; in the batch: token %d logprob %.9g\n", s, t,
                        l, t1[s], l1[s]);
                explain(&b, s, t, l, t1[s], l1[s]);
            }
        }
    }
    CHECK(differ == 0, "%d of %d samples changed when sampled alone", differ, n);

    // Timing: the op alone (inputs resident), default parameters and the whole grid's mix.
    void *d_logits = ops_malloc(gpu, (size_t)n * V * ops_dtype_size(gpu));
    OpsSampleParams *d_params = ops_malloc(gpu, (size_t)n * sizeof *d_params);
    int32_t *d_off = ops_malloc(gpu, (size_t)(n + 1) * 4), *d_hist = ops_malloc(gpu, (size_t)b.offsets[n] * 4 + 4);
    int32_t *d_tok = ops_malloc(gpu, n * 4);
    float *d_lp = ops_malloc(gpu, n * 4);
    check_ctx(gpu, "gpu alloc");
    ops_upload_f32(gpu, d_logits, b.logits, (size_t)n * V);
    ops_copy_to_device(gpu, d_off, b.offsets, (size_t)(n + 1) * 4);
    ops_copy_to_device(gpu, d_hist, b.history, (size_t)b.offsets[n] * 4);
    for (int mode = 0; mode < 2; mode++) {
        OpsSampleParams *p = xmalloc((size_t)n * sizeof *p);
        memcpy(p, b.params, (size_t)n * sizeof *p);
        for (int s = 0; s < n; s++) p[s].mask_mode = 0, p[s].n_mask = 0, p[s].mask = NULL; // host ids: not here
        if (mode == 0)
            for (int s = 0; s < n; s++) {
                p[s].temperature = 1.0f;
                p[s].top_k = 0;
                p[s].top_p = 1.0f;
                p[s].min_p = 0.0f;
                p[s].repetition_penalty = 1.0f;
            }
        ops_copy_to_device(gpu, d_params, p, (size_t)n * sizeof *p);
        ops_sample_rows(gpu, d_tok, d_lp, d_logits, d_params, d_hist, d_off, n, n, V, b.offsets[n]);
        ops_synchronize(gpu);
        const int reps = 20;
        const double t0 = now();
        for (int i = 0; i < reps; i++)
            ops_sample_rows(gpu, d_tok, d_lp, d_logits, d_params, d_hist, d_off, n, n, V, b.offsets[n]);
        ops_synchronize(gpu);
        check_ctx(gpu, "timing");
        printf("%d samples x V=%d, %s: %.3f ms per call\n", n, V,
               mode == 0 ? "T=1, no filters, no penalty" : "the grid's mix of filters and penalties",
               (now() - t0) / reps * 1e3);
        free(p);
    }
    ops_free(gpu, d_logits);
    ops_free(gpu, d_params);
    ops_free(gpu, d_off);
    ops_free(gpu, d_hist);
    ops_free(gpu, d_tok);
    ops_free(gpu, d_lp);
    free(t1);
    free(t2);
    free(l1);
    free(l2);
    batch_free(&b);
}

int main(void) {
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    char err[512];
    if (ops_create(&gpu, OPS_BACKEND_CUDA, 0, err, sizeof err) != 0 ||
        ops_create(&cpu, OPS_BACKEND_CPU, 0, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    test_grid();
    test_edges();
    test_masks();
    test_unfiltered_draws();
    test_batch_independence();
    ops_destroy(gpu);
    ops_destroy(cpu);
    return check_exit_code("test_cuda_sample");
}
