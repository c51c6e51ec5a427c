// rollout_server/zmq_control_auth.c — the ZAP handler and handshake-failure log of the control socket
// (zmq_control_auth.h).
#include "rollout_server/zmq_control_auth.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "rollout_server/http_server.h"
#include "shared/err.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"   // fixed by ZeroMQ's ZAP specification (RFC 27)
#define AUTH_POLL_MS 100                         // how often the thread looks at the stop flag
#define REFUSAL_LOG_INTERVAL_S 60.0              // one line per address (or kind of failure) per interval
#define MAX_TRACKED 128                          // addresses remembered for the rate limit
#define ZAP_FRAMES 7                             // version, id, domain, address, routing id, mechanism, key

// One address (or kind of handshake failure) that was refused: when it was last logged, and the refusals since.
typedef struct {
    char what[128];
    double logged_at;
    long suppressed;
} Refusal;

struct ZmqControlAuth {
    void *zap, *monitor;
    char monitor_name[64];
    pthread_t thread;
    int started;
    atomic_int stop;
    ControlKey authorized[CONTROL_MAX_AUTHORIZED_KEYS];
    int n_authorized;
    char authorized_path[512];
    Refusal refusals[MAX_TRACKED];   // thread only
    int n_refusals;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Returns -1 when `what` was logged less than an interval ago (the refusal is counted), else the number of
// refusals not logged since its last line (0 for the first): the caller logs it.
static long refusal_should_log(ZmqControlAuth *a, const char *what) {
    double t = now_s();
    Refusal *r = NULL;
    for (int i = 0; i < a->n_refusals && !r; i++)
        if (!strcmp(a->refusals[i].what, what)) r = &a->refusals[i];
    if (r && t - r->logged_at < REFUSAL_LOG_INTERVAL_S) {
        r->suppressed++;
        return -1;
    }
    if (!r) {
        // A new address takes a free entry, else the one logged longest ago.
        int slot = 0;
        if (a->n_refusals < MAX_TRACKED) {
            slot = a->n_refusals++;
        } else {
            for (int i = 1; i < MAX_TRACKED; i++)
                if (a->refusals[i].logged_at < a->refusals[slot].logged_at) slot = i;
        }
        r = &a->refusals[slot];
        snprintf(r->what, sizeof r->what, "%s", what);
        r->suppressed = 0;
    }
    long folded = r->suppressed;
    r->logged_at = t;
    r->suppressed = 0;
    return folded;
}

static void recv_frames(void *sock, zmq_msg_t *parts, int *n) {
    *n = 0;
    int more = 1;
    while (more) {
        zmq_msg_t tmp, *m = *n < ZAP_FRAMES ? &parts[*n] : &tmp;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, sock, 0) < 0) {
            zmq_msg_close(m);
            return;
        }
        more = zmq_msg_more(m);
        if (m == &tmp) zmq_msg_close(m);
        else (*n)++;
    }
}

static void frame_text(zmq_msg_t *m, char *out, size_t cap) {
    size_t len = zmq_msg_size(m) < cap - 1 ? zmq_msg_size(m) : cap - 1;
    memcpy(out, zmq_msg_data(m), len);
    out[len] = '\0';
}

// Answers one ZAP request (RFC 27): 200 for a CURVE client whose public key is authorized, 400 otherwise.
static void handle_zap(ZmqControlAuth *a) {
    zmq_msg_t parts[ZAP_FRAMES];
    int n;
    recv_frames(a->zap, parts, &n);
    if (n < 6) {
        for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
        return;   // not a ZAP request ZeroMQ would send; REP has nothing to answer
    }
    char address[64], mechanism[16], client[CONTROL_KEY_Z85_LEN + 1] = "";
    frame_text(&parts[3], address, sizeof address);
    frame_text(&parts[5], mechanism, sizeof mechanism);
    int ok = 0;
    if (n == 7 && !strcmp(mechanism, "CURVE") && zmq_msg_size(&parts[6]) == 32) {
        zmq_z85_encode(client, zmq_msg_data(&parts[6]), 32);
        for (int i = 0; i < a->n_authorized && !ok; i++) ok = !strcmp(a->authorized[i], client);
    }
    const char *status = ok ? "200" : "400", *text = ok ? "OK" : "client key not authorized";
    zmq_send(a->zap, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(a->zap, zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1]), ZMQ_SNDMORE);
    zmq_send(a->zap, status, 3, ZMQ_SNDMORE);
    zmq_send(a->zap, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(a->zap, ok ? client : "", ok ? CONTROL_KEY_Z85_LEN : 0, ZMQ_SNDMORE);
    zmq_send(a->zap, "", 0, 0);
    for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
    if (ok) return;
    long folded = refusal_should_log(a, address);
    if (folded < 0) return;
    serve_log("refused a control connection from %s: its CURVE public key %s is not in %s (if that client is "
              "yours, add its public key there and restart this server); %ld more refusal(s) from that address "
              "since its last such line (at most one a minute)",
              address, client[0] ? client : "(none)", a->authorized_path, folded);
}

// A handshake that failed before ZAP: the client does not speak CURVE, or does not know the server's key.
static void handle_monitor_event(ZmqControlAuth *a) {
    zmq_msg_t parts[ZAP_FRAMES];
    int n;
    recv_frames(a->monitor, parts, &n);
    if (n < 2 || zmq_msg_size(&parts[0]) < 6) {
        for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
        return;
    }
    const uint8_t *d = zmq_msg_data(&parts[0]);
    uint16_t event;
    uint32_t value;
    memcpy(&event, d, 2);
    memcpy(&value, d + 2, 4);
    char endpoint[128];
    frame_text(&parts[1], endpoint, sizeof endpoint);
    for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
    const char *why;
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        why = "a client without CURVE keys (give tandem-train --control-server-key and --control-client-key)";
    else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)
        why = "a CURVE client that does not hold this server's public key (its --control-server-key is another "
              "server's)";
    else
        why = "a peer whose handshake did not complete (it closed the connection, a port scan, or not a tandem "
              "control client)";
    long folded = refusal_should_log(a, why);
    if (folded < 0) return;
    serve_log("refused a control connection on %s from %s; %ld more such refusal(s) since the last such line (at "
              "most one a minute)",
              endpoint, why, folded);
}

static void *auth_main(void *arg) {
    ZmqControlAuth *a = arg;
    while (!atomic_load(&a->stop)) {
        zmq_pollitem_t items[2] = {{a->zap, 0, ZMQ_POLLIN, 0}, {a->monitor, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, AUTH_POLL_MS) < 0) {
            if (zmq_errno() == ETERM) break;
            continue;
        }
        if (items[0].revents & ZMQ_POLLIN) handle_zap(a);
        if (items[1].revents & ZMQ_POLLIN) handle_monitor_event(a);
    }
    return NULL;
}

static void auth_free(ZmqControlAuth *a) {
    if (a->zap) zmq_close(a->zap);
    if (a->monitor) zmq_close(a->monitor);
    free(a);
}

int zmq_control_auth_start(ZmqControlAuth **out, void *ctx, void *router, const ZmqControlKeys *keys, char *err,
                           size_t err_len) {
    *out = NULL;
    if (keys->n_authorized < 1) return err_fail(err, err_len, "zmq control: CURVE needs at least one authorized key");
    ZmqControlAuth *a = calloc(1, sizeof *a);
    if (!a) return err_fail(err, err_len, "zmq control: out of memory");
    memcpy(a->authorized, keys->authorized, sizeof(ControlKey) * (size_t)keys->n_authorized);
    a->n_authorized = keys->n_authorized;
    snprintf(a->authorized_path, sizeof a->authorized_path, "%s",
             keys->authorized_path ? keys->authorized_path : "the authorized keys");
    int zero = 0, one = 1;
    a->zap = zmq_socket(ctx, ZMQ_REP);
    if (!a->zap || zmq_setsockopt(a->zap, ZMQ_LINGER, &zero, sizeof zero) || zmq_bind(a->zap, ZAP_ENDPOINT)) {
        err_fail(err, err_len, "zmq control: cannot start the ZAP handler: %s", zmq_strerror(zmq_errno()));
        auth_free(a);
        return -1;
    }
    snprintf(a->monitor_name, sizeof a->monitor_name, "inproc://tandem-control-monitor-%p", (void *)a);
    const int events = ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL;
    // ZeroMQ admits every CURVE client when no handler is bound at ZAP_ENDPOINT, so the handler is bound before
    // the router and stops only after the router is closed (zmq_control.c's control_free).
    static const char domain[] = "tandem-control";
    if (zmq_setsockopt(router, ZMQ_CURVE_SERVER, &one, sizeof one) ||
        zmq_setsockopt(router, ZMQ_CURVE_SECRETKEY, keys->server.secret_key, CONTROL_KEY_Z85_LEN + 1) ||
        zmq_setsockopt(router, ZMQ_ZAP_DOMAIN, domain, sizeof domain - 1) ||
        zmq_socket_monitor(router, a->monitor_name, events) != 0 || !(a->monitor = zmq_socket(ctx, ZMQ_PAIR)) ||
        zmq_setsockopt(a->monitor, ZMQ_LINGER, &zero, sizeof zero) || zmq_connect(a->monitor, a->monitor_name)) {
        err_fail(err, err_len, "zmq control: cannot make the control socket a CURVE server: %s (libzmq must be built "
             "with libsodium)", zmq_strerror(zmq_errno()));
        zmq_socket_monitor(router, NULL, 0);
        auth_free(a);
        return -1;
    }
    // The sockets migrate to the thread: pthread_create is the full barrier ZeroMQ asks for.
    if (pthread_create(&a->thread, NULL, auth_main, a)) {
        err_fail(err, err_len, "zmq control: cannot start the ZAP handler thread");
        zmq_socket_monitor(router, NULL, 0);
        auth_free(a);
        return -1;
    }
    a->started = 1;
    *out = a;
    return 0;
}

void zmq_control_auth_stop(ZmqControlAuth *a) {
    if (!a) return;
    atomic_store(&a->stop, 1);
    if (a->started) pthread_join(a->thread, NULL);
    auth_free(a);
}

int zmq_control_endpoint_is_local(const char *endpoint) {
    if (!strncmp(endpoint, "ipc://", 6) || !strncmp(endpoint, "inproc://", 9)) return 1;
    if (strncmp(endpoint, "tcp://", 6) != 0) return 0;
    const char *host = endpoint + 6;
    if (!strncmp(host, "localhost:", 10) || !strncmp(host, "[::1]:", 6)) return 1;
    if (strncmp(host, "127.", 4) != 0) return 0;
    // An IPv4 literal in 127.0.0.0/8 (a host name that starts with "127." is not one).
    const char *p = host;
    while ((*p >= '0' && *p <= '9') || *p == '.') p++;
    return *p == ':';
}
