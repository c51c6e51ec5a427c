// rollout_server/engine.c — the generation engine: set-up and tear-down, and the engine thread's loop (admit,
// schedule, hand the step to the model runner, fork, emit, apply control requests). The device side of a step —
// model, KV pool, step arrays, graphs, sampling — is the model runner's (model_runner.c). Submission and the
// control calls made by other threads are in engine_control.c; request handles in engine_request.c.
//
// Threads: the engine thread alone touches the runner, the block manager, the scheduler and the sequences. Other
// threads talk to it through the engine mutex (incoming and abort lists, control requests, the published stats)
// and through each request's own mutex (its event queue). The engine thread never holds the engine mutex while
// it takes a request's mutex, so clients may take them in the other order.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "rollout_server/engine_internal.h"
#include "rollout_server/sample_mask.h"
#include "rollout_server/sampler.h"

// ---- defaults and names -------------------------------------------------------------------------

void sampling_params_default(SamplingParams *p) {
    memset(p, 0, sizeof *p);
    p->n = 1;
    p->max_tokens = 16;
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
    p->skip_special_tokens = 1;
    p->prompt_logprobs = -1;
}

void engine_config_default(EngineConfig *c) {
    memset(c, 0, sizeof *c);
    c->backend = OPS_BACKEND_CPU;
    c->kv_cache_bytes = (size_t)1 << 30;
    c->block_size = 16;
    c->max_num_seqs = 256;
    c->max_num_batched_tokens = 2048;
    c->max_queued_requests = 1024;
    c->enable_prefix_caching = 1;
    c->cuda_graph_max_batch = 512;
}

const char *finish_reason_name(FinishReason r) {
    switch (r) {
    case FINISH_LENGTH: return "length";
    case FINISH_STOP: return "stop";
    case FINISH_ABORT: return "abort";
    case FINISH_ERROR: return "error";
    default: return "none";
    }
}

static const char *const UPDATE_MODE_NAMES[] = {[ENGINE_UPDATE_KEEP] = "keep", [ENGINE_UPDATE_ABORT] = "abort",
                                                [ENGINE_UPDATE_KEEP_KV] = "keep_kv"};
#define N_UPDATE_MODES ((int)(sizeof UPDATE_MODE_NAMES / sizeof UPDATE_MODE_NAMES[0]))

const char *engine_update_mode_name(EngineUpdateMode m) {
    return (int)m >= 0 && (int)m < N_UPDATE_MODES ? UPDATE_MODE_NAMES[m] : "?";
}

int engine_update_mode_parse(const char *s, EngineUpdateMode *m) {
    for (int i = 0; s && i < N_UPDATE_MODES; i++)
        if (!strcmp(s, UPDATE_MODE_NAMES[i])) {
            *m = (EngineUpdateMode)i;
            return 0;
        }
    return -1;
}

const Model *engine_model(const Engine *e) { return e->m; }
const Tokenizer *engine_tokenizer(const Engine *e) { return e->tok; }
const char *engine_model_id(const Engine *e) { return e->model_id; }
int engine_adapter_count(const Engine *e) { return runner_adapter_count(e->runner); }
const char *engine_adapter_name(const Engine *e, int k) { return runner_adapter_name(e->runner, k); }

int64_t engine_policy_version(const Engine *e) {
    Engine *m = (Engine *)e;
    pthread_mutex_lock(&m->mu);
    int64_t v = m->version;
    pthread_mutex_unlock(&m->mu);
    return v;
}

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// ---- request bookkeeping on the engine thread ---------------------------------------------------

static void queued_dec(Engine *e) {
    pthread_mutex_lock(&e->mu);
    e->n_queued--;
    pthread_mutex_unlock(&e->mu);
}

// Takes every sequence of r out of the scheduler and gives back its blocks.
static void drop_sequences(Engine *e, EngineRequest *r) {
    for (int i = 0; i < r->n; i++) sched_remove(&e->sched, &r->seqs[i].s);
    if (r->state == REQ_QUEUED) queued_dec(e);
    else e->n_requests_running--;
    r->n_live = 0;
}

// The engine thread lets go of r (state REQ_DONE): a wake pending for the step is dropped, since letting go wakes
// the client anyway. r stays allocated: a client that released it left it on the abort list.
static void let_go(Engine *e, EngineRequest *r) {
    if (r->wake_slot >= 0) {
        e->wake_reqs[r->wake_slot] = NULL;
        r->wake_slot = -1;
    }
    request_engine_done(r);
}

// Wakes, once each, the clients of the requests that got events this step.
static void wake_clients(Engine *e) {
    for (int i = 0; i < e->n_wake; i++) {
        EngineRequest *r = e->wake_reqs[i];
        if (!r) continue;
        r->wake_slot = -1;
        request_wake(r);
    }
    e->n_wake = 0;
}

// Counts a completion of r finishing at `now` for `reason`: its end-to-end latency and its finish reason.
static void count_finish(Engine *e, const EngineRequest *r, FinishReason reason, double now) {
    latency_observe(&e->live.latency[LATENCY_E2E], LATENCY_E2E, now - r->submitted_at);
    e->live.completions_finished[reason]++;
}

// Ends every unfinished completion of r with a bare finish event of `reason`, then lets go of r.
static void end_request(Engine *e, EngineRequest *r, FinishReason reason) {
    int wake;
    const double now = latency_clock();
    for (int i = 0; i < r->n; i++)
        if (r->seqs[i].s.status != SEQ_DONE) {
            request_push(r, i, -1, 0.0f, NULL, NULL, 0, reason, NULL, -1, e->version, &wake);
            count_finish(e, r, reason, now);
        }
    drop_sequences(e, r);
    let_go(e, r);
}

static void finish_seq(Engine *e, EngSeq *q) {
    sched_remove(&e->sched, &q->s);
    q->req->n_live--;
}

static void maybe_done(Engine *e, EngineRequest *r) {
    if (r->n_live > 0) return;
    e->n_requests_running--;
    let_go(e, r);
}

// Appends sample k's token to its completion q, turns it into text and an event.
static void emit_token(Engine *e, EngSeq *q, int k) {
    EngineRequest *r = q->req;
    Sequence *s = &q->s;
    const int32_t tok = e->out.tokens[k];
    s->tokens[s->n_tokens++] = tok;
    const int last = s->n_tokens - s->n_prompt >= r->p.max_tokens || s->n_tokens >= e->m->cfg.max_seq_len;
    DetokResult res;
    char err[256];
    e->text.len = 0;
    if (detok_step(&q->detok, tok, last, &e->text, &res, err, sizeof err) != 0) {
        res.finish = FINISH_ERROR;
        res.stop_reason = NULL;
        res.stop_token = -1;
    }
    e->live.generation_tokens_total++;
    int wake;
    if (request_push(r, q->index, tok, e->out.logprobs[k], e->out.top + (size_t)k * ENGINE_MAX_TOP_LOGPROBS,
                     e->text.data, e->text.len, res.finish, res.stop_reason, res.stop_token, e->version, &wake) != 0 &&
        res.finish == FINISH_NONE)
        res.finish = FINISH_ERROR; // the event could not be queued: end the completion (it says FINISH_ERROR)
    // Latencies: the one clock read of this event. The first token of a completion measures TTFT from submission,
    // each later one the gap since the previous (a restart after a weight update keeps counting gaps).
    const double now = latency_clock();
    if (q->last_token_at > 0) latency_observe(&e->live.latency[LATENCY_ITL], LATENCY_ITL, now - q->last_token_at);
    else latency_observe(&e->live.latency[LATENCY_TTFT], LATENCY_TTFT, now - r->submitted_at);
    q->last_token_at = now;
    if (res.finish != FINISH_NONE) count_finish(e, r, res.finish, now);
    if (wake && r->wake_slot < 0) { // one wake per request and step, after the step's last event (wake_clients)
        r->wake_slot = e->n_wake;
        e->wake_reqs[e->n_wake++] = r;
    }
    if (res.finish != FINISH_NONE) finish_seq(e, q);
}

// Completion 0 finished computing the prompt: completions 1..n-1 take shared references on its blocks, each
// completion takes its first token (samples k0..k0+n-1, all from the one logits row), and the new ones join the
// running set (those beyond max_num_seqs wait at the front of the queue, keeping their blocks).
static void fork_request(Engine *e, EngineRequest *r, int k0) {
    EngSeq *parent = &r->seqs[0];
    request_set_state(r, REQ_DECODE);
    for (int i = 1; i < r->n; i++) {
        EngSeq *c = &r->seqs[i];
        bm_fork(e->bm, &c->s.table, &parent->s.table);
        c->s.n_computed = parent->s.n_computed;
    }
    for (int i = 0; i < r->n; i++) emit_token(e, &r->seqs[i], k0 + i);
    int first_surplus = r->n;
    for (int i = 1; i < r->n; i++) {
        EngSeq *c = &r->seqs[i];
        if (c->s.status == SEQ_DONE) continue;
        if (e->sched.running.count < e->sched.max_num_seqs) sched_add_running(&e->sched, &c->s);
        else if (first_surplus == r->n) first_surplus = i;
    }
    for (int i = r->n - 1; i >= first_surplus; i--)
        if (r->seqs[i].s.status == SEQ_NEW) sched_add_waiting(&e->sched, &r->seqs[i].s, 1);
}

// Completion 0 of r was admitted for the first time (q): r leaves the queue.
static void admit(Engine *e, EngineRequest *r, const Sequence *q) {
    e->n_requests_running++;
    queued_dec(e);
    e->live.prompt_tokens_total += r->prompt_len;
    e->live.cached_prompt_tokens_total += q->cached_at_admission;
    pthread_mutex_lock(&r->mu);
    r->state = REQ_PREFILL;
    r->cached_tokens = q->cached_at_admission;
    pthread_mutex_unlock(&r->mu);
}

// Room for n runner samples. Returns 0 or -1 (out of memory).
static int samples_reserve(Engine *e, int n) {
    if (n <= e->samples_cap) return 0;
    const int cap = n > 2 * e->samples_cap ? n : 2 * e->samples_cap;
    RunnerSample *s = realloc(e->samples, (size_t)cap * sizeof *s);
    if (!s) return -1;
    e->samples = s;
    e->samples_cap = cap;
    return 0;
}

// Room for n mask ids. Returns 0 or -1 (out of memory).
static int mask_reserve(Engine *e, int64_t n) {
    if (n <= e->mask_cap) return 0;
    const int64_t cap = n > 2 * e->mask_cap ? n : 2 * e->mask_cap;
    int32_t *m = realloc(e->mask_ids, (size_t)cap * sizeof *m);
    if (!m) return -1;
    e->mask_ids = m;
    e->mask_cap = cap;
    return 0;
}

// The step as the runner takes it: the scheduled sequences in step order, and the samples of each one whose last
// token the step computes, in step order too: a request's first logits row is sampled by each of its n
// completions, any other row by its own completion. Each draws the uniform of (its stream, its output position);
// penalised samples carry their whole history (prompt then generated ids), and masked ones (min_tokens, bad words,
// allowed ids) their completion's mask for this token (sample_mask.h). Returns the number of samples, or -1 with a
// message (out of memory).
static int plan_step(Engine *e, char *err, size_t err_len) {
    Scheduler *s = &e->sched;
    int n_samples = 0, n_rows = 0;
    for (int i = 0; i < s->n_step; i++) {
        const Sequence *q = s->step[i];
        EngineRequest *r = ((EngSeq *)q)->req;
        if (r->state == REQ_QUEUED && q->just_admitted) admit(e, r, q);
        const int sampled = q->n_computed + q->sched == q->n_tokens;
        e->run_seqs[i] = (RunnerSeq){.tokens = q->tokens, .n_computed = q->n_computed, .n_sched = q->sched,
                                     .blocks = q->table.ids, .n_blocks = q->table.n,
                                     .n_samples = !sampled ? 0 : r->state == REQ_DECODE ? 1 : r->n,
                                     .adapter = r->p.adapter};
        if (r->prompt_lp && r->state != REQ_DECODE) { // completion 0 computing the prompt: score it
            RunnerSeq *rs = &e->run_seqs[i];
            rs->score_until = r->prompt_len - 1;
            rs->score_top = r->p.prompt_logprobs;
            rs->score_lp = r->prompt_lp;
            rs->score_rank = r->prompt_rank;
            rs->score_alts = r->prompt_top;
        }
        n_samples += e->run_seqs[i].n_samples;
        n_rows += sampled;
    }
    int64_t n_mask = 0;
    for (int i = 0; i < s->n_step; i++)
        n_mask += (int64_t)e->run_seqs[i].n_samples * ((EngSeq *)s->step[i])->req->mask_cap;
    if (samples_reserve(e, n_samples) != 0 || mask_reserve(e, n_mask) != 0) {
        snprintf(err, err_len, "out of memory for the step's %d sampling rows", n_rows);
        return -1;
    }
    int64_t mask_at = 0;
    for (int i = 0, k = 0; i < s->n_step; i++) {
        EngSeq *q = (EngSeq *)s->step[i];
        EngineRequest *r = q->req;
        const SamplingParams *p = &r->p;
        const int penalised = p->repetition_penalty != 1.0f;
        for (int c = 0; c < e->run_seqs[i].n_samples; c++, k++) {
            const EngSeq *cq = r->state == REQ_DECODE ? q : &r->seqs[c];
            const Sequence *cs = &cq->s;
            e->samples[k] = (RunnerSample){
                .p = {.u = sampler_uniform(r->seed + (uint64_t)cq->index, (uint64_t)(cs->n_tokens - cs->n_prompt)),
                      .temperature = p->temperature,
                      .top_p = p->top_p,
                      .min_p = p->min_p,
                      .repetition_penalty = p->repetition_penalty,
                      .top_k = p->top_k},
                .history = penalised ? cs->tokens : NULL,
                .n_history = penalised ? cs->n_tokens : 0,
                .top_logprobs = p->top_logprobs,
            };
            if (r->mask_cap > 0) {
                OpsSampleParams *op = &e->samples[k].p;
                int32_t *ids = e->mask_ids + mask_at;
                op->n_mask = sample_mask_build(p, r->guide, e->eos, e->n_eos, cs->tokens + cs->n_prompt,
                                               cs->n_tokens - cs->n_prompt, ids, &op->mask_mode);
                op->mask = op->n_mask > 0 ? ids : NULL;
                mask_at += op->n_mask;
            }
        }
    }
    return n_samples;
}

// Everything in the step failed (backend error): each request involved ends with FINISH_ERROR.
static void fail_step(Engine *e) {
    int n = 0;
    for (int i = 0; i < e->sched.n_step; i++) {
        EngineRequest *r = ((EngSeq *)e->sched.step[i])->req;
        int seen = 0;
        for (int j = 0; j < n && !seen; j++) seen = e->scratch_reqs[j] == r;
        if (!seen) e->scratch_reqs[n++] = r;
    }
    for (int j = 0; j < n; j++) end_request(e, e->scratch_reqs[j], FINISH_ERROR);
}

// One engine step. Returns the number of tokens it ran (0: nothing could be scheduled).
static int run_step(Engine *e) {
    Scheduler *s = &e->sched;
    const double t0 = now_seconds();
    const int64_t preempt_before = s->preemptions;
    const int n = sched_step(s);
    if (n == 0) return 0;
    char err[512];
    const int n_samples = plan_step(e, err, sizeof err);
    int failed = n_samples < 0;
    if (!failed) {
        failed = runner_step(e->runner, e->run_seqs, s->n_step, e->samples, n_samples, &e->out, err, sizeof err) != 0;
        if (e->out.kind >= 0) {
            e->live.step_compute_seconds_sum += e->out.compute_seconds;
            e->live.steps_by_kind[e->out.kind]++;
            e->live.compute_seconds_by_kind[e->out.kind] += e->out.compute_seconds;
        }
    }
    if (failed) {
        fprintf(stderr, "tandem-serve: engine step failed, its requests end with an error: %s\n", err);
        fail_step(e);
    } else {
        sched_commit(s);
        // Samples are in step order (plan_step). Letting go of a request never frees it here (a released one waits
        // on the abort list), so later entries stay valid.
        for (int i = 0, k = 0; i < s->n_step; i++) {
            if (e->run_seqs[i].n_samples == 0) continue;
            EngSeq *q = (EngSeq *)s->step[i];
            EngineRequest *r = q->req;
            if (r->state != REQ_DECODE) {
                fork_request(e, r, k);
                k += r->n;
            } else {
                emit_token(e, q, k++);
            }
            maybe_done(e, r);
        }
        wake_clients(e);
    }
    const double dt = now_seconds() - t0;
    static const double bounds_ms[11] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000};
    for (int b = 0; b < 11; b++)
        if (dt * 1e3 <= bounds_ms[b]) e->live.step_seconds_buckets[b]++;
    e->live.step_seconds_buckets[11]++;
    e->live.step_seconds_sum += dt;
    e->live.steps_total++;
    e->live.preemptions_total += s->preemptions - preempt_before;
    return n;
}

// ---- engine thread ------------------------------------------------------------------------------

static void publish_stats(Engine *e) { // under mu
    EngineStats *st = &e->stats;
    *st = e->live;
    st->requests_running = e->n_requests_running;
    st->sequences_running = e->sched.running.count;
    st->kv_blocks_total = e->n_blocks;
    st->kv_blocks_used = bm_num_used(e->bm);
    st->kv_blocks_cached = bm_num_cached(e->bm);
}

// Completion q of an admitted request starts over from its prompt (ENGINE_UPDATE_ABORT): its generated tokens are
// dropped, its text decoder restarts, and its client is told (request_restart). Returns 0, or -1 when the decoder
// could not restart (no memory): then q is kept as it is.
static int restart_completion(EngSeq *q) {
    char err[256];
    if (detok_restart(&q->detok, err, sizeof err) != 0) {
        fprintf(stderr, "tandem-serve: a weight update keeps completion %d instead of re-queuing it: %s\n", q->index,
                err);
        return -1;
    }
    q->s.n_tokens = q->s.n_prompt;
    request_restart(q->req, q->index);
    return 0;
}

// After the weights changed. With ENGINE_UPDATE_KEEP_KV the sequences in flight go on as they are (their tables
// predate the prefix-cache reset, so their blocks are never registered). Otherwise no K/V computed under the old
// weights is used again: every admitted request's unfinished completions give their blocks back and go to the
// front of the queue (sched_requeue_all), to recompute under the new weights what they hold: with
// ENGINE_UPDATE_KEEP their prompt and generated tokens, so that their next token is what the new weights sample
// after that prefix; with ENGINE_UPDATE_ABORT, for requests that take restarts, the prompt alone. A request still
// computing its prompt holds no output: it restarts its prompt either way.
static void requeue_in_flight(Engine *e, EngineUpdateMode mode, EngineCommitReport *rep) {
    const SeqList *lists[2] = {&e->sched.running, &e->sched.waiting};
    for (int l = 0; l < 2; l++)
        for (Sequence *s = lists[l]->head; s; s = s->next) {
            EngSeq *q = (EngSeq *)s;
            EngineRequest *r = q->req;
            if (r->state == REQ_QUEUED) continue; // nothing computed yet
            if (r->state == REQ_PREFILL) { // completion 0 computes the prompt for all n_live
                if (mode == ENGINE_UPDATE_ABORT) rep->sequences_requeued += r->n_live;
                else rep->sequences_kept += r->n_live;
                continue;
            }
            if (mode == ENGINE_UPDATE_ABORT && request_restartable(r) && restart_completion(q) == 0)
                rep->sequences_requeued++;
            else
                rep->sequences_kept++;
        }
    if (mode != ENGINE_UPDATE_KEEP_KV) sched_requeue_all(&e->sched);
}

// Swaps the runner's device staging in (device) or uploads the host staging units the commit took, then re-queues
// the sequences in flight as `mode` says and resets the prefix cache (its blocks hold K/V of the old weights).
// Not under mu.
// An adapter commit (lora) installs the policy's adapter instead; a whole-weights one drops it.
static void apply_commit(Engine *e, int64_t version, int device, const LoraConfig *lora, float *const *lora_units,
                         EngineUpdateMode mode) {
    char msg[512] = "";
    int rc;
    if (lora) {
        rc = runner_set_policy_adapter(e->runner, lora, lora_units, msg, sizeof msg);
    } else {
        rc = device ? runner_swap_device_weights(e->runner, msg, sizeof msg)
                    : runner_upload_weights(e->runner, e->commit_units, msg, sizeof msg);
        if (rc == 0) runner_drop_policy_adapter(e->runner);
    }
    for (int u = 0; u < e->m->layout.n_units; u++) {
        free(e->commit_units[u]);
        e->commit_units[u] = NULL;
    }
    EngineCommitReport rep = {0};
    if (rc == 0) {
        requeue_in_flight(e, mode, &rep);
        bm_reset_prefix_cache(e->bm);
        e->live.weight_updates_total++;
        e->live.weight_update_sequences_kept_total += rep.sequences_kept;
        e->live.weight_update_sequences_requeued_total += rep.sequences_requeued;
    } else {
        rc = ENGINE_EINTERNAL;
    }
    pthread_mutex_lock(&e->mu);
    if (rc == 0) e->version = version;
    e->commit_rc = rc;
    e->commit_report = rep;
    snprintf(e->commit_err, sizeof e->commit_err, "%s", msg);
    pthread_mutex_unlock(&e->mu);
}

// Generation runs again after a weight update (engine thread, under mu): how long it stood still goes into the
// pause histogram.
static void close_update_pause(Engine *e) {
    static const int bounds_ms[10] = ENGINE_UPDATE_PAUSE_BOUNDS_MS;
    const double dt = now_seconds() - e->update_pause_from;
    for (int b = 0; b < 10; b++)
        if (dt * 1e3 <= bounds_ms[b]) e->live.weight_update_pause_buckets[b]++;
    e->live.weight_update_pause_buckets[10]++;
    e->live.weight_update_pause_seconds_sum += dt;
    e->update_pause_open = 0;
    publish_stats(e);
}

// Moves the incoming requests into the scheduler's queue, and drops and frees the ones their clients released
// (those the engine still held lose their sequences). Not under mu.
static void take_requests(Engine *e, EngineRequest *in, EngineRequest *aborted) {
    for (EngineRequest *r = in, *next; r; r = next) {
        next = r->next_in;
        sched_add_waiting(&e->sched, &r->seqs[0].s, 0);
    }
    for (EngineRequest *r = aborted, *next; r; r = next) {
        next = r->next_abort;
        if (r->state != REQ_DONE) {
            // Its unfinished completions end here, aborted by their client: counted as vLLM counts them.
            const double now = latency_clock();
            for (int i = 0; i < r->n; i++)
                if (r->seqs[i].s.status != SEQ_DONE) count_finish(e, r, FINISH_ABORT, now);
            drop_sequences(e, r);
        }
        request_free(r); // released by the client, which left it to us
    }
}

static void *engine_main(void *arg) {
    Engine *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (e->commit_req != e->commit_done) {
            const int64_t gen = e->commit_req, version = e->commit_version;
            const int device = e->commit_device;
            const LoraConfig *lora = e->commit_lora;
            float *const *lora_units = e->commit_lora_units;
            const EngineUpdateMode mode = e->commit_mode;
            // Generation stopped at the end of the last step, or earlier when a pause had taken effect.
            const double stopped = e->paused && e->pause_ack ? e->paused_since : now_seconds();
            for (int u = 0; u < e->m->layout.n_units && !device && !lora; u++) {
                e->commit_units[u] = e->staging[u];
                e->staging[u] = NULL;
            }
            pthread_mutex_unlock(&e->mu);
            apply_commit(e, version, device, lora, lora_units, mode);
            pthread_mutex_lock(&e->mu);
            if (e->commit_rc == 0 && !e->update_pause_open) {
                e->update_pause_from = stopped;
                e->update_pause_open = 1;
            }
            e->commit_done = gen;
            publish_stats(e);
            pthread_cond_broadcast(&e->ack);
            continue;
        }
        if (e->reset_req != e->reset_done) {
            const int64_t gen = e->reset_req;
            bm_reset_prefix_cache(e->bm); // the engine thread owns the block manager; nothing else runs now
            e->reset_done = gen;
            publish_stats(e);
            pthread_cond_broadcast(&e->ack);
            continue;
        }
        if (e->in_head || e->aborts) {
            EngineRequest *in = e->in_head, *ab = e->aborts;
            e->in_head = e->in_tail = e->aborts = NULL;
            e->idle = 0; // until the loop looks again: engine_destroy must not take the queue for empty
            pthread_mutex_unlock(&e->mu);
            take_requests(e, in, ab);
            pthread_mutex_lock(&e->mu);
            publish_stats(e);
            continue;
        }
        if (e->abort_req != e->abort_done) { // after the inbox: every request submitted before it ends
            const int64_t gen = e->abort_req;
            pthread_mutex_unlock(&e->mu);
            while (e->sched.running.head || e->sched.waiting.head) {
                Sequence *q = e->sched.running.head ? e->sched.running.head : e->sched.waiting.head;
                end_request(e, ((EngSeq *)q)->req, FINISH_ABORT);
            }
            pthread_mutex_lock(&e->mu);
            e->abort_done = gen;
            publish_stats(e);
            pthread_cond_broadcast(&e->ack);
            continue;
        }
        if (e->abort_all) {
            pthread_mutex_unlock(&e->mu);
            while (e->sched.running.head || e->sched.waiting.head) {
                Sequence *q = e->sched.running.head ? e->sched.running.head : e->sched.waiting.head;
                end_request(e, ((EngSeq *)q)->req, FINISH_ABORT);
            }
            pthread_mutex_lock(&e->mu);
            if (e->aborts) continue; // a client released a handle meanwhile: free it before leaving
            break;
        }
        if (e->paused) {
            if (!e->pause_ack) e->paused_since = now_seconds();
            e->pause_ack = 1;
            pthread_cond_broadcast(&e->ack);
            pthread_cond_wait(&e->wake, &e->mu);
            continue;
        }
        if (e->update_pause_open) close_update_pause(e);
        if (e->sched.running.count + e->sched.waiting.count == 0) {
            e->idle = 1;
            pthread_cond_broadcast(&e->ack);
            pthread_cond_wait(&e->wake, &e->mu);
            continue;
        }
        e->idle = 0;
        pthread_mutex_unlock(&e->mu);
        const int ran = run_step(e);
        pthread_mutex_lock(&e->mu);
        publish_stats(e);
        pthread_cond_broadcast(&e->ack);
        if (ran == 0) { // nothing fit (the scheduler frees waiting blocks when idle, so this is transient)
            struct timespec t;
            clock_gettime(CLOCK_REALTIME, &t);
            t.tv_nsec += 10000000L;
            if (t.tv_nsec >= 1000000000L) {
                t.tv_sec++;
                t.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&e->wake, &e->mu, &t);
        }
    }
    e->idle = 1;
    e->exited = 1;
    publish_stats(e);
    pthread_cond_broadcast(&e->ack);
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

void engine_post_abort(Engine *e, EngineRequest *r) { // under r->mu (see engine_request_release)
    pthread_mutex_lock(&e->mu);
    r->next_abort = e->aborts;
    e->aborts = r;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

// ---- create / destroy ---------------------------------------------------------------------------

static void engine_free(Engine *e) {
    if (!e) return;
    if (e->staging) {
        for (int u = 0; u < e->m->layout.n_units; u++) free(e->staging[u]);
        free(e->staging);
    }
    free(e->commit_units);
    free(e->run_seqs);
    free(e->samples);
    free(e->mask_ids);
    free(e->scratch_reqs);
    free(e->wake_reqs);
    textbuf_free(&e->text);
    sched_destroy(&e->sched);
    bm_destroy(e->bm);
    if (e->tok) tokenizer_free(e->tok);
    runner_free(e->runner);
    guide_cache_destroy(&e->guides);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->ack);
    free(e);
}

static int check_config(const EngineConfig *c, char *err, size_t err_len) {
    if (!c->model_dir || !*c->model_dir) snprintf(err, err_len, "no model folder given");
    else if (c->block_size < 1 || c->block_size > 1024) snprintf(err, err_len, "block size %d must be in [1, 1024]", c->block_size);
    else if (c->max_num_seqs < 1) snprintf(err, err_len, "--max-num-seqs %d must be >= 1", c->max_num_seqs);
    else if (c->max_num_batched_tokens < c->max_num_seqs)
        snprintf(err, err_len, "--max-num-batched-tokens %d must be >= --max-num-seqs %d (every running sequence "
                 "decodes one token per step)", c->max_num_batched_tokens, c->max_num_seqs);
    else if (c->max_queued_requests < 1) snprintf(err, err_len, "--max-queued-requests %d must be >= 1", c->max_queued_requests);
    else return 0;
    return ENGINE_EINVAL;
}

static void collect_eos(Engine *e) {
    int32_t ids[ENGINE_MAX_EOS];
    int n = 0;
    for (int i = 0; i < e->m->cfg.n_eos_token_ids && n < ENGINE_MAX_EOS; i++) ids[n++] = e->m->cfg.eos_token_ids[i];
    if (e->tok) {
        int32_t t[ENGINE_MAX_EOS];
        size_t nt = tokenizer_eos_ids(e->tok, t, ENGINE_MAX_EOS);
        for (size_t i = 0; i < nt && i < ENGINE_MAX_EOS && n < ENGINE_MAX_EOS; i++) ids[n++] = t[i];
    }
    e->n_eos = 0;
    for (int i = 0; i < n; i++) {
        int dup = ids[i] < 0;
        for (int j = 0; j < e->n_eos && !dup; j++) dup = e->eos[j] == ids[i];
        if (!dup) e->eos[e->n_eos++] = ids[i];
    }
}

int engine_create(Engine **out, const EngineConfig *cfg, char *err, size_t err_len) {
    *out = NULL;
    int rc = check_config(cfg, err, err_len);
    if (rc) return rc;
    Engine *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, err_len, "out of memory");
        return ENGINE_ENOMEM;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->ack, NULL);
    guide_cache_init(&e->guides);
    e->cfg = *cfg;
    e->cfg.model_dir = NULL; // the caller's string may not outlive us; the id below is what we keep
    {
        size_t len = strlen(cfg->model_dir);
        while (len > 1 && cfg->model_dir[len - 1] == '/') len--;
        size_t start = len;
        while (start > 0 && cfg->model_dir[start - 1] != '/') start--;
        snprintf(e->model_id, sizeof e->model_id, "%.*s", (int)(len - start), cfg->model_dir + start);
    }
    // The tokenizer first: a broken tokenizer.json is refused in a moment, before the model, the KV pool and the
    // CUDA graphs are set up.
    {
        char path[4096], msg[768];
        struct stat stt;
        snprintf(path, sizeof path, "%s/tokenizer.json", cfg->model_dir);
        if (stat(path, &stt) == 0 && tokenizer_load(&e->tok, cfg->model_dir, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "cannot load the tokenizer of %s: %s", cfg->model_dir, msg);
            rc = ENGINE_EINVAL;
            goto fail;
        }
    }
    if ((rc = runner_create(&e->runner, cfg, err, err_len)) != 0) goto fail;
    e->m = runner_model(e->runner);
    e->V = e->m->cfg.vocab_size;
    e->n_blocks = runner_num_blocks(e->runner);
    collect_eos(e);
    char msg[512];
    const size_t S = (size_t)cfg->max_num_seqs, n_units = (size_t)e->m->layout.n_units;
    if (bm_create(&e->bm, e->n_blocks, cfg->block_size, cfg->enable_prefix_caching, runner_copy_kv_rows, e->runner,
                  msg, sizeof msg) != 0 ||
        sched_init(&e->sched, e->bm, cfg->max_num_seqs, cfg->max_num_batched_tokens) != 0 ||
        samples_reserve(e, cfg->max_num_seqs) != 0)
        goto oom;
    e->run_seqs = malloc(S * sizeof *e->run_seqs);
    e->scratch_reqs = malloc(S * sizeof *e->scratch_reqs);
    e->wake_reqs = malloc(S * sizeof *e->wake_reqs);
    e->staging = calloc(n_units, sizeof *e->staging);
    e->commit_units = calloc(n_units, sizeof *e->commit_units);
    if (!e->run_seqs || !e->scratch_reqs || !e->wake_reqs || !e->staging || !e->commit_units ||
        textbuf_append(&e->text, "", 0) != 0)
        goto oom;
    e->accepting = 1;
    e->idle = 1;
    publish_stats(e);
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        snprintf(err, err_len, "cannot start the engine thread");
        rc = ENGINE_EINTERNAL;
        goto fail;
    }
    e->thread_started = 1;
    *out = e;
    return 0;
oom:
    snprintf(err, err_len, "out of host memory setting up the engine");
    rc = ENGINE_ENOMEM;
fail:
    engine_free(e);
    return rc;
}

void engine_destroy(Engine *e, int drain_timeout_ms) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->accepting = 0;
    e->paused = 0; // a paused engine could never drain
    pthread_cond_broadcast(&e->wake);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    const int ms = drain_timeout_ms > 0 ? drain_timeout_ms : 0;
    deadline.tv_sec += ms / 1000;
    deadline.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    while (ms > 0 && !e->exited && (!e->idle || e->in_head))
        if (pthread_cond_timedwait(&e->ack, &e->mu, &deadline) != 0) break;
    e->abort_all = 1;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->mu);
    if (e->thread_started) pthread_join(e->thread, NULL);
    engine_free(e);
}
