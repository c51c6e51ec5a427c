// rollout_server/model_runner.c — the device side of the engine's steps (model_runner.h): set-up (context,
// model, step workspace, decode graphs, KV pool), one step (step arrays, graph or eager, sampling on the device,
// top logprobs on the host) and the weights' device copies.
#include "rollout_server/model_runner.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout_server/model_runner_internal.h"
#include "rollout_server/sampler.h"

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

const Model *runner_model(const ModelRunner *r) { return r->tp > 1 ? &r->whole : &r->shards[0].m; }
int runner_num_blocks(const ModelRunner *r) { return r->n_blocks; }
OpsCtx *runner_ops(ModelRunner *r) { return r->ops; }

// ---- sampling -----------------------------------------------------------------------------------

// Room for n samples, nh history ids and nm mask ids, host and backend. Returns 0 or -1 (out of memory).
static int samp_reserve(ModelRunner *r, int n, int64_t nh, int64_t nm) {
    if (nh > INT32_MAX || nm > INT32_MAX) return -1;
    if (n > r->samp_cap) {
        const int cap = n > 2 * r->samp_cap ? n : 2 * r->samp_cap;
        OpsSampleParams *par = realloc(r->samp_params, (size_t)cap * sizeof *par);
        if (par) r->samp_params = par;
        int32_t *off = realloc(r->samp_off, (size_t)(cap + 1) * sizeof *off);
        if (off) r->samp_off = off;
        int32_t *tok = realloc(r->samp_tok, (size_t)cap * sizeof *tok);
        if (tok) r->samp_tok = tok;
        float *lp = realloc(r->samp_lp, (size_t)cap * sizeof *lp);
        if (lp) r->samp_lp = lp;
        TokenLogprob *top = realloc(r->samp_top, (size_t)cap * ENGINE_MAX_TOP_LOGPROBS * sizeof *top);
        if (top) r->samp_top = top;
        if (!par || !off || !tok || !lp || !top) return -1;
        ops_free(r->ops, r->d_params);
        ops_free(r->ops, r->d_off);
        ops_free(r->ops, r->d_tok);
        ops_free(r->ops, r->d_lp);
        r->d_params = ops_malloc(r->ops, (size_t)cap * sizeof *r->d_params);
        r->d_off = ops_malloc(r->ops, (size_t)(cap + 1) * sizeof *r->d_off);
        r->d_tok = ops_malloc(r->ops, (size_t)cap * sizeof *r->d_tok);
        r->d_lp = ops_malloc(r->ops, (size_t)cap * sizeof *r->d_lp);
        if (!r->d_params || !r->d_off || !r->d_tok || !r->d_lp) {
            r->samp_cap = 0; // whatever was allocated is freed and re-made by the next call
            return -1;
        }
        r->samp_cap = cap;
    }
    if (nh > r->hist_cap) {
        const int64_t want = nh > 2 * (int64_t)r->hist_cap ? nh : 2 * (int64_t)r->hist_cap;
        const int cap = want > INT32_MAX ? INT32_MAX : (int)want;
        int32_t *h = realloc(r->samp_hist, (size_t)cap * sizeof *h);
        if (!h) return -1;
        r->samp_hist = h;
        ops_free(r->ops, r->d_hist);
        if (!(r->d_hist = ops_malloc(r->ops, (size_t)cap * sizeof *r->d_hist))) {
            r->hist_cap = 0;
            return -1;
        }
        r->hist_cap = cap;
    }
    if (nm > r->mask_cap) {
        const int64_t want = nm > 2 * (int64_t)r->mask_cap ? nm : 2 * (int64_t)r->mask_cap;
        const int cap = want > INT32_MAX ? INT32_MAX : (int)want;
        int32_t *m = realloc(r->samp_mask, (size_t)cap * sizeof *m);
        if (!m) return -1;
        r->samp_mask = m;
        ops_free(r->ops, r->d_mask);
        if (!(r->d_mask = ops_malloc(r->ops, (size_t)cap * sizeof *r->d_mask))) {
            r->mask_cap = 0;
            return -1;
        }
        r->mask_cap = cap;
    }
    return 0;
}

// The op's inputs for the step's samples: parameters with their logits rows (the samples of sequence i read the
// row of its last token, rows numbered in sequence order), the penalised samples' histories packed one after
// the other, and the masked samples' ids likewise (each mask pointer moved to its ids' backend copy). Returns 0 or
// -1 (out of memory).
static int pack_samples(ModelRunner *r, const RunnerSeq *seqs, int n_seqs, const RunnerSample *samples, int n) {
    int64_t nh = 0, nm = 0;
    for (int k = 0; k < n; k++) nh += samples[k].history ? samples[k].n_history : 0;
    for (int k = 0; k < n; k++) nm += samples[k].p.mask ? samples[k].p.n_mask : 0;
    if (samp_reserve(r, n, nh, nm) != 0) return -1;
    r->samp_off[0] = 0;
    r->samp_n_mask = 0;
    for (int i = 0, k = 0, row = 0; i < n_seqs; i++) {
        if (seqs[i].n_samples <= 0) continue;
        for (int c = 0; c < seqs[i].n_samples; c++, k++) {
            const RunnerSample *s = &samples[k];
            const int h = s->history ? s->n_history : 0;
            r->samp_params[k] = s->p;
            r->samp_params[k].logits_row = row;
            if (h > 0) memcpy(r->samp_hist + r->samp_off[k], s->history, (size_t)h * sizeof *s->history);
            if (s->p.mask && s->p.n_mask > 0) {
                memcpy(r->samp_mask + r->samp_n_mask, s->p.mask, (size_t)s->p.n_mask * sizeof *s->p.mask);
                r->samp_params[k].mask = r->d_mask + r->samp_n_mask;
                r->samp_n_mask += s->p.n_mask;
            } else {
                r->samp_params[k].mask = NULL;
                r->samp_params[k].n_mask = 0;
            }
            r->samp_off[k + 1] = r->samp_off[k] + h;
        }
        row++;
    }
    return 0;
}

// Samples the step's logits rows where they are (backend memory) and downloads the ids and logprobs, 8 bytes a
// sample, plus the rows whose samples asked for top logprobs. Returns 0 or -1 with a message.
static int sample_step(ModelRunner *r, const RunnerSample *samples, int n, int n_rows, char *err, size_t err_len) {
    OpsCtx *o = r->ops;
    const int nh = r->samp_off[n], V = r->V;
    const void *logits = decode_bufs_logits(r->shards[0].bufs);
    ops_copy_to_device(o, r->d_params, r->samp_params, (size_t)n * sizeof *r->d_params);
    ops_copy_to_device(o, r->d_off, r->samp_off, (size_t)(n + 1) * sizeof *r->d_off);
    if (nh > 0) ops_copy_to_device(o, r->d_hist, r->samp_hist, (size_t)nh * sizeof *r->d_hist);
    if (r->samp_n_mask > 0)
        ops_copy_to_device(o, r->d_mask, r->samp_mask, (size_t)r->samp_n_mask * sizeof *r->d_mask);
    ops_sample_rows(o, r->d_tok, r->d_lp, logits, r->d_params, r->d_hist, r->d_off, n, n_rows, V, nh);
    ops_copy_to_host(o, r->samp_tok, r->d_tok, (size_t)n * sizeof *r->samp_tok);
    ops_copy_to_host(o, r->samp_lp, r->d_lp, (size_t)n * sizeof *r->samp_lp);
    const size_t es = ops_dtype_size(o);
    for (int k = 0, last = -1; k < n; k++) { // a fork's samples share one row, next to each other
        const int row = r->samp_params[k].logits_row;
        if (samples[k].top_logprobs <= 0 || row == last) continue;
        ops_download_f32(o, r->logits + (size_t)row * V, (const char *)logits + (size_t)row * V * es, (size_t)V);
        last = row;
    }
    if (ops_status(o)) {
        snprintf(err, err_len, "sampling failed: %s", ops_error(o));
        return -1;
    }
    for (int k = 0; k < n; k++)
        if (r->samp_tok[k] < 0 || r->samp_tok[k] >= V) {
            snprintf(err, err_len, "sampling gave token %d for sample %d of %d (vocabulary %d)", r->samp_tok[k], k, n,
                     V);
            return -1;
        }
    // A sample that asks for top logprobs takes its logprob and the alternatives from the host copy of its row:
    // one distribution for the two.
    for (int k = 0; k < n; k++) {
        const int n_top = samples[k].top_logprobs;
        if (n_top <= 0) continue;
        const float t = r->samp_params[k].temperature;
        const float inv_t = t < SAMPLER_GREEDY_BELOW ? 1.0f : 1.0f / t;
        r->samp_lp[k] = sampler_logprob(r->logits + (size_t)r->samp_params[k].logits_row * V, V, inv_t,
                                        r->samp_tok[k], n_top, r->samp_top + (size_t)k * ENGINE_MAX_TOP_LOGPROBS);
    }
    return 0;
}

// ---- the step -----------------------------------------------------------------------------------

// Logs what the last step did to the decode graphs: the first graph recorded for a batch size, or a recording that
// failed. Recording a size again for swapped-in weight buffers is routine and not logged.
static void log_graphs(ModelRunner *r) {
    DecodeGraphStats g;
    decode_bufs_graph_stats(r->shards[0].bufs, &g);
    const int64_t events = g.recordings + g.failures;
    if (events == r->graph_logged) return;
    r->graph_logged = events;
    if (g.last_failed)
        fprintf(stderr, "tandem-serve: recording the CUDA graph of decode batch %d failed, %s: %s\n", g.last_batch,
                g.last_gave_up ? "that batch size runs eagerly from now on" : "it runs eagerly until a retry succeeds",
                g.last_error);
    else if (!g.last_again)
        fprintf(stderr, "tandem-serve: CUDA graph of decode batch %d recorded in %.1f ms (%.1f MiB device memory; "
                        "%d graphs)\n", g.last_batch, g.last_seconds * 1e3, g.last_bytes / 1048576.0, g.graphs);
}

// Fills the step arrays from the sequences. Returns the number of tokens, with *mb the width of the block-table
// rows and *n_rows the number of logits rows (the sampled sequences' last tokens), or -1 past the workspace.
static int fill_step_arrays(ModelRunner *r, const RunnerSeq *seqs, int n_seqs, int *mb, int *n_rows) {
    const int bs = r->block_size;
    // Block tables go to the model as rows of mb entries, mb = the step's longest table, not max_blocks: entries
    // past a table's end are never read (each token reads its own positions' blocks, all within its table).
    *mb = 1;
    int n = 0;
    for (int i = 0; i < n_seqs; i++) {
        if (seqs[i].n_blocks > r->max_blocks || seqs[i].n_sched < 1) return -1;
        if (seqs[i].n_blocks > *mb) *mb = seqs[i].n_blocks;
        n += seqs[i].n_sched;
    }
    if (n_seqs > r->max_num_seqs || n > r->max_num_batched_tokens) return -1;
    n = 0;
    *n_rows = 0;
    r->n_score = 0;
    for (int i = 0; i < n_seqs; i++) {
        const RunnerSeq *q = &seqs[i];
        for (int t = 0; t < q->n_sched; t++, n++) {
            const int pos = q->n_computed + t;
            r->tok_ids[n] = q->tokens[pos];
            r->tok_seq[n] = i;
            r->tok_pos[n] = pos;
            r->slots[n] = q->blocks[pos / bs] * bs + pos % bs;
        }
        for (int t = 0; t < q->n_sched && q->score_until > 0; t++) {
            const int pos = q->n_computed + t;
            if (pos >= q->score_until) break;
            r->score_rows[r->n_score] = n - q->n_sched + t;
            r->score_seq[r->n_score] = i;
            r->score_pos[r->n_score++] = pos;
        }
        int32_t *tab = r->tables + (size_t)i * *mb;
        memcpy(tab, q->blocks, (size_t)q->n_blocks * sizeof *tab);
        for (int j = q->n_blocks; j < *mb; j++) tab[j] = -1;
        if (q->n_samples > 0) r->rows[(*n_rows)++] = n - 1;
    }
    return n;
}

// Shard k's part of the step in r->plan: the model over the step arrays, logits left in backend memory for the
// sampling op (shard 0's, gathered from every shard). Decode-only steps run at a padded batch size (a CUDA graph
// replay where one is recorded); the others run unpadded.
int runner_shard_step(ModelRunner *r, int k) {
    RunnerShard *s = &r->shards[k];
    const RunnerStepPlan *p = &r->plan;
    if (p->padded)
        return model_decode_step_padded(&s->m, s->bufs, &s->src, &s->kv, p->n, r->tok_ids, r->tok_pos, r->slots,
                                        r->tables, p->mb, NULL, s->err, sizeof s->err) != 0 ? -1 : 0;
    // Prefill steps meet a new token count almost every time: their GEMMs take cuBLASLt's first pick instead of
    // being timed on the spot (which cost a 0.5B prefill step ~55 ms on an H100).
    const int tuning = ops_set_gemm_tuning(s->ops, 0);
    const int rc = model_decode_step(&s->m, s->bufs, &s->src, &s->kv, p->n, r->tok_ids, r->tok_seq, r->tok_pos,
                                     r->slots, r->tables, p->n_seqs, p->mb, r->rows, p->n_rows, NULL, s->err,
                                     sizeof s->err);
    ops_set_gemm_tuning(s->ops, tuning);
    return rc != 0 ? -1 : 0;
}

int runner_shard_score(ModelRunner *r, int k) {
    RunnerShard *s = &r->shards[k];
    const int chunk = r->max_num_seqs, V = r->V;
    for (int first = 0; first < r->n_score; first += chunk) {
        const int n = r->n_score - first < chunk ? r->n_score - first : chunk;
        if (model_decode_more_logits(&s->m, s->bufs, &s->src, r->score_rows + first, n, k == 0 ? r->logits : NULL,
                                     s->err, sizeof s->err) != 0)
            return -1;
        for (int j = 0; j < n && k == 0; j++) {
            const RunnerSeq *q = &r->step_seqs[r->score_seq[first + j]];
            const int at = r->score_pos[first + j] + 1, target = q->tokens[at];
            const float *row = r->logits + (size_t)j * V;
            int rank = 1;
            for (int v = 0; v < V; v++) rank += row[v] > row[target];
            q->score_lp[at] = sampler_logprob(row, V, 1.0f, target, q->score_top,
                                              q->score_alts + (size_t)at * q->score_top);
            q->score_rank[at] = rank;
        }
    }
    return 0;
}

// The model over the step's tokens on every shard. *kind says what ran. Returns 0 or -1 with a message.
static int run_model(ModelRunner *r, int n, int n_seqs, int mb, int n_rows, int *kind, char *err, size_t err_len) {
    // Decode-only: one token per sequence, each its sequence's last (so token i is sequence i's and logits row i).
    const int decode_only = n == n_seqs && n_rows == n;
    DecodeBufs *lead = r->shards[0].bufs;
    r->plan = (RunnerStepPlan){.n = n, .n_seqs = n_seqs, .mb = mb, .n_rows = n_rows,
                               .padded = decode_only && decode_bufs_padded_size(lead, n) > 0};
    *kind = decode_only ? ENGINE_STEP_DECODE_EAGER : ENGINE_STEP_PREFILL;
    DecodeGraphStats before, after;
    decode_bufs_graph_stats(lead, &before);
    const int rc = runner_shards_run(r, SHARD_JOB_STEP, err, err_len);
    if (r->plan.padded) {
        decode_bufs_graph_stats(lead, &after);
        if (after.replays > before.replays) *kind = ENGINE_STEP_DECODE_GRAPH;
        log_graphs(r);
    }
    return rc;
}

int runner_step(ModelRunner *r, const RunnerSeq *seqs, int n_seqs, const RunnerSample *samples, int n_samples,
                RunnerOutput *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    out->kind = -1;
    int mb, n_rows, asked = 0;
    for (int i = 0; i < n_seqs; i++) asked += seqs[i].n_samples > 0 ? seqs[i].n_samples : 0;
    if (asked != n_samples) {
        snprintf(err, err_len, "the step's sequences ask for %d samples but %d are given", asked, n_samples);
        return -1;
    }
    const int n = fill_step_arrays(r, seqs, n_seqs, &mb, &n_rows);
    if (n < 0) {
        snprintf(err, err_len, "a step of %d sequences does not fit the runner's workspace (%d sequences, %d tokens, "
                 "%d blocks per sequence)", n_seqs, r->max_num_seqs, r->max_num_batched_tokens, r->max_blocks);
        return -1;
    }
    if (pack_samples(r, seqs, n_seqs, samples, n_samples) != 0) {
        snprintf(err, err_len, "out of memory for the step's %d sampling rows", n_rows);
        return -1;
    }
    const double t0 = now_seconds();
    r->step_seqs = seqs;
    int failed = run_model(r, n, n_seqs, mb, n_rows, &out->kind, err, err_len) != 0;
    failed = failed || (n_rows > 0 && sample_step(r, samples, n_samples, n_rows, err, err_len) != 0);
    // Scoring replaces the step's logits rows (sampling has read them) with those of the scored tokens.
    failed = failed || (r->n_score > 0 && runner_shards_run(r, SHARD_JOB_SCORE, err, err_len) != 0);
    for (int k = 0; k < r->tp && !failed && n_rows == 0; k++) { // nothing to sample: still wait for the step, and
        OpsCtx *o = r->shards[k].ops;                             // see it succeeded
        ops_synchronize(o);
        if ((failed = ops_status(o) != 0)) snprintf(err, err_len, "decode step failed: %s", ops_error(o));
    }
    out->compute_seconds = now_seconds() - t0;
    if (failed) {
        for (int k = 0; k < r->tp; k++) ops_clear_error(r->shards[k].ops);
        return -1;
    }
    out->tokens = r->samp_tok;
    out->logprobs = r->samp_lp;
    out->top = r->samp_top;
    return 0;
}

void runner_copy_kv_rows(void *user, int32_t dst, int32_t src, int rows) {
    ModelRunner *r = user;
    for (int k = 0; k < r->tp; k++) {   // every shard's pool holds its KV heads of the block
        RunnerShard *s = &r->shards[k];
        const size_t token_bytes = (size_t)s->m.cfg.num_kv_heads * s->m.cfg.head_dim * ops_dtype_size(s->ops);
        const size_t blk = (size_t)r->block_size * token_bytes, bytes = (size_t)rows * token_bytes;
        for (int l = 0; l < s->kv.n_layers; l++) {
            ops_copy(s->ops, (char *)s->kv.k[l] + dst * blk, (char *)s->kv.k[l] + src * blk, bytes);
            ops_copy(s->ops, (char *)s->kv.v[l] + dst * blk, (char *)s->kv.v[l] + src * blk, bytes);
        }
    }
}

// ---- weights ------------------------------------------------------------------------------------

// Waits for every shard and reports the first failure (clearing every shard's error).
static int shards_synchronize(ModelRunner *r, const char *what, char *err, size_t err_len) {
    int failed = 0;
    for (int k = 0; k < r->tp; k++) {
        OpsCtx *o = r->shards[k].ops;
        ops_synchronize(o);
        if (ops_status(o) && !failed) {
            failed = 1;
            snprintf(err, err_len, "%s failed on %s%d (the weights may be partly updated): %s", what,
                     r->tp > 1 ? "tensor-parallel shard " : "device ", k, ops_error(o));
        }
        ops_clear_error(o);
    }
    return failed ? -1 : 0;
}

int runner_upload_weights(ModelRunner *r, float *const *units, char *err, size_t err_len) {
    const Layout *L = &runner_model(r)->layout;
    float *slice = NULL;
    if (r->tp > 1) {
        size_t most = 0;
        for (int k = 0; k < r->tp; k++)
            if (r->shards[k].m.layout.max_unit_numel > most) most = r->shards[k].m.layout.max_unit_numel;
        if (!(slice = malloc(most * sizeof *slice)))
            return snprintf(err, err_len, "out of host memory slicing the new weights"), -1;
    }
    for (int u = 0; u < L->n_units; u++) {
        if (!units[u]) continue;
        for (int k = 0; k < r->tp; k++) {
            RunnerShard *s = &r->shards[k];
            if (r->tp == 1) {
                ops_upload_f32(s->ops, s->w.params[u], units[u], L->unit_numel[u]);
                continue;
            }
            model_shard_unit(&r->whole, &s->m, u, units[u], slice);
            ops_upload_f32(s->ops, s->w.params[u], slice, s->m.layout.unit_numel[u]);
            ops_synchronize(s->ops);   // slice is reused for the next shard
        }
    }
    free(slice);
    return shards_synchronize(r, "uploading the new weights", err, err_len);
}

void *runner_weights_device_staging(ModelRunner *r, int unit) {
    const Layout *L = &runner_model(r)->layout;
    if (unit < 0 || unit >= L->n_units) return NULL;
    if (!r->dstaging[unit]) {
        r->dstaging[unit] = ops_malloc(r->ops, L->unit_numel[unit] * ops_dtype_size(r->ops));
        if (!r->dstaging[unit]) ops_clear_error(r->ops); // the caller reports the missing memory
    }
    if (r->tp > 1 && !r->shard_scratch) {
        size_t most = 0;
        for (int k = 0; k < r->tp; k++) {
            const size_t b = model_shard_scratch_bytes(&r->shards[k].m);
            if (b > most) most = b;
        }
        if (!(r->shard_scratch = ops_malloc(r->ops, most))) {
            ops_clear_error(r->ops);
            return NULL;
        }
    }
    return r->dstaging[unit];
}

int runner_weights_device_missing(const ModelRunner *r) {
    const Layout *L = &runner_model(r)->layout;
    for (int u = 0; u < L->n_units; u++)
        if (!r->dstaging[u]) return u;
    return r->tp > 1 && !r->shard_scratch ? 0 : -1;
}

int runner_swap_device_weights(ModelRunner *r, char *err, size_t err_len) {
    if (r->tp == 1) {
        RunnerShard *s = &r->shards[0];
        for (int u = 0; u < s->m.layout.n_units; u++) {
            void *live = s->w.params[u];
            s->w.params[u] = r->dstaging[u];
            r->dstaging[u] = live;
        }
        return shards_synchronize(r, "uploading the new weights", err, err_len);
    }
    // Shards: each unit's slices go from the whole unit on shard 0 into the shards' live weights, in place (the
    // engine thread calls this between steps, so no step reads them meanwhile).
    if (shards_synchronize(r, "finishing the step before the weight swap", err, err_len) != 0) return -1;
    for (int u = 0; u < r->whole.layout.n_units; u++)
        for (int k = 0; k < r->tp; k++) {
            RunnerShard *s = &r->shards[k];
            if (model_shard_unit_device(&r->whole, r->ops, r->dstaging[u], &s->m, s->w.params[u], u, r->shard_scratch,
                                        err, err_len) != 0) {
                shards_synchronize(r, "", NULL, 0);
                return -1;
            }
        }
    return shards_synchronize(r, "uploading the new weights", err, err_len);
}

// ---- set-up -------------------------------------------------------------------------------------

// Records the decode graph of every ladder size before serving, on padding-only steps (token 0 at position 0 of
// block 0, slot -1: nothing is stored, the outputs are dropped), as vLLM captures its graphs at start-up: otherwise
// the first step at each batch size runs eagerly and records (40-140 ms each on an H100), and a load ramping up to
// 512 sequences met four or five of them. A size that fails here records, or runs eagerly, on its first real step.
static void record_decode_graphs(ModelRunner *r, int top) {
    const double t0 = now_seconds();
    for (int i = 0; i < top; i++) {
        r->tok_ids[i] = 0;
        r->tok_pos[i] = 0;
        r->slots[i] = -1;
        r->tables[i] = 0;
    }
    int ladder[64];
    const int n_ladder = decode_ladder(top, ladder, 64);
    char err[512] = "";
    int failed = 0;
    for (int k = 0; k < n_ladder; k++) {
        RunnerShard *s = &r->shards[0];   // graphs only without shards (decode_bufs_enable_padded)
        if (model_decode_step_padded(&s->m, s->bufs, &s->src, &s->kv, ladder[k], r->tok_ids, r->tok_pos, r->slots,
                                     r->tables, 1, NULL, err, sizeof err) != 0) {
            failed++;
            ops_clear_error(r->ops);
        }
    }
    ops_synchronize(r->ops);
    if (ops_status(r->ops)) {
        snprintf(err, sizeof err, "%s", ops_error(r->ops));
        ops_clear_error(r->ops);
        failed = failed ? failed : 1;
    }
    DecodeGraphStats g;
    decode_bufs_graph_stats(r->shards[0].bufs, &g);
    r->graph_logged = g.recordings + g.failures;
    if (failed || g.failures)
        fprintf(stderr, "tandem-serve: recording the decode graphs at start-up failed for %d of %d batch sizes (%s); "
                        "they record on their first step instead\n", failed > g.failures ? failed : (int)g.failures,
                n_ladder, err[0] ? err : g.last_error);
    fprintf(stderr, "tandem-serve: %d decode graphs recorded in %.2f s\n", g.graphs, now_seconds() - t0);
}

// Decode-only steps on the GPU: padded to the ladder of batch sizes and replayed as CUDA graphs (recorded on the
// first step of each size). With --enforce-eager they run eagerly at the same padded sizes, which keeps their
// numbers identical to the graphs'. On the CPU nothing is padded: there is no launch cost to save.
static int set_up_padded(ModelRunner *r, const EngineConfig *cfg, char *err, size_t err_len) {
    if (cfg->backend != OPS_BACKEND_CUDA || cfg->cuda_graph_max_batch <= 0) return 0;
    char msg[512];
    int top = 0;
    for (int k = 0; k < r->tp; k++) {
        RunnerShard *s = &r->shards[k];
        if ((top = decode_bufs_enable_padded(s->bufs, &s->m, cfg->cuda_graph_max_batch, !cfg->enforce_eager, msg,
                                             sizeof msg)) < 0) {
            snprintf(err, err_len, "%s (lower --cuda-graph-max-batch)", msg);
            return ENGINE_ENOMEM;
        }
    }
    int ladder[64];
    const int n_ladder = decode_ladder(top, ladder, 64);
    char sizes[512];
    size_t used = 0;
    for (int i = 0; i < n_ladder && used < sizeof sizes; i++)
        used += (size_t)snprintf(sizes + used, sizeof sizes - used, "%s%d", i ? ", " : "", ladder[i]);
    fprintf(stderr, "tandem-serve: decode-only steps of up to %d sequences are padded to batch sizes %s and %s\n", top,
            sizes,
            decode_bufs_graphs_on(r->shards[0].bufs) ? "replayed as CUDA graphs (recorded now)"
            : cfg->enforce_eager                     ? "run eagerly (--enforce-eager)"
            : r->tp > 1 ? "run eagerly (CUDA graphs do not hold the tensor-parallel all-reduces yet)"
                        : "run eagerly (CUDA graphs are off while profile_ops times each op)");
    return 0;
}

// Blocks of shard s's KV pool that the memory budget holds (--kv-cache-memory: bytes per device; or what
// --gpu-memory-utilization leaves on its device). Returns 0 or an ENGINE_* code with a message.
static int shard_kv_blocks(ModelRunner *r, RunnerShard *s, const EngineConfig *cfg, size_t *n_blocks,
                           const char **budget_flag, char *err, size_t err_len) {
    size_t kv_bytes = cfg->kv_cache_bytes;
    *budget_flag = "--kv-cache-memory";
    const size_t weights = s->m.layout.n_params * ops_dtype_size(s->ops);
    if (cfg->gpu_memory_utilization > 0) {
        size_t free_b, total_b;
        if (ops_memory_info(s->ops, &free_b, &total_b) != 0) {
            snprintf(err, err_len, "--gpu-memory-utilization needs a CUDA device (this engine runs on the %s); use "
                     "--kv-cache-memory", cfg->backend == OPS_BACKEND_CUDA ? "GPU but its memory cannot be read" : "CPU");
            ops_clear_error(s->ops);
            return ENGINE_EINVAL;
        }
        // Everything in use now (our weights and workspace, other processes) counts against the fraction; the rest
        // goes to the KV pool, less the NCCL weight copy and a margin for the sampler, cuBLAS and NCCL. With shards,
        // the NCCL copy holds whole units on shard 0 (they are sliced into the shards at the swap).
        const size_t copy = !cfg->reserve_weight_copy ? 0 : r->tp > 1 && s->index != 0 ? 0
                            : r->tp > 1 ? r->whole.layout.n_params * ops_dtype_size(s->ops) : weights;
        const size_t margin = (size_t)512 << 20;
        const double allowed = cfg->gpu_memory_utilization * (double)total_b;
        const double used = (double)(total_b - free_b);
        const double left = allowed - used - (double)margin - (double)copy;
        kv_bytes = left > 0 ? (size_t)left : 0;
        *budget_flag = "--gpu-memory-utilization";
        fprintf(stderr, "tandem-serve: %s%d: GPU memory %.1f GiB, %.0f %% allowed = %.1f GiB; in use %.1f GiB (weights "
                        "%.2f GiB, workspace, others), weight-update copy %.2f GiB, margin 0.5 GiB -> KV pool %.2f GiB\n",
                r->tp > 1 ? "shard " : "device ", r->tp > 1 ? s->index : cfg->device, total_b / 1073741824.0,
                cfg->gpu_memory_utilization * 100, allowed / 1073741824.0, used / 1073741824.0,
                weights / 1073741824.0, copy / 1073741824.0, kv_bytes / 1073741824.0);
    }
    *n_blocks = kv_bytes / kv_cache_bytes_per_block(&s->m, cfg->block_size);
    return 0;
}

// The KV pool: as many blocks as the memory budget holds on every shard (the same block ids on each). Each step
// writes up to max_num_batched_tokens tokens (or a whole context, if shorter), so a pool smaller than that is a
// configuration mistake. Returns 0 or an ENGINE_* code with a message.
static int size_kv_pool(ModelRunner *r, const EngineConfig *cfg, char *err, size_t err_len) {
    const char *budget_flag = "--kv-cache-memory";
    size_t n_blocks = SIZE_MAX;
    for (int k = 0; k < r->tp; k++) {
        size_t nb;
        const int rc = shard_kv_blocks(r, &r->shards[k], cfg, &nb, &budget_flag, err, err_len);
        if (rc != 0) return rc;
        if (nb < n_blocks) n_blocks = nb;
    }
    const int bs = cfg->block_size, max_len = runner_model(r)->cfg.max_seq_len;
    const size_t per_block = kv_cache_bytes_per_block(&r->shards[0].m, bs);
    const int step_tokens = cfg->max_num_batched_tokens < max_len ? cfg->max_num_batched_tokens : max_len;
    const size_t min_blocks = ((size_t)step_tokens + bs - 1) / bs;
    if (n_blocks < min_blocks || n_blocks > INT32_MAX / (size_t)bs) {
        snprintf(err, err_len, "the KV pool (%s) of %zu bytes%s holds %zu KV blocks of %d tokens (%zu bytes each), "
                 "but one step of %d tokens needs %zu (%zu bytes): raise %s%s or lower --max-num-batched-tokens",
                 budget_flag, n_blocks * per_block, r->tp > 1 ? " per shard" : "", n_blocks, bs, per_block,
                 step_tokens, min_blocks, min_blocks * per_block, budget_flag,
                 r->tp > 1 ? ", raise --tensor-parallel-size" : "");
        return ENGINE_EINVAL;
    }
    r->n_blocks = (int)n_blocks;
    for (int k = 0; k < r->tp; k++) {
        char msg[512];
        if (kv_cache_create(&r->shards[k].kv, &r->shards[k].m, r->n_blocks, bs, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "%s (lower %s)", msg, budget_flag);
            return ENGINE_ENOMEM;
        }
    }
    const Model *whole = runner_model(r);
    const double weights = (double)r->shards[0].m.layout.n_params * ops_dtype_size(r->ops);
    const long long tokens = (long long)r->n_blocks * bs;
    char shards[64] = "";
    if (r->tp > 1) snprintf(shards, sizeof shards, "%d tensor-parallel shards, on each: ", r->tp);
    fprintf(stderr, "tandem-serve: %sweights %.3f GiB and a KV pool of %d blocks x %d tokens (%.3f GiB): %lld tokens "
                    "in all, the longest context %lld tokens (the model's %d)\n", shards,
            weights / 1073741824.0, r->n_blocks, bs,
            (double)r->n_blocks * per_block / 1073741824.0, tokens,
            tokens < whole->cfg.max_seq_len ? tokens : (long long)whole->cfg.max_seq_len, whole->cfg.max_seq_len);
    return 0;
}

void runner_free(ModelRunner *r) {
    if (!r) return;
    runner_shards_stop(r);
    const Model *whole = r->shards ? runner_model(r) : NULL;
    if (r->dstaging) {
        for (int u = 0; whole && u < whole->layout.n_units; u++) ops_free(r->ops, r->dstaging[u]);
        free(r->dstaging);
    }
    if (r->ops) ops_free(r->ops, r->shard_scratch);
    free(r->tok_ids);
    free(r->tok_seq);
    free(r->tok_pos);
    free(r->slots);
    free(r->tables);
    free(r->rows);
    free(r->score_rows);
    free(r->score_seq);
    free(r->score_pos);
    free(r->logits);
    free(r->samp_params);
    free(r->samp_off);
    free(r->samp_hist);
    free(r->samp_mask);
    free(r->samp_tok);
    free(r->samp_lp);
    free(r->samp_top);
    if (r->ops) {
        ops_free(r->ops, r->d_params);
        ops_free(r->ops, r->d_off);
        ops_free(r->ops, r->d_hist);
        ops_free(r->ops, r->d_mask);
        ops_free(r->ops, r->d_tok);
        ops_free(r->ops, r->d_lp);
    }
    if (r->have_whole) model_free(&r->whole);
    for (int k = r->shards ? r->tp - 1 : -1; k >= 0; k--) {
        RunnerShard *s = &r->shards[k];
        if (s->bufs) decode_bufs_free(s->bufs, &s->m);
        if (s->kv.k) kv_cache_free(&s->kv, &s->m);
        if (s->comm) comm_destroy(s->comm);
        if (s->have_weights) resident_free(&s->w, &s->m);
        if (s->have_model) model_free(&s->m);
        if (s->ops) ops_destroy(s->ops);
    }
    free(r->shards);
    free(r);
}

// Backend bytes of one shard's weights at tensor-parallel size tp, or 0 when tp does not divide the model.
static size_t shard_weight_bytes(const ModelConfig *mc, int tp, size_t es) {
    ModelConfig sc;
    ModelShard sh;
    Layout L;
    char msg[256];
    if (model_shard_config(mc, 0, tp, &sc, &sh, msg, sizeof msg) != 0 || layout_build(&L, &sc, msg, sizeof msg) != 0)
        return 0;
    const size_t bytes = L.total_numel * es;
    layout_free(&L);
    return bytes;
}

// CUDA: refuses, before anything is allocated, weights that do not fit the free memory of a device (shard
// weights at tp, on ops's device), naming the smallest tensor-parallel size whose shards would fit. Returns 0, or
// ENGINE_ENOMEM with the message.
static int check_weights_fit(const ModelConfig *mc, int tp, OpsCtx *ops, int device, char *err, size_t err_len) {
    size_t free_b, total_b;
    if (ops_memory_info(ops, &free_b, &total_b) != 0) {
        ops_clear_error(ops);   // the CPU backend: host memory, nothing to say in advance
        return 0;
    }
    const size_t es = ops_dtype_size(ops), need = shard_weight_bytes(mc, tp, es);
    if (need == 0 || need < free_b) return 0;
    int fits = 0;
    for (int n = tp + 1; n <= 64 && !fits; n++) {
        const size_t b = shard_weight_bytes(mc, n, es);
        if (b && b < free_b * 9 / 10) fits = n;   // a tenth left for the step workspace and the KV pool
    }
    char hint[160];
    if (fits)
        snprintf(hint, sizeof hint, "the smallest --tensor-parallel-size whose shards fit is %d (%.2f GiB each)", fits,
                 shard_weight_bytes(mc, fits, es) / 1073741824.0);
    else
        snprintf(hint, sizeof hint, "no --tensor-parallel-size up to 64 that divides this model fits");
    snprintf(err, err_len, "the model's weights need %.2f GiB per GPU at --tensor-parallel-size %d, but cuda:%d has "
             "%.2f GiB free (of %.2f): %s", need / 1073741824.0, tp, device, free_b / 1073741824.0,
             total_b / 1073741824.0, hint);
    return ENGINE_ENOMEM;
}

// Contexts, shard models and weights of a tensor-parallel runner: shard k on device cfg->device + k (CPU: a context
// each), the whole model described on shard 0, the folder read once and sliced. Returns 0 or an ENGINE_* code.
static int load_shards(ModelRunner *r, const EngineConfig *cfg, char *err, size_t err_len) {
    char msg[768];
    ModelConfig mc;
    if (config_load(&mc, cfg->model_dir, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "cannot load the model from %s: %s", cfg->model_dir, msg);
        return ENGINE_EINVAL;
    }
    ModelConfig probe;
    ModelShard probe_shard;
    if (model_shard_config(&mc, 0, r->tp, &probe, &probe_shard, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "%s: %s (--tensor-parallel-size)", cfg->model_dir, msg);
        return ENGINE_EINVAL;
    }
    Model *models[64];
    ResidentWeights *weights[64];
    for (int k = 0; k < r->tp; k++) {
        RunnerShard *s = &r->shards[k];
        s->index = k;
        s->runner = r;
        const int device = cfg->backend == OPS_BACKEND_CUDA ? cfg->device + k : cfg->device;
        if (ops_create_with_settings(&s->ops, cfg->backend, device, &cfg->ops, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "cannot start the %s backend for tensor-parallel shard %d (device %d): %s",
                     cfg->backend == OPS_BACKEND_CUDA ? "cuda" : "cpu", k, device, msg);
            return ENGINE_EINTERNAL;
        }
        const int fit = check_weights_fit(&mc, r->tp, s->ops, device, err, err_len);
        if (fit != 0) return fit;
        if (model_init_shard(&s->m, &mc, k, r->tp, s->ops, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "tensor-parallel shard %d: %s", k, msg);
            return ENGINE_EINVAL;
        }
        s->have_model = 1;
        if (resident_alloc(&s->w, &s->m, 0, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "tensor-parallel shard %d (device %d): %s (this model needs more tensor-parallel "
                     "shards, or GPUs with more memory)", k, device, msg);
            return ENGINE_ENOMEM;
        }
        s->have_weights = 1;
        s->src = resident_source(&s->w);
        models[k] = &s->m;
        weights[k] = &s->w;
    }
    r->ops = r->shards[0].ops;
    if (model_init(&r->whole, &mc, r->ops, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "%s", msg);
        return ENGINE_ENOMEM;
    }
    r->have_whole = 1;
    if (model_load_shard_weights(&r->whole, models, weights, r->tp, cfg->model_dir, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "cannot load the model from %s: %s", cfg->model_dir, msg);
        return ENGINE_EINVAL;
    }
    return 0;
}

int runner_create(ModelRunner **out, const EngineConfig *cfg, char *err, size_t err_len) {
    *out = NULL;
    const int tp = cfg->tensor_parallel_size > 0 ? cfg->tensor_parallel_size : 1;
    if (tp > 64) return snprintf(err, err_len, "--tensor-parallel-size %d: at most 64 shards", tp), ENGINE_EINVAL;
    ModelRunner *r = calloc(1, sizeof *r);
    if (!r || !(r->shards = calloc((size_t)tp, sizeof *r->shards))) {
        free(r);
        return snprintf(err, err_len, "out of memory"), ENGINE_ENOMEM;
    }
    r->tp = tp;
    r->comm_backend = cfg->backend == OPS_BACKEND_CUDA ? COMM_BACKEND_NCCL : COMM_BACKEND_HOST;
    r->block_size = cfg->block_size;
    r->max_num_seqs = cfg->max_num_seqs;
    r->max_num_batched_tokens = cfg->max_num_batched_tokens;
    char msg[768];
    int rc = ENGINE_EINTERNAL;
    if (tp == 1) {
        RunnerShard *s = &r->shards[0];
        if (ops_create_with_settings(&s->ops, cfg->backend, cfg->device, &cfg->ops, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "cannot start the %s backend: %s", cfg->backend == OPS_BACKEND_CUDA ? "cuda" : "cpu",
                     msg);
            goto fail;
        }
        r->ops = s->ops;
        ModelConfig mc;
        if (config_load(&mc, cfg->model_dir, msg, sizeof msg) == 0 &&
            (rc = check_weights_fit(&mc, 1, s->ops, cfg->device, err, err_len)) != 0)
            goto fail;
        rc = ENGINE_EINTERNAL;
        if (model_load(&s->m, &s->w, s->ops, cfg->model_dir, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "cannot load the model from %s: %s", cfg->model_dir, msg);
            rc = ENGINE_EINVAL;
            goto fail;
        }
        s->have_model = s->have_weights = 1;
        s->src = resident_source(&s->w);
    } else if ((rc = load_shards(r, cfg, err, err_len)) != 0) {
        goto fail;
    }
    const Model *whole = runner_model(r);
    r->V = whole->cfg.vocab_size;
    // Step workspace first, so that --gpu-memory-utilization sees what it takes.
    r->max_blocks = (whole->cfg.max_seq_len + cfg->block_size - 1) / cfg->block_size;
    for (int k = 0; k < tp; k++) {
        RunnerShard *s = &r->shards[k];
        if (decode_bufs_create(&s->bufs, &s->m, cfg->max_num_batched_tokens, cfg->max_num_seqs, r->max_blocks,
                               cfg->max_num_seqs, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "%s (lower --max-num-batched-tokens or --max-num-seqs)", msg);
            rc = ENGINE_ENOMEM;
            goto fail;
        }
    }
    if ((rc = set_up_padded(r, cfg, err, err_len)) != 0 || (rc = size_kv_pool(r, cfg, err, err_len)) != 0) goto fail;
    const size_t T = (size_t)cfg->max_num_batched_tokens, S = (size_t)cfg->max_num_seqs;
    r->tok_ids = malloc(T * sizeof *r->tok_ids);
    r->tok_seq = malloc(T * sizeof *r->tok_seq);
    r->tok_pos = malloc(T * sizeof *r->tok_pos);
    r->slots = malloc(T * sizeof *r->slots);
    r->tables = malloc(S * r->max_blocks * sizeof *r->tables);
    r->rows = malloc(S * sizeof *r->rows);
    r->score_rows = malloc(T * sizeof *r->score_rows);
    r->score_seq = malloc(T * sizeof *r->score_seq);
    r->score_pos = malloc(T * sizeof *r->score_pos);
    r->logits = malloc(S * r->V * sizeof *r->logits);
    r->dstaging = calloc((size_t)whole->layout.n_units, sizeof *r->dstaging);
    if (!r->tok_ids || !r->tok_seq || !r->tok_pos || !r->slots || !r->tables || !r->rows || !r->logits ||
        !r->score_rows || !r->score_seq || !r->score_pos ||
        !r->dstaging || samp_reserve(r, cfg->max_num_seqs, 0, 0) != 0) {
        snprintf(err, err_len, "out of host memory setting up the engine");
        rc = ENGINE_ENOMEM;
        goto fail;
    }
    if ((rc = runner_shards_start(r, err, err_len)) != 0) goto fail;
    if (decode_bufs_graphs_on(r->shards[0].bufs)) record_decode_graphs(r, decode_bufs_padded_max(r->shards[0].bufs));
    *out = r;
    return 0;
fail:
    runner_free(r);
    return rc;
}
