// test_rollout_sampler_ops.c — the fused sampling op (ops_sample_rows) on the CPU backend (kernels/cpu/cpu_sample.c,
// the host reference the CUDA kernel is held to) against its semantics as kernels/ops.h states them, written out
// plainly here (ref_sample: one full sort instead of the op's cuts and candidate floors):
//   - the whole parameter grid (greedy, T 0.3 / 1 / 1.7, top_k 0 / 1 / 5 / 50, top_p 1 / 0.9 / 0.3, min_p 0 / 0.1,
//     repetition penalty 1 / 1.3) over rows of V = 1 .. 151936 of several shapes (ties from bf16 quantisation
//     and from a coarse grid, peaked, flat, one big tie, -inf entries), with histories holding repeats and
//     out-of-range ids, many samples sharing one logits row: the same token for every sample and the same
//     logprob (within 1e-5);
//   - edge parameters (top_k >= V or V - 1, top_p tiny or 0, min_p 1 or above, a row of only -inf);
//   - a logits_row outside the rows gives token -1 and a NaN logprob; a sample's result does not depend on the
//     other samples of the call;
//   - masks (allowed_token_ids, bad words, min_tokens): the grid again with each sample's allow or ban list, the
//     same token as the reference, never a forbidden id, the logprob the raw distribution's; greedy under a mask,
//     a mask that leaves nothing (id 0).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "rollout_server/sampler.h"
#include "tests/unit/sample_testlib.h"
#include "tests/unit/check_macros.h"

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

// ---- the reference -----------------------------------------------------------------------------------
//
// ops_sample_rows' semantics (kernels/ops.h) with nothing but a sort: penalty on each distinct history id in
// [0, V); every id the mask forbids -inf; greedy: the argmax (lowest id on ties); otherwise x = penalised logits * (1 / T) in float and
// w = exp(x - max x) in double, the survivors of min-p (w > 0, and w >= min_p when min_p > 0), then of top-k
// (x at least the k-th largest survivor's), then the top-p prefix of the survivors in (x desc, id asc) order,
// kept while the weight ranked above is below top_p of theirs; the draw walks the kept ids in id order until the
// cumulated weight passes u times their total. Sums run in id order (the prefix's in sorted order) in double, so
// the token is not just as likely as the op's but the same one.

typedef struct {
    float x;
    int32_t id;
} RefCand;

typedef struct {
    int V;
    float *x;
    double *w;
    unsigned char *alive, *penalised, *forbidden;
    RefCand *c;
} Ref;

static Ref ref_new(int V) {
    Ref r = {.V = V};
    r.x = xmalloc((size_t)V * sizeof *r.x);
    r.w = xmalloc((size_t)V * sizeof *r.w);
    r.alive = xmalloc((size_t)V);
    r.penalised = xmalloc((size_t)V);
    r.forbidden = xmalloc((size_t)V);
    r.c = xmalloc((size_t)V * sizeof *r.c);
    return r;
}

static void ref_free(Ref *r) {
    free(r->x);
    free(r->w);
    free(r->alive);
    free(r->penalised);
    free(r->forbidden);
    free(r->c);
}

static int ref_cmp(const void *pa, const void *pb) {
    const RefCand *a = pa, *b = pb;
    if (a->x != b->x) return a->x > b->x ? -1 : 1;
    return a->id < b->id ? -1 : (a->id > b->id);
}

// log_softmax(logits * inv_t)[id] of the raw row, in double.
static float ref_logprob(const float *logits, int V, float inv_t, int32_t id) {
    float m = -INFINITY;
    for (int i = 0; i < V; i++) m = fmaxf(m, logits[i] * inv_t);
    double sum = 0.0;
    for (int i = 0; i < V && m != -INFINITY; i++) sum += exp((double)(logits[i] * inv_t) - m);
    const double lse = m == -INFINITY ? -INFINITY : m + log(sum);
    return (float)((double)(logits[id] * inv_t) - lse);
}

// The kept set of a non-greedy sample (r->alive), over r->x already scaled and r->w.
static void ref_filter(Ref *r, const OpsSampleParams *p) {
    const int V = r->V;
    int n = 0;
    for (int i = 0; i < V; i++) {
        r->alive[i] = r->w[i] > 0.0 && (!(p->min_p > 0.0f) || r->w[i] >= p->min_p);
        if (r->alive[i]) r->c[n++] = (RefCand){r->x[i], i};
    }
    const int top_k_on = p->top_k > 0 && p->top_k < V && n > p->top_k;
    if (!top_k_on && !(p->top_p < 1.0f)) return;
    qsort(r->c, (size_t)n, sizeof *r->c, ref_cmp);
    if (top_k_on) {
        const float kth = r->c[p->top_k - 1].x;
        while (n > 0 && r->c[n - 1].x < kth) r->alive[r->c[--n].id] = 0;
    }
    if (p->top_p < 1.0f) {
        double total = 0.0;
        for (int i = 0; i < V; i++)
            if (r->alive[i]) total += r->w[i];
        const double need = p->top_p * total;
        double above = 0.0;
        int keep = 0;
        while (keep < n && (keep == 0 || above < need)) above += r->w[r->c[keep++].id];
        for (int j = keep; j < n; j++) r->alive[r->c[j].id] = 0;
    }
}

static int32_t ref_sample(Ref *r, const float *logits, const OpsSampleParams *p, const int32_t *hist, int nh,
                          float *lp) {
    const int V = r->V;
    const int greedy = p->temperature < OPS_SAMPLE_GREEDY_BELOW;
    const float inv_t = greedy ? 1.0f : 1.0f / p->temperature;
    memcpy(r->x, logits, (size_t)V * sizeof *r->x);
    if (p->repetition_penalty != 1.0f) {
        memset(r->penalised, 0, (size_t)V);
        for (int h = 0; h < nh; h++) {
            const int32_t t = hist[h];
            if (t < 0 || t >= V || r->penalised[t]) continue;
            r->penalised[t] = 1;
            r->x[t] = r->x[t] > 0 ? r->x[t] / p->repetition_penalty : r->x[t] * p->repetition_penalty;
        }
    }
    if (p->mask_mode == OPS_SAMPLE_MASK_BAN || p->mask_mode == OPS_SAMPLE_MASK_ALLOW) {
        const int allow = p->mask_mode == OPS_SAMPLE_MASK_ALLOW;
        memset(r->forbidden, allow, (size_t)V);
        for (int k = 0; k < p->n_mask; k++)
            if (p->mask[k] >= 0 && p->mask[k] < V) r->forbidden[p->mask[k]] = !allow;
        for (int i = 0; i < V; i++)
            if (r->forbidden[i]) r->x[i] = -INFINITY;
    }
    int32_t tok = 0;
    if (greedy) {
        for (int i = 1; i < V; i++)
            if (r->x[i] > r->x[tok]) tok = i;
    } else {
        float xm = -INFINITY;
        for (int i = 0; i < V; i++) xm = fmaxf(xm, r->x[i] *= inv_t);
        for (int i = 0; i < V; i++) r->w[i] = xm == -INFINITY ? 0.0 : exp((double)r->x[i] - xm);
        ref_filter(r, p);
        double total = 0.0;
        for (int i = 0; i < V; i++)
            if (r->alive[i]) total += r->w[i];
        const double target = p->u * total;
        double cum = 0.0;
        tok = -1;
        for (int i = 0; i < V; i++) {
            if (!r->alive[i]) continue;
            tok = i;
            cum += r->w[i];
            if (cum > target) break;
        }
        if (tok < 0) tok = 0; // nothing kept (every logit -inf, min_p > 1): id 0
    }
    *lp = ref_logprob(logits, V, inv_t, tok);
    return tok;
}

// A batch of n samples over n_rows rows of V logits, each sample with its own params, history, stream, pos.
typedef struct {
    int V, n, n_rows;
    float *logits;              // (n_rows, V)
    int *kind;                  // (n_rows)
    OpsSampleParams *params;    // (n)
    uint64_t *stream, *pos;     // (n)
    int32_t *offsets, *history; // (n + 1), (offsets[n])
    int32_t *mask_ids;          // every sample's mask ids, params[s].mask pointing in (NULL: no masks)
} SBatch;

static void batch_free(SBatch *b) {
    free(b->logits);
    free(b->kind);
    free(b->params);
    free(b->stream);
    free(b->pos);
    free(b->offsets);
    free(b->history);
    free(b->mask_ids);
}

// Samples cycle through the parameter grid starting at combo c0; rows cycle through the kinds.
static SBatch make_batch(int V, int n, int n_rows, int c0, int max_hist) {
    SBatch b = {.V = V, .n = n, .n_rows = n_rows};
    b.logits = xmalloc((size_t)n_rows * V * sizeof *b.logits);
    b.kind = xmalloc((size_t)n_rows * sizeof *b.kind);
    b.params = xmalloc((size_t)n * sizeof *b.params);
    b.stream = xmalloc((size_t)n * sizeof *b.stream);
    b.pos = xmalloc((size_t)n * sizeof *b.pos);
    b.offsets = xmalloc((size_t)(n + 1) * sizeof *b.offsets);
    b.history = xmalloc((size_t)n * max_hist * sizeof *b.history + 4);
    for (int r = 0; r < n_rows; r++) {
        b.kind[r] = (r + c0) % ST_KINDS;
        st_make_row(b.logits + (size_t)r * V, V, b.kind[r], r % 2);
    }
    b.offsets[0] = 0;
    for (int s = 0; s < n; s++) {
        st_combo((c0 + s) % ST_N_COMBOS, &b.params[s]);
        b.params[s].logits_row = st_int(0, n_rows);
        b.stream[s] = st_next();
        b.pos[s] = (uint64_t)st_int(0, 5000);
        b.params[s].u = sampler_uniform(b.stream[s], b.pos[s]);
        b.offsets[s + 1] = b.offsets[s] + st_make_history(b.history + b.offsets[s], max_hist, V);
    }
    return b;
}

// Runs the op on the CPU backend over the batch.
static void run_op(OpsCtx *ctx, const SBatch *b, int32_t *tok, float *lp) {
    ops_sample_rows(ctx, tok, lp, b->logits, b->params, b->history, b->offsets, b->n, b->n_rows, b->V,
                    b->offsets[b->n]);
    CHECK(ops_status(ctx) == 0, "ops_sample_rows: %s", ops_error(ctx));
    ops_clear_error(ctx);
}

static int same_lp(float a, float b, double tol) {
    return (isnan(a) && isnan(b)) || a == b || fabs((double)a - b) <= tol;
}

// Every sample of the batch against the reference. Returns the number of mismatching samples.
static int compare_batch(OpsCtx *ctx, const SBatch *b, int *n_bitwise, double *max_lp_diff) {
    int32_t *tok = xmalloc((size_t)b->n * sizeof *tok);
    float *lp = xmalloc((size_t)b->n * sizeof *lp);
    run_op(ctx, b, tok, lp);
    Ref ref = ref_new(b->V);
    int bad = 0;
    for (int s = 0; s < b->n; s++) {
        const OpsSampleParams *o = &b->params[s];
        const int32_t *h = b->history + b->offsets[s];
        const int nh = b->offsets[s + 1] - b->offsets[s];
        float want_lp;
        const int32_t want = ref_sample(&ref, b->logits + (size_t)o->logits_row * b->V, o, h, nh, &want_lp);
        const double d = same_lp(lp[s], want_lp, 0.0) ? 0.0 : fabs((double)lp[s] - want_lp);
        if (!(d <= *max_lp_diff)) *max_lp_diff = isnan(d) ? INFINITY : d;
        *n_bitwise += memcmp(&lp[s], &want_lp, sizeof want_lp) == 0;
        if (tok[s] != want || !same_lp(lp[s], want_lp, 1e-5)) {
            if (bad++ < 5) {
                fprintf(stderr, "  V=%d sample %d (row %d, %s, history %d): ", b->V, s, o->logits_row,
                        st_kind_name[b->kind[o->logits_row]], nh);
                st_print_params(stderr, o);
                fprintf(stderr, "\n    op token %d logprob %.9g | reference token %d logprob %.9g\n", tok[s], lp[s],
                        want, want_lp);
            }
        }
    }
    ref_free(&ref);
    free(tok);
    free(lp);
    return bad;
}

// Gives every sample of b a mask of up to max_len ids (st_make_mask), the ids in b->mask_ids.
static void add_masks(SBatch *b, int max_len) {
    b->mask_ids = xmalloc((size_t)b->n * 2 * max_len * sizeof *b->mask_ids);
    for (int s = 0, at = 0; s < b->n; s++) {
        OpsSampleParams *p = &b->params[s];
        p->mask = b->mask_ids + at;
        p->n_mask = st_make_mask(b->mask_ids + at, max_len, b->logits + (size_t)p->logits_row * b->V, b->V,
                                 &p->mask_mode);
        at += p->n_mask;
    }
}

// Is id allowed by p's mask?
static int mask_allows(const OpsSampleParams *p, int32_t id) {
    int listed = 0;
    for (int k = 0; k < p->n_mask && !listed; k++) listed = p->mask[k] == id;
    return p->mask_mode == OPS_SAMPLE_MASK_ALLOW ? listed : p->mask_mode == OPS_SAMPLE_MASK_BAN ? !listed : 1;
}

static void test_masks(OpsCtx *ctx) {
    static const int plan[][4] = {{1, 192, 4, 2},  {7, 576, 16, 4},    {300, 576, 32, 8},
                                  {4096, 192, 12, 8}, {151936, 96, 6, 4}};
    int total = 0, bitwise = 0, forbidden = 0, changed = 0;
    double max_lp = 0.0;
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        SBatch b = make_batch(plan[i][0], plan[i][1], plan[i][2], (int)i * 5, 20);
        int32_t *free_tok = xmalloc((size_t)b.n * sizeof *free_tok);
        float *free_lp = xmalloc((size_t)b.n * sizeof *free_lp);
        run_op(ctx, &b, free_tok, free_lp);
        add_masks(&b, plan[i][3]);
        const int nb = compare_batch(ctx, &b, &bitwise, &max_lp);
        CHECK(nb == 0, "masked V=%d: %d of %d samples differ from the reference", b.V, nb, b.n);
        int32_t *tok = xmalloc((size_t)b.n * sizeof *tok);
        float *lp = xmalloc((size_t)b.n * sizeof *lp);
        run_op(ctx, &b, tok, lp);
        for (int s = 0; s < b.n; s++) {
            const OpsSampleParams *p = &b.params[s];
            int any = 0; // does the mask leave an id with a logit above -inf?
            for (int j = 0; j < b.V && !any; j++)
                any = mask_allows(p, j) && b.logits[(size_t)p->logits_row * b.V + j] > -INFINITY;
            if (any && !mask_allows(p, tok[s])) {
                if (forbidden++ < 5) fprintf(stderr, "  V=%d sample %d drew forbidden id %d\n", b.V, s, tok[s]);
            }
            changed += tok[s] != free_tok[s];
            // The reported logprob is the raw distribution's, mask or not.
            const int greedy = p->temperature < OPS_SAMPLE_GREEDY_BELOW;
            const float want = ref_logprob(b.logits + (size_t)p->logits_row * b.V, b.V,
                                           greedy ? 1.0f : 1.0f / p->temperature, tok[s]);
            CHECK(same_lp(lp[s], want, 1e-5), "masked V=%d sample %d: logprob %.9g, raw distribution's %.9g", b.V, s,
                  lp[s], want);
        }
        total += b.n;
        free(tok);
        free(lp);
        free(free_tok);
        free(free_lp);
        batch_free(&b);
    }
    printf("masks: %d samples, %d drew a forbidden id, %d tokens changed by their mask, max |logprob diff| %.3g\n",
           total, forbidden, changed, max_lp);
    CHECK(forbidden == 0, "%d samples drew an id their mask forbids", forbidden);
    CHECK(changed > total / 10, "only %d of %d masks changed the token: the test does not exercise them", changed,
          total);

    // Greedy under a mask: the best allowed id; a mask that leaves nothing: id 0 with the raw logprob.
    const float row[6] = {0.5f, 3.0f, 1.0f, 2.0f, -1.0f, 2.0f};
    const int32_t allow[] = {4, 2, 4, 99};
    const int32_t ban[] = {1, 3};
    OpsSampleParams p = {.temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 1.0f,
                         .mask_mode = OPS_SAMPLE_MASK_ALLOW, .n_mask = 4, .mask = allow};
    int32_t t = -7;
    float l = 0.0f;
    ops_sample_rows(ctx, &t, &l, row, &p, NULL, NULL, 1, 1, 6, 0);
    CHECK(t == 2, "greedy with allowed {4, 2}: token %d, expected 2", t);
    CHECK(same_lp(l, ref_logprob(row, 6, 1.0f, 2), 1e-6), "greedy masked logprob %.9g is not the raw one", l);
    p = (OpsSampleParams){.temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 1.0f,
                          .mask_mode = OPS_SAMPLE_MASK_BAN, .n_mask = 2, .mask = ban};
    ops_sample_rows(ctx, &t, &l, row, &p, NULL, NULL, 1, 1, 6, 0);
    CHECK(t == 5, "greedy with {1, 3} banned: token %d, expected 5 (the tie of 3's value)", t);
    p = (OpsSampleParams){.u = 0.99, .temperature = 1.0f, .top_p = 1.0f, .repetition_penalty = 1.0f,
                          .mask_mode = OPS_SAMPLE_MASK_ALLOW, .n_mask = 1, .mask = &allow[3]};
    ops_sample_rows(ctx, &t, &l, row, &p, NULL, NULL, 1, 1, 6, 0);
    CHECK(t == 0, "nothing allowed: token %d, expected 0", t);
    CHECK(same_lp(l, ref_logprob(row, 6, 1.0f, 0), 1e-6), "nothing allowed: logprob %.9g is not the raw one", l);
    p.mask_mode = OPS_SAMPLE_MASK_NONE; // the ids are ignored without a mode
    ops_sample_rows(ctx, &t, &l, row, &p, NULL, NULL, 1, 1, 6, 0);
    CHECK(t == 5, "no mask at u = 0.99: token %d, expected 5", t);
    CHECK(ops_status(ctx) == 0, "ops_sample_rows: %s", ops_error(ctx));
}

static void test_grid(OpsCtx *ctx) {
    // (V, samples, rows): every V sees all 192 combinations at least once; small vocabularies many times over.
    static const int plan[][3] = {{1, 192, 4},     {2, 576, 16},     {5, 576, 16},  {64, 576, 32},
                                  {300, 576, 32},  {1000, 576, 32},  {4096, 384, 24}, {32000, 192, 12},
                                  {151936, 192, 14}};
    int total = 0, bad = 0, bitwise = 0;
    double max_lp = 0.0;
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        SBatch b = make_batch(plan[i][0], plan[i][1], plan[i][2], (int)i * 7, 40);
        const int nb = compare_batch(ctx, &b, &bitwise, &max_lp);
        CHECK(nb == 0, "V=%d: %d of %d samples differ from the reference", b.V, nb, b.n);
        total += b.n;
        bad += nb;
        batch_free(&b);
    }
    printf("grid: %d samples, %d differ from the reference, %d logprobs bitwise equal, max |logprob diff| %.3g\n",
           total, bad, bitwise, max_lp);
    CHECK(max_lp <= 1e-5, "max |logprob diff| %.3g > 1e-5", max_lp);
}

// Parameters at the edges of their ranges, on a few shapes.
static void test_edges(OpsCtx *ctx) {
    const int V = 257;
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
    };
    const int n_edge = sizeof edge / sizeof edge[0];
    SBatch b = make_batch(V, n_edge * ST_KINDS * 4, ST_KINDS, 0, 12);
    for (int s = 0; s < b.n; s++) {
        const double u = b.params[s].u;
        b.params[s] = edge[s % n_edge];
        b.params[s].u = u;
        b.params[s].logits_row = (s / n_edge) % ST_KINDS;
    }
    int bitwise = 0;
    double max_lp = 0.0;
    CHECK(compare_batch(ctx, &b, &bitwise, &max_lp) == 0, "edge parameters differ from the reference");
    batch_free(&b);

    // A row of only -inf: both answer id 0 (nothing to choose from), and the op a NaN logprob.
    float row[8];
    for (int i = 0; i < 8; i++) row[i] = -INFINITY;
    OpsSampleParams p = {.u = 0.5, .temperature = 1.0f, .top_p = 0.9f, .repetition_penalty = 1.0f};
    int32_t tok = -7;
    float lp = 0.0f;
    ops_sample_rows(ctx, &tok, &lp, row, &p, NULL, NULL, 1, 1, 8, 0);
    Ref ref = ref_new(8);
    float want_lp;
    const int32_t want = ref_sample(&ref, row, &p, NULL, 0, &want_lp);
    CHECK(tok == 0 && want == 0 && isnan(lp), "all -inf: op %d (logprob %g), reference %d", tok, lp, want);
    ref_free(&ref);
}

static void test_bad_row_and_independence(OpsCtx *ctx) {
    SBatch b = make_batch(1000, 64, 8, 3, 30);
    int32_t *tok = xmalloc(64 * sizeof *tok);
    float *lp = xmalloc(64 * sizeof *lp);
    b.params[5].logits_row = 8;
    b.params[9].logits_row = -1;
    run_op(ctx, &b, tok, lp);
    CHECK(tok[5] == -1 && isnan(lp[5]) && tok[9] == -1 && isnan(lp[9]),
          "a bad logits_row gives -1 / NaN (%d %g, %d %g)", tok[5], lp[5], tok[9], lp[9]);
    // Each sample alone (its own history, offsets from 0) equals its result in the batch.
    int differ = 0;
    for (int s = 0; s < 64; s++) {
        if (s == 5 || s == 9) continue;
        int32_t off[2] = {0, b.offsets[s + 1] - b.offsets[s]}, t1;
        float l1;
        ops_sample_rows(ctx, &t1, &l1, b.logits, &b.params[s], b.history + b.offsets[s], off, 1, b.n_rows, b.V, off[1]);
        differ += t1 != tok[s] || memcmp(&l1, &lp[s], sizeof l1) != 0;
    }
    CHECK(differ == 0, "%d samples changed when run alone", differ);
    // No history at all (NULL offsets) is the same as empty histories.
    for (int s = 0; s <= b.n; s++) b.offsets[s] = 0;
    int32_t *t2 = xmalloc(64 * sizeof *t2);
    float *l2 = xmalloc(64 * sizeof *l2);
    run_op(ctx, &b, tok, lp);
    ops_sample_rows(ctx, t2, l2, b.logits, b.params, NULL, NULL, 64, b.n_rows, b.V, 0);
    CHECK(memcmp(tok, t2, 64 * sizeof *t2) == 0, "NULL history differs from empty histories");
    free(t2);
    free(l2);
    free(tok);
    free(lp);
    batch_free(&b);
}

int main(void) {
    OpsCtx *ctx;
    char err[256];
    if (ops_create(&ctx, OPS_BACKEND_CPU, 0, err, sizeof err) != 0) {
        fprintf(stderr, "cpu backend: %s\n", err);
        return 1;
    }
    test_grid(ctx);
    test_edges(ctx);
    test_bad_row_and_independence(ctx);
    test_masks(ctx);
    ops_destroy(ctx);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all sampler op checks passed\n");
    return 0;
}
