// rollout_server/weight_nccl.c — receiving weights over NCCL into engine 0's device staging copy (each
// tensor-parallel shard its own parts), then spreading it to the other engines (see rollout_server/weight_nccl.h).
#include "rollout_server/weight_nccl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/comm/comm.h"
#include "shared/layout.h"
#include "shared/model.h"

#define BUCKET_BYTES ((size_t)1 << 30)   // = the trainer's WEIGHT_SYNC_BUCKET_BYTES: both sides group alike

// One tensor-parallel shard's member of the communicator and its receive (shard 0 on the update's thread, the
// others on threads of their own, so that each shard's calls come from one thread as NCCL wants).
typedef struct {
    struct WeightNccl *w;
    int shard;
    Comm *comm;                          // kept across updates while the id stays the same
    pthread_t thread;
    int have_thread;
    int rc;
    char err[640];
    ModelShardPart parts[MODEL_SHARD_MAX_PARTS];
} ShardRecv;

struct WeightNccl {
    EngineGroup *g;
    Engine *e;                           // engine 0: the one that receives
    int timeout_ms;
    int tp;                              // engine 0's shards: members rank .. rank + tp - 1
    ShardRecv *shards;                   // (tp)
    uint8_t id[ZMSG_NCCL_ID_BYTES];
    int world, rank;
    CommBackend backend;
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
    if (w) w->tp = engine_tp(engine_group_engine(g, 0));
    if (!w || !(w->shards = calloc((size_t)w->tp, sizeof *w->shards))) {
        free(w);
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    w->g = g;
    w->e = engine_group_engine(g, 0);
    w->timeout_ms = timeout_ms;
    for (int k = 0; k < w->tp; k++) w->shards[k] = (ShardRecv){.w = w, .shard = k};
    *out = w;
    return 0;
}

static void join_thread(WeightNccl *w) {
    if (!w->running) return;
    pthread_join(w->thread, NULL);
    w->running = 0;
}

static void drop_comms(WeightNccl *w) {
    for (int k = 0; k < w->tp; k++) {
        comm_destroy_now(w->shards[k].comm);
        w->shards[k].comm = NULL;
    }
}

void weight_nccl_free(WeightNccl *w) {
    if (!w) return;
    join_thread(w);
    drop_comms(w);
    free(w->shards);
    free(w);
}

int weight_nccl_supported(const WeightNccl *w, ZmsgCommBackend backend, char *why, size_t why_len) {
    OpsCtx *o = engine_ops(w->e);
    const int cuda = ops_backend(o) == OPS_BACKEND_CUDA;
    if (backend == ZMSG_COMM_HOST && cuda) {
        snprintf(why, why_len, "the trainer's ranks run on the CPU (the host communicator) and this server on GPUs");
        return 0;
    }
    if (backend == ZMSG_COMM_HOST) return 1;
    if (!cuda || ops_dtype_size(o) != 2) {
        snprintf(why, why_len, "this server runs on the CPU (--device cpu); NCCL needs a CUDA engine");
        return 0;
    }
    if (!comm_backend_available(COMM_BACKEND_NCCL)) {
        snprintf(why, why_len, "NCCL is not available in this build or on this machine");
        return 0;
    }
    return 1;
}

static int shard_fail(ShardRecv *s, const char *what) {
    snprintf(s->err, sizeof s->err, "%s: %s", what, comm_error(s->comm));
    return -1;
}

// Shard s's receive of the update: joins the communicator as member rank + shard (if it is new), then receives from
// every trainer rank its slice of every unit (tp 1) or the parts of it that the shard holds (model_shard_parts), in
// the senders' bucket order, straight into the shard's device staging. 0, or -1 with s->err.
static int receive_shard(ShardRecv *s) {
    WeightNccl *w = s->w;
    Engine *e = w->e;
    const Layout *L = &engine_model(e)->layout;
    const Model *sm = engine_shard_model(e, s->shard);
    OpsCtx *ops = engine_shard_ops(e, s->shard);
    const size_t es = ops_dtype_size(ops);
    const CommDtype dt = es == 2 ? COMM_BF16 : COMM_F32;
    const int W = w->trainer_ranks;
    if (!s->comm) {
        char err[512];
        const CommPeerWatch watch = {.gone_ms = abandoned_gone_ms, .name = abandoned_name, .arg = w};
        if (comm_create_with_id_watched(&s->comm, w->backend, w->id, w->rank + s->shard, w->world, w->timeout_ms,
                                        &watch, ops, err, sizeof err) != 0) {
            s->comm = NULL;
            snprintf(s->err, sizeof s->err, "joining the weight-sync communicator as member %d of %d: %s",
                     w->rank + s->shard, w->world, err);
            return -1;
        }
    }
    Comm *c = s->comm;
    comm_wait_compute(c);   // staging buffers may have been read by the last swap's copy on the compute stream
    if (w->adapter_numel) {
        // Adapters (a few hundred MB at most; tp 1): one group, layer l's unit from trainer rank l % W (the rank that
        // holds its master: trainer/lora_train.h), straight into engine 0's adapter staging.
        if (comm_group_start(c) != 0) return shard_fail(s, "receiving adapters");
        for (int layer = 0; layer < engine_model(e)->cfg.num_layers; layer++) {
            void *dst = engine_adapter_device_staging(e, w->adapter_numel, layer);
            if (!dst) {
                comm_group_end(c);
                snprintf(s->err, sizeof s->err, "no device memory for the adapter units of layer %d", layer);
                return -1;
            }
            if (comm_recv(c, dst, w->adapter_numel, dt, layer % W) != 0) {
                comm_group_end(c);
                return shard_fail(s, "receiving adapters");
            }
        }
        if (comm_group_end(c) != 0) return shard_fail(s, "receiving adapters");
    }
    for (int u0 = 0; u0 < L->n_units && !w->adapter_numel;) {
        size_t bucket = 0;
        int u1 = u0;
        if (comm_group_start(c) != 0) return shard_fail(s, "receiving weights");
        // The same buckets as the senders (trainer/weight_sync.c): bytes of the sender's own slice per unit.
        while (u1 < L->n_units && (u1 == u0 || bucket < BUCKET_BYTES)) {
            const size_t slice = layout_padded_unit_numel(L, u1, W) / W;
            char *dst = engine_weights_device_staging(e, s->shard, u1);
            if (!dst) {
                comm_group_end(c);
                snprintf(s->err, sizeof s->err, "no device memory for the staging copy of unit %d", u1);
                return -1;
            }
            for (int r = 0; r < W; r++) {
                const size_t off = (size_t)r * slice;
                if (off >= L->unit_numel[u1]) break;
                const size_t count = L->unit_numel[u1] - off < slice ? L->unit_numel[u1] - off : slice;
                int n = 1, rc = 0;
                if (w->tp > 1)
                    n = model_shard_parts(L, &sm->layout, &sm->cfg, &sm->shard, u1, off, off + count, s->parts,
                                          MODEL_SHARD_MAX_PARTS);
                if (n < 0) {
                    comm_group_end(c);
                    snprintf(s->err, sizeof s->err, "unit %d has more than %d parts for shard %d", u1,
                             MODEL_SHARD_MAX_PARTS, s->shard);
                    return -1;
                }
                for (int p = 0; p < n && rc == 0; p++)
                    rc = w->tp > 1 ? comm_recv(c, dst + s->parts[p].shard_at * es, s->parts[p].rows * s->parts[p].cols,
                                               dt, r)
                                   : comm_recv(c, dst + off * es, count, dt, r);
                if (rc != 0) {
                    comm_group_end(c);
                    return shard_fail(s, "receiving weights");
                }
            }
            const size_t own = L->unit_numel[u1] < slice ? L->unit_numel[u1] : slice;   // rank 0's: the largest
            bucket += own * es;
            u1++;
        }
        if (comm_group_end(c) != 0) return shard_fail(s, "receiving weights");
        u0 = u1;
    }
    return comm_synchronize(c) != 0 ? shard_fail(s, "receiving weights") : 0;
}

static void *shard_main(void *arg) {
    ShardRecv *s = arg;
    s->rc = receive_shard(s);
    return NULL;
}

static void *receive_main(void *arg) {
    WeightNccl *w = arg;
    char err[640];
    w->rc = -1;
    for (int k = 0; k < w->tp; k++) w->shards[k].err[0] = '\0';
    for (int k = 1; k < w->tp; k++) {
        ShardRecv *s = &w->shards[k];
        s->have_thread = pthread_create(&s->thread, NULL, shard_main, s) == 0;
        if (!s->have_thread) s->rc = -1, snprintf(s->err, sizeof s->err, "cannot start its receive thread");
    }
    shard_main(&w->shards[0]);
    int failed = -1;
    for (int k = 0; k < w->tp; k++) {
        ShardRecv *s = &w->shards[k];
        if (s->have_thread) pthread_join(s->thread, NULL);
        s->have_thread = 0;
        if (s->rc != 0 && failed < 0) failed = k;
    }
    if (failed >= 0) {
        if (w->tp > 1)
            snprintf(w->err, sizeof w->err, "tensor-parallel shard %d: %s", failed, w->shards[failed].err);
        else
            snprintf(w->err, sizeof w->err, "%s", w->shards[0].err);
        goto drop;
    }
    if (!w->adapter_numel && engine_group_size(w->g) > 1 &&
        engine_group_spread_device_staging(w->g, err, sizeof err) != 0) {
        snprintf(w->err, sizeof w->err, "spreading the received weights to the other engines: %.600s", err);
        goto drop;   // as any failed update: the next weights_begin brings a new communicator
    }
    w->t_done = now_s();
    w->rc = 0;
    return NULL;
drop:
    drop_comms(w);
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
    const int tp = q->tensor_parallel_size > 1 ? q->tensor_parallel_size : 1;
    if (tp != w->tp) {
        snprintf(err, err_len, "the trainer cut the weights for %d tensor-parallel shard(s), this server runs %d; the "
                 "trainer reads the size again at its next hello", tp, w->tp);
        return WEIGHT_NCCL_ESHARDS;
    }
    if (adapter_numel && w->tp > 1) {
        snprintf(err, err_len, "adapter updates into a tensor-parallel server (%d shards) are not supported; push "
                 "merged weights (tandem-train --lora-sync merged)", w->tp);
        return -1;
    }
    const CommBackend backend = q->comm_backend == ZMSG_COMM_HOST ? COMM_BACKEND_HOST : COMM_BACKEND_NCCL;
    if (memcmp(w->id, q->nccl_id, sizeof w->id) != 0 || w->world != q->nccl_world || w->rank != q->nccl_rank ||
        w->backend != backend)
        drop_comms(w);   // a new communicator: the trainer's ranks or servers changed
    memcpy(w->id, q->nccl_id, sizeof w->id);
    w->world = q->nccl_world;
    w->rank = q->nccl_rank;
    w->backend = backend;
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
