// test_decode_narrow_tables.c — block tables narrower than the decode buffers' (shared/model_decode.c): the
// rollout engine sends rows of the step's longest table instead of max_blocks entries, and the model spreads them
// into the full-width rows the attention reads.
//
// A random Llama-style model, 6 sequences with scattered blocks of 4 tokens growing over 30 decode steps (tables
// grow from 2 to 10 of 24 entries); each step the rows are rotated, so a row held another sequence the step before.
// Every step, unpadded (model_decode_step) and padded (model_decode_step_padded, eager on the CPU, CUDA graphs on a
// GPU): the logits with narrow tables equal those with full-width tables bit for bit, also after the entries past
// each table's end were filled with wrong (valid) block ids by a full-width step in between. Tables wider than the
// buffers are refused with a message. CPU always; the CUDA backend too where a GPU is present.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/model.h"
#include "testlib.h"

static const char *LLAMA =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 300, \"hidden_size\": 128,"
    " \"intermediate_size\": 256, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
    " \"max_position_embeddings\": 96, \"hidden_act\": \"silu\", \"tie_word_embeddings\": false}";

enum { S = 6, BS = 4, MB = 96 / BS, STEPS = 30 };

// Block j of sequence s: scattered over the pool (s * MB + j, permuted) so that a wrong table row reads other K/V.
static int32_t block_of(int s, int j) { return (int32_t)(((s * MB + j) * 37) % (S * MB)); }

static int blocks_for(int len) { return (len + BS - 1) / BS; }

// Rows (n, width): row i = sequence sel[i]'s blocks covering len[sel[i]] tokens, then `past` up to width.
static void fill_tables(int32_t *tab, int width, const int *sel, int n, const int *len, int past_wrong) {
    for (int i = 0; i < n; i++) {
        const int s = sel[i], nb = blocks_for(len[s]);
        for (int j = 0; j < width; j++)
            tab[i * width + j] = j < nb ? block_of(s, j) : past_wrong ? block_of((s + 1) % S, j) : -1;
    }
}

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof *a) == 0; }

static void run(OpsBackend be, const char *name) {
    char err[512];
    OpsCtx *o;
    Model m;
    ResidentWeights w;
    KVCache kv;
    DecodeBufs *b;
    REQUIRE(ops_create(&o, be, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(tiny_model_init(&m, &w, o, LLAMA, 0, 11, 0.05f, err, sizeof err) == 0, "%s", err);
    UnitSource src = resident_source(&w);
    const int V = m.cfg.vocab_size;
    REQUIRE(kv_cache_create(&kv, &m, S * MB, BS, err, sizeof err) == 0, "%s", err);
    REQUIRE(decode_bufs_create(&b, &m, S * 8, S, MB, S, err, sizeof err) == 0, "%s", err);
    REQUIRE(decode_bufs_enable_padded(b, &m, S, 1, err, sizeof err) == S, "%s", err);

    // Prefill: prompts of 5..8 tokens, full-width tables.
    int len[S], sel[S];
    int32_t next[S], tok[S * 8], seq[S * 8], pos[S * 8], slot[S * 8], rows[S];
    static int32_t full[S * MB], narrow[S * MB], wrong[S * MB];
    float *la = malloc((size_t)S * V * sizeof *la), *lb = malloc((size_t)S * V * sizeof *lb);
    REQUIRE(la && lb, "out of memory");
    int N = 0;
    for (int s = 0; s < S; s++) {
        len[s] = 5 + s % 4;
        for (int i = 0; i < len[s]; i++, N++) {
            tok[N] = (int32_t)((s * 53 + i * 19 + 3) % V);
            seq[N] = s;
            pos[N] = i;
            slot[N] = block_of(s, i / BS) * BS + i % BS;
        }
        rows[s] = N - 1;
        sel[s] = s;
    }
    fill_tables(full, MB, sel, S, len, 0);
    REQUIRE(model_decode_step(&m, b, &src, &kv, N, tok, seq, pos, slot, full, S, MB, rows, S, la, err, sizeof err) == 0,
            "%s prefill: %s", name, err);
    for (int s = 0; s < S; s++) {
        int best = 0;
        for (int v = 1; v < V; v++)
            if (la[(size_t)s * V + v] > la[(size_t)s * V + best]) best = v;
        next[s] = best;
    }

    int widest = 0;
    for (int step = 0; step < STEPS; step++) {
        const int n = step % 3 == 2 ? S - 1 : S; // now and then one sequence sits out
        int width = 1;
        for (int i = 0; i < n; i++) {
            const int s = (i + step) % S;
            sel[i] = s;
            tok[i] = next[s];
            pos[i] = len[s];
            seq[i] = rows[i] = i;
            slot[i] = block_of(s, len[s] / BS) * BS + len[s] % BS;
            if (blocks_for(len[s] + 1) > width) width = blocks_for(len[s] + 1);
        }
        widest = width > widest ? width : widest;
        for (int i = 0; i < n; i++) len[sel[i]]++; // the tables cover the token written this step
        fill_tables(full, MB, sel, n, len, 0);
        fill_tables(wrong, MB, sel, n, len, 1);
        fill_tables(narrow, width, sel, n, len, 0);
        // Unpadded: full width, then wrong ids past the ends (same step again: the same K/V rewritten), then narrow.
        int rc = model_decode_step(&m, b, &src, &kv, n, tok, seq, pos, slot, full, n, MB, rows, n, la, err, sizeof err);
        rc |= model_decode_step(&m, b, &src, &kv, n, tok, seq, pos, slot, wrong, n, MB, rows, n, lb, err, sizeof err);
        CHECK(rc == 0 && same_bits(la, lb, (size_t)n * V), "%s step %d: entries past the tables' ends were read", name,
              step);
        rc |= model_decode_step(&m, b, &src, &kv, n, tok, seq, pos, slot, narrow, n, width, rows, n, lb, err,
                                sizeof err);
        CHECK(rc == 0 && same_bits(la, lb, (size_t)n * V), "%s step %d: unpadded, tables of %d != %d (%s)", name, step,
              width, MB, rc ? err : "logits differ");
        // Padded: the same comparison.
        rc = model_decode_step_padded(&m, b, &src, &kv, n, tok, pos, slot, full, MB, la, err, sizeof err);
        rc |= model_decode_step_padded(&m, b, &src, &kv, n, tok, pos, slot, wrong, MB, lb, err, sizeof err);
        rc |= model_decode_step_padded(&m, b, &src, &kv, n, tok, pos, slot, narrow, width, lb, err, sizeof err);
        CHECK(rc == 0 && same_bits(la, lb, (size_t)n * V), "%s step %d: padded, tables of %d != %d (%s)", name, step,
              width, MB, rc ? err : "logits differ");
        for (int i = 0; i < n; i++) {
            int best = 0;
            for (int v = 1; v < V; v++)
                if (la[(size_t)i * V + v] > la[(size_t)i * V + best]) best = v;
            next[sel[i]] = best;
        }
    }
    CHECK(widest >= 9 && widest < MB, "%s: the tables grew to %d blocks", name, widest);
    const int too_wide = model_decode_step(&m, b, &src, &kv, 1, tok, seq, pos, slot, full, 1, MB + 1, rows, 1, la,
                                           err, sizeof err);
    CHECK(too_wide != 0 && strstr(err, "block tables of 25"), "%s: tables wider than the buffers: %s", name, err);
    CHECK(model_decode_step_padded(&m, b, &src, &kv, 1, tok, pos, slot, full, MB + 1, la, err, sizeof err) != 0 &&
              strstr(err, "block tables of 25"),
          "%s: padded, tables wider than the buffers: %s", name, err);
    free(la);
    free(lb);
    decode_bufs_free(b, &m);
    kv_cache_free(&kv, &m);
    tiny_model_free(&m, &w);
    ops_destroy(o);
}

int main(void) {
    run(OPS_BACKEND_CPU, "cpu");
    if (ops_backend_available(OPS_BACKEND_CUDA)) run(OPS_BACKEND_CUDA, "cuda");
    return check_exit_code("test_decode_narrow_tables");
}
