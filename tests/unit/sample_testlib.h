// tests/unit/sample_testlib.h — what the tests of ops_sample_rows share (test_rollout_sampler_ops.c: CPU op vs
// the host sampler; test_cuda_sample.c: CUDA op vs CPU op): a seeded generator, logits rows of several shapes
// (smooth, bf16-quantised and coarse-grid ones full of ties, peaked, flat, one big tie, rows with -inf, rows
// where half the logits are +0 or -0: one value to a comparison, two bit patterns to a radix search), random
// histories with repeats and out-of-range ids, and the grid of sampling parameters the brief asks for.
// Header-only (static functions): every test file is its own executable.
#ifndef TANDEM_TESTS_SAMPLE_TESTLIB_H
#define TANDEM_TESTS_SAMPLE_TESTLIB_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kernels/ops.h"

static uint64_t st_rng = 0x2545F4914F6CDD1Dull;
static inline uint64_t st_next(void) { // xorshift64*
    st_rng ^= st_rng >> 12;
    st_rng ^= st_rng << 25;
    st_rng ^= st_rng >> 27;
    return st_rng * 0x2545F4914F6CDD1Dull;
}
static inline double st_unit(void) { return (double)(st_next() >> 11) / 9007199254740992.0; } // [0, 1)
static inline int st_int(int lo, int hi) { return lo + (int)(st_next() % (uint64_t)(hi - lo)); } // [lo, hi)
static inline double st_gauss(void) {
    const double a = st_unit() + 1e-300, b = st_unit();
    return sqrt(-2.0 * log(a)) * cos(6.283185307179586 * b);
}

// fp32 -> the nearest bf16 value (round to nearest even), kept as a float.
static inline float st_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7f800000u) != 0x7f800000u) b += 0x7fffu + ((b >> 16) & 1u);
    b &= 0xffff0000u;
    memcpy(&f, &b, 4);
    return f;
}

enum { ST_SMOOTH, ST_BF16, ST_GRID, ST_PEAKED, ST_FLAT, ST_ONE_TIE, ST_NEG_INF, ST_ZEROS, ST_KINDS };
static const char *const st_kind_name[ST_KINDS] = {"smooth", "bf16",     "grid",    "peaked",
                                                   "flat",   "one-tie",  "some-inf", "signed-zeros"};

// One row of V logits of the given kind. Every value is bf16-exact when `bf16` is set (the CUDA op reads bf16).
static inline void st_make_row(float *row, int V, int kind, int bf16) {
    const double scale = 0.5 + 4.0 * st_unit();
    for (int i = 0; i < V; i++) {
        double v;
        switch (kind) {
        case ST_SMOOTH: v = scale * st_gauss(); break;
        case ST_BF16: v = st_bf16((float)(3.0 * scale * st_gauss())); break;
        case ST_GRID: v = floor(2.0 * scale * st_gauss()) * 0.5; break;        // half-integers: big tie groups
        case ST_PEAKED: v = st_gauss() + (st_unit() < 0.002 ? 12.0 + 4.0 * st_unit() : 0.0); break;
        case ST_FLAT: v = 0.01 * st_gauss(); break;
        case ST_ONE_TIE: v = st_unit() < 0.8 ? 1.5 : -2.0 + st_gauss(); break;
        case ST_NEG_INF: v = st_unit() < 0.3 ? -INFINITY : scale * st_gauss(); break;
        default: v = st_unit() < 0.5 ? (st_unit() < 0.5 ? -0.0 : 0.0) : 0.5 * st_gauss(); break;
        }
        row[i] = bf16 ? st_bf16((float)v) : (float)v;
    }
    if (kind == ST_NEG_INF) row[st_int(0, V)] = bf16 ? st_bf16(1.0f) : 1.0f; // at least one finite logit
}

// A history of up to max_len ids: repeats (ids drawn from a small pool) and, now and then, ids outside [0, V).
static inline int st_make_history(int32_t *h, int max_len, int V) {
    const int n = st_int(0, max_len + 1);
    int32_t pool[16];
    for (int i = 0; i < 16; i++) pool[i] = st_int(0, V);
    for (int i = 0; i < n; i++) {
        const double r = st_unit();
        h[i] = r < 0.03 ? -1 - st_int(0, 3) : r < 0.06 ? V + st_int(0, 3) : pool[st_int(0, 16)];
    }
    return n;
}

// A mask for a sample reading `row` (V logits): *mode OPS_SAMPLE_MASK_ALLOW with 1..max_len random ids, or
// OPS_SAMPLE_MASK_BAN with the row's 1..max_len largest logits (so that the ban changes the draw) and random ids;
// either way with repeats and, now and then, ids outside [0, V). Returns the number of ids written to ids.
static inline int st_make_mask(int32_t *ids, int max_len, const float *row, int V, int32_t *mode) {
    const int n = st_int(1, max_len + 1);
    *mode = st_unit() < 0.5 ? OPS_SAMPLE_MASK_ALLOW : OPS_SAMPLE_MASK_BAN;
    int k = 0;
    if (*mode == OPS_SAMPLE_MASK_BAN) {
        for (; k < n && k < V; k++) { // the k-th largest not yet banned (ties: lowest id)
            int best = -1;
            for (int i = 0; i < V; i++) {
                int taken = 0;
                for (int j = 0; j < k && !taken; j++) taken = ids[j] == i;
                if (!taken && (best < 0 || row[i] > row[best])) best = i;
            }
            ids[k] = best;
        }
    }
    for (; k < 2 * n; k++) {
        const double r = st_unit();
        ids[k] = r < 0.05 ? -1 - st_int(0, 3) : r < 0.1 ? V + st_int(0, 3) : r < 0.3 && k > 0 ? ids[st_int(0, k)]
                                                                                        : st_int(0, V);
    }
    return k;
}

// The parameter grid: greedy and T in {0.3, 1, 1.7}, top_k {0, 1, 5, 50}, top_p {1, 0.9, 0.3}, min_p {0, 0.1},
// repetition penalty {1, 1.3}: 4 * 4 * 3 * 2 * 2 = 192 combinations, numbered 0..ST_N_COMBOS-1.
enum { ST_N_COMBOS = 192 };
static inline void st_combo(int c, OpsSampleParams *p) {
    static const float temps[4] = {0.0f, 0.3f, 1.0f, 1.7f};
    static const int ks[4] = {0, 1, 5, 50};
    static const float tps[3] = {1.0f, 0.9f, 0.3f};
    memset(p, 0, sizeof *p);
    p->temperature = temps[c % 4];
    c /= 4;
    p->top_k = ks[c % 4];
    c /= 4;
    p->top_p = tps[c % 3];
    c /= 3;
    p->min_p = c % 2 ? 0.1f : 0.0f;
    c /= 2;
    p->repetition_penalty = c % 2 ? 1.3f : 1.0f;
}

static inline void st_print_params(FILE *f, const OpsSampleParams *p) {
    fprintf(f, "T=%g top_k=%d top_p=%g min_p=%g penalty=%g u=%.17g", p->temperature, p->top_k, p->top_p, p->min_p,
            p->repetition_penalty, p->u);
}

#endif
