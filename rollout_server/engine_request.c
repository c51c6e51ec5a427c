// rollout_server/engine_request.c — request handles: what a submitting thread holds while the engine thread
// generates. Each handle has its own mutex, condition variable and queue of event slots; the engine thread
// pushes, the client pops. Slots are recycled through a free list, so a long generation allocates nothing per
// token once its buffers have grown.
//
// Lifetime: the handle is freed by whichever side lets go last — the engine thread (request_engine_done, state
// REQ_DONE) or the client (engine_request_release). A client that lets go first puts the request on the engine's
// abort list; from then on only the engine thread may free it.
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout_server/engine_internal.h"
#include "rollout_server/sample_mask.h"

int request_alloc(EngineRequest **out, Engine *e, const int32_t *prompt, int prompt_len, const SamplingParams *p,
                  int max_blocks, const Tokenizer *tok, const int32_t *eos, int n_eos, char *err, size_t err_len) {
    *out = NULL;
    EngineRequest *r = calloc(1, sizeof *r);
    if (!r) goto oom;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->e = e;
    r->p = *p;
    r->n = p->n;
    r->prompt_len = prompt_len;
    r->max_len = prompt_len + p->max_tokens;
    for (int i = 0; i < ENGINE_MAX_STOP; i++) r->p.stop[i] = NULL;
    for (int i = 0; i < p->n_stop; i++)
        if (!(r->p.stop[i] = strdup(p->stop[i]))) goto oom;
    if (p->n_allowed > 0) {
        if (!(r->mask_allowed = malloc((size_t)p->n_allowed * sizeof *r->mask_allowed))) goto oom;
        memcpy(r->mask_allowed, p->allowed_token_ids, (size_t)p->n_allowed * sizeof *r->mask_allowed);
    }
    r->p.allowed_token_ids = r->mask_allowed;
    if (p->n_bad_words > 0) {
        const int n_ids = p->bad_words_offsets[p->n_bad_words];
        r->mask_bad_offsets = malloc((size_t)(p->n_bad_words + 1) * sizeof *r->mask_bad_offsets);
        r->mask_bad_ids = malloc((size_t)(n_ids > 0 ? n_ids : 1) * sizeof *r->mask_bad_ids);
        if (!r->mask_bad_offsets || !r->mask_bad_ids) goto oom;
        memcpy(r->mask_bad_offsets, p->bad_words_offsets, (size_t)(p->n_bad_words + 1) * sizeof *r->mask_bad_offsets);
        memcpy(r->mask_bad_ids, p->bad_words_ids, (size_t)n_ids * sizeof *r->mask_bad_ids);
    }
    r->p.bad_words_ids = r->mask_bad_ids;
    r->p.bad_words_offsets = r->mask_bad_offsets;
    if (p->structured_regex) {   // compiled here (or shared), on the caller's thread: the engine thread only reads it
        char msg[400];
        if (guide_cache_get(&e->guides, p->structured_regex, p->structured_regex_len, tok, e->V, eos, n_eos,
                            &r->guide, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "structured_outputs: %s", msg);
            request_free(r);
            return ENGINE_EINVAL;
        }
    }
    r->p.structured_regex = NULL;   // the caller's text; the guide is what the request keeps
    r->mask_cap = sample_mask_cap(&r->p, r->guide, n_eos);
    r->q_cap = r->n < 4 ? 4 : r->n;
    r->queue = calloc((size_t)r->q_cap, sizeof *r->queue);
    r->open = calloc((size_t)r->n, sizeof *r->open);
    r->restart_next = calloc((size_t)r->n, 1);
    r->seqs = calloc((size_t)r->n, sizeof *r->seqs);
    if (!r->queue || !r->open || !r->restart_next || !r->seqs) goto oom;
    if (p->prompt_logprobs >= 0) {
        r->prompt_lp = malloc((size_t)prompt_len * sizeof *r->prompt_lp);
        r->prompt_rank = calloc((size_t)prompt_len, sizeof *r->prompt_rank);
        r->prompt_top = calloc((size_t)prompt_len * (p->prompt_logprobs ? p->prompt_logprobs : 1),
                               sizeof *r->prompt_top);
        if (!r->prompt_lp || !r->prompt_rank || !r->prompt_top) goto oom;
        for (int i = 0; i < prompt_len; i++) r->prompt_lp[i] = NAN;
    }
    for (int i = 0; i < r->n; i++) {
        EngSeq *q = &r->seqs[i];
        q->req = r;
        q->index = i;
        q->s.cap = r->max_len;
        q->s.n_prompt = prompt_len;
        q->s.n_tokens = prompt_len;
        if (!(q->s.tokens = malloc((size_t)r->max_len * sizeof *q->s.tokens))) goto oom;
        memcpy(q->s.tokens, prompt, (size_t)prompt_len * sizeof *prompt);
        if (bm_table_init(&q->s.table, max_blocks) != 0) goto oom;
        // A LoRA adapter changes every layer's K/V: its sequences share cached prefixes only with each other.
        if (p->adapter > 0) bm_table_set_root(&q->s.table, 0x9E3779B97F4A7C15ULL * (uint64_t)p->adapter);
        q->s.no_prefix_match = p->prompt_logprobs >= 0;
        const Tokenizer *text_tok = r->p.no_text && r->p.n_stop == 0 ? NULL : tok; // NULL: ids and finishes only
        if (detok_init(&q->detok, text_tok, &r->p, eos, n_eos, err, err_len) != 0) {
            request_free(r);
            return ENGINE_ENOMEM;
        }
    }
    r->state = REQ_QUEUED;
    r->n_live = r->n;
    r->wake_slot = -1;
    *out = r;
    return 0;
oom:
    snprintf(err, err_len, "out of memory for a request of n=%d x %d tokens", p->n, prompt_len + p->max_tokens);
    request_free(r);
    return ENGINE_ENOMEM;
}

static void slot_free(EvSlot *s) {
    if (!s) return;
    free(s->tokens);
    free(s->logprobs);
    free(s->top);
    textbuf_free(&s->text);
    free(s);
}

void request_free(EngineRequest *r) {
    if (!r) return;
    if (r->seqs) {
        for (int i = 0; i < r->n; i++) {
            free(r->seqs[i].s.tokens);
            bm_table_destroy(&r->seqs[i].s.table);
            detok_free(&r->seqs[i].detok);
        }
        free(r->seqs);
    }
    if (r->queue)
        for (int i = 0; i < r->q_len; i++) slot_free(r->queue[(r->q_head + i) % r->q_cap]);
    while (r->free_slots) {
        EvSlot *s = r->free_slots;
        r->free_slots = s->next_free;
        slot_free(s);
    }
    slot_free(r->current);
    if (r->guide) guide_cache_put(&r->e->guides, r->guide);
    free(r->prompt_lp);
    free(r->prompt_top);
    free(r->prompt_rank);
    free(r->queue);
    free(r->open);
    free(r->restart_next);
    for (int i = 0; i < ENGINE_MAX_STOP; i++) free(r->p.stop[i]);
    free(r->mask_allowed);
    free(r->mask_bad_ids);
    free(r->mask_bad_offsets);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

static int slot_reserve(EvSlot *s, int n, int k) {
    if (n <= s->cap) return 0;
    int cap = s->cap ? s->cap : 4;
    while (cap < n) cap *= 2;
    int32_t *t = realloc(s->tokens, (size_t)cap * sizeof *t);
    if (!t) return -1;
    s->tokens = t;
    float *l = realloc(s->logprobs, (size_t)cap * sizeof *l);
    if (!l) return -1;
    s->logprobs = l;
    if (k > 0) {
        TokenLogprob *tp = realloc(s->top, (size_t)cap * k * sizeof *tp);
        if (!tp) return -1;
        s->top = tp;
    }
    s->cap = cap;
    return 0;
}

// A fresh slot at the back of the queue (under r->mu).
static EvSlot *slot_open(EngineRequest *r, int index, int64_t version) {
    EvSlot *s = r->free_slots;
    if (s) r->free_slots = s->next_free;
    else if (!(s = calloc(1, sizeof *s))) return NULL;
    if (r->q_len == r->q_cap) {
        EvSlot **q = malloc((size_t)r->q_cap * 2 * sizeof *q);
        if (!q) {
            s->next_free = r->free_slots;
            r->free_slots = s;
            return NULL;
        }
        for (int i = 0; i < r->q_len; i++) q[i] = r->queue[(r->q_head + i) % r->q_cap];
        free(r->queue);
        r->queue = q;
        r->q_head = 0;
        r->q_cap *= 2;
    }
    s->index = index;
    s->n = 0;
    s->text.len = 0;
    if (s->text.data) s->text.data[0] = '\0';
    s->finish = FINISH_NONE;
    s->stop_reason = NULL;
    s->stop_token = -1;
    s->version = version;
    s->restarted = r->restart_next[index];
    r->restart_next[index] = 0;
    s->next_free = NULL;
    r->queue[(r->q_head + r->q_len++) % r->q_cap] = s;
    r->open[index] = s;
    return s;
}

int request_push(EngineRequest *r, int index, int32_t tok, float logprob, const TokenLogprob *top, const char *text,
                 size_t text_len, FinishReason finish, const char *stop_reason, int32_t stop_token, int64_t version,
                 int *wake) {
    const int k = r->p.top_logprobs;
    int rc = 0;
    pthread_mutex_lock(&r->mu);
    *wake = 0;
    if (r->released) goto out; // nobody will read it
    EvSlot *s = r->open[index];
    if (s && s->version != version) s = r->open[index] = NULL; // one policy version per event
    if (!s && !(s = slot_open(r, index, version))) goto oom;
    if (tok >= 0) {
        if (slot_reserve(s, s->n + 1, k) != 0) goto oom;
        s->tokens[s->n] = tok;
        s->logprobs[s->n] = logprob;
        if (k > 0) memcpy(s->top + (size_t)s->n * k, top, (size_t)k * sizeof *top);
        s->n++;
    }
    if (text_len && textbuf_append(&s->text, text, text_len) != 0) goto oom;
    if (finish != FINISH_NONE) {
        s->finish = finish;
        s->stop_reason = stop_reason;
        s->stop_token = stop_token;
        r->open[index] = NULL;
    }
    goto out;
oom:
    // Without memory for the event, end the completion visibly rather than lose tokens silently.
    rc = -1;
    if (r->open[index]) {
        r->open[index]->finish = FINISH_ERROR;
        r->open[index] = NULL;
    }
out:
    *wake = !r->released && (!r->wake_on_finish || finish != FINISH_NONE || rc != 0);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

void request_restart(EngineRequest *r, int index) {
    pthread_mutex_lock(&r->mu);
    r->open[index] = NULL; // what it holds stays queued: the client drops it when the restarted slot comes
    r->restart_next[index] = 1;
    pthread_mutex_unlock(&r->mu);
}

int request_restartable(EngineRequest *r) {
    pthread_mutex_lock(&r->mu);
    const int yes = r->restartable;
    pthread_mutex_unlock(&r->mu);
    return yes;
}

void engine_request_allow_restart(EngineRequest *r) {
    pthread_mutex_lock(&r->mu);
    r->restartable = 1;
    pthread_mutex_unlock(&r->mu);
}

void request_wake(EngineRequest *r) {
    pthread_mutex_lock(&r->mu);
    pthread_cond_broadcast(&r->cv); // no system call when nobody waits
    pthread_mutex_unlock(&r->mu);
}

void engine_request_wake_on_finish(EngineRequest *r) {
    pthread_mutex_lock(&r->mu);
    r->wake_on_finish = 1;
    pthread_mutex_unlock(&r->mu);
}

void request_set_state(EngineRequest *r, ReqState state) {
    pthread_mutex_lock(&r->mu);
    r->state = state;
    pthread_mutex_unlock(&r->mu);
}

void request_engine_done(EngineRequest *r) {
    pthread_mutex_lock(&r->mu);
    r->state = REQ_DONE;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

int engine_request_next(EngineRequest *r, EngineEvent *ev, int timeout_ms) {
    struct timespec deadline;
    if (timeout_ms > 0) {
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_sec += timeout_ms / 1000;
        deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&r->mu);
    while (r->q_len == 0) {
        // Every completion's finish delivered, or the engine gone without one (an event it could not allocate).
        if (r->n_finish_delivered == r->n || r->state == REQ_DONE) {
            pthread_mutex_unlock(&r->mu);
            return -1;
        }
        if (timeout_ms == 0) goto timeout;
        if (timeout_ms < 0) pthread_cond_wait(&r->cv, &r->mu);
        else if (pthread_cond_timedwait(&r->cv, &r->mu, &deadline) != 0 && r->q_len == 0) goto timeout;
    }
    EvSlot *s = r->queue[r->q_head];
    r->q_head = (r->q_head + 1) % r->q_cap;
    r->q_len--;
    if (r->open[s->index] == s) r->open[s->index] = NULL;
    if (r->current) {
        r->current->next_free = r->free_slots;
        r->free_slots = r->current;
    }
    r->current = s;
    if (s->finish != FINISH_NONE) r->n_finish_delivered++;
    memset(ev, 0, sizeof *ev);
    ev->index = s->index;
    ev->n_tokens = s->n;
    ev->tokens = s->tokens;
    ev->logprobs = s->logprobs;
    ev->top = r->p.top_logprobs > 0 ? s->top : NULL;
    ev->text = s->text.data ? s->text.data : "";
    ev->text_len = s->text.len;
    ev->finish = s->finish;
    ev->stop_reason = s->stop_reason;
    ev->stop_token = s->stop_token;
    ev->policy_version = s->version;
    ev->restarted = s->restarted;
    pthread_mutex_unlock(&r->mu);
    return 1;
timeout:
    pthread_mutex_unlock(&r->mu);
    return 0;
}

int engine_request_prompt_tokens(const EngineRequest *r) { return r->prompt_len; }

int engine_request_prompt_logprobs(const EngineRequest *r, const float **lp, const TokenLogprob **top,
                                   const int32_t **rank) {
    if (r->p.prompt_logprobs < 0) return -1;
    *lp = r->prompt_lp;
    *top = r->prompt_top;
    *rank = r->prompt_rank;
    return r->p.prompt_logprobs;
}

int engine_request_cached_tokens(const EngineRequest *r) {
    EngineRequest *m = (EngineRequest *)r; // the mutex, not the value, is what changes
    pthread_mutex_lock(&m->mu);
    int n = m->cached_tokens;
    pthread_mutex_unlock(&m->mu);
    return n;
}

void engine_request_release(EngineRequest *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->released = 1;
    const int done = r->state == REQ_DONE;
    // Lock order: handle mutex, then engine mutex (the engine thread never holds its own mutex while it takes a
    // handle's).
    if (!done) engine_post_abort(r->e, r);
    pthread_mutex_unlock(&r->mu);
    if (done) request_free(r);
}
