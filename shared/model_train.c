// shared/model_train.c — training forward (per-token logprobs) and backward over a packed batch.
//
// Activation memory: the residual stream at every layer boundary (L+1 buffers of (N, C)) is always kept;
// each layer's intermediates are kept per layer, or — with activation checkpointing — in one slot that
// backward refills by recomputing the layer (up to its SwiGLU: backward never needs the layer's output again).
// Checkpointing keeps each layer's attention output and log-sum-exp as well (L x (N x Hq x D + N x Hq fp32), about
// 0.7 GB for Qwen2.5-1.5B at 8,192 tokens in bf16), so that the recompute skips the attention. Without q/k norms
// (Qwen2, Llama) it keeps q, k, v (after RoPE) and xmid too (another L x N x (Hq D + 2 Hkv D + C) storage elements,
// ~1.6 GB there): the recompute is then the two RMSNorms and the MLP up to SwiGLU — no q/k/v or output projection,
// no RoPE. With q/k norms the recompute also redoes the projections, norms and RoPE of the attention half.
// The lm_head + log-softmax runs over row chunks so the (N, V) logits never exist at once, unless the caller asks to
// keep them (TRAIN_ACTS_KEEP_LOGITS): then one GEMM writes the whole batch's logits into one (N, V) buffer — storage
// dtype, never fp32 probabilities — and the backward, instead of running the lm_head GEMM again chunk by chunk,
// turns them into their gradient in place and runs the lm_head's backward as one GEMM each for dx and dW (the fp32
// dW is then read and written once, not once per chunk).
//
// Residual adds: layer l writes only its MLP output into residual[l+1]; the add of its xmid runs fused with the
// next RMSNorm — layer l+1's input norm, or the final norm — so residual[l+1] is complete from then on.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/model_internal.h"

// Logit chunks hold at most this many elements (rows * V): 16 MB on the CPU (cache-friendly), 512 MB of bf16 on
// a GPU (~1,700 rows of a 152k vocabulary, so that the lm_head GEMMs of a chunk — its weight gradient reduces over
// the chunk's rows — are large enough to run near the GPU's peak).
#define LOGIT_CHUNK_ELEMS_CPU (1u << 22)
#define LOGIT_CHUNK_ELEMS_GPU (1u << 28)

struct TrainActs {
    int max_tokens, max_seqs, checkpoint, keep_logits, n_slots, chunk_rows;
    size_t bytes;
    int32_t *tokens, *targets, *cu_seqlens, *positions; // backend memory: (N), (N), (B+1), (N)
    int32_t *positions_host;                            // (N)
    void *residual_block;
    void **residual;          // (L+1) x (N, C) layer inputs; residual[L] is the last layer's output
    LayerActs *slots;         // (n_slots)
    void **slot_blocks;       // (n_slots)
    void *kept_block;         // checkpointing: what each layer keeps across the recompute, NULL without
    void **kept_att;          // (L) x (N, Hq*D) storage dtype
    float **kept_lse;         // (L) x (N, Hq) fp32
    int kept_qkv;             // also q, k, v and xmid (models without q/k norms):
    void **kept_q, **kept_k, **kept_v, **kept_xmid; // (L) x (N, Hq*D), (N, Hkv*D), (N, Hkv*D), (N, C)
    size_t kept_bytes;
    LayerGrads grads;
    void *grads_block;
    void *dres;               // (N, C)
    void *xf;                 // (N, C) final-norm output
    float *rstd_final;        // (N)
    void *logits_chunk;       // (chunk_rows, V), or (max_tokens, V) with keep_logits (their gradient in backward)
    size_t logits_kept_bytes; // the latter's size, 0 without
    void *dlogits_chunk;      // (chunk_rows, V); NULL with keep_logits
    float *logprobs, *lse, *entropy, *dlogprobs, *dentropy; // (N) each
    // The batch of the last forward.
    int n_tokens, n_seqs;
    float inv_temperature;
    int has_entropy;          // the forward computed per-token entropy (needed by a backward with dentropy)
    int logits_spent;         // keep_logits: a backward has turned the kept logits into their gradient
};

size_t train_acts_bytes(const TrainActs *a) { return a->bytes; }
size_t train_acts_kept_bytes(const TrainActs *a) { return a->kept_bytes; }
size_t train_acts_logits_bytes(const TrainActs *a) { return a->logits_kept_bytes; }

static void *track(TrainActs *a, OpsCtx *o, size_t bytes) {
    a->bytes += bytes;
    return ops_malloc(o, bytes);
}

int train_acts_create(TrainActs **out, const Model *m, int max_tokens, int max_seqs, int flags, char *err,
                      size_t err_len) {
    const int checkpoint = (flags & TRAIN_ACTS_CHECKPOINT) != 0;
    *out = NULL;
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const size_t es = ops_dtype_size(o), N = (size_t)max_tokens, C = cfg->hidden_size, V = cfg->vocab_size;
    const size_t Hq = cfg->num_heads, QD = Hq * cfg->head_dim;
    const int L = cfg->num_layers;
    TrainActs *a = calloc(1, sizeof *a);
    if (!a) goto oom;
    a->max_tokens = max_tokens;
    a->max_seqs = max_seqs;
    a->checkpoint = checkpoint;
    a->keep_logits = (flags & TRAIN_ACTS_KEEP_LOGITS) != 0;
    a->n_slots = checkpoint ? 1 : L;
    size_t rows = (ops_backend(o) == OPS_BACKEND_CUDA ? LOGIT_CHUNK_ELEMS_GPU : LOGIT_CHUNK_ELEMS_CPU) / V;
    // On a GPU, whole 128-row tiles: the lm_head GEMMs of a 1,664-row chunk ran 11-14 % faster than of 1,766 rows
    // (bench/notes/gpu-passes-h200.md, "GEMMs of one training step").
    if (ops_backend(o) == OPS_BACKEND_CUDA && rows >= 128) rows -= rows % 128;
    a->chunk_rows = (int)(rows < 1 ? 1 : rows > N ? N : rows);
    a->tokens = track(a, o, N * 4);
    a->targets = track(a, o, N * 4);
    a->positions = track(a, o, N * 4);
    a->cu_seqlens = track(a, o, ((size_t)max_seqs + 1) * 4);
    a->positions_host = malloc(N * 4);
    a->residual = calloc((size_t)L + 1, sizeof(void *));
    a->slots = calloc((size_t)a->n_slots, sizeof(LayerActs));
    a->slot_blocks = calloc((size_t)a->n_slots, sizeof(void *));
    if (!a->positions_host || !a->residual || !a->slots || !a->slot_blocks) goto oom;
    size_t res_bytes = (N * C * es + 255) / 256 * 256;
    a->residual_block = track(a, o, res_bytes * (L + 1));
    if (!a->residual_block) goto oom;
    for (int l = 0; l <= L; l++) a->residual[l] = (char *)a->residual_block + res_bytes * l;
    if (layer_grads_alloc(m, &a->grads, max_tokens, &a->grads_block) != 0) goto oom;
    a->bytes += a->grads.bytes;
    const int mode = checkpoint ? LAYER_ACTS_TRAINING_KEPT_ATT : LAYER_ACTS_TRAINING;
    for (int s = 0; s < a->n_slots; s++) {
        if (layer_acts_alloc(m, &a->slots[s], max_tokens, mode, &a->slot_blocks[s]) != 0) goto oom;
        a->bytes += a->slots[s].bytes;
        // The fused q/k/v projection's output is split right away: every slot uses the backward's dqkv as scratch.
        a->slots[s].qkv = a->grads.dqkv;
    }
    if (checkpoint) {
#define ROUND256(b) (((b) + 255) / 256 * 256)
        const size_t KVD = (size_t)cfg->num_kv_heads * cfg->head_dim;
        const size_t att_bytes = ROUND256(N * QD * es), lse_bytes = ROUND256(N * Hq * 4);
        const size_t q_bytes = ROUND256(N * QD * es), kv_bytes = ROUND256(N * KVD * es), x_bytes = ROUND256(N * C * es);
        a->kept_qkv = !cfg->qk_norm;
        const size_t per_layer = att_bytes + lse_bytes + (a->kept_qkv ? q_bytes + 2 * kv_bytes + x_bytes : 0);
#undef ROUND256
        a->kept_att = calloc((size_t)L, sizeof(void *));
        a->kept_lse = calloc((size_t)L, sizeof(float *));
        a->kept_q = calloc((size_t)L, sizeof(void *));
        a->kept_k = calloc((size_t)L, sizeof(void *));
        a->kept_v = calloc((size_t)L, sizeof(void *));
        a->kept_xmid = calloc((size_t)L, sizeof(void *));
        if (!a->kept_att || !a->kept_lse || !a->kept_q || !a->kept_k || !a->kept_v || !a->kept_xmid) goto oom;
        a->kept_bytes = per_layer * (size_t)L;
        if (L > 0 && !(a->kept_block = track(a, o, a->kept_bytes))) goto oom;
        for (int l = 0; l < L; l++) {
            char *b = (char *)a->kept_block + per_layer * l;
            a->kept_att[l] = b;
            a->kept_lse[l] = (float *)(b + att_bytes);
            if (!a->kept_qkv) continue;
            a->kept_q[l] = b + att_bytes + lse_bytes;
            a->kept_k[l] = (char *)a->kept_q[l] + q_bytes;
            a->kept_v[l] = (char *)a->kept_k[l] + kv_bytes;
            a->kept_xmid[l] = (char *)a->kept_v[l] + kv_bytes;
        }
    }
    a->dres = track(a, o, N * C * es);
    a->xf = track(a, o, N * C * es);
    a->rstd_final = track(a, o, N * 4);
    if (a->keep_logits) a->logits_kept_bytes = N * V * es;
    a->logits_chunk = track(a, o, a->keep_logits ? a->logits_kept_bytes : (size_t)a->chunk_rows * V * es);
    if (!a->keep_logits) a->dlogits_chunk = track(a, o, (size_t)a->chunk_rows * V * es);
    a->logprobs = track(a, o, N * 4);
    a->lse = track(a, o, N * 4);
    a->entropy = track(a, o, N * 4);
    a->dlogprobs = track(a, o, N * 4);
    a->dentropy = track(a, o, N * 4);
    if (ops_status(o)) goto oom;
    if (m->lora && model_lora_reserve(m->lora, max_tokens, err, err_len) != 0) {
        train_acts_free(a, m);
        return -1;
    }
    *out = a;
    return 0;
oom:
    snprintf(err, err_len, "out of memory for training activations (%d tokens, %d sequences): %s", max_tokens,
             max_seqs, ops_error(o));
    if (a) train_acts_free(a, m);
    return -1;
}

void train_acts_free(TrainActs *a, const Model *m) {
    if (!a) return;
    OpsCtx *o = m->ops;
    ops_free(o, a->tokens);
    ops_free(o, a->targets);
    ops_free(o, a->positions);
    ops_free(o, a->cu_seqlens);
    free(a->positions_host);
    ops_free(o, a->residual_block);
    free(a->residual);
    if (a->slot_blocks)
        for (int s = 0; s < a->n_slots; s++) ops_free(o, a->slot_blocks[s]);
    free(a->slot_blocks);
    free(a->slots);
    ops_free(o, a->kept_block);
    free(a->kept_att);
    free(a->kept_lse);
    free(a->kept_q);
    free(a->kept_k);
    free(a->kept_v);
    free(a->kept_xmid);
    ops_free(o, a->grads_block);
    ops_free(o, a->dres);
    ops_free(o, a->xf);
    ops_free(o, a->rstd_final);
    ops_free(o, a->logits_chunk);
    ops_free(o, a->dlogits_chunk);
    ops_free(o, a->logprobs);
    ops_free(o, a->lse);
    ops_free(o, a->entropy);
    ops_free(o, a->dlogprobs);
    ops_free(o, a->dentropy);
    free(a);
}

static int check_batch(const Model *m, const TrainActs *a, const Batch *b, char *err, size_t err_len) {
    if (b->n_seqs < 1 || b->n_seqs > a->max_seqs) {
        snprintf(err, err_len, "batch has %d sequences; this buffer holds 1..%d", b->n_seqs, a->max_seqs);
        return -1;
    }
    if (b->cu_seqlens[0] != 0 || b->cu_seqlens[b->n_seqs] != b->n_tokens) {
        snprintf(err, err_len, "cu_seqlens must start at 0 and end at n_tokens (%d)", b->n_tokens);
        return -1;
    }
    if (b->n_tokens < 1 || b->n_tokens > a->max_tokens) {
        snprintf(err, err_len, "batch has %d tokens; this buffer holds 1..%d", b->n_tokens, a->max_tokens);
        return -1;
    }
    for (int s = 0; s < b->n_seqs; s++) {
        int len = b->cu_seqlens[s + 1] - b->cu_seqlens[s];
        if (len < 1 || len > m->cfg.max_seq_len) {
            snprintf(err, err_len, "sequence %d has length %d; allowed 1..%d (the model's context)", s, len,
                     m->cfg.max_seq_len);
            return -1;
        }
    }
    for (int i = 0; i < b->n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= m->cfg.vocab_size || b->targets[i] >= m->cfg.vocab_size) {
            snprintf(err, err_len, "token %d: id %d / target %d outside the vocabulary of %d", i, b->tokens[i],
                     b->targets[i], m->cfg.vocab_size);
            return -1;
        }
    }
    return 0;
}

static int ops_failed(const Model *m, const char *what, char *err, size_t err_len) {
    if (!ops_status(m->ops)) return 0;
    snprintf(err, err_len, "%s failed: %s", what, ops_error(m->ops));
    return -1;
}

#define ACQUIRE(src, u, dst, what)                                                                \
    do {                                                                                          \
        dst = (src)->acquire((src)->user, (u));                                                   \
        if (!dst) {                                                                               \
            snprintf(err, err_len, "%s: parameters of unit %d unavailable: %s", what, (u), ops_error(m->ops)); \
            return -1;                                                                            \
        }                                                                                         \
    } while (0)
#define RELEASE(src, u) do { if ((src)->release) (src)->release((src)->user, (u)); } while (0)
#define GRAD_DONE(src, u) do { if ((src)->grad_done) (src)->grad_done((src)->user, (u)); } while (0)
#define PREFETCH(src, u) do { if ((src)->prefetch) (src)->prefetch((src)->user, (u)); } while (0)

// Unit u's fp32 gradient buffer, NULL for a frozen base (a source without gradients).
static float *base_grad(UnitSource *src, int u) { return src->grad ? src->grad(src->user, u) : NULL; }

static AttnArgs train_attn(const TrainActs *a) {
    return (AttnArgs){.paged = 0, .cu_seqlens = a->cu_seqlens, .n_seqs = a->n_seqs};
}

// The LayerActs that layer l runs in: its own, or — checkpointing — the shared slot with layer l's kept attention
// output and log-sum-exp (and q, k, v, xmid when those are kept: without q/k norms q_pre and k_pre are q and k).
static LayerActs *layer_slot(TrainActs *a, int l) {
    if (!a->checkpoint) return &a->slots[l];
    LayerActs *s = &a->slots[0];
    s->att = a->kept_att[l];
    s->lse = a->kept_lse[l];
    if (a->kept_qkv) {
        s->q = s->q_pre = a->kept_q[l];
        s->k = s->k_pre = a->kept_k[l];
        s->v = a->kept_v[l];
        s->xmid = a->kept_xmid[l];
    }
    return s;
}

// The checkpoint recompute of a layer whose q, k, v, attention output and xmid were kept: h1 and h2 (with their
// rstd) from the stored residual input and xmid — plain norms of stored values repeat the forward's fused norms bit
// for bit — then the MLP up to SwiGLU. x_in (N, C) is the layer's complete input.
static void recompute_kept(Model *m, const void *p, LayerActs *s, const void *x_in, int N) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const LayerOffsets *lo = &m->layout.layer;
    const int C = cfg->hidden_size, I = cfg->intermediate_size;
    ops_rmsnorm_fwd(o, s->h1, s->rstd1, x_in, elem_at(m, p, lo->ln1), N, C, cfg->rms_norm_eps);
    ops_rmsnorm_fwd(o, s->h2, s->rstd2, s->xmid, elem_at(m, p, lo->ln2), N, C, cfg->rms_norm_eps);
    ops_matmul_fwd(o, s->gu, s->h2, elem_at(m, p, lo->wgu), NULL, N, C, 2 * I);
    lora_forward(m, LORA_GROUP_GU, s->h2, s->gu, N);
    ops_swiglu_fwd(o, s->act, s->gu, N, I);
}

// lm_head weight: unit L+1's own, or the embedding table (unit 0) when tied.
static const void *lm_head_weight(const Model *m, const void *p_final, const void *p_embed) {
    return m->layout.lm_head == SIZE_MAX ? elem_at(m, p_embed, m->layout.embed) : elem_at(m, p_final, m->layout.lm_head);
}

int model_forward(Model *m, TrainActs *a, UnitSource *src, const Batch *b, float inv_temperature, float *logprobs,
                  float *entropy, float *logits, char *err, size_t err_len) {
    if (check_batch(m, a, b, err, err_len) != 0) return -1;
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const int N = b->n_tokens, C = cfg->hidden_size, V = cfg->vocab_size, L = cfg->num_layers;
    const size_t es = ops_dtype_size(o);
    a->n_tokens = N;
    a->n_seqs = b->n_seqs;
    a->inv_temperature = inv_temperature;
    a->has_entropy = entropy != NULL;
    a->logits_spent = 0;
    if (b->positions) {
        memcpy(a->positions_host, b->positions, (size_t)N * 4);
    } else {
        for (int s = 0; s < b->n_seqs; s++)
            for (int i = b->cu_seqlens[s]; i < b->cu_seqlens[s + 1]; i++) a->positions_host[i] = i - b->cu_seqlens[s];
    }
    ops_copy_to_device(o, a->tokens, b->tokens, (size_t)N * 4);
    ops_copy_to_device(o, a->targets, b->targets, (size_t)N * 4);
    ops_copy_to_device(o, a->positions, a->positions_host, (size_t)N * 4);
    ops_copy_to_device(o, a->cu_seqlens, b->cu_seqlens, ((size_t)b->n_seqs + 1) * 4);

    const void *p;
    ACQUIRE(src, 0, p, "embedding");
    PREFETCH(src, L > 0 ? layout_layer_unit(0) : layout_final_unit(&m->layout));
    ops_embedding_fwd(o, a->residual[0], a->tokens, elem_at(m, p, m->layout.embed), N, C, V);
    RELEASE(src, 0);
    AttnArgs att = train_attn(a);
    const void *pending = NULL; // the previous layer's xmid, still to be added into residual[l]
    for (int l = 0; l < L; l++) {
        ACQUIRE(src, layout_layer_unit(l), p, "layer forward");
        PREFETCH(src, l + 1 < L ? layout_layer_unit(l + 1) : layout_final_unit(&m->layout));
        LayerActs *slot = layer_slot(a, l);
        if (m->lora) m->lora->layer = l;
        layer_forward_fused(m, p, slot, a->residual[l], pending, a->residual[l + 1], a->positions, N, &att);
        pending = slot->xmid;
        RELEASE(src, layout_layer_unit(l));
        if (ops_failed(m, "layer forward", err, err_len)) return -1;
    }
    const int uf = layout_final_unit(&m->layout);
    const void *pf, *p0 = NULL;
    ACQUIRE(src, uf, pf, "final norm");
    if (m->layout.lm_head == SIZE_MAX) ACQUIRE(src, 0, p0, "tied lm_head");
    ops_residual_rmsnorm_fwd(o, pending ? a->residual[L] : NULL, a->xf, a->rstd_final, a->residual[L], pending,
                             elem_at(m, pf, m->layout.final_norm), N, C, cfg->rms_norm_eps);
    const void *w_lm = lm_head_weight(m, pf, p0);
    const int step = a->keep_logits ? N : a->chunk_rows;  // kept logits: the whole batch in one GEMM
    for (int r0 = 0; r0 < N; r0 += step) {
        int rows = N - r0 < step ? N - r0 : step;
        ops_matmul_fwd(o, a->logits_chunk, elem_at(m, a->xf, (size_t)r0 * C), w_lm, NULL, rows, C, V);
        // Entropy costs one more pass over each row: only when asked for (a backward with an entropy term needs it).
        ops_logprobs_fwd(o, a->logprobs + r0, a->lse + r0, entropy ? a->entropy + r0 : NULL, a->logits_chunk,
                         a->targets + r0, rows, V, inv_temperature);
        if (logits) ops_download_f32(o, logits + (size_t)r0 * V, a->logits_chunk, (size_t)rows * V);
    }
    if (p0) RELEASE(src, 0);
    RELEASE(src, uf);
    if (logprobs) ops_copy_to_host(o, logprobs, a->logprobs, (size_t)N * 4);
    if (entropy) ops_copy_to_host(o, entropy, a->entropy, (size_t)N * 4);
    ops_synchronize(o);
    (void)es;
    return ops_failed(m, "forward", err, err_len);
}

int model_backward(Model *m, TrainActs *a, UnitSource *src, const float *dlogprobs, char *err, size_t err_len) {
    return model_backward_entropy(m, a, src, dlogprobs, NULL, err, err_len);
}

int model_backward_entropy(Model *m, TrainActs *a, UnitSource *src, const float *dlogprobs, const float *dentropy,
                           char *err, size_t err_len) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const int N = a->n_tokens, C = cfg->hidden_size, V = cfg->vocab_size, L = cfg->num_layers;
    if (N <= 0) {
        snprintf(err, err_len, "model_backward called without a preceding model_forward");
        return -1;
    }
    if (a->logits_spent) {
        snprintf(err, err_len, "model_backward: the kept logits of the last model_forward were used by a backward "
                 "already; run model_forward again (or create the buffers without TRAIN_ACTS_KEEP_LOGITS)");
        return -1;
    }
    if (dentropy && !a->has_entropy) {
        snprintf(err, err_len, "model_backward with an entropy term needs a model_forward that computed entropy");
        return -1;
    }
    // A source without gradients is a frozen base: only LoRA adapters train then.
    if (!src->grad && !m->lora) {
        snprintf(err, err_len, "model_backward needs a unit source with gradient buffers (or LoRA adapters to train)");
        return -1;
    }
    ops_copy_to_device(o, a->dlogprobs, dlogprobs, (size_t)N * 4);
    if (dentropy) ops_copy_to_device(o, a->dentropy, dentropy, (size_t)N * 4);
    const int uf = layout_final_unit(&m->layout);
    const int tied = m->layout.lm_head == SIZE_MAX;
    const void *pf, *p0 = NULL;
    ACQUIRE(src, uf, pf, "final norm backward");
    float *gf = base_grad(src, uf), *g0 = tied ? base_grad(src, 0) : NULL;
    if (tied) ACQUIRE(src, 0, p0, "tied lm_head backward");
    if (L > 0) PREFETCH(src, layout_layer_unit(L - 1));
    const void *w_lm = lm_head_weight(m, pf, p0);
    float *dw_lm = tied ? (g0 ? g0 + m->layout.embed : NULL) : (gf ? gf + m->layout.lm_head : NULL);
    void *dxf = a->grads.dh; // (N, C): free until the first layer's backward
    if (a->keep_logits) {
        // The forward's logits become their gradient in place, then one GEMM each for dx and dW.
        ops_logprobs_bwd(o, a->logits_chunk, a->dlogprobs, dentropy ? a->dentropy : NULL, a->entropy, a->logits_chunk,
                         a->targets, a->lse, N, V, a->inv_temperature);
        ops_matmul_bwd(o, dxf, dw_lm, NULL, a->logits_chunk, a->xf, w_lm, N, C, V, 0);
        a->logits_spent = 1;
    }
    for (int r0 = 0; !a->keep_logits && r0 < N; r0 += a->chunk_rows) {
        int rows = N - r0 < a->chunk_rows ? N - r0 : a->chunk_rows;
        const void *xf_c = elem_at(m, a->xf, (size_t)r0 * C);
        ops_matmul_fwd(o, a->logits_chunk, xf_c, w_lm, NULL, rows, C, V);
        ops_logprobs_bwd(o, a->dlogits_chunk, a->dlogprobs + r0, dentropy ? a->dentropy + r0 : NULL, a->entropy + r0,
                         a->logits_chunk, a->targets + r0, a->lse + r0, rows, V, a->inv_temperature);
        ops_matmul_bwd(o, elem_at(m, dxf, (size_t)r0 * C), dw_lm, NULL, a->dlogits_chunk, xf_c, w_lm, rows, C, V, 0);
    }
    // dres = d residual[L] (dres_in NULL: nothing flows into the stream from above the final norm).
    ops_residual_rmsnorm_bwd(o, a->dres, gf ? gf + m->layout.final_norm : NULL, NULL, dxf, a->residual[L],
                             elem_at(m, pf, m->layout.final_norm), a->rstd_final, N, C);
    GRAD_DONE(src, uf);
    if (tied) RELEASE(src, 0);
    RELEASE(src, uf);
    if (ops_failed(m, "lm_head backward", err, err_len)) return -1;

    AttnArgs att = train_attn(a);
    for (int l = L - 1; l >= 0; l--) {
        int u = layout_layer_unit(l);
        const void *p;
        ACQUIRE(src, u, p, "layer backward");
        if (l > 0) PREFETCH(src, layout_layer_unit(l - 1));
        LayerActs *slot = layer_slot(a, l);
        if (m->lora) m->lora->layer = l;
        // Recompute from the stored complete input, all but the attention (its output and lse were kept);
        // residual[l + 1] is complete already and stays untouched.
        if (a->checkpoint && a->kept_qkv) {
            recompute_kept(m, p, slot, a->residual[l], N);
        } else if (a->checkpoint) {
            AttnArgs kept = att;
            kept.reuse_att = 1;
            layer_forward_fused(m, p, slot, a->residual[l], NULL, NULL, a->positions, N, &kept);
        }
        layer_backward(m, p, base_grad(src, u), slot, &a->grads, a->dres, a->residual[l], a->positions, N, &att);
        GRAD_DONE(src, u);
        RELEASE(src, u);
        if (ops_failed(m, "layer backward", err, err_len)) return -1;
    }
    if (!tied) g0 = base_grad(src, 0);
    if (g0) ops_embedding_bwd(o, g0 + m->layout.embed, a->dres, a->tokens, N, C);
    GRAD_DONE(src, 0);
    ops_synchronize(o);
    return ops_failed(m, "embedding backward", err, err_len);
}
