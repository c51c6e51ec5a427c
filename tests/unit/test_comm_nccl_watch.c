// tests/unit/test_comm_nccl_watch.c — a communicator joined by id with a peer watch (comm.h CommPeerWatch): the
// weight-sync group of trainer ranks and rollout servers, where the trainer learns that a server died from its
// control connection, not from NCCL.
//
// Two processes (one per GPU, else exit 77) join by id with a long timeout (60 s). Member 1's "control channel" is
// a shared page: it writes the moment it is to be taken as gone. Scenarios:
//   - call: member 1 joins, then stops taking part (alive, paused: NCCL cannot tell) and is marked gone; member 0's
//     all_reduce fails within the grace period (~2 s), not the 60 s timeout, with COMM_ERR_PEER and a message
//     naming "member 1 (test peer 1)"; the compute stream behind the aborted call does not hang;
//   - join: member 1 never joins and is marked gone; member 0's comm_create_with_id_watched gives up in seconds,
//     naming it;
//   - healthy: a watch that never reports anyone gone changes nothing (a send/recv round trip succeeds).
// Usage: test_comm_nccl_watch [call join healthy]   (default: all)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "shared/comm/comm.h"
#include "shared/comm/comm_internal.h"   // COMM_ERR_MAX

#ifdef TANDEM_HAVE_CUDA
#include <cuda_runtime.h>

#include "spawn_testlib.h"

#define LONG_TIMEOUT_MS 60000

static int want_scenario(int argc, char **argv, const char *name) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0) return 1;
    return 0;
}

typedef struct {
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    volatile int id_ready;
    volatile int64_t gone_ms[2];   // written by a member when it is to be taken as gone
} Shared;

static Shared *shared;

static int64_t watch_gone_ms(void *arg, int member) {
    (void)arg;
    return __atomic_load_n(&shared->gone_ms[member], __ATOMIC_ACQUIRE);
}

static int64_t never_gone_ms(void *arg, int member) {
    (void)arg, (void)member;
    return 0;
}

static void watch_name(void *arg, int member, char *out, size_t len) {
    (void)arg;
    snprintf(out, len, "test peer %d", member);
}

static void share_id(int rank, uint8_t id[COMM_UNIQUE_ID_BYTES]) {
    char err[COMM_ERR_MAX];
    if (rank == 0) {
        CHECK(comm_unique_id(COMM_BACKEND_NCCL, id, err, sizeof err) == 0);
        memcpy(shared->id, id, COMM_UNIQUE_ID_BYTES);
        __atomic_store_n(&shared->id_ready, 1, __ATOMIC_RELEASE);
        return;
    }
    int64_t t0 = now_ms();
    while (!__atomic_load_n(&shared->id_ready, __ATOMIC_ACQUIRE) && now_ms() - t0 < 20000) usleep(1000);
    CHECK(shared->id_ready == 1);
    memcpy(id, shared->id, COMM_UNIQUE_ID_BYTES);
}

static int open_ops(OpsCtx **ops, int rank) {
    char err[COMM_ERR_MAX];
    if (ops_create(ops, OPS_BACKEND_CUDA, rank, err, sizeof err) != 0) {
        fprintf(stderr, "rank %d: ops_create: %s\n", rank, err);
        return -1;
    }
    return 0;
}

// Both members: a CUDA context on GPU `rank`, the id from member 0, joined with `watch`. NULL on failure (said).
static Comm *join_watched(int rank, const CommPeerWatch *watch, OpsCtx **ops) {
    if (open_ops(ops, rank) != 0) return NULL;
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    share_id(rank, id);
    char err[COMM_ERR_MAX];
    Comm *c = NULL;
    if (comm_create_with_id_watched(&c, COMM_BACKEND_NCCL, id, rank, 2, LONG_TIMEOUT_MS, watch, *ops, err,
                                    sizeof err) != 0) {
        fprintf(stderr, "rank %d: join: %s\n", rank, err);
        ops_destroy(*ops);
        return NULL;
    }
    return c;
}

static void mark_gone(int rank) { __atomic_store_n(&shared->gone_ms[rank], now_ms(), __ATOMIC_RELEASE); }

static int call_child(int rank, int port, void *arg) {
    (void)port, (void)arg;
    OpsCtx *ops;
    Comm *c = join_watched(rank, &(CommPeerWatch){.gone_ms = watch_gone_ms, .name = watch_name}, &ops);
    if (!c) return 1;
    size_t n = (size_t)1 << 20;
    void *buf = ops_malloc(ops, n * 2);
    // One round trip that works: the watch has said nothing yet.
    CHECK(comm_group_start(c) == 0);
    CHECK((rank == 0 ? comm_send(c, buf, n, COMM_BF16, 1) : comm_recv(c, buf, n, COMM_BF16, 0)) == 0);
    CHECK(comm_group_end(c) == 0);
    CHECK(comm_synchronize(c) == 0);
    if (rank == 1) {
        mark_gone(1);              // its control connection dropped, as far as member 0 can tell
        fflush(stdout);
        fflush(stderr);
        for (;;) pause();          // alive and never calls again: NCCL alone would wait for the timeout
    }
    // An all_reduce cannot finish without member 1 (a send of this size could: NCCL buffers it on the way).
    int64_t t0 = now_ms();
    int rc1 = comm_all_reduce(c, buf, n, COMM_BF16, COMM_SUM);
    comm_compute_wait(c);
    int rc2 = comm_synchronize(c);
    int64_t waited = now_ms() - t0;
    printf("  call: comm_synchronize -> %d after %lld ms: %s\n", rc2, (long long)waited, comm_error(c));
    fflush(stdout);
    // The call itself may wait for NCCL to take it and so be the one that fails (then synchronize: FAILED).
    CHECK((rc1 == 0 && rc2 == COMM_ERR_PEER) || (rc1 == COMM_ERR_PEER && rc2 == COMM_ERR_FAILED));
    CHECK(waited < 6000);
    CHECK(strstr(comm_error(c), "member 1 (test peer 1) went away") != NULL);
    int64_t t1 = now_ms();
    ops_synchronize(ops);          // the abort let the all_reduce's kernel exit
    CHECK(ops_status(ops) == 0 && now_ms() - t1 < 5000);
    comm_destroy(c);
    ops_free(ops, buf);
    ops_destroy(ops);
    return failures ? 1 : 0;
}

static int join_child(int rank, int port, void *arg) {
    (void)port, (void)arg;
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    if (rank == 1) {
        share_id(rank, id);
        usleep(300000);
        mark_gone(1);              // never joins
        for (;;) pause();
    }
    OpsCtx *ops;
    if (open_ops(&ops, 0) != 0) return 1;
    share_id(0, id);
    char err[COMM_ERR_MAX] = "";
    CommPeerWatch watch = {.gone_ms = watch_gone_ms, .name = watch_name};
    Comm *c = NULL;
    int64_t t0 = now_ms();
    int rc = comm_create_with_id_watched(&c, COMM_BACKEND_NCCL, id, 0, 2, LONG_TIMEOUT_MS, &watch, ops, err,
                                         sizeof err);
    int64_t waited = now_ms() - t0;
    printf("  join: comm_create_with_id_watched -> %d after %lld ms: %s\n", rc, (long long)waited, err);
    CHECK(rc == COMM_ERR_PEER && c == NULL);
    CHECK(waited < 6000);
    CHECK(strstr(err, "member 1 (test peer 1) went away") != NULL);
    ops_destroy(ops);
    return failures ? 1 : 0;
}

static int healthy_child(int rank, int port, void *arg) {
    (void)port, (void)arg;
    OpsCtx *ops;
    Comm *c = join_watched(rank, &(CommPeerWatch){.gone_ms = never_gone_ms}, &ops);
    if (!c) return 1;
    size_t n = (size_t)1 << 20;
    uint16_t *host = malloc(n * 2);
    void *buf = ops_malloc(ops, n * 2);
    for (size_t i = 0; i < n; i++) host[i] = rank == 0 ? (uint16_t)(i * 7) : 0;
    ops_copy_to_device(ops, buf, host, n * 2);
    comm_wait_compute(c);
    CHECK(comm_group_start(c) == 0);
    CHECK((rank == 0 ? comm_send(c, buf, n, COMM_BF16, 1) : comm_recv(c, buf, n, COMM_BF16, 0)) == 0);
    CHECK(comm_group_end(c) == 0);
    CHECK(comm_synchronize(c) == 0);
    comm_compute_wait(c);
    ops_copy_to_host(ops, host, buf, n * 2);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += host[i] != (uint16_t)(i * 7);
    CHECK(bad == 0);
    comm_destroy(c);
    ops_free(ops, buf);
    free(host);
    ops_destroy(ops);
    return failures ? 1 : 0;
}

static void scenario(const char *name, ChildFn fn, const int *want) {
    memset((void *)shared, 0, sizeof *shared);
    int codes[2];
    spawn(2, fn, NULL, 40000, 2000, codes);
    report(name, 2, codes, want);
}
#endif

int main(int argc, char **argv) {
    setenv("NCCL_NVLS_ENABLE", "0", 0);   // NVLink multicast can take a shared host's GPUs down (gpu/README)
#ifndef TANDEM_HAVE_CUDA
    (void)argc, (void)argv;
    printf("skip: this build has no CUDA, so no nccl backend\n");
    return 77;
#else
    int gpus = gpu_count();
    if (gpus < 2) {
        printf("skip: %d CUDA device(s) with a working NCCL here; these tests need 2\n", gpus);
        return 77;
    }
    shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) {
        perror("mmap");
        return 2;
    }
    int all = argc < 2;
    // Member 1 pauses for ever in "call" and "join": the spawner kills it once member 0 is done (-1).
    if (all || want_scenario(argc, argv, "call")) scenario("call", call_child, (const int[]){0, -1});
    if (all || want_scenario(argc, argv, "join")) scenario("join", join_child, (const int[]){0, -1});
    if (all || want_scenario(argc, argv, "healthy")) scenario("healthy", healthy_child, (const int[]){0, 0});
    munmap(shared, sizeof *shared);
    printf("%s\n", failures ? "FAILED" : "all passed");
    return failures ? 1 : 0;
#endif
}
