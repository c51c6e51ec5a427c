// tests/unit/kernels_testlib.h — helpers shared by the kernel tests (test_kernels_*.c): a seeded random
// generator, tolerance checks that print the worst element, and a central finite-difference gradient.
// Header-only (static functions) because every test file is its own executable.
#ifndef TANDEM_TESTS_KERNELS_TESTLIB_H
#define TANDEM_TESTS_KERNELS_TESTLIB_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int kt_failures = 0;

#define KT_CHECK(cond, ...)                                                                                  \
    do {                                                                                                     \
        if (!(cond)) {                                                                                       \
            kt_failures++;                                                                                   \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                             \
            fprintf(stderr, __VA_ARGS__);                                                                    \
            fputc('\n', stderr);                                                                             \
        }                                                                                                    \
    } while (0)

// xorshift64*: deterministic across platforms, so a failure reproduces.
static uint64_t kt_rng_state = 0x9E3779B97F4A7C15ull;
static inline void kt_seed(uint64_t s) { kt_rng_state = s ? s : 1; }
static inline uint64_t kt_next(void) {
    kt_rng_state ^= kt_rng_state >> 12;
    kt_rng_state ^= kt_rng_state << 25;
    kt_rng_state ^= kt_rng_state >> 27;
    return kt_rng_state * 0x2545F4914F6CDD1Dull;
}
// Uniform in [-1, 1).
static inline double kt_uniform(void) { return (double)(kt_next() >> 11) * (2.0 / 9007199254740992.0) - 1.0; }
static inline int kt_randint(int lo, int hi) { return lo + (int)(kt_next() % (uint64_t)(hi - lo)); } // [lo, hi)
// Round-to-nearest-even to bf16, kept in an fp32: values both backends hold exactly (CUDA stores bf16).
static inline float kt_round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline void kt_fill(float *x, size_t n, double scale) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(scale * kt_uniform());
}

static inline float *kt_falloc(size_t n) {
    float *p = calloc(n ? n : 1, sizeof(float));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}
static inline double *kt_dalloc(size_t n) {
    double *p = calloc(n ? n : 1, sizeof(double));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}
static inline double *kt_to_double(const float *x, size_t n) {
    double *d = kt_dalloc(n);
    for (size_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

// Passes when every |got - want| <= atol + rtol * |want|; NaN always fails. Prints the worst element and the
// number of failures; returns 1 on pass.
static inline int kt_close_abs(const char *what, const float *got, const double *want, size_t n, double rtol,
                               double atol) {
    size_t worst = 0, bad = 0;
    double worst_excess = -1.0;
    for (size_t i = 0; i < n; i++) {
        const double err = fabs((double)got[i] - want[i]);
        const double lim = atol + rtol * fabs(want[i]);
        if (!(err <= lim)) bad++;
        const double excess = isnan(err) ? INFINITY : err - lim;
        if (excess > worst_excess) { worst_excess = excess; worst = i; }
    }
    if (bad) {
        kt_failures++;
        fprintf(stderr, "FAIL %s: %zu of %zu elements out of tolerance (rtol %g, atol %g); worst [%zu] got %.9g want %.9g\n",
                what, bad, n, rtol, atol, worst, n ? got[worst] : 0.0, n ? want[worst] : 0.0);
        return 0;
    }
    return 1;
}

static inline double kt_max_abs(const double *x, size_t n) {
    double m = 0.0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

// As kt_close_abs with atol = atol_rel * max|want|: a tolerance relative to the tensor's scale, so elements
// near zero are held to an absolute, not a relative, bound.
static inline int kt_close(const char *what, const float *got, const double *want, size_t n, double rtol,
                           double atol_rel) {
    return kt_close_abs(what, got, want, n, rtol, atol_rel * kt_max_abs(want, n));
}

// Central finite difference of a scalar function of a double vector: grad[i] = (f(x + h e_i) - f(x - h e_i)) / 2h.
// In double with h = 1e-6 (inputs are O(1)) the error is ~1e-10 (rounding eps/h plus h^2 truncation), far
// below the fp32 kernels' tolerance, so the finite difference is a faithful reference gradient.
typedef double (*kt_scalar_fn)(const double *x, void *ctx);
static inline void kt_fd_grad(kt_scalar_fn f, double *x, size_t n, void *ctx, double *grad) {
    const double h = 1e-6;
    for (size_t i = 0; i < n; i++) {
        const double x0 = x[i];
        x[i] = x0 + h;
        const double fp = f(x, ctx);
        x[i] = x0 - h;
        const double fm = f(x, ctx);
        x[i] = x0;
        grad[i] = (fp - fm) / (2.0 * h);
    }
}

static inline double kt_dot(const double *a, const double *b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline int kt_finish(const char *name) {
    if (kt_failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", name, kt_failures);
        return 1;
    }
    printf("%s: all checks passed\n", name);
    return 0;
}

#endif
