// rollout_server/runner_ipc.c — transport ipc's receive staging: a shard's device staging placed in memory that the
// trainer ranks of this host map (see runner_weights_ipc_staging in rollout_server/model_runner.h).
//
// Each shard has two regions, A and B, each holding every unit of the shard's layout. The staging goes into the one
// that does not hold the live weights; runner_swap_device_weights then makes it live, so after two updates the live
// weights and the staging alternate between A and B, and the copies ops_malloc made (the loaded weights, the NCCL
// staging) are freed on the way: the shard holds two copies of its weights, as with transport nccl.
#include <stdio.h>
#include <stdlib.h>

#include "rollout_server/model_runner_internal.h"

static int in_region(const IpcRegion *g, const void *p) {
    return g->ptr && p && (const char *)p >= (const char *)g->ptr && (const char *)p < (const char *)g->ptr + g->bytes;
}

static int in_either(const RunnerShard *s, const void *p) {
    return in_region(&s->ipc[0], p) || in_region(&s->ipc[1], p);
}

const IpcRegion *runner_weights_ipc_staging(ModelRunner *r, int shard, char *err, size_t err_len) {
    if (shard < 0 || shard >= r->tp) return snprintf(err, err_len, "no tensor-parallel shard %d", shard), NULL;
    RunnerShard *s = &r->shards[shard];
    const Layout *L = &s->m.layout;
    const int cuda = ops_backend(s->ops) == OPS_BACKEND_CUDA;
    if (!s->ipc_offsets) {
        if (!(s->ipc_offsets = malloc((size_t)L->n_units * sizeof *s->ipc_offsets)))
            return snprintf(err, err_len, "out of host memory"), NULL;
        ipc_unit_offsets(L, ops_dtype_size(s->ops), s->ipc_offsets);
    }
    // Units swap together, so unit 0 tells where the live weights are.
    const int target = in_region(&s->ipc[0], s->w.params[0]) ? 1 : 0;
    IpcRegion *g = &s->ipc[target];
    // The staging that is not in a region (ops_malloc's: the NCCL path's, or the first live copy swapped out) is given
    // back before the region is made, so that the device never holds three copies of the shard's weights. Should the
    // region then fail, the staging is made again on demand (runner_weights_device_staging).
    for (int u = 0; u < L->n_units && !g->ptr; u++)
        if (s->dstaging[u] && !in_either(s, s->dstaging[u])) {
            ops_free(s->ops, s->dstaging[u]);
            s->dstaging[u] = NULL;
        }
    if (!g->ptr) {
        char tag[32], msg[512];
        snprintf(tag, sizeof tag, "s%d%c", shard, 'a' + target);
        const size_t bytes = ipc_unit_offsets(L, ops_dtype_size(s->ops), s->ipc_offsets);
        if (ipc_region_create(g, cuda ? IPC_KIND_CUDA : IPC_KIND_SHM, cuda ? ops_cuda_device(s->ops) : -1, tag, bytes,
                              msg, sizeof msg) != 0) {
            snprintf(err, err_len, "no memory for the %zu MB of %s that transport ipc receives into: %s%s",
                     bytes >> 20, r->tp > 1 ? "a tensor-parallel shard's weights" : "the weights", msg,
                     cuda ? "; lower --kv-cache-memory" : "");
            return NULL;
        }
    }
    // The region's units become the staging (any ops_malloc copy left, from an NCCL update since, is given back).
    for (int u = 0; u < L->n_units; u++) {
        void *want = (char *)g->ptr + s->ipc_offsets[u];
        if (s->dstaging[u] == want) continue;
        if (!in_either(s, s->dstaging[u])) ops_free(s->ops, s->dstaging[u]);
        s->dstaging[u] = want;
    }
    return g;
}

void runner_ipc_release(RunnerShard *s) {
    for (int u = 0; s->ipc_offsets && u < s->m.layout.n_units; u++) {
        if (s->dstaging && in_either(s, s->dstaging[u])) s->dstaging[u] = NULL;
        if (s->w.params && in_either(s, s->w.params[u])) s->w.params[u] = NULL;
    }
    ipc_region_close(&s->ipc[0]);
    ipc_region_close(&s->ipc[1]);
    free(s->ipc_offsets);
    s->ipc_offsets = NULL;
}
