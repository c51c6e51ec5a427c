// tests/reference/tools/trainer_lr_tool.c — prints tandem's learning-rate schedule for the Python reference
// test (tests/reference/test_lr_schedule.py).
//   usage: trainer_lr_tool TYPE BASE_LR WARMUP_STEPS WARMUP_RATIO TOTAL_STEPS N_STEPS
//   stdout: {"warmup": W, "lrs": [lr(0), ..., lr(N_STEPS - 1)]} with 17 significant digits.
#include <stdio.h>
#include <stdlib.h>

#include "trainer/lr_schedule.h"

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s TYPE BASE_LR WARMUP_STEPS WARMUP_RATIO TOTAL_STEPS N_STEPS\n", argv[0]);
        return 2;
    }
    LrSchedType t;
    if (lr_schedule_parse(argv[1], &t) != 0) {
        fprintf(stderr, "unknown schedule '%s'\n", argv[1]);
        return 1;
    }
    double base = strtod(argv[2], NULL), ws = strtod(argv[3], NULL), wr = strtod(argv[4], NULL);
    long total = strtol(argv[5], NULL, 10), n = strtol(argv[6], NULL, 10);
    long warmup = lr_schedule_warmup_steps(ws, wr, total);
    printf("{\"warmup\": %ld, \"lrs\": [", warmup);
    for (long s = 0; s < n; s++) printf("%s%.17g", s ? ", " : "", lr_schedule_lr(t, base, s, warmup, total));
    printf("]}\n");
    return 0;
}
