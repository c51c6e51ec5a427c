// rollout_server/runner_adapters.c — the model runner's LoRA adapters (model_runner.h "LoRA adapters"): the --lora
// PEFT folders loaded at start, and each step's row ranges through them (shared/model_lora.h ModelLoraRows).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/model_runner_internal.h"

static void free_merge_cache(ModelRunner *r);

int runner_adapter_count(const ModelRunner *r) { return r->n_adapters; }

const char *runner_adapter_name(const ModelRunner *r, int k) {
    return k >= 1 && k <= r->n_adapters ? r->adapter_names[k] : NULL;
}

int runner_adapters_load(ModelRunner *r, const EngineConfig *cfg, char *err, size_t err_len) {
    const int n = cfg->n_loras > 0 ? cfg->n_loras : 0;
    r->adapter_updates_lowrank = cfg->adapter_updates_lowrank;
    r->adapters = calloc((size_t)n + 1, sizeof *r->adapters);
    r->adapter_names = calloc((size_t)n + 1, sizeof *r->adapter_names);
    if (!r->adapters || !r->adapter_names) return snprintf(err, err_len, "out of memory"), ENGINE_ENOMEM;
    if (n > 0 && r->tp > 1)
        return snprintf(err, err_len, "--lora with --tensor-parallel-size %d: adapters are served on one device only "
                        "(serve the merged model instead, or use --tensor-parallel-size 1)", r->tp), ENGINE_EINVAL;
    Model *m = &r->shards[0].m;
    float **host = calloc((size_t)m->cfg.num_layers, sizeof *host);
    if (!host) return snprintf(err, err_len, "out of memory"), ENGINE_ENOMEM;
    int rc = 0, max_r = 0;
    char msg[768];
    for (int k = 1; k <= n && rc == 0; k++) {
        const char *name = cfg->lora_names[k - 1], *dir = cfg->lora_dirs[k - 1];
        LoraConfig lc;
        ModelLora *l = NULL;
        rc = ENGINE_EINVAL;
        if (lora_config_read(dir, &lc, msg, sizeof msg) != 0 || model_lora_create(&l, m, &lc, 0, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "--lora %s=%s: %s", name, dir, msg);
            break;
        }
        r->adapters[k] = l;
        r->n_adapters = k;
        if (!(r->adapter_names[k] = strdup(name))) {
            rc = ENGINE_ENOMEM;
            snprintf(err, err_len, "out of memory");
            break;
        }
        int ok = 1;
        for (int layer = 0; layer < l->n_layers && ok; layer++)
            ok = (host[layer] = malloc(l->unit_numel * sizeof(float))) != NULL;
        if (!ok) {
            rc = ENGINE_ENOMEM;
            snprintf(err, err_len, "out of host memory reading --lora %s", name);
        } else if (model_lora_load(l, dir, host, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "--lora %s=%s: %s", name, dir, msg);
        } else if (model_lora_serve_from(l, host, msg, sizeof msg) != 0) {
            rc = ENGINE_ENOMEM;
            snprintf(err, err_len, "--lora %s: %s", name, msg);
        } else {
            rc = 0;
            if (lc.r > max_r) max_r = lc.r;
        }
        for (int layer = 0; layer < m->cfg.num_layers; layer++) free(host[layer]), host[layer] = NULL;
    }
    free(host);
    if (rc != 0) return rc;
    if (n > 0) {
        if (model_lora_rows_reserve(&r->lora_rows, m, r->max_num_batched_tokens, max_r, msg, sizeof msg) != 0)
            return snprintf(err, err_len, "%s", msg), ENGINE_ENOMEM;
        m->lora_rows = &r->lora_rows;
    }
    return 0;
}

// Frees the base copy of merged adapter updates.
static void free_adapter_base(ModelRunner *r) {
    if (!r->adapter_base) return;
    for (int u = 0; u < runner_model(r)->layout.n_units; u++) ops_free(r->ops, r->adapter_base[u]);
    free(r->adapter_base);
    r->adapter_base = NULL;
}

static void free_adapter_staging(ModelRunner *r) {
    for (int layer = 0; r->adapter_staging && layer < runner_model(r)->cfg.num_layers; layer++)
        ops_free(r->ops, r->adapter_staging[layer]);
    free(r->adapter_staging);
    r->adapter_staging = NULL;
    r->adapter_staging_numel = 0;
}

void *runner_adapter_device_staging(ModelRunner *r, size_t unit_numel, int layer) {
    const int L = runner_model(r)->cfg.num_layers;
    if (layer < 0 || layer >= L || unit_numel == 0) return NULL;
    if (r->adapter_staging_numel != unit_numel) free_adapter_staging(r);
    if (!r->adapter_staging && !(r->adapter_staging = calloc((size_t)L, sizeof(void *)))) return NULL;
    r->adapter_staging_numel = unit_numel;
    if (!r->adapter_staging[layer] &&
        !(r->adapter_staging[layer] = ops_malloc(r->ops, unit_numel * ops_dtype_size(r->ops))))
        ops_clear_error(r->ops);   // the caller reports the missing memory
    return r->adapter_staging[layer];
}

void runner_adapters_free(ModelRunner *r) {
    free_adapter_base(r);
    free_adapter_staging(r);
    free_merge_cache(r);
    for (int k = 0; r->adapters && k <= r->n_adapters; k++) model_lora_free(r->adapters[k]);
    for (int k = 0; r->adapter_names && k <= r->n_adapters; k++) free(r->adapter_names[k]);
    free(r->adapters);
    free(r->adapter_names);
    model_lora_rows_free(&r->lora_rows);
    r->adapters = NULL;
    r->adapter_names = NULL;
    r->n_adapters = 0;
}

int runner_adapter_ranges(ModelRunner *r, const RunnerSeq *seqs, int n_seqs) {
    ModelLoraRows *lr = &r->lora_rows;
    lr->n_ranges = 0;
    if (!r->adapters || !lr->ranges) return 0;
    int row = 0;
    for (int i = 0; i < n_seqs; i++) {
        const int k = seqs[i].adapter;
        const ModelLora *l = k >= 0 && k <= r->n_adapters ? r->adapters[k] : NULL;
        if (l) {
            LoraRowRange *last = lr->n_ranges > 0 ? &lr->ranges[lr->n_ranges - 1] : NULL;
            if (last && last->lora == l && last->row0 + last->rows == row) last->rows += seqs[i].n_sched;
            else lr->ranges[lr->n_ranges++] = (LoraRowRange){row, seqs[i].n_sched, l};
        }
        row += seqs[i].n_sched;
    }
    return lr->n_ranges;
}

// Same adapters' shape and scale: what a ModelLora made for one config can serve for the other.
static int same_adapters(const LoraConfig *a, const LoraConfig *b) {
    return a->r == b->r && a->alpha == b->alpha && a->use_rslora == b->use_rslora && a->targets == b->targets;
}

static void free_merge_cache(ModelRunner *r) {
    if (r->merge_lora) ops_free(r->ops, r->merge_scratch);
    model_lora_free(r->merge_lora);
    r->merge_lora = NULL;
    r->merge_scratch = NULL;
}

// The adapters merged into the served weights: live layer unit = base copy + s B A (the copy taken from the live
// weights before the first merge), from the adapter units in the device staging. Returns 0, 1 when the copy does
// not fit in device memory (nothing changed), or -1 with a message.
static int merge_policy_adapter(ModelRunner *r, const LoraConfig *c, char *err, size_t err_len) {
    Model *m = &r->shards[0].m;
    OpsCtx *o = r->ops;
    const Layout *L = &m->layout;
    const size_t es = ops_dtype_size(o);
    char msg[512];
    if (r->merge_lora && !same_adapters(&r->merge_lora->cfg, c)) free_merge_cache(r);
    if (!r->merge_lora) {
        if (model_lora_create(&r->merge_lora, m, c, 0, msg, sizeof msg) != 0)
            return snprintf(err, err_len, "%s", msg), -1;
        if (!(r->merge_scratch = ops_malloc(o, model_lora_merge_scratch_bytes(r->merge_lora, o)))) {
            ops_clear_error(o);
            free_merge_cache(r);
            return 1;
        }
    }
    if (!r->adapter_base && (r->adapter_base = calloc((size_t)L->n_units, sizeof(void *)))) {
        for (int layer = 0; layer < m->cfg.num_layers; layer++) {
            const int u = layout_layer_unit(layer);
            if (!(r->adapter_base[u] = ops_malloc(o, L->unit_numel[u] * es))) {
                free_adapter_base(r);
                break;
            }
            ops_copy(o, r->adapter_base[u], r->shards[0].w.params[u], L->unit_numel[u] * es);
        }
    }
    if (!r->adapter_base) {
        ops_clear_error(o);
        free_merge_cache(r);
        return 1;
    }
    for (int layer = 0; layer < m->cfg.num_layers; layer++) {
        const int u = layout_layer_unit(layer);
        model_lora_merge_layer(r->merge_lora, m, o, r->adapter_staging[layer], r->adapter_base[u],
                               r->shards[0].w.params[u], r->merge_scratch);
    }
    ops_synchronize(o);
    if (ops_status(o)) {
        snprintf(err, err_len, "merging the adapters: %s", ops_error(o));
        ops_clear_error(o);
        return -1;
    }
    model_lora_free(r->adapters[0]);   // a low-rank policy adapter of before goes
    r->adapters[0] = NULL;
    return 0;
}

int runner_set_policy_adapter(ModelRunner *r, const LoraConfig *c, float *const *host, char *err, size_t err_len) {
    if (r->tp > 1)
        return snprintf(err, err_len, "adapter updates into a tensor-parallel server (--tensor-parallel-size %d) are "
                        "not supported: push merged weights (tandem-train --lora-sync merged)", r->tp), -1;
    const Model *base = runner_model(r);
    const size_t numel = model_lora_unit_numel(&base->cfg, c);
    for (int layer = 0; layer < base->cfg.num_layers; layer++) {
        if (host && runner_adapter_device_staging(r, numel, layer))
            ops_upload_f32(r->ops, r->adapter_staging[layer], host[layer], numel);
        if (r->adapter_staging_numel != numel || !r->adapter_staging || !r->adapter_staging[layer])
            return snprintf(err, err_len, host ? "no device memory for the adapter units of layer %d"
                                               : "the adapter units of layer %d were never received", layer), -1;
    }
    // Merged, unless asked otherwise or --lora adapters are served: theirs apply to the base weights alone.
    if (!r->adapter_updates_lowrank && r->n_adapters == 0) {
        const int merged = merge_policy_adapter(r, c, err, err_len);
        if (merged <= 0) return merged;
        if (!r->lowrank_fallback_logged)
            fprintf(stderr, "tandem-serve: no device memory for a copy of the base's decoder layers, which merging "
                            "adapter updates needs: this and later adapters run as a low-rank path beside the base "
                            "weights (slower decode; free memory with a lower --gpu-memory-utilization, or set "
                            "--adapter-update-mode lowrank to say so)\n");
        r->lowrank_fallback_logged = 1;
    }
    // Low-rank: the live policy adapter's serving copy is rebuilt in place when its shape is the same (between two
    // steps, nothing reads it; only a device fault could fail it then), else a new adapter replaces it.
    Model *m = &r->shards[0].m;
    ModelLora *l = r->adapters[0] && same_adapters(&r->adapters[0]->cfg, c) ? r->adapters[0] : NULL;
    const int fresh = l == NULL;
    char msg[512];
    if (fresh && model_lora_create(&l, m, c, 0, msg, sizeof msg) != 0) return snprintf(err, err_len, "%s", msg), -1;
    int rc = model_lora_serve_from_units(l, (const void *const *)r->adapter_staging, msg, sizeof msg);
    ops_synchronize(l->ops);
    if (rc == 0 && ops_status(l->ops)) snprintf(msg, sizeof msg, "%s", ops_error(l->ops)), rc = -1;
    if (rc == 0) rc = model_lora_rows_reserve(&r->lora_rows, m, r->max_num_batched_tokens, c->r, msg, sizeof msg);
    if (rc != 0) {
        snprintf(err, err_len, "installing the adapter: %s", msg);
        ops_clear_error(l->ops);
        if (fresh) model_lora_free(l);
        return -1;
    }
    if (fresh) {
        model_lora_free(r->adapters[0]);
        r->adapters[0] = l;
    }
    m->lora_rows = &r->lora_rows;
    return 0;
}

void runner_drop_policy_adapter(ModelRunner *r) {
    free_adapter_base(r);   // the live weights are whole new ones
    if (!r->adapters) return;
    model_lora_free(r->adapters[0]);
    r->adapters[0] = NULL;
}
