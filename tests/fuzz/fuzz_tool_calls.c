// tests/fuzz/fuzz_tool_calls.c — libFuzzer target for tool calls in assistant text (shared/tool_calls.h): what a
// policy writes is arbitrary text, and reading it must never fail or crash.
//
// Input: byte 0 picks the format (hermes, llama3, mistral); the rest is the assistant turn.
// Checks: parsing succeeds; content is set, no longer than the input and valid UTF-8 when the input is; every call
// has a non-empty name and an object of arguments; an error, when set, is non-empty, valid UTF-8 when the input is,
// and short enough to show the policy.
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#include <stdint.h>

#include "fuzz_testlib.h"
#include "shared/tool_calls.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const ToolCallFormat f = (ToolCallFormat)(TOOL_FORMAT_HERMES + data[0] % 3);
    const char *text = (const char *)data + 1;
    const size_t n = size - 1;
    const int utf8 = fuzz_valid_utf8(text, n);
    ToolCallParse p;
    char err[256];
    REQUIRE(tool_calls_parse(f, text, n, &p, err, sizeof err) == 0);
    REQUIRE(p.content && strlen(p.content) <= n);
    if (utf8) REQUIRE(fuzz_valid_utf8(p.content, strlen(p.content)));
    REQUIRE(p.n_calls <= n);
    for (size_t i = 0; i < p.n_calls; i++) {
        REQUIRE(p.calls[i].name && p.calls[i].name[0]);
        REQUIRE(json_is_object(p.calls[i].arguments));
    }
    if (p.error) {
        REQUIRE(p.error[0] && strlen(p.error) < 512);
        if (utf8) REQUIRE(fuzz_valid_utf8(p.error, strlen(p.error)));
    }
    tool_call_parse_free(&p);
    return 0;
}
