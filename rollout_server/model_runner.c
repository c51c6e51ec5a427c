// rollout_server/model_runner.c — the device side of the engine's steps (model_runner.h): set-up (context,
// model, step workspace, decode graphs, KV pool), one step (step arrays, graph or eager, sampling on the device,
// top logprobs on the host) and the weights' device copies.
#include "rollout_server/model_runner.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout_server/sampler.h"

struct ModelRunner {
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    int have_model;
    UnitSource src;
    KVCache kv;
    DecodeBufs *bufs;
    void **dstaging;                // (n_units) transport nccl: second copies in backend memory (storage dtype)
    int block_size, max_num_seqs, max_num_batched_tokens, max_blocks, n_blocks, V;
    // Step arrays (host): one entry per token of the step, max_num_batched_tokens of them ...
    int32_t *tok_ids, *tok_seq, *tok_pos, *slots;
    int32_t *tables;                // (max_num_seqs, max_blocks) room for the block tables of the step's sequences,
                                    // filled as (n_seqs, the step's longest table)
    int32_t *rows;                  // (max_num_seqs) step token index of each logits row
    float *logits;                  // (max_num_seqs, V) host copies of the logits rows that top logprobs need
    // Sampling: one entry per sample. Arrays grow on demand: samp_cap samples, hist_cap history ids, mask_cap mask
    // ids.
    int samp_cap, hist_cap, mask_cap;
    OpsSampleParams *samp_params;   // (samp_cap) host
    int32_t *samp_off;              // (samp_cap + 1) host: history offsets (histories of penalised samples only)
    int32_t *samp_hist;             // (hist_cap) host
    int32_t *samp_mask;             // (mask_cap) host: the masked samples' ids one after the other ...
    int samp_n_mask;                // ... this many for the step
    int32_t *samp_tok;              // (samp_cap) host: sampled ids
    float *samp_lp;                 // (samp_cap) host: their logprobs
    TokenLogprob *samp_top;         // (samp_cap, ENGINE_MAX_TOP_LOGPROBS) host: alternatives
    OpsSampleParams *d_params;      // backend copies of the above
    int32_t *d_off, *d_hist, *d_tok, *d_mask;
    float *d_lp;
    int64_t graph_logged;           // decode graph recordings + failures already logged (log_graphs)
};

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

const Model *runner_model(const ModelRunner *r) { return &r->m; }
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
    const void *logits = decode_bufs_logits(r->bufs);
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
    decode_bufs_graph_stats(r->bufs, &g);
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
    for (int i = 0; i < n_seqs; i++) {
        const RunnerSeq *q = &seqs[i];
        for (int t = 0; t < q->n_sched; t++, n++) {
            const int pos = q->n_computed + t;
            r->tok_ids[n] = q->tokens[pos];
            r->tok_seq[n] = i;
            r->tok_pos[n] = pos;
            r->slots[n] = q->blocks[pos / bs] * bs + pos % bs;
        }
        int32_t *tab = r->tables + (size_t)i * *mb;
        memcpy(tab, q->blocks, (size_t)q->n_blocks * sizeof *tab);
        for (int j = q->n_blocks; j < *mb; j++) tab[j] = -1;
        if (q->n_samples > 0) r->rows[(*n_rows)++] = n - 1;
    }
    return n;
}

// The model over the step's tokens, logits left in backend memory for the sampling op. Decode-only steps run at a
// padded batch size (a CUDA graph replay where one is recorded); the others run unpadded. *kind says which ran.
// Returns 0 or -1 with a message.
static int run_model(ModelRunner *r, int n, int n_seqs, int mb, int n_rows, int *kind, char *err, size_t err_len) {
    // Decode-only: one token per sequence, each its sequence's last (so token i is sequence i's and logits row i).
    const int decode_only = n == n_seqs && n_rows == n;
    *kind = decode_only ? ENGINE_STEP_DECODE_EAGER : ENGINE_STEP_PREFILL;
    if (decode_only && decode_bufs_padded_size(r->bufs, n) > 0) {
        DecodeGraphStats before, after;
        decode_bufs_graph_stats(r->bufs, &before);
        const int rc = model_decode_step_padded(&r->m, r->bufs, &r->src, &r->kv, n, r->tok_ids, r->tok_pos, r->slots,
                                                r->tables, mb, NULL, err, err_len);
        decode_bufs_graph_stats(r->bufs, &after);
        if (after.replays > before.replays) *kind = ENGINE_STEP_DECODE_GRAPH;
        log_graphs(r);
        return rc != 0 ? -1 : 0;
    }
    // Prefill steps meet a new token count almost every time: their GEMMs take cuBLASLt's first pick instead of
    // being timed on the spot (which cost a 0.5B prefill step ~55 ms on an H100).
    const int tuning = ops_set_gemm_tuning(r->ops, 0);
    const int rc = model_decode_step(&r->m, r->bufs, &r->src, &r->kv, n, r->tok_ids, r->tok_seq, r->tok_pos, r->slots,
                                     r->tables, n_seqs, mb, r->rows, n_rows, NULL, err, err_len);
    ops_set_gemm_tuning(r->ops, tuning);
    return rc != 0 ? -1 : 0;
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
    int failed = run_model(r, n, n_seqs, mb, n_rows, &out->kind, err, err_len) != 0;
    failed = failed || (n_rows > 0 && sample_step(r, samples, n_samples, n_rows, err, err_len) != 0);
    if (!failed && n_rows == 0) { // nothing to sample: still wait for the step, and see it succeeded
        ops_synchronize(r->ops);
        if ((failed = ops_status(r->ops) != 0)) snprintf(err, err_len, "decode step failed: %s", ops_error(r->ops));
    }
    out->compute_seconds = now_seconds() - t0;
    if (failed) {
        ops_clear_error(r->ops);
        return -1;
    }
    out->tokens = r->samp_tok;
    out->logprobs = r->samp_lp;
    out->top = r->samp_top;
    return 0;
}

void runner_copy_kv_rows(void *user, int32_t dst, int32_t src, int rows) {
    ModelRunner *r = user;
    const size_t token_bytes = (size_t)r->m.cfg.num_kv_heads * r->m.cfg.head_dim * ops_dtype_size(r->ops);
    const size_t blk = (size_t)r->block_size * token_bytes, bytes = (size_t)rows * token_bytes;
    for (int l = 0; l < r->kv.n_layers; l++) {
        ops_copy(r->ops, (char *)r->kv.k[l] + dst * blk, (char *)r->kv.k[l] + src * blk, bytes);
        ops_copy(r->ops, (char *)r->kv.v[l] + dst * blk, (char *)r->kv.v[l] + src * blk, bytes);
    }
}

// ---- weights ------------------------------------------------------------------------------------

int runner_upload_weights(ModelRunner *r, float *const *units, char *err, size_t err_len) {
    const Layout *L = &r->m.layout;
    for (int u = 0; u < L->n_units; u++)
        if (units[u]) ops_upload_f32(r->ops, r->w.params[u], units[u], L->unit_numel[u]);
    ops_synchronize(r->ops);
    if (ops_status(r->ops)) {
        snprintf(err, err_len, "uploading the new weights failed (the weights may be partly updated): %s",
                 ops_error(r->ops));
        ops_clear_error(r->ops);
        return -1;
    }
    return 0;
}

void *runner_weights_device_staging(ModelRunner *r, int unit) {
    if (unit < 0 || unit >= r->m.layout.n_units) return NULL;
    if (!r->dstaging[unit]) {
        r->dstaging[unit] = ops_malloc(r->ops, r->m.layout.unit_numel[unit] * ops_dtype_size(r->ops));
        if (!r->dstaging[unit]) ops_clear_error(r->ops); // the caller reports the missing memory
    }
    return r->dstaging[unit];
}

int runner_weights_device_missing(const ModelRunner *r) {
    for (int u = 0; u < r->m.layout.n_units; u++)
        if (!r->dstaging[u]) return u;
    return -1;
}

int runner_swap_device_weights(ModelRunner *r, char *err, size_t err_len) {
    for (int u = 0; u < r->m.layout.n_units; u++) {
        void *live = r->w.params[u];
        r->w.params[u] = r->dstaging[u];
        r->dstaging[u] = live;
    }
    ops_synchronize(r->ops);
    if (ops_status(r->ops)) {
        snprintf(err, err_len, "uploading the new weights failed (the weights may be partly updated): %s",
                 ops_error(r->ops));
        ops_clear_error(r->ops);
        return -1;
    }
    return 0;
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
        if (model_decode_step_padded(&r->m, r->bufs, &r->src, &r->kv, ladder[k], r->tok_ids, r->tok_pos, r->slots,
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
    decode_bufs_graph_stats(r->bufs, &g);
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
    const int top = decode_bufs_enable_padded(r->bufs, &r->m, cfg->cuda_graph_max_batch, !cfg->enforce_eager, msg,
                                              sizeof msg);
    if (top < 0) {
        snprintf(err, err_len, "%s (lower --cuda-graph-max-batch)", msg);
        return ENGINE_ENOMEM;
    }
    int ladder[64];
    const int n_ladder = decode_ladder(top, ladder, 64);
    char sizes[512];
    size_t used = 0;
    for (int i = 0; i < n_ladder && used < sizeof sizes; i++)
        used += (size_t)snprintf(sizes + used, sizeof sizes - used, "%s%d", i ? ", " : "", ladder[i]);
    fprintf(stderr, "tandem-serve: decode-only steps of up to %d sequences are padded to batch sizes %s and %s\n", top,
            sizes,
            decode_bufs_graphs_on(r->bufs) ? "replayed as CUDA graphs (recorded now)"
            : cfg->enforce_eager           ? "run eagerly (--enforce-eager)"
                                           : "run eagerly (CUDA graphs are off while profile_ops times each op)");
    return 0;
}

// The KV pool: as many blocks as the memory budget holds. Each step writes up to max_num_batched_tokens tokens (or
// a whole context, if shorter), so a pool smaller than that is a configuration mistake. Returns 0 or an ENGINE_*
// code with a message.
static int size_kv_pool(ModelRunner *r, const EngineConfig *cfg, char *err, size_t err_len) {
    const char *budget_flag = "--kv-cache-memory";
    size_t kv_bytes = cfg->kv_cache_bytes;
    if (cfg->gpu_memory_utilization > 0) {
        size_t free_b, total_b;
        if (ops_memory_info(r->ops, &free_b, &total_b) != 0) {
            snprintf(err, err_len, "--gpu-memory-utilization needs a CUDA device (this engine runs on the %s); use "
                     "--kv-cache-memory", cfg->backend == OPS_BACKEND_CUDA ? "GPU but its memory cannot be read" : "CPU");
            ops_clear_error(r->ops);
            return ENGINE_EINVAL;
        }
        // Everything in use now (our weights and workspace, other processes) counts against the fraction; the rest
        // goes to the KV pool, less the NCCL weight copy and a margin for the sampler, cuBLAS and NCCL.
        const size_t weights = r->m.layout.n_params * ops_dtype_size(r->ops);
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
    const int bs = cfg->block_size, max_len = r->m.cfg.max_seq_len;
    const size_t per_block = kv_cache_bytes_per_block(&r->m, bs);
    const size_t n_blocks = kv_bytes / per_block;
    const int step_tokens = cfg->max_num_batched_tokens < max_len ? cfg->max_num_batched_tokens : max_len;
    const size_t min_blocks = ((size_t)step_tokens + bs - 1) / bs;
    if (n_blocks < min_blocks || n_blocks > INT32_MAX / (size_t)bs) {
        snprintf(err, err_len, "the KV pool (%s) of %zu bytes holds %zu KV blocks of %d tokens (%zu bytes each), but "
                 "one step of %d tokens needs %zu (%zu bytes): raise %s or lower --max-num-batched-tokens",
                 budget_flag, kv_bytes, n_blocks, bs, per_block, step_tokens, min_blocks, min_blocks * per_block,
                 budget_flag);
        return ENGINE_EINVAL;
    }
    r->n_blocks = (int)n_blocks;
    char msg[512];
    if (kv_cache_create(&r->kv, &r->m, r->n_blocks, bs, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "%s (lower %s)", msg, budget_flag);
        return ENGINE_ENOMEM;
    }
    return 0;
}

void runner_free(ModelRunner *r) {
    if (!r) return;
    if (r->dstaging) {
        for (int u = 0; u < r->m.layout.n_units; u++) ops_free(r->ops, r->dstaging[u]);
        free(r->dstaging);
    }
    free(r->tok_ids);
    free(r->tok_seq);
    free(r->tok_pos);
    free(r->slots);
    free(r->tables);
    free(r->rows);
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
    if (r->bufs) decode_bufs_free(r->bufs, &r->m);
    if (r->kv.k) kv_cache_free(&r->kv, &r->m);
    if (r->have_model) {
        resident_free(&r->w, &r->m);
        model_free(&r->m);
    }
    if (r->ops) ops_destroy(r->ops);
    free(r);
}

int runner_create(ModelRunner **out, const EngineConfig *cfg, char *err, size_t err_len) {
    *out = NULL;
    ModelRunner *r = calloc(1, sizeof *r);
    if (!r) return snprintf(err, err_len, "out of memory"), ENGINE_ENOMEM;
    r->block_size = cfg->block_size;
    r->max_num_seqs = cfg->max_num_seqs;
    r->max_num_batched_tokens = cfg->max_num_batched_tokens;
    char msg[768];
    int rc = ENGINE_EINTERNAL;
    if (ops_create_with_settings(&r->ops, cfg->backend, cfg->device, &cfg->ops, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "cannot start the %s backend: %s", cfg->backend == OPS_BACKEND_CUDA ? "cuda" : "cpu", msg);
        goto fail;
    }
    if (model_load(&r->m, &r->w, r->ops, cfg->model_dir, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "cannot load the model from %s: %s", cfg->model_dir, msg);
        rc = ENGINE_EINVAL;
        goto fail;
    }
    r->have_model = 1;
    r->src = resident_source(&r->w);
    r->V = r->m.cfg.vocab_size;
    // Step workspace first, so that --gpu-memory-utilization sees what it takes.
    r->max_blocks = (r->m.cfg.max_seq_len + cfg->block_size - 1) / cfg->block_size;
    if (decode_bufs_create(&r->bufs, &r->m, cfg->max_num_batched_tokens, cfg->max_num_seqs, r->max_blocks,
                           cfg->max_num_seqs, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "%s (lower --max-num-batched-tokens or --max-num-seqs)", msg);
        rc = ENGINE_ENOMEM;
        goto fail;
    }
    if ((rc = set_up_padded(r, cfg, err, err_len)) != 0 || (rc = size_kv_pool(r, cfg, err, err_len)) != 0) goto fail;
    const size_t T = (size_t)cfg->max_num_batched_tokens, S = (size_t)cfg->max_num_seqs;
    r->tok_ids = malloc(T * sizeof *r->tok_ids);
    r->tok_seq = malloc(T * sizeof *r->tok_seq);
    r->tok_pos = malloc(T * sizeof *r->tok_pos);
    r->slots = malloc(T * sizeof *r->slots);
    r->tables = malloc(S * r->max_blocks * sizeof *r->tables);
    r->rows = malloc(S * sizeof *r->rows);
    r->logits = malloc(S * r->V * sizeof *r->logits);
    r->dstaging = calloc((size_t)r->m.layout.n_units, sizeof *r->dstaging);
    if (!r->tok_ids || !r->tok_seq || !r->tok_pos || !r->slots || !r->tables || !r->rows || !r->logits ||
        !r->dstaging || samp_reserve(r, cfg->max_num_seqs, 0, 0) != 0) {
        snprintf(err, err_len, "out of host memory setting up the engine");
        rc = ENGINE_ENOMEM;
        goto fail;
    }
    if (decode_bufs_graphs_on(r->bufs)) record_decode_graphs(r, decode_bufs_padded_max(r->bufs));
    *out = r;
    return 0;
fail:
    runner_free(r);
    return rc;
}
