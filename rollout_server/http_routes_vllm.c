// rollout_server/http_routes_vllm.c — vLLM's native routes that TRL >= 1.11's VLLMClient calls besides the
// OpenAI ones (checked against trl/generation/vllm_client.py of TRL 1.16): /server_info, /reset_prefix_cache,
// /pause (?mode=abort|keep|wait&clear_cache=true|false), /resume, /is_paused, and answers that say what is
// not served: vLLM's NCCL weight-transfer routes and its multimodal feature routes. /get_world_size (no
// slash) shares TRL's old handler (http_routes_misc.c). Each handler runs on its connection's thread and only
// asks the engines (engine_group.h), which do the work on their own threads.
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/http_internal.h"

#define WAIT_IDLE_SLICE_MS 50

// GET /server_info -> {"vllm_config": {...}}: only what a client decides on. weight_transfer_config is null:
// TRL's init_communicator reads it and stops with "no weight-transfer engine" before it opens an NCCL
// rendezvous that this server would never join.
void http_route_vllm_server_info(HttpReq *r) {
    HttpServer *s = r->srv;
    json_t *model = json_object();
    json_object_set_new(model, "model", json_string(engine_group_model_id(s->engines)));
    json_object_set_new(model, "served_model_name", json_string(s->model_name));
    json_object_set_new(model, "max_model_len", json_integer(s->max_model_len));
    json_t *parallel = json_object();
    json_object_set_new(parallel, "tensor_parallel_size", json_integer(engine_tp(engine_group_engine(s->engines, 0))));
    json_object_set_new(parallel, "data_parallel_size", json_integer(engine_group_size(s->engines)));
    json_t *cfg = json_object();
    json_object_set_new(cfg, "model_config", model);
    json_object_set_new(cfg, "parallel_config", parallel);
    json_object_set_new(cfg, "weight_transfer_config", json_null());
    json_t *o = json_object();
    json_object_set_new(o, "vllm_config", cfg);
    json_object_set_new(o, "server", json_string("tandem-serve"));
    http_reply_json(r, 200, o);
}

// POST /reset_prefix_cache -> {"success": true} (vLLM >= 0.26's shape; older clients ignore the body).
void http_route_vllm_reset_prefix_cache(HttpReq *r) {
    engine_group_reset_prefix_cache(r->srv->engines);
    json_t *o = json_object();
    json_object_set_new(o, "success", json_true());
    http_reply_json(r, 200, o);
}

typedef struct {
    const char *mode;
    const char *clear_cache;
    char unknown[64];
} PauseArgs;

static enum MHD_Result collect_pause_arg(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    PauseArgs *a = cls;
    if (strcmp(key, "mode") == 0) a->mode = value ? value : "";
    else if (strcmp(key, "clear_cache") == 0) a->clear_cache = value ? value : "";
    else if (!a->unknown[0]) snprintf(a->unknown, sizeof a->unknown, "%s", key);
    return MHD_YES;
}

// "true"/"false" as vLLM's query parser takes them (also 1/0); -1 for anything else.
static int query_bool(const char *v) {
    if (strcmp(v, "true") == 0 || strcmp(v, "True") == 0 || strcmp(v, "1") == 0) return 1;
    if (strcmp(v, "false") == 0 || strcmp(v, "False") == 0 || strcmp(v, "0") == 0) return 0;
    return -1;
}

// POST /pause?mode=abort|keep|wait&clear_cache=true -> {"status": "paused", "mode": ...}
//   abort (vLLM's default): requests in flight end now with finish_reason "abort"; keep: they stay, frozen
//   with their KV cache, and go on after /resume (also across a weight update made meanwhile, per the
//   server's --weight-update-mode); wait: the answer comes once nothing is queued or running, then the
//   engines pause. Requests that arrive while paused wait in the queue. clear_cache (default true) empties
//   the prefix cache (requests in flight keep their own blocks).
void http_route_vllm_pause(HttpReq *r) {
    PauseArgs a = {0};
    HttpError e = {0};
    MHD_get_connection_values(r->conn, MHD_GET_ARGUMENT_KIND, collect_pause_arg, &a);
    if (a.unknown[0]) {
        http_error_set(&e, 400, a.unknown, "'%s' is not a parameter of /pause (it takes mode and clear_cache)",
                       a.unknown);
        http_reply_error(r, &e);
        return;
    }
    const char *mode = a.mode ? a.mode : "abort";
    if (strcmp(mode, "abort") != 0 && strcmp(mode, "keep") != 0 && strcmp(mode, "wait") != 0) {
        http_error_set(&e, 400, "mode", "'mode' must be abort, keep or wait, got '%s'", mode);
        http_reply_error(r, &e);
        return;
    }
    const int clear = a.clear_cache ? query_bool(a.clear_cache) : 1;
    if (clear < 0) {
        http_error_set(&e, 400, "clear_cache", "'clear_cache' must be true or false, got '%s'", a.clear_cache);
        http_reply_error(r, &e);
        return;
    }
    EngineGroup *g = r->srv->engines;
    if (strcmp(mode, "wait") == 0) { // in slices, so that a client gone or a shutdown ends the wait, unpaused
        while (!engine_group_wait_idle(g, WAIT_IDLE_SLICE_MS)) {
            if (http_client_gone(r->fd)) {
                http_error_set(&e, 499, NULL, "client went away");
                http_reply_error(r, &e);
                return;
            }
            if (atomic_load(&r->srv->draining)) {
                http_error_set(&e, 503, NULL, "the server is shutting down; it was not paused");
                http_reply_error(r, &e);
                return;
            }
        }
    }
    engine_group_pause(g);
    // After the pause: what arrives from now on queues behind it instead of being aborted.
    if (strcmp(mode, "abort") == 0) engine_group_abort_requests(g);
    if (clear) engine_group_reset_prefix_cache(g);
    json_t *o = json_object();
    json_object_set_new(o, "status", json_string("paused"));
    json_object_set_new(o, "mode", json_string(mode));
    http_reply_json(r, 200, o);
}

// POST /resume -> {"status": "resumed"}: kept and queued requests go on.
void http_route_vllm_resume(HttpReq *r) {
    engine_group_resume(r->srv->engines);
    json_t *o = json_object();
    json_object_set_new(o, "status", json_string("resumed"));
    http_reply_json(r, 200, o);
}

// GET /is_paused -> {"is_paused": bool} (true when any engine is paused, by /pause or by the trainer).
void http_route_vllm_is_paused(HttpReq *r) {
    EngineStats st;
    engine_group_stats(r->srv->engines, &st, NULL);
    json_t *o = json_object();
    json_object_set_new(o, "is_paused", json_boolean(st.paused));
    http_reply_json(r, 200, o);
}

// vLLM's NCCL weight-transfer routes: the trainer side (vLLM's trainer_init / packed broadcast) is vLLM code
// that this server does not speak, so each route says so at once instead of leaving a trainer in a rendezvous.
void http_route_vllm_weight_transfer(HttpReq *r) {
    HttpError e = {0};
    http_error_set(&e, 501, NULL, "%s: vLLM's NCCL weight transfer is not served by tandem-serve (/server_info "
                   "reports weight_transfer_config null). Train with tandem-train, whose weight sync updates this "
                   "server over its control channel (--control, docs/protocol-zmq.md); the generation routes "
                   "work with any trainer", r->path);
    http_reply_error(r, &e);
}

// vLLM's multimodal routes (TRL calls them only for prompts with images): this server runs text models.
void http_route_vllm_multimodal(HttpReq *r) {
    HttpError e = {0};
    http_error_set(&e, 501, NULL, "%s is not served by tandem-serve: it exists for multimodal prompts (images) "
                   "and this server runs text models; send text or token-id prompts to /v1/completions or "
                   "messages to /v1/chat/completions", r->path);
    http_reply_error(r, &e);
}
