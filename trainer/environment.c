// trainer/environment.c — the environment interface and the built-in tools environment (environment.h).
#include "trainer/environment.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"

int env_reset(Environment *env, const EnvResetRequest *req, size_t n, EnvResetResult *out, char *err,
              size_t err_len) {
    memset(out, 0, n * sizeof *out);
    if (n == 0) return 0;
    return env->ops->reset(env, req, n, out, err, err_len);
}

int env_step(Environment *env, const EnvStepRequest *req, size_t n, EnvStepResult *out, char *err, size_t err_len) {
    memset(out, 0, n * sizeof *out);
    for (size_t i = 0; i < n; i++) out[i].reward = NAN;
    if (n == 0) return 0;
    return env->ops->step(env, req, n, out, err, err_len);
}

void env_free(Environment *env) {
    if (!env) return;
    json_decref(env->tool_schemas);
    env->tool_schemas = NULL;
    env->ops->destroy(env);
}

const json_t *env_tool_schemas(const Environment *env) { return env ? env->tool_schemas : NULL; }

void env_reset_result_free(EnvResetResult *r) {
    if (!r) return;
    free(r->observation);
    r->observation = NULL;
}

void env_step_result_free(EnvStepResult *r) {
    if (!r) return;
    for (size_t i = 0; i < r->n_messages; i++) {
        free(r->messages[i].name);
        free(r->messages[i].content);
        free(r->messages[i].call_id);
    }
    free(r->messages);
    r->messages = NULL;
    r->n_messages = 0;
}

typedef struct {
    Environment base;
    ToolBox *tb;
} BuiltinEnv;

static int builtin_reset(Environment *env, const EnvResetRequest *req, size_t n, EnvResetResult *out, char *err,
                         size_t err_len) {
    (void)env, (void)req, (void)n, (void)out, (void)err, (void)err_len;
    return 0;   // the built-in tools keep no per-episode state
}

static int builtin_step(Environment *env, const EnvStepRequest *req, size_t n, EnvStepResult *out, char *err,
                        size_t err_len) {
    BuiltinEnv *b = (BuiltinEnv *)env;
    for (size_t i = 0; i < n; i++) {
        const ToolCallParse *p = req[i].parse;
        size_t k = p ? p->n_calls : 0;
        if (!k) continue;   // never done: an answer without calls ends the episode by itself
        if (!(out[i].messages = calloc(k, sizeof *out[i].messages))) goto oom;
        for (size_t c = 0; c < k; c++) {
            int failed = 0;
            ToolMessage *m = &out[i].messages[out[i].n_messages];
            m->content = toolbox_run(b->tb, &p->calls[c], &failed);
            if (!m->content || !(m->name = strdup(p->calls[c].name)) ||
                (p->calls[c].id && !(m->call_id = strdup(p->calls[c].id)))) {
                free(m->content);
                free(m->name);
                goto oom;
            }
            out[i].n_messages++;
            out[i].n_tool_failures += failed;
        }
    }
    return 0;
oom:
    for (size_t i = 0; i < n; i++) env_step_result_free(&out[i]);
    return err_fail(err, err_len, "built-in tools: out of memory");
}

static void builtin_destroy(Environment *env) {
    BuiltinEnv *b = (BuiltinEnv *)env;
    toolbox_free(b->tb);
    free(b);
}

static const EnvironmentOps BUILTIN_OPS = {builtin_reset, builtin_step, builtin_destroy};

int env_builtin_create(Environment **out, ToolBox *tb, char *err, size_t err_len) {
    *out = NULL;
    BuiltinEnv *b = calloc(1, sizeof *b);
    if (!b) {
        toolbox_free(tb);
        return err_fail(err, err_len, "built-in tools: out of memory");
    }
    b->base.ops = &BUILTIN_OPS;
    b->base.kind = "builtin";
    b->tb = tb;
    if (!(b->base.tool_schemas = toolbox_schemas(tb))) {
        builtin_destroy(&b->base);
        return err_fail(err, err_len, "built-in tools: out of memory");
    }
    *out = &b->base;
    return 0;
}
