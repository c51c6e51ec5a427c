// tests/unit/test_rollout_weight_recv.c — the weight receiver without sockets or engine: a layout hash mismatch
// is refused naming both hashes; slices split, reordered and overlapping land at the right place in fp32 and
// bf16; weights_end is refused while any unit is incomplete (naming it), for another peer or version; every
// out-of-range slice is refused before anything is written; a new weights_begin abandons the old update. Into bf16
// staging (a server whose weights are bf16) bf16 slices land as they are and fp32 ones rounded as the device upload
// rounds.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/weight_recv.h"
#include "shared/config.h"
#include "shared/dtype.h"
#include "shared/layout.h"
#include "tests/unit/check_macros.h"

typedef struct {
    void **bufs;     // (n_units) -> (unit_numel) staging copies: fp32, or bf16 bits with bf16
    int bf16;
    int calls;
} Staging;

static void *staging_fn(void *user, int unit, int *bf16) {
    Staging *s = user;
    s->calls++;
    *bf16 = s->bf16;
    return s->bufs[unit];
}

static const char *OWNER = "\x00\x6b\x8b\x45\x67";   // ZeroMQ routing ids start with a 0 byte
static const char *OTHER = "\x00\x6b\x8b\x45\x68";

// Expects rc < 0 and err to contain needle (and needle2).
static void expect_err(int line, int rc, const char *err, const char *needle, const char *needle2) {
    if (!(rc < 0 && strstr(err, needle) && (!needle2 || strstr(err, needle2)))) {
        fprintf(stderr, "line %d: expected an error with '%s' '%s', got rc=%d err='%s'\n", line, needle,
                needle2 ? needle2 : "", rc, err);
        failures++;
    }
}
#define EXPECT_ERR(rc, needle, needle2) expect_err(__LINE__, rc, err, needle, needle2)

int main(void) {
    const char *cfg_json = "{\"architectures\":[\"LlamaForCausalLM\"],\"vocab_size\":50,\"hidden_size\":16,"
                           "\"intermediate_size\":24,\"num_hidden_layers\":2,\"num_attention_heads\":2,"
                           "\"num_key_value_heads\":1,\"tie_word_embeddings\":false}";
    ModelConfig cfg;
    Layout L;
    char err[1024] = "";
    if (config_parse(&cfg, cfg_json, strlen(cfg_json), err, sizeof err) || layout_build(&L, &cfg, err, sizeof err)) {
        fprintf(stderr, "setup failed: %s\n", err);
        return 1;
    }
    Staging st = {calloc((size_t)L.n_units, sizeof(void *)), 0, 0};
    for (int u = 0; u < L.n_units; u++) st.bufs[u] = calloc(L.unit_numel[u], sizeof(float));
    WeightRecv w;
    CHECK(weight_recv_init(&w, &L, err, sizeof err) == 0);
    int64_t ab = 0;
    const size_t ol = 5;

    // Nothing open yet.
    float one[4] = {1, 2, 3, 4};
    EXPECT_ERR(weight_recv_slice(&w, OWNER, ol, 0, 0, 0, 0, 4, ZMSG_DTYPE_F32, one, staging_fn, &st, err, sizeof err),
               "no weight update is open", NULL);
    EXPECT_ERR(weight_recv_ready(&w, OWNER, ol, 1, err, sizeof err), "no weight update is open", NULL);

    // Layout hash mismatch names both hashes.
    char mine[17], theirs[17];
    zmsg_hash_to_hex(L.hash, mine);
    zmsg_hash_to_hex(L.hash ^ 1, theirs);
    EXPECT_ERR(weight_recv_begin(&w, 1, L.hash ^ 1, OWNER, ol, &ab, err, sizeof err), theirs, mine);
    CHECK(!w.active);

    CHECK(weight_recv_begin(&w, 7, L.hash, OWNER, ol, &ab, err, sizeof err) == 0 && ab == -1 && w.active);

    // Reference values per unit: element i of unit u = u * 1000 + i * 0.25 (exact in bf16 only for some; the
    // bf16 units are checked against the bf16 rounding of the same values).
    float **ref = calloc((size_t)L.n_units, sizeof(float *));
    for (int u = 0; u < L.n_units; u++) {
        ref[u] = malloc(L.unit_numel[u] * sizeof(float));
        for (size_t i = 0; i < L.unit_numel[u]; i++) ref[u][i] = (float)u * 1000.0f + (float)i * 0.25f;
    }
    // Refusals leave staging untouched.
    int last = L.n_units - 1;
    int64_t n_last = (int64_t)L.unit_numel[last];
    EXPECT_ERR(weight_recv_slice(&w, OWNER, ol, 0, 0, L.n_units, 0, 4, ZMSG_DTYPE_F32, one, staging_fn, &st, err, sizeof err),
               "unit 4 out of range", "0..3");
    EXPECT_ERR(weight_recv_slice(&w, OWNER, ol, 0, 0, -1, 0, 4, ZMSG_DTYPE_F32, one, staging_fn, &st, err, sizeof err),
               "unit -1 out of range", NULL);
    EXPECT_ERR(weight_recv_slice(&w, OWNER, ol, 0, 0, last, n_last - 3, 4, ZMSG_DTYPE_F32, one, staging_fn, &st, err,
                                 sizeof err), "outside unit 3", NULL);
    EXPECT_ERR(weight_recv_slice(&w, OWNER, ol, 0, 0, last, -1, 4, ZMSG_DTYPE_F32, one, staging_fn, &st, err, sizeof err),
               "outside unit 3", NULL);
    EXPECT_ERR(weight_recv_slice(&w, OTHER, ol, 0, 0, 0, 0, 4, ZMSG_DTYPE_F32, one, staging_fn, &st, err, sizeof err),
               "another peer", NULL);
    // Another peer naming a different update is refused too; naming the open one (7) it may send (ZeRO ranks).
    EXPECT_ERR(weight_recv_slice(&w, OTHER, ol, 1, 6, 0, 0, 4, ZMSG_DTYPE_F32, one, staging_fn, &st, err, sizeof err),
               "another peer", "names another version");
    CHECK(st.calls == 0 && weight_recv_covered(&w, last) == 0);
    CHECK(weight_recv_slice(&w, OTHER, ol, 1, 7, last, 0, 4, ZMSG_DTYPE_F32, ref[last], staging_fn, &st, err,
                            sizeof err) == 0);
    CHECK(weight_recv_covered(&w, last) == 4);

    // Unit 0 in fp32 slices, back to front; unit 1 in bf16 with overlapping slices; unit 2 fp32 in one
    // slice from an odd address; the last unit in two halves with a gap, filled afterwards.
    int64_t n0 = (int64_t)L.unit_numel[0];
    for (int64_t off = n0; off > 0;) {
        int64_t c = off >= 100 ? 100 : off;
        off -= c;
        CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, 0, off, c, ZMSG_DTYPE_F32, ref[0] + off, staging_fn, &st, err,
                                sizeof err) == 0);
    }
    int64_t n1 = (int64_t)L.unit_numel[1];
    uint16_t *b1 = malloc((size_t)n1 * 2);
    dtype_f32_to_bf16_n(b1, ref[1], (size_t)n1);
    int64_t step = n1 / 3;
    CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, 1, 0, step + 10, ZMSG_DTYPE_BF16, b1, staging_fn, &st, err,
                            sizeof err) == 0);
    CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, 1, 2 * step - 5, n1 - (2 * step - 5), ZMSG_DTYPE_BF16, b1 + 2 * step - 5,
                            staging_fn, &st, err, sizeof err) == 0);
    CHECK(weight_recv_covered(&w, 1) == step + 10 + n1 - (2 * step - 5));
    EXPECT_ERR(weight_recv_ready(&w, OWNER, ol, 7, err, sizeof err), "unit 1 is incomplete", NULL);
    CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, 1, step, step, ZMSG_DTYPE_BF16, b1 + step, staging_fn, &st, err,
                            sizeof err) == 0);
    CHECK(weight_recv_covered(&w, 1) == n1);
    int64_t n2 = (int64_t)L.unit_numel[2];
    char *odd = malloc((size_t)n2 * 4 + 1);
    memcpy(odd + 1, ref[2], (size_t)n2 * 4);
    CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, 2, 0, n2, ZMSG_DTYPE_F32, odd + 1, staging_fn, &st, err, sizeof err) == 0);
    int64_t half = n_last / 2;
    CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, last, 0, half - 64, ZMSG_DTYPE_F32, ref[last], staging_fn, &st, err,
                            sizeof err) == 0);
    CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, last, half, n_last - half, ZMSG_DTYPE_F32, ref[last] + half, staging_fn,
                            &st, err, sizeof err) == 0);
    char want[128], gap[64];
    snprintf(want, sizeof want, "unit %d is incomplete: %lld of its %lld elements", last,
             (long long)(n_last - 64), (long long)n_last);
    snprintf(gap, sizeof gap, "first missing element %lld", (long long)(half - 64));
    EXPECT_ERR(weight_recv_ready(&w, OWNER, ol, 7, err, sizeof err), want, gap);
    CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, last, half - 64, 64, ZMSG_DTYPE_F32, ref[last] + half - 64, staging_fn, &st,
                            err, sizeof err) == 0);
    EXPECT_ERR(weight_recv_ready(&w, OWNER, ol, 8, err, sizeof err), "version 8 does not match", "version 7");
    EXPECT_ERR(weight_recv_ready(&w, OTHER, ol, 7, err, sizeof err), "another peer", NULL);
    CHECK(weight_recv_ready(&w, OWNER, ol, 7, err, sizeof err) == 0);
    for (int u = 0; u < L.n_units; u++) {
        int bad = 0;
        for (size_t i = 0; i < L.unit_numel[u]; i++) {
            float want_v = u == 1 ? dtype_bf16_to_f32(dtype_f32_to_bf16(ref[u][i])) : ref[u][i];
            if (((float *)st.bufs[u])[i] != want_v) bad++;
        }
        if (bad) fprintf(stderr, "unit %d: %d elements differ\n", u, bad);
        CHECK(bad == 0);
    }

    // A new weights_begin abandons the open update and starts from zero coverage.
    CHECK(weight_recv_begin(&w, 9, L.hash, OTHER, ol, &ab, err, sizeof err) == 0 && ab == 7);
    for (int u = 0; u < L.n_units; u++) CHECK(weight_recv_covered(&w, u) == 0);
    EXPECT_ERR(weight_recv_ready(&w, OTHER, ol, 9, err, sizeof err), "unit 0 is incomplete: 0 of", NULL);
    EXPECT_ERR(weight_recv_slice(&w, OWNER, ol, 0, 0, 0, 0, 4, ZMSG_DTYPE_F32, one, staging_fn, &st, err, sizeof err),
               "another peer", NULL);
    weight_recv_reset(&w);
    CHECK(!w.active);

    // A server whose weights are bf16 stages in bf16: bf16 slices land as they are, fp32 ones (from an odd address)
    // rounded as dtype_f32_to_bf16 rounds, which is the rule the upload to the device applies.
    Staging sb = {calloc((size_t)L.n_units, sizeof(void *)), 1, 0};
    for (int u = 0; u < L.n_units; u++) sb.bufs[u] = calloc(L.unit_numel[u], sizeof(uint16_t));
    CHECK(weight_recv_begin(&w, 11, L.hash, OWNER, ol, &ab, err, sizeof err) == 0);
    for (int u = 0; u < L.n_units; u++) {
        const int64_t n = (int64_t)L.unit_numel[u];
        if (u == 1) {
            CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, u, 0, n, ZMSG_DTYPE_BF16, b1, staging_fn, &sb, err,
                                    sizeof err) == 0);
            continue;
        }
        char *src = malloc((size_t)n * 4 + 1);
        memcpy(src + 1, ref[u], (size_t)n * 4);
        CHECK(weight_recv_slice(&w, OWNER, ol, 0, 0, u, 0, n, ZMSG_DTYPE_F32, src + 1, staging_fn, &sb, err,
                                sizeof err) == 0);
        free(src);
    }
    CHECK(weight_recv_ready(&w, OWNER, ol, 11, err, sizeof err) == 0);
    for (int u = 0; u < L.n_units; u++) {
        int bad = 0;
        for (size_t i = 0; i < L.unit_numel[u]; i++) bad += ((uint16_t *)sb.bufs[u])[i] != dtype_f32_to_bf16(ref[u][i]);
        if (bad) fprintf(stderr, "bf16 staging, unit %d: %d elements differ\n", u, bad);
        CHECK(bad == 0);
        free(sb.bufs[u]);
    }
    free(sb.bufs);
    weight_recv_reset(&w);

    for (int u = 0; u < L.n_units; u++) {
        free(st.bufs[u]);
        free(ref[u]);
    }
    free(st.bufs);
    free(ref);
    free(b1);
    free(odd);
    weight_recv_free(&w);
    layout_free(&L);
    if (failures) {
        fprintf(stderr, "test_rollout_weight_recv: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_rollout_weight_recv: all checks passed\n");
    return 0;
}
