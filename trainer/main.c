// tandem-train — GRPO (and SFT) ranks. One process per device; the launch contract is torchrun's:
// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (a single process needs none of them).
// Options: `tandem-train --help` (docs/configuration.md lists the same table).
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/version.h"
#include "trainer/control_keygen.h"
#include "trainer/demo.h"
#include "trainer/eval.h"
#include "trainer/launch.h"
#include "trainer/trainer.h"

// The file or flags had problems: the rules between options (train_config_finalize) are checked too on what was
// read, so that one run lists every problem. A rule problem of a key already reported is left out (it follows from
// that key not being set).
static void report_with_rule_problems(TrainConfig *cfg, char *err, size_t err_len) {
    const char *ws = getenv("WORLD_SIZE");
    int world = ws && atoi(ws) > 0 ? atoi(ws) : 1;
    static char rules[16384];
    if (train_config_finalize(cfg, world, rules, sizeof rules) == 0) return;
    // The rule report: one problem, or "N problems:" and one per line after "\n  ".
    char *line = rules;
    size_t digits = strspn(rules, "0123456789");
    if (digits && strncmp(rules + digits, " problems:\n  ", 13) == 0) line = rules + digits + 13;
    int added = 0;
    size_t used = strlen(err);
    while (line && *line) {
        char *next = strstr(line, "\n  ");
        if (next) *next = '\0';
        char key[128];
        size_t k = strcspn(line, ": (");
        snprintf(key, sizeof key, "%.*s:", (int)(k < sizeof key - 2 ? k : sizeof key - 2), line);
        if (!strstr(err, key) && used + strlen(line) + 8 < err_len) {
            used += (size_t)snprintf(err + used, err_len - used, "%s%s", added++ ? "\n  " : "\nand by the rules between "
                                     "options:\n  ", line);
        }
        line = next ? next + 3 : NULL;
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "launch") == 0) return launch_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "eval") == 0) return eval_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "demo") == 0) return demo_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "keygen") == 0) return control_keygen_main(argc - 1, argv + 1);
    static char err[32768];
    TrainConfig cfg;
    train_config_default(&cfg);
    int r = train_config_parse_args(&cfg, argc, argv, err, sizeof err);
    if (r == TRAIN_CONFIG_HELP) {
        train_config_print_help(stdout);
        printf("\nThis text and the version:\n  -h, --help\n      this text\n  --version\n      the version of "
               "tandem-train and how it was built\n"
               "\nSubcommands: tandem-train launch --help (servers + ranks of a run on this machine),\n"
               "             tandem-train eval --help (score a held-out set through an OpenAI-compatible server),\n"
               "             tandem-train demo --help (the whole pipeline on a built-in task, no downloads)\n"
               "             tandem-train keygen --help (CURVE keys for the ZeroMQ control channel)\n");
        train_config_free(&cfg);
        return 0;
    }
    if (r == TRAIN_CONFIG_VERSION) {
        tandem_print_version(stdout, "tandem-train");
        train_config_free(&cfg);
        return 0;
    }
    if (r != 0) {
        report_with_rule_problems(&cfg, err, sizeof err);
        fprintf(stderr, "tandem-train: %s\n(run tandem-train --help for every option)\n", err);
        train_config_free(&cfg);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    Trainer t;
    int rc = trainer_open(&t, &cfg, err, sizeof err);
    if (rc == 0) rc = cfg.mode == TRAIN_MODE_SFT ? trainer_run_sft(&t, err, sizeof err) : trainer_run_grpo(&t, err, sizeof err);
    int rank = t.rank;
    if (rc != 0) fprintf(stderr, "tandem-train[rank %d]: %s\n", rank, err);
    else if (rank == 0) fprintf(stderr, "tandem-train: done after %lld steps\n", (long long)t.progress.step);
    trainer_close(&t);
    train_config_free(&cfg);
    return rc == 0 ? 0 : 1;
}
