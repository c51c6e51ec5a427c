// shared/model_lora_io.c — PEFT adapter folders: adapter_config.json and adapter_model.safetensors, read and
// written (shared/model_lora.h). PEFT's loader (PeftModel.from_pretrained) reads what model_lora_save writes; the
// keys written are those of PEFT's LoraConfig that describe what tandem trains, the rest keep PEFT's defaults.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shared/model_lora.h"
#include "shared/safetensors.h"

#define ADAPTER_CONFIG "adapter_config.json"
#define ADAPTER_WEIGHTS "adapter_model.safetensors"

// A key that must be absent, null, false, empty or equal to `fine` (a string) for tandem to run the adapter.
static int refuse_set(json_t *root, const char *key, const char *fine, const char *path, char *err, size_t err_len) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v) || json_is_false(v) || (json_is_object(v) && json_object_size(v) == 0) ||
        (json_is_array(v) && json_array_size(v) == 0) ||
        (fine && json_is_string(v) && !strcmp(json_string_value(v), fine)))
        return 0;
    snprintf(err, err_len, "%s: \"%s\" is set; tandem runs plain LoRA adapters only (%s%s%s)", path, key,
             fine ? "it must be \"" : "it must be unset, null or false", fine ? fine : "", fine ? "\"" : "");
    return -1;
}

int lora_config_read(const char *dir, LoraConfig *c, char *err, size_t err_len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, ADAPTER_CONFIG);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) {
        snprintf(err, err_len, "cannot read %s: %s (a PEFT adapter folder holds adapter_config.json)", path, je.text);
        return -1;
    }
    int rc = -1;
    memset(c, 0, sizeof *c);
    json_t *v = json_object_get(root, "peft_type");
    if (!json_is_string(v) || strcmp(json_string_value(v), "LORA") != 0) {
        snprintf(err, err_len, "%s: \"peft_type\" must be \"LORA\"", path);
        goto done;
    }
    static const char *const unsupported[] = {"use_dora", "rank_pattern", "alpha_pattern", "fan_in_fan_out",
                                              "layers_to_transform", "modules_to_save", "layer_replication",
                                              "lora_bias", "trainable_token_indices", "exclude_modules",
                                              "target_parameters"};
    for (size_t i = 0; i < sizeof unsupported / sizeof *unsupported; i++)
        if (refuse_set(root, unsupported[i], NULL, path, err, err_len) != 0) goto done;
    if (refuse_set(root, "bias", "none", path, err, err_len) != 0) goto done;
    v = json_object_get(root, "r");
    if (!json_is_integer(v)) {
        snprintf(err, err_len, "%s: \"r\" must be an integer", path);
        goto done;
    }
    c->r = (int)json_integer_value(v);
    v = json_object_get(root, "lora_alpha");
    if (!json_is_number(v)) {
        snprintf(err, err_len, "%s: \"lora_alpha\" must be a number", path);
        goto done;
    }
    c->alpha = (float)json_number_value(v);
    c->use_rslora = json_is_true(json_object_get(root, "use_rslora"));
    v = json_object_get(root, "init_lora_weights");
    c->init = json_is_string(v) && !strcmp(json_string_value(v), "gaussian") ? LORA_INIT_GAUSSIAN : LORA_INIT_DEFAULT;
    // Dropout acts in training only: an adapter trained with it loads and runs as any other.
    c->dropout = 0.0f;
    v = json_object_get(root, "target_modules");
    if (json_is_string(v)) {
        if (strcmp(json_string_value(v), "all-linear") != 0) {
            snprintf(err, err_len, "%s: \"target_modules\" is the pattern '%s'; tandem takes a list of module names "
                     "or all-linear", path, json_string_value(v));
            goto done;
        }
        c->targets = LORA_ALL_TARGETS;
    } else if (json_is_array(v) && json_array_size(v) > 0) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) {
            unsigned bits;
            if (!json_is_string(e)) {
                snprintf(err, err_len, "%s: \"target_modules\" holds a non-string", path);
                goto done;
            }
            // PEFT matches a module whose name is the entry or ends with "." + entry, and writes all-linear as
            // every adapted module's full name (model.layers.3.mlp.up_proj): the last component names the module.
            // An adapter on some layers only then lacks tensors that model_lora_load asks for, and is refused there.
            const char *name = strrchr(json_string_value(e), '.');
            name = name ? name + 1 : json_string_value(e);
            char msg[256];
            if (lora_parse_targets(name, &bits, msg, sizeof msg) != 0) {
                snprintf(err, err_len, "%s: %s", path, msg);
                goto done;
            }
            c->targets |= bits;
        }
    } else {
        snprintf(err, err_len, "%s: \"target_modules\" must be a list of module names", path);
        goto done;
    }
    char msg[256];
    if (lora_config_check(c, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "%s: %s", path, msg);
        goto done;
    }
    rc = 0;
done:
    json_decref(root);
    return rc;
}

int model_lora_load(ModelLora *l, const char *dir, float *const *host, char *err, size_t err_len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, ADAPTER_WEIGHTS);
    SafetensorsSet *set;
    if (st_open(&set, path, err, err_len) != 0) return -1;
    int rc = -1;
    // Every tensor must be one of ours: an adapter for a module tandem does not target (or another rank) is refused.
    for (size_t i = 0; i < st_count(set); i++) {
        const StTensor *t = st_tensor_at(set, i);
        int found = 0;
        for (int k = 0; k < l->n_tensors && !found; k++) found = !strcmp(l->tensors[k].name, t->name);
        if (!found) {
            char mods[128];
            lora_targets_text(l->cfg.targets, mods, sizeof mods);
            snprintf(err, err_len, "%s: tensor %s has no place in the adapter that adapter_config.json describes "
                     "(r %d, target_modules %s, %d layers)", path, t->name, l->cfg.r, mods, l->n_layers);
            goto done;
        }
    }
    for (int layer = 0; layer < l->n_layers; layer++) memset(host[layer], 0, l->unit_numel * sizeof(float));
    for (int k = 0; k < l->n_tensors; k++) {
        const LayoutTensor *lt = &l->tensors[k];
        const StTensor *t = st_find(set, lt->name);
        if (!t) {
            snprintf(err, err_len, "%s: tensor %s is missing (tandem adapts every layer alike: an adapter on some "
                     "layers only is not supported)", path, lt->name);
            goto done;
        }
        if (st_check_param(t, err, err_len) != 0 || st_check_shape(t, 2, lt->shape, err, err_len) != 0 ||
            st_read_f32(t, host[lt->unit] + lt->offset, lt->numel, err, err_len) != 0)
            goto done;
    }
    for (int layer = 0; layer < l->n_layers; layer++)
        ops_upload_f32(l->ops, l->params[layer], host[layer], l->unit_numel);
    ops_synchronize(l->ops);
    if (ops_status(l->ops)) {
        snprintf(err, err_len, "loading %s: %s", path, ops_error(l->ops));
        goto done;
    }
    rc = 0;
done:
    st_close(set);
    return rc;
}

static int write_config(const ModelLora *l, const char *dir, const char *base_model, char *err, size_t err_len) {
    json_t *targets = json_array();
    for (int i = 0; i < LORA_N_MODULES; i++)
        if (l->cfg.targets & (1u << i)) json_array_append_new(targets, json_string(lora_module_name(i)));
    json_t *j = json_pack("{s:s, s:s, s:o, s:i, s:f, s:f, s:o, s:b, s:s, s:b, s:b, s:b, s:o, s:o}", "peft_type", "LORA",
                          "task_type", "CAUSAL_LM", "base_model_name_or_path",
                          base_model ? json_string(base_model) : json_null(), "r", l->cfg.r, "lora_alpha",
                          (double)l->cfg.alpha, "lora_dropout", (double)l->cfg.dropout, "target_modules", targets,
                          "use_rslora", l->cfg.use_rslora, "bias", "none", "fan_in_fan_out", 0, "use_dora", 0,
                          "inference_mode", 1, "modules_to_save", json_null(), "init_lora_weights",
                          l->cfg.init == LORA_INIT_GAUSSIAN ? json_string("gaussian") : json_true());
    if (!j) {
        snprintf(err, err_len, "out of memory for adapter_config.json");
        return -1;
    }
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/%s", dir, ADAPTER_CONFIG);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int rc = json_dump_file(j, tmp, JSON_INDENT(2)) == 0 && rename(tmp, path) == 0 ? 0 : -1;
    json_decref(j);
    if (rc != 0) snprintf(err, err_len, "cannot write %s (is the folder writable?)", path);
    return rc;
}

int model_lora_save(const ModelLora *l, float *const *host, const char *dir, const char *base_model, char *err,
                    size_t err_len) {
    if (mkdir(dir, 0755) != 0) {
        struct stat st;
        if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
            snprintf(err, err_len, "cannot make the adapter folder %s", dir);
            return -1;
        }
    }
    StWriter *w;
    if (st_writer_create(&w, err, err_len) != 0) return -1;
    int rc = -1;
    for (int k = 0; k < l->n_tensors; k++) {
        const LayoutTensor *t = &l->tensors[k];
        if (st_writer_add(w, t->name, ST_F32, 2, t->shape, host[t->unit] + t->offset, ST_F32, err, err_len) != 0)
            goto done;
    }
    // The writer names its file model.safetensors: write into a folder of our own, then move it into place.
    char tmp_dir[4096], from[4200], to[4200];
    snprintf(tmp_dir, sizeof tmp_dir, "%s/.adapter-tmp", dir);
    if (st_writer_write(w, tmp_dir, 0, err, err_len) != 0) goto done;
    snprintf(from, sizeof from, "%s/model.safetensors", tmp_dir);
    snprintf(to, sizeof to, "%s/%s", dir, ADAPTER_WEIGHTS);
    if (rename(from, to) != 0) {
        snprintf(err, err_len, "cannot move %s to %s", from, to);
        goto done;
    }
    rmdir(tmp_dir);
    rc = write_config(l, dir, base_model, err, err_len);
done:
    st_writer_free(w);
    return rc;
}
