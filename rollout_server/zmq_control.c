// rollout_server/zmq_control.c — the ROUTER socket thread and the generate collector thread (zmq_control.h).
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

#include "rollout_server/weight_nccl.h"
#include "rollout_server/weight_recv.h"
#include "shared/zmq_msg.h"
#include "shared/err.h"

#define ZC_POLL_MS 100          // how often the threads look at the stop flag when idle
#define ZC_LINGER_MS 500        // queued replies (e.g. shutdown's ack) get this long to leave at close
#define ZC_MAX_FRAMES (ZMSG_MAX_PROMPTS + 2)   // routing id + header + prompts
#define ZC_RECV_BATCH 64        // messages read before results waiting on the inproc pipe get forwarded

// One prompt of a generate in flight: the engine handle and what its n completions produced so far.
typedef struct Job {
    struct Job *next;
    EngineRequest *req;
    int engine;                 // the engine it was routed to
    unsigned char rid[256];     // the peer's routing id (where the result goes)
    size_t rid_len;
    int64_t id;
    int prompt_index, n_prompts, n;
    int32_t **tok;              // (n) -> (cap[i]) generated ids of completion i
    float **lp;                 // (n) -> (cap[i]) their logprobs
    int *len, *cap;             // (n)
    ZmsgFinish *fin;            // (n)
    int64_t *v0, *v1;           // (n) policy version of the first / last token
    int *seen, *done;           // (n)
    int n_done;
} Job;

struct ZmqControl {
    EngineGroup *g;
    void *ctx, *router, *pull, *push;
    char pipe_name[64];
    pthread_t sock_thread, coll_thread;
    int sock_started, coll_started;
    atomic_int stop, coll_stop, shutdown_requested;
    atomic_llong prompts_in_flight;
    void (*on_shutdown)(void *);
    void *on_shutdown_user;
    pthread_mutex_t mu;         // guards incoming and on_shutdown
    pthread_cond_t cv;
    Job *incoming;              // jobs submitted by the socket thread, not yet taken by the collector
    WeightRecv wr;              // socket thread only
    WeightNccl *wn;             // socket thread only: transport nccl
    ZmqControlAuth *auth;       // NULL without keys
};

static double now_s(void) {
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

static void send_msg(void *sock, const void *rid, size_t rid_len, const ZmsgMsg *m) {
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

static void send_error(void *sock, const void *rid, size_t rid_len, int64_t id, const char *code, const char *fmt,
                       ...) {
    ZmsgMsg m;
    char text[ZMSG_TEXT_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    zmsg_error(&m, id, code, text);
    send_msg(sock, rid, rid_len, &m);
}

static void send_ack(ZmqControl *z, const void *rid, size_t rid_len, ZmsgType t, int64_t id) {
    ZmsgMsg m;
    zmsg_init(&m, t, ZMSG_DIR_REPLY, id);
    send_msg(z->router, rid, rid_len, &m);
}

// ---- collector thread: pump engine events of every job, send each finished prompt's result ------------

static void job_free(Job *j) {
    if (!j) return;
    for (int i = 0; i < j->n; i++) {
        if (j->tok) free(j->tok[i]);
        if (j->lp) free(j->lp[i]);
    }
    free(j->tok);
    free(j->lp);
    free(j->len);
    free(j->cap);
    free(j->fin);
    free(j->v0);
    free(j->v1);
    free(j->seen);
    free(j->done);
    free(j);
}

static Job *job_new(int n) {
    Job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->n = n;
    j->tok = calloc((size_t)n, sizeof *j->tok);
    j->lp = calloc((size_t)n, sizeof *j->lp);
    j->len = calloc((size_t)n, sizeof *j->len);
    j->cap = calloc((size_t)n, sizeof *j->cap);
    j->fin = calloc((size_t)n, sizeof *j->fin);
    j->v0 = calloc((size_t)n, sizeof *j->v0);
    j->v1 = calloc((size_t)n, sizeof *j->v1);
    j->seen = calloc((size_t)n, sizeof *j->seen);
    j->done = calloc((size_t)n, sizeof *j->done);
    if (!j->tok || !j->lp || !j->len || !j->cap || !j->fin || !j->v0 || !j->v1 || !j->seen || !j->done) {
        job_free(j);
        return NULL;
    }
    return j;
}

static ZmsgFinish map_finish(FinishReason r) {
    switch (r) {
    case FINISH_LENGTH: return ZMSG_FINISH_LENGTH;
    case FINISH_STOP: return ZMSG_FINISH_STOP;
    case FINISH_ABORT: return ZMSG_FINISH_ABORT;
    default: return ZMSG_FINISH_ERROR;
    }
}

// Appends one engine event to its completion. When memory runs out the completion is finished as "error",
// so the result still goes out.
static void job_event(Job *j, const EngineEvent *ev) {
    int i = ev->index;
    if (i < 0 || i >= j->n || j->done[i]) return;
    if (ev->n_tokens > 0) {
        if (j->len[i] + ev->n_tokens > j->cap[i]) {
            int cap = j->cap[i] ? j->cap[i] : 64;
            while (cap < j->len[i] + ev->n_tokens) cap *= 2;
            int32_t *t = realloc(j->tok[i], sizeof(int32_t) * (size_t)cap);
            if (t) j->tok[i] = t;
            float *l = realloc(j->lp[i], sizeof(float) * (size_t)cap);
            if (l) j->lp[i] = l;
            if (!t || !l) {
                j->fin[i] = ZMSG_FINISH_ERROR;
                j->done[i] = 1;
                j->n_done++;
                return;
            }
            j->cap[i] = cap;
        }
        memcpy(j->tok[i] + j->len[i], ev->tokens, sizeof(int32_t) * (size_t)ev->n_tokens);
        memcpy(j->lp[i] + j->len[i], ev->logprobs, sizeof(float) * (size_t)ev->n_tokens);
        j->len[i] += ev->n_tokens;
    }
    if (ev->n_tokens > 0 || !j->seen[i]) {
        if (!j->seen[i]) j->v0[i] = ev->policy_version;
        j->v1[i] = ev->policy_version;
        j->seen[i] = 1;
    }
    if (ev->finish != FINISH_NONE) {
        j->fin[i] = map_finish(ev->finish);
        j->done[i] = 1;
        j->n_done++;
    }
}

// Sends the prompt's result through the inproc PUSH socket (the socket thread forwards it to the peer).
static void job_send(ZmqControl *z, Job *j) {
    size_t total = 0;
    for (int i = 0; i < j->n; i++) total += (size_t)j->len[i];
    int32_t *tok = malloc(sizeof(int32_t) * (total ? total : 1));
    float *lp = malloc(sizeof(float) * (total ? total : 1));
    if (!tok || !lp) {
        free(tok);
        free(lp);
        send_error(z->push, j->rid, j->rid_len, j->id, "out_of_memory",
                   "generate: out of memory assembling the result of prompt %d", j->prompt_index);
        return;
    }
    size_t at = 0;
    for (int i = 0; i < j->n; i++) {
        if (j->len[i]) {
            memcpy(tok + at, j->tok[i], sizeof(int32_t) * (size_t)j->len[i]);
            memcpy(lp + at, j->lp[i], sizeof(float) * (size_t)j->len[i]);
        }
        at += (size_t)j->len[i];
    }
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_RESULT, ZMSG_DIR_REPLY, j->id);
    m.prompt_index = j->prompt_index;
    m.n_prompts = j->n_prompts;
    m.n_completions = j->n;
    m.completion_lens = j->len;
    m.finish_reasons = j->fin;
    m.policy_versions = j->v0;
    m.policy_versions_end = j->v1;
    m.tokens = tok;
    m.logprobs = lp;
    m.prompt_tokens = engine_request_prompt_tokens(j->req);
    m.cached_tokens = engine_request_cached_tokens(j->req);
    send_msg(z->push, j->rid, j->rid_len, &m);
    free(tok);
    free(lp);
}

// Reads every event available now (timeout_ms for the first one). Returns 1 if any arrived.
static int job_pump(Job *j, int timeout_ms) {
    EngineEvent ev;
    int got = 0;
    while (j->n_done < j->n) {
        int rc = engine_request_next(j->req, &ev, got ? 0 : timeout_ms);
        if (rc == 1) {
            job_event(j, &ev);
            got = 1;
        } else if (rc < 0) {
            // The engine says nothing more will come: completions without a finish event ended in error.
            for (int i = 0; i < j->n; i++)
                if (!j->done[i]) {
                    j->fin[i] = ZMSG_FINISH_ERROR;
                    j->done[i] = 1;
                    j->n_done++;
                }
            got = 1;
        } else {
            break;
        }
    }
    return got;
}

static void *collector_main(void *arg) {
    ZmqControl *z = arg;
    Job *jobs = NULL;
    for (;;) {
        pthread_mutex_lock(&z->mu);
        if (!jobs && !z->incoming && !atomic_load(&z->coll_stop)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += ZC_POLL_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&z->cv, &z->mu, &ts);
        }
        while (z->incoming) {   // move new jobs to the end of the local list, keeping submission order
            Job *j = z->incoming;
            z->incoming = j->next;
            j->next = NULL;
            Job **tail = &jobs;
            while (*tail) tail = &(*tail)->next;
            *tail = j;
        }
        pthread_mutex_unlock(&z->mu);
        if (atomic_load(&z->coll_stop)) break;
        int any = 0;
        for (Job **pj = &jobs; *pj;) {
            Job *j = *pj;
            any |= job_pump(j, 0);
            if (j->n_done == j->n) {
                job_send(z, j);
                engine_group_release(z->g, j->req, j->engine, j->n);
                atomic_fetch_sub(&z->prompts_in_flight, 1);
                *pj = j->next;
                job_free(j);
            } else {
                pj = &j->next;
            }
        }
        // Nothing ready: block briefly on the oldest job instead of spinning (its finishes wake us at once; the
        // others' finishes wait at most this long, which only delays a result, never a token).
        if (!any && jobs) job_pump(jobs, 5);
    }
    // Stopping: abort what is still running.
    while (jobs) {
        Job *j = jobs;
        jobs = j->next;
        engine_group_release(z->g, j->req, j->engine, j->n);
        atomic_fetch_sub(&z->prompts_in_flight, 1);
        job_free(j);
    }
    zmq_close(z->push);
    z->push = NULL;
    return NULL;
}

// ---- socket thread: parse requests, act, reply --------------------------------------------------------

static const char *engine_code(int rc) {
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
        send_error(z->router, rid, rl, q->id, "unsupported_version",
                   "hello: this server speaks protocol version %d, the peer asked for %d", ZMSG_PROTOCOL_VERSION,
                   q->protocol_version);
        return;
    }
    const Model *model = engine_group_model(z->g);
    const Layout *L = &model->layout;
    int64_t *numel = malloc(sizeof(int64_t) * (size_t)L->n_units);
    if (!numel) {
        send_error(z->router, rid, rl, q->id, "out_of_memory", "hello: out of memory");
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
    send_msg(z->router, rid, rl, &m);
    free(numel);
}

static void do_generate(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    const ZmsgSampling *s = &q->sampling;
    SamplingParams sp;
    sampling_params_default(&sp);
    sp.n = s->n;
    sp.max_tokens = s->max_tokens;
    sp.temperature = s->temperature;
    sp.top_p = s->top_p;
    sp.top_k = s->top_k;
    sp.min_p = s->min_p;
    sp.repetition_penalty = s->repetition_penalty;
    sp.has_seed = s->has_seed;
    sp.seed = s->seed;
    sp.ignore_eos = s->ignore_eos;
    sp.no_text = 1; // results carry ids and logprobs only
    for (int i = 0; i < s->n_stop_token_ids && i < ENGINE_MAX_STOP; i++) sp.stop_token_ids[i] = s->stop_token_ids[i];
    sp.n_stop_token_ids = s->n_stop_token_ids < ENGINE_MAX_STOP ? s->n_stop_token_ids : ENGINE_MAX_STOP;
    // All prompts or none: a refusal of prompt k releases (aborts) prompts 0..k-1 and answers one error.
    Job *first = NULL, **tail = &first;
    char err[512];
    for (int p = 0; p < q->n_prompts; p++) {
        Job *j = job_new(s->n);
        int rc = j ? engine_group_submit(z->g, q->prompts[p], q->prompt_lens[p], &sp, &j->req, &j->engine, err,
                                         sizeof err)
                   : ENGINE_ENOMEM;
        if (rc) {
            if (!j) snprintf(err, sizeof err, "out of memory");
            job_free(j);
            while (first) {
                Job *n = first->next;
                engine_group_release(z->g, first->req, first->engine, first->n);
                job_free(first);
                first = n;
            }
            send_error(z->router, rid, rl, q->id, engine_code(rc), "generate: prompt %d of %d refused: %s", p,
                       q->n_prompts, err);
            return;
        }
        engine_request_wake_on_finish(j->req); // results go out whole: per-step wakes would only cost the engine
        memcpy(j->rid, rid, rl);
        j->rid_len = rl;
        j->id = q->id;
        j->prompt_index = p;
        j->n_prompts = q->n_prompts;
        *tail = j;
        tail = &j->next;
    }
    atomic_fetch_add(&z->prompts_in_flight, q->n_prompts);
    pthread_mutex_lock(&z->mu);
    Job **t = &z->incoming;
    while (*t) t = &(*t)->next;
    *t = first;
    pthread_cond_signal(&z->cv);
    pthread_mutex_unlock(&z->mu);
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
    send_msg(z->router, rid, rl, &m);
}

static float *staging_of(void *user, int unit) { return engine_group_weights_staging((EngineGroup *)user, unit); }

// Transport nccl (rollout_server/weight_nccl.h): checks, then the receive runs on its own thread; the reply goes
// out at once so that the trainer ranks can start sending.
static void begin_nccl(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    char err[768];
    if (!weight_nccl_supported(z->wn, err, sizeof err)) {
        send_error(z->router, rid, rl, q->id, "unsupported", "weights_begin: transport \"nccl\": %s; use transport "
                   "\"zmq\"", err);
        return;
    }
    if (q->layout_hash != z->wr.layout_hash) {
        char a[17], b[17];
        zmsg_hash_to_hex(q->layout_hash, a);
        zmsg_hash_to_hex(z->wr.layout_hash, b);
        send_error(z->router, rid, rl, q->id, "layout_mismatch", "weights_begin: layout hash %s, this server's model "
                   "has %s", a, b);
        return;
    }
    weight_recv_reset(&z->wr);   // a zmq update still open is abandoned, as by any weights_begin
    int bad_engine, bad_unit;
    if (engine_group_device_staging_ready(z->g, &bad_engine, &bad_unit) != 0) {
        send_error(z->router, rid, rl, q->id, "out_of_memory", "weights_begin: no GPU memory on %s for the second "
                   "copy of the weights that an NCCL update is received into (unit %d); lower --kv-cache-memory",
                   engine_group_device_name(z->g, bad_engine), bad_unit);
        return;
    }
    if (weight_nccl_begin(z->wn, q, err, sizeof err) != 0) {
        send_error(z->router, rid, rl, q->id, "internal", "weights_begin: %s", err);
        return;
    }
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, ZMSG_DIR_REPLY, q->id);
    m.version = q->version;
    send_msg(z->router, rid, rl, &m);
}

static void end_nccl(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    char err[768];
    double received;
    if (weight_nccl_finish(z->wn, q->version, &received, err, sizeof err) != 0) {
        fprintf(stderr, "tandem-serve: weight update to version %lld over NCCL failed; serving the previous "
                        "weights: %s\n", (long long)q->version, err);
        send_error(z->router, rid, rl, q->id, "internal", "weights_end: %s", err);
        return;
    }
    double t0 = now_s();
    int rc = engine_group_commit_device_weights(z->g, q->version, err, sizeof err);
    double t1 = now_s();
    if (rc) {
        send_error(z->router, rid, rl, q->id, engine_code(rc), "weights_end: commit failed: %s", err);
        return;
    }
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_WEIGHTS_END, ZMSG_DIR_REPLY, q->id);
    m.version = q->version;
    m.seconds = received + (t1 - t0);
    m.commit_seconds = t1 - t0;
    send_msg(z->router, rid, rl, &m);
}

static void do_weights(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    char err[768];
    if (q->type == ZMSG_WEIGHTS_BEGIN) {
        if (q->transport == ZMSG_TRANSPORT_NCCL) {
            begin_nccl(z, rid, rl, q);
            return;
        }
        weight_nccl_abandon(z->wn);
        int64_t abandoned;
        if (weight_recv_begin(&z->wr, q->version, q->layout_hash, rid, rl, &abandoned, err, sizeof err)) {
            send_error(z->router, rid, rl, q->id, "layout_mismatch", "%s", err);
            return;
        }
        if (abandoned >= 0)
            fprintf(stderr, "zmq_control: weight update to version %lld abandoned by a new weights_begin\n",
                    (long long)abandoned);
        ZmsgMsg m;
        zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, ZMSG_DIR_REPLY, q->id);
        m.version = q->version;
        send_msg(z->router, rid, rl, &m);
    } else if (q->type == ZMSG_WEIGHTS_SLICE) {
        if (weight_recv_slice(&z->wr, rid, rl, q->has_version, q->version, q->unit, q->offset, q->count, q->dtype, q->slice_data, staging_of,
                              z->g, err, sizeof err))
            send_error(z->router, rid, rl, q->id, "bad_slice", "%s", err);
    } else if (weight_nccl_active(z->wn)) {
        end_nccl(z, rid, rl, q);
    } else {
        if (weight_recv_ready(&z->wr, rid, rl, q->version, err, sizeof err)) {
            send_error(z->router, rid, rl, q->id, "weights_incomplete", "%s", err);
            return;
        }
        double t0 = now_s();
        int rc = engine_group_commit_weights(z->g, q->version, err, sizeof err);
        double t1 = now_s();
        double total = t1 - z->wr.t_begin;
        weight_recv_reset(&z->wr);
        if (rc) {
            send_error(z->router, rid, rl, q->id, engine_code(rc), "weights_end: commit failed: %s", err);
            return;
        }
        ZmsgMsg m;
        zmsg_init(&m, ZMSG_WEIGHTS_END, ZMSG_DIR_REPLY, q->id);
        m.version = q->version;
        m.seconds = total;
        m.commit_seconds = t1 - t0;
        send_msg(z->router, rid, rl, &m);
    }
}

// One message from the ROUTER: frames[0] the peer's routing id, frames[1..] what the peer sent.
static void handle(ZmqControl *z, zmq_msg_t *parts, int n_parts, int overflow) {
    const void *rid = zmq_msg_data(&parts[0]);
    size_t rl = zmq_msg_size(&parts[0]);
    if (rl > 256) return;   // ZeroMQ never makes such ids; nothing sensible to answer to
    if (overflow) {
        send_error(z->router, rid, rl, -1, "bad_message", "message has more than %d frames", ZC_MAX_FRAMES - 1);
        return;
    }
    ZmsgFrame fr[ZC_MAX_FRAMES];
    for (int i = 1; i < n_parts; i++) fr[i - 1] = (ZmsgFrame){zmq_msg_data(&parts[i]), zmq_msg_size(&parts[i])};
    ZmsgMsg q;
    char err[768];
    if (zmsg_parse(&q, ZMSG_DIR_REQUEST, fr, n_parts - 1, err, sizeof err)) {
        send_error(z->router, rid, rl, q.id, "bad_message", "%s", err);
        return;
    }
    switch (q.type) {
    case ZMSG_HELLO: do_hello(z, rid, rl, &q); break;
    case ZMSG_GENERATE: do_generate(z, rid, rl, &q); break;
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
    case ZMSG_WEIGHTS_END: do_weights(z, rid, rl, &q); break;
    default: send_error(z->router, rid, rl, q.id, "bad_message", "%s is not a request", zmsg_type_name(q.type));
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
    while (z->incoming) {
        Job *j = z->incoming;
        z->incoming = j->next;
        engine_group_release(z->g, j->req, j->engine, j->n);
        job_free(j);
    }
    weight_recv_free(&z->wr);
    weight_nccl_free(z->wn);
    pthread_mutex_destroy(&z->mu);
    pthread_cond_destroy(&z->cv);
    free(z);
}

int zmq_control_start(ZmqControl **out, EngineGroup *g, const char *endpoint, const ZmqControlKeys *keys,
                      int weight_sync_timeout_ms, char *err, size_t err_len) {
    *out = NULL;
    if (!g || !endpoint || !*endpoint) return err_fail(err, err_len, "zmq control: engines and an endpoint are needed");
    ZmqControl *z = calloc(1, sizeof *z);
    if (!z) return err_fail(err, err_len, "zmq control: out of memory");
    z->g = g;
    pthread_mutex_init(&z->mu, NULL);
    pthread_cond_init(&z->cv, NULL);
    if (weight_recv_init(&z->wr, &engine_group_model(g)->layout, err, err_len) ||
        weight_nccl_create(&z->wn, g, weight_sync_timeout_ms, err, err_len)) {
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
    if (pthread_create(&z->coll_thread, NULL, collector_main, z)) {
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
