// test_model_shard.c — tensor-parallel shards of the model on the CPU backend (shared/model_shard.c): a tiny model
// split over 2 and 4 shards, each shard a thread with its own compute context and the host communicator between
// them (the CPU twin of a tensor-parallel rollout server), gives the logits of the whole model:
//   - paged steps (prefill chunks and decodes mixed, scattered block tables): every shard's logits equal the
//     whole model's within fp32 summation-order error (1e-5 relative), and are the same bits on every shard;
//   - padded decode-only steps of 1 and 3 sequences (the fused small-batch layer and the general one) likewise;
//   - shard configs: heads, KV heads (split, and replicated at 4 shards over 2 KV heads), MLP width, vocabulary rows
//     (67 rows over 2 and 4 shards: the last shard has padding rows); sizes that do not divide are refused;
//   - model_shard_unit: the shards' slices of every tensor put back together are the whole tensor;
//   - model_shard_parts (a weight update straight into the shards): for the whole unit cut into W flat slices as
//     ZeRO cuts it (W = 1, 2, 3, 5, 8) and one slice per element, the parts of every slice, copied into a zeroed
//     shard unit, give model_shard_unit's slice exactly, no shard element is written twice, and every part is
//     contiguous in the shard unit, and in the whole unit when it says so;
//   - model_fill_random (--load-format random): every shard of 2 and 4 filled on its own holds model_shard_unit's slice
//     of the whole model filled at once, bit for bit; norms are 1, weights within +-0.0347 and not all alike.
// Both architectures' variants: q/k norms, q/k/v biases and tied embeddings (Qwen3), untied lm_head (Llama).
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/comm/comm.h"
#include "shared/model.h"
#include "spawn_testlib.h"
#include "model_testlib.h"
#include "testlib.h"

static const char *CONFIG_QWEN3 = TINY_QWEN3_CONFIG;
static const char *CONFIG_LLAMA = TINY_LLAMA_CONFIG;

enum { BS = 4, MAX_BLOCKS = 8, N_BLOCKS = 16, MAX_TOK = 16 };

// The same work for the whole model and for every shard: paged steps over two sequences, then padded decode steps.
// Writes the logits of every step, one after the other, into out (at most OUT_FLOATS), and how many into *n_out.
#define OUT_FLOATS (64 * 67)
static int run_steps(Model *m, UnitSource *src, float *out, size_t *n_out, char *err, size_t err_len) {
    const int V = m->shard.vocab_total, n0 = 21, n1 = 6;
    int32_t tok[32], tables[2 * MAX_BLOCKS];
    for (int i = 0; i < n0 + n1; i++) tok[i] = (i * 13 + 5) % V;
    for (int j = 0; j < MAX_BLOCKS; j++) {
        tables[j] = 15 - 2 * j;
        tables[MAX_BLOCKS + j] = 2 * j;
    }
    KVCache kv;
    DecodeBufs *bufs = NULL;
    int rc = -1;
    if (kv_cache_create(&kv, m, N_BLOCKS, BS, err, err_len) != 0) return -1;
    if (decode_bufs_create(&bufs, m, MAX_TOK, 4, MAX_BLOCKS, MAX_TOK, err, err_len) != 0) goto out;
    if (decode_bufs_enable_padded(bufs, m, 4, 0, err, err_len) != 4) goto out;
    *n_out = 0;
    // Paged steps: seq0 prefill chunk [0,9); seq0 [9,16) + seq1 [0,5); then one token at a time.
    int pos[2] = {0, 0};
    const int plan[][2] = {{9, 0}, {7, 5}, {1, 1}, {1, 0}, {1, 0}};
    for (size_t s = 0; s < sizeof plan / sizeof plan[0]; s++) {
        int32_t tk[MAX_TOK], sq[MAX_TOK], ps[MAX_TOK], sl[MAX_TOK], rows[MAX_TOK];
        int n = 0;
        for (int q = 0; q < 2; q++)
            for (int i = 0; i < plan[s][q]; i++, n++) {
                const int p = pos[q]++;
                tk[n] = tok[(q ? n0 : 0) + p];
                sq[n] = q;
                ps[n] = p;
                sl[n] = tables[q * MAX_BLOCKS + p / BS] * BS + p % BS;
                rows[n] = n;
            }
        if (model_decode_step(m, bufs, src, &kv, n, tk, sq, ps, sl, tables, 2, MAX_BLOCKS, rows, n,
                              out + *n_out, err, err_len) != 0)
            goto out;
        *n_out += (size_t)n * V;
    }
    // Padded decode-only steps: sequence 0 alone (the fused small-batch layer), then 3 rows (sequence 0, sequence 1
    // and sequence 0's table again at a fresh position, as a third sequence reading the same blocks).
    for (int k = 0; k < 2; k++) {
        const int n = k == 0 ? 1 : 3;
        int32_t tk[3], ps[3], sl[3], tb[3 * MAX_BLOCKS];
        for (int i = 0; i < n; i++) {
            const int q = i == 1 ? 1 : 0, p = pos[q]++;
            tk[i] = (p * 7 + 3) % V;
            ps[i] = p;
            sl[i] = tables[q * MAX_BLOCKS + p / BS] * BS + p % BS;
            memcpy(tb + i * MAX_BLOCKS, tables + q * MAX_BLOCKS, MAX_BLOCKS * sizeof *tb);
        }
        if (model_decode_step_padded(m, bufs, src, &kv, n, tk, ps, sl, tb, MAX_BLOCKS, out + *n_out, err,
                                     err_len) != 0)
            goto out;
        *n_out += (size_t)n * V;
    }
    rc = 0;
out:
    decode_bufs_free(bufs, m);
    kv_cache_free(&kv, m);
    return rc;
}

typedef struct {
    const Model *full;
    float *const *units;   // the whole model's units, host fp32
    int rank, size, port;
    float *out;
    size_t n_out;
    int rc;
    char err[512];
} ShardRun;

static void *shard_main(void *arg) {
    ShardRun *s = arg;
    OpsCtx *ops = NULL;
    Model m;
    ResidentWeights w;
    Comm *comm = NULL;
    int have_m = 0, have_w = 0;
    s->rc = -1;
    if (ops_create(&ops, OPS_BACKEND_CPU, 0, s->err, sizeof s->err) != 0) return NULL;
    if (model_init_shard(&m, &s->full->cfg, s->rank, s->size, ops, s->err, sizeof s->err) != 0) goto out;
    have_m = 1;
    if (resident_alloc(&w, &m, 0, s->err, sizeof s->err) != 0) goto out;
    have_w = 1;
    for (int u = 0; u < m.layout.n_units; u++) {
        float *slice = malloc(m.layout.unit_numel[u] * sizeof *slice);
        model_shard_unit(s->full, &m, u, s->units[u], slice, sizeof(float));
        ops_upload_f32(ops, w.params[u], slice, m.layout.unit_numel[u]);
        free(slice);
    }
    CommInit ci = {.rank = s->rank, .world_size = s->size, .master_port = s->port, .timeout_ms = 20000};
    snprintf(ci.master_addr, sizeof ci.master_addr, "127.0.0.1");
    if (comm_create(&comm, COMM_BACKEND_HOST, &ci, NULL, s->err, sizeof s->err) != 0) goto out;
    m.shard.comm = comm;
    UnitSource src = resident_source(&w);
    s->rc = run_steps(&m, &src, s->out, &s->n_out, s->err, sizeof s->err);
out:
    if (comm) comm_destroy(comm);
    if (have_w) resident_free(&w, &m);
    if (have_m) model_free(&m);
    ops_destroy(ops);
    return NULL;
}

static void test_shards_equal_whole(const char *json, const char *name) {
    char err[512];
    OpsCtx *ops;
    Model full;
    ResidentWeights fw;
    REQUIRE(ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(tiny_model_init(&full, &fw, ops, json, 0, 7, 0.3f, err, sizeof err) == 0, "%s", err);
    float **units = calloc((size_t)full.layout.n_units, sizeof *units);
    for (int u = 0; u < full.layout.n_units; u++) {
        units[u] = malloc(full.layout.unit_numel[u] * sizeof(float));
        ops_download_f32(ops, units[u], fw.params[u], full.layout.unit_numel[u]);
    }
    float *want = malloc(OUT_FLOATS * sizeof *want);
    size_t n_want = 0;
    UnitSource src = resident_source(&fw);
    CHECK(run_steps(&full, &src, want, &n_want, err, sizeof err) == 0, "%s whole model: %s", name, err);

    for (int size = 2; size <= 4; size *= 2) {
        ShardRun runs[4];
        pthread_t th[4];
        const int port = free_port();
        for (int r = 0; r < size; r++) {
            runs[r] = (ShardRun){.full = &full, .units = units, .rank = r, .size = size, .port = port};
            runs[r].out = malloc(OUT_FLOATS * sizeof(float));
            pthread_create(&th[r], NULL, shard_main, &runs[r]);
        }
        for (int r = 0; r < size; r++) pthread_join(th[r], NULL);
        for (int r = 0; r < size; r++) {
            CHECK(runs[r].rc == 0, "%s, shard %d of %d: %s", name, r, size, runs[r].err);
            if (runs[r].rc != 0) continue;
            CHECK(runs[r].n_out == n_want, "%s, shard %d of %d: %zu logits, want %zu", name, r, size, runs[r].n_out,
                  n_want);
            const double e = model_max_rel(runs[r].out, want, n_want);
            CHECK(e <= 1e-5, "%s, shard %d of %d: logits differ from the whole model's by %.3g", name, r, size, e);
            CHECK(memcmp(runs[r].out, runs[0].out, n_want * sizeof(float)) == 0,
                  "%s, %d shards: shard %d's logits are not shard 0's bits", name, size, r);
            if (r == 0) printf("ok   %s, %d shards: logits within %.2g of the whole model's\n", name, size, e);
        }
        for (int r = 0; r < size; r++) free(runs[r].out);
    }
    for (int u = 0; u < full.layout.n_units; u++) free(units[u]);
    free(units);
    free(want);
    tiny_model_free(&full, &fw);
    ops_destroy(ops);
}

// The whole model of config json on a CPU context of its own.
static void whole_model(const char *json, ModelConfig *cfg, OpsCtx **ops, Model *full) {
    char err[512];
    REQUIRE(config_parse(cfg, json, strlen(json), err, sizeof err) == 0, "%s", err);
    REQUIRE(ops_create(ops, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(model_init(full, cfg, *ops, err, sizeof err) == 0, "%s", err);
}

// The shards' slices of each tensor put back at their places rebuild it, every element exactly once (KV heads
// replicated at 4 shards: each copy equals the original), and the vocabulary padding rows are zeros.
static void test_slices_rebuild(const char *json, const char *name) {
    char err[512];
    ModelConfig cfg;
    OpsCtx *ops;
    Model full;
    whole_model(json, &cfg, &ops, &full);
    for (int size = 2; size <= 4; size *= 2) {
        for (int u = 0; u < full.layout.n_units; u++) {
            float *src = malloc(full.layout.unit_numel[u] * sizeof *src);
            for (size_t i = 0; i < full.layout.unit_numel[u]; i++) src[i] = (float)(i + 1);
            int *seen = calloc(full.layout.unit_numel[u], sizeof *seen);
            int bad = 0;
            for (int r = 0; r < size && !bad; r++) {
                Model sh;
                REQUIRE(model_init_shard(&sh, &cfg, r, size, ops, err, sizeof err) == 0, "%s", err);
                float *dst = malloc(sh.layout.unit_numel[u] * sizeof *dst);
                model_shard_unit(&full, &sh, u, src, dst, sizeof(float));
                // Every value the shard holds is an element of the whole unit (values are offsets + 1), or padding 0.
                for (size_t i = 0; i < sh.layout.unit_numel[u]; i++) {
                    const float v = dst[i];
                    if (v == 0) continue;
                    if (v < 1 || v > (float)full.layout.unit_numel[u]) { bad = 1; break; }
                    seen[(size_t)v - 1]++;
                }
                free(dst);
                model_free(&sh);
            }
            CHECK(!bad, "%s, %d shards, unit %d: a shard holds a value that is not the unit's", name, size, u);
            // Every parameter of the unit is held: once when split, by every shard when replicated.
            for (int i = 0; i < full.layout.n_tensors && !bad; i++) {
                const LayoutTensor *t = &full.layout.tensors[i];
                if (t->unit != u) continue;
                const int replicated = t->ndim == 1 && !strstr(t->name, "_proj.bias");
                const int kv = strstr(t->name, "k_proj") || strstr(t->name, "v_proj");
                const int want = replicated ? size : kv && size > cfg.num_kv_heads ? size / cfg.num_kv_heads : 1;
                for (size_t k = 0; k < t->numel; k++)
                    if (seen[t->offset + k] != want) {
                        CHECK(0, "%s, %d shards: element %zu of %s is held %d times, want %d", name, size, k, t->name,
                              seen[t->offset + k], want);
                        bad = 1;
                        break;
                    }
            }
            free(seen);
            free(src);
        }
    }
    // Sizes that do not divide the model are refused with the numbers.
    ModelConfig sc;
    ModelShard s;
    CHECK(model_shard_config(&cfg, 0, 3, &sc, &s, err, sizeof err) != 0 && strstr(err, "4 attention heads"),
          "3 shards of 4 heads accepted: %s", err);
    CHECK(model_shard_config(&cfg, 0, 8, &sc, &s, err, sizeof err) != 0, "8 shards of 4 heads accepted");
    CHECK(model_shard_config(&cfg, 2, 2, &sc, &s, err, sizeof err) != 0, "shard 2 of 2 accepted");
    CHECK(model_shard_config(&cfg, 3, 4, &sc, &s, err, sizeof err) == 0 && sc.num_heads == 1 &&
          sc.num_kv_heads == 1 && s.kv_head_begin == 1 && sc.vocab_size == 17 && s.vocab_begin == 51,
          "shard 3 of 4: %d heads, %d KV heads from %d, vocabulary rows %d from %d", sc.num_heads, sc.num_kv_heads,
          s.kv_head_begin, sc.vocab_size, s.vocab_begin);
    model_free(&full);
    ops_destroy(ops);
}

// Applies the parts of the whole unit's slices [w * s, min((w + 1) * s, numel)) to a zeroed shard unit.
static int apply_parts(const Model *full, const Model *sh, int u, size_t slice, const float *src, float *dst,
                       int *writes, const char *name, int size, int r) {
    const size_t numel = full->layout.unit_numel[u];
    ModelShardPart parts[MODEL_SHARD_MAX_PARTS];
    for (size_t b = 0; b < numel; b += slice) {
        const size_t e = b + slice < numel ? b + slice : numel;
        const int n = model_shard_parts(&full->layout, &sh->layout, &sh->cfg, &sh->shard, u, b, e, parts,
                                        MODEL_SHARD_MAX_PARTS);
        if (n < 0) {
            CHECK(0, "%s, shard %d of %d, unit %d, slice [%zu, %zu): more than %d parts", name, r, size, u, b, e,
                  MODEL_SHARD_MAX_PARTS);
            return -1;
        }
        for (int i = 0; i < n; i++) {
            const ModelShardPart *p = &parts[i];
            if (p->full_at < b || p->full_at + (p->rows - 1) * p->full_cols + p->cols > e || p->cols > p->full_cols ||
                p->shard_at + p->rows * p->cols > sh->layout.unit_numel[u] ||
                (p->rows == 1 && p->cols != p->full_cols)) {
                CHECK(0, "%s, shard %d of %d, unit %d, slice [%zu, %zu): part %d (at %zu, %zu x %zu of %zu) leaves "
                      "it", name, r, size, u, b, e, i, p->full_at, p->rows, p->cols, p->full_cols);
                return -1;
            }
            for (size_t row = 0; row < p->rows; row++)
                for (size_t c = 0; c < p->cols; c++) {
                    const size_t at = p->shard_at + row * p->cols + c;
                    dst[at] = src[p->full_at + row * p->full_cols + c];
                    writes[at]++;
                }
        }
    }
    return 0;
}

static void test_parts(const char *json, const char *name) {
    char err[512];
    ModelConfig cfg;
    OpsCtx *ops;
    Model full;
    whole_model(json, &cfg, &ops, &full);
    const int cuts[] = {1, 2, 3, 5, 8, 0};   // 0: one slice per element
    int checked = 0;
    for (int size = 2; size <= 4; size *= 2)
        for (int r = 0; r < size; r++) {
            Model sh;
            REQUIRE(model_init_shard(&sh, &cfg, r, size, ops, err, sizeof err) == 0, "%s", err);
            for (int u = 0; u < full.layout.n_units; u++) {
                const size_t numel = full.layout.unit_numel[u], snumel = sh.layout.unit_numel[u];
                float *src = malloc(numel * sizeof *src), *want = malloc(snumel * sizeof *want),
                      *got = malloc(snumel * sizeof *got);
                int *writes = malloc(snumel * sizeof *writes);
                for (size_t i = 0; i < numel; i++) src[i] = (float)(i + 1);
                model_shard_unit(&full, &sh, u, src, want, sizeof(float));
                for (size_t c = 0; c < sizeof cuts / sizeof *cuts; c++) {
                    const size_t slice = cuts[c] ? layout_padded_unit_numel(&full.layout, u, cuts[c]) / cuts[c] : 1;
                    memset(got, 0, snumel * sizeof *got);
                    memset(writes, 0, snumel * sizeof *writes);
                    if (apply_parts(&full, &sh, u, slice, src, got, writes, name, size, r) != 0) break;
                    size_t i = 0;
                    while (i < snumel && got[i] == want[i] && writes[i] <= 1) i++;
                    CHECK(i == snumel, "%s, shard %d of %d, unit %d, %d slices: element %zu is %g (written %d times), "
                          "want %g", name, r, size, u, cuts[c], i, i < snumel ? got[i] : 0.0,
                          i < snumel ? writes[i] : 0, i < snumel ? want[i] : 0.0);
                    checked++;
                }
                free(src);
                free(want);
                free(got);
                free(writes);
            }
            model_free(&sh);
        }
    CHECK(checked > 0, "%s: nothing checked", name);
    model_free(&full);
    ops_destroy(ops);
}

static void test_random_weights(const char *json, const char *name) {
    char err[512];
    ModelConfig cfg;
    OpsCtx *ops;
    Model full;
    ResidentWeights fw;
    whole_model(json, &cfg, &ops, &full);
    REQUIRE(resident_alloc(&fw, &full, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(model_fill_random(&full, &full.layout, &fw, 77, err, sizeof err) == 0, "%s", err);
    int norms_one = 1, in_range = 1, distinct = 0;
    for (int i = 0; i < full.layout.n_tensors; i++) {
        const LayoutTensor *t = &full.layout.tensors[i];
        const float *v = (const float *)fw.params[t->unit] + t->offset;
        for (size_t k = 0; k < t->numel; k++) {
            if (strstr(t->name, "norm")) norms_one &= v[k] == 1.0f;
            else in_range &= fabsf(v[k]) <= 0.0347f, distinct += k > 0 && v[k] != v[k - 1];
        }
    }
    CHECK(norms_one && in_range && distinct > 1000, "%s: norms 1 %d, weights in range %d, %d changes", name, norms_one,
          in_range, distinct);
    for (int size = 2; size <= 4; size *= 2)
        for (int r = 0; r < size; r++) {
            Model sh;
            ResidentWeights sw;
            REQUIRE(model_init_shard(&sh, &cfg, r, size, ops, err, sizeof err) == 0, "%s", err);
            REQUIRE(resident_alloc(&sw, &sh, 0, err, sizeof err) == 0, "%s", err);
            CHECK(model_fill_random(&sh, &full.layout, &sw, 77, err, sizeof err) == 0, "%s", err);
            for (int u = 0; u < sh.layout.n_units; u++) {
                float *want = malloc(sh.layout.unit_numel[u] * sizeof *want);
                model_shard_unit(&full, &sh, u, fw.params[u], want, sizeof(float));
                CHECK(memcmp(want, sw.params[u], sh.layout.unit_numel[u] * sizeof *want) == 0,
                      "%s, shard %d of %d, unit %d: random weights differ from the whole model's slice", name, r, size, u);
                free(want);
            }
            resident_free(&sw, &sh);
            model_free(&sh);
        }
    resident_free(&fw, &full);
    model_free(&full);
    ops_destroy(ops);
}

int main(void) {
    test_random_weights(CONFIG_QWEN3, "qwen3");
    test_random_weights(CONFIG_LLAMA, "llama");
    test_parts(CONFIG_QWEN3, "qwen3");
    test_parts(CONFIG_LLAMA, "llama");
    test_slices_rebuild(CONFIG_QWEN3, "qwen3");
    test_slices_rebuild(CONFIG_LLAMA, "llama");
    test_shards_equal_whole(CONFIG_QWEN3, "qwen3");
    test_shards_equal_whole(CONFIG_LLAMA, "llama");
    return check_exit_code("test_model_shard");
}
