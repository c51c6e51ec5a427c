// trainer/tool_builtin.c — the calculator and lookup tools (tool_builtin.h).
#include "trainer/tool_builtin.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"
#include "trainer/tool_calculator.h"

#define LOOKUP_KEYS_SHOWN 8

struct ToolBox {
    json_t *table;   // NULL: no lookup tool
};

int toolbox_create(ToolBox **out, const json_t *lookup_table, char *err, size_t err_len) {
    *out = NULL;
    if (lookup_table && !json_is_object(lookup_table))
        return err_fail(err, err_len, "the lookup table must be a JSON object of key -> value");
    ToolBox *tb = calloc(1, sizeof *tb);
    if (!tb || (lookup_table && !(tb->table = json_deep_copy(lookup_table)))) {
        free(tb);
        return err_fail(err, err_len, "toolbox: out of memory");
    }
    *out = tb;
    return 0;
}

void toolbox_free(ToolBox *tb) {
    if (!tb) return;
    json_decref(tb->table);
    free(tb);
}

// One tool's definition in the shape transformers' get_json_schema derives from a typed Python function with a
// Google-style docstring (what TRL renders for tools=[f]): {"type": "function", "function": {"name", "description",
// "parameters": {"type": "object", "properties": {arg: {"type": "string", "description"}}, "required": [arg]},
// "return": {"type": "string", "description"}}}. Keys in that order: the templates' tojson writes them as given.
static json_t *schema(const char *name, const char *description, const char *arg, const char *arg_description,
                      const char *returns) {
    return json_pack("{s:s, s:{s:s, s:s, s:{s:s, s:{s:{s:s, s:s}}, s:[s]}, s:{s:s, s:s}}}", "type", "function",
                     "function", "name", name, "description", description, "parameters", "type", "object",
                     "properties", arg, "type", "string", "description", arg_description, "required", arg, "return",
                     "type", "string", "description", returns);
}

json_t *toolbox_schemas(const ToolBox *tb) {
    json_t *list = json_array();
    if (!list) return NULL;
    json_t *calc = schema("calculator", "Evaluates an arithmetic expression exactly.", "expression",
                          "The expression: integers or decimals with + - * / % // ^ ** and parentheses, e.g. "
                          "\"123456789 * 987654321\".",
                          "The exact result (integers up to 38 digits), or {\"error\": ...} when it cannot be "
                          "computed.");
    json_t *lookup = tb->table ? schema("lookup", "Returns the value stored under a key in a small table.", "key",
                                        "The key to look up.", "The value, or {\"error\": ...} naming known keys.")
                               : NULL;
    if (!calc || json_array_append_new(list, calc) != 0 || (tb->table && (!lookup ||
                                                                          json_array_append_new(list, lookup) != 0))) {
        json_decref(list);
        return NULL;
    }
    return list;
}

char *tool_error_text(const char *message) {
    json_t *o = json_pack("{s:s}", "error", message);
    char *s = o ? json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
    json_decref(o);
    return s;
}

static char *fail(int *failed, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static char *fail(int *failed, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    *failed = 1;
    return tool_error_text(buf);
}

// The one string argument a tool takes; NULL after setting *answer to the error.
static const char *string_arg(const ToolCall *call, const char *arg, int *failed, char **answer) {
    json_t *v = json_object_get(call->arguments, arg);
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_number(v) && strcmp(arg, "expression") == 0) return NULL;   // caller prints the number
    *answer = fail(failed, "%s needs the argument \"%s\" (a string)%s", call->name, arg,
                   v ? "; it was given another type" : "");
    return NULL;
}

static char *run_calculator(const ToolCall *call, int *failed) {
    char *answer = NULL;
    const char *expr = string_arg(call, "expression", failed, &answer);
    char num[64];
    if (!expr && answer) return answer;
    if (!expr) {  // a bare number as the expression: evaluate its text
        char *t = json_dumps(json_object_get(call->arguments, "expression"), JSON_ENCODE_ANY);
        snprintf(num, sizeof num, "%s", t ? t : "");
        free(t);
        expr = num;
    }
    char out[512];
    if (calculator_eval(expr, out, sizeof out) != 0) return fail(failed, "calculator: %s", out);
    return strdup(out);
}

static char *run_lookup(const ToolBox *tb, const ToolCall *call, int *failed) {
    char *answer = NULL;
    const char *key = string_arg(call, "key", failed, &answer);
    if (!key) return answer;
    json_t *v = json_object_get(tb->table, key);
    if (!v) {
        char known[512] = "";
        size_t shown = 0;
        const char *k;
        json_t *val;
        json_object_foreach(tb->table, k, val) {
            if (shown++ == LOOKUP_KEYS_SHOWN) {
                strncat(known, ", ...", sizeof known - strlen(known) - 1);
                break;
            }
            if (shown > 1) strncat(known, ", ", sizeof known - strlen(known) - 1);
            strncat(known, k, sizeof known - strlen(known) - 1);
        }
        (void)val;
        return fail(failed, "lookup: no entry for key '%s'; known keys: %s", key, known);
    }
    if (json_is_string(v)) return strdup(json_string_value(v));
    return json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
}

char *toolbox_run(const ToolBox *tb, const ToolCall *call, int *failed) {
    *failed = 0;
    if (strcmp(call->name, "calculator") == 0) return run_calculator(call, failed);
    if (strcmp(call->name, "lookup") == 0 && tb->table) return run_lookup(tb, call, failed);
    return fail(failed, "Tool %s not found: the tools are calculator%s", call->name, tb->table ? " and lookup" : "");
}
