// rollout_server/weight_nccl.c — receiving weights over NCCL into engine 0's device staging copy, then spreading it
// to the other engines (see rollout_server/weight_nccl.h).
#include "rollout_server/weight_nccl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/comm/comm.h"
#include "shared/layout.h"

#define BUCKET_BYTES ((size_t)1 << 30)   // = the trainer's WEIGHT_SYNC_BUCKET_BYTES: both sides group alike

struct WeightNccl {
    EngineGroup *g;
    Engine *e;                           // engine 0: the one that receives
    int timeout_ms;
    Comm *comm;                          // receive thread only, while one runs
    uint8_t id[ZMSG_NCCL_ID_BYTES];
    int world, rank;
    // The update in flight.
    pthread_t thread;
    int running, active;
    int64_t version;
    int trainer_ranks;
    size_t adapter_numel;                // an adapter update: elements of each layer's unit; 0: whole weights
    double t_begin, t_done;
    int rc;
    char err[768];
    // Set (monotonic ms) when a new weights_begin replaces the update in flight: the receive thread's
    // communicator then treats every other member as gone and fails within its grace period, instead of waiting
    // its timeout for senders that moved on (the trainer aborted that update, e.g. another server died in it).
    atomic_llong abandoned_ms;
};

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t abandoned_gone_ms(void *arg, int member) {
    (void)member;
    return atomic_load(&((WeightNccl *)arg)->abandoned_ms);
}

static void abandoned_name(void *arg, int member, char *out, size_t len) {
    const WeightNccl *w = arg;
    snprintf(out, len, "%s; a new weights_begin replaced this update", member < w->trainer_ranks ? "a trainer rank"
                                                                                              : "a rollout server");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int weight_nccl_create(WeightNccl **out, EngineGroup *g, int timeout_ms, char *err, size_t err_len) {
    WeightNccl *w = calloc(1, sizeof *w);
    if (!w) {
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    w->g = g;
    w->e = engine_group_engine(g, 0);
    w->timeout_ms = timeout_ms;
    *out = w;
    return 0;
}

static void join_thread(WeightNccl *w) {
    if (!w->running) return;
    pthread_join(w->thread, NULL);
    w->running = 0;
}

void weight_nccl_free(WeightNccl *w) {
    if (!w) return;
    join_thread(w);
    comm_destroy_now(w->comm);
    free(w);
}

int weight_nccl_supported(const WeightNccl *w, char *why, size_t why_len) {
    OpsCtx *o = engine_ops(w->e);
    if (ops_backend(o) != OPS_BACKEND_CUDA || ops_dtype_size(o) != 2) {
        snprintf(why, why_len, "this server runs on the CPU (--device cpu); NCCL needs a CUDA engine");
        return 0;
    }
    if (!comm_backend_available(COMM_BACKEND_NCCL)) {
        snprintf(why, why_len, "NCCL is not available in this build or on this machine");
        return 0;
    }
    return 1;
}

static void *receive_main(void *arg) {
    WeightNccl *w = arg;
    Engine *e = w->e;
    const Layout *L = &engine_model(e)->layout;
    const int W = w->trainer_ranks;
    char err[640];
    w->rc = -1;
    if (!w->comm) {
        const CommPeerWatch watch = {.gone_ms = abandoned_gone_ms, .name = abandoned_name, .arg = w};
        if (comm_create_with_id_watched(&w->comm, COMM_BACKEND_NCCL, w->id, w->rank, w->world, w->timeout_ms, &watch,
                                        engine_ops(e), err, sizeof err) != 0) {
            w->comm = NULL;
            snprintf(w->err, sizeof w->err, "joining the weight-sync communicator as member %d of %d: %s", w->rank,
                     w->world, err);
            return NULL;
        }
    }
    Comm *c = w->comm;
    comm_wait_compute(c);   // staging buffers may have been read by the last swap's copy on the compute stream
    if (w->adapter_numel) {
        // Adapters (a few hundred MB at most): one group, layer l's unit from trainer rank l % W (the rank that
        // holds its master: trainer/lora_train.h), straight into engine 0's adapter staging.
        if (comm_group_start(c) != 0) goto fail;
        for (int layer = 0; layer < engine_model(e)->cfg.num_layers; layer++) {
            void *dst = engine_adapter_device_staging(e, w->adapter_numel, layer);
            if (!dst) {
                comm_group_end(c);
                snprintf(w->err, sizeof w->err, "no device memory for the adapter units of layer %d", layer);
                goto drop;
            }
            if (comm_recv(c, dst, w->adapter_numel, COMM_BF16, layer % W) != 0) {
                comm_group_end(c);
                goto fail;
            }
        }
        if (comm_group_end(c) != 0) goto fail;
    }
    for (int u0 = 0; u0 < L->n_units && !w->adapter_numel;) {
        size_t bucket = 0;
        int u1 = u0;
        if (comm_group_start(c) != 0) goto fail;
        // The same buckets as the senders (trainer/weight_sync.c): bytes of the sender's own slice per unit.
        while (u1 < L->n_units && (u1 == u0 || bucket < BUCKET_BYTES)) {
            size_t shard = layout_padded_unit_numel(L, u1, W) / W;
            char *dst = engine_weights_device_staging(e, u1);
            for (int r = 0; r < W && dst; r++) {
                size_t off = (size_t)r * shard;
                if (off >= L->unit_numel[u1]) break;
                size_t count = L->unit_numel[u1] - off < shard ? L->unit_numel[u1] - off : shard;
                if (comm_recv(c, dst + off * 2, count, COMM_BF16, r) != 0) {
                    comm_group_end(c);
                    goto fail;
                }
            }
            if (!dst) {
                comm_group_end(c);
                snprintf(w->err, sizeof w->err, "no device memory for the staging copy of unit %d", u1);
                goto drop;
            }
            size_t own = L->unit_numel[u1] < shard ? L->unit_numel[u1] : shard;   // rank 0's slice: the largest
            bucket += own * 2;
            u1++;
        }
        if (comm_group_end(c) != 0) goto fail;
        u0 = u1;
    }
    if (comm_synchronize(c) != 0) goto fail;
    if (!w->adapter_numel && engine_group_size(w->g) > 1 &&
        engine_group_spread_device_staging(w->g, err, sizeof err) != 0) {
        snprintf(w->err, sizeof w->err, "spreading the received weights to the other engines: %.600s", err);
        goto drop;   // as any failed update: the next weights_begin brings a new communicator
    }
    w->t_done = now_s();
    w->rc = 0;
    return NULL;
fail:
    snprintf(w->err, sizeof w->err, "receiving weights over NCCL: %s", comm_error(c));
drop:
    comm_destroy_now(w->comm);
    w->comm = NULL;
    return NULL;
}

// A receive still running gives up (within ~2 s: its peers count as gone) and is joined.
static void stop_receive(WeightNccl *w) {
    if (w->running) atomic_store(&w->abandoned_ms, now_ms());
    join_thread(w);
}

void weight_nccl_stop(WeightNccl *w) {
    stop_receive(w);
    if (w->active)
        fprintf(stderr, "tandem-serve: weight update to version %lld abandoned by a new weights_begin\n",
                (long long)w->version);
    w->active = 0;
}

int weight_nccl_begin(WeightNccl *w, const ZmsgMsg *q, size_t adapter_numel, char *err, size_t err_len) {
    weight_nccl_stop(w);
    if (w->comm && (memcmp(w->id, q->nccl_id, sizeof w->id) != 0 || w->world != q->nccl_world ||
                    w->rank != q->nccl_rank)) {
        comm_destroy_now(w->comm);   // a new communicator: the trainer's ranks or servers changed
        w->comm = NULL;
    }
    memcpy(w->id, q->nccl_id, sizeof w->id);
    w->world = q->nccl_world;
    w->rank = q->nccl_rank;
    w->trainer_ranks = q->trainer_ranks;
    w->adapter_numel = adapter_numel;
    w->version = q->version;
    w->t_begin = now_s();
    w->err[0] = 0;
    if (pthread_create(&w->thread, NULL, receive_main, w) != 0) {
        snprintf(err, err_len, "cannot start the NCCL receive thread");
        return -1;
    }
    w->running = w->active = 1;
    return 0;
}

int weight_nccl_active(const WeightNccl *w) { return w->active; }

int weight_nccl_adapter(const WeightNccl *w) { return w->active && w->adapter_numel > 0; }

void weight_nccl_abandon(WeightNccl *w) {
    if (w->active)
        fprintf(stderr, "tandem-serve: weight update to version %lld over NCCL abandoned (the trainer switched to "
                        "transport zmq)\n", (long long)w->version);
    w->active = 0;
}

int weight_nccl_finish(WeightNccl *w, int64_t version, double *seconds, char *err, size_t err_len) {
    if (!w->active || w->version != version) {
        snprintf(err, err_len, "weights_end for version %lld, but the open NCCL update is %s", (long long)version,
                 w->active ? "another version" : "none");
        return -1;
    }
    join_thread(w);
    w->active = 0;
    if (w->rc != 0) {
        snprintf(err, err_len, "%s", w->err);
        return -1;
    }
    *seconds = w->t_done - w->t_begin;
    return 0;
}
