// test_model_lora_rows.c — LoRA adapters in the rollout server's steps (m->lora_rows, CPU backend, fp32):
//   1. a sequence whose rows run through an adapter gets the logits of the merged model (W + s B A, PEFT's
//      merge_and_unload, model_lora_merge_unit) run without adapters: max |diff| / max |ref| <= 1e-4 (another
//      summation order only);
//   2. one step holding three sequences — adapter 1 (every module, r 4), the base model, adapter 2 (q_proj and
//      v_proj, r 2, rsLoRA) — gives each sequence's logits bit for bit as a step of it alone with its adapter:
//      which adapters share a step changes no row (the server batches requests of several adapters together);
//   3. ranges whose rank exceeds the scratch's fail the step with a message;
//   4. a padded decode step whose row runs through one adapter (replayed from its CUDA graph the second time on a
//      GPU) gives the unpadded step's logits (CPU: 1e-6; CUDA: 3e-2), and a padded step of two ranges is refused.
// For a Llama-style model and a Qwen3-style one (q/k norms). On a GPU machine the same again on the CUDA backend
// (bf16): 2, 3 and 4 unchanged, 1 within max rel 3e-2 (the merged weight is rounded to bf16 once, the adapter's path
// rounds its (N, r) and (N, out) intermediates).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/model.h"
#include "shared/model_lora.h"
#include "model_testlib.h"
#include "testlib.h"

enum { BS = 8, MB = 4, N_SEQ = 3, MAX_TOK = 64 };

static const int PROMPT[N_SEQ] = {7, 5, 6};

typedef struct {
    Model m;
    ResidentWeights w;
    UnitSource src;
    KVCache kv;
    DecodeBufs *b;
    ModelLoraRows rows;
    int V;
} Rig;

static uint64_t rng_next(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

static int32_t token_of(int s, int i, int V) { return (int32_t)((s * 977 + i * 131 + 7) % V); }

// Runs the prompts of sequences sel[0..count) in one step; adapter[k] (NULL: base) for sequence k's rows. Writes
// each sequence's last-token logits row into out[k] (V floats). Returns 0 or -1 with err.
static int run_step(Rig *r, const int *sel, int count, ModelLora *const *adapter, float *const *out, char *err,
                    size_t err_len) {
    int32_t tok[MAX_TOK], seq[MAX_TOK], pos[MAX_TOK], slot[MAX_TOK], rows[N_SEQ], tables[N_SEQ * MB];
    int N = 0;
    r->rows.n_ranges = 0;
    for (int k = 0; k < count; k++) {
        const int s = sel[k];
        if (adapter[k]) r->rows.ranges[r->rows.n_ranges++] = (LoraRowRange){N, PROMPT[s], adapter[k]};
        for (int i = 0; i < PROMPT[s]; i++, N++) {
            tok[N] = token_of(s, i, r->V);
            seq[N] = k;
            pos[N] = i;
            slot[N] = (s * MB + i / BS) * BS + i % BS;
        }
        for (int j = 0; j < MB; j++) tables[k * MB + j] = s * MB + j;
        rows[k] = N - 1;
    }
    float *logits = malloc((size_t)count * r->V * sizeof *logits);
    if (!logits) return -1;
    int rc = model_decode_step(&r->m, r->b, &r->src, &r->kv, N, tok, seq, pos, slot, tables, count, MB, rows, count,
                               logits, err, err_len);
    for (int k = 0; rc == 0 && k < count; k++) memcpy(out[k], logits + (size_t)k * r->V, (size_t)r->V * 4);
    free(logits);
    return rc;
}

// An adapter with PEFT's init for A and a random B (B = 0 would add nothing).
static ModelLora *make_adapter(Rig *r, const LoraConfig *lc, uint64_t seed, float **host) {
    char err[512];
    ModelLora *l;
    REQUIRE(model_lora_create(&l, &r->m, lc, 0, err, sizeof err) == 0, "%s", err);
    for (int layer = 0; layer < l->n_layers; layer++) {
        host[layer] = malloc(l->unit_numel * sizeof(float));
        REQUIRE(host[layer], "out of memory");
        model_lora_init_unit(l, seed, layer, host[layer]);
        uint64_t st = seed * 31 + (uint64_t)layer;
        for (int i = 0; i < LORA_N_MODULES; i++) {
            if (l->b_off[i] == SIZE_MAX) continue;
            float *bm = host[layer] + l->b_off[i];
            for (size_t k = 0; k < (size_t)l->out[i] * l->cfg.r; k++)
                bm[k] = 0.3f * ((float)(rng_next(&st) % 2001) / 1000.0f - 1.0f);
        }
        ops_upload_f32(l->ops, l->params[layer], host[layer], l->unit_numel);
    }
    REQUIRE(model_lora_serve_from(l, host, err, sizeof err) == 0, "%s", err);
    return l;
}

static void check_config(const char *name, const char *json, OpsBackend be) {
    char err[512];
    OpsCtx *o, *cpu;
    Rig r;
    memset(&r, 0, sizeof r);
    const double tol = be == OPS_BACKEND_CPU ? 1e-4 : 3e-2;
    REQUIRE(ops_create(&o, be, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(ops_create(&cpu, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(tiny_model_init(&r.m, &r.w, o, json, 0, 5, 0.08f, err, sizeof err) == 0, "%s", err);
    r.src = resident_source(&r.w);
    r.V = r.m.cfg.vocab_size;
    REQUIRE(kv_cache_create(&r.kv, &r.m, N_SEQ * MB, BS, err, sizeof err) == 0, "%s", err);
    REQUIRE(decode_bufs_create(&r.b, &r.m, MAX_TOK, N_SEQ, MB, N_SEQ, err, sizeof err) == 0, "%s", err);
    REQUIRE(model_lora_rows_reserve(&r.rows, &r.m, MAX_TOK, 4, err, sizeof err) == 0, "%s", err);
    r.m.lora_rows = &r.rows;

    const int L = r.m.cfg.num_layers;
    float **host1 = calloc((size_t)L, sizeof *host1), **host2 = calloc((size_t)L, sizeof *host2);
    LoraConfig lc1 = {.r = 4, .alpha = 8, .targets = LORA_ALL_TARGETS};
    LoraConfig lc2 = {.r = 2, .alpha = 3, .use_rslora = 1, .targets = (1u << LORA_Q_PROJ) | (1u << LORA_V_PROJ)};
    ModelLora *a1 = make_adapter(&r, &lc1, 11, host1), *a2 = make_adapter(&r, &lc2, 12, host2);
    ModelLora *const by_seq[N_SEQ] = {a1, NULL, a2};
    float *alone[N_SEQ], *mixed[N_SEQ], *merged[N_SEQ];
    for (int s = 0; s < N_SEQ; s++) {
        alone[s] = malloc((size_t)r.V * 4);
        mixed[s] = malloc((size_t)r.V * 4);
        merged[s] = malloc((size_t)r.V * 4);
    }

    // Each sequence alone, through its adapter.
    for (int s = 0; s < N_SEQ; s++)
        REQUIRE(run_step(&r, &s, 1, &by_seq[s], &alone[s], err, sizeof err) == 0, "%s", err);
    // All three in one step.
    const int all[N_SEQ] = {0, 1, 2};
    REQUIRE(run_step(&r, all, N_SEQ, by_seq, mixed, err, sizeof err) == 0, "%s", err);
    for (int s = 0; s < N_SEQ; s++)
        CHECK(memcmp(alone[s], mixed[s], (size_t)r.V * 4) == 0,
              "%s: sequence %d's logits in a step shared with other adapters differ from its own step's", name, s);

    // The merged models without adapters: each adapted sequence against its own merge.
    ModelLora *const none[1] = {NULL};
    float *const *hosts[N_SEQ] = {host1, NULL, host2};
    float **base = calloc((size_t)r.m.layout.n_units, sizeof *base);
    for (int u = 0; u < r.m.layout.n_units; u++) {
        base[u] = malloc(r.m.layout.unit_numel[u] * 4);
        ops_download_f32(o, base[u], r.w.params[u], r.m.layout.unit_numel[u]);
    }
    for (int s = 0; s < N_SEQ; s++) {
        for (int u = 0; u < r.m.layout.n_units; u++) ops_upload_f32(o, r.w.params[u], base[u], r.m.layout.unit_numel[u]);
        if (hosts[s]) {
            float *unit = malloc(r.m.layout.unit_numel[layout_layer_unit(0)] * 4);
            for (int l = 0; l < L; l++) {
                const int u = layout_layer_unit(l);
                memcpy(unit, base[u], r.m.layout.unit_numel[u] * 4);
                REQUIRE(model_lora_merge_unit(by_seq[s], &r.m, cpu, hosts[s][l], unit, err, sizeof err) == 0, "%s",
                        err);
                ops_upload_f32(o, r.w.params[u], unit, r.m.layout.unit_numel[u]);
            }
            free(unit);
        }
        REQUIRE(run_step(&r, &s, 1, none, &merged[s], err, sizeof err) == 0, "%s", err);
        const double rel = model_max_rel(alone[s], merged[s], (size_t)r.V);
        CHECK(rel <= tol, "%s: sequence %d through its adapter vs the merged model: max rel %.3g > %.0e", name, s, rel,
              tol);
        // The adapter must change the logits (else the comparison above says nothing).
        if (hosts[s]) {
            for (int u = 0; u < r.m.layout.n_units; u++)
                ops_upload_f32(o, r.w.params[u], base[u], r.m.layout.unit_numel[u]);
            float *plain = malloc((size_t)r.V * 4);
            REQUIRE(run_step(&r, &s, 1, none, &plain, err, sizeof err) == 0, "%s", err);
            const double moved = model_max_rel(plain, alone[s], (size_t)r.V);
            CHECK(moved > 3 * tol, "%s: adapter of sequence %d moves the logits by max rel %.3g only", name, s, moved);
            free(plain);
        }
    }
    for (int u = 0; u < r.m.layout.n_units; u++) ops_upload_f32(o, r.w.params[u], base[u], r.m.layout.unit_numel[u]);

    // An adapter above the scratch's rank fails the step, naming why.
    LoraConfig lc3 = {.r = 8, .alpha = 8, .targets = 1u << LORA_O_PROJ};
    float **host3 = calloc((size_t)L, sizeof *host3);
    ModelLora *a3 = make_adapter(&r, &lc3, 13, host3);
    int s0 = 0;
    err[0] = '\0';
    CHECK(run_step(&r, &s0, 1, &a3, &mixed[0], err, sizeof err) != 0 && strstr(err, "rank"),
          "%s: an adapter of rank 8 over scratch of rank 4 was run (%s)", name, err);
    ops_clear_error(o);

    // Sequence 0's prompt through adapter 1 again (its cache), then its next token unpadded and padded.
    REQUIRE(run_step(&r, &s0, 1, &by_seq[0], &alone[0], err, sizeof err) == 0, "%s", err);
    REQUIRE(decode_bufs_enable_padded(r.b, &r.m, N_SEQ, 1, err, sizeof err) > 0, "%s", err);
    const int32_t t1 = 3, p1 = PROMPT[0], sl1 = PROMPT[0], sq1 = 0, row1 = 0, tab[MB] = {0, 1, 2, 3};
    r.rows.ranges[0] = (LoraRowRange){0, 1, a1};
    r.rows.n_ranges = 1;
    float *unpadded = malloc((size_t)r.V * 4), *padded = malloc((size_t)r.V * 4);
    REQUIRE(model_decode_step(&r.m, r.b, &r.src, &r.kv, 1, &t1, &sq1, &p1, &sl1, tab, 1, MB, &row1, 1, unpadded, err,
                              sizeof err) == 0, "%s", err);
    for (int pass = 0; pass < 2; pass++) {
        REQUIRE(model_decode_step_padded(&r.m, r.b, &r.src, &r.kv, 1, &t1, &p1, &sl1, tab, MB, padded, err,
                                         sizeof err) == 0, "%s", err);
        const double rel = model_max_rel(padded, unpadded, (size_t)r.V);
        CHECK(rel <= (be == OPS_BACKEND_CPU ? 1e-6 : tol), "%s: padded step %d with an adapter vs unpadded: max rel %.3g",
              name, pass, rel);
        CHECK(r.rows.ranges[0].rows == 1, "%s: the padded step left its range at %d rows", name, r.rows.ranges[0].rows);
    }
    r.rows.ranges[1] = (LoraRowRange){0, 1, a2};
    r.rows.n_ranges = 2;
    CHECK(model_decode_step_padded(&r.m, r.b, &r.src, &r.kv, 1, &t1, &p1, &sl1, tab, MB, NULL, err, sizeof err) != 0,
          "%s: a padded step ran two adapter ranges", name);
    free(unpadded), free(padded);

    for (int s = 0; s < N_SEQ; s++) free(alone[s]), free(mixed[s]), free(merged[s]);
    for (int u = 0; u < r.m.layout.n_units; u++) free(base[u]);
    for (int l = 0; l < L; l++) free(host1[l]), free(host2[l]), free(host3[l]);
    free(base), free(host1), free(host2), free(host3);
    model_lora_free(a1), model_lora_free(a2), model_lora_free(a3);
    model_lora_rows_free(&r.rows);
    decode_bufs_free(r.b, &r.m);
    kv_cache_free(&r.kv, &r.m);
    tiny_model_free(&r.m, &r.w);
    ops_destroy(o);
    ops_destroy(cpu);
}

int main(void) {
    check_config("llama", SMALL_LLAMA_CONFIG, OPS_BACKEND_CPU);
    check_config("qwen3", SMALL_QWEN3_CONFIG, OPS_BACKEND_CPU);
    if (ops_backend_available(OPS_BACKEND_CUDA)) {
        check_config("llama cuda", SMALL_LLAMA_CONFIG, OPS_BACKEND_CUDA);
        check_config("qwen3 cuda", SMALL_QWEN3_CONFIG, OPS_BACKEND_CUDA);
    } else {
        printf("test_model_lora_rows: no CUDA device, the CUDA half is skipped\n");
    }
    return check_exit_code("test_model_lora_rows");
}
