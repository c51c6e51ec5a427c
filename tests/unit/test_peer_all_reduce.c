// tests/unit/test_peer_all_reduce.c — ops_peer_all_reduce (kernels/ops.h) on the cpu backend: the sum across the
// tensor-parallel shards of one process that a decode step's layers make; each shard is a thread, as in tandem-serve.
// The cuda kernel and its comparison with this twin: test_cuda_peer_all_reduce.
//
// 2, 3 and 4 shards: counts 1, 7, 8, 5,120, 5,121 and the capacity, with and without a residual, each call made 5
// times in a row (both exchange buffers, epochs past the first): every shard's x equals the fp32 sum over the shards
// in shard order plus the residual, exactly; the inputs change every call (a stale buffer fails).
// Refusals: a count above the capacity and a misaligned x are context errors; a group of 1 or 9 shards is refused
// with a message. A late shard: shard 0 calls alone with a 0.3 s timeout and gets, within 5 s, an error naming
// shard 1.
#include "peer_testlib.h"

static void cpu_cases(void) {
    static Shard sh[4];
    OpsCtx *ctxs[4];
    char err[256];
    for (int k = 0; k < 4; k++) REQUIRE(ops_create(&ctxs[k], OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "%s", err);
    for (int n = 2; n <= 4; n++)
        for (int ci = 0; ci <= N_COUNTS; ci++)
            for (int r = 0; r < 2; r++) {
                const size_t count = ci < N_COUNTS ? counts[ci] : MAX_COUNT;
                if (run_group(ctxs, n, count, r, 10.0, sh, shard_eager) != 0) continue;
                int wrong = 0;
                for (int k = 0; k < n; k++) {
                    CHECK(sh[k].rc == 0, "cpu n %d count %zu shard %d: %s", n, count, k, ops_error(ctxs[k]));
                    for (int c = 0; c < CALLS; c++)
                        for (size_t i = 0; i < count; i++) wrong += sh[k].host[c][i] != expected(n, c, 0, i, r);
                }
                CHECK(wrong == 0, "cpu n %d count %zu residual %d: %d elements differ from the fp32 sum", n, count, r,
                      wrong);
            }

    // Refusals.
    OpsPeerGroup *g = NULL;
    CHECK(ops_peer_group_create(&g, ctxs, 1, 16, 1.0, err, sizeof err) != 0 && strstr(err, "2 to"), "%s", err);
    OpsCtx *nine[9];
    for (int k = 0; k < 9; k++) nine[k] = ctxs[0];
    CHECK(ops_peer_group_create(&g, nine, 9, 16, 1.0, err, sizeof err) != 0, "9 shards accepted");
    REQUIRE(ops_peer_group_create(&g, ctxs, 2, 16, 1.0, err, sizeof err) == 0, "%s", err);
    void *x = ops_malloc(ctxs[0], 64 * 4);
    ops_peer_all_reduce(g, 0, x, NULL, 17);
    CHECK(ops_status(ctxs[0]) != 0 && strstr(ops_error(ctxs[0]), "capacity 16"), "over capacity: %s",
          ops_error(ctxs[0]));
    ops_clear_error(ctxs[0]);
    ops_peer_all_reduce(g, 0, (char *)x + 4, NULL, 8);
    CHECK(ops_status(ctxs[0]) != 0 && strstr(ops_error(ctxs[0]), "aligned"), "misaligned: %s", ops_error(ctxs[0]));
    ops_clear_error(ctxs[0]);
    ops_peer_group_destroy(g);

    // A late shard: shard 0 alone.
    REQUIRE(ops_peer_group_create(&g, ctxs, 2, 16, 0.3, err, sizeof err) == 0, "%s", err);
    const double t0 = now_s();
    ops_peer_all_reduce(g, 0, x, NULL, 8);
    const double waited = now_s() - t0;
    CHECK(ops_status(ctxs[0]) != 0 && strstr(ops_error(ctxs[0]), "for shard 1"), "late shard: %s",
          ops_error(ctxs[0]));
    CHECK(waited < 5.0, "the late shard was found after %.1f s", waited);
    printf("cpu: a late shard is reported after %.2f s (timeout 0.3 s): %s\n", waited, ops_error(ctxs[0]));
    ops_clear_error(ctxs[0]);
    ops_peer_group_destroy(g);
    ops_free(ctxs[0], x);
    for (int k = 0; k < 4; k++) ops_destroy(ctxs[k]);
    printf("cpu: 2-4 shards, counts 1..%d, with and without a residual: equal to the fp32 sum in shard order\n",
           MAX_COUNT);
}

int main(void) {
    cpu_cases();
    return check_exit_code("test_peer_all_reduce");
}
