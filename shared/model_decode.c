// shared/model_decode.c — inference forward through a paged KV cache (prefill chunks and decodes in one step),
// decode-only steps padded to a ladder of batch sizes and replayed as CUDA graphs, and greedy generation over a
// contiguous cache (the rollout server brings the block manager and sampler).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/comm/comm.h"
#include "shared/model_internal.h"

// Rungs of the padded-batch ladder (decode_ladder): ~2 per doubling up to 2^20 fits well within this.
#define DECODE_LADDER_MAX 48
// Graphs kept per rung, for different pointers: the NCCL weight update alternates between two buffer sets, so with
// two slots the steady state replays without recording again after each update.
#define DECODE_GRAPH_SLOTS 2
// Failed recordings of a rung before it stops trying (a recording can fail for a reason that passes: another
// thread's call on the same device may invalidate it).
#define DECODE_GRAPH_TRIES 3
// Padded steps of at most this many rows run layer_decode_small (fused projections; kernels/cuda/cuda_gemv.cu takes
// one or two rows).
#define DECODE_SMALL_ROWS 2

// One graph of a padded batch size, and what it froze in: every parameter unit's pointer, each layer's KV pools,
// the rotary table and the cache's block size (a replay with other ones would read the old memory).
typedef struct {
    OpsGraph *g;
    const void **key;           // (n_key)
    int block_size;
    uint64_t used;              // step clock of its last use (the least recently used slot is recorded over)
} DecodeGraph;

typedef struct {
    DecodeGraph slot[DECODE_GRAPH_SLOTS];
    int failures;               // DECODE_GRAPH_TRIES of them: this size runs eagerly from now on
} DecodeRung;

struct DecodeBufs {
    int max_tokens, max_seqs, max_blocks, max_logit_rows;
    LayerActs acts;
    void *acts_block;
    void *x[2];                 // (N, C) ping-pong residual stream
    void *rows, *rows_normed;   // (max_logit_rows, C)
    void *logits;               // (max_logit_rows, V), V the whole model's (m->shard.vocab_total)
    void *logits_shard;         // tensor-parallel shards: (max_logit_rows, Vs) this shard's vocabulary columns
    void *logits_gathered;      //   and (shards, max_logit_rows, Vs) every shard's, in rank order; NULL at size 1
    int32_t *tokens, *token_seq, *token_pos, *slot_mapping; // (N) backend memory
    int32_t *block_tables;      // (max_seqs + 1, max_blocks) backend memory; row max_seqs stays 0 (padding rows)
    int32_t *tables_stage;      // (max_seqs * max_blocks) backend memory: narrower host tables land here first
    const void *last_x;         // the last model_decode_step's final hidden states (N, C), for model_decode_more_logits
    int last_n;                 //   and its N (0: none, or a padded step ran since)
    // Padded decode-only steps (model_decode_step_padded); n_ladder 0 = not set up.
    int ladder[DECODE_LADDER_MAX], n_ladder; // ascending padded batch sizes
    int use_graphs;
    int32_t *vote;              // tensor-parallel shards with graphs: (2 + shards) backend memory, the constants
                                // 0 and 1, then every shard's say on a recording (shards_keep_recording)
    int32_t *pad_ids;           // (4, P) backend memory, P = the top rung: tokens | token_seq | token_pos | slots
    int32_t *pad_host;          // (4, P) host staging of the same
    const void **units;         // (n_units) the step's acquired parameters
    const void **key;           // (n_key) the step's graph key (DecodeGraph.key)
    int n_units, n_key;
    DecodeRung rungs[DECODE_LADDER_MAX];
    uint64_t clock;             // padded steps run so far
    DecodeGraphStats stats;
};

size_t kv_cache_bytes_per_block(const Model *m, int block_size) {
    return 2 * (size_t)m->cfg.num_layers * block_size * m->cfg.num_kv_heads * m->cfg.head_dim * ops_dtype_size(m->ops);
}

int kv_cache_create(KVCache *kv, const Model *m, int n_blocks, int block_size, char *err, size_t err_len) {
    memset(kv, 0, sizeof *kv);
    kv->n_layers = m->cfg.num_layers;
    kv->n_blocks = n_blocks;
    kv->block_size = block_size;
    kv->k = calloc((size_t)kv->n_layers, sizeof(void *));
    kv->v = calloc((size_t)kv->n_layers, sizeof(void *));
    size_t bytes = (size_t)n_blocks * block_size * m->cfg.num_kv_heads * m->cfg.head_dim * ops_dtype_size(m->ops);
    if (!kv->k || !kv->v) goto oom;
    for (int l = 0; l < kv->n_layers; l++) {
        kv->k[l] = ops_malloc(m->ops, bytes);
        kv->v[l] = ops_malloc(m->ops, bytes);
        if (!kv->k[l] || !kv->v[l]) goto oom;
    }
    return 0;
oom:
    snprintf(err, err_len, "out of memory for a KV cache of %d blocks x %d tokens: %s", n_blocks, block_size,
             ops_error(m->ops));
    kv_cache_free(kv, m);
    return -1;
}

void kv_cache_free(KVCache *kv, const Model *m) {
    for (int l = 0; l < kv->n_layers; l++) {
        if (kv->k) ops_free(m->ops, kv->k[l]);
        if (kv->v) ops_free(m->ops, kv->v[l]);
    }
    free(kv->k);
    free(kv->v);
    memset(kv, 0, sizeof *kv);
}

int decode_bufs_create(DecodeBufs **out, const Model *m, int max_tokens, int max_seqs, int max_blocks,
                       int max_logit_rows, char *err, size_t err_len) {
    OpsCtx *o = m->ops;
    const size_t es = ops_dtype_size(o), N = (size_t)max_tokens, C = m->cfg.hidden_size, V = m->shard.vocab_total;
    DecodeBufs *b = calloc(1, sizeof *b);
    *out = NULL;
    if (!b) goto oom;
    b->max_tokens = max_tokens;
    b->max_seqs = max_seqs;
    b->max_blocks = max_blocks;
    b->max_logit_rows = max_logit_rows;
    if (layer_acts_alloc(m, &b->acts, max_tokens, LAYER_ACTS_INFERENCE, &b->acts_block) != 0) goto oom;
    b->x[0] = ops_malloc(o, N * C * es);
    b->x[1] = ops_malloc(o, N * C * es);
    b->rows = ops_malloc(o, (size_t)max_logit_rows * C * es);
    b->rows_normed = ops_malloc(o, (size_t)max_logit_rows * C * es);
    b->logits = ops_malloc(o, (size_t)max_logit_rows * V * es);
    if (m->shard.size > 1) {
        const size_t Vs = (size_t)m->cfg.vocab_size;
        b->logits_shard = ops_malloc(o, (size_t)max_logit_rows * Vs * es);
        b->logits_gathered = ops_malloc(o, (size_t)m->shard.size * max_logit_rows * Vs * es);
    }
    b->tokens = ops_malloc(o, N * 4);
    b->token_seq = ops_malloc(o, N * 4);
    b->token_pos = ops_malloc(o, N * 4);
    b->slot_mapping = ops_malloc(o, N * 4);
    b->block_tables = ops_malloc(o, ((size_t)max_seqs + 1) * max_blocks * 4);
    b->tables_stage = ops_malloc(o, (size_t)max_seqs * max_blocks * 4);
    if (ops_status(o)) goto oom;
    *out = b;
    return 0;
oom:
    snprintf(err, err_len, "out of memory for decode buffers (%d tokens): %s", max_tokens, ops_error(o));
    decode_bufs_free(b, m);
    return -1;
}

const void *decode_bufs_logits(const DecodeBufs *b) { return b->logits; }

static void padded_free(DecodeBufs *b, const Model *m) {
    for (int r = 0; r < DECODE_LADDER_MAX; r++)
        for (int k = 0; k < DECODE_GRAPH_SLOTS; k++) {
            ops_graph_destroy(m->ops, b->rungs[r].slot[k].g);
            free(b->rungs[r].slot[k].key);
        }
    memset(b->rungs, 0, sizeof b->rungs);
    ops_free(m->ops, b->pad_ids);
    ops_free(m->ops, b->vote);
    b->vote = NULL;
    free(b->pad_host);
    free(b->units);
    free(b->key);
    b->pad_ids = b->pad_host = NULL;
    b->units = b->key = NULL;
    b->n_ladder = 0;
    b->use_graphs = 0;
}

void decode_bufs_free(DecodeBufs *b, const Model *m) {
    if (!b) return;
    OpsCtx *o = m->ops;
    padded_free(b, m);
    ops_free(o, b->acts_block);
    ops_free(o, b->x[0]);
    ops_free(o, b->x[1]);
    ops_free(o, b->rows);
    ops_free(o, b->rows_normed);
    ops_free(o, b->logits);
    ops_free(o, b->logits_shard);
    ops_free(o, b->logits_gathered);
    ops_free(o, b->tokens);
    ops_free(o, b->token_seq);
    ops_free(o, b->token_pos);
    ops_free(o, b->slot_mapping);
    ops_free(o, b->block_tables);
    ops_free(o, b->tables_stage);
    free(b);
}

// Rows 0..n-1 of the backend's block tables (rows of b->max_blocks entries) <- host rows of `width` entries
// (width <= max_blocks; the entries past width keep whatever they held, and no kernel reads them: a token reads
// the entries of its positions only, and those are below width). Full-width rows go over in one copy; narrower
// ones (the rollout engine sends only the blocks in use) land in a staging buffer and are spread by one strided
// device copy, so n * width entries cross the bus instead of n * max_blocks.
static void upload_tables(OpsCtx *o, DecodeBufs *b, const int32_t *tables, int n, int width) {
    const size_t es = ops_dtype_size(o);
    if (width == b->max_blocks) {
        ops_copy_to_device(o, b->block_tables, tables, (size_t)n * width * sizeof *tables);
    } else if (sizeof *tables % es == 0) { // ops_copy_2d counts storage elements: `per` of them make one entry
        const size_t per = sizeof *tables / es;
        ops_copy_to_device(o, b->tables_stage, tables, (size_t)n * width * sizeof *tables);
        ops_copy_2d(o, b->block_tables, (size_t)b->max_blocks * per, b->tables_stage, (size_t)width * per, (size_t)n,
                    (size_t)width * per);
    } else {
        for (int i = 0; i < n; i++)
            ops_copy_to_device(o, b->block_tables + (size_t)i * b->max_blocks, tables + (size_t)i * width,
                               (size_t)width * sizeof *tables);
    }
}

// x (N, C) = the embedding rows of tokens (backend memory). A tensor-parallel shard looks up the ids of its vocabulary
// rows and the shards add their rows up.
static void embed_tokens(Model *m, void *x, const int32_t *tokens, const void *unit0, int N) {
    const ModelShard *s = &m->shard;
    const int C = m->cfg.hidden_size;
    const void *table = elem_at(m, unit0, m->layout.embed);
    if (s->size == 1) {
        ops_embedding_fwd(m->ops, x, tokens, table, N, C, m->cfg.vocab_size);
        return;
    }
    ops_embedding_shard_fwd(m->ops, x, tokens, table, N, C, s->vocab_begin, m->cfg.vocab_size, s->vocab_total);
    model_shard_reduce(m, x, NULL, (size_t)N * C);
}

// b->logits (R, V) = rows_normed (R, C) W_lm^T. A tensor-parallel shard computes its vocabulary columns; every shard
// gathers all of them and lays them out as whole rows (the padding columns past V dropped), so that sampling and
// logprobs see the whole vocabulary.
static void lm_head_logits(Model *m, DecodeBufs *b, const void *rows_normed, const void *w_lm, int R) {
    OpsCtx *o = m->ops;
    ModelShard *s = &m->shard;
    const int C = m->cfg.hidden_size, Vs = m->cfg.vocab_size, V = s->vocab_total;
    if (s->size == 1) {
        ops_matmul_fwd_batch_invariant(o, b->logits, rows_normed, w_lm, NULL, R, C, V);
        return;
    }
    ops_matmul_fwd_batch_invariant(o, b->logits_shard, rows_normed, w_lm, NULL, R, C, Vs);
    model_shard_gather(m, b->logits_gathered, b->logits_shard, (size_t)R * Vs);
    for (int r = 0; r < s->size; r++) {
        const int cols = V - r * Vs < Vs ? V - r * Vs : Vs;
        if (cols > 0)
            ops_copy_2d(o, elem_at(m, b->logits, (size_t)r * Vs), (size_t)V,
                        elem_at(m, b->logits_gathered, (size_t)r * R * Vs), (size_t)Vs, (size_t)R, (size_t)cols);
    }
}

// The step's result when tensor-parallel collectives ran: 0, or -1 with a message when one of them failed.
static int shard_step_status(Model *m, char *err, size_t err_len) {
    if (!m->shard.failed) return 0;
    m->shard.failed = 0;
    snprintf(err, err_len, "a tensor-parallel collective between the model's %d shards failed (shard %d): %s",
             m->shard.size, m->shard.rank, comm_error(m->shard.comm));
    return -1;
}

// b->logits (n_rows, V) = lm_head(final_norm(x[rows])) for token rows of x (N, C); also host fp32 into logits when
// not NULL. Returns 0 or -1 with a message (bad row, parameters unavailable).
static int rows_logits(Model *m, DecodeBufs *b, UnitSource *src, const void *x, int N, const int32_t *rows,
                       int n_rows, float *logits, char *err, size_t err_len) {
    OpsCtx *o = m->ops;
    const int C = m->cfg.hidden_size;
    const size_t es = ops_dtype_size(o);
    for (int r = 0; r < n_rows; r++) {
        if (rows[r] < 0 || rows[r] >= N) {
            snprintf(err, err_len, "logit row %d names token %d of a %d-token step", r, rows[r], N);
            return -1;
        }
        ops_copy(o, elem_at(m, b->rows, (size_t)r * C), elem_at(m, x, (size_t)rows[r] * C), C * es);
    }
    const int uf = layout_final_unit(&m->layout);
    const void *pf = src->acquire(src->user, uf), *p0 = NULL;
    if (!pf || (m->layout.lm_head == SIZE_MAX && !(p0 = src->acquire(src->user, 0)))) {
        snprintf(err, err_len, "decode step: model parameters unavailable: %s", ops_error(o));
        return -1;
    }
    ops_rmsnorm_fwd(o, b->rows_normed, NULL, b->rows, elem_at(m, pf, m->layout.final_norm), n_rows, C,
                    m->cfg.rms_norm_eps);
    const void *w_lm = p0 ? elem_at(m, p0, m->layout.embed) : elem_at(m, pf, m->layout.lm_head);
    lm_head_logits(m, b, b->rows_normed, w_lm, n_rows);
    if (logits) ops_download_f32(o, logits, b->logits, (size_t)n_rows * m->shard.vocab_total);
    if (p0 && src->release) src->release(src->user, 0);
    if (src->release) src->release(src->user, uf);
    return 0;
}

int model_decode_more_logits(Model *m, DecodeBufs *b, UnitSource *src, const int32_t *rows, int n_rows,
                             float *logits, char *err, size_t err_len) {
    if (b->last_n == 0 || n_rows < 1 || n_rows > b->max_logit_rows) {
        snprintf(err, err_len, "more logits: %d rows (at most %d) after %s", n_rows, b->max_logit_rows,
                 b->last_n ? "an unpadded step" : "no unpadded step");
        return -1;
    }
    if (rows_logits(m, b, src, b->last_x, b->last_n, rows, n_rows, logits, err, err_len) != 0) return -1;
    if (logits) ops_synchronize(m->ops);
    if (shard_step_status(m, err, err_len) != 0) return -1;
    if (ops_status(m->ops)) {
        snprintf(err, err_len, "more logits failed: %s", ops_error(m->ops));
        return -1;
    }
    return 0;
}

int model_decode_step(Model *m, DecodeBufs *b, UnitSource *src, KVCache *kv, int N, const int32_t *tokens,
                      const int32_t *token_seq, const int32_t *token_pos, const int32_t *slot_mapping,
                      const int32_t *block_tables, int n_seqs, int max_blocks, const int32_t *logit_rows,
                      int n_logit_rows, float *logits, char *err, size_t err_len) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const int C = cfg->hidden_size, V = m->shard.vocab_total;
    if (N < 1 || N > b->max_tokens || n_seqs < 1 || n_seqs > b->max_seqs || max_blocks < 1 ||
        max_blocks > b->max_blocks || n_logit_rows < 0 || n_logit_rows > b->max_logit_rows) {
        snprintf(err, err_len, "decode step of %d tokens / %d sequences / %d logit rows / block tables of %d exceeds "
                 "its buffers (%d / %d / %d / %d)", N, n_seqs, n_logit_rows, max_blocks, b->max_tokens, b->max_seqs,
                 b->max_logit_rows, b->max_blocks);
        return -1;
    }
    for (int i = 0; i < N; i++) {
        if (tokens[i] < 0 || tokens[i] >= V || token_seq[i] < 0 || token_seq[i] >= n_seqs || token_pos[i] < 0 ||
            token_pos[i] >= max_blocks * kv->block_size || slot_mapping[i] >= kv->n_blocks * kv->block_size) {
            snprintf(err, err_len, "decode token %d is out of range (id %d, sequence %d, position %d, slot %d)", i,
                     tokens[i], token_seq[i], token_pos[i], slot_mapping[i]);
            return -1;
        }
    }
    ops_copy_to_device(o, b->tokens, tokens, (size_t)N * 4);
    ops_copy_to_device(o, b->token_seq, token_seq, (size_t)N * 4);
    ops_copy_to_device(o, b->token_pos, token_pos, (size_t)N * 4);
    ops_copy_to_device(o, b->slot_mapping, slot_mapping, (size_t)N * 4);
    upload_tables(o, b, block_tables, n_seqs, max_blocks);

    const void *p = src->acquire(src->user, 0);
    if (!p) goto unavailable;
    embed_tokens(m, b->x[0], b->tokens, p, N);
    if (src->release) src->release(src->user, 0);
    AttnArgs att = {.paged = 1, .slot_mapping = b->slot_mapping, .block_tables = b->block_tables,
                    .token_seq = b->token_seq, .max_blocks = b->max_blocks, .block_size = kv->block_size,
                    .n_seqs = n_seqs};
    // The residual stream as in training: each layer adds the previous layer's attention half (pending = its
    // xmid) inside its first norm and leaves its MLP output in the other buffer (the same bits as add + norm).
    int cur = 0;
    const void *pending = NULL;
    for (int l = 0; l < cfg->num_layers; l++) {
        int u = layout_layer_unit(l);
        if (!(p = src->acquire(src->user, u))) goto unavailable;
        att.k_cache = kv->k[l];
        att.v_cache = kv->v[l];
        if (m->lora_rows) m->lora_rows->layer = l;
        layer_forward_fused(m, p, &b->acts, b->x[cur], pending, b->x[cur ^ 1], b->token_pos, N, &att);
        pending = b->acts.xmid;
        if (src->release) src->release(src->user, u);
        cur ^= 1;
    }
    if (pending) ops_add_inplace(o, b->x[cur], pending, (size_t)N * C);
    b->last_x = b->x[cur];
    b->last_n = N;
    if (n_logit_rows > 0 && rows_logits(m, b, src, b->x[cur], N, logit_rows, n_logit_rows, logits, err, err_len) != 0)
        return -1;
    // Logits left in backend memory: the caller's next op runs after this step on the same stream, so there is
    // nothing to wait for here (an asynchronous failure shows at the caller's next synchronization).
    if (logits) ops_synchronize(o);
    if (shard_step_status(m, err, err_len) != 0) return -1;
    if (ops_status(o)) {
        snprintf(err, err_len, "decode step failed: %s", ops_error(o));
        return -1;
    }
    return 0;
unavailable:
    snprintf(err, err_len, "decode step: model parameters unavailable: %s", ops_error(o));
    return -1;
}

// ---- decode-only steps: padded to a ladder of batch sizes, replayed as CUDA graphs ----------------

int decode_ladder(int cap, int *sizes, int max_sizes) {
    int n = 0;
    if (cap < 1 || max_sizes < 1) return 0;
    // 1, 2, 4, 8, then two rungs per doubling (16, 24, 32, 48, ...): padding wastes at most a third of a step.
    for (int s = 1; s < 16 && s < cap && n < max_sizes - 1; s *= 2) sizes[n++] = s;
    for (long p = 16; p < cap && n < max_sizes - 1; p *= 2) {
        sizes[n++] = (int)p;
        if (p * 3 / 2 < cap && n < max_sizes - 1) sizes[n++] = (int)(p * 3 / 2);
    }
    sizes[n++] = cap;  // the cap itself closes the ladder, so every batch up to it has a rung
    return n;
}

int decode_bufs_enable_padded(DecodeBufs *b, const Model *m, int max_batch, int use_graphs, char *err,
                              size_t err_len) {
    int limit = max_batch;
    if (limit > b->max_tokens) limit = b->max_tokens;
    if (limit > b->max_seqs) limit = b->max_seqs;
    if (limit > b->max_logit_rows) limit = b->max_logit_rows;
    if (limit > (1 << 20)) limit = 1 << 20;
    // Tensor-parallel shards record their collectives into the graphs too (shared/comm/comm.h, "CUDA graphs"), which
    // needs their communicator, joined before this, in NCCL's blocking mode.
    const int want_graphs = use_graphs && ops_graph_supported(m->ops) &&
                            (m->shard.size == 1 || comm_graph_capable(m->shard.comm));
    if (b->n_ladder > 0 && limit == b->ladder[b->n_ladder - 1]) {  // the same ladder: keep the graphs recorded
        b->use_graphs = want_graphs;
        return limit;
    }
    padded_free(b, m);
    if (limit < 1) return 0;
    const int n = decode_ladder(limit, b->ladder, DECODE_LADDER_MAX), P = b->ladder[n - 1];
    b->n_units = m->layout.n_units;
    // Units, each layer's K and V pools, the rotary table; then an adapter's units and its scratch (zeros without).
    b->n_key = b->n_units + 2 * m->cfg.num_layers + 1 + m->cfg.num_layers + 1;
    b->pad_ids = ops_malloc(m->ops, (size_t)4 * P * sizeof(int32_t));
    b->pad_host = malloc((size_t)4 * P * sizeof(int32_t));
    b->units = calloc((size_t)b->n_units, sizeof *b->units);
    b->key = calloc((size_t)b->n_key, sizeof *b->key);
    if (want_graphs && m->shard.size > 1 && (b->vote = ops_malloc(m->ops, (size_t)(2 + m->shard.size) * 4))) {
        const int32_t constants[2] = {0, 1};
        ops_copy_to_device(m->ops, b->vote, constants, sizeof constants);
    }
    int ok = b->pad_ids && b->pad_host && b->units && b->key && (!want_graphs || m->shard.size == 1 || b->vote);
    for (int r = 0; r < n; r++)
        for (int k = 0; k < DECODE_GRAPH_SLOTS && ok; k++)
            ok = (b->rungs[r].slot[k].key = calloc((size_t)b->n_key, sizeof(void *))) != NULL;
    if (!ok) {
        snprintf(err, err_len, "out of memory for padded decode steps of up to %d sequences: %s", P,
                 ops_status(m->ops) ? ops_error(m->ops) : "host memory");
        padded_free(b, m);
        return -1;
    }
    b->n_ladder = n;
    b->use_graphs = want_graphs;
    return P;
}

int decode_bufs_padded_max(const DecodeBufs *b) { return b->n_ladder > 0 ? b->ladder[b->n_ladder - 1] : 0; }

int decode_bufs_padded_size(const DecodeBufs *b, int n) {
    if (n < 1 || b->n_ladder == 0 || n > b->ladder[b->n_ladder - 1]) return 0;
    int r = 0;
    while (b->ladder[r] < n) r++;
    return b->ladder[r];
}

int decode_bufs_graphs_on(const DecodeBufs *b) { return b->use_graphs; }

void decode_bufs_graph_stats(const DecodeBufs *b, DecodeGraphStats *s) { *s = b->stats; }

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// Queues the padded step over P rows (the inputs are already in pad_ids and block_tables): the same ops, shapes
// and buffers whether it runs now or is recorded into a graph, so both give the same bits.
static void padded_forward(Model *m, DecodeBufs *b, KVCache *kv, int P) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const int C = cfg->hidden_size, T = b->ladder[b->n_ladder - 1];
    const int32_t *tokens = b->pad_ids, *seq = b->pad_ids + T, *pos = b->pad_ids + 2 * T, *slots = b->pad_ids + 3 * T;
    embed_tokens(m, b->x[0], tokens, b->units[0], P);
    AttnArgs att = {.paged = 1, .slot_mapping = slots, .block_tables = b->block_tables, .token_seq = seq,
                    .max_blocks = b->max_blocks, .block_size = kv->block_size, .n_seqs = b->max_seqs + 1,
                    .decode = 1};
    int cur = 0;
    const void *pending = NULL;   // as in model_decode_step: the previous layer's xmid, added by the next norm
    const int adapter = m->lora_rows && m->lora_rows->n_ranges > 0;
    for (int l = 0; l < cfg->num_layers; l++) {
        att.k_cache = kv->k[l];
        att.v_cache = kv->v[l];
        if (adapter) m->lora_rows->layer = l;
        if (P <= DECODE_SMALL_ROWS && !adapter) {   // a row or two: the projections carry the norms, SwiGLU and residual adds
            layer_decode_small(m, b->units[layout_layer_unit(l)], &b->acts, b->x[cur], b->x[cur ^ 1], pos, P, &att);
        } else {
            layer_forward_fused(m, b->units[layout_layer_unit(l)], &b->acts, b->x[cur], pending, b->x[cur ^ 1], pos, P,
                                &att);
            pending = b->acts.xmid;
        }
        cur ^= 1;
    }
    // Every row is a sequence's next token: the final norm reads the residual stream in place (no row gather),
    // adding the last layer's pending half first.
    const void *pf = b->units[layout_final_unit(&m->layout)];
    ops_residual_rmsnorm_fwd(o, pending ? b->x[cur] : NULL, b->rows_normed, NULL, b->x[cur], pending,
                             elem_at(m, pf, m->layout.final_norm), P, C, cfg->rms_norm_eps);
    const void *w_lm = m->layout.lm_head == SIZE_MAX ? elem_at(m, b->units[0], m->layout.embed)
                                                     : elem_at(m, pf, m->layout.lm_head);
    lm_head_logits(m, b, b->rows_normed, w_lm, P);
}

// Tensor-parallel shards: whether every shard's recording of this step succeeded (ok: this shard's). The shards must
// take every record/replay decision together: NCCL may run a collective recorded into a graph with another algorithm
// than the same collective run directly, so a shard replaying a step while another runs it eagerly could stall or
// mix up their data. Everything the decisions follow from is the same on every shard, since the engine drives them
// in lock-step: the padded size, the step clock, whether the step's key matches a slot (the parameter units and KV
// pools are swapped on every shard in one job), and each rung's failures, as long as every shard counts the same
// ones. Only a recording's own outcome can differ (device memory, a capture another thread invalidated, an op that
// failed on one shard): so the shards exchange it here (an all_gather of each one's 0 or 1, eager), and a recording
// that failed anywhere counts as failed everywhere. Every shard comes here at the same step, also one whose eager run
// failed (it says 1 from the constant, its context being unusable); recording itself runs no collective.
static int shards_keep_recording(Model *m, DecodeBufs *b, int ok) {
    ModelShard *s = &m->shard;
    if (s->size <= 1) return ok;
    // A collective of this shard failed in the step: it issued none after it (model_shard_reduce), so the other
    // shards' calls, this exchange among them, end with the comm timeout whatever it does here.
    if (s->failed) return 0;
    comm_wait_compute(s->comm);
    if (comm_all_gather(s->comm, b->vote + 2, b->vote + (ok ? 0 : 1), 1, COMM_I32) != 0) {
        s->failed = 1;
        return 0;
    }
    comm_compute_wait(s->comm);
    int32_t says[64];
    const int n = s->size < 64 ? s->size : 64;
    ops_copy_to_host(m->ops, says, b->vote + 2, (size_t)n * sizeof *says);   // waits for the all_gather
    if (ops_status(m->ops)) return 0;
    for (int k = 0; k < n; k++)
        if (says[k]) return 0;
    return ok;
}

// Records the padded step of rung r (size P) into one of its slots (an empty one, else the least recently used),
// right after the same ops ran eagerly (which made every GEMM plan, handle and scratch they need). A failure is
// not the step's: its eager run stands, the reason goes to the stats, and after DECODE_GRAPH_TRIES failures the
// size runs eagerly for good. Tensor-parallel shards keep a recording only when every shard's succeeded
// (shards_keep_recording); a shard whose eager run failed (ops_status) records nothing but still has its say.
static void padded_record(Model *m, DecodeBufs *b, KVCache *kv, int r, int P) {
    OpsCtx *o = m->ops;
    const int step_failed = ops_status(o) != 0;
    if (step_failed && m->shard.size == 1) return;
    DecodeRung *rung = &b->rungs[r];
    DecodeGraph *g = &rung->slot[0];
    int had_graph = 0;
    for (int k = 0; k < DECODE_GRAPH_SLOTS; k++) {
        DecodeGraph *c = &rung->slot[k];
        had_graph |= c->g != NULL;
        if (g->g && (!c->g || c->used < g->used)) g = c;
    }
    size_t free0 = 0, free1 = 0, total = 0;
    const int have_mem = !step_failed && ops_memory_info(o, &free0, &total) == 0;
    const double t0 = seconds_now();
    int rc = step_failed ? -1 : ops_graph_begin(o);
    if (rc == OPS_GRAPH_UNSUPPORTED) {   // per-op profiling: graphs_supported said so already, on every shard alike
        b->use_graphs = 0;
        return;
    }
    if (rc == 0) {
        padded_forward(m, b, kv, P);
        rc = ops_graph_end(o, &g->g);
    }
    if (!shards_keep_recording(m, b, rc == 0) && rc == 0) {
        // Another shard's recording failed: drop this one's as well (it may have replaced or updated the slot's
        // graph, which its old key no longer describes).
        ops_graph_destroy(o, g->g);
        g->g = NULL;
        memset(g->key, 0, (size_t)b->n_key * sizeof *g->key);
        rc = ops_set_error(o, -1, __FILE__, __LINE__, "the recording failed on another tensor-parallel shard");
    }
    const double dt = seconds_now() - t0;
    DecodeGraphStats *s = &b->stats;
    s->last_batch = P;
    s->last_failed = rc != 0;
    s->last_again = had_graph;
    s->last_seconds = dt;
    s->record_seconds += dt;
    s->last_bytes = 0;
    if (rc != 0) {
        // Counted on every shard alike (they all come here, and shards_keep_recording made the outcome common), so
        // that they give up on the same rung at the same step.
        rung->failures++;
        s->failures++;
        s->last_gave_up = rung->failures >= DECODE_GRAPH_TRIES;
        if (step_failed) {   // the step's error stays for the step to report
            snprintf(s->last_error, sizeof s->last_error, "the eager step failed: %s", ops_error(o));
            return;
        }
        snprintf(s->last_error, sizeof s->last_error, "%s", ops_error(o));
        ops_clear_error(o);
        return;
    }
    memcpy(g->key, b->key, (size_t)b->n_key * sizeof *b->key);
    g->block_size = kv->block_size;
    g->used = b->clock;
    s->recordings++;
    if (have_mem && ops_memory_info(o, &free1, &total) == 0) s->last_bytes = (int64_t)free0 - (int64_t)free1;
    s->graphs = 0;
    for (int i = 0; i < b->n_ladder; i++)
        for (int k = 0; k < DECODE_GRAPH_SLOTS; k++) s->graphs += b->rungs[i].slot[k].g != NULL;
}

int model_decode_step_padded(Model *m, DecodeBufs *b, UnitSource *src, KVCache *kv, int n, const int32_t *tokens,
                             const int32_t *token_pos, const int32_t *slot_mapping, const int32_t *block_tables,
                             int max_blocks, float *logits, char *err, size_t err_len) {
    OpsCtx *o = m->ops;
    const int V = m->shard.vocab_total;
    const int P = decode_bufs_padded_size(b, n);
    b->last_n = 0;
    // LoRA adapter rows: one adapter for every row (its range then covers the padding rows too, which are dropped).
    ModelLoraRows *lr = m->lora_rows;
    if (lr && lr->n_ranges > 0 && (lr->n_ranges > 1 || lr->ranges[0].row0 != 0 || lr->ranges[0].rows != n)) {
        snprintf(err, err_len, "a padded decode step runs one LoRA adapter for all its rows, not %d ranges: run this "
                 "step through model_decode_step", lr->n_ranges);
        return -1;
    }
    if (P == 0 || max_blocks < 1 || max_blocks > b->max_blocks) {
        snprintf(err, err_len, "padded decode step of %d sequences (block tables of %d, at most %d) does not fit: %s",
                 n, max_blocks, b->max_blocks,
                 b->n_ladder == 0 ? "padded steps are not set up (decode_bufs_enable_padded)"
                 : P == 0         ? "beyond the largest rung"
                                  : "block tables of that width");
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= V || token_pos[i] < 0 || token_pos[i] >= max_blocks * kv->block_size ||
            slot_mapping[i] >= kv->n_blocks * kv->block_size) {
            snprintf(err, err_len, "decode token %d is out of range (id %d, position %d, slot %d)", i, tokens[i],
                     token_pos[i], slot_mapping[i]);
            return -1;
        }
    }
    // Inputs into the fixed buffers the graph reads. Padding rows: token 0 at position 0 of the all-zero block
    // table in row max_seqs (block 0 exists: the row reads real, finite cache entries), slot -1 (nothing stored).
    // Each row's numbers depend only on its own inputs, so padding changes no real row.
    const int T = b->ladder[b->n_ladder - 1];
    int32_t *h = b->pad_host;
    for (int i = 0; i < P; i++) {
        const int real = i < n;
        h[i] = real ? tokens[i] : 0;
        h[T + i] = real ? i : b->max_seqs;
        h[2 * T + i] = real ? token_pos[i] : 0;
        h[3 * T + i] = real ? slot_mapping[i] : -1;
    }
    ops_copy_to_device(o, b->pad_ids, h, (size_t)4 * T * sizeof *h);
    upload_tables(o, b, block_tables, n, max_blocks);

    // Every unit at once: a graph reads them all in one launch.
    int acquired = 0;
    for (; acquired < b->n_units; acquired++)
        if (!(b->units[acquired] = src->acquire(src->user, acquired))) break;
    if (acquired < b->n_units) {
        for (int u = 0; u < acquired; u++)
            if (src->release) src->release(src->user, u);
        snprintf(err, err_len, "decode step: model parameters unavailable: %s", ops_error(o));
        return -1;
    }
    int k = 0;
    for (int u = 0; u < b->n_units; u++) b->key[k++] = b->units[u];
    for (int l = 0; l < m->cfg.num_layers; l++) {
        b->key[k++] = kv->k[l];
        b->key[k++] = kv->v[l];
    }
    b->key[k++] = m->inv_freq;
    const ModelLora *adapter = lr && lr->n_ranges > 0 ? lr->ranges[0].lora : NULL;
    for (int l = 0; l < m->cfg.num_layers; l++) b->key[k++] = adapter ? adapter->params[l] : NULL;
    b->key[k++] = adapter ? lr->block : NULL;
    if (adapter) lr->ranges[0].rows = P;
    int r = 0;
    while (b->ladder[r] != P) r++;
    DecodeRung *rung = &b->rungs[r];
    DecodeGraph *g = NULL;
    b->clock++;
    for (int j = 0; j < DECODE_GRAPH_SLOTS && b->use_graphs && !g; j++) {
        DecodeGraph *c = &rung->slot[j];
        if (c->g && c->block_size == kv->block_size && memcmp(c->key, b->key, (size_t)b->n_key * sizeof *b->key) == 0)
            g = c;
    }
    if (g) {
        g->used = b->clock;
        // Shards: the replay holds the collectives, so it is watched by the communicator's watchdog (a stalled peer
        // fails the step after the comm timeout instead of hanging it), and never launched on a failed communicator.
        if (m->shard.size == 1) ops_graph_launch(o, g->g);
        else if (!m->shard.failed && comm_graph_launch(m->shard.comm, g->g) != 0) m->shard.failed = 1;
        b->stats.replays++;
    } else {
        // First use of this size, or new parameter / cache pointers (a weight swap): run it eagerly, then record.
        padded_forward(m, b, kv, P);
        b->stats.eager_steps++;
        if (b->use_graphs && rung->failures < DECODE_GRAPH_TRIES) padded_record(m, b, kv, r, P);
    }
    if (adapter) lr->ranges[0].rows = n;
    for (int u = b->n_units - 1; u >= 0; u--)
        if (src->release) src->release(src->user, u);
    if (logits) ops_download_f32(o, logits, b->logits, (size_t)n * V);
    if (shard_step_status(m, err, err_len) != 0) return -1;
    if (ops_status(o)) {
        snprintf(err, err_len, "decode step failed: %s", ops_error(o));
        return -1;
    }
    return 0;
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

int model_generate_greedy(Model *m, UnitSource *src, int B, const int32_t *const *prompts, const int *prompt_lens,
                          int max_new, const int32_t *eos_ids, int n_eos, int32_t *out_tokens, char *err,
                          size_t err_len) {
    const int block_size = 16, V = m->shard.vocab_total;
    int max_len = 0, total_prompt = 0;
    for (int b = 0; b < B; b++) {
        if (prompt_lens[b] < 1) {
            snprintf(err, err_len, "prompt %d is empty", b);
            return -1;
        }
        if (prompt_lens[b] + max_new > max_len) max_len = prompt_lens[b] + max_new;
        total_prompt += prompt_lens[b];
    }
    if (max_len > m->cfg.max_seq_len) {
        snprintf(err, err_len, "prompt + max_new = %d exceeds the model's context of %d", max_len, m->cfg.max_seq_len);
        return -1;
    }
    const int max_blocks = (max_len + block_size - 1) / block_size;
    const int N_max = total_prompt > B ? total_prompt : B;
    KVCache kv;
    DecodeBufs *bufs = NULL;
    int rc = -1;
    int32_t *tok = malloc((size_t)N_max * 4 * 5), *seq = tok + N_max, *pos = seq + N_max, *slot = pos + N_max,
            *rows = slot + N_max;
    int32_t *tables = malloc((size_t)B * max_blocks * 4);
    int *len = calloc((size_t)B, sizeof(int)), *done = calloc((size_t)B, sizeof(int));
    float *logits = malloc((size_t)B * V * sizeof(float));
    if (!tok || !tables || !len || !done || !logits) {
        snprintf(err, err_len, "out of host memory for generation");
        goto out;
    }
    if (kv_cache_create(&kv, m, B * max_blocks, block_size, err, err_len) != 0) goto out;
    if (decode_bufs_create(&bufs, m, N_max, B, max_blocks, B, err, err_len) != 0) goto out_kv;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < max_blocks; j++) tables[b * max_blocks + j] = b * max_blocks + j;
    for (int i = 0; i < B * max_new; i++) out_tokens[i] = -1;

    // Prefill every prompt in one step; logits of each prompt's last token.
    int N = 0;
    for (int b = 0; b < B; b++) {
        for (int i = 0; i < prompt_lens[b]; i++, N++) {
            tok[N] = prompts[b][i];
            seq[N] = b;
            pos[N] = i;
            slot[N] = b * max_blocks * block_size + i;
        }
        rows[b] = N - 1;
        len[b] = prompt_lens[b];
    }
    if (model_decode_step(m, bufs, src, &kv, N, tok, seq, pos, slot, tables, B, max_blocks, rows, B, logits, err,
                          err_len) != 0)
        goto out_bufs;
    for (int step = 0; step < max_new; step++) {
        // Logits rows are the live sequences in index order (those decoded by the previous step): pick each
        // one's next token, then decode the ones that go on together.
        N = 0;
        int r = 0;
        for (int b = 0; b < B; b++) {
            if (done[b]) continue;
            int next = argmax(logits + (size_t)r++ * V, V);
            out_tokens[b * max_new + step] = next;
            for (int e = 0; e < n_eos; e++)
                if (next == eos_ids[e]) done[b] = 1;
            if (done[b] || step + 1 == max_new) continue;
            tok[N] = next;
            seq[N] = b;
            pos[N] = len[b];
            slot[N] = b * max_blocks * block_size + len[b];
            rows[N] = N;
            len[b]++;
            N++;
        }
        if (N == 0) break;
        if (model_decode_step(m, bufs, src, &kv, N, tok, seq, pos, slot, tables, B, max_blocks, rows, N, logits, err,
                              err_len) != 0)
            goto out_bufs;
    }
    rc = 0;
out_bufs:
    decode_bufs_free(bufs, m);
out_kv:
    kv_cache_free(&kv, m);
out:
    free(tok);
    free(tables);
    free(len);
    free(done);
    free(logits);
    return rc;
}
