// kernels/cuda/cuda_rope.cu — rotary embedding, Hugging Face "rotate_half" layout, in place on bf16.
// Within each head of D values element i pairs with i + D/2 (i < D/2) and the pair turns by
// angle = pos * inv_freq[i], the fp32 product as transformers computes it; cos/sin in fp32 (full-range
// sincosf: angles reach tens of thousands of radians). An odd D leaves the last element as is (CPU twin).
#include "kernels/cuda/cuda_common.cuh"

// x (N, H, D) in place; positions (N); inv_freq (D/2). One thread per (token, head, pair).
// sign = +1 forward (x1 cos - x2 sin, x2 cos + x1 sin), -1 its transpose (the backward).
__global__ void rope_kernel(bf16 *x, const int32_t *positions, const float *inv_freq, int N, int H, int D,
                            float sign) {
    const int half = D / 2;
    const size_t total = (size_t)N * H * half;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const size_t nh = idx / half;         // token * H + head
        const size_t n = nh / H;
        const float angle = (float)positions[n] * inv_freq[i];
        float s, c;
        sincosf(angle, &s, &c);
        s *= sign;
        bf16 *p = x + nh * D;
        const float a = bf2f(p[i]), b = bf2f(p[i + half]);
        p[i] = f2bf(a * c - b * s);
        p[i + half] = f2bf(b * c + a * s);
    }
}

static void rope_launch(OpsCtx *ctx, void *x, const int32_t *positions, const float *inv_freq, int N, int H, int D,
                        float sign, const char *name) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && H >= 0 && D >= 0, "%s: bad shape N=%d H=%d D=%d", name, N, H, D);
    size_t total = (size_t)N * H * (D / 2);
    if (!total) return;
    rope_kernel<<<cuda_grid_1d(total, 256, st), 256, 0, st->stream>>>((bf16 *)x, positions, inv_freq, N, H, D, sign);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_rope_fwd(OpsCtx *ctx, void *x, const int32_t *positions, const float *inv_freq, int N, int H, int D) {
    rope_launch(ctx, x, positions, inv_freq, N, H, D, 1.0f, "rope_fwd");
}
void cuda_rope_bwd(OpsCtx *ctx, void *dx, const int32_t *positions, const float *inv_freq, int N, int H, int D) {
    rope_launch(ctx, dx, positions, inv_freq, N, H, D, -1.0f, "rope_bwd");
}
