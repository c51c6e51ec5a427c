// rollout_server/zmq_control_auth.h — who may use the control channel (docs/protocol-zmq.md, "Authentication").
//
// With keys, the ROUTER socket is a CURVE server: the handshake fails for a client without CURVE or without the
// server's public key, and a ZAP handler (ZeroMQ's authentication hook, a REP socket at inproc://zeromq.zap.01 in
// the control's context) refuses every client whose public key is not listed. A refused client gets no
// connection at all, so nothing it sends reaches the engine.
// Each refusal is logged on stderr, at most once a minute per client address (ZAP) or per kind of failed
// handshake (socket monitor: ZeroMQ does not say which address failed a handshake), with the count of refusals
// folded into that line, so a client retrying in a loop does not flood the log.
#ifndef TANDEM_ROLLOUT_ZMQ_CONTROL_AUTH_H
#define TANDEM_ROLLOUT_ZMQ_CONTROL_AUTH_H

#include <stddef.h>

#include "shared/control_keys.h"

// What tandem-serve was given: the server's key pair and the client public keys allowed in.
typedef struct {
    ControlKeyPair server;
    ControlKey authorized[CONTROL_MAX_AUTHORIZED_KEYS];
    int n_authorized;
    const char *authorized_path;    // named in the refusal lines
} ZmqControlKeys;

typedef struct ZmqControlAuth ZmqControlAuth;

// Starts the ZAP handler in ctx and makes router (not yet bound) a CURVE server with keys' server pair, its
// handshake failures watched. Call before zmq_bind. The handler thread owns its sockets until the stop.
int zmq_control_auth_start(ZmqControlAuth **out, void *ctx, void *router, const ZmqControlKeys *keys, char *err,
                           size_t err_len);
// Stops the thread and closes its sockets; before zmq_ctx_term of ctx. NULL is a no-op.
void zmq_control_auth_stop(ZmqControlAuth *a);

// 1 when nobody outside this machine can reach endpoint: ipc://, inproc://, and tcp:// on a loopback address
// (127.0.0.0/8, ::1, localhost). A control channel without keys is only allowed there (or with
// --control-insecure).
int zmq_control_endpoint_is_local(const char *endpoint);

#endif
