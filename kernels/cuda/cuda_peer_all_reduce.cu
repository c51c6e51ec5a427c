// kernels/cuda/cuda_peer_all_reduce.cu — ops_peer_all_reduce on CUDA (kernels/ops.h "sums across the tensor-parallel
// shards of one process"): one kernel of OPS_PEER_BLOCKS blocks on the shard's stream, reading the other shards'
// exchange buffers through peer access. dev/cuda/allreduce_p2p.cu is the experiment it came from.
//
// Work split, the same on every shard: vectors of 8 bf16, vector i to block (i / PEER_THREADS) % OPS_PEER_BLOCKS;
// the elements past the last whole vector to block 0. Block b of one shard only meets block b of the others: it
// publishes its epoch in their slot [b][rank] once its part of the copy is in, and reads their part b once their
// slot [b][j] in its own flags says so. Each block keeps its own epoch (counter[b]) in device memory: every call
// launches all blocks, so the blocks' epochs stay equal across shards, and a replayed graph needs no argument.
#include <stdio.h>

#include "kernels/cuda/cuda_common.cuh"

#define PEER_THREADS 256

typedef struct {
    uint4 *buf[2][OPS_PEER_MAX];   // every shard's exchange buffers (peer pointers)
    uint32_t *flags[OPS_PEER_MAX]; // every shard's slots (OPS_PEER_BLOCKS, OPS_PEER_MAX)
    uint32_t *counter;             // this shard's epochs (OPS_PEER_BLOCKS)
    CudaFault *fault;
    int rank, n;
    unsigned long long timeout_ns;
} PeerArgs;

__device__ __forceinline__ void peer_store_release(uint32_t *p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t peer_load_acquire(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned long long peer_now_ns(void) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// x (count) = residual + sum over shards; nvec = count / 8 whole vectors, the tail (count % 8 elements) in block 0.
__global__ void peer_all_reduce_kernel(PeerArgs a, bf16 *x, const bf16 *residual, size_t nvec, int tail) {
    __shared__ uint32_t epoch;
    const int b = blockIdx.x;
    if (threadIdx.x == 0) epoch = a.counter[b] + 1;
    __syncthreads();
    const uint32_t e = epoch;
    uint4 *const *buf = a.buf[e & 1];
    const size_t stride = (size_t)OPS_PEER_BLOCKS * PEER_THREADS;
    for (size_t i = (size_t)b * PEER_THREADS + threadIdx.x; i < nvec; i += stride) buf[a.rank][i] = ((const uint4 *)x)[i];
    if (b == 0 && (int)threadIdx.x < tail) ((bf16 *)buf[a.rank])[nvec * 8 + threadIdx.x] = x[nvec * 8 + threadIdx.x];
    __syncthreads();
    const int j = threadIdx.x;
    if (j < a.n && j != a.rank) {
        peer_store_release(&a.flags[j][b * OPS_PEER_MAX + a.rank], e);
        const uint32_t *slot = &a.flags[a.rank][b * OPS_PEER_MAX + j];
        const unsigned long long t0 = peer_now_ns();
        while ((int32_t)(peer_load_acquire(slot) - e) < 0)
            if (peer_now_ns() - t0 > a.timeout_ns) {
                cuda_fault(a.fault, CUDA_FAULT_PEER_TIMEOUT, a.rank, j, (int)(a.timeout_ns / 1000000ull));
                break;
            }
    }
    __syncthreads();
    for (size_t i = (size_t)b * PEER_THREADS + threadIdx.x; i < nvec; i += stride) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int g = 0; g < a.n; g++) {
            const uint4 v = __ldcg(&buf[g][i]);   // past L1: another device wrote it
            const bf16 *h = (const bf16 *)&v;
            for (int k = 0; k < 8; k++) acc[k] += __bfloat162float(h[k]);
        }
        if (residual) {
            const uint4 r = ((const uint4 *)residual)[i];
            const bf16 *h = (const bf16 *)&r;
            for (int k = 0; k < 8; k++) acc[k] += __bfloat162float(h[k]);
        }
        uint4 out;
        bf16 *o = (bf16 *)&out;
        for (int k = 0; k < 8; k++) o[k] = __float2bfloat16(acc[k]);
        ((uint4 *)x)[i] = out;
    }
    if (b == 0 && (int)threadIdx.x < tail) {
        const size_t i = nvec * 8 + threadIdx.x;
        float acc = 0.f;
        for (int g = 0; g < a.n; g++) acc += __bfloat162float(__ldcg((const bf16 *)buf[g] + i));
        if (residual) acc += __bfloat162float(residual[i]);
        x[i] = __float2bfloat16(acc);
    }
    if (threadIdx.x == 0) a.counter[b] = e;
}

extern "C" void cuda_peer_all_reduce(OpsCtx *ctx, void *const *buf0, void *const *buf1, uint32_t *const *flags,
                                     uint32_t *counter, int rank, int n, void *x, const void *residual, size_t count,
                                     double timeout_s) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    PeerArgs a;
    for (int k = 0; k < n; k++) {
        a.buf[0][k] = (uint4 *)buf0[k];
        a.buf[1][k] = (uint4 *)buf1[k];
        a.flags[k] = flags[k];
    }
    a.counter = counter;
    a.fault = st->fault_dev;
    a.rank = rank;
    a.n = n;
    a.timeout_ns = (unsigned long long)(timeout_s * 1e9);
    peer_all_reduce_kernel<<<OPS_PEER_BLOCKS, PEER_THREADS, 0, st->stream>>>(a, (bf16 *)x, (const bf16 *)residual,
                                                                               count / 8, (int)(count % 8));
    CUDA_CHECK_LAUNCH(ctx);
    st->fault_armed = 1;
}

extern "C" int cuda_peer_enable(OpsCtx *const *ctxs, int n, char *err, size_t err_len) {
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++)
        for (int j = 0; j < n && rc == 0; j++) {
            const int di = ops_cuda_device(ctxs[i]), dj = ops_cuda_device(ctxs[j]);
            if (di == dj) continue;
            int can = 0;
            cudaError_t e = cudaDeviceCanAccessPeer(&can, di, dj);
            if (e != cudaSuccess || !can) {
                snprintf(err, err_len, "cuda:%d cannot read cuda:%d's memory (no peer access%s%s)", di, dj,
                         e != cudaSuccess ? ": " : "", e != cudaSuccess ? cudaGetErrorString(e) : "");
                rc = -1;
                break;
            }
            if ((e = cudaSetDevice(di)) == cudaSuccess) e = cudaDeviceEnablePeerAccess(dj, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) {
                cudaGetLastError();
                e = cudaSuccess;
            }
            if (e != cudaSuccess) {
                snprintf(err, err_len, "enabling cuda:%d's access to cuda:%d: %s", di, dj, cudaGetErrorString(e));
                cudaGetLastError();
                rc = -1;
            }
        }
    if (prev >= 0) cudaSetDevice(prev);
    return rc;
}
