// rollout_server/http_conn_deadline.c — per-connection read deadlines enforced by a sweep thread (see
// http_conn_deadline.h).
#include "rollout_server/http_conn_deadline.h"

#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout_server/http_server.h"

// How often the sweep looks at the connections.
#define SWEEP_PERIOD_MS 250
// How long past its deadline a connection is left before the sweep closes it: time for the access handler to
// answer 408 to a request whose last bytes arrive just late, rather than the client seeing a closed socket.
#define SWEEP_GRACE_S 1.5

typedef enum { PHASE_READING, PHASE_HANDLING, PHASE_IDLE } ConnPhase;

struct HttpConn {
    int fd;
    char client[64];          // numeric address, for the log
    ConnPhase phase;
    double phase_start;       // CLOCK_MONOTONIC seconds
    int cut;                  // the sweep closed it
    HttpConn *prev, *next;
};

struct HttpConnTracker {
    double read_timeout_s;    // 0 = none
    unsigned idle_timeout_s;
    pthread_mutex_t mu;       // guards the list and every HttpConn's fields
    pthread_cond_t wake;      // signalled to stop the sweep
    int stopping;
    int sweeping;             // the sweep thread runs
    pthread_t sweep_thread;
    HttpConn *head;
};

static double mono_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

// Seconds a connection in this phase may last, or 0 for no limit.
static double phase_limit(const HttpConnTracker *t, ConnPhase phase) {
    switch (phase) {
    case PHASE_READING: return t->read_timeout_s;
    case PHASE_IDLE: return (double)t->idle_timeout_s;
    case PHASE_HANDLING: break;
    }
    return 0;
}

static void *sweep_main(void *arg) {
    HttpConnTracker *t = arg;
    pthread_mutex_lock(&t->mu);
    while (!t->stopping) {
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += SWEEP_PERIOD_MS * 1000000L;
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        while (!t->stopping && pthread_cond_timedwait(&t->wake, &t->mu, &until) != ETIMEDOUT) {}
        if (t->stopping) break;
        // One log line per sweep and reason, however many connections it closes: a flood of slow clients
        // must not become a flood of log lines.
        int cut_reading = 0, cut_idle = 0;
        char reading_example[64] = "", idle_example[64] = "";
        double now = mono_now();
        for (HttpConn *c = t->head; c; c = c->next) {
            double limit = phase_limit(t, c->phase);
            if (c->cut || limit <= 0 || now - c->phase_start <= limit + SWEEP_GRACE_S) continue;
            // The fd is still open: libmicrohttpd closes it only after the close notification, which waits
            // for this mutex to unlink the connection.
            shutdown(c->fd, SHUT_RDWR);
            c->cut = 1;
            if (c->phase == PHASE_READING) {
                if (!cut_reading++) snprintf(reading_example, sizeof reading_example, "%s", c->client);
            } else if (!cut_idle++) {
                snprintf(idle_example, sizeof idle_example, "%s", c->client);
            }
        }
        if (cut_reading)
            serve_log("closed %d connection%s (from %s%s) whose request had not arrived in full %g s after it "
                      "started (--request-read-timeout %g): a slow or stalled client; if legitimate clients are "
                      "this slow, raise --request-read-timeout",
                      cut_reading, cut_reading == 1 ? "" : "s", reading_example, cut_reading > 1 ? " and others" : "",
                      t->read_timeout_s, t->read_timeout_s);
        if (cut_idle)
            serve_log("closed %d kept-alive connection%s (from %s%s) whose next request line had not arrived %u s "
                      "after the previous answer",
                      cut_idle, cut_idle == 1 ? "" : "s", idle_example, cut_idle > 1 ? " and others" : "",
                      t->idle_timeout_s);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

int http_conn_tracker_start(HttpConnTracker **out, double read_timeout_s, unsigned idle_timeout_s, char *err,
                            size_t err_len) {
    *out = NULL;
    HttpConnTracker *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    t->read_timeout_s = read_timeout_s;
    t->idle_timeout_s = idle_timeout_s;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->wake, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&t->mu, NULL);
    int rc = pthread_create(&t->sweep_thread, NULL, sweep_main, t);
    if (rc != 0) {
        snprintf(err, err_len, "cannot start the connection deadline thread: %s", strerror(rc));
        pthread_cond_destroy(&t->wake);
        pthread_mutex_destroy(&t->mu);
        free(t);
        return -1;
    }
    t->sweeping = 1;
    *out = t;
    return 0;
}

void http_conn_tracker_stop_sweep(HttpConnTracker *t) {
    if (!t || !t->sweeping) return;
    pthread_mutex_lock(&t->mu);
    t->stopping = 1;
    pthread_cond_broadcast(&t->wake);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->sweep_thread, NULL);
    t->sweeping = 0;
}

void http_conn_tracker_free(HttpConnTracker *t) {
    if (!t) return;
    http_conn_tracker_stop_sweep(t);
    while (t->head) {
        HttpConn *c = t->head;
        t->head = c->next;
        free(c);
    }
    pthread_cond_destroy(&t->wake);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

HttpConn *http_conn_opened(HttpConnTracker *t, int fd, const struct sockaddr *addr) {
    HttpConn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->fd = fd;
    socklen_t addr_len = addr && addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
    if (!addr || getnameinfo(addr, addr_len, c->client, sizeof c->client, NULL, 0, NI_NUMERICHOST) != 0)
        snprintf(c->client, sizeof c->client, "an unknown address");
    c->phase = PHASE_READING;
    c->phase_start = mono_now();
    pthread_mutex_lock(&t->mu);
    c->next = t->head;
    if (t->head) t->head->prev = c;
    t->head = c;
    pthread_mutex_unlock(&t->mu);
    return c;
}

void http_conn_closed(HttpConnTracker *t, HttpConn *c) {
    if (!c) return;
    pthread_mutex_lock(&t->mu);
    if (c->prev) c->prev->next = c->next;
    else t->head = c->next;
    if (c->next) c->next->prev = c->prev;
    pthread_mutex_unlock(&t->mu);
    free(c);
}

static void set_phase(HttpConnTracker *t, HttpConn *c, ConnPhase phase) {
    if (!c) return;
    pthread_mutex_lock(&t->mu);
    c->phase = phase;
    c->phase_start = mono_now();
    pthread_mutex_unlock(&t->mu);
}

void http_conn_request_line(HttpConnTracker *t, HttpConn *c) {
    if (!c) return;
    pthread_mutex_lock(&t->mu);
    // The first request's clock started at the connect: a client that connects and waits gets no extra time.
    if (c->phase == PHASE_IDLE) {
        c->phase = PHASE_READING;
        c->phase_start = mono_now();
    }
    pthread_mutex_unlock(&t->mu);
}

int http_conn_request_late(HttpConnTracker *t, HttpConn *c) {
    if (!c || t->read_timeout_s <= 0) return 0;
    pthread_mutex_lock(&t->mu);
    int late = c->phase == PHASE_READING && mono_now() - c->phase_start > t->read_timeout_s;
    pthread_mutex_unlock(&t->mu);
    return late;
}

void http_conn_request_in(HttpConnTracker *t, HttpConn *c) { set_phase(t, c, PHASE_HANDLING); }

void http_conn_request_done(HttpConnTracker *t, HttpConn *c) { set_phase(t, c, PHASE_IDLE); }

int http_conn_was_cut(HttpConnTracker *t, HttpConn *c) {
    if (!c) return 0;
    pthread_mutex_lock(&t->mu);
    int cut = c->cut;
    pthread_mutex_unlock(&t->mu);
    return cut;
}
