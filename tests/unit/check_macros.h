// tests/unit/check_macros.h — the checks of every C unit test. Include it in the test's .c file, directly or through
// a topic testlib that includes it (each test is its own executable, so the failure count is a static of that file):
//   CHECK(cond) or CHECK(cond, "format", args...)     counts a failure, prints where and why, goes on;
//   REQUIRE(cond) or REQUIRE(cond, "format", ...)     prints the same and ends the test (exit 1);
//   CHECK_EQ(got, want)                               integers: prints both;
//   CHECK_NEAR(got, want, tol)                        one float: |got - want| <= tol (NaN fails); prints both;
//   check_close_abs / check_close                     float arrays against a double reference: prints how many
//                                                     are out of tolerance and the worst one's index, got, want;
//   check_exit_code(name)                             the test's exit code, after a line that says how it went.
// A failure line starts with "FAIL file:line:" (REQUIRE: "FATAL file:line:").
#ifndef TANDEM_TESTS_CHECK_MACROS_H
#define TANDEM_TESTS_CHECK_MACROS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int failures = 0;   // checks failed so far in this process

// CHECK and REQUIRE take an optional printf message (at most 31 arguments after the condition): counting the
// arguments picks the bare form or the one with a message.
#define CHECK_FORM_(a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,  \
                    a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, form, ...)                                  \
    form
#define CHECK_PICK_(bare, with_message, ...)                                                                           \
    CHECK_FORM_(__VA_ARGS__, with_message, with_message, with_message, with_message, with_message, with_message,       \
                with_message, with_message, with_message, with_message, with_message, with_message, with_message,      \
                with_message, with_message, with_message, with_message, with_message, with_message, with_message,      \
                with_message, with_message, with_message, with_message, with_message, with_message, with_message,      \
                with_message, with_message, with_message, with_message, bare, unused)

#define CHECK_BARE_(cond)                                                                                              \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            failures++;                                                                                                \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                                            \
        }                                                                                                              \
    } while (0)
#define CHECK_WITH_MESSAGE_(cond, ...)                                                                                 \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            failures++;                                                                                                \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                            \
            fprintf(stderr, __VA_ARGS__);                                                                              \
            fputc('\n', stderr);                                                                                       \
        }                                                                                                              \
    } while (0)
#define CHECK(...) CHECK_PICK_(CHECK_BARE_, CHECK_WITH_MESSAGE_, __VA_ARGS__)(__VA_ARGS__)

#define REQUIRE_BARE_(cond)                                                                                            \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "FATAL %s:%d: %s\n", __FILE__, __LINE__, #cond);                                           \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)
#define REQUIRE_WITH_MESSAGE_(cond, ...)                                                                               \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "FATAL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                           \
            fprintf(stderr, __VA_ARGS__);                                                                              \
            fputc('\n', stderr);                                                                                       \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)
#define REQUIRE(...) CHECK_PICK_(REQUIRE_BARE_, REQUIRE_WITH_MESSAGE_, __VA_ARGS__)(__VA_ARGS__)

// Integers of any type, compared as long long (a 64-bit unsigned value keeps its bits).
#define CHECK_EQ(got, want)                                                                                            \
    do {                                                                                                               \
        const long long got_ = (long long)(got), want_ = (long long)(want);                                            \
        if (got_ != want_) {                                                                                           \
            failures++;                                                                                                \
            fprintf(stderr, "FAIL %s:%d: %s is %lld, want %lld (%s)\n", __FILE__, __LINE__, #got, got_, want_, #want); \
        }                                                                                                              \
    } while (0)

#define CHECK_NEAR(got, want, tol)                                                                                     \
    do {                                                                                                               \
        const double got_ = (got), want_ = (want), tol_ = (tol);                                                       \
        if (!(fabs(got_ - want_) <= tol_)) {                                                                           \
            failures++;                                                                                                \
            fprintf(stderr, "FAIL %s:%d: %s is %.9g, want %.9g (tolerance %g)\n", __FILE__, __LINE__, #got, got_,      \
                    want_, tol_);                                                                                      \
        }                                                                                                              \
    } while (0)

static inline double check_max_abs(const double *x, size_t n) {
    double m = 0.0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

// Passes when every |got[i] - want[i]| <= atol + rtol * |want[i]|; NaN always fails. On a failure prints `what`,
// how many elements are out, and the worst one (index, got, want). Returns 1 on pass.
static inline int check_close_abs(const char *what, const float *got, const double *want, size_t n, double rtol,
                                  double atol) {
    size_t worst = 0, bad = 0;
    double worst_excess = -1.0;
    for (size_t i = 0; i < n; i++) {
        const double err = fabs((double)got[i] - want[i]);
        const double lim = atol + rtol * fabs(want[i]);
        if (!(err <= lim)) bad++;
        const double excess = isnan(err) ? INFINITY : err - lim;
        if (excess > worst_excess) {
            worst_excess = excess;
            worst = i;
        }
    }
    if (bad) {
        failures++;
        fprintf(stderr, "FAIL %s: %zu of %zu elements out of tolerance (rtol %g, atol %g); worst [%zu] got %.9g"
                " want %.9g\n",
                what, bad, n, rtol, atol, worst, n ? got[worst] : 0.0, n ? want[worst] : 0.0);
        return 0;
    }
    return 1;
}

// As check_close_abs with atol = atol_rel * max|want|: a tolerance relative to the tensor's scale, so elements near
// zero are held to an absolute, not a relative, bound.
static inline int check_close(const char *what, const float *got, const double *want, size_t n, double rtol,
                              double atol_rel) {
    return check_close_abs(what, got, want, n, rtol, atol_rel * check_max_abs(want, n));
}

// 0 after "<test_name>: all checks passed" on stdout when nothing failed; else 1 after "<test_name>: N check(s)
// failed" on stderr. main returns it.
static inline int check_exit_code(const char *test_name) {
    if (failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", test_name, failures);
        return 1;
    }
    printf("%s: all checks passed\n", test_name);
    return 0;
}

#endif
