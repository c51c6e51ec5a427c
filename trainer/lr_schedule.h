// trainer/lr_schedule.h — learning-rate schedules, equal to transformers' get_scheduler (LambdaLR).
//
// transformers builds a LambdaLR whose multiplier at scheduler step s is lambda(s), and the Trainer calls
// scheduler.step() after every optimizer step. So the optimizer step with 0-based index s (the (s+1)-th
// update) uses lr = learning_rate * lambda(s): step 0 uses lambda(0) (0.0 during a warmup), and the
// learning_rate the Trainer logs after step s is the one of step s+1. The multipliers, with W warmup steps
// and T total optimizer steps:
//   constant               1                                          (W is ignored, as transformers does)
//   constant_with_warmup   s < W: s / max(1, W);  else 1
//   linear                 s < W: s / max(1, W);  else max(0, (T - s) / max(1, T - W))
//   cosine                 s < W: s / max(1, W);  else max(0, 0.5 * (1 + cos(pi * 2 * 0.5 * p))),
//                          p = (s - W) / max(1, T - W)   (num_cycles = 0.5: half a cosine down to 0)
// All in double precision, in the same operation order as the Python, so the values are bit-identical.
#ifndef TANDEM_TRAINER_LR_SCHEDULE_H
#define TANDEM_TRAINER_LR_SCHEDULE_H

#include <stddef.h>

typedef enum {
    LR_SCHED_LINEAR = 0,          // transformers' default (TRL's GRPOConfig keeps it)
    LR_SCHED_COSINE,
    LR_SCHED_CONSTANT,
    LR_SCHED_CONSTANT_WITH_WARMUP,
    LR_SCHED_COUNT
} LrSchedType;

// The names lr_scheduler_type accepts, indexed by LrSchedType, NULL-terminated.
extern const char *const lr_schedule_names[LR_SCHED_COUNT + 1];

// Parses a name ("linear", "cosine", "constant", "constant_with_warmup"). Returns 0, or -1 when unknown.
int lr_schedule_parse(const char *name, LrSchedType *out);
const char *lr_schedule_name(LrSchedType t);

// Number of warmup steps as transformers' TrainingArguments computes it from total_steps optimizer steps:
// warmup_steps >= 1 counts steps (truncated to an integer); 0 < warmup_steps < 1 is a ratio of total_steps
// (transformers 5: ceil(total_steps * warmup_steps)); warmup_steps == 0 falls back to warmup_ratio
// (transformers 4's key: ceil(total_steps * warmup_ratio)). Negative inputs count as 0.
long lr_schedule_warmup_steps(double warmup_steps, double warmup_ratio, long total_steps);

// The multiplier lambda(step) described above; step is the 0-based optimizer step.
double lr_schedule_factor(LrSchedType t, long step, long warmup_steps, long total_steps);

// base_lr * lambda(step): the learning rate the optimizer step `step` uses.
double lr_schedule_lr(LrSchedType t, double base_lr, long step, long warmup_steps, long total_steps);

#endif
