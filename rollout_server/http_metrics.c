// rollout_server/http_metrics.c — request counters and Prometheus text (see http_metrics.h).
#include "rollout_server/http_metrics.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/http_metrics_vllm.h"
#include "rollout_server/http_response.h"

static const int kStatuses[HTTP_STATUS_SLOTS - 1] = {200, 400, 401, 404, 405, 408, 413, 429, 499, 500, 501, 503, 504};

static const char *const kRoutePaths[HTTP_ROUTE_COUNT] = {
    "/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/metrics",
    "/health/", "/get_world_size/", "/generate/", "/get_world_size", "/server_info", "/reset_prefix_cache", "/pause",
    "/resume", "/is_paused", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
    "/finish_weight_update", "/v1/chat/completions/render", "/inference/v1/generate", "other"};

const char *http_route_path(HttpRoute r) { return r >= 0 && r < HTTP_ROUTE_COUNT ? kRoutePaths[r] : "other"; }

static int status_slot(int status) {
    for (int i = 0; i < HTTP_STATUS_SLOTS - 1; i++)
        if (kStatuses[i] == status) return i;
    return HTTP_STATUS_SLOTS - 1;
}

void http_metrics_init(HttpMetrics *m) {
    for (int r = 0; r < HTTP_ROUTE_COUNT; r++)
        for (int s = 0; s < HTTP_STATUS_SLOTS; s++) atomic_init(&m->count[r][s], 0);
    atomic_init(&m->in_flight, 0);
}

void http_metrics_count(HttpMetrics *m, HttpRoute route, int status) {
    if (route < 0 || route >= HTTP_ROUTE_COUNT) route = HTTP_ROUTE_OTHER;
    atomic_fetch_add(&m->count[route][status_slot(status)], 1);
}

long long http_metrics_get(HttpMetrics *m, HttpRoute route, int status) {
    return atomic_load(&m->count[route][status_slot(status)]);
}

static void metric(HttpBuf *b, const char *name, const char *type, const char *help, const char *label,
                   long long value) {
    http_buf_appendf(b, "# HELP %s %s\n# TYPE %s %s\n%s{%s} %lld\n", name, help, name, type, name, label, value);
}

// One family with a series per engine: value(per[i]) under labels lab, engine="i", device="...".
static void per_engine(HttpBuf *b, const char *name, const char *type, const char *help, const char *lab,
                       const EngineMemberStats *per, const char *const *devices, int n,
                       long long (*value)(const EngineMemberStats *)) {
    http_buf_appendf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    for (int i = 0; i < n; i++)
        http_buf_appendf(b, "%s{%s,engine=\"%d\",device=\"%s\"} %lld\n", name, lab, i, devices[i], value(&per[i]));
}

static long long v_routed(const EngineMemberStats *p) { return p->requests_routed; }
static long long v_outstanding(const EngineMemberStats *p) { return p->outstanding; }
static long long v_waiting(const EngineMemberStats *p) { return p->stats.requests_waiting; }
static long long v_running(const EngineMemberStats *p) { return p->stats.requests_running; }
static long long v_seqs(const EngineMemberStats *p) { return p->stats.sequences_running; }
static long long v_blocks(const EngineMemberStats *p) { return p->stats.kv_blocks_total; }
static long long v_blocks_used(const EngineMemberStats *p) { return p->stats.kv_blocks_used; }
static long long v_prompt(const EngineMemberStats *p) { return p->stats.prompt_tokens_total; }
static long long v_gen(const EngineMemberStats *p) { return p->stats.generation_tokens_total; }
static long long v_steps(const EngineMemberStats *p) { return p->stats.steps_total; }
static long long v_version(const EngineMemberStats *p) { return p->stats.policy_version; }

char *http_metrics_render(HttpMetrics *m, const EngineStats *s, const EngineMemberStats *per,
                          const char *const *devices, int n_engines, const char *model_name, size_t *len) {
    HttpBuf b = {0};
    // The model name goes into a label value: escape backslash, quote and newline as the format requires.
    char model[256];
    size_t k = 0;
    for (const char *p = model_name ? model_name : ""; *p && k + 2 < sizeof model; p++) {
        if (*p == '\\' || *p == '"') model[k++] = '\\', model[k++] = *p;
        else if (*p == '\n') model[k++] = '\\', model[k++] = 'n';
        else model[k++] = *p;
    }
    model[k] = 0;
    char lab[300];
    snprintf(lab, sizeof lab, "model_name=\"%s\"", model);

    http_buf_appendf(&b, "# HELP tandem_http_requests_total HTTP requests answered, by route and status.\n"
            "# TYPE tandem_http_requests_total counter\n");
    for (int r = 0; r < HTTP_ROUTE_COUNT; r++)
        for (int i = 0; i < HTTP_STATUS_SLOTS; i++) {
            long long c = atomic_load(&m->count[r][i]);
            if (c == 0) continue;
            char st[16];
            if (i < HTTP_STATUS_SLOTS - 1) snprintf(st, sizeof st, "%d", kStatuses[i]);
            else snprintf(st, sizeof st, "other");
            http_buf_appendf(&b, "tandem_http_requests_total{route=\"%s\",status=\"%s\"} %lld\n", kRoutePaths[r], st, c);
        }
    metric(&b, "tandem_http_requests_in_flight", "gauge", "HTTP requests being handled now.", lab,
           atomic_load(&m->in_flight));

    metric(&b, "tandem_requests_waiting", "gauge", "Requests queued, not yet admitted by the engine.", lab,
           s->requests_waiting);
    metric(&b, "tandem_requests_running", "gauge", "Requests admitted and generating.", lab, s->requests_running);
    metric(&b, "tandem_sequences_running", "gauge", "Sequences (completions) decoding.", lab, s->sequences_running);
    metric(&b, "tandem_kv_blocks_total", "gauge", "KV cache blocks in the pool.", lab, s->kv_blocks_total);
    metric(&b, "tandem_kv_blocks_used", "gauge", "KV cache blocks referenced by sequences.", lab,
           s->kv_blocks_used);
    metric(&b, "tandem_kv_blocks_free", "gauge",
           "KV cache blocks allocatable (free, including evictable cached prefixes).", lab,
           s->kv_blocks_total - s->kv_blocks_used);
    metric(&b, "tandem_kv_blocks_cached", "gauge",
           "KV cache blocks unreferenced but holding a cached prefix (evictable).", lab,
           s->kv_blocks_cached);
    metric(&b, "tandem_prompt_tokens_total", "counter", "Prompt tokens processed.", lab, s->prompt_tokens_total);
    metric(&b, "tandem_generation_tokens_total", "counter", "Tokens generated.", lab, s->generation_tokens_total);
    metric(&b, "tandem_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.", lab,
           s->cached_prompt_tokens_total);
    metric(&b, "tandem_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.", lab,
           s->preemptions_total);
    metric(&b, "tandem_policy_version", "gauge", "Version of the weights generating now.", lab, s->policy_version);
    metric(&b, "tandem_engine_paused", "gauge", "1 while the engine is paused by the control channel.", lab, s->paused);

    // Step-time histogram: EngineStats buckets are cumulative counts at these bounds (ms), the last is +Inf.
    static const int bounds_ms[11] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000};
    http_buf_appendf(&b, "# HELP tandem_engine_step_seconds Wall time of one engine step.\n"
            "# TYPE tandem_engine_step_seconds histogram\n");
    for (int i = 0; i < 11; i++)
        http_buf_appendf(&b, "tandem_engine_step_seconds_bucket{%s,le=\"%g\"} %lld\n", lab, bounds_ms[i] / 1000.0,
            (long long)s->step_seconds_buckets[i]);
    http_buf_appendf(&b, "tandem_engine_step_seconds_bucket{%s,le=\"+Inf\"} %lld\n", lab, (long long)s->step_seconds_buckets[11]);
    http_buf_appendf(&b, "tandem_engine_step_seconds_sum{%s} %.9g\n", lab, s->step_seconds_sum);
    http_buf_appendf(&b, "tandem_engine_step_seconds_count{%s} %lld\n", lab, (long long)s->steps_total);
    http_buf_appendf(&b, "# HELP tandem_engine_step_compute_seconds_total Part of the engine steps' wall time spent in the model "
            "and sampling calls; the rest is bookkeeping on the host.\n"
            "# TYPE tandem_engine_step_compute_seconds_total counter\n");
    http_buf_appendf(&b, "tandem_engine_step_compute_seconds_total{%s} %.9g\n", lab, s->step_compute_seconds_sum);
    static const char *const kinds[3] = {"decode_graph", "decode_eager", "prefill"};
    http_buf_appendf(&b, "# HELP tandem_engine_steps_by_kind_total Engine steps by kind: decode_graph (decode-only, replayed from "
            "a CUDA graph), decode_eager (decode-only, op by op), prefill (with prompt tokens).\n"
            "# TYPE tandem_engine_steps_by_kind_total counter\n");
    for (int k = 0; k < 3; k++)
        http_buf_appendf(&b, "tandem_engine_steps_by_kind_total{%s,kind=\"%s\"} %lld\n", lab, kinds[k],
            (long long)s->steps_by_kind[k]);
    http_buf_appendf(&b, "# HELP tandem_engine_step_compute_seconds_by_kind_total tandem_engine_step_compute_seconds_total by the "
            "kind of step.\n"
            "# TYPE tandem_engine_step_compute_seconds_by_kind_total counter\n");
    for (int k = 0; k < 3; k++)
        http_buf_appendf(&b, "tandem_engine_step_compute_seconds_by_kind_total{%s,kind=\"%s\"} %.9g\n", lab, kinds[k],
            s->compute_seconds_by_kind[k]);

    // Weight updates (issue 24: applied while generating): what they did to the sequences in flight and how long
    // each stopped the engine (per engine: with --devices an update counts once per engine).
    metric(&b, "tandem_weight_updates_total", "counter", "Weight updates applied (per engine).", lab,
           s->weight_updates_total);
    metric(&b, "tandem_weight_update_sequences_kept_total", "counter",
           "Completions in flight that a weight update carried across: their tokens recomputed under the new "
           "weights, the rest sampled by the new version.", lab, s->weight_update_sequences_kept_total);
    metric(&b, "tandem_weight_update_sequences_requeued_total", "counter",
           "Completions in flight that a weight update started over from their prompt (mode abort).", lab,
           s->weight_update_sequences_requeued_total);
    static const int pause_ms[10] = ENGINE_UPDATE_PAUSE_BOUNDS_MS;
    http_buf_appendf(&b, "# HELP tandem_weight_update_pause_seconds Time a weight update stopped generation: from the end of the "
            "engine's last step before it (or from a pause already in effect) to its next step.\n"
            "# TYPE tandem_weight_update_pause_seconds histogram\n");
    for (int i = 0; i < 10; i++)
        http_buf_appendf(&b, "tandem_weight_update_pause_seconds_bucket{%s,le=\"%g\"} %lld\n", lab, pause_ms[i] / 1000.0,
            (long long)s->weight_update_pause_buckets[i]);
    http_buf_appendf(&b, "tandem_weight_update_pause_seconds_bucket{%s,le=\"+Inf\"} %lld\n", lab,
        (long long)s->weight_update_pause_buckets[10]);
    http_buf_appendf(&b, "tandem_weight_update_pause_seconds_sum{%s} %.9g\n", lab, s->weight_update_pause_seconds_sum);
    http_buf_appendf(&b, "tandem_weight_update_pause_seconds_count{%s} %lld\n", lab, (long long)s->weight_update_pause_buckets[10]);

    // Each engine of the server (--devices): the same figures apart, labelled by index and device.
    static const struct {
        const char *name, *type, *help;
        long long (*value)(const EngineMemberStats *);
    } fams[] = {
        {"tandem_engine_requests_routed_total", "counter", "Requests (prompts) routed to this engine.", v_routed},
        {"tandem_engine_outstanding_sequences", "gauge",
         "Completions routed to this engine and not yet released: the load the router balances.", v_outstanding},
        {"tandem_engine_requests_waiting", "gauge", "Requests queued on this engine, not yet admitted.", v_waiting},
        {"tandem_engine_requests_running", "gauge", "Requests admitted and generating on this engine.", v_running},
        {"tandem_engine_sequences_running", "gauge", "Sequences (completions) decoding on this engine.", v_seqs},
        {"tandem_engine_kv_blocks_total", "gauge", "KV cache blocks in this engine's pool.", v_blocks},
        {"tandem_engine_kv_blocks_used", "gauge", "KV cache blocks referenced by this engine's sequences.",
         v_blocks_used},
        {"tandem_engine_prompt_tokens_total", "counter", "Prompt tokens this engine processed.", v_prompt},
        {"tandem_engine_generation_tokens_total", "counter", "Tokens this engine generated.", v_gen},
        {"tandem_engine_steps_total", "counter", "Steps this engine ran.", v_steps},
        {"tandem_engine_policy_version", "gauge", "Version of the weights this engine generates with.", v_version},
    };
    for (size_t f = 0; per && f < sizeof fams / sizeof fams[0]; f++)
        per_engine(&b, fams[f].name, fams[f].type, fams[f].help, lab, per, devices, n_engines, fams[f].value);

    http_metrics_render_vllm(&b, s, lab);

    if (b.oom) {
        http_buf_free(&b);
        return NULL;
    }
    if (!b.data) http_buf_append(&b, "", 0);
    if (len) *len = b.len;
    return b.data;
}
