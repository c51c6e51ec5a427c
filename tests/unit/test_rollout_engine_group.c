// test_rollout_engine_group.c — several engines in one server (rollout_server/engine_group.h, `--devices`), on a
// tiny random model written to a temporary folder. Runs on two CPU engines always, and on CUDA devices 0 and 1
// when two are visible (it says so when it skips that part):
//   - --devices lists parse, and bad ones are refused with the reason;
//   - routing: each request goes to the engine with the fewest outstanding completions, ties to the lowest
//     index; releases give the load back; the per-engine counters say where requests went;
//   - the same greedy request gives the same tokens on either engine (and, on the CPU, the model core's);
//   - a host-staged (zmq) weight commit reaches every engine: the new weights' outputs on both, one version;
//     an engine paused by a peer stays paused after a commit;
//   - a commit that lands while both engines generate carries engine 0's request across (one version change inside
//     each completion) and, in mode abort, starts engine 1's (which takes restarts) over; the report and the stats
//     sum the engines;
//   - a device-staged (nccl) update received by engine 0 and spread with ops_copy_peer reaches every engine and
//     gives the outputs of the same weights committed through the host path;
//   - ops_copy_peer copies between the two engines' contexts byte for byte;
//   - an engine that cannot start names its device and the ones already made are freed.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rollout_server/engine_group.h"
#include "shared/dtype.h"
#include "tests/unit/check_macros.h"
#include "tests/unit/testlib.h"

static const char *CONFIG =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 256, \"hidden_size\": 128, \"intermediate_size\": 256,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"max_position_embeddings\": 256,"
    " \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": false}";
#define SEED_BASE 11
#define SEED_B 12
#define SEED_C 13
#define STD 0.5f
#define MAX_NEW 12

static char model_dir[256];

static void die(const char *what, const char *err) {
    fprintf(stderr, "set-up failed: %s: %s\n", what, err);
    exit(1);
}

// A CPU model with the random weights of `seed` (model_init_random), for references and unit sizes.
typedef struct {
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
} Ref;

static void ref_make(Ref *r, uint64_t seed) {
    char err[512];
    if (ops_create(&r->ops, OPS_BACKEND_CPU, 0, err, sizeof err) ||
        tiny_model_init(&r->m, &r->w, r->ops, CONFIG, 0, seed, STD, err, sizeof err))
        die("reference model", err);
}

static void ref_free(Ref *r) {
    tiny_model_free(&r->m, &r->w);
    ops_destroy(r->ops);
}

static void ref_greedy(Ref *r, const int32_t *prompt, int n, int32_t *out) {
    char err[512];
    UnitSource src = resident_source(&r->w);
    if (model_generate_greedy(&r->m, &src, 1, &prompt, &n, MAX_NEW, NULL, 0, out, err, sizeof err))
        die("greedy", err);
}

static const int32_t PROMPT[] = {1, 17, 250, 3, 99, 42, 7, 200, 13};
#define PROMPT_LEN ((int)(sizeof PROMPT / sizeof PROMPT[0]))

static SamplingParams greedy_params(int n) {
    SamplingParams p;
    sampling_params_default(&p);
    p.n = n;
    p.max_tokens = MAX_NEW;
    p.temperature = 0.0f;
    p.ignore_eos = 1;
    return p;
}

// Runs a submitted request to its end: completion 0's tokens into out (MAX_NEW), the version of its last token.
static int64_t drain(EngineRequest *r, int32_t *out) {
    EngineEvent ev;
    int n = 0, rc;
    int64_t version = -1;
    while ((rc = engine_request_next(r, &ev, 10000)) != -1) {
        if (rc == 0) {
            fprintf(stderr, "no event in 10 s\n");
            failures++;
            break;
        }
        if (ev.index != 0) continue;
        for (int i = 0; i < ev.n_tokens && n < MAX_NEW; i++) out[n++] = ev.tokens[i];
        if (ev.n_tokens > 0) version = ev.policy_version;
    }
    CHECK(n == MAX_NEW, "%d tokens of %d", n, MAX_NEW);
    return version;
}

// Greedy tokens of PROMPT from engine i alone (submitted to it directly), checked to carry version `version`.
static void engine_greedy(EngineGroup *g, int i, int64_t version, int32_t *out) {
    SamplingParams p = greedy_params(1);
    EngineRequest *r;
    char err[512];
    if (engine_submit(engine_group_engine(g, i), PROMPT, PROMPT_LEN, &p, &r, err, sizeof err)) die("submit", err);
    int64_t v = drain(r, out);
    CHECK(v == version, "engine %d generated with version %lld, expected %lld", i, (long long)v, (long long)version);
    engine_request_release(r);
}

static void make_model_dir(void) {
    char err[512];
    if (temp_dir_make("tandem_engine_group", model_dir, sizeof model_dir)) die("mkdtemp", strerror(errno));
    if (tiny_model_write_random(model_dir, CONFIG, SEED_BASE, STD, err, sizeof err)) die("model", err);
}

static void test_parse(void) {
    EngineDevice d[4];
    char err[256];
    CHECK(engine_devices_parse("cpu,cpu", d, 4, err, sizeof err) == 2 && d[1].backend == OPS_BACKEND_CPU, "%s", err);
    CHECK(engine_devices_parse("0,1", d, 4, err, sizeof err) == 2 && d[0].backend == OPS_BACKEND_CUDA &&
          d[0].device == 0 && d[1].device == 1, "%s", err);
    CHECK(engine_devices_parse("cuda:3,cuda,2", d, 4, err, sizeof err) == 3 && d[0].device == 3 && d[1].device == 0 &&
          d[2].device == 2, "%s", err);
    CHECK(engine_devices_parse("cpu,cuda:1", d, 4, err, sizeof err) < 0 && strstr(err, "mix"), "%s", err);
    CHECK(engine_devices_parse("0,,1", d, 4, err, sizeof err) < 0 && strstr(err, "empty"), "%s", err);
    CHECK(engine_devices_parse("gpu0", d, 4, err, sizeof err) < 0 && strstr(err, "'gpu0' is not a device"), "%s", err);
    CHECK(engine_devices_parse("-1", d, 4, err, sizeof err) < 0, "negative index accepted");
    CHECK(engine_devices_parse("0,1,2,3,4", d, 4, err, sizeof err) < 0 && strstr(err, "more than 4"), "%s", err);
    char name[32];
    engine_device_name(&(EngineDevice){OPS_BACKEND_CUDA, 7}, name, sizeof name);
    CHECK(strcmp(name, "cuda:7") == 0, "%s", name);
}

static EngineGroup *make_group(const EngineDevice *devs, int n) {
    EngineConfig c;
    engine_config_default(&c);
    c.model_dir = model_dir;
    c.kv_cache_bytes = (size_t)8 << 20;
    c.max_num_seqs = 16;
    c.max_num_batched_tokens = 256;
    c.seed = 5;
    EngineGroup *g;
    char err[1024];
    if (engine_group_create(&g, &c, devs, n, err, sizeof err)) die("engine_group_create", err);
    return g;
}

static void check_routing(EngineGroup *g) {
    // Held paused, so that nothing finishes while the loads are compared: the load is what was submitted.
    engine_group_pause(g);
    SamplingParams p2 = greedy_params(2), p1 = greedy_params(1);
    EngineRequest *r[4];
    int at[4];
    char err[512];
    const SamplingParams *ps[4] = {&p2, &p1, &p1, &p1};
    // Loads (0, 0) -> 0; (2, 0) -> 1; (2, 1) -> 1; (2, 2) -> 0.
    const int want[4] = {0, 1, 1, 0};
    for (int i = 0; i < 4; i++) {
        int rc = engine_group_submit(g, PROMPT, PROMPT_LEN, ps[i], &r[i], &at[i], err, sizeof err);
        CHECK(rc == 0 && at[i] == want[i], "request %d went to engine %d (rc %d %s), expected %d", i, at[i], rc, err,
              want[i]);
    }
    EngineStats total;
    EngineMemberStats per[2];
    engine_group_stats(g, &total, per);
    CHECK(per[0].outstanding == 3 && per[1].outstanding == 2, "outstanding %lld %lld", (long long)per[0].outstanding,
          (long long)per[1].outstanding);
    CHECK(total.requests_waiting == 4 && total.paused == 1, "waiting %lld paused %d",
          (long long)total.requests_waiting, total.paused);
    engine_group_resume(g);
    int32_t tok[4][MAX_NEW];
    for (int i = 0; i < 4; i++) {
        drain(r[i], tok[i]);
        engine_group_release(g, r[i], at[i], ps[i]->n);
    }
    // The same greedy request on either engine: the same tokens.
    CHECK(memcmp(tok[0], tok[1], sizeof tok[0]) == 0 && memcmp(tok[0], tok[3], sizeof tok[0]) == 0,
          "engines disagree on a greedy request");
    // The engines publish their counters after a step, maybe just after its last tokens reached us.
    for (int t = 0; t < 500; t++) {
        engine_group_stats(g, &total, per);
        if (total.generation_tokens_total >= 5 * MAX_NEW) break;
        usleep(10000);
    }
    CHECK(per[0].outstanding == 0 && per[1].outstanding == 0, "load left after release: %lld %lld",
          (long long)per[0].outstanding, (long long)per[1].outstanding);
    CHECK(per[0].requests_routed == 2 && per[1].requests_routed == 2, "routed %lld %lld",
          (long long)per[0].requests_routed, (long long)per[1].requests_routed);
    CHECK(per[0].stats.generation_tokens_total == 3 * MAX_NEW && per[1].stats.generation_tokens_total == 2 * MAX_NEW,
          "generated %lld %lld", (long long)per[0].stats.generation_tokens_total,
          (long long)per[1].stats.generation_tokens_total);
    CHECK(total.generation_tokens_total == 5 * MAX_NEW, "total generated %lld",
          (long long)total.generation_tokens_total);
    // A refusal every engine would give (bad parameters) comes back once, and counts against no engine.
    SamplingParams bad = greedy_params(1);
    bad.top_p = 2.0f;
    EngineRequest *rb;
    int eb;
    CHECK(engine_group_submit(g, PROMPT, PROMPT_LEN, &bad, &rb, &eb, err, sizeof err) == ENGINE_EINVAL &&
          strstr(err, "top_p") && eb == -1, "%s", err);
    engine_group_stats(g, &total, per);
    CHECK(per[0].outstanding == 0 && per[1].outstanding == 0, "a refused request left load");
}

// Host staging (transport zmq): engine 0's staging receives the units of `seed` (as bf16 bits where the engines'
// weights are bf16, as the receiver writes them), the commit reaches every engine.
static void stage_host(EngineGroup *g, uint64_t seed, const Ref *shape) {
    const Layout *L = &engine_group_model(g)->layout;
    float *f = malloc(L->max_unit_numel * sizeof *f);
    if (!f) die("staging", "out of host memory");
    for (int u = 0; u < L->n_units; u++) {
        void *st = engine_group_weights_staging(g, u);
        if (!st) die("staging", "NULL");
        model_random_unit_f32(&shape->m, seed, STD, u, f);
        if (engine_group_weights_staging_bf16(g)) dtype_f32_to_bf16_n(st, f, L->unit_numel[u]);
        else memcpy(st, f, L->unit_numel[u] * sizeof *f);
    }
    free(f);
}

static void commit_host(EngineGroup *g, uint64_t seed, int64_t version, const Ref *shape) {
    stage_host(g, seed, shape);
    char err[1024];
    int rc = engine_group_commit_weights(g, version, ENGINE_UPDATE_KEEP, NULL, err, sizeof err);
    CHECK(rc == 0, "host commit: %s", err);
}

// Device staging (transport nccl, without NCCL): engine 0's device staging gets the units of `seed` as the
// receiver would leave them, then they are spread to the other engines and swapped in everywhere.
static void commit_device(EngineGroup *g, uint64_t seed, int64_t version, const Ref *shape) {
    int be, bs, bu;
    CHECK(engine_group_device_staging_ready(g, &be, &bs, &bu) == 0, "no device staging on engine %d shard %d unit %d",
          be, bs, bu);
    const Layout *L = &engine_group_model(g)->layout;
    Engine *e0 = engine_group_engine(g, 0);
    OpsCtx *o = engine_ops(e0);
    for (int u = 0; u < L->n_units; u++) {
        float *host = malloc(L->unit_numel[u] * sizeof *host);
        if (!host) die("malloc", "unit");
        model_random_unit_f32(&shape->m, seed, STD, u, host);
        ops_upload_f32(o, engine_weights_device_staging(e0, 0, u), host, L->unit_numel[u]);
        ops_synchronize(o);
        free(host);
    }
    CHECK(ops_status(o) == 0, "upload into engine 0's staging: %s", ops_error(o));
    char err[1024];
    CHECK(engine_group_spread_device_staging(g, err, sizeof err) == 0, "spread: %s", err);
    CHECK(engine_group_commit_device_weights(g, version, ENGINE_UPDATE_KEEP, NULL, err, sizeof err) == 0, "device commit: %s", err);
}

static void check_weights(EngineGroup *g, OpsBackend be) {
    Ref shape;
    ref_make(&shape, SEED_BASE);
    int32_t base0[MAX_NEW], base1[MAX_NEW], ref[MAX_NEW];
    engine_greedy(g, 0, 0, base0);
    engine_greedy(g, 1, 0, base1);
    CHECK(memcmp(base0, base1, sizeof base0) == 0, "engines disagree on the loaded weights");
    if (be == OPS_BACKEND_CPU) {
        ref_greedy(&shape, PROMPT, PROMPT_LEN, ref);
        CHECK(memcmp(base0, ref, sizeof ref) == 0, "engine 0 differs from the model core");
    }

    // Host path: weights B, version 1, on both engines.
    commit_host(g, SEED_B, 1, &shape);
    int32_t b0[MAX_NEW], b1[MAX_NEW];
    engine_greedy(g, 0, 1, b0);
    engine_greedy(g, 1, 1, b1);
    CHECK(memcmp(b0, b1, sizeof b0) == 0, "engines disagree after the host commit");
    CHECK(memcmp(b0, base0, sizeof b0) != 0, "the host commit changed nothing");
    CHECK(engine_group_policy_version(g) == 1, "version %lld", (long long)engine_group_policy_version(g));
    if (be == OPS_BACKEND_CPU) {
        Ref rb;
        ref_make(&rb, SEED_B);
        ref_greedy(&rb, PROMPT, PROMPT_LEN, ref);
        CHECK(memcmp(b0, ref, sizeof ref) == 0, "host commit: not the new weights' output");
        ref_free(&rb);
    }

    // A pause from a peer outlives a commit.
    engine_group_pause(g);
    commit_host(g, SEED_B, 2, &shape);
    EngineStats total;
    EngineMemberStats per[2];
    engine_group_stats(g, &total, per);
    CHECK(per[0].stats.paused && per[1].stats.paused, "a commit resumed paused engines");
    CHECK(per[0].stats.policy_version == 2 && per[1].stats.policy_version == 2, "versions %lld %lld",
          (long long)per[0].stats.policy_version, (long long)per[1].stats.policy_version);
    engine_group_resume(g);

    // Device path: weights C received by engine 0, spread, version 3.
    commit_device(g, SEED_C, 3, &shape);
    int32_t c0[MAX_NEW], c1[MAX_NEW];
    engine_greedy(g, 0, 3, c0);
    engine_greedy(g, 1, 3, c1);
    CHECK(memcmp(c0, c1, sizeof c0) == 0, "engines disagree after the device commit");
    CHECK(memcmp(c0, b0, sizeof c0) != 0, "the device commit changed nothing");
    // The same weights C through the host path: the same outputs, so the spread copies were exact.
    commit_host(g, SEED_C, 4, &shape);
    int32_t h0[MAX_NEW], h1[MAX_NEW];
    engine_greedy(g, 0, 4, h0);
    engine_greedy(g, 1, 4, h1);
    CHECK(memcmp(h0, c0, sizeof h0) == 0 && memcmp(h1, c0, sizeof h1) == 0,
          "weights C through the device path and the host path give different outputs");
    // And a second device update into the staging copies the last swap left (the previous live weights).
    commit_device(g, SEED_B, 5, &shape);
    engine_greedy(g, 0, 5, c0);
    engine_greedy(g, 1, 5, c1);
    CHECK(memcmp(c0, b0, sizeof c0) == 0 && memcmp(c1, b0, sizeof c1) == 0, "second device update: not weights B");
    ref_free(&shape);
}

// Takes r's events to the end: completion i's token count, restarts, and where its version changed (the index of
// its first token of `version`, -1 when it has none or some token of another version follows it).
static void take_all(EngineRequest *r, int64_t version, int *n, int *restarts, int *change) {
    EngineEvent ev;
    int rc;
    for (int i = 0; i < 2; i++) n[i] = restarts[i] = 0, change[i] = -1;
    while ((rc = engine_request_next(r, &ev, 10000)) == 1) {
        const int i = ev.index;
        if (ev.restarted) n[i] = 0, restarts[i]++, change[i] = -1;
        if (ev.n_tokens > 0 && ev.policy_version == version && change[i] < 0) change[i] = n[i];
        if (ev.n_tokens > 0 && ev.policy_version != version && change[i] >= 0) change[i] = -2;
        n[i] += ev.n_tokens;
    }
    CHECK(rc == -1, "no event in 10 s");
}

static void check_in_flight_commit(EngineGroup *g) {
    Ref shape;
    ref_make(&shape, SEED_BASE);
    SamplingParams p = greedy_params(2);
    p.max_tokens = 240; // of the context's 256: the engines are far from done when the commit comes
    EngineRequest *r[2];
    char err[512];
    stage_host(g, SEED_C, &shape);
    engine_group_pause(g);
    for (int i = 0; i < 2; i++)
        if (engine_submit(engine_group_engine(g, i), PROMPT, PROMPT_LEN, &p, &r[i], err, sizeof err)) die("submit", err);
    engine_request_allow_restart(r[1]);
    EngineStats before, after;
    EngineMemberStats per0[2], per[2];
    engine_group_stats(g, &before, per0);
    engine_group_resume(g);
    for (int spins = 0;; spins++) { // until each engine ran its first step: both its completions have a token
        engine_group_stats(g, &after, per);
        if (per[0].stats.generation_tokens_total - per0[0].stats.generation_tokens_total >= 2 &&
            per[1].stats.generation_tokens_total - per0[1].stats.generation_tokens_total >= 2)
            break;
        if (spins == 10000) die("in-flight commit", "the engines ran no step in 10 s");
        usleep(1000);
    }
    engine_group_pause(g); // after their current step: the commit lands inside every completion
    EngineCommitReport rep;
    CHECK(engine_group_commit_weights(g, 6, ENGINE_UPDATE_ABORT, &rep, err, sizeof err) == 0, "commit: %s", err);
    engine_group_resume(g);
    CHECK(rep.sequences_kept == 2 && rep.sequences_requeued == 2, "report: %lld kept, %lld re-queued (want 2, 2)",
          (long long)rep.sequences_kept, (long long)rep.sequences_requeued);
    int n[2], restarts[2], change[2];
    take_all(r[0], 6, n, restarts, change);
    for (int i = 0; i < 2; i++)
        CHECK(n[i] == 240 && restarts[i] == 0 && change[i] > 0, "engine 0, completion %d (kept): %d tokens, %d "
              "restarts, change at %d", i, n[i], restarts[i], change[i]);
    take_all(r[1], 6, n, restarts, change);
    for (int i = 0; i < 2; i++)
        CHECK(n[i] == 240 && restarts[i] == 1 && change[i] == 0, "engine 1, completion %d (re-queued): %d tokens, %d "
              "restarts, new version from %d", i, n[i], restarts[i], change[i]);
    engine_request_release(r[0]);
    engine_request_release(r[1]);
    engine_group_stats(g, &after, NULL);
    CHECK(after.weight_updates_total - before.weight_updates_total == 2 &&
              after.weight_update_sequences_kept_total - before.weight_update_sequences_kept_total == 2 &&
              after.weight_update_sequences_requeued_total - before.weight_update_sequences_requeued_total == 2,
          "group stats: one update per engine, 2 kept, 2 re-queued");
    ref_free(&shape);
}

static void check_copy_peer(EngineGroup *g) {
    OpsCtx *a = engine_ops(engine_group_engine(g, 0)), *b = engine_ops(engine_group_engine(g, 1));
    enum { N = 100003 };
    float *host = malloc(N * sizeof *host), *back = malloc(N * sizeof *back);
    for (int i = 0; i < N; i++) host[i] = (float)((i * 37) % 257) - 128.0f;   // integers |x| <= 128: exact in bf16
    void *src = ops_malloc(a, N * ops_dtype_size(a)), *dst = ops_malloc(b, N * ops_dtype_size(b));
    ops_upload_f32(a, src, host, N);
    ops_synchronize(a);
    char err[512];
    CHECK(ops_copy_peer(b, dst, a, src, N * ops_dtype_size(a), err, sizeof err) == 0, "%s", err);
    ops_download_f32(b, back, dst, N);
    ops_synchronize(b);
    CHECK(ops_status(a) == 0 && ops_status(b) == 0, "%s %s", ops_error(a), ops_error(b));
    CHECK(memcmp(host, back, N * sizeof *host) == 0, "peer copy changed the bytes");
    CHECK(ops_copy_peer(b, NULL, a, src, 4, err, sizeof err) != 0 && strstr(err, "NULL"), "%s", err);
    ops_free(a, src);
    ops_free(b, dst);
    free(host);
    free(back);
}

static void check_failed_start(OpsBackend be, int dev0) {
    EngineDevice devs[2] = {{be, dev0}, {OPS_BACKEND_CUDA, 999}};
    EngineConfig c;
    engine_config_default(&c);
    c.model_dir = model_dir;
    c.kv_cache_bytes = (size_t)8 << 20;
    c.max_num_seqs = 16;
    c.max_num_batched_tokens = 256;
    EngineGroup *g = NULL;
    char err[1024];
    CHECK(engine_group_create(&g, &c, devs, 2, err, sizeof err) != 0 && g == NULL &&
          strstr(err, "engine 1 on device cuda:999"), "%s", err);
}

static void run(OpsBackend be, int dev0, int dev1) {
    const EngineDevice devs[2] = {{be, dev0}, {be, dev1}};
    char n0[32], n1[32];
    engine_device_name(&devs[0], n0, sizeof n0);
    engine_device_name(&devs[1], n1, sizeof n1);
    printf("engines on %s, %s\n", n0, n1);
    EngineGroup *g = make_group(devs, 2);
    CHECK(engine_group_size(g) == 2 && strcmp(engine_group_device_name(g, 1), n1) == 0, "%s",
          engine_group_device_name(g, 1));
    check_routing(g);
    check_weights(g, be);
    check_in_flight_commit(g);
    check_copy_peer(g);
    engine_group_destroy(g, 1000);
    check_failed_start(be, dev0);
}

int main(void) {
    make_model_dir();
    test_parse();
    run(OPS_BACKEND_CPU, 0, 0);
    if (ops_backend_available(OPS_BACKEND_CUDA) && ops_cuda_device_count() >= 2)
        run(OPS_BACKEND_CUDA, 0, 1);
    else
        printf("SKIP (CUDA part): needs two CUDA devices, %d visible\n", ops_cuda_device_count());
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", model_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", model_dir);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all engine group checks passed\n");
    return 0;
}
