// bench/bench_util.h — the small helpers every C benchmark uses: a monotonic clock and a "1,2,4" list of sizes.
#ifndef TANDEM_BENCH_UTIL_H
#define TANDEM_BENCH_UTIL_H

#include <stdlib.h>
#include <time.h>

// Seconds on the monotonic clock (differences only).
static inline double bench_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// "1,2,4" → out[0..n): each in 1..65536, at most max of them. Returns n, or -1 on anything else.
static inline int bench_parse_list(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 65536) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

#endif
