// rollout_server/http_metrics.h — HTTP request counters (by route and status) and the Prometheus text
// exposition of /metrics: those counters, the engines' EngineStats summed over the engines, and each engine's
// own (label engine="i", device="cuda:1").
#ifndef TANDEM_ROLLOUT_HTTP_METRICS_H
#define TANDEM_ROLLOUT_HTTP_METRICS_H

#include <stdatomic.h>
#include <stddef.h>

#include "rollout_server/engine_group.h"

typedef enum {
    HTTP_ROUTE_HEALTH = 0,
    HTTP_ROUTE_MODELS,
    HTTP_ROUTE_COMPLETIONS,
    HTTP_ROUTE_CHAT,
    HTTP_ROUTE_TOKENIZE,
    HTTP_ROUTE_DETOKENIZE,
    HTTP_ROUTE_METRICS,
    HTTP_ROUTE_TRL_HEALTH,
    HTTP_ROUTE_TRL_WORLD_SIZE,
    HTTP_ROUTE_TRL_GENERATE,
    HTTP_ROUTE_VLLM_WORLD_SIZE,       // vLLM's native routes (TRL >= 1.11 VLLMClient), http_routes_vllm.c
    HTTP_ROUTE_VLLM_SERVER_INFO,
    HTTP_ROUTE_VLLM_RESET_PREFIX_CACHE,
    HTTP_ROUTE_VLLM_PAUSE,
    HTTP_ROUTE_VLLM_RESUME,
    HTTP_ROUTE_VLLM_IS_PAUSED,
    HTTP_ROUTE_VLLM_INIT_WEIGHT_TRANSFER,
    HTTP_ROUTE_VLLM_START_WEIGHT_UPDATE,
    HTTP_ROUTE_VLLM_UPDATE_WEIGHTS,
    HTTP_ROUTE_VLLM_FINISH_WEIGHT_UPDATE,
    HTTP_ROUTE_VLLM_CHAT_RENDER,
    HTTP_ROUTE_VLLM_INFERENCE_GENERATE,
    HTTP_ROUTE_OTHER,       // unknown paths (404)
    HTTP_ROUTE_COUNT
} HttpRoute;

// Statuses counted individually; anything else lands in the last slot, exported as status="other".
// 499 is a client that went away before its answer was complete (nginx's convention).
#define HTTP_STATUS_SLOTS 14

typedef struct {
    atomic_llong count[HTTP_ROUTE_COUNT][HTTP_STATUS_SLOTS];
    atomic_llong in_flight;
} HttpMetrics;

const char *http_route_path(HttpRoute r);   // "/v1/completions", ... ("other" for HTTP_ROUTE_OTHER)
void http_metrics_init(HttpMetrics *m);
void http_metrics_count(HttpMetrics *m, HttpRoute route, int status);
long long http_metrics_get(HttpMetrics *m, HttpRoute route, int status);

// Prometheus text format 0.0.4 (malloc'd, NUL-terminated; *len its length): tandem_http_requests_total
// {route, status}, tandem_http_requests_in_flight, the engine gauges, counters and the step-time histogram of
// `total` (over all engines), and the tandem_engine_* series of each of the n_engines engines (per[i] on
// devices[i]).
char *http_metrics_render(HttpMetrics *m, const EngineStats *total, const EngineMemberStats *per,
                          const char *const *devices, int n_engines, const char *model_name, size_t *len);

#endif
