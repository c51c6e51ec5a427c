// shared/model_lora.c — LoRA adapters: their configuration, layout, init, memory, and the adapter path of a
// projection's forward and backward (called from shared/model_layer.c).
//
// Forward of module i of a projection group (q|k|v, o, gate|up, down), input x (N, in), group output y (N, width):
//   t_i (N, r) = s * (x A_i^T)           kept per layer for the backward (ops_scale_inplace applies s); with
//                                        lora_dropout p, x is x * mask_i / (1 - p) (ops_dropout, seeded per layer and
//                                        module, regenerated in the backward: dx then passes through the same mask)
//   y[:, cols_i] += t_i B_i^T            one GEMM into scratch, added into the module's columns of y
// Backward, with dy the group output's gradient (its columns cols_i = dy_i):
//   dt (N, r) = dy_i B_i ; dB_i += dy_i^T t_i       (one ops_matmul_bwd)
//   dt *= s ; dx += dt A_i ; dA_i += dt^T x          (a second one, accumulating into the base path's dx)
// which are the derivatives of y = s (x A^T) B^T: dB = s dy^T (x A^T), dA = s (dy B)^T x, dx = s dy B A.
#include "shared/model_lora.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/model_internal.h"

static const char *const MODULE_NAMES[LORA_N_MODULES] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"};

const char *lora_module_name(int module) {
    return module >= 0 && module < LORA_N_MODULES ? MODULE_NAMES[module] : "?";
}

int lora_parse_targets(const char *text, unsigned *targets, char *err, size_t err_len) {
    *targets = 0;
    if (!text || !*text) {
        snprintf(err, err_len, "lora_target_modules is empty: give PEFT module names (q_proj,k_proj,v_proj,o_proj,"
                 "gate_proj,up_proj,down_proj) or all-linear");
        return -1;
    }
    const char *p = text;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        while (n > 0 && (*p == ' ' || *p == '[' || *p == '"' || *p == '\'')) p++, n--;
        while (n > 0 && (p[n - 1] == ' ' || p[n - 1] == ']' || p[n - 1] == '"' || p[n - 1] == '\'')) n--;
        int found = -1;
        if (n == 10 && strncmp(p, "all-linear", 10) == 0) {
            *targets |= LORA_ALL_TARGETS;
            found = LORA_N_MODULES;
        }
        for (int i = 0; i < LORA_N_MODULES && found < 0; i++)
            if (strlen(MODULE_NAMES[i]) == n && strncmp(p, MODULE_NAMES[i], n) == 0) found = i;
        if (found < 0) {
            snprintf(err, err_len, "lora_target_modules: unknown module '%.*s' (tandem's decoder has q_proj, k_proj, "
                     "v_proj, o_proj, gate_proj, up_proj, down_proj; or all-linear)", (int)n, p);
            return -1;
        }
        if (found < LORA_N_MODULES) *targets |= 1u << found;
        if (!end) break;
        p = end + 1;
    }
    if (!*targets) {
        snprintf(err, err_len, "lora_target_modules '%s' names no module", text);
        return -1;
    }
    return 0;
}

void lora_targets_text(unsigned targets, char *out, size_t len) {
    size_t used = 0;
    out[0] = '\0';
    for (int i = 0; i < LORA_N_MODULES; i++)
        if (targets & (1u << i)) {
            int n = snprintf(out + used, len - used, "%s%s", used ? "," : "", MODULE_NAMES[i]);
            if (n < 0 || (size_t)n >= len - used) return;
            used += (size_t)n;
        }
}

int lora_parse_init(const char *text, LoraInit *out, char *err, size_t err_len) {
    if (!strcmp(text, "default") || !strcmp(text, "true") || !strcmp(text, "True")) *out = LORA_INIT_DEFAULT;
    else if (!strcmp(text, "gaussian")) *out = LORA_INIT_GAUSSIAN;
    else {
        snprintf(err, err_len, "lora_init '%s' is not supported: use default (PEFT's init_lora_weights=True: "
                 "kaiming-uniform A, zero B) or gaussian", text);
        return -1;
    }
    return 0;
}

int lora_config_check(const LoraConfig *c, char *err, size_t err_len) {
    if (c->r < 1) {
        snprintf(err, err_len, "lora_r must be >= 1 (got %d)", c->r);
        return -1;
    }
    if (!(c->alpha > 0) || !isfinite(c->alpha)) {
        snprintf(err, err_len, "lora_alpha must be a positive number (got %g)", (double)c->alpha);
        return -1;
    }
    if (!(c->dropout >= 0.0f && c->dropout < 1.0f)) {
        snprintf(err, err_len, "lora_dropout must be in [0, 1) (got %g)", (double)c->dropout);
        return -1;
    }
    if (!(c->targets & LORA_ALL_TARGETS)) {
        snprintf(err, err_len, "lora_target_modules names no module");
        return -1;
    }
    return 0;
}

float lora_scale(const LoraConfig *c) {
    return c->use_rslora ? c->alpha / sqrtf((float)c->r) : c->alpha / (float)c->r;
}

static size_t align_up(size_t n) { return (n + LAYOUT_ALIGN - 1) / LAYOUT_ALIGN * LAYOUT_ALIGN; }

// Each module's in and out sizes and its A's and B's offsets in an adapter unit (SIZE_MAX when not targeted);
// returns the unit's elements.
static size_t unit_layout(const ModelConfig *cfg, const LoraConfig *c, int *in, int *out, size_t *a_off,
                          size_t *b_off) {
    const int C = cfg->hidden_size, I = cfg->intermediate_size, QD = cfg->num_heads * cfg->head_dim,
              KVD = cfg->num_kv_heads * cfg->head_dim;
    const int ins[LORA_N_MODULES] = {C, C, C, QD, C, C, I}, outs[LORA_N_MODULES] = {QD, KVD, KVD, C, I, I, C};
    size_t off = 0;
    for (int i = 0; i < LORA_N_MODULES; i++) {
        in[i] = ins[i];
        out[i] = outs[i];
        a_off[i] = b_off[i] = SIZE_MAX;
        if (!(c->targets & (1u << i))) continue;
        a_off[i] = off;
        off = align_up(off + (size_t)c->r * ins[i]);
        b_off[i] = off;
        off = align_up(off + (size_t)outs[i] * c->r);
    }
    return off;
}

size_t model_lora_unit_numel(const ModelConfig *cfg, const LoraConfig *c) {
    int in[LORA_N_MODULES], out[LORA_N_MODULES];
    size_t a[LORA_N_MODULES], b[LORA_N_MODULES];
    return unit_layout(cfg, c, in, out, a, b);
}

int model_lora_create(ModelLora **out, const Model *m, const LoraConfig *c, int with_grads, char *err,
                      size_t err_len) {
    *out = NULL;
    if (lora_config_check(c, err, err_len) != 0) return -1;
    if (m->shard.size > 1) {
        snprintf(err, err_len, "LoRA adapters on a tensor-parallel shard are not supported");
        return -1;
    }
    ModelLora *l = calloc(1, sizeof *l);
    if (!l) goto oom;
    const ModelConfig *cfg = &m->cfg;
    const int r = c->r;
    l->cfg = *c;
    l->scale = lora_scale(c);
    l->n_layers = cfg->num_layers;
    l->ops = m->ops;
    l->unit_numel = unit_layout(cfg, c, l->in, l->out, l->a_off, l->b_off);
    int per_layer = 0;
    for (int i = 0; i < LORA_N_MODULES; i++) per_layer += 2 * (l->a_off[i] != SIZE_MAX);
    const int *in = l->in, *outd = l->out;
    l->n_tensors = per_layer * l->n_layers;
    l->tensors = calloc((size_t)l->n_tensors, sizeof *l->tensors);
    l->params = calloc((size_t)l->n_layers, sizeof(void *));
    if (with_grads) l->grads = calloc((size_t)l->n_layers, sizeof(float *));
    if (!l->tensors || !l->params || (with_grads && !l->grads)) goto oom;
    int k = 0;
    for (int layer = 0; layer < l->n_layers; layer++)
        for (int i = 0; i < LORA_N_MODULES; i++) {
            if (!(c->targets & (1u << i))) continue;
            const char *block = i <= LORA_O_PROJ ? "self_attn" : "mlp";
            for (int ab = 0; ab < 2; ab++) {
                LayoutTensor *t = &l->tensors[k++];
                snprintf(t->name, sizeof t->name, "base_model.model.model.layers.%d.%s.%s.lora_%c.weight", layer,
                         block, MODULE_NAMES[i], ab ? 'B' : 'A');
                t->unit = layer;
                t->offset = ab ? l->b_off[i] : l->a_off[i];
                t->ndim = 2;
                t->shape[0] = ab ? outd[i] : r;
                t->shape[1] = ab ? r : in[i];
                t->numel = (size_t)outd[i] * r * ab + (size_t)r * in[i] * !ab;
            }
        }
    const size_t es = ops_dtype_size(m->ops);
    for (int layer = 0; layer < l->n_layers; layer++) {
        if (!(l->params[layer] = ops_malloc(m->ops, l->unit_numel * es))) goto oom;
        if (with_grads && !(l->grads[layer] = ops_malloc(m->ops, l->unit_numel * sizeof(float)))) goto oom;
    }
    *out = l;
    return 0;
oom:
    snprintf(err, err_len, "out of memory for LoRA adapters (r %d): %s", c->r, ops_error(m->ops));
    model_lora_free(l);
    return -1;
}

void model_lora_free(ModelLora *l) {
    if (!l) return;
    for (int layer = 0; layer < l->n_layers; layer++) {
        if (l->params) ops_free(l->ops, l->params[layer]);
        if (l->grads) ops_free(l->ops, l->grads[layer]);
    }
    if (l->act_block) ops_free(l->ops, l->act_block);
    for (int layer = 0; l->serve && layer < l->n_layers; layer++) ops_free(l->ops, l->serve[layer]);
    free(l->serve);
    free(l->params);
    free(l->grads);
    free(l->tensors);
    free(l);
}

static size_t max_i(size_t a, size_t b) { return a > b ? a : b; }

int model_lora_reserve(ModelLora *l, int max_tokens, char *err, size_t err_len) {
    if (max_tokens <= l->max_tokens) return 0;
    const size_t es = ops_dtype_size(l->ops), N = (size_t)max_tokens, r = (size_t)l->cfg.r;
    size_t out_max = 0;
    for (int i = 0; i < LORA_N_MODULES; i++) out_max = max_i(out_max, (size_t)l->out[i]);
    const size_t qkv = (size_t)l->out[LORA_Q_PROJ] + 2 * (size_t)l->out[LORA_K_PROJ];
    const size_t sum_w = max_i(qkv, 2 * (size_t)l->out[LORA_GATE_PROJ]);
    size_t in_max = 0;
    for (int i = 0; i < LORA_N_MODULES; i++) in_max = max_i(in_max, (size_t)l->in[i]);
    const size_t t_bytes = (size_t)l->n_layers * LORA_N_MODULES * N * r * es;
    const size_t drop_bytes = l->cfg.dropout > 0 ? 2 * N * in_max * es : 0;
    const size_t bytes = t_bytes + N * out_max * es + N * sum_w * es + N * r * es + drop_bytes;
    void *block = ops_malloc(l->ops, bytes);
    if (!block) {
        snprintf(err, err_len, "out of memory for LoRA activations (%d tokens): %s", max_tokens, ops_error(l->ops));
        return -1;
    }
    if (l->act_block) ops_free(l->ops, l->act_block);
    l->act_block = block;
    l->tmp = (char *)block + t_bytes;
    l->sum = (char *)l->tmp + N * out_max * es;
    l->dt = (char *)l->sum + N * sum_w * es;
    l->xd = drop_bytes ? (char *)l->dt + N * r * es : NULL;
    l->dxd = drop_bytes ? (char *)l->xd + N * in_max * es : NULL;
    l->max_tokens = max_tokens;
    return 0;
}

void model_lora_zero_grads(ModelLora *l) {
    if (!l->grads) return;
    for (int layer = 0; layer < l->n_layers; layer++)
        ops_memset_zero(l->ops, l->grads[layer], l->unit_numel * sizeof(float));
}

// splitmix64: a deterministic stream per (seed, layer, module), so one module's values do not depend on which others
// are targeted.
static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

uint64_t lora_dropout_seed(uint64_t seed, int64_t step, int micro, int rank) {
    return mix64(mix64(mix64(seed + 0x9E3779B97F4A7C15ULL) + (uint64_t)step) + ((uint64_t)micro << 20) +
                 (uint64_t)rank);
}

uint64_t lora_module_dropout_seed(uint64_t seed, int layer, int module) {
    return mix64(seed + (uint64_t)(layer * LORA_N_MODULES + module + 1) * 0xD1B54A32D192ED03ULL);
}

static double uniform01(uint64_t *s) { return ((splitmix64(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

void model_lora_init_unit(const ModelLora *l, uint64_t seed, int layer, float *host) {
    memset(host, 0, l->unit_numel * sizeof(float));
    const int r = l->cfg.r;
    for (int i = 0; i < LORA_N_MODULES; i++) {
        if (l->a_off[i] == SIZE_MAX) continue;
        uint64_t st = seed ^ (0xA24BAED4963EE407ULL * (uint64_t)(layer * LORA_N_MODULES + i + 1));
        float *a = host + l->a_off[i];
        const size_t n = (size_t)r * l->in[i];
        if (l->cfg.init == LORA_INIT_GAUSSIAN) {
            // normal(0, 1/r), Box-Muller
            for (size_t k = 0; k < n; k++) {
                double u1 = uniform01(&st), u2 = uniform01(&st);
                a[k] = (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2) / r);
            }
        } else {
            // kaiming_uniform_(a = sqrt(5)) on (r, in): gain sqrt(2 / 6), bound gain * sqrt(3 / in) = 1 / sqrt(in)
            const double bound = 1.0 / sqrt((double)l->in[i]);
            for (size_t k = 0; k < n; k++) a[k] = (float)((2.0 * uniform01(&st) - 1.0) * bound);
        }
    }
}

int model_lora_init(ModelLora *l, uint64_t seed, char *err, size_t err_len) {
    float *host = malloc(l->unit_numel * sizeof(float));
    if (!host) {
        snprintf(err, err_len, "out of host memory for the LoRA init");
        return -1;
    }
    for (int layer = 0; layer < l->n_layers; layer++) {
        model_lora_init_unit(l, seed, layer, host);
        ops_upload_f32(l->ops, l->params[layer], host, l->unit_numel);
    }
    ops_synchronize(l->ops);
    free(host);
    if (ops_status(l->ops)) {
        snprintf(err, err_len, "LoRA init: %s", ops_error(l->ops));
        return -1;
    }
    return 0;
}

int model_lora_merge_unit(const ModelLora *l, const Model *m, OpsCtx *cpu, const float *adapter, float *unit,
                          char *err, size_t err_len) {
    if (ops_backend(cpu) != OPS_BACKEND_CPU) {
        snprintf(err, err_len, "model_lora_merge_unit needs a CPU ops context");
        return -1;
    }
    // A CPU context's memory is host memory and its storage dtype fp32: the backend merge, run there.
    void *scratch = malloc(model_lora_merge_scratch_bytes(l, cpu));
    if (!scratch) {
        snprintf(err, err_len, "out of host memory merging the adapters");
        return -1;
    }
    model_lora_merge_layer(l, m, cpu, adapter, unit, unit, scratch);
    free(scratch);
    if (ops_status(cpu)) {
        snprintf(err, err_len, "merging the adapters: %s", ops_error(cpu));
        return -1;
    }
    return 0;
}

size_t model_lora_merge_scratch_bytes(const ModelLora *l, OpsCtx *o) {
    size_t most = 0;
    for (int i = 0; i < LORA_N_MODULES; i++) most = max_i(most, (size_t)l->out[i] * l->cfg.r);
    return most * ops_dtype_size(o);
}

void model_lora_merge_layer(const ModelLora *l, const Model *m, OpsCtx *o, const void *adapter, const void *base,
                            void *dst, void *scratch) {
    const size_t es = ops_dtype_size(o);
    const LayerOffsets *lo = &m->layout.layer;
    const size_t IC = (size_t)m->cfg.intermediate_size * m->cfg.hidden_size;
    const size_t w_off[LORA_N_MODULES] = {lo->wq, lo->wk, lo->wv, lo->wo, lo->wgu, lo->wgu + IC, lo->wdown};
    const char *unit = adapter;
    if (dst != base) ops_copy(o, dst, base, m->layout.unit_numel[layout_layer_unit(0)] * es);
    for (int i = 0; i < LORA_N_MODULES; i++) {
        if (l->a_off[i] == SIZE_MAX) continue;
        const int in = l->in[i], out = l->out[i], r = l->cfg.r;
        // W (out, in) += (s B) A: the input-gradient GEMM of a Linear with weight A (r, in) fed s B (out, r) as its
        // output gradient, accumulating into W: no transposed copy, no (out, in) temporary, one rounding.
        ops_copy(o, scratch, unit + l->b_off[i] * es, (size_t)out * r * es);
        ops_scale_inplace(o, scratch, l->scale, (size_t)out * r);
        ops_matmul_bwd(o, (char *)dst + w_off[i] * es, NULL, NULL, scratch, NULL, unit + l->a_off[i] * es, out, in, r,
                       1);
    }
}

// ---- the adapter path of a projection group (model_internal.h) -----------------------------------------------

typedef struct {
    int first, count;   // modules first .. first + count - 1
    int width;          // the group's output columns
    int col[3];         // each module's first column
} Group;

static Group group_of(const ModelLora *l, int group) {
    const int QD = l->out[LORA_Q_PROJ], KVD = l->out[LORA_K_PROJ], I = l->out[LORA_GATE_PROJ];
    switch (group) {
    case LORA_GROUP_QKV: return (Group){LORA_Q_PROJ, 3, QD + 2 * KVD, {0, QD, QD + KVD}};
    case LORA_GROUP_O: return (Group){LORA_O_PROJ, 1, l->out[LORA_O_PROJ], {0}};
    case LORA_GROUP_GU: return (Group){LORA_GATE_PROJ, 2, 2 * I, {0, I}};
    default: return (Group){LORA_DOWN_PROJ, 1, l->out[LORA_DOWN_PROJ], {0}};
    }
}

static void *t_of(const ModelLora *l, int module) {
    const size_t es = ops_dtype_size(l->ops);
    const size_t slot = (size_t)l->layer * LORA_N_MODULES + (size_t)module;
    return (char *)l->act_block + slot * (size_t)l->max_tokens * l->cfg.r * es;
}

static void *at(const ModelLora *l, void *base, size_t off) { return (char *)base + off * ops_dtype_size(l->ops); }

void lora_forward(Model *m, int group, const void *x, void *y, int N) {
    ModelLora *l = m->lora;
    if (!l) return;
    OpsCtx *o = m->ops;
    const Group g = group_of(l, group);
    int targeted = 0;
    for (int k = 0; k < g.count; k++) targeted += l->a_off[g.first + k] != SIZE_MAX;
    if (!targeted) return;
    if (N > l->max_tokens) {
        ops_set_error(o, -1, __FILE__, __LINE__, "LoRA activations hold %d tokens, the batch has %d", l->max_tokens,
                      N);
        return;
    }
    const int r = l->cfg.r;
    void *p = l->params[l->layer];
    // A lone module spanning the whole output adds its GEMM's result directly; otherwise the modules' results are
    // gathered into their columns of one (N, width) sum first.
    const int whole = g.count == 1;
    if (!whole) ops_memset_zero(o, l->sum, (size_t)N * g.width * ops_dtype_size(o));
    for (int k = 0; k < g.count; k++) {
        const int i = g.first + k;
        if (l->a_off[i] == SIZE_MAX) continue;
        void *t = t_of(l, i);
        const void *xi = x;
        // PEFT's lora_dropout on the adapter's input, a mask of its own per module
        if (l->cfg.dropout > 0 && !l->no_dropout) {
            ops_dropout(o, l->xd, x, (size_t)N * l->in[i], l->cfg.dropout,
                        lora_module_dropout_seed(l->dropout_seed, l->layer, i));
            xi = l->xd;
        }
        ops_matmul_fwd(o, t, xi, at(l, p, l->a_off[i]), NULL, N, l->in[i], r);
        ops_scale_inplace(o, t, l->scale, (size_t)N * r);
        ops_matmul_fwd(o, l->tmp, t, at(l, p, l->b_off[i]), NULL, N, r, l->out[i]);
        if (!whole) ops_copy_2d(o, at(l, l->sum, g.col[k]), g.width, l->tmp, l->out[i], (size_t)N, l->out[i]);
    }
    ops_add_inplace(o, y, whole ? l->tmp : l->sum, (size_t)N * g.width);
}

void lora_backward(Model *m, int group, const void *dy, const void *x, void *dx, int N) {
    ModelLora *l = m->lora;
    if (!l) return;
    OpsCtx *o = m->ops;
    const Group g = group_of(l, group);
    const int r = l->cfg.r;
    void *p = l->params[l->layer];
    float *gr = l->grads ? l->grads[l->layer] : NULL;
    for (int k = 0; k < g.count; k++) {
        const int i = g.first + k;
        if (l->a_off[i] == SIZE_MAX) continue;
        const void *dy_i = dy;
        if (g.count > 1) {  // the module's columns of the fused gradient, made contiguous
            ops_copy_2d(o, l->tmp, l->out[i], at(l, (void *)dy, g.col[k]), g.width, (size_t)N, l->out[i]);
            dy_i = l->tmp;
        }
        ops_matmul_bwd(o, l->dt, gr ? gr + l->b_off[i] : NULL, NULL, dy_i, t_of(l, i), at(l, p, l->b_off[i]), N, r,
                       l->out[i], 0);
        ops_scale_inplace(o, l->dt, l->scale, (size_t)N * r);
        if (l->cfg.dropout > 0 && !l->no_dropout) {
            // The forward's mask again: dA from the dropped-out input, and the input gradient through the mask.
            const uint64_t seed = lora_module_dropout_seed(l->dropout_seed, l->layer, i);
            const size_t n = (size_t)N * l->in[i];
            ops_dropout(o, l->xd, x, n, l->cfg.dropout, seed);
            ops_matmul_bwd(o, l->dxd, gr ? gr + l->a_off[i] : NULL, NULL, l->dt, l->xd, at(l, p, l->a_off[i]), N,
                           l->in[i], r, 0);
            ops_dropout(o, l->dxd, l->dxd, n, l->cfg.dropout, seed);
            ops_add_inplace(o, dx, l->dxd, n);
            continue;
        }
        ops_matmul_bwd(o, dx, gr ? gr + l->a_off[i] : NULL, NULL, l->dt, x, at(l, p, l->a_off[i]), N, l->in[i], r,
                       1);
    }
}

// ---- adapters in inference steps (model_lora.h ModelLoraRows) --------------------------------------------------

int model_lora_rows_reserve(ModelLoraRows *lr, const Model *m, int max_tokens, int max_r, char *err, size_t err_len) {
    if (max_tokens <= lr->max_tokens && max_r <= lr->max_r && lr->block) return 0;
    if (max_tokens < lr->max_tokens) max_tokens = lr->max_tokens;
    if (max_r < lr->max_r) max_r = lr->max_r;
    const ModelConfig *c = &m->cfg;
    const size_t es = ops_dtype_size(m->ops), N = (size_t)max_tokens;
    const size_t QD = (size_t)c->num_heads * c->head_dim, KVD = (size_t)c->num_kv_heads * c->head_dim;
    const size_t I = (size_t)c->intermediate_size, C = (size_t)c->hidden_size;
    const size_t sum_w = max_i(max_i(QD + 2 * KVD, 2 * I), C);
    void *block = ops_malloc(m->ops, N * (3 * (size_t)max_r + sum_w) * es);
    // Ranges: at most one per row.
    LoraRowRange *ranges = max_tokens > lr->cap_ranges ? realloc(lr->ranges, N * sizeof *ranges) : lr->ranges;
    if (!block || !ranges) {
        if (block) ops_free(m->ops, block);
        if (ranges) lr->ranges = ranges;
        snprintf(err, err_len, "out of memory for the adapters' step scratch (%d tokens, rank %d): %s", max_tokens,
                 max_r, ops_error(m->ops));
        return -1;
    }
    lr->ranges = ranges;
    if (max_tokens > lr->cap_ranges) lr->cap_ranges = max_tokens;
    if (lr->block) ops_free(lr->ops, lr->block);
    lr->ops = m->ops;
    lr->block = block;
    lr->t = block;
    lr->sum = (char *)block + N * 3 * (size_t)max_r * es;
    lr->max_tokens = max_tokens;
    lr->max_r = max_r;
    return 0;
}

void model_lora_rows_free(ModelLoraRows *lr) {
    if (lr->block) ops_free(lr->ops, lr->block);
    free(lr->ranges);
    memset(lr, 0, sizeof *lr);
}

// The serving copy's layout (ModelLora.serve_*) and its per-layer buffers. Returns 0 or -1 (out of memory).
static int serve_alloc(ModelLora *l) {
    const int r = l->cfg.r;
    size_t off = 0;
    for (int g = 0; g < 4; g++) {
        const Group grp = group_of(l, g);
        l->serve_m[g] = 0;
        for (int k = 0; k < grp.count; k++) l->serve_m[g] += l->a_off[grp.first + k] != SIZE_MAX;
        l->serve_a[g] = l->serve_b[g] = SIZE_MAX;
        if (!l->serve_m[g]) continue;
        const size_t mr = (size_t)l->serve_m[g] * r;
        l->serve_a[g] = off;
        off = align_up(off + mr * l->in[grp.first]);
        l->serve_b[g] = off;
        off = align_up(off + (size_t)grp.width * mr);
    }
    if (l->serve && l->serve_numel != off) return -1;   // a layout is fixed by the config: never changes
    l->serve_numel = off;
    if (!l->serve && !(l->serve = calloc((size_t)l->n_layers, sizeof(void *)))) return -1;
    for (int layer = 0; layer < l->n_layers; layer++)
        if (!l->serve[layer] && !(l->serve[layer] = ops_malloc(l->ops, off * ops_dtype_size(l->ops)))) return -1;
    return 0;
}

// Layer `layer`'s serving copy from its adapter unit (storage dtype, l->ops memory), as copy items appended to
// items (2 per targeted module): each A copied into its group's stack, each B scaled by s into its rows and columns
// of the group's block. Returns how many it appended.
static int serve_layer_items(const ModelLora *l, int layer, const void *unit, OpsCopy2D *items) {
    const size_t es = ops_dtype_size(l->ops);
    const int r = l->cfg.r;
    char *dst = l->serve[layer];   // zero-filled when made; what is written here is the same places every time
    const char *src = unit;
    int n = 0;
    for (int g = 0; g < 4; g++) {
        if (!l->serve_m[g]) continue;
        const Group grp = group_of(l, g);
        const size_t mr = (size_t)l->serve_m[g] * r;
        int j = 0;
        for (int k = 0; k < grp.count; k++) {
            const int i = grp.first + k;
            if (l->a_off[i] == SIZE_MAX) continue;
            const size_t in = (size_t)l->in[i];
            items[n++] = (OpsCopy2D){.dst = dst + (l->serve_a[g] + (size_t)j * r * in) * es, .src = src + l->a_off[i] * es,
                                     .dst_pitch = in, .src_pitch = in, .rows = (size_t)r, .cols = in, .scale = 1.0f};
            items[n++] = (OpsCopy2D){.dst = dst + (l->serve_b[g] + (size_t)grp.col[k] * mr + (size_t)j * r) * es,
                                     .src = src + l->b_off[i] * es, .dst_pitch = mr, .src_pitch = (size_t)r,
                                     .rows = (size_t)l->out[i], .cols = (size_t)r, .scale = l->scale};
            j++;
        }
    }
    return n;
}

static int serve_failed(ModelLora *l, char *err, size_t err_len) {
    snprintf(err, err_len, "out of memory for the adapter's serving copy%s%s", ops_status(l->ops) ? ": " : "",
             ops_status(l->ops) ? ops_error(l->ops) : "");
    return -1;
}

int model_lora_serve_from_units(ModelLora *l, const void *const *units, char *err, size_t err_len) {
    OpsCopy2D *items = malloc((size_t)l->n_layers * 2 * LORA_N_MODULES * sizeof *items);
    if (!items || serve_alloc(l) != 0) {
        free(items);
        return serve_failed(l, err, err_len);
    }
    int n = 0;
    for (int layer = 0; layer < l->n_layers; layer++) n += serve_layer_items(l, layer, units[layer], items + n);
    ops_copy_2d_batch(l->ops, items, n);
    free(items);
    return ops_status(l->ops) ? serve_failed(l, err, err_len) : 0;
}

int model_lora_serve_from(ModelLora *l, float *const *host, char *err, size_t err_len) {
    if (serve_alloc(l) != 0) return serve_failed(l, err, err_len);
    // Each layer's host unit rounded to the storage dtype on the way in, as the trainer's adapter units are.
    void *unit = ops_malloc(l->ops, l->unit_numel * ops_dtype_size(l->ops));
    if (!unit) return serve_failed(l, err, err_len);
    OpsCopy2D items[2 * LORA_N_MODULES];
    for (int layer = 0; layer < l->n_layers; layer++) {
        ops_upload_f32(l->ops, unit, host[layer], l->unit_numel);
        ops_copy_2d_batch(l->ops, items, serve_layer_items(l, layer, unit, items));
    }
    ops_synchronize(l->ops);
    ops_free(l->ops, unit);
    return ops_status(l->ops) ? serve_failed(l, err, err_len) : 0;
}

void lora_rows_forward(Model *m, int group, const void *x, void *y, int N) {
    ModelLoraRows *lr = m->lora_rows;
    if (!lr || lr->n_ranges == 0) return;
    OpsCtx *o = m->ops;
    const size_t es = ops_dtype_size(o);
    if (N > lr->max_tokens) {
        ops_set_error(o, -1, __FILE__, __LINE__, "adapter scratch holds %d tokens, the step has %d", lr->max_tokens, N);
        return;
    }
    for (int s = 0; s < lr->n_ranges; s++) {
        const LoraRowRange *rg = &lr->ranges[s];
        const ModelLora *l = rg->lora;
        const int mg = l->serve_m[group];
        if (!mg || rg->rows < 1 || rg->row0 < 0 || rg->row0 + rg->rows > N) continue;
        if (!l->serve || l->cfg.r > lr->max_r) {
            ops_set_error(o, -1, __FILE__, __LINE__, l->serve ? "adapter rank %d is above the step scratch's %d"
                                                              : "adapter (rank %d) has no serving copy (scratch %d)",
                          l->cfg.r, lr->max_r);
            return;
        }
        const Group g = group_of(l, group);
        const int n = rg->rows, mr = mg * l->cfg.r, in = l->in[g.first];
        const void *xs = (const char *)x + (size_t)rg->row0 * in * es;
        void *ys = (char *)y + (size_t)rg->row0 * g.width * es;
        void *p = l->serve[lr->layer];
        ops_matmul_fwd_batch_invariant(o, lr->t, xs, at(l, p, l->serve_a[group]), NULL, n, in, mr);
        ops_matmul_fwd_batch_invariant(o, lr->sum, lr->t, at(l, p, l->serve_b[group]), NULL, n, mr, g.width);
        ops_add_inplace(o, ys, lr->sum, (size_t)n * g.width);
    }
}
