// model_testlib.h — the model configs and the packed batch the whole-model tests share (test_model,
// test_model_shard: the tiny configs on the CPU; test_model_cuda, test_model_lora_cuda: the small ones on both
// backends), and the relative error they compare with.
#ifndef TANDEM_TESTS_MODEL_TESTLIB_H
#define TANDEM_TESTS_MODEL_TESTLIB_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "shared/model.h"

// Qwen3-style (q/k norm, attention bias, tied) and Llama-style (GQA, untied), vocabulary 67, width 32.
#define TINY_QWEN3_CONFIG                                                                                          \
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 67, \"hidden_size\": 32, \"intermediate_size\": 48," \
    " \"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 12,"          \
    " \"max_position_embeddings\": 128, \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": true,"                     \
    " \"attention_bias\": true, \"hidden_act\": \"silu\", \"rope_parameters\": {\"rope_theta\": 10000.0,"           \
    " \"rope_type\": \"default\"}}"
#define TINY_LLAMA_CONFIG                                                                                          \
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 67, \"hidden_size\": 32, \"intermediate_size\": 48," \
    " \"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"                            \
    " \"max_position_embeddings\": 128, \"hidden_act\": \"silu\", \"tie_word_embeddings\": false}"

// The same two families at vocabulary 301, width 128 (head_dim 64 for Qwen3), for the CUDA-vs-CPU tests.
#define SMALL_LLAMA_CONFIG                                                                                           \
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 301, \"hidden_size\": 128, \"intermediate_size\": 256," \
    " \"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"max_position_embeddings\": 256," \
    " \"hidden_act\": \"silu\", \"tie_word_embeddings\": false}"
#define SMALL_QWEN3_CONFIG                                                                                           \
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 301, \"hidden_size\": 128, \"intermediate_size\": 192," \
    " \"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 64,"            \
    " \"max_position_embeddings\": 256, \"hidden_act\": \"silu\", \"tie_word_embeddings\": true,"                     \
    " \"attention_bias\": true}"

// max |a - b| / max |b| over n values (1 as the denominator when b is all zeros).
static inline double model_max_rel(const float *a, const float *b, size_t n) {
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return d / (m > 0 ? m : 1);
}

// A packed batch of B sequences of lens[b] tokens (token n of the pack is (37 n + 11) mod vocab), each position's
// target the next token of its sequence (-1 at a sequence's end), and the mean-logprob loss's gradient dlp
// (-1 / scored where scored, 0 elsewhere). Free with packed_batch_free.
typedef struct {
    int32_t *tokens, *targets, *cu_seqlens;   // (N) (N) (B + 1)
    float *dlp;                               // (N)
    Batch batch;
} PackedBatch;

static inline int packed_batch_make(PackedBatch *p, const int *lens, int B, int vocab) {
    int N = 0;
    for (int b = 0; b < B; b++) N += lens[b];
    p->tokens = malloc((size_t)N * 4);
    p->targets = malloc((size_t)N * 4);
    p->cu_seqlens = calloc((size_t)B + 1, 4);
    p->dlp = malloc((size_t)N * 4);
    if (!p->tokens || !p->targets || !p->cu_seqlens || !p->dlp) return -1;
    for (int b = 0, n = 0; b < B; b++) {
        for (int i = 0; i < lens[b]; i++, n++) p->tokens[n] = (n * 37 + 11) % vocab;
        p->cu_seqlens[b + 1] = n;
    }
    int scored = 0;
    for (int b = 0; b < B; b++)
        for (int i = p->cu_seqlens[b]; i < p->cu_seqlens[b + 1]; i++) {
            p->targets[i] = i + 1 < p->cu_seqlens[b + 1] ? p->tokens[i + 1] : -1;
            scored += p->targets[i] >= 0;
        }
    for (int i = 0; i < N; i++) p->dlp[i] = p->targets[i] >= 0 ? -1.0f / scored : 0.0f;
    p->batch = (Batch){.n_seqs = B, .n_tokens = N, .tokens = p->tokens, .targets = p->targets,
                       .cu_seqlens = p->cu_seqlens};
    return 0;
}

static inline void packed_batch_free(PackedBatch *p) {
    free(p->tokens), free(p->targets), free(p->cu_seqlens), free(p->dlp);
}

#endif
