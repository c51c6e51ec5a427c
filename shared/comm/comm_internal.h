// shared/comm/comm_internal.h — what comm.c (dispatch, argument checks) shares with the backends (comm_host.c,
// comm_nccl.c). Not for users of comm.h.
#ifndef TANDEM_SHARED_COMM_INTERNAL_H
#define TANDEM_SHARED_COMM_INTERNAL_H

#include "shared/comm/comm.h"
#include "shared/comm/rendezvous.h"

#define COMM_ERR_MAX 1024

// ZMTP heartbeats on the connections to the peers (the host backend's data sockets, the nccl side channel): a peer
// whose process stops answering (SIGSTOP, a hung or cut-off host) loses its connection as one that exits does, so
// a frozen rank is named after about COMM_HEARTBEAT_TIMEOUT_MS instead of the call's whole timeout. libzmq's own
// I/O thread answers the pings, so a rank that is only busy (computing, blocked in a call) keeps its connection.
#define COMM_HEARTBEAT_IVL_MS 2000
#define COMM_HEARTBEAT_TIMEOUT_MS 10000
// Sets them on a DEALER (before it connects); 0 or -1 (errno from libzmq).
int comm_set_heartbeats(void *dealer);

// A communicator joined by id with a CommPeerWatch (comm.h): a call, or the joining, held up while a watched member
// is gone fails after this grace (calls: the timeout if shorter) instead of the timeout. The host backend looks at
// the watch at least every COMM_WATCH_TICK_MS while it waits (the nccl watchdog every tick).
#define COMM_GONE_GRACE_MS 2000
#define COMM_WATCH_TICK_MS 100

// Fields are owned by the thread that uses the communicator; the nccl backend's own threads never touch them
// (they report through the backend state, and comm.c picks that up with comm_nccl_poll).
struct Comm {
    CommBackend backend;
    int rank, world, timeout_ms;
    int failed;              // 1 after the first failure other than COMM_ERR_INVALID
    uint64_t calls;          // collective calls accepted so far ("call #n" in messages)
    int *node;               // (world) node index of every member
    int nnodes;
    CommBytes bytes;         // sent so far (comm_bytes)
    OpsCtx *ops;
    void *impl;              // backend state
    char err[COMM_ERR_MAX];
};

// Records a message and returns code; any code except COMM_ERR_INVALID marks the communicator failed.
int comm_fail(Comm *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
const char *comm_dtype_name(CommDtype dtype);

// Host backend. Arguments were checked by comm.c (ranges, NULLs, overlaps, count > 0). watch: NULL, or the peer
// watch of a communicator joined by id (copied; see COMM_GONE_GRACE_MS), consulted while joining and in every call.
int comm_host_create(Comm *c, const CommInit *ci, const CommPeerWatch *watch, char *err, size_t err_len);
// The host backend's id (comm_host_id.c): 1 when id starts as comm_unique_id_host's ids do (whatever follows).
int comm_host_id_is(const uint8_t id[COMM_UNIQUE_ID_BYTES]);
// Reads the rendezvous address (addr_len >= COMM_HOST_ID_ADDR_MAX + 1) and port out of a host id; a malformed or
// foreign id (an NCCL id's bytes) is COMM_ERR_INVALID with a message saying what a host id looks like.
int comm_host_id_parse(const uint8_t id[COMM_UNIQUE_ID_BYTES], char *addr, size_t addr_len, int *port, char *err,
                       size_t err_len);
// c->rank / c->world are the new communicator's; members[i] is member i's rank in parent; every member of parent
// calls it (those joining none with c == NULL), since the endpoints travel over parent.
int comm_host_split(Comm *c, Comm *parent, const int *members, char *err, size_t err_len);
void comm_host_destroy(Comm *c);
const char *comm_host_peer_endpoint(const Comm *c, int peer);
int comm_host_all_gather(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype);
int comm_host_reduce_scatter(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype, CommOp op);
int comm_host_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommOp op);
int comm_host_broadcast(Comm *c, void *buf, size_t count, CommDtype dtype, int root);
int comm_host_send(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer);
int comm_host_recv(Comm *c, void *buf, size_t count, CommDtype dtype, int peer);
int comm_host_barrier(Comm *c);

// NCCL backend (comm_nccl.c, CUDA builds only). Arguments were checked by comm.c as for the host backend;
// c->calls already counts the call being made. ci == NULL with id != NULL: join by id (no rendezvous). blocking: NCCL's
// blocking mode (comm_create_local_group), else non-blocking.
int comm_nccl_create(Comm *c, const CommInit *ci, const uint8_t *id, const CommPeerWatch *watch, int blocking,
                     char *err, size_t err_len);
void comm_nccl_destroy(Comm *c);
void comm_nccl_destroy_now(Comm *c);   // abort: no finalize with peers
int comm_nccl_unique_id(uint8_t id[COMM_UNIQUE_ID_BYTES], char *err, size_t err_len);
int comm_nccl_available(void);
// A failure found by the watchdog since the last call: recorded in c (comm_fail) and returned; else 0.
int comm_nccl_poll(Comm *c);
void comm_nccl_set_timeout(Comm *c, int timeout_ms);
int comm_nccl_all_gather(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype);
int comm_nccl_reduce_scatter(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype, CommOp op);
int comm_nccl_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommOp op);
int comm_nccl_broadcast(Comm *c, void *buf, size_t count, CommDtype dtype, int root);
int comm_nccl_send(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer);
int comm_nccl_recv(Comm *c, void *buf, size_t count, CommDtype dtype, int peer);
int comm_nccl_barrier(Comm *c);
int comm_nccl_group_start(Comm *c);
int comm_nccl_group_end(Comm *c);
int comm_nccl_synchronize(Comm *c);
void comm_nccl_wait_compute(Comm *c);
void comm_nccl_compute_wait(Comm *c);
int comm_nccl_graph_capable(const Comm *c);
int comm_nccl_graph_launch(Comm *c, OpsGraph *graph);

// Side channel of the nccl backend (comm_probe.c): names the peer that holds up a stalled call. Made by a
// rank that joins through the rendezvous: bind, publish the endpoint in the rendezvous, then start with the
// peer table. comm_probe_watch, _gone_ms and _diagnose belong to one thread (the watchdog).
typedef struct CommProbe CommProbe;
enum { COMM_PROBE_JOINING = 0, COMM_PROBE_READY, COMM_PROBE_FAILED };
typedef struct { uint32_t phase; uint64_t queued, completed; } CommProbeState;   // phase: COMM_PROBE_*
#define COMM_PROBE_WAIT_MS 1000   // how long a diagnosis waits for the peers' answers

// Binds this rank's probe socket on the interface that routes to master_addr; endpoint receives the address
// to publish. *out is set even on failure (release it with comm_probe_close).
int comm_probe_bind(CommProbe **out, int rank, int world, const char *master_addr, int master_port, char *endpoint,
                    size_t endpoint_len, char *err, size_t err_len);
// Connects to every peer's probe socket (a monitor notes each connection closing) and starts answering the
// peers' probes with state(arg), called on the responder thread.
int comm_probe_start(CommProbe *p, const RdzvPeer *peers, void (*state)(void *arg, CommProbeState *out), void *arg,
                     char *err, size_t err_len);
// Waits at most wait_ms for a connection event, then records what happened.
void comm_probe_watch(CommProbe *p, int wait_ms);
// When peer's process went away (its connection closed; CLOCK_MONOTONIC ms), 0 while it is connected.
int64_t comm_probe_gone_ms(const CommProbe *p, int peer);
// Probes every peer (at most COMM_PROBE_WAIT_MS) and appends "; rank q (host h, pid n) <why>" to out for each
// one that holds up NCCL operation number seq (init: joining), or one clause saying that none does. Returns
// the number of peers that went away.
int comm_probe_diagnose(CommProbe *p, uint64_t seq, int init, char *out, size_t len);
void comm_probe_close(CommProbe *p);

#endif
