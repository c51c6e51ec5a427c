// trainer/server_liveness.c — socket monitors of the control connections (see trainer/server_liveness.h).
#include "trainer/server_liveness.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#define POLL_PERIOD_MS 20   // the monitors are read this often: a drop is known within this delay

typedef struct {
    void *pair;                 // the PAIR end of slot k's monitor; NULL while nothing is watched
    atomic_llong gone_ms;       // see server_liveness_gone_ms
} Slot;

struct ServerLiveness {
    void *zctx;
    int n;
    Slot *slots;                // (n)
    unsigned generation;        // makes each monitor's inproc endpoint unique
    pthread_mutex_t mu;         // guards the pair pointers (the thread reads them, watch/unwatch replace them)
    atomic_int stop;
    pthread_t thread;
    int thread_running;
};

int64_t server_liveness_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// Drains one monitor: every event is a 6-byte frame {uint16 event, uint32 value} and an endpoint frame.
static void drain(Slot *s) {
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s->pair, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        uint16_t event = 0;
        if (zmq_msg_size(&m) >= 2) memcpy(&event, zmq_msg_data(&m), 2);
        int more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        while (more) {
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, s->pair, 0) < 0) more = 0;
            else more = zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (event == ZMQ_EVENT_DISCONNECTED) atomic_store(&s->gone_ms, server_liveness_now_ms());
    }
}

static void *watch_main(void *arg) {
    ServerLiveness *l = arg;
    const struct timespec pause = {0, POLL_PERIOD_MS * 1000000L};
    while (!atomic_load(&l->stop)) {
        pthread_mutex_lock(&l->mu);
        for (int k = 0; k < l->n; k++)
            if (l->slots[k].pair) drain(&l->slots[k]);
        pthread_mutex_unlock(&l->mu);
        nanosleep(&pause, NULL);
    }
    return NULL;
}

int server_liveness_create(ServerLiveness **out, void *zctx, int n_servers, char *err, size_t err_len) {
    *out = NULL;
    ServerLiveness *l = calloc(1, sizeof *l);
    if (!l || !(l->slots = calloc((size_t)(n_servers > 0 ? n_servers : 1), sizeof *l->slots))) {
        free(l);
        snprintf(err, err_len, "out of memory for the control connections' monitors");
        return -1;
    }
    l->zctx = zctx;
    l->n = n_servers;
    pthread_mutex_init(&l->mu, NULL);
    if (pthread_create(&l->thread, NULL, watch_main, l) != 0) {
        snprintf(err, err_len, "cannot start the thread that watches the rollout servers' connections");
        server_liveness_destroy(l);
        return -1;
    }
    l->thread_running = 1;
    *out = l;
    return 0;
}

void server_liveness_destroy(ServerLiveness *l) {
    if (!l) return;
    atomic_store(&l->stop, 1);
    if (l->thread_running) pthread_join(l->thread, NULL);
    for (int k = 0; k < l->n; k++)
        if (l->slots[k].pair) zmq_close(l->slots[k].pair);
    pthread_mutex_destroy(&l->mu);
    free(l->slots);
    free(l);
}

void server_liveness_unwatch(ServerLiveness *l, int k) {
    pthread_mutex_lock(&l->mu);
    if (l->slots[k].pair) zmq_close(l->slots[k].pair);
    l->slots[k].pair = NULL;
    pthread_mutex_unlock(&l->mu);
}

int server_liveness_watch(ServerLiveness *l, int k, void *sock, char *err, size_t err_len) {
    server_liveness_unwatch(l, k);
    int ivl = CONTROL_HEARTBEAT_IVL_MS, timeout = CONTROL_HEARTBEAT_TIMEOUT_MS;
    if (zmq_setsockopt(sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl) != 0 ||
        zmq_setsockopt(sock, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof timeout) != 0) {
        snprintf(err, err_len, "setting heartbeats on a control socket: %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    char endpoint[96];
    pthread_mutex_lock(&l->mu);
    snprintf(endpoint, sizeof endpoint, "inproc://tandem-liveness.%p.%d.%u", (void *)l, k, l->generation++);
    pthread_mutex_unlock(&l->mu);
    void *pair = NULL;
    if (zmq_socket_monitor(sock, endpoint, ZMQ_EVENT_DISCONNECTED) != 0 ||
        !(pair = zmq_socket(l->zctx, ZMQ_PAIR)) || zmq_connect(pair, endpoint) != 0) {
        snprintf(err, err_len, "monitoring a control socket: %s", zmq_strerror(zmq_errno()));
        if (pair) zmq_close(pair);
        return -1;
    }
    pthread_mutex_lock(&l->mu);
    l->slots[k].pair = pair;
    pthread_mutex_unlock(&l->mu);
    return 0;
}

int64_t server_liveness_gone_ms(ServerLiveness *l, int k) {
    return atomic_load(&l->slots[k].gone_ms);
}
