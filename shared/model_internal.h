// shared/model_internal.h — pieces shared by the model's training and inference paths (not a public API).
#ifndef TANDEM_SHARED_MODEL_INTERNAL_H
#define TANDEM_SHARED_MODEL_INTERNAL_H

#include "shared/model.h"
#include "shared/model_lora.h"

// Element `off` of a storage-dtype buffer.
static inline void *elem_at(const Model *m, const void *base, size_t off) {
    return (char *)base + off * ops_dtype_size(m->ops);
}

// One decoder layer's forward intermediates for N tokens (storage dtype unless marked fp32).
typedef struct {
    void *h1;      // (N, C) input_layernorm output
    void *qkv;     // (N, Hq*D + 2 Hkv*D) fused [q | k | v] projection, split into q_pre, k_pre, v right away: scratch,
                   // never read after the layer's forward (training points it at LayerGrads.dqkv, see
                   // layer_acts_alloc)
    void *q_pre;   // (N, Hq*D) q projection before q_norm (== q when there is no q_norm)
    void *k_pre;   // (N, Hkv*D) k projection before k_norm (== k when there is no k_norm)
    void *q;       // (N, Hq, D) after q_norm and RoPE
    void *k;       // (N, Hkv, D) after k_norm and RoPE
    void *v;       // (N, Hkv, D)
    void *att;     // (N, Hq*D) attention output
    void *xmid;    // (N, C) residual after attention
    void *h2;      // (N, C) post_attention_layernorm output
    void *gu;      // (N, 2I) fused gate|up projection
    void *act;     // (N, I) silu(gate) * up
    float *rstd1;  // (N)
    float *rstd2;  // (N)
    float *q_rstd; // (N*Hq) qk_norm only
    float *k_rstd; // (N*Hkv) qk_norm only
    float *lse;    // (N, Hq) attention log-sum-exp (training only)
    size_t bytes;  // backend memory of the block that layer_acts_alloc carved these from
} LayerActs;

// Backward scratch for one layer (storage dtype).
typedef struct {
    void *dh;      // (N, C)
    void *dq;      // (N, Hq*D)
    void *dk;      // (N, Hkv*D)
    void *dv;      // (N, Hkv*D)
    void *dqkv;    // (N, Hq*D + 2 Hkv*D) [dq | dk | dv] packed for the fused projection's backward
    void *dq_pre;  // (N, Hq*D) qk_norm only
    void *dk_pre;  // (N, Hkv*D) qk_norm only
    void *datt;    // (N, Hq*D)
    void *dgu;     // (N, 2I)
    void *dact;    // (N, I)
    size_t bytes;  // backend memory of the block
} LayerGrads;

// How attention sees the tokens: packed training sequences, or a paged KV cache.
typedef struct {
    int paged;
    const int32_t *cu_seqlens; // training: (B+1) backend memory
    int n_seqs;
    void *k_cache, *v_cache;   // paged: this layer's pools
    const int32_t *slot_mapping, *block_tables, *token_seq; // backend memory
    int max_blocks, block_size;
    // Training: a->att and a->lse hold this layer's attention output and log-sum-exp already (kept from the first
    // forward, for a checkpoint recompute): the forward skips the attention itself.
    int reuse_att;
    // Paged, decode-only: every token with a slot is its sequence's only token in the step (the padded decode
    // steps), so the split, RoPE, cache store and attention may run as one op (ops_attention_paged_decode_fwd).
    int decode;
} AttnArgs;

// What layer_acts_alloc carves. Training: the attention's lse too; the fused projection's scratch qkv is then left
// NULL for the caller to point at its LayerGrads' dqkv (same size; a layer's forward is done with qkv before any
// backward writes dqkv), so that every slot shares one. KEPT_ATT: att and lse are left NULL too — the caller points
// them at the buffers of the layer about to run (activation checkpointing keeps them per layer).
enum { LAYER_ACTS_INFERENCE = 0, LAYER_ACTS_TRAINING = 1, LAYER_ACTS_TRAINING_KEPT_ATT = 2 };
// Allocates LayerActs for N tokens in one block of backend memory; *block receives it (free with ops_free).
// mode: LAYER_ACTS_* (above).
int layer_acts_alloc(const Model *m, LayerActs *a, int N, int mode, void **block);
int layer_grads_alloc(const Model *m, LayerGrads *g, int N, void **block);

// One layer, x_out = layer(x_in), with the residual add that ends it fused into the RMSNorm that follows it (the
// next layer's input norm, or the final norm), so that the residual stream is not read twice; p = the layer's unit
// parameters; positions (N) backend memory:
//   x (N, C): on entry the layer's input minus `pending`, on return the complete input. pending (N, C) is the
//     previous layer's a->xmid — that layer wrote only its MLP output into x — or NULL when x is complete already
//     (the embedding output; a recompute for backward). x += pending is fused with h1 = rmsnorm(x).
//   mlp_out (N, C) receives act Wd^T: the layer's output minus a->xmid, completed by the next call (or by
//     ops_residual_rmsnorm_fwd for the final norm). NULL skips the down projection: backward needs only act.
// The values are those of the unfused order (add, then norm), bit for bit.
void layer_forward_fused(Model *m, const void *p, LayerActs *a, void *x, const void *pending, void *mlp_out,
                         const int32_t *positions, int N, const AttnArgs *att);
// One layer of a decode step of a few rows (padded sizes 1 and 2), x_out (N, C) = layer(x) with x and x_out complete
// (no pending half): each projection runs with its neighbouring norm, SwiGLU or residual add folded in
// (ops_matmul_fused_fwd), and the q/k/v projection (without qk-norm) with RoPE and the KV cache store too: five
// kernels (and the attention's merge of context splits) where the general path has nine. att must be paged. The values are those of
// layer_forward_fused followed by the residual add, up to the last bits of the norms (another summation order on the
// GPU).
void layer_decode_small(Model *m, const void *p, LayerActs *a, const void *x, void *x_out, const int32_t *positions,
                        int N, const AttnArgs *att);
// The LoRA adapter path of a projection group (shared/model_lora.c), for layer m->lora->layer; no-ops without
// adapters or when the group has no targeted module. lora_forward: y (N, width) += the group's adapters' outputs
// for input x (N, in), keeping each module's s * x A^T for the backward. lora_backward: dx (N, in) += the input
// gradient through the adapters, and the adapters' gradients += theirs, for the group output's gradient dy.
enum { LORA_GROUP_QKV, LORA_GROUP_O, LORA_GROUP_GU, LORA_GROUP_DOWN };
void lora_forward(Model *m, int group, const void *x, void *y, int N);
void lora_backward(Model *m, int group, const void *dy, const void *x, void *dx, int N);
// The adapters of an inference step (m->lora_rows, layer m->lora_rows->layer): y (N, width) += each row range's
// adapter outputs for input x (N, in). A no-op without ranges.
void lora_rows_forward(Model *m, int group, const void *x, void *y, int N);

// dres (N, C) holds d x_out on entry and d x_in on return; g (unit numel fp32) accumulates parameter grads.
void layer_backward(Model *m, const void *p, float *g, const LayerActs *a, const LayerGrads *d, void *dres,
                    const void *x_in, const int32_t *positions, int N, const AttnArgs *att);

#endif
