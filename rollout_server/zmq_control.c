// rollout_server/zmq_control.c — the control channel's ROUTER socket thread (zmq_control.h): receive, dispatch,
// reply (hello, stats, pause / resume / reset_cache, shutdown), forward the collector's results; and the lifecycle.
// Generate requests and their collector thread are in zmq_generate.c, weight updates in zmq_weights.c.
#include "rollout_server/zmq_control.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "rollout_server/zmq_control_internal.h"
#include "shared/err.h"

#define ZC_LINGER_MS 500        // queued replies (e.g. shutdown's ack) get this long to leave at close
#define ZC_MAX_FRAMES (ZMSG_MAX_PROMPTS + 2)   // routing id + header + prompts
#define ZC_RECV_BATCH 64        // messages read before results waiting on the inproc pipe get forwarded

double zc_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Sends the routing id then the encoded message's frames on sock (the ROUTER, or the inproc PUSH that feeds it).
static void send_frames(void *sock, const void *rid, size_t rid_len, const ZmsgOut *o) {
    if (zmq_send(sock, rid, rid_len, ZMQ_SNDMORE) < 0) return;
    for (int i = 0; i < o->n_frames; i++)
        zmq_send(sock, o->frames[i].data, o->frames[i].size, i + 1 < o->n_frames ? ZMQ_SNDMORE : 0);
}

void zc_send_msg(void *sock, const void *rid, size_t rid_len, const ZmsgMsg *m) {
    ZmsgOut o;
    char err[256];
    if (zmsg_build(m, &o, err, sizeof err)) {
        // Only a bug in this file can get here; answer with an error rather than leave the peer waiting.
        fprintf(stderr, "zmq_control: cannot encode a %s reply: %s\n", zmsg_type_name(m->type), err);
        ZmsgMsg e;
        zmsg_error(&e, m->id, "internal", err);
        if (zmsg_build(&e, &o, err, sizeof err)) return;
    }
    send_frames(sock, rid, rid_len, &o);
    zmsg_out_free(&o);
}

void zc_send_error(void *sock, const void *rid, size_t rid_len, int64_t id, const char *code, const char *fmt, ...) {
    ZmsgMsg m;
    char text[ZMSG_TEXT_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    zmsg_error(&m, id, code, text);
    zc_send_msg(sock, rid, rid_len, &m);
}

static void send_ack(ZmqControl *z, const void *rid, size_t rid_len, ZmsgType t, int64_t id) {
    ZmsgMsg m;
    zmsg_init(&m, t, ZMSG_DIR_REPLY, id);
    zc_send_msg(z->router, rid, rid_len, &m);
}

// ---- socket thread: parse requests, act, reply --------------------------------------------------------

const char *zc_engine_code(int rc) {
    switch (rc) {
    case ENGINE_EINVAL: return "invalid";
    case ENGINE_ETOOLONG: return "too_long";
    case ENGINE_EQUEUE_FULL: return "queue_full";
    case ENGINE_ESHUTDOWN: return "shutting_down";
    case ENGINE_ENOMEM: return "out_of_memory";
    default: return "internal";
    }
}

static void do_hello(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    if (q->protocol_version && q->protocol_version != ZMSG_PROTOCOL_VERSION) {
        zc_send_error(z->router, rid, rl, q->id, "unsupported_version",
                      "hello: this server speaks protocol version %d, the peer asked for %d", ZMSG_PROTOCOL_VERSION,
                      q->protocol_version);
        return;
    }
    const Model *model = engine_group_model(z->g);
    const Layout *L = &model->layout;
    int64_t *numel = malloc(sizeof(int64_t) * (size_t)L->n_units);
    if (!numel) {
        zc_send_error(z->router, rid, rl, q->id, "out_of_memory", "hello: out of memory");
        return;
    }
    for (int u = 0; u < L->n_units; u++) numel[u] = (int64_t)L->unit_numel[u];
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_HELLO, ZMSG_DIR_REPLY, q->id);
    m.protocol_version = ZMSG_PROTOCOL_VERSION;
    snprintf(m.model_id, sizeof m.model_id, "%s", engine_group_model_id(z->g));
    m.layout_hash = L->hash;
    m.n_units = L->n_units;
    m.unit_numel = numel;
    m.policy_version = engine_group_policy_version(z->g);
    m.max_seq_len = model->cfg.max_seq_len;
    m.vocab_size = model->cfg.vocab_size;
    m.tensor_parallel_size = engine_tp(engine_group_engine(z->g, 0));
    zc_send_msg(z->router, rid, rl, &m);
    free(numel);
}

static void do_stats(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    EngineStats es;
    engine_group_stats(z->g, &es, NULL);
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_STATS, ZMSG_DIR_REPLY, q->id);
    ZmsgStats *s = &m.stats;
    s->requests_waiting = es.requests_waiting;
    s->requests_running = es.requests_running;
    s->sequences_running = es.sequences_running;
    s->kv_blocks_total = es.kv_blocks_total;
    s->kv_blocks_used = es.kv_blocks_used;
    s->kv_blocks_cached = es.kv_blocks_cached;
    s->prompt_tokens_total = es.prompt_tokens_total;
    s->generation_tokens_total = es.generation_tokens_total;
    s->cached_prompt_tokens_total = es.cached_prompt_tokens_total;
    s->preemptions_total = es.preemptions_total;
    s->steps_total = es.steps_total;
    s->step_seconds_sum = es.step_seconds_sum;
    s->policy_version = es.policy_version;
    s->paused = es.paused;
    s->prompts_in_flight = atomic_load(&z->prompts_in_flight);
    zc_send_msg(z->router, rid, rl, &m);
}

// One message from the ROUTER: frames[0] the peer's routing id, frames[1..] what the peer sent.
static void handle(ZmqControl *z, zmq_msg_t *parts, int n_parts, int overflow) {
    const void *rid = zmq_msg_data(&parts[0]);
    size_t rl = zmq_msg_size(&parts[0]);
    if (rl > 256) return;   // ZeroMQ never makes such ids; nothing sensible to answer to
    if (overflow) {
        zc_send_error(z->router, rid, rl, -1, "bad_message", "message has more than %d frames", ZC_MAX_FRAMES - 1);
        return;
    }
    ZmsgFrame fr[ZC_MAX_FRAMES];
    for (int i = 1; i < n_parts; i++) fr[i - 1] = (ZmsgFrame){zmq_msg_data(&parts[i]), zmq_msg_size(&parts[i])};
    ZmsgMsg q;
    char err[768];
    if (zmsg_parse(&q, ZMSG_DIR_REQUEST, fr, n_parts - 1, err, sizeof err)) {
        zc_send_error(z->router, rid, rl, q.id, "bad_message", "%s", err);
        return;
    }
    switch (q.type) {
    case ZMSG_HELLO: do_hello(z, rid, rl, &q); break;
    case ZMSG_GENERATE: zc_generate(z, rid, rl, &q); break;
    case ZMSG_PAUSE:
        engine_group_pause(z->g);
        send_ack(z, rid, rl, q.type, q.id);
        break;
    case ZMSG_RESUME:
        engine_group_resume(z->g);
        send_ack(z, rid, rl, q.type, q.id);
        break;
    case ZMSG_RESET_CACHE:
        engine_group_reset_prefix_cache(z->g);
        send_ack(z, rid, rl, q.type, q.id);
        break;
    case ZMSG_STATS: do_stats(z, rid, rl, &q); break;
    case ZMSG_SHUTDOWN: {
        send_ack(z, rid, rl, q.type, q.id);
        atomic_store(&z->shutdown_requested, 1);
        pthread_mutex_lock(&z->mu);
        void (*cb)(void *) = z->on_shutdown;
        void *user = z->on_shutdown_user;
        pthread_mutex_unlock(&z->mu);
        if (cb) cb(user);
        break;
    }
    case ZMSG_WEIGHTS_BEGIN:
    case ZMSG_WEIGHTS_SLICE:
    case ZMSG_WEIGHTS_END: zc_weights(z, rid, rl, &q); break;
    default: zc_send_error(z->router, rid, rl, q.id, "bad_message", "%s is not a request", zmsg_type_name(q.type));
    }
    zmsg_free(&q);
}

// Reads one multipart message (non-blocking). Returns 0 if none was waiting.
static int recv_one(ZmqControl *z, zmq_msg_t *parts) {
    int n = 0, overflow = 0, more = 1;
    while (more) {
        zmq_msg_t tmp;
        zmq_msg_t *m = n < ZC_MAX_FRAMES ? &parts[n] : &tmp;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, z->router, n == 0 ? ZMQ_DONTWAIT : 0) < 0) {
            zmq_msg_close(m);
            if (n == 0) return 0;
            break;   // context terminating mid-message
        }
        more = zmq_msg_more(m);
        if (m == &tmp) {
            overflow = 1;
            zmq_msg_close(m);
        } else {
            n++;
        }
    }
    if (n >= 1) handle(z, parts, n, overflow);
    for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
    return 1;
}

// Moves finished results from the collector's pipe to the ROUTER, frames as they are.
static void forward_results(ZmqControl *z) {
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, z->pull, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        int more;
        do {
            more = zmq_msg_more(&m);
            zmq_msg_send(&m, z->router, more ? ZMQ_SNDMORE : 0);   // unknown peer: ROUTER drops it
            zmq_msg_close(&m);
            if (more) {
                zmq_msg_init(&m);
                if (zmq_msg_recv(&m, z->pull, 0) < 0) {
                    zmq_msg_close(&m);
                    return;
                }
            }
        } while (more);
    }
}

static void *socket_main(void *arg) {
    ZmqControl *z = arg;
    zmq_msg_t *parts = malloc(sizeof(zmq_msg_t) * ZC_MAX_FRAMES);
    while (parts && !atomic_load(&z->stop)) {
        zmq_pollitem_t items[2] = {{z->router, 0, ZMQ_POLLIN, 0}, {z->pull, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, ZC_POLL_MS) < 0) {
            if (zmq_errno() == EINTR) continue;
            fprintf(stderr, "zmq_control: poll failed: %s\n", zmq_strerror(zmq_errno()));
            break;
        }
        if (items[1].revents & ZMQ_POLLIN) forward_results(z);
        if (items[0].revents & ZMQ_POLLIN)
            for (int k = 0; k < ZC_RECV_BATCH && !atomic_load(&z->stop) && recv_one(z, parts); k++) {}
    }
    free(parts);
    // Stop the collector (it releases its jobs and closes the PUSH end), then flush what it sent last.
    atomic_store(&z->coll_stop, 1);
    pthread_mutex_lock(&z->mu);
    pthread_cond_signal(&z->cv);
    pthread_mutex_unlock(&z->mu);
    if (z->coll_started) pthread_join(z->coll_thread, NULL);
    z->coll_started = 0;
    forward_results(z);
    zmq_close(z->pull);
    zmq_close(z->router);
    z->pull = z->router = NULL;
    return NULL;
}

// ---- lifecycle ---------------------------------------------------------------------------------------

static void control_free(ZmqControl *z) {
    if (z->push) zmq_close(z->push);
    if (z->pull) zmq_close(z->pull);
    if (z->router) zmq_close(z->router);
    zmq_control_auth_stop(z->auth);
    if (z->ctx) zmq_ctx_term(z->ctx);
    zc_drop_jobs(z, z->incoming);
    z->incoming = NULL;
    weight_recv_free(&z->wr);
    zc_adapter_free(z);
    weight_nccl_free(z->wn);
    weight_ipc_free(z->wi);
    pthread_mutex_destroy(&z->mu);
    pthread_cond_destroy(&z->cv);
    free(z);
}

int zmq_control_start(ZmqControl **out, EngineGroup *g, const char *endpoint, const ZmqControlKeys *keys,
                      int weight_sync_timeout_ms, EngineUpdateMode update_mode, char *err, size_t err_len) {
    *out = NULL;
    if (!g || !endpoint || !*endpoint) return err_fail(err, err_len, "zmq control: engines and an endpoint are needed");
    ZmqControl *z = calloc(1, sizeof *z);
    if (!z) return err_fail(err, err_len, "zmq control: out of memory");
    z->g = g;
    z->update_mode = update_mode;
    pthread_mutex_init(&z->mu, NULL);
    pthread_cond_init(&z->cv, NULL);
    if (weight_recv_init(&z->wr, &engine_group_model(g)->layout, err, err_len) ||
        weight_nccl_create(&z->wn, g, weight_sync_timeout_ms, err, err_len) ||
        weight_ipc_create(&z->wi, g, err, err_len)) {
        control_free(z);
        return -1;
    }
    int zero = 0, linger = ZC_LINGER_MS;
    z->ctx = zmq_ctx_new();
    if (z->ctx) z->router = zmq_socket(z->ctx, ZMQ_ROUTER);
    if (!z->router) {
        err_fail(err, err_len, "zmq control: cannot create the ROUTER socket: %s", zmq_strerror(zmq_errno()));
        control_free(z);
        return -1;
    }
    // Unbounded send queue: a trainer that sends 1000s of prompts before reading must not lose results to the
    // default high-water mark (ROUTER drops on overflow). Receive stays bounded: slow weight writes push back.
    zmq_setsockopt(z->router, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(z->router, ZMQ_LINGER, &linger, sizeof linger);
    // A peer that sends a larger frame is disconnected instead of having it buffered whole.
    int64_t max_frame = ZMSG_MAX_REQUEST_FRAME_BYTES;
    zmq_setsockopt(z->router, ZMQ_MAXMSGSIZE, &max_frame, sizeof max_frame);
    // Keys before bind: a socket bound without CURVE would admit the first clients in the clear.
    if (keys && zmq_control_auth_start(&z->auth, z->ctx, z->router, keys, err, err_len) != 0) {
        control_free(z);
        return -1;
    }
    // ZeroMQ binds and accepts IPv6 only when asked; an IPv6 literal is spelt in brackets.
    int ipv6 = strchr(endpoint, '[') != NULL;
    if (ipv6) zmq_setsockopt(z->router, ZMQ_IPV6, &ipv6, sizeof ipv6);
    if (zmq_bind(z->router, endpoint) < 0) {
        const int e = zmq_errno();
        err_fail(err, err_len, "zmq control: cannot bind %s: %s%s", endpoint, zmq_strerror(e),
             e == EADDRINUSE ? " (another process holds that port: pick a free one with --control, or with "
                               "tandem-train launch --control-port, whose server i takes port P + i)"
                             : "");
        control_free(z);
        return -1;
    }
    snprintf(z->pipe_name, sizeof z->pipe_name, "inproc://tandem-zmq-control-%p", (void *)z);
    z->pull = zmq_socket(z->ctx, ZMQ_PULL);
    z->push = zmq_socket(z->ctx, ZMQ_PUSH);
    if (!z->pull || !z->push) {
        err_fail(err, err_len, "zmq control: cannot create the result pipe: %s", zmq_strerror(zmq_errno()));
        control_free(z);
        return -1;
    }
    zmq_setsockopt(z->pull, ZMQ_RCVHWM, &zero, sizeof zero);
    zmq_setsockopt(z->push, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(z->pull, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(z->push, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_bind(z->pull, z->pipe_name) < 0 || zmq_connect(z->push, z->pipe_name) < 0) {
        err_fail(err, err_len, "zmq control: cannot connect the result pipe: %s", zmq_strerror(zmq_errno()));
        control_free(z);
        return -1;
    }
    // Sockets created here migrate to their threads: pthread_create is the full barrier ZeroMQ asks for.
    if (pthread_create(&z->coll_thread, NULL, zc_collector_main, z)) {
        err_fail(err, err_len, "zmq control: cannot start the collector thread");
        control_free(z);
        return -1;
    }
    z->coll_started = 1;
    if (pthread_create(&z->sock_thread, NULL, socket_main, z)) {
        atomic_store(&z->coll_stop, 1);
        pthread_join(z->coll_thread, NULL);
        err_fail(err, err_len, "zmq control: cannot start the socket thread");
        control_free(z);
        return -1;
    }
    z->sock_started = 1;
    *out = z;
    return 0;
}

int zmq_control_shutdown_requested(ZmqControl *z) { return z ? atomic_load(&z->shutdown_requested) : 0; }

void zmq_control_on_shutdown(ZmqControl *z, void (*cb)(void *user), void *user) {
    if (!z) return;
    pthread_mutex_lock(&z->mu);
    z->on_shutdown = cb;
    z->on_shutdown_user = user;
    pthread_mutex_unlock(&z->mu);
}

void zmq_control_stop(ZmqControl *z) {
    if (!z) return;
    atomic_store(&z->stop, 1);
    if (z->sock_started) pthread_join(z->sock_thread, NULL);
    control_free(z);
}
