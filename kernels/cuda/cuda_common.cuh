// kernels/cuda/cuda_common.cuh — what every CUDA op file shares: the backend state hanging off the ops
// context, the checked-call macros, bf16 load/store helpers and warp/block reductions.
//
// Error model: ops are asynchronous on the context's single stream. A failing CUDA/cuBLAS call records
// "file:line: call: reason" in the context (ops_set_error) and the op returns; the dispatcher then turns
// every later op into a no-op. Faults found *inside* a kernel (a token id outside the vocabulary) are
// written to a small device record and turned into a context error at the next synchronization point
// (ops_synchronize, ops_copy_to_host, ops_download_f32), because the host cannot see them earlier.
#ifndef TANDEM_KERNELS_CUDA_COMMON_CUH
#define TANDEM_KERNELS_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_ops.h"

typedef __nv_bfloat16 bf16;

// Kinds of fault a kernel can report through the device fault record.
enum {
    CUDA_FAULT_NONE = 0,
    CUDA_FAULT_EMBEDDING_TOKEN = 1,  // info: row, token id, V
    CUDA_FAULT_PEER_TIMEOUT = 2,     // ops_peer_all_reduce; info: waiting shard, late shard, timeout ms
};

// The device fault record: the first kernel to fault claims it with atomicCAS on `kind`.
typedef struct {
    int kind;
    int info[3];
} CudaFault;

// Cached cuBLASLt plan (descriptors + chosen algorithm) for one GEMM shape; see cuda_matmul.cu.
typedef struct CudaGemmPlan CudaGemmPlan;
typedef struct CudaProfile CudaProfile;
CudaProfile *cuda_profile_create(void);
void cuda_profile_destroy(CudaProfile *p);

typedef struct {
    int device;
    int sm_count;
    size_t max_smem_optin;        // bytes of dynamic shared memory a block may opt into
    cudaStream_t stream;          // where ops queue work: main_stream, or capture_stream while a graph records
    cudaStream_t main_stream;     // the context's compute stream (ops_cuda_stream); never changes
    cudaStream_t capture_stream;  // private stream graphs are recorded on (cuda_graph.cu), made on first use
    int capturing;                // a graph is being recorded (by the thread that began it)
    int capture_saved_fault;      // fault_armed before the recording (restored after it)
    cublasLtHandle_t lt;
    cublasHandle_t blas;          // cublasGemmEx fallback, created on first use (cuda_matmul.cu)
    void *lt_workspace;           // cuBLASLt workspace (split-K partials and the like)
    size_t lt_workspace_bytes;
    void *scratch;                // stream-ordered scratch for reductions (partials, attention Delta)
    size_t scratch_bytes;
    int scratch_in_graph;         // a graph recorded the current scratch pointer: growing keeps the old buffer
    void **scratch_retired;       // (n_scratch_retired) such old buffers, freed with the state
    int n_scratch_retired;
    CudaFault *fault_dev;         // device fault record
    CudaFault *fault_host;        // pinned host mirror, read after a stream synchronize
    uint16_t *stage;              // pinned host staging for fp32 <-> bf16 conversion (CONVERT_CHUNK elements)
    uint32_t *upload_f32;         // device staging of ops_upload_f32's fp32 chunks (UPLOAD_CHUNK), made on first use
    int fault_armed;              // a kernel that may fault ran since the last check
    CudaGemmPlan *plans;          // small cache of GEMM plans (cuda_matmul.cu owns its contents)
    int n_plans;
    OpsGemmAutotune gemm_autotune; // the context's setting (OpsSettings)
    int gemm_tuning_paused;       // ops_set_gemm_tuning(ctx, 0): new shapes take the heuristic's first pick
    double gemm_tune_s;           // host seconds spent timing GEMM candidates (bounded, see cuda_matmul.cu)
    CudaProfile *profile;         // per-op timing (OpsSettings.profile_ops), NULL when off (cuda_profile.cu)
} CudaState;

// Records "call failed: reason" with the call site; the *_RET variants return a value instead of void.
#define CUDA_CHECK_RET(ctx, call, retval)                                                                  \
    do {                                                                                                   \
        cudaError_t cuda_check_e_ = (call);                                                                \
        if (cuda_check_e_ != cudaSuccess) {                                                                \
            ops_set_error((ctx), -1, __FILE__, __LINE__, "%s failed: %s (%s)", #call,                       \
                          cudaGetErrorString(cuda_check_e_), cudaGetErrorName(cuda_check_e_));              \
            return retval;                                                                                 \
        }                                                                                                  \
    } while (0)
#define CUDA_CHECK(ctx, call) CUDA_CHECK_RET(ctx, call, )

#define CUBLAS_CHECK_RET(ctx, call, retval)                                                                \
    do {                                                                                                   \
        cublasStatus_t cublas_check_s_ = (call);                                                           \
        if (cublas_check_s_ != CUBLAS_STATUS_SUCCESS) {                                                    \
            ops_set_error((ctx), -1, __FILE__, __LINE__, "%s failed: cuBLAS status %d (%s)", #call,         \
                          (int)cublas_check_s_, cublasLtGetStatusString(cublas_check_s_));                  \
            return retval;                                                                                 \
        }                                                                                                  \
    } while (0)
#define CUBLAS_CHECK(ctx, call) CUBLAS_CHECK_RET(ctx, call, )

// After a kernel launch: configuration errors (too much shared memory, bad grid) surface here.
#define CUDA_CHECK_LAUNCH(ctx) CUDA_CHECK(ctx, cudaGetLastError())

// Argument errors are reported the same way, naming the argument.
#define CUDA_ARG_CHECK(ctx, cond, ...)                                                                     \
    do {                                                                                                   \
        if (!(cond)) {                                                                                     \
            ops_set_error((ctx), -1, __FILE__, __LINE__, __VA_ARGS__);                                     \
            return;                                                                                        \
        }                                                                                                  \
    } while (0)

// The context's state with its device made current on the calling thread (the current device is per
// thread, and the thread that runs ops need not be the one that created the context). NULL + error on failure.
CudaState *cuda_enter(OpsCtx *ctx);

// 1 (with an error recorded naming `what`) when the calling thread is recording a graph on this context: for calls
// that cannot be recorded (allocation, free, host copies, synchronization, lazily made handles or plans). Else 0.
int cuda_refuse_in_capture(OpsCtx *ctx, const CudaState *st, const char *what);
// 1 when the calling thread is recording a graph on this context (cuda_graph.cu), else 0.
int cuda_recording(const CudaState *st);

// Stream-ordered scratch of at least `bytes` (grown with cudaMallocAsync on the stream, never shrunk).
// Contents are undefined; valid until the next op that asks for scratch. NULL + error on failure.
// While a graph records, the scratch already there is handed out (and kept alive for the graph from then on)
// but growing it is refused: an eager run of the same ops before the recording sizes it.
void *cuda_scratch(OpsCtx *ctx, CudaState *st, size_t bytes);

// The forward projection for at most GEMV_MAX_ROWS rows (decode steps), cuda_gemv.cu: out (N, OC) = in (N, IC)
// w^T + bias, as cuda_matmul_fwd computes it. cuda_gemv_applies says whether the shapes, alignment and device
// allow it; cuda_matmul_fwd then calls cuda_gemv_fwd instead of cuBLASLt.
#define GEMV_MAX_ROWS 2
int cuda_gemv_applies(const CudaState *st, const void *out, const void *in, const void *w, const void *bias, int N,
                      int IC);
void cuda_gemv_fwd(OpsCtx *ctx, CudaState *st, void *out, const void *in, const void *w, const void *bias, int N,
                   int IC, int OC);

// Blocks for a grid-stride elementwise kernel over n items.
static inline unsigned cuda_grid_1d(size_t n, int threads, const CudaState *st) {
    size_t blocks = (n + threads - 1) / threads;
    size_t cap = (size_t)st->sm_count * 32;  // enough to fill the GPU; the loop covers the rest
    if (blocks > cap) blocks = cap;
    return blocks ? (unsigned)blocks : 1u;
}

// ---- device helpers -------------------------------------------------------------------------------

__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); }
// RoPE's rotation with its roundings spelled out, out1 = x1 c - x2 s and out2 = x2 c + x1 s: left to itself nvcc
// picks per kernel which product to fuse into an FMA. These are the FMAs it chose for the first one-pair-per-thread
// kernel of cuda_rope.cu, so every kernel that turns pairs (cuda_rope.cu, cuda_gemv.cu) gives those bits.
__device__ __forceinline__ float rot1(float a, float b, float c, float s) { return __fmaf_rn(c, a, -__fmul_rn(s, b)); }
__device__ __forceinline__ float rot2(float a, float b, float c, float s) { return __fmaf_rn(s, a, __fmul_rn(c, b)); }
// silu(g) = g / (1 + exp(-g)): PyTorch's formula, as the CPU twin (SwiGLU, cuda_swiglu.cu and cuda_gemv.cu).
__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }
// 8 bf16 values as one 16-byte vector <-> 8 floats (round to nearest even on the way back).
__device__ __forceinline__ void unpack8f(uint4 u, float f[8]) {
    const __nv_bfloat162 *p = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 t = __bfloat1622float2(p[j]);
        f[2 * j] = t.x;
        f[2 * j + 1] = t.y;
    }
}
__device__ __forceinline__ uint4 pack8f(const float f[8]) {
    uint4 u;
    __nv_bfloat162 *p = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) p[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    return u;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `red` is __shared__ storage of 32 floats; the function syncs before reusing it, so it may be called
// back to back.
__device__ __forceinline__ float block_sum(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? red[lane] : 0.0f;
    return warp_sum(t);
}
__device__ __forceinline__ double block_sum_d(double v, double *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double t = lane < nwarps ? red[lane] : 0.0;
    return warp_sum_d(t);
}

// Records a kernel-side fault (first one wins).
__device__ __forceinline__ void cuda_fault(CudaFault *f, int kind, int a, int b, int c) {
    if (atomicCAS(&f->kind, 0, -1) == 0) {  // -1: claimed, details being written
        f->info[0] = a;
        f->info[1] = b;
        f->info[2] = c;
        __threadfence();
        atomicExch(&f->kind, kind);
    }
}

#endif
