// shared/comm/comm_probe.c — the side channel of the nccl backend (comm_internal.h): which peer holds up a call
// that NCCL cannot finish.
//
// NCCL cannot say which rank is missing when a collective stalls, so every rank that joined through the
// rendezvous also binds a ZeroMQ ROUTER (its "probe socket", published as its rendezvous endpoint):
//   - a responder thread answers each probe with {phase, NCCL operations queued, completed} (Answer below),
//     so a peer whose own threads are busy or blocked still answers while its process lives;
//   - the watchdog holds a DEALER to every peer's ROUTER; the DEALER's socket monitor reports the moment the
//     peer's process goes away (its kernel closes the connection);
//   - comm_probe_diagnose sends every connected peer a probe and names each one that went away, that does not
//     answer within COMM_PROBE_WAIT_MS (stopped or hung process, host or network down), that failed itself, or
//     that has queued fewer operations than the stalled one needs (it has not reached that call).
// Wire format: probe = {magic, from rank} (8 bytes), answer = Answer (32 bytes), little-endian as they are.
#include "shared/comm/comm_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define PROBE_MAGIC 0x504e4354u   // "TCNP"
#define LIST_MAX 3                // peers named one by one in a diagnosis (the rest are counted)

// `ask` numbers a diagnosis: its answer echoes it, so an answer that arrives after its diagnosis gave up (a slow
// peer) is not taken for the answer to a later one.
typedef struct { uint32_t magic, from, ask; } Probe;
typedef struct { uint32_t magic, rank, pid, phase; uint64_t queued, completed; uint32_t ask, pad; } Answer;
_Static_assert(sizeof(Probe) == 12 && sizeof(Answer) == 40, "Probe and Answer are wire formats");

struct CommProbe {
    int rank, world;
    void *zctx;
    void *router;                 // this rank's probe socket; the responder thread's once it runs
    void **dealer, **mon;         // (world) to every peer's probe socket, and its monitor; NULL for this rank
    int64_t *gone_ms;             // (world) when the peer's connection closed; 0 while connected
    RdzvPeer *peers;              // (world)
    void (*state)(void *arg, CommProbeState *out);
    void *state_arg;
    pthread_t responder;
    int responder_running;
    Answer *ans;                  // (world) scratch of comm_probe_diagnose
    uint32_t ask;                 // number of the last diagnosis
    zmq_pollitem_t *items;        // (world)
    int *item_peer;               // (world)
};

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int zfail(char *err, size_t len, const char *what) {
    snprintf(err, len, "comm nccl side channel: %s: %s", what, zmq_strerror(zmq_errno()));
    return COMM_ERR_SYSTEM;
}

int comm_probe_bind(CommProbe **out, int rank, int world, const char *master_addr, int master_port, char *endpoint,
                    size_t endpoint_len, char *err, size_t err_len) {
    *out = NULL;
    CommProbe *p = calloc(1, sizeof *p);
    if (!p) return zfail(err, err_len, "out of memory");
    p->rank = rank;
    p->world = world;
    size_t w = (size_t)world;
    p->dealer = calloc(w, sizeof *p->dealer);
    p->mon = calloc(w, sizeof *p->mon);
    p->gone_ms = calloc(w, sizeof *p->gone_ms);
    p->peers = calloc(w, sizeof *p->peers);
    p->ans = calloc(w, sizeof *p->ans);
    p->items = calloc(w, sizeof *p->items);
    p->item_peer = calloc(w, sizeof *p->item_peer);
    *out = p;   // comm_probe_close releases whatever was made, also after a failure below
    if (!p->dealer || !p->mon || !p->gone_ms || !p->peers || !p->ans || !p->items || !p->item_peer) {
        snprintf(err, err_len, "comm nccl side channel: out of memory");
        return COMM_ERR_SYSTEM;
    }
    char addr[64], bind_ep[96];
    if (rendezvous_local_address(master_addr, master_port, addr, sizeof addr, err, err_len) != 0)
        return COMM_ERR_INVALID;
    int v6 = strchr(addr, ':') != NULL, one = 1, zero = 0;
    snprintf(bind_ep, sizeof bind_ep, v6 ? "tcp://[%s]:*" : "tcp://%s:*", addr);
    p->zctx = zmq_ctx_new();
    if (!p->zctx) return zfail(err, err_len, "zmq_ctx_new");
    p->router = zmq_socket(p->zctx, ZMQ_ROUTER);
    if (!p->router) return zfail(err, err_len, "ROUTER socket");
    zmq_setsockopt(p->router, ZMQ_LINGER, &zero, sizeof zero);
    if (v6) zmq_setsockopt(p->router, ZMQ_IPV6, &one, sizeof one);
    if (zmq_bind(p->router, bind_ep) != 0) return zfail(err, err_len, bind_ep);
    if (zmq_getsockopt(p->router, ZMQ_LAST_ENDPOINT, endpoint, &endpoint_len) != 0)
        return zfail(err, err_len, "ZMQ_LAST_ENDPOINT");
    return 0;
}

static void *respond_main(void *arg) {
    CommProbe *p = arg;
    for (;;) {
        zmq_msg_t part[2];
        int n = 0, more = 1, term = 0;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, p->router, 0) < 0) {
                zmq_msg_close(&m);
                if (zmq_errno() == EINTR) continue;
                term = 1;   // ETERM: comm_probe_close shut the context down
                break;
            }
            more = zmq_msg_more(&m);
            if (n < 2) part[n++] = m;
            else zmq_msg_close(&m);
        }
        Probe pr;
        if (!term && n == 2 && zmq_msg_size(&part[1]) == sizeof pr) {
            memcpy(&pr, zmq_msg_data(&part[1]), sizeof pr);
            if (pr.magic == PROBE_MAGIC) {
                CommProbeState s = {0};
                p->state(p->state_arg, &s);
                Answer a = {PROBE_MAGIC, (uint32_t)p->rank, (uint32_t)getpid(), s.phase, s.queued, s.completed,
                            pr.ask, 0};
                size_t idn = zmq_msg_size(&part[0]);
                if (zmq_send(p->router, zmq_msg_data(&part[0]), idn, ZMQ_SNDMORE | ZMQ_DONTWAIT) == (int)idn)
                    zmq_send(p->router, &a, sizeof a, ZMQ_DONTWAIT);
            }
        }
        for (int i = 0; i < n; i++) zmq_msg_close(&part[i]);
        if (term) break;
    }
    zmq_close(p->router);
    return NULL;
}

int comm_probe_start(CommProbe *p, const RdzvPeer *peers, void (*state)(void *arg, CommProbeState *out), void *arg,
                     char *err, size_t err_len) {
    memcpy(p->peers, peers, (size_t)p->world * sizeof *p->peers);
    p->state = state;
    p->state_arg = arg;
    int one = 1, zero = 0;
    for (int q = 0; q < p->world; q++) {
        if (q == p->rank) continue;
        char mon_ep[64];
        snprintf(mon_ep, sizeof mon_ep, "inproc://comm-probe-monitor-%d", q);
        p->dealer[q] = zmq_socket(p->zctx, ZMQ_DEALER);
        p->mon[q] = zmq_socket(p->zctx, ZMQ_PAIR);
        if (!p->dealer[q] || !p->mon[q]) return zfail(err, err_len, "DEALER socket");
        zmq_setsockopt(p->dealer[q], ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(p->mon[q], ZMQ_LINGER, &zero, sizeof zero);
        if (comm_set_heartbeats(p->dealer[q]) != 0) return zfail(err, err_len, "heartbeats");
        if (strchr(p->peers[q].endpoint, '[')) zmq_setsockopt(p->dealer[q], ZMQ_IPV6, &one, sizeof one);
        // The monitor is attached before connecting, so that no close can slip by unseen.
        if (zmq_socket_monitor(p->dealer[q], mon_ep, ZMQ_EVENT_DISCONNECTED) != 0 || zmq_connect(p->mon[q], mon_ep) != 0)
            return zfail(err, err_len, "socket monitor");
        if (zmq_connect(p->dealer[q], p->peers[q].endpoint) != 0) {
            snprintf(err, err_len, "comm nccl side channel: cannot connect to rank %d's endpoint '%s': %s", q,
                     p->peers[q].endpoint, zmq_strerror(zmq_errno()));
            return COMM_ERR_PEER;
        }
    }
    if (pthread_create(&p->responder, NULL, respond_main, p) != 0) {
        snprintf(err, err_len, "comm nccl side channel: cannot start the responder thread");
        return COMM_ERR_SYSTEM;
    }
    p->responder_running = 1;
    return 0;
}

// Reads pending monitor events: a disconnect marks the peer gone (for good).
static void drain(CommProbe *p) {
    for (int q = 0; q < p->world; q++) {
        if (!p->mon[q]) continue;
        for (;;) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, p->mon[q], ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&m);
                break;
            }
            uint16_t ev = 0;
            if (zmq_msg_size(&m) >= 2) memcpy(&ev, zmq_msg_data(&m), 2);
            int more = zmq_msg_more(&m);
            zmq_msg_close(&m);
            if (more) {   // the event's second frame: the endpoint
                zmq_msg_init(&m);
                zmq_msg_recv(&m, p->mon[q], ZMQ_DONTWAIT);
                zmq_msg_close(&m);
            }
            if ((ev & ZMQ_EVENT_DISCONNECTED) && !p->gone_ms[q]) p->gone_ms[q] = now_ms();
        }
    }
}

void comm_probe_watch(CommProbe *p, int wait_ms) {
    int n = 0;
    for (int q = 0; q < p->world; q++)
        if (p->mon[q]) p->items[n++] = (zmq_pollitem_t){p->mon[q], 0, ZMQ_POLLIN, 0};
    if (n) zmq_poll(p->items, n, wait_ms);   // an interrupted wait only ends the tick early
    drain(p);
}

int64_t comm_probe_gone_ms(const CommProbe *p, int peer) {
    return peer >= 0 && peer < p->world ? p->gone_ms[peer] : 0;
}

static void append(char *out, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void append(char *out, size_t len, const char *fmt, ...) {
    size_t used = strlen(out);
    if (used + 1 >= len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out + used, len - used, fmt, ap);
    va_end(ap);
}

int comm_probe_diagnose(CommProbe *p, uint64_t seq, int init, char *out, size_t len) {
    drain(p);
    memset(p->ans, 0, (size_t)p->world * sizeof *p->ans);
    Probe pr = {PROBE_MAGIC, (uint32_t)p->rank, ++p->ask};
    for (int q = 0; q < p->world; q++)
        if (p->dealer[q] && !p->gone_ms[q]) zmq_send(p->dealer[q], &pr, sizeof pr, ZMQ_DONTWAIT);
    int64_t deadline = now_ms() + COMM_PROBE_WAIT_MS;
    for (;;) {
        int n = 0;
        for (int q = 0; q < p->world; q++)
            if (p->dealer[q] && !p->gone_ms[q] && !p->ans[q].magic) {
                p->items[n] = (zmq_pollitem_t){p->dealer[q], 0, ZMQ_POLLIN, 0};
                p->item_peer[n++] = q;
            }
        int64_t left = deadline - now_ms();
        if (n == 0 || left <= 0) break;
        if (zmq_poll(p->items, n, left < 10 ? left : 10) < 0 && zmq_errno() != EINTR) break;
        for (int i = 0; i < n; i++) {
            Answer a;
            if (!(p->items[i].revents & ZMQ_POLLIN)) continue;
            int got = zmq_recv(p->items[i].socket, &a, sizeof a, ZMQ_DONTWAIT);
            if (got == (int)sizeof a && a.magic == PROBE_MAGIC && a.rank == (uint32_t)p->item_peer[i] &&
                a.ask == pr.ask)
                p->ans[p->item_peer[i]] = a;
        }
        drain(p);   // a peer that dies while we wait is named as gone, not as silent
    }
    int gone = 0, blamed = 0;
    for (int q = 0; q < p->world; q++) {
        if (q == p->rank) continue;
        char why[256] = "";
        if (p->gone_ms[q]) {
            gone++;
            snprintf(why, sizeof why, "went away (its connections closed %lld ms ago: the process exited, or stopped "
                     "answering heartbeats for %d s)", (long long)(now_ms() - p->gone_ms[q]),
                     COMM_HEARTBEAT_TIMEOUT_MS / 1000);
        } else if (!p->ans[q].magic) {
            snprintf(why, sizeof why, "does not answer within %d ms (stopped or hung process, or its host or network "
                     "is down)", COMM_PROBE_WAIT_MS);
        } else if (p->ans[q].phase == COMM_PROBE_FAILED) {
            snprintf(why, sizeof why, "has failed itself (see its own error)");
        } else if (!init && p->ans[q].queued < seq) {
            snprintf(why, sizeof why, "is alive but has queued %llu NCCL operations where this one is #%llu: it has "
                     "not reached this call (busy elsewhere for longer than the timeout, or the ranks called different "
                     "collectives)", (unsigned long long)p->ans[q].queued, (unsigned long long)seq);
        }
        if (!why[0]) continue;
        if (++blamed <= LIST_MAX)
            append(out, len, "; rank %d (host %s, pid %d) %s", q, p->peers[q].hostname, p->peers[q].pid, why);
    }
    if (blamed > LIST_MAX) append(out, len, "; and %d more rank(s)", blamed - LIST_MAX);
    if (!blamed)
        append(out, len, init ? "; every peer is alive and joining: NCCL could not connect the ranks (network "
                                "interfaces or firewall? NCCL_SOCKET_IFNAME; NCCL_DEBUG=WARN says more)"
                              : "; every peer is alive and has reached this call: NCCL itself is stuck (network or "
                                "fabric? NCCL_DEBUG=WARN says more)");
    return gone;
}

void comm_probe_close(CommProbe *p) {
    if (!p) return;
    if (p->zctx) {
        zmq_ctx_shutdown(p->zctx);   // the responder's blocking receive returns ETERM; it closes its socket
        if (p->responder_running) pthread_join(p->responder, NULL);
        else if (p->router) zmq_close(p->router);
        for (int q = 0; p->dealer && q < p->world; q++) {
            if (p->dealer[q]) {
                zmq_socket_monitor(p->dealer[q], NULL, 0);
                zmq_close(p->dealer[q]);
            }
            if (p->mon && p->mon[q]) zmq_close(p->mon[q]);
        }
        zmq_ctx_term(p->zctx);
    }
    free(p->dealer);
    free(p->mon);
    free(p->gone_ms);
    free(p->peers);
    free(p->ans);
    free(p->items);
    free(p->item_peer);
    free(p);
}
