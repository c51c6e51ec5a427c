// shared/comm/comm_nccl.c — the `nccl` backend of comm.h: an NCCL communicator on the OpsCtx's GPU, a
// communication stream beside its compute stream, and a watchdog that turns a stalled call into an error.
//
// Joining: rank 0 makes the NCCL unique id and hands it out as the rendezvous blob (shared/comm/rendezvous.h). The
// communicator is non-blocking (ncclConfig_t.blocking = 0): joining and every NCCL call return at once, with
// ncclInProgress while NCCL finishes queuing in the background (polled with ncclCommGetAsyncError), so that no
// call can hang the caller and a stalled communicator can be abandoned (ncclCommAbort).
//
// Threads: the caller's thread makes every call; per communicator a watchdog thread watches what is queued and
// a responder thread answers the peers' liveness probes. Every NCCL call on the communicator, the queue of
// records and the failure state are guarded by Nccl.mu. The caller's Comm is touched by the caller only: it
// learns about the watchdog's verdict through comm_nccl_poll (comm.c calls it at the start of every call).
//
// Watchdog. A call queued outside a group (a whole group counts as one) gets a record with two events on the
// communication stream, `start` before it and `end` after it. Every tick the watchdog drops records whose `end`
// has completed and notes when the oldest record's `start` completed: from then on the calls and compute work
// it waits for are done and only the peers can hold it up. It trips when
//   - that was timeout_ms ago (COMM_ERR_TIMEOUT);
//   - a peer's process went away (its side-channel connection closed, or, for a communicator joined by id, the
//     caller's CommPeerWatch says so) and the oldest record has been stuck for GONE_GRACE_MS since both (or the
//     timeout, if shorter) (COMM_ERR_PEER); while joining, a watched member gone for GONE_GRACE_MS;
//   - NCCL reports an asynchronous error (a network failure, a remote error);
//   - joining has not finished timeout_ms after it began.
// Tripping probes the peers to name the culprit, records the message and aborts the communicator: NCCL's kernels
// see its abort flag and exit, so nothing queued behind them (the compute stream included) stays stuck.
//
// CUDA graphs (comm.h). A call made while the calling thread records a graph on the compute context is issued on
// the recording's stream and lands in the graph, with no record: NCCL makes it a persistent plan that the graph owns.
// comm_graph_launch watches each replay with a record whose events bracket the launch on the compute stream. NCCL's
// teardown of a communicator waits until no graph holds its plans, so once a call has been recorded an abort is not
// run under mu on the thread that found the failure: the watchdog runs it outside mu, where NCCL sets its abort flag
// at once (the kernels, those of a replay too, exit) and then waits for the owner of the graphs to destroy them.
//
// Side channel (shared/comm/comm_probe.c; ranks that joined through the rendezvous, world > 1): each rank publishes a
// ZeroMQ probe socket in the rendezvous; a peer whose process exits is seen at once (its connection closes), and
// a diagnosis asks every peer how far it got, naming the ones that went away, do not answer, or have not
// reached the stalled call.
#include "shared/comm/comm_internal.h"

#include <cuda_runtime.h>
#include <errno.h>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

_Static_assert(sizeof(ncclUniqueId) == COMM_UNIQUE_ID_BYTES, "comm.h's unique id is NCCL's");

#define RING_CAP 1024              // records in flight; a caller that gets this far ahead waits for the device
#define WATCH_TICK_MS 1            // watchdog period
#define GONE_GRACE_MS COMM_GONE_GRACE_MS   // see "Watchdog"
#define SPIN_POLLS 4000            // polls that yield before polling sleeps (a few ms): see settle()

enum { K_ALL_GATHER, K_REDUCE_SCATTER, K_ALL_REDUCE, K_BROADCAST, K_SEND, K_RECV, K_BARRIER, K_GROUP, K_GRAPH };
static const char *const KIND[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "send", "recv",
                                   "barrier", "group", "graph replay"};

// One NCCL call as the caller made it.
typedef struct {
    int kind;
    const void *send;
    void *recv;
    size_t count;
    CommDtype dtype;
    CommOp op;
    int arg;                       // root (broadcast) or peer (send, recv)
    size_t bytes;                  // the larger buffer (for messages)
} Op;

// A queued call (or group) in the watchdog's ring.
typedef struct {
    cudaEvent_t start, end;        // created when the slot is first used, then reused
    int kind;
    uint64_t call_first, call_last;// comm.h call numbers ("call #n")
    uint64_t seq;                  // NCCL operations queued up to and including this one (compared with peers')
    size_t count, bytes;
    CommDtype dtype;
    int arg;                       // op, root or peer
    int nsend, nrecv, ncoll;       // group: what it holds
    int ended;                     // fully in the stream (`end` recorded)
    int64_t started_ms;            // when the watchdog saw `start` complete; 0: not yet
} Rec;

typedef struct {
    int rank, world, device;
    int blocking;                  // NCCL's blocking mode (calls can be recorded into graphs)
    ncclComm_t comm;
    cudaStream_t stream;           // communication stream
    cudaStream_t compute;          // the OpsCtx's compute stream
    cudaEvent_t ev_compute, ev_comm;
    int *scratch;                  // (1) device int for comm_barrier
    Rec grp;                       // the group being built (caller's thread)

    pthread_mutex_t mu;            // guards the fields below and every NCCL call on comm
    pthread_cond_t cv;             // ring space freed, or a failure recorded
    Rec *ring;                     // (RING_CAP) slot = ticket % RING_CAP
    uint64_t pushed, popped;
    int group_depth;
    int timeout_ms;
    int init_pending;
    int64_t init_started_ms;
    int fail_code;                 // the watchdog's (or the first) failure; 0 if none
    char fail_msg[COMM_ERR_MAX];
    int aborted;                   // ncclCommAbort was called: comm is gone
    int recorded;                  // a call was recorded into a graph: aborts run on the watchdog (see "CUDA graphs")
    int abort_pending;             // the watchdog is to abort comm

    atomic_int stop;
    atomic_int phase;                  // COMM_PROBE_*
    atomic_ullong queued, completed;   // NCCL operations, for the peers' probes
    pthread_t watch;
    int watch_running;
    CommProbe *probe;                  // NULL without a peer table; the watchdog's once it runs
    CommPeerWatch peer_watch;          // the caller's view of the members (joined by id); gone_ms NULL: none
} Nccl;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

// "file:line: call: reason (NCCL's last message)"
static void nccl_what(char *out, size_t len, ncclResult_t r, const char *call, const char *file, int line) {
    const char *last = ncclGetLastError(NULL);
    int detail = last && *last;
    snprintf(out, len, "%s:%d: %s: %s%s%s%s", file, line, call, ncclGetErrorString(r), detail ? " (" : "",
             detail ? last : "", detail ? ")" : "");
}

static int nccl_code(ncclResult_t r) { return r == ncclRemoteError ? COMM_ERR_PEER : COMM_ERR_SYSTEM; }

static ncclDataType_t nccl_dtype(CommDtype d) {
    switch (d) {
    case COMM_F32: return ncclFloat32;
    case COMM_BF16: return ncclBfloat16;
    case COMM_I32: return ncclInt32;
    case COMM_U8: return ncclUint8;
    case COMM_F64: return ncclFloat64;
    }
    return ncclFloat32;   // comm.c refused anything else
}

// "all_reduce (call #42: count 1048576, f32, sum; 4194304 bytes)" / "group (calls #7-#8: 1 send, 1 recv; ...)".
static void describe(char *out, size_t len, const Rec *r) {
    if (r->kind == K_GRAPH) {
        snprintf(out, len, "graph replay (a CUDA graph holding recorded calls, queued after call #%llu)",
                 (unsigned long long)r->call_first);
        return;
    }
    if (r->kind == K_GROUP) {
        snprintf(out, len, "group (calls #%llu-#%llu: %d send, %d recv, %d collective; %zu bytes)",
                 (unsigned long long)r->call_first, (unsigned long long)r->call_last, r->nsend, r->nrecv, r->ncoll,
                 r->bytes);
        return;
    }
    char arg[32] = "";
    if (r->kind == K_REDUCE_SCATTER || r->kind == K_ALL_REDUCE)
        snprintf(arg, sizeof arg, ", %s", r->arg == COMM_MAX ? "max" : "sum");
    else if (r->kind == K_BROADCAST)
        snprintf(arg, sizeof arg, ", root %d", r->arg);
    else if (r->kind == K_SEND || r->kind == K_RECV)
        snprintf(arg, sizeof arg, ", peer %d", r->arg);
    snprintf(out, len, "%s (call #%llu: count %zu, %s%s; %zu bytes)", KIND[r->kind], (unsigned long long)r->call_first,
             r->count, comm_dtype_name(r->dtype), arg, r->bytes);
}

// ---- failure state -----------------------------------------------------------------------------

// With mu held, after fail_code is set. Inside a group the caller's thread has NCCL calls pending in its
// thread-local group: the abort waits until comm_group_end has handed them to NCCL.
// After a call was recorded into a graph, ncclCommAbort would block (with mu held) until the graphs are destroyed: the
// watchdog runs it then (watch_abort).
static void abort_locked(Nccl *h) {
    atomic_store(&h->phase, COMM_PROBE_FAILED);
    pthread_cond_broadcast(&h->cv);
    if (!h->comm || h->aborted || h->group_depth > 0) return;
    if (h->recorded) {
        h->abort_pending = 1;
        return;
    }
    ncclCommAbort(h->comm);   // its own failure has nothing to add: the communicator is gone either way
    h->aborted = 1;
}

int comm_nccl_poll(Comm *c) {
    Nccl *h = c->impl;
    char msg[COMM_ERR_MAX];
    pthread_mutex_lock(&h->mu);
    int code = h->fail_code;
    if (code) memcpy(msg, h->fail_msg, sizeof msg);
    pthread_mutex_unlock(&h->mu);
    return code ? comm_fail(c, code, "%s", msg) : 0;
}

// A failure found on the caller's thread: the first failure wins (the watchdog may have found one already),
// and anything but COMM_ERR_INVALID aborts the communicator.
static int fail_main(Comm *c, Nccl *h, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int fail_main(Comm *c, Nccl *h, int code, const char *fmt, ...) {
    char msg[COMM_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&h->mu);
    if (h->fail_code) {
        code = h->fail_code;
        memcpy(msg, h->fail_msg, sizeof msg);
    } else if (code != COMM_ERR_INVALID) {
        h->fail_code = code;
        memcpy(h->fail_msg, msg, sizeof msg);
        abort_locked(h);
    }
    pthread_mutex_unlock(&h->mu);
    return comm_fail(c, code, "%s", msg);
}

#define CUDA_FAIL(c, h, e, call) \
    fail_main(c, h, COMM_ERR_SYSTEM, "comm nccl: %s:%d: %s: %s", __FILE__, __LINE__, call, cudaGetErrorString(e))

// ---- watchdog ----------------------------------------------------------------------------------

typedef struct {
    int code;                      // 0: nothing to report
    int init;
    uint64_t seq;
    char head[512];
} Trip;

// When member p was last seen going away: by the side channel, else by the caller's watch; 0: never.
static int64_t member_gone_ms(const Nccl *h, int p) {
    int64_t at = h->probe ? comm_probe_gone_ms(h->probe, p) : 0;
    if (!at && h->peer_watch.gone_ms && p != h->rank) at = h->peer_watch.gone_ms(h->peer_watch.arg, p);
    return at;
}

// A member gone since `since` (ms) for at least `grace` ms, or -1.
static int gone_member(const Nccl *h, int64_t since, int64_t grace, int64_t now) {
    for (int p = 0; p < h->world; p++) {
        int64_t at = member_gone_ms(h, p);
        if (at && at >= since && now - at >= grace) return p;
    }
    return -1;
}

// "member p (<the watch's name>)" or "member p".
static void member_name(const Nccl *h, int p, char *out, size_t len) {
    char what[256] = "";
    if (h->peer_watch.name) h->peer_watch.name(h->peer_watch.arg, p, what, sizeof what);
    snprintf(out, len, "member %d%s%s%s", p, what[0] ? " (" : "", what, what[0] ? ")" : "");
}

// One look at the queue, mu held. Fills t when something must fail.
static void watch_check(Nccl *h, Trip *t) {
    int64_t now = now_ms();
    char desc[256] = "";
    // Completed records leave the ring (oldest first: the stream runs them in order).
    while (h->pushed > h->popped) {
        Rec *r = &h->ring[h->popped % RING_CAP];
        if (!r->ended) break;
        cudaError_t e = cudaEventQuery(r->end);
        if (e == cudaErrorNotReady) break;
        if (e != cudaSuccess) {
            t->code = COMM_ERR_SYSTEM;
            t->seq = r->seq;
            describe(desc, sizeof desc, r);
            snprintf(t->head, sizeof t->head, "comm nccl %s: %s:%d: cudaEventQuery: %s", desc, __FILE__, __LINE__,
                     cudaGetErrorString(e));
            return;
        }
        atomic_fetch_add(&h->completed, (unsigned long long)(r->kind == K_GROUP   ? r->nsend + r->nrecv + r->ncoll
                                                             : r->kind == K_GRAPH ? 0
                                                                                  : 1));
        h->popped++;
        pthread_cond_broadcast(&h->cv);
    }
    Rec *r = h->pushed > h->popped ? &h->ring[h->popped % RING_CAP] : NULL;   // the oldest call not done
    if (r) {
        describe(desc + 1, sizeof desc - 1, r);
        desc[0] = ' ';
        t->seq = r->seq;
    }
    if (h->comm) {   // NCCL's own asynchronous errors: a network failure, a remote error
        ncclResult_t st = ncclSuccess, q = ncclCommGetAsyncError(h->comm, &st);
        if (q != ncclSuccess || (st != ncclSuccess && st != ncclInProgress)) {
            char what[384];
            nccl_what(what, sizeof what, q != ncclSuccess ? q : st, "ncclCommGetAsyncError", __FILE__, __LINE__);
            t->code = nccl_code(q != ncclSuccess ? q : st);
            t->init = h->init_pending;
            if (!r) t->seq = atomic_load(&h->queued);
            snprintf(t->head, sizeof t->head, "comm nccl%s: NCCL reported an error: %s", desc, what);
            return;
        }
    }
    if (h->init_pending) {
        int gone = h->peer_watch.gone_ms ? gone_member(h, h->init_started_ms, GONE_GRACE_MS, now) : -1;
        if (gone >= 0) {
            char who[320];
            member_name(h, gone, who, sizeof who);
            t->code = COMM_ERR_PEER;
            t->init = 1;
            snprintf(t->head, sizeof t->head, "comm nccl: rank %d could not join the NCCL communicator of %d ranks: "
                     "%s went away", h->rank, h->world, who);
            return;
        }
        if (now - h->init_started_ms >= h->timeout_ms) {
            t->code = COMM_ERR_TIMEOUT;
            t->init = 1;
            snprintf(t->head, sizeof t->head, "comm nccl: rank %d could not join the NCCL communicator of %d ranks "
                     "within %d ms", h->rank, h->world, h->timeout_ms);
        }
        return;
    }
    if (!r) return;
    if (!r->started_ms) {
        cudaError_t e = cudaEventQuery(r->start);
        if (e == cudaSuccess) r->started_ms = now;
        else if (e != cudaErrorNotReady) {
            t->code = COMM_ERR_SYSTEM;
            snprintf(t->head, sizeof t->head, "comm nccl%s: %s:%d: cudaEventQuery: %s", desc, __FILE__, __LINE__,
                     cudaGetErrorString(e));
            return;
        }
    }
    if (!r->started_ms) return;
    int64_t stuck = now - r->started_ms, grace = h->timeout_ms < GONE_GRACE_MS ? h->timeout_ms : GONE_GRACE_MS;
    int gone = -1;
    for (int p = 0; p < h->world && gone < 0; p++) {
        int64_t at = member_gone_ms(h, p), since = at > r->started_ms ? at : r->started_ms;
        if (at && now - since >= grace) gone = p;
    }
    char who[320] = "a peer";
    if (gone >= 0 && !h->probe) member_name(h, gone, who, sizeof who);
    if (gone >= 0)
        snprintf(t->head, sizeof t->head, "comm nccl%s: not complete %lld ms after it could start, and %s went "
                 "away", desc, (long long)stuck, who);
    else if (stuck >= h->timeout_ms)
        snprintf(t->head, sizeof t->head, "comm nccl%s: not complete %lld ms after it could start (comm timeout %d ms)",
                 desc, (long long)stuck, h->timeout_ms);
    else
        return;
    t->code = gone >= 0 ? COMM_ERR_PEER : COMM_ERR_TIMEOUT;
}

// Names the culprits, records the failure and aborts the communicator.
static void watch_trip(Nccl *h, const Trip *t) {
    char diag[COMM_ERR_MAX] = "";
    int gone = 0;
    if (h->probe) gone = comm_probe_diagnose(h->probe, t->seq, t->init, diag, sizeof diag);
    else if (h->world > 1 && !h->peer_watch.gone_ms)
        snprintf(diag, sizeof diag, "; the peers cannot be named (joined by id: no peer table)");
    pthread_mutex_lock(&h->mu);
    if (!h->fail_code) {
        h->fail_code = gone ? COMM_ERR_PEER : t->code;   // a peer that went away explains the rest
        snprintf(h->fail_msg, sizeof h->fail_msg, "%s%s. The communicator was aborted.", t->head, diag);
        abort_locked(h);
    }
    pthread_mutex_unlock(&h->mu);
}

// The abort of a communicator whose calls were recorded into graphs (abort_locked): outside mu, since NCCL returns
// only once those graphs are destroyed; nobody else calls into comm meanwhile (every call checks fail_code first).
static void watch_abort(Nccl *h) {
    pthread_mutex_lock(&h->mu);
    const int go = h->abort_pending && !h->aborted && h->group_depth == 0;
    if (go) h->abort_pending = 0;
    pthread_mutex_unlock(&h->mu);
    if (!go) return;
    ncclCommAbort(h->comm);
    pthread_mutex_lock(&h->mu);
    h->aborted = 1;
    pthread_mutex_unlock(&h->mu);
}

static void *watch_main(void *arg) {
    Nccl *h = arg;
    // Event queries and ncclCommAbort act on the communicator's device; the current device is per thread.
    cudaError_t e = cudaSetDevice(h->device);
    if (e != cudaSuccess) {
        Trip t = {.code = COMM_ERR_SYSTEM};
        snprintf(t.head, sizeof t.head, "comm nccl: %s:%d: watchdog cudaSetDevice(%d): %s", __FILE__, __LINE__,
                 h->device, cudaGetErrorString(e));
        watch_trip(h, &t);
    }
    while (!atomic_load(&h->stop)) {
        if (h->probe) comm_probe_watch(h->probe, WATCH_TICK_MS);   // wakes early for a disconnect
        else sleep_us(WATCH_TICK_MS * 1000);
        Trip t = {0};
        pthread_mutex_lock(&h->mu);
        if (!h->fail_code) watch_check(h, &t);
        pthread_mutex_unlock(&h->mu);
        if (t.code) watch_trip(h, &t);
        watch_abort(h);
    }
    return NULL;
}

// ---- set-up and tear-down ----------------------------------------------------------------------

// Releases everything; graceful: flush the communicator (ncclCommFinalize, bounded by the timeout) instead of
// aborting it. Handles a partly built state.
static void nccl_free(Nccl *h, int graceful) {
    if (h->watch_running) {
        atomic_store(&h->stop, 1);
        pthread_join(h->watch, NULL);
    }
    if (h->comm && !h->aborted) {
        // The watchdog is gone: this thread is the only user of comm from here on.
        int done = 0;
        ncclResult_t r = graceful ? ncclCommFinalize(h->comm) : ncclInternalError;
        for (int64_t deadline = now_ms() + h->timeout_ms; graceful && (r == ncclSuccess || r == ncclInProgress);) {
            ncclResult_t st = ncclInProgress;
            r = ncclCommGetAsyncError(h->comm, &st);
            if (r == ncclSuccess && st == ncclSuccess) {
                done = 1;
                break;
            }
            if (r != ncclSuccess || st != ncclInProgress || now_ms() > deadline) break;
            sleep_us(1000);
        }
        if (done) ncclCommDestroy(h->comm);
        else ncclCommAbort(h->comm);   // teardown: nobody is left to hear a failure
    }
    comm_probe_close(h->probe);
    // Teardown is best effort: these return at once and release what is still in use when the device is done.
    for (int i = 0; h->ring && i < RING_CAP; i++) {
        if (h->ring[i].start) cudaEventDestroy(h->ring[i].start);
        if (h->ring[i].end) cudaEventDestroy(h->ring[i].end);
    }
    if (h->ev_compute) cudaEventDestroy(h->ev_compute);
    if (h->ev_comm) cudaEventDestroy(h->ev_comm);
    if (h->scratch) cudaFreeAsync(h->scratch, h->stream);
    if (h->stream) cudaStreamDestroy(h->stream);
    cudaGetLastError();
    free(h->ring);
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
}

#define CREATE_CUDA(call)                                                                                    \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) {                                                                             \
            snprintf(err, err_len, "comm nccl: %s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            rc = COMM_ERR_SYSTEM;                                                                            \
            goto fail;                                                                                       \
        }                                                                                                    \
    } while (0)
#define CREATE_NCCL(call)                                                                                    \
    do {                                                                                                     \
        ncclResult_t r_ = (call);                                                                            \
        if (r_ != ncclSuccess && r_ != ncclInProgress) {                                                     \
            char what_[512];                                                                                 \
            nccl_what(what_, sizeof what_, r_, #call, __FILE__, __LINE__);                                   \
            snprintf(err, err_len, "comm nccl: %s", what_);                                                  \
            rc = nccl_code(r_);                                                                              \
            goto fail;                                                                                       \
        }                                                                                                    \
    } while (0)

// The peers' answer to a probe (responder thread).
static void probe_state(void *arg, CommProbeState *out) {
    Nccl *h = arg;
    out->phase = (uint32_t)atomic_load(&h->phase);
    out->queued = atomic_load(&h->queued);
    out->completed = atomic_load(&h->completed);
}

// The rendezvous: publishes this rank's probe endpoint, gets the peer table and rank 0's unique id, and starts
// the side channel.
static int meet(Nccl *h, const CommInit *ci, ncclUniqueId *uid, char *err, size_t err_len) {
    char ep[RDZV_ENDPOINT_MAX];
    int rc = comm_probe_bind(&h->probe, h->rank, h->world, ci->master_addr, ci->master_port, ep, sizeof ep, err,
                             err_len);
    if (rc) return rc;
    RdzvConfig rc_cfg = {.rank = h->rank, .world_size = h->world, .master_addr = ci->master_addr,
                         .master_port = ci->master_port, .port_source = ci->port_source[0] ? ci->port_source : NULL,
                         .timeout_ms = ci->timeout_ms, .endpoint = ep,
                         .node = ci->node, .nnodes = ci->nnodes, .local_world_size = ci->local_world_size,
                         .progress = ci->progress, .progress_arg = ci->progress_arg};
    Rendezvous *rz = NULL;
    if (rendezvous_run(&rz, &rc_cfg, uid, sizeof *uid, err, err_len) != 0) return COMM_ERR_PEER;
    size_t blob_len = 0;
    const void *blob = rendezvous_blob(rz, &blob_len);
    if (blob_len != sizeof *uid) {
        snprintf(err, err_len, "comm nccl: rank 0 handed out %zu bytes instead of a %zu-byte NCCL unique id (does "
                 "rank 0 use the host backend?)", blob_len, sizeof *uid);
        rendezvous_close(rz);
        return COMM_ERR_PEER;
    }
    memcpy(uid, blob, sizeof *uid);
    rc = comm_probe_start(h->probe, rendezvous_peers(rz), probe_state, h, err, err_len);
    rendezvous_close(rz);
    return rc;
}

int comm_nccl_create(Comm *c, const CommInit *ci, const uint8_t *id, const CommPeerWatch *watch, int blocking,
                     char *err, size_t err_len) {
    Nccl *h = calloc(1, sizeof *h);
    if (!h) {
        snprintf(err, err_len, "comm nccl: out of memory");
        return COMM_ERR_SYSTEM;
    }
    int rc = COMM_ERR_SYSTEM;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    h->rank = c->rank;
    h->world = c->world;
    h->timeout_ms = c->timeout_ms;
    h->blocking = blocking != 0;
    if (watch) h->peer_watch = *watch;
    h->device = ops_cuda_device(c->ops);
    h->compute = (cudaStream_t)ops_cuda_stream(c->ops);
    h->ring = calloc(RING_CAP, sizeof *h->ring);
    if (!h->ring) {
        snprintf(err, err_len, "comm nccl: out of memory");
        goto fail;
    }
    if (h->device < 0 || !h->compute) {
        snprintf(err, err_len, "comm nccl: the compute context has no CUDA device or stream");
        rc = COMM_ERR_INVALID;
        goto fail;
    }
    int least = 0, greatest = 0;
    CREATE_CUDA(cudaSetDevice(h->device));
    // Highest priority: a collective that overlaps compute (ZeRO-3 prefetch) gets SMs as soon as it can run.
    CREATE_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CREATE_CUDA(cudaStreamCreateWithPriority(&h->stream, cudaStreamNonBlocking, greatest));
    CREATE_CUDA(cudaEventCreateWithFlags(&h->ev_compute, cudaEventDisableTiming));
    CREATE_CUDA(cudaEventCreateWithFlags(&h->ev_comm, cudaEventDisableTiming));
    CREATE_CUDA(cudaMallocAsync((void **)&h->scratch, sizeof(int), h->stream));
    CREATE_CUDA(cudaMemsetAsync(h->scratch, 0, sizeof(int), h->stream));

    ncclUniqueId uid;
    memset(&uid, 0, sizeof uid);
    if (id) {
        memcpy(&uid, id, sizeof uid);
    } else {
        if (h->rank == 0) CREATE_NCCL(ncclGetUniqueId(&uid));
        if (h->world > 1 && (rc = meet(h, ci, &uid, err, err_len)) != 0) goto fail;
    }

    h->init_pending = 1;
    h->init_started_ms = now_ms();
    if (pthread_create(&h->watch, NULL, watch_main, h) != 0) {
        snprintf(err, err_len, "comm nccl: cannot start the watchdog thread");
        rc = COMM_ERR_SYSTEM;
        goto fail;
    }
    h->watch_running = 1;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = blocking ? 1 : 0;
    pthread_mutex_lock(&h->mu);
    ncclResult_t r = ncclCommInitRankConfig(&h->comm, h->world, uid, h->rank, &cfg);
    pthread_mutex_unlock(&h->mu);
    CREATE_NCCL(r);
    // Joining runs in NCCL's background thread; the watchdog aborts it after the timeout.
    for (;;) {
        pthread_mutex_lock(&h->mu);
        if (h->fail_code) {
            snprintf(err, err_len, "%s", h->fail_msg);
            rc = h->fail_code;
            pthread_mutex_unlock(&h->mu);
            goto fail;
        }
        ncclResult_t st = ncclInProgress, q = ncclCommGetAsyncError(h->comm, &st);
        if (q == ncclSuccess && st == ncclSuccess) h->init_pending = 0;
        pthread_mutex_unlock(&h->mu);
        CREATE_NCCL(q);
        CREATE_NCCL(st);
        if (st == ncclSuccess) break;
        sleep_us(1000);
    }
    atomic_store(&h->phase, COMM_PROBE_READY);
    c->impl = h;
    return 0;
fail:
    nccl_free(h, 0);
    return rc;
}

void comm_nccl_destroy(Comm *c) {
    Nccl *h = c->impl;
    if (!h) return;
    cudaSetDevice(h->device);
    while (h->group_depth > 0) comm_nccl_group_end(c);   // a group left open: hand its calls to NCCL first
    int graceful = !c->failed && comm_nccl_poll(c) == 0 && comm_nccl_synchronize(c) == 0;
    nccl_free(h, graceful);
    c->impl = NULL;
}

void comm_nccl_destroy_now(Comm *c) {
    Nccl *h = c->impl;
    if (!h) return;
    cudaSetDevice(h->device);
    while (h->group_depth > 0) comm_nccl_group_end(c);
    nccl_free(h, 0);
    c->impl = NULL;
}

int comm_nccl_unique_id(uint8_t id[COMM_UNIQUE_ID_BYTES], char *err, size_t err_len) {
    ncclUniqueId uid;
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) {
        char what[512];
        nccl_what(what, sizeof what, r, "ncclGetUniqueId", __FILE__, __LINE__);
        snprintf(err, err_len, "comm nccl: %s", what);
        return nccl_code(r);
    }
    memcpy(id, &uid, sizeof uid);
    return 0;
}

int comm_nccl_available(void) {
    int n = 0, v = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();   // the sticky "no device" error
        return 0;
    }
    return n > 0 && ncclGetVersion(&v) == ncclSuccess && v > 0;
}

void comm_nccl_set_timeout(Comm *c, int timeout_ms) {
    Nccl *h = c->impl;
    pthread_mutex_lock(&h->mu);
    h->timeout_ms = timeout_ms;
    pthread_mutex_unlock(&h->mu);
}

// ---- calls -------------------------------------------------------------------------------------

// Hands one call to NCCL on stream s: the communication stream, or a graph's recording stream (mu held).
static ncclResult_t issue(Nccl *h, const Op *o, cudaStream_t s) {
    ncclDataType_t t = nccl_dtype(o->dtype);
    ncclRedOp_t op = o->op == COMM_MAX ? ncclMax : ncclSum;
    switch (o->kind) {
    case K_ALL_GATHER: return ncclAllGather(o->send, o->recv, o->count, t, h->comm, s);
    case K_REDUCE_SCATTER: return ncclReduceScatter(o->send, o->recv, o->count, t, op, h->comm, s);
    case K_ALL_REDUCE:
    case K_BARRIER: return ncclAllReduce(o->send, o->recv, o->count, t, op, h->comm, s);
    case K_BROADCAST: return ncclBroadcast(o->send, o->recv, o->count, t, o->arg, h->comm, s);
    case K_SEND: return ncclSend(o->send, o->count, t, o->arg, h->comm, s);
    case K_RECV: return ncclRecv(o->recv, o->count, t, o->arg, h->comm, s);
    }
    return ncclInvalidArgument;
}

static const char *issue_name(int kind) {
    static const char *const N[] = {"ncclAllGather", "ncclReduceScatter", "ncclAllReduce", "ncclBroadcast",
                                    "ncclSend", "ncclRecv", "ncclAllReduce", "ncclGroupEnd", "cudaGraphLaunch"};
    return N[kind];
}

// Polls that wait for something that takes microseconds: yield at first (a sleep costs 50+ us of timer slack),
// sleep once it takes longer.
static void poll_pause(unsigned polls) {
    if (polls < SPIN_POLLS) sched_yield();
    else sleep_us(50);
}

// After an NCCL call: 0 once its work is in the stream, else the failure, recorded. A non-blocking communicator
// queues every launch from a thread of its own and answers ncclInProgress meanwhile (NCCL's group.cc), so
// this wait is part of every call's cost.
static int settle(Comm *c, Nccl *h, ncclResult_t r, const char *call, int line) {
    for (unsigned polls = 0; r == ncclInProgress; polls++) {
        poll_pause(polls);
        pthread_mutex_lock(&h->mu);
        int failed = h->fail_code;
        ncclResult_t st = ncclInProgress, q = failed ? ncclSuccess : ncclCommGetAsyncError(h->comm, &st);
        pthread_mutex_unlock(&h->mu);
        if (failed) return comm_nccl_poll(c);
        if (q != ncclSuccess) {
            r = q;
            call = "ncclCommGetAsyncError";
            break;
        }
        r = st;
    }
    if (r == ncclSuccess) return 0;
    char what[512];
    nccl_what(what, sizeof what, r, call, __FILE__, line);
    return fail_main(c, h, nccl_code(r), "comm nccl (call #%llu): %s", (unsigned long long)c->calls, what);
}

// Buffers must be device memory of the communicator's GPU (or managed memory): anything else is refused
// before NCCL sees it, and the communicator stays usable.
static int check_ptr(Comm *c, Nccl *h, const char *name, const void *p) {
    struct cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return comm_fail(c, COMM_ERR_INVALID, "comm nccl (call #%llu): %s %p: %s", (unsigned long long)c->calls, name,
                         p, cudaGetErrorString(e));
    }
    if (a.type == cudaMemoryTypeManaged || (a.type == cudaMemoryTypeDevice && a.device == h->device)) return 0;
    if (a.type == cudaMemoryTypeDevice)
        return comm_fail(c, COMM_ERR_INVALID, "comm nccl (call #%llu): %s is memory of GPU %d but the communicator "
                         "is on GPU %d", (unsigned long long)c->calls, name, a.device, h->device);
    return comm_fail(c, COMM_ERR_INVALID, "comm nccl (call #%llu): %s is host memory: the nccl backend needs device "
                     "memory of GPU %d (ops_malloc)", (unsigned long long)c->calls, name, h->device);
}

// Closes the caller's outermost group whatever the state (mu held): NCCL's group state belongs to the thread,
// and its calls must reach NCCL before the communicator can be aborted. The result does not matter: the
// caller is failing already.
static void group_close_locked(Nccl *h) {
    while (h->group_depth > 0) {
        ncclGroupEnd();
        h->group_depth--;
    }
    if (h->fail_code) abort_locked(h);
}

static void rec_fill(Rec *r, const Op *o, uint64_t call, uint64_t seq) {
    r->kind = o->kind;
    r->call_first = r->call_last = call;
    r->seq = seq;
    r->count = o->count;
    r->bytes = o->bytes;
    r->dtype = o->dtype;
    r->arg = o->kind == K_REDUCE_SCATTER || o->kind == K_ALL_REDUCE ? (int)o->op : o->arg;
    r->nsend = o->kind == K_SEND;
    r->nrecv = o->kind == K_RECV;
    r->ncoll = !r->nsend && !r->nrecv;
}

// Records one call into the graph the calling thread records on the compute context (comm.h "CUDA graphs"): issued
// on the recording's stream, no watchdog record (a replay gets one from comm_graph_launch).
static int record_call(Comm *c, Nccl *h, const Op *o, cudaStream_t capture) {
    if (!h->blocking)
        return comm_fail(c, COMM_ERR_INVALID, "comm nccl (call #%llu): %s cannot be recorded into a CUDA graph: the "
                         "communicator is in NCCL's non-blocking mode, which launches from a thread of its own "
                         "(comm_create_local_group joins in the blocking mode)", (unsigned long long)c->calls,
                         KIND[o->kind]);
    pthread_mutex_lock(&h->mu);
    if (h->fail_code) {
        pthread_mutex_unlock(&h->mu);
        return comm_nccl_poll(c);
    }
    h->recorded = 1;   // a graph may hold a plan of comm from now on: aborts wait for it (abort_locked)
    ncclResult_t r = issue(h, o, capture);
    pthread_mutex_unlock(&h->mu);
    return settle(c, h, r, issue_name(o->kind), __LINE__);
}

// Queues one call (o) or, with o == NULL, the group built so far (ncclGroupEnd): outside a group it is
// bracketed by the record's events and handed to the watchdog; inside a group it joins h->grp. While the calling
// thread records a graph on the compute context, a call outside a group is recorded instead (record_call).
static int run(Comm *c, Nccl *h, const Op *o) {
    cudaError_t e = cudaSetDevice(h->device);
    if (e != cudaSuccess) {
        if (!o) {
            pthread_mutex_lock(&h->mu);
            group_close_locked(h);
            pthread_mutex_unlock(&h->mu);
        }
        return CUDA_FAIL(c, h, e, "cudaSetDevice");
    }
    cudaStream_t capture = o && h->group_depth == 0 ? (cudaStream_t)ops_cuda_recording_stream(c->ops) : NULL;
    if (capture) return record_call(c, h, o, capture);
    if (o && h->group_depth > 0) {
        pthread_mutex_lock(&h->mu);
        if (h->fail_code) {
            pthread_mutex_unlock(&h->mu);
            return comm_nccl_poll(c);
        }
        uint64_t seq = atomic_fetch_add(&h->queued, 1) + 1;
        ncclResult_t r = issue(h, o, h->stream);
        pthread_mutex_unlock(&h->mu);
        if (!h->grp.call_first) {
            rec_fill(&h->grp, o, c->calls, seq);
            h->grp.kind = K_GROUP;
        } else {
            h->grp.nsend += o->kind == K_SEND;
            h->grp.nrecv += o->kind == K_RECV;
            h->grp.ncoll += o->kind != K_SEND && o->kind != K_RECV;
            h->grp.bytes += o->bytes;
        }
        h->grp.call_last = c->calls;
        h->grp.seq = seq;
        return settle(c, h, r, issue_name(o->kind), __LINE__);
    }
    pthread_mutex_lock(&h->mu);
    while (h->pushed - h->popped == RING_CAP && !h->fail_code) pthread_cond_wait(&h->cv, &h->mu);
    if (h->fail_code) {
        if (!o) group_close_locked(h);
        pthread_mutex_unlock(&h->mu);
        return comm_nccl_poll(c);
    }
    Rec *rec = &h->ring[h->pushed % RING_CAP];
    if (o) rec_fill(rec, o, c->calls, atomic_fetch_add(&h->queued, 1) + 1);
    else *rec = (Rec){.start = rec->start, .end = rec->end, .kind = K_GROUP, .call_first = h->grp.call_first,
                      .call_last = h->grp.call_last, .seq = h->grp.seq, .bytes = h->grp.bytes, .nsend = h->grp.nsend,
                      .nrecv = h->grp.nrecv, .ncoll = h->grp.ncoll};
    rec->ended = 0;
    rec->started_ms = 0;
    if (!rec->start) e = cudaEventCreateWithFlags(&rec->start, cudaEventDisableTiming);
    if (e == cudaSuccess && !rec->end) e = cudaEventCreateWithFlags(&rec->end, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(rec->start, h->stream);
    if (e != cudaSuccess) {
        if (!o) group_close_locked(h);
        pthread_mutex_unlock(&h->mu);
        return CUDA_FAIL(c, h, e, "cudaEventRecord (start)");
    }
    h->pushed++;
    ncclResult_t r = o ? issue(h, o, h->stream) : ncclGroupEnd();
    if (!o) h->group_depth = 0;
    pthread_mutex_unlock(&h->mu);
    int rc = settle(c, h, r, o ? issue_name(o->kind) : "ncclGroupEnd", __LINE__);
    pthread_mutex_lock(&h->mu);
    e = rc == 0 ? cudaEventRecord(rec->end, h->stream) : cudaSuccess;
    rec->ended = 1;   // after a failure the watchdog looks no more
    if (!o && h->fail_code) abort_locked(h);   // an abort that waited for the group to be handed over
    pthread_mutex_unlock(&h->mu);
    if (e != cudaSuccess) return CUDA_FAIL(c, h, e, "cudaEventRecord (end)");
    return rc;
}

static size_t esz(CommDtype d) { return comm_dtype_size(d); }

int comm_nccl_all_gather(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype) {
    Nccl *h = c->impl;
    int rc = check_ptr(c, h, "recv", recv);
    if (rc || (rc = check_ptr(c, h, "send", send))) return rc;
    Op o = {.kind = K_ALL_GATHER, .send = send, .recv = recv, .count = count, .dtype = dtype,
            .bytes = count * esz(dtype) * (size_t)c->world};
    return run(c, h, &o);
}

int comm_nccl_reduce_scatter(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype, CommOp op) {
    Nccl *h = c->impl;
    int rc = check_ptr(c, h, "recv", recv);
    if (rc || (rc = check_ptr(c, h, "send", send))) return rc;
    Op o = {.kind = K_REDUCE_SCATTER, .send = send, .recv = recv, .count = count, .dtype = dtype, .op = op,
            .bytes = count * esz(dtype) * (size_t)c->world};
    return run(c, h, &o);
}

int comm_nccl_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommOp op) {
    Nccl *h = c->impl;
    int rc = check_ptr(c, h, "buf", buf);
    if (rc) return rc;
    Op o = {.kind = K_ALL_REDUCE, .send = buf, .recv = buf, .count = count, .dtype = dtype, .op = op,
            .bytes = count * esz(dtype)};
    return run(c, h, &o);
}

int comm_nccl_broadcast(Comm *c, void *buf, size_t count, CommDtype dtype, int root) {
    Nccl *h = c->impl;
    int rc = check_ptr(c, h, "buf", buf);
    if (rc) return rc;
    Op o = {.kind = K_BROADCAST, .send = buf, .recv = buf, .count = count, .dtype = dtype, .arg = root,
            .bytes = count * esz(dtype)};
    return run(c, h, &o);
}

int comm_nccl_send(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer) {
    Nccl *h = c->impl;
    int rc = check_ptr(c, h, "buf", buf);
    if (rc) return rc;
    Op o = {.kind = K_SEND, .send = buf, .count = count, .dtype = dtype, .arg = peer, .bytes = count * esz(dtype)};
    return run(c, h, &o);
}

int comm_nccl_recv(Comm *c, void *buf, size_t count, CommDtype dtype, int peer) {
    Nccl *h = c->impl;
    int rc = check_ptr(c, h, "buf", buf);
    if (rc) return rc;
    Op o = {.kind = K_RECV, .recv = buf, .count = count, .dtype = dtype, .arg = peer, .bytes = count * esz(dtype)};
    return run(c, h, &o);
}

int comm_nccl_barrier(Comm *c) {
    Nccl *h = c->impl;
    if (h->group_depth > 0) return comm_fail(c, COMM_ERR_INVALID, "comm_barrier: inside a group");
    Op o = {.kind = K_BARRIER, .send = h->scratch, .recv = h->scratch, .count = 1, .dtype = COMM_I32, .op = COMM_SUM,
            .bytes = sizeof(int)};
    int rc = run(c, h, &o);
    return rc ? rc : comm_nccl_synchronize(c);
}

int comm_nccl_group_start(Comm *c) {
    Nccl *h = c->impl;
    if (ops_cuda_recording_stream(c->ops))
        return comm_fail(c, COMM_ERR_INVALID, "comm_group_start: a group cannot be recorded into a CUDA graph (this "
                         "thread records one on the compute context)");
    pthread_mutex_lock(&h->mu);
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess && h->group_depth++ == 0) memset(&h->grp, 0, sizeof h->grp);
    pthread_mutex_unlock(&h->mu);
    return settle(c, h, r, "ncclGroupStart", __LINE__);
}

// comm.c calls this even on a failed communicator, so that the thread's NCCL group is always closed.
int comm_nccl_group_end(Comm *c) {
    Nccl *h = c->impl;
    if (h->group_depth == 0)
        return c->failed ? COMM_ERR_FAILED : comm_fail(c, COMM_ERR_INVALID, "comm_group_end: no group is open");
    pthread_mutex_lock(&h->mu);
    int failed = h->fail_code;
    pthread_mutex_unlock(&h->mu);
    // The outermost end of a group that holds calls of a healthy communicator is queued and watched as one call.
    if (h->group_depth == 1 && h->grp.call_first && !failed && !c->failed) return run(c, h, NULL);
    pthread_mutex_lock(&h->mu);
    ncclResult_t r = ncclGroupEnd();
    h->group_depth--;
    if (h->group_depth == 0 && h->fail_code) abort_locked(h);
    pthread_mutex_unlock(&h->mu);
    if (failed || c->failed) return c->failed ? COMM_ERR_FAILED : comm_nccl_poll(c);
    return settle(c, h, r, "ncclGroupEnd", __LINE__);
}

int comm_nccl_synchronize(Comm *c) {
    Nccl *h = c->impl;
    if (h->group_depth > 0)
        return comm_fail(c, COMM_ERR_INVALID, "comm_synchronize: inside a group (its calls are queued at comm_group_end)");
    for (unsigned spins = 0;; spins++) {
        pthread_mutex_lock(&h->mu);
        int failed = h->fail_code, idle = h->pushed == h->popped;
        // The newest record: this thread queued it completely (ended), and only this thread records its events.
        cudaEvent_t last = idle || failed ? NULL : h->ring[(h->pushed - 1) % RING_CAP].end;
        pthread_mutex_unlock(&h->mu);
        if (failed) return comm_nccl_poll(c);
        cudaError_t e = idle ? cudaSuccess : cudaEventQuery(last);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) return CUDA_FAIL(c, h, e, "cudaEventQuery");
        poll_pause(spins);
    }
    // Done: unless the watchdog aborted it (the kernels then exit early) or NCCL found an error on the way.
    pthread_mutex_lock(&h->mu);
    int failed = h->fail_code;
    ncclResult_t st = ncclSuccess, q = failed ? ncclSuccess : ncclCommGetAsyncError(h->comm, &st);
    pthread_mutex_unlock(&h->mu);
    if (failed) return comm_nccl_poll(c);
    return settle(c, h, q != ncclSuccess ? q : st == ncclInProgress ? ncclSuccess : st, "ncclCommGetAsyncError",
                  __LINE__);
}

// While the calling thread records a graph, its calls go to the recording's stream in order with the ops: nothing to
// order (comm.h "CUDA graphs"). Likewise in comm_nccl_compute_wait.
void comm_nccl_wait_compute(Comm *c) {
    Nccl *h = c->impl;
    if (ops_cuda_recording_stream(c->ops)) return;
    cudaError_t e = cudaSetDevice(h->device);
    if (e == cudaSuccess) e = cudaEventRecord(h->ev_compute, h->compute);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(h->stream, h->ev_compute, 0);
    if (e != cudaSuccess) CUDA_FAIL(c, h, e, "comm_wait_compute (cudaEventRecord / cudaStreamWaitEvent)");
}

void comm_nccl_compute_wait(Comm *c) {
    Nccl *h = c->impl;
    if (ops_cuda_recording_stream(c->ops)) return;
    cudaError_t e = cudaSetDevice(h->device);
    if (e == cudaSuccess) e = cudaEventRecord(h->ev_comm, h->stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(h->compute, h->ev_comm, 0);
    if (e != cudaSuccess) CUDA_FAIL(c, h, e, "comm_compute_wait (cudaEventRecord / cudaStreamWaitEvent)");
}

// ---- graphs --------------------------------------------------------------------------------------

int comm_nccl_graph_capable(const Comm *c) {
    const Nccl *h = c->impl;
    return h && h->blocking;
}

// The replay is bracketed by a record's events on the compute stream, where ops_graph_launch queues it: the watchdog
// times it from `start` (the compute work before it is done) like a call.
int comm_nccl_graph_launch(Comm *c, OpsGraph *graph) {
    Nccl *h = c->impl;
    if (h->group_depth > 0) return comm_fail(c, COMM_ERR_INVALID, "comm_graph_launch: inside a group");
    if (ops_cuda_recording_stream(c->ops))
        return comm_fail(c, COMM_ERR_INVALID,
                         "comm_graph_launch: this thread is recording a graph on the compute context");
    cudaError_t e = cudaSetDevice(h->device);
    if (e != cudaSuccess) return CUDA_FAIL(c, h, e, "cudaSetDevice");
    pthread_mutex_lock(&h->mu);
    while (h->pushed - h->popped == RING_CAP && !h->fail_code) pthread_cond_wait(&h->cv, &h->mu);
    if (h->fail_code) {
        pthread_mutex_unlock(&h->mu);
        return comm_nccl_poll(c);
    }
    Rec *rec = &h->ring[h->pushed % RING_CAP];
    *rec = (Rec){.start = rec->start, .end = rec->end, .kind = K_GRAPH, .call_first = c->calls,
                 .call_last = c->calls, .seq = atomic_load(&h->queued)};
    if (!rec->start) e = cudaEventCreateWithFlags(&rec->start, cudaEventDisableTiming);
    if (e == cudaSuccess && !rec->end) e = cudaEventCreateWithFlags(&rec->end, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(rec->start, h->compute);
    if (e != cudaSuccess) {
        pthread_mutex_unlock(&h->mu);
        return CUDA_FAIL(c, h, e, "cudaEventRecord (graph replay start)");
    }
    h->pushed++;
    pthread_mutex_unlock(&h->mu);
    const int launch = ops_graph_launch(c->ops, graph);
    pthread_mutex_lock(&h->mu);
    e = cudaEventRecord(rec->end, h->compute);   // also after a failed launch: the record must end
    rec->ended = 1;
    pthread_mutex_unlock(&h->mu);
    if (e != cudaSuccess) return CUDA_FAIL(c, h, e, "cudaEventRecord (graph replay end)");
    if (launch != 0) return comm_fail(c, COMM_ERR_INVALID, "comm_graph_launch: %s", ops_error(c->ops));
    return 0;
}
