// dev/cuda/allreduce_p2p.cu — an experiment, not part of tandem's build: a one-shot all-reduce of small bf16 rows
// between the GPUs of one process over peer access (NVLink), against NCCL's all-reduce, both inside CUDA graphs.
// Build and run by hand (dev/cuda/README.md):
//   nvcc -O3 -std=c++17 -arch=sm_90 -o allreduce_p2p dev/cuda/allreduce_p2p.cu -lnccl -lpthread
//   ./allreduce_p2p [--gpus N] [--calls K] [--replays R]
//
// Why: a tensor-parallel decode step of a 32B model holds two all-reduces per layer (128 a step) of one row per
// sequence (5,120 bf16 at batch 1: 10 KB). Their time is latency, not bandwidth, and it is the gap between TP 2 and
// the 2-GPU bandwidth bound (bench/notes/tensor-parallel.md). The shards of a tandem-serve TP engine are threads of
// one process, so every shard can map every other shard's buffers with cudaDeviceEnablePeerAccess: no IPC.
//
// The kernel (one launch per all-reduce, G blocks of T threads on every GPU; element vectors of 8 bf16 split over
// the blocks the same way on every GPU):
//   1. block b copies its vectors of x into this GPU's buffer of parity e & 1 (e: the call's epoch, this block's
//      counter + 1, kept in device memory so that a graph replay needs no new argument);
//   2. after a block barrier, thread j < N (j != me) releases epoch e into GPU j's flag slot [b][me] (st.release.sys);
//   3. thread j spins (ld.acquire.sys) until its own slot [b][j] holds an epoch >= e (a peer may already be one
//      call ahead); a block barrier;
//   4. every element of block b's vectors becomes the sum over GPUs 0..N-1, in that order, read from each GPU's
//      buffer (ld.global.cg: past L1), accumulated in fp32 and rounded once: every GPU gets the same bits;
//   5. thread 0 stores e as the block's counter.
// Two buffers by parity make one barrier per call enough: GPU j can only write buffer p again at call e + 2, after
// every peer released e + 1, which each does only after its reads of call e.
// A spin past the timeout sets an error word and gives up (the caller checks it), instead of hanging the GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GPUS 8
#define AR_BLOCKS 16
#define AR_THREADS 256

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
#define NK(x) do { ncclResult_t e_ = (x); if (e_ != ncclSuccess) { fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, ncclGetErrorString(e_)); exit(1); } } while (0)

typedef struct {
    uint4 *buf[2][MAX_GPUS];   // every GPU's two buffers (peer pointers)
    uint32_t *flags[MAX_GPUS]; // every GPU's flag slots [AR_BLOCKS][MAX_GPUS]
    uint32_t *counter;         // this GPU's per-block epochs [AR_BLOCKS]
    int *error;                // this GPU's error word (mapped host memory)
    int me, n;
    unsigned long long timeout_ns;
} ArArgs;

__device__ static inline void store_release(uint32_t *p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ static inline uint32_t load_acquire(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ static inline unsigned long long now_ns(void) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void ar_kernel(ArArgs a, uint4 *x, int nvec) {
    __shared__ uint32_t epoch;
    const int b = blockIdx.x;
    if (threadIdx.x == 0) epoch = a.counter[b] + 1;
    __syncthreads();
    const uint32_t e = epoch;
    uint4 *mine = a.buf[e & 1][a.me];
    for (int i = b * AR_THREADS + threadIdx.x; i < nvec; i += AR_BLOCKS * AR_THREADS) mine[i] = x[i];
    __syncthreads();
    const int j = threadIdx.x;
    if (j < a.n && j != a.me) {
        store_release(&a.flags[j][b * MAX_GPUS + a.me], e);
        const uint32_t *slot = &a.flags[a.me][b * MAX_GPUS + j];
        const unsigned long long t0 = now_ns();
        while ((int32_t)(load_acquire(slot) - e) < 0)
            if (now_ns() - t0 > a.timeout_ns) {
                atomicExch(a.error, 1);
                break;
            }
    }
    __syncthreads();
    for (int i = b * AR_THREADS + threadIdx.x; i < nvec; i += AR_BLOCKS * AR_THREADS) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int g = 0; g < a.n; g++) {
            const uint4 v = __ldcg(&a.buf[e & 1][g][i]);
            const __nv_bfloat16 *h = (const __nv_bfloat16 *)&v;
            for (int k = 0; k < 8; k++) acc[k] += __bfloat162float(h[k]);
        }
        uint4 out;
        __nv_bfloat16 *o = (__nv_bfloat16 *)&out;
        for (int k = 0; k < 8; k++) o[k] = __float2bfloat16(acc[k]);
        x[i] = out;
    }
    if (threadIdx.x == 0) a.counter[b] = e;
}

static int n_gpus = 2, calls = 128, replays = 50;
static const int sizes[] = {5120, 8192, 16 * 5120, 16 * 8192, 256 * 5120, 2048 * 5120};
#define N_SIZES (int)(sizeof sizes / sizeof sizes[0])
static size_t max_elems = 2048 * 5120;

static uint4 *bufs[2][MAX_GPUS];
static uint32_t *flags[MAX_GPUS];
static ncclUniqueId nccl_id;
static pthread_barrier_t barrier;
static double ms_nccl[MAX_GPUS][N_SIZES], ms_p2p[MAX_GPUS][N_SIZES];
static int bad[MAX_GPUS];

static float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t host_rand_bf16(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    float f = (float)((*s >> 40) & 0xffff) / 65536.0f - 0.5f;
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static void *gpu_main(void *arg) {
    const int me = (int)(intptr_t)arg;
    CK(cudaSetDevice(me));
    for (int j = 0; j < n_gpus; j++)
        if (j != me) CK(cudaDeviceEnablePeerAccess(j, 0));
    ncclComm_t comm;
    NK(ncclCommInitRank(&comm, n_gpus, nccl_id, me));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ArArgs a;
    memset(&a, 0, sizeof a);
    pthread_barrier_wait(&barrier); // every GPU's buffers exist
    for (int p = 0; p < 2; p++)
        for (int g = 0; g < n_gpus; g++) a.buf[p][g] = bufs[p][g];
    for (int g = 0; g < n_gpus; g++) a.flags[g] = flags[g];
    CK(cudaMalloc(&a.counter, AR_BLOCKS * sizeof(uint32_t)));
    CK(cudaMemset(a.counter, 0, AR_BLOCKS * sizeof(uint32_t)));
    CK(cudaHostAlloc(&a.error, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    *a.error = 0;
    a.me = me;
    a.n = n_gpus;
    a.timeout_ns = 10ull * 1000 * 1000 * 1000;

    uint16_t *x, *y, *h = (uint16_t *)malloc(max_elems * 2), *ref = (uint16_t *)malloc(max_elems * 2);
    CK(cudaMalloc(&x, max_elems * 2));
    CK(cudaMalloc(&y, max_elems * 2));
    // correctness: every GPU's input is a seeded draw; the p2p sum equals the fp32 sum in GPU order rounded once,
    // and for 2 GPUs equals NCCL's bits.
    for (int si = 0; si < N_SIZES; si++) {
        const int n = sizes[si];
        float *sum = (float *)calloc(n, sizeof(float));
        for (int g = 0; g < n_gpus; g++) {
            uint64_t s = 1234 + 77 * g + n;
            for (int i = 0; i < n; i++) {
                uint16_t v = host_rand_bf16(&s);
                sum[i] += bf(v);
                if (g == me) h[i] = v;
            }
        }
        CK(cudaMemcpy(x, h, n * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(y, h, n * 2, cudaMemcpyHostToDevice));
        pthread_barrier_wait(&barrier);
        ar_kernel<<<AR_BLOCKS, AR_THREADS, 0, st>>>(a, (uint4 *)x, n / 8);
        NK(ncclAllReduce(y, y, n, ncclBfloat16, ncclSum, comm, st));
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(h, x, n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ref, y, n * 2, cudaMemcpyDeviceToHost));
        int wrong = 0, differ_nccl = 0;
        for (int i = 0; i < n; i++) {
            float f = sum[i];
            uint32_t u; memcpy(&u, &f, 4);
            u += 0x7fff + ((u >> 16) & 1);
            if (h[i] != (uint16_t)(u >> 16)) wrong++;
            if (h[i] != ref[i]) differ_nccl++;
        }
        if (wrong || *a.error || (n_gpus == 2 && differ_nccl)) {
            fprintf(stderr, "gpu %d n %d: %d wrong vs the CPU sum, %d differ from NCCL, error %d\n", me, n, wrong,
                    differ_nccl, *a.error);
            bad[me] = 1;
        }
        free(sum);
    }
    // timing: a graph of `calls` all-reduces, replayed `replays` times, all GPUs at once
    for (int si = 0; si < N_SIZES; si++) {
        const int n = sizes[si];
        for (int kind = 0; kind < 2; kind++) {
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            pthread_barrier_wait(&barrier);
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            for (int c = 0; c < calls; c++) {
                if (kind == 0) NK(ncclAllReduce(x, x, n, ncclBfloat16, ncclSum, comm, st));
                else ar_kernel<<<AR_BLOCKS, AR_THREADS, 0, st>>>(a, (uint4 *)x, n / 8);
            }
            CK(cudaStreamEndCapture(st, &graph));
            CK(cudaGraphInstantiate(&exec, graph, 0));
            pthread_barrier_wait(&barrier);
            CK(cudaGraphLaunch(exec, st));
            CK(cudaStreamSynchronize(st));
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            pthread_barrier_wait(&barrier);
            CK(cudaEventRecord(e0, st));
            for (int r = 0; r < replays; r++) CK(cudaGraphLaunch(exec, st));
            CK(cudaEventRecord(e1, st));
            CK(cudaStreamSynchronize(st));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            (kind == 0 ? ms_nccl : ms_p2p)[me][si] = ms / (replays * calls) * 1000.0; // µs per all-reduce
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(graph));
        }
    }
    if (*a.error) bad[me] = 1;
    ncclCommDestroy(comm);
    return NULL;
}

int main(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--gpus")) n_gpus = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--calls")) calls = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--replays")) replays = atoi(argv[i + 1]);
    }
    int have;
    CK(cudaGetDeviceCount(&have));
    if (have < n_gpus || n_gpus < 2 || n_gpus > MAX_GPUS) {
        fprintf(stderr, "needs %d GPUs (2..%d), %d visible\n", n_gpus, MAX_GPUS, have);
        return 77;
    }
    for (int g = 0; g < n_gpus; g++) {
        CK(cudaSetDevice(g));
        for (int p = 0; p < 2; p++) CK(cudaMalloc(&bufs[p][g], max_elems * 2));
        CK(cudaMalloc(&flags[g], AR_BLOCKS * MAX_GPUS * sizeof(uint32_t)));
        CK(cudaMemset(flags[g], 0, AR_BLOCKS * MAX_GPUS * sizeof(uint32_t)));
    }
    NK(ncclGetUniqueId(&nccl_id));
    pthread_barrier_init(&barrier, NULL, n_gpus);
    pthread_t th[MAX_GPUS];
    for (int g = 0; g < n_gpus; g++) pthread_create(&th[g], NULL, gpu_main, (void *)(intptr_t)g);
    for (int g = 0; g < n_gpus; g++) pthread_join(th[g], NULL);
    int failed = 0;
    for (int g = 0; g < n_gpus; g++) failed |= bad[g];
    printf("all-reduce of bf16 rows inside a CUDA graph, %d GPUs, %d calls a graph, us per call (GPU 0)\n", n_gpus, calls);
    printf("| elements | bytes | NCCL us | p2p us | NCCL / p2p |\n|---|---|---|---|---|\n");
    for (int si = 0; si < N_SIZES; si++)
        printf("| %d | %d | %.2f | %.2f | %.2fx |\n", sizes[si], sizes[si] * 2, ms_nccl[0][si], ms_p2p[0][si],
               ms_nccl[0][si] / ms_p2p[0][si]);
    printf("correctness (p2p = fp32 sum in GPU order rounded once%s): %s\n", n_gpus == 2 ? ", = NCCL's bits" : "",
           failed ? "FAIL" : "PASS");
    return failed;
}
