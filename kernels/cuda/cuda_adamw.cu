// kernels/cuda/cuda_adamw.cu — AdamW on fp32 master weights and moments, writing the bf16 parameters.
//
// The arithmetic mirrors the CPU twin (kernels/cpu/cpu_adamw.c), which mirrors torch.optim.AdamW: the
// scalars are computed on the host in double and rounded to float once, and each element goes through
//   p = p * decay                          (only when weight_decay != 0)
//   m = fma(1 - beta1, g - m, m)           (torch's lerp)
//   v = v * beta2 + (1 - beta2) * g * g
//   p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)
// with IEEE round-to-nearest intrinsics so that nvcc cannot contract or reorder anything: the GPU then
// computes the same float operations as the CPU (up to FMA contraction the host compiler may apply).
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

typedef struct {
    float decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps, grad_scale;
    int decays;
} AdamwScalars;

// master, m, v, grad (n) fp32; param_out (n) bf16 or NULL.
__global__ void adamw_kernel(float *master, float *m, float *v, const float *grad, bf16 *param_out, size_t n,
                             AdamwScalars s) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float g = __fmul_rn(grad[i], s.grad_scale);
        float pi = master[i];
        if (s.decays) pi = __fmul_rn(pi, s.decay);
        const float mi = __fmaf_rn(s.w1, __fsub_rn(g, m[i]), m[i]);
        float vi = __fmul_rn(v[i], s.beta2);
        vi = __fadd_rn(vi, __fmul_rn(__fmul_rn(s.w2, g), g));
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
        pi = __fadd_rn(pi, __fdiv_rn(__fmul_rn(s.neg_step_size, mi), denom));
        master[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (param_out) param_out[i] = f2bf(pi);
    }
}

void cuda_adamw_step(OpsCtx *ctx, float *master, float *m, float *v, const float *grad, void *param_out, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, step >= 1, "adamw_step: step must count from 1, got %d", step);
    if (n == 0) return;
    const double bias_correction1 = 1.0 - pow((double)beta1, (double)step);
    const double bias_correction2 = 1.0 - pow((double)beta2, (double)step);
    AdamwScalars s;
    s.decay = (float)(1.0 - (double)lr * (double)weight_decay);
    s.w1 = (float)(1.0 - (double)beta1);
    s.beta2 = beta2;
    s.w2 = (float)(1.0 - (double)beta2);
    s.neg_step_size = (float)(-((double)lr / bias_correction1));
    s.bc2_sqrt = (float)sqrt(bias_correction2);
    s.eps = eps;
    s.grad_scale = grad_scale;
    s.decays = weight_decay != 0.0f;
    adamw_kernel<<<cuda_grid_1d(n, 256, st), 256, 0, st->stream>>>(master, m, v, grad, (bf16 *)param_out, n, s);
    CUDA_CHECK_LAUNCH(ctx);
}
