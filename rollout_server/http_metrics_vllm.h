// rollout_server/http_metrics_vllm.h — the vLLM-named series of /metrics (vllm:num_requests_running, the latency
// histograms, ...), rendered from the engines' summed EngineStats beside tandem's own tandem_* series, so that
// dashboards and autoscalers written for vLLM read tandem-serve unchanged. docs/http-api.md lists the differences.
#ifndef TANDEM_ROLLOUT_HTTP_METRICS_VLLM_H
#define TANDEM_ROLLOUT_HTTP_METRICS_VLLM_H

#include "rollout_server/engine.h"
#include "rollout_server/http_response.h"

// Appends the vllm:* families of `s` (all engines summed) to b; `labels` is the label set every series carries
// (model_name="..."), already escaped.
void http_metrics_render_vllm(HttpBuf *b, const EngineStats *s, const char *labels);

#endif
