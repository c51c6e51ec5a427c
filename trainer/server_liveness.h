// trainer/server_liveness.h — whether each rollout server's control connection is up, seen as it changes.
//
// A server that dies (kill -9, a node lost) or stalls (stopped, hung host) mid-request used to be noticed only
// when the request's timeout ran out (minutes), and never during an NCCL weight push, where the trainer waits on
// the GPU, not on the socket. Each DEALER to a server sends ZMTP heartbeats (CONTROL_HEARTBEAT_*: a peer whose
// process or host stops answering them is disconnected) and has a libzmq socket monitor; a thread of this module
// reads the monitors and records, per server, the moment its connection last dropped. Any thread may ask
// (server_liveness_gone_ms): the rollout client while it waits for an answer, the NCCL watchdog of the
// weight-sync communicator while a push is on the GPU.
#ifndef TANDEM_TRAINER_SERVER_LIVENESS_H
#define TANDEM_TRAINER_SERVER_LIVENESS_H

#include <stddef.h>
#include <stdint.h>

// ZMTP heartbeats on every control socket: a ping every second; no answer for 4 s drops the connection.
#define CONTROL_HEARTBEAT_IVL_MS 1000
#define CONTROL_HEARTBEAT_TIMEOUT_MS 4000

typedef struct ServerLiveness ServerLiveness;

// For n_servers servers of ZeroMQ context zctx; starts the thread that reads the monitors.
int server_liveness_create(ServerLiveness **out, void *zctx, int n_servers, char *err, size_t err_len);
// Stops the thread and closes the monitors (before the sockets they watch are closed, or after: either works).
void server_liveness_destroy(ServerLiveness *l);

// From now on watches `sock` (server k's DEALER; call from the thread that owns it, before it connects) instead
// of what slot k watched before. Sets the socket's heartbeat options.
int server_liveness_watch(ServerLiveness *l, int k, void *sock, char *err, size_t err_len);
// Stops watching slot k (call before closing its socket).
void server_liveness_unwatch(ServerLiveness *l, int k);

// Monotonic milliseconds (server_liveness_now_ms' clock) of the last time server k's connection dropped; 0 if
// it never did. Thread-safe.
int64_t server_liveness_gone_ms(ServerLiveness *l, int k);
int64_t server_liveness_now_ms(void);

#endif
