// tests/fuzz/fuzz_trainer_env_reply.c — libFuzzer target for what reaches tandem-train from outside in a multi-turn
// rollout: an environment service's answers (trainer/env_service.h: env_service_parse_reset and
// env_service_parse_step for a batch of episodes, env_service_parse_tools for its tool definitions) and the
// calculator's expressions (trainer/tool_calculator.h), which the policy writes.
//
// Input: byte 0 = what: bit 0 reset (else step), bits 1-2 = episodes - 1, bit 3 = the calculator instead, bit 4 =
// the /tools answer instead; the rest is the answer body (or the expression).
// Checks: a refusal comes with a message and leaves nothing to free; an accepted answer has an entry per episode:
// observations with strings, a step that is not done has observations when its turn made calls, a reward that is
// a number or NaN. An accepted /tools answer is NULL or a non-empty list of {"type": "function", "function": {"name":
// a non-empty string, "parameters": an object when present}}. The calculator answers 0 with a number that reads back whole, or -1 with a message; its output
// is NUL-terminated inside the buffer.
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#include <math.h>
#include <stdint.h>

#include "fuzz_testlib.h"
#include "trainer/env_service.h"
#include "trainer/tool_calculator.h"

static void fuzz_calculator(const char *text, size_t n) {
    char *expr = malloc(n + 1);
    REQUIRE(expr);
    memcpy(expr, text, n);
    expr[n] = '\0';
    char out[128];
    memset(out, 'x', sizeof out);
    int rc = calculator_eval(expr, out, sizeof out);
    REQUIRE(rc == 0 || rc == -1);
    REQUIRE(memchr(out, '\0', sizeof out) != NULL && out[0] != '\0');
    if (rc == 0) {
        char *end = NULL;
        double v = strtod(out, &end);
        REQUIRE(end && *end == '\0' && isfinite(v));
    }
    free(expr);
}

static void fuzz_tools(const char *body, size_t len) {
    json_t *tools = NULL;
    char err[512] = "";
    if (env_service_parse_tools(body, len, &tools, err, sizeof err) != 0) {
        REQUIRE(err[0] && tools == NULL);
        return;
    }
    if (!tools) return;
    REQUIRE(json_is_array(tools) && json_array_size(tools) > 0);
    for (size_t i = 0; i < json_array_size(tools); i++) {
        const json_t *fn = json_object_get(json_array_get(tools, i), "function");
        const json_t *name = json_object_get(fn, "name"), *params = json_object_get(fn, "parameters");
        REQUIRE(json_is_string(name) && json_string_length(name) > 0);
        REQUIRE(!params || json_is_object(params));
    }
    json_decref(tools);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const char *body = (const char *)data + 1;
    const size_t len = size - 1, n = 1 + ((data[0] >> 1) & 3);
    if (data[0] & 16) {
        char *copy = malloc(len + 1);   // exact size and NUL-terminated, as http_post returns a body
        REQUIRE(copy);
        memcpy(copy, body, len);
        copy[len] = '\0';
        fuzz_tools(copy, len);
        free(copy);
        return 0;
    }
    if (data[0] & 8) {
        fuzz_calculator(body, len);
        return 0;
    }
    char *copy = malloc(len + 1);   // an exact-size, NUL-terminated body, as http_post returns it
    REQUIRE(copy);
    memcpy(copy, body, len);
    copy[len] = '\0';
    static const char *const ids[4] = {"e0", "e1", "e2", "e3"};
    char err[512];
    if (data[0] & 1) {
        EnvResetRequest req[4];
        EnvResetResult out[4];
        for (size_t i = 0; i < n; i++) req[i] = (EnvResetRequest){.episode_id = ids[i], .seed = i};
        err[0] = '\0';
        if (env_service_parse_reset(copy, len, req, n, out, err, sizeof err) != 0) {
            REQUIRE(err[0]);
            for (size_t i = 0; i < n; i++) REQUIRE(out[i].observation == NULL);
        } else {
            for (size_t i = 0; i < n; i++) env_reset_result_free(&out[i]);
        }
    } else {
        ToolCall call = {.name = "calculator", .arguments = json_object()};
        ToolCallParse with_call = {.content = "", .calls = &call, .n_calls = 1};
        EnvStepRequest req[4];
        EnvStepResult out[4];
        for (size_t i = 0; i < n; i++)
            req[i] = (EnvStepRequest){.episode_id = ids[i], .turn = 1, .message = "m",
                                      .parse = i % 2 ? &with_call : NULL};
        err[0] = '\0';
        if (env_service_parse_step(copy, len, req, n, out, err, sizeof err) != 0) {
            REQUIRE(err[0]);
            for (size_t i = 0; i < n; i++) REQUIRE(out[i].messages == NULL && out[i].n_messages == 0);
        } else {
            for (size_t i = 0; i < n; i++) {
                REQUIRE(isnan(out[i].reward) || isfinite(out[i].reward));
                if (i % 2 && !out[i].done) REQUIRE(out[i].n_messages > 0);
                for (size_t m = 0; m < out[i].n_messages; m++)
                    REQUIRE(out[i].messages[m].name && out[i].messages[m].content);
                env_step_result_free(&out[i]);
            }
        }
        json_decref(call.arguments);
    }
    free(copy);
    return 0;
}
