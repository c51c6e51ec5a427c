// rollout_server/model_runner.c — the device side of the engine's steps (model_runner.h): one step (step arrays,
// graph or eager, sampling on the device, top logprobs on the host, prompt scoring) and the weights' device copies.
// Set-up and tear-down: model_runner_setup.c; the tensor-parallel shards' threads: runner_shards.c.
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
int runner_samp_reserve(ModelRunner *r, int n, int64_t nh, int64_t nm) {
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
    if (runner_samp_reserve(r, n, nh, nm) != 0) return -1;
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
    // LoRA adapter rows: a padded step (and its graph) runs one adapter over all its rows; a step of several
    // adapters, or of adapter and base rows, runs unpadded.
    const int ranges = runner_adapter_ranges(r, r->step_seqs, n_seqs);
    const int one_adapter = ranges == 0 || (ranges == 1 && r->lora_rows.ranges[0].rows == n);
    r->plan = (RunnerStepPlan){.n = n, .n_seqs = n_seqs, .mb = mb, .n_rows = n_rows,
                               .padded = decode_only && one_adapter && decode_bufs_padded_size(lead, n) > 0};
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

// One shard's unit from host memory in the storage dtype: bf16 bits copied as they are, or fp32 values.
static void upload_unit(RunnerShard *s, int u, const void *host) {
    const size_t n = s->m.layout.unit_numel[u];
    if (ops_dtype_size(s->ops) == 2) ops_copy_to_device(s->ops, s->w.params[u], host, n * 2);
    else ops_upload_f32(s->ops, s->w.params[u], host, n);
}

int runner_upload_weights(ModelRunner *r, void *const *units, char *err, size_t err_len) {
    const Layout *L = &runner_model(r)->layout;
    const size_t es = ops_dtype_size(r->ops);
    void *slice = NULL;
    if (r->tp > 1) {
        size_t most = 0;
        for (int k = 0; k < r->tp; k++)
            if (r->shards[k].m.layout.max_unit_numel > most) most = r->shards[k].m.layout.max_unit_numel;
        if (!(slice = malloc(most * es)))
            return snprintf(err, err_len, "out of host memory slicing the new weights"), -1;
    }
    for (int u = 0; u < L->n_units; u++) {
        if (!units[u]) continue;
        for (int k = 0; k < r->tp; k++) {
            RunnerShard *s = &r->shards[k];
            if (r->tp == 1) {
                upload_unit(s, u, units[u]);
                continue;
            }
            model_shard_unit(&r->whole, &s->m, u, units[u], slice, es);
            upload_unit(s, u, slice);
            ops_synchronize(s->ops);   // slice is reused for the next shard
        }
    }
    free(slice);
    return shards_synchronize(r, "uploading the new weights", err, err_len);
}

int runner_tp(const ModelRunner *r) { return r->tp; }

const Model *runner_shard_model(const ModelRunner *r, int shard) { return &r->shards[shard].m; }

OpsCtx *runner_shard_ops(ModelRunner *r, int shard) { return r->shards[shard].ops; }

void *runner_weights_device_staging(ModelRunner *r, int shard, int unit) {
    if (shard < 0 || shard >= r->tp) return NULL;
    RunnerShard *s = &r->shards[shard];
    if (unit < 0 || unit >= s->m.layout.n_units) return NULL;
    // Zero-filled: the parts an update sends never cover the alignment gaps or the vocabulary padding rows, which
    // stay zero across swaps (the live copy that becomes the next staging was loaded with them zero).
    if (!s->dstaging[unit] && !(s->dstaging[unit] = ops_malloc(s->ops, s->m.layout.unit_numel[unit] *
                                                                         ops_dtype_size(s->ops))))
        ops_clear_error(s->ops);   // the caller reports the missing memory
    return s->dstaging[unit];
}

int runner_weights_device_missing(const ModelRunner *r, int *shard) {
    for (int k = 0; k < r->tp; k++)
        for (int u = 0; u < r->shards[k].m.layout.n_units; u++)
            if (!r->shards[k].dstaging[u]) return *shard = k, u;
    return -1;
}

int runner_swap_device_weights(ModelRunner *r, char *err, size_t err_len) {
    // The engine thread calls this between steps, so no step reads the weights meanwhile.
    if (shards_synchronize(r, "finishing the step before the weight swap", err, err_len) != 0) return -1;
    for (int k = 0; k < r->tp; k++) {
        RunnerShard *s = &r->shards[k];
        for (int u = 0; u < s->m.layout.n_units; u++) {
            void *live = s->w.params[u];
            s->w.params[u] = s->dstaging[u];
            s->dstaging[u] = live;
        }
    }
    return shards_synchronize(r, "uploading the new weights", err, err_len);
}

