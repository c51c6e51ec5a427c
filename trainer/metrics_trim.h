// trainer/metrics_trim.h — metrics.jsonl as a resumed run finds it.
//
// A run that stopped after checkpoint-N had already appended the rows of steps N+1.. to metrics.jsonl; resumed
// from checkpoint-N, the run logs those steps again. So at resume the file is cut back to the rows of steps
// <= N, and then holds every step once. The cut is atomic: the kept rows go to metrics.jsonl.tmp, which is
// fsynced and renamed over metrics.jsonl (a stop during the cut leaves the old file whole).
#ifndef TANDEM_TRAINER_METRICS_TRIM_H
#define TANDEM_TRAINER_METRICS_TRIM_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    size_t kept;         // rows with "step" <= the resume step, kept byte for byte
    size_t later;        // rows with a later step: removed
    size_t unreadable;   // lines that are not a JSON object with an integer "step" (a row cut short by the
                         // stop): removed
} MetricsTrim;

// Keeps in path (a metrics.jsonl) only the rows with "step" <= last_step. A path that does not exist is fine
// (all counts 0); a file with nothing to remove is left untouched. Returns 0, or -1 with a message naming the
// file.
int metrics_trim_after_step(const char *path, int64_t last_step, MetricsTrim *trim, char *err, size_t err_len);

#endif
