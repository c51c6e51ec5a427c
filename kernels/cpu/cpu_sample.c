// kernels/cpu/cpu_sample.c — the CPU twin of ops_sample_rows and the host reference of the rollout server's
// sampling semantics (kernels/ops.h states them; vLLM's order, which TRL's GRPO generation runs on): the next token
// of each sample from one fp32 logits row, organised the way the CUDA kernel is: every filter ends up as a cut on
// the penalised, temperature-scaled logit x — min-p at a value t0, top-k at the k-th largest value, top-p at a
// value xt plus an id inside xt's ties — and the draw walks the kept tokens in id order:
//   kept(i) = x[i] > xt  ||  (x[i] == xt && i <= id_cut).
//
// The arithmetic is pinned down (x in float; weights w = exp(x - max x) and every sum in double, always in the same
// order), so a token follows from its row, parameters and uniform alone; the cuts only restate the filters
// (tests/unit/test_rollout_sampler_ops.c holds this file to the semantics written out plainly, and the CUDA test
// holds the kernel to this file).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_parallel.h"

typedef struct {
    float v;
    int32_t id;
} Cand;

// Per-thread scratch for rows of V logits.
typedef struct {
    float *x;        // (V) penalised, temperature-scaled logits
    double *w;       // (V) exp(x - max x)
    float *sel;      // (V) top-k selection
    Cand *cand;      // (V) top-p candidates
    uint32_t *seen;  // (V / 32 + 1) bitmap: history ids already penalised, then the mask's ids
} Scratch;

static void scratch_free(Scratch *s) {
    free(s->x);
    free(s->w);
    free(s->sel);
    free(s->cand);
    free(s->seen);
}

static int scratch_alloc(Scratch *s, int V) {
    s->x = malloc((size_t)V * sizeof *s->x);
    s->w = malloc((size_t)V * sizeof *s->w);
    s->sel = malloc((size_t)V * sizeof *s->sel);
    s->cand = malloc((size_t)V * sizeof *s->cand);
    s->seen = calloc((size_t)V / 32 + 1, sizeof *s->seen);
    return s->x && s->w && s->sel && s->cand && s->seen ? 0 : -1;
}

// Floats as unsigned keys in the same order (the sign flips the rest): the cuts are searched over these.
static uint32_t float_key(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
static float key_float(uint32_t k) {
    uint32_t b = (k & 0x80000000u) ? k & 0x7fffffffu : ~k;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

// Does a token with scaled logit t survive min-p (and underflow)? It does when w = exp(t - xm) > 0 and, with
// min-p on, w >= min_p. Monotone in t, so the survivors are exactly {x >= t0}.
static int survives(float t, double xm, float min_p) {
    const double w = exp((double)t - xm);
    return w > 0.0 && (!(min_p > 0.0f) || w >= min_p);
}

// The smallest float t0 that survives, by bisection over the float keys in (-inf, xm]; 0 when nothing does
// (every logit -inf, or min_p > 1).
static int lowest_survivor(double xm, float min_p, float *t0) {
    if (!survives((float)xm, xm, min_p)) return 0;
    uint32_t lo = float_key(-INFINITY), hi = float_key((float)xm); // survives(lo) is false, survives(hi) true
    while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (survives(key_float(mid), xm, min_p)) hi = mid;
        else lo = mid;
    }
    *t0 = key_float(hi);
    return 1;
}

// logsumexp of logits * inv_t over V entries, in double.
static double row_lse(const float *logits, int V, float inv_t) {
    float m = -INFINITY;
    for (int i = 0; i < V; i++) {
        float z = logits[i] * inv_t;
        if (z > m) m = z;
    }
    if (m == -INFINITY) return -INFINITY;
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += exp((double)(logits[i] * inv_t) - m);
    return m + log(sum);
}

// The k-th largest of a[0..n) (1-based k <= n) by quickselect; a is reordered.
static float kth_largest(float *a, int n, int k) {
    int lo = 0, hi = n - 1, target = k - 1;
    while (lo < hi) {
        float pivot = a[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                float t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (target <= j) hi = j;
        else if (target >= i) lo = i;
        else return a[target];
    }
    return a[lo];
}

static int cand_cmp(const void *pa, const void *pb) {
    const Cand *a = pa, *b = pb;
    if (a->v != b->v) return a->v > b->v ? -1 : 1;
    return a->id < b->id ? -1 : (a->id > b->id);
}

// The top-p cut among the survivors {x >= x_lo}: the kept tokens are the first ones in (x desc, id asc) order
// while the mass ranked above is below top_p * total. Sets (*xt, *id_cut) to the last kept token. Only tokens
// above a weight floor that already holds top_p of the mass are sorted (the floor starts at 1e-4 of the top
// weight and is lowered 10^4-fold until it does).
static void top_p_cut(Scratch *s, int V, float x_lo, float top_p, float *xt, int *id_cut) {
    const float *x = s->x;
    const double *w = s->w;
    double total = 0.0;
    for (int i = 0; i < V; i++)
        if (x[i] >= x_lo) total += w[i];
    const double need = top_p * total;
    int n = 0;
    double floor_w = 1e-4;
    for (;;) {
        double mass = 0.0;
        n = 0;
        for (int i = 0; i < V; i++) {
            if (!(x[i] >= x_lo) || w[i] < floor_w) continue;
            s->cand[n++] = (Cand){x[i], i};
            mass += w[i];
        }
        if (mass >= need || floor_w == 0.0) break;
        floor_w = floor_w < 1e-200 ? 0.0 : floor_w * 1e-4;
    }
    if (n == 0) return;
    qsort(s->cand, (size_t)n, sizeof *s->cand, cand_cmp);
    double above = 0.0;
    int keep = 0;
    while (keep < n && (keep == 0 || above < need)) above += w[s->cand[keep++].id];
    *xt = s->cand[keep - 1].v;
    *id_cut = s->cand[keep - 1].id;
}

// The mask of p on the penalised logits x (V): each forbidden id's logit becomes -inf (the bitmap is left clear).
static void apply_mask(Scratch *s, float *x, int V, const OpsSampleParams *p) {
    const int32_t *ids = p->n_mask > 0 ? p->mask : NULL;
    const int n = ids ? p->n_mask : 0;
    if (p->mask_mode == OPS_SAMPLE_MASK_BAN) {
        for (int k = 0; k < n; k++)
            if (ids[k] >= 0 && ids[k] < V) x[ids[k]] = -INFINITY;
        return;
    }
    for (int k = 0; k < n; k++)
        if (ids[k] >= 0 && ids[k] < V) s->seen[ids[k] >> 5] |= 1u << (ids[k] & 31);
    for (int i = 0; i < V; i++)
        if (!(s->seen[i >> 5] >> (i & 31) & 1u)) x[i] = -INFINITY;
    memset(s->seen, 0, ((size_t)V / 32 + 1) * sizeof *s->seen);
}

// One sample: token and logprob of params p over the logits row `logits` (V) with history hist (nh).
static void sample_one(Scratch *s, const float *logits, int V, const OpsSampleParams *p, const int32_t *hist, int nh,
                       int32_t *tok_out, float *lp_out) {
    const int greedy = p->temperature < OPS_SAMPLE_GREEDY_BELOW;
    const float inv_t = greedy ? 1.0f : 1.0f / p->temperature;
    float *x = s->x;
    double *w = s->w;
    memcpy(x, logits, (size_t)V * sizeof *x);
    const float pen = p->repetition_penalty;
    const int penalised = pen != 1.0f && nh > 0;
    if (penalised) {
        for (int h = 0; h < nh; h++) {
            const int32_t t = hist[h];
            if (t < 0 || t >= V || (s->seen[t >> 5] >> (t & 31) & 1u)) continue;
            s->seen[t >> 5] |= 1u << (t & 31);
            x[t] = x[t] > 0 ? x[t] / pen : x[t] * pen;
        }
        memset(s->seen, 0, ((size_t)V / 32 + 1) * sizeof *s->seen);
    }
    const int masked = p->mask_mode == OPS_SAMPLE_MASK_BAN || p->mask_mode == OPS_SAMPLE_MASK_ALLOW;
    if (masked) apply_mask(s, x, V, p);
    double lse = NAN;
    int32_t tok = 0;
    if (greedy) {
        for (int i = 1; i < V; i++)
            if (x[i] > x[tok]) tok = i;
    } else {
        float xm = -INFINITY;
        for (int i = 0; i < V; i++) {
            x[i] *= inv_t;
            if (x[i] > xm) xm = x[i];
        }
        double all = 0.0;
        for (int i = 0; i < V; i++) all += w[i] = xm == -INFINITY ? 0.0 : exp((double)x[i] - xm);
        if (!penalised && !masked) lse = xm + log(all); // x is exactly logits / T: the reported distribution's
                                                        // normaliser
        float t0;
        if (lowest_survivor(xm, p->min_p, &t0)) {
            float x_lo = t0;
            if (p->top_k > 0 && p->top_k < V) {
                int n = 0;
                for (int i = 0; i < V; i++)
                    if (x[i] >= t0) s->sel[n++] = x[i];
                if (n > p->top_k) x_lo = kth_largest(s->sel, n, p->top_k);
            }
            float xt = x_lo;
            int id_cut = V - 1;
            if (p->top_p < 1.0f) top_p_cut(s, V, x_lo, p->top_p, &xt, &id_cut);
            double total = 0.0;
            for (int i = 0; i < V; i++)
                if (x[i] > xt || (x[i] == xt && i <= id_cut)) total += w[i];
            const double target = p->u * total;
            double cum = 0.0;
            tok = -1;
            for (int i = 0; i < V; i++) {
                if (!(x[i] > xt || (x[i] == xt && i <= id_cut))) continue;
                tok = i; // the last kept id is the answer when rounding leaves cum just short of target
                cum += w[i];
                if (cum > target) break;
            }
            if (tok < 0) tok = 0;
        }
    }
    if (isnan(lse)) lse = row_lse(logits, V, inv_t);
    *tok_out = tok;
    *lp_out = (float)((double)(logits[tok] * inv_t) - lse);
}

int cpu_sample_rows(int32_t *tokens, float *logprobs, const float *logits, const OpsSampleParams *params,
                    const int32_t *history, const int32_t *history_offsets, int n, int n_rows, int V, int n_history) {
    int failed = 0;
    // Samples are independent and each is computed by one thread in a fixed order: the thread count does not
    // change any result. Every thread enters the loop (a worksharing loop must be met by all of them) and one
    // without scratch reports the failure.
    CPU_OMP("omp parallel if (n > 1 && (long)n * V >= 65536) reduction(|:failed)")
    {
        Scratch sc;
        const int have = scratch_alloc(&sc, V) == 0;
        CPU_OMP("omp for schedule(dynamic, 1)")
        for (int s = 0; s < n; s++) {
            const OpsSampleParams *p = &params[s];
            if (p->logits_row < 0 || p->logits_row >= n_rows) {
                tokens[s] = -1;
                logprobs[s] = NAN;
                continue;
            }
            if (!have) {
                failed = 1;
                continue;
            }
            int h0 = 0, h1 = 0;
            if (history_offsets) {
                h0 = history_offsets[s] < 0 ? 0 : history_offsets[s] > n_history ? n_history : history_offsets[s];
                h1 = history_offsets[s + 1] < h0 ? h0 : history_offsets[s + 1] > n_history ? n_history
                                                                                          : history_offsets[s + 1];
            }
            sample_one(&sc, logits + (size_t)p->logits_row * V, V, p, h1 > h0 ? history + h0 : NULL, h1 - h0,
                       &tokens[s], &logprobs[s]);
        }
        scratch_free(&sc);
    }
    return failed ? -1 : 0;
}
