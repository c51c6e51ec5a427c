// kernels/cuda/cuda_gemv.cu — the forward projection for one or two rows (decode steps of 1..2 sequences):
// out (N, OC) = in (N, IC) @ w^T + bias with N <= GEMV_MAX_ROWS, bf16 in and out, fp32 accumulation.
//
// Why: at a row or two the projection is a pass over the weight matrix, bound by memory bandwidth, and
// cuBLASLt's small-N kernels leave part of it on the table. Here every warp owns output columns o (rows of w,
// contiguous in memory: IC values) and streams them in 16-byte vectors with several loads in flight per lane,
// while the N input rows sit in shared memory (bf16, N x IC); each lane keeps N fp32 partial dot products, the
// warp sums them with shuffles, and lane 0 adds the bias and rounds once, as the cuBLASLt bias epilogue does.
// Measured on an H200 (bench/bench_decode_gpu.py --ab TANDEM_GEMV=0, whole decode steps with CUDA graphs):
// 1.12x / 1.16x faster steps at batch 1 (Qwen2.5-0.5B / 1.5B shapes) than with cuBLASLt, but 0.72x / 0.68x at
// batch 8, where reading eight staged input rows from shared memory for every weight vector costs more than the
// pass saves: hence at most two rows.
// cuda_matmul_fwd calls it when cuda_gemv_applies; TANDEM_GEMV=0 turns it off (comparisons). The summation order
// differs from cuBLASLt's, so results differ from it in the last bits.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

#define GEMV_THREADS 512
#define GEMV_UNROLL 4      // 16-byte weight loads in flight per lane before the first is used
#define GEMV_MAX_SMEM (48 * 1024)

// acc + dot of 8 bf16 weights (one 16-byte vector) with 8 bf16 inputs.
__device__ __forceinline__ float dot8_acc(uint4 wv, uint4 xv, float acc) {
    float w[8], x[8];
    unpack8f(wv, w);
    unpack8f(xv, x);
#pragma unroll
    for (int j = 0; j < 8; j++) acc = fmaf(w[j], x[j], acc);
    return acc;
}

// Weights are read once per step: keep them out of L1.
__device__ __forceinline__ uint4 load_stream(const uint4 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// out (NR, OC), in (NR, IC), w (OC, IC), bias (OC) or NULL; IC % 8 == 0, out/in/w 16-byte aligned.
// Grid-stride over output columns, one warp per column at a time.
template <int NR>
__global__ void __launch_bounds__(GEMV_THREADS) gemv_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ in,
                                                             const bf16 *__restrict__ w,
                                                             const bf16 *__restrict__ bias, int IC, int OC) {
    extern __shared__ uint4 xs[];   // (NR, IC / 8)
    const int C8 = IC / 8;
    const uint4 *in4 = reinterpret_cast<const uint4 *>(in);
    for (int i = threadIdx.x; i < NR * C8; i += blockDim.x) xs[i] = in4[i];
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, n_warps = (gridDim.x * blockDim.x) >> 5;
    for (int o = warp; o < OC; o += n_warps) {
        const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)o * IC);
        float acc[NR];
#pragma unroll
        for (int r = 0; r < NR; r++) acc[r] = 0.0f;
        for (int c0 = lane; c0 < C8; c0 += 32 * GEMV_UNROLL) {
            uint4 wv[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                const int c = c0 + 32 * u;
                wv[u] = c < C8 ? load_stream(wr + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                const int c = c0 + 32 * u;
                if (c < C8) {
#pragma unroll
                    for (int r = 0; r < NR; r++) acc[r] = dot8_acc(wv[u], xs[r * C8 + c], acc[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < NR; r++) acc[r] = warp_sum(acc[r]);
        if (lane == 0) {
            const float b = bias ? bf2f(bias[o]) : 0.0f;
#pragma unroll
            for (int r = 0; r < NR; r++) out[(size_t)r * OC + o] = f2bf(acc[r] + b);
        }
    }
}

static int gemv_enabled(void) {
    static int on = -1;   // read once per process
    if (on < 0) {
        const char *v = getenv("TANDEM_GEMV");
        on = !(v && strcmp(v, "0") == 0);
    }
    return on;
}

int cuda_gemv_applies(const CudaState *st, const void *out, const void *in, const void *w, const void *bias, int N,
                      int IC) {
    (void)st;
    const uintptr_t a = (uintptr_t)out | (uintptr_t)in | (uintptr_t)w;
    const size_t smem = (size_t)N * IC * 2;   // the input rows, staged in shared memory
    return gemv_enabled() && N >= 1 && N <= GEMV_MAX_ROWS && IC % 8 == 0 && (a & 15) == 0 &&
           ((uintptr_t)bias & 1) == 0 && smem <= GEMV_MAX_SMEM;
}

template <int NR>
static void gemv_launch(OpsCtx *ctx, CudaState *st, void *out, const void *in, const void *w, const void *bias, int IC,
                        int OC) {
    const size_t smem = (size_t)NR * IC * 2;
    // Enough warps to keep every SM streaming (as many blocks per SM as the staged rows let fit, at most 4 of
    // 512 threads); each warp then walks OC with a grid stride.
    const int warps_per_block = GEMV_THREADS / 32;
    long per_sm = smem ? (long)((200 * 1024) / smem) : 4;
    per_sm = per_sm < 1 ? 1 : per_sm > 4 ? 4 : per_sm;
    long blocks = ((long)OC + warps_per_block - 1) / warps_per_block;
    if (blocks > (long)st->sm_count * per_sm) blocks = (long)st->sm_count * per_sm;
    gemv_kernel<NR><<<(unsigned)blocks, GEMV_THREADS, smem, st->stream>>>((bf16 *)out, (const bf16 *)in,
                                                                         (const bf16 *)w, (const bf16 *)bias, IC, OC);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_gemv_fwd(OpsCtx *ctx, CudaState *st, void *out, const void *in, const void *w, const void *bias, int N,
                   int IC, int OC) {
    if (N == 1) gemv_launch<1>(ctx, st, out, in, w, bias, IC, OC);
    else gemv_launch<2>(ctx, st, out, in, w, bias, IC, OC);
}
