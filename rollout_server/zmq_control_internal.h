// rollout_server/zmq_control_internal.h — what the files of the ZeroMQ control channel share (zmq_control.h is the
// API): zmq_control.c runs the ROUTER socket thread (receive, dispatch, replies, hello, stats, pause / resume /
// reset / shutdown) and the lifecycle; zmq_generate.c takes generate requests and runs the collector thread that
// gathers their results; zmq_weights.c handles weights_begin / weights_slice / weights_end. Not an API.
#ifndef TANDEM_ROLLOUT_ZMQ_CONTROL_INTERNAL_H
#define TANDEM_ROLLOUT_ZMQ_CONTROL_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "rollout_server/weight_ipc.h"
#include "rollout_server/weight_nccl.h"
#include "rollout_server/weight_recv.h"
#include "rollout_server/zmq_control.h"
#include "shared/zmq_msg.h"

#define ZC_POLL_MS 100          // how often the threads look at the stop flag when idle

typedef struct ZcJob ZcJob;     // one prompt of a generate in flight (zmq_generate.c)

struct ZmqControl {
    EngineGroup *g;
    EngineUpdateMode update_mode; // what a weights_end without "mode" does with the sequences in flight
    void *ctx, *router, *pull, *push;
    char pipe_name[64];
    pthread_t sock_thread, coll_thread;
    int sock_started, coll_started;
    atomic_int stop, coll_stop, shutdown_requested;
    atomic_llong prompts_in_flight;
    void (*on_shutdown)(void *);
    void *on_shutdown_user;
    pthread_mutex_t mu;         // guards incoming and on_shutdown
    pthread_cond_t cv;
    ZcJob *incoming;            // jobs submitted by the socket thread, not yet taken by the collector
    WeightRecv wr;              // socket thread only
    WeightNccl *wn;             // socket thread only: transport nccl
    WeightIpc *wi;              // socket thread only: transport ipc
    // An adapter update (weights_begin with "adapter"), socket thread only: its receiver over the decoder layers'
    // adapter units, their host staging (adapter_layers of adapter_numel[0] fp32 each) and the adapters' config.
    WeightRecv wa;
    int adapter_open;
    struct LoraConfig *adapter_cfg;
    size_t *adapter_numel;      // (adapter_layers) every entry the same
    float **adapter_units;      // (adapter_layers)
    int adapter_layers;
    ZmqControlAuth *auth;       // NULL without keys
};

// ---- zmq_weights.c ---
// Frees an adapter update's receiver and staging.
void zc_adapter_free(ZmqControl *z);

// ---- zmq_control.c ----------------------------------------------------------------------------------------
// Encodes m and sends it, after the routing id, on sock (the ROUTER, or the inproc PUSH that feeds it).
void zc_send_msg(void *sock, const void *rid, size_t rid_len, const ZmsgMsg *m);
// An error reply {code, printf-style message} to request `id`.
void zc_send_error(void *sock, const void *rid, size_t rid_len, int64_t id, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
// The protocol's error code of an ENGINE_* return code.
const char *zc_engine_code(int rc);
double zc_now(void);            // monotonic seconds

// ---- zmq_generate.c ---------------------------------------------------------------------------------------
// A generate request (socket thread): submits every prompt or none, and hands the jobs to the collector.
void zc_generate(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q);
// The collector thread: pumps the events of every job, sends each finished prompt's result through z->push, and at
// coll_stop releases (aborts) what is left and closes z->push.
void *zc_collector_main(void *arg);
// Releases (aborts) and frees a list of jobs the collector never took.
void zc_drop_jobs(ZmqControl *z, ZcJob *jobs);

// ---- zmq_weights.c ----------------------------------------------------------------------------------------
// weights_begin, weights_slice or weights_end (socket thread), transport zmq or nccl.
void zc_weights(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q);

#endif
