// kernels/cuda/cuda_logprobs.cu — row-wise log-softmax of logits / temperature over the vocabulary:
// per-token logprob of the target, log-sum-exp, entropy, and the gradient of the logprobs (bf16 dlogits).
//
// Numerics as the CPU twin: z = logits * inv_temperature, m = max z, y = z - m,
//   S = sum exp(y), lse = m + log S, logprob = y[target] - log S, entropy = log S - sum exp(y) y / S.
// Working with y keeps large logits accurate (z - lse would cancel). Per-thread sums in fp32 (a thread
// sees V / 1024 terms), the block combination in double.
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

static const int LP_THREADS = 1024;

// logits (N, V) bf16; targets, logprobs, lse, entropy (N); entropy may be NULL. One block per row.
// targets[n] < 0: ignored row, logprob 0; targets[n] >= V: logprob NaN (the CPU twin's convention: the
// mistake surfaces in the loss instead of reading out of bounds).
__global__ void logprobs_fwd_kernel(float *logprobs, float *lse, float *entropy, const bf16 *logits,
                                    const int32_t *targets, int V, float inv_t) {
    __shared__ float redf[32];
    __shared__ double redd[32];
    const size_t row = blockIdx.x;
    const bf16 *x = logits + row * V;
    float mx = -INFINITY;
    for (int c = threadIdx.x; c < V; c += blockDim.x) mx = fmaxf(mx, bf2f(x[c]) * inv_t);
    mx = warp_max(mx);
    if ((threadIdx.x & 31) == 0) redf[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = (threadIdx.x & 31) < (blockDim.x >> 5) ? redf[threadIdx.x & 31] : -INFINITY;
    mx = warp_max(mx);
    float se = 0.0f, sey = 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const float y = bf2f(x[c]) * inv_t - mx;
        const float e = expf(y);
        se += e;
        sey += e * y;
    }
    const double sum_e = block_sum_d((double)se, redd);
    const double sum_ey = block_sum_d((double)sey, redd);
    if (threadIdx.x == 0) {
        const double log_s = log(sum_e);
        lse[row] = (float)((double)mx + log_s);
        if (entropy) entropy[row] = (float)(log_s - sum_ey / sum_e);
        const int t = targets[row];
        if (t < 0) logprobs[row] = 0.0f;
        else if (t >= V) logprobs[row] = __int_as_float(0x7fc00000);
        else logprobs[row] = (float)((double)(bf2f(x[t]) * inv_t - mx) - log_s);
    }
}

// dlogits (N, V) = dlogprobs[n] * inv_t * (onehot(target) - exp(z - lse[n])), overwritten; zero rows for
// ignored (or out-of-range) targets.
// With dentropy: plus dentropy[n] * inv_t * (-p (log p + entropy[n])) on every row (d entropy / d z).
__global__ void logprobs_bwd_kernel(bf16 *dlogits, const float *dlogprobs, const float *dentropy, const float *entropy,
                                    const bf16 *logits, const int32_t *targets, const float *lse, int V, float inv_t) {
    const size_t row = blockIdx.x;
    const bf16 *x = logits + row * V;
    bf16 *d = dlogits + row * V;
    const int t = targets[row];
    const bool scored = t >= 0 && t < V;
    const float g = scored ? dlogprobs[row] * inv_t : 0.0f;
    const float gh = dentropy ? dentropy[row] * inv_t : 0.0f, h = dentropy ? entropy[row] : 0.0f;
    const float l = lse[row];
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const float lp = bf2f(x[c]) * inv_t - l, p = expf(lp);
        d[c] = f2bf((c == t ? g * (1.0f - p) : -g * p) - gh * p * (lp + h));
    }
}

void cuda_logprobs_fwd(OpsCtx *ctx, float *logprobs, float *lse, float *entropy, const void *logits,
                       const int32_t *targets, int N, int V, float inv_temperature) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && V > 0, "logprobs_fwd: bad shape N=%d V=%d", N, V);
    if (N == 0) return;
    int threads = V >= 4 * LP_THREADS ? LP_THREADS : V >= 1024 ? 256 : 128;
    logprobs_fwd_kernel<<<N, threads, 0, st->stream>>>(logprobs, lse, entropy, (const bf16 *)logits, targets, V,
                                                        inv_temperature);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_logprobs_bwd(OpsCtx *ctx, void *dlogits, const float *dlogprobs, const float *dentropy,
                       const float *entropy, const void *logits,
                       const int32_t *targets, const float *lse, int N, int V, float inv_temperature) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && V > 0, "logprobs_bwd: bad shape N=%d V=%d", N, V);
    if (N == 0) return;
    int threads = V >= 4 * 512 ? 512 : 128;
    logprobs_bwd_kernel<<<N, threads, 0, st->stream>>>((bf16 *)dlogits, dlogprobs, dentropy, entropy,
                                                        (const bf16 *)logits, targets, lse, V, inv_temperature);
    CUDA_CHECK_LAUNCH(ctx);
}
