// shared/model_shard.c — tensor-parallel shards of the model (shared/model.h, "tensor-parallel shards"): the shard's
// config, and each unit's slice of the whole model's parameters, on the host and on the backend.
//
// A shard's layout is the layout of its config (shared/layout.c), so it holds the same tensors in the same order as
// the whole model's, each with the shard's rows or columns; tensor i of one is tensor i of the other. Which part of
// a tensor a shard holds follows from the tensor's role:
//   embed_tokens, lm_head (V, C)          rows  [vocab_begin, + cfg.vocab_size)   (past V: zero rows)
//   q_proj (Hq*D, C), its bias            rows  [q_head_begin * D, + Hq_shard * D)
//   k_proj, v_proj (Hkv*D, C), biases     rows  [kv_head_begin * D, + Hkv_shard * D)
//   gate_proj, up_proj (I, C)             rows  [rank * I_shard, + I_shard)
//   o_proj (C, Hq*D)                      cols  [q_head_begin * D, + Hq_shard * D)
//   down_proj (C, I)                      cols  [rank * I_shard, + I_shard)
//   norms, q_norm, k_norm                 all of it (replicated)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/comm/comm.h"
#include "shared/safetensors.h"
#include "shared/model_internal.h"

int model_shard_config(const ModelConfig *full, int rank, int size, ModelConfig *out, ModelShard *shard, char *err,
                       size_t err_len) {
    const int Hq = full->num_heads, Hkv = full->num_kv_heads, I = full->intermediate_size, V = full->vocab_size;
    if (size < 1 || rank < 0 || rank >= size) {
        snprintf(err, err_len, "tensor-parallel shard %d of %d does not exist", rank, size);
        return -1;
    }
    if (Hq % size != 0 || I % size != 0 || (Hkv % size != 0 && size % Hkv != 0)) {
        snprintf(err, err_len, "a tensor-parallel size of %d does not divide this model (%d attention heads, %d KV "
                 "heads, MLP width %d): the size must divide the attention heads and the MLP width, and divide the KV "
                 "heads or be a multiple of them", size, Hq, Hkv, I);
        return -1;
    }
    *out = *full;
    memset(shard, 0, sizeof *shard);
    shard->rank = rank;
    shard->size = size;
    shard->vocab_total = V;
    out->num_heads = Hq / size;
    out->intermediate_size = I / size;
    out->vocab_size = (V + size - 1) / size;
    shard->vocab_begin = rank * out->vocab_size;
    shard->q_head_begin = rank * out->num_heads;
    if (Hkv >= size) {
        out->num_kv_heads = Hkv / size;
        shard->kv_head_begin = rank * out->num_kv_heads;
    } else {   // size / Hkv shards share each KV head: those holding its query heads
        out->num_kv_heads = 1;
        shard->kv_head_begin = rank / (size / Hkv);
    }
    return 0;
}

int model_init_shard(Model *m, const ModelConfig *full, int rank, int size, OpsCtx *ops, char *err, size_t err_len) {
    ModelConfig cfg;
    ModelShard shard;
    if (model_shard_config(full, rank, size, &cfg, &shard, err, err_len) != 0) return -1;
    if (model_init(m, &cfg, ops, err, err_len) != 0) return -1;
    m->shard = shard;
    return 0;
}

static int ends_with(const char *s, const char *suffix) {
    const size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

// Where the shard's tensor t starts in the whole model's tensor: first row and first column.
static void slice_origin(const ModelConfig *shard_cfg, const ModelShard *s, const LayoutTensor *t, int64_t *row0,
                         int64_t *col0) {
    const int64_t D = shard_cfg->head_dim;
    *row0 = 0;
    *col0 = 0;
    if (ends_with(t->name, "embed_tokens.weight") || ends_with(t->name, "lm_head.weight"))
        *row0 = s->vocab_begin;
    else if (strstr(t->name, "q_proj."))
        *row0 = s->q_head_begin * D;
    else if (strstr(t->name, "k_proj.") || strstr(t->name, "v_proj."))
        *row0 = s->kv_head_begin * D;
    else if (strstr(t->name, "gate_proj.") || strstr(t->name, "up_proj."))
        *row0 = (int64_t)s->rank * shard_cfg->intermediate_size;
    else if (strstr(t->name, "o_proj."))
        *col0 = s->q_head_begin * D;
    else if (strstr(t->name, "down_proj."))
        *col0 = (int64_t)s->rank * shard_cfg->intermediate_size;
}

// Tensor i's slice in unit `unit`: where the shard's part starts in the whole tensor (element offset from the
// whole unit's start, full_at), where it goes in the shard's unit (shard_at), its rows (those the whole tensor has:
// vocabulary padding rows do not), its columns and the whole tensor's. 0 when tensor i is not in unit.
typedef struct {
    size_t full_at, shard_at;
    int64_t rows, cols, full_cols;
} TensorSlice;

static int tensor_slice(const Layout *full, const Layout *shard, const ModelConfig *shard_cfg, const ModelShard *s,
                        int i, int unit, TensorSlice *out) {
    const LayoutTensor *st = &shard->tensors[i], *ft = &full->tensors[i];
    if (st->unit != unit) return 0;
    int64_t row0, col0;
    slice_origin(shard_cfg, s, st, &row0, &col0);
    int64_t rows = ft->shape[0] - row0;
    if (rows > st->shape[0]) rows = st->shape[0];
    *out = (TensorSlice){.full_at = ft->offset + (size_t)(row0 * ft->shape[1] + col0), .shard_at = st->offset,
                         .rows = rows > 0 ? rows : 0, .cols = st->shape[1], .full_cols = ft->shape[1]};
    return 1;
}

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }
static size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

int model_shard_parts(const Layout *full, const Layout *shard, const ModelConfig *shard_cfg, const ModelShard *s,
                      int unit, size_t begin, size_t end, ModelShardPart *parts, int cap) {
    int n = 0;
#define ADD_PART(...)                                          \
    do {                                                       \
        if (n == cap) return -1;                               \
        parts[n++] = (ModelShardPart){__VA_ARGS__};            \
    } while (0)
    for (int i = 0; i < shard->n_tensors; i++) {
        TensorSlice t;
        if (!tensor_slice(full, shard, shard_cfg, s, i, unit, &t) || t.rows == 0) continue;
        const size_t rows = (size_t)t.rows, cols = (size_t)t.cols, fc = (size_t)t.full_cols;
        if (cols == fc) {   // whole rows: one contiguous range of the whole unit
            const size_t lo = max_size(begin, t.full_at), hi = min_size(end, t.full_at + rows * cols);
            if (lo < hi) ADD_PART(.full_at = lo, .shard_at = t.shard_at + (lo - t.full_at), .rows = 1, .cols = hi - lo,
                                  .full_cols = hi - lo);
            continue;
        }
        // A column block of every row: row r covers [full_at + r * fc, + cols) of the whole unit.
        if (end <= t.full_at || begin >= t.full_at + (rows - 1) * fc + cols) continue;
        size_t r0 = begin <= t.full_at ? 0 : (begin - t.full_at + fc - cols) / fc;   // first row ending past begin
        size_t r1 = end <= t.full_at ? 0 : min_size(rows, (end - t.full_at + fc - 1) / fc);   // rows starting < end
        for (size_t r = r0; r < r1;) {
            const size_t at = t.full_at + r * fc, lo = max_size(begin, at), hi = min_size(end, at + cols);
            if (lo > at || hi < at + cols) {   // a partial row: alone
                if (lo < hi) ADD_PART(.full_at = lo, .shard_at = t.shard_at + r * cols + (lo - at), .rows = 1,
                                      .cols = hi - lo, .full_cols = hi - lo);
                r++;
                continue;
            }
            size_t m = r + 1;   // whole rows r .. m-1 (row m-1 ends inside [begin, end))
            while (m < r1 && t.full_at + m * fc + cols <= end) m++;
            ADD_PART(.full_at = at, .shard_at = t.shard_at + r * cols, .rows = m - r, .cols = cols,
                     .full_cols = m - r == 1 ? cols : fc);
            r = m;
        }
    }
#undef ADD_PART
    return n;
}

void model_shard_unit(const Model *full, const Model *shard, int unit, const void *full_unit, void *shard_unit,
                      size_t elem) {
    memset(shard_unit, 0, shard->layout.unit_numel[unit] * elem);
    for (int i = 0; i < shard->layout.n_tensors; i++) {
        TensorSlice s;
        if (!tensor_slice(&full->layout, &shard->layout, &shard->cfg, &shard->shard, i, unit, &s)) continue;
        for (int64_t r = 0; r < s.rows; r++)
            memcpy((char *)shard_unit + (s.shard_at + (size_t)(r * s.cols)) * elem,
                   (const char *)full_unit + (s.full_at + (size_t)(r * s.full_cols)) * elem, (size_t)s.cols * elem);
    }
}

int model_fill_random(const Model *m, const Layout *full, ResidentWeights *w, uint64_t seed, char *err,
                     size_t err_len) {
    const float scale = 0.02f * 1.7320508f;   // a uniform's half-width for std 0.02
    size_t most_norm = 0;
    for (int i = 0; i < m->layout.n_tensors; i++)
        if (strstr(m->layout.tensors[i].name, "norm") && m->layout.tensors[i].numel > most_norm)
            most_norm = m->layout.tensors[i].numel;
    float *ones = malloc((most_norm ? most_norm : 1) * sizeof *ones);
    if (!ones) return snprintf(err, err_len, "out of host memory for random weights"), -1;
    for (size_t i = 0; i < most_norm; i++) ones[i] = 1.0f;
    const size_t es = ops_dtype_size(m->ops);
    ModelShardPart parts[MODEL_SHARD_MAX_PARTS];
    for (int u = 0; u < m->layout.n_units; u++) {
        const int n = model_shard_parts(full, &m->layout, &m->cfg, &m->shard, u, 0, full->unit_numel[u], parts,
                                      MODEL_SHARD_MAX_PARTS);
        if (n < 0) {
            free(ones);
            return snprintf(err, err_len, "unit %d has more than %d parts", u, MODEL_SHARD_MAX_PARTS), -1;
        }
        const uint64_t unit_seed = seed ^ ((uint64_t)(u + 1) * 0xD1B54A32D192ED03ULL);
        for (int p = 0; p < n; p++)
            ops_fill_hashed_uniform(m->ops, (char *)w->params[u] + parts[p].shard_at * es, parts[p].rows, parts[p].cols,
                                    parts[p].full_at, parts[p].full_cols, unit_seed, scale);
        for (int i = 0; i < m->layout.n_tensors; i++) {
            const LayoutTensor *t = &m->layout.tensors[i];
            if (t->unit == u && strstr(t->name, "norm")) {
                ops_upload_f32(m->ops, (char *)w->params[u] + t->offset * es, ones, t->numel);
                ops_synchronize(m->ops);   // the upload reads the host array
            }
        }
    }
    free(ones);
    ops_synchronize(m->ops);
    if (ops_status(m->ops)) return snprintf(err, err_len, "random weights: %s", ops_error(m->ops)), -1;
    return 0;
}

static CommDtype storage_comm_dtype(const Model *m) { return ops_dtype_size(m->ops) == 2 ? COMM_BF16 : COMM_F32; }

void model_shard_reduce(Model *m, void *buf, const void *residual, size_t count) {
    ModelShard *s = &m->shard;
    if (s->size <= 1 || s->failed) return;
    if (s->peers && count <= ops_peer_group_capacity(s->peers)) {
        ops_peer_all_reduce(s->peers, s->rank, buf, residual, count);
        if (ops_status(m->ops) != 0) s->failed = 1;
        return;
    }
    comm_wait_compute(s->comm);
    if (comm_all_reduce(s->comm, buf, count, storage_comm_dtype(m), COMM_SUM) != 0) s->failed = 1;
    comm_compute_wait(s->comm);
    if (residual && !s->failed) ops_add_inplace(m->ops, buf, residual, count);
}

void model_shard_gather(Model *m, void *recv, const void *send, size_t count) {
    ModelShard *s = &m->shard;
    if (s->size <= 1 || s->failed) return;
    comm_wait_compute(s->comm);
    if (comm_all_gather(s->comm, recv, send, count, storage_comm_dtype(m)) != 0) s->failed = 1;
    comm_compute_wait(s->comm);
}

int model_load_shard_weights(const Model *whole, Model *const *shards, ResidentWeights *const *w, int n,
                             const char *model_dir, char *err, size_t err_len) {
    const Layout *L = &whole->layout;
    SafetensorsSet *set = NULL;
    if (st_open(&set, model_dir, err, err_len) != 0) return -1;
    int rc = -1;
    size_t most = 0;
    for (int k = 0; k < n; k++)
        if (shards[k]->layout.max_unit_numel > most) most = shards[k]->layout.max_unit_numel;
    float *host = malloc(L->max_unit_numel * sizeof *host), *slice = malloc(most * sizeof *slice);
    if (!host || !slice) {
        snprintf(err, err_len, "out of host memory loading %s", model_dir);
        goto out;
    }
    if (model_check_tensors(whole, set, err, err_len) != 0) goto out;
    for (int u = 0; u < L->n_units; u++) {
        if (model_read_unit(whole, set, u, host, err, err_len) != 0) goto out;
        for (int k = 0; k < n; k++) {
            model_shard_unit(whole, shards[k], u, host, slice, sizeof(float));
            ops_upload_f32(shards[k]->ops, w[k]->params[u], slice, shards[k]->layout.unit_numel[u]);
            ops_synchronize(shards[k]->ops);   // slice is reused for the next shard
        }
    }
    for (int k = 0; k < n; k++)
        if (ops_status(shards[k]->ops)) {
            snprintf(err, err_len, "uploading %s to tensor-parallel shard %d: %s", model_dir, k,
                     ops_error(shards[k]->ops));
            goto out;
        }
    rc = 0;
out:
    free(host);
    free(slice);
    st_close(set);
    return rc;
}
