// tests/unit/test_tool_calls.c — tool calls out of assistant text: what the real chat templates render for an
// assistant message with tool_calls (Qwen2.5 / Qwen3, Llama 3.1, Mistral v0.3), several calls, and broken calls
// that must become an error the policy reads (never a crash, never a call).
#include <string.h>

#include "check_macros.h"
#include "shared/tool_calls.h"

static ToolCallParse parse(ToolCallFormat f, const char *text) {
    ToolCallParse p;
    char err[256];
    REQUIRE(tool_calls_parse(f, text, strlen(text), &p, err, sizeof err) == 0, "%s", err);
    return p;
}

static int args_equal(const ToolCall *c, const char *json) {
    json_error_t je;
    json_t *want = json_loads(json, 0, &je);
    int eq = want && json_equal(c->arguments, want);
    json_decref(want);
    return eq;
}

static void test_hermes(void) {
    // Qwen2.5's template for {"role": "assistant", "content": "Let me check.", "tool_calls": [two calls]}.
    ToolCallParse p = parse(TOOL_FORMAT_HERMES,
                            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                            "\"Paris\", \"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"calculator\", "
                            "\"arguments\": {\"expression\": \"12345678 * 87654321\"}}\n</tool_call><|im_end|>\n");
    CHECK(p.error == NULL, "%s", p.error);
    REQUIRE(p.n_calls == 2);
    CHECK(strcmp(p.calls[0].name, "get_weather") == 0);
    CHECK(args_equal(&p.calls[0], "{\"city\": \"Paris\", \"days\": 3}"));
    CHECK(strcmp(p.calls[1].name, "calculator") == 0);
    CHECK(args_equal(&p.calls[1], "{\"expression\": \"12345678 * 87654321\"}"));
    CHECK(strcmp(p.content, "Let me check.") == 0, "content '%s'", p.content);
    tool_call_parse_free(&p);

    p = parse(TOOL_FORMAT_HERMES, "The answer is 4.<|im_end|>");
    CHECK(p.n_calls == 0 && p.error == NULL);
    CHECK(strcmp(p.content, "The answer is 4.") == 0);
    tool_call_parse_free(&p);

    // Arguments as a JSON string (the OpenAI wire form) and no arguments at all.
    p = parse(TOOL_FORMAT_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>"
                                  "<tool_call>{\"name\": \"g\"}</tool_call>");
    REQUIRE(p.n_calls == 2);
    CHECK(args_equal(&p.calls[0], "{\"x\": 1}"));
    CHECK(args_equal(&p.calls[1], "{}"));
    tool_call_parse_free(&p);

    // Broken: bad JSON (the first good call is kept), no name, arguments not an object, unclosed tag.
    p = parse(TOOL_FORMAT_HERMES, "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
                                  "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": 2+2}\n"
                                  "</tool_call>");
    CHECK(p.n_calls == 1);
    CHECK(p.error && strstr(p.error, "tool call 2 is not valid JSON"), "%s", p.error);
    tool_call_parse_free(&p);
    p = parse(TOOL_FORMAT_HERMES, "<tool_call>{\"arguments\": {}}</tool_call>");
    CHECK(p.n_calls == 0 && p.error && strstr(p.error, "no \"name\""), "%s", p.error);
    tool_call_parse_free(&p);
    p = parse(TOOL_FORMAT_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>");
    CHECK(p.n_calls == 0 && p.error && strstr(p.error, "must be a JSON object"), "%s", p.error);
    tool_call_parse_free(&p);
    p = parse(TOOL_FORMAT_HERMES, "<tool_call>\n{\"name\": \"calculator\", \"argu");
    CHECK(p.n_calls == 0 && p.error && strstr(p.error, "no closing </tool_call>"), "%s", p.error);
    tool_call_parse_free(&p);
}

static void test_llama3(void) {
    // Llama 3.1's template for an assistant message with one tool call.
    ToolCallParse p = parse(TOOL_FORMAT_LLAMA3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"
                                                "<|eot_id|>");
    CHECK(p.error == NULL, "%s", p.error);
    REQUIRE(p.n_calls == 1);
    CHECK(strcmp(p.calls[0].name, "get_weather") == 0);
    CHECK(args_equal(&p.calls[0], "{\"city\": \"Paris\"}"));
    CHECK(strcmp(p.content, "") == 0);
    tool_call_parse_free(&p);

    p = parse(TOOL_FORMAT_LLAMA3, "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; "
                                  "{\"name\": \"b\", \"parameters\": {}}<|eom_id|>");
    REQUIRE(p.n_calls == 2, "%zu %s", p.n_calls, p.error);
    CHECK(strcmp(p.calls[1].name, "b") == 0);
    tool_call_parse_free(&p);

    p = parse(TOOL_FORMAT_LLAMA3, "The weather in Paris is sunny.<|eot_id|>");
    CHECK(p.n_calls == 0 && p.error == NULL && strcmp(p.content, "The weather in Paris is sunny.") == 0);
    tool_call_parse_free(&p);
    p = parse(TOOL_FORMAT_LLAMA3, "{\"answer\": 4}");   // JSON without a name: an answer, not a call
    CHECK(p.n_calls == 0 && p.error == NULL && strcmp(p.content, "{\"answer\": 4}") == 0);
    tool_call_parse_free(&p);

    p = parse(TOOL_FORMAT_LLAMA3, "{\"name\": \"calculator\", \"parameters\": {\"expression\": \"1+");
    CHECK(p.n_calls == 0 && p.error && strstr(p.error, "not valid JSON"), "%s", p.error);
    tool_call_parse_free(&p);
    p = parse(TOOL_FORMAT_LLAMA3, "<|python_tag|>print(2+2)");
    CHECK(p.n_calls == 0 && p.error && strstr(p.error, "not a JSON function call"), "%s", p.error);
    tool_call_parse_free(&p);
}

static void test_mistral(void) {
    // Mistral v0.3's template: [TOOL_CALLS] [calls with 9-character ids]</s>.
    ToolCallParse p = parse(TOOL_FORMAT_MISTRAL,
                            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": "
                            "\"abcDEF123\"}, {\"name\": \"calculator\", \"arguments\": {\"expression\": \"1+1\"}, "
                            "\"id\": \"xyz987654\"}]</s>");
    CHECK(p.error == NULL, "%s", p.error);
    REQUIRE(p.n_calls == 2);
    CHECK(strcmp(p.calls[0].id, "abcDEF123") == 0);
    CHECK(strcmp(p.calls[1].name, "calculator") == 0);
    CHECK(args_equal(&p.calls[1], "{\"expression\": \"1+1\"}"));
    tool_call_parse_free(&p);

    // v11 tokenizers: [TOOL_CALLS]name[ARGS]{...}, repeated.
    p = parse(TOOL_FORMAT_MISTRAL, "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}"
                                   "[TOOL_CALLS]lookup[CALL_ID]k12345678[ARGS]{\"key\": \"x\"}</s>");
    REQUIRE(p.n_calls == 2, "%zu %s", p.n_calls, p.error);
    CHECK(strcmp(p.content, "Sure.") == 0);
    CHECK(strcmp(p.calls[1].name, "lookup") == 0 && strcmp(p.calls[1].id, "k12345678") == 0);
    CHECK(args_equal(&p.calls[0], "{\"city\": \"Rome\"}"));
    tool_call_parse_free(&p);

    p = parse(TOOL_FORMAT_MISTRAL, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {]");
    CHECK(p.n_calls == 0 && p.error && strstr(p.error, "not valid JSON"), "%s", p.error);
    tool_call_parse_free(&p);
    p = parse(TOOL_FORMAT_MISTRAL, "[TOOL_CALLS] get_weather {\"city\": 1}");
    CHECK(p.n_calls == 0 && p.error && strstr(p.error, "neither a JSON list"), "%s", p.error);
    tool_call_parse_free(&p);
}

static void test_names_and_garbage(void) {
    ToolCallFormat f;
    char err[256];
    CHECK(tool_call_format_from_name("llama3", &f, err, sizeof err) == 0 && f == TOOL_FORMAT_LLAMA3);
    CHECK(tool_call_format_from_name("qwen", &f, err, sizeof err) == -1 && strstr(err, "hermes"));
    // Every prefix of a call, in every format: an answer, never a crash.
    const char *texts[] = {("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, {\"b\": \"\\u00e9\"}]}}\n"
                            "</tool_call>"),
                           "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": 1}}; {\"name\": \"g\"}",
                           "[TOOL_CALLS]f[CALL_ID]123456789[ARGS]{\"a\": 1}[TOOL_CALLS] [{\"name\": \"g\"}]"};
    for (int t = 0; t < 3; t++)
        for (size_t n = 0; n <= strlen(texts[t]); n++)
            for (int fmt = TOOL_FORMAT_HERMES; fmt <= TOOL_FORMAT_MISTRAL; fmt++) {
                ToolCallParse p;
                REQUIRE(tool_calls_parse((ToolCallFormat)fmt, texts[t], n, &p, err, sizeof err) == 0);
                CHECK(p.content != NULL);
                tool_call_parse_free(&p);
            }
}

int main(void) {
    test_hermes();
    test_llama3();
    test_mistral();
    test_names_and_garbage();
    return check_exit_code("test_tool_calls");
}
