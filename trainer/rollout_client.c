// trainer/rollout_client.c — DEALER sockets to the rollout servers (see trainer/rollout_client.h).
#include "trainer/rollout_client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "shared/control_keys.h"
#include "trainer/server_liveness.h"
#include "trainer/wait_log.h"

// 1 when s's connection dropped at or after since_ms (the process died, restarted or stopped answering
// heartbeats): whatever was sent to it since is lost.
int rollout_gone_since(RolloutClient *c, const Server *s, double since_ms) {
    int64_t at = server_liveness_gone_ms(c->live, server_index(c, s));
    return at > 0 && (double)at >= since_ms;
}

// Sends a message (frames 0..n-1). A server that cannot take it (its connection is down, so the message would
// queue, or its queue is full) is waited for while it stays connected, up to timeout_ms. Returns 0 sent, 1 not
// sent (the server went away since since_ms, or stayed full: *gone says which), -1 error with a message.
int rollout_send_msg(RolloutClient *c, Server *s, const ZmsgMsg *m, double since_ms, int timeout_ms, int *gone,
                    char *err, size_t err_len) {
    *gone = 0;
    ZmsgOut out;
    if (zmsg_build(m, &out, err, err_len) != 0) return -1;
    int rc = 0;
    const double deadline = now_ms() + timeout_ms;
    for (int i = 0; i < out.n_frames && rc == 0; i++) {
        int flags = i + 1 < out.n_frames ? ZMQ_SNDMORE : 0;
        // The first frame decides (libzmq queues a message whole): no blocking send, so a dead server cannot
        // hold the caller.
        while (i == 0 && zmq_send(s->sock, out.frames[0].data, out.frames[0].size, flags | ZMQ_DONTWAIT) < 0) {
            if (zmq_errno() != EAGAIN) {
                rc = -1;
                break;
            }
            if ((*gone = rollout_gone_since(c, s, since_ms)) || now_ms() >= deadline) {
                rc = 1;
                break;
            }
            zmq_pollitem_t item = {s->sock, 0, ZMQ_POLLOUT, 0};
            zmq_poll(&item, 1, POLL_SLICE_MS);
        }
        if (i == 0) {
            if (rc != 0) break;
            continue;
        }
        if (zmq_send(s->sock, out.frames[i].data, out.frames[i].size, flags) < 0) rc = -1;
    }
    if (rc < 0)
        snprintf(err, err_len, "sending %s to rollout server %s failed: %s", zmsg_type_name(m->type), s->endpoint,
                 zmq_strerror(zmq_errno()));
    zmsg_out_free(&out);
    return rc;
}

int rollout_recv_msg(Server *s, ZmsgMsg *m, zmq_msg_t *parts, int *n_parts, char *err, size_t err_len) {
    *n_parts = 0;
    int more = 1;
    while (more) {
        if (*n_parts == 8) {
            snprintf(err, err_len, "rollout server %s sent a message with too many frames", s->endpoint);
            return -1;
        }
        zmq_msg_t *p = &parts[*n_parts];
        zmq_msg_init(p);
        if (zmq_msg_recv(p, s->sock, *n_parts == 0 ? ZMQ_DONTWAIT : 0) < 0) {
            zmq_msg_close(p);
            return 0;
        }
        (*n_parts)++;
        more = zmq_msg_more(p);
    }
    ZmsgFrame frames[8];
    for (int i = 0; i < *n_parts; i++) frames[i] = (ZmsgFrame){zmq_msg_data(&parts[i]), zmq_msg_size(&parts[i])};
    if (zmsg_parse(m, ZMSG_DIR_REPLY, frames, *n_parts, err, err_len) != 0) return -1;
    return 1;
}

void rollout_close_parts(zmq_msg_t *parts, int n) {
    for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
}

// Waits for the reply with this id (request `what`, sent at since_ms) from s, up to timeout_ms, logging every
// WAIT_LOG_INTERVAL_S while it waits. Returns 1 (reply in *m), 0 when none will come: the timeout passed, or the
// server's connection dropped since the request (*gone = 1; it is lost with the process that had it), -1 on
// error (an error reply becomes a message naming the server).
int rollout_wait_reply(RolloutClient *c, Server *s, int64_t id, const char *what, double since_ms, ZmsgMsg *m,
                      int timeout_ms, int *gone, char *err, size_t err_len) {
    *gone = 0;
    double deadline = now_ms() + timeout_ms;
    WaitLog wl;
    wait_log_start(&wl, timeout_ms / 1000.0, "--rollout-timeout", "rollout server %s to answer %s (connected)",
                   s->endpoint, what);
    for (;;) {
        double left = deadline - now_ms();
        if (left <= 0) return 0;
        if ((*gone = rollout_gone_since(c, s, since_ms))) return 0;
        wait_log_tick(&wl);
        zmq_pollitem_t item = {s->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, left < POLL_SLICE_MS ? (long)left : POLL_SLICE_MS) < 0) {
            snprintf(err, err_len, "polling rollout server %s: %s", s->endpoint, zmq_strerror(zmq_errno()));
            return -1;
        }
        if (!(item.revents & ZMQ_POLLIN)) continue;
        zmq_msg_t parts[8];
        int n_parts;
        int r = rollout_recv_msg(s, m, parts, &n_parts, err, err_len);
        rollout_close_parts(parts, n_parts);
        if (r < 0) return -1;
        if (r == 0) continue;
        // An answer to a generation still in flight (rollout_generate_start) is kept for its collection.
        if (m->id != id && rollout_pending_keep(c, server_index(c, s), m)) continue;
        if (m->type == ZMSG_ERROR && rollout_gone_since(c, s, since_ms)) {
            // A refusal from the process that replaced the one the request went to (e.g. a weight slice of an
            // update the restarted server never began): the request is lost, not refused.
            zmsg_free(m);
            *gone = 1;
            return 0;
        }
        if (m->type == ZMSG_ERROR) {
            snprintf(err, err_len, "rollout server %s refused request %lld: [%s] %s", s->endpoint, (long long)m->id,
                     m->code, m->message);
            zmsg_free(m);
            return -1;
        }
        if (m->id == id) return 1;
        zmsg_free(m); // a late answer to something abandoned
    }
}

int rollout_hello(RolloutClient *c, Server *s, int timeout_ms, char *err, size_t err_len) {
    ZmsgMsg req, rep;
    int64_t id = c->next_id++;
    zmsg_init(&req, ZMSG_HELLO, ZMSG_DIR_REQUEST, id);
    req.protocol_version = ZMSG_PROTOCOL_VERSION;
    // A server that refuses this client's handshake (CURVE keys missing or not admitted) leaves the socket with
    // no connection, where the message cannot go: send_msg waits for one, as long as for the answer.
    const double t0 = now_ms();
    int gone, sr = rollout_send_msg(c, s, &req, t0, timeout_ms, &gone, err, err_len);
    if (sr != 0) return sr < 0 ? -1 : 0;
    int r = rollout_wait_reply(c, s, id, "hello", t0, &rep, timeout_ms, &gone, err, err_len);
    if (r <= 0) return r == 0 ? 0 : -1;
    int rc = 1;
    if (rep.layout_hash != c->layout_hash) {
        char a[17], b[17];
        zmsg_hash_to_hex(rep.layout_hash, a);
        zmsg_hash_to_hex(c->layout_hash, b);
        snprintf(err, err_len, "rollout server %s serves a model with layout hash %s, the trainer's is %s: start it "
                 "with the same model (--model) as the trainer", s->endpoint, a, b);
        rc = -1;
    }
    s->max_seq_len = rep.max_seq_len;
    s->tensor_parallel_size = rep.tensor_parallel_size;
    s->policy_version = rep.policy_version;
    zmsg_free(&rep);
    return rc;
}

// s->sock: a DEALER connected to s->endpoint, a CURVE client when the run has keys (set before connect: the
// handshake starts at connect).
static int open_socket(RolloutClient *c, Server *s, char *err, size_t err_len) {
    s->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    int linger = 0;
    int64_t max_frame = ZMSG_MAX_REPLY_FRAME_BYTES;   // a server that sends more is disconnected (and set aside)
    if (!s->sock || zmq_setsockopt(s->sock, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_setsockopt(s->sock, ZMQ_MAXMSGSIZE, &max_frame, sizeof max_frame) != 0) {
        snprintf(err, err_len, "cannot open a socket for rollout server %s: %s", s->endpoint,
                 zmq_strerror(zmq_errno()));
        return -1;
    }
    // ZeroMQ connects to an IPv6 address (spelt in brackets) only when asked.
    int ipv6 = strchr(s->endpoint, '[') != NULL;
    if (ipv6) zmq_setsockopt(s->sock, ZMQ_IPV6, &ipv6, sizeof ipv6);
    if (c->secure && control_client_secure(s->sock, c->server_public, &c->client, err, err_len) != 0) return -1;
    if (server_liveness_watch(c->live, server_index(c, s), s->sock, err, err_len) != 0) return -1;
    if (zmq_connect(s->sock, s->endpoint) != 0) {
        snprintf(err, err_len, "cannot connect to rollout server %s: %s", s->endpoint, zmq_strerror(zmq_errno()));
        return -1;
    }
    return 0;
}

// A fresh socket for a server that stopped answering: whatever was queued for the old connection (requests of
// a round it missed, slices of an abandoned weight push) is dropped instead of reaching a restarted server.
static int reopen(RolloutClient *c, Server *s, char *err, size_t err_len) {
    server_liveness_unwatch(c->live, server_index(c, s));
    if (s->sock) zmq_close(s->sock);
    s->sock = NULL;
    s->in_flight = 0;
    s->epoch++;   // requests sent on the old socket are lost: a generation in flight sends them again
    if (open_socket(c, s, err, err_len) != 0) return -1;
    return 0;
}

void rollout_mark_dead(RolloutClient *c, Server *s, const char *why) {
    if (!s->alive) return;
    fprintf(stderr, "tandem-train: rollout server %s %s; carrying on with the others and checking it again every "
            "round\n", s->endpoint, why);
    s->alive = 0;
    char err[512];
    if (reopen(c, s, err, sizeof err) != 0) fprintf(stderr, "tandem-train: %s\n", err);
}

static int rollout_client_poll(RolloutClient *c, int64_t version, int timeout_ms, int *stale, int *alive_out,
                               char *err, size_t err_len);

int rollout_client_refresh(RolloutClient *c, int64_t version, int timeout_ms, int *stale, char *err, size_t err_len) {
    // With no server answering, keep asking for up to six request timeouts: a restarting server comes back.
    double give_up = now_ms() + 6.0 * c->timeout_ms;
    WaitLog wl;
    wait_log_start(&wl, 6.0 * c->timeout_ms / 1000, "6 x --rollout-timeout", "a rollout server to answer (%d "
                   "configured, none answers)", c->n_servers);
    for (;;) {
        int alive = 0;
        const double t0 = now_ms();
        if (rollout_client_poll(c, version, timeout_ms, stale, &alive, err, err_len) != 0) return -1;
        if (alive > 0) return 0;
        if (now_ms() >= give_up) break;
        wait_log_tick(&wl);
        // A refused connection answers at once: pause so that one round of hellos takes at least timeout_ms.
        double rest = t0 + timeout_ms - now_ms();
        if (rest > 0) zmq_poll(NULL, 0, (long)rest);
    }
    snprintf(err, err_len, "no rollout server answered for %.0f s (%d configured): is tandem-serve running?",
             6.0 * c->timeout_ms / 1000, c->n_servers);
    return -1;
}

static int rollout_client_poll(RolloutClient *c, int64_t version, int timeout_ms, int *stale, int *alive_out,
                               char *err, size_t err_len) {
    *stale = 0;
    int alive = 0;
    for (int k = 0; k < c->n_servers; k++) {
        Server *s = &c->servers[k];
        int r = rollout_hello(c, s, timeout_ms, err, err_len);
        if (r < 0) return -1;
        if (r == 0) {
            rollout_mark_dead(c, s, "does not answer");
            continue;
        }
        if (!s->alive) fprintf(stderr, "tandem-train: rollout server %s answers again (weights version %lld)\n",
                               s->endpoint, (long long)s->policy_version);
        s->alive = 1;
        alive++;
        if (s->policy_version != version) *stale = 1;
    }
    *alive_out = alive;
    return 0;
}

int rollout_client_step_seconds(RolloutClient *c, int timeout_ms, double *step_seconds, int *n_answered, char *err,
                                size_t err_len) {
    *step_seconds = 0, *n_answered = 0;
    for (int k = 0; k < c->n_servers; k++) {
        Server *s = &c->servers[k];
        if (!s->alive) continue;
        ZmsgMsg req, rep;
        zmsg_init(&req, ZMSG_STATS, ZMSG_DIR_REQUEST, c->next_id++);
        const double t0 = now_ms();
        int gone, r = rollout_send_msg(c, s, &req, t0, timeout_ms, &gone, err, err_len);
        if (r < 0) return -1;
        if (r > 0) continue;
        r = rollout_wait_reply(c, s, req.id, "stats", t0, &rep, timeout_ms, &gone, err, err_len);
        if (r < 0) return -1;
        if (r == 0) continue;
        *step_seconds += rep.stats.step_seconds_sum;
        (*n_answered)++;
        zmsg_free(&rep);
    }
    return 0;
}

int rollout_client_create(RolloutClient **out, const char *endpoints, uint64_t layout_hash, int timeout_ms,
                          const char *server_key_path, const char *client_key_path, char *err, size_t err_len) {
    *out = NULL;
    RolloutClient *c = calloc(1, sizeof *c);
    if (!c || !(c->zctx = zmq_ctx_new())) {
        snprintf(err, err_len, "out of memory creating the rollout client");
        free(c);
        return -1;
    }
    c->layout_hash = layout_hash;
    c->timeout_ms = timeout_ms;
    if (server_liveness_create(&c->live, c->zctx, MAX_SERVERS, err, err_len) != 0) goto fail;
    // Flags and config keys win; the environment lets a Secret or a wrapper supply the paths.
    const char *env_server = getenv("TANDEM_CONTROL_SERVER_KEY"), *env_client = getenv("TANDEM_CONTROL_CLIENT_KEY");
    if (!server_key_path && env_server && env_server[0]) server_key_path = env_server;
    if (!client_key_path && env_client && env_client[0]) client_key_path = env_client;
    if ((server_key_path != NULL) != (client_key_path != NULL)) {
        snprintf(err, err_len, "%s needs %s as well: a CURVE client needs the server's public key and a key pair of "
                 "its own (tandem-train keygen DIR writes DIR/server.pub and DIR/client.key)",
                 server_key_path ? "--control-server-key" : "--control-client-key",
                 server_key_path ? "--control-client-key" : "--control-server-key");
        goto fail;
    }
    if (server_key_path) {
        char kerr[900];
        if (control_public_key_read(server_key_path, c->server_public, kerr, sizeof kerr) != 0 ||
            control_keypair_read(client_key_path, &c->client, kerr, sizeof kerr) != 0) {
            snprintf(err, err_len, "the control channel's keys: %s", kerr);
            goto fail;
        }
        c->secure = 1;
    }
    c->next_id = 1;
    const char *p = endpoints;
    while (p && *p) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == 0 || len >= sizeof c->servers[0].endpoint || c->n_servers == MAX_SERVERS) {
            snprintf(err, err_len, "--rollout-servers: bad or too many endpoints in \"%s\"", endpoints);
            goto fail;
        }
        Server *s = &c->servers[c->n_servers++];
        memcpy(s->endpoint, p, len);
        s->endpoint[len] = 0;
        if (open_socket(c, s, err, err_len) != 0) goto fail;
        p = comma ? comma + 1 : NULL;
    }
    if (c->n_servers == 0) {
        snprintf(err, err_len, "--rollout-servers is empty: give at least one tcp://host:port");
        goto fail;
    }
    double deadline = now_ms() + timeout_ms;
    for (int i = 0; i < c->n_servers; i++) {
        Server *s = &c->servers[i];
        WaitLog wl;
        wait_log_start(&wl, timeout_ms / 1000.0, "--rollout-timeout", "rollout server %s (no answer yet)",
                       s->endpoint);
        for (;;) {
            double left = deadline - now_ms(), t0 = now_ms();
            int slice = left < 1000 ? (int)(left > 0 ? left : 0) : 1000;
            int r = rollout_hello(c, s, slice, err, err_len);
            if (r < 0) goto fail;
            if (r == 1) break;
            if (now_ms() >= deadline) {
                snprintf(err, err_len, "rollout server %s did not answer within %d ms: is tandem-serve running with "
                         "--control %s? %s", s->endpoint, timeout_ms, s->endpoint,
                         c->secure ? "It must run with keys: its --control-key-file the pair of "
                                     "--control-server-key, its --control-authorized-keys listing this trainer's "
                                     "--control-client-key (its log names refused clients); a server without keys "
                                     "does not answer a client with them"
                                   : "If it was started with --control-key-file, give this trainer "
                                     "--control-server-key and --control-client-key: a server with keys does not "
                                     "answer a client without them");
                goto fail;
            }
            wait_log_tick(&wl);
            double rest = t0 + slice - now_ms();   // a refused connection answers at once
            if (rest > 0) zmq_poll(NULL, 0, (long)rest);
        }
        s->alive = 1;
    }
    *out = c;
    return 0;
fail:
    rollout_client_destroy(c);
    return -1;
}

void rollout_client_destroy(RolloutClient *c) {
    if (!c) return;
    server_liveness_destroy(c->live);
    for (int i = 0; i < c->n_servers; i++)
        if (c->servers[i].sock) zmq_close(c->servers[i].sock);
    if (c->zctx) zmq_ctx_term(c->zctx);
    free(c);
}

int rollout_client_max_seq_len(const RolloutClient *c) {
    int m = 0;
    for (int i = 0; i < c->n_servers; i++)
        if (m == 0 || c->servers[i].max_seq_len < m) m = c->servers[i].max_seq_len;
    return m;
}
