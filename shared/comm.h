// shared/comm.h — collectives among trainer ranks (and, for the weight sync, rollout servers).
//
// Two backends, one set of calls with NCCL's semantics:
//   host : CPU processes on one or several machines, data over ZeroMQ TCP sockets (CPU runs, CI).
//   nccl : GPUs within and across nodes (kernels/cuda; the CUDA issue).
// Buffers are backend memory (host memory for `host`, device memory for `nccl`). Counts are elements.
// Every rank must call the same collectives in the same order (the host backend detects a mismatch and
// names both calls). A count of 0 returns at once (NCCL's rule). Reductions add contributions in rank order
// (0, 1, ..., N-1) so that results do not depend on message arrival order (determinism across runs);
// bf16 contributions are added in fp32 and rounded once; max propagates NaN; integer sums wrap.
// In place: all_gather with send == recv + rank * count, reduce_scatter with recv == send + rank * count
// (NCCL's rule); other overlaps of send and recv are refused.
//
// Ordering: with `nccl`, collectives are enqueued on a communication stream beside the compute stream;
// comm_wait_compute() makes later collectives wait for compute work queued so far, and
// comm_compute_wait() makes later compute wait for collectives queued so far. With `host` every call has
// completed when it returns and these two are no-ops.
//
// Failure: a peer that does not answer within the timeout, or goes away, makes the call return a negative
// code with a message naming the rank (comm_error). After a failure the communicator is unusable.
#ifndef TANDEM_SHARED_COMM_H
#define TANDEM_SHARED_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"

typedef enum { COMM_BACKEND_HOST = 0, COMM_BACKEND_NCCL = 1 } CommBackend;
typedef enum { COMM_F32 = 0, COMM_BF16, COMM_I32, COMM_U8, COMM_F64 } CommDtype;
typedef enum { COMM_SUM = 0, COMM_MAX } CommOp;

// Negative return codes (comm_error says more). After COMM_ERR_INVALID nothing was sent and the
// communicator stays usable; after any other code it is unusable and every later call returns
// COMM_ERR_FAILED with the first failure's message.
enum {
    COMM_ERR_INVALID = -1,      // bad argument or environment value (named)
    COMM_ERR_TIMEOUT = -2,      // a peer was silent past the timeout (named)
    COMM_ERR_PEER = -3,         // a peer went away, or called a different collective (named)
    COMM_ERR_SYSTEM = -4,       // out of memory, socket failure
    COMM_ERR_UNSUPPORTED = -5,  // backend not available in this build
    COMM_ERR_FAILED = -6,       // the communicator failed earlier
};

// The launch contract (torchrun names): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
typedef struct {
    int rank, world_size, local_rank;
    char master_addr[256];
    int master_port;
    int timeout_ms;          // rendezvous and per-call timeout (--init-timeout / --comm-timeout)
} CommInit;

// Reads the launch contract from the environment. Missing variables default to a single rank
// (RANK 0, WORLD_SIZE 1, LOCAL_RANK 0, MASTER_ADDR 127.0.0.1, MASTER_PORT 29500); malformed ones are errors.
int comm_init_from_env(CommInit *ci, int timeout_ms, char *err, size_t err_len);

typedef struct Comm Comm;

// Joins the group: rank 0 runs the rendezvous at MASTER_ADDR:MASTER_PORT and hands out the peer table;
// a rank missing after timeout_ms is named in the error. ops is the compute context (nccl: its device/stream;
// host: unused, may be NULL). WORLD_SIZE 1 opens no sockets.
int comm_create(Comm **out, CommBackend backend, const CommInit *ci, OpsCtx *ops, char *err, size_t err_len);
void comm_destroy(Comm *c);
// The per-call timeout from now on (e.g. --comm-timeout after a longer --init-timeout for joining). A call
// fails when nothing moves between this rank and the peers it waits on for timeout_ms.
int comm_set_timeout(Comm *c, int timeout_ms);
int comm_rank(const Comm *c);
int comm_world_size(const Comm *c);
const char *comm_error(const Comm *c);
size_t comm_dtype_size(CommDtype dtype);

// recv (world * count) = concatenation of every rank's send (count), in rank order.
int comm_all_gather(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype);
// recv (count) = op over ranks of send[rank * count : (rank + 1) * count] (send holds world * count).
int comm_reduce_scatter(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype, CommOp op);
// In place: buf (count) = op over ranks of buf.
int comm_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommOp op);
// buf (count) on every rank = root's buf.
int comm_broadcast(Comm *c, void *buf, size_t count, CommDtype dtype, int root);
// Point to point (matched in call order per pair of ranks).
int comm_send(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer);
int comm_recv(Comm *c, void *buf, size_t count, CommDtype dtype, int peer);
int comm_barrier(Comm *c);

void comm_wait_compute(Comm *c);
void comm_compute_wait(Comm *c);

#endif
