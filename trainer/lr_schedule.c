// trainer/lr_schedule.c — warmup + constant / linear / cosine multipliers (see lr_schedule.h).
#include "trainer/lr_schedule.h"

#include <math.h>
#include <string.h>

const char *const lr_schedule_names[LR_SCHED_COUNT + 1] = {
    [LR_SCHED_LINEAR] = "linear",
    [LR_SCHED_COSINE] = "cosine",
    [LR_SCHED_CONSTANT] = "constant",
    [LR_SCHED_CONSTANT_WITH_WARMUP] = "constant_with_warmup",
    [LR_SCHED_COUNT] = NULL,
};

int lr_schedule_parse(const char *name, LrSchedType *out) {
    if (!name) return -1;
    for (int i = 0; i < LR_SCHED_COUNT; i++) {
        if (strcmp(name, lr_schedule_names[i]) == 0) {
            *out = (LrSchedType)i;
            return 0;
        }
    }
    return -1;
}

const char *lr_schedule_name(LrSchedType t) {
    return (t >= 0 && t < LR_SCHED_COUNT) ? lr_schedule_names[t] : "?";
}

long lr_schedule_warmup_steps(double warmup_steps, double warmup_ratio, long total_steps) {
    if (total_steps < 0) total_steps = 0;
    if (warmup_steps >= 1.0) return (long)warmup_steps;  // Python int() truncates toward zero
    if (warmup_steps > 0.0) return (long)ceil((double)total_steps * warmup_steps);
    if (warmup_ratio > 0.0) return (long)ceil((double)total_steps * warmup_ratio);
    return 0;
}

// Python's max(1, n) / max(1.0, n) as a double denominator.
static double den_at_least_one(long n) { return (double)(n > 1 ? n : 1); }

double lr_schedule_factor(LrSchedType t, long step, long warmup, long total) {
    if (t == LR_SCHED_CONSTANT) return 1.0;
    if (step < warmup) return (double)step / den_at_least_one(warmup);
    switch (t) {
    case LR_SCHED_CONSTANT_WITH_WARMUP:
        return 1.0;
    case LR_SCHED_LINEAR: {
        double f = (double)(total - step) / den_at_least_one(total - warmup);
        return f > 0.0 ? f : 0.0;
    }
    case LR_SCHED_COSINE: {
        const double num_cycles = 0.5;
        double progress = (double)(step - warmup) / den_at_least_one(total - warmup);
        // Same association as transformers: math.pi * float(num_cycles) * 2.0 * progress.
        double f = 0.5 * (1.0 + cos(M_PI * num_cycles * 2.0 * progress));
        return f > 0.0 ? f : 0.0;
    }
    default:
        return 1.0;
    }
}

double lr_schedule_lr(LrSchedType t, double base_lr, long step, long warmup, long total) {
    return base_lr * lr_schedule_factor(t, step, warmup, total);
}
