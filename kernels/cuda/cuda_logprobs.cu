// kernels/cuda/cuda_logprobs.cu — row-wise log-softmax of logits / temperature over the vocabulary:
// per-token logprob of the target, log-sum-exp, entropy, and the gradient of the logprobs (bf16 dlogits).
//
// Numerics as the CPU twin: z = logits * inv_temperature, m = max z, y = z - m,
//   S = sum exp(y), lse = m + log S, logprob = y[target] - log S, entropy = log S - sum exp(y) y / S.
// Working with y keeps large logits accurate (z - lse would cancel). One pass over the row: each thread keeps
// an online (m_t, S_t, E_t) over the values it sees (S_t = sum exp(z - m_t), E_t = sum exp(z - m_t)(z - m_t),
// rescaled when m_t grows) and the block combines them at the common m in double. The row is read in 16-byte
// vectors of 8 values (scalar loads for the unaligned head and the tail), once in the forward and once in
// the backward: these kernels move the whole (N, V) logits, so they are bandwidth-bound.
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_common.cuh"

static const int LP_THREADS = 1024;

// Values before the row's first 16-byte boundary (the rest is read as vectors of 8, then a tail).
__device__ __forceinline__ int row_head(const bf16 *x, int V) {
    const int h = (int)(((16 - ((uintptr_t)x & 15)) & 15) / 2);
    return h < V ? h : V;
}

struct OnlineSum {
    float m, s, e;  // running max, sum exp(z - m), sum exp(z - m)(z - m)
};

__device__ __forceinline__ void online_raise(OnlineSum &a, float mx) {
    if (mx > a.m) {
        if (a.s > 0.0f) {
            const float d = a.m - mx, r = expf(d);
            a.e = r * (a.e + d * a.s);
            a.s *= r;
        }
        a.m = mx;
    }
}
__device__ __forceinline__ void online_add(OnlineSum &a, float z) {
    const float y = z - a.m, ey = expf(y);
    a.s += ey;
    a.e += ey * y;
}

// logits (N, V) bf16; targets, logprobs, lse, entropy (N); entropy may be NULL. One block per row.
// targets[n] < 0: ignored row, logprob 0; targets[n] >= V: logprob NaN (the CPU twin's convention: the
// mistake surfaces in the loss instead of reading out of bounds).
__global__ void logprobs_fwd_kernel(float *logprobs, float *lse, float *entropy, const bf16 *logits,
                                    const int32_t *targets, int V, float inv_t) {
    __shared__ float redf[32];
    __shared__ double redd[32];
    const size_t row = blockIdx.x;
    const bf16 *x = logits + row * V;
    const int head = row_head(x, V), nvec = (V - head) / 8, tail0 = head + 8 * nvec;
    const uint4 *xv = reinterpret_cast<const uint4 *>(x + head);
    OnlineSum a = {-INFINITY, 0.0f, 0.0f};
    for (int c = threadIdx.x; c < head; c += blockDim.x) {
        const float z = bf2f(x[c]) * inv_t;
        online_raise(a, z);
        online_add(a, z);
    }
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        float z[8];
        unpack8f(xv[i], z);
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            z[j] *= inv_t;
            mx = fmaxf(mx, z[j]);
        }
        online_raise(a, mx);
#pragma unroll
        for (int j = 0; j < 8; j++) online_add(a, z[j]);
    }
    for (int c = tail0 + threadIdx.x; c < V; c += blockDim.x) {
        const float z = bf2f(x[c]) * inv_t;
        online_raise(a, z);
        online_add(a, z);
    }
    float mx = warp_max(a.m);
    if ((threadIdx.x & 31) == 0) redf[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = (threadIdx.x & 31) < (blockDim.x >> 5) ? redf[threadIdx.x & 31] : -INFINITY;
    mx = warp_max(mx);
    // This thread's sums moved to the row's max: exp(z - mx) = exp(z - m_t) exp(m_t - mx), z - mx = (z - m_t) + d.
    double se = 0.0, sey = 0.0;
    if (a.s > 0.0f) {
        const float d = a.m - mx, r = expf(d);
        se = (double)(a.s * r);
        sey = (double)(r * (a.e + d * a.s));
    }
    const double sum_e = block_sum_d(se, redd);
    const double sum_ey = block_sum_d(sey, redd);
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

// d logit for value x at column c: g (onehot(t) - p) - gh p (log p + h), with log p = x inv_t - l.
__device__ __forceinline__ float dlogit(float x, int c, int t, float g, float gh, float h, float l, float inv_t) {
    const float lp = x * inv_t - l, p = expf(lp);
    return (c == t ? g * (1.0f - p) : -g * p) - gh * p * (lp + h);
}

// dlogits (N, V) = dlogprobs[n] * inv_t * (onehot(target) - exp(z - lse[n])), overwritten; zero rows for
// ignored (or out-of-range) targets.
// With dentropy: plus dentropy[n] * inv_t * (-p (log p + entropy[n])) on every row (d entropy / d z).
// In place (dlogits == logits) too: a thread writes only the values it has just read.
// Vectors of 8 where the logits and dlogits rows are aligned alike (always, when both bases are 16-byte aligned).
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
    const bool same_align = (((uintptr_t)x ^ (uintptr_t)d) & 15) == 0;
    const int head = same_align ? row_head(x, V) : V, nvec = (V - head) / 8, tail0 = head + 8 * nvec;
    for (int c = threadIdx.x; c < head; c += blockDim.x) d[c] = f2bf(dlogit(bf2f(x[c]), c, t, g, gh, h, l, inv_t));
    const uint4 *xv = reinterpret_cast<const uint4 *>(x + head);
    uint4 *dv = reinterpret_cast<uint4 *>(d + head);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        float z[8];
        unpack8f(xv[i], z);
        const int c0 = head + 8 * i;
#pragma unroll
        for (int j = 0; j < 8; j++) z[j] = dlogit(z[j], c0 + j, t, g, gh, h, l, inv_t);
        dv[i] = pack8f(z);
    }
    for (int c = tail0 + threadIdx.x; c < V; c += blockDim.x) d[c] = f2bf(dlogit(bf2f(x[c]), c, t, g, gh, h, l, inv_t));
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
