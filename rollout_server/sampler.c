// rollout_server/sampler.c — host-side sampling over one fp32 logits row (see sampler.h for the semantics).
//
// Cost per call is O(V) plus a sort of the few candidates that top-k / top-p can keep: top-k finds its threshold
// by selection, and top-p first collects the tokens above a probability floor that already holds top_p of the
// mass (a token below the floor has more than top_p ranked above it, so it can never be kept).
#include "rollout_server/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float v;
    int32_t id;
} Cand;

struct Sampler {
    int V;
    float *x;        // (V) penalised, temperature-scaled logits
    double *w;       // (V) exp(x - max x); 0 marks a filtered token
    float *sel;      // (V) scratch for selection
    Cand *cand;      // (V) candidates of top-p
    uint32_t *seen;  // (V) stamp of the last call that penalised the id (repetition penalty dedupe)
    uint32_t stamp;
};

int sampler_create(Sampler **out, int V) {
    Sampler *s = calloc(1, sizeof *s);
    *out = NULL;
    if (!s) return -1;
    s->V = V;
    s->x = malloc((size_t)V * sizeof *s->x);
    s->w = malloc((size_t)V * sizeof *s->w);
    s->sel = malloc((size_t)V * sizeof *s->sel);
    s->cand = malloc((size_t)V * sizeof *s->cand);
    s->seen = calloc((size_t)V, sizeof *s->seen);
    if (!s->x || !s->w || !s->sel || !s->cand || !s->seen) {
        sampler_free(s);
        return -1;
    }
    *out = s;
    return 0;
}

void sampler_free(Sampler *s) {
    if (!s) return;
    free(s->x);
    free(s->w);
    free(s->sel);
    free(s->cand);
    free(s->seen);
    free(s);
}

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

double sampler_uniform(uint64_t stream, uint64_t pos) {
    // Two rounds of the splitmix64 finaliser over (stream, position): a counter-based generator, so any draw
    // can be recomputed from its coordinates alone.
    uint64_t h = mix64(mix64(stream + 0x9E3779B97F4A7C15ULL) ^ (pos * 0xD1B54A32D192ED03ULL + 0x8CB92BA72F3D8DD7ULL));
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
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

// The k best (value desc, id asc) of logits * inv_t as logprobs against lse, best first.
static void top_k_logprobs(const float *logits, int V, float inv_t, double lse, int k, TokenLogprob *top) {
    int n = 0;
    for (int i = 0; i < V; i++) {
        float z = logits[i] * inv_t;
        // Strictly greater than the current worst: an equal value with a larger id ranks below it.
        if (n == k && !(z > top[k - 1].logprob)) continue;
        int j = n < k ? n++ : k - 1;
        while (j > 0 && z > top[j - 1].logprob) {
            top[j] = top[j - 1];
            j--;
        }
        top[j].id = i;
        top[j].logprob = z;
    }
    for (int j = 0; j < n; j++) top[j].logprob = (float)(top[j].logprob - lse);
    for (int j = n; j < k; j++) top[j] = (TokenLogprob){-1, -INFINITY}; // fewer ids than asked for
}

float sampler_logprob(const float *logits, int V, float inv_temperature, int32_t id, int k, TokenLogprob *top) {
    double lse = row_lse(logits, V, inv_temperature);
    if (top && k > 0) top_k_logprobs(logits, V, inv_temperature, lse, k, top);
    return (float)((double)(logits[id] * inv_temperature) - lse);
}

static void apply_repetition_penalty(Sampler *s, float penalty, const int32_t *hist, int n) {
    if (++s->stamp == 0) { // wrapped: old stamps could collide with the new ones
        memset(s->seen, 0, (size_t)s->V * sizeof *s->seen);
        s->stamp = 1;
    }
    for (int i = 0; i < n; i++) {
        int32_t t = hist[i];
        if (t < 0 || t >= s->V || s->seen[t] == s->stamp) continue;
        s->seen[t] = s->stamp;
        s->x[t] = s->x[t] > 0 ? s->x[t] / penalty : s->x[t] * penalty;
    }
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

// Filters the temperature-scaled logits s->x: on entry s->w[i] = exp(x[i] - xm) (xm = max x); on return a
// filtered token has w[i] = 0. min-p, then top-k, then top-p, each over the survivors of the previous one.
static void apply_filters(Sampler *s, const SamplingParams *p) {
    const int V = s->V;
    const float *x = s->x;
    double *w = s->w;
    if (p->min_p > 0.0f) // prob_i >= min_p * prob_max  <=>  w_i >= min_p
        for (int i = 0; i < V; i++)
            if (w[i] < p->min_p) w[i] = 0.0;
    if (p->top_k > 0 && p->top_k < V) {
        int n = 0;
        for (int i = 0; i < V; i++)
            if (w[i] > 0.0) s->sel[n++] = x[i];
        if (n > p->top_k) {
            const float kth = kth_largest(s->sel, n, p->top_k);
            for (int i = 0; i < V; i++)
                if (x[i] < kth) w[i] = 0.0;
        }
    }
    if (p->top_p < 1.0f) {
        double total = 0.0;
        for (int i = 0; i < V; i++) total += w[i];
        const double need = p->top_p * total;
        // Lower the floor until the candidates above it hold at least top_p of the mass.
        int n = 0;
        double floor_w = 1e-4;
        for (;;) {
            double mass = 0.0;
            n = 0;
            for (int i = 0; i < V; i++) {
                if (w[i] == 0.0 || w[i] < floor_w) continue;
                s->cand[n++] = (Cand){x[i], i};
                mass += w[i];
            }
            if (mass >= need || floor_w == 0.0) break;
            floor_w = floor_w < 1e-200 ? 0.0 : floor_w * 1e-4;
        }
        qsort(s->cand, (size_t)n, sizeof *s->cand, cand_cmp);
        double above = 0.0;
        int keep = 0;
        while (keep < n && (keep == 0 || above < need)) above += w[s->cand[keep++].id];
        // Keep exactly the first `keep` candidates: the rest of them, and everything below the floor, go.
        for (int c = keep; c < n; c++) w[s->cand[c].id] = 0.0;
        for (int i = 0; i < V; i++)
            if (w[i] < floor_w) w[i] = 0.0;
    }
}

int32_t sampler_sample(Sampler *s, const float *logits, const SamplingParams *p, const int32_t *history,
                       int n_history, uint64_t stream, uint64_t pos, float *logprob, TokenLogprob *top) {
    const int V = s->V;
    const int greedy = p->temperature < SAMPLER_GREEDY_BELOW;
    const float inv_t = greedy ? 1.0f : 1.0f / p->temperature;
    memcpy(s->x, logits, (size_t)V * sizeof *s->x);
    const int penalised = p->repetition_penalty != 1.0f && n_history > 0;
    if (penalised) apply_repetition_penalty(s, p->repetition_penalty, history, n_history);
    double lse = NAN;
    int32_t tok = 0;
    if (greedy) {
        for (int i = 1; i < V; i++)
            if (s->x[i] > s->x[tok]) tok = i;
    } else {
        float xm = -INFINITY;
        for (int i = 0; i < V; i++) {
            s->x[i] *= inv_t;
            if (s->x[i] > xm) xm = s->x[i];
        }
        // Every logit -inf: all weights 0 (exp(-inf - -inf) would be NaN), and the draw falls back to id 0.
        double all = 0.0;
        for (int i = 0; i < V; i++) all += s->w[i] = xm == -INFINITY ? 0.0 : exp((double)s->x[i] - xm);
        // Without a penalty x is exactly logits / T: its logsumexp is the reported distribution's.
        if (!penalised) lse = xm + log(all);
        apply_filters(s, p);
        double total = 0.0;
        for (int i = 0; i < V; i++) total += s->w[i];
        const double target = sampler_uniform(stream, pos) * total;
        double cum = 0.0;
        tok = -1;
        for (int i = 0; i < V; i++) {
            if (s->w[i] == 0.0) continue;
            tok = i; // the last kept id is the answer when rounding leaves cum just short of target
            cum += s->w[i];
            if (cum > target) break;
        }
        if (tok < 0) tok = 0; // every logit was -inf: nothing to choose from but a valid id
    }
    if (isnan(lse)) lse = row_lse(logits, V, inv_t);
    *logprob = (float)((double)(logits[tok] * inv_t) - lse);
    if (top && p->top_logprobs > 0) top_k_logprobs(logits, V, inv_t, lse, p->top_logprobs, top);
    return tok;
}
