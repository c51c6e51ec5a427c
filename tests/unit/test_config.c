// tests/unit/test_config.c — config.json parsing: each architecture, transformers' defaults, both rope forms,
// sliding windows, every refusal (with the field named in the message), rotary frequencies, and round trip.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "check_macros.h"
#include "shared/config.h"

static const char *BASE = "\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128, "
                          "\"num_hidden_layers\": 3, \"num_attention_heads\": 4";

// Parses "{<arch fields>, BASE, <extra>}" and expects success.
static ModelConfig parse_ok(const char *head, const char *extra) {
    char text[4096];
    snprintf(text, sizeof text, "{%s%s%s%s%s}", head, head[0] ? ", " : "", BASE, extra[0] ? ", " : "", extra);
    ModelConfig c;
    char err[512] = "";
    int rc = config_parse(&c, text, strlen(text), err, sizeof err);
    if (rc != 0) fprintf(stderr, "unexpected refusal of %s: %s\n", text, err);
    CHECK(rc == 0);
    return c;
}

// Expects config_parse to refuse `text` with a message containing every non-NULL needle.
static void refuse_text(int line, const char *text, const char *needle1, const char *needle2) {
    ModelConfig c;
    char err[512] = "";
    int rc = config_parse(&c, text, strlen(text), err, sizeof err);
    int ok = rc < 0 && (!needle1 || strstr(err, needle1)) && (!needle2 || strstr(err, needle2));
    if (!ok) {
        fprintf(stderr, "line %d: expected refusal mentioning '%s' '%s', got rc=%d err='%s'\n  input: %s\n", line,
                needle1 ? needle1 : "", needle2 ? needle2 : "", rc, err, text);
        failures++;
    }
}

static void refuse(int line, const char *head, const char *extra, const char *needle1, const char *needle2) {
    char text[4096];
    snprintf(text, sizeof text, "{%s, %s%s%s}", head, BASE, extra[0] ? ", " : "", extra);
    refuse_text(line, text, needle1, needle2);
}

#define LLAMA "\"architectures\": [\"LlamaForCausalLM\"]"
#define QWEN2 "\"architectures\": [\"Qwen2ForCausalLM\"]"
#define QWEN3 "\"architectures\": [\"Qwen3ForCausalLM\"]"
#define MISTRAL "\"architectures\": [\"MistralForCausalLM\"]"

static void test_llama_defaults(void) {
    ModelConfig c = parse_ok(LLAMA, "");
    CHECK(c.arch == ARCH_LLAMA && strcmp(c.arch_name, "LlamaForCausalLM") == 0);
    CHECK(c.vocab_size == 1000 && c.hidden_size == 64 && c.intermediate_size == 128 && c.num_layers == 3);
    CHECK(c.num_heads == 4 && c.num_kv_heads == 4 && c.head_dim == 16);
    CHECK(c.max_position_embeddings == 2048 && c.max_seq_len == 2048 && c.sliding_window == 0);
    CHECK(c.rms_norm_eps == 1e-6f && c.rope_theta == 10000.0f && c.rope_type == ROPE_DEFAULT);
    CHECK(!c.tie_word_embeddings && !c.attention_bias && !c.qk_norm);
    // LlamaConfig's class defaults: bos 1, eos 2
    CHECK(c.bos_token_id == 1 && c.n_eos_token_ids == 1 && c.eos_token_ids[0] == 2 && c.torch_dtype[0] == '\0');

    c = parse_ok(LLAMA, "\"num_key_value_heads\": 2, \"rms_norm_eps\": 1e-5, \"tie_word_embeddings\": true, "
                        "\"attention_bias\": true, \"mlp_bias\": false, \"max_position_embeddings\": 4096, "
                        "\"bos_token_id\": 7, \"eos_token_id\": [8, 9, 10], \"torch_dtype\": \"bfloat16\", "
                        "\"rope_theta\": 500000.0, \"rope_scaling\": null, \"hidden_act\": \"silu\", "
                        "\"sliding_window\": 16");
    CHECK(c.num_kv_heads == 2 && c.rms_norm_eps == 1e-5f && c.tie_word_embeddings && c.attention_bias);
    CHECK(c.max_position_embeddings == 4096 && c.max_seq_len == 4096);
    CHECK(c.sliding_window == 0);   // Llama has no sliding window: the key is ignored as transformers does
    CHECK(c.bos_token_id == 7 && c.n_eos_token_ids == 3 && c.eos_token_ids[0] == 8 && c.eos_token_ids[2] == 10);
    CHECK(strcmp(c.torch_dtype, "bfloat16") == 0 && c.rope_theta == 500000.0f && c.rope_type == ROPE_DEFAULT);

    // explicit nulls take the defaults; eos_token_id may be a single int; "dtype" (5.x) wins over "torch_dtype"
    c = parse_ok(LLAMA, "\"num_key_value_heads\": null, \"head_dim\": null, \"eos_token_id\": 2, "
                        "\"dtype\": \"float32\", \"torch_dtype\": \"float16\"");
    CHECK(c.num_kv_heads == 4 && c.head_dim == 16 && c.n_eos_token_ids == 1 && c.eos_token_ids[0] == 2);
    CHECK(strcmp(c.torch_dtype, "float32") == 0);
    // model_type fallback when "architectures" is absent, null or empty
    c = parse_ok("\"model_type\": \"llama\"", "");
    CHECK(c.arch == ARCH_LLAMA && strcmp(c.arch_name, "LlamaForCausalLM") == 0);
    c = parse_ok("\"architectures\": null, \"model_type\": \"qwen3\"", "\"num_key_value_heads\": 4");
    CHECK(c.arch == ARCH_QWEN3);
    c = parse_ok("\"architectures\": [], \"model_type\": \"mistral\"", "\"num_key_value_heads\": 4");
    CHECK(c.arch == ARCH_MISTRAL);
}

static void test_qwen_mistral(void) {
    // Qwen2: q/k/v bias always; a missing num_key_value_heads is Qwen2Config's default 32 (not Hq)
    ModelConfig c = parse_ok(QWEN2, "\"num_key_value_heads\": 2, \"attention_bias\": false");
    CHECK(c.arch == ARCH_QWEN2 && c.attention_bias == 1 && c.qk_norm == 0 && c.num_kv_heads == 2);
    CHECK(c.max_position_embeddings == 32768 && c.sliding_window == 0 && c.max_window_layers == 28);
    CHECK(c.bos_token_id == -1 && c.n_eos_token_ids == 0);   // Qwen2Config: no default token ids
    c = parse_ok(LLAMA, "\"bos_token_id\": null, \"eos_token_id\": null");   // explicit null: none
    CHECK(c.bos_token_id == -1 && c.n_eos_token_ids == 0);
    refuse(__LINE__, QWEN2, "", "num_key_value_heads", "(32)");   // 4 heads, default 32 kv heads
    c = parse_ok(QWEN2, "\"num_key_value_heads\": 1, \"head_dim\": 32");   // head_dim honoured (getattr)
    CHECK(c.head_dim == 32);

    // Qwen3: q/k norm, attention_bias from the key, head_dim defaults to 128
    c = parse_ok(QWEN3, "\"num_key_value_heads\": 2");
    CHECK(c.arch == ARCH_QWEN3 && c.qk_norm == 1 && c.attention_bias == 0 && c.head_dim == 128);
    c = parse_ok(QWEN3, "\"num_key_value_heads\": 2, \"head_dim\": 24, \"attention_bias\": true");
    CHECK(c.head_dim == 24 && c.attention_bias == 1);

    // Mistral: head_dim from the file, no attention bias even if the key says so, sliding window default 4096
    c = parse_ok(MISTRAL, "\"num_key_value_heads\": 2, \"head_dim\": 32, \"attention_bias\": true");
    CHECK(c.arch == ARCH_MISTRAL && c.head_dim == 32 && c.attention_bias == 0 && c.qk_norm == 0);
    CHECK(c.max_position_embeddings == 131072 && c.sliding_window == 4096 && c.max_seq_len == 4096);
    c = parse_ok(MISTRAL, "\"num_key_value_heads\": 2, \"sliding_window\": null, \"max_position_embeddings\": 100");
    CHECK(c.sliding_window == 0 && c.max_seq_len == 100);
    c = parse_ok(MISTRAL, "\"num_key_value_heads\": 2, \"sliding_window\": 512, \"max_position_embeddings\": 8192");
    CHECK(c.sliding_window == 512 && c.max_seq_len == 512);
    refuse(__LINE__, MISTRAL, "", "num_key_value_heads", "(8)");   // MistralConfig's default 8 kv heads vs 4 heads
}

static void test_sliding_window_qwen(void) {
    // Window used only with use_sliding_window and at least one sliding layer; it caps max_seq_len.
    ModelConfig c = parse_ok(QWEN2, "\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": "
                                    "64, \"max_window_layers\": 1, \"max_position_embeddings\": 1024");
    CHECK(c.sliding_window == 64 && c.max_seq_len == 64 && c.max_window_layers == 1);
    c = parse_ok(QWEN2, "\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": 64, "
                        "\"max_window_layers\": 3");   // no layer index >= 3 among 3 layers
    CHECK(c.sliding_window == 0 && c.max_seq_len == 32768);
    c = parse_ok(QWEN3, "\"num_key_value_heads\": 2, \"use_sliding_window\": false, \"sliding_window\": 64, "
                        "\"layer_types\": [\"full_attention\", \"sliding_attention\", \"sliding_attention\"]");
    CHECK(c.sliding_window == 0);
    c = parse_ok(QWEN3, "\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": 64, "
                        "\"max_window_layers\": 28, "
                        "\"layer_types\": [\"full_attention\", \"sliding_attention\", \"full_attention\"]");
    CHECK(c.sliding_window == 64 && c.max_seq_len == 64);   // layer_types wins over max_window_layers
    c = parse_ok(QWEN3, "\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": 64, "
                        "\"layer_types\": [\"full_attention\", \"full_attention\", \"full_attention\"]");
    CHECK(c.sliding_window == 0);
    c = parse_ok(QWEN2, "\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"max_window_layers\": 0");
    CHECK(c.sliding_window == 4096 && c.max_seq_len == 4096);   // Qwen2Config's default window
    refuse(__LINE__, QWEN2, "\"num_key_value_heads\": 2, \"layer_types\": [\"full_attention\"]", "layer_types",
           "3");
    refuse(__LINE__, QWEN2, "\"num_key_value_heads\": 2, \"layer_types\": [\"full_attention\", \"chunked\", "
           "\"full_attention\"]", "layer_types", "chunked");
    refuse(__LINE__, QWEN2, "\"num_key_value_heads\": 2, \"use_sliding_window\": 1", "use_sliding_window", NULL);
    refuse(__LINE__, MISTRAL, "\"num_key_value_heads\": 2, \"sliding_window\": 0", "sliding_window", NULL);
}

static void test_rope_forms(void) {
    // transformers 5.x: rope_parameters carries theta and type
    ModelConfig c = parse_ok(LLAMA, "\"max_position_embeddings\": 131072, \"rope_parameters\": {\"rope_type\": "
                                    "\"llama3\", \"rope_theta\": 500000.0, \"factor\": 8.0, \"low_freq_factor\": 1.0, "
                                    "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}");
    CHECK(c.rope_type == ROPE_LLAMA3 && c.rope_theta == 500000.0f && c.rope_factor == 8.0f);
    CHECK(c.rope_low_freq_factor == 1.0f && c.rope_high_freq_factor == 4.0f && c.rope_original_max_position == 8192);
    // transformers 4.x: top-level rope_theta, rope_scaling with the old "type" key
    ModelConfig d = parse_ok(LLAMA, "\"max_position_embeddings\": 131072, \"rope_theta\": 500000, \"rope_scaling\": "
                                    "{\"type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1, "
                                    "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 8192}");
    CHECK(memcmp(&c, &d, sizeof c) == 0);
    // original_max_position_embeddings falls back to max_position_embeddings
    c = parse_ok(LLAMA, "\"max_position_embeddings\": 999, \"rope_scaling\": {\"rope_type\": \"llama3\", "
                        "\"factor\": 8, \"low_freq_factor\": 1, \"high_freq_factor\": 4}");
    CHECK(c.rope_original_max_position == 999);
    // a theta inside the dict wins over the top-level key; a non-empty rope_scaling wins over rope_parameters
    c = parse_ok(LLAMA, "\"rope_theta\": 1.0, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 77.5}");
    CHECK(c.rope_theta == 77.5f && c.rope_type == ROPE_DEFAULT);
    c = parse_ok(LLAMA, "\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.5}, "
                        "\"rope_parameters\": {\"rope_type\": \"default\"}");
    CHECK(c.rope_type == ROPE_LINEAR && c.rope_factor == 2.5f && c.rope_theta == 10000.0f);
    c = parse_ok(LLAMA, "\"rope_scaling\": {}, \"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 4}");
    CHECK(c.rope_type == ROPE_LINEAR && c.rope_factor == 4.0f);
    c = parse_ok(LLAMA, "\"rope_parameters\": {\"rope_theta\": 1000000.0}");   // type defaults to "default"
    CHECK(c.rope_type == ROPE_DEFAULT && c.rope_theta == 1000000.0f);
    c = parse_ok(LLAMA, "\"partial_rotary_factor\": 1.0");
    CHECK(c.rope_type == ROPE_DEFAULT);
}

static void test_refusals(void) {
    // unknown architecture / model type, named
    refuse_text(__LINE__, "{\"architectures\": [\"GPT2LMHeadModel\"], \"vocab_size\": 1}", "GPT2LMHeadModel",
                "architectures");
    refuse_text(__LINE__, "{\"model_type\": \"gemma\"}", "gemma", "model_type");
    refuse_text(__LINE__, "{\"vocab_size\": 1}", "architectures", NULL);
    refuse_text(__LINE__, "{\"architectures\": \"LlamaForCausalLM\"}", "architectures", "array");
    refuse_text(__LINE__, "{\"architectures\": [3]}", "architectures", NULL);
    // not JSON / not an object / duplicate keys
    refuse_text(__LINE__, "{\"architectures\": [\"LlamaForCausalLM\"], ", "invalid JSON", NULL);
    refuse_text(__LINE__, "[1, 2]", "top level", NULL);
    refuse_text(__LINE__, "", "invalid JSON", NULL);
    refuse(__LINE__, LLAMA, "\"hidden_size\": 32", "invalid JSON", "hidden_size");
    // every valid JSON number is read (shared/json_read.h), but an integer field beyond int64 is out of range
    refuse_text(__LINE__, "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 1000000000000000019884624838656}",
                "vocab_size", "outside");

    // every required field missing, then mistyped, then out of range: each message names the field
    static const char *req[] = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads"};
    for (int i = 0; i < 5; i++) {
        json_t *o = json_pack("{s:[s], s:i, s:i, s:i, s:i, s:i}", "architectures", "LlamaForCausalLM", "vocab_size",
                              1000, "hidden_size", 64, "intermediate_size", 128, "num_hidden_layers", 2,
                              "num_attention_heads", 4);
        json_object_del(o, req[i]);
        char *t = json_dumps(o, 0);
        refuse_text(__LINE__, t, "missing", req[i]);
        free(t);
        json_object_set_new(o, req[i], json_string("64"));
        t = json_dumps(o, 0);
        refuse_text(__LINE__, t, req[i], "integer");
        free(t);
        json_object_set_new(o, req[i], json_real(64.0));
        t = json_dumps(o, 0);
        refuse_text(__LINE__, t, req[i], "integer");
        free(t);
        json_object_set_new(o, req[i], json_integer(0));
        t = json_dumps(o, 0);
        refuse_text(__LINE__, t, req[i], "outside");
        free(t);
        json_object_set_new(o, req[i], json_integer(-5));
        t = json_dumps(o, 0);
        refuse_text(__LINE__, t, req[i], "outside");
        free(t);
        json_decref(o);
    }
    refuse(__LINE__, LLAMA, "\"num_key_value_heads\": 3", "num_key_value_heads", "divide");
    refuse(__LINE__, LLAMA, "\"num_key_value_heads\": 0", "num_key_value_heads", "outside");
    refuse(__LINE__, LLAMA, "\"num_key_value_heads\": \"2\"", "num_key_value_heads", "integer");
    refuse_text(__LINE__, "{" LLAMA ", \"vocab_size\": 10, \"hidden_size\": 66, \"intermediate_size\": 8, "
                "\"num_hidden_layers\": 1, \"num_attention_heads\": 4}", "num_attention_heads", "hidden_size");
    // Llama checks divisibility even with head_dim (LlamaConfig.validate_architecture); Mistral does not
    refuse_text(__LINE__, "{" LLAMA ", \"vocab_size\": 10, \"hidden_size\": 66, \"intermediate_size\": 8, "
                "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"head_dim\": 16}", "num_attention_heads",
                NULL);
    char err[256];
    ModelConfig c;
    const char *mis = "{" MISTRAL ", \"vocab_size\": 10, \"hidden_size\": 66, \"intermediate_size\": 8, "
                      "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_key_value_heads\": 4, "
                      "\"head_dim\": 16}";
    CHECK(config_parse(&c, mis, strlen(mis), err, sizeof err) == 0 && c.head_dim == 16);
    refuse(__LINE__, MISTRAL, "\"num_key_value_heads\": 4, \"head_dim\": 15", "head_dim", "even");
    refuse(__LINE__, LLAMA, "\"head_dim\": -2", "head_dim", "outside");
    refuse(__LINE__, LLAMA, "\"max_position_embeddings\": 0", "max_position_embeddings", NULL);
    refuse(__LINE__, LLAMA, "\"max_position_embeddings\": 1e4", "max_position_embeddings", "integer");

    // unsupported features, named
    refuse(__LINE__, LLAMA, "\"hidden_act\": \"gelu\"", "hidden_act", "gelu");
    refuse(__LINE__, LLAMA, "\"hidden_act\": 1", "hidden_act", "string");
    refuse(__LINE__, LLAMA, "\"mlp_bias\": true", "mlp_bias", NULL);
    refuse(__LINE__, LLAMA, "\"mlp_bias\": \"no\"", "mlp_bias", "true or false");
    refuse(__LINE__, LLAMA, "\"tie_word_embeddings\": 1", "tie_word_embeddings", NULL);
    refuse(__LINE__, LLAMA, "\"attention_bias\": null, \"rms_norm_eps\": \"1e-5\"", "rms_norm_eps", "number");
    refuse(__LINE__, LLAMA, "\"rms_norm_eps\": 0", "rms_norm_eps", "positive");
    refuse(__LINE__, LLAMA, "\"rms_norm_eps\": -1e-6", "rms_norm_eps", NULL);
    refuse(__LINE__, LLAMA, "\"rms_norm_eps\": 1e-86", "rms_norm_eps", "float32");   // rounds to 0 in float32
    refuse(__LINE__, LLAMA, "\"rope_theta\": 1e39", "rope_theta", "float32");
    refuse(__LINE__, LLAMA, "\"rope_theta\": 0", "rope_theta", NULL);
    refuse(__LINE__, LLAMA, "\"rope_theta\": \"1e4\"", "rope_theta", "number");
    refuse(__LINE__, LLAMA, "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}", "yarn", "rope_scaling");
    refuse(__LINE__, LLAMA, "\"rope_parameters\": {\"rope_type\": \"dynamic\", \"factor\": 4}", "dynamic",
           "rope_parameters");
    refuse(__LINE__, LLAMA, "\"rope_scaling\": {\"type\": \"longrope\"}", "longrope", NULL);
    refuse(__LINE__, LLAMA, "\"rope_scaling\": {\"rope_type\": 3}", "rope_type", "string");
    refuse(__LINE__, LLAMA, "\"rope_scaling\": [1]", "rope_scaling", "object");
    refuse(__LINE__, LLAMA, "\"rope_parameters\": \"default\"", "rope_parameters", "object");
    refuse(__LINE__, LLAMA, "\"rope_scaling\": {\"rope_type\": \"linear\"}", "factor", "missing");
    refuse(__LINE__, LLAMA, "\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": -2}", "factor", NULL);
    refuse(__LINE__, LLAMA, "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"high_freq_factor\": 4}",
           "low_freq_factor", "missing");
    refuse(__LINE__, LLAMA, "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4, "
           "\"high_freq_factor\": 4}", "high_freq_factor", "greater");
    refuse(__LINE__, LLAMA, "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1, "
           "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 81.5}", "original_max_position_embeddings",
           "integer");
    refuse(__LINE__, LLAMA, "\"partial_rotary_factor\": 0.5", "partial_rotary_factor", NULL);
    refuse(__LINE__, LLAMA, "\"rope_parameters\": {\"rope_type\": \"default\", \"partial_rotary_factor\": 0.25}",
           "partial_rotary_factor", NULL);
    refuse(__LINE__, LLAMA, "\"rope_parameters\": {\"full_attention\": {\"rope_type\": \"default\"}}",
           "rope_parameters", "per-layer");
    refuse(__LINE__, LLAMA, "\"eos_token_id\": [1, 2, 3, 4, 5, 6, 7, 8, 9]", "eos_token_id", "at most 8");
    refuse(__LINE__, LLAMA, "\"eos_token_id\": [1, \"2\"]", "eos_token_id", NULL);
    refuse(__LINE__, LLAMA, "\"eos_token_id\": \"</s>\"", "eos_token_id", NULL);
    refuse(__LINE__, LLAMA, "\"bos_token_id\": -1", "bos_token_id", NULL);
    refuse(__LINE__, LLAMA, "\"torch_dtype\": \"int8\"", "torch_dtype", "int8");
    refuse(__LINE__, LLAMA, "\"dtype\": 16", "dtype", "string");
}

// Rotary frequencies against the formulas evaluated here in double precision. config_rope_inv_freq follows
// transformers' float32 tensor arithmetic, so the bound is a few float32 roundings (1e-6 relative); the Python
// reference test compares it with transformers itself at 2e-7.
static void test_inv_freq(void) {
    ModelConfig c;
    const char *text =
        "{" LLAMA ", \"vocab_size\": 10, \"hidden_size\": 1024, \"intermediate_size\": 8, \"num_hidden_layers\": 1, "
        "\"num_attention_heads\": 8, \"max_position_embeddings\": 131072, \"rope_parameters\": {\"rope_type\": "
        "\"llama3\", \"rope_theta\": 500000.0, \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
        "\"original_max_position_embeddings\": 8192}}";
    char err[256];
    CHECK(config_parse(&c, text, strlen(text), err, sizeof err) == 0);
    const int D = c.head_dim;   // 128
    float f[64];
    config_rope_inv_freq(&c, f);
    int n_low = 0, n_mid = 0, n_high = 0;
    double worst = 0;
    for (int i = 0; i < D / 2; i++) {
        double base = 1.0 / pow(500000.0, (2.0 * i) / D);
        double wavelen = 2 * M_PI / base, want;
        if (wavelen < 8192.0 / 4.0) {
            want = base;
            n_high++;
        } else if (wavelen > 8192.0 / 1.0) {
            want = base / 8.0;
            n_low++;
        } else {
            double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
            want = (1 - smooth) * base / 8.0 + smooth * base;
            n_mid++;
        }
        double rel = fabs(f[i] - want) / want;
        if (rel > worst) worst = rel;
    }
    CHECK(worst < 1e-6);
    CHECK(n_low > 0 && n_mid > 0 && n_high > 0);   // all three bands exercised
    printf("llama3 inv_freq: max relative difference to the double formula %.3g (%d high, %d mid, %d low)\n", worst,
           n_high, n_mid, n_low);

    const char *lin = "{" QWEN2 ", \"vocab_size\": 10, \"hidden_size\": 64, \"intermediate_size\": 8, "
                      "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, "
                      "\"rope_theta\": 1000000.0, \"rope_scaling\": {\"type\": \"linear\", \"factor\": 4.0}}";
    CHECK(config_parse(&c, lin, strlen(lin), err, sizeof err) == 0);
    config_rope_inv_freq(&c, f);
    worst = 0;
    for (int i = 0; i < 16; i++) {
        double want = 1.0 / pow(1000000.0, (2.0 * i) / 32) / 4.0;
        worst = fmax(worst, fabs(f[i] - want) / want);
    }
    CHECK(worst < 1e-6);
    c.rope_type = ROPE_DEFAULT;
    config_rope_inv_freq(&c, f);
    CHECK(f[0] == 1.0f && fabs(f[15] - 1.0 / pow(1e6, 30.0 / 32)) < 1e-6 * f[15]);
}

// Parse -> config_to_json -> parse must reproduce the struct exactly, for every arch and option mix.
static void test_round_trip(void) {
    const char *cases[] = {
        "{" LLAMA ", " "\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 3, "
        "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"rms_norm_eps\": 1e-5, \"tie_word_embeddings\": true, "
        "\"attention_bias\": true, \"bos_token_id\": 1, \"eos_token_id\": [2, 3], \"torch_dtype\": \"bfloat16\", "
        "\"rope_theta\": 500000, \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 32, \"low_freq_factor\": 1, "
        "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 8192}, \"max_position_embeddings\": 131072}",
        "{" QWEN2 ", " "\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 3, "
        "\"num_attention_heads\": 4, \"num_key_value_heads\": 1, \"rms_norm_eps\": 1e-6, \"use_sliding_window\": true, "
        "\"sliding_window\": 100, \"max_window_layers\": 2, \"eos_token_id\": 5, \"rope_theta\": 1000000.0}",
        "{" QWEN3 ", " "\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 3, "
        "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 32, \"attention_bias\": true, "
        "\"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 2.5, \"rope_theta\": 12345.678}, \"dtype\": \"float16\"}",
        "{" MISTRAL ", " "\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 3, "
        "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"sliding_window\": null, \"rms_norm_eps\": 3.3e-7}",
        "{" MISTRAL ", " "\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 3, "
        "\"num_attention_heads\": 4, \"num_key_value_heads\": 2}",
        // explicit layer_types that max_window_layers does not describe: still windowed after the round trip
        "{" QWEN3 ", " "\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 3, "
        "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": 9, "
        "\"layer_types\": [\"sliding_attention\", \"full_attention\", \"full_attention\"]}",
        "{\"model_type\": \"llama\", " "\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128, "
        "\"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"bos_token_id\": null, \"eos_token_id\": []}",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ModelConfig a, b;
        char err[256] = "";
        int rc = config_parse(&a, cases[i], strlen(cases[i]), err, sizeof err);
        CHECK(rc == 0);
        if (rc) {
            fprintf(stderr, "case %zu: %s\n", i, err);
            continue;
        }
        char *text = config_to_json(&a);
        CHECK(text != NULL);
        if (!text) continue;
        rc = config_parse(&b, text, strlen(text), err, sizeof err);
        CHECK(rc == 0);
        if (rc || memcmp(&a, &b, sizeof a) != 0) {
            fprintf(stderr, "case %zu does not round-trip (%s):\n%s\n", i, err, text);
            failures++;
        }
        // numbers are written in their shortest form, as transformers writes them
        if (i == 0) CHECK(strstr(text, "\"rms_norm_eps\": 1e-5,") || strstr(text, "\"rms_norm_eps\": 1e-05,"));
        free(text);
    }
}

static void test_load(void) {
    char dir[] = "/tmp/tandem_test_config_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char path[256], err[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    ModelConfig c;
    CHECK(config_load(&c, dir, err, sizeof err) == CONFIG_ERR_IO && strstr(err, "config.json"));
    FILE *f = fopen(path, "w");
    fprintf(f, "{" LLAMA ", %s, \"hidden_act\": \"relu\"}", BASE);
    fclose(f);
    CHECK(config_load(&c, dir, err, sizeof err) == CONFIG_ERR_INVALID);
    CHECK(strstr(err, path) == err && strstr(err, "hidden_act"));   // the message starts with the file's path
    f = fopen(path, "w");
    fprintf(f, "{" LLAMA ", %s}", BASE);
    fclose(f);
    CHECK(config_load(&c, dir, err, sizeof err) == 0 && c.num_layers == 3);
    unlink(path);
    rmdir(dir);
}

int main(void) {
    test_llama_defaults();
    test_qwen_mistral();
    test_sliding_window_qwen();
    test_rope_forms();
    test_refusals();
    test_inv_freq();
    test_round_trip();
    test_load();
    return check_exit_code("test_config");
}
