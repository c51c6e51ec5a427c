// shared/cli.h — the command-line options of tandem's commands (tandem-serve, tandem-train launch / eval / demo):
// one option table per command, one parser, one --help format and one wording of errors.
//
// A command describes its options as a table of CliOption rows pointing into its own options struct (offsetof),
// fills the struct with its defaults, and calls cli_parse. `--flag VALUE` and `--flag=VALUE` are both taken;
// `--help`/`-h` and `--version` are built in; `--` ends the options (what follows is the caller's, e.g. the
// tandem-train options that launch passes on). --help prints every option with its value name, help and the
// default read from the defaults struct, wrapped at 118 columns:
//   usage: tandem-train eval --url URL --data FILE [options]
//   <description>
//     --max-tokens N               most tokens per completion (default 256)
// Errors name the command, the option and the value, and say what would be taken:
//   tandem-train eval: --n 'x' is not an integer (see --help)
//   tandem-train eval: --top-p 1.5 is out of range (0 < value <= 1; see --help)
//   tandem-train demo: unknown option --grpo-stepz; did you mean --grpo-steps? (see --help)
#ifndef TANDEM_SHARED_CLI_H
#define TANDEM_SHARED_CLI_H

#include <stddef.h>
#include <stdio.h>

typedef enum {
    CLI_TEXT,    // const char *: the argv string itself (not copied)
    CLI_INT,     // int
    CLI_LONG,    // long long
    CLI_DOUBLE,  // double (finite)
    CLI_SWITCH,  // int set to 1; takes no value
    CLI_LIST,    // CliList: every occurrence appends its value
} CliType;

#define CLI_LIST_MAX 64
typedef struct {
    const char *items[CLI_LIST_MAX];
    int n;
} CliList;

// Numeric bounds: CLI_BOUND_NONE leaves that side open; min_exclusive turns "min <= v" into "min < v".
#define CLI_BOUND_NONE 0
#define CLI_BOUND_MIN 1
#define CLI_BOUND_MAX 2

typedef struct {
    const char *flag;        // "--max-tokens"
    CliType type;
    size_t offset;           // of the field in the options struct
    const char *value_name;  // "N", "URL", "DIR", ...; NULL: by type (TEXT, N, FLOAT)
    const char *help;        // one line; the default is appended
    int bounds;              // CLI_BOUND_MIN | CLI_BOUND_MAX for numbers
    double min, max;
    int min_exclusive;
    const char *choices;     // text: the values taken, separated by '|' ("auto|cpu|cuda"); NULL: any
    int required;            // --help says "required" instead of a default; cli_parse checks it is given
    const char *default_note; // --help's default when it is not the field's value ("env NNODES, else 1")
} CliOption;

typedef struct {
    const char *command;      // "tandem-train eval": begins every message
    const char *synopsis;     // what follows the command on the usage line: "--url URL --data FILE [options]"
    const char *description;  // printed after the usage line (may be NULL)
    const char *epilog;       // printed after the options (may be NULL)
    const CliOption *options;
    int n_options;
} CliSpec;

enum { CLI_OK = 0, CLI_HELP = 1, CLI_VERSION = 2, CLI_ERROR = -1 };

// Parses argv[1..argc) into opts, which holds the defaults on entry. *rest (may be NULL) gets the index of the first
// argument after "--" (argc when there is none). CLI_HELP / CLI_VERSION when asked for (the caller prints); on
// CLI_ERROR, err holds one line: the command, the option, what is wrong.
int cli_parse(const CliSpec *spec, void *opts, int argc, char **argv, int *rest, char *err, size_t err_len);
// The usage text: synopsis, description, every option with its default taken from `defaults`, --help, --version.
void cli_usage(const CliSpec *spec, const void *defaults, FILE *f);

#endif
