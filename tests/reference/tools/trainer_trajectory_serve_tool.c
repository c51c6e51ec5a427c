// tests/reference/tools/trainer_trajectory_serve_tool.c — trajectories whose assistant turns come from running
// rollout servers (trainer/trajectory_rollout.h), with the built-in tools, for tests/e2e/test_trajectory_serve.py.
//   usage: trainer_trajectory_serve_tool ENDPOINTS LAYOUT_HASH_HEX MODEL_FOLDER < script.json
//   script.json: {"format": "hermes", "max_completion_length": 200, "temperature": 0, "seed": 1,
//                 "episodes": [{"prompt_ids": [...], "script": {"<turn>": {"replace": [ids]}
//                                                                          | {"append": [ids], "server_max_tokens": 8}}}]}
//   A turn with "replace" is the scripted ids instead of the server's (a tiny random model does not call tools by
//   itself); "append" adds ids after the server's turn, whose length "server_max_tokens" may cap. Scripted ids get
//   logprob 0 and version -7.
//   stdout: {"episodes": [{"completion_ids", "mask", "logprobs", "versions", "end",
//            "turns": [{"turn", "history", "server_ids", "server_logprobs"}]}]}   (the server's part of each turn)
//   A failure prints its message on stderr and exits 1.
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "shared/tokenizer/chat_template.h"
#include "trainer/trajectory_rollout.h"

typedef struct {
    TrajectoryRolloutSampler server;
    json_t *episodes;
    json_t **turns;   // per episode: the records
} Scripted;

static json_t *script_for(const Scripted *s, size_t e, int turn, const char *what) {
    char key[16];
    snprintf(key, sizeof key, "%d", turn);
    return json_object_get(json_object_get(json_object_get(json_array_get(s->episodes, e), "script"), key), what);
}

static json_t *ints(const int32_t *v, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

static int scripted_sample(void *ctx, const TrajectorySampleRequest *req, size_t n, TrajectorySample *out, char *err,
                           size_t err_len) {
    Scripted *s = ctx;
    TrajectorySampleRequest *ask = calloc(n + 1, sizeof *ask);
    size_t *which = calloc(n + 1, sizeof *which);
    TrajectorySample *got = calloc(n + 1, sizeof *got);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (!script_for(s, req[i].episode, req[i].turn, "replace")) {
            json_t *cap = script_for(s, req[i].episode, req[i].turn, "server_max_tokens");
            ask[k] = req[i];
            if (cap && (size_t)json_integer_value(cap) < ask[k].max_new_tokens)
                ask[k].max_new_tokens = (size_t)json_integer_value(cap);
            which[k++] = i;
        }
    if (k && trajectory_rollout_sample(&s->server, ask, k, got, err, err_len) != 0) return -1;
    memset(out, 0, n * sizeof *out);
    for (size_t j = 0; j < k; j++) out[which[j]] = got[j];
    for (size_t i = 0; i < n; i++) {
        size_t e = req[i].episode;
        json_t *rep = script_for(s, e, req[i].turn, "replace"), *app = script_for(s, e, req[i].turn, "append");
        size_t own = out[i].n;
        json_array_append_new(s->turns[e], json_pack("{s:i, s:o, s:o}", "turn", req[i].turn, "history",
                                                     ints(req[i].ids, req[i].n_ids), "server_ids",
                                                     ints(out[i].ids, own)));
        json_t *lps = json_array();
        for (size_t t = 0; t < own; t++) json_array_append_new(lps, json_real(out[i].logprobs[t]));
        json_object_set_new(json_array_get(s->turns[e], json_array_size(s->turns[e]) - 1), "server_logprobs", lps);
        json_t *extra = rep ? rep : app;
        size_t add = json_array_size(extra);
        if (own + add > req[i].max_new_tokens) add = req[i].max_new_tokens - own;
        out[i].ids = realloc(out[i].ids, (own + add + 1) * sizeof *out[i].ids);
        out[i].logprobs = realloc(out[i].logprobs, (own + add + 1) * sizeof *out[i].logprobs);
        for (size_t t = 0; t < add; t++) {
            out[i].ids[own + t] = (int32_t)json_integer_value(json_array_get(extra, t));
            out[i].logprobs[own + t] = 0.0f;
        }
        out[i].n = own + add;
        if (rep) out[i].version = -7;
    }
    free(ask), free(which), free(got);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s ENDPOINTS LAYOUT_HASH_HEX MODEL_FOLDER < script.json\n", argv[0]);
        return 2;
    }
    char err[2048];
    json_error_t je;
    json_t *in = json_loadf(stdin, 0, &je);
    if (!in) {
        fprintf(stderr, "stdin: %s\n", je.text);
        return 2;
    }
    Tokenizer *tok = NULL;
    ChatTemplate *ct = NULL;
    TrajectoryBuilder b = {0};
    ToolBox *tb = NULL;
    Scripted s = {.episodes = json_object_get(in, "episodes")};
    if (tokenizer_load(&tok, argv[3], err, sizeof err) != 0 ||
        chat_template_from_tokenizer(&ct, tok, NULL, err, sizeof err) != 0 ||
        tool_turn_style(&b.style, ct, tok, 1, err, sizeof err) != 0 ||
        tool_call_format_from_name(json_string_value(json_object_get(in, "format")), &b.opt.format, err,
                                   sizeof err) != 0 ||
        toolbox_create(&tb, NULL, err, sizeof err) != 0 || env_builtin_create(&b.env, tb, err, sizeof err) != 0 ||
        rollout_client_create(&s.server.client, argv[1], strtoull(argv[2], NULL, 16), 30000, NULL, NULL, err,
                              sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    s.server.sampling = (ZmsgSampling){.n = 1, .max_tokens = 16, .temperature = 1.0f, .top_p = 1.0f, .top_k = -1,
                                       .repetition_penalty = 1.0f};
    s.server.sampling.temperature = (float)json_number_value(json_object_get(in, "temperature"));
    s.server.seed = (uint64_t)json_integer_value(json_object_get(in, "seed"));
    b.opt.max_tool_calling_iterations = -1;
    b.opt.max_completion_length = (size_t)json_integer_value(json_object_get(in, "max_completion_length"));
    b.opt.max_model_len = (size_t)rollout_client_max_seq_len(s.server.client);
    b.tok = tok;
    b.sample = scripted_sample;
    b.sample_ctx = &s;
    size_t n = json_array_size(s.episodes);
    s.turns = calloc(n + 1, sizeof *s.turns);
    Trajectory *t = calloc(n + 1, sizeof *t);
    char **ids = calloc(n + 1, sizeof *ids);
    for (size_t e = 0; e < n; e++) {
        json_t *p = json_object_get(json_array_get(s.episodes, e), "prompt_ids");
        size_t k = json_array_size(p);
        int32_t *prompt = malloc((k + 1) * sizeof *prompt);
        for (size_t i = 0; i < k; i++) prompt[i] = (int32_t)json_integer_value(json_array_get(p, i));
        trajectory_init(&t[e], prompt, k);
        free(prompt);
        s.turns[e] = json_array();
        char name[32];
        snprintf(name, sizeof name, "e%zu", e);
        ids[e] = strdup(name);
    }
    if (trajectories_run(&b, t, (const char *const *)ids, n, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    json_t *out_eps = json_array();
    for (size_t e = 0; e < n; e++) {
        size_t c = trajectory_completion_len(&t[e]);
        json_t *mask = json_array(), *lps = json_array(), *vers = json_array();
        for (size_t i = 0; i < c; i++) {
            json_array_append_new(mask, json_integer(t[e].mask[i]));
            json_array_append_new(lps, json_real(t[e].logprobs[i]));
            json_array_append_new(vers, json_integer(t[e].versions[i]));
        }
        json_array_append_new(out_eps, json_pack("{s:o, s:o, s:o, s:o, s:s, s:o, s:i}", "completion_ids",
                                                 ints(t[e].ids + t[e].prompt_len, c), "mask", mask, "logprobs", lps,
                                                 "versions", vers, "end", trajectory_end_name(t[e].end), "turns",
                                                 s.turns[e], "n_tool_calls", t[e].n_tool_calls));
        trajectory_free(&t[e]);
        free(ids[e]);
    }
    json_t *out = json_pack("{s:o}", "episodes", out_eps);
    char *txt = json_dumps(out, JSON_COMPACT);
    printf("%s\n", txt);
    free(txt);
    json_decref(out);
    json_decref(in);
    free(t), free(ids), free(s.turns);
    rollout_client_destroy(s.server.client);
    env_free(b.env);
    chat_template_free(ct);
    tokenizer_free(tok);
    return 0;
}
