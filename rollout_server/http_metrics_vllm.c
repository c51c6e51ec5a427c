// rollout_server/http_metrics_vllm.c — vLLM's metric names over tandem's engine figures (see http_metrics_vllm.h).
#include "rollout_server/http_metrics_vllm.h"

#include <stdio.h>

static void family(HttpBuf *b, const char *name, const char *type, const char *help) {
    http_buf_appendf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void integer(HttpBuf *b, const char *name, const char *type, const char *help, const char *labels,
                    long long value) {
    family(b, name, type, help);
    http_buf_appendf(b, "%s{%s} %lld\n", name, labels, value);
}

// A histogram from per-bucket counts: Prometheus wants each bucket cumulative, then +Inf, sum and count.
static void histogram(HttpBuf *b, const char *name, const char *help, const char *labels, const LatencyHist *h,
                      LatencyKind kind) {
    int n;
    const double *bound = latency_bounds(kind, &n);
    family(b, name, "histogram", help);
    long long cumulative = 0;
    for (int i = 0; i < n; i++) {
        cumulative += h->buckets[i];
        http_buf_appendf(b, "%s_bucket{%s,le=\"%g\"} %lld\n", name, labels, bound[i], cumulative);
    }
    http_buf_appendf(b, "%s_bucket{%s,le=\"+Inf\"} %lld\n", name, labels, (long long)h->count);
    http_buf_appendf(b, "%s_sum{%s} %.9g\n", name, labels, h->sum);
    http_buf_appendf(b, "%s_count{%s} %lld\n", name, labels, (long long)h->count);
}

void http_metrics_render_vllm(HttpBuf *b, const EngineStats *s, const char *labels) {
    // vLLM schedules each of a request's n completions as a request of its own, so its request counts are
    // tandem's completion counts where tandem tracks them (running, finished, latencies).
    integer(b, "vllm:num_requests_running", "gauge", "Requests (completions) in the engines' running batches.", labels,
            s->sequences_running);
    integer(b, "vllm:num_requests_waiting", "gauge", "Requests waiting to be admitted by an engine.", labels,
            s->requests_waiting);
    family(b, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.");
    http_buf_appendf(b, "vllm:kv_cache_usage_perc{%s} %.9g\n", labels,
        s->kv_blocks_total > 0 ? (double)s->kv_blocks_used / (double)s->kv_blocks_total : 0.0);
    integer(b, "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", labels,
            s->prompt_tokens_total);
    integer(b, "vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", labels,
            s->generation_tokens_total);
    integer(b, "vllm:num_preemptions_total", "counter", "Cumulative number of preemptions from the engine.", labels,
            s->preemptions_total);
    integer(b, "vllm:prefix_cache_queries_total", "counter",
            "Prefix cache queries, in terms of number of queried tokens.", labels, s->prompt_tokens_total);
    integer(b, "vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
            labels, s->cached_prompt_tokens_total);

    static const struct {
        FinishReason reason;
        const char *label;
    } reasons[] = {{FINISH_STOP, "stop"}, {FINISH_LENGTH, "length"}, {FINISH_ABORT, "abort"}, {FINISH_ERROR, "error"}};
    family(b, "vllm:request_success_total", "counter", "Count of successfully processed requests.");
    for (size_t i = 0; i < sizeof reasons / sizeof reasons[0]; i++)
        http_buf_appendf(b, "vllm:request_success_total{%s,finished_reason=\"%s\"} %lld\n", labels, reasons[i].label,
            (long long)s->completions_finished[reasons[i].reason]);

    histogram(b, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
              &s->latency[LATENCY_TTFT], LATENCY_TTFT);
    histogram(b, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels,
              &s->latency[LATENCY_ITL], LATENCY_ITL);
    histogram(b, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels,
              &s->latency[LATENCY_E2E], LATENCY_E2E);
}
