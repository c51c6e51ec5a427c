// tests/unit/kernels_testlib.h — helpers shared by the kernel tests (test_kernels_*.c): a seeded random
// generator, bf16 rounding, allocation, and a central finite-difference gradient (the checks, tolerance checks
// included, are check_macros.h's).
// Header-only (static functions) because every test file is its own executable.
#ifndef TANDEM_TESTS_KERNELS_TESTLIB_H
#define TANDEM_TESTS_KERNELS_TESTLIB_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"

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
// splitmix64 over a stream of the caller's: the generator of the CUDA-vs-CPU comparisons (test_cuda_attention.c,
// test_cuda_vs_cpu.c), whose cases keep their values.
static inline uint64_t kt_splitmix_next(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// A float in [lo, hi) from the top 24 bits of the random word `bits`.
static inline float kt_uniform_in(uint64_t bits, float lo, float hi) {
    return lo + (hi - lo) * (float)((bits >> 40) * (1.0 / 16777216.0));
}
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

#endif
