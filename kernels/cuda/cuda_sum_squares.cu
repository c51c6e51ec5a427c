// kernels/cuda/cuda_sum_squares.cu — *out += sum x[i]^2 over n fp32 values (global gradient norm).
// Deterministic: a fixed grid writes one double partial per block into scratch, then one block adds the
// partials in index order. Doubles because the sum runs over up to billions of squares.
#include "kernels/cuda/cuda_common.cuh"

static const int SS_THREADS = 512;

__global__ void sum_squares_partial_kernel(double *partials, const float *x, size_t n) {
    __shared__ double red[32];
    double acc = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        double v = x[i];
        acc += v * v;
    }
    acc = block_sum_d(acc, red);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void sum_squares_final_kernel(float *out, const double *partials, int n_partials) {
    __shared__ double red[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n_partials; i += blockDim.x) acc += partials[i];
    acc = block_sum_d(acc, red);
    if (threadIdx.x == 0) *out = (float)((double)*out + acc);
}

void cuda_sum_squares(OpsCtx *ctx, float *out, const float *x, size_t n) {
    CudaState *st = cuda_enter(ctx);
    if (!st || n == 0) return;
    unsigned blocks = cuda_grid_1d(n, SS_THREADS, st);
    if (blocks > 1024) blocks = 1024;
    double *partials = (double *)cuda_scratch(ctx, st, blocks * sizeof(double));
    if (!partials) return;
    sum_squares_partial_kernel<<<blocks, SS_THREADS, 0, st->stream>>>(partials, x, n);
    CUDA_CHECK_LAUNCH(ctx);
    sum_squares_final_kernel<<<1, SS_THREADS, 0, st->stream>>>(out, partials, (int)blocks);
    CUDA_CHECK_LAUNCH(ctx);
}
