// shared/comm/comm.c — comm.h's front: argument checks shared by every backend, and dispatch to the backend
// (comm_host.c; comm_nccl.c in CUDA builds). The launch contract is read by comm_env.c.
#include "shared/err.h"
#include "shared/comm/comm_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#ifdef TANDEM_HAVE_CUDA
#define HAVE_NCCL 1
#define BACKEND(c, nccl_call, host_call) ((c)->backend == COMM_BACKEND_NCCL ? (nccl_call) : (host_call))
#define BACKEND_DO(c, nccl_stmt, host_stmt)                                                                  \
    do {                                                                                                     \
        if ((c)->backend == COMM_BACKEND_NCCL) { nccl_stmt; } else { host_stmt; }                            \
    } while (0)
#else
// A CPU build never creates an nccl communicator, and must not reference the nccl functions.
#define HAVE_NCCL 0
#define BACKEND(c, nccl_call, host_call) (host_call)
#define BACKEND_DO(c, nccl_stmt, host_stmt) do { host_stmt; } while (0)
#endif

static const char NO_NCCL[] = "the nccl backend needs a CUDA build (cmake -DTANDEM_CUDA=ON with nvcc and NCCL); "
                              "this build has only the host backend";

int comm_fail(Comm *c, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    if (code != COMM_ERR_INVALID) c->failed = 1;
    return code;
}

size_t comm_dtype_size(CommDtype dtype) {
    switch (dtype) {
    case COMM_F32: return 4;
    case COMM_BF16: return 2;
    case COMM_I32: return 4;
    case COMM_U8: return 1;
    case COMM_F64: return 8;
    }
    return 0;
}

int comm_set_heartbeats(void *dealer) {
    int ivl = COMM_HEARTBEAT_IVL_MS, timeout = COMM_HEARTBEAT_TIMEOUT_MS;
    if (zmq_setsockopt(dealer, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl) != 0) return -1;
    return zmq_setsockopt(dealer, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof timeout);
}

const char *comm_dtype_name(CommDtype dtype) {
    switch (dtype) {
    case COMM_F32: return "f32";
    case COMM_BF16: return "bf16";
    case COMM_I32: return "i32";
    case COMM_U8: return "u8";
    case COMM_F64: return "f64";
    }
    return "?";
}

// The backend is known, compiled in, and (nccl) has a CUDA compute context to work beside.
static int check_backend(CommBackend backend, OpsCtx *ops, const char *fn, char *err, size_t err_len) {
    if (backend == COMM_BACKEND_HOST) return 0;
    if (backend != COMM_BACKEND_NCCL) return err_fail_code(COMM_ERR_INVALID, err, err_len, "%s: unknown backend %d", fn, (int)backend);
    if (!HAVE_NCCL) {
        err_fail_code(COMM_ERR_INVALID, err, err_len, "%s: %s", fn, NO_NCCL);
        return COMM_ERR_UNSUPPORTED;
    }
    if (!ops || ops_backend(ops) != OPS_BACKEND_CUDA)
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "%s: the nccl backend needs a CUDA compute context (ops %s)", fn,
                       ops ? "is a CPU context" : "is NULL");
    return 0;
}

static Comm *new_comm(CommBackend backend, int rank, int world, int timeout_ms, OpsCtx *ops, char *err, size_t err_len) {
    Comm *c = calloc(1, sizeof *c);
    if (!c) {
        err_fail_code(COMM_ERR_INVALID, err, err_len, "comm: out of memory");
        return NULL;
    }
    c->backend = backend;
    c->rank = rank;
    c->world = world;
    c->timeout_ms = timeout_ms;
    c->ops = ops;
    c->node = malloc((size_t)world * sizeof *c->node);
    if (!c->node) {
        free(c);
        err_fail_code(COMM_ERR_INVALID, err, err_len, "comm: out of memory");
        return NULL;
    }
    // Until told otherwise (comm_create: the launch contract; comm_set_nodes), every member is a node of its own.
    for (int m = 0; m < world; m++) c->node[m] = m;
    c->nnodes = world;
    return c;
}

static void free_comm(Comm *c) {
    free(c->node);
    free(c);
}

int comm_create(Comm **out, CommBackend backend, const CommInit *ci, OpsCtx *ops, char *err, size_t err_len) {
    if (!out) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create: out is NULL");
    *out = NULL;
    if (!ci) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create: ci is NULL");
    if (ci->world_size < 1) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create: world_size %d must be >= 1", ci->world_size);
    if (ci->rank < 0 || ci->rank >= ci->world_size)
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create: rank %d is outside world_size %d", ci->rank, ci->world_size);
    if (ci->local_rank < 0) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create: local_rank %d is negative", ci->local_rank);
    if (ci->timeout_ms <= 0) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create: timeout_ms %d must be > 0", ci->timeout_ms);
    if (ci->world_size > 1) {
        if (!memchr(ci->master_addr, '\0', sizeof ci->master_addr) || !ci->master_addr[0])
            return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create: master_addr is empty or not terminated");
        if (ci->master_port < 1 || ci->master_port > 65535)
            return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create: master_port %d is outside 1..65535", ci->master_port);
    }
    int rc = check_backend(backend, ops, "comm_create", err, err_len);
    if (rc) return rc;
    Comm *c = new_comm(backend, ci->rank, ci->world_size, ci->timeout_ms, ops, err, err_len);
    if (!c) return COMM_ERR_SYSTEM;
    // The rendezvous holds every rank to this layout (rendezvous.h), so each rank can compute the whole map.
    int lws = ci->nnodes > 0 ? ci->local_world_size : ci->world_size;
    if (lws < 1 || ci->world_size % lws || (ci->nnodes > 0 && ci->nnodes != ci->world_size / lws)) {
        free_comm(c);
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create: %d nodes x local_world_size %d is not "
                             "world_size %d", ci->nnodes, ci->local_world_size, ci->world_size);
    }
    for (int m = 0; m < c->world; m++) c->node[m] = m / lws;
    c->nnodes = c->world / lws;
    rc = BACKEND(c, comm_nccl_create(c, ci, NULL, NULL, 0, err, err_len), comm_host_create(c, ci, NULL, err, err_len));
    if (rc != 0) {
        free_comm(c);
        return rc;
    }
    *out = c;
    return 0;
}

int comm_create_with_id(Comm **out, CommBackend backend, const uint8_t id[COMM_UNIQUE_ID_BYTES], int rank,
                        int world, int timeout_ms, OpsCtx *ops, char *err, size_t err_len) {
    return comm_create_with_id_watched(out, backend, id, rank, world, timeout_ms, NULL, ops, err, err_len);
}

// Joins by id, with NCCL's blocking mode or not.
static int create_with_id(Comm **out, CommBackend backend, const uint8_t id[COMM_UNIQUE_ID_BYTES], int rank, int world,
                          int timeout_ms, const CommPeerWatch *watch, int blocking, OpsCtx *ops, char *err,
                          size_t err_len) {
    if (!out) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create_with_id: out is NULL");
    *out = NULL;
    if (!id) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create_with_id: id is NULL");
    if (world < 1) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create_with_id: world %d must be >= 1", world);
    if (rank < 0 || rank >= world)
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create_with_id: rank %d is outside world %d", rank, world);
    if (timeout_ms <= 0) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create_with_id: timeout_ms %d must be > 0", timeout_ms);
    // The host id is the rendezvous address of comm_create's launch contract, for one group of `world` members.
    CommInit ci = {.rank = rank, .world_size = world, .timeout_ms = timeout_ms};
    int rc = 0;
    if (backend == COMM_BACKEND_HOST) {
        if ((rc = comm_host_id_parse(id, ci.master_addr, sizeof ci.master_addr, &ci.master_port, err, err_len)) != 0)
            return rc;
        snprintf(ci.port_source, sizeof ci.port_source, "the host id's port");
    } else if (backend == COMM_BACKEND_NCCL && comm_host_id_is(id)) {
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create_with_id: the id is a host backend id "
                             "(comm_unique_id_host); the nccl backend joins with an id from comm_unique_id(COMM_BACKEND_NCCL)");
    }
    if ((rc = check_backend(backend, ops, "comm_create_with_id", err, err_len)) != 0) return rc;
    if (watch && !watch->gone_ms) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create_with_id: a peer watch needs gone_ms");
    Comm *c = new_comm(backend, rank, world, timeout_ms, ops, err, err_len);
    if (!c) return COMM_ERR_SYSTEM;
    rc = BACKEND(c, comm_nccl_create(c, NULL, id, watch, blocking, err, err_len),
                 comm_host_create(c, &ci, watch, err, err_len));
    if (rc != 0) {
        free_comm(c);
        return rc;
    }
    *out = c;
    return 0;
}

int comm_create_with_id_watched(Comm **out, CommBackend backend, const uint8_t id[COMM_UNIQUE_ID_BYTES], int rank,
                                int world, int timeout_ms, const CommPeerWatch *watch, OpsCtx *ops, char *err,
                                size_t err_len) {
    return create_with_id(out, backend, id, rank, world, timeout_ms, watch, 0, ops, err, err_len);
}

int comm_create_local_group(Comm **out, CommBackend backend, const uint8_t id[COMM_UNIQUE_ID_BYTES], int rank,
                            int world, int timeout_ms, OpsCtx *ops, char *err, size_t err_len) {
    return create_with_id(out, backend, id, rank, world, timeout_ms, NULL, 1, ops, err, err_len);
}

int comm_unique_id(CommBackend backend, uint8_t id[COMM_UNIQUE_ID_BYTES], char *err, size_t err_len) {
    if (!id) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id: id is NULL");
    if (backend == COMM_BACKEND_HOST) {
        err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id: the host backend's id names the address of its "
                      "rendezvous: make it with comm_unique_id_host(addr, id, ...)");
        return COMM_ERR_UNSUPPORTED;
    }
    if (backend != COMM_BACKEND_NCCL) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id: unknown backend %d", (int)backend);
#if HAVE_NCCL
    return comm_nccl_unique_id(id, err, err_len);
#else
    err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id: %s", NO_NCCL);
    return COMM_ERR_UNSUPPORTED;
#endif
}

int comm_backend_available(CommBackend backend) {
    if (backend == COMM_BACKEND_HOST) return 1;
#if HAVE_NCCL
    if (backend == COMM_BACKEND_NCCL) return comm_nccl_available();
#endif
    return 0;
}

void comm_destroy(Comm *c) {
    if (!c) return;
    BACKEND_DO(c, comm_nccl_destroy(c), comm_host_destroy(c));
    free_comm(c);
}

void comm_destroy_now(Comm *c) {
    if (!c) return;
    BACKEND_DO(c, comm_nccl_destroy_now(c), comm_host_destroy(c));
    free_comm(c);
}

int comm_set_timeout(Comm *c, int timeout_ms) {
    if (!c) return COMM_ERR_INVALID;
    if (timeout_ms <= 0) return comm_fail(c, COMM_ERR_INVALID, "comm_set_timeout: timeout %d ms must be > 0", timeout_ms);
    c->timeout_ms = timeout_ms;
    BACKEND_DO(c, comm_nccl_set_timeout(c, timeout_ms), (void)0);
    return 0;
}

int comm_rank(const Comm *c) { return c ? c->rank : -1; }
int comm_world_size(const Comm *c) { return c ? c->world : 0; }
const char *comm_error(const Comm *c) { return c ? c->err : "comm: NULL communicator"; }

const char *comm_peer_endpoint(const Comm *c, int peer) {
    if (!c || c->backend != COMM_BACKEND_HOST || peer < 0 || peer >= c->world) return NULL;
    return comm_host_peer_endpoint(c, peer);
}

// A communicator that failed earlier, or (nccl) whose watchdog found a failure since the last call: the code
// to return (the first time the failure's own code, then COMM_ERR_FAILED), else 0.
static int check_state(Comm *c) {
    if (!c) return COMM_ERR_INVALID;
    if (c->failed) return COMM_ERR_FAILED;   // c->err keeps the first failure's message
    return BACKEND(c, comm_nccl_poll(c), 0);
}

// Checks shared by every call. Returns 0, or the code to return (message recorded).
static int check_call(Comm *c, const char *fn, size_t count, CommDtype dtype, size_t factor) {
    int rc = check_state(c);
    if (rc) return rc;
    size_t esz = comm_dtype_size(dtype);
    if (!esz) return comm_fail(c, COMM_ERR_INVALID, "%s: dtype %d is not a CommDtype", fn, (int)dtype);
    if (count > SIZE_MAX / factor / esz)
        return comm_fail(c, COMM_ERR_INVALID, "%s: count %zu x %zu x %zu bytes overflows", fn, count, factor, esz);
    return 0;
}

static int check_op(Comm *c, const char *fn, CommOp op) {
    if (op != COMM_SUM && op != COMM_MAX) return comm_fail(c, COMM_ERR_INVALID, "%s: op %d is not a CommOp", fn, (int)op);
    return 0;
}

static int check_buf(Comm *c, const char *fn, const char *name, const void *p, size_t count) {
    if (count && !p) return comm_fail(c, COMM_ERR_INVALID, "%s: %s is NULL with count %zu", fn, name, count);
    return 0;
}

static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + nb && y < x + na;
}

// comm_bytes: `bytes` sent to every other member (peer < 0) or to one.
static int count_sent(Comm *c, int rc, size_t bytes, int peer) {
    if (rc != 0) return rc;
    for (int m = 0; m < c->world; m++) {
        if (m == c->rank || (peer >= 0 && m != peer)) continue;
        if (c->node[m] == c->node[c->rank]) c->bytes.intra_node += bytes;
        else c->bytes.inter_node += bytes;
    }
    return 0;
}

int comm_all_gather(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype) {
    const char *fn = "comm_all_gather";
    int rc = check_call(c, fn, count, dtype, c ? (size_t)c->world : 1);
    if (rc || (rc = check_buf(c, fn, "recv", recv, count)) || (rc = check_buf(c, fn, "send", send, count))) return rc;
    c->calls++;
    if (!count) return 0;
    size_t bytes = count * comm_dtype_size(dtype);
    if (send != (const char *)recv + (size_t)c->rank * bytes && overlaps(recv, bytes * c->world, send, bytes))
        return comm_fail(c, COMM_ERR_INVALID, "%s: send overlaps recv without being recv + rank * count (in place)", fn);
    return count_sent(c, BACKEND(c, comm_nccl_all_gather(c, recv, send, count, dtype),
                                 comm_host_all_gather(c, recv, send, count, dtype)), bytes, -1);
}

int comm_reduce_scatter(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype, CommOp op) {
    const char *fn = "comm_reduce_scatter";
    int rc = check_call(c, fn, count, dtype, c ? (size_t)c->world : 1);
    if (rc || (rc = check_op(c, fn, op)) || (rc = check_buf(c, fn, "recv", recv, count)) ||
        (rc = check_buf(c, fn, "send", send, count)))
        return rc;
    c->calls++;
    if (!count) return 0;
    size_t bytes = count * comm_dtype_size(dtype);
    if (recv != (const char *)send + (size_t)c->rank * bytes && overlaps(recv, bytes, send, bytes * c->world))
        return comm_fail(c, COMM_ERR_INVALID, "%s: recv overlaps send without being send + rank * count (in place)", fn);
    return count_sent(c, BACKEND(c, comm_nccl_reduce_scatter(c, recv, send, count, dtype, op),
                                 comm_host_reduce_scatter(c, recv, send, count, dtype, op)), bytes, -1);
}

int comm_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommOp op) {
    const char *fn = "comm_all_reduce";
    int rc = check_call(c, fn, count, dtype, 1);
    if (rc || (rc = check_op(c, fn, op)) || (rc = check_buf(c, fn, "buf", buf, count))) return rc;
    c->calls++;
    if (!count) return 0;
    size_t chunk = (count + (size_t)c->world - 1) / (size_t)c->world;
    return count_sent(c, BACKEND(c, comm_nccl_all_reduce(c, buf, count, dtype, op),
                                 comm_host_all_reduce(c, buf, count, dtype, op)), 2 * chunk * comm_dtype_size(dtype), -1);
}

int comm_broadcast(Comm *c, void *buf, size_t count, CommDtype dtype, int root) {
    const char *fn = "comm_broadcast";
    int rc = check_call(c, fn, count, dtype, 1);
    if (rc || (rc = check_buf(c, fn, "buf", buf, count))) return rc;
    if (root < 0 || root >= c->world)
        return comm_fail(c, COMM_ERR_INVALID, "%s: root %d is outside world size %d", fn, root, c->world);
    c->calls++;
    if (!count) return 0;
    return count_sent(c, BACKEND(c, comm_nccl_broadcast(c, buf, count, dtype, root),
                                 comm_host_broadcast(c, buf, count, dtype, root)),
                      c->rank == root ? count * comm_dtype_size(dtype) : 0, -1);
}

static int check_peer(Comm *c, const char *fn, int peer) {
    if (peer < 0 || peer >= c->world)
        return comm_fail(c, COMM_ERR_INVALID, "%s: peer %d is outside world size %d", fn, peer, c->world);
    if (peer == c->rank) return comm_fail(c, COMM_ERR_INVALID, "%s: peer %d is this rank", fn, peer);
    return 0;
}

int comm_send(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer) {
    const char *fn = "comm_send";
    int rc = check_call(c, fn, count, dtype, 1);
    if (rc || (rc = check_buf(c, fn, "buf", buf, count)) || (rc = check_peer(c, fn, peer))) return rc;
    c->calls++;
    if (!count) return 0;
    return count_sent(c, BACKEND(c, comm_nccl_send(c, buf, count, dtype, peer), comm_host_send(c, buf, count, dtype, peer)),
                      count * comm_dtype_size(dtype), peer);
}

int comm_recv(Comm *c, void *buf, size_t count, CommDtype dtype, int peer) {
    const char *fn = "comm_recv";
    int rc = check_call(c, fn, count, dtype, 1);
    if (rc || (rc = check_buf(c, fn, "buf", buf, count)) || (rc = check_peer(c, fn, peer))) return rc;
    c->calls++;
    if (!count) return 0;
    return BACKEND(c, comm_nccl_recv(c, buf, count, dtype, peer), comm_host_recv(c, buf, count, dtype, peer));
}

int comm_barrier(Comm *c) {
    int rc = check_state(c);
    if (rc) return rc;
    c->calls++;
    return BACKEND(c, comm_nccl_barrier(c), comm_host_barrier(c));
}

// The host backend completes every call before returning (comm.h "Ordering"): groups, synchronization and
// stream ordering have nothing to do there.
int comm_group_start(Comm *c) {
    int rc = check_state(c);
    return rc ? rc : BACKEND(c, comm_nccl_group_start(c), 0);
}

int comm_group_end(Comm *c) {
    if (!c) return COMM_ERR_INVALID;
    int rc = check_state(c);
    // nccl: even a failed communicator closes its group, because NCCL's group state belongs to the thread.
    int end = BACKEND(c, comm_nccl_group_end(c), 0);
    return rc ? rc : end;
}

int comm_synchronize(Comm *c) {
    int rc = check_state(c);
    return rc ? rc : BACKEND(c, comm_nccl_synchronize(c), 0);
}

void comm_wait_compute(Comm *c) {
    if (check_state(c) == 0) BACKEND_DO(c, comm_nccl_wait_compute(c), (void)0);
}

void comm_compute_wait(Comm *c) {
    if (check_state(c) == 0) BACKEND_DO(c, comm_nccl_compute_wait(c), (void)0);
}

int comm_graph_capable(const Comm *c) {
    return c && !c->failed && BACKEND(c, comm_nccl_graph_capable(c), 0);
}

int comm_graph_launch(Comm *c, OpsGraph *graph) {
    int rc = check_state(c);
    if (rc) return rc;
    if (!graph) return comm_fail(c, COMM_ERR_INVALID, "comm_graph_launch: graph is NULL");
    if (c->backend == COMM_BACKEND_HOST) {   // the host backend runs beside CPU contexts, which record no graphs
        if (!c->ops)
            return comm_fail(c, COMM_ERR_INVALID, "comm_graph_launch: the communicator has no compute context");
        if (ops_graph_launch(c->ops, graph) == 0) return 0;
        return comm_fail(c, COMM_ERR_INVALID, "comm_graph_launch: %s", ops_error(c->ops));
    }
    return BACKEND(c, comm_nccl_graph_launch(c, graph), COMM_ERR_UNSUPPORTED);
}
