// tests/unit/test_comm_nccl.c — shared/comm/comm.h with the nccl backend: one process per GPU (fork) on 127.0.0.1.
//
// Every build: the API answers without a GPU (host: no unique id, no join by id, groups and comm_synchronize are
// no-ops; nccl without CUDA: COMM_ERR_UNSUPPORTED with a message; nccl without a CUDA compute context: refused),
// and the side channel that names a stalled rank (comm_probe_*) tells apart a peer that is behind, one that
// does not answer (SIGSTOP) and one that went away (SIGKILL).
// With 2 GPUs (else exit 77, saying why), 2 ranks:
//   - every collective against the host's rank-order result, for f32/bf16/i32/u8/f64, sum and max, counts 1,
//     1000003 and 64 MiB, in place and not (all_gather, reduce_scatter), broadcast from both roots; exact except
//     bf16 sums (within one bf16 rounding, comm.h);
//   - send/recv in both directions inside a group, and in a meeting order without one;
//   - comm_unique_id + comm_create_with_id beside the rendezvous communicator, calls interleaved;
//   - ordering: comm_wait_compute makes a collective see a memset that the compute stream runs after a 300 ms
//     host callback, comm_compute_wait makes a compute-stream copy see a collective that a late peer holds back;
//     the same without those calls reads stale data (so the checks can fail);
//   - refused arguments (host memory, synchronize inside a group) leave the communicator usable;
//   - failures: a peer that exits abruptly in the middle, and one that stops calling (sleeps), make the next
//     collective's comm_synchronize fail within the timeout + 2 s naming the call and rank 1; the compute stream
//     that waits for the aborted collective does not hang; later calls return COMM_ERR_FAILED with the first
//     message; a rank that never arrives at the rendezvous is named, and so is one that comes to the rendezvous
//     but not to NCCL's init (the join is abandoned after the timeout);
//   - one rank alone (world 1) and the all_gather / reduce_scatter bus bandwidth at 256 MB (nccl-tests formula:
//     busbw = bytes / time * (n - 1) / n), printed.
// Usage: test_comm_nccl [scenario ...]   (api probe missing main world1 exit hang init; default: all)
#include <signal.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shared/comm/comm.h"
#include "shared/comm/comm_internal.h"
#include "shared/dtype.h"
#include "shared/comm/rendezvous.h"

#ifdef TANDEM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "spawn_testlib.h"

// ---- every build: the API without a GPU --------------------------------------------------------

static void api_checks(void) {
    char err[512] = "";
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    CHECK(comm_backend_available(COMM_BACKEND_HOST) == 1);
    CHECK(comm_unique_id(COMM_BACKEND_HOST, id, err, sizeof err) == COMM_ERR_UNSUPPORTED &&
          strstr(err, "comm_unique_id_host"));
    // The host backend joins by id with comm_unique_id_host's ids (tests/unit/test_comm_host_id.c); other bytes
    // are refused.
    memset(id, 0, sizeof id);
    Comm *c = NULL;
    err[0] = '\0';
    CHECK(comm_create_with_id(&c, COMM_BACKEND_HOST, id, 0, 1, 1000, NULL, err, sizeof err) == COMM_ERR_INVALID);
    CHECK(c == NULL && strstr(err, "not a host backend id"));
    CommInit one = {.rank = 0, .world_size = 1, .timeout_ms = 1000, .master_port = 29500};
    snprintf(one.master_addr, sizeof one.master_addr, "127.0.0.1");
    CHECK(comm_create(&c, COMM_BACKEND_HOST, &one, NULL, err, sizeof err) == 0);
    if (c) {   // host: groups and synchronization have nothing to do
        CHECK(comm_group_start(c) == 0 && comm_group_end(c) == 0 && comm_synchronize(c) == 0);
        comm_wait_compute(c);
        comm_compute_wait(c);
        comm_destroy(c);
    }
    CHECK(comm_group_start(NULL) == COMM_ERR_INVALID && comm_synchronize(NULL) == COMM_ERR_INVALID);
#ifdef TANDEM_HAVE_CUDA
    // The compute context is checked before anything else happens (no CUDA call, no socket).
    err[0] = '\0';
    CHECK(comm_create(&c, COMM_BACKEND_NCCL, &one, NULL, err, sizeof err) == COMM_ERR_INVALID && strstr(err, "CUDA"));
    OpsCtx *cpu = NULL;
    CHECK(ops_create(&cpu, OPS_BACKEND_CPU, 0, err, sizeof err) == 0);
    err[0] = '\0';
    CHECK(comm_create(&c, COMM_BACKEND_NCCL, &one, cpu, err, sizeof err) == COMM_ERR_INVALID && strstr(err, "CPU"));
    err[0] = '\0';
    CHECK(comm_create_with_id(&c, COMM_BACKEND_NCCL, id, 2, 2, 1000, cpu, err, sizeof err) == COMM_ERR_INVALID &&
          strstr(err, "rank 2"));
    ops_destroy(cpu);
#else
    CHECK(comm_backend_available(COMM_BACKEND_NCCL) == 0);
    err[0] = '\0';
    CHECK(comm_unique_id(COMM_BACKEND_NCCL, id, err, sizeof err) == COMM_ERR_UNSUPPORTED && strstr(err, "CUDA build"));
    err[0] = '\0';
    CHECK(comm_create(&c, COMM_BACKEND_NCCL, &one, NULL, err, sizeof err) == COMM_ERR_UNSUPPORTED && strstr(err, "CUDA"));
    err[0] = '\0';
    CHECK(comm_create_with_id(&c, COMM_BACKEND_NCCL, id, 0, 1, 1000, NULL, err, sizeof err) == COMM_ERR_UNSUPPORTED &&
          strstr(err, "CUDA"));
#endif
    printf("%-8s %s\n", "api", failures ? "FAILED" : "ok");
}

// ---- every build: the side channel -------------------------------------------------------------

static void probe_answer(void *arg, CommProbeState *out) {
    int rank = *(const int *)arg;
    out->phase = COMM_PROBE_READY;
    out->queued = rank == 0 ? 5 : 3;   // rank 1 is two operations behind
    out->completed = 2;
}

// Rank 0 diagnoses rank 1: behind, then stopped (no answer), then killed (gone). Rank 1 just answers.
// kill() returns before the signal has stopped every thread of the target: wait until the kernel reports the
// process stopped ('T' in /proc/PID/stat), at most a second.
static void wait_stopped(pid_t pid) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    for (int i = 0; i < 100; i++) {
        FILE *f = fopen(path, "r");
        char state = 0;
        if (f) {
            if (fscanf(f, "%*d (%*[^)]) %c", &state) != 1) state = 0;
            fclose(f);
        }
        if (state == 'T' || state == 't') return;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static int probe_child(int rank, int port, void *arg) {
    (void)arg;
    char ep[RDZV_ENDPOINT_MAX], err[512], out[COMM_ERR_MAX];
    CommProbe *p = NULL;
    Rendezvous *rz = NULL;
    int rc = comm_probe_bind(&p, rank, 2, "127.0.0.1", port, ep, sizeof ep, err, sizeof err);
    RdzvConfig cfg = {.rank = rank, .world_size = 2, .master_addr = "127.0.0.1", .master_port = port,
                      .timeout_ms = 10000, .endpoint = ep};
    if (rc == 0) rc = rendezvous_run(&rz, &cfg, NULL, 0, err, sizeof err);
    if (rc == 0) rc = comm_probe_start(p, rendezvous_peers(rz), probe_answer, &rank, err, sizeof err);
    if (rc == 0) rc = rendezvous_barrier(rz, 10000, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "probe rank %d: %s\n", rank, err);
        return 1;
    }
    if (rank == 1)
        for (;;) pause();   // answers from the responder thread until rank 0 kills it
    pid_t peer = rendezvous_peers(rz)[1].pid;

    out[0] = '\0';
    CHECK(comm_probe_diagnose(p, 5, 0, out, sizeof out) == 0);
    CHECK(strstr(out, "rank 1 (host ") && strstr(out, "has queued 3 NCCL operations where this one is #5"));
    out[0] = '\0';
    CHECK(comm_probe_diagnose(p, 3, 0, out, sizeof out) == 0);
    CHECK(strstr(out, "every peer is alive and has reached this call") != NULL);

    kill(peer, SIGSTOP);   // alive, connected, silent
    wait_stopped(peer);
    int64_t t0 = now_ms();
    out[0] = '\0';
    CHECK(comm_probe_diagnose(p, 5, 0, out, sizeof out) == 0);
    CHECK(strstr(out, "rank 1 (host ") && strstr(out, "does not answer"));
    CHECK(now_ms() - t0 >= COMM_PROBE_WAIT_MS - 50 && now_ms() - t0 < COMM_PROBE_WAIT_MS + 1000);
    printf("  probe (stopped): %s\n", out);

    kill(peer, SIGKILL);   // its kernel closes the connection
    t0 = now_ms();
    while (!comm_probe_gone_ms(p, 1) && now_ms() - t0 < 3000) comm_probe_watch(p, 10);
    CHECK(comm_probe_gone_ms(p, 1) != 0);
    printf("  probe: rank 1's exit seen after %lld ms\n", (long long)(now_ms() - t0));
    out[0] = '\0';
    CHECK(comm_probe_diagnose(p, 5, 0, out, sizeof out) == 1);
    CHECK(strstr(out, "rank 1 (host ") && strstr(out, "went away"));
    printf("  probe (killed): %s\n", out);
    comm_probe_close(p);
    rendezvous_close(rz);
    return failures ? 1 : 0;
}

static void probe_test(void) {
    int codes[2];
    spawn(2, probe_child, NULL, 30000, 5000, codes);
    report("probe", 2, codes, (const int[]){0, -1});
}

static int want_scenario(int argc, char **argv, const char *name) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0) return 1;
    return 0;
}

#ifdef TANDEM_HAVE_CUDA
// ---- with 2 GPUs -------------------------------------------------------------------------------

#define TIMEOUT_MS 30000             // joining and calls in the scenarios that should succeed
#define BIG ((size_t)64 << 20)       // bytes of the largest per-rank block
#define ODD ((size_t)1000003)        // an odd count (a prime), not a multiple of any vector width
#define CUDA_OK(call)                                                                                         \
    do {                                                                                                      \
        cudaError_t e_ = (call);                                                                              \
        if (e_ != cudaSuccess) {                                                                              \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));           \
            failures++;                                                                                       \
        }                                                                                                     \
    } while (0)

static const char *const DT[] = {"f32", "bf16", "i32", "u8", "f64"};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}
static uint8_t *shared_id;           // MAP_SHARED page: rank 0 hands rank 1 the id for comm_create_with_id
static volatile int *shared_flag;


typedef struct {
    int rank, world;
    OpsCtx *ops;
    cudaStream_t cs;                 // the compute stream
    Comm *c;
} Rank;

static int rank_open(Rank *g, int rank, int world, int port, int timeout_ms) {
    char err[COMM_ERR_MAX];
    memset(g, 0, sizeof *g);
    g->rank = rank;
    g->world = world;
    if (ops_create(&g->ops, OPS_BACKEND_CUDA, rank, err, sizeof err) != 0) {
        fprintf(stderr, "rank %d: ops_create: %s\n", rank, err);
        return -1;
    }
    g->cs = (cudaStream_t)ops_cuda_stream(g->ops);
    CHECK(ops_cuda_device(g->ops) == rank && g->cs != NULL);
    CommInit ci = {.rank = rank, .world_size = world, .local_rank = rank, .master_port = port, .timeout_ms = timeout_ms};
    snprintf(ci.master_addr, sizeof ci.master_addr, "127.0.0.1");
    int rc = comm_create(&g->c, COMM_BACKEND_NCCL, &ci, g->ops, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "rank %d: comm_create: %d: %s\n", rank, rc, err);
        ops_destroy(g->ops);
        return -1;
    }
    return 0;
}

static void rank_close(Rank *g) {
    comm_destroy(g->c);
    CHECK(ops_status(g->ops) == 0);
    if (ops_status(g->ops)) fprintf(stderr, "rank %d: %s\n", g->rank, ops_error(g->ops));
    ops_destroy(g->ops);
}

static void must(Rank *g, int rc, const char *what) {
    if (rc == 0) return;
    fprintf(stderr, "rank %d: %s failed (%d): %s\n", g->rank, what, rc, comm_error(g->c));
    failures++;
}

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Rank r's data, n elements. Reals are small multiples of a power of two, so that the sum of two is exact in
// every float type: two-rank sums then match the host bit for bit whatever the order (bf16 included).
// Integers span their whole range, so sums wrap.
static void gen(void *dst, CommDtype dt, int r, size_t n, uint32_t salt) {
    uint64_t base = ((uint64_t)salt << 48) ^ ((uint64_t)r << 40);
    for (size_t i = 0; i < n; i++) {
        uint64_t k = mix64(base ^ i);
        switch (dt) {
        case COMM_F32: ((float *)dst)[i] = (float)((int)(k % 2001) - 1000) / 16.0f; break;
        case COMM_BF16: ((uint16_t *)dst)[i] = dtype_f32_to_bf16((float)((int)(k % 255) - 127) / 8.0f); break;
        case COMM_I32: ((uint32_t *)dst)[i] = (uint32_t)k; break;
        case COMM_U8: ((uint8_t *)dst)[i] = (uint8_t)k; break;
        case COMM_F64: ((double *)dst)[i] = (double)((int64_t)(k % 2000001) - 1000000) / 1024.0; break;
        }
    }
}

#define REDUCE_LOOP(T, COMBINE)                                                                              \
    for (size_t j = 0; j < n; j++) {                                                                         \
        T a = ((const T *)src[0])[off + j];                                                                  \
        for (int r = 1; r < world; r++) {                                                                    \
            T v = ((const T *)src[r])[off + j];                                                              \
            a = (COMBINE);                                                                                   \
        }                                                                                                    \
        ((T *)want)[j] = a;                                                                                  \
    }

// want (n) = op over ranks 0..world-1, in that order, of src[r][off + j] (bf16: fp32 sums, rounded once).
static void reduce_ref(void *want, void *const *src, int world, size_t off, size_t n, CommDtype dt, CommOp op) {
    int sum = op == COMM_SUM;
    switch (dt) {
    case COMM_F32: REDUCE_LOOP(float, sum ? a + v : (v > a ? v : a)); break;
    case COMM_F64: REDUCE_LOOP(double, sum ? a + v : (v > a ? v : a)); break;
    case COMM_I32: REDUCE_LOOP(uint32_t, sum ? a + v : ((int32_t)v > (int32_t)a ? v : a)); break;
    case COMM_U8: REDUCE_LOOP(uint8_t, sum ? (uint8_t)(a + v) : (v > a ? v : a)); break;
    case COMM_BF16:
        for (size_t j = 0; j < n; j++) {
            float a = dtype_bf16_to_f32(((const uint16_t *)src[0])[off + j]);
            for (int r = 1; r < world; r++) {
                float v = dtype_bf16_to_f32(((const uint16_t *)src[r])[off + j]);
                a = sum ? a + v : (v > a ? v : a);
            }
            ((uint16_t *)want)[j] = dtype_f32_to_bf16(a);
        }
        break;
    }
}

static double value_at(const void *p, size_t j, CommDtype dt) {
    switch (dt) {
    case COMM_F32: return ((const float *)p)[j];
    case COMM_BF16: return dtype_bf16_to_f32(((const uint16_t *)p)[j]);
    case COMM_I32: return ((const int32_t *)p)[j];
    case COMM_U8: return ((const uint8_t *)p)[j];
    case COMM_F64: return ((const double *)p)[j];
    }
    return 0;
}

// Bit for bit, except bf16 sums: within one bf16 rounding of the host's fp32 sum (comm.h); reports the
// first difference.
static void same(const Rank *g, const char *what, const void *got, const void *want, size_t n, CommDtype dt,
                 int bf16_sum) {
    size_t esz = comm_dtype_size(dt), j = 0, off = 0;
    if (!bf16_sum) {
        if (memcmp(got, want, n * esz) == 0) return;
        while (memcmp((const char *)got + j * esz, (const char *)want + j * esz, esz) == 0) j++;
    } else {
        for (j = 0; j < n; j++) {
            double a = value_at(got, j, dt), b = value_at(want, j, dt), d = a > b ? a - b : b - a;
            if (!(d <= (b < 0 ? -b : b) / 128.0)) break;
            off += a != b;
        }
        if (j == n) {
            if (off) printf("  rank %d: %s: %zu of %zu bf16 sums differ from the host's by one rounding\n", g->rank,
                            what, off, n);
            return;
        }
    }
    fprintf(stderr, "rank %d: %s (%s, count %zu): element %zu is %.9g, want %.9g\n", g->rank, what, DT[dt], n, j,
            value_at(got, j, dt), value_at(want, j, dt));
    failures++;
}

typedef struct {
    void *src[2];                    // host: every rank's data (world * BIG bytes each)
    void *got, *want;                // host (world * BIG bytes)
    unsigned char *dsend, *drecv;    // device (world * BIG bytes)
} Bufs;

enum { AR, RS, AG, BC };

// One collective of n elements against the host's result. The input is uploaded on the compute stream and
// read back on it: comm_wait_compute / comm_compute_wait order the collective between the two.
static void check_one(Rank *g, Bufs *b, int kind, CommDtype dt, CommOp op, size_t n, int inplace, int root) {
    static const char *const KN[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"};
    size_t esz = comm_dtype_size(dt), w = (size_t)g->world, me = (size_t)g->rank, nres = n;
    char what[96];
    snprintf(what, sizeof what, "%s%s %s%s", KN[kind], inplace ? " in place" : "",
             kind == AR || kind == RS ? (op == COMM_SUM ? "sum " : "max ") : "", DT[dt]);
    if (kind == BC) snprintf(what + strlen(what), sizeof what - strlen(what), " root %d", root);
    // Garbage where results go, so that an element the collective does not write shows.
    CUDA_OK(cudaMemsetAsync(b->drecv, 0xA5, w * n * esz, g->cs));
    CUDA_OK(cudaMemsetAsync(b->dsend, 0x5A, w * n * esz, g->cs));
    void *res = b->dsend;
    int rc = 0;
    switch (kind) {
    case AR:
        ops_copy_to_device(g->ops, b->dsend, b->src[me], n * esz);
        comm_wait_compute(g->c);
        rc = comm_all_reduce(g->c, b->dsend, n, dt, op);
        reduce_ref(b->want, b->src, g->world, 0, n, dt, op);
        break;
    case RS:
        ops_copy_to_device(g->ops, b->dsend, b->src[me], w * n * esz);
        comm_wait_compute(g->c);
        res = inplace ? b->dsend + me * n * esz : b->drecv;
        rc = comm_reduce_scatter(g->c, res, b->dsend, n, dt, op);
        reduce_ref(b->want, b->src, g->world, me * n, n, dt, op);
        break;
    case AG: {
        unsigned char *in = inplace ? b->drecv + me * n * esz : b->dsend;
        ops_copy_to_device(g->ops, in, b->src[me], n * esz);
        comm_wait_compute(g->c);
        rc = comm_all_gather(g->c, b->drecv, in, n, dt);
        res = b->drecv;
        nres = w * n;
        for (size_t r = 0; r < w; r++) memcpy((char *)b->want + r * n * esz, b->src[r], n * esz);
        break;
    }
    case BC:
        ops_copy_to_device(g->ops, b->dsend, b->src[me], n * esz);
        comm_wait_compute(g->c);
        rc = comm_broadcast(g->c, b->dsend, n, dt, root);
        memcpy(b->want, b->src[root], n * esz);
        break;
    }
    must(g, rc, what);
    comm_compute_wait(g->c);
    ops_copy_to_host(g->ops, b->got, res, nres * esz);
    same(g, what, b->got, b->want, nres, dt, (kind == AR || kind == RS) && dt == COMM_BF16 && op == COMM_SUM);
}

static void collectives_test(Rank *g, Bufs *b) {
    double t0 = now_s();
    for (int d = 0; d < 5; d++) {
        CommDtype dt = (CommDtype)d;
        size_t esz = comm_dtype_size(dt), counts[3] = {1, ODD, BIG / esz};
        for (int r = 0; r < g->world; r++) gen(b->src[r], dt, r, (size_t)g->world * BIG / esz, 1 + d);
        for (int k = 0; k < 3; k++) {
            size_t n = counts[k];
            for (int op = 0; op < 2; op++) {
                check_one(g, b, AR, dt, (CommOp)op, n, 0, 0);
                check_one(g, b, RS, dt, (CommOp)op, n, 0, 0);
                check_one(g, b, RS, dt, (CommOp)op, n, 1, 0);
            }
            check_one(g, b, AG, dt, COMM_SUM, n, 0, 0);
            check_one(g, b, AG, dt, COMM_SUM, n, 1, 0);
            check_one(g, b, BC, dt, COMM_SUM, n, 0, 0);
            check_one(g, b, BC, dt, COMM_SUM, n, 0, 1);
        }
    }
    CHECK(comm_synchronize(g->c) == 0);
    if (g->rank == 0) printf("  collectives: 150 checks (5 dtypes x 3 counts x 10) in %.1f s\n", now_s() - t0);
}

// Sends and receives between the two ranks: both directions at once inside a group (each rank in its own
// order), then in an order that meets without one.
static void p2p_test(Rank *g, Bufs *b) {
    int me = g->rank, peer = 1 - me;
    size_t counts[3] = {1, ODD, BIG / 4};
    for (int k = 0; k < 3; k++) {
        size_t n = counts[k];
        for (int r = 0; r < 2; r++) gen(b->src[r], COMM_F32, r, n, 40 + k);
        CUDA_OK(cudaMemsetAsync(b->drecv, 0xA5, n * 4, g->cs));
        ops_copy_to_device(g->ops, b->dsend, b->src[me], n * 4);
        comm_wait_compute(g->c);
        must(g, comm_group_start(g->c), "comm_group_start");
        if (me == 0) {
            must(g, comm_send(g->c, b->dsend, n, COMM_F32, peer), "comm_send");
            must(g, comm_recv(g->c, b->drecv, n, COMM_F32, peer), "comm_recv");
        } else {
            must(g, comm_recv(g->c, b->drecv, n, COMM_F32, peer), "comm_recv");
            must(g, comm_send(g->c, b->dsend, n, COMM_F32, peer), "comm_send");
        }
        must(g, comm_group_end(g->c), "comm_group_end");
        comm_compute_wait(g->c);
        ops_copy_to_host(g->ops, b->got, b->drecv, n * 4);
        same(g, "send/recv in a group", b->got, b->src[peer], n, COMM_F32, 0);
    }
    size_t n = ODD;
    CUDA_OK(cudaMemsetAsync(b->drecv, 0xA5, n * 4, g->cs));
    comm_wait_compute(g->c);
    if (me == 0) {
        must(g, comm_send(g->c, b->dsend, n, COMM_F32, peer), "comm_send");
        must(g, comm_recv(g->c, b->drecv, n, COMM_F32, peer), "comm_recv");
    } else {
        must(g, comm_recv(g->c, b->drecv, n, COMM_F32, peer), "comm_recv");
        must(g, comm_send(g->c, b->dsend, n, COMM_F32, peer), "comm_send");
    }
    must(g, comm_synchronize(g->c), "comm_synchronize");
    ops_copy_to_host(g->ops, b->got, b->drecv, n * 4);
    same(g, "send then recv", b->got, b->src[peer], n, COMM_F32, 0);   // dsend still holds the last round's data
}

static void CUDART_CB pause_300ms(void *arg) {
    (void)arg;
    usleep(300000);
}

static size_t count_byte(const unsigned char *p, size_t n, unsigned char v) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += p[i] == v;
    return k;
}

// What comm_wait_compute and comm_compute_wait order, and that without them the collective runs early.
static void ordering_test(Rank *g, Bufs *b) {
    size_t n = ODD, w = (size_t)g->world;
    unsigned char *host = b->got;
    for (int control = 0; control < 2; control++) {
        // The compute stream pauses 300 ms, then writes 7s into the send buffer; the all_gather must read them.
        CUDA_OK(cudaMemsetAsync(b->dsend, 0, n, g->cs));
        CUDA_OK(cudaMemsetAsync(b->drecv, 0, w * n, g->cs));
        CUDA_OK(cudaStreamSynchronize(g->cs));
        CUDA_OK(cudaLaunchHostFunc(g->cs, pause_300ms, NULL));
        CUDA_OK(cudaMemsetAsync(b->dsend, 7, n, g->cs));
        if (!control) comm_wait_compute(g->c);
        must(g, comm_all_gather(g->c, b->drecv, b->dsend, n, COMM_U8), "comm_all_gather");
        must(g, comm_synchronize(g->c), "comm_synchronize");
        CUDA_OK(cudaStreamSynchronize(g->cs));
        ops_copy_to_host(g->ops, host, b->drecv, w * n);
        size_t sevens = count_byte(host, w * n, 7);
        if (!control) CHECK(sevens == w * n);
        else CHECK(sevens == 0);   // without comm_wait_compute it read the buffer before the memset
    }
    for (int control = 0; control < 2; control++) {
        // Rank 1 arrives 300 ms late; rank 0's compute-stream copy of the result must wait for the collective.
        CUDA_OK(cudaMemsetAsync(b->dsend, 7, n, g->cs));
        CUDA_OK(cudaMemsetAsync(b->drecv, 0, w * n, g->cs));
        CUDA_OK(cudaStreamSynchronize(g->cs));
        if (g->rank == 1) usleep(300000);
        must(g, comm_all_gather(g->c, b->drecv, b->dsend, n, COMM_U8), "comm_all_gather");
        if (!control) comm_compute_wait(g->c);
        ops_copy_to_host(g->ops, host, b->drecv, w * n);
        if (!control) CHECK(count_byte(host, w * n, 7) == w * n);
        else if (g->rank == 0) CHECK(count_byte(host + n, n, 7) == 0);   // copied before rank 1's block came
        must(g, comm_synchronize(g->c), "comm_synchronize");
    }
}

// Refused calls leave the communicator usable (the next scenario uses it).
static void refused_test(Rank *g) {
    float host[16] = {0};
    CHECK(comm_all_reduce(g->c, host, 16, COMM_F32, COMM_SUM) == COMM_ERR_INVALID);
    CHECK(strstr(comm_error(g->c), "host memory") != NULL);
    CHECK(comm_group_start(g->c) == 0);
    CHECK(comm_synchronize(g->c) == COMM_ERR_INVALID && strstr(comm_error(g->c), "inside a group"));
    CHECK(comm_barrier(g->c) == COMM_ERR_INVALID);
    CHECK(comm_group_end(g->c) == 0);
    CHECK(comm_group_end(g->c) == COMM_ERR_INVALID && strstr(comm_error(g->c), "no group"));
    CHECK(comm_barrier(g->c) == 0);
}

// A second communicator joined by id, used alongside the first.
static void with_id_test(Rank *g, Bufs *b) {
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    char err[COMM_ERR_MAX];
    if (g->rank == 0) {
        CHECK(comm_unique_id(COMM_BACKEND_NCCL, id, err, sizeof err) == 0);
        memcpy(shared_id, id, sizeof id);
        __atomic_store_n(shared_flag, 1, __ATOMIC_RELEASE);
    } else {
        int64_t t0 = now_ms();
        while (!__atomic_load_n(shared_flag, __ATOMIC_ACQUIRE) && now_ms() - t0 < 20000) usleep(1000);
        CHECK(*shared_flag == 1);
        memcpy(id, shared_id, sizeof id);
    }
    Comm *c2 = NULL;
    int rc = comm_create_with_id(&c2, COMM_BACKEND_NCCL, id, g->rank, 2, TIMEOUT_MS, g->ops, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "rank %d: comm_create_with_id: %d: %s\n", g->rank, rc, err);
        failures++;
        return;
    }
    CHECK(comm_rank(c2) == g->rank && comm_world_size(c2) == 2);
    size_t n = ODD, esz = 4;
    unsigned char *want2 = malloc(n * esz);
    for (int round = 0; round < 3; round++) {
        for (int r = 0; r < 2; r++) gen((char *)b->src[r], COMM_I32, r, 2 * n, 60 + round);
        ops_copy_to_device(g->ops, b->dsend, b->src[g->rank], n * esz);
        ops_copy_to_device(g->ops, b->drecv, (char *)b->src[g->rank] + n * esz, n * esz);
        comm_wait_compute(g->c);
        comm_wait_compute(c2);
        must(g, comm_all_reduce(g->c, b->dsend, n, COMM_I32, COMM_SUM), "all_reduce (first communicator)");
        rc = comm_all_reduce(c2, b->drecv, n, COMM_I32, COMM_MAX);
        if (rc) {
            fprintf(stderr, "rank %d: all_reduce (by id): %s\n", g->rank, comm_error(c2));
            failures++;
        }
        comm_compute_wait(g->c);
        comm_compute_wait(c2);
        reduce_ref(b->want, b->src, 2, 0, n, COMM_I32, COMM_SUM);
        reduce_ref(want2, b->src, 2, n, n, COMM_I32, COMM_MAX);
        ops_copy_to_host(g->ops, b->got, b->dsend, n * esz);
        same(g, "all_reduce beside a communicator joined by id", b->got, b->want, n, COMM_I32, 0);
        ops_copy_to_host(g->ops, b->got, b->drecv, n * esz);
        same(g, "all_reduce on the communicator joined by id", b->got, want2, n, COMM_I32, 0);
    }
    CHECK(comm_barrier(c2) == 0);
    free(want2);
    comm_destroy(c2);
}

// nccl-tests' bus bandwidth at 256 MB: busbw = bytes / time * (n - 1) / n, bytes = the all_gather's output or
// the reduce_scatter's input.
static void bandwidth_test(Rank *g) {
    size_t total = (size_t)256 << 20, w = (size_t)g->world;
    void *s = ops_malloc(g->ops, total), *r = ops_malloc(g->ops, total);
    double bw[2], host_us[2];
    for (int k = 0; k < 2; k++) {
        const int warm = 5, iters = 50;
        double t0 = 0, in_calls = 0;
        for (int i = 0; i < warm + iters; i++) {
            if (i == warm) {
                must(g, comm_synchronize(g->c), "comm_synchronize");
                t0 = now_s();
                in_calls = 0;
            }
            double c0 = now_s();
            if (k == 0) must(g, comm_all_gather(g->c, r, s, total / w / 2, COMM_BF16), "comm_all_gather");
            else must(g, comm_reduce_scatter(g->c, r, s, total / w / 4, COMM_F32, COMM_SUM), "comm_reduce_scatter");
            in_calls += now_s() - c0;
        }
        must(g, comm_synchronize(g->c), "comm_synchronize");
        double t = (now_s() - t0) / iters;
        bw[k] = (double)total / t * (double)(w - 1) / (double)w / 1e9;
        host_us[k] = in_calls / iters * 1e6;
    }
    if (g->rank == 0)
        printf("  bus bandwidth at 256 MB, %zu ranks (nccl-tests busbw): all_gather bf16 %.1f GB/s, reduce_scatter "
               "f32 sum %.1f GB/s (the host spends %.0f / %.0f us in each call)\n", w, bw[0], bw[1], host_us[0],
               host_us[1]);
    // The latency floor: one-element all_reduces back to back.
    const int small = 200;
    double t0 = now_s(), in_calls = 0;
    for (int i = 0; i < small; i++) {
        double c0 = now_s();
        must(g, comm_all_reduce(g->c, r, 1, COMM_F32, COMM_SUM), "comm_all_reduce");
        in_calls += now_s() - c0;
    }
    must(g, comm_synchronize(g->c), "comm_synchronize");
    if (g->rank == 0)
        printf("  one-element all_reduce: %.0f us each back to back (the host spends %.0f us in each call)\n",
               (now_s() - t0) / small * 1e6, in_calls / small * 1e6);
    ops_free(g->ops, s);
    ops_free(g->ops, r);
}

static int main_child(int rank, int port, void *arg) {
    (void)arg;
    Rank g;
    if (rank_open(&g, rank, 2, port, TIMEOUT_MS) != 0) return 1;
    CHECK(comm_rank(g.c) == rank && comm_world_size(g.c) == 2);
    size_t bytes = 2 * BIG;
    Bufs b = {{malloc(bytes), malloc(bytes)}, malloc(bytes), malloc(bytes), ops_malloc(g.ops, bytes),
              ops_malloc(g.ops, bytes)};
    if (!b.src[0] || !b.src[1] || !b.got || !b.want || !b.dsend || !b.drecv) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        return 1;
    }
    collectives_test(&g, &b);
    p2p_test(&g, &b);
    ordering_test(&g, &b);
    refused_test(&g);
    with_id_test(&g, &b);
    bandwidth_test(&g);
    CHECK(comm_synchronize(g.c) == 0);
    free(b.src[0]), free(b.src[1]), free(b.got), free(b.want);
    ops_free(g.ops, b.dsend);
    ops_free(g.ops, b.drecv);
    rank_close(&g);
    return failures ? 1 : 0;
}

static void main_test(void) {
    int codes[2];
    shared_id = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared_id == MAP_FAILED) {
        perror("mmap");
        exit(2);
    }
    shared_flag = (volatile int *)(shared_id + COMM_UNIQUE_ID_BYTES);
    spawn(2, main_child, NULL, 100000, -1, codes);
    report("main", 2, codes, (const int[]){0, 0});
    munmap(shared_id, 4096);
}

// One rank alone: the collectives are copies; joined through comm_create and by id.
static int world1_child(int rank, int port, void *arg) {
    (void)arg;
    Rank g;
    if (rank_open(&g, 0, 1, port, TIMEOUT_MS) != 0) return 1;
    size_t bytes = ODD * 8;
    Bufs b = {{malloc(bytes), NULL}, malloc(bytes), malloc(bytes), ops_malloc(g.ops, bytes), ops_malloc(g.ops, bytes)};
    for (int d = 0; d < 5; d++) {
        CommDtype dt = (CommDtype)d;
        gen(b.src[0], dt, 0, ODD, 80 + d);
        check_one(&g, &b, AR, dt, COMM_SUM, ODD, 0, 0);
        check_one(&g, &b, RS, dt, COMM_MAX, ODD, 0, 0);
        check_one(&g, &b, AG, dt, COMM_SUM, ODD, 1, 0);
        check_one(&g, &b, BC, dt, COMM_SUM, ODD, 0, 0);
    }
    CHECK(comm_barrier(g.c) == 0);
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    char err[COMM_ERR_MAX];
    Comm *c2 = NULL;
    CHECK(comm_unique_id(COMM_BACKEND_NCCL, id, err, sizeof err) == 0);
    CHECK(comm_create_with_id(&c2, COMM_BACKEND_NCCL, id, 0, 1, TIMEOUT_MS, g.ops, err, sizeof err) == 0);
    if (c2) {
        Comm *keep = g.c;
        g.c = c2;
        check_one(&g, &b, AR, COMM_F32, COMM_SUM, ODD, 0, 0);
        g.c = keep;
        comm_destroy(c2);
    }
    free(b.src[0]), free(b.got), free(b.want);
    ops_free(g.ops, b.dsend);
    ops_free(g.ops, b.drecv);
    rank_close(&g);
    return failures ? 1 : 0;
}

static void world1_test(void) {
    int codes[1];
    spawn(1, world1_child, NULL, 30000, -1, codes);
    report("world1", 1, codes, (const int[]){0});
}

// Rank 1 stops in the middle: it exits abruptly (exit_peer) or sleeps. Rank 0's next collective must fail within
// the timeout + 2 s, naming the call and rank 1, without leaving its compute stream stuck.
static int failure_child(int rank, int port, void *arg) {
    int exit_peer = *(const int *)arg;
    const int timeout = 3000;
    Rank g;
    if (rank_open(&g, rank, 2, port, TIMEOUT_MS) != 0) return 1;
    size_t n = (size_t)1 << 20;
    void *buf = ops_malloc(g.ops, n * 4);
    CHECK(comm_set_timeout(g.c, timeout) == 0);
    must(&g, comm_all_reduce(g.c, buf, n, COMM_F32, COMM_SUM), "comm_all_reduce");
    must(&g, comm_synchronize(g.c), "comm_synchronize");
    if (rank == 1) {
        fflush(stdout);
        fflush(stderr);
        if (exit_peer) _exit(0);   // no comm_destroy: the process is just gone
        for (;;) pause();          // alive, never calls again; the parent kills it
    }
    int64_t t0 = now_ms();
    int rc1 = comm_all_reduce(g.c, buf, n, COMM_F32, COMM_SUM);
    comm_compute_wait(g.c);        // the compute stream now waits for the doomed collective
    int rc2 = comm_synchronize(g.c);
    int64_t waited = now_ms() - t0;
    char msg[COMM_ERR_MAX];
    snprintf(msg, sizeof msg, "%s", comm_error(g.c));
    printf("  %s: comm_synchronize -> %d after %lld ms: %s\n", exit_peer ? "exit" : "hang", rc2, (long long)waited, msg);
    // A peer that exits may be noticed (by NCCL or the side channel) before the call is even queued: then the
    // call itself fails, naming rank 1 all the same.
    CHECK(rc1 == 0 || (exit_peer && rc1 == COMM_ERR_PEER && rc2 == COMM_ERR_FAILED));
    int rc = rc1 ? rc1 : rc2;
    CHECK(exit_peer ? rc == COMM_ERR_PEER || rc == COMM_ERR_TIMEOUT : rc == COMM_ERR_TIMEOUT);
    CHECK(waited < timeout + 2000);
    if (rc1 == 0) CHECK(strstr(msg, "all_reduce (call #2: count 1048576, f32, sum; 4194304 bytes)") != NULL);
    CHECK(strstr(msg, "rank 1 (host ") != NULL);
    CHECK(strstr(msg, exit_peer ? "went away" : "has queued 1 NCCL operations where this one is #2") != NULL);
    int64_t t1 = now_ms();
    ops_synchronize(g.ops);        // the abort let the collective's kernels exit
    CHECK(ops_status(g.ops) == 0 && now_ms() - t1 < 5000);
    CHECK(comm_all_reduce(g.c, buf, n, COMM_F32, COMM_SUM) == COMM_ERR_FAILED);
    CHECK(comm_synchronize(g.c) == COMM_ERR_FAILED && strcmp(comm_error(g.c), msg) == 0);
    t1 = now_ms();
    comm_destroy(g.c);
    CHECK(now_ms() - t1 < 5000);
    ops_free(g.ops, buf);
    ops_destroy(g.ops);
    return failures ? 1 : 0;
}

static void failure_test(int exit_peer) {
    int codes[2];
    spawn(2, failure_child, &exit_peer, 40000, 3000, codes);
    report(exit_peer ? "exit" : "hang", 2, codes, (const int[]){0, exit_peer ? 0 : -1});
}

// Rank 1 never comes to the rendezvous: rank 0 names it after its timeout.
static int missing_child(int rank, int port, void *arg) {
    (void)rank, (void)arg;
    OpsCtx *ops = NULL;
    char err[COMM_ERR_MAX] = "";
    if (ops_create(&ops, OPS_BACKEND_CUDA, 0, err, sizeof err) != 0) {
        fprintf(stderr, "ops_create: %s\n", err);
        return 1;
    }
    CommInit ci = {.rank = 0, .world_size = 2, .master_port = port, .timeout_ms = 1500};
    snprintf(ci.master_addr, sizeof ci.master_addr, "127.0.0.1");
    Comm *c = NULL;
    int64_t t0 = now_ms();
    int rc = comm_create(&c, COMM_BACKEND_NCCL, &ci, ops, err, sizeof err);
    int64_t waited = now_ms() - t0;
    printf("  missing: comm_create -> %d after %lld ms: %s\n", rc, (long long)waited, err);
    CHECK(rc == COMM_ERR_PEER && c == NULL);
    CHECK(strstr(err, "rank 1") && strstr(err, "did not arrive"));
    CHECK(waited < 1500 + 2000);
    ops_destroy(ops);
    return failures ? 1 : 0;
}

// Rank 1 comes to the rendezvous (with a probe socket, as the nccl backend does) but not to NCCL's init, and
// leaves: rank 0's join fails after its timeout, naming rank 1, and NCCL's half-done init is abandoned.
static void joining_state(void *arg, CommProbeState *out) {
    (void)arg;
    out->phase = COMM_PROBE_JOINING;
    out->queued = out->completed = 0;
}

static int init_child(int rank, int port, void *arg) {
    (void)arg;
    char err[COMM_ERR_MAX] = "";
    if (rank == 1) {
        char ep[RDZV_ENDPOINT_MAX];
        CommProbe *p = NULL;
        Rendezvous *rz = NULL;
        RdzvConfig cfg = {.rank = 1, .world_size = 2, .master_addr = "127.0.0.1", .master_port = port,
                          .timeout_ms = 10000, .endpoint = ep};
        int rc = comm_probe_bind(&p, 1, 2, "127.0.0.1", port, ep, sizeof ep, err, sizeof err);
        if (rc == 0) rc = rendezvous_run(&rz, &cfg, NULL, 0, err, sizeof err);
        if (rc == 0) rc = comm_probe_start(p, rendezvous_peers(rz), joining_state, NULL, err, sizeof err);
        if (rc != 0) {
            fprintf(stderr, "init rank 1: %s\n", err);
            return 1;
        }
        usleep(500000);
        fflush(stdout);
        _exit(0);   // gone without joining NCCL
    }
    OpsCtx *ops = NULL;
    if (ops_create(&ops, OPS_BACKEND_CUDA, 0, err, sizeof err) != 0) {
        fprintf(stderr, "ops_create: %s\n", err);
        return 1;
    }
    CommInit ci = {.rank = 0, .world_size = 2, .master_port = port, .timeout_ms = 3000};
    snprintf(ci.master_addr, sizeof ci.master_addr, "127.0.0.1");
    Comm *c = NULL;
    int64_t t0 = now_ms();
    int rc = comm_create(&c, COMM_BACKEND_NCCL, &ci, ops, err, sizeof err);
    int64_t waited = now_ms() - t0;
    printf("  init: comm_create -> %d after %lld ms: %s\n", rc, (long long)waited, err);
    CHECK(rc == COMM_ERR_PEER && c == NULL);
    CHECK(strstr(err, "could not join the NCCL communicator of 2 ranks within 3000 ms") != NULL);
    CHECK(strstr(err, "rank 1 (host ") && strstr(err, "went away"));
    CHECK(waited < 3000 + 2000);
    ops_destroy(ops);
    return failures ? 1 : 0;
}

static void init_test(void) {
    int codes[2];
    spawn(2, init_child, NULL, 20000, 2000, codes);
    report("init", 2, codes, (const int[]){0, 0});
}

static void missing_test(void) {
    int codes[1];
    spawn(1, missing_child, NULL, 20000, -1, codes);
    report("missing", 1, codes, (const int[]){0});
}
#endif

int main(int argc, char **argv) {
    setenv("NCCL_NVLS_ENABLE", "0", 0);   // NVLink multicast can take a shared host's GPUs down (gpu/README)
    int all = argc < 2;
#define WANT(name) (all || want_scenario(argc, argv, name))
    if (WANT("api")) api_checks();
    if (WANT("probe")) probe_test();
#ifndef TANDEM_HAVE_CUDA
    if (failures) return 1;
    printf("skip: this build has no CUDA, so no nccl backend (the API and side-channel checks passed)\n");
    return 77;
#else
    int gpus = gpu_count();
    if (gpus < 2) {
        if (failures) return 1;
        printf("skip: %d CUDA device(s) with a working NCCL here; the nccl tests need 2 (API and side-channel checks "
               "passed)\n", gpus);
        return 77;
    }
    if (WANT("missing")) missing_test();
    if (WANT("main")) main_test();
    if (WANT("world1")) world1_test();
    if (WANT("exit")) failure_test(1);
    if (WANT("hang")) failure_test(0);
    if (WANT("init")) init_test();
    printf("%s\n", failures ? "FAILED" : "all passed");
    return failures ? 1 : 0;
#endif
}
