// rollout_server/weight_ipc.c — transport ipc's receive staging: regions the trainer ranks of this host map and
// write, copied into the engines' device staging at weights_end (see rollout_server/weight_ipc.h).
#include "rollout_server/weight_ipc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shared/ipc_region.h"

struct WeightIpc {
    EngineGroup *g;
    Engine *e;                 // engine 0: its shards' layouts and devices
    int tp;
    IpcRegion *regions;        // (tp) made at the first update
    size_t **offsets;          // (tp) -> (n_units of the shard's layout) bytes into the region
    char host[IPC_HOST_ID_MAX];
    uint64_t staging_id;       // 0 until the regions are made
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
    if (w) w->tp = engine_tp(engine_group_engine(g, 0));
    if (!w || !(w->regions = calloc((size_t)w->tp, sizeof *w->regions)) ||
        !(w->offsets = calloc((size_t)w->tp, sizeof *w->offsets))) {
        if (w) free(w->regions);
        free(w);
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    w->g = g;
    w->e = engine_group_engine(g, 0);
    // Without a boot id, every ipc weights_begin is refused (the host cannot be told): the message says why.
    char why[256];
    if (ipc_host_id(w->host, why, sizeof why) != 0) w->host[0] = '\0';
    *out = w;
    return 0;
}

static void free_regions(WeightIpc *w) {
    for (int k = 0; k < w->tp; k++) {
        ipc_region_close(&w->regions[k]);
        free(w->offsets[k]);
        w->offsets[k] = NULL;
    }
    w->staging_id = 0;
}

void weight_ipc_free(WeightIpc *w) {
    if (!w) return;
    free_regions(w);
    free(w->regions);
    free(w->offsets);
    free(w);
}

// Every shard's region, sized for its layout in the shard's storage dtype. 0, or WEIGHT_IPC_ENOMEM with a message.
static int make_regions(WeightIpc *w, char *err, size_t err_len) {
    for (int k = 0; k < w->tp; k++) {
        const Layout *L = &engine_shard_model(w->e, k)->layout;
        OpsCtx *ops = engine_shard_ops(w->e, k);
        const int cuda = ops_backend(ops) == OPS_BACKEND_CUDA;
        char tag[32], msg[512];
        if (!(w->offsets[k] = malloc((size_t)L->n_units * sizeof *w->offsets[k]))) {
            snprintf(err, err_len, "out of host memory");
            goto fail;
        }
        const size_t bytes = ipc_unit_offsets(L, ops_dtype_size(ops), w->offsets[k]);
        snprintf(tag, sizeof tag, "s%d", k);
        if (ipc_region_create(&w->regions[k], cuda ? IPC_KIND_CUDA : IPC_KIND_SHM, cuda ? ops_cuda_device(ops) : -1,
                              tag, bytes, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "no memory for the %zu MB staging that transport ipc receives %s into: %s%s",
                     bytes >> 20, w->tp > 1 ? "a tensor-parallel shard" : "the weights", msg,
                     cuda ? "; lower --kv-cache-memory, or use transport nccl" : "");
            goto fail;
        }
    }
    w->staging_id = ipc_random_id();
    fprintf(stderr, "tandem-serve: transport ipc: staging made (%d region(s), %s, staging id %016llx)\n", w->tp,
            w->regions[0].kind == IPC_KIND_CUDA ? "CUDA IPC" : "shared memory", (unsigned long long)w->staging_id);
    return 0;
fail:
    free_regions(w);
    return WEIGHT_IPC_ENOMEM;
}

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
    int rc;
    if (!w->staging_id && (rc = make_regions(w, err, err_len)) != 0) return rc;
    memset(reply, 0, sizeof *reply);
    reply->present = 1;
    snprintf(reply->host, sizeof reply->host, "%s", w->host);
    reply->staging_id = w->staging_id;
    reply->pid = (int64_t)getpid();
    reply->cuda = w->regions[0].kind == IPC_KIND_CUDA;
    reply->n_shards = w->tp;
    for (int k = 0; k < w->tp; k++) {
        ZmsgIpcShard *sh = &reply->shards[k];
        snprintf(sh->handle, sizeof sh->handle, "%s", w->regions[k].handle);
        sh->bytes = (int64_t)w->regions[k].bytes;
        if (reply->cuda) {
            char pci[IPC_DEVICE_ID_MAX], uuid[IPC_DEVICE_ID_MAX];
            if (ipc_cuda_device_ids(w->regions[k].device, pci, uuid) != 0)
                snprintf(pci, sizeof pci, "cuda:%d", w->regions[k].device), snprintf(uuid, sizeof uuid, "unknown");
            snprintf(sh->device, sizeof sh->device, "%s", pci);
            snprintf(sh->uuid, sizeof sh->uuid, "%s", uuid);
        }
    }
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
    // Region of shard sh (on engine 0's device of that shard) -> the same shard's staging on every engine: on engine
    // 0 a copy within one device, on the others a peer copy (as engine_group_spread_device_staging).
    for (int i = 0; i < engine_group_size(w->g); i++) {
        Engine *e = engine_group_engine(w->g, i);
        for (int sh = 0; sh < w->tp; sh++) {
            const Layout *L = &engine_shard_model(w->e, sh)->layout;
            OpsCtx *src_ops = engine_shard_ops(w->e, sh), *dst_ops = engine_shard_ops(e, sh);
            const size_t es = ops_dtype_size(src_ops);
            for (int u = 0; u < L->n_units; u++) {
                void *dst = engine_weights_device_staging(e, sh, u);
                char msg[512];
                if (!dst) {
                    snprintf(err, err_len, "engine %d (%s) has no device staging for unit %d of shard %d", i,
                             engine_group_device_name(w->g, i), u, sh);
                    return -1;
                }
                if (ops_copy_peer(dst_ops, dst, src_ops, (const char *)w->regions[sh].ptr + w->offsets[sh][u],
                                  L->unit_numel[u] * es, msg, sizeof msg) != 0) {
                    snprintf(err, err_len, "copying unit %d of shard %d from the ipc staging into engine %d (%s): %s",
                             u, sh, i, engine_group_device_name(w->g, i), msg);
                    return -1;
                }
            }
        }
    }
    *seconds = now_s() - w->t_begin;
    return 0;
}
