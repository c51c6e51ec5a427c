// trainer/lora_train.c — the frozen base and the LoRA adapters' optimizer (trainer/lora_train.h).
#include "trainer/lora_train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/safetensors.h"

#define OPTIMIZER_FILE "trainer_state/adapter_optimizer.safetensors"

struct LoraTrain {
    Model *m;                // not owned; m->lora points at `lora` while the state lives
    Comm *c;                 // not owned
    OpsCtx *ops;
    ResidentWeights base;    // the frozen base: params only
    ModelLora *lora;         // adapter units and their fp32 gradients
    // ZeRO over the adapters: layer l's fp32 master and Adam moments live on rank l % world only (its owner);
    // the other ranks' entries are NULL. The adapter units (storage dtype) and the gradients are on every rank.
    float **master, **adam_m, **adam_v; // (n_layers) fp32 backend memory, unit_numel each, or NULL
    int rank, world;
    float *gather;           // one unit of fp32 backend memory: a layer's state broadcast from its owner
    float **held[3];         // rank 0 after lora_train_collect: host master, adam_m, adam_v of every layer
    float *sumsq;            // one fp32 in backend memory
    void **merged;           // (n_layers) merged layer units, storage dtype (lora_train_refresh_merged), or NULL
    void *scratch;           // its backend scratch (model_lora_merge_scratch_bytes)
};

static int fail_ops(LoraTrain *lt, const char *what, char *err, size_t err_len) {
    snprintf(err, err_len, "%s: %s", what, ops_error(lt->ops));
    return -1;
}

int lora_train_create(LoraTrain **out, Model *m, Comm *c, const LoraConfig *lc, const char *model_dir, uint64_t seed,
                      char *err, size_t err_len) {
    *out = NULL;
    LoraTrain *lt = calloc(1, sizeof *lt);
    if (!lt) {
        snprintf(err, err_len, "out of memory for the LoRA state");
        return -1;
    }
    lt->m = m;
    lt->c = c;
    lt->ops = m->ops;
    lt->rank = comm_rank(c);
    lt->world = comm_world_size(c);
    if (resident_alloc(&lt->base, m, 0, err, err_len) != 0 ||
        model_load_weights(m, &lt->base, model_dir, err, err_len) != 0 ||
        model_lora_create(&lt->lora, m, lc, 1, err, err_len) != 0)
        goto fail;
    const int L = lt->lora->n_layers;
    const size_t n = lt->lora->unit_numel;
    lt->master = calloc((size_t)L, sizeof(float *));
    lt->adam_m = calloc((size_t)L, sizeof(float *));
    lt->adam_v = calloc((size_t)L, sizeof(float *));
    float *host = malloc(n * sizeof(float));
    if (!lt->master || !lt->adam_m || !lt->adam_v || !host) {
        free(host);
        snprintf(err, err_len, "out of memory for the LoRA optimizer state");
        goto fail;
    }
    // The fp32 master is the init itself; the adapter units (storage dtype) are its rounding. Every rank draws
    // every layer's init (the units are on every rank); each keeps the master and moments of its own layers.
    int ok = 1;
    for (int l = 0; l < L && ok; l++) {
        model_lora_init_unit(lt->lora, seed, l, host);
        ops_upload_f32(lt->ops, lt->lora->params[l], host, n);
        if (!lora_train_owns(lt, l)) continue;
        lt->master[l] = ops_malloc(lt->ops, n * sizeof(float));
        lt->adam_m[l] = ops_malloc(lt->ops, n * sizeof(float));
        lt->adam_v[l] = ops_malloc(lt->ops, n * sizeof(float));
        if (!(ok = lt->master[l] && lt->adam_m[l] && lt->adam_v[l])) break;
        ops_copy_to_device(lt->ops, lt->master[l], host, n * sizeof(float));
    }
    ops_synchronize(lt->ops);
    free(host);
    lt->sumsq = ops_malloc(lt->ops, sizeof(float));
    lt->gather = lt->world > 1 ? ops_malloc(lt->ops, n * sizeof(float)) : NULL;
    if (!ok || ops_status(lt->ops) || !lt->sumsq || (lt->world > 1 && !lt->gather)) {
        fail_ops(lt, "LoRA optimizer state", err, err_len);
        goto fail;
    }
    model_lora_zero_grads(lt->lora);
    m->lora = lt->lora;
    *out = lt;
    return 0;
fail:
    lora_train_destroy(lt);
    return -1;
}

void lora_train_destroy(LoraTrain *lt) {
    if (!lt) return;
    if (lt->m && lt->m->lora == lt->lora) lt->m->lora = NULL;
    for (int l = 0; lt->lora && l < lt->lora->n_layers; l++) {
        if (lt->master) ops_free(lt->ops, lt->master[l]);
        if (lt->adam_m) ops_free(lt->ops, lt->adam_m[l]);
        if (lt->adam_v) ops_free(lt->ops, lt->adam_v[l]);
    }
    free(lt->master);
    free(lt->adam_m);
    free(lt->adam_v);
    if (lt->sumsq) ops_free(lt->ops, lt->sumsq);
    if (lt->gather) ops_free(lt->ops, lt->gather);
    if (lt->lora) lora_train_release(lt);
    for (int l = 0; lt->merged && l < lt->lora->n_layers; l++) ops_free(lt->ops, lt->merged[l]);
    free(lt->merged);
    if (lt->scratch) ops_free(lt->ops, lt->scratch);
    model_lora_free(lt->lora);
    if (lt->base.params) resident_free(&lt->base, lt->m);
    free(lt);
}

UnitSource lora_train_source(LoraTrain *lt) {
    UnitSource s = resident_source(&lt->base);
    s.grad = NULL;  // frozen: the model skips the base's weight gradients
    return s;
}

int lora_train_reserve(LoraTrain *lt, int max_tokens, char *err, size_t err_len) {
    return model_lora_reserve(lt->lora, max_tokens, err, err_len);
}

int lora_train_owns(const LoraTrain *lt, int layer) { return layer % lt->world == lt->rank; }

void lora_train_memory(const LoraTrain *lt, LoraTrainMemory *mem) {
    const ModelLora *l = lt->lora;
    const size_t es = ops_dtype_size(lt->ops), units = (size_t)l->n_layers * l->unit_numel;
    size_t owned = 0;
    for (int layer = 0; layer < l->n_layers; layer++) owned += (size_t)lora_train_owns(lt, layer) * l->unit_numel;
    mem->base_bytes = lt->m->layout.total_numel * es;
    mem->adapter_bytes = units * es;
    mem->state_bytes = (units + 3 * owned) * sizeof(float);
    mem->n_adapter_params = 0;
    for (int i = 0; i < l->n_tensors; i++) mem->n_adapter_params += l->tensors[i].numel;
}

int lora_train_step(LoraTrain *lt, const AdamWParams *p, float lr, int step, float *grad_norm, char *err,
                    size_t err_len) {
    ModelLora *l = lt->lora;
    OpsCtx *o = lt->ops;
    const size_t n = l->unit_numel;
    // Data parallelism: each rank's gradient is its share of the global loss's (the loss is normalised over every
    // rank's tokens), so the sum over the ranks is the global gradient.
    if (comm_world_size(lt->c) > 1) {
        comm_wait_compute(lt->c);
        for (int layer = 0; layer < l->n_layers; layer++)
            if (comm_all_reduce(lt->c, l->grads[layer], n, COMM_F32, COMM_SUM) != 0) {
                snprintf(err, err_len, "all-reduce of layer %d's adapter gradients failed: %s", layer,
                         comm_error(lt->c));
                return -1;
            }
        comm_compute_wait(lt->c);
    }
    ops_memset_zero(o, lt->sumsq, sizeof(float));
    for (int layer = 0; layer < l->n_layers; layer++) ops_sum_squares(o, lt->sumsq, l->grads[layer], n);
    float sumsq = 0;
    ops_copy_to_host(o, &sumsq, lt->sumsq, sizeof sumsq);
    const float norm = sqrtf(sumsq);
    if (grad_norm) *grad_norm = norm;
    // torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1.
    float scale = 1.0f;
    if (p->max_grad_norm > 0) {
        const float coef = p->max_grad_norm / (norm + 1e-6f);
        scale = coef < 1.0f ? coef : 1.0f;
    }
    // The padding between tensors has zero gradients and zero masters: AdamW leaves it zero. Each layer's owner
    // steps it and broadcasts the new adapter unit (storage dtype) to the other ranks.
    for (int layer = 0; layer < l->n_layers; layer++)
        if (lora_train_owns(lt, layer))
            ops_adamw_step(o, lt->master[layer], lt->adam_m[layer], lt->adam_v[layer], l->grads[layer],
                           l->params[layer], n, lr, p->beta1, p->beta2, p->eps, p->weight_decay, step, scale);
    if (lt->world > 1) {
        const CommDtype dt = ops_dtype_size(o) == 2 ? COMM_BF16 : COMM_F32;
        comm_wait_compute(lt->c);
        for (int layer = 0; layer < l->n_layers; layer++)
            if (comm_broadcast(lt->c, l->params[layer], n, dt, layer % lt->world) != 0) {
                snprintf(err, err_len, "broadcast of layer %d's adapters from rank %d failed: %s", layer,
                         layer % lt->world, comm_error(lt->c));
                return -1;
            }
        comm_compute_wait(lt->c);
    }
    model_lora_zero_grads(l);
    ops_synchronize(o);
    if (ops_status(o)) {
        snprintf(err, err_len, "LoRA optimizer step %d: %s", step, ops_error(o));
        return -1;
    }
    return 0;
}

static float **state_of(const LoraTrain *lt, int which) {
    return which == 0 ? lt->master : which == 1 ? lt->adam_m : lt->adam_v;
}

int lora_train_gather(LoraTrain *lt, int layer, int which, float *host, char *err, size_t err_len) {
    OpsCtx *o = lt->ops;
    const size_t bytes = lt->lora->unit_numel * sizeof(float);
    const int root = layer % lt->world;
    const float *src = state_of(lt, which)[layer];
    if (lt->world > 1) {
        if (root == lt->rank) ops_copy(o, lt->gather, src, bytes);
        comm_wait_compute(lt->c);
        if (comm_broadcast(lt->c, lt->gather, lt->lora->unit_numel, COMM_F32, root) != 0) {
            snprintf(err, err_len, "broadcast of layer %d's adapter state from rank %d failed: %s", layer, root,
                     comm_error(lt->c));
            return -1;
        }
        comm_compute_wait(lt->c);
        src = lt->gather;
    }
    if (host) ops_copy_to_host(o, host, src, bytes);
    if (ops_status(o)) return fail_ops(lt, "reading the adapter state", err, err_len);
    return 0;
}

static void free_host(float **host, int n) {
    for (int layer = 0; host && layer < n; layer++) free(host[layer]);
    free(host);
}

void lora_train_release(LoraTrain *lt) {
    for (int k = 0; k < 3; k++) {
        free_host(lt->held[k], lt->lora->n_layers);
        lt->held[k] = NULL;
    }
}

int lora_train_collect(LoraTrain *lt, char *err, size_t err_len) {
    const ModelLora *l = lt->lora;
    lora_train_release(lt);
    int keep = lt->rank == 0, oom = 0;
    for (int k = 0; k < 3 && keep && !oom; k++) {
        oom = !(lt->held[k] = calloc((size_t)l->n_layers, sizeof(float *)));
        for (int layer = 0; !oom && layer < l->n_layers; layer++)
            oom = !(lt->held[k][layer] = malloc(l->unit_numel * sizeof(float)));
    }
    if (oom) lora_train_release(lt), keep = 0;
    // Out of memory, rank 0 still takes part in every broadcast: a rank that left early would hang the others.
    int rc = 0;
    for (int layer = 0; rc == 0 && layer < l->n_layers; layer++)
        for (int k = 0; rc == 0 && k < 3; k++)
            rc = lora_train_gather(lt, layer, k, keep ? lt->held[k][layer] : NULL, err, err_len);
    if (rc == 0 && oom) rc = -1, snprintf(err, err_len, "out of host memory collecting the adapters' state");
    if (rc != 0) lora_train_release(lt);
    return rc;
}

int lora_train_save(LoraTrain *lt, const char *dir, const char *base_model, char *err, size_t err_len) {
    ModelLora *l = lt->lora;
    const int L = l->n_layers;
    float **const *host = lt->held;
    int rc = host[0] && host[1] && host[2] ? 0 : -1;
    if (rc != 0) snprintf(err, err_len, "the adapters' state was not collected (lora_train_collect) before saving");
    if (rc == 0) rc = model_lora_save(l, host[0], dir, base_model, err, err_len);
    StWriter *w = NULL;
    char (*names)[32] = rc == 0 ? calloc((size_t)L * 3, sizeof *names) : NULL;
    if (rc == 0 && (!names || st_writer_create(&w, err, err_len) != 0)) {
        if (!names) snprintf(err, err_len, "out of memory for the adapter optimizer state");
        rc = -1;
    }
    static const char *const kinds[3] = {"master", "adam_m", "adam_v"};
    const int64_t shape[1] = {(int64_t)l->unit_numel};
    for (int layer = 0; rc == 0 && layer < L; layer++)
        for (int k = 0; rc == 0 && k < 3; k++) {
            snprintf(names[layer * 3 + k], sizeof names[0], "%s.%d", kinds[k], layer);
            rc = st_writer_add(w, names[layer * 3 + k], ST_F32, 1, shape, host[k][layer], ST_F32, err, err_len);
        }
    char state_dir[4096], from[4200], to[4200];
    snprintf(state_dir, sizeof state_dir, "%s/trainer_state", dir);
    if (rc == 0) rc = st_writer_write(w, state_dir, 0, err, err_len);
    snprintf(from, sizeof from, "%s/model.safetensors", state_dir);
    snprintf(to, sizeof to, "%s/%s", dir, OPTIMIZER_FILE);
    if (rc == 0 && rename(from, to) != 0) {
        snprintf(err, err_len, "cannot move %s to %s", from, to);
        rc = -1;
    }
    st_writer_free(w);
    free(names);
    return rc;
}

int lora_train_load(LoraTrain *lt, const char *dir, char *err, size_t err_len) {
    ModelLora *l = lt->lora;
    LoraConfig saved;
    if (lora_config_read(dir, &saved, err, err_len) != 0) return -1;
    const LoraConfig *now = &l->cfg;
    if (saved.r != now->r || saved.alpha != now->alpha || saved.use_rslora != now->use_rslora ||
        saved.targets != now->targets) {
        char a[128], b[128];
        lora_targets_text(saved.targets, a, sizeof a);
        lora_targets_text(now->targets, b, sizeof b);
        snprintf(err, err_len, "%s holds adapters of r %d, lora_alpha %g, use_rslora %d on %s; this run asks for r %d, "
                 "lora_alpha %g, use_rslora %d on %s: resume with the checkpoint's LoRA options", dir, saved.r,
                 (double)saved.alpha, saved.use_rslora, a, now->r, (double)now->alpha, now->use_rslora, b);
        return -1;
    }
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, OPTIMIZER_FILE);
    SafetensorsSet *set;
    if (st_open(&set, path, err, err_len) != 0) return -1;
    float *host = malloc(l->unit_numel * sizeof(float));
    int rc = host ? 0 : -1;
    if (!host) snprintf(err, err_len, "out of host memory restoring the adapters");
    static const char *const kinds[3] = {"master", "adam_m", "adam_v"};
    float **dst[3] = {lt->master, lt->adam_m, lt->adam_v};
    const int64_t shape[1] = {(int64_t)l->unit_numel};
    for (int layer = 0; rc == 0 && layer < l->n_layers; layer++)
        for (int k = 0; rc == 0 && k < 3; k++) {
            char name[32];
            snprintf(name, sizeof name, "%s.%d", kinds[k], layer);
            const StTensor *t = st_find(set, name);
            if (!t) {
                snprintf(err, err_len, "%s: tensor %s is missing", path, name);
                rc = -1;
                break;
            }
            rc = st_check_shape(t, 1, shape, err, err_len) || st_read_f32(t, host, l->unit_numel, err, err_len);
            if (rc != 0) break;
            // Every rank's adapter units from the masters; the state itself to each layer's owner.
            if (lora_train_owns(lt, layer)) ops_copy_to_device(lt->ops, dst[k][layer], host, l->unit_numel * sizeof(float));
            if (k == 0) ops_upload_f32(lt->ops, l->params[layer], host, l->unit_numel);
        }
    ops_synchronize(lt->ops);
    free(host);
    st_close(set);
    if (rc == 0 && ops_status(lt->ops)) return fail_ops(lt, "restoring the adapters", err, err_len);
    return rc ? -1 : 0;
}

int lora_train_save_merged(LoraTrain *lt, const char *dir, char *err, size_t err_len) {
    const Model *m = lt->m;
    const ModelLora *l = lt->lora;
    const int U = m->layout.n_units;
    OpsCtx *cpu = NULL;
    float **host = calloc((size_t)U, sizeof *host), *const *masters = lt->held[0];
    int rc = host ? 0 : -1;
    if (rc != 0) snprintf(err, err_len, "out of host memory for the merged model");
    if (rc == 0 && !masters)
        rc = -1, snprintf(err, err_len, "the adapters' state was not collected (lora_train_collect) before saving");
    if (rc == 0) rc = ops_create(&cpu, OPS_BACKEND_CPU, 0, err, err_len);
    for (int u = 0; rc == 0 && u < U; u++) {
        if (!(host[u] = malloc(m->layout.unit_numel[u] * sizeof(float)))) {
            snprintf(err, err_len, "out of host memory for the merged model (unit %d)", u);
            rc = -1;
            break;
        }
        ops_download_f32(lt->ops, host[u], lt->base.params[u], m->layout.unit_numel[u]);
        const int layer = u - layout_layer_unit(0);
        if (layer < 0 || layer >= l->n_layers) continue;
        rc = model_lora_merge_unit(l, m, cpu, masters[layer], host[u], err, err_len);
    }
    if (rc == 0 && ops_status(lt->ops)) rc = fail_ops(lt, "merging the adapters", err, err_len);
    if (rc == 0) rc = model_save_host(m, host, dir, ops_dtype_size(lt->ops) == 2, 0, err, err_len);
    for (int u = 0; host && u < U; u++) free(host[u]);
    free(host);
    if (cpu) ops_destroy(cpu);
    return rc;
}

const ModelLora *lora_train_adapters(const LoraTrain *lt) { return lt->lora; }

int lora_train_refresh_merged(LoraTrain *lt, char *err, size_t err_len) {
    const Model *m = lt->m;
    const ModelLora *l = lt->lora;
    OpsCtx *o = lt->ops;
    const size_t es = ops_dtype_size(o);
    if (!lt->merged) {
        lt->merged = calloc((size_t)l->n_layers, sizeof(void *));
        lt->scratch = ops_malloc(o, model_lora_merge_scratch_bytes(l, o));
        for (int layer = 0; lt->merged && layer < l->n_layers; layer++)
            if (!(lt->merged[layer] = ops_malloc(o, m->layout.unit_numel[layout_layer_unit(layer)] * es))) break;
        if (!lt->merged || !lt->scratch || ops_status(o)) {
            snprintf(err, err_len, "out of memory for the merged weights the rollout servers get: %s", ops_error(o));
            return -1;
        }
    }
    // From the adapter units every rank holds (the rounding of the masters, what the forward computes with): no
    // collective, every rank merges its own copy.
    for (int layer = 0; layer < l->n_layers; layer++)
        model_lora_merge_layer(l, m, o, l->params[layer], lt->base.params[layout_layer_unit(layer)], lt->merged[layer],
                               lt->scratch);
    ops_synchronize(o);
    return ops_status(o) ? fail_ops(lt, "merging the adapters for the rollout servers", err, err_len) : 0;
}

const void *lora_train_merged_unit(const LoraTrain *lt, int unit) {
    const int layer = unit - layout_layer_unit(0);
    if (lt->merged && layer >= 0 && layer < lt->lora->n_layers) return lt->merged[layer];
    return lt->base.params[unit];
}
