// tests/unit/peer_testlib.h — the shards of test_peer_all_reduce (cpu) and test_cuda_peer_all_reduce: each shard a
// thread calling ops_peer_all_reduce (kernels/ops.h) on its own context, as tandem-serve's tensor-parallel shards do,
// on inputs that are bf16 values (so both backends start from the same numbers).
#ifndef TANDEM_TESTS_PEER_TESTLIB_H
#define TANDEM_TESTS_PEER_TESTLIB_H

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "check_macros.h"
#include "kernels/ops.h"

#define MAX_COUNT 5121
#define CALLS 5

static const size_t counts[] = {1, 7, 8, 5120, 5121};
#define N_COUNTS (int)(sizeof counts / sizeof counts[0])

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// A bf16-representable value of shard k, call c, element i (so cpu and cuda start from the same numbers).
static inline float value(int k, int c, size_t i, int residual) {
    uint32_t h = (uint32_t)(i * 2654435761u) ^ (uint32_t)(k * 40503u + c * 977u + residual * 7919u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    float f = ((float)(h & 0xffff) / 32768.0f - 1.0f) * (residual ? 4.0f : 1.0f);
    uint32_t u;
    memcpy(&u, &f, 4);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

typedef struct {
    OpsPeerGroup *g;
    OpsCtx *ctx;
    int rank, n, graph;
    size_t count;
    int with_residual;
    void *x, *res;
    float host[CALLS][MAX_COUNT];   // this shard's results, per call
    int rc;
} Shard;

static inline void upload(Shard *s, int c, int replay) {
    float in[MAX_COUNT], res[MAX_COUNT];
    for (size_t i = 0; i < s->count; i++) {
        in[i] = value(s->rank, c + 10 * replay, i, 0);
        res[i] = value(0, c + 10 * replay, i, 1);   // the residual stream is the same on every shard
    }
    ops_upload_f32(s->ctx, s->x, in, s->count);
    ops_upload_f32(s->ctx, s->res, res, s->count);
    ops_synchronize(s->ctx);
}

// Eager: CALLS calls, inputs uploaded before each.
static inline void *shard_eager(void *arg) {
    Shard *s = arg;
    for (int c = 0; c < CALLS; c++) {
        upload(s, c, 0);
        ops_peer_all_reduce(s->g, s->rank, s->x, s->with_residual ? s->res : NULL, s->count);
        ops_download_f32(s->ctx, s->host[c], s->x, s->count);
    }
    s->rc = ops_status(s->ctx);
    return NULL;
}

// The expected result of call c (replay r) of a group of n: fp32 sum in shard order, plus the residual.
static inline float expected(int n, int c, int r, size_t i, int with_residual) {
    float acc = 0.0f;
    for (int k = 0; k < n; k++) acc += value(k, c + 10 * r, i, 0);
    return with_residual ? acc + value(0, c + 10 * r, i, 1) : acc;
}

static inline int run_group(OpsCtx **ctxs, int n, size_t count, int with_residual, double timeout_s, Shard *sh,
                     void *(*fn)(void *)) {
    char err[256];
    OpsPeerGroup *g = NULL;
    if (ops_peer_group_create(&g, ctxs, n, MAX_COUNT, timeout_s, err, sizeof err) != 0) {
        CHECK(0, "peer group of %d: %s", n, err);
        return -1;
    }
    pthread_t th[OPS_PEER_MAX];
    for (int k = 0; k < n; k++) {
        sh[k].g = g;
        sh[k].ctx = ctxs[k];
        sh[k].rank = k;
        sh[k].n = n;
        sh[k].count = count;
        sh[k].with_residual = with_residual;
        sh[k].x = ops_malloc(ctxs[k], MAX_COUNT * 4);
        sh[k].res = ops_malloc(ctxs[k], MAX_COUNT * 4);
        pthread_create(&th[k], NULL, fn, &sh[k]);
    }
    for (int k = 0; k < n; k++) pthread_join(th[k], NULL);
    for (int k = 0; k < n; k++) {
        ops_free(ctxs[k], sh[k].x);
        ops_free(ctxs[k], sh[k].res);
    }
    ops_peer_group_destroy(g);
    return 0;
}

#endif
