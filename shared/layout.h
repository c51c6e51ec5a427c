// shared/layout.h — the unit parameter layout: the spine that the model, the ZeRO-3 trainer, the rollout
// server, checkpoints and the weight sync all share (docs/layout.md).
//
// Parameters live in units: unit 0 = token embedding, units 1..L = decoder layers, unit L+1 = final norm
// (+ lm_head when the embeddings are untied). Each unit is one flat contiguous buffer; every tensor sits at a
// fixed offset (in elements, aligned to LAYOUT_ALIGN) inside it. All decoder-layer units share one set of
// offsets (LayerOffsets), so the model code addresses a layer as `unit_base + off.wq`.
// Within a layer, q_proj, k_proj and v_proj are adjacent (and so are their biases) so they form one fused
// (Hq*D + 2 Hkv*D, C) weight, and gate_proj and up_proj are adjacent so they form one fused (2I, C) weight.
#ifndef TANDEM_SHARED_LAYOUT_H
#define TANDEM_SHARED_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "shared/config.h"

// Tensor offsets are multiples of 64 elements: 128-byte aligned in bf16, 256 in fp32 (vector loads, cuBLASLt).
#define LAYOUT_ALIGN 64
#define LAYOUT_NAME_MAX 96

typedef struct {
    char name[LAYOUT_NAME_MAX]; // Hugging Face tensor name, e.g. "model.layers.3.self_attn.q_proj.weight"
    int unit;
    size_t offset;              // elements from the unit's start
    int ndim;                   // 1 or 2
    int64_t shape[2];
    size_t numel;
} LayoutTensor;

// Offsets (elements) of one decoder layer's tensors inside its unit; SIZE_MAX when the tensor is absent.
typedef struct {
    size_t ln1;        // input_layernorm.weight (C)
    size_t wq;         // q_proj.weight (Hq*D, C), followed directly by
    size_t wk;         //   k_proj.weight (Hkv*D, C), followed directly by
    size_t wv;         //   v_proj.weight (Hkv*D, C): the fused (Hq*D + 2 Hkv*D, C) weight starts at wq
    size_t bq, bk, bv; // q/k/v_proj.bias (Hq*D), (Hkv*D), (Hkv*D), adjacent — attention_bias only
    size_t q_norm;     // q_norm.weight (D) — Qwen3 only
    size_t k_norm;     // k_norm.weight (D) — Qwen3 only
    size_t wo;         // o_proj.weight (C, Hq*D)
    size_t ln2;        // post_attention_layernorm.weight (C)
    size_t wgu;        // gate_proj.weight (I, C) followed by up_proj.weight (I, C) = fused (2I, C)
    size_t wdown;      // down_proj.weight (C, I)
} LayerOffsets;

typedef struct {
    int n_units;           // L + 2
    size_t *unit_numel;    // (n_units) elements of each unit (a multiple of LAYOUT_ALIGN)
    size_t max_unit_numel;
    size_t total_numel;    // sum over units (parameters plus alignment padding)
    size_t n_params;       // true parameter count (no padding; tied lm_head counted once)
    LayoutTensor *tensors; // (n_tensors) in unit order, then offset order
    int n_tensors;
    LayerOffsets layer;
    size_t embed;          // unit 0: embed_tokens.weight (V, C)
    size_t final_norm;     // unit L+1: norm.weight (C)
    size_t lm_head;        // unit L+1: lm_head.weight (V, C); SIZE_MAX when tied (read unit 0 at `embed`)
    uint64_t hash;         // FNV-1a over names, units, offsets and shapes: peers compare it before a weight sync
} Layout;

int layout_build(Layout *layout, const ModelConfig *cfg, char *err, size_t err_len);
void layout_free(Layout *layout);
// Index of the tensor with this HF name, or -1.
int layout_find(const Layout *layout, const char *name);
// Elements of `unit` after padding it so that it splits into n_shards equal, LAYOUT_ALIGN-aligned slices.
size_t layout_padded_unit_numel(const Layout *layout, int unit, int n_shards);
// Unit index of decoder layer l (0-based) and of the final unit.
static inline int layout_layer_unit(int l) { return 1 + l; }
static inline int layout_final_unit(const Layout *layout) { return layout->n_units - 1; }

#endif
