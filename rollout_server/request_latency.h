// rollout_server/request_latency.h — latency histograms of completions (time to first token, inter-token,
// end to end), bucketed at vLLM's bounds so that /metrics can publish them under vLLM's names.
// The engine thread observes into its own EngineStats (one clock read per token event); /metrics sums engines.
#ifndef TANDEM_ROLLOUT_REQUEST_LATENCY_H
#define TANDEM_ROLLOUT_REQUEST_LATENCY_H

#include <stdint.h>

typedef enum {
    LATENCY_TTFT = 0, // submission to a completion's first token
    LATENCY_ITL,      // one token of a completion to its next
    LATENCY_E2E,      // submission to a completion's finish
    LATENCY_KINDS
} LatencyKind;

#define LATENCY_MAX_BOUNDS 24

// Per-bucket (not cumulative) counts: bucket b counts observations in (bound[b-1], bound[b]]; the slot after the
// last bound counts those above it (+Inf). Cumulating is left to the reader, so an observation costs one search.
typedef struct {
    int64_t buckets[LATENCY_MAX_BOUNDS + 1];
    int64_t count;
    double sum;
} LatencyHist;

// The upper bounds (seconds, ascending) of kind's buckets; *n gets their number (<= LATENCY_MAX_BOUNDS).
const double *latency_bounds(LatencyKind kind, int *n);
void latency_observe(LatencyHist *h, LatencyKind kind, double seconds);
// Adds src's counts and sum into dst (engines of a group).
void latency_add(LatencyHist *dst, const LatencyHist *src);
// CLOCK_MONOTONIC in seconds: the one clock every latency timestamp is read from.
double latency_clock(void);

#endif
