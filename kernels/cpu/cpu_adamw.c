// kernels/cpu/cpu_adamw.c — AdamW with torch.optim.AdamW's arithmetic, step by step, in fp32.
//
// torch (torch/optim/adam.py, _single_tensor_adam with decoupled_weight_decay, the path PyTorch takes for
// CPU tensors) computes its scalars in Python doubles and applies them to fp32 tensors in this order:
//   param.mul_(1 - lr * weight_decay)
//   exp_avg.lerp_(grad, 1 - beta1)                      m + (1 - beta1) * (g - m), fused multiply-add
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//   bias_correction1 = 1 - beta1 ** step ; bias_correction2 = 1 - beta2 ** step
//   step_size = lr / bias_correction1
//   denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-step_size)    p + (-step_size * m) / denom
// Mirroring the order (and where the scalars are rounded to float) keeps a run within float rounding of
// PyTorch's over many steps instead of drifting by a reordering's worth every step.
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

// master, m, v, grad, param_out (n) fp32; step counts from 1; g = grad * grad_scale.
void cpu_adamw_step(float *master, float *m, float *v, const float *grad, float *param_out, size_t n, float lr,
                    float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale) {
    const double bias_correction1 = 1.0 - pow((double)beta1, (double)step);
    const double bias_correction2 = 1.0 - pow((double)beta2, (double)step);
    const float decay = (float)(1.0 - (double)lr * (double)weight_decay);
    const float w1 = (float)(1.0 - (double)beta1);
    const float w2 = (float)(1.0 - (double)beta2);
    const float neg_step_size = (float)(-((double)lr / bias_correction1));
    const float bc2_sqrt = (float)sqrt(bias_correction2);
    const int decays = weight_decay != 0.0f;
    float *restrict p = master, *restrict mm = m, *restrict vv = v;
    for (size_t i = 0; i < n; i++) {
        const float g = grad[i] * grad_scale;
        float pi = p[i];
        if (decays) pi = pi * decay;
        const float mi = fmaf(w1, g - mm[i], mm[i]);
        float vi = vv[i] * beta2;
        vi = vi + w2 * g * g;
        const float denom = sqrtf(vi) / bc2_sqrt + eps;
        pi = pi + neg_step_size * mi / denom;
        p[i] = pi;
        mm[i] = mi;
        vv[i] = vi;
    }
    if (param_out && param_out != master) memcpy(param_out, master, n * sizeof(float));
}
