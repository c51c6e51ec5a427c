// rollout_server/zmq_generate.c — generate requests on the control channel (zmq_control.h): the socket thread
// submits each prompt as a job (zc_generate); the collector thread pumps the engine events of every job in flight
// and sends each finished prompt's result through the inproc PUSH socket, which the socket thread forwards to the
// peer, so that each ZeroMQ socket is only ever touched by one thread.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "rollout_server/zmq_control_internal.h"

// One prompt of a generate in flight: the engine handle and what its n completions produced so far.
struct ZcJob {
    struct ZcJob *next;
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
    ZmsgVersionChange **chg;    // (n) -> (chg_cap[i]) where completion i's version changed (token index, version)
    int *n_chg, *chg_cap;       // (n)
    int *seen, *done;           // (n)
    int n_done;
};

// ---- collector thread: pump engine events of every job, send each finished prompt's result ------------

static void job_free(ZcJob *j) {
    if (!j) return;
    for (int i = 0; i < j->n; i++) {
        if (j->tok) free(j->tok[i]);
        if (j->lp) free(j->lp[i]);
        if (j->chg) free(j->chg[i]);
    }
    free(j->tok);
    free(j->lp);
    free(j->chg);
    free(j->n_chg);
    free(j->chg_cap);
    free(j->len);
    free(j->cap);
    free(j->fin);
    free(j->v0);
    free(j->v1);
    free(j->seen);
    free(j->done);
    free(j);
}

static ZcJob *job_new(int n) {
    ZcJob *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->n = n;
    j->tok = calloc((size_t)n, sizeof *j->tok);
    j->lp = calloc((size_t)n, sizeof *j->lp);
    j->len = calloc((size_t)n, sizeof *j->len);
    j->cap = calloc((size_t)n, sizeof *j->cap);
    j->fin = calloc((size_t)n, sizeof *j->fin);
    j->v0 = calloc((size_t)n, sizeof *j->v0);
    j->v1 = calloc((size_t)n, sizeof *j->v1);
    j->chg = calloc((size_t)n, sizeof *j->chg);
    j->n_chg = calloc((size_t)n, sizeof *j->n_chg);
    j->chg_cap = calloc((size_t)n, sizeof *j->chg_cap);
    j->seen = calloc((size_t)n, sizeof *j->seen);
    j->done = calloc((size_t)n, sizeof *j->done);
    if (!j->tok || !j->lp || !j->len || !j->cap || !j->fin || !j->v0 || !j->v1 || !j->chg || !j->n_chg || !j->chg_cap ||
        !j->seen || !j->done) {
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

// Completion i ends as "error" (out of memory), so that the result still goes out.
static void job_fail(ZcJob *j, int i) {
    j->fin[i] = ZMSG_FINISH_ERROR;
    j->done[i] = 1;
    j->n_done++;
}

// Records that completion i's tokens from its current length on come from `version`. Returns 0 or -1 (no memory).
static int job_version_change(ZcJob *j, int i, int64_t version) {
    if (j->n_chg[i] == j->chg_cap[i]) {
        const int cap = j->chg_cap[i] ? 2 * j->chg_cap[i] : 4;
        ZmsgVersionChange *c = realloc(j->chg[i], (size_t)cap * sizeof *c);
        if (!c) return -1;
        j->chg[i] = c;
        j->chg_cap[i] = cap;
    }
    j->chg[i][j->n_chg[i]++] = (ZmsgVersionChange){.token = j->len[i], .version = version};
    return 0;
}

// Appends one engine event to its completion: tokens, logprobs, and a version change when the event's version is
// not that of the completion's last token. A restarted completion (weight update, mode abort) drops what it had.
// When memory runs out the completion is finished as "error", so the result still goes out.
static void job_event(ZcJob *j, const EngineEvent *ev) {
    int i = ev->index;
    if (i < 0 || i >= j->n || j->done[i]) return;
    if (ev->restarted) {
        j->len[i] = 0;
        j->n_chg[i] = 0;
        j->seen[i] = 0;
    }
    if (ev->n_tokens > 0 && j->len[i] > 0 && ev->policy_version != j->v1[i] &&
        job_version_change(j, i, ev->policy_version) != 0) {
        job_fail(j, i);
        return;
    }
    if (ev->n_tokens > 0) {
        if (j->len[i] + ev->n_tokens > j->cap[i]) {
            int cap = j->cap[i] ? j->cap[i] : 64;
            while (cap < j->len[i] + ev->n_tokens) cap *= 2;
            int32_t *t = realloc(j->tok[i], sizeof(int32_t) * (size_t)cap);
            if (t) j->tok[i] = t;
            float *l = realloc(j->lp[i], sizeof(float) * (size_t)cap);
            if (l) j->lp[i] = l;
            if (!t || !l) {
                job_fail(j, i);
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
static void job_send(ZmqControl *z, ZcJob *j) {
    size_t total = 0;
    for (int i = 0; i < j->n; i++) total += (size_t)j->len[i];
    int32_t *tok = malloc(sizeof(int32_t) * (total ? total : 1));
    float *lp = malloc(sizeof(float) * (total ? total : 1));
    if (!tok || !lp) {
        free(tok);
        free(lp);
        zc_send_error(z->push, j->rid, j->rid_len, j->id, "out_of_memory",
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
    // Version changes, flattened completion by completion (sent only when there is one).
    size_t n_changes = 0;
    for (int i = 0; i < j->n; i++) n_changes += (size_t)j->n_chg[i];
    ZmsgVersionChange *chg = n_changes ? malloc(n_changes * sizeof *chg) : NULL;
    if (n_changes && !chg) {
        free(tok);
        free(lp);
        zc_send_error(z->push, j->rid, j->rid_len, j->id, "out_of_memory",
                      "generate: out of memory assembling the result of prompt %d", j->prompt_index);
        return;
    }
    for (int i = 0, at_c = 0; i < j->n; i++) {
        if (j->n_chg[i]) memcpy(chg + at_c, j->chg[i], (size_t)j->n_chg[i] * sizeof *chg);
        at_c += j->n_chg[i];
    }
    m.n_version_changes = chg ? j->n_chg : NULL;
    m.version_changes = chg;
    m.tokens = tok;
    m.logprobs = lp;
    m.prompt_tokens = engine_request_prompt_tokens(j->req);
    m.cached_tokens = engine_request_cached_tokens(j->req);
    zc_send_msg(z->push, j->rid, j->rid_len, &m);
    free(tok);
    free(lp);
    free(chg);
}

// Reads every event available now (timeout_ms for the first one). Returns 1 if any arrived.
static int job_pump(ZcJob *j, int timeout_ms) {
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

void *zc_collector_main(void *arg) {
    ZmqControl *z = arg;
    ZcJob *jobs = NULL;
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
            ZcJob *j = z->incoming;
            z->incoming = j->next;
            j->next = NULL;
            ZcJob **tail = &jobs;
            while (*tail) tail = &(*tail)->next;
            *tail = j;
        }
        pthread_mutex_unlock(&z->mu);
        if (atomic_load(&z->coll_stop)) break;
        int any = 0;
        for (ZcJob **pj = &jobs; *pj;) {
            ZcJob *j = *pj;
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
        ZcJob *j = jobs;
        jobs = j->next;
        engine_group_release(z->g, j->req, j->engine, j->n);
        atomic_fetch_sub(&z->prompts_in_flight, 1);
        job_free(j);
    }
    zmq_close(z->push);
    z->push = NULL;
    return NULL;
}

void zc_drop_jobs(ZmqControl *z, ZcJob *jobs) {
    while (jobs) {
        ZcJob *j = jobs;
        jobs = j->next;
        engine_group_release(z->g, j->req, j->engine, j->n);
        job_free(j);
    }
}

// ---- socket thread: a generate request becomes one job per prompt ------------------------------------

void zc_generate(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
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
    ZcJob *first = NULL, **tail = &first;
    char err[512];
    for (int p = 0; p < q->n_prompts; p++) {
        ZcJob *j = job_new(s->n);
        int rc = j ? engine_group_submit(z->g, q->prompts[p], q->prompt_lens[p], &sp, &j->req, &j->engine, err,
                                         sizeof err)
                   : ENGINE_ENOMEM;
        if (rc) {
            if (!j) snprintf(err, sizeof err, "out of memory");
            job_free(j);
            while (first) {
                ZcJob *n = first->next;
                engine_group_release(z->g, first->req, first->engine, first->n);
                job_free(first);
                first = n;
            }
            zc_send_error(z->router, rid, rl, q->id, zc_engine_code(rc), "generate: prompt %d of %d refused: %s", p,
                          q->n_prompts, err);
            return;
        }
        engine_request_wake_on_finish(j->req); // results go out whole: per-step wakes would only cost the engine
        engine_request_allow_restart(j->req);  // ... so a weight update in mode abort may start them over
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
    ZcJob **t = &z->incoming;
    while (*t) t = &(*t)->next;
    *t = first;
    pthread_cond_signal(&z->cv);
    pthread_mutex_unlock(&z->mu);
}
