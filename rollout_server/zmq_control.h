// rollout_server/zmq_control.h — the trainer's ZeroMQ control channel (`--control tcp://host:port`).
//
// A ROUTER socket served by its own thread; trainers connect with DEALER and speak the protocol of
// docs/protocol-zmq.md (codec: shared/zmq_msg.h): hello, generate (results per prompt as each finishes),
// pause, resume, reset_cache, stats, shutdown, and the weight receive path weights_begin / weights_slice /
// weights_end with transport "zmq" (rollout_server/weight_recv.h) or "nccl" (rollout_server/weight_nccl.h).
// A malformed message gets an error reply; the server keeps serving.
//
// Threads: the socket thread owns the ROUTER socket and the weight-update state; a collector thread pumps the
// events of every generate in flight (engine_request_next) and hands finished results back to the socket
// thread through an inproc PUSH/PULL pair, so each ZeroMQ socket is only ever touched by one thread.
#ifndef TANDEM_ROLLOUT_ZMQ_CONTROL_H
#define TANDEM_ROLLOUT_ZMQ_CONTROL_H

#include <stddef.h>

#include "rollout_server/engine_group.h"
#include "rollout_server/zmq_control_auth.h"

typedef struct ZmqControl ZmqControl;

// Binds a ROUTER socket at endpoint (e.g. "tcp://0.0.0.0:5555", "ipc:///tmp/x") and starts serving the engines
// of g: each prompt of a generate is routed on its own (engine_group_submit); pause, resume, reset_cache and
// weight updates apply to every engine; stats and hello answer for the whole server.
// weight_sync_timeout_ms bounds joining the NCCL weight-sync communicator and each NCCL receive. update_mode is what
// a weights_end without "mode" does with the sequences in flight (engine_commit_weights).
// keys: NULL serves every client (plain ZeroMQ); else the socket is a CURVE server that admits only the
// authorized client keys (rollout_server/zmq_control_auth.h). The caller decides where plain is allowed.
// Returns 0, or a negative code with a message (bad endpoint, address in use, ...). g must outlive the control.
int zmq_control_start(ZmqControl **out, EngineGroup *g, const char *endpoint, const ZmqControlKeys *keys,
                      int weight_sync_timeout_ms, EngineUpdateMode update_mode, char *err, size_t err_len);

// 1 once a peer has sent `shutdown` (the acknowledgement is already queued): main should then stop the HTTP
// server, call zmq_control_stop and engine_group_destroy, and exit 0 as on SIGTERM. Safe from any thread.
int zmq_control_shutdown_requested(ZmqControl *z);

// Optional: called once, from the control thread, right after a `shutdown` was acknowledged (for example to
// wake main's wait loop). Set it before a peer can send shutdown, i.e. right after zmq_control_start.
void zmq_control_on_shutdown(ZmqControl *z, void (*cb)(void *user), void *user);

// Stops both threads, releases (aborts) every generate still in flight, drops a half-received weight update
// (the engine keeps its current weights), flushes queued replies for up to half a second and closes the
// socket. Call it before engine_group_destroy. NULL is a no-op.
void zmq_control_stop(ZmqControl *z);

#endif
