// trainer/wait_log.h — the "still waiting" lines of a wait that can last longer than a few seconds.
//
// A wait loop that printed on every pass printed the same line hundreds of times a second when its passes were
// short. A WaitLog prints at most one line per interval (WAIT_LOG_INTERVAL_S) however often it is ticked, and
// each line says what is awaited, for how long so far and the limit:
//   tandem-train: still waiting for reward service http://h:8000/score (64 completions): 20 s of at most 70 s (--reward-connect-timeout + --reward-timeout)
#ifndef TANDEM_TRAINER_WAIT_LOG_H
#define TANDEM_TRAINER_WAIT_LOG_H

#include <stdio.h>

#define WAIT_LOG_INTERVAL_S 10.0

typedef struct {
    char what[384];         // what is awaited ("reward service URL (64 completions)")
    char limit_name[96];    // the option(s) that set the limit
    double limit_s;         // the wait gives up after this many seconds
    double interval_s;      // WAIT_LOG_INTERVAL_S; a test may shorten it
    double start_s, next_s; // monotonic seconds: the wait's start, the next line's due time (0: one interval
                            // after the start)
    FILE *out;              // stderr; a test may capture it
} WaitLog;

// Starts the clock of a wait of at most limit_s seconds (limit_name: the option that sets it).
void wait_log_start(WaitLog *w, double limit_s, const char *limit_name, const char *what_fmt, ...)
    __attribute__((format(printf, 4, 5)));
// Prints the line if an interval has passed since the last one (or the start): 1 printed, 0 not yet.
int wait_log_tick(WaitLog *w);
// Seconds until the next line is due (0 when it is): a waiter blocks at most this long before ticking again.
double wait_log_due_in(const WaitLog *w);
// Seconds since wait_log_start.
double wait_log_elapsed(const WaitLog *w);

#endif
