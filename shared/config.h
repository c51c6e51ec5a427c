// shared/config.h — a decoder model's hyper-parameters, read from a Hugging Face config.json.
#ifndef TANDEM_SHARED_CONFIG_H
#define TANDEM_SHARED_CONFIG_H

#include <stddef.h>

typedef enum {
    ARCH_LLAMA = 0,   // LlamaForCausalLM (Llama 2/3.x, SmolLM, TinyLlama)
    ARCH_QWEN2,       // Qwen2ForCausalLM (Qwen2/2.5, R1-distill): q/k/v bias
    ARCH_QWEN3,       // Qwen3ForCausalLM: q/k RMSNorm per head
    ARCH_MISTRAL,     // MistralForCausalLM
} ModelArch;

typedef enum { ROPE_DEFAULT = 0, ROPE_LLAMA3, ROPE_LINEAR } RopeType;

typedef struct {
    ModelArch arch;
    char arch_name[64];        // as in "architectures"[0], e.g. "Qwen2ForCausalLM"
    int vocab_size;            // V
    int hidden_size;           // C
    int intermediate_size;     // I
    int num_layers;            // L
    int num_heads;             // Hq
    int num_kv_heads;          // Hkv (defaults to Hq)
    int head_dim;              // D (defaults to C / Hq)
    int max_position_embeddings;
    int max_seq_len;           // usable context: max_position_embeddings, capped at sliding_window if one is set
    int sliding_window;        // 0 when none. Sequences never exceed it (max_seq_len), so attention stays exact.
    int max_window_layers;     // Qwen2/3: layers >= this one use the window (kept so config_to_json round-trips)
    float rms_norm_eps;
    float rope_theta;
    RopeType rope_type;
    float rope_factor;                 // llama3 / linear
    float rope_low_freq_factor;        // llama3
    float rope_high_freq_factor;       // llama3
    int rope_original_max_position;    // llama3
    int tie_word_embeddings;
    int attention_bias;        // q/k/v bias (always on for Qwen2; o_proj never has one)
    int qk_norm;               // Qwen3
    int bos_token_id;          // -1 when null (a missing key takes the class default: Llama/Mistral 1, Qwen none)
    int eos_token_ids[8];      // config.json's eos_token_id (int or list; missing: Llama/Mistral 2, Qwen none)
    int n_eos_token_ids;
    char torch_dtype[16];      // "bfloat16", "float16", "float32" ("" when absent)
} ModelConfig;

#define CONFIG_ERR_INVALID (-1)   // the file's content is refused (message names the field)
#define CONFIG_ERR_IO      (-2)   // the file cannot be read

// Parses config.json text. Returns 0, or a negative code with a message naming the offending field in err
// (unknown architecture, missing or mistyped field, unsupported feature such as mlp_bias or a rope type).
// Accepts both the transformers 4.x keys (rope_theta, rope_scaling) and the 5.x key (rope_parameters).
// docs/model-files.md lists every key read, its default and what is refused.
int config_parse(ModelConfig *cfg, const char *json_text, size_t len, char *err, size_t err_len);
// Reads and parses DIR/config.json (the message is prefixed with the file's path).
int config_load(ModelConfig *cfg, const char *model_dir, char *err, size_t err_len);
// Writes cfg as an HF-loadable config.json text (malloc'd, caller frees). NULL on out of memory.
char *config_to_json(const ModelConfig *cfg);

// Fills inv_freq (D/2) with the rotary inverse frequencies, rope scaling applied as transformers does.
void config_rope_inv_freq(const ModelConfig *cfg, float *inv_freq);

#endif
