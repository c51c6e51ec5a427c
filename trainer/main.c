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

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "launch") == 0) return launch_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "eval") == 0) return eval_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "demo") == 0) return demo_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "keygen") == 0) return control_keygen_main(argc - 1, argv + 1);
    char err[2048];
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
