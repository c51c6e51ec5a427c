// test_rollout_sampler.c — the rollout server's sampling as the engine runs it (ops_sample_rows on the CPU backend,
// whose host reference is kernels/cpu/cpu_sample.c, drawing with sampler_uniform; top logprobs from
// sampler_logprob) against naive implementations written here:
//   - reported logprobs are exactly log_softmax(logits / T) of the raw logits (T = 1 when greedy), before any
//     penalty or filter; top logprobs are the best ids of that distribution, best first, and sampler_logprob
//     gives the op's logprob;
//   - greedy = argmax of the repetition-penalised logits (HF semantics: positive / penalty, negative * penalty,
//     each distinct history token once);
//   - every filter (temperature, min-p, top-k with ties, top-p, and all together): sampled tokens always lie in
//     the naive filter's support, and over many draws the empirical frequencies match the naive filtered
//     softmax (within 5 standard errors);
//   - randomness is a pure function of (stream, position): reproducible, and distinct streams differ.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "rollout_server/sampler.h"
#include "tests/unit/check_macros.h"

static uint64_t lcg = 99;
static double frand(void) {
    lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(lcg >> 11) / 9007199254740992.0;
}

static OpsCtx *ctx; // the CPU backend

// n draws from one row of V logits under p through ops_sample_rows, as the engine hands them over: draw i uses the
// uniform of (stream, pos0 + i) and carries the history hist (nh ids). tok, lp (n).
static void sample_n(const float *logits, int V, const SamplingParams *p, const int32_t *hist, int nh,
                     uint64_t stream, uint64_t pos0, int n, int32_t *tok, float *lp) {
    OpsSampleParams *par = malloc((size_t)n * sizeof *par);
    int32_t *off = malloc((size_t)(n + 1) * sizeof *off);
    int32_t *h = malloc((size_t)n * nh * sizeof *h + sizeof *h);
    if (!par || !off || !h) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    for (int i = 0; i < n; i++) {
        par[i] = (OpsSampleParams){.u = sampler_uniform(stream, pos0 + (uint64_t)i),
                                   .temperature = p->temperature,
                                   .top_p = p->top_p,
                                   .min_p = p->min_p,
                                   .repetition_penalty = p->repetition_penalty,
                                   .top_k = p->top_k,
                                   .logits_row = 0};
        off[i] = i * nh;
        if (nh > 0) memcpy(h + (size_t)i * nh, hist, (size_t)nh * sizeof *hist);
    }
    off[n] = n * nh;
    ops_sample_rows(ctx, tok, lp, logits, par, nh > 0 ? h : NULL, nh > 0 ? off : NULL, n, 1, V, n * nh);
    CHECK(ops_status(ctx) == 0, "ops_sample_rows: %s", ops_error(ctx));
    ops_clear_error(ctx);
    free(par);
    free(off);
    free(h);
}

// One draw: the token of (stream, pos) and its logprob.
static int32_t sample1(const float *logits, int V, const SamplingParams *p, const int32_t *hist, int nh,
                       uint64_t stream, uint64_t pos, float *lp) {
    int32_t tok;
    sample_n(logits, V, p, hist, nh, stream, pos, 1, &tok, lp);
    return tok;
}

static void sampling(SamplingParams *p, float t, int top_k, float top_p, float min_p, float rep) {
    memset(p, 0, sizeof *p);
    p->n = 1;
    p->max_tokens = 1;
    p->temperature = t;
    p->top_k = top_k;
    p->top_p = top_p;
    p->min_p = min_p;
    p->repetition_penalty = rep;
}

// Naive filtered distribution (double): penalty, temperature, min-p, top-k (ties kept), top-p, each on the
// renormalised survivors of the previous one.
static void naive_probs(const float *logits, int V, const SamplingParams *p, const int32_t *hist, int nh, double *prob) {
    double *x = malloc((size_t)V * sizeof *x);
    int *alive = malloc((size_t)V * sizeof *alive);
    for (int i = 0; i < V; i++) {
        x[i] = logits[i];
        alive[i] = 1;
    }
    for (int i = 0; i < V; i++) { // repetition penalty on each distinct history id
        int in = 0;
        for (int h = 0; h < nh; h++) in |= hist[h] == i;
        if (in && p->repetition_penalty != 1.0f) {
            float xf = logits[i];
            x[i] = xf > 0 ? xf / p->repetition_penalty : xf * p->repetition_penalty;
        }
    }
    for (int i = 0; i < V; i++) x[i] = (float)((float)x[i] * (1.0f / p->temperature));
    double mx = -INFINITY;
    for (int i = 0; i < V; i++) mx = fmax(mx, x[i]);
    if (p->min_p > 0)
        for (int i = 0; i < V; i++)
            if (exp(x[i] - mx) < p->min_p) alive[i] = 0;
    if (p->top_k > 0) {
        for (int i = 0; i < V; i++) {
            if (!alive[i]) continue;
            int better = 0;
            for (int j = 0; j < V; j++) better += alive[j] && x[j] > x[i];
            if (better >= p->top_k) alive[i] = 0;
        }
    }
    if (p->top_p < 1.0f) {
        double total = 0;
        for (int i = 0; i < V; i++)
            if (alive[i]) total += exp(x[i] - mx);
        int *keep = calloc((size_t)V, sizeof *keep);
        for (int i = 0; i < V; i++) {
            if (!alive[i]) continue;
            double above = 0; // mass ranked strictly above i (value desc, id asc)
            for (int j = 0; j < V; j++)
                if (alive[j] && (x[j] > x[i] || (x[j] == x[i] && j < i))) above += exp(x[j] - mx);
            keep[i] = above < p->top_p * total;
        }
        for (int i = 0; i < V; i++) alive[i] = keep[i];
        free(keep);
    }
    double total = 0;
    for (int i = 0; i < V; i++) total += alive[i] ? exp(x[i] - mx) : 0;
    for (int i = 0; i < V; i++) prob[i] = alive[i] ? exp(x[i] - mx) / total : 0;
    free(x);
    free(alive);
}

static void test_logprobs_exact(int V) {
    float *logits = malloc((size_t)V * sizeof *logits);
    for (int i = 0; i < V; i++) logits[i] = (float)(4 * frand() - 2);
    const float temps[6] = {0.0f, 0.7f, 1.3f, 0.0f, 0.7f, 1.3f};
    for (int ti = 0; ti < 6; ti++) {
        SamplingParams p;
        // Filters and the penalty must not change the reported logprob (with and without a penalty).
        sampling(&p, temps[ti], 5, 0.8f, 0.05f, ti < 3 ? 1.4f : 1.0f);
        p.top_logprobs = 6;
        int32_t hist[3] = {1, 2, 3};
        TokenLogprob top[6];
        float lp;
        const double T = temps[ti] > 0 ? temps[ti] : 1.0;
        const float inv_t = temps[ti] > 0 ? 1.0f / temps[ti] : 1.0f;
        double m = -INFINITY, sum = 0;
        for (int i = 0; i < V; i++) m = fmax(m, logits[i] / T);
        for (int i = 0; i < V; i++) sum += exp(logits[i] / T - m);
        const double lse = m + log(sum);
        for (int pos = 0; pos < 20; pos++) {
            int32_t t = sample1(logits, V, &p, hist, 3, 7, pos, &lp);
            CHECK(fabs(lp - (logits[t] / T - lse)) < 1e-5, "T %g: logprob %g vs %g", T, lp, logits[t] / T - lse);
            // The runner's top logprobs come from sampler_logprob on the same row: one distribution for the two.
            const float host_lp = sampler_logprob(logits, V, inv_t, t, p.top_logprobs, top);
            CHECK(fabs(host_lp - lp) < 1e-6, "T %g: sampler_logprob %g vs the op's %g", T, host_lp, lp);
        }
        // Top logprobs: the 6 best of the unfiltered distribution, best first.
        for (int k = 0; k < 6; k++) {
            int rank = 0;
            for (int i = 0; i < V; i++) rank += logits[i] > logits[top[k].id] || (logits[i] == logits[top[k].id] && i < top[k].id);
            CHECK(rank == k, "top[%d] is id %d of rank %d", k, top[k].id, rank);
            CHECK(fabs(top[k].logprob - (logits[top[k].id] / T - lse)) < 1e-5, "top[%d] logprob", k);
        }
    }
    free(logits);
}

static void test_greedy_and_penalty(void) {
    float logits[6] = {1.0f, 3.0f, 2.5f, -0.5f, -0.4f, 0.0f};
    SamplingParams p;
    float lp;
    sampling(&p, 0.0f, 0, 1.0f, 0.0f, 1.0f);
    CHECK(sample1(logits, 6, &p, NULL, 0, 1, 0, &lp) == 1, "argmax");
    sampling(&p, 1e-7f, 0, 1.0f, 0.0f, 1.0f); // logits / 1e-7 would overflow: treated as greedy, logprobs at T = 1
    int all_argmax = 1;
    for (int pos = 0; pos < 50; pos++) all_argmax &= sample1(logits, 6, &p, NULL, 0, 9, pos, &lp) == 1;
    CHECK(all_argmax && fabs(lp - sampler_logprob(logits, 6, 1.0f, 1, 0, NULL)) < 1e-7, "tiny temperature is greedy");
    // Penalty 1.5 on id 1 (3 -> 2) makes id 2 (2.5) the argmax; duplicates in the history apply it once.
    int32_t hist[4] = {1, 1, 1, 4};
    sampling(&p, 0.0f, 0, 1.0f, 0.0f, 1.5f);
    CHECK(sample1(logits, 6, &p, hist, 4, 1, 0, &lp) == 2, "penalised argmax");
    CHECK(fabs(lp - sampler_logprob(logits, 6, 1.0f, 2, 0, NULL)) < 1e-7, "greedy logprob at T=1 of raw logits");
    // Negative logits are multiplied: -0.4 * 1.5 = -0.6 < -0.5, so id 0 now beats id 1.
    float neg[6] = {-0.5f, -0.4f, -3.0f, -3.0f, -3.0f, -3.0f};
    int32_t h2[1] = {1};
    CHECK(sample1(neg, 6, &p, h2, 1, 1, 0, &lp) == 0, "a negative logit is multiplied by the penalty");
    // Ties go to the lower id.
    float tie[6] = {0.5f, 2.0f, 2.0f, 1.0f, 0.0f, 0.0f};
    sampling(&p, 0.0f, 0, 1.0f, 0.0f, 1.0f);
    CHECK(sample1(tie, 6, &p, NULL, 0, 1, 0, &lp) == 1, "tie -> lower id");
}

// Draws n tokens at positions 0..n-1 and compares frequencies with the naive filtered softmax.
static void check_distribution(const float *logits, int V, const SamplingParams *p, const int32_t *hist, int nh,
                               const char *what) {
    enum { N = 100000 };
    double prob[16];
    naive_probs(logits, V, p, hist, nh, prob);
    int count[16] = {0}, outside = 0;
    int32_t *tok = malloc(N * sizeof *tok);
    float *lp = malloc(N * sizeof *lp);
    sample_n(logits, V, p, hist, nh, 1234, 0, N, tok, lp);
    for (int i = 0; i < N; i++) {
        const int32_t t = tok[i] >= 0 && tok[i] < V ? tok[i] : 0;
        outside += tok[i] != t || prob[t] == 0.0;
        count[t]++;
    }
    free(tok);
    free(lp);
    CHECK(outside == 0, "%s: %d draws outside the filtered support", what, outside);
    for (int i = 0; i < V; i++) {
        double f = (double)count[i] / N, se = sqrt(fmax(prob[i] * (1 - prob[i]), 1e-12) / N);
        CHECK(fabs(f - prob[i]) <= 5 * se + 1e-4, "%s: id %d frequency %.5f vs %.5f", what, i, f, prob[i]);
    }
}

static void test_filters(void) {
    const float logits[8] = {2.0f, 1.5f, 1.5f, 0.3f, -0.2f, -1.0f, 0.9f, -2.5f};
    const int32_t hist[3] = {0, 6, 6};
    SamplingParams p;
    sampling(&p, 1.0f, 0, 1.0f, 0.0f, 1.0f);
    check_distribution(logits, 8, &p, NULL, 0, "T=1");
    sampling(&p, 0.5f, 0, 1.0f, 0.0f, 1.0f);
    check_distribution(logits, 8, &p, NULL, 0, "T=0.5");
    sampling(&p, 1.0f, 2, 1.0f, 0.0f, 1.0f); // ids 1 and 2 tie for second place: both kept
    check_distribution(logits, 8, &p, NULL, 0, "top_k=2 with a tie");
    sampling(&p, 1.0f, 0, 0.6f, 0.0f, 1.0f);
    check_distribution(logits, 8, &p, NULL, 0, "top_p=0.6");
    sampling(&p, 1.0f, 0, 1.0f, 0.2f, 1.0f);
    check_distribution(logits, 8, &p, NULL, 0, "min_p=0.2");
    sampling(&p, 1.0f, 0, 1.0f, 0.0f, 1.8f);
    check_distribution(logits, 8, &p, hist, 3, "repetition_penalty=1.8");
    sampling(&p, 0.8f, 4, 0.9f, 0.05f, 1.3f);
    check_distribution(logits, 8, &p, hist, 3, "all filters");
    sampling(&p, 1.0f, 0, 0.01f, 0.0f, 1.0f); // tiny top_p keeps only the top token
    check_distribution(logits, 8, &p, NULL, 0, "top_p=0.01");
}

// A large vocabulary: top-p's candidate pre-selection and top-k's selection must keep exactly the naive set.
static void test_support_large(void) {
    const int V = 1000;
    int32_t tok[8000];
    float lps[8000];
    float *logits = malloc((size_t)V * sizeof *logits);
    double *prob = malloc((size_t)V * sizeof *prob);
    int *hit = calloc((size_t)V, sizeof *hit);
    for (int i = 0; i < V; i++) logits[i] = (float)(6 * frand() * frand());
    const float cfg[4][3] = {{0, 0.95f, 0}, {50, 1.0f, 0}, {200, 0.7f, 0.01f}, {0, 0.999f, 0}};
    for (int c = 0; c < 4; c++) {
        SamplingParams p;
        sampling(&p, 1.0f, (int)cfg[c][0], cfg[c][1], cfg[c][2], 1.0f);
        naive_probs(logits, V, &p, NULL, 0, prob);
        memset(hit, 0, (size_t)V * sizeof *hit);
        int outside = 0, kept = 0, missed = 0;
        sample_n(logits, V, &p, NULL, 0, 77, 0, 8000, tok, lps);
        for (int i = 0; i < 8000; i++) {
            const int32_t t = tok[i] >= 0 && tok[i] < V ? tok[i] : 0;
            outside += tok[i] != t || prob[t] == 0.0;
            hit[t] = 1;
        }
        for (int i = 0; i < V; i++) {
            kept += prob[i] > 0;
            missed += prob[i] > 1.5e-3 && !hit[i]; // expected count > 12: missing it is a bug, not chance
        }
        CHECK(outside == 0 && missed == 0 && kept > 10, "config %d: %d outside, %d likely ids never drawn (%d kept)", c,
              outside, missed, kept);
    }
    free(logits);
    free(prob);
    free(hit);
}

static void test_randomness(void) {
    double mean = 0;
    int in_range = 1;
    for (int i = 0; i < 100000; i++) {
        double u = sampler_uniform(5, (uint64_t)i);
        in_range &= u >= 0.0 && u < 1.0;
        mean += u;
    }
    mean /= 100000;
    CHECK(in_range && fabs(mean - 0.5) < 0.005, "uniform mean %g", mean);
    CHECK(sampler_uniform(42, 17) == sampler_uniform(42, 17), "a pure function of (stream, position)");
    const float logits[8] = {0.1f, 0.2f, 0.3f, 0.1f, 0.0f, 0.2f, 0.3f, 0.1f};
    SamplingParams p;
    sampling(&p, 1.0f, 0, 1.0f, 0.0f, 1.0f);
    int same_seed = 1, diff = 0;
    float lp;
    for (int pos = 0; pos < 64; pos++) {
        int32_t a = sample1(logits, 8, &p, NULL, 0, 1000, pos, &lp);
        // Interleave another stream: sampling keeps no state between calls.
        sample1(logits, 8, &p, NULL, 0, 3, pos * 7, &lp);
        int32_t b = sample1(logits, 8, &p, NULL, 0, 1000, pos, &lp);
        int32_t c = sample1(logits, 8, &p, NULL, 0, 1001, pos, &lp);
        same_seed &= a == b;
        diff += a != c;
    }
    CHECK(same_seed, "same (stream, position) gives the same token");
    CHECK(diff > 20, "streams seed and seed+1 differ (%d of 64 positions)", diff);
}

int main(void) {
    char err[256];
    if (ops_create(&ctx, OPS_BACKEND_CPU, 0, err, sizeof err) != 0) {
        fprintf(stderr, "cpu backend: %s\n", err);
        return 1;
    }
    test_logprobs_exact(50);
    test_greedy_and_penalty();
    test_filters();
    test_support_large();
    test_randomness();
    ops_destroy(ctx);
    if (failures) {
        fprintf(stderr, "test_rollout_sampler: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_rollout_sampler: all passed\n");
    return 0;
}
