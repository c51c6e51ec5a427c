// shared/model_decode.c — inference forward through a paged KV cache (prefill chunks and decodes in one step),
// and greedy generation over a contiguous cache (the rollout server brings the block manager and sampler).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/model_internal.h"

struct DecodeBufs {
    int max_tokens, max_seqs, max_blocks, max_logit_rows;
    LayerActs acts;
    void *acts_block;
    void *x[2];                 // (N, C) ping-pong residual stream
    void *rows, *rows_normed;   // (max_logit_rows, C)
    void *logits;               // (max_logit_rows, V)
    int32_t *tokens, *token_seq, *token_pos, *slot_mapping; // (N) backend memory
    int32_t *block_tables;      // (max_seqs, max_blocks) backend memory
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
    const size_t es = ops_dtype_size(o), N = (size_t)max_tokens, C = m->cfg.hidden_size, V = m->cfg.vocab_size;
    DecodeBufs *b = calloc(1, sizeof *b);
    *out = NULL;
    if (!b) goto oom;
    b->max_tokens = max_tokens;
    b->max_seqs = max_seqs;
    b->max_blocks = max_blocks;
    b->max_logit_rows = max_logit_rows;
    if (layer_acts_alloc(m, &b->acts, max_tokens, 0, &b->acts_block) != 0) goto oom;
    b->x[0] = ops_malloc(o, N * C * es);
    b->x[1] = ops_malloc(o, N * C * es);
    b->rows = ops_malloc(o, (size_t)max_logit_rows * C * es);
    b->rows_normed = ops_malloc(o, (size_t)max_logit_rows * C * es);
    b->logits = ops_malloc(o, (size_t)max_logit_rows * V * es);
    b->tokens = ops_malloc(o, N * 4);
    b->token_seq = ops_malloc(o, N * 4);
    b->token_pos = ops_malloc(o, N * 4);
    b->slot_mapping = ops_malloc(o, N * 4);
    b->block_tables = ops_malloc(o, (size_t)max_seqs * max_blocks * 4);
    if (ops_status(o)) goto oom;
    *out = b;
    return 0;
oom:
    snprintf(err, err_len, "out of memory for decode buffers (%d tokens): %s", max_tokens, ops_error(o));
    decode_bufs_free(b, m);
    return -1;
}

const void *decode_bufs_logits(const DecodeBufs *b) { return b->logits; }

void decode_bufs_free(DecodeBufs *b, const Model *m) {
    if (!b) return;
    OpsCtx *o = m->ops;
    ops_free(o, b->acts_block);
    ops_free(o, b->x[0]);
    ops_free(o, b->x[1]);
    ops_free(o, b->rows);
    ops_free(o, b->rows_normed);
    ops_free(o, b->logits);
    ops_free(o, b->tokens);
    ops_free(o, b->token_seq);
    ops_free(o, b->token_pos);
    ops_free(o, b->slot_mapping);
    ops_free(o, b->block_tables);
    free(b);
}

int model_decode_step(Model *m, DecodeBufs *b, UnitSource *src, KVCache *kv, int N, const int32_t *tokens,
                      const int32_t *token_seq, const int32_t *token_pos, const int32_t *slot_mapping,
                      const int32_t *block_tables, int n_seqs, int max_blocks, const int32_t *logit_rows,
                      int n_logit_rows, float *logits, char *err, size_t err_len) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const int C = cfg->hidden_size, V = cfg->vocab_size;
    const size_t es = ops_dtype_size(o);
    if (N < 1 || N > b->max_tokens || n_seqs < 1 || n_seqs > b->max_seqs || max_blocks != b->max_blocks ||
        n_logit_rows < 0 || n_logit_rows > b->max_logit_rows) {
        snprintf(err, err_len, "decode step of %d tokens / %d sequences / %d logit rows exceeds its buffers "
                 "(%d / %d / %d)", N, n_seqs, n_logit_rows, b->max_tokens, b->max_seqs, b->max_logit_rows);
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
    ops_copy_to_device(o, b->block_tables, block_tables, (size_t)n_seqs * max_blocks * 4);

    const void *p = src->acquire(src->user, 0);
    if (!p) goto unavailable;
    ops_embedding_fwd(o, b->x[0], b->tokens, elem_at(m, p, m->layout.embed), N, C, V);
    if (src->release) src->release(src->user, 0);
    AttnArgs att = {.paged = 1, .slot_mapping = b->slot_mapping, .block_tables = b->block_tables,
                    .token_seq = b->token_seq, .max_blocks = max_blocks, .block_size = kv->block_size,
                    .n_seqs = n_seqs};
    int cur = 0;
    for (int l = 0; l < cfg->num_layers; l++) {
        int u = layout_layer_unit(l);
        if (!(p = src->acquire(src->user, u))) goto unavailable;
        att.k_cache = kv->k[l];
        att.v_cache = kv->v[l];
        layer_forward(m, p, &b->acts, b->x[cur], b->x[cur ^ 1], b->token_pos, N, &att);
        if (src->release) src->release(src->user, u);
        cur ^= 1;
    }
    if (n_logit_rows > 0) {
        for (int r = 0; r < n_logit_rows; r++) {
            if (logit_rows[r] < 0 || logit_rows[r] >= N) {
                snprintf(err, err_len, "logit row %d names token %d of a %d-token step", r, logit_rows[r], N);
                return -1;
            }
            ops_copy(o, elem_at(m, b->rows, (size_t)r * C), elem_at(m, b->x[cur], (size_t)logit_rows[r] * C), C * es);
        }
        const int uf = layout_final_unit(&m->layout);
        const void *pf = src->acquire(src->user, uf), *p0 = NULL;
        if (!pf) goto unavailable;
        if (m->layout.lm_head == SIZE_MAX && !(p0 = src->acquire(src->user, 0))) goto unavailable;
        ops_rmsnorm_fwd(o, b->rows_normed, NULL, b->rows, elem_at(m, pf, m->layout.final_norm), n_logit_rows, C,
                        cfg->rms_norm_eps);
        const void *w_lm = p0 ? elem_at(m, p0, m->layout.embed) : elem_at(m, pf, m->layout.lm_head);
        ops_matmul_fwd(o, b->logits, b->rows_normed, w_lm, NULL, n_logit_rows, C, V);
        if (logits) ops_download_f32(o, logits, b->logits, (size_t)n_logit_rows * V);
        if (p0 && src->release) src->release(src->user, 0);
        if (src->release) src->release(src->user, uf);
    }
    // Logits left in backend memory: the caller's next op runs after this step on the same stream, so there is
    // nothing to wait for here (an asynchronous failure shows at the caller's next synchronization).
    if (logits) ops_synchronize(o);
    if (ops_status(o)) {
        snprintf(err, err_len, "decode step failed: %s", ops_error(o));
        return -1;
    }
    return 0;
unavailable:
    snprintf(err, err_len, "decode step: model parameters unavailable: %s", ops_error(o));
    return -1;
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
    const int block_size = 16, V = m->cfg.vocab_size;
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
