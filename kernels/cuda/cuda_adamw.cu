// kernels/cuda/cuda_adamw.cu — AdamW on fp32 master weights and moments, writing the bf16 parameters.
//
// The arithmetic mirrors the CPU twin (kernels/cpu/cpu_adamw.c), which mirrors torch.optim.AdamW: the
// scalars are computed on the host in double and rounded to float once, and each element goes through
//   p = p * decay                          (only when weight_decay != 0)
//   m = fma(1 - beta1, g - m, m)           (torch's lerp)
//   v = v * beta2 + (1 - beta2) * g * g
//   p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)
// with IEEE round-to-nearest intrinsics so that nvcc cannot contract or reorder anything: the GPU then
// computes the same float operations as the CPU (up to FMA contraction the host compiler may apply), and the vector
// and one-at-a-time paths below the same bits.
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

typedef struct {
    float decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps, grad_scale;
    int decays;
} AdamwScalars;

// One element, in place on p (master), mi, vi; gr is the raw gradient.
__device__ __forceinline__ void adamw_elem(float gr, float &pi, float &mi, float &vi, const AdamwScalars &s) {
    const float g = __fmul_rn(gr, s.grad_scale);
    if (s.decays) pi = __fmul_rn(pi, s.decay);
    mi = __fmaf_rn(s.w1, __fsub_rn(g, mi), mi);
    vi = __fmul_rn(vi, s.beta2);
    vi = __fadd_rn(vi, __fmul_rn(__fmul_rn(s.w2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    pi = __fadd_rn(pi, __fdiv_rn(__fmul_rn(s.neg_step_size, mi), denom));
}

// master, m, v, grad (n) fp32; param_out (n) bf16 or NULL. Elements [head, head + 4 n_vec) go four at a time as
// 16-byte vectors (bf16x4 to param_out): the caller has checked that they are aligned so. The at most 3 + 3 (or,
// when the buffers' alignments disagree, all n) elements around them go one at a time. The optimizer moves ~30 bytes
// per parameter and nothing else, so the step is as fast as those bytes stream.
__global__ void adamw_kernel(float *master, float *m, float *v, const float *grad, bf16 *param_out, size_t n,
                             size_t head, size_t n_vec, AdamwScalars s) {
    const size_t stride = (size_t)gridDim.x * blockDim.x, tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    float4 *p4 = reinterpret_cast<float4 *>(master + head), *m4 = reinterpret_cast<float4 *>(m + head);
    float4 *v4 = reinterpret_cast<float4 *>(v + head);
    const float4 *g4 = reinterpret_cast<const float4 *>(grad + head);
    uint2 *out4 = param_out ? reinterpret_cast<uint2 *>(param_out + head) : NULL;
    for (size_t i = tid; i < n_vec; i += stride) {
        float4 pi = p4[i], mi = m4[i], vi = v4[i];
        const float4 gi = g4[i];
        adamw_elem(gi.x, pi.x, mi.x, vi.x, s);
        adamw_elem(gi.y, pi.y, mi.y, vi.y, s);
        adamw_elem(gi.z, pi.z, mi.z, vi.z, s);
        adamw_elem(gi.w, pi.w, mi.w, vi.w, s);
        p4[i] = pi;
        m4[i] = mi;
        v4[i] = vi;
        if (out4) {
            uint2 u;
            __nv_bfloat162 *b = reinterpret_cast<__nv_bfloat162 *>(&u);
            b[0] = __floats2bfloat162_rn(pi.x, pi.y);
            b[1] = __floats2bfloat162_rn(pi.z, pi.w);
            out4[i] = u;
        }
    }
    const size_t tail = head + 4 * n_vec, n_single = head + (n - tail);
    for (size_t j = tid; j < n_single; j += stride) {
        const size_t i = j < head ? j : tail + (j - head);
        float pi = master[i], mi = m[i], vi = v[i];
        adamw_elem(grad[i], pi, mi, vi, s);
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
    // Elements before master's first 16-byte boundary go one at a time; the vector part needs m, v and grad at the
    // same phase (param_out at an 8-byte one), else everything goes one at a time.
    size_t head = (16 - ((uintptr_t)master & 15)) / 4 % 4;
    if (head > n) head = n;
    size_t n_vec = (n - head) / 4;
    const int same_phase = ((uintptr_t)(m + head) & 15) == 0 && ((uintptr_t)(v + head) & 15) == 0 &&
                           ((uintptr_t)(grad + head) & 15) == 0 &&
                           (!param_out || ((uintptr_t)((bf16 *)param_out + head) & 7) == 0);
    if (((uintptr_t)master & 3) || !same_phase) head = n, n_vec = 0;
    // One wave of resident blocks at most: a grid-stride loop over more blocks than fit would end on a partial wave.
    const size_t items = n_vec ? n_vec : n;  // with vectors, the first 6 threads also take the singles
    int per_sm = 0;
    CUDA_CHECK(ctx, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, adamw_kernel, 256, 0));
    unsigned blocks = cuda_grid_1d(items, 256, st);
    const unsigned wave = (unsigned)st->sm_count * (unsigned)(per_sm > 0 ? per_sm : 1);
    if (blocks > wave) blocks = wave;
    adamw_kernel<<<blocks, 256, 0, st->stream>>>(master, m, v, grad, (bf16 *)param_out, n, head, n_vec, s);
    CUDA_CHECK_LAUNCH(ctx);
}
