// shared/comm_internal.h — what comm.c (dispatch, argument checks) shares with the backends (comm_host.c;
// the nccl backend later). Not for users of comm.h.
#ifndef TANDEM_SHARED_COMM_INTERNAL_H
#define TANDEM_SHARED_COMM_INTERNAL_H

#include "shared/comm.h"

#define COMM_ERR_MAX 1024

struct Comm {
    CommBackend backend;
    int rank, world, timeout_ms;
    int failed;              // 1 after the first failure other than COMM_ERR_INVALID
    uint64_t calls;          // collective calls accepted so far ("call #n" in messages)
    OpsCtx *ops;
    void *impl;              // backend state
    char err[COMM_ERR_MAX];
};

// Records a message and returns code; any code except COMM_ERR_INVALID marks the communicator failed.
int comm_fail(Comm *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
const char *comm_dtype_name(CommDtype dtype);

// Host backend. Arguments were checked by comm.c (ranges, NULLs, overlaps, count > 0).
int comm_host_create(Comm *c, const CommInit *ci, char *err, size_t err_len);
void comm_host_destroy(Comm *c);
int comm_host_all_gather(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype);
int comm_host_reduce_scatter(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype, CommOp op);
int comm_host_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommOp op);
int comm_host_broadcast(Comm *c, void *buf, size_t count, CommDtype dtype, int root);
int comm_host_send(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer);
int comm_host_recv(Comm *c, void *buf, size_t count, CommDtype dtype, int peer);
int comm_host_barrier(Comm *c);

#endif
