// trainer/weight_sync_ipc.c — transport ipc: every trainer rank copies its own slices straight into the staging of
// the rollout servers on its host (trainer/weight_sync.h; the server side is rollout_server/weight_ipc.h).
//
// Rank 0 opens the update on every answering server (weights_begin with this host's boot id); each reply names, per
// tensor-parallel shard, a region of the server's memory (a CUDA IPC handle on GPUs, a POSIX shared-memory name on
// the CPU) holding every unit of the shard's layout at ipc_unit_offsets: the shard's receive staging, one of two
// regions that the staging and the live weights take turns in. Rank 0 broadcasts the replies; each rank maps the
// regions it has not mapped yet (kept across pushes, keyed by the server's staging id and the handle: a restarted
// server has a new staging id, and its old mappings are dropped), copies its ZeRO slice of every unit in (a
// tensor-parallel shard: the parts it holds, whole-row blocks as one copy, column blocks as one strided copy), waits
// for its copies, and the ranks agree; rank 0's weights_end then has each server swap staging and live weights.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/ipc_region.h"
#include "trainer/lora_train.h"
#include "trainer/weight_sync_internal.h"
#include "trainer/weight_sync_shards.h"

// One server shard's staging, mapped by this rank.
typedef struct {
    uint64_t staging_id;   // the server's, from its weights_begin reply
    int shard;
    IpcRegion region;
    size_t *offsets;       // (n_units) bytes into the region where each unit of the shard's layout starts
} IpcMap;

struct WeightSyncIpc {
    IpcMap *maps;
    int n, cap;
    char host[IPC_HOST_ID_MAX];   // this host's boot id ("" until the first push)
};

static void drop_map(IpcMap *m) {
    ipc_region_close(&m->region);
    free(m->offsets);
    memset(m, 0, sizeof *m);
}

void weight_sync_ipc_free(struct WeightSyncIpc *ipc) {
    if (!ipc) return;
    for (int i = 0; i < ipc->n; i++) drop_map(&ipc->maps[i]);
    free(ipc->maps);
    free(ipc);
}

static const char ELSE[] = "use --weight-sync-transport nccl or zmq";

// Shard k of server `name`'s staging (reply r), mapped: the one mapped before when its staging id and handle are
// the same, else opened now after checking what the server said against this rank. Its index in ipc->maps, or -1
// with a message naming the server.
static int map_of(Trainer *t, struct WeightSyncIpc *ipc, const char *name, const ZmsgIpc *r, int k, const Layout *L,
                  char *err, size_t err_len) {
    for (int i = 0; i < ipc->n; i++)
        if (ipc->maps[i].staging_id == r->staging_id && ipc->maps[i].shard == k &&
            !strcmp(ipc->maps[i].region.handle, r->shards[k].handle))
            return i;
    const int cuda = ops_backend(t->ops) == OPS_BACKEND_CUDA;
    if (r->cuda != cuda) {
        snprintf(err, err_len, "rollout server %s keeps its weights %s and trainer rank %d computes %s; transport ipc "
                 "needs both on GPUs or both on the CPU: use --weight-sync-transport zmq", name,
                 r->cuda ? "on a GPU" : "on the CPU", t->rank, cuda ? "on a GPU" : "on the CPU");
        return -1;
    }
    if (ipc->n == ipc->cap) {
        IpcMap *grown = realloc(ipc->maps, (size_t)(ipc->cap * 2 + 4) * sizeof *grown);
        if (!grown) return snprintf(err, err_len, "out of memory for the ipc mappings"), -1;
        ipc->maps = grown;
        ipc->cap = ipc->cap * 2 + 4;
    }
    IpcMap *m = &ipc->maps[ipc->n];
    memset(m, 0, sizeof *m);
    if (!(m->offsets = malloc((size_t)L->n_units * sizeof *m->offsets)))
        return snprintf(err, err_len, "out of memory for the ipc mappings"), -1;
    const ZmsgIpcShard *sh = &r->shards[k];
    const size_t want = ipc_unit_offsets(L, ops_dtype_size(t->ops), m->offsets);
    if ((size_t)sh->bytes != want) {
        snprintf(err, err_len, "rollout server %s's staging of shard %d holds %lld bytes, trainer rank %d writes %zu "
                 "(this model's units in %s): the server runs another model or storage dtype", name, k,
                 (long long)sh->bytes, t->rank, want, ops_dtype_size(t->ops) == 2 ? "bf16" : "fp32");
        free(m->offsets);
        m->offsets = NULL;
        return -1;
    }
    char msg[512];
    if (ipc_region_open(&m->region, r->cuda ? IPC_KIND_CUDA : IPC_KIND_SHM, sh->handle, want,
                        cuda ? ops_cuda_device(t->ops) : -1, msg, sizeof msg) != 0) {
        if (r->cuda)
            snprintf(err, err_len, "trainer rank %d cannot map the weight staging of rollout server %s (shard %d, GPU "
                     "%s %s) on its own GPU: %s; %s", t->rank, name, k, sh->device, sh->uuid, msg, ELSE);
        else
            snprintf(err, err_len, "trainer rank %d cannot map the weight staging of rollout server %s (shard %d): "
                     "%s; %s", t->rank, name, k, msg, ELSE);
        free(m->offsets);
        m->offsets = NULL;
        return -1;
    }
    m->staging_id = r->staging_id;
    m->shard = k;
    return ipc->n++;
}

// Elements [sl->off, sl->off + sl->count) of unit u into shard k's staging of a server of tp shards (tp 1: the
// whole unit's place). Queued on the compute stream; returns the bytes, or -1 with a message.
static double copy_slice(Trainer *t, const IpcMap *m, int tp, int k, int u, const WeightSlice *sl, char *err,
                         size_t err_len) {
    const size_t es = ops_dtype_size(t->ops);
    char *unit = (char *)m->region.ptr + m->offsets[u];
    if (tp == 1) {
        ops_copy(t->ops, unit + sl->off * es, sl->src, sl->count * es);
        return (double)(sl->count * es);
    }
    const ModelShardPart *parts;
    const int n = weight_shards_parts(t->sync.shards, &t->model, tp, k, u, sl->off, sl->count, &parts, err, err_len);
    if (n < 0) return -1;
    double bytes = 0;
    for (int p = 0; p < n; p++) {
        const ModelShardPart *q = &parts[p];
        const char *src = (const char *)sl->src + (q->full_at - sl->off) * es;
        if (weight_shards_part_strided(q))
            ops_copy_2d(t->ops, unit + q->shard_at * es, q->cols, src, q->full_cols, q->rows, q->cols);
        else
            ops_copy(t->ops, unit + q->shard_at * es, src, q->rows * q->cols * es);
        bytes += (double)(q->rows * q->cols * es);
    }
    return bytes;
}

// Every rank: maps the n servers' staging (replies r, rollout client indices servers) and copies its slices into
// it. 0, or -1 with a message.
static int write_staging(Trainer *t, const int *servers, const ZmsgIpc *r, int n, char *err, size_t err_len) {
    WeightSync *ws = &t->sync;
    struct WeightSyncIpc *ipc = ws->ipc;
    // Mappings of servers no longer in the push (restarted: a new staging id; gone) are let go first. A server's two
    // regions (its staging and its live weights take turns in them) stay mapped while it is.
    for (int i = 0; i < ipc->n;) {
        int named = 0;
        for (int j = 0; j < n; j++) named |= ipc->maps[i].staging_id == r[j].staging_id;
        if (named) {
            i++;
            continue;
        }
        drop_map(&ipc->maps[i]);
        ipc->maps[i] = ipc->maps[--ipc->n];
    }
    int *maps = malloc((size_t)n * ZMSG_IPC_MAX_SHARDS * sizeof *maps);   // [j * ZMSG_IPC_MAX_SHARDS + k] -> ipc->maps
    if (!maps) return snprintf(err, err_len, "out of memory for the ipc plan"), -1;
    int rc = 0;
    for (int j = 0; j < n && rc == 0; j++) {
        const char *name = rollout_server_endpoint(t->rollout, servers[j]);
        if (strcmp(r[j].host, ipc->host) != 0) {
            snprintf(err, err_len, "rollout server %s runs on another host (boot id %s) than trainer rank %d (%s): "
                     "transport ipc maps the server's memory and needs both on one host; %s", name, r[j].host,
                     t->rank, ipc->host, ELSE);
            rc = -1;
        }
        for (int k = 0; k < r[j].n_shards && rc == 0; k++) {
            const Layout *L = r[j].n_shards == 1 ? &t->model.layout
                                                 : weight_shards_layout(&ws->shards, t->ops, &t->model,
                                                                        r[j].n_shards, k, err, err_len);
            if (!L || (maps[j * ZMSG_IPC_MAX_SHARDS + k] = map_of(t, ipc, name, &r[j], k, L, err, err_len)) < 0)
                rc = -1;
        }
    }
    ws->bytes = 0;
    ws->send_start = trainer_now();
    const Layout *L = &t->model.layout;
    const size_t es = ops_dtype_size(t->ops);
    for (int u = 0; u < L->n_units && rc == 0; u++) {
        WeightSlice sl;
        sl.count = weight_sync_owned_count(t, u, &sl.off);
        if (sl.count == 0) continue;
        sl.src = t->lora ? (const char *)lora_train_merged_unit(t->lora, u) + sl.off * es
                         : zero3_param_shard(t->policy, u);
        for (int j = 0; j < n && rc == 0; j++)
            for (int k = 0; k < r[j].n_shards && rc == 0; k++) {
                const double b = copy_slice(t, &ipc->maps[maps[j * ZMSG_IPC_MAX_SHARDS + k]], r[j].n_shards, k, u,
                                            &sl, err, err_len);
                if (b < 0) rc = -1;
                else ws->bytes += b;
            }
    }
    free(maps);
    ops_synchronize(t->ops);   // the servers read the staging after weights_end: every copy must have landed
    if (rc == 0 && ops_status(t->ops)) {
        snprintf(err, err_len, "copying weights into the servers' ipc staging: %s", ops_error(t->ops));
        ops_clear_error(t->ops);
        rc = -1;
    }
    ws->transfer_seconds = trainer_now() - ws->send_start;
    return rc;
}

int weight_sync_push_ipc(Trainer *t, int64_t version, char *err, size_t err_len) {
    WeightSync *ws = &t->sync;
    if (!ws->ipc && !(ws->ipc = calloc(1, sizeof *ws->ipc)))
        return snprintf(err, err_len, "out of memory for the ipc mappings"), -1;
    if (!ws->ipc->host[0] && ipc_host_id(ws->ipc->host, err, err_len) != 0) return -1;
    const double t0 = trainer_now();
    // Rank 0's verdict and members, then the servers' replies.
    int32_t head[2 + ROLLOUT_MAX_SERVERS] = {0};
    int servers[ROLLOUT_MAX_SERVERS], n = 0, rc = 0;
    ZmsgIpc *replies = calloc(ROLLOUT_MAX_SERVERS, sizeof *replies);
    if (!replies) return snprintf(err, err_len, "out of memory for the ipc plan"), -1;
    if (t->rank == 0) rc = rollout_weights_begin_ipc(t->rollout, version, ws->ipc->host, servers, &n, replies, err,
                                                     err_len);
    head[0] = rc == 0;
    head[1] = n;
    for (int j = 0; j < n; j++) head[2 + j] = servers[j];
    if (comm_broadcast(t->comm, head, 2 + ROLLOUT_MAX_SERVERS, COMM_I32, 0) != 0 ||
        (head[0] && head[1] > 0 &&
         comm_broadcast(t->comm, replies, (size_t)head[1] * sizeof *replies, COMM_U8, 0) != 0)) {
        if (rc == 0) snprintf(err, err_len, "weight sync: %s", comm_error(t->comm));
        free(replies);
        return -1;
    }
    ws->begin_seconds = t->rank == 0 ? trainer_now() - t0 : 0;
    if (!head[0]) {
        if (t->rank != 0) snprintf(err, err_len, "weight sync: rank 0 could not start it");
        free(replies);
        return -1;
    }
    n = head[1];
    for (int j = 0; j < n; j++) servers[j] = head[2 + j];
    if (t->rank != 0) rollout_weights_set_members(t->rollout, servers, n);
    ws->bytes = ws->transfer_seconds = 0;
    rc = n > 0 ? write_staging(t, servers, replies, n, err, err_len) : 0;
    free(replies);
    if (weight_sync_agree(t, rc, err, err_len) != 0) return -1;
    return n > 0 ? weight_sync_finish(t, version, 0, NULL, err, err_len) : 0;
}
