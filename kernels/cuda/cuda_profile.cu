// kernels/cuda/cuda_profile.cu — per-op GPU time, for finding where a step goes (OpsSettings.profile_ops).
//
// On a context created with it, kernels/ops.c brackets every CUDA op with two events on the
// compute stream; pairs are resolved in batches (a stream synchronize every PROFILE_PAIRS ops, which slows the
// run: use it to see shares, not to time) and summed per op name. ops_profile_print writes the table.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

#define PROFILE_PAIRS 512
#define PROFILE_NAMES 64

struct CudaProfile {
    cudaEvent_t ev[2 * PROFILE_PAIRS];
    const char *pending[PROFILE_PAIRS];
    int n_pending;
    const char *name[PROFILE_NAMES];
    double ms[PROFILE_NAMES];
    long calls[PROFILE_NAMES];
    int n_names;
};

CudaProfile *cuda_profile_create(void) {
    CudaProfile *p = (CudaProfile *)calloc(1, sizeof *p);
    if (!p) return NULL;
    for (int i = 0; i < 2 * PROFILE_PAIRS; i++)
        if (cudaEventCreate(&p->ev[i]) != cudaSuccess) {
            cudaGetLastError();
            for (int j = 0; j < i; j++) cudaEventDestroy(p->ev[j]);
            free(p);
            return NULL;
        }
    return p;
}

void cuda_profile_destroy(CudaProfile *p) {
    if (!p) return;
    for (int i = 0; i < 2 * PROFILE_PAIRS; i++) cudaEventDestroy(p->ev[i]);
    free(p);
}

// Waits for the recorded pairs and adds their times to the per-name sums.
static void resolve(CudaProfile *p) {
    for (int i = 0; i < p->n_pending; i++) {
        float ms = 0;
        cudaEventSynchronize(p->ev[2 * i + 1]);
        cudaEventElapsedTime(&ms, p->ev[2 * i], p->ev[2 * i + 1]);
        int k = 0;
        while (k < p->n_names && strcmp(p->name[k], p->pending[i]) != 0) k++;
        if (k == p->n_names) {
            if (k == PROFILE_NAMES) continue;
            p->name[p->n_names++] = p->pending[i];
        }
        p->ms[k] += ms;
        p->calls[k]++;
    }
    cudaGetLastError();
    p->n_pending = 0;
}

int cuda_profile_begin(OpsCtx *ctx) {
    CudaState *st = (CudaState *)ops_backend_state(ctx);
    if (!st || !st->profile) return -1;
    CudaProfile *p = st->profile;
    if (p->n_pending == PROFILE_PAIRS) resolve(p);
    cudaEventRecord(p->ev[2 * p->n_pending], st->stream);
    return p->n_pending;
}

void cuda_profile_end(OpsCtx *ctx, int slot, const char *name) {
    if (slot < 0) return;
    CudaState *st = (CudaState *)ops_backend_state(ctx);
    CudaProfile *p = st->profile;
    cudaEventRecord(p->ev[2 * slot + 1], st->stream);
    p->pending[slot] = name;
    p->n_pending = slot + 1;
}

void cuda_profile_print(OpsCtx *ctx) {
    CudaState *st = (CudaState *)ops_backend_state(ctx);
    if (!st || !st->profile) return;
    CudaProfile *p = st->profile;
    resolve(p);
    double total = 0;
    for (int k = 0; k < p->n_names; k++) total += p->ms[k];
    int order[PROFILE_NAMES];
    for (int k = 0; k < p->n_names; k++) order[k] = k;
    for (int a = 0; a < p->n_names; a++)   // by time, largest first (a handful of names: insertion sort)
        for (int b = a; b > 0 && p->ms[order[b]] > p->ms[order[b - 1]]; b--) {
            int t = order[b];
            order[b] = order[b - 1];
            order[b - 1] = t;
        }
    fprintf(stderr, "GPU time per op (profile_ops; total %.1f ms):\n", total);
    for (int a = 0; a < p->n_names; a++) {
        int k = order[a];
        fprintf(stderr, "  %-28s %10.2f ms %5.1f %%  %8ld calls\n", p->name[k], p->ms[k],
                total > 0 ? 100 * p->ms[k] / total : 0.0, p->calls[k]);
    }
    memset(p->ms, 0, sizeof p->ms);
    memset(p->calls, 0, sizeof p->calls);
    p->n_names = 0;
}
