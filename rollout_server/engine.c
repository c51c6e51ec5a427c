// rollout_server/engine.c — the generation engine: set-up and tear-down, and the engine thread's loop (admit,
// schedule, run the model, sample, emit, apply control requests). Submission and the control calls made by other
// threads are in engine_control.c; request handles in engine_request.c.
//
// Threads: the engine thread alone touches the model, the KV cache, the block manager, the scheduler and the
// sequences. Other threads talk to it through the engine mutex (incoming and abort lists, control requests,
// the published stats) and through each request's own mutex (its event queue). The engine thread never holds
// the engine mutex while it takes a request's mutex, so clients may take them in the other order.
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "rollout_server/engine_internal.h"

// ---- defaults and names -------------------------------------------------------------------------

void sampling_params_default(SamplingParams *p) {
    memset(p, 0, sizeof *p);
    p->n = 1;
    p->max_tokens = 16;
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
    p->skip_special_tokens = 1;
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

const Model *engine_model(const Engine *e) { return &e->m; }
const Tokenizer *engine_tokenizer(const Engine *e) { return e->tok; }
const char *engine_model_id(const Engine *e) { return e->model_id; }

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
    for (int i = 0; i < r->n; i++) {
        EngSeq *q = &r->seqs[i];
        sched_remove(&e->sched, &q->s);
        q->finished = 1;
    }
    if (!r->admitted) queued_dec(e);
    else e->n_requests_running--;
    r->n_live = 0;
}

// The engine thread lets go of r (which may free it): a wake pending for the step is dropped, since letting go
// wakes the client anyway.
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

// Ends every unfinished completion of r with a bare finish event of `reason`, then lets go of r.
static void end_request(Engine *e, EngineRequest *r, FinishReason reason) {
    int wake;
    for (int i = 0; i < r->n; i++)
        if (!r->seqs[i].finished)
            request_push(r, i, -1, 0.0f, NULL, NULL, 0, reason, NULL, -1, e->version, &wake);
    drop_sequences(e, r);
    let_go(e, r);
}

static void finish_seq(Engine *e, EngSeq *q) {
    q->finished = 1;
    sched_remove(&e->sched, &q->s);
    q->req->n_live--;
}

static void maybe_done(Engine *e, EngineRequest *r) {
    if (r->n_live > 0) return;
    e->n_requests_running--;
    let_go(e, r);
}

// Appends sample k's token to its completion q, turns it into text and an event. When the request asks for top
// logprobs, the token's logprob and the alternatives both come from the host copy of its logits row (one
// distribution for the two).
static void emit_token(Engine *e, EngSeq *q, int k) {
    EngineRequest *r = q->req;
    Sequence *s = &q->s;
    const int n_top = r->p.top_logprobs;
    const int32_t tok = e->samp_tok[k];
    float lp = e->samp_lp[k];
    if (n_top > 0) {
        const float inv_t = r->p.temperature < SAMPLER_GREEDY_BELOW ? 1.0f : 1.0f / r->p.temperature;
        lp = sampler_logprob(e->logits + (size_t)e->samp_params[k].logits_row * e->V, e->V, inv_t, tok, n_top, e->top);
    }
    s->tokens[s->n_tokens++] = tok;
    const int last = s->n_tokens - s->n_prompt >= r->p.max_tokens || s->n_tokens >= e->m.cfg.max_seq_len;
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
    if (request_push(r, q->index, tok, lp, e->top, e->text.data, e->text.len, res.finish, res.stop_reason,
                     res.stop_token, e->version, &wake) != 0 && res.finish == FINISH_NONE)
        res.finish = FINISH_ERROR; // the event could not be queued: end the completion (it says FINISH_ERROR)
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
    r->forked = 1;
    for (int i = 1; i < r->n; i++) {
        EngSeq *c = &r->seqs[i];
        bm_fork(e->bm, &c->s.table, &parent->s.table);
        c->s.n_computed = parent->s.n_computed;
    }
    for (int i = 0; i < r->n; i++) emit_token(e, &r->seqs[i], k0 + i);
    int first_surplus = r->n;
    for (int i = 1; i < r->n; i++) {
        EngSeq *c = &r->seqs[i];
        if (c->finished) continue;
        if (e->sched.running.count < e->sched.max_num_seqs) sched_add_running(&e->sched, &c->s);
        else if (first_surplus == r->n) first_surplus = i;
    }
    for (int i = r->n - 1; i >= first_surplus; i--)
        if (!r->seqs[i].finished && r->seqs[i].s.status == SEQ_NEW) sched_add_waiting(&e->sched, &r->seqs[i].s, 1);
}

// ---- sampling on the backend --------------------------------------------------------------------

// Room for n samples and nh history ids, host and backend. Returns 0 or -1 (out of memory).
static int samp_reserve(Engine *e, int n, int64_t nh) {
    if (nh > INT32_MAX) return -1;
    if (n > e->samp_cap) {
        const int cap = n > 2 * e->samp_cap ? n : 2 * e->samp_cap;
        EngSeq **seq = realloc(e->samp_seq, (size_t)cap * sizeof *seq);
        if (seq) e->samp_seq = seq;
        OpsSampleParams *par = realloc(e->samp_params, (size_t)cap * sizeof *par);
        if (par) e->samp_params = par;
        int32_t *off = realloc(e->samp_off, (size_t)(cap + 1) * sizeof *off);
        if (off) e->samp_off = off;
        int32_t *tok = realloc(e->samp_tok, (size_t)cap * sizeof *tok);
        if (tok) e->samp_tok = tok;
        float *lp = realloc(e->samp_lp, (size_t)cap * sizeof *lp);
        if (lp) e->samp_lp = lp;
        if (!seq || !par || !off || !tok || !lp) return -1;
        ops_free(e->ops, e->d_params);
        ops_free(e->ops, e->d_off);
        ops_free(e->ops, e->d_tok);
        ops_free(e->ops, e->d_lp);
        e->d_params = ops_malloc(e->ops, (size_t)cap * sizeof *e->d_params);
        e->d_off = ops_malloc(e->ops, (size_t)(cap + 1) * sizeof *e->d_off);
        e->d_tok = ops_malloc(e->ops, (size_t)cap * sizeof *e->d_tok);
        e->d_lp = ops_malloc(e->ops, (size_t)cap * sizeof *e->d_lp);
        if (!e->d_params || !e->d_off || !e->d_tok || !e->d_lp) {
            e->samp_cap = 0; // whatever was allocated is freed and re-made by the next call
            return -1;
        }
        e->samp_cap = cap;
    }
    if (nh > e->hist_cap) {
        const int64_t want = nh > 2 * (int64_t)e->hist_cap ? nh : 2 * (int64_t)e->hist_cap;
        const int cap = want > INT32_MAX ? INT32_MAX : (int)want;
        int32_t *h = realloc(e->samp_hist, (size_t)cap * sizeof *h);
        if (!h) return -1;
        e->samp_hist = h;
        ops_free(e->ops, e->d_hist);
        if (!(e->d_hist = ops_malloc(e->ops, (size_t)cap * sizeof *e->d_hist))) {
            e->hist_cap = 0;
            return -1;
        }
        e->hist_cap = cap;
    }
    return 0;
}

// The step's samples, in step order: a request's first logits row is sampled by each of its n completions, any
// other row by its own completion. Each draws the uniform of (its stream, its output position); penalised
// samples carry their whole history (prompt then generated ids). Returns 0 or -1 (out of memory).
static int build_samples(Engine *e) {
    Scheduler *s = &e->sched;
    int n = 0;
    int64_t nh = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            if (samp_reserve(e, n, nh) != 0) return -1;
            n = 0;
            nh = 0;
            e->samp_off[0] = 0;
        }
        for (int i = 0; i < s->n_step; i++) {
            if (e->row_of[i] < 0) continue;
            EngSeq *q = (EngSeq *)s->step[i];
            EngineRequest *r = q->req;
            const SamplingParams *p = &r->p;
            const int m = r->forked ? 1 : r->n;
            for (int c = 0; c < m; c++, n++) {
                EngSeq *cq = r->forked ? q : &r->seqs[c];
                const Sequence *cs = &cq->s;
                const int penalised = p->repetition_penalty != 1.0f;
                if (pass == 1) {
                    e->samp_seq[n] = cq;
                    e->samp_params[n] = (OpsSampleParams){
                        .u = sampler_uniform(r->seed + (uint64_t)cq->index, (uint64_t)(cs->n_tokens - cs->n_prompt)),
                        .temperature = p->temperature,
                        .top_p = p->top_p,
                        .min_p = p->min_p,
                        .repetition_penalty = p->repetition_penalty,
                        .top_k = p->top_k,
                        .logits_row = e->row_of[i],
                    };
                    if (penalised) memcpy(e->samp_hist + nh, cs->tokens, (size_t)cs->n_tokens * sizeof *cs->tokens);
                }
                if (penalised) nh += cs->n_tokens;
                if (pass == 1) e->samp_off[n + 1] = (int32_t)nh;
            }
        }
    }
    e->n_samp = n;
    return 0;
}

// Samples the step's logits rows where they are (backend memory) and downloads the ids and logprobs, 8 bytes a
// sample, plus the rows whose requests asked for top logprobs. Returns 0 or -1 with a message.
static int sample_step(Engine *e, int n_rows, char *err, size_t err_len) {
    OpsCtx *o = e->ops;
    const int n = e->n_samp, nh = e->samp_off[n], V = e->V;
    const void *logits = decode_bufs_logits(e->bufs);
    ops_copy_to_device(o, e->d_params, e->samp_params, (size_t)n * sizeof *e->d_params);
    ops_copy_to_device(o, e->d_off, e->samp_off, (size_t)(n + 1) * sizeof *e->d_off);
    if (nh > 0) ops_copy_to_device(o, e->d_hist, e->samp_hist, (size_t)nh * sizeof *e->d_hist);
    ops_sample_rows(o, e->d_tok, e->d_lp, logits, e->d_params, e->d_hist, e->d_off, n, n_rows, V, nh);
    ops_copy_to_host(o, e->samp_tok, e->d_tok, (size_t)n * sizeof *e->samp_tok);
    ops_copy_to_host(o, e->samp_lp, e->d_lp, (size_t)n * sizeof *e->samp_lp);
    const size_t es = ops_dtype_size(o);
    for (int k = 0, last = -1; k < n; k++) { // a fork's samples share one row, next to each other
        const int row = e->samp_params[k].logits_row;
        if (e->samp_seq[k]->req->p.top_logprobs <= 0 || row == last) continue;
        ops_download_f32(o, e->logits + (size_t)row * V, (const char *)logits + (size_t)row * V * es, (size_t)V);
        last = row;
    }
    if (ops_status(o)) {
        snprintf(err, err_len, "sampling failed: %s", ops_error(o));
        return -1;
    }
    for (int k = 0; k < n; k++)
        if (e->samp_tok[k] < 0 || e->samp_tok[k] >= V) {
            snprintf(err, err_len, "sampling gave token %d for sample %d of %d (vocabulary %d)", e->samp_tok[k], k, n,
                     V);
            return -1;
        }
    return 0;
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

// Logs what the last step did to the decode graphs: the first graph recorded for a batch size, or a recording that
// failed. Recording a size again for swapped-in weight buffers is routine and not logged.
static void log_graphs(Engine *e) {
    DecodeGraphStats g;
    decode_bufs_graph_stats(e->bufs, &g);
    const int64_t events = g.recordings + g.failures;
    if (events == e->graph_logged) return;
    e->graph_logged = events;
    if (g.last_failed)
        fprintf(stderr, "tandem-serve: recording the CUDA graph of decode batch %d failed, %s: %s\n", g.last_batch,
                g.last_gave_up ? "that batch size runs eagerly from now on" : "it runs eagerly until a retry succeeds",
                g.last_error);
    else if (!g.last_again)
        fprintf(stderr, "tandem-serve: CUDA graph of decode batch %d recorded in %.1f ms (%.1f MiB device memory; "
                        "%d graphs)\n", g.last_batch, g.last_seconds * 1e3, g.last_bytes / 1048576.0, g.graphs);
}

// Records the decode graph of every ladder size before serving, on padding-only steps (token 0 at position 0 of
// block 0, slot -1: nothing is stored, the outputs are dropped), as vLLM captures its graphs at start-up: otherwise
// the first step at each batch size runs eagerly and records (40-140 ms each on an H100), and a load ramping up to
// 512 sequences met four or five of them. A size that fails here records, or runs eagerly, on its first real step.
static void record_decode_graphs(Engine *e, int top) {
    const double t0 = now_seconds();
    for (int i = 0; i < top; i++) {
        e->tok_ids[i] = 0;
        e->tok_pos[i] = 0;
        e->slots[i] = -1;
        e->tables[i] = 0;
    }
    int ladder[64];
    const int n_ladder = decode_ladder(top, ladder, 64);
    char err[512] = "";
    int failed = 0;
    for (int r = 0; r < n_ladder; r++) {
        if (model_decode_step_padded(&e->m, e->bufs, &e->src, &e->kv, ladder[r], e->tok_ids, e->tok_pos, e->slots,
                                     e->tables, 1, NULL, err, sizeof err) != 0) {
            failed++;
            ops_clear_error(e->ops);
        }
    }
    ops_synchronize(e->ops);
    if (ops_status(e->ops)) {
        snprintf(err, sizeof err, "%s", ops_error(e->ops));
        ops_clear_error(e->ops);
        failed = failed ? failed : 1;
    }
    DecodeGraphStats g;
    decode_bufs_graph_stats(e->bufs, &g);
    e->graph_logged = g.recordings + g.failures;
    if (failed || g.failures)
        fprintf(stderr, "tandem-serve: recording the decode graphs at start-up failed for %d of %d batch sizes (%s); "
                        "they record on their first step instead\n", failed > g.failures ? failed : (int)g.failures,
                n_ladder, err[0] ? err : g.last_error);
    fprintf(stderr, "tandem-serve: %d decode graphs recorded in %.2f s\n", g.graphs, now_seconds() - t0);
}

// One engine step. Returns the number of tokens it ran (0: nothing could be scheduled).
static int run_step(Engine *e) {
    Scheduler *s = &e->sched;
    const double t0 = now_seconds();
    const int64_t preempt_before = s->preemptions;
    if (sched_step(s) == 0) return 0;
    const int bs = e->cfg.block_size;
    // Block tables go to the model as rows of mb entries, mb = the step's longest table, not max_blocks: entries
    // past a table's end are never read (each token reads its own positions' blocks, all within its table).
    int mb = 1;
    for (int i = 0; i < s->n_step; i++)
        if (s->step[i]->table.n > mb) mb = s->step[i]->table.n;
    int n = 0, n_rows = 0;
    for (int i = 0; i < s->n_step; i++) {
        Sequence *q = s->step[i];
        EngSeq *es = (EngSeq *)q;
        if (q->just_admitted && q->n_admissions == 1 && es->index == 0) { // the request's first admission
            EngineRequest *r = es->req;
            r->admitted = 1;
            e->n_requests_running++;
            queued_dec(e);
            e->live.prompt_tokens_total += r->prompt_len;
            e->live.cached_prompt_tokens_total += q->cached_at_admission;
            pthread_mutex_lock(&r->mu);
            r->cached_tokens = q->cached_at_admission;
            pthread_mutex_unlock(&r->mu);
        }
        for (int t = 0; t < q->sched; t++, n++) {
            const int pos = q->n_computed + t;
            e->tok_ids[n] = q->tokens[pos];
            e->tok_seq[n] = i;
            e->tok_pos[n] = pos;
            e->slots[n] = q->table.ids[pos / bs] * bs + pos % bs;
        }
        int32_t *tab = e->tables + (size_t)i * mb;
        memcpy(tab, q->table.ids, (size_t)q->table.n * sizeof *tab);
        for (int j = q->table.n; j < mb; j++) tab[j] = -1;
        if (q->n_computed + q->sched == q->n_tokens) {
            e->rows[n_rows] = n - 1;
            e->row_of[i] = n_rows++;
        } else {
            e->row_of[i] = -1;
        }
    }
    char err[512];
    int failed = 0;
    // Decode-only: one token per sequence, each its sequence's last (so token i is sequence i's and logits row i).
    const int decode_only = n == s->n_step && n_rows == n;
    if (build_samples(e) != 0) {
        snprintf(err, sizeof err, "out of memory for the step's %d sampling rows", n_rows);
        failed = 1;
    } else {
        const double tc = now_seconds();
        int kind = decode_only ? ENGINE_STEP_DECODE_EAGER : ENGINE_STEP_PREFILL;
        // The logits stay in backend memory: the sampling op reads them there.
        if (decode_only && decode_bufs_padded_size(e->bufs, n) > 0) {
            DecodeGraphStats before, after;
            decode_bufs_graph_stats(e->bufs, &before);
            failed = model_decode_step_padded(&e->m, e->bufs, &e->src, &e->kv, n, e->tok_ids, e->tok_pos, e->slots,
                                              e->tables, mb, NULL, err, sizeof err) != 0;
            decode_bufs_graph_stats(e->bufs, &after);
            if (after.replays > before.replays) kind = ENGINE_STEP_DECODE_GRAPH;
            log_graphs(e);
        } else {
            // Prefill steps meet a new token count almost every time: their GEMMs take cuBLASLt's first pick instead
            // of being timed on the spot (which cost a 0.5B prefill step ~55 ms on an H100).
            const int tuning = ops_set_gemm_tuning(e->ops, 0);
            failed = model_decode_step(&e->m, e->bufs, &e->src, &e->kv, n, e->tok_ids, e->tok_seq, e->tok_pos,
                                       e->slots, e->tables, s->n_step, mb, e->rows, n_rows, NULL, err, sizeof err) != 0;
            ops_set_gemm_tuning(e->ops, tuning);
        }
        failed = failed || (n_rows > 0 && sample_step(e, n_rows, err, sizeof err) != 0);
        if (!failed && n_rows == 0) { // nothing to sample: still wait for the step, and see it succeeded
            ops_synchronize(e->ops);
            if ((failed = ops_status(e->ops) != 0))
                snprintf(err, sizeof err, "decode step failed: %s", ops_error(e->ops));
        }
        const double dc = now_seconds() - tc;
        e->live.step_compute_seconds_sum += dc;
        e->live.steps_by_kind[kind]++;
        e->live.compute_seconds_by_kind[kind] += dc;
    }
    if (failed) {
        fprintf(stderr, "tandem-serve: engine step failed, its requests end with an error: %s\n", err);
        ops_clear_error(e->ops);
        fail_step(e);
    } else {
        sched_commit(s);
        // A request is freed only after its last completion finishes, so later entries stay valid. Samples are
        // in step order (build_samples).
        for (int i = 0, k = 0; i < s->n_step; i++) {
            if (e->row_of[i] < 0) continue;
            EngSeq *q = (EngSeq *)s->step[i];
            EngineRequest *r = q->req;
            if (!r->forked) {
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

static void apply_commit(Engine *e, int64_t version) { // not under mu
    const Layout *L = &e->m.layout;
    int rc = 0;
    char msg[512] = "";
    for (int u = 0; u < L->n_units; u++) {
        if (e->commit_device) {
            // Transport nccl: the received copy becomes live; the old one receives the next update.
            void *live = e->w.params[u];
            e->w.params[u] = e->dstaging[u];
            e->dstaging[u] = live;
            continue;
        }
        if (!e->commit_units[u]) continue;
        ops_upload_f32(e->ops, e->w.params[u], e->commit_units[u], L->unit_numel[u]);
        free(e->commit_units[u]);
        e->commit_units[u] = NULL;
    }
    ops_synchronize(e->ops);
    if (ops_status(e->ops)) {
        rc = ENGINE_EINTERNAL;
        snprintf(msg, sizeof msg, "uploading the new weights failed (the weights may be partly updated): %s",
                 ops_error(e->ops));
        ops_clear_error(e->ops);
    } else {
        bm_reset_prefix_cache(e->bm);
    }
    pthread_mutex_lock(&e->mu);
    if (rc == 0) e->version = version;
    e->commit_rc = rc;
    snprintf(e->commit_err, sizeof e->commit_err, "%s", msg);
    pthread_mutex_unlock(&e->mu);
}

static void *engine_main(void *arg) {
    Engine *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (e->commit_req != e->commit_done) {
            const int64_t gen = e->commit_req, version = e->commit_version;
            for (int u = 0; u < e->m.layout.n_units && !e->commit_device; u++) {
                e->commit_units[u] = e->staging[u];
                e->staging[u] = NULL;
            }
            pthread_mutex_unlock(&e->mu);
            apply_commit(e, version);
            pthread_mutex_lock(&e->mu);
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
            for (EngineRequest *r = in, *next; r; r = next) {
                next = r->next_in;
                sched_add_waiting(&e->sched, &r->seqs[0].s, 0);
            }
            for (EngineRequest *r = ab, *next; r; r = next) {
                next = r->next_abort;
                pthread_mutex_lock(&r->mu);
                const int done = r->engine_done;
                pthread_mutex_unlock(&r->mu);
                if (!done) drop_sequences(e, r);
                request_free(r); // released by the client, which left it to us
            }
            pthread_mutex_lock(&e->mu);
            publish_stats(e);
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
            e->pause_ack = 1;
            pthread_cond_broadcast(&e->ack);
            pthread_cond_wait(&e->wake, &e->mu);
            continue;
        }
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
    if (e->dstaging) {
        for (int u = 0; u < e->m.layout.n_units; u++) ops_free(e->ops, e->dstaging[u]);
        free(e->dstaging);
    }
    if (e->staging) {
        for (int u = 0; u < e->m.layout.n_units; u++) free(e->staging[u]);
        free(e->staging);
    }
    free(e->commit_units);
    free(e->tok_ids);
    free(e->tok_seq);
    free(e->tok_pos);
    free(e->slots);
    free(e->tables);
    free(e->rows);
    free(e->row_of);
    free(e->logits);
    free(e->samp_seq);
    free(e->samp_params);
    free(e->samp_off);
    free(e->samp_hist);
    free(e->samp_tok);
    free(e->samp_lp);
    if (e->ops) {
        ops_free(e->ops, e->d_params);
        ops_free(e->ops, e->d_off);
        ops_free(e->ops, e->d_hist);
        ops_free(e->ops, e->d_tok);
        ops_free(e->ops, e->d_lp);
    }
    free(e->scratch_reqs);
    free(e->wake_reqs);
    textbuf_free(&e->text);
    sched_destroy(&e->sched);
    bm_destroy(e->bm);
    if (e->bufs) decode_bufs_free(e->bufs, &e->m);
    if (e->kv.k) kv_cache_free(&e->kv, &e->m);
    if (e->tok) tokenizer_free(e->tok);
    if (e->have_model) {
        resident_free(&e->w, &e->m);
        model_free(&e->m);
    }
    if (e->ops) ops_destroy(e->ops);
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
    for (int i = 0; i < e->m.cfg.n_eos_token_ids && n < ENGINE_MAX_EOS; i++) ids[n++] = e->m.cfg.eos_token_ids[i];
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
    e->cfg = *cfg;
    e->cfg.model_dir = NULL; // the caller's string may not outlive us; the id below is what we keep
    {
        size_t len = strlen(cfg->model_dir);
        while (len > 1 && cfg->model_dir[len - 1] == '/') len--;
        size_t start = len;
        while (start > 0 && cfg->model_dir[start - 1] != '/') start--;
        snprintf(e->model_id, sizeof e->model_id, "%.*s", (int)(len - start), cfg->model_dir + start);
    }
    char msg[768];
    rc = ENGINE_EINTERNAL;
    if (ops_create_with_settings(&e->ops, cfg->backend, cfg->device, &cfg->ops, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "cannot start the %s backend: %s", cfg->backend == OPS_BACKEND_CUDA ? "cuda" : "cpu", msg);
        goto fail;
    }
    if (model_load(&e->m, &e->w, e->ops, cfg->model_dir, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "cannot load the model from %s: %s", cfg->model_dir, msg);
        rc = ENGINE_EINVAL;
        goto fail;
    }
    e->have_model = 1;
    e->src = resident_source(&e->w);
    e->V = e->m.cfg.vocab_size;
    {
        char path[4096];
        struct stat stt;
        snprintf(path, sizeof path, "%s/tokenizer.json", cfg->model_dir);
        if (stat(path, &stt) == 0 && tokenizer_load(&e->tok, cfg->model_dir, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "cannot load the tokenizer of %s: %s", cfg->model_dir, msg);
            rc = ENGINE_EINVAL;
            goto fail;
        }
    }
    collect_eos(e);

    // Step workspace first, so that --gpu-memory-utilization sees what it takes.
    const int bs = cfg->block_size, max_len = e->m.cfg.max_seq_len;
    e->max_blocks = (max_len + bs - 1) / bs;
    if (decode_bufs_create(&e->bufs, &e->m, cfg->max_num_batched_tokens, cfg->max_num_seqs, e->max_blocks,
                           cfg->max_num_seqs, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "%s (lower --max-num-batched-tokens or --max-num-seqs)", msg);
        rc = ENGINE_ENOMEM;
        goto fail;
    }
    // Decode-only steps on the GPU: padded to the ladder of batch sizes and replayed as CUDA graphs (recorded on
    // the first step of each size). With --enforce-eager they run eagerly at the same padded sizes, which keeps
    // their numbers identical to the graphs'. On the CPU nothing is padded: there is no launch cost to save.
    if (cfg->backend == OPS_BACKEND_CUDA && cfg->cuda_graph_max_batch > 0) {
        const int top = decode_bufs_enable_padded(e->bufs, &e->m, cfg->cuda_graph_max_batch, !cfg->enforce_eager, msg,
                                                  sizeof msg);
        if (top < 0) {
            snprintf(err, err_len, "%s (lower --cuda-graph-max-batch)", msg);
            rc = ENGINE_ENOMEM;
            goto fail;
        }
        int ladder[64];
        const int n_ladder = decode_ladder(top, ladder, 64);
        char sizes[512];
        size_t used = 0;
        for (int i = 0; i < n_ladder && used < sizeof sizes; i++)
            used += (size_t)snprintf(sizes + used, sizeof sizes - used, "%s%d", i ? ", " : "", ladder[i]);
        fprintf(stderr, "tandem-serve: decode-only steps of up to %d sequences are padded to batch sizes %s and %s\n",
                top, sizes,
                decode_bufs_graphs_on(e->bufs) ? "replayed as CUDA graphs (recorded now)"
                : cfg->enforce_eager ? "run eagerly (--enforce-eager)"
                                     : "run eagerly (CUDA graphs are off while profile_ops times each op)");
    }
    // The KV pool: as many blocks as the memory budget holds. Each step writes up to max_num_batched_tokens
    // tokens (or a whole context, if shorter), so a pool smaller than that is a configuration mistake.
    const char *budget_flag = "--kv-cache-memory";
    size_t kv_bytes = cfg->kv_cache_bytes;
    if (cfg->gpu_memory_utilization > 0) {
        size_t free_b, total_b;
        if (ops_memory_info(e->ops, &free_b, &total_b) != 0) {
            snprintf(err, err_len, "--gpu-memory-utilization needs a CUDA device (this engine runs on the %s); use "
                     "--kv-cache-memory", cfg->backend == OPS_BACKEND_CUDA ? "GPU but its memory cannot be read" : "CPU");
            ops_clear_error(e->ops);
            rc = ENGINE_EINVAL;
            goto fail;
        }
        // Everything in use now (our weights and workspace, other processes) counts against the fraction;
        // the rest goes to the KV pool, less the NCCL weight copy and a margin for the sampler, cuBLAS and NCCL.
        const size_t weights = e->m.layout.n_params * ops_dtype_size(e->ops);
        const size_t margin = (size_t)512 << 20;
        const double allowed = cfg->gpu_memory_utilization * (double)total_b;
        const double used = (double)(total_b - free_b);
        const double left = allowed - used - (double)margin - (cfg->reserve_weight_copy ? (double)weights : 0.0);
        kv_bytes = left > 0 ? (size_t)left : 0;
        budget_flag = "--gpu-memory-utilization";
        fprintf(stderr, "tandem-serve: GPU memory %.1f GiB, %.0f %% allowed = %.1f GiB; in use %.1f GiB (weights %.2f "
                        "GiB, workspace, others), weight-update copy %.2f GiB, margin 0.5 GiB -> KV pool %.2f GiB\n",
                total_b / 1073741824.0, cfg->gpu_memory_utilization * 100, allowed / 1073741824.0,
                used / 1073741824.0, weights / 1073741824.0, cfg->reserve_weight_copy ? weights / 1073741824.0 : 0.0,
                kv_bytes / 1073741824.0);
    }
    const size_t per_block = kv_cache_bytes_per_block(&e->m, bs);
    const size_t n_blocks = kv_bytes / per_block;
    const int step_tokens = cfg->max_num_batched_tokens < max_len ? cfg->max_num_batched_tokens : max_len;
    const size_t min_blocks = ((size_t)step_tokens + bs - 1) / bs;
    if (n_blocks < min_blocks || n_blocks > INT32_MAX / (size_t)bs) {
        snprintf(err, err_len, "the KV pool (%s) of %zu bytes holds %zu KV blocks of %d tokens (%zu bytes each), but "
                 "one step of %d tokens needs %zu (%zu bytes): raise %s or lower --max-num-batched-tokens",
                 budget_flag, kv_bytes, n_blocks, bs, per_block, step_tokens, min_blocks, min_blocks * per_block,
                 budget_flag);
        rc = ENGINE_EINVAL;
        goto fail;
    }
    e->n_blocks = (int)n_blocks;
    if (kv_cache_create(&e->kv, &e->m, e->n_blocks, bs, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "%s (lower %s)", msg, budget_flag);
        rc = ENGINE_ENOMEM;
        goto fail;
    }
    const size_t token_bytes = (size_t)e->m.cfg.num_kv_heads * e->m.cfg.head_dim * ops_dtype_size(e->ops);
    if (bm_create(&e->bm, e->n_blocks, bs, cfg->enable_prefix_caching, &e->kv, e->ops, token_bytes, msg, sizeof msg) != 0 ||
        sched_init(&e->sched, e->bm, cfg->max_num_seqs, cfg->max_num_batched_tokens) != 0 ||
        samp_reserve(e, cfg->max_num_seqs, 0) != 0)
        goto oom;
    const size_t T = (size_t)cfg->max_num_batched_tokens, S = (size_t)cfg->max_num_seqs;
    e->tok_ids = malloc(T * sizeof *e->tok_ids);
    e->tok_seq = malloc(T * sizeof *e->tok_seq);
    e->tok_pos = malloc(T * sizeof *e->tok_pos);
    e->slots = malloc(T * sizeof *e->slots);
    e->tables = malloc(S * e->max_blocks * sizeof *e->tables);
    e->rows = malloc(S * sizeof *e->rows);
    e->row_of = malloc(S * sizeof *e->row_of);
    e->logits = malloc(S * e->V * sizeof *e->logits);
    e->scratch_reqs = malloc(S * sizeof *e->scratch_reqs);
    e->wake_reqs = malloc(S * sizeof *e->wake_reqs);
    e->staging = calloc((size_t)e->m.layout.n_units, sizeof *e->staging);
    e->dstaging = calloc((size_t)e->m.layout.n_units, sizeof *e->dstaging);
    e->commit_units = calloc((size_t)e->m.layout.n_units, sizeof *e->commit_units);
    if (!e->tok_ids || !e->tok_seq || !e->tok_pos || !e->slots || !e->tables || !e->rows || !e->row_of ||
        !e->logits || !e->scratch_reqs || !e->wake_reqs || !e->staging || !e->dstaging || !e->commit_units ||
        textbuf_append(&e->text, "", 0) != 0)
        goto oom;
    if (e->bufs && decode_bufs_graphs_on(e->bufs)) record_decode_graphs(e, decode_bufs_padded_max(e->bufs));
    e->accepting = 1;
    e->idle = 1;
    publish_stats(e);
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        snprintf(err, err_len, "cannot start the engine thread");
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
