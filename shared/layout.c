// shared/layout.c — builds the unit layout from a model config (see shared/layout.h).
#include "shared/layout.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Layout *layout;
    int cap;
    size_t cursor; // next free element in the unit being built
    int unit;
} Builder;

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Appends a tensor to the current unit and returns its offset, or SIZE_MAX on allocation failure.
static size_t add_tensor(Builder *b, const char *name, int ndim, int64_t d0, int64_t d1) {
    Layout *L = b->layout;
    if (L->n_tensors == b->cap) {
        int cap = b->cap ? b->cap * 2 : 64;
        LayoutTensor *t = realloc(L->tensors, (size_t)cap * sizeof *t);
        if (!t) return SIZE_MAX;
        L->tensors = t;
        b->cap = cap;
    }
    LayoutTensor *t = &L->tensors[L->n_tensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->unit = b->unit;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = ndim == 2 ? d1 : 1;
    t->numel = (size_t)d0 * (size_t)(ndim == 2 ? d1 : 1);
    t->offset = b->cursor;
    b->cursor = align_up(b->cursor + t->numel, LAYOUT_ALIGN);
    L->n_params += t->numel;
    return t->offset;
}

// Places the next tensor directly after the one at `start` (numel elements), dropping the alignment padding: for
// tensors that the model reads as one fused matrix. A no-op when numel is a multiple of LAYOUT_ALIGN.
static void pack_after(Builder *b, size_t start, size_t numel) { b->cursor = start + numel; }

static void end_unit(Builder *b) {
    b->layout->unit_numel[b->unit] = b->cursor;
    b->unit++;
    b->cursor = 0;
}

static uint64_t fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 1099511628211ULL; }
    return h;
}

int layout_build(Layout *layout, const ModelConfig *cfg, char *err, size_t err_len) {
    memset(layout, 0, sizeof *layout);
    const int64_t C = cfg->hidden_size, I = cfg->intermediate_size, V = cfg->vocab_size, D = cfg->head_dim;
    const int64_t QD = (int64_t)cfg->num_heads * D, KVD = (int64_t)cfg->num_kv_heads * D;
    layout->n_units = cfg->num_layers + 2;
    layout->unit_numel = calloc((size_t)layout->n_units, sizeof(size_t));
    if (!layout->unit_numel) goto oom;
    Builder b = {.layout = layout};
    char name[LAYOUT_NAME_MAX];
    size_t off;
#define ADD(dst, nd, d0, d1)                                   \
    do {                                                       \
        if ((off = add_tensor(&b, name, nd, d0, d1)) == SIZE_MAX) goto oom; \
        dst = off;                                             \
    } while (0)

    snprintf(name, sizeof name, "model.embed_tokens.weight");
    ADD(layout->embed, 2, V, C);
    end_unit(&b);

    LayerOffsets lo;
    memset(&lo, 0xff, sizeof lo); // SIZE_MAX = absent
    for (int l = 0; l < cfg->num_layers; l++) {
        LayerOffsets cur;
        memset(&cur, 0xff, sizeof cur);
#define LNAME(suffix) snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix)
        LNAME("input_layernorm.weight");            ADD(cur.ln1, 1, C, 0);
        // q, k and v must be adjacent with no padding between them (weights, and biases when present): they are
        // read as one fused (QD + 2 KVD, C) matrix with one (QD + 2 KVD) bias (model_layer.c).
        LNAME("self_attn.q_proj.weight");           ADD(cur.wq, 2, QD, C);
        pack_after(&b, cur.wq, (size_t)(QD * C));
        LNAME("self_attn.k_proj.weight");           ADD(cur.wk, 2, KVD, C);
        pack_after(&b, cur.wk, (size_t)(KVD * C));
        LNAME("self_attn.v_proj.weight");           ADD(cur.wv, 2, KVD, C);
        if (cfg->attention_bias) {
            LNAME("self_attn.q_proj.bias");         ADD(cur.bq, 1, QD, 0);
            pack_after(&b, cur.bq, (size_t)QD);
            LNAME("self_attn.k_proj.bias");         ADD(cur.bk, 1, KVD, 0);
            pack_after(&b, cur.bk, (size_t)KVD);
            LNAME("self_attn.v_proj.bias");         ADD(cur.bv, 1, KVD, 0);
        }
        if (cfg->qk_norm) {
            LNAME("self_attn.q_norm.weight");       ADD(cur.q_norm, 1, D, 0);
            LNAME("self_attn.k_norm.weight");       ADD(cur.k_norm, 1, D, 0);
        }
        LNAME("self_attn.o_proj.weight");           ADD(cur.wo, 2, C, QD);
        LNAME("post_attention_layernorm.weight");   ADD(cur.ln2, 1, C, 0);
        // gate and up must be adjacent with no padding between them: they are read as one (2I, C) matrix.
        LNAME("mlp.gate_proj.weight");              ADD(cur.wgu, 2, I, C);
        pack_after(&b, cur.wgu, (size_t)(I * C));
        size_t up;
        LNAME("mlp.up_proj.weight");                ADD(up, 2, I, C);
        LNAME("mlp.down_proj.weight");              ADD(cur.wdown, 2, C, I);
#undef LNAME
        (void)up;
        lo = cur;
        end_unit(&b);
    }
    layout->layer = lo;

    snprintf(name, sizeof name, "model.norm.weight");
    ADD(layout->final_norm, 1, C, 0);
    layout->lm_head = SIZE_MAX;
    if (!cfg->tie_word_embeddings) {
        snprintf(name, sizeof name, "lm_head.weight");
        ADD(layout->lm_head, 2, V, C);
    }
    end_unit(&b);
#undef ADD

    uint64_t h = 1469598103934665603ULL;
    for (int u = 0; u < layout->n_units; u++) {
        layout->total_numel += layout->unit_numel[u];
        if (layout->unit_numel[u] > layout->max_unit_numel) layout->max_unit_numel = layout->unit_numel[u];
    }
    for (int i = 0; i < layout->n_tensors; i++) {
        const LayoutTensor *t = &layout->tensors[i];
        h = fnv1a(h, t->name, strlen(t->name) + 1);
        int64_t rec[5] = {t->unit, (int64_t)t->offset, t->ndim, t->shape[0], t->shape[1]};
        h = fnv1a(h, rec, sizeof rec);
    }
    layout->hash = h;
    return 0;
oom:
    layout_free(layout);
    snprintf(err, err_len, "out of memory building the parameter layout");
    return -1;
}

void layout_free(Layout *layout) {
    free(layout->unit_numel);
    free(layout->tensors);
    memset(layout, 0, sizeof *layout);
}

int layout_find(const Layout *layout, const char *name) {
    for (int i = 0; i < layout->n_tensors; i++)
        if (strcmp(layout->tensors[i].name, name) == 0) return i;
    return -1;
}

size_t layout_padded_unit_numel(const Layout *layout, int unit, int n_shards) {
    size_t q = (size_t)n_shards * LAYOUT_ALIGN;
    return align_up(layout->unit_numel[unit], q);
}
