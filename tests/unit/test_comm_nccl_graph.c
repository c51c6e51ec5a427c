// tests/unit/test_comm_nccl_graph.c — CUDA graphs that hold communicator calls (shared/comm/comm.h, "CUDA graphs"):
// the tensor-parallel shards' decode steps record their all-reduces into the graphs they replay.
//
// Every build: comm_graph_capable and comm_graph_launch answer without a GPU (NULL, a host communicator: not capable;
// a launch without a graph or without a compute context is refused and the communicator stays usable).
// With a GPU (else exit 77, saying why), world 1, on GPU 0:
//   - a graph recorded on a context holds add -> all_reduce -> add between ops; replayed 5 times with new inputs
//     uploaded before each replay, every result is the one the same ops give eagerly (so a replay that did not run
//     the recorded ops, or ran them on stale inputs, fails); comm_wait_compute / comm_compute_wait while recording
//     are accepted (nothing to order);
//   - a communicator in NCCL's non-blocking mode (comm_create_with_id) is not capable, and its call while recording
//     is refused with a message naming the mode; the communicator stays usable (an eager all_reduce after it works).
// With 2 GPUs (else that part is skipped, saying so), two shards as two threads (comm_create_local_group):
//   - each records the same graph concurrently, replays it 5 times with eager all_reduces on the same communicator
//     in between; the all_reduce inside sums both shards' values (checked exactly);
//   - the replay guard: shard 1 records but never replays, shard 0 replays with a 2 s timeout: the replay's
//     all_reduce stalls, the watchdog fails the communicator within the timeout + 10 s, shard 0's compute stream
//     moves on (ops_synchronize returns), comm_synchronize and a second comm_graph_launch return the failure, and
//     after the graph is destroyed the communicator is released (the abort waits for the graphs).
// Usage: test_comm_nccl_graph [scenario ...]   (api one nonblocking two hang; default: all)
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/comm/comm.h"

#ifdef TANDEM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "check_macros.h"

static int want_scenario(int argc, char **argv, const char *name) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0) return 1;
    return 0;
}

static void api_checks(void) {
    char err[512] = "";
    CHECK(comm_graph_capable(NULL) == 0);
    CHECK(comm_graph_launch(NULL, NULL) == COMM_ERR_INVALID);
    CommInit one = {.rank = 0, .world_size = 1, .timeout_ms = 1000, .master_port = 29500};
    snprintf(one.master_addr, sizeof one.master_addr, "127.0.0.1");
    Comm *c = NULL;
    REQUIRE(comm_create(&c, COMM_BACKEND_HOST, &one, NULL, err, sizeof err) == 0, "%s", err);
    CHECK(comm_graph_capable(c) == 0);
    CHECK(comm_graph_launch(c, NULL) == COMM_ERR_INVALID && strstr(comm_error(c), "NULL"), "%s", comm_error(c));
    // Refused arguments leave it usable: a collective still runs.
    float x = 2.0f;
    CHECK(comm_all_reduce(c, &x, 1, COMM_F32, COMM_SUM) == 0 && x == 2.0f);
    comm_destroy(c);
}

#ifdef TANDEM_HAVE_CUDA

enum { N_SMALL = 4096, N_LARGE = 1 << 20, REPLAYS = 5 };

// The ops around the collective: a += b; all_reduce(a); c += a. Inputs for replay r on shard k: a = r + k + i % 7,
// b = 1, c = i % 3; every value is a small integer, exact in bf16, so the results are checked exactly.
typedef struct {
    OpsCtx *o;
    Comm *c;
    void *a, *b, *cc;
    size_t n;
    float *host;
} Bufs;

static int bufs_make(Bufs *b, OpsCtx *o, Comm *c, size_t n) {
    const size_t es = ops_dtype_size(o);
    *b = (Bufs){.o = o, .c = c, .n = n};
    b->a = ops_malloc(o, n * es);
    b->b = ops_malloc(o, n * es);
    b->cc = ops_malloc(o, n * es);
    b->host = malloc(n * sizeof *b->host);
    return b->a && b->b && b->cc && b->host ? 0 : -1;
}

static void bufs_free(Bufs *b) {
    ops_free(b->o, b->a);
    ops_free(b->o, b->b);
    ops_free(b->o, b->cc);
    free(b->host);
}

static void set_inputs(Bufs *b, int r, int k) {
    for (size_t i = 0; i < b->n; i++) b->host[i] = (float)(r + k + (int)(i % 7));
    ops_upload_f32(b->o, b->a, b->host, b->n);
    for (size_t i = 0; i < b->n; i++) b->host[i] = 1.0f;
    ops_upload_f32(b->o, b->b, b->host, b->n);
    for (size_t i = 0; i < b->n; i++) b->host[i] = (float)(i % 3);
    ops_upload_f32(b->o, b->cc, b->host, b->n);
}

// Queues (or records) the three steps; 0 or the collective's code.
static int step(Bufs *b) {
    ops_add_inplace(b->o, b->a, b->b, b->n);
    comm_wait_compute(b->c);
    int rc = comm_all_reduce(b->c, b->a, b->n, COMM_BF16, COMM_SUM);
    comm_compute_wait(b->c);
    ops_add_inplace(b->o, b->cc, b->a, b->n);
    return rc;
}

// c after one step at replay r over `world` shards: i % 3 + sum_k (r + k + i % 7 + 1). Returns the wrong elements.
static size_t check_result(Bufs *b, int r, int world, const char *what) {
    ops_download_f32(b->o, b->host, b->cc, b->n);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < b->n; i++) {
        float want = (float)(i % 3);
        for (int k = 0; k < world; k++) want += (float)(r + k + (int)(i % 7) + 1);
        if (b->host[i] != want && bad++ == 0) first = i;
    }
    CHECK(bad == 0 && ops_status(b->o) == 0, "%s, replay %d, n %zu: %zu wrong, first [%zu] (%s)", what, r, b->n, bad,
          first, ops_error(b->o));
    return bad;
}

// Eager once (NCCL connects and the ops make their plans), record, replay REPLAYS times checking each.
static void record_and_replay(Bufs *b, int rank, int world, int eager_between, const char *what) {
    set_inputs(b, 100, rank);
    CHECK(step(b) == 0, "%s eager: %s", what, comm_error(b->c));
    check_result(b, 100, world, what);
    OpsGraph *g = NULL;
    REQUIRE(ops_graph_begin(b->o) == 0, "%s: %s", what, ops_error(b->o));
    const int rc = step(b);
    const int end = ops_graph_end(b->o, &g);
    CHECK(rc == 0, "%s recording the all_reduce: %s", what, comm_error(b->c));
    REQUIRE(end == 0 && g, "%s: ops_graph_end: %s", what, ops_error(b->o));
    for (int r = 0; r < REPLAYS; r++) {
        set_inputs(b, r, rank);
        CHECK(comm_graph_launch(b->c, g) == 0, "%s replay %d: %s", what, r, comm_error(b->c));
        check_result(b, r, world, what);
        if (eager_between) {   // an eager all_reduce between replays, on the same communicator
            set_inputs(b, 50 + r, rank);
            CHECK(step(b) == 0, "%s eager between replays: %s", what, comm_error(b->c));
            check_result(b, 50 + r, world, what);
        }
    }
    CHECK(comm_synchronize(b->c) == 0, "%s: %s", what, comm_error(b->c));
    ops_graph_destroy(b->o, g);
}

static int gpu_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return comm_backend_available(COMM_BACKEND_NCCL) ? n : 0;
}

// A context on cuda:0 and a fresh NCCL id: the set-up of the one-rank cases.
static OpsCtx *one_rank(uint8_t id[COMM_UNIQUE_ID_BYTES]) {
    char err[512] = "";
    OpsCtx *o = NULL;
    REQUIRE(ops_create(&o, OPS_BACKEND_CUDA, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(comm_unique_id(COMM_BACKEND_NCCL, id, err, sizeof err) == 0, "%s", err);
    return o;
}

static void one_test(void) {
    char err[512] = "";
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    OpsCtx *o = one_rank(id);
    Comm *c = NULL;
    REQUIRE(comm_create_local_group(&c, COMM_BACKEND_NCCL, id, 0, 1, 30000, o, err, sizeof err) == 0, "%s", err);
    CHECK(comm_graph_capable(c) == 1);
    const size_t sizes[2] = {N_SMALL, N_LARGE};
    for (int s = 0; s < 2; s++) {
        Bufs b;
        REQUIRE(bufs_make(&b, o, c, sizes[s]) == 0, "%s", ops_error(o));
        record_and_replay(&b, 0, 1, s == 0, "world 1");
        bufs_free(&b);
    }
    comm_destroy(c);
    ops_destroy(o);
    printf("one: %s\n", failures ? "FAILED" : "passed");
}

static void nonblocking_test(void) {
    char err[512] = "";
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    OpsCtx *o = one_rank(id);
    Comm *c = NULL;
    REQUIRE(comm_create_with_id(&c, COMM_BACKEND_NCCL, id, 0, 1, 30000, o, err, sizeof err) == 0, "%s", err);
    CHECK(comm_graph_capable(c) == 0);
    Bufs b;
    REQUIRE(bufs_make(&b, o, c, N_SMALL) == 0, "%s", ops_error(o));
    set_inputs(&b, 0, 0);
    OpsGraph *g = NULL;
    REQUIRE(ops_graph_begin(o) == 0, "%s", ops_error(o));
    const int rc = comm_all_reduce(c, b.a, b.n, COMM_BF16, COMM_SUM);
    CHECK(rc == COMM_ERR_INVALID && strstr(comm_error(c), "non-blocking"), "rc %d: %s", rc, comm_error(c));
    CHECK(ops_graph_end(o, &g) == 0, "%s", ops_error(o));   // an empty recording
    ops_graph_destroy(o, g);
    CHECK(step(&b) == 0, "eager after the refusal: %s", comm_error(c));
    check_result(&b, 0, 1, "non-blocking, eager");
    bufs_free(&b);
    comm_destroy(c);
    ops_destroy(o);
    printf("nonblocking: %s\n", failures ? "FAILED" : "passed");
}

// ---- two shards, one thread each ----

typedef struct {
    int rank, hang;
    const uint8_t *id;
    pthread_barrier_t *bar;
    int failed;            // checks that failed on this thread
    char why[512];
} Shard;

#define SHARD_CHECK(s, cond, ...)                                                                                   \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            (s)->failed++;                                                                                         \
            fprintf(stderr, "FAIL %s:%d: shard %d: ", __FILE__, __LINE__, (s)->rank);                             \
            fprintf(stderr, __VA_ARGS__);                                                                          \
            fputc('\n', stderr);                                                                                   \
        }                                                                                                          \
    } while (0)

static int64_t mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// The replay guard (s->hang): shard 1 records and never replays; shard 0's replay stalls in its all_reduce.
static void hang_shard(Shard *s, Bufs *b) {
    comm_set_timeout(b->c, 2000);
    set_inputs(b, 0, s->rank);
    SHARD_CHECK(s, step(b) == 0, "eager: %s", comm_error(b->c));
    OpsGraph *g = NULL;
    int rc = ops_graph_begin(b->o);
    if (rc == 0) {
        rc = step(b);
        rc = ops_graph_end(b->o, &g) != 0 ? -1 : rc;
    }
    SHARD_CHECK(s, rc == 0 && g, "recording: %s / %s", comm_error(b->c), ops_error(b->o));
    pthread_barrier_wait(s->bar);
    if (s->rank == 0 && g) {
        const int64_t t0 = mono_ms();
        SHARD_CHECK(s, comm_graph_launch(b->c, g) == 0, "the first replay is queued: %s", comm_error(b->c));
        ops_synchronize(b->o);   // returns once the abort lets the replay's kernels exit
        rc = comm_synchronize(b->c);
        const int64_t waited = mono_ms() - t0;
        SHARD_CHECK(s, rc == COMM_ERR_TIMEOUT && strstr(comm_error(b->c), "graph replay"), "rc %d: %s", rc,
                    comm_error(b->c));
        SHARD_CHECK(s, waited >= 1500 && waited < 12000, "the stalled replay failed after %lld ms (timeout 2000)",
                    (long long)waited);
        SHARD_CHECK(s, comm_graph_launch(b->c, g) == COMM_ERR_FAILED, "a replay on the failed communicator");
        printf("hang: the stalled replay failed after %lld ms: %s\n", (long long)waited, comm_error(b->c));
    }
    pthread_barrier_wait(s->bar);
    ops_graph_destroy(b->o, g);   // before the communicator: its release waits for the graphs
}

static void *shard_main(void *arg) {
    Shard *s = arg;
    char err[512] = "";
    OpsCtx *o = NULL;
    Comm *c = NULL;
    if (ops_create(&o, OPS_BACKEND_CUDA, s->rank, err, sizeof err) != 0) {
        SHARD_CHECK(s, 0, "ops_create: %s", err);
        pthread_barrier_wait(s->bar);   // the join below would wait for this shard forever
        return NULL;
    }
    const int joined = comm_create_local_group(&c, COMM_BACKEND_NCCL, s->id, s->rank, 2, 30000, o, err, sizeof err);
    SHARD_CHECK(s, joined == 0 && comm_graph_capable(c), "join: %s", err);
    pthread_barrier_wait(s->bar);
    if (joined == 0) {
        Bufs b;
        if (bufs_make(&b, o, c, s->hang ? N_SMALL : N_LARGE) != 0) {
            SHARD_CHECK(s, 0, "buffers: %s", ops_error(o));
        } else if (s->hang) {
            hang_shard(s, &b);
        } else {
            // The checks inside count into `failures` of this process; both threads' counts add up there.
            record_and_replay(&b, s->rank, 2, 1, s->rank ? "shard 1" : "shard 0");
        }
        if (b.a) bufs_free(&b);
        if (s->hang && s->rank == 1) comm_destroy_now(c);   // its peer's communicator is gone
        else comm_destroy(c);
    }
    ops_destroy(o);
    return NULL;
}

static void two_test(int hang) {
    char err[512] = "";
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    REQUIRE(comm_unique_id(COMM_BACKEND_NCCL, id, err, sizeof err) == 0, "%s", err);
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    Shard s[2];
    pthread_t t[2];
    for (int k = 0; k < 2; k++) {
        s[k] = (Shard){.rank = k, .hang = hang, .id = id, .bar = &bar};
        REQUIRE(pthread_create(&t[k], NULL, shard_main, &s[k]) == 0);
    }
    for (int k = 0; k < 2; k++) pthread_join(t[k], NULL);
    pthread_barrier_destroy(&bar);
    failures += s[0].failed + s[1].failed;
    printf("%s: %s\n", hang ? "hang" : "two", failures ? "FAILED" : "passed");
}
#endif

int main(int argc, char **argv) {
    setenv("NCCL_NVLS_ENABLE", "0", 0);   // NVLink multicast can take a shared host's GPUs down (gpu/README)
    const int all = argc < 2;
#define WANT(name) (all || want_scenario(argc, argv, name))
    if (WANT("api")) api_checks();
#ifndef TANDEM_HAVE_CUDA
    if (failures) return 1;
    printf("skip: this build has no CUDA, so no CUDA graphs or nccl backend (the API checks passed)\n");
    return 77;
#else
    const int gpus = gpu_count();
    if (gpus < 1) {
        if (failures) return 1;
        printf("skip: no CUDA device with a working NCCL here (the API checks passed)\n");
        return 77;
    }
    if (WANT("one")) one_test();
    if (WANT("nonblocking")) nonblocking_test();
    if (gpus < 2) {
        printf("two, hang: skipped, %d CUDA device here and they need 2\n", gpus);
    } else {
        if (WANT("two")) two_test(0);
        if (WANT("hang")) two_test(1);
    }
    printf("%s\n", failures ? "FAILED" : "all passed");
    return failures ? 1 : 0;
#endif
}
