// kernels/cuda/cuda_swiglu.cu — SwiGLU on the fused [gate | up] projection, bf16 storage, fp32 math.
//   forward:  out = silu(g) * u,  silu(g) = g / (1 + exp(-g))  (PyTorch's formula, as the CPU twin)
//   backward: dg = dout * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  du = dout * silu(g)
#include "kernels/cuda/cuda_common.cuh"

__device__ __forceinline__ float sigmoidf_(float g) { return 1.0f / (1.0f + expf(-g)); }

// out (N, I); gu (N, 2I): gate in columns [0, I), up in [I, 2I).
__global__ void swiglu_fwd_kernel(bf16 *out, const bf16 *gu, size_t total, int I) {
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        size_t n = idx / I, i = idx - n * I;
        const bf16 *row = gu + n * 2 * (size_t)I;
        float g = bf2f(row[i]), u = bf2f(row[I + i]);
        out[idx] = f2bf(g / (1.0f + expf(-g)) * u);
    }
}

// dgu (N, 2I) overwritten; dout (N, I).
__global__ void swiglu_bwd_kernel(bf16 *dgu, const bf16 *dout, const bf16 *gu, size_t total, int I) {
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        size_t n = idx / I, i = idx - n * I;
        const bf16 *row = gu + n * 2 * (size_t)I;
        float g = bf2f(row[i]), u = bf2f(row[I + i]), d = bf2f(dout[idx]);
        float s = sigmoidf_(g);
        bf16 *drow = dgu + n * 2 * (size_t)I;
        drow[i] = f2bf(d * u * s * (1.0f + g * (1.0f - s)));
        drow[I + i] = f2bf(d * g * s);
    }
}

void cuda_swiglu_fwd(OpsCtx *ctx, void *out, const void *gu, int N, int I) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && I >= 0, "swiglu_fwd: negative shape N=%d I=%d", N, I);
    size_t total = (size_t)N * I;
    if (!total) return;
    swiglu_fwd_kernel<<<cuda_grid_1d(total, 256, st), 256, 0, st->stream>>>((bf16 *)out, (const bf16 *)gu, total, I);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_swiglu_bwd(OpsCtx *ctx, void *dgu, const void *dout, const void *gu, int N, int I) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && I >= 0, "swiglu_bwd: negative shape N=%d I=%d", N, I);
    size_t total = (size_t)N * I;
    if (!total) return;
    swiglu_bwd_kernel<<<cuda_grid_1d(total, 256, st), 256, 0, st->stream>>>((bf16 *)dgu, (const bf16 *)dout,
                                                                             (const bf16 *)gu, total, I);
    CUDA_CHECK_LAUNCH(ctx);
}
