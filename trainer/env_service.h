// trainer/env_service.h — an environment served over HTTP (--env-url), written in any language. The protocol is
// docs/environments.md; in short, both calls are POST with a JSON body, batched over episodes:
//   <url>/reset  {"episodes": [{"episode_id": "...", "seed": 123, "row": {...dataset row...}}, ...]}
//             -> {"episodes": [{"episode_id": "...", "observation": "text" | null}, ...]}
//   <url>/step   {"steps": [{"episode_id": "...", "turn": 1, "message": "assistant text",
//                            "tool_calls": [{"name": "...", "arguments": {...}}], "tool_call_error": null}, ...]}
//             -> {"steps": [{"episode_id": "...", "observations": [{"name": "...", "content": "..."}],
//                            "done": false, "reward": null}, ...]}
//   <url>/tools  {} -> {"tools": [{"type": "function", "function": {...}}, ...]}   (optional: a 404 means none)
// Answers list the episodes in request order with the same ids; anything else (a missing field, a wrong type,
// another count or order) is an error naming the URL, the entry and the field, never a guess.
// Failures: connection errors, timeouts, HTTP 5xx and 429 are retried up to max_retries times after backoff_s,
// doubled each time (capped at 30 s), as for the reward service; a retried call is sent byte for byte again, so a
// service answers a repeated (episode_id, turn) as it did the first time. Other statuses and malformed answers
// are not retried. A call that cannot get an answer fails the round with the last error.
#ifndef TANDEM_TRAINER_ENV_SERVICE_H
#define TANDEM_TRAINER_ENV_SERVICE_H

#include <stddef.h>

#include "trainer/environment.h"

typedef struct {
    const char *url;            // http://host:port[/prefix]: the calls go to <url>/reset and <url>/step
    double timeout_s;           // per attempt, after connecting (> 0)
    double connect_timeout_s;   // per attempt (> 0)
    int max_retries;            // extra attempts after the first (>= 0)
    double backoff_s;           // wait before the first retry (>= 0), doubled for each further one
    size_t max_response_bytes;  // 0: HTTP_DEFAULT_MAX_RESPONSE_BYTES
} EnvServiceOptions;

void env_service_options_default(EnvServiceOptions *o);
// Optional third call: POST <url>/tools with {} -> {"tools": [{"type": "function", "function": {"name", "description",
// "parameters"}}, ...]}, the tools' definitions for the prompt (env->tool_schemas; none for a 404, an empty list or
// null). Retried as the other calls; a malformed answer is an error naming the entry and field.
int env_service_fetch_tools(Environment *env, char *err, size_t err_len);
int env_service_create(Environment **out, const EnvServiceOptions *o, char *err, size_t err_len);

// The request bodies and the answer readers env_service sends and uses (malloc'd JSON text; NULL: no memory).
char *env_service_reset_json(const EnvResetRequest *req, size_t n);
char *env_service_step_json(const EnvStepRequest *req, size_t n);
// 0, or -1 with a message naming the entry and field that are wrong (out is left with nothing to free).
int env_service_parse_reset(const char *body, size_t len, const EnvResetRequest *req, size_t n, EnvResetResult *out,
                            char *err, size_t err_len);
// The /tools answer: *out the list (new reference) or NULL when it holds none.
int env_service_parse_tools(const char *body, size_t len, json_t **out, char *err, size_t err_len);
int env_service_parse_step(const char *body, size_t len, const EnvStepRequest *req, size_t n, EnvStepResult *out,
                           char *err, size_t err_len);

#endif
