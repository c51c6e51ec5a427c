// shared/model_layer.c — one decoder layer, forward and backward, written against kernels/ops.h.
//
//   h1 = rmsnorm(x) ; [q|k|v] = h1 [Wq;Wk;Wv]^T (+[bq|bk|bv]) ; [qk_norm] ; rope(q, k) ; att = attention(q, k, v)
//   xmid = x + att Wo^T ; h2 = rmsnorm(xmid) ; gu = h2 [Wg;Wu]^T ; act = silu(g) * u ; x_out = xmid + act Wd^T
// Each residual add runs fused with the RMSNorm after it (ops_residual_rmsnorm_fwd): xmid's inside the layer, and
// x_out's — in the training forward — with the next layer's input norm (layer_forward_fused). The backward needs no
// separate add either: the norms' backward adds their input gradient into the residual stream's gradient.
// q, k and v come from one GEMM over the fused weight (shared/layout.h keeps them adjacent): the k and v projections
// alone are thin (Hkv*D rows) and slow. The fused output is split into contiguous q, k, v (rope, qk_norm, attention
// and the KV cache read those), and backward packs dq, dk, dv back into one buffer for one GEMM; without qk_norm
// the split and the pack run fused with RoPE (ops_qkv_rope_fwd / _bwd).
#include <stdint.h>

#include "shared/model_internal.h"

#define ABSENT SIZE_MAX

// Carves consecutive, 64-element-aligned buffers out of one allocation.
typedef struct {
    char *base;
    size_t used, es;
} Carver;

static void *carve(Carver *c, size_t elems, size_t elem_size) {
    size_t bytes = (elems * elem_size + 255) / 256 * 256;
    void *p = c->base ? c->base + c->used : NULL;
    c->used += bytes;
    return p;
}

// Returns the block's size in bytes, or 0 on allocation failure.
static size_t alloc_carved(const Model *m, void **block, Carver *c,
                           void (*assign)(const Model *, Carver *, void *, int, int), void *target, int N, int flag) {
    // First pass measures, second assigns.
    Carver measure = {.base = NULL, .used = 0, .es = ops_dtype_size(m->ops)};
    assign(m, &measure, target, N, flag);
    *block = ops_malloc(m->ops, measure.used);
    if (!*block) return 0;
    *c = (Carver){.base = *block, .used = 0, .es = measure.es};
    assign(m, c, target, N, flag);
    return measure.used;
}

static void assign_acts(const Model *m, Carver *c, void *target, int N, int mode) {
    LayerActs *a = target;
    const ModelConfig *cfg = &m->cfg;
    size_t C = cfg->hidden_size, I = cfg->intermediate_size, D = cfg->head_dim;
    size_t QD = (size_t)cfg->num_heads * D, KVD = (size_t)cfg->num_kv_heads * D, n = (size_t)N;
    a->h1 = carve(c, n * C, c->es);
    const int training = mode != LAYER_ACTS_INFERENCE, kept_att = mode == LAYER_ACTS_TRAINING_KEPT_ATT;
    a->qkv = training ? NULL : carve(c, n * (QD + 2 * KVD), c->es);
    a->q = carve(c, n * QD, c->es);
    a->k = carve(c, n * KVD, c->es);
    a->v = carve(c, n * KVD, c->es);
    a->q_pre = cfg->qk_norm ? carve(c, n * QD, c->es) : a->q;
    a->k_pre = cfg->qk_norm ? carve(c, n * KVD, c->es) : a->k;
    a->att = kept_att ? NULL : carve(c, n * QD, c->es);
    a->xmid = carve(c, n * C, c->es);
    a->h2 = carve(c, n * C, c->es);
    a->gu = carve(c, n * 2 * I, c->es);
    a->act = carve(c, n * I, c->es);
    a->rstd1 = carve(c, n, 4);
    a->rstd2 = carve(c, n, 4);
    a->q_rstd = cfg->qk_norm ? carve(c, n * cfg->num_heads, 4) : NULL;
    a->k_rstd = cfg->qk_norm ? carve(c, n * cfg->num_kv_heads, 4) : NULL;
    a->lse = training && !kept_att ? carve(c, n * cfg->num_heads, 4) : NULL;
}

static void assign_grads(const Model *m, Carver *c, void *target, int N, int unused) {
    LayerGrads *g = target;
    const ModelConfig *cfg = &m->cfg;
    size_t C = cfg->hidden_size, I = cfg->intermediate_size, D = cfg->head_dim;
    size_t QD = (size_t)cfg->num_heads * D, KVD = (size_t)cfg->num_kv_heads * D, n = (size_t)N;
    g->dh = carve(c, n * C, c->es);
    g->dq = carve(c, n * QD, c->es);
    g->dk = carve(c, n * KVD, c->es);
    g->dv = carve(c, n * KVD, c->es);
    g->dqkv = carve(c, n * (QD + 2 * KVD), c->es);
    g->dq_pre = cfg->qk_norm ? carve(c, n * QD, c->es) : NULL;
    g->dk_pre = cfg->qk_norm ? carve(c, n * KVD, c->es) : NULL;
    g->datt = carve(c, n * QD, c->es);
    g->dgu = carve(c, n * 2 * I, c->es);
    g->dact = carve(c, n * I, c->es);
}

int layer_acts_alloc(const Model *m, LayerActs *a, int N, int mode, void **block) {
    Carver c;
    a->bytes = alloc_carved(m, block, &c, assign_acts, a, N, mode);
    return a->bytes ? 0 : -1;
}

int layer_grads_alloc(const Model *m, LayerGrads *g, int N, void **block) {
    Carver c;
    g->bytes = alloc_carved(m, block, &c, assign_grads, g, N, 0);
    return g->bytes ? 0 : -1;
}

static const void *param(const Model *m, const void *p, size_t off) { return off == ABSENT ? NULL : elem_at(m, p, off); }

// From the fused projection's output a->qkv to the attention output a->att: q, k, v made contiguous (qk_norm), or
// split and rotated in one pass (the same bits as split, then rope), k and v stored to the cache when paged.
// A decode-only paged step hands the whole of it to ops_attention_paged_decode_fwd.
static void qkv_to_attention(Model *m, const void *p, LayerActs *a, const int32_t *positions, int N,
                             const AttnArgs *att) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const LayerOffsets *lo = &m->layout.layer;
    const int D = cfg->head_dim, Hq = cfg->num_heads, Hkv = cfg->num_kv_heads;
    const size_t QD = (size_t)Hq * D, KVD = (size_t)Hkv * D, QKV = QD + 2 * KVD;
    if (!cfg->qk_norm && att->paged && att->decode) {
        ops_attention_paged_decode_fwd(o, a->att, a->q, att->k_cache, att->v_cache, att->slot_mapping, a->qkv,
                                       att->block_tables, att->token_seq, positions, m->inv_freq, N, Hq, Hkv, D,
                                       att->block_size, att->max_blocks, m->attn_scale);
        return;
    }
    if (cfg->qk_norm) {
        ops_copy_2d(o, a->q_pre, QD, a->qkv, QKV, (size_t)N, QD);
        ops_copy_2d(o, a->k_pre, KVD, elem_at(m, a->qkv, QD), QKV, (size_t)N, KVD);
        ops_copy_2d(o, a->v, KVD, elem_at(m, a->qkv, QD + KVD), QKV, (size_t)N, KVD);
        ops_rmsnorm_fwd(o, a->q, a->q_rstd, a->q_pre, param(m, p, lo->q_norm), N * Hq, D, cfg->rms_norm_eps);
        ops_rmsnorm_fwd(o, a->k, a->k_rstd, a->k_pre, param(m, p, lo->k_norm), N * Hkv, D, cfg->rms_norm_eps);
        ops_rope_fwd(o, a->q, positions, m->inv_freq, N, Hq, D);
        ops_rope_fwd(o, a->k, positions, m->inv_freq, N, Hkv, D);
    } else if (att->paged) {   // k and v go straight to their cache slots
        ops_qkv_rope_store_fwd(o, a->q, att->k_cache, att->v_cache, att->slot_mapping, a->qkv, positions, m->inv_freq,
                               N, Hq, Hkv, D);
    } else {
        ops_qkv_rope_fwd(o, a->q, a->k, a->v, a->qkv, positions, m->inv_freq, N, Hq, Hkv, D);
    }
    if (att->paged) {
        if (cfg->qk_norm)
            ops_kv_cache_store(o, att->k_cache, att->v_cache, a->k, a->v, att->slot_mapping, N, Hkv, D);
        ops_attention_paged_fwd(o, a->att, a->q, att->k_cache, att->v_cache, att->block_tables, att->token_seq,
                                positions, N, Hq, Hkv, D, att->block_size, att->max_blocks, m->attn_scale);
    } else if (!att->reuse_att) {
        ops_attention_fwd(o, a->att, a->lse, a->q, a->k, a->v, att->cu_seqlens, att->n_seqs, N, Hq, Hkv, D,
                          m->attn_scale);
    }
}

// A projection of the layer's forward. The rollout server's steps (paged attention) take the batch-invariant GEMM:
// continuous batching decides by timing which sequences share a step, and a sequence's logits must not depend on
// it. Training takes ops_matmul_fwd (OpenBLAS on the CPU, faster for its thousands of rows); its micro-batches are
// packed the same way run to run.
static void project(Model *m, const AttnArgs *att, void *out, const void *in, const void *w, const void *bias, int N,
                    int IC, int OC) {
    if (att->paged) ops_matmul_fwd_batch_invariant(m->ops, out, in, w, bias, N, IC, OC);
    else ops_matmul_fwd(m->ops, out, in, w, bias, N, IC, OC);
}

// The LoRA adapters of a projection group beside its base GEMM: the training ones (m->lora) in training steps, the
// step's per-row adapters (m->lora_rows) in the rollout server's paged steps.
static void adapters(Model *m, const AttnArgs *att, int group, const void *x, void *y, int N) {
    if (!att->paged) lora_forward(m, group, x, y, N);
    else lora_rows_forward(m, group, x, y, N);
}

// From h1 (in a) to act, given the layer's complete input x_in: attention, then xmid = x_in + att Wo^T fused with
// h2 = rmsnorm(xmid), the gate/up projection and SwiGLU.
static void attention_and_mlp(Model *m, const void *p, LayerActs *a, const void *x_in, const int32_t *positions, int N,
                              const AttnArgs *att) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const LayerOffsets *lo = &m->layout.layer;
    const int C = cfg->hidden_size, I = cfg->intermediate_size, D = cfg->head_dim, Hq = cfg->num_heads;
    const size_t QKV = (size_t)Hq * D + 2 * (size_t)cfg->num_kv_heads * D;

    // One GEMM over the fused weight and bias (both start at q's).
    project(m, att, a->qkv, a->h1, param(m, p, lo->wq), param(m, p, lo->bq), N, C, (int)QKV);
    adapters(m, att, LORA_GROUP_QKV, a->h1, a->qkv, N);
    qkv_to_attention(m, p, a, positions, N, att);
    project(m, att, a->xmid, a->att, param(m, p, lo->wo), NULL, N, Hq * D, C);
    adapters(m, att, LORA_GROUP_O, a->att, a->xmid, N);
    model_shard_reduce(m, a->xmid, NULL, (size_t)N * C);   // o_proj is row-parallel: the shards' partial sums
    ops_residual_rmsnorm_fwd(o, a->xmid, a->h2, a->rstd2, a->xmid, x_in, param(m, p, lo->ln2), N, C,
                             cfg->rms_norm_eps);
    project(m, att, a->gu, a->h2, param(m, p, lo->wgu), NULL, N, C, 2 * I);
    adapters(m, att, LORA_GROUP_GU, a->h2, a->gu, N);
    ops_swiglu_fwd(o, a->act, a->gu, N, I);
}

void layer_decode_small(Model *m, const void *p, LayerActs *a, const void *x, void *x_out, const int32_t *positions,
                        int N, const AttnArgs *att) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const LayerOffsets *lo = &m->layout.layer;
    const int C = cfg->hidden_size, I = cfg->intermediate_size, D = cfg->head_dim, Hq = cfg->num_heads;
    const int QKV = Hq * D + 2 * cfg->num_kv_heads * D;
    const float eps = cfg->rms_norm_eps;
    if (!cfg->qk_norm && att->paged) {
        // q|k|v = rmsnorm(x) [Wq;Wk;Wv]^T + b, split, q and k turned, q to a->q and k, v to their cache slots
        ops_matmul_fused_fwd(o, a->q, x, param(m, p, lo->wq), param(m, p, lo->bq), N, C, QKV,
                             &(OpsProjFusion){.norm_w = param(m, p, lo->ln1), .eps = eps, .h = a->h1,
                                              .rope_store = 1, .qkv = a->qkv, .positions = positions,
                                              .slot_mapping = att->slot_mapping, .inv_freq = m->inv_freq,
                                              .k_cache = att->k_cache, .v_cache = att->v_cache, .Hq = Hq,
                                              .Hkv = cfg->num_kv_heads, .D = D});
        ops_attention_paged_fwd(o, a->att, a->q, att->k_cache, att->v_cache, att->block_tables, att->token_seq,
                                positions, N, Hq, cfg->num_kv_heads, D, att->block_size, att->max_blocks,
                                m->attn_scale);
    } else {
        // qkv = rmsnorm(x) [Wq;Wk;Wv]^T + b
        ops_matmul_fused_fwd(o, a->qkv, x, param(m, p, lo->wq), param(m, p, lo->bq), N, C, QKV,
                             &(OpsProjFusion){.norm_w = param(m, p, lo->ln1), .eps = eps, .h = a->h1});
        qkv_to_attention(m, p, a, positions, N, att);
    }
    // xmid = x + att Wo^T. Tensor-parallel shards sum their partial att Wo^T and add the residual in
    // model_shard_reduce.
    const int sharded = m->shard.size > 1;
    ops_matmul_fused_fwd(o, a->xmid, a->att, param(m, p, lo->wo), NULL, N, Hq * D, C,
                         &(OpsProjFusion){.residual = sharded ? NULL : x});
    if (sharded) model_shard_reduce(m, a->xmid, x, (size_t)N * C);
    // act = swiglu(rmsnorm(xmid) [Wg;Wu]^T)
    ops_matmul_fused_fwd(o, a->act, a->xmid, param(m, p, lo->wgu), NULL, N, C, 2 * I,
                         &(OpsProjFusion){.norm_w = param(m, p, lo->ln2), .eps = eps, .h = a->h2, .swiglu = 1,
                                          .gu = a->gu});
    // x_out = xmid + act Wd^T (sharded: as above)
    ops_matmul_fused_fwd(o, x_out, a->act, param(m, p, lo->wdown), NULL, N, I, C,
                         &(OpsProjFusion){.residual = sharded ? NULL : a->xmid});
    if (sharded) model_shard_reduce(m, x_out, a->xmid, (size_t)N * C);
}

void layer_forward_fused(Model *m, const void *p, LayerActs *a, void *x, const void *pending, void *mlp_out,
                         const int32_t *positions, int N, const AttnArgs *att) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const LayerOffsets *lo = &m->layout.layer;
    const int C = cfg->hidden_size, I = cfg->intermediate_size;

    // x += pending (the previous layer's xmid) and h1 = rmsnorm(x) in one pass; without pending a plain norm.
    ops_residual_rmsnorm_fwd(o, pending ? x : NULL, a->h1, a->rstd1, x, pending, param(m, p, lo->ln1), N, C,
                             cfg->rms_norm_eps);
    attention_and_mlp(m, p, a, x, positions, N, att);
    if (mlp_out) {
        project(m, att, mlp_out, a->act, param(m, p, lo->wdown), NULL, N, I, C);
        adapters(m, att, LORA_GROUP_DOWN, a->act, mlp_out, N);
        model_shard_reduce(m, mlp_out, NULL, (size_t)N * C);   // down_proj is row-parallel
    }
}

// g NULL: a frozen base (LoRA training), whose weight-gradient GEMMs are skipped.
static float *grad_at(float *g, size_t off) { return !g || off == ABSENT ? NULL : g + off; }

void layer_backward(Model *m, const void *p, float *g, const LayerActs *a, const LayerGrads *d, void *dres,
                    const void *x_in, const int32_t *positions, int N, const AttnArgs *att) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const LayerOffsets *lo = &m->layout.layer;
    const int C = cfg->hidden_size, I = cfg->intermediate_size, D = cfg->head_dim;
    const int Hq = cfg->num_heads, Hkv = cfg->num_kv_heads;
    const size_t QD = (size_t)Hq * D, KVD = (size_t)Hkv * D, QKV = QD + 2 * KVD;

    // MLP branch: dres = d x_out = d xmid (residual) + d(mlp) ...
    ops_matmul_bwd(o, d->dact, grad_at(g, lo->wdown), NULL, dres, a->act, param(m, p, lo->wdown), N, I, C, 0);
    lora_backward(m, LORA_GROUP_DOWN, dres, a->act, d->dact, N);
    ops_swiglu_bwd(o, d->dgu, d->dact, a->gu, N, I);
    ops_matmul_bwd(o, d->dh, grad_at(g, lo->wgu), NULL, d->dgu, a->h2, param(m, p, lo->wgu), N, C, 2 * I, 0);
    lora_backward(m, LORA_GROUP_GU, d->dgu, a->h2, d->dh, N);
    ops_residual_rmsnorm_bwd(o, dres, grad_at(g, lo->ln2), dres, d->dh, a->xmid, param(m, p, lo->ln2), a->rstd2, N,
                             C);
    // Attention branch: dres now = d xmid.
    ops_matmul_bwd(o, d->datt, grad_at(g, lo->wo), NULL, dres, a->att, param(m, p, lo->wo), N, Hq * D, C, 0);
    lora_backward(m, LORA_GROUP_O, dres, a->att, d->datt, N);
    ops_attention_bwd(o, d->dq, d->dk, d->dv, d->datt, a->q, a->k, a->v, a->att, a->lse, att->cu_seqlens,
                      att->n_seqs, N, Hq, Hkv, D, m->attn_scale);
    // [dq | dk | dv] packed (after RoPE's backward, and qk_norm's), then one GEMM: dh, and dW / dbias of the fused
    // weight, which land on the three tensors' gradients (the fp32 gradient buffer has the parameters' offsets).
    // Without qk_norm the rotation back and the pack are one pass.
    if (cfg->qk_norm) {
        ops_rope_bwd(o, d->dq, positions, m->inv_freq, N, Hq, D);
        ops_rope_bwd(o, d->dk, positions, m->inv_freq, N, Hkv, D);
        // No residual here: dres_in NULL overwrites dq_pre / dk_pre.
        ops_residual_rmsnorm_bwd(o, d->dq_pre, grad_at(g, lo->q_norm), NULL, d->dq, a->q_pre, param(m, p, lo->q_norm),
                                 a->q_rstd, N * Hq, D);
        ops_residual_rmsnorm_bwd(o, d->dk_pre, grad_at(g, lo->k_norm), NULL, d->dk, a->k_pre, param(m, p, lo->k_norm),
                                 a->k_rstd, N * Hkv, D);
        ops_copy_2d(o, d->dqkv, QKV, d->dq_pre, QD, (size_t)N, QD);
        ops_copy_2d(o, elem_at(m, d->dqkv, QD), QKV, d->dk_pre, KVD, (size_t)N, KVD);
        ops_copy_2d(o, elem_at(m, d->dqkv, QD + KVD), QKV, d->dv, KVD, (size_t)N, KVD);
    } else {
        ops_qkv_rope_bwd(o, d->dqkv, d->dq, d->dk, d->dv, positions, m->inv_freq, N, Hq, Hkv, D);
    }
    ops_matmul_bwd(o, d->dh, grad_at(g, lo->wq), grad_at(g, lo->bq), d->dqkv, a->h1, param(m, p, lo->wq), N, C,
                   (int)QKV, 0);
    lora_backward(m, LORA_GROUP_QKV, d->dqkv, a->h1, d->dh, N);
    ops_residual_rmsnorm_bwd(o, dres, grad_at(g, lo->ln1), dres, d->dh, x_in, param(m, p, lo->ln1), a->rstd1, N, C);
}
