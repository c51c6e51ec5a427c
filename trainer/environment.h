// trainer/environment.h — what a multi-turn rollout talks to: an environment that starts an episode per prompt row
// (reset) and answers each assistant turn (step) with tool messages, whether the episode is over, and a reward.
//
// Two kinds: the built-in tools (tool_builtin.h: runs the turn's tool calls; gives no reward, the reward functions
// score the final answer) and an HTTP service in any language (env_service.h, protocol in docs/environments.md).
// Calls are batched: one reset or step call carries every episode that needs one, so a service sees many
// episodes in flight at once.
#ifndef TANDEM_TRAINER_ENVIRONMENT_H
#define TANDEM_TRAINER_ENVIRONMENT_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "shared/tool_calls.h"
#include "trainer/tool_builtin.h"

typedef struct {
    char *name;      // malloc'd: the tool that answered ("" when unknown)
    char *content;   // malloc'd: the answer, rendered as a tool message
    char *call_id;   // malloc'd, or NULL: the id of the call it answers (Mistral templates need it)
} ToolMessage;

typedef struct {
    const char *episode_id;  // unique within the run
    const json_t *row;       // the dataset row (an object; NULL: none)
    uint64_t seed;
} EnvResetRequest;

typedef struct {
    char *observation;       // malloc'd, or NULL: text to append to the prompt's last user message (as TRL does
                             // with what an environment's reset returns)
} EnvResetResult;

typedef struct {
    const char *episode_id;
    int turn;                     // 1 for the first assistant turn
    const char *message;          // the assistant turn as text (end-of-turn token removed)
    const ToolCallParse *parse;   // its tool calls (the readable ones) and the parse error, if any
} EnvStepRequest;

typedef struct {
    ToolMessage *messages;        // the answers to the turn (one per call for the built-in tools)
    size_t n_messages;
    int done;                     // the environment ends the episode
    double reward;                // NAN: none
    int n_tool_failures;          // calls that answered an error
} EnvStepResult;

typedef struct Environment Environment;

typedef struct {
    int (*reset)(Environment *env, const EnvResetRequest *req, size_t n, EnvResetResult *out, char *err,
                 size_t err_len);
    int (*step)(Environment *env, const EnvStepRequest *req, size_t n, EnvStepResult *out, char *err, size_t err_len);
    void (*destroy)(Environment *env);
} EnvironmentOps;

struct Environment {
    const EnvironmentOps *ops;
    const char *kind;        // "builtin" or "service"
    json_t *tool_schemas;    // owned, or NULL: the tools' definitions [{"type": "function", "function": {...}}] for
                             // the prompt (the built-in tools' always; a service's when it answers POST <url>/tools)
};

// Both fill out[0..n) (zeroed first) or fail with -1 and a message; on failure out holds nothing to free.
int env_reset(Environment *env, const EnvResetRequest *req, size_t n, EnvResetResult *out, char *err,
              size_t err_len);
int env_step(Environment *env, const EnvStepRequest *req, size_t n, EnvStepResult *out, char *err, size_t err_len);
void env_free(Environment *env);
// The tools' definitions (borrowed), or NULL when the environment gives none.
const json_t *env_tool_schemas(const Environment *env);
void env_reset_result_free(EnvResetResult *r);
void env_step_result_free(EnvStepResult *r);

// The built-in tools. Takes ownership of tb.
int env_builtin_create(Environment **out, ToolBox *tb, char *err, size_t err_len);

#endif
