// rollout_server/engine_control.c — what other threads call: submission (parameter checks, the too-long and
// queue-full refusals), pause / resume, prefix-cache reset, weight staging and commit, stats. Each call only
// takes the engine mutex and hands work to the engine thread (engine.c), waiting for it where the call is
// synchronous (pause, reset, commit).
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout_server/engine_internal.h"

static uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// ---- submission ---------------------------------------------------------------------------------

static int check_params(const Engine *e, const int32_t *prompt, int prompt_len, const SamplingParams *p, char *err,
                        size_t err_len) {
    if (!prompt || prompt_len < 1) return snprintf(err, err_len, "the prompt is empty"), ENGINE_EINVAL;
    for (int i = 0; i < prompt_len; i++)
        if (prompt[i] < 0 || prompt[i] >= e->V)
            return snprintf(err, err_len, "prompt token %d is %d, outside the vocabulary [0, %d)", i, prompt[i], e->V),
                   ENGINE_EINVAL;
    if (p->n < 1) return snprintf(err, err_len, "n must be >= 1, got %d", p->n), ENGINE_EINVAL;
    if (p->adapter < 0 || p->adapter > runner_adapter_count(e->runner))
        return snprintf(err, err_len, "adapter %d does not exist (this engine has %d LoRA adapters)", p->adapter,
                        runner_adapter_count(e->runner)), ENGINE_EINVAL;
    if (p->max_tokens < 1) return snprintf(err, err_len, "max_tokens must be >= 1, got %d", p->max_tokens), ENGINE_EINVAL;
    if (!(p->temperature >= 0.0f) || isinf(p->temperature))
        return snprintf(err, err_len, "temperature must be a finite number >= 0, got %g", p->temperature), ENGINE_EINVAL;
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return snprintf(err, err_len, "top_p must be in (0, 1], got %g", p->top_p), ENGINE_EINVAL;
    if (p->top_k < -1) return snprintf(err, err_len, "top_k must be -1, 0 (off) or positive, got %d", p->top_k), ENGINE_EINVAL;
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return snprintf(err, err_len, "min_p must be in [0, 1], got %g", p->min_p), ENGINE_EINVAL;
    if (!(p->repetition_penalty > 0.0f) || isinf(p->repetition_penalty))
        return snprintf(err, err_len, "repetition_penalty must be a finite number > 0, got %g", p->repetition_penalty),
               ENGINE_EINVAL;
    if (p->top_logprobs < 0 || p->top_logprobs > ENGINE_MAX_TOP_LOGPROBS)
        return snprintf(err, err_len, "logprobs must be in [0, %d], got %d", ENGINE_MAX_TOP_LOGPROBS, p->top_logprobs),
               ENGINE_EINVAL;
    if (p->prompt_logprobs < -1 || p->prompt_logprobs > ENGINE_MAX_TOP_LOGPROBS)
        return snprintf(err, err_len, "prompt_logprobs must be in [0, %d] (or none), got %d", ENGINE_MAX_TOP_LOGPROBS,
                        p->prompt_logprobs), ENGINE_EINVAL;
    if (p->n_stop < 0 || p->n_stop > ENGINE_MAX_STOP)
        return snprintf(err, err_len, "at most %d stop strings, got %d", ENGINE_MAX_STOP, p->n_stop), ENGINE_EINVAL;
    for (int i = 0; i < p->n_stop; i++)
        if (!p->stop[i] || !*p->stop[i]) return snprintf(err, err_len, "stop string %d is empty", i), ENGINE_EINVAL;
    if (p->n_stop > 0 && !e->tok)
        return snprintf(err, err_len, "stop strings need a tokenizer, and the model folder of %s has no "
                        "tokenizer.json (use stop_token_ids)", e->model_id), ENGINE_EINVAL;
    if (p->n_stop_token_ids < 0 || p->n_stop_token_ids > ENGINE_MAX_STOP)
        return snprintf(err, err_len, "at most %d stop token ids, got %d", ENGINE_MAX_STOP, p->n_stop_token_ids),
               ENGINE_EINVAL;
    for (int i = 0; i < p->n_stop_token_ids; i++)
        if (p->stop_token_ids[i] < 0 || p->stop_token_ids[i] >= e->V)
            return snprintf(err, err_len, "stop token id %d is outside the vocabulary [0, %d)", p->stop_token_ids[i], e->V),
                   ENGINE_EINVAL;
    if (p->min_tokens < 0 || p->min_tokens > p->max_tokens)
        return snprintf(err, err_len, "min_tokens must be in [0, max_tokens = %d], got %d", p->max_tokens,
                        p->min_tokens), ENGINE_EINVAL;
    if (p->n_allowed < 0 || (p->n_allowed > 0 && !p->allowed_token_ids))
        return snprintf(err, err_len, "allowed_token_ids: %d ids without a list", p->n_allowed), ENGINE_EINVAL;
    for (int i = 0; i < p->n_allowed; i++)
        if (p->allowed_token_ids[i] < 0 || p->allowed_token_ids[i] >= e->V)
            return snprintf(err, err_len, "allowed token id %d is outside the vocabulary [0, %d)",
                            p->allowed_token_ids[i], e->V), ENGINE_EINVAL;
    if (p->min_tokens > 0 && p->n_allowed > 0) { // is any allowed id neither an eos nor a stop id?
        int content = 0;
        for (int i = 0; i < p->n_allowed && !content; i++) {
            int stops = 0;
            for (int j = 0; j < e->n_eos && !stops; j++) stops = e->eos[j] == p->allowed_token_ids[i];
            for (int j = 0; j < p->n_stop_token_ids && !stops; j++)
                stops = p->stop_token_ids[j] == p->allowed_token_ids[i];
            content = !stops;
        }
        if (!content)
            return snprintf(err, err_len, "allowed_token_ids holds only eos / stop token ids, which min_tokens = %d "
                            "forbids for the first tokens: nothing could be generated", p->min_tokens), ENGINE_EINVAL;
    }
    // Each completion's mask travels to the device every step (a request's first step samples all n at once).
    if ((int64_t)p->n * (p->n_allowed + p->n_bad_words) > ENGINE_MAX_MASK_IDS)
        return snprintf(err, err_len, "allowed_token_ids (%d ids) and bad words (%d) for n = %d completions make "
                        "more than %d mask ids a step: send fewer ids or a smaller n", p->n_allowed, p->n_bad_words,
                        p->n, ENGINE_MAX_MASK_IDS), ENGINE_EINVAL;
    if (p->n_bad_words < 0 || (p->n_bad_words > 0 && (!p->bad_words_ids || !p->bad_words_offsets)))
        return snprintf(err, err_len, "bad words: %d words without their ids", p->n_bad_words), ENGINE_EINVAL;
    for (int w = 0; w < p->n_bad_words; w++) {
        if (p->bad_words_offsets[0] != 0 || p->bad_words_offsets[w + 1] <= p->bad_words_offsets[w])
            return snprintf(err, err_len, "bad word %d has no token ids", w), ENGINE_EINVAL;
        for (int k = p->bad_words_offsets[w]; k < p->bad_words_offsets[w + 1]; k++)
            if (p->bad_words_ids[k] < 0 || p->bad_words_ids[k] >= e->V)
                return snprintf(err, err_len, "bad word %d holds token id %d, outside the vocabulary [0, %d)", w,
                                p->bad_words_ids[k], e->V), ENGINE_EINVAL;
    }
    const int64_t total = (int64_t)prompt_len + p->max_tokens;
    if (total > e->m->cfg.max_seq_len)
        return snprintf(err, err_len, "the prompt (%d tokens) plus max_tokens (%d) is %lld tokens, beyond the model's "
                        "context of %d", prompt_len, p->max_tokens, (long long)total, e->m->cfg.max_seq_len), ENGINE_ETOOLONG;
    const int bs = e->cfg.block_size;
    if ((total + bs - 1) / bs > e->n_blocks)
        return snprintf(err, err_len, "the prompt (%d tokens) plus max_tokens (%d) is %lld tokens, beyond the whole KV "
                        "cache of %lld tokens (raise --kv-cache-memory)", prompt_len, p->max_tokens, (long long)total,
                        (long long)e->n_blocks * bs), ENGINE_ETOOLONG;
    return 0;
}

// Under mu: why a new request cannot be queued now, or 0.
static int queue_refusal(const Engine *e, char *err, size_t err_len) {
    if (!e->accepting || e->exited) return snprintf(err, err_len, "the server is shutting down"), ENGINE_ESHUTDOWN;
    if (e->n_queued >= e->cfg.max_queued_requests)
        return snprintf(err, err_len, "the request queue is full (%d waiting; --max-queued-requests)", e->n_queued),
               ENGINE_EQUEUE_FULL;
    return 0;
}

int engine_submit(Engine *e, const int32_t *prompt, int prompt_len, const SamplingParams *p, EngineRequest **out,
                  char *err, size_t err_len) {
    *out = NULL;
    if (!p) return snprintf(err, err_len, "no sampling parameters"), ENGINE_EINVAL;
    int rc = check_params(e, prompt, prompt_len, p, err, err_len);
    if (rc) return rc;
    pthread_mutex_lock(&e->mu);
    rc = queue_refusal(e, err, err_len);
    pthread_mutex_unlock(&e->mu);
    if (rc) return rc;
    SamplingParams q = *p;
    if (q.top_k < 0) q.top_k = 0;
    const int bs = e->cfg.block_size, max_blocks = (prompt_len + p->max_tokens + bs - 1) / bs;
    EngineRequest *r;
    if ((rc = request_alloc(&r, e, prompt, prompt_len, &q, max_blocks, e->tok, e->eos, e->n_eos, err, err_len)) != 0)
        return rc;
    pthread_mutex_lock(&e->mu);
    if ((rc = queue_refusal(e, err, err_len)) != 0) {
        pthread_mutex_unlock(&e->mu);
        request_free(r);
        return rc;
    }
    r->seed = p->has_seed ? p->seed : mix64(e->cfg.seed ^ mix64(++e->n_submitted));
    r->submitted_at = latency_clock();
    r->next_in = NULL;
    if (e->in_tail) e->in_tail->next_in = r;
    else e->in_head = r;
    e->in_tail = r;
    e->n_queued++;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->mu);
    *out = r;
    return 0;
}

// ---- control ------------------------------------------------------------------------------------

void engine_pause(Engine *e) {
    pthread_mutex_lock(&e->mu);
    e->paused = 1;
    pthread_cond_broadcast(&e->wake);
    while (e->paused && !e->pause_ack && !e->exited && !e->abort_all) pthread_cond_wait(&e->ack, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

void engine_resume(Engine *e) {
    pthread_mutex_lock(&e->mu);
    e->paused = 0;
    e->pause_ack = 0;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

void engine_reset_prefix_cache(Engine *e) {
    pthread_mutex_lock(&e->mu);
    const int64_t gen = ++e->reset_req;
    pthread_cond_broadcast(&e->wake);
    while (e->reset_done < gen && !e->exited) pthread_cond_wait(&e->ack, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

void engine_abort_requests(Engine *e) {
    pthread_mutex_lock(&e->mu);
    const int64_t gen = ++e->abort_req;
    pthread_cond_broadcast(&e->wake);
    while (e->abort_done < gen && !e->exited) pthread_cond_wait(&e->ack, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

int engine_wait_idle(Engine *e, int timeout_ms) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&e->mu);
    int done, timed_out = 0;
    while (!(done = e->paused || (e->idle && !e->in_head) || e->exited || e->abort_all) && !timed_out)
        timed_out = pthread_cond_timedwait(&e->ack, &e->mu, &deadline) != 0;
    pthread_mutex_unlock(&e->mu);
    return done;
}

int engine_weights_staging_bf16(const Engine *e) { return ops_dtype_size(runner_ops(e->runner)) == 2; }

void *engine_weights_staging(Engine *e, int unit) {
    if (unit < 0 || unit >= e->m->layout.n_units) return NULL;
    pthread_mutex_lock(&e->mu);
    if (!e->staging[unit])
        e->staging[unit] = calloc(e->m->layout.unit_numel[unit], ops_dtype_size(runner_ops(e->runner)));
    void *p = e->staging[unit];
    pthread_mutex_unlock(&e->mu);
    return p;
}

void *engine_weights_device_staging(Engine *e, int shard, int unit) {
    pthread_mutex_lock(&e->mu);
    void *p = runner_weights_device_staging(e->runner, shard, unit);
    pthread_mutex_unlock(&e->mu);
    return p;
}

const IpcRegion *engine_weights_ipc_staging(Engine *e, int shard, char *err, size_t err_len) {
    pthread_mutex_lock(&e->mu);
    const IpcRegion *g = runner_weights_ipc_staging(e->runner, shard, err, err_len);
    pthread_mutex_unlock(&e->mu);
    return g;
}

void *engine_adapter_device_staging(Engine *e, size_t unit_numel, int layer) {
    pthread_mutex_lock(&e->mu);
    void *p = runner_adapter_device_staging(e->runner, unit_numel, layer);
    pthread_mutex_unlock(&e->mu);
    return p;
}

OpsCtx *engine_ops(Engine *e) { return runner_ops(e->runner); }

int engine_tp(const Engine *e) { return runner_tp(e->runner); }

const Model *engine_shard_model(const Engine *e, int shard) { return runner_shard_model(e->runner, shard); }

OpsCtx *engine_shard_ops(Engine *e, int shard) { return runner_shard_ops(e->runner, shard); }

static int commit(Engine *e, int64_t version, int device, const LoraConfig *lora, float *const *lora_units,
                  EngineUpdateMode mode, EngineCommitReport *rep, char *err, size_t err_len);

int engine_commit_weights(Engine *e, int64_t version, EngineUpdateMode mode, EngineCommitReport *rep, char *err,
                          size_t err_len) {
    return commit(e, version, 0, NULL, NULL, mode, rep, err, err_len);
}

int engine_commit_adapter(Engine *e, int64_t version, const LoraConfig *c, float *const *units, EngineUpdateMode mode,
                          EngineCommitReport *rep, char *err, size_t err_len) {
    return commit(e, version, 0, c, units, mode, rep, err, err_len);
}

int engine_commit_device_weights(Engine *e, int64_t version, EngineUpdateMode mode, EngineCommitReport *rep,
                                 char *err, size_t err_len) {
    if (rep) memset(rep, 0, sizeof *rep);
    pthread_mutex_lock(&e->mu);
    int shard = 0;
    const int missing = runner_weights_device_missing(e->runner, &shard);
    pthread_mutex_unlock(&e->mu);
    if (missing >= 0)
        return snprintf(err, err_len, "unit %d (shard %d) was never received", missing, shard), ENGINE_EINVAL;
    return commit(e, version, 1, NULL, NULL, mode, rep, err, err_len);
}

static int commit(Engine *e, int64_t version, int device, const LoraConfig *lora, float *const *lora_units,
                  EngineUpdateMode mode, EngineCommitReport *rep, char *err, size_t err_len) {
    if (rep) memset(rep, 0, sizeof *rep);
    pthread_mutex_lock(&e->mu);
    if (e->exited || e->abort_all) {
        pthread_mutex_unlock(&e->mu);
        return snprintf(err, err_len, "the engine is shutting down"), ENGINE_ESHUTDOWN;
    }
    const int64_t gen = ++e->commit_req;
    e->commit_version = version;
    e->commit_device = device;
    e->commit_lora = lora;
    e->commit_lora_units = lora_units;
    e->commit_mode = mode;
    pthread_cond_broadcast(&e->wake);
    while (e->commit_done < gen && !e->exited) pthread_cond_wait(&e->ack, &e->mu);
    int rc;
    if (e->commit_done < gen) {
        rc = ENGINE_ESHUTDOWN;
        snprintf(err, err_len, "the engine stopped before applying the weights");
    } else {
        rc = e->commit_rc;
        if (rc) snprintf(err, err_len, "%s", e->commit_err);
        else if (rep) *rep = e->commit_report;
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

void engine_stats(Engine *e, EngineStats *s) {
    pthread_mutex_lock(&e->mu);
    *s = e->stats;
    s->requests_waiting = e->n_queued;
    s->policy_version = e->version;
    s->paused = e->paused;
    pthread_mutex_unlock(&e->mu);
}
