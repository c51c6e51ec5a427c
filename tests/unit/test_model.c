// test_model.c — consistency of the model core's own paths on a tiny random model (CPU backend, fp32):
//   - the paged inference path (prefill in chunks, then decodes, scattered block tables) gives the logits of
//     the training forward on the same tokens (tolerance 1e-4 relative: same math, different summation order);
//   - activation checkpointing (recompute) gives the same gradients as saved activations (bit-identical: the
//     recomputation runs the same kernels on the same inputs);
//   - gradient accumulation: two backward passes give twice one pass's gradients (1e-6 relative);
//   - the layout: padding for N shards, hash changes with the architecture, name lookup, fused q/k/v groups
//     adjacent, no tensors overlapping;
//   - bad input is an error message, not a crash.
// Agreement with PyTorch itself is proven by tests/reference/test_model_vs_transformers.py.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/model.h"
#include "model_testlib.h"
#include "testlib.h"

static const char *CONFIG_QWEN3 = TINY_QWEN3_CONFIG;
static const char *CONFIG_LLAMA = TINY_LLAMA_CONFIG;

typedef struct {
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
} Tiny;

static void tiny_init(Tiny *t, const char *json) {
    char err[512];
    REQUIRE(ops_create(&t->ops, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(tiny_model_init(&t->m, &t->w, t->ops, json, 1, 7, 0.3f, err, sizeof err) == 0, "%s", err);
}

static void tiny_free(Tiny *t) {
    tiny_model_free(&t->m, &t->w);
    ops_destroy(t->ops);
}

// Two sequences (lengths 21 and 6) through the training forward: logits (N, V).
static void training_logits(Tiny *t, const int32_t *tok, int n0, int n1, float *logits) {
    char err[512];
    int N = n0 + n1;
    int32_t targets[64], cu[3] = {0, n0, N};
    for (int i = 0; i < N; i++) targets[i] = -1;
    TrainActs *a;
    CHECK(train_acts_create(&a, &t->m, N, 2, 0, err, sizeof err) == 0, "%s", err);
    Batch b = {.n_seqs = 2, .n_tokens = N, .tokens = tok, .targets = targets, .cu_seqlens = cu};
    UnitSource src = resident_source(&t->w);
    CHECK(model_forward(&t->m, a, &src, &b, 1.0f, NULL, NULL, logits, err, sizeof err) == 0, "%s", err);
    train_acts_free(a, &t->m);
}

static void test_paged_equals_training(const char *json) {
    Tiny t;
    tiny_init(&t, json);
    char err[512];
    const int V = t.m.cfg.vocab_size, n0 = 21, n1 = 6, N = n0 + n1, bs = 4, max_blocks = 8;
    int32_t tok[64];
    for (int i = 0; i < N; i++) tok[i] = (i * 13 + 5) % V;
    float *want = malloc((size_t)N * V * 4), *got = malloc((size_t)N * V * 4);
    training_logits(&t, tok, n0, n1, want);

    // Scattered, interleaved physical blocks: sequence 0 owns 15, 13, 11, ... and sequence 1 owns 0, 2, 4, ...
    int32_t tables[2 * 8];
    for (int j = 0; j < max_blocks; j++) {
        tables[j] = 15 - 2 * j;
        tables[max_blocks + j] = 2 * j;
    }
    KVCache kv;
    DecodeBufs *bufs;
    CHECK(kv_cache_create(&kv, &t.m, 16, bs, err, sizeof err) == 0, "%s", err);
    CHECK(decode_bufs_create(&bufs, &t.m, 16, 2, max_blocks, 16, err, sizeof err) == 0, "%s", err);
    UnitSource src = resident_source(&t.w);
    // Steps: seq0 prefill chunk [0,9) ; seq0 [9,16) + seq1 prefill [0,5) ; then one token at a time for the rest.
    int pos0 = 0, pos1 = 0;
    int plan[][2] = {{9, 0}, {7, 5}, {1, 1}, {1, 0}, {1, 0}, {1, 0}, {1, 0}};
    for (size_t s = 0; s < sizeof plan / sizeof plan[0]; s++) {
        int32_t tk[16], sq[16], ps[16], sl[16], rows[16];
        int n = 0;
        for (int q = 0; q < 2; q++) {
            int take = plan[s][q], *pos = q == 0 ? &pos0 : &pos1, base = q == 0 ? 0 : n0;
            for (int i = 0; i < take; i++, n++) {
                int p = (*pos)++;
                tk[n] = tok[base + p];
                sq[n] = q;
                ps[n] = p;
                sl[n] = tables[q * max_blocks + p / bs] * bs + p % bs;
                rows[n] = n;
            }
        }
        float *lg = malloc((size_t)n * V * 4);
        CHECK(model_decode_step(&t.m, bufs, &src, &kv, n, tk, sq, ps, sl, tables, 2, max_blocks, rows, n, lg, err,
                                sizeof err) == 0, "%s", err);
        for (int i = 0; i < n; i++) {
            int idx = (sq[i] == 0 ? 0 : n0) + ps[i];
            memcpy(got + (size_t)idx * V, lg + (size_t)i * V, (size_t)V * 4);
        }
        free(lg);
    }
    CHECK(pos0 == n0 && pos1 == n1, "plan covers %d/%d and %d/%d tokens", pos0, n0, pos1, n1);
    double e = model_max_rel(got, want, (size_t)N * V);
    CHECK(e <= 1e-4, "paged logits differ from training logits by %.3g", e);

    // A token id outside the vocabulary is refused with a message.
    int32_t bad = V + 3, sq0 = 0, ps0 = 0, sl0 = 0, row0 = 0;
    float lg1[128];
    CHECK(model_decode_step(&t.m, bufs, &src, &kv, 1, &bad, &sq0, &ps0, &sl0, tables, 2, max_blocks, &row0, 1, lg1,
                            err, sizeof err) != 0 && strstr(err, "out of range"), "bad token accepted: %s", err);
    decode_bufs_free(bufs, &t.m);
    kv_cache_free(&kv, &t.m);
    free(want);
    free(got);
    tiny_free(&t);
}

static void grads_of(Tiny *t, int flags, int passes, float **out) {
    char err[512];
    const int N = 19;
    int32_t tok[19], targets[19], cu[4] = {0, 7, 8, 19};
    for (int i = 0; i < N; i++) {
        tok[i] = (i * 29 + 3) % t->m.cfg.vocab_size;
        targets[i] = (i * 31 + 11) % t->m.cfg.vocab_size;
    }
    targets[6] = -1;
    float lp[19], dlp[19];
    for (int i = 0; i < N; i++) dlp[i] = targets[i] < 0 ? 0.0f : -0.1f * (1 + i % 3);
    TrainActs *a;
    CHECK(train_acts_create(&a, &t->m, N, 3, flags, err, sizeof err) == 0, "%s", err);
    CHECK(!(flags & TRAIN_ACTS_KEEP_LOGITS) ||
              train_acts_logits_bytes(a) == (size_t)N * t->m.cfg.vocab_size * ops_dtype_size(t->m.ops),
          "kept logits: %zu bytes", train_acts_logits_bytes(a));
    Batch b = {.n_seqs = 3, .n_tokens = N, .tokens = tok, .targets = targets, .cu_seqlens = cu};
    UnitSource src = resident_source(&t->w);
    resident_zero_grads(&t->w, &t->m);
    for (int p = 0; p < passes; p++) {
        CHECK(model_forward(&t->m, a, &src, &b, 1.25f, lp, NULL, NULL, err, sizeof err) == 0, "%s", err);
        CHECK(model_backward(&t->m, a, &src, dlp, err, sizeof err) == 0, "%s", err);
    }
    // Kept logits became their gradient: a second backward of the same forward is refused (and adds nothing).
    if (flags & TRAIN_ACTS_KEEP_LOGITS)
        CHECK(model_backward(&t->m, a, &src, dlp, err, sizeof err) != 0 && strstr(err, "kept logits"),
              "a second backward on spent logits: %s", err);
    for (int u = 0; u < t->m.layout.n_units; u++) {
        out[u] = malloc(t->m.layout.unit_numel[u] * 4);
        memcpy(out[u], t->w.grads[u], t->m.layout.unit_numel[u] * 4);
    }
    train_acts_free(a, &t->m);
}

static void test_checkpointing_and_accumulation(const char *json) {
    Tiny t;
    tiny_init(&t, json);
    int U = t.m.layout.n_units;
    float *saved[16], *recomputed[16], *twice[16], *kept[16], *kept_ckpt[16], *kept_twice[16];
    grads_of(&t, 0, 1, saved);
    grads_of(&t, TRAIN_ACTS_CHECKPOINT, 1, recomputed);
    grads_of(&t, 0, 2, twice);
    // Logits kept from the forward instead of recomputed: the same GEMMs on the same rows, so the same bits.
    grads_of(&t, TRAIN_ACTS_KEEP_LOGITS, 1, kept);
    grads_of(&t, TRAIN_ACTS_KEEP_LOGITS | TRAIN_ACTS_CHECKPOINT, 1, kept_ckpt);
    grads_of(&t, TRAIN_ACTS_KEEP_LOGITS, 2, kept_twice);
    for (int u = 0; u < U; u++) {
        size_t n = t.m.layout.unit_numel[u];
        CHECK(memcmp(saved[u], recomputed[u], n * 4) == 0, "unit %d: checkpointed gradients differ", u);
        CHECK(memcmp(saved[u], kept[u], n * 4) == 0, "unit %d: gradients with kept logits differ", u);
        CHECK(memcmp(saved[u], kept_ckpt[u], n * 4) == 0, "unit %d: kept logits + checkpointing differ", u);
        CHECK(memcmp(twice[u], kept_twice[u], n * 4) == 0, "unit %d: two passes with kept logits differ", u);
        free(kept[u]);
        free(kept_ckpt[u]);
        free(kept_twice[u]);
        double norm = 0;
        for (size_t i = 0; i < n; i++) {
            saved[u][i] *= 2;
            norm += fabs(saved[u][i]);
        }
        CHECK(norm > 0, "unit %d has an all-zero gradient", u);
        double e = model_max_rel(twice[u], saved[u], n);
        CHECK(e <= 1e-6, "unit %d: two accumulated passes differ from 2x one pass by %.3g", u, e);
        free(saved[u]);
        free(recomputed[u]);
        free(twice[u]);
    }
    tiny_free(&t);
}

static void test_layout(void) {
    char err[512];
    ModelConfig a, b;
    Layout la, lb;
    CHECK(config_parse(&a, CONFIG_QWEN3, strlen(CONFIG_QWEN3), err, sizeof err) == 0, "%s", err);
    CHECK(config_parse(&b, CONFIG_LLAMA, strlen(CONFIG_LLAMA), err, sizeof err) == 0, "%s", err);
    CHECK(layout_build(&la, &a, err, sizeof err) == 0, "%s", err);
    CHECK(layout_build(&lb, &b, err, sizeof err) == 0, "%s", err);
    CHECK(la.n_units == 5 && lb.n_units == 5, "units %d %d", la.n_units, lb.n_units);
    CHECK(la.lm_head == SIZE_MAX && lb.lm_head != SIZE_MAX, "tied/untied lm_head");
    CHECK(la.hash != lb.hash, "different layouts share a hash");
    for (int u = 0; u < la.n_units; u++) {
        CHECK(la.unit_numel[u] % LAYOUT_ALIGN == 0, "unit %d not aligned", u);
        for (int n = 1; n <= 7; n++) {
            size_t p = layout_padded_unit_numel(&la, u, n);
            CHECK(p >= la.unit_numel[u] && p % ((size_t)n * LAYOUT_ALIGN) == 0, "unit %d padded for %d: %zu", u, n, p);
        }
    }
    int i = layout_find(&la, "model.layers.2.self_attn.k_norm.weight");
    CHECK(i >= 0 && la.tensors[i].unit == 3 && la.tensors[i].offset == la.layer.k_norm && la.tensors[i].shape[0] == 12,
          "k_norm lookup");
    i = layout_find(&la, "model.layers.1.mlp.up_proj.weight");
    CHECK(i >= 0 && la.tensors[i].offset == la.layer.wgu + (size_t)48 * 32, "up_proj follows gate_proj");
    // q/k/v weights and biases form fused groups with no padding (the biases' 48 and 24 are not multiples of 64).
    const LayerOffsets *lo = &la.layer;
    CHECK(lo->wk == lo->wq + (size_t)48 * 32 && lo->wv == lo->wk + (size_t)24 * 32, "q/k/v weights adjacent");
    CHECK(lo->bk == lo->bq + 48 && lo->bv == lo->bk + 24, "q/k/v biases adjacent: %zu %zu %zu", lo->bq, lo->bk, lo->bv);
    i = layout_find(&la, "model.layers.0.self_attn.v_proj.bias");
    CHECK(i >= 0 && la.tensors[i].offset == lo->bv && la.tensors[i].numel == 24, "v_proj.bias lookup");
    for (int k = 1; k < la.n_tensors; k++) {
        const LayoutTensor *p = &la.tensors[k - 1], *t = &la.tensors[k];
        CHECK(t->unit != p->unit || t->offset >= p->offset + p->numel, "%s overlaps %s", t->name, p->name);
        CHECK(t->offset + t->numel <= la.unit_numel[t->unit], "%s runs past its unit", t->name);
    }
    CHECK(layout_find(&la, "model.layers.3.mlp.up_proj.weight") < 0, "layer 3 does not exist");
    CHECK(layout_find(&lb, "model.layers.0.self_attn.q_proj.bias") < 0, "llama has no q bias");
    size_t n_params = 0;
    for (int k = 0; k < lb.n_tensors; k++) n_params += lb.tensors[k].numel;
    CHECK(n_params == lb.n_params, "n_params %zu vs %zu", n_params, lb.n_params);
    layout_free(&la);
    layout_free(&lb);
}

int main(void) {
    test_layout();
    test_paged_equals_training(CONFIG_QWEN3);
    test_paged_equals_training(CONFIG_LLAMA);
    test_checkpointing_and_accumulation(CONFIG_QWEN3);
    test_checkpointing_and_accumulation(CONFIG_LLAMA);
    return check_exit_code("test_model");
}
