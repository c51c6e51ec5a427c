// rollout_server/request_latency.c — latency histograms at vLLM's bucket bounds (see request_latency.h).
#include "rollout_server/request_latency.h"

#include <time.h>

// vLLM's bounds (vllm/v1/metrics/loggers.py): a dashboard's histogram_quantile over our buckets reads the same.
static const double kTtft[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
                               1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double kItl[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                              0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double kE2e[] = {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
                              30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

_Static_assert(sizeof kTtft / sizeof kTtft[0] <= LATENCY_MAX_BOUNDS, "TTFT bounds exceed LATENCY_MAX_BOUNDS");
_Static_assert(sizeof kItl / sizeof kItl[0] <= LATENCY_MAX_BOUNDS, "ITL bounds exceed LATENCY_MAX_BOUNDS");
_Static_assert(sizeof kE2e / sizeof kE2e[0] <= LATENCY_MAX_BOUNDS, "e2e bounds exceed LATENCY_MAX_BOUNDS");

const double *latency_bounds(LatencyKind kind, int *n) {
    switch (kind) {
    case LATENCY_TTFT: *n = (int)(sizeof kTtft / sizeof kTtft[0]); return kTtft;
    case LATENCY_ITL: *n = (int)(sizeof kItl / sizeof kItl[0]); return kItl;
    default: *n = (int)(sizeof kE2e / sizeof kE2e[0]); return kE2e;
    }
}

void latency_observe(LatencyHist *h, LatencyKind kind, double seconds) {
    int n;
    const double *bound = latency_bounds(kind, &n);
    if (seconds < 0) seconds = 0; // one monotonic clock: only rounding can make an interval negative
    int lo = 0, hi = n; // first bound >= seconds, n when none
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (bound[mid] < seconds) lo = mid + 1;
        else hi = mid;
    }
    h->buckets[lo]++;
    h->count++;
    h->sum += seconds;
}

void latency_add(LatencyHist *dst, const LatencyHist *src) {
    for (int b = 0; b <= LATENCY_MAX_BOUNDS; b++) dst->buckets[b] += src->buckets[b];
    dst->count += src->count;
    dst->sum += src->sum;
}

double latency_clock(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}
