// tests/unit/test_trainer_tools.c — the built-in calculator (values as Python computes them, except that an even
// integer division stays an integer) and its refusals, the lookup tool, and the built-in tools environment.
#include <math.h>
#include <string.h>

#include "check_macros.h"
#include "trainer/environment.h"
#include "trainer/tool_calculator.h"

static void check_value(const char *expr, const char *want) {
    char out[256];
    int rc = calculator_eval(expr, out, sizeof out);
    CHECK(rc == 0 && strcmp(out, want) == 0, "%s -> %s (rc %d), want %s", expr, out, rc, want);
}

static void check_refused(const char *expr, const char *part) {
    char out[256];
    int rc = calculator_eval(expr, out, sizeof out);
    CHECK(rc == -1 && strstr(out, part), "%s -> %s (rc %d), want an error with '%s'", expr, out, rc, part);
}

static void test_calculator(void) {
    check_value("2+3*4", "14");
    check_value("(2+3)*4", "20");
    check_value("-2**2", "-4");
    check_value("2**-1", "0.5");
    check_value("7//2", "3");
    check_value("-7//2", "-4");
    check_value("-7%3", "2");
    check_value("7%-3", "-2");
    check_value("10/4", "2.5");
    check_value("10/5", "2");
    check_value("1e3+1", "1001.0");
    check_value(".5+5.", "5.5");
    check_value("2^10", "1024");
    check_value(" 99999999999999999999 * 99999999999999999 ", "9999999999999999899900000000000000001");
    check_value("0.1+0.2", "0.30000000000000004");
    check_value("1/3", "0.3333333333333333");
    check_value("3*-2", "-6");
    check_value("2**0.5", "1.4142135623730951");
    check_value("-(-(3))", "3");
    check_value("100000000000000000000000000000000000000//7", "14285714285714285714285714285714285714");
    check_refused("1/0", "division by zero");
    check_refused("5 % 0", "division by zero");
    check_refused("1.5 % 2", "needs integers");
    check_refused("2+", "ends too early");
    check_refused("2 + x", "unexpected 'x' at position 5");
    check_refused("(1+2", "')' is missing");
    check_refused("1+2)", "unmatched ')' at position 4");
    check_refused("__import__('os')", "unexpected '_'");
    check_refused("10**40", "larger than 38 digits");
    check_refused("99999999999999999999*99999999999999999999", "larger than 38 digits");
    check_refused("1e308*10", "not a finite number");
    check_refused("0**-1", "negative power");
    char deep[300];
    memset(deep, '(', 200);
    strcpy(deep + 200, "1");
    check_refused(deep, "nested deeper");
    char long_expr[CALCULATOR_MAX_CHARS + 10];
    memset(long_expr, '1', sizeof long_expr - 1);
    long_expr[sizeof long_expr - 1] = '\0';
    check_refused(long_expr, "at most 1000");
}

static ToolCall make_call(const char *name, const char *args_json) {
    json_error_t je;
    ToolCall c = {.name = (char *)name, .arguments = json_loads(args_json, 0, &je)};
    return c;
}

static void test_builtin_env(void) {
    char err[256];
    json_t *table = json_pack("{s:s, s:[i,i]}", "pi", "3.14159", "list", 1, 2);
    ToolBox *tb = NULL;
    REQUIRE(toolbox_create(&tb, table, err, sizeof err) == 0, "%s", err);
    json_decref(table);
    json_t *schemas = toolbox_schemas(tb);
    CHECK(json_array_size(schemas) == 2);
    CHECK(strcmp(json_string_value(json_object_get(json_object_get(json_array_get(schemas, 1), "function"), "name")),
                 "lookup") == 0);
    json_decref(schemas);

    ToolCall calls[4] = {make_call("lookup", "{\"key\": \"list\"}"), make_call("calculator", "{\"expression\": 12}"),
                         make_call("calculator", "{\"expr\": \"1\"}"), make_call("lookup", "{\"key\": \"e\"}")};
    ToolCallParse parse = {.content = "", .calls = calls, .n_calls = 4};
    Environment *env = NULL;
    REQUIRE(env_builtin_create(&env, tb, err, sizeof err) == 0);
    EnvStepRequest req[2] = {{.episode_id = "a", .turn = 1, .message = "...", .parse = &parse},
                             {.episode_id = "b", .turn = 1, .message = "42", .parse = NULL}};
    EnvStepResult out[2];
    REQUIRE(env_step(env, req, 2, out, err, sizeof err) == 0, "%s", err);
    REQUIRE(out[0].n_messages == 4);
    CHECK(strcmp(out[0].messages[0].content, "[1,2]") == 0, "%s", out[0].messages[0].content);
    CHECK(strcmp(out[0].messages[1].content, "12") == 0, "%s", out[0].messages[1].content);
    CHECK(strstr(out[0].messages[2].content, "needs the argument \\\"expression\\\""), "%s",
          out[0].messages[2].content);
    CHECK(strstr(out[0].messages[3].content, "no entry for key 'e'; known keys: pi, list"), "%s",
          out[0].messages[3].content);
    CHECK(out[0].n_tool_failures == 2 && !out[0].done && isnan(out[0].reward));
    CHECK(out[1].n_messages == 0 && !out[1].done);
    for (int i = 0; i < 2; i++) env_step_result_free(&out[i]);
    for (int i = 0; i < 4; i++) json_decref(calls[i].arguments);
    env_free(env);

    json_t *not_object = json_array();
    CHECK(toolbox_create(&tb, not_object, err, sizeof err) == -1 && strstr(err, "JSON object"));
    json_decref(not_object);
}

int main(void) {
    test_calculator();
    test_builtin_env();
    return check_exit_code("test_trainer_tools");
}
