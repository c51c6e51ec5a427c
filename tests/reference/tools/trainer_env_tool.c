// tests/reference/tools/trainer_env_tool.c — drives an environment (trainer/environment.h) for the Python tests.
//   usage: trainer_env_tool (URL | builtin) TIMEOUT_S CONNECT_TIMEOUT_S RETRIES BACKOFF_S
// One JSON request per line on stdin, one answer per line on stdout:
//   {"op": "reset", "episodes": [{"episode_id", "seed", "row"}]}  -> {"episodes": [{"observation": ...}]}
//   {"op": "step", "format": "hermes", "steps": [{"episode_id", "turn", "message"}]}
//       (each message is parsed for tool calls in that format first)
//     -> {"steps": [{"observations": [{"name", "content"}], "done", "reward", "tool_failures", "parse_error"}]}
//   {"op": "tools"}  -> {"tools": [...] | null}   (the environment's tool definitions; a service is asked first)
//   {"op": "prompt", "model": DIR, "row": {"prompt": [messages]}, "chat_template": NAME | null}
//     -> {"ids": [...], "text": "...", "written": true|false}: the row rendered and tokenized as the trainer does
//        for a multi-turn run (trainer/tool_prompt.h, data_parse_row)
// A failing call answers {"error": "<message>"} and the tool goes on with the next line.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "shared/tokenizer/chat_template.h"
#include "shared/tokenizer/tokenizer.h"
#include "trainer/data.h"
#include "trainer/env_service.h"
#include "trainer/environment.h"
#include "trainer/tool_prompt.h"

static json_t *do_reset(Environment *env, json_t *req) {
    json_t *eps = json_object_get(req, "episodes");
    size_t n = json_array_size(eps);
    EnvResetRequest *r = calloc(n + 1, sizeof *r);
    EnvResetResult *out = calloc(n + 1, sizeof *out);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(eps, i);
        r[i].episode_id = json_string_value(json_object_get(e, "episode_id"));
        r[i].seed = (uint64_t)json_integer_value(json_object_get(e, "seed"));
        r[i].row = json_object_get(e, "row");
    }
    char err[2048];
    json_t *ans;
    if (env_reset(env, r, n, out, err, sizeof err) != 0) {
        ans = json_pack("{s:s}", "error", err);
    } else {
        json_t *list = json_array();
        for (size_t i = 0; i < n; i++) {
            json_array_append_new(list, json_pack("{s:o}", "observation",
                                                  out[i].observation ? json_string(out[i].observation) : json_null()));
            env_reset_result_free(&out[i]);
        }
        ans = json_pack("{s:o}", "episodes", list);
    }
    free(r), free(out);
    return ans;
}

static json_t *do_step(Environment *env, json_t *req) {
    json_t *steps = json_object_get(req, "steps");
    size_t n = json_array_size(steps);
    ToolCallFormat f = TOOL_FORMAT_HERMES;
    char err[2048];
    if (json_object_get(req, "format") &&
        tool_call_format_from_name(json_string_value(json_object_get(req, "format")), &f, err, sizeof err) != 0)
        return json_pack("{s:s}", "error", err);
    EnvStepRequest *r = calloc(n + 1, sizeof *r);
    ToolCallParse *p = calloc(n + 1, sizeof *p);
    EnvStepResult *out = calloc(n + 1, sizeof *out);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(steps, i);
        const char *msg = json_string_value(json_object_get(e, "message"));
        r[i].episode_id = json_string_value(json_object_get(e, "episode_id"));
        r[i].turn = (int)json_integer_value(json_object_get(e, "turn"));
        r[i].message = msg;
        tool_calls_parse(f, msg, strlen(msg), &p[i], err, sizeof err);
        r[i].parse = &p[i];
    }
    json_t *ans;
    if (env_step(env, r, n, out, err, sizeof err) != 0) {
        ans = json_pack("{s:s}", "error", err);
    } else {
        json_t *list = json_array();
        for (size_t i = 0; i < n; i++) {
            json_t *obs = json_array();
            for (size_t m = 0; m < out[i].n_messages; m++)
                json_array_append_new(obs, json_pack("{s:s, s:s}", "name", out[i].messages[m].name, "content",
                                                     out[i].messages[m].content));
            json_array_append_new(
                list, json_pack("{s:o, s:b, s:o, s:i, s:o}", "observations", obs, "done", out[i].done, "reward",
                                isnan(out[i].reward) ? json_null() : json_real(out[i].reward), "tool_failures",
                                out[i].n_tool_failures, "parse_error",
                                p[i].error ? json_string(p[i].error) : json_null()));
            env_step_result_free(&out[i]);
        }
        ans = json_pack("{s:o}", "steps", list);
    }
    for (size_t i = 0; i < n; i++) tool_call_parse_free(&p[i]);
    free(r), free(p), free(out);
    return ans;
}

static json_t *do_tools(Environment *env) {
    char err[2048];
    if (strcmp(env->kind, "service") == 0 && env_service_fetch_tools(env, err, sizeof err) != 0)
        return json_pack("{s:s}", "error", err);
    const json_t *t = env_tool_schemas(env);
    return json_pack("{s:O}", "tools", t ? (json_t *)t : json_null());
}

static json_t *do_prompt(Environment *env, json_t *req) {
    char err[2048];
    Tokenizer *tok = NULL;
    ChatTemplate *ct = NULL;
    const char *force = json_string_value(json_object_get(req, "chat_template"));
    if (tokenizer_load(&tok, json_string_value(json_object_get(req, "model")), err, sizeof err) != 0)
        return json_pack("{s:s}", "error", err);
    if (chat_template_from_tokenizer(&ct, tok, force, err, sizeof err) != 0) {
        tokenizer_free(tok);
        return json_pack("{s:s}", "error", err);
    }
    ToolPrompt tp;
    json_t *ans = NULL;
    if (tool_prompt_init(&tp, env, ct, err, sizeof err) != 0) {
        ans = json_pack("{s:s}", "error", err);
    } else {
        DataOptions opt = {.tok = tok, .chat = ct, .render = &tp.opt, .world_size = 1};
        char *text = json_dumps(json_object_get(req, "row"), JSON_COMPACT);
        DataRow row;
        memset(&row, 0, sizeof row);
        if (data_parse_row(&opt, text, strlen(text), &row, "row", err, sizeof err) != 0) {
            ans = json_pack("{s:s}", "error", err);
        } else {
            json_t *ids = json_array();
            for (size_t i = 0; i < row.n_ids; i++) json_array_append_new(ids, json_integer(row.ids[i]));
            ans = json_pack("{s:o, s:s, s:b}", "ids", ids, "text", row.prompt_text, "written", tp.written);
            data_row_clear(&row);
        }
        free(text);
        tool_prompt_free(&tp);
    }
    chat_template_free(ct);
    tokenizer_free(tok);
    return ans;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s (URL | builtin) TIMEOUT_S CONNECT_TIMEOUT_S RETRIES BACKOFF_S\n", argv[0]);
        return 2;
    }
    char err[2048];
    Environment *env = NULL;
    int rc;
    if (strcmp(argv[1], "builtin") == 0) {
        json_t *table = json_pack("{s:s, s:i}", "capital of France", "Paris", "answer", 42);
        ToolBox *tb = NULL;
        rc = toolbox_create(&tb, table, err, sizeof err);
        json_decref(table);
        if (rc == 0) rc = env_builtin_create(&env, tb, err, sizeof err);
    } else {
        EnvServiceOptions o;
        env_service_options_default(&o);
        o.url = argv[1];
        o.timeout_s = atof(argv[2]);
        o.connect_timeout_s = atof(argv[3]);
        o.max_retries = atoi(argv[4]);
        o.backoff_s = atof(argv[5]);
        rc = env_service_create(&env, &o, err, sizeof err);
    }
    if (rc != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0) {
        json_error_t je;
        json_t *req = json_loads(line, 0, &je);
        const char *op = json_string_value(json_object_get(req, "op"));
        json_t *ans = !op                        ? json_pack("{s:s}", "error", "need \"op\"")
                      : strcmp(op, "reset") == 0  ? do_reset(env, req)
                      : strcmp(op, "tools") == 0  ? do_tools(env)
                      : strcmp(op, "prompt") == 0 ? do_prompt(env, req)
                                                  : do_step(env, req);
        char *s = json_dumps(ans, JSON_COMPACT);
        printf("%s\n", s);
        fflush(stdout);
        free(s);
        json_decref(ans);
        json_decref(req);
    }
    free(line);
    env_free(env);
    return 0;
}
