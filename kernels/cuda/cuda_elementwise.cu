// kernels/cuda/cuda_elementwise.cu — residual add y (n) += x (n) on bf16 storage, summed in fp32 and
// rounded once (the CPU twin adds in fp32); x (n) *= s on bf16 storage, multiplied in fp32 and rounded once;
// seeded dropout (ops_dropout: the mask is a function of the seed and the element index, as on the CPU).
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/index_hash.h"

// 8 bf16 per 16-byte vector when both pointers are 16-byte aligned; n8 vectors, then the tail.
__global__ void add_inplace_vec8_kernel(uint4 *y, const uint4 *x, size_t n8) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        uint4 yv = y[i], xv = x[i];
        __nv_bfloat162 *yp = reinterpret_cast<__nv_bfloat162 *>(&yv);
        const __nv_bfloat162 *xp = reinterpret_cast<const __nv_bfloat162 *>(&xv);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float2 a = __bfloat1622float2(yp[j]), b = __bfloat1622float2(xp[j]);
            yp[j] = __floats2bfloat162_rn(a.x + b.x, a.y + b.y);
        }
        y[i] = yv;
    }
}

__global__ void add_inplace_kernel(bf16 *y, const bf16 *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = f2bf(bf2f(y[i]) + bf2f(x[i]));
}

void cuda_add_inplace(OpsCtx *ctx, void *y, const void *x, size_t n) {
    CudaState *st = cuda_enter(ctx);
    if (!st || n == 0) return;
    bf16 *yb = (bf16 *)y;
    const bf16 *xb = (const bf16 *)x;
    size_t done = 0;
    if ((((uintptr_t)y | (uintptr_t)x) & 15) == 0 && n >= 8) {
        size_t n8 = n / 8;
        add_inplace_vec8_kernel<<<cuda_grid_1d(n8, 256, st), 256, 0, st->stream>>>((uint4 *)y, (const uint4 *)x, n8);
        CUDA_CHECK_LAUNCH(ctx);
        done = n8 * 8;
    }
    if (done < n) {
        add_inplace_kernel<<<cuda_grid_1d(n - done, 256, st), 256, 0, st->stream>>>(yb + done, xb + done, n - done);
        CUDA_CHECK_LAUNCH(ctx);
    }
}

// fp32 accumulation of gradient slices (ZeRO reduce-scatter results, micro-batch accumulation).
__global__ void add_f32_kernel(float *y, const float *x, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) y[i] += x[i];
}

void cuda_add_f32(OpsCtx *ctx, float *y, const float *x, size_t n) {
    CudaState *st = cuda_enter(ctx);
    if (!st || n == 0) return;
    add_f32_kernel<<<cuda_grid_1d(n, 256, st), 256, 0, st->stream>>>(y, x, n);
    CUDA_CHECK_LAUNCH(ctx);
}

// The LoRA scale on the adapter's (N, r) intermediate: multiplied in fp32, rounded once.
__global__ void scale_inplace_kernel(bf16 *x, float s, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) * s);
}

void cuda_scale_inplace(OpsCtx *ctx, void *x, float s, size_t n) {
    CudaState *st = cuda_enter(ctx);
    if (!st || n == 0) return;
    scale_inplace_kernel<<<cuda_grid_1d(n, 256, st), 256, 0, st->stream>>>((bf16 *)x, s, n);
    CUDA_CHECK_LAUNCH(ctx);
}

// ops_copy_2d_batch: up to COPY_BATCH items per launch, passed by value (one item per grid row y); each item's
// rows * cols elements are spread over the blocks of its row with a grid stride. Scaled elements go through fp32 and
// one rounding, as scale_inplace_kernel does.
#define COPY_BATCH 64
struct CopyBatch {
    OpsCopy2D item[COPY_BATCH];
};

__global__ void copy_2d_batch_kernel(CopyBatch b) {
    const OpsCopy2D it = b.item[blockIdx.y];
    const size_t n = it.rows * it.cols;
    bf16 *dst = (bf16 *)it.dst;
    const bf16 *src = (const bf16 *)it.src;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / it.cols, c = i - r * it.cols;
        const bf16 v = src[r * it.src_pitch + c];
        dst[r * it.dst_pitch + c] = it.scale == 1.0f ? v : f2bf(bf2f(v) * it.scale);
    }
}

void cuda_copy_2d_batch(OpsCtx *ctx, const OpsCopy2D *items, int n) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    for (int k0 = 0; k0 < n; k0 += COPY_BATCH) {
        CopyBatch b;
        const int m = n - k0 < COPY_BATCH ? n - k0 : COPY_BATCH;
        size_t most = 1;
        for (int k = 0; k < m; k++) {
            b.item[k] = items[k0 + k];
            if (b.item[k].rows * b.item[k].cols > most) most = b.item[k].rows * b.item[k].cols;
        }
        // At most 256 blocks an item: the blocks of the smaller items in the launch would only exit.
        const unsigned bx = cuda_grid_1d(most, 256, st);
        const dim3 grid(bx < 256 ? bx : 256, (unsigned)m);
        copy_2d_batch_kernel<<<grid, 256, 0, st->stream>>>(b);
        CUDA_CHECK_LAUNCH(ctx);
    }
}

// ops_fill_hashed_uniform: the CPU twin's arithmetic (kernels/ops.c), element by element; __fmul_rn keeps the two
// steps from fusing into one FMA, so the fp32 value is the twin's before the one rounding to bf16.
__global__ void fill_hashed_uniform_kernel(bf16 *dst, size_t rows, size_t cols, uint64_t first, size_t index_pitch,
                                           uint64_t seed, float scale) {
    const size_t n = rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / cols, c = i - r * cols;
        const float u = __fsub_rn(__fmul_rn((float)index_hash24(seed, first + r * index_pitch + c), 0x1p-23f), 1.0f);
        dst[i] = f2bf(__fmul_rn(u, scale));
    }
}

void cuda_fill_hashed_uniform(OpsCtx *ctx, void *dst, size_t rows, size_t cols, uint64_t first, size_t index_pitch,
                              uint64_t seed, float scale) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    fill_hashed_uniform_kernel<<<cuda_grid_1d(rows * cols, 256, st), 256, 0, st->stream>>>(
        (bf16 *)dst, rows, cols, first, index_pitch, seed, scale);
    CUDA_CHECK_LAUNCH(ctx);
}

__global__ void dropout_kernel(bf16 *out, const bf16 *in, size_t n, uint32_t threshold, float scale, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = index_hash24(seed, i) >= threshold ? f2bf(bf2f(in[i]) * scale) : f2bf(0.0f);
    }
}

void cuda_dropout(OpsCtx *ctx, void *out, const void *in, size_t n, float p, uint64_t seed) {
    CudaState *st = cuda_enter(ctx);
    if (!st || n == 0) return;
    const uint32_t threshold = (uint32_t)llrint((double)p * 16777216.0);
    dropout_kernel<<<cuda_grid_1d(n, 256, st), 256, 0, st->stream>>>((bf16 *)out, (const bf16 *)in, n, threshold,
                                                                      1.0f / (1.0f - p), seed);
    CUDA_CHECK_LAUNCH(ctx);
}
