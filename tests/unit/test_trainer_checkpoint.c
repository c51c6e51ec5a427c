// test_trainer_checkpoint.c — trainer_state.json records the ZeRO stage the run used (it used to say 0 whatever
// the stage), and a checkpoint written at one stage resumes at another: every stage keeps the same slices.
//
// One process (WORLD_SIZE 1, CPU, host communicator), a tiny random Qwen3-style model. For each stage 1-3:
// save at step 7, read trainer_state.json back; then load that checkpoint into a ZeRO state of the next stage
// and compare its master weights with the saved ones.
// Re-slicing (checkpoint_reslice.c): the rank files of a flat checkpoint of N ranks (written here element by
// element, N = 3 and 5: slices that do not line up with any new cut) read back as the slices of M = 1, 2, 4, 7
// ranks hold every element of every unit where it belongs, master and both moments, with zero padding.
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/comm/comm.h"
#include "shared/model.h"
#include "trainer/checkpoint.h"
#include "shared/safetensors.h"
#include "trainer/make_dirs.h"
#include "trainer/remove_tree.h"
#include "trainer/zero3.h"

static const char *CONFIG =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 61, \"hidden_size\": 32, "
    "\"intermediate_size\": 40, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
    "\"num_key_value_heads\": 2, \"head_dim\": 8, \"max_position_embeddings\": 64, "
    "\"tie_word_embeddings\": true, \"attention_bias\": true, \"hidden_act\": \"silu\"}";

static OpsCtx *ops;
static Comm *comm;
static Model model;
static char root[64];

static Zero3 *random_state(int stage, uint64_t seed) {
    char err[512];
    Zero3 *z = NULL;
    REQUIRE(zero3_create(&z, &model, comm, stage, err, sizeof err) == 0, "zero3_create: %s", err);
    REQUIRE(zero3_init_random(z, seed, 0.2f, err, sizeof err) == 0, "zero3_init_random: %s", err);
    return z;
}

// Unit u's master slice on the host (caller frees).
static float *master_of(Zero3 *z, int u) {
    size_t n = zero3_shard_count(z, u);
    float *h = malloc((n ? n : 1) * sizeof(float));
    ops_copy_to_host(ops, h, zero3_master_shard(z, u), n * sizeof(float));
    ops_synchronize(ops);
    return h;
}

static void test_stage(int stage) {
    char err[1024], out[PATH_MAX], saved[PATH_MAX], loaded[PATH_MAX], state[PATH_MAX + 32];
    snprintf(out, sizeof out, "%s/stage%d", root, stage);
    Zero3 *z = random_state(stage, 11);
    CheckpointOptions co = {.output_dir = out, .base_model_dir = root};
    TrainProgress p = {.step = 7, .epoch = 1, .data_position = 3, .rng = {5, 6}, .policy_version = 7};
    CHECK(checkpoint_save(z, &model, comm, &co, &p, saved, err, sizeof err) == 0, "save at stage %d: %s", stage, err);
    snprintf(state, sizeof state, "%s/trainer_state.json", saved);
    json_error_t je;
    json_t *j = json_load_file(state, 0, &je);
    CHECK(j != NULL, "read %s: %s", state, je.text);
    json_t *recorded = json_object_get(j, "zero_stage");
    CHECK(json_is_integer(recorded) && json_integer_value(recorded) == stage, "stage %d recorded as %lld", stage,
          (long long)json_integer_value(recorded));
    CHECK(json_integer_value(json_object_get(j, "world_size")) == 1, "world_size");
    json_decref(j);

    // Resume at the next stage: the same master weights come back.
    int other = stage % 3 + 1;
    Zero3 *z2 = random_state(other, 12);
    TrainProgress back = {0};
    CHECK(checkpoint_load(z2, &model, comm, &co, "latest", &back, loaded, err, sizeof err) == 0,
          "load stage %d's checkpoint at stage %d: %s", stage, other, err);
    CHECK(back.step == 7 && back.data_position == 3 && back.rng[1] == 6, "progress");
    for (int u = 0; u < model.layout.n_units; u++) {
        float *a = master_of(z, u), *b = master_of(z2, u);
        CHECK(memcmp(a, b, zero3_shard_count(z, u) * sizeof(float)) == 0, "unit %d differs after resume", u);
        free(a);
        free(b);
    }
    zero3_destroy(z2);
    zero3_destroy(z);
}

// trainer_state.json as a save writes it is read back whole; a damaged one (negative counts, no ranks, hex that
// is not 16 lowercase digits, a missing field) is refused with the file's name instead of resuming from it.
static void test_state_json(void) {
    static const char *const good = "{\"global_step\": 50, \"epoch\": 1, \"data_position\": 12800, \"rng\": "
                                    "[\"0000000000000001\", \"9e3779b97f4a7c15\"], \"policy_version\": 50, "
                                    "\"world_size\": 2, \"zero_stage\": 3, \"layout_hash\": \"509d21c0b51d40f9\"}";
    char err[512];
    CheckpointState st;
    json_t *j = json_loads(good, 0, NULL);
    CHECK(checkpoint_state_from_json(j, "state.json", &st, err, sizeof err) == 0, "good state refused: %s", err);
    CHECK(st.progress.step == 50 && st.progress.epoch == 1 && st.progress.data_position == 12800 &&
              st.progress.rng[1] == 0x9e3779b97f4a7c15ULL && st.world_size == 2 && st.zero_stage == 3 &&
              st.layout_hash == 0x509d21c0b51d40f9ULL, "state read wrong");
    CHECK(strcmp(st.zero_slicing, "full_shard") == 0, "a state without zero_slicing reads as '%s'", st.zero_slicing);
    json_decref(j);
    CHECK(st.progress.num_input_tokens_seen == 0, "a state without num_input_tokens_seen counts from 0");
    // zero_slicing and num_input_tokens_seen round-trip (a resume compares the first with the run's own, and goes
    // on counting the second).
    strcpy(st.zero_slicing, "hpz:8");
    st.progress.num_input_tokens_seen = 123456789012LL;
    json_t *w = checkpoint_state_to_json(&st);
    CheckpointState back;
    CHECK(w && checkpoint_state_from_json(w, "state.json", &back, err, sizeof err) == 0 &&
          strcmp(back.zero_slicing, "hpz:8") == 0 && back.progress.num_input_tokens_seen == 123456789012LL);
    json_decref(w);
    static const struct {
        const char *key, *value;
    } bad[] = {{"global_step", "-1"}, {"data_position", "-5"}, {"world_size", "0"}, {"layout_hash", "\"509D21C0B51D40F9\""},
               {"rng", "[\"zz\", \"9e3779b97f4a7c15\"]"}, {"rng", "[\"00000000000000010\", \"1\"]"},
               {"epoch", "\"1\""}, {"num_input_tokens_seen", "-3"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        j = json_loads(good, 0, NULL);
        json_object_set_new(j, bad[i].key, json_loads(bad[i].value, JSON_DECODE_ANY, NULL));
        err[0] = '\0';
        CHECK(checkpoint_state_from_json(j, "state.json", &st, err, sizeof err) != 0 && strstr(err, "state.json"),
              "%s = %s accepted", bad[i].key, bad[i].value);
        json_decref(j);
    }
}

// Element i of unit u, kind k (master, adam_m, adam_v): distinct for every (u, i, k); padding (i >= numel) is 0.
static float element(int u, size_t i, int k) {
    return i < model.layout.unit_numel[u] ? (float)(u * 100000 + (long)i) + 0.25f * (float)k : 0.0f;
}

// Writes the optimizer.safetensors of every rank of a checkpoint of `world` ranks under dir, cut as zero3.c cuts:
// g = 0 flat (rank r holds slice r of world); hybrid g > 0 (slice r % g of g, every node a replica); hpz g < 0
// (-g ranks a node: slice (r % G) M + r / G of world, M nodes).
static void write_ranks(const char *dir, int world, int g) {
    const Layout *L = &model.layout;
    char err[1024];
    const int K = g > 0 ? g : world, G = g < 0 ? -g : 0, M = G ? world / G : 0;
    for (int r = 0; r < world; r++) {
        const int slice = g > 0 ? r % g : G ? (r % G) * M + r / G : r;
        StWriter *w = NULL;
        REQUIRE(st_writer_create(&w, err, sizeof err) == 0, "st_writer_create: %s", err);
        float **vals = calloc((size_t)L->n_units * 3, sizeof *vals);
        char (*names)[48] = calloc((size_t)L->n_units * 3, sizeof *names);
        for (int u = 0; u < L->n_units; u++) {
            size_t n = layout_padded_unit_numel(L, u, K) / (size_t)K;
            for (int k = 0; k < 3; k++) {
                float *v = vals[u * 3 + k] = malloc(n * sizeof(float));
                for (size_t i = 0; i < n; i++) v[i] = element(u, (size_t)slice * n + i, k);
                snprintf(names[u * 3 + k], sizeof names[0], "%s.%d", k == 0 ? "master" : k == 1 ? "adam_m" : "adam_v",
                         u);
                int64_t shape[1] = {(int64_t)n};
                REQUIRE(st_writer_add(w, names[u * 3 + k], ST_F32, 1, shape, v, ST_F32, err, sizeof err) == 0,
                        "st_writer_add: %s", err);
            }
        }
        char rank_dir[PATH_MAX + 64], from[PATH_MAX + 96], to[PATH_MAX + 96];
        snprintf(rank_dir, sizeof rank_dir, "%s/trainer_state/rank-%05d", dir, r);
        REQUIRE(make_dirs(rank_dir, err, sizeof err) == 0 && st_writer_write(w, rank_dir, 0, err, sizeof err) == 0,
                "write %s: %s", rank_dir, err);
        snprintf(from, sizeof from, "%s/model.safetensors", rank_dir);
        snprintf(to, sizeof to, "%s/optimizer.safetensors", rank_dir);
        REQUIRE(rename(from, to) == 0, "rename %s", from);
        st_writer_free(w);
        for (int i = 0; i < L->n_units * 3; i++) free(vals[i]);
        free(vals);
        free(names);
    }
}

// Old checkpoints of every cut (flat 3 and 5 ranks; HSDP and hpZ of 2 nodes x 2 and 3 nodes x 2) read back as any
// flat cut of 1, 2, 4 or 7 ranks: every element in place. A cut text zero3.c never writes is refused.
static void test_reslice(void) {
    const Layout *L = &model.layout;
    static const struct {
        int world, g;
        const char *cut;
    } olds[] = {{3, 0, "full_shard"}, {5, 0, "full_shard"}, {4, 2, "hybrid_shard:2"}, {6, 2, "hybrid_shard:2"},
                {4, -2, "hpz:2"}, {6, -2, "hpz:2"}};
    static const int news[] = {1, 2, 4, 7};
    for (size_t a = 0; a < sizeof olds / sizeof *olds; a++) {
        char dir[PATH_MAX], err[1024];
        snprintf(dir, sizeof dir, "%s/cut%zu", root, a);
        write_ranks(dir, olds[a].world, olds[a].g);
        for (size_t b = 0; b < sizeof news / sizeof *news; b++) {
            CheckpointReslice *rs = NULL;
            REQUIRE(checkpoint_reslice_open(&rs, dir, olds[a].world, olds[a].cut, err, sizeof err) == 0, "open: %s",
                    err);
            long wrong = 0;
            for (int r = 0; r < news[b]; r++)
                for (int u = 0; u < L->n_units; u++) {
                    size_t n = layout_padded_unit_numel(L, u, news[b]) / (size_t)news[b], off = (size_t)r * n;
                    float *got[3];
                    for (int k = 0; k < 3; k++) got[k] = malloc(n * sizeof(float));
                    CHECK(checkpoint_read_resliced_unit(rs, L, u, off, n, got[0], got[1], got[2], err, sizeof err) == 0,
                          "%s of %d -> %d ranks, rank %d unit %d: %s", olds[a].cut, olds[a].world, news[b], r, u, err);
                    for (int k = 0; k < 3; k++)
                        for (size_t i = 0; i < n; i++) wrong += got[k][i] != element(u, off + i, k);
                    for (int k = 0; k < 3; k++) free(got[k]);
                }
            CHECK(wrong == 0, "%s of %d -> %d ranks: %ld elements out of place", olds[a].cut, olds[a].world, news[b],
                  wrong);
            checkpoint_reslice_close(rs);
        }
    }
    static const char *const bad[] = {"hpz:4", "hybrid_shard:0", "hpz:2x", "ring"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        CheckpointReslice *rs = NULL;
        char err[1024] = "";
        CHECK(checkpoint_reslice_open(&rs, root, 6, bad[i], err, sizeof err) != 0 && rs == NULL &&
                  strstr(err, bad[i]) != NULL,
              "cut \"%s\" of 6 ranks was not refused by name (%s)", bad[i], err);
    }
}

int main(void) {
    test_state_json();
    static const char *const contract[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
    for (size_t i = 0; i < sizeof contract / sizeof *contract; i++) unsetenv(contract[i]);
    snprintf(root, sizeof root, "/tmp/tandem_ckpt_XXXXXX");
    REQUIRE(mkdtemp(root), "mkdtemp");
    char err[1024];
    CommInit ci;
    ModelConfig cfg;
    REQUIRE(comm_init_from_env(&ci, 10000, err, sizeof err) == 0, "comm_init_from_env: %s", err);
    REQUIRE(ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "ops_create: %s", err);
    REQUIRE(comm_create(&comm, COMM_BACKEND_HOST, &ci, ops, err, sizeof err) == 0, "comm_create: %s", err);
    REQUIRE(config_parse(&cfg, CONFIG, strlen(CONFIG), err, sizeof err) == 0, "config_parse: %s", err);
    REQUIRE(model_init(&model, &cfg, ops, err, sizeof err) == 0, "model_init: %s", err);
    for (int stage = 1; stage <= 3; stage++) test_stage(stage);
    test_reslice();
    model_free(&model);
    comm_destroy(comm);
    ops_destroy(ops);
    remove_tree(root, NULL, 0);
    return check_exit_code("test_trainer_checkpoint");
}
