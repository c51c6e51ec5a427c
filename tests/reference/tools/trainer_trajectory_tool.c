// tests/reference/tools/trainer_trajectory_tool.c — runs trajectories_run (trainer/trajectory.h) with the built-in
// tools and a scripted sampler, for tests/reference/test_trajectory_vs_trl.py.
//   usage: trainer_trajectory_tool MODEL_FOLDER < script.json
//   script.json: {"format": "hermes", "enable_thinking": true, "max_tool_calling_iterations": -1,
//                 "max_completion_length": 256, "max_model_len": 0, "lookup": {...}?,
//                 "episodes": [{"prompt_ids": [...], "turns": [{"ids": [...], "logprobs": [...], "version": 3}]}]}
//   The sampler answers an episode's k-th request with its k-th scripted turn, cut to max_new_tokens.
//   stdout: {"episodes": [{"completion_ids", "mask", "logprobs", "versions", "histories": [[ids the sampler was
//            given], ...], "end", "n_assistant_turns", "n_tool_calls", "n_tool_failures"}]}
//   A failure prints its message on stderr and exits 1.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "shared/tokenizer/chat_template.h"
#include "trainer/trajectory.h"

typedef struct {
    json_t *episodes;
    int *next;           // per episode: the next scripted turn
    json_t **histories;  // per episode: list of the histories given to the sampler
} Script;

static int scripted_sample(void *ctx, const TrajectorySampleRequest *req, size_t n, TrajectorySample *out, char *err,
                           size_t err_len) {
    Script *s = ctx;
    for (size_t i = 0; i < n; i++) {
        size_t e = req[i].episode;
        json_t *turns = json_object_get(json_array_get(s->episodes, e), "turns");
        json_t *turn = json_array_get(turns, (size_t)s->next[e]++);
        if (!turn) {
            snprintf(err, err_len, "episode %zu asked for turn %d: the script has %zu", e, s->next[e],
                     json_array_size(turns));
            return -1;
        }
        json_t *h = json_array();
        for (size_t k = 0; k < req[i].n_ids; k++) json_array_append_new(h, json_integer(req[i].ids[k]));
        json_array_append_new(s->histories[e], h);
        json_t *ids = json_object_get(turn, "ids"), *lps = json_object_get(turn, "logprobs");
        size_t m = json_array_size(ids);
        if (m > req[i].max_new_tokens) m = req[i].max_new_tokens;
        out[i].ids = malloc((m + 1) * sizeof *out[i].ids);
        out[i].logprobs = malloc((m + 1) * sizeof *out[i].logprobs);
        for (size_t k = 0; k < m; k++) {
            out[i].ids[k] = (int32_t)json_integer_value(json_array_get(ids, k));
            out[i].logprobs[k] = (float)json_number_value(json_array_get(lps, k));
        }
        out[i].n = m;
        out[i].version = json_integer_value(json_object_get(turn, "version"));
    }
    return 0;
}

static json_t *int_list(const int32_t *v, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL_FOLDER < script.json\n", argv[0]);
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
    if (tokenizer_load(&tok, argv[1], err, sizeof err) != 0 ||
        chat_template_from_tokenizer(&ct, tok, NULL, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    TrajectoryBuilder b = {0};
    json_t *enable = json_object_get(in, "enable_thinking");
    if (tool_turn_style(&b.style, ct, tok, enable ? json_is_true(enable) : 1, err, sizeof err) != 0 ||
        tool_call_format_from_name(json_string_value(json_object_get(in, "format")), &b.opt.format, err,
                                   sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    b.opt.max_tool_calling_iterations = (int)json_integer_value(json_object_get(in, "max_tool_calling_iterations"));
    b.opt.max_completion_length = (size_t)json_integer_value(json_object_get(in, "max_completion_length"));
    b.opt.max_model_len = (size_t)json_integer_value(json_object_get(in, "max_model_len"));
    b.tok = tok;
    ToolBox *tb = NULL;
    if (toolbox_create(&tb, json_object_get(in, "lookup"), err, sizeof err) != 0 ||
        env_builtin_create(&b.env, tb, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    json_t *eps = json_object_get(in, "episodes");
    size_t n = json_array_size(eps);
    Script s = {.episodes = eps, .next = calloc(n + 1, sizeof(int)), .histories = calloc(n + 1, sizeof(json_t *))};
    Trajectory *t = calloc(n + 1, sizeof *t);
    char **ids = calloc(n + 1, sizeof *ids);
    for (size_t e = 0; e < n; e++) {
        json_t *p = json_object_get(json_array_get(eps, e), "prompt_ids");
        size_t k = json_array_size(p);
        int32_t *prompt = malloc((k + 1) * sizeof *prompt);
        for (size_t i = 0; i < k; i++) prompt[i] = (int32_t)json_integer_value(json_array_get(p, i));
        trajectory_init(&t[e], prompt, k);
        free(prompt);
        s.histories[e] = json_array();
        char name[32];
        snprintf(name, sizeof name, "e%zu", e);
        ids[e] = strdup(name);
    }
    b.sample = scripted_sample;
    b.sample_ctx = &s;
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
        json_array_append_new(
            out_eps, json_pack("{s:o, s:o, s:o, s:o, s:o, s:s, s:i, s:i, s:i}", "completion_ids",
                               int_list(t[e].ids + t[e].prompt_len, c), "mask", mask, "logprobs", lps, "versions",
                               vers, "histories", s.histories[e], "end", trajectory_end_name(t[e].end),
                               "n_assistant_turns", t[e].n_assistant_turns, "n_tool_calls", t[e].n_tool_calls,
                               "n_tool_failures", t[e].n_tool_failures));
        trajectory_free(&t[e]);
        free(ids[e]);
    }
    json_t *out = json_pack("{s:o}", "episodes", out_eps);
    char *txt = json_dumps(out, JSON_COMPACT);
    printf("%s\n", txt);
    free(txt);
    json_decref(out);
    json_decref(in);
    free(t), free(ids), free(s.next), free(s.histories);
    env_free(b.env);
    chat_template_free(ct);
    tokenizer_free(tok);
    return 0;
}
