// kernels/cuda/cuda_sum_squares.cu — *out += sum x[i]^2 over n fp32 values (global gradient norm).
// Deterministic: a fixed grid writes one double partial per block into scratch, then one block adds the
// partials in index order. Doubles because the sum runs over up to billions of squares. Reads are 16-byte vectors:
// the op is a pure stream over the gradient.
#include "kernels/cuda/cuda_common.cuh"

static const int SS_THREADS = 512;

// x[head, head + 4 n_vec) is read as 16-byte vectors (16-byte aligned), the at most 3 + 3 elements around it (or all
// n when x is not 4-byte aligned) one at a time. A fixed grid of one wave of blocks; each writes its partial.
__global__ void sum_squares_partial_kernel(double *partials, const float *x, size_t n, size_t head, size_t n_vec) {
    __shared__ double red[32];
    const size_t stride = (size_t)gridDim.x * blockDim.x, tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const float4 *x4 = reinterpret_cast<const float4 *>(x + head);
    // Two vectors in flight per thread (two running sums), then the odd one out.
    double acc = 0.0, acc2 = 0.0;
    size_t i = tid;
    for (; i + stride < n_vec; i += 2 * stride) {
        const float4 t = x4[i], u = x4[i + stride];
        acc += (double)t.x * t.x;
        acc2 += (double)u.x * u.x;
        acc += (double)t.y * t.y;
        acc2 += (double)u.y * u.y;
        acc += (double)t.z * t.z;
        acc2 += (double)u.z * u.z;
        acc += (double)t.w * t.w;
        acc2 += (double)u.w * u.w;
    }
    if (i < n_vec) {
        const float4 t = x4[i];
        acc += ((double)t.x * t.x + (double)t.y * t.y) + ((double)t.z * t.z + (double)t.w * t.w);
    }
    acc += acc2;
    const size_t tail = head + 4 * n_vec, n_single = head + (n - tail);
    for (size_t j = tid; j < n_single; j += stride) {
        const double t = x[j < head ? j : tail + (j - head)];
        acc += t * t;
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
    size_t head = (16 - ((uintptr_t)x & 15)) / 4 % 4;
    if (head > n || ((uintptr_t)x & 3)) head = n;
    const size_t n_vec = (n - head) / 4;
    // One wave of resident blocks (fewer for small n): the loads stream without a second, partial wave.
    int per_sm = 0;
    CUDA_CHECK(ctx, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sum_squares_partial_kernel, SS_THREADS, 0));
    unsigned blocks = cuda_grid_1d(n_vec ? n_vec : n, SS_THREADS, st);
    const unsigned wave = (unsigned)st->sm_count * (unsigned)(per_sm > 0 ? per_sm : 1);
    if (blocks > wave) blocks = wave;
    if (blocks > 1024) blocks = 1024;
    double *partials = (double *)cuda_scratch(ctx, st, blocks * sizeof(double));
    if (!partials) return;
    sum_squares_partial_kernel<<<blocks, SS_THREADS, 0, st->stream>>>(partials, x, n, head, n_vec);
    CUDA_CHECK_LAUNCH(ctx);
    sum_squares_final_kernel<<<1, SS_THREADS, 0, st->stream>>>(out, partials, (int)blocks);
    CUDA_CHECK_LAUNCH(ctx);
}
