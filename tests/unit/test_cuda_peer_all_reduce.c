// tests/unit/test_cuda_peer_all_reduce.c — ops_peer_all_reduce's CUDA kernel against its cpu twin (kernels/ops.h),
// each shard a thread. Exit 77 without a GPU, saying so.
//
// 2 shards, on GPUs 0 and 1 when there are two (peer access over NVLink), else both on GPU 0 (two streams): counts 1,
// 7, 8, 5,120, 5,121 and the capacity as bf16, with and without a residual, 5 calls each: every shard's result bit
// for bit the cpu twin's fp32 result rounded to bf16 (the same sums in the same order, rounded once), the same on both
// shards. Then each shard records a call into a CUDA graph and replays it 3 times with new inputs: each replay sums
// its own inputs. Then a late shard: shard 0 calls alone with a 0.5 s timeout; the next synchronization reports,
// within 5 s, an error naming shard 1.
#include "peer_testlib.h"

// cuda: CALLS calls recorded into one graph per shard, replayed 3 times with new inputs.
static void *shard_graph(void *arg) {
    Shard *s = arg;
    upload(s, 0, 0);
    OpsGraph *graph = NULL;
    if (ops_graph_begin(s->ctx) != 0) {
        s->rc = -1;
        return NULL;
    }
    ops_peer_all_reduce(s->g, s->rank, s->x, s->res, s->count);
    if (ops_graph_end(s->ctx, &graph) != 0) {
        s->rc = -1;
        return NULL;
    }
    // The recording ran nothing; every replay sums the inputs uploaded before it.
    for (int r = 1; r <= 3; r++) {
        upload(s, 0, r);
        if (ops_graph_launch(s->ctx, graph) != 0) break;
        ops_download_f32(s->ctx, s->host[r - 1], s->x, s->count);
    }
    s->rc = ops_status(s->ctx);
    ops_graph_destroy(s->ctx, graph);
    return NULL;
}

static int cuda_cases(void) {
    const int devices = ops_cuda_device_count();
    if (devices < 1) {
        printf("cuda: skipped (no CUDA device in this build or machine)\n");
        return 77;
    }
    static Shard sh[2];
    OpsCtx *ctxs[2], *cpu[2];
    char err[256];
    for (int k = 0; k < 2; k++) {
        REQUIRE(ops_create(&ctxs[k], OPS_BACKEND_CUDA, devices > 1 ? k : 0, err, sizeof err) == 0, "%s", err);
        REQUIRE(ops_create(&cpu[k], OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "%s", err);
    }
    printf("cuda: 2 shards on %s\n", devices > 1 ? "cuda:0 and cuda:1" : "cuda:0 (both)");
    static Shard twin[2];
    for (int ci = 0; ci <= N_COUNTS; ci++)
        for (int r = 0; r < 2; r++) {
            const size_t count = ci < N_COUNTS ? counts[ci] : MAX_COUNT;
            if (run_group(ctxs, 2, count, r, 10.0, sh, shard_eager) != 0) continue;
            if (run_group(cpu, 2, count, r, 10.0, twin, shard_eager) != 0) continue;
            int wrong = 0, differ = 0;
            for (int k = 0; k < 2; k++) {
                CHECK(sh[k].rc == 0, "cuda count %zu shard %d: %s", count, k, ops_error(ctxs[k]));
                for (int c = 0; c < CALLS; c++)
                    for (size_t i = 0; i < count; i++) {
                        wrong += sh[k].host[c][i] != round_bf16(twin[k].host[c][i]);
                        differ += sh[k].host[c][i] != sh[0].host[c][i];
                    }
            }
            CHECK(wrong == 0, "cuda count %zu residual %d: %d elements differ from the cpu twin rounded to bf16",
                  count, r, wrong);
            CHECK(differ == 0, "cuda count %zu: the shards' results differ in %d elements", count, differ);
        }
    printf("cuda: counts 1..%d, with and without a residual, 5 calls each: bit for bit the cpu twin rounded to bf16, "
           "the same on both shards\n", MAX_COUNT);

    if (ops_graph_supported(ctxs[0])) {
        run_group(ctxs, 2, 5120, 1, 10.0, sh, shard_graph);
        int wrong = 0;
        for (int k = 0; k < 2; k++) {
            CHECK(sh[k].rc == 0, "graph shard %d: %s", k, ops_error(ctxs[k]));
            for (int r = 1; r <= 3; r++)
                for (size_t i = 0; i < 5120; i++)
                    wrong += sh[k].host[r - 1][i] != round_bf16(expected(2, 0, r, i, 1));
        }
        CHECK(wrong == 0, "graph replays: %d elements differ from the sum of the inputs of their replay", wrong);
        printf("cuda: a recorded call replayed 3 times with new inputs sums each replay's inputs\n");
    }

    OpsPeerGroup *g = NULL;
    REQUIRE(ops_peer_group_create(&g, ctxs, 2, 16, 0.5, err, sizeof err) == 0, "%s", err);
    void *x = ops_malloc(ctxs[0], 64);
    const double t0 = now_s();
    ops_peer_all_reduce(g, 0, x, NULL, 8);
    ops_synchronize(ctxs[0]);
    const double waited = now_s() - t0;
    CHECK(ops_status(ctxs[0]) != 0 && strstr(ops_error(ctxs[0]), "for shard 1"), "late shard: %s",
          ops_error(ctxs[0]));
    CHECK(waited < 5.0, "the late shard was found after %.1f s", waited);
    printf("cuda: a late shard is reported after %.2f s (timeout 0.5 s): %s\n", waited, ops_error(ctxs[0]));
    ops_clear_error(ctxs[0]);
    ops_free(ctxs[0], x);
    ops_peer_group_destroy(g);
    for (int k = 0; k < 2; k++) {
        ops_destroy(ctxs[k]);
        ops_destroy(cpu[k]);
    }
    return 0;
}

int main(void) {
    const int rc = cuda_cases();
    if (rc == 77) return 77;
    return check_exit_code("test_cuda_peer_all_reduce");
}
