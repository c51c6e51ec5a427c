// shared/model_io.c — loading a Hugging Face model folder into units, and saving units as one.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "shared/model.h"
#include "shared/safetensors.h"

// Tensors a checkpoint may carry that the layout deliberately has no place for.
static int tolerated_extra(const Model *m, const char *name) {
    if (m->layout.lm_head == SIZE_MAX && strcmp(name, "lm_head.weight") == 0) return 1; // tied: same as embed_tokens
    size_t n = strlen(name), k = strlen("rotary_emb.inv_freq");
    return n >= k && strcmp(name + n - k, "rotary_emb.inv_freq") == 0; // old checkpoints store RoPE buffers
}

int model_check_tensors(const Model *m, const SafetensorsSet *set, char *err, size_t err_len) {
    for (size_t i = 0; i < st_count(set); i++) {
        const StTensor *t = st_tensor_at(set, i);
        if (layout_find(&m->layout, t->name) < 0 && !tolerated_extra(m, t->name)) {
            snprintf(err, err_len, "unexpected tensor %s in %s: a %s with this config.json has no such parameter",
                     t->name, t->path, m->cfg.arch_name);
            return -1;
        }
    }
    return 0;
}

int model_read_unit(const Model *m, const SafetensorsSet *set, int unit, float *host, char *err, size_t err_len) {
    const Layout *L = &m->layout;
    memset(host, 0, L->unit_numel[unit] * sizeof(float));
    for (int i = 0; i < L->n_tensors; i++) {
        const LayoutTensor *lt = &L->tensors[i];
        if (lt->unit != unit) continue;
        const StTensor *t = st_find(set, lt->name);
        if (!t) {
            snprintf(err, err_len, "tensor %s is missing from the checkpoint", lt->name);
            return -1;
        }
        if (st_check_param(t, err, err_len) != 0 || st_check_shape(t, lt->ndim, lt->shape, err, err_len) != 0 ||
            st_read_f32(t, host + lt->offset, lt->numel, err, err_len) != 0)
            return -1;
    }
    return 0;
}

int model_load_weights(const Model *m, ResidentWeights *w, const char *model_dir, char *err, size_t err_len) {
    const Layout *L = &m->layout;
    SafetensorsSet *set = NULL;
    if (st_open(&set, model_dir, err, err_len) != 0) return -1;
    int rc = -1;
    float *host = NULL;
    if (model_check_tensors(m, set, err, err_len) != 0) goto out;
    host = malloc(L->max_unit_numel * sizeof(float));
    if (!host) {
        snprintf(err, err_len, "out of host memory loading %s", model_dir);
        goto out;
    }
    for (int u = 0; u < L->n_units; u++) {
        if (model_read_unit(m, set, u, host, err, err_len) != 0) goto out;
        ops_upload_f32(m->ops, w->params[u], host, L->unit_numel[u]);
    }
    ops_synchronize(m->ops);
    if (ops_status(m->ops)) {
        snprintf(err, err_len, "uploading %s: %s", model_dir, ops_error(m->ops));
        goto out;
    }
    rc = 0;
out:
    free(host);
    st_close(set);
    return rc;
}

int model_load(Model *m, ResidentWeights *w, OpsCtx *ops, const char *model_dir, char *err, size_t err_len) {
    ModelConfig cfg;
    if (config_load(&cfg, model_dir, err, err_len) != 0) return -1;
    if (model_init(m, &cfg, ops, err, err_len) != 0) return -1;
    if (resident_alloc(w, m, 0, err, err_len) != 0) {
        model_free(m);
        return -1;
    }
    if (model_load_weights(m, w, model_dir, err, err_len) != 0) {
        resident_free(w, m);
        model_free(m);
        return -1;
    }
    return 0;
}

static int write_text_file(const char *dir, const char *name, const char *text, char *err, size_t err_len) {
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        snprintf(err, err_len, "cannot write %s: %s", tmp, strerror(errno));
        return -1;
    }
    int ok = fputs(text, f) >= 0;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        snprintf(err, err_len, "cannot write %s: %s", path, strerror(errno));
        remove(tmp);
        return -1;
    }
    return 0;
}

int model_save_host(const Model *m, float *const *units, const char *out_dir, int dtype_bf16, size_t max_shard_bytes,
                    char *err, size_t err_len) {
    const Layout *L = &m->layout;
    StWriter *w = NULL;
    if (st_writer_create(&w, err, err_len) != 0) return -1;
    int rc = -1;
    for (int i = 0; i < L->n_tensors; i++) {
        const LayoutTensor *t = &L->tensors[i];
        if (st_writer_add(w, t->name, dtype_bf16 ? ST_BF16 : ST_F32, t->ndim, t->shape, units[t->unit] + t->offset,
                          ST_F32, err, err_len) != 0)
            goto out;
    }
    if (st_writer_write(w, out_dir, max_shard_bytes, err, err_len) != 0) goto out;
    ModelConfig cfg = m->cfg;
    snprintf(cfg.torch_dtype, sizeof cfg.torch_dtype, "%s", dtype_bf16 ? "bfloat16" : "float32");
    char *json = config_to_json(&cfg);
    if (!json) {
        snprintf(err, err_len, "out of memory writing config.json");
        goto out;
    }
    rc = write_text_file(out_dir, "config.json", json, err, err_len);
    free(json);
out:
    st_writer_free(w);
    return rc;
}

int model_save(const Model *m, UnitSource *units, const char *out_dir, int dtype_bf16, size_t max_shard_bytes,
               char *err, size_t err_len) {
    const Layout *L = &m->layout;
    float **host = calloc((size_t)L->n_units, sizeof(float *));
    int rc = -1;
    if (!host) {
        snprintf(err, err_len, "out of host memory saving to %s", out_dir);
        return -1;
    }
    // The writer reads every tensor when it writes, so all units stay in host memory until then.
    for (int u = 0; u < L->n_units; u++) {
        host[u] = malloc(L->unit_numel[u] * sizeof(float));
        const void *p = units->acquire(units->user, u);
        if (!host[u] || !p) {
            snprintf(err, err_len, "saving unit %d: %s", u, host[u] ? ops_error(m->ops) : "out of host memory");
            goto out;
        }
        ops_download_f32(m->ops, host[u], p, L->unit_numel[u]);
        if (units->release) units->release(units->user, u);
    }
    ops_synchronize(m->ops);
    if (ops_status(m->ops)) {
        snprintf(err, err_len, "saving to %s: %s", out_dir, ops_error(m->ops));
        goto out;
    }
    rc = model_save_host(m, host, out_dir, dtype_bf16, max_shard_bytes, err, err_len);
out:
    for (int u = 0; u < L->n_units; u++) free(host[u]);
    free(host);
    return rc;
}
