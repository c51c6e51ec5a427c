// shared/comm/comm.h — collectives among trainer ranks (and, for the weight sync, rollout servers).
//
// Two backends, one set of calls with NCCL's semantics:
//   host : CPU processes (or threads) on one or several machines, data over ZeroMQ TCP sockets (CPU runs, CI).
//   nccl : GPUs within and across nodes (shared/comm/comm_nccl.c; CUDA builds only).
// Both join through the rendezvous (comm_create: the launch contract) or by id (comm_create_with_id: members that
// meet by other means pass a 128-byte id around; comm_unique_id for nccl, comm_unique_id_host for host).
// Buffers are backend memory (host memory for `host`, device memory of the OpsCtx's device for `nccl`).
// Counts are elements. Every rank must call the same collectives in the same order (the host backend detects
// a mismatch and names both calls; with nccl a mismatch stalls and ends in the timeout below). A count of 0
// returns at once (NCCL's rule). In place: all_gather with send == recv + rank * count, reduce_scatter with
// recv == send + rank * count (NCCL's rule); other overlaps of send and recv are refused.
//
// Reductions. host: contributions are added in rank order (0, 1, ..., N-1) so that results do not depend on
// message arrival order; bf16 contributions are added in fp32 and rounded once; max propagates NaN.
// nccl: NCCL's order (ring or tree, not rank order) and NCCL's arithmetic: bf16 sums round to bf16 after
// every addition (N-1 roundings), max follows fmax (a NaN loses to a number). Results are bit-identical
// across runs with the same world size and topology, and an all_reduce leaves the same bits on every rank;
// N-rank results equal 1-rank (or host) results only within bf16 / fp32 rounding (exactly for integers, and
// for two ranks, where each element is a single addition). Integer sums wrap on both backends.
//
// Ordering (nccl). Calls return once the work is queued (about 0.1 ms of host time each: NCCL's non-blocking
// mode, which keeps every call bounded, queues each launch from a thread); the data moves later, on a
// communication stream of the communicator beside the OpsCtx's compute stream. What orders what:
//   - calls on one communicator run in call order (one stream);
//   - comm_wait_compute(): later calls on this communicator wait for compute work queued before it;
//   - comm_compute_wait(): compute work queued after it waits for this communicator's calls queued before it;
//   - comm_synchronize(): the host waits for every queued call (comm_barrier and comm_destroy also wait).
// Nothing else: without comm_wait_compute a collective may read a buffer before the kernel that writes it
// has run, and without comm_compute_wait (or comm_synchronize) compute may read a result, or overwrite or
// free a buffer, while a collective still uses it. Two communicators are not ordered against each other
// (order them through the compute stream, and issue their calls in the same order on every rank).
// With `host` every call has completed when it returns and these are no-ops.
//
// Failure: a peer that does not answer within the timeout, or goes away, makes a call fail with a negative
// code and a message naming the call and, where it can tell, the rank (comm_error). With nccl a watchdog
// thread checks every queued call: one that has not completed timeout_ms after it could start (the calls
// and the compute work it waits for are done) aborts the communicator, and the next call on this thread
// returns the error (COMM_ERR_TIMEOUT, or COMM_ERR_PEER when a peer's process is known to be gone). After a
// failure the communicator is unusable.
#ifndef TANDEM_SHARED_COMM_H
#define TANDEM_SHARED_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"
#include "shared/comm/rendezvous.h"

typedef enum { COMM_BACKEND_HOST = 0, COMM_BACKEND_NCCL = 1 } CommBackend;
typedef enum { COMM_F32 = 0, COMM_BF16, COMM_I32, COMM_U8, COMM_F64 } CommDtype;
typedef enum { COMM_SUM = 0, COMM_MAX } CommOp;

// Negative return codes (comm_error says more). After COMM_ERR_INVALID nothing was sent and the
// communicator stays usable; after any other code it is unusable and every later call returns
// COMM_ERR_FAILED with the first failure's message.
enum {
    COMM_ERR_INVALID = -1,      // bad argument or environment value (named)
    COMM_ERR_TIMEOUT = -2,      // a peer was silent past the timeout (named)
    COMM_ERR_PEER = -3,         // a peer went away, or called a different collective (named); rendezvous failures
    COMM_ERR_SYSTEM = -4,       // out of memory, socket failure, CUDA or NCCL error (file:line)
    COMM_ERR_UNSUPPORTED = -5,  // backend not available in this build
    COMM_ERR_FAILED = -6,       // the communicator failed earlier
};

// The launch contract (torchrun names): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, and the node this
// rank runs on: LOCAL_WORLD_SIZE (ranks per node), NNODES or torchrun's GROUP_WORLD_SIZE (nodes), NODE_RANK or
// torchrun's GROUP_RANK (this node's index). Ranks are numbered node by node (RANK = node * LOCAL_WORLD_SIZE +
// LOCAL_RANK), as `tandem-train launch` and torchrun number them; every node has LOCAL_WORLD_SIZE ranks.
// Kubeflow PyTorchJob / JobSet's PET_NPROC_PER_NODE, PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT
// are further names of LOCAL_WORLD_SIZE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (comm_env.c).
typedef struct {
    int rank, world_size, local_rank;
    int node, nnodes, local_world_size;
    char master_addr[256];
    int master_port;         // rank 0's rendezvous port (comm_rendezvous_port_from_env), not always MASTER_PORT
    char port_source[96];    // which variable said it, for messages: "MASTER_PORT", "MASTER_PORT+1 (torchrun's ...)"
    int timeout_ms;          // rendezvous and per-call timeout (--init-timeout / --comm-timeout)
    RdzvProgressFn progress; // the rendezvous's "still waiting" lines (shared/comm/rendezvous.h); NULL: silent
    void *progress_arg;
} CommInit;

// Reads the launch contract from the environment. Missing variables default to a single rank
// (RANK 0, WORLD_SIZE 1, LOCAL_RANK 0, MASTER_ADDR 127.0.0.1, MASTER_PORT 29500); malformed ones are errors.
// Node variables: none set means one node of WORLD_SIZE ranks; LOCAL_WORLD_SIZE or NNODES alone gives the other
// (WORLD_SIZE must divide); an unset node index is RANK / LOCAL_WORLD_SIZE and an unset LOCAL_RANK
// RANK % LOCAL_WORLD_SIZE. Contradictions are errors naming the variables and their values: two names of one
// value that differ (NNODES, GROUP_WORLD_SIZE, PET_NNODES; NODE_RANK, GROUP_RANK, PET_NODE_RANK; LOCAL_WORLD_SIZE,
// PET_NPROC_PER_NODE; MASTER_ADDR, PET_MASTER_ADDR; MASTER_PORT, PET_MASTER_PORT), WORLD_SIZE != nodes x ranks per
// node, LOCAL_RANK >= ranks per node, a node index >= nodes, RANK != node x ranks per node + LOCAL_RANK, and a
// pod of PET_NPROC_PER_NODE > 1 ranks whose process has no LOCAL_RANK (PyTorchJob's RANK is the pod's index: a
// launcher must start the pod's ranks). A PET_ value that is not an integer (torchrun's "auto", "1:4") is not
// read; under torchrun (TORCHELASTIC_RUN_ID set) no PET_ variable is read: torchrun's own variables say what it
// made of them. ci->master_port is the rendezvous port of comm_rendezvous_port_from_env.
int comm_init_from_env(CommInit *ci, int timeout_ms, char *err, size_t err_len);

// The port rank 0's rendezvous binds, given MASTER_PORT's value (master_port, read from master_port_name): the
// port TANDEM_RENDEZVOUS_PORT names when set; else under torchrun (TORCHELASTIC_RUN_ID set) master_port + 1,
// because torchrun's agent on MASTER_ADDR already listens on MASTER_PORT (its TCPStore, which the workers are
// meant to share); else master_port. `tandem-train launch` and every rank use this one rule. source says which
// (for messages). Errors: TANDEM_RENDEZVOUS_PORT malformed or outside 1..65535, MASTER_PORT + 1 past 65535.
int comm_rendezvous_port_from_env(int master_port, const char *master_port_name, int *port, char *source,
                                  size_t source_len, char *err, size_t err_len);

typedef struct Comm Comm;

// Joins the group: rank 0 runs the rendezvous at MASTER_ADDR:MASTER_PORT and hands out the peer table;
// a rank missing after timeout_ms is named in the error. Every rank registers its node (ci->node, nnodes,
// local_world_size); rank 0 refuses a rank whose node layout differs from its own, and says the node map
// through ci->progress once everyone is in. ops is the compute context (nccl: its device/stream;
// host: unused, may be NULL). WORLD_SIZE 1 opens no sockets.
// nccl: ops must be a CUDA context; its device is the communicator's (create it on LOCAL_RANK) and the
// communication stream is ordered against its compute stream (see Ordering).
int comm_create(Comm **out, CommBackend backend, const CommInit *ci, OpsCtx *ops, char *err, size_t err_len);

#define COMM_UNIQUE_ID_BYTES 128
// nccl: a fresh NCCL unique id (for a communicator whose members meet by other means, e.g. the weight-sync
// group of trainer ranks + rollout servers whose id travels over ZeroMQ). The process that made it must stay
// alive until every member has joined (it answers their first contact). host: COMM_ERR_UNSUPPORTED (its id names
// an address: comm_unique_id_host).
int comm_unique_id(CommBackend backend, uint8_t id[COMM_UNIQUE_ID_BYTES], char *err, size_t err_len);
// host: an id naming a rendezvous at addr on a TCP port free now (the kernel's pick for port 0 there): the text
// "tandem-host-id 1 ADDR PORT", NUL-padded to 128 bytes. addr (IPv4/IPv6 literal without brackets, or host name; at
// most COMM_HOST_ID_ADDR_MAX bytes) must be an address of THIS machine that every member can reach, because the
// member that joins as rank 0 binds the rendezvous there: make the id on rank 0's machine (best in rank 0's process,
// so nothing else takes the port before it binds; a port taken meanwhile makes rank 0's join fail naming it). A
// host name is checked to resolve to an address of this machine; the rendezvous then listens on every IPv4
// interface. Errors: COMM_ERR_INVALID (addr empty, too long, not bare, not resolvable, not this machine's),
// COMM_ERR_SYSTEM (no free port).
#define COMM_HOST_ID_ADDR_MAX 100
int comm_unique_id_host(const char *addr, uint8_t id[COMM_UNIQUE_ID_BYTES], char *err, size_t err_len);
// Joins a communicator of `world` members identified by id, as member `rank`. Joining and every later call are
// bounded by timeout_ms. Every member passes the same id and world and a distinct rank 0..world-1.
// nccl: NCCL's own bootstrap, no rendezvous; there is no peer table, so failures cannot name the rank that is
//   gone (a CommPeerWatch can).
// host: the rendezvous (rendezvous.h) at the id's ADDR:PORT, run by member 0 (no node layout is checked; the node
//   map is as for nccl, see comm_node), then the data sockets as for comm_create; failures name the rank, host and
//   pid as comm_create's do. A malformed or foreign id (an NCCL id on host, a host id on nccl) is COMM_ERR_INVALID at once.
int comm_create_with_id(Comm **out, CommBackend backend, const uint8_t id[COMM_UNIQUE_ID_BYTES], int rank,
                        int world, int timeout_ms, OpsCtx *ops, char *err, size_t err_len);
// What a member of a communicator joined by id knows about the others from a channel of its own (the trainer's
// control connections to the rollout servers, say): gone_ms(arg, member) is the monotonic time in ms
// (CLOCK_MONOTONIC) at which that member's process was last seen going away, 0 if never. Thread-safe: the
// backend asks while it waits (nccl: the watchdog every tick; host: the joining or calling thread, at least every
// 100 ms). Both backends apply one rule (2 s = the grace):
//   - joining fails when a member gone at or after the join started has been gone for 2 s (earlier gone times are
//     taken as news from before this communicator);
//   - a call fails when a member it waits on (host; nccl: any member) is gone and the call has been held up for the
//     grace since both the call started and the member went (since = max(gone time, call start); grace = the
//     smaller of 2 s and the timeout),
// instead of waiting out the timeout. Either returns COMM_ERR_PEER with a message naming the member
// ("member 2 (<name(arg, member, out, len)>)"; name may be NULL).
typedef struct {
    int64_t (*gone_ms)(void *arg, int member);
    void (*name)(void *arg, int member, char *out, size_t len);
    void *arg;
} CommPeerWatch;
// comm_create_with_id with a peer watch (copied; arg must outlive the communicator). NULL watch: none.
int comm_create_with_id_watched(Comm **out, CommBackend backend, const uint8_t id[COMM_UNIQUE_ID_BYTES], int rank,
                                int world, int timeout_ms, const CommPeerWatch *watch, OpsCtx *ops, char *err,
                                size_t err_len);
// comm_create_with_id for the members of one process, each joining from its own thread at the same time (the
// tensor-parallel shards of a rollout server): NCCL's blocking mode, whose calls cost a few µs of host time against
// ~100 µs for the non-blocking mode's (which lets a watchdog abort a join that waits on a member that never comes;
// here none can fail to come). A call that stalls is still aborted by the watchdog after the timeout.
int comm_create_local_group(Comm **out, CommBackend backend, const uint8_t id[COMM_UNIQUE_ID_BYTES], int rank,
                            int world, int timeout_ms, OpsCtx *ops, char *err, size_t err_len);
// 1 when this build and machine can run the backend (host: always; nccl: a CUDA build, a visible device and
// a working libnccl).
int comm_backend_available(CommBackend backend);

// nccl: waits (at most the timeout) for queued calls, then releases the communicator; after a failure it
// waits for nothing. host: see docs/operations-comm.md (shutdown).
void comm_destroy(Comm *c);
// Releases at once without flushing with the peers (nccl: ncclCommAbort; host: as comm_destroy): for a
// communicator whose peers live on and will not tear it down with us — the weight-sync group of trainer ranks
// and rollout servers, which a finalize would wait on until the timeout. Queued calls must be complete
// (comm_synchronize) or abandoned.
void comm_destroy_now(Comm *c);
// The per-call timeout from now on (e.g. --comm-timeout after a longer --init-timeout for joining). host: a
// call fails when nothing moves between this rank and the peers it waits on for timeout_ms. nccl: a queued
// call fails when it has not completed timeout_ms after it could start.
int comm_set_timeout(Comm *c, int timeout_ms);
int comm_rank(const Comm *c);
int comm_world_size(const Comm *c);

// ---- nodes and sub-communicators (docs/operations-comm.md "Nodes") ----
// The node index of member m, 0 .. comm_node_count - 1, or -1 for a bad member. Made through the rendezvous: the
// launch contract's node index (RANK / LOCAL_WORLD_SIZE). Made by comm_split: the parent's nodes renumbered in the
// order their first member appears. Joined by id: every member a node of its own until comm_set_nodes.
int comm_node(const Comm *c, int member);
int comm_node_count(const Comm *c);
// Gives a communicator joined by id its members' nodes (world entries, e.g. copied from the host communicator
// of the same ranks with comm_node). Local: nothing is sent.
int comm_set_nodes(Comm *c, const int *node);
// Collective over parent (every member calls it): the members that pass the same color >= 0 form a new
// communicator, ranked by key, then by parent rank (MPI_Comm_split's rule). color < 0: this rank joins none
// (*out = NULL). The new one has the parent's backend, compute context, timeout and node map.
// host: new sockets, their endpoints exchanged over the parent. nccl: a fresh unique id per color, made by its
// first member and exchanged over the parent; the sub-communicator has no peer watch (a lost member is found
// by the timeout, not named).
int comm_split(Comm **out, Comm *parent, int color, int key, char *err, size_t err_len);
// The two splits of a node-aware layout, collectives over parent: *intra = the members on this rank's node
// (ranked by parent rank), *inter = the members with this rank's index within its node, one per node (ranked by
// node). Needs the same number of members on every node.
int comm_split_nodes(Comm *parent, Comm **intra, Comm **inter, char *err, size_t err_len);

// Bytes this rank has sent through the communicator since it was made, split by whether the receiving member
// is on this rank's node. Counted per call from its arguments as the host backend moves them (every rank sends
// its block straight to every peer: all_gather / reduce_scatter count x size to each peer, all_reduce
// 2 x ceil(count / N) x size to each, broadcast count x size from the root to each, send count x size), on
// both backends: NCCL's rings and trees move the same bytes per rank over other routes.
typedef struct {
    uint64_t intra_node, inter_node;
} CommBytes;
void comm_bytes(const Comm *c, CommBytes *out);
const char *comm_error(const Comm *c);
// host backend: the data endpoint rank `peer` published at the rendezvous ("tcp://addr:port"); its libzmq answers
// ZMTP heartbeats, so a connection to it tells whether that rank's process lives. NULL for nccl or a bad peer.
const char *comm_peer_endpoint(const Comm *c, int peer);
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
// Returns when every rank has called it (nccl: a one-element all_reduce, then comm_synchronize).
int comm_barrier(Comm *c);

// Brackets calls that must progress together, typically sends and receives between the same ranks in both
// directions, which would otherwise wait for each other (nccl: ncclGroupStart/End; the calls are queued at
// comm_group_end). Calls of one communicator only; may nest. host: no-ops (0), so large paired send/recv
// still need an order in which they can meet.
int comm_group_start(Comm *c);
int comm_group_end(Comm *c);
// Waits until every queued call has completed on the device (host: returns at once); the timeout applies.
// Not inside a group.
int comm_synchronize(Comm *c);

// See "Ordering" above. A CUDA failure here fails the communicator (comm_error; later calls return
// COMM_ERR_FAILED).
void comm_wait_compute(Comm *c);
void comm_compute_wait(Comm *c);

// ---- CUDA graphs (nccl) ----
// A call made by a thread while it records a graph on the communicator's compute context (ops_graph_begin ..
// ops_graph_end, kernels/ops.h) is recorded into that graph instead of being run: NCCL queues it on the recording's
// stream (ops_cuda_recording_stream), in order with the recorded ops, so comm_wait_compute and comm_compute_wait have
// nothing to order then (they do nothing). It gets no watchdog record (an event recorded into a graph cannot be
// watched); the replay is watched instead, through comm_graph_launch. Recording needs NCCL's blocking mode
// (comm_create_local_group; comm_graph_capable): in the non-blocking mode NCCL launches from a thread of its own,
// outside the recording, and the call is refused (COMM_ERR_INVALID, the communicator stays usable). Groups are not
// recorded (refused the same way). Every member must replay the graphs that hold its calls in the same order, and
// all members must take the same path for a call (all recorded and replayed, or all run): NCCL may pick another
// algorithm for a call recorded into a graph than for one run directly.
// Lifetime: a graph holding a communicator's calls must be destroyed before the communicator (NCCL's teardown waits
// until no graph holds its calls). After a failure the abort makes NCCL's kernels (in replays too) exit at once, and
// completes on the watchdog's thread once those graphs are destroyed.
// host: there are no graphs on the CPU (ops_graph_begin answers OPS_GRAPH_UNSUPPORTED), nothing is recorded.

// 1 when calls of this communicator can be recorded into CUDA graphs (nccl in NCCL's blocking mode), else 0.
int comm_graph_capable(const Comm *c);
// Queues one replay of graph (ops_graph_launch on the communicator's compute context), a graph that holds calls of
// this communicator, under the watchdog: a replay that has not completed timeout_ms after it could start (the
// compute work queued before it is done) fails the communicator as a stalled call does (COMM_ERR_TIMEOUT, seen by the
// next call, comm_synchronize or comm_graph_launch; the abort lets the compute stream move on). A communicator that
// failed earlier is not replayed on (its NCCL state is gone): its code is returned and nothing is queued. Returns 0,
// a negative comm code (comm_error), or COMM_ERR_INVALID when ops_graph_launch failed (the context's error says why;
// the communicator stays usable).
int comm_graph_launch(Comm *c, OpsGraph *graph);

#endif
