// rollout_server/http_routes_misc.c — /health, /tokenize, /detokenize, /metrics and the TRL vllm-serve
// routes /health/, /get_world_size/, /generate/ (shapes from TRL's trl/scripts/vllm_serve.py).
#include <stdlib.h>
#include <string.h>

#include "rollout_server/http_internal.h"

// A server of several engines (--devices) also lists each engine: its device, policy version and load.
void http_route_health(HttpReq *r) {
    EngineGroup *g = r->srv->engines;
    const int n = engine_group_size(g);
    json_t *o = json_object();
    json_object_set_new(o, "status", json_string("ok"));
    if (n > 1) {
        EngineStats total;
        EngineMemberStats per[ENGINE_GROUP_MAX];
        engine_group_stats(g, &total, per);
        json_t *list = json_array();
        for (int i = 0; i < n; i++) {
            json_t *e = json_object();
            json_object_set_new(e, "engine", json_integer(i));
            json_object_set_new(e, "device", json_string(engine_group_device_name(g, i)));
            json_object_set_new(e, "policy_version", json_integer(per[i].stats.policy_version));
            json_object_set_new(e, "requests_waiting", json_integer(per[i].stats.requests_waiting));
            json_object_set_new(e, "requests_running", json_integer(per[i].stats.requests_running));
            json_array_append_new(list, e);
        }
        json_object_set_new(o, "engines", list);
    }
    http_reply_json(r, 200, o);
}

void http_route_trl_health(HttpReq *r) {
    json_t *o = json_object();
    json_object_set_new(o, "status", json_string("ok"));
    http_reply_json(r, 200, o);
}

void http_route_trl_world_size(HttpReq *r) {
    // TRL's vllm-serve answers tensor_parallel_size x data_parallel_size: here the shards of one engine times the
    // engines (--devices).
    EngineGroup *g = r->srv->engines;
    json_t *o = json_object();
    json_object_set_new(o, "world_size", json_integer(engine_group_size(g) * engine_tp(engine_group_engine(g, 0))));
    http_reply_json(r, 200, o);
}

void http_route_metrics(HttpReq *r) {
    EngineGroup *g = r->srv->engines;
    const int n = engine_group_size(g);
    EngineStats st;
    EngineMemberStats per[ENGINE_GROUP_MAX];
    const char *devices[ENGINE_GROUP_MAX];
    engine_group_stats(g, &st, per);
    for (int i = 0; i < n; i++) devices[i] = engine_group_device_name(g, i);
    size_t len = 0;
    char *text = http_metrics_render(&r->srv->metrics, &st, per, devices, n, r->srv->model_name, &len);
    if (!text) {
        HttpError e = {0};
        http_error_set(&e, 500, NULL, "out of memory rendering metrics");
        http_reply_error(r, &e);
        return;
    }
    http_reply_data(r, 200, "text/plain; version=0.0.4; charset=utf-8", text, len);
}

// {"prompt": text, "add_special_tokens": true} or {"messages": [...], "add_generation_prompt": true}
//   -> {"count", "max_model_len", "tokens", "token_strs"}   (vLLM's /tokenize)
void http_route_tokenize(HttpReq *r) {
    HttpServer *s = r->srv;
    HttpError e = {0};
    json_t *req = NULL, *tokens = NULL;
    char *rendered = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    if (http_body_parse(r->body.data, r->body.len, &req, &e) < 0) goto fail;
    int has_msgs = json_object_get(req, "messages") != NULL, has_prompt = json_object_get(req, "prompt") != NULL;
    if (http_need_tokenizer(engine_group_tokenizer(s->engines), has_msgs ? "messages" : "prompt",
                            "tokenize text", &e) < 0)
        goto fail;
    if (has_msgs == has_prompt) {
        http_error_set(&e, 400, has_msgs ? "messages" : "prompt", "send exactly one of 'prompt' and 'messages'");
        goto fail;
    }
    int add_special = has_msgs ? 0 : 1, add_gen = 1, want_strs = 0;
    if (http_get_bool(req, "add_special_tokens", &add_special, &e) < 0) goto fail;
    if (http_get_bool(req, "add_generation_prompt", &add_gen, &e) < 0) goto fail;
    if (http_get_bool(req, "return_token_strs", &want_strs, &e) < 0) goto fail;
    const char *text;
    size_t text_len = 0;
    if (has_msgs) {
        if (http_render_messages(s, req, add_gen, &rendered, &text_len, &e) < 0) goto fail;
        text = rendered;
    } else {
        int rc = http_get_string(req, "prompt", &text, &text_len, &e);
        if (rc < 0) goto fail;
        if (rc == 0) {
            http_error_set(&e, 400, "prompt", "'prompt' must be a string");
            goto fail;
        }
    }
    char msg[256];
    const Tokenizer *tok = engine_group_tokenizer(s->engines);
    if (tokenizer_encode(tok, text, text_len, add_special, &ids, &n, msg, sizeof msg) != 0) {
        http_error_set(&e, 400, has_msgs ? "messages" : "prompt", "cannot tokenize: %s", msg);
        goto fail;
    }
    tokens = json_array();
    json_t *strs = want_strs ? json_array() : json_null();
    for (size_t i = 0; i < n; i++) {
        json_array_append_new(tokens, json_integer(ids[i]));
        if (want_strs) {
            size_t tl = 0;
            const char *t = tokenizer_id_to_token(engine_group_tokenizer(s->engines), ids[i], &tl);
            json_array_append_new(strs, json_stringn(t ? t : "", t ? tl : 0));
        }
    }
    json_t *o = json_object();
    json_object_set_new(o, "count", json_integer((json_int_t)n));
    json_object_set_new(o, "max_model_len", json_integer(s->max_model_len));
    json_object_set_new(o, "tokens", tokens);
    json_object_set_new(o, "token_strs", strs);
    free(ids);
    free(rendered);
    json_decref(req);
    http_reply_json(r, 200, o);
    return;
fail:
    free(ids);
    free(rendered);
    json_decref(req);
    http_reply_error(r, &e);
}

// {"tokens": [ids]} -> {"prompt": text}   (vLLM's /detokenize; special tokens are kept, as tokenizer.decode)
void http_route_detokenize(HttpReq *r) {
    HttpServer *s = r->srv;
    HttpError e = {0};
    json_t *req = NULL;
    int32_t *ids = NULL;
    int n = 0;
    if (http_body_parse(r->body.data, r->body.len, &req, &e) < 0) goto fail;
    const json_t *t = json_object_get(req, "tokens");
    if (!t || json_is_null(t)) {
        http_error_set(&e, 400, "tokens", "'tokens' is required");
        goto fail;
    }
    if (http_parse_id_list(t, "tokens", s->vocab_size, &ids, &n, &e) < 0) goto fail;
    if (http_need_tokenizer(engine_group_tokenizer(s->engines), "tokens", "turn token ids into text", &e) < 0)
        goto fail;
    char *text = NULL;
    size_t len = 0;
    char msg[256];
    if (tokenizer_decode(engine_group_tokenizer(s->engines), ids, (size_t)n, 0, &text, &len, msg, sizeof msg) != 0) {
        http_error_set(&e, 400, "tokens", "cannot decode: %s", msg);
        goto fail;
    }
    json_t *o = json_object();
    json_object_set_new(o, "prompt", json_stringn(text, len));
    free(text);
    free(ids);
    json_decref(req);
    http_reply_json(r, 200, o);
    return;
fail:
    free(ids);
    json_decref(req);
    http_reply_error(r, &e);
}

// TRL vllm-serve POST /generate/: {"prompts": [texts] | [[ids]], "n", "repetition_penalty", "temperature",
// "top_p", "top_k", "min_p", "max_tokens", "logprobs", "images": null, "structured_outputs_regex": null,
// "generation_kwargs": {}} -> {"prompt_ids", "completion_ids" (n per prompt, flattened), "logprobs",
// "logprob_token_ids"}, plus "policy_versions" with "return_policy_versions": true.
void http_route_trl_generate(HttpReq *r) {
    HttpServer *s = r->srv;
    HttpError e = {0};
    json_t *req = NULL;
    HttpPromptList pl = {0};
    HttpGenOptions o;
    HttpGen g = {0};
    int32_t **ids = NULL;
    int *lens = NULL;
    if (http_body_parse(r->body.data, r->body.len, &req, &e) < 0) goto fail;
    if (http_parse_generation(req, HTTP_API_TRL, s->vocab_size, &o, &e) < 0) goto fail;
    if (http_parse_prompts(json_object_get(req, "prompts"), "prompts", s->vocab_size, 0, &pl, &e) < 0) goto fail;
    if ((long)pl.n * o.sp.n > HTTP_MAX_COMPLETIONS) {
        http_error_set(&e, 400, "n", "%d prompts x n=%d completions is over the limit of %d per request", pl.n,
                       o.sp.n, HTTP_MAX_COMPLETIONS);
        goto fail;
    }
    if (http_tokenize_prompts(engine_group_tokenizer(s->engines), &pl, 1, &ids, &lens, &e) < 0) goto fail;
    o.sp.no_text = 1; // the answer carries ids and logprobs only
    if (http_gen_submit(&g, s, r->fd, ids, lens, pl.n, &o.sp, &e) < 0) goto fail;
    if (http_gen_collect(&g, &e) < 0) goto fail;
    r->prompt_tokens = http_gen_prompt_tokens(&g);
    r->completion_tokens = http_gen_completion_tokens(&g);
    json_t *out = http_trl_response((const int32_t *const *)ids, lens, pl.n, o.sp.n, g.choices, o.logprobs,
                                    o.return_policy_versions);
    http_gen_release(&g);
    http_free_ids(ids, lens, pl.n);
    http_prompts_free(&pl);
    json_decref(req);
    http_reply_json(r, 200, out);
    return;
fail:
    http_gen_release(&g);
    http_free_ids(ids, lens, pl.n);
    http_prompts_free(&pl);
    json_decref(req);
    http_reply_error(r, &e);
}
