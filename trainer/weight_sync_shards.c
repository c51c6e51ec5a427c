// trainer/weight_sync_shards.c — an NCCL weight update sent straight into a rollout server's tensor-parallel shards
// (see trainer/weight_sync_shards.h).
#include "trainer/weight_sync_shards.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int size;           // tensor-parallel size
    ModelConfig *cfg;   // (size) each shard's config
    ModelShard *shard;  // (size)
    Layout *layout;     // (size)
} ShardCut;

struct WeightShards {
    ShardCut cuts[WEIGHT_SHARDS_MAX_SIZES];
    int n_cuts;
    OpsCtx *ops;
    void *pack;         // backend memory: the bucket's column-sliced parts, packed (storage dtype)
    size_t pack_numel;
    size_t *pack_at;    // (n_units x WEIGHT_SHARDS_MAX_SIZES) where unit u's parts for cut i start in pack
    int n_units;
    ModelShardPart parts[MODEL_SHARD_MAX_PARTS];
};

void weight_shards_free(WeightShards *ws) {
    if (!ws) return;
    for (int i = 0; i < ws->n_cuts; i++) {
        for (int k = 0; k < ws->cuts[i].size; k++) layout_free(&ws->cuts[i].layout[k]);
        free(ws->cuts[i].cfg);
        free(ws->cuts[i].shard);
        free(ws->cuts[i].layout);
    }
    if (ws->pack) ops_free(ws->ops, ws->pack);
    free(ws->pack_at);
    free(ws);
}

// The cut of tensor-parallel size n, made on first use. NULL with a message when the model does not split so.
static const ShardCut *cut_of(WeightShards *ws, const Model *m, int n, int *index, char *err, size_t err_len) {
    for (int i = 0; i < ws->n_cuts; i++)
        if (ws->cuts[i].size == n) return *index = i, &ws->cuts[i];
    if (ws->n_cuts == WEIGHT_SHARDS_MAX_SIZES) {
        snprintf(err, err_len, "the rollout servers run more than %d different tensor-parallel sizes",
                 WEIGHT_SHARDS_MAX_SIZES);
        return NULL;
    }
    ShardCut *c = &ws->cuts[ws->n_cuts];
    c->cfg = calloc((size_t)n, sizeof *c->cfg);
    c->shard = calloc((size_t)n, sizeof *c->shard);
    c->layout = calloc((size_t)n, sizeof *c->layout);
    if (!c->cfg || !c->shard || !c->layout) {
        snprintf(err, err_len, "out of memory for the shard layouts of tensor-parallel size %d", n);
        goto fail;
    }
    for (int k = 0; k < n; k++) {
        char msg[384];
        if (model_shard_config(&m->cfg, k, n, &c->cfg[k], &c->shard[k], msg, sizeof msg) != 0 ||
            layout_build(&c->layout[k], &c->cfg[k], msg, sizeof msg) != 0) {
            for (int j = 0; j < k; j++) layout_free(&c->layout[j]);
            snprintf(err, err_len, "a rollout server runs %d tensor-parallel shards: %s", n, msg);
            goto fail;
        }
    }
    c->size = n;
    *index = ws->n_cuts++;
    return c;
fail:
    free(c->cfg);
    free(c->shard);
    free(c->layout);
    memset(c, 0, sizeof *c);
    return NULL;
}

static int parts_of(WeightShards *ws, const Model *m, const ShardCut *c, int k, int u, size_t off, size_t count,
                    char *err, size_t err_len) {
    int n = model_shard_parts(&m->layout, &c->layout[k], &c->cfg[k], &c->shard[k], u, off, off + count, ws->parts,
                              MODEL_SHARD_MAX_PARTS);
    if (n < 0)
        snprintf(err, err_len, "unit %d has more than %d parts for tensor-parallel shard %d", u, MODEL_SHARD_MAX_PARTS,
                 k);
    return n;
}

// *wsp, made on first use. NULL with a message when out of memory.
static WeightShards *tables(WeightShards **wsp, OpsCtx *ops, const Model *m, char *err, size_t err_len) {
    WeightShards *ws = *wsp;
    if (ws) return ws;
    if (!(ws = calloc(1, sizeof *ws)) ||
        !(ws->pack_at = calloc((size_t)m->layout.n_units * WEIGHT_SHARDS_MAX_SIZES, sizeof *ws->pack_at))) {
        free(ws);
        snprintf(err, err_len, "out of memory for the weight sync's shard tables");
        return NULL;
    }
    ws->ops = ops;
    ws->n_units = m->layout.n_units;
    return *wsp = ws;
}

const Layout *weight_shards_layout(WeightShards **wsp, OpsCtx *ops, const Model *m, int tp, int k, char *err,
                                   size_t err_len) {
    int i;
    WeightShards *ws = tables(wsp, ops, m, err, err_len);
    const ShardCut *cut = ws ? cut_of(ws, m, tp, &i, err, err_len) : NULL;
    return cut && k >= 0 && k < tp ? &cut->layout[k] : NULL;
}

int weight_shards_parts(WeightShards *ws, const Model *m, int tp, int k, int u, size_t off, size_t count,
                        const ModelShardPart **parts, char *err, size_t err_len) {
    int i;
    const ShardCut *cut = cut_of(ws, m, tp, &i, err, err_len);
    if (!cut) return -1;
    *parts = ws->parts;
    return parts_of(ws, m, cut, k, u, off, count, err, err_len);
}

int weight_shards_part_strided(const ModelShardPart *p) { return p->rows > 1 && p->cols != p->full_cols; }

int weight_shards_pack(WeightShards **wsp, OpsCtx *ops, Comm *c, const Model *m, const int *tp, int n_servers,
                       int u0, int u1, const WeightSlice *slices, char *err, size_t err_len) {
    WeightShards *ws = tables(wsp, ops, m, err, err_len);
    if (!ws) return -1;
    int sizes[WEIGHT_SHARDS_MAX_SIZES], n_sizes = 0;
    for (int j = 0; j < n_servers; j++) {
        int i, seen = 0;
        if (tp[j] <= 1) continue;
        if (!cut_of(ws, m, tp[j], &i, err, err_len)) return -1;
        for (int s = 0; s < n_sizes; s++) seen |= sizes[s] == i;
        if (!seen) sizes[n_sizes++] = i;
    }
    // Where each (unit, cut) block of packed parts starts, and how much the bucket needs.
    size_t total = 0;
    for (int u = u0; u < u1; u++)
        for (int s = 0; s < n_sizes; s++) {
            const ShardCut *cut = &ws->cuts[sizes[s]];
            ws->pack_at[(size_t)u * WEIGHT_SHARDS_MAX_SIZES + (size_t)sizes[s]] = total;
            for (int k = 0; k < cut->size && slices[u - u0].count; k++) {
                int n = parts_of(ws, m, cut, k, u, slices[u - u0].off, slices[u - u0].count, err, err_len);
                if (n < 0) return -1;
                for (int p = 0; p < n; p++)
                    if (weight_shards_part_strided(&ws->parts[p])) total += ws->parts[p].rows * ws->parts[p].cols;
            }
        }
    if (total == 0) return 0;
    // The pack buffer is read by the previous bucket's sends: the copies below wait for them.
    comm_compute_wait(c);
    const size_t es = ops_dtype_size(ops);
    if (total > ws->pack_numel) {
        if (comm_synchronize(c) != 0) {
            snprintf(err, err_len, "weight sync: %s", comm_error(c));
            return -1;
        }
        if (ws->pack) ops_free(ops, ws->pack);
        ws->pack_numel = 0;
        if (!(ws->pack = ops_malloc(ops, total * es))) {
            snprintf(err, err_len, "no device memory for %zu MB of weight slices packed for the tensor-parallel "
                     "shards: %s", total * es >> 20, ops_error(ops));
            ops_clear_error(ops);
            return -1;
        }
        ws->pack_numel = total;
    }
    for (int u = u0; u < u1; u++)
        for (int s = 0; s < n_sizes; s++) {
            const ShardCut *cut = &ws->cuts[sizes[s]];
            const WeightSlice *sl = &slices[u - u0];
            size_t at = ws->pack_at[(size_t)u * WEIGHT_SHARDS_MAX_SIZES + (size_t)sizes[s]];
            for (int k = 0; k < cut->size && sl->count; k++) {
                int n = parts_of(ws, m, cut, k, u, sl->off, sl->count, err, err_len);
                for (int p = 0; p < n; p++) {
                    const ModelShardPart *q = &ws->parts[p];
                    if (!weight_shards_part_strided(q)) continue;
                    ops_copy_2d(ops, (char *)ws->pack + at * es, q->cols,
                                (const char *)sl->src + (q->full_at - sl->off) * es, q->full_cols, q->rows, q->cols);
                    at += q->rows * q->cols;
                }
            }
        }
    if (ops_status(ops)) {
        snprintf(err, err_len, "packing weight slices for the tensor-parallel shards: %s", ops_error(ops));
        return -1;
    }
    return 0;
}

int weight_shards_send(WeightShards *ws, Comm *c, const Model *m, int u, const WeightSlice *sl, int tp, int first,
                       CommDtype dtype, double *bytes, char *err, size_t err_len) {
    int i;
    const ShardCut *cut = cut_of(ws, m, tp, &i, err, err_len);
    if (!cut) return -1;
    const size_t es = comm_dtype_size(dtype);
    size_t at = ws->pack_at[(size_t)u * WEIGHT_SHARDS_MAX_SIZES + (size_t)i];
    for (int k = 0; k < tp && sl->count; k++) {
        int n = parts_of(ws, m, cut, k, u, sl->off, sl->count, err, err_len);
        if (n < 0) return -1;
        for (int p = 0; p < n; p++) {
            const ModelShardPart *q = &ws->parts[p];
            const size_t numel = q->rows * q->cols;
            const void *src = weight_shards_part_strided(q) ? (const char *)ws->pack + at * es
                                        : (const char *)sl->src + (q->full_at - sl->off) * es;
            if (weight_shards_part_strided(q)) at += numel;
            if (comm_send(c, src, numel, dtype, first + k) != 0) {
                snprintf(err, err_len, "weight sync over NCCL: %s", comm_error(c));
                return -1;
            }
            *bytes += (double)numel * (double)es;
        }
    }
    return 0;
}
