// shared/comm/rendezvous.h — how the trainer ranks find each other (launch contract: RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT; docs/operations-comm.md).
//
// Rank 0 binds a ZeroMQ ROUTER at tcp://MASTER_ADDR:MASTER_PORT; every other rank connects a DEALER and
// registers {rank, world_size, hostname, pid, data endpoint}. Rank 0 registers itself without a socket.
// When all WORLD_SIZE ranks are in, rank 0 sends every rank the peer table and an opaque blob that rank 0
// supplied (the NCCL unique id for the nccl backend; empty for host). Failures are answers, never hangs:
//   - a rank missing when rank 0's timeout expires: rank 0 fails naming every missing rank, and every rank
//     that did arrive receives the same message;
//   - a rank registered twice, a rank outside WORLD_SIZE, a WORLD_SIZE that differs from rank 0's, or a node
//     layout (NNODES, LOCAL_WORLD_SIZE, a node index other than RANK / LOCAL_WORLD_SIZE) that differs from rank
//     0's: refused at once, naming the rank, and sent to every rank that has arrived;
//   - once everyone is in, rank 0 says the node map through the progress function (one line:
//     "node map: node 0 (host a): ranks 0-1; node 1 (host b): ranks 2-3");
//   - rank 0 never answering: the other ranks give up after twice the timeout (twice, so that while rank 0
//     is still waiting for someone they hear rank 0's verdict instead of timing out on their own);
//   - the caller's cancel hook saying that a rank will never come (RdzvConfig.cancelled): every rank that asks it
//     gives up within RDZV_CANCEL_TICK_MS with the hook's sentence, rank 0 telling the ranks that have arrived.
// The handle may be kept open for rendezvous_barrier (e.g. a final barrier for backends that have no
// other channel); rank 0 keeps its port bound until rendezvous_close.
#ifndef TANDEM_SHARED_RENDEZVOUS_H
#define TANDEM_SHARED_RENDEZVOUS_H

#include <stddef.h>

#define RDZV_PROTOCOL_VERSION 2
#define RDZV_HOST_MAX 256
#define RDZV_ENDPOINT_MAX 256
#define RDZV_BLOB_MAX (1u << 20)   // the NCCL unique id is 128 bytes; anything near 1 MiB is a mistake

typedef struct {
    int rank;
    int pid;
    char hostname[RDZV_HOST_MAX];
    char endpoint[RDZV_ENDPOINT_MAX];   // the rank's data endpoint (backend-defined; "" allowed)
} RdzvPeer;

// While the rendezvous waits (rank 0 for the others, the others for rank 0), it says what it waits for every
// RDZV_PROGRESS_MS through this function, one line without a newline (the caller prefixes and prints it).
#define RDZV_PROGRESS_MS 10000
typedef void (*RdzvProgressFn)(void *arg, const char *line);

typedef struct {
    int rank, world_size;
    const char *master_addr;   // IPv4/IPv6 literal or host name
    int master_port;           // 1..65535
    const char *port_source;   // the variable that gave master_port, for messages (NULL = "MASTER_PORT")
    int timeout_ms;            // > 0: rank 0 waits this long for registrations (others wait twice as long)
    const char *endpoint;      // this rank's data endpoint, published in the table (NULL = "")
    int node, nnodes, local_world_size;   // this rank's node (CommInit's); nnodes 0: one node of world_size ranks
    RdzvProgressFn progress;   // NULL: silent
    void *progress_arg;
    int progress_ms;           // the interval of those lines; 0: RDZV_PROGRESS_MS
    // NULL, or asked at least every RDZV_CANCEL_TICK_MS while rendezvous_run waits: nonzero gives up at once with
    // why (one sentence the hook wrote) as the error; rank 0 also sends it to every rank that has arrived. For a
    // caller that learns from elsewhere that a member will never come (comm.h CommPeerWatch).
    int (*cancelled)(void *arg, char *why, size_t why_len);
    void *cancel_arg;
} RdzvConfig;
#define RDZV_CANCEL_TICK_MS 100

typedef struct Rendezvous Rendezvous;

// Runs the rendezvous. blob/blob_len: rank 0's opaque payload (at most RDZV_BLOB_MAX bytes), handed to
// every rank; ignored on other ranks. On success *out holds the peer table and rank 0's blob.
int rendezvous_run(Rendezvous **out, const RdzvConfig *cfg, const void *blob, size_t blob_len, char *err,
                   size_t err_len);
int rendezvous_world_size(const Rendezvous *r);
// world_size entries, indexed by rank.
const RdzvPeer *rendezvous_peers(const Rendezvous *r);
// Rank 0's blob (every rank gets the same bytes); *len may be 0.
const void *rendezvous_blob(const Rendezvous *r, size_t *len);
// Every rank calls it; returns when all have. A missing rank is named (rank 0 waits timeout_ms, the
// others twice that). After a failure the handle is only good for rendezvous_close.
int rendezvous_barrier(Rendezvous *r, int timeout_ms, char *err, size_t err_len);
void rendezvous_close(Rendezvous *r);

// The address and port of an endpoint "tcp://ADDR:PORT" or "tcp://[ADDR]:PORT" (an IPv6 literal in brackets; the
// scheme may be missing): ADDR without brackets into addr, PORT into *port (0 when there is none or it is "*").
void rendezvous_endpoint_split(const char *endpoint, char *addr, size_t addr_len, int *port);

// The local IP address (numeric, no brackets) of the interface that routes to master_addr, so that a
// rank can publish a data endpoint its peers can reach. 127.0.0.1 for a loopback master. Sends nothing.
int rendezvous_local_address(const char *master_addr, int master_port, char *out, size_t out_len, char *err,
                             size_t err_len);

#endif
