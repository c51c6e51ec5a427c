// tests/reference/tools/tool_calls_cli.c — drives shared/tool_calls for the Python reference tests.
//
// One JSON request per line on stdin, one JSON answer per line on stdout:
//   {"format": "hermes"|"llama3"|"mistral", "text": "..."}
//     -> {"content": "...", "tool_calls": [{"name": ..., "arguments": {...}, "id"?: ...}], "error": "..."|null}
// A bad request answers {"failure": "..."}.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/tool_calls.h"

static json_t *answer(const char *line) {
    json_error_t je;
    json_t *req = json_loads(line, 0, &je);
    char err[256];
    ToolCallFormat f;
    json_t *text = req ? json_object_get(req, "text") : NULL;
    if (!json_is_string(text) ||
        tool_call_format_from_name(json_string_value(json_object_get(req, "format")), &f, err, sizeof err) != 0) {
        json_decref(req);
        return json_pack("{s:s}", "failure", req ? "need \"format\" and \"text\"" : "not JSON");
    }
    ToolCallParse p;
    if (tool_calls_parse(f, json_string_value(text), json_string_length(text), &p, err, sizeof err) != 0) {
        json_decref(req);
        return json_pack("{s:s}", "failure", err);
    }
    json_t *calls = json_array();
    for (size_t i = 0; i < p.n_calls; i++) {
        json_t *c = json_pack("{s:s, s:O}", "name", p.calls[i].name, "arguments", p.calls[i].arguments);
        if (p.calls[i].id) json_object_set_new(c, "id", json_string(p.calls[i].id));
        json_array_append_new(calls, c);
    }
    json_t *out = json_pack("{s:s, s:o, s:o}", "content", p.content, "tool_calls", calls, "error",
                            p.error ? json_string(p.error) : json_null());
    tool_call_parse_free(&p);
    json_decref(req);
    return out;
}

int main(void) {
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0) {
        json_t *out = answer(line);
        char *s = json_dumps(out, JSON_COMPACT);
        printf("%s\n", s);
        fflush(stdout);
        free(s);
        json_decref(out);
    }
    free(line);
    return 0;
}
