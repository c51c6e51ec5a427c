// tests/unit/test_cli.c — shared/cli.h: every option type, both value spellings, bounds and choices, required
// options, "--" and the list type, the errors' wording and the --help format.
#define _GNU_SOURCE
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/cli.h"
#include "tests/unit/check_macros.h"

typedef struct {
    const char *name, *mode;
    int count, verbose;
    long long seed;
    double rate;
    CliList extra;
} Opts;

static const CliOption kOptions[] = {
    {.flag = "--name", .type = CLI_TEXT, .offset = offsetof(Opts, name), .value_name = "NAME", .help = "a name",
     .required = 1},
    {.flag = "--mode", .type = CLI_TEXT, .offset = offsetof(Opts, mode), .help = "how", .choices = "fast|slow"},
    {.flag = "--count", .type = CLI_INT, .offset = offsetof(Opts, count), .help = "how many",
     .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = 1, .max = 10},
    {.flag = "--seed", .type = CLI_LONG, .offset = offsetof(Opts, seed), .help = "seed"},
    {.flag = "--rate", .type = CLI_DOUBLE, .offset = offsetof(Opts, rate), .help = "a rate",
     .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = 0, .max = 1, .min_exclusive = 1},
    {.flag = "--verbose", .type = CLI_SWITCH, .offset = offsetof(Opts, verbose), .help = "say more"},
    {.flag = "--extra", .type = CLI_LIST, .offset = offsetof(Opts, extra), .value_name = "ARG", .help = "passed on"},
};
static const CliSpec kSpec = {.command = "tool", .synopsis = "--name NAME [options]", .description = "Does a thing.",
                              .options = kOptions, .n_options = sizeof kOptions / sizeof kOptions[0]};
static const Opts kDefaults = {.mode = "fast", .count = 3, .seed = 7, .rate = 0.5};

// Parses a NULL-terminated argument list (argv[0] = "tool") into *o from the defaults.
static int parse(Opts *o, int *rest, char *err, size_t err_len, ...) {
    char *argv[32] = {"tool"};
    int argc = 1;
    va_list ap;
    va_start(ap, err_len);
    for (const char *a; (a = va_arg(ap, const char *)) && argc < 31;) argv[argc++] = (char *)a;
    va_end(ap);
    *o = kDefaults;
    err[0] = 0;
    return cli_parse(&kSpec, o, argc, argv, rest, err, err_len);
}

#define EXPECT_ERROR(text, ...)                                                                                       \
    do {                                                                                                              \
        CHECK(parse(&o, NULL, err, sizeof err, __VA_ARGS__, NULL) == CLI_ERROR);                                      \
        CHECK(strstr(err, text) != NULL, "error '%s' lacks '%s'", err, text);                                        \
        CHECK(!strncmp(err, "tool: ", 6), "error '%s' does not name the command", err);                              \
        CHECK(strstr(err, "(see --help)") != NULL || strstr(err, "; see --help)") != NULL, "error '%s' lacks --help", err); \
    } while (0)

int main(void) {
    Opts o;
    char err[256];
    int rest = -1;
    // Every type, both spellings.
    CHECK(parse(&o, &rest, err, sizeof err, "--name", "x", "--mode=slow", "--count", "10", "--seed=-5", "--rate",
                "1", "--verbose", "--extra", "--a=1", "--extra=b", NULL) == CLI_OK, "%s", err);
    CHECK(!strcmp(o.name, "x") && !strcmp(o.mode, "slow"));
    CHECK_EQ(o.count, 10);
    CHECK_EQ(o.seed, -5);   // no bounds given: any long long
    CHECK(o.rate == 1.0 && o.verbose == 1);
    CHECK(o.extra.n == 2 && !strcmp(o.extra.items[0], "--a=1") && !strcmp(o.extra.items[1], "b"));
    CHECK_EQ(rest, 13);     // no "--": argc
    // Defaults stay where no option is given; "--" ends the options.
    CHECK(parse(&o, &rest, err, sizeof err, "--name", "y", "--", "--count", "99", NULL) == CLI_OK, "%s", err);
    CHECK(o.count == 3 && o.seed == 7 && o.rate == 0.5 && !o.verbose && o.extra.n == 0);
    CHECK_EQ(rest, 4);
    CHECK(parse(&o, NULL, err, sizeof err, "--count", "x", "-h", NULL) == CLI_ERROR);   // parsed in order
    CHECK(parse(&o, NULL, err, sizeof err, "-h", NULL) == CLI_HELP);
    CHECK(parse(&o, NULL, err, sizeof err, "--help", "--count", "x", NULL) == CLI_HELP);
    CHECK(parse(&o, NULL, err, sizeof err, "--version", NULL) == CLI_VERSION);
    // Errors and their wording.
    EXPECT_ERROR("--name NAME is required", "--count", "2");
    EXPECT_ERROR("unknown option --cuont; did you mean --count? (see --help)", "--name", "x", "--cuont", "2");
    EXPECT_ERROR("unknown option --zzzzzzzz (see --help)", "--name", "x", "--zzzzzzzz");
    EXPECT_ERROR("--count needs a value", "--name", "x", "--count");
    EXPECT_ERROR("--count 'abc' is not an integer", "--name", "x", "--count", "abc");
    EXPECT_ERROR("--count '' is not an integer", "--name", "x", "--count=");
    EXPECT_ERROR("--count '3x' is not an integer", "--name", "x", "--count", "3x");
    EXPECT_ERROR("--count 11 is out of range (1 <= value <= 10; see --help)", "--name", "x", "--count", "11");
    EXPECT_ERROR("--count 99999999999 is out of range", "--name", "x", "--count", "99999999999");
    EXPECT_ERROR("--seed 99999999999999999999999 is out of range", "--name", "x", "--seed", "99999999999999999999999");
    EXPECT_ERROR("--rate 0 is out of range (0 < value <= 1; see --help)", "--name", "x", "--rate", "0");
    EXPECT_ERROR("--rate 'nan' is not a finite number", "--name", "x", "--rate", "nan");
    EXPECT_ERROR("--rate '1e999' is not a finite number", "--name", "x", "--rate", "1e999");
    EXPECT_ERROR("--mode 'medium' is not one of fast|slow", "--name", "x", "--mode", "medium");
    EXPECT_ERROR("--verbose takes no value", "--name", "x", "--verbose=1");
    // The list refuses more than it holds.
    {
        char *argv[CLI_LIST_MAX * 2 + 8] = {"tool", "--name", "x"};   // 3 + 2 * (CLI_LIST_MAX + 1) entries
        int argc = 3;
        for (int i = 0; i <= CLI_LIST_MAX; i++) argv[argc++] = "--extra", argv[argc++] = "v";
        o = kDefaults;
        CHECK(cli_parse(&kSpec, &o, argc, argv, NULL, err, sizeof err) == CLI_ERROR);
        CHECK(strstr(err, "--extra given more than 64 times") != NULL, "%s", err);
    }
    // --help: every option with its value name, help and default; required ones say so; a long help wraps.
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    REQUIRE(f != NULL);
    cli_usage(&kSpec, &kDefaults, f);
    fclose(f);
    CHECK(strstr(text, "usage: tool --name NAME [options]\n\nDoes a thing.\n") == text, "%s", text);
    CHECK(strstr(text, "  --name NAME                  a name (required)\n") != NULL, "%s", text);
    CHECK(strstr(text, "  --mode TEXT                  how (default fast)\n") != NULL, "%s", text);
    CHECK(strstr(text, "  --count N                    how many (default 3)\n") != NULL, "%s", text);
    CHECK(strstr(text, "  --rate FLOAT                 a rate (default 0.5)\n") != NULL, "%s", text);
    CHECK(strstr(text, "  --verbose                    say more (default off)\n") != NULL, "%s", text);
    CHECK(strstr(text, "  --extra ARG                  passed on (repeatable; default none)\n") != NULL, "%s", text);
    CHECK(strstr(text, "  -h, --help ") != NULL && strstr(text, "  --version ") != NULL, "%s", text);
    for (const char *line = text; *line;) {
        const char *nl = strchr(line, '\n');
        size_t n = nl ? (size_t)(nl - line) : strlen(line);
        CHECK(n <= 118, "line of %zu characters: %.*s", n, (int)n, line);
        line += n + (nl != NULL);
    }
    free(text);
    return check_exit_code("test_cli");
}
