// engine_probe — drives the rollout server's generation engine for tests/reference/test_engine_vs_transformers.py.
//
//   engine_probe MODEL_DIR   stdin {"kv_tokens": 4096, "block_size": 16, "max_num_seqs": 64,
//                                   "max_num_batched_tokens": 256, "prefix_caching": true,
//                                   "requests": [{"prompt": [ids], "n", "max_tokens", "temperature", "top_p",
//                                                 "top_k", "min_p", "repetition_penalty", "seed", "stop": [strings],
//                                                 "stop_token_ids": [ids], "ignore_eos", "include_stop_str",
//                                                 "logprobs", "skip_special_tokens"}, ...]}
//   All requests are submitted at once (so they share engine steps), then collected. Prints
//   {"results": [{"cached_tokens": c, "completions": [{"tokens", "logprobs", "top": [[[id, lp], ...] per token],
//                 "text", "finish", "stop_reason", "stop_token", "version"}]}], "preemptions": p}
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/engine.h"

#define DIE(...)                                       \
    do {                                               \
        fprintf(stderr, "engine_probe: " __VA_ARGS__); \
        fputc('\n', stderr);                           \
        exit(1);                                       \
    } while (0)

static double num(json_t *o, const char *key, double dflt) {
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : dflt;
}

static int flag(json_t *o, const char *key, int dflt) {
    json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

static void parse_request(json_t *q, SamplingParams *p, int32_t **prompt, int *len) {
    sampling_params_default(p);
    json_t *pr = json_object_get(q, "prompt");
    if (!json_is_array(pr)) DIE("request without a \"prompt\" array");
    *len = (int)json_array_size(pr);
    *prompt = malloc((size_t)(*len ? *len : 1) * sizeof **prompt);
    for (int i = 0; i < *len; i++) (*prompt)[i] = (int32_t)json_integer_value(json_array_get(pr, i));
    p->n = (int)num(q, "n", 1);
    p->max_tokens = (int)num(q, "max_tokens", 16);
    p->temperature = (float)num(q, "temperature", 1.0);
    p->top_p = (float)num(q, "top_p", 1.0);
    p->top_k = (int)num(q, "top_k", 0);
    p->min_p = (float)num(q, "min_p", 0.0);
    p->repetition_penalty = (float)num(q, "repetition_penalty", 1.0);
    json_t *seed = json_object_get(q, "seed");
    if (json_is_integer(seed)) {
        p->has_seed = 1;
        p->seed = (uint64_t)json_integer_value(seed);
    }
    json_t *stop = json_object_get(q, "stop"), *ids = json_object_get(q, "stop_token_ids");
    for (size_t i = 0; json_is_array(stop) && i < json_array_size(stop) && i < ENGINE_MAX_STOP; i++)
        p->stop[p->n_stop++] = (char *)json_string_value(json_array_get(stop, i));
    for (size_t i = 0; json_is_array(ids) && i < json_array_size(ids) && i < ENGINE_MAX_STOP; i++)
        p->stop_token_ids[p->n_stop_token_ids++] = (int32_t)json_integer_value(json_array_get(ids, i));
    p->ignore_eos = flag(q, "ignore_eos", 0);
    p->include_stop_str = flag(q, "include_stop_str", 0);
    p->top_logprobs = (int)num(q, "logprobs", 0);
    p->skip_special_tokens = flag(q, "skip_special_tokens", 1);
}

typedef struct {
    json_t *tokens, *logprobs, *top;
    char *text;
    size_t len;
    json_t *obj;
} Out;

int main(int argc, char **argv) {
    if (argc != 2) DIE("usage: engine_probe MODEL_DIR < request.json");
    json_error_t jerr;
    json_t *in = json_loadf(stdin, 0, &jerr);
    if (!in) DIE("bad JSON on stdin: %s", jerr.text);
    char err[1024];
    ModelConfig mc;
    if (config_load(&mc, argv[1], err, sizeof err)) DIE("%s", err);
    EngineConfig cfg;
    engine_config_default(&cfg);
    cfg.model_dir = argv[1];
    cfg.block_size = (int)num(in, "block_size", 16);
    cfg.max_num_seqs = (int)num(in, "max_num_seqs", 64);
    cfg.max_num_batched_tokens = (int)num(in, "max_num_batched_tokens", 256);
    cfg.enable_prefix_caching = flag(in, "prefix_caching", 1);
    // fp32 K and V of every layer per token (the CPU backend's storage).
    const size_t token_bytes = 2ull * mc.num_layers * mc.num_kv_heads * mc.head_dim * sizeof(float);
    cfg.kv_cache_bytes = (size_t)num(in, "kv_tokens", 4096) * token_bytes;
    Engine *e;
    if (engine_create(&e, &cfg, err, sizeof err)) DIE("%s", err);

    json_t *reqs = json_object_get(in, "requests");
    const size_t R = json_array_size(reqs);
    EngineRequest **handles = calloc(R ? R : 1, sizeof *handles);
    int *ns = calloc(R ? R : 1, sizeof *ns);
    for (size_t i = 0; i < R; i++) {
        SamplingParams p;
        int32_t *prompt;
        int len;
        parse_request(json_array_get(reqs, i), &p, &prompt, &len);
        ns[i] = p.n;
        if (engine_submit(e, prompt, len, &p, &handles[i], err, sizeof err)) DIE("request %zu: %s", i, err);
        free(prompt);
    }
    json_t *results = json_array();
    for (size_t i = 0; i < R; i++) {
        Out *o = calloc((size_t)ns[i], sizeof *o);
        for (int c = 0; c < ns[i]; c++) {
            o[c].obj = json_object();
            o[c].tokens = json_array();
            o[c].logprobs = json_array();
            o[c].top = json_array();
            o[c].text = calloc(1, 1);
        }
        EngineEvent ev;
        int rc;
        while ((rc = engine_request_next(handles[i], &ev, 60000)) == 1) {
            Out *x = &o[ev.index];
            for (int t = 0; t < ev.n_tokens; t++) {
                json_array_append_new(x->tokens, json_integer(ev.tokens[t]));
                json_array_append_new(x->logprobs, json_real(ev.logprobs[t]));
                if (!ev.top) continue;
                json_t *row = json_array();
                json_t *req = json_array_get(reqs, i);
                for (int k = 0; k < (int)num(req, "logprobs", 0); k++) {
                    const TokenLogprob *tl = &ev.top[t * (int)num(req, "logprobs", 0) + k];
                    json_array_append_new(row, json_pack("[if]", (json_int_t)tl->id, (double)tl->logprob));
                }
                json_array_append_new(x->top, row);
            }
            x->text = realloc(x->text, x->len + ev.text_len + 1);
            memcpy(x->text + x->len, ev.text, ev.text_len);
            x->len += ev.text_len;
            x->text[x->len] = '\0';
            json_object_set_new(x->obj, "version", json_integer(ev.policy_version));
            if (ev.finish != FINISH_NONE) {
                json_object_set_new(x->obj, "finish", json_string(finish_reason_name(ev.finish)));
                json_object_set_new(x->obj, "stop_reason", ev.stop_reason ? json_string(ev.stop_reason) : json_null());
                json_object_set_new(x->obj, "stop_token", json_integer(ev.stop_token));
            }
        }
        if (rc != -1) DIE("request %zu: no event for 60 s", i);
        json_t *comps = json_array();
        for (int c = 0; c < ns[i]; c++) {
            json_object_set_new(o[c].obj, "tokens", o[c].tokens);
            json_object_set_new(o[c].obj, "logprobs", o[c].logprobs);
            json_object_set_new(o[c].obj, "top", o[c].top);
            json_object_set_new(o[c].obj, "text", json_stringn(o[c].text, o[c].len));
            json_array_append_new(comps, o[c].obj);
            free(o[c].text);
        }
        json_array_append_new(results, json_pack("{s:i, s:o}", "cached_tokens",
                                                 engine_request_cached_tokens(handles[i]), "completions", comps));
        engine_request_release(handles[i]);
        free(o);
    }
    EngineStats st;
    engine_stats(e, &st);
    json_t *out = json_pack("{s:o, s:I}", "results", results, "preemptions", (json_int_t)st.preemptions_total);
    char *s = json_dumps(out, JSON_COMPACT);
    puts(s);
    free(s);
    json_decref(out);
    json_decref(in);
    free(handles);
    free(ns);
    engine_destroy(e, 1000);
    return 0;
}
