// trainer/env_service.c — the HTTP environment (protocol in env_service.h and docs/environments.md).
#include "trainer/env_service.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/err.h"
#include "shared/json_read.h"
#include "shared/tokenizer/tokenizer.h"
#include "trainer/http_client.h"
#include "trainer/wait_log.h"

#define BACKOFF_CAP_S 30.0

typedef struct {
    Environment base;
    EnvServiceOptions opt;
    char *reset_url, *step_url, *tools_url;
} ServiceEnv;

void env_service_options_default(EnvServiceOptions *o) {
    memset(o, 0, sizeof *o);
    o->timeout_s = 60.0;
    o->connect_timeout_s = 10.0;
    o->max_retries = 3;
    o->backoff_s = 1.0;
}

// A JSON string from text that may hold invalid UTF-8 (a turn cut inside a character): repaired as Python decodes.
static json_t *text_json(const char *s) {
    if (!s) return json_string("");
    json_t *v = json_stringn(s, strlen(s));
    if (v) return v;
    size_t n = 0;
    char *fixed = tokenizer_utf8_repair(s, strlen(s), &n);
    if (!fixed) return NULL;
    v = json_stringn(fixed, n);
    free(fixed);
    return v;
}

char *env_service_reset_json(const EnvResetRequest *req, size_t n) {
    json_t *list = json_array();
    json_t *root = json_pack("{s:o}", "episodes", list);
    if (!root) return NULL;
    for (size_t i = 0; i < n; i++) {
        json_t *row = req[i].row ? json_deep_copy(req[i].row) : json_object();
        json_t *e = json_pack("{s:s, s:I, s:o}", "episode_id", req[i].episode_id, "seed",
                              (json_int_t)(req[i].seed & 0x7fffffffffffffffULL), "row", row);
        if (!e || json_array_append_new(list, e) != 0) {
            json_decref(root);
            return NULL;
        }
    }
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

char *env_service_step_json(const EnvStepRequest *req, size_t n) {
    json_t *list = json_array();
    json_t *root = json_pack("{s:o}", "steps", list);
    if (!root) return NULL;
    for (size_t i = 0; i < n; i++) {
        const ToolCallParse *p = req[i].parse;
        json_t *calls = json_array();
        for (size_t c = 0; p && calls && c < p->n_calls; c++) {
            json_t *call = json_pack("{s:s, s:O}", "name", p->calls[c].name, "arguments", p->calls[c].arguments);
            if (call && p->calls[c].id) json_object_set_new(call, "id", json_string(p->calls[c].id));
            if (!call || json_array_append_new(calls, call) != 0) {
                json_decref(calls);
                calls = NULL;
            }
        }
        json_t *msg = text_json(req[i].message);
        json_t *perr = p && p->error ? json_string(p->error) : json_null();
        json_t *e = (calls && msg && perr)
                        ? json_pack("{s:s, s:i, s:o, s:o, s:o}", "episode_id", req[i].episode_id, "turn", req[i].turn,
                                    "message", msg, "tool_calls", calls, "tool_call_error", perr)
                        : NULL;
        if (!e || json_array_append_new(list, e) != 0) {
            if (!e) json_decref(calls), json_decref(msg), json_decref(perr);
            json_decref(root);
            return NULL;
        }
    }
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

// The answer's list under key, checked against the request's n episode ids. NULL with a message when wrong.
static json_t *answer_list(const char *body, size_t len, const char *key, size_t n, const char *const *ids,
                           json_t **root, char *err, size_t err_len) {
    json_error_t je;
    *root = json_read_buffer(body, len, 0, &je);
    if (!*root) {
        err_fail(err, err_len, "the answer is not valid JSON (%s at line %d column %d)", je.text, je.line, je.column);
        return NULL;
    }
    json_t *list = json_is_object(*root) ? json_object_get(*root, key) : NULL;
    if (!json_is_array(list)) {
        err_fail(err, err_len, "the answer must be an object with a list \"%s\"", key);
        return NULL;
    }
    if (json_array_size(list) != n) {
        err_fail(err, err_len, "\"%s\" has %zu entries for %zu episodes (one per episode, in request order)", key,
                 json_array_size(list), n);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(list, i);
        json_t *id = json_is_object(e) ? json_object_get(e, "episode_id") : NULL;
        if (!json_is_object(e)) {
            err_fail(err, err_len, "\"%s\"[%zu] is not an object", key, i);
            return NULL;
        }
        if (!json_is_string(id) || strcmp(json_string_value(id), ids[i]) != 0) {
            err_fail(err, err_len, "\"%s\"[%zu].episode_id must be \"%s\" (answers in request order)", key, i,
                     ids[i]);
            return NULL;
        }
    }
    return list;
}

int env_service_parse_reset(const char *body, size_t len, const EnvResetRequest *req, size_t n, EnvResetResult *out,
                            char *err, size_t err_len) {
    memset(out, 0, n * sizeof *out);
    const char **ids = calloc(n + 1, sizeof *ids);
    if (!ids) return err_fail(err, err_len, "out of memory");
    for (size_t i = 0; i < n; i++) ids[i] = req[i].episode_id;
    json_t *root = NULL;
    json_t *list = answer_list(body, len, "episodes", n, ids, &root, err, err_len);
    free(ids);
    int rc = list ? 0 : -1;
    for (size_t i = 0; list && i < n; i++) {
        json_t *obs = json_object_get(json_array_get(list, i), "observation");
        if (!obs || json_is_null(obs)) continue;
        if (!json_is_string(obs)) {
            rc = err_fail(err, err_len, "\"episodes\"[%zu].observation must be a string or null", i);
            break;
        }
        if (!(out[i].observation = strdup(json_string_value(obs)))) {
            rc = err_fail(err, err_len, "out of memory");
            break;
        }
    }
    if (rc != 0)
        for (size_t i = 0; i < n; i++) env_reset_result_free(&out[i]);
    json_decref(root);
    return rc;
}

static int parse_one_step(json_t *e, size_t i, const EnvStepRequest *req, EnvStepResult *r, char *err,
                          size_t err_len) {
    json_t *done = json_object_get(e, "done");
    json_t *reward = json_object_get(e, "reward");
    json_t *obs = json_object_get(e, "observations");
    if (!json_is_boolean(done))
        return err_fail(err, err_len, "\"steps\"[%zu].done must be true or false", i);
    r->done = json_is_true(done);
    if (reward && !json_is_null(reward) && !json_is_number(reward))
        return err_fail(err, err_len, "\"steps\"[%zu].reward must be a number or null", i);
    r->reward = json_is_number(reward) ? json_number_value(reward) : NAN;
    if (obs && !json_is_null(obs) && !json_is_array(obs))
        return err_fail(err, err_len, "\"steps\"[%zu].observations must be a list of {\"name\", \"content\"}", i);
    size_t k = json_is_array(obs) ? json_array_size(obs) : 0;
    if (k == 0 && !r->done && req->parse && req->parse->n_calls > 0)
        return err_fail(err, err_len, "\"steps\"[%zu] has tool calls but no observations and is not done: the "
                        "policy would have nothing new to read (answer each call, or done: true)", i);
    if (k && !(r->messages = calloc(k, sizeof *r->messages))) return err_fail(err, err_len, "out of memory");
    for (size_t m = 0; m < k; m++) {
        json_t *o = json_array_get(obs, m);
        json_t *name = json_is_object(o) ? json_object_get(o, "name") : NULL;
        json_t *content = json_is_object(o) ? json_object_get(o, "content") : NULL;
        if (!json_is_string(content) || (name && !json_is_null(name) && !json_is_string(name)))
            return err_fail(err, err_len, "\"steps\"[%zu].observations[%zu] must be {\"name\": string, \"content\": "
                            "string}", i, m);
        ToolMessage *t = &r->messages[r->n_messages];
        t->name = strdup(json_is_string(name) ? json_string_value(name) : "");
        t->content = strdup(json_string_value(content));
        r->n_messages++;
        if (!t->name || !t->content) return err_fail(err, err_len, "out of memory");
    }
    return 0;
}

int env_service_parse_step(const char *body, size_t len, const EnvStepRequest *req, size_t n, EnvStepResult *out,
                           char *err, size_t err_len) {
    memset(out, 0, n * sizeof *out);
    for (size_t i = 0; i < n; i++) out[i].reward = NAN;
    const char **ids = calloc(n + 1, sizeof *ids);
    if (!ids) return err_fail(err, err_len, "out of memory");
    for (size_t i = 0; i < n; i++) ids[i] = req[i].episode_id;
    json_t *root = NULL;
    json_t *list = answer_list(body, len, "steps", n, ids, &root, err, err_len);
    free(ids);
    int rc = list ? 0 : -1;
    for (size_t i = 0; list && i < n && rc == 0; i++)
        rc = parse_one_step(json_array_get(list, i), i, &req[i], &out[i], err, err_len);
    if (rc != 0)
        for (size_t i = 0; i < n; i++) env_step_result_free(&out[i]);
    json_decref(root);
    return rc;
}




// POSTs body to url with retries; on success resp holds the 200 answer. -1 with the last failure otherwise; 1 (resp
// empty) for a 404 when absent_ok (an optional call the service does not serve).
static int post_with_retries(const ServiceEnv *s, const char *url, const char *what, size_t n, const char *body,
                             int absent_ok, HttpResponse *resp, char *err, size_t err_len) {
    HttpOptions ho = {.connect_timeout_ms = http_timeout_ms(s->opt.connect_timeout_s),
                      .timeout_ms = http_timeout_ms(s->opt.timeout_s),
                      .max_response_bytes = s->opt.max_response_bytes};
    char msg[1024] = "";
    double wait = fmin(s->opt.backoff_s, BACKOFF_CAP_S);
    int attempts = 0;
    for (int attempt = 0; attempt <= s->opt.max_retries; attempt++) {
        attempts++;
        if (attempt > 0) {
            fprintf(stderr, "tandem-train: environment service: %s; attempt %d of %d in %.3g s\n", msg, attempt + 1,
                    s->opt.max_retries + 1, wait);
            http_sleep_seconds(wait);
            wait = fmin(wait * 2.0, BACKOFF_CAP_S);
        }
        http_response_free(resp);
        WaitLog answer;
        wait_log_start(&answer, s->opt.connect_timeout_s + s->opt.timeout_s, "--env-connect-timeout + --env-timeout",
                       "environment service %s (%s, %zu episodes)", url, what, n);
        ho.wait_log = &answer;
        int hrc = http_post(url, "application/json", body, strlen(body), &ho, resp, msg, sizeof msg);
        if (hrc == HTTP_E_CONNECT || hrc == HTTP_E_TIMEOUT || hrc == HTTP_E_IO) continue;
        if (hrc != HTTP_OK) break;
        if (resp->status == 200) return 0;
        if (resp->status == 404 && absent_ok) {
            http_response_free(resp);
            return 1;
        }
        char ex[201];
        http_body_excerpt(resp->body, resp->body_len, ex, sizeof ex);
        snprintf(msg, sizeof msg, "%s: HTTP status %d: %s", url, resp->status, ex);
        if (resp->status < 500 && resp->status != 429) break;
    }
    http_response_free(resp);
    return err_fail(err, err_len, "environment service %s failed after %d attempt(s): %s", what, attempts, msg);
}

static int bad_answer(const char *url, const HttpResponse *resp, const char *perr, char *err, size_t err_len) {
    char ex[161];
    http_body_excerpt(resp->body, resp->body_len, ex, sizeof ex);
    return err_fail(err, err_len, "environment service %s: bad answer: %s; body starts: %s", url, perr, ex);
}

static int service_reset(Environment *env, const EnvResetRequest *req, size_t n, EnvResetResult *out, char *err,
                         size_t err_len) {
    ServiceEnv *s = (ServiceEnv *)env;
    char *body = env_service_reset_json(req, n);
    if (!body) return err_fail(err, err_len, "environment service: out of memory building the reset request");
    HttpResponse resp = {0};
    int rc = post_with_retries(s, s->reset_url, "reset", n, body, 0, &resp, err, err_len);
    free(body);
    if (rc != 0) return rc;
    char perr[512];
    rc = env_service_parse_reset(resp.body, resp.body_len, req, n, out, perr, sizeof perr);
    if (rc != 0) bad_answer(s->reset_url, &resp, perr, err, err_len);
    http_response_free(&resp);
    return rc;
}

static int service_step(Environment *env, const EnvStepRequest *req, size_t n, EnvStepResult *out, char *err,
                        size_t err_len) {
    ServiceEnv *s = (ServiceEnv *)env;
    char *body = env_service_step_json(req, n);
    if (!body) return err_fail(err, err_len, "environment service: out of memory building the step request");
    HttpResponse resp = {0};
    int rc = post_with_retries(s, s->step_url, "step", n, body, 0, &resp, err, err_len);
    free(body);
    if (rc != 0) return rc;
    char perr[512];
    rc = env_service_parse_step(resp.body, resp.body_len, req, n, out, perr, sizeof perr);
    if (rc != 0) bad_answer(s->step_url, &resp, perr, err, err_len);
    http_response_free(&resp);
    return rc;
}

int env_service_parse_tools(const char *body, size_t len, json_t **out, char *err, size_t err_len) {
    *out = NULL;
    json_error_t je;
    json_t *root = json_read_buffer(body, len, 0, &je);
    if (!root)
        return err_fail(err, err_len, "the answer is not valid JSON (%s at line %d column %d)", je.text, je.line,
                        je.column);
    json_t *list = json_is_object(root) ? json_object_get(root, "tools") : NULL;
    int rc = 0;
    if (!json_is_object(root) || (list && !json_is_null(list) && !json_is_array(list))) {
        rc = err_fail(err, err_len, "the answer must be an object {\"tools\": [{\"type\": \"function\", "
                      "\"function\": {\"name\", \"description\", \"parameters\"}}, ...]}");
    }
    for (size_t i = 0; rc == 0 && json_is_array(list) && i < json_array_size(list); i++) {
        const json_t *t = json_array_get(list, i);
        const json_t *fn = json_is_object(t) ? json_object_get(t, "function") : NULL;
        const json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
        const json_t *params = json_is_object(fn) ? json_object_get(fn, "parameters") : NULL;
        if (!json_is_object(t) || !json_is_string(json_object_get(t, "type")) ||
            strcmp(json_string_value(json_object_get(t, "type")), "function") != 0)
            rc = err_fail(err, err_len, "\"tools\"[%zu].type must be \"function\"", i);
        else if (!json_is_object(fn))
            rc = err_fail(err, err_len, "\"tools\"[%zu].function must be an object {\"name\", \"description\", "
                          "\"parameters\"}", i);
        else if (!json_is_string(name) || json_string_length(name) == 0)
            rc = err_fail(err, err_len, "\"tools\"[%zu].function.name must be a non-empty string", i);
        else if (params && !json_is_object(params))
            rc = err_fail(err, err_len, "\"tools\"[%zu].function.parameters must be a JSON schema object", i);
    }
    if (rc == 0 && json_is_array(list) && json_array_size(list) > 0) *out = json_incref(list);
    json_decref(root);
    return rc;
}

int env_service_fetch_tools(Environment *env, char *err, size_t err_len) {
    ServiceEnv *s = (ServiceEnv *)env;
    if (!env || strcmp(env->kind, "service") != 0)
        return err_fail(err, err_len, "env_service_fetch_tools: not an environment service");
    HttpResponse resp = {0};
    int rc = post_with_retries(s, s->tools_url, "tools", 0, "{}", 1, &resp, err, err_len);
    if (rc != 0) return rc > 0 ? 0 : -1;   // 404: the service gives no definitions
    char perr[512];
    json_t *tools = NULL;
    rc = env_service_parse_tools(resp.body, resp.body_len, &tools, perr, sizeof perr);
    if (rc != 0) bad_answer(s->tools_url, &resp, perr, err, err_len);
    http_response_free(&resp);
    json_decref(env->tool_schemas);
    env->tool_schemas = tools;
    return rc;
}

static void service_destroy(Environment *env) {
    ServiceEnv *s = (ServiceEnv *)env;
    free(s->reset_url);
    free(s->step_url);
    free(s->tools_url);
    free(s);
}

static const EnvironmentOps SERVICE_OPS = {service_reset, service_step, service_destroy};

static char *join_url(const char *base, const char *tail) {
    size_t n = strlen(base);
    while (n && base[n - 1] == '/') n--;
    char *u = malloc(n + strlen(tail) + 1);
    if (!u) return NULL;
    memcpy(u, base, n);
    strcpy(u + n, tail);
    return u;
}

int env_service_create(Environment **out, const EnvServiceOptions *o, char *err, size_t err_len) {
    *out = NULL;
    HttpUrl u;
    char uerr[512];
    if (!o || !o->url || http_parse_url(o->url, &u, uerr, sizeof uerr) != 0)
        return err_fail(err, err_len, "env_url: %s", o && o->url ? uerr : "no URL given");
    if (!(o->timeout_s > 0) || !(o->connect_timeout_s > 0) || o->max_retries < 0 || !(o->backoff_s >= 0))
        return err_fail(err, err_len, "environment service %s: timeouts must be > 0, retries and backoff >= 0", o->url);
    ServiceEnv *s = calloc(1, sizeof *s);
    if (!s || !(s->reset_url = join_url(o->url, "/reset")) || !(s->step_url = join_url(o->url, "/step")) ||
        !(s->tools_url = join_url(o->url, "/tools"))) {
        if (s) service_destroy(&s->base);
        return err_fail(err, err_len, "environment service: out of memory");
    }
    s->base.ops = &SERVICE_OPS;
    s->base.kind = "service";
    s->opt = *o;
    s->opt.url = NULL;
    *out = &s->base;
    return 0;
}
