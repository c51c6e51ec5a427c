// kernels/cuda/cuda_rmsnorm.cu — RMSNorm as Hugging Face's LlamaRMSNorm computes it, bf16 in and out,
// fp32 math: r = 1 / sqrt(mean(x^2) + eps), out = w * (x * r).
#include "kernels/cuda/cuda_common.cuh"

static int rms_threads(int C) { return C >= 1024 ? 512 : C >= 256 ? 256 : 128; }

// out, x (N, C); w (C); rstd (N) or NULL. One block per row; the second pass re-reads x from L1/L2.
__global__ void rmsnorm_fwd_kernel(bf16 *out, float *rstd, const bf16 *x, const bf16 *w, int C, float eps) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const bf16 *xr = x + row * C;
    bf16 *yr = out + row * C;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float v = bf2f(xr[c]);
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) yr[c] = f2bf(bf2f(w[c]) * (bf2f(xr[c]) * r));
    if (rstd && threadIdx.x == 0) rstd[row] = r;
}

// With g = dout, r = rstd[n]:  dx_i += r w_i g_i - x_i r^3 / C * sum_j g_j w_j x_j ;  dw_i += g_i x_i r.
// Blocks stride over rows; each keeps its dw partial (C floats) in shared memory, owned column by column
// by its threads (no conflicts), then writes it to partials[block] (gridDim.x, C). A second kernel sums
// the partials in block order, so dw is deterministic.
__global__ void rmsnorm_bwd_kernel(bf16 *dx, float *partials, const bf16 *dout, const bf16 *x, const bf16 *w,
                                   const float *rstd, int N, int C) {
    extern __shared__ float dw_acc[];  // (C)
    __shared__ float red[32];
    for (int c = threadIdx.x; c < C; c += blockDim.x) dw_acc[c] = 0.0f;
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const bf16 *xr = x + (size_t)row * C, *gr = dout + (size_t)row * C;
        bf16 *dxr = dx + (size_t)row * C;
        const float r = rstd[row];
        float gwx = 0.0f;
        for (int c = threadIdx.x; c < C; c += blockDim.x) gwx += bf2f(gr[c]) * bf2f(w[c]) * bf2f(xr[c]);
        gwx = block_sum(gwx, red);
        const float k = gwx * r * r * r / (float)C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const float g = bf2f(gr[c]), xv = bf2f(xr[c]);
            dxr[c] = f2bf(bf2f(dxr[c]) + (r * bf2f(w[c]) * g - xv * k));
            dw_acc[c] += g * xv * r;
        }
    }
    float *p = partials + (size_t)blockIdx.x * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) p[c] = dw_acc[c];
}

// dw (C) += sum over the n_partials rows of partials (n_partials, C), in row order.
__global__ void column_sum_accumulate_kernel(float *dw, const float *partials, int n_partials, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.0f;
    for (int b = 0; b < n_partials; b++) s += partials[(size_t)b * C + c];
    dw[c] += s;
}

void cuda_rmsnorm_fwd(OpsCtx *ctx, void *out, float *rstd, const void *x, const void *w, int N, int C, float eps) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && C > 0, "rmsnorm_fwd: bad shape N=%d C=%d", N, C);
    if (N == 0) return;
    rmsnorm_fwd_kernel<<<N, rms_threads(C), 0, st->stream>>>((bf16 *)out, rstd, (const bf16 *)x, (const bf16 *)w, C,
                                                             eps);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_rmsnorm_bwd(OpsCtx *ctx, void *dx, float *dw, const void *dout, const void *x, const void *w,
                      const float *rstd, int N, int C) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && C > 0, "rmsnorm_bwd: bad shape N=%d C=%d", N, C);
    if (N == 0) return;
    const size_t smem = (size_t)C * sizeof(float);
    CUDA_ARG_CHECK(ctx, smem <= st->max_smem_optin, "rmsnorm_bwd: C=%d needs %zu bytes of shared memory (device has %zu)",
                   C, smem, st->max_smem_optin);
    // About two blocks per SM: enough parallelism over rows, few partial rows to add up.
    int blocks = st->sm_count * 2;
    if (blocks > N) blocks = N;
    float *partials = (float *)cuda_scratch(ctx, st, (size_t)blocks * C * sizeof(float));
    if (!partials) return;
    if (smem > 48 * 1024)
        CUDA_CHECK(ctx, cudaFuncSetAttribute(rmsnorm_bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    rmsnorm_bwd_kernel<<<blocks, rms_threads(C), smem, st->stream>>>((bf16 *)dx, partials, (const bf16 *)dout,
                                                                     (const bf16 *)x, (const bf16 *)w, rstd, N, C);
    CUDA_CHECK_LAUNCH(ctx);
    if (!dw) return;
    column_sum_accumulate_kernel<<<(C + 255) / 256, 256, 0, st->stream>>>(dw, partials, blocks, C);
    CUDA_CHECK_LAUNCH(ctx);
}
