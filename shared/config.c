// shared/config.c — Hugging Face config.json -> ModelConfig, and back (see docs/model-files.md).
//
// Defaults follow the transformers 5.x config classes (LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig), so a
// file means here what it means to transformers; the few places where tandem is stricter are refusals with a
// message naming the field, never a silent reinterpretation.
#include "shared/err.h"
#include "shared/config.h"

#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "shared/json_get.h"
#include "shared/json_read.h"

// Upper bounds keep every derived product (Hq*D*C, V*C, ...) inside int64 and reject absurd fuzzed values.
#define DIM_MAX    (1 << 20)   // hidden_size, intermediate_size, head_dim
#define COUNT_MAX  (1 << 16)   // layers, heads
#define VOCAB_MAX  (1 << 26)
#define CONFIG_FILE_MAX (16u << 20)

// Every read goes through shared/json_get.h: messages start "config.json: " (config_load puts the file's path
// there) and name the field's full path; null reads as absent, as transformers takes it for its default.
#define FAIL_INVALID(...) err_fail_code(CONFIG_ERR_INVALID, at->err, at->err_len, __VA_ARGS__)

// A positive float32, also after rounding (1e-86 would silently become 0).
static int positive_float(const JsonAt *at, const char *key, double x, float *out) {
    if (!(x > 0.0) || x > 3.0e38 || !((float)x > 0.0f))
        return json_get_fail(at, key, "must be a positive float32, got %g", x);
    *out = (float)x;
    return 0;
}

// A number member that must be a positive float32.
static int get_positive_float(const JsonAt *at, const char *key, JsonPresence presence, double default_value,
                              float *out) {
    double x;
    int rc = json_get_double(at, key, presence, default_value, -DBL_MAX, DBL_MAX, &x);
    return rc ? rc : positive_float(at, key, x, out);
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

static const ArchInfo *find_arch(const JsonAt *at) {
    JsonAt archs;
    if (json_get_array(at, "architectures", JSON_GET_OPTIONAL, &archs)) return NULL;
    if (archs.json && json_array_size(archs.json) > 0) {
        JsonAt first = json_at_element(&archs, 0);
        const char *name;
        if (json_get_string(&first, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &name, NULL)) return NULL;
        for (size_t i = 0; i < N_ARCHS; i++)
            if (strcmp(name, ARCHS[i].arch_name) == 0) return &ARCHS[i];
        FAIL_INVALID("config.json: unsupported architecture \"%.64s\" (\"architectures\"[0]); supported: "
                     "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM",
                     name);
        return NULL;
    }
    const char *model_type;
    if (json_get_string(at, "model_type", JSON_GET_OPTIONAL, NULL, JSON_ANY_LENGTH, &model_type, NULL)) return NULL;
    if (!model_type) {
        FAIL_INVALID("config.json: missing \"architectures\" (and no \"model_type\" to fall back on)");
        return NULL;
    }
    for (size_t i = 0; i < N_ARCHS; i++)
        if (strcmp(model_type, ARCHS[i].model_type) == 0) return &ARCHS[i];
    FAIL_INVALID("config.json: unsupported model_type \"%.64s\" (no \"architectures\"); supported: llama, qwen2, "
                 "qwen3, mistral",
                 model_type);
    return NULL;
}

// Rotary embedding parameters. transformers 4.x: top-level rope_theta + rope_scaling ({"rope_type"|"type", ...}
// or null); 5.x: rope_parameters {"rope_type", "rope_theta", ...}. As in transformers' convert_rope_params_to_dict,
// a non-empty rope_scaling wins, and a theta inside the dict wins over the top-level one.
static int parse_rope(ModelConfig *cfg, const JsonAt *at) {
    JsonAt rope;   // rope.json NULL: neither dict
    if (json_get_object(at, "rope_scaling", JSON_GET_OPTIONAL, &rope)) return CONFIG_ERR_INVALID;
    if (!rope.json || json_object_size(rope.json) == 0) {
        if (json_get_object(at, "rope_parameters", JSON_GET_OPTIONAL, &rope)) return CONFIG_ERR_INVALID;
    }
    double theta, prf;
    if (json_get_double(at, "rope_theta", JSON_GET_OPTIONAL, 10000.0, -DBL_MAX, DBL_MAX, &theta) ||
        json_get_double(at, "partial_rotary_factor", JSON_GET_OPTIONAL, 1.0, -DBL_MAX, DBL_MAX, &prf))
        return CONFIG_ERR_INVALID;
    const JsonAt *theta_at = at, *prf_at = at;   // where each value came from, for messages
    const char *type = "default";
    if (rope.json) {
        // Per-layer-type rope dicts ({"full_attention": {...}, ...}) would silently read as the default rope here.
        if (json_is_object(json_object_get(rope.json, "full_attention")) ||
            json_is_object(json_object_get(rope.json, "sliding_attention")))
            return json_get_fail(&rope, NULL, "holds per-layer-type parameters (nested by attention type), which are "
                                 "not supported");
        if (json_get_present(&rope, "rope_theta")) theta_at = &rope;
        if (json_get_present(&rope, "partial_rotary_factor")) prf_at = &rope;
        if (json_get_double(&rope, "rope_theta", JSON_GET_OPTIONAL, theta, -DBL_MAX, DBL_MAX, &theta) ||
            json_get_double(&rope, "partial_rotary_factor", JSON_GET_OPTIONAL, prf, -DBL_MAX, DBL_MAX, &prf))
            return CONFIG_ERR_INVALID;
        const char *type_key = json_get_present(&rope, "rope_type") ? "rope_type" : "type";
        if (json_get_string(&rope, type_key, JSON_GET_OPTIONAL, "default", JSON_ANY_LENGTH, &type, NULL))
            return CONFIG_ERR_INVALID;
        if (strcmp(type, "default") && strcmp(type, "linear") && strcmp(type, "llama3"))
            return json_get_fail(&rope, type_key, "= \"%.32s\" is not supported (default, llama3, linear)", type);
    }
    if (positive_float(theta_at, "rope_theta", theta, &cfg->rope_theta)) return CONFIG_ERR_INVALID;
    if (prf != 1.0) return json_get_fail(prf_at, "partial_rotary_factor", "= %g is not supported (only 1.0)", prf);
    cfg->rope_factor = 1.0f;
    cfg->rope_low_freq_factor = 1.0f;
    cfg->rope_high_freq_factor = 1.0f;
    cfg->rope_original_max_position = 0;
    if (strcmp(type, "default") == 0) {
        cfg->rope_type = ROPE_DEFAULT;
    } else if (strcmp(type, "linear") == 0) {
        cfg->rope_type = ROPE_LINEAR;
        if (get_positive_float(&rope, "factor", JSON_GET_REQUIRED, 0, &cfg->rope_factor)) return CONFIG_ERR_INVALID;
    } else {
        cfg->rope_type = ROPE_LLAMA3;
        if (get_positive_float(&rope, "factor", JSON_GET_REQUIRED, 0, &cfg->rope_factor) ||
            get_positive_float(&rope, "low_freq_factor", JSON_GET_REQUIRED, 0, &cfg->rope_low_freq_factor) ||
            get_positive_float(&rope, "high_freq_factor", JSON_GET_REQUIRED, 0, &cfg->rope_high_freq_factor))
            return CONFIG_ERR_INVALID;
        // The smoothing step divides by (high - low): equal factors would make it 0/0.
        if (!(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor))
            return json_get_fail(&rope, "high_freq_factor", "(%g) must be greater than low_freq_factor (%g)",
                                 cfg->rope_high_freq_factor, cfg->rope_low_freq_factor);
        // transformers' standardize_rope_params falls back to max_position_embeddings.
        if (json_get_int(&rope, "original_max_position_embeddings", JSON_GET_OPTIONAL, cfg->max_position_embeddings,
                         1, INT_MAX, &cfg->rope_original_max_position))
            return CONFIG_ERR_INVALID;
    }
    return 0;
}

// Sliding-window attention is accepted, not refused: the window becomes a cap on the sequence length, so every
// sequence tandem runs is shorter than the window and windowed attention equals full attention exactly.
static int parse_sliding_window(ModelConfig *cfg, const JsonAt *at) {
    cfg->sliding_window = 0;
    cfg->max_window_layers = 0;
    if (cfg->arch != ARCH_MISTRAL && cfg->arch != ARCH_QWEN2 && cfg->arch != ARCH_QWEN3) return 0;
    // MistralConfig and Qwen2/3Config: sliding_window defaults to 4096 when the key is missing; null disables it.
    int sw = 0;
    const int sw_default = json_object_get(at->json, "sliding_window") ? 0 : 4096;
    if (json_get_int(at, "sliding_window", JSON_GET_OPTIONAL, sw_default, 1, INT_MAX, &sw)) return CONFIG_ERR_INVALID;
    if (cfg->arch == ARCH_MISTRAL) {
        cfg->sliding_window = sw;
        return 0;
    }
    // Qwen2/3: the window applies only with use_sliding_window, and only to the layers layer_types marks
    // "sliding_attention" (by default the layers from max_window_layers on).
    int use = 0;
    if (json_get_bool(at, "use_sliding_window", JSON_GET_OPTIONAL, 0, &use) ||
        json_get_int(at, "max_window_layers", JSON_GET_OPTIONAL, 28, 0, INT_MAX, &cfg->max_window_layers))
        return CONFIG_ERR_INVALID;
    int any_sliding = 0;
    JsonAt layer_types;
    if (json_get_array(at, "layer_types", JSON_GET_OPTIONAL, &layer_types)) return CONFIG_ERR_INVALID;
    if (layer_types.json) {
        const size_t n = json_array_size(layer_types.json);
        if ((long long)n != cfg->num_layers)
            return json_get_fail(&layer_types, NULL, "has %zu entries, num_hidden_layers is %d", n, cfg->num_layers);
        for (size_t i = 0; i < n; i++) {
            JsonAt entry = json_at_element(&layer_types, i);
            const char *s;
            if (json_get_string(&entry, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL))
                return CONFIG_ERR_INVALID;
            if (strcmp(s, "sliding_attention") == 0)
                any_sliding = 1;
            else if (strcmp(s, "full_attention") != 0)
                return json_get_fail(&entry, NULL, "= \"%.32s\" is not supported (full_attention or "
                                     "sliding_attention)", s);
        }
    } else {
        any_sliding = cfg->max_window_layers < cfg->num_layers;
    }
    if (use && sw > 0 && any_sliding) cfg->sliding_window = sw;
    return 0;
}

// bos/eos ids. A missing key takes the class default (LlamaConfig and MistralConfig: bos 1, eos 2; Qwen2/3: none);
// an explicit null means none.
static int parse_token_ids(ModelConfig *cfg, const JsonAt *at) {
    const int llama_like = cfg->arch == ARCH_LLAMA || cfg->arch == ARCH_MISTRAL;
    const int bos_default = (!json_object_get(at->json, "bos_token_id") && llama_like) ? 1 : -1;
    if (json_get_int(at, "bos_token_id", JSON_GET_OPTIONAL, bos_default, 0, INT_MAX, &cfg->bos_token_id))
        return CONFIG_ERR_INVALID;
    cfg->n_eos_token_ids = 0;
    const json_t *e = json_object_get(at->json, "eos_token_id");
    if (!e) {
        if (llama_like) cfg->eos_token_ids[cfg->n_eos_token_ids++] = 2;
        return 0;
    }
    if (json_is_null(e)) return 0;
    const int cap = (int)(sizeof cfg->eos_token_ids / sizeof cfg->eos_token_ids[0]);
    if (json_is_number(e)) {
        if (json_get_int(at, "eos_token_id", JSON_GET_REQUIRED, 0, 0, INT_MAX, &cfg->eos_token_ids[0]))
            return CONFIG_ERR_INVALID;
        cfg->n_eos_token_ids = 1;
        return 0;
    }
    if (!json_is_array(e))
        return json_get_fail(at, "eos_token_id", "must be an integer, a list or null, got %s", json_kind_name(e));
    JsonAt ids = json_at_value(at, e, "eos_token_id");
    if (json_array_size(e) > (size_t)cap)
        return json_get_fail(&ids, NULL, "lists %zu ids, at most %d are supported", json_array_size(e), cap);
    for (size_t i = 0; i < json_array_size(e); i++) {
        JsonAt id = json_at_element(&ids, i);
        if (json_get_int(&id, NULL, JSON_GET_REQUIRED, 0, 0, INT_MAX, &cfg->eos_token_ids[cfg->n_eos_token_ids]))
            return CONFIG_ERR_INVALID;
        cfg->n_eos_token_ids++;
    }
    return 0;
}

static int parse_dtype(ModelConfig *cfg, const JsonAt *at) {
    // transformers 5.x writes "dtype", 4.x "torch_dtype"; "dtype" wins when both are present.
    const char *key = json_get_present(at, "dtype") ? "dtype" : "torch_dtype";
    const char *s;
    cfg->torch_dtype[0] = '\0';
    if (json_get_string(at, key, JSON_GET_OPTIONAL, NULL, JSON_ANY_LENGTH, &s, NULL)) return CONFIG_ERR_INVALID;
    if (!s) return 0;
    if (strcmp(s, "bfloat16") && strcmp(s, "float16") && strcmp(s, "float32"))
        return json_get_fail(at, key, "= \"%.32s\" is not supported (bfloat16, float16, float32)", s);
    snprintf(cfg->torch_dtype, sizeof cfg->torch_dtype, "%s", s);
    return 0;
}

static int parse_root(ModelConfig *cfg, const JsonAt *at) {
    if (!json_is_object(at->json))
        return json_get_fail(at, NULL, "must be an object, got %s", json_kind_name(at->json));
    const ArchInfo *ai = find_arch(at);
    if (!ai) return CONFIG_ERR_INVALID;
    cfg->arch = ai->arch;
    snprintf(cfg->arch_name, sizeof cfg->arch_name, "%s", ai->arch_name);

    if (json_get_int(at, "vocab_size", JSON_GET_REQUIRED, 0, 1, VOCAB_MAX, &cfg->vocab_size) ||
        json_get_int(at, "hidden_size", JSON_GET_REQUIRED, 0, 1, DIM_MAX, &cfg->hidden_size) ||
        json_get_int(at, "intermediate_size", JSON_GET_REQUIRED, 0, 1, DIM_MAX, &cfg->intermediate_size) ||
        json_get_int(at, "num_hidden_layers", JSON_GET_REQUIRED, 0, 1, COUNT_MAX, &cfg->num_layers) ||
        json_get_int(at, "num_attention_heads", JSON_GET_REQUIRED, 0, 1, COUNT_MAX, &cfg->num_heads))
        return CONFIG_ERR_INVALID;
    const int C = cfg->hidden_size, Hq = cfg->num_heads;

    // num_key_value_heads: a missing key takes the class default (Qwen2/3: 32, Mistral: 8, Llama: Hq);
    // an explicit null becomes Hq in every class's __post_init__.
    const int kv_default = (!json_object_get(at->json, "num_key_value_heads") && ai->kv_heads > 0) ? ai->kv_heads : Hq;
    if (json_get_int(at, "num_key_value_heads", JSON_GET_OPTIONAL, kv_default, 1, COUNT_MAX, &cfg->num_kv_heads))
        return CONFIG_ERR_INVALID;
    if (Hq % cfg->num_kv_heads != 0)
        return json_get_fail(at, "num_key_value_heads", "(%d) must divide num_attention_heads (%d)",
                             cfg->num_kv_heads, Hq);

    // head_dim: Qwen3Config defaults it to 128; the others derive C / Hq when it is missing or null.
    const int derived_dim = (ai->arch == ARCH_QWEN3 && !json_object_get(at->json, "head_dim")) ? 128 : 0;
    if (json_get_int(at, "head_dim", JSON_GET_OPTIONAL, derived_dim, 1, DIM_MAX, &cfg->head_dim))
        return CONFIG_ERR_INVALID;
    if (cfg->head_dim == 0 || ai->arch == ARCH_LLAMA) {
        // LlamaConfig.validate_architecture checks divisibility even with an explicit head_dim.
        if (C % Hq != 0)
            return json_get_fail(at, "num_attention_heads", "(%d) must divide hidden_size (%d)", Hq, C);
        if (cfg->head_dim == 0) cfg->head_dim = C / Hq;
    }
    if (cfg->head_dim % 2 != 0)
        return json_get_fail(at, "head_dim", "(%d) must be even: rotary embeddings rotate pairs", cfg->head_dim);
    if ((long long)Hq * cfg->head_dim > DIM_MAX)
        return FAIL_INVALID("config.json: num_attention_heads * head_dim (%lld) is out of range",
                            (long long)Hq * cfg->head_dim);

    if (json_get_int(at, "max_position_embeddings", JSON_GET_OPTIONAL, ai->max_position, 1, INT_MAX,
                     &cfg->max_position_embeddings) ||
        get_positive_float(at, "rms_norm_eps", JSON_GET_OPTIONAL, 1e-6, &cfg->rms_norm_eps))
        return CONFIG_ERR_INVALID;

    const char *act;
    if (json_get_string(at, "hidden_act", JSON_GET_OPTIONAL, "silu", JSON_ANY_LENGTH, &act, NULL))
        return CONFIG_ERR_INVALID;
    if (strcmp(act, "silu") != 0)
        return json_get_fail(at, "hidden_act", "= \"%.32s\" is not supported (only silu)", act);

    if (json_get_bool(at, "tie_word_embeddings", JSON_GET_OPTIONAL, 0, &cfg->tie_word_embeddings))
        return CONFIG_ERR_INVALID;
    // Bias flags as each architecture's modeling code uses them: Qwen2 always has q/k/v bias, Llama and Qwen3
    // read attention_bias, Mistral never has one; only Llama's MLP reads mlp_bias.
    cfg->attention_bias = 0;
    if (ai->arch == ARCH_QWEN2) {
        cfg->attention_bias = 1;
    } else if (ai->arch == ARCH_LLAMA || ai->arch == ARCH_QWEN3) {
        if (json_get_bool(at, "attention_bias", JSON_GET_OPTIONAL, 0, &cfg->attention_bias))
            return CONFIG_ERR_INVALID;
    }
    if (ai->arch == ARCH_LLAMA) {
        int mlp_bias = 0;
        if (json_get_bool(at, "mlp_bias", JSON_GET_OPTIONAL, 0, &mlp_bias)) return CONFIG_ERR_INVALID;
        if (mlp_bias) return json_get_fail(at, "mlp_bias", "= true is not supported");
    }
    cfg->qk_norm = ai->arch == ARCH_QWEN3;

    if (parse_rope(cfg, at) || parse_sliding_window(cfg, at) || parse_token_ids(cfg, at) || parse_dtype(cfg, at))
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
    JsonAt at = json_at_document(root, "config.json", 1, CONFIG_ERR_INVALID, err, err_len);
    int rc = parse_root(cfg, &at);
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
