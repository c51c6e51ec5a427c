// trainer/wait_log.c — see trainer/wait_log.h.
#include "trainer/wait_log.h"

#include <stdarg.h>
#include <string.h>
#include <time.h>

static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

void wait_log_start(WaitLog *w, double limit_s, const char *limit_name, const char *what_fmt, ...) {
    memset(w, 0, sizeof *w);
    va_list ap;
    va_start(ap, what_fmt);
    vsnprintf(w->what, sizeof w->what, what_fmt, ap);
    va_end(ap);
    snprintf(w->limit_name, sizeof w->limit_name, "%s", limit_name);
    w->limit_s = limit_s;
    w->interval_s = WAIT_LOG_INTERVAL_S;
    w->start_s = monotonic_s();
    w->out = stderr;
}

// The first line is due one interval after the start (next_s is 0 until then, so interval_s may be set after
// wait_log_start).
static double next_due(const WaitLog *w) { return w->next_s > 0 ? w->next_s : w->start_s + w->interval_s; }

int wait_log_tick(WaitLog *w) {
    double now = monotonic_s();
    w->next_s = next_due(w);
    if (now < w->next_s) return 0;
    fprintf(w->out, "tandem-train: still waiting for %s: %.0f s of at most %.0f s (%s)\n", w->what, now - w->start_s,
            w->limit_s, w->limit_name);
    fflush(w->out);
    // The next line is one interval after this one's due time (not after now): a tick that came late does not
    // shift the rest, and one that came more than an interval late still prints a single line.
    while (w->next_s <= now) w->next_s += w->interval_s;
    return 1;
}

double wait_log_due_in(const WaitLog *w) {
    double left = next_due(w) - monotonic_s();
    return left > 0 ? left : 0;
}

double wait_log_elapsed(const WaitLog *w) { return monotonic_s() - w->start_s; }
