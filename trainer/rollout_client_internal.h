// trainer/rollout_client_internal.h — what trainer/rollout_client.c (connections, generation) shares with
// trainer/rollout_weights.c (weight pushes): the client's state and its request/answer primitives.
#ifndef TANDEM_TRAINER_ROLLOUT_CLIENT_INTERNAL_H
#define TANDEM_TRAINER_ROLLOUT_CLIENT_INTERNAL_H

#include <zmq.h>

#include "shared/control_keys.h"
#include "trainer/rollout_client.h"
#include "trainer/server_liveness.h"

#define MAX_SERVERS ROLLOUT_MAX_SERVERS
#define SLICE_ELEMS (1 << 20)     // elements per weights_slice frame
#define POLL_SLICE_MS 100         // a wait looks at the server's liveness this often

typedef struct {
    char endpoint[256];
    void *sock;
    int alive;
    int max_seq_len;
    int tensor_parallel_size;   // its shards, as of the last hello: members of an NCCL weight update
    int in_flight;      // prompts assigned and not answered
    int64_t policy_version;   // as of the last hello
    int in_push;        // a member of the weight update in flight (rollout_weights_set_members)
    int epoch;          // bumped each time the socket is replaced: what was sent on an older one is lost
} Server;

struct RolloutClient {
    void *zctx;
    int secure;                 // 1: every socket is a CURVE client with the keys below
    ControlKey server_public;
    ControlKeyPair client;
    ServerLiveness *live;       // whether each server's connection is up (heartbeats, socket monitors)
    Server servers[MAX_SERVERS];
    int n_servers;
    uint64_t layout_hash;
    int timeout_ms;
    int64_t next_id;
    int next_server;    // round-robin cursor
    double push_since_ms;   // when the weight update in flight began (its members: Server.in_push)
    struct RolloutPending *pending;   // generations sent and not yet collected (rollout_generate_start), a list
};

static inline double now_ms(void) { return (double)server_liveness_now_ms(); }
static inline int server_index(const RolloutClient *c, const Server *s) { return (int)(s - c->servers); }

// 1 when s's connection dropped at or after since_ms (the process died, restarted or stopped answering
// heartbeats): whatever was sent to it since is lost.
int rollout_gone_since(RolloutClient *c, const Server *s, double since_ms);
// Sends m to s without blocking on a dead server: 0 sent, 1 not sent (*gone: it went away since since_ms, else it
// stayed full for timeout_ms), -1 error.
int rollout_send_msg(RolloutClient *c, Server *s, const ZmsgMsg *m, double since_ms, int timeout_ms, int *gone,
                     char *err, size_t err_len);
// The answer to request id (`what`, sent at since_ms): 1 in *m, 0 none will come (*gone says why), -1 error.
int rollout_wait_reply(RolloutClient *c, Server *s, int64_t id, const char *what, double since_ms, ZmsgMsg *m,
                       int timeout_ms, int *gone, char *err, size_t err_len);
// Receives one whole multipart message from s (non-blocking: call after poll says it is readable): 1 with *m
// parsed (it owns its data; free with zmsg_free), 0 if nothing was there, -1 on a malformed reply. parts (8) are
// closed by the caller with rollout_close_parts.
int rollout_recv_msg(Server *s, ZmsgMsg *m, zmq_msg_t *parts, int *n_parts, char *err, size_t err_len);
void rollout_close_parts(zmq_msg_t *parts, int n);
// An answer read while waiting for something else (a hello, a weight push): when it answers a prompt of a
// generation in flight from server `server`, that generation keeps it (*m is moved, returns 1); else 0.
int rollout_pending_keep(RolloutClient *c, int server, ZmsgMsg *m);
// A hello round trip: 1 answered, 0 no answer within timeout_ms, -1 error (another layout, a refusal).
int rollout_hello(RolloutClient *c, Server *s, int timeout_ms, char *err, size_t err_len);
// Sets s aside (logged once, `why`) and gives it a fresh socket.
void rollout_mark_dead(RolloutClient *c, Server *s, const char *why);

#endif
