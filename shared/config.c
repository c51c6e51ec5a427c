// shared/config.c — Hugging Face config.json -> ModelConfig, and back (see docs/model-files.md).
//
// Defaults follow the transformers 5.x config classes (LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig), so a
// file means here what it means to transformers; the few places where tandem is stricter are refusals with a
// message naming the field, never a silent reinterpretation.
#include "shared/err.h"
#include "shared/config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "shared/json_read.h"

// Upper bounds keep every derived product (Hq*D*C, V*C, ...) inside int64 and reject absurd fuzzed values.
#define DIM_MAX    (1 << 20)   // hidden_size, intermediate_size, head_dim
#define COUNT_MAX  (1 << 16)   // layers, heads
#define VOCAB_MAX  (1 << 26)
#define CONFIG_FILE_MAX (16u << 20)

static const char *json_kind(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

// A key counts as absent when missing or null (transformers then uses its default).
static json_t *get(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return (v && !json_is_null(v)) ? v : NULL;
}

// Integer field in [lo, hi]. *out keeps `dflt` when the key is absent; required fields pass required=1.
static int get_int(json_t *obj, const char *key, int required, int dflt, long long lo, long long hi, int *out,
                   char *err, size_t err_len) {
    json_t *v = get(obj, key);
    if (!v) {
        if (required) return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: missing required field \"%s\"", key);
        *out = dflt;
        return 0;
    }
    // An integer beyond int64 arrives as a real (shared/json_read.h): out of range, not of the wrong type.
    if (json_is_real(v) && fabs(json_real_value(v)) >= 0x1p63)
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s\" = %.17g is out of range [%lld, %lld]", key, json_real_value(v),
                    lo, hi);
    if (!json_is_integer(v))
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s\" must be an integer, got %s", key, json_kind(v));
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s\" = %lld is out of range [%lld, %lld]", key, (long long)x, lo,
                    hi);
    *out = (int)x;
    return 0;
}

static int get_bool(json_t *obj, const char *key, int dflt, int *out, char *err, size_t err_len) {
    json_t *v = get(obj, key);
    if (!v) {
        *out = dflt;
        return 0;
    }
    if (!json_is_boolean(v))
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s\" must be true or false, got %s", key, json_kind(v));
    *out = json_is_true(v);
    return 0;
}

// Number (integer or real) field; `where` prefixes the key in messages (e.g. "rope_parameters.").
static int get_number(json_t *obj, const char *where, const char *key, int required, double dflt, double *out,
                      char *err, size_t err_len) {
    json_t *v = get(obj, key);
    if (!v) {
        if (required) return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: missing required field \"%s%s\"", where, key);
        *out = dflt;
        return 0;
    }
    if (!json_is_number(v))
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s%s\" must be a number, got %s", where, key, json_kind(v));
    *out = json_number_value(v);
    if (!isfinite(*out)) return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s%s\" is not finite", where, key);
    return 0;
}

static int positive_float(double x, const char *where, const char *key, float *out, char *err, size_t err_len) {
    // Positive after rounding to float32 too: 1e-86 would silently become 0.
    if (!(x > 0.0) || x > 3.0e38 || !((float)x > 0.0f))
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s%s\" = %g must be a positive float32", where, key, x);
    *out = (float)x;
    return 0;
}

typedef struct {
    const char *arch_name;
    const char *model_type;
    ModelArch arch;
    int max_position;   // class default of max_position_embeddings
    int kv_heads;       // class default of num_key_value_heads when the key is missing (0: = num_attention_heads)
} ArchInfo;

static const ArchInfo ARCHS[] = {
    {"LlamaForCausalLM", "llama", ARCH_LLAMA, 2048, 0},
    {"Qwen2ForCausalLM", "qwen2", ARCH_QWEN2, 32768, 32},
    {"Qwen3ForCausalLM", "qwen3", ARCH_QWEN3, 32768, 32},
    {"MistralForCausalLM", "mistral", ARCH_MISTRAL, 4096 * 32, 8},
};
#define N_ARCHS (sizeof ARCHS / sizeof ARCHS[0])

static const ArchInfo *find_arch(json_t *root, char *err, size_t err_len) {
    json_t *archs = get(root, "architectures");
    if (archs) {
        if (!json_is_array(archs))
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"architectures\" must be an array, got %s", json_kind(archs)),
                   NULL;
        if (json_array_size(archs) > 0) {
            json_t *a0 = json_array_get(archs, 0);
            if (!json_is_string(a0))
                return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"architectures\"[0] must be a string, got %s",
                            json_kind(a0)),
                       NULL;
            for (size_t i = 0; i < N_ARCHS; i++)
                if (strcmp(json_string_value(a0), ARCHS[i].arch_name) == 0) return &ARCHS[i];
            err_fail_code(CONFIG_ERR_INVALID, err, err_len,
                 "config.json: unsupported architecture \"%.64s\" (\"architectures\"[0]); supported: "
                 "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM",
                 json_string_value(a0));
            return NULL;
        }
    }
    json_t *mt = get(root, "model_type");
    if (!mt)
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: missing \"architectures\" (and no \"model_type\" to fall back on)"),
               NULL;
    if (!json_is_string(mt))
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"model_type\" must be a string, got %s", json_kind(mt)), NULL;
    for (size_t i = 0; i < N_ARCHS; i++)
        if (strcmp(json_string_value(mt), ARCHS[i].model_type) == 0) return &ARCHS[i];
    err_fail_code(CONFIG_ERR_INVALID, err, err_len,
         "config.json: unsupported model_type \"%.64s\" (no \"architectures\"); supported: llama, qwen2, qwen3, "
         "mistral",
         json_string_value(mt));
    return NULL;
}

// Rotary embedding parameters. transformers 4.x: top-level rope_theta + rope_scaling ({"rope_type"|"type", ...}
// or null); 5.x: rope_parameters {"rope_type", "rope_theta", ...}. As in transformers' convert_rope_params_to_dict,
// a non-empty rope_scaling wins, and a theta inside the dict wins over the top-level one.
static int parse_rope(ModelConfig *cfg, json_t *root, char *err, size_t err_len) {
    json_t *rp = NULL;
    const char *where = "rope_parameters.";
    json_t *rs = get(root, "rope_scaling");
    if (rs) {
        if (!json_is_object(rs))
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"rope_scaling\" must be an object or null, got %s",
                        json_kind(rs));
        if (json_object_size(rs) > 0) {
            rp = rs;
            where = "rope_scaling.";
        }
    }
    if (!rp) {
        json_t *p = get(root, "rope_parameters");
        if (p && !json_is_object(p))
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"rope_parameters\" must be an object or null, got %s",
                        json_kind(p));
        rp = p;
    }
    double theta, prf;
    if (get_number(root, "", "rope_theta", 0, 10000.0, &theta, err, err_len)) return CONFIG_ERR_INVALID;
    if (get_number(root, "", "partial_rotary_factor", 0, 1.0, &prf, err, err_len)) return CONFIG_ERR_INVALID;
    const char *type = "default";
    if (rp) {
        // Per-layer-type rope dicts ({"full_attention": {...}, ...}) would silently read as the default rope here.
        if (json_is_object(json_object_get(rp, "full_attention")) ||
            json_is_object(json_object_get(rp, "sliding_attention")))
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: per-layer-type \"%.*s\" (nested by attention type) is not "
                        "supported", (int)strlen(where) - 1, where);
        if (get_number(rp, where, "rope_theta", 0, theta, &theta, err, err_len)) return CONFIG_ERR_INVALID;
        if (get_number(rp, where, "partial_rotary_factor", 0, prf, &prf, err, err_len)) return CONFIG_ERR_INVALID;
        json_t *t = get(rp, "rope_type");
        const char *tkey = "rope_type";
        if (!t) {
            t = get(rp, "type");
            tkey = "type";
        }
        if (t) {
            if (!json_is_string(t))
                return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s%s\" must be a string, got %s", where, tkey,
                            json_kind(t));
            type = json_string_value(t);
        }
    }
    if (positive_float(theta, (rp && json_object_get(rp, "rope_theta")) ? where : "", "rope_theta", &cfg->rope_theta,
                       err, err_len))
        return CONFIG_ERR_INVALID;
    if (prf != 1.0)
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"partial_rotary_factor\" = %g is not supported (only 1.0)", prf);
    cfg->rope_factor = 1.0f;
    cfg->rope_low_freq_factor = 1.0f;
    cfg->rope_high_freq_factor = 1.0f;
    cfg->rope_original_max_position = 0;
    double v;
    if (strcmp(type, "default") == 0) {
        cfg->rope_type = ROPE_DEFAULT;
    } else if (strcmp(type, "linear") == 0) {
        cfg->rope_type = ROPE_LINEAR;
        if (get_number(rp, where, "factor", 1, 0, &v, err, err_len) ||
            positive_float(v, where, "factor", &cfg->rope_factor, err, err_len))
            return CONFIG_ERR_INVALID;
    } else if (strcmp(type, "llama3") == 0) {
        cfg->rope_type = ROPE_LLAMA3;
        if (get_number(rp, where, "factor", 1, 0, &v, err, err_len) ||
            positive_float(v, where, "factor", &cfg->rope_factor, err, err_len))
            return CONFIG_ERR_INVALID;
        if (get_number(rp, where, "low_freq_factor", 1, 0, &v, err, err_len) ||
            positive_float(v, where, "low_freq_factor", &cfg->rope_low_freq_factor, err, err_len))
            return CONFIG_ERR_INVALID;
        if (get_number(rp, where, "high_freq_factor", 1, 0, &v, err, err_len) ||
            positive_float(v, where, "high_freq_factor", &cfg->rope_high_freq_factor, err, err_len))
            return CONFIG_ERR_INVALID;
        // The smoothing step divides by (high - low): equal factors would make it 0/0.
        if (!(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor))
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%shigh_freq_factor\" (%g) must be greater than "
                        "low_freq_factor (%g)", where, cfg->rope_high_freq_factor, cfg->rope_low_freq_factor);
        // transformers' standardize_rope_params falls back to max_position_embeddings.
        json_t *o = get(rp, "original_max_position_embeddings");
        if (!o) {
            cfg->rope_original_max_position = cfg->max_position_embeddings;
        } else {
            if (!json_is_integer(o))
                return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%soriginal_max_position_embeddings\" must be an integer, "
                            "got %s", where, json_kind(o));
            json_int_t x = json_integer_value(o);
            if (x <= 0 || x > INT_MAX)
                return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%soriginal_max_position_embeddings\" = %lld is out of "
                            "range", where, (long long)x);
            cfg->rope_original_max_position = (int)x;
        }
    } else {
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: unsupported rope type \"%.32s\" (\"%srope_type\"); supported: "
                    "default, llama3, linear", type, where);
    }
    return 0;
}

// Sliding-window attention is accepted, not refused: the window becomes a cap on the sequence length, so every
// sequence tandem runs is shorter than the window and windowed attention equals full attention exactly.
static int parse_sliding_window(ModelConfig *cfg, json_t *root, char *err, size_t err_len) {
    int sw = 0;
    cfg->sliding_window = 0;
    cfg->max_window_layers = 0;
    if (cfg->arch == ARCH_MISTRAL) {
        // MistralConfig: sliding_window defaults to 4096 when the key is missing; null disables it.
        json_t *v = json_object_get(root, "sliding_window");
        if (!v) {
            sw = 4096;
        } else if (!json_is_null(v)) {
            if (get_int(root, "sliding_window", 0, 0, 1, INT_MAX, &sw, err, err_len)) return CONFIG_ERR_INVALID;
        }
        cfg->sliding_window = sw;
        return 0;
    }
    if (cfg->arch != ARCH_QWEN2 && cfg->arch != ARCH_QWEN3) return 0;
    // Qwen2/3: the window applies only with use_sliding_window, and only to the layers layer_types marks
    // "sliding_attention" (by default the layers from max_window_layers on).
    int use = 0;
    if (get_bool(root, "use_sliding_window", 0, &use, err, err_len)) return CONFIG_ERR_INVALID;
    if (get_int(root, "max_window_layers", 0, 28, 0, INT_MAX, &cfg->max_window_layers, err, err_len))
        return CONFIG_ERR_INVALID;
    json_t *v = json_object_get(root, "sliding_window");
    if (!v) {
        sw = 4096;
    } else if (!json_is_null(v)) {
        if (get_int(root, "sliding_window", 0, 0, 1, INT_MAX, &sw, err, err_len)) return CONFIG_ERR_INVALID;
    }
    int any_sliding = 0;
    json_t *lt = get(root, "layer_types");
    if (lt) {
        if (!json_is_array(lt))
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"layer_types\" must be an array, got %s", json_kind(lt));
        if ((long long)json_array_size(lt) != cfg->num_layers)
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"layer_types\" has %zu entries, num_hidden_layers is %d",
                        json_array_size(lt), cfg->num_layers);
        for (size_t i = 0; i < json_array_size(lt); i++) {
            json_t *e = json_array_get(lt, i);
            const char *s = json_string_value(e);
            if (!s)
                return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"layer_types\"[%zu] must be a string, got %s", i,
                            json_kind(e));
            if (strcmp(s, "sliding_attention") == 0)
                any_sliding = 1;
            else if (strcmp(s, "full_attention") != 0)
                return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"layer_types\"[%zu] = \"%.32s\" is not supported "
                            "(full_attention or sliding_attention)", i, s);
        }
    } else {
        any_sliding = cfg->max_window_layers < cfg->num_layers;
    }
    if (use && sw > 0 && any_sliding) cfg->sliding_window = sw;
    return 0;
}

// bos/eos ids. A missing key takes the class default (LlamaConfig and MistralConfig: bos 1, eos 2; Qwen2/3: none);
// an explicit null means none.
static int parse_token_ids(ModelConfig *cfg, json_t *root, char *err, size_t err_len) {
    const int llama_like = cfg->arch == ARCH_LLAMA || cfg->arch == ARCH_MISTRAL;
    cfg->bos_token_id = -1;
    json_t *b = json_object_get(root, "bos_token_id");
    if (get_int(root, "bos_token_id", 0, (!b && llama_like) ? 1 : -1, 0, INT_MAX, &cfg->bos_token_id, err, err_len))
        return CONFIG_ERR_INVALID;
    cfg->n_eos_token_ids = 0;
    json_t *e = json_object_get(root, "eos_token_id");
    if (!e) {
        if (llama_like) cfg->eos_token_ids[cfg->n_eos_token_ids++] = 2;
        return 0;
    }
    if (json_is_null(e)) return 0;
    const int cap = (int)(sizeof cfg->eos_token_ids / sizeof cfg->eos_token_ids[0]);
    if (json_is_integer(e)) {
        json_int_t x = json_integer_value(e);
        if (x < 0 || x > INT_MAX)
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"eos_token_id\" = %lld is out of range", (long long)x);
        cfg->eos_token_ids[cfg->n_eos_token_ids++] = (int)x;
        return 0;
    }
    if (!json_is_array(e))
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"eos_token_id\" must be an integer, a list or null, got %s",
                    json_kind(e));
    if (json_array_size(e) > (size_t)cap)
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"eos_token_id\" lists %zu ids, at most %d are supported",
                    json_array_size(e), cap);
    for (size_t i = 0; i < json_array_size(e); i++) {
        json_t *x = json_array_get(e, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT_MAX)
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"eos_token_id\"[%zu] must be a non-negative integer", i);
        cfg->eos_token_ids[cfg->n_eos_token_ids++] = (int)json_integer_value(x);
    }
    return 0;
}

static int parse_dtype(ModelConfig *cfg, json_t *root, char *err, size_t err_len) {
    // transformers 5.x writes "dtype", 4.x "torch_dtype"; "dtype" wins when both are present.
    const char *key = "dtype";
    json_t *d = get(root, key);
    if (!d) {
        key = "torch_dtype";
        d = get(root, key);
    }
    cfg->torch_dtype[0] = '\0';
    if (!d) return 0;
    if (!json_is_string(d))
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s\" must be a string, got %s", key, json_kind(d));
    const char *s = json_string_value(d);
    if (strcmp(s, "bfloat16") && strcmp(s, "float16") && strcmp(s, "float32"))
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"%s\" = \"%.32s\" is not supported (bfloat16, float16, float32)",
                    key, s);
    snprintf(cfg->torch_dtype, sizeof cfg->torch_dtype, "%s", s);
    return 0;
}

static int parse_root(ModelConfig *cfg, json_t *root, char *err, size_t err_len) {
    if (!json_is_object(root))
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: the top level must be an object, got %s", json_kind(root));
    const ArchInfo *ai = find_arch(root, err, err_len);
    if (!ai) return CONFIG_ERR_INVALID;
    cfg->arch = ai->arch;
    snprintf(cfg->arch_name, sizeof cfg->arch_name, "%s", ai->arch_name);

    if (get_int(root, "vocab_size", 1, 0, 1, VOCAB_MAX, &cfg->vocab_size, err, err_len) ||
        get_int(root, "hidden_size", 1, 0, 1, DIM_MAX, &cfg->hidden_size, err, err_len) ||
        get_int(root, "intermediate_size", 1, 0, 1, DIM_MAX, &cfg->intermediate_size, err, err_len) ||
        get_int(root, "num_hidden_layers", 1, 0, 1, COUNT_MAX, &cfg->num_layers, err, err_len) ||
        get_int(root, "num_attention_heads", 1, 0, 1, COUNT_MAX, &cfg->num_heads, err, err_len))
        return CONFIG_ERR_INVALID;
    const int C = cfg->hidden_size, Hq = cfg->num_heads;

    // num_key_value_heads: a missing key takes the class default (Qwen2/3: 32, Mistral: 8, Llama: Hq);
    // an explicit null becomes Hq in every class's __post_init__.
    json_t *kv = json_object_get(root, "num_key_value_heads");
    int kv_default = (kv == NULL && ai->kv_heads > 0) ? ai->kv_heads : Hq;
    if (get_int(root, "num_key_value_heads", 0, kv_default, 1, COUNT_MAX, &cfg->num_kv_heads, err, err_len))
        return CONFIG_ERR_INVALID;
    if (Hq % cfg->num_kv_heads != 0)
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"num_key_value_heads\" (%d) must divide num_attention_heads (%d)",
                    cfg->num_kv_heads, Hq);

    // head_dim: Qwen3Config defaults it to 128; the others derive C / Hq when it is missing or null.
    int derived_dim = (ai->arch == ARCH_QWEN3 && json_object_get(root, "head_dim") == NULL) ? 128 : 0;
    if (get_int(root, "head_dim", 0, derived_dim, 1, DIM_MAX, &cfg->head_dim, err, err_len)) return CONFIG_ERR_INVALID;
    if (cfg->head_dim == 0 || ai->arch == ARCH_LLAMA) {
        // LlamaConfig.validate_architecture checks divisibility even with an explicit head_dim.
        if (C % Hq != 0)
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"num_attention_heads\" (%d) must divide hidden_size (%d)", Hq,
                        C);
        if (cfg->head_dim == 0) cfg->head_dim = C / Hq;
    }
    if (cfg->head_dim % 2 != 0)
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"head_dim\" (%d) must be even: rotary embeddings rotate pairs",
                    cfg->head_dim);
    if ((long long)Hq * cfg->head_dim > DIM_MAX)
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: num_attention_heads * head_dim (%lld) is out of range",
                    (long long)Hq * cfg->head_dim);

    if (get_int(root, "max_position_embeddings", 0, ai->max_position, 1, INT_MAX, &cfg->max_position_embeddings,
                err, err_len))
        return CONFIG_ERR_INVALID;

    double eps;
    if (get_number(root, "", "rms_norm_eps", 0, 1e-6, &eps, err, err_len) ||
        positive_float(eps, "", "rms_norm_eps", &cfg->rms_norm_eps, err, err_len))
        return CONFIG_ERR_INVALID;

    json_t *act = get(root, "hidden_act");
    if (act) {
        if (!json_is_string(act))
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"hidden_act\" must be a string, got %s", json_kind(act));
        if (strcmp(json_string_value(act), "silu") != 0)
            return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"hidden_act\" = \"%.32s\" is not supported (only silu)",
                        json_string_value(act));
    }

    if (get_bool(root, "tie_word_embeddings", 0, &cfg->tie_word_embeddings, err, err_len)) return CONFIG_ERR_INVALID;
    // Bias flags as each architecture's modeling code uses them: Qwen2 always has q/k/v bias, Llama and Qwen3
    // read attention_bias, Mistral never has one; only Llama's MLP reads mlp_bias.
    cfg->attention_bias = 0;
    if (ai->arch == ARCH_QWEN2) {
        cfg->attention_bias = 1;
    } else if (ai->arch == ARCH_LLAMA || ai->arch == ARCH_QWEN3) {
        if (get_bool(root, "attention_bias", 0, &cfg->attention_bias, err, err_len)) return CONFIG_ERR_INVALID;
    }
    if (ai->arch == ARCH_LLAMA) {
        int mlp_bias = 0;
        if (get_bool(root, "mlp_bias", 0, &mlp_bias, err, err_len)) return CONFIG_ERR_INVALID;
        if (mlp_bias) return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: \"mlp_bias\": true is not supported");
    }
    cfg->qk_norm = ai->arch == ARCH_QWEN3;

    if (parse_rope(cfg, root, err, err_len) || parse_sliding_window(cfg, root, err, err_len) ||
        parse_token_ids(cfg, root, err, err_len) || parse_dtype(cfg, root, err, err_len))
        return CONFIG_ERR_INVALID;
    cfg->max_seq_len = cfg->max_position_embeddings;
    if (cfg->sliding_window > 0 && cfg->sliding_window < cfg->max_seq_len) cfg->max_seq_len = cfg->sliding_window;
    return 0;
}

int config_parse(ModelConfig *cfg, const char *json_text, size_t len, char *err, size_t err_len) {
    if (!cfg || !json_text) return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config_parse: NULL argument");
    memset(cfg, 0, sizeof *cfg);
    json_error_t je;
    // Duplicate keys are refused: two "hidden_size" entries would make the file mean different things to
    // different readers.
    json_t *root = json_read_buffer(json_text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return err_fail_code(CONFIG_ERR_INVALID, err, err_len, "config.json: invalid JSON at line %d column %d: %s", je.line, je.column, je.text);
    int rc = parse_root(cfg, root, err, err_len);
    json_decref(root);
    if (rc) memset(cfg, 0, sizeof *cfg);
    return rc;
}

int config_load(ModelConfig *cfg, const char *model_dir, char *err, size_t err_len) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/config.json", model_dir) >= (int)sizeof path) {
        if (err && err_len) snprintf(err, err_len, "%s: path too long", model_dir);
        return CONFIG_ERR_IO;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (err && err_len) snprintf(err, err_len, "%s: cannot open: %s", path, strerror(errno));
        return CONFIG_ERR_IO;
    }
    char *buf = malloc(CONFIG_FILE_MAX + 1);
    size_t n = buf ? fread(buf, 1, CONFIG_FILE_MAX + 1, f) : 0;
    int read_err = ferror(f);
    fclose(f);
    if (!buf || read_err || n > CONFIG_FILE_MAX) {
        if (err && err_len)
            snprintf(err, err_len, "%s: %s", path,
                     !buf ? "out of memory" : read_err ? "read error" : "larger than 16 MiB, refused");
        free(buf);
        return CONFIG_ERR_IO;
    }
    char msg[512];
    int rc = config_parse(cfg, buf, n, msg, sizeof msg);
    free(buf);
    if (rc && err && err_len) {
        // Messages start with "config.json: "; replace that with the full path.
        const char *m = strncmp(msg, "config.json: ", 13) == 0 ? msg + 13 : msg;
        snprintf(err, err_len, "%s: %s", path, m);
    }
    return rc;
}

// ---- writing ---------------------------------------------------------------------------------------------

// A float32 value as the double of its shortest decimal form, so that json_dumps with 9 significant digits prints
// 1e-06 rather than 9.99999997e-07 and transformers reads back exactly the number the original file held.
static json_t *json_f32(float f) {
    char buf[32];
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
        if ((float)strtod(buf, NULL) == f) break;
    }
    return json_real(strtod(buf, NULL));
}

char *config_to_json(const ModelConfig *cfg) {
    const ArchInfo *ai = NULL;
    for (size_t i = 0; i < N_ARCHS; i++)
        if (ARCHS[i].arch == cfg->arch) ai = &ARCHS[i];
    if (!ai) return NULL;
    json_t *o = json_object();
    json_t *archs = json_array();
    json_array_append_new(archs, json_string(ai->arch_name));
    json_object_set_new(o, "architectures", archs);
    json_object_set_new(o, "model_type", json_string(ai->model_type));
    json_object_set_new(o, "vocab_size", json_integer(cfg->vocab_size));
    json_object_set_new(o, "hidden_size", json_integer(cfg->hidden_size));
    json_object_set_new(o, "intermediate_size", json_integer(cfg->intermediate_size));
    json_object_set_new(o, "num_hidden_layers", json_integer(cfg->num_layers));
    json_object_set_new(o, "num_attention_heads", json_integer(cfg->num_heads));
    json_object_set_new(o, "num_key_value_heads", json_integer(cfg->num_kv_heads));
    // Qwen2Config has no head_dim attribute (the model derives C / Hq): write it only when it differs.
    if (cfg->arch != ARCH_QWEN2 || cfg->head_dim * cfg->num_heads != cfg->hidden_size)
        json_object_set_new(o, "head_dim", json_integer(cfg->head_dim));
    json_object_set_new(o, "max_position_embeddings", json_integer(cfg->max_position_embeddings));
    json_object_set_new(o, "rms_norm_eps", json_f32(cfg->rms_norm_eps));
    json_object_set_new(o, "hidden_act", json_string("silu"));
    json_object_set_new(o, "tie_word_embeddings", json_boolean(cfg->tie_word_embeddings));
    if (cfg->arch == ARCH_LLAMA || cfg->arch == ARCH_QWEN3)
        json_object_set_new(o, "attention_bias", json_boolean(cfg->attention_bias));
    if (cfg->arch == ARCH_LLAMA) json_object_set_new(o, "mlp_bias", json_false());

    json_t *rp = json_object();
    json_object_set_new(rp, "rope_theta", json_f32(cfg->rope_theta));
    if (cfg->rope_type == ROPE_LLAMA3) {
        json_object_set_new(rp, "rope_type", json_string("llama3"));
        json_object_set_new(rp, "factor", json_f32(cfg->rope_factor));
        json_object_set_new(rp, "low_freq_factor", json_f32(cfg->rope_low_freq_factor));
        json_object_set_new(rp, "high_freq_factor", json_f32(cfg->rope_high_freq_factor));
        json_object_set_new(rp, "original_max_position_embeddings", json_integer(cfg->rope_original_max_position));
    } else if (cfg->rope_type == ROPE_LINEAR) {
        json_object_set_new(rp, "rope_type", json_string("linear"));
        json_object_set_new(rp, "factor", json_f32(cfg->rope_factor));
    } else {
        json_object_set_new(rp, "rope_type", json_string("default"));
    }
    json_object_set_new(o, "rope_parameters", rp);

    json_t *sw = cfg->sliding_window > 0 ? json_integer(cfg->sliding_window) : json_null();
    if (cfg->arch == ARCH_MISTRAL) {
        json_object_set_new(o, "sliding_window", sw);
    } else if (cfg->arch == ARCH_QWEN2 || cfg->arch == ARCH_QWEN3) {
        json_object_set_new(o, "use_sliding_window", json_boolean(cfg->sliding_window > 0));
        json_object_set_new(o, "sliding_window", sw);
        json_object_set_new(o, "max_window_layers", json_integer(cfg->max_window_layers));
        if (cfg->sliding_window > 0) {
            // The layers from max_window_layers on use the window, as transformers derives layer_types. A file whose
            // explicit layer_types disagreed with max_window_layers is written with every layer windowed: the same
            // model, since sequences never exceed the window (max_seq_len).
            int from = cfg->max_window_layers < cfg->num_layers ? cfg->max_window_layers : 0;
            json_t *lt = json_array();
            for (int l = 0; l < cfg->num_layers; l++)
                json_array_append_new(lt, json_string(l >= from ? "sliding_attention" : "full_attention"));
            json_object_set_new(o, "layer_types", lt);
        }
    } else {
        json_decref(sw);
    }

    json_object_set_new(o, "bos_token_id", cfg->bos_token_id >= 0 ? json_integer(cfg->bos_token_id) : json_null());
    if (cfg->n_eos_token_ids == 1) {
        json_object_set_new(o, "eos_token_id", json_integer(cfg->eos_token_ids[0]));
    } else if (cfg->n_eos_token_ids > 1) {
        json_t *e = json_array();
        for (int i = 0; i < cfg->n_eos_token_ids && i < 8; i++) json_array_append_new(e, json_integer(cfg->eos_token_ids[i]));
        json_object_set_new(o, "eos_token_id", e);
    } else {
        json_object_set_new(o, "eos_token_id", json_null());
    }
    if (cfg->torch_dtype[0]) json_object_set_new(o, "dtype", json_string(cfg->torch_dtype));

    char *text = json_dumps(o, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(9));
    json_decref(o);
    return text;
}

// ---- rotary frequencies -----------------------------------------------------------------------------------

// transformers computes these in float32 tensors, one rounding per tensor op; each step below is one of those ops
// (volatile keeps the compiler from fusing a*b+c into an FMA, which torch's separate ops never do).
void config_rope_inv_freq(const ModelConfig *cfg, float *inv_freq) {
    const int D = cfg->head_dim;
    const float theta = cfg->rope_theta;
    for (int i = 0; i < D / 2; i++) {
        // 1 / theta ** (arange(0, D, 2).float() / D)
        float expo = (float)(2 * i) / (float)D;
        float p = (float)pow((double)theta, (double)expo);
        inv_freq[i] = 1.0f / p;
    }
    if (cfg->rope_type == ROPE_LINEAR) {
        for (int i = 0; i < D / 2; i++) inv_freq[i] = inv_freq[i] / cfg->rope_factor;
        return;
    }
    if (cfg->rope_type != ROPE_LLAMA3) return;
    // _compute_llama3_parameters: long wavelengths (beyond old_context / low_freq_factor) are slowed by `factor`,
    // short ones (below old_context / high_freq_factor) kept, and the band between interpolated smoothly.
    const float factor = cfg->rope_factor, lo = cfg->rope_low_freq_factor, hi = cfg->rope_high_freq_factor;
    const double old_ctx = (double)cfg->rope_original_max_position;
    const float low_wavelen = (float)(old_ctx / lo);     // python float, compared against a float32 tensor
    const float high_wavelen = (float)(old_ctx / hi);
    const float two_pi = (float)(2.0 * M_PI);
    const float band = (float)((double)hi - (double)lo);
    for (int i = 0; i < D / 2; i++) {
        const float f = inv_freq[i];
        volatile float recip = 1.0f / f;
        const float wavelen = recip * two_pi;            // torch: (2*pi) / t == t.reciprocal() * (2*pi)
        float scaled = wavelen > low_wavelen ? f / factor : f;
        if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
            volatile float rw = 1.0f / wavelen;
            volatile float ratio = rw * (float)old_ctx;  // old_context_len / wavelen
            volatile float smooth = (ratio - lo) / band;
            volatile float a = (1.0f - smooth) * scaled;
            volatile float a_div = a / factor;
            volatile float b = smooth * scaled;
            scaled = a_div + b;
        }
        inv_freq[i] = scaled;
    }
}
