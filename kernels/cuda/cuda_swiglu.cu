// kernels/cuda/cuda_swiglu.cu — SwiGLU on the fused [gate | up] projection, bf16 storage, fp32 math.
//   forward:  out = silu(g) * u,  silu(g) = g / (1 + exp(-g))  (PyTorch's formula, as the CPU twin)
//   backward: dg = dout * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  du = dout * g * sigmoid(g)
// Memory-bound: each thread moves 8 consecutive columns as one 16-byte load of gate, of up (and of dout) and one
// 16-byte store per output, when I % 8 == 0 and the buffers are 16-byte aligned (every model shape); other shapes
// go element by element through the same arithmetic. A grid-stride loop walks (row, column-vector) pairs with an
// incremental row/column split, so there is no division in the loop.
#include "kernels/cuda/cuda_common.cuh"

__device__ __forceinline__ float sigmoid_f(float g) { return 1.0f / (1.0f + expf(-g)); }

// Element (n, i) of a row-major (rows, I) walk, advanced by a fixed stride without dividing: the stride's
// whole rows and leftover columns are split once.
struct RowWalk {
    size_t n;
    int i;
};
__device__ __forceinline__ void walk_advance(RowWalk &w, size_t stride_rows, int stride_cols, int I) {
    w.n += stride_rows;
    w.i += stride_cols;
    if (w.i >= I) {
        w.i -= I;
        w.n++;
    }
}

// out (N, I) as (N, V) 16-byte vectors, V = I / 8; gu (N, 2V) vectors: gate in [0, V), up in [V, 2V).
__global__ void swiglu_fwd_vec_kernel(uint4 *__restrict__ out, const uint4 *__restrict__ gu, size_t N, int V) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    RowWalk w = {start / V, (int)(start % V)};
    const size_t stride_rows = stride / V;
    const int stride_cols = (int)(stride % V);
    for (; w.n < N; walk_advance(w, stride_rows, stride_cols, V)) {
        const uint4 *row = gu + w.n * 2 * V;
        const uint4 gv = row[w.i], uv = row[V + w.i];
        float g[8], u[8], o[8];
        unpack8f(gv, g);
        unpack8f(uv, u);
#pragma unroll
        for (int k = 0; k < 8; k++) o[k] = silu_f(g[k]) * u[k];
        out[w.n * V + w.i] = pack8f(o);
    }
}

// dgu (N, 2V) overwritten; dout (N, V); gu (N, 2V) — all in 16-byte vectors.
__global__ void swiglu_bwd_vec_kernel(uint4 *__restrict__ dgu, const uint4 *__restrict__ dout,
                                      const uint4 *__restrict__ gu, size_t N, int V) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    RowWalk w = {start / V, (int)(start % V)};
    const size_t stride_rows = stride / V;
    const int stride_cols = (int)(stride % V);
    for (; w.n < N; walk_advance(w, stride_rows, stride_cols, V)) {
        const uint4 *row = gu + w.n * 2 * V;
        const uint4 gv = row[w.i], uv = row[V + w.i], dv = dout[w.n * V + w.i];
        float g[8], u[8], d[8], dg[8], du[8];
        unpack8f(gv, g);
        unpack8f(uv, u);
        unpack8f(dv, d);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float s = sigmoid_f(g[k]);
            dg[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
            du[k] = d[k] * g[k] * s;
        }
        uint4 *drow = dgu + w.n * 2 * V;
        drow[w.i] = pack8f(dg);
        drow[V + w.i] = pack8f(du);
    }
}

// Element paths (I % 8 != 0 or unaligned views): out (N, I); gu, dgu (N, 2I); dout (N, I).
__global__ void swiglu_fwd_kernel(bf16 *out, const bf16 *gu, size_t N, int I) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    RowWalk w = {start / I, (int)(start % I)};
    const size_t stride_rows = stride / I;
    const int stride_cols = (int)(stride % I);
    for (; w.n < N; walk_advance(w, stride_rows, stride_cols, I)) {
        const bf16 *row = gu + w.n * 2 * I;
        out[w.n * I + w.i] = f2bf(silu_f(bf2f(row[w.i])) * bf2f(row[I + w.i]));
    }
}

__global__ void swiglu_bwd_kernel(bf16 *dgu, const bf16 *dout, const bf16 *gu, size_t N, int I) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    RowWalk w = {start / I, (int)(start % I)};
    const size_t stride_rows = stride / I;
    const int stride_cols = (int)(stride % I);
    for (; w.n < N; walk_advance(w, stride_rows, stride_cols, I)) {
        const bf16 *row = gu + w.n * 2 * I;
        const float g = bf2f(row[w.i]), u = bf2f(row[I + w.i]), d = bf2f(dout[w.n * I + w.i]);
        const float s = sigmoid_f(g);
        bf16 *drow = dgu + w.n * 2 * I;
        drow[w.i] = f2bf(d * u * s * (1.0f + g * (1.0f - s)));
        drow[I + w.i] = f2bf(d * g * s);
    }
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// Threads per block and blocks for n work items: the GPU filled (cuda_grid_1d's cap), each thread looping over
// the rest.
enum { SWIGLU_THREADS = 256 };

void cuda_swiglu_fwd(OpsCtx *ctx, void *out, const void *gu, int N, int I) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && I >= 0, "swiglu_fwd: negative shape N=%d I=%d", N, I);
    if (N == 0 || I == 0) return;
    if (I % 8 == 0 && aligned16(out) && aligned16(gu)) {
        const int V = I / 8;
        swiglu_fwd_vec_kernel<<<cuda_grid_1d((size_t)N * V, SWIGLU_THREADS, st), SWIGLU_THREADS, 0, st->stream>>>(
            (uint4 *)out, (const uint4 *)gu, (size_t)N, V);
    } else {
        swiglu_fwd_kernel<<<cuda_grid_1d((size_t)N * I, SWIGLU_THREADS, st), SWIGLU_THREADS, 0, st->stream>>>(
            (bf16 *)out, (const bf16 *)gu, (size_t)N, I);
    }
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_swiglu_bwd(OpsCtx *ctx, void *dgu, const void *dout, const void *gu, int N, int I) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && I >= 0, "swiglu_bwd: negative shape N=%d I=%d", N, I);
    if (N == 0 || I == 0) return;
    if (I % 8 == 0 && aligned16(dgu) && aligned16(dout) && aligned16(gu)) {
        const int V = I / 8;
        swiglu_bwd_vec_kernel<<<cuda_grid_1d((size_t)N * V, SWIGLU_THREADS, st), SWIGLU_THREADS, 0, st->stream>>>(
            (uint4 *)dgu, (const uint4 *)dout, (const uint4 *)gu, (size_t)N, V);
    } else {
        swiglu_bwd_kernel<<<cuda_grid_1d((size_t)N * I, SWIGLU_THREADS, st), SWIGLU_THREADS, 0, st->stream>>>(
            (bf16 *)dgu, (const bf16 *)dout, (const bf16 *)gu, (size_t)N, I);
    }
    CUDA_CHECK_LAUNCH(ctx);
}
