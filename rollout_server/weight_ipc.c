// rollout_server/weight_ipc.c — transport ipc's side of an update: the sender's host and shards checked, engine 0's
// device staging placed in memory the trainer ranks map (rollout_server/model_runner.h runner_weights_ipc_staging),
// its handles in the reply (see rollout_server/weight_ipc.h).
#include "rollout_server/weight_ipc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shared/ipc_region.h"

struct WeightIpc {
    EngineGroup *g;
    Engine *e;                 // engine 0: its shards' staging is what the ranks write
    int tp;
    char host[IPC_HOST_ID_MAX];
    uint64_t staging_id;       // this process's: a restarted server has another
    int announced;             // the first update's regions were logged
    int active;
    int64_t version;
    double t_begin;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int weight_ipc_create(WeightIpc **out, EngineGroup *g, char *err, size_t err_len) {
    WeightIpc *w = calloc(1, sizeof *w);
    if (!w) {
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    w->g = g;
    w->e = engine_group_engine(g, 0);
    w->tp = engine_tp(w->e);
    w->staging_id = ipc_random_id();
    // Without a boot id every ipc weights_begin is refused (this host cannot be told from another).
    char why[256];
    if (ipc_host_id(w->host, why, sizeof why) != 0) w->host[0] = '\0';
    *out = w;
    return 0;
}

void weight_ipc_free(WeightIpc *w) { free(w); }

int weight_ipc_begin(WeightIpc *w, const ZmsgMsg *q, ZmsgIpc *reply, char *err, size_t err_len) {
    w->active = 0;
    if (!w->host[0] || strcmp(w->host, q->ipc_host) != 0) {
        snprintf(err, err_len, "transport \"ipc\" needs the trainer on this server's host, and it is not (this host's "
                 "boot id %s, the trainer's %s); use transport \"nccl\" or \"zmq\"",
                 w->host[0] ? w->host : "(unreadable)", q->ipc_host);
        return WEIGHT_IPC_EUNSUPPORTED;
    }
    const int tp = q->tensor_parallel_size > 1 ? q->tensor_parallel_size : 1;
    if (tp != w->tp) {
        snprintf(err, err_len, "the trainer cut the weights for %d tensor-parallel shard(s), this server runs %d; the "
                 "trainer reads the size again at its next hello", tp, w->tp);
        return WEIGHT_IPC_ESHARDS;
    }
    if (w->tp > ZMSG_IPC_MAX_SHARDS) {
        snprintf(err, err_len, "transport \"ipc\" describes at most %d shards, this server runs %d; use transport "
                 "\"nccl\"", ZMSG_IPC_MAX_SHARDS, w->tp);
        return WEIGHT_IPC_EUNSUPPORTED;
    }
    memset(reply, 0, sizeof *reply);
    reply->present = 1;
    snprintf(reply->host, sizeof reply->host, "%s", w->host);
    reply->staging_id = w->staging_id;
    reply->pid = (int64_t)getpid();
    reply->n_shards = w->tp;
    for (int k = 0; k < w->tp; k++) {
        char msg[640];
        const IpcRegion *g = engine_weights_ipc_staging(w->e, k, msg, sizeof msg);
        if (!g) {
            snprintf(err, err_len, "%s", msg);
            return WEIGHT_IPC_ENOMEM;
        }
        ZmsgIpcShard *sh = &reply->shards[k];
        reply->cuda = g->kind == IPC_KIND_CUDA;
        snprintf(sh->handle, sizeof sh->handle, "%s", g->handle);
        sh->bytes = (int64_t)g->bytes;
        if (reply->cuda) {
            char pci[IPC_DEVICE_ID_MAX], uuid[IPC_DEVICE_ID_MAX];
            if (ipc_cuda_device_ids(g->device, pci, uuid) != 0)
                snprintf(pci, sizeof pci, "cuda:%d", g->device), snprintf(uuid, sizeof uuid, "unknown");
            snprintf(sh->device, sizeof sh->device, "%s", pci);
            snprintf(sh->uuid, sizeof sh->uuid, "%s", uuid);
        }
    }
    // The other engines (--devices) receive a copy of engine 0's staging at weights_end: theirs must exist.
    int bad_engine, bad_shard, bad_unit;
    if (engine_group_device_staging_ready(w->g, &bad_engine, &bad_shard, &bad_unit) != 0) {
        snprintf(err, err_len, "no memory on %s (tensor-parallel shard %d) for the second copy of the weights that an "
                 "ipc update is spread into (unit %d); lower --kv-cache-memory",
                 engine_group_device_name(w->g, bad_engine), bad_shard, bad_unit);
        return WEIGHT_IPC_ENOMEM;
    }
    if (!w->announced)
        fprintf(stderr,
                "tandem-serve: transport ipc: the weight staging of %d shard(s) is in %s (staging id %016llx)\n",
                w->tp, reply->cuda ? "CUDA IPC memory" : "shared memory", (unsigned long long)w->staging_id);
    w->announced = 1;
    w->version = q->version;
    w->t_begin = now_s();
    w->active = 1;
    return 0;
}

int weight_ipc_active(const WeightIpc *w) { return w->active; }

void weight_ipc_abandon(WeightIpc *w) {
    if (w->active)
        fprintf(stderr, "tandem-serve: weight update to version %lld over ipc abandoned by a new weights_begin\n",
                (long long)w->version);
    w->active = 0;
}

int weight_ipc_finish(WeightIpc *w, int64_t version, double *seconds, char *err, size_t err_len) {
    if (!w->active || w->version != version) {
        snprintf(err, err_len, "weights_end for version %lld, but the open ipc update is %s", (long long)version,
                 w->active ? "another version" : "none");
        return -1;
    }
    w->active = 0;
    // Engine 0's staging holds the update; the other engines get a copy of it, as over NCCL.
    char msg[640];
    if (engine_group_size(w->g) > 1 && engine_group_spread_device_staging(w->g, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "spreading the received weights to the other engines: %s", msg);
        return -1;
    }
    *seconds = now_s() - w->t_begin;
    return 0;
}
