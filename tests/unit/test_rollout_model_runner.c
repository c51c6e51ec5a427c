// test_rollout_model_runner.c — the model runner's seam (rollout_server/model_runner.h) on a tiny random model,
// without the engine, on the CPU backend and, when a GPU is visible, on CUDA device 0 (it says so when it skips that):
//   - the KV pool holds what its budget buys, and a budget below one step's blocks is refused naming the flag;
//     --gpu-memory-utilization sizes it on a GPU and is refused on the CPU;
//   - a prefill and a decode step give greedy tokens whose reported logprob is the first of the top logprobs;
//   - runner_copy_kv_rows really copies K/V: a sequence reading a copied block decodes exactly like the one reading
//     the original (bit for bit), and one reading a block never written does not;
//   - several samples of one row (a fork's first tokens) draw independently: same uniform, same token;
//   - a step whose samples do not match its sequences is refused;
//   - weights: uploading no unit changes nothing, swapping in the device staging changes the output and swapping back
//     restores it; runner_weights_device_missing tracks the staging copies;
//   - CUDA: decode-only steps replay the graphs recorded at start-up, and --enforce-eager gives their bits eagerly.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rollout_server/model_runner.h"
#include "tests/unit/check_macros.h"
#include "tests/unit/testlib.h"

static const char *CONFIG =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 64, \"hidden_size\": 32, \"intermediate_size\": 48,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"max_position_embeddings\": 160,"
    " \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": false, \"eos_token_id\": 63, \"bos_token_id\": 0}";
enum { BS = 4 };
static char dir[256];
static OpsBackend backend = OPS_BACKEND_CPU;
// Tolerance of comparisons between two runs of the same computation: none on the CPU, whose steps are the same bits
// whatever runs beside them; a little on CUDA, where nothing promises two runs the same bits.
static double tol = 0.0;

static int close_to(float a, float b) { return memcmp(&a, &b, sizeof a) == 0 || fabs((double)a - b) <= tol; }

static void die(const char *what, const char *err) {
    fprintf(stderr, "set-up failed: %s: %s\n", what, err);
    exit(1);
}

static void make_model_dir(void) {
    char err[512];
    if (temp_dir_make("tandem_runner", dir, sizeof dir)) die("mkdtemp", strerror(errno));
    if (tiny_model_write_random(dir, CONFIG, 5, 0.5f, err, sizeof err)) die("model", err);
}

static void remove_model_dir(void) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

static EngineConfig config(size_t kv_bytes) {
    EngineConfig c;
    engine_config_default(&c);
    c.model_dir = dir;
    c.backend = backend;
    c.block_size = BS;
    c.max_num_seqs = 8;
    c.max_num_batched_tokens = 64;
    c.kv_cache_bytes = kv_bytes;
    c.ops.gemm_autotune = OPS_GEMM_AUTOTUNE_OFF; // GEMMs keep the shape's first pick: two runners run the same ones
    return c;
}

static RunnerSample greedy_sample(int top_logprobs) {
    return (RunnerSample){.p = {.temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 1.0f},
                          .top_logprobs = top_logprobs};
}

static const int32_t PROMPT[6] = {3, 14, 15, 9, 26, 5};

// Prefills PROMPT into blocks (b0, b1) and samples its next token greedily. Returns the token; *lp its logprob.
static int32_t prefill(ModelRunner *r, int32_t b0, int32_t b1, float *lp) {
    const int32_t blocks[2] = {b0, b1};
    RunnerSeq q = {.tokens = PROMPT, .n_computed = 0, .n_sched = 6, .blocks = blocks, .n_blocks = 2, .n_samples = 1};
    RunnerSample s = greedy_sample(0);
    RunnerOutput out;
    char err[512];
    if (runner_step(r, &q, 1, &s, 1, &out, err, sizeof err) != 0) {
        CHECK(0, "prefill: %s", err);
        *lp = NAN;
        return -1;
    }
    CHECK(out.kind == ENGINE_STEP_PREFILL, "a step with prompt tokens is a prefill step (kind %d)", out.kind);
    *lp = out.logprobs[0];
    return out.tokens[0];
}

static void test_kv_sizing(void) {
    char err[512];
    ModelRunner *r;
    EngineConfig c = config((size_t)64 << 10);
    CHECK(runner_create(&r, &c, err, sizeof err) == 0, "%s", err);
    const size_t per_block = kv_cache_bytes_per_block(runner_model(r), BS);
    CHECK(runner_num_blocks(r) == (int)(c.kv_cache_bytes / per_block), "%d blocks of %zu bytes in %zu bytes",
          runner_num_blocks(r), per_block, c.kv_cache_bytes);
    runner_free(r);
    // One step of 64 tokens needs 16 blocks; a budget of 8 is a configuration mistake.
    c = config(8 * per_block);
    CHECK(runner_create(&r, &c, err, sizeof err) == ENGINE_EINVAL && strstr(err, "--kv-cache-memory"),
          "a pool below one step's blocks is refused: %s", err);
    c = config(0);
    c.gpu_memory_utilization = 0.25;
    if (backend == OPS_BACKEND_CPU) {
        CHECK(runner_create(&r, &c, err, sizeof err) == ENGINE_EINVAL && strstr(err, "CUDA device"),
              "--gpu-memory-utilization on the CPU is refused: %s", err);
    } else if (runner_create(&r, &c, err, sizeof err) == 0) {
        CHECK(runner_num_blocks(r) >= 16, "a quarter of the GPU holds %d blocks", runner_num_blocks(r));
        runner_free(r);
    } else {
        CHECK(0, "--gpu-memory-utilization 0.25: %s", err);
    }
}

// The three decodes of test_steps_and_copies: what two runners of one model must agree on.
typedef struct {
    int32_t tok[3];
    float lp[3];
    int kind;
} Decoded;

static void test_steps_and_copies(ModelRunner *r, Decoded *d) {
    char err[512];
    float lp0;
    int32_t seq[8];
    memcpy(seq, PROMPT, sizeof PROMPT);
    seq[6] = prefill(r, 0, 1, &lp0);
    CHECK(seq[6] >= 0 && seq[6] < 64 && isfinite(lp0), "prefill gives token %d logprob %g", seq[6], lp0);
    // Block 1 holds positions 4..5 of the prompt: copy them into block 2; block 3 is never written.
    runner_copy_kv_rows(r, 2, 1, 2);
    const int32_t own[2] = {0, 1}, copied[2] = {0, 2}, blank[2] = {0, 3};
    RunnerSeq q[3] = {
        {.tokens = seq, .n_computed = 6, .n_sched = 1, .blocks = own, .n_blocks = 2, .n_samples = 1},
        {.tokens = seq, .n_computed = 6, .n_sched = 1, .blocks = copied, .n_blocks = 2, .n_samples = 1},
        {.tokens = seq, .n_computed = 6, .n_sched = 1, .blocks = blank, .n_blocks = 2, .n_samples = 1},
    };
    RunnerSample s[3] = {greedy_sample(3), greedy_sample(3), greedy_sample(3)};
    RunnerOutput out;
    CHECK(runner_step(r, q, 3, s, 3, &out, err, sizeof err) == 0, "decode: %s", err);
    for (int k = 0; k < 3; k++) {
        d->tok[k] = out.tokens[k];
        d->lp[k] = out.logprobs[k];
    }
    d->kind = out.kind;
    CHECK(backend == OPS_BACKEND_CUDA || out.kind == ENGINE_STEP_DECODE_EAGER,
          "a decode-only step on the CPU runs eagerly (kind %d)", out.kind);
    // One step, one kernel for the three rows: the copy must give the original's bits on any backend.
    CHECK(out.tokens[0] == out.tokens[1] && memcmp(&out.logprobs[0], &out.logprobs[1], sizeof(float)) == 0,
          "the copied block decodes like the original: %d %.9g vs %d %.9g", out.tokens[0], out.logprobs[0],
          out.tokens[1], out.logprobs[1]);
    CHECK(!(fabs((double)out.logprobs[0] - out.logprobs[2]) <= 1e-4),
          "a block never written decodes differently (logprobs %.9g, %.9g)", out.logprobs[0], out.logprobs[2]);
    const TokenLogprob *top = out.top;
    CHECK(top[0].id == out.tokens[0] && top[0].logprob == out.logprobs[0] && top[1].logprob <= top[0].logprob &&
          top[2].logprob <= top[1].logprob, "greedy: the token is the best of the top logprobs, which come best first");

    // Three samples of one row, as at a fork: the same uniform draws the same token, another may not.
    const int32_t blocks[2] = {4, 5};
    RunnerSeq f = {.tokens = PROMPT, .n_computed = 0, .n_sched = 6, .blocks = blocks, .n_blocks = 2, .n_samples = 3};
    RunnerSample fs[3];
    for (int k = 0; k < 3; k++)
        fs[k] = (RunnerSample){.p = {.u = k == 2 ? 0.999 : 0.001, .temperature = 1.0f, .top_p = 1.0f,
                                     .repetition_penalty = 1.0f}};
    CHECK(runner_step(r, &f, 1, fs, 3, &out, err, sizeof err) == 0, "fork row: %s", err);
    CHECK(out.tokens[0] == out.tokens[1] && out.logprobs[0] == out.logprobs[1],
          "samples of one row with one uniform agree: %d vs %d", out.tokens[0], out.tokens[1]);
    CHECK(out.tokens[0] != out.tokens[2], "u 0.001 and 0.999 of a 64-token softmax pick different tokens (%d)",
          out.tokens[0]);

    // Samples must match the sequences' n_samples.
    CHECK(runner_step(r, &f, 1, fs, 2, &out, err, sizeof err) != 0 && strstr(err, "samples"),
          "a step with fewer samples than its sequences ask for is refused: %s", err);
}

static void test_weights(ModelRunner *r) {
    char err[512];
    const Layout *L = &runner_model(r)->layout;
    float before, after;
    const int32_t t_before = prefill(r, 6, 7, &before);
    void **none = calloc((size_t)L->n_units, sizeof *none);
    CHECK(runner_upload_weights(r, none, err, sizeof err) == 0, "%s", err);
    free(none);
    const int32_t t_same = prefill(r, 6, 7, &after);
    CHECK(t_same == t_before && close_to(after, before), "uploading no unit changes nothing");

    int shard = -1;
    CHECK(runner_weights_device_missing(r, &shard) == 0 && shard == 0, "no staging yet: unit 0 is missing (%d)",
          runner_weights_device_missing(r, &shard));
    OpsCtx *ops = runner_ops(r);
    for (int u = 0; u < L->n_units; u++) {
        void *d = runner_weights_device_staging(r, 0, u);
        CHECK(d != NULL, "staging of unit %d", u);
        float *host = calloc(L->unit_numel[u], sizeof *host);
        for (size_t i = 0; i < L->unit_numel[u]; i++) host[i] = 0.01f * (float)((i * 7 + u) % 13) - 0.06f;
        if (d) ops_upload_f32(ops, d, host, L->unit_numel[u]);
        free(host);
    }
    CHECK(runner_weights_device_missing(r, &shard) == -1, "every unit staged");
    CHECK(runner_swap_device_weights(r, err, sizeof err) == 0, "%s", err);
    prefill(r, 6, 7, &after);
    CHECK(!(fabs((double)after - before) <= 1e-4), "other weights, other logprob (%.9g)", after);
    CHECK(runner_swap_device_weights(r, err, sizeof err) == 0, "%s", err);
    const int32_t t_back = prefill(r, 6, 7, &after);
    CHECK(t_back == t_before && close_to(after, before), "swapping back restores the output: %d %.9g vs %d %.9g",
          t_back, after, t_before, before);
}

// Every check on one backend. On CUDA, decode-only steps replay graphs, and a runner with enforce_eager gives the
// same bits eagerly.
static void run(OpsBackend be) {
    backend = be;
    tol = be == OPS_BACKEND_CUDA ? 1e-5 : 0.0;
    test_kv_sizing();
    char err[512];
    ModelRunner *r;
    EngineConfig c = config((size_t)64 << 10);
    if (runner_create(&r, &c, err, sizeof err) != 0) {
        CHECK(0, "runner_create: %s", err);
        return;
    }
    Decoded graph, eager;
    test_steps_and_copies(r, &graph);
    test_weights(r);
    runner_free(r);
    if (be != OPS_BACKEND_CUDA) return;
    CHECK(graph.kind == ENGINE_STEP_DECODE_GRAPH, "the decode step replayed a graph recorded at start-up (kind %d)",
          graph.kind);
    c.enforce_eager = 1;
    if (runner_create(&r, &c, err, sizeof err) != 0) {
        CHECK(0, "runner_create (enforce_eager): %s", err);
        return;
    }
    test_steps_and_copies(r, &eager);
    runner_free(r);
    CHECK(eager.kind == ENGINE_STEP_DECODE_EAGER, "--enforce-eager runs the decode step eagerly (kind %d)", eager.kind);
    for (int k = 0; k < 3; k++)
        CHECK(eager.tok[k] == graph.tok[k] && memcmp(&eager.lp[k], &graph.lp[k], sizeof(float)) == 0,
              "row %d: eager %d %.9g vs graph %d %.9g", k, eager.tok[k], eager.lp[k], graph.tok[k], graph.lp[k]);
}

int main(void) {
    make_model_dir();
    run(OPS_BACKEND_CPU);
    if (ops_backend_available(OPS_BACKEND_CUDA)) run(OPS_BACKEND_CUDA);
    else printf("SKIP (CUDA part): no CUDA device visible\n");
    remove_model_dir();
    if (failures) {
        fprintf(stderr, "test_rollout_model_runner: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_rollout_model_runner: all passed\n");
    return 0;
}
