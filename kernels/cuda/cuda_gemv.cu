// kernels/cuda/cuda_gemv.cu — the forward projection for one or two rows (decode steps of 1..2 sequences):
// out (N, OC) = in (N, IC) @ w^T + bias with N <= GEMV_MAX_ROWS, bf16 in and out, fp32 accumulation.
//
// Why: at a row or two the projection is a pass over the weight matrix, bound by memory bandwidth, and
// cuBLASLt's small-N kernels leave part of it on the table. Here every warp owns output columns o (rows of w,
// contiguous in memory: IC values) and streams them in 16-byte vectors with several loads in flight per lane,
// while the N input rows sit in shared memory (bf16, N x IC); each lane keeps N fp32 partial dot products, the
// warp sums them with shuffles, and lane 0 adds the bias and rounds once, as the cuBLASLt bias epilogue does.
// Whole decode steps are faster this way than with cuBLASLt at one and two rows, but slower at eight, where
// reading eight staged input rows from shared memory for every weight vector costs more than the pass saves:
// hence at most two rows (bench/notes/gpu-passes-h200.md has the comparison).
// cuda_matmul_fwd calls it when cuda_gemv_applies. The summation order differs from cuBLASLt's, so results differ
// from it in the last bits.
//
// The same pass also runs ops_matmul_fused_fwd (cuda_matmul_fused_fwd), the decode step's projections with their
// neighbours folded in, one kernel instead of two or three:
//   prologue RMSNorm: every block normalises the staged rows itself (a row of a few thousand values: cheaper than
//     a launch), with the arithmetic of cuda_rmsnorm.cu (o = w (x r), r = 1 / sqrt(mean x^2 + eps)) but its own
//     summation order, so h may differ from ops_rmsnorm_fwd's in the last bit;
//   epilogue SwiGLU: a warp computes gate row o and up row o + I together, rounds both to bf16 as the stored
//     projection would be, and writes silu(g) u (cuda_swiglu.cu's arithmetic);
//   epilogue residual: the projection rounded to bf16, plus the residual, rounded again (the unfused add's
//     arithmetic);
//   epilogue RoPE + cache store (the q/k/v projection): a warp computes rows t D + i and t D + i + D/2 of head t
//     together, rounds both to bf16, turns q and k heads with cuda_rope.cu's arithmetic (sincosf of the fp32
//     angle, rot1 / rot2) and writes q to its buffer, k and v to their KV cache slots: the split, RoPE and store
//     kernel of a decode layer folded in.
#include <stdint.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.h"

// Warps per block. At batch 1 the small projections have few outputs (0.5B: 576 q|k|v pairs, 896 o and down rows),
// and blocks of 8 warps spread them over about twice as many SMs as blocks of 16, each SM then pulling half the
// bytes; blocks of 4 warps lost at 1.5B (bench/notes/gpu-decode-batch1.md, twelfth pass).
#define GEMV_WARPS 8
#define GEMV_THREADS (GEMV_WARPS * 32)
// The launch bound of the kernel as it was measured (blocks of up to 16 warps were tried with it): it sets the
// register budget the compiler allocates for, and a bound of GEMV_THREADS would compile other code.
#define GEMV_LAUNCH_BOUND 512
#define GEMV_UNROLL 4      // 16-byte weight loads in flight per lane before the first is used
#define GEMV_MAX_SMEM (48 * 1024)

// acc + dot of 8 bf16 weights (one 16-byte vector) with 8 bf16 inputs.
__device__ __forceinline__ float dot8_acc(uint4 wv, uint4 xv, float acc) {
    float w[8], x[8];
    unpack8f(wv, w);
    unpack8f(xv, x);
#pragma unroll
    for (int j = 0; j < 8; j++) acc = fmaf(w[j], x[j], acc);
    return acc;
}

// Weights are read once per step: keep them out of L1.
__device__ __forceinline__ uint4 load_stream(const uint4 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// What one launch computes (ops_matmul_fused_fwd's fields; a plain projection leaves them NULL / 0).
struct GemvArgs {
    bf16 *out;               // (NR, n_out): n_out = OC, or OC / 2 with swiglu
    const bf16 *in, *w, *bias;
    const bf16 *norm_w;      // prologue RMSNorm weight (IC) or NULL
    float eps;
    const bf16 *residual;    // epilogue residual (NR, OC) or NULL
    int IC, OC;
    // GEMV_ROPE: positions, slots (NR), inv_freq (D / 2), caches (n_slots, Hkv, D); out is q (NR, Hq, D)
    const int32_t *positions, *slots;
    const float *inv_freq;
    bf16 *k_cache, *v_cache;
    int Hq, Hkv, D;
};

// What the epilogue does with a warp's output(s).
enum { GEMV_PLAIN = 0, GEMV_SWIGLU = 1, GEMV_ROPE = 2 };

// Sum over the block (blockDim.x a multiple of 32); red: NR x 32 floats of shared memory.
template <int NR>
__device__ __forceinline__ void block_sums(float v[NR], float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < NR; r++) {
        const float t = warp_sum(v[r]);
        if (lane == 0) red[r * 32 + warp] = t;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < NR; r++) v[r] = warp_sum(lane < nw ? red[r * 32 + lane] : 0.0f);
}

// out (NR, OC), in (NR, IC), w (OC, IC) [SWIGLU: (2I, IC), out (NR, I)], bias (OC) or NULL; IC % 8 == 0,
// out/in/w/norm_w 16-byte aligned. Grid-stride over outputs, one warp per output column (SWIGLU: per gate/up pair;
// ROPE: per pair of dims i, i + D/2 of a head) at a time.
template <int NR, int MODE>
__global__ void __launch_bounds__(GEMV_LAUNCH_BOUND) gemv_kernel(GemvArgs a) {
    constexpr bool SWIGLU = MODE == GEMV_SWIGLU, ROPE = MODE == GEMV_ROPE;
    extern __shared__ uint4 xs[];   // (NR, IC / 8)
    __shared__ float red[NR * 32];
    const int C8 = a.IC / 8;
    const uint4 *in4 = reinterpret_cast<const uint4 *>(a.in);
    for (int i = threadIdx.x; i < NR * C8; i += blockDim.x) xs[i] = in4[i];
    __syncthreads();
    if (a.norm_w) {
        float ss[NR];
#pragma unroll
        for (int r = 0; r < NR; r++) {
            ss[r] = 0.0f;
            for (int c = threadIdx.x; c < C8; c += blockDim.x) {
                float v[8];
                unpack8f(xs[r * C8 + c], v);
#pragma unroll
                for (int k = 0; k < 8; k++) ss[r] += v[k] * v[k];
            }
        }
        block_sums<NR>(ss, red);
        const uint4 *w4 = reinterpret_cast<const uint4 *>(a.norm_w);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const float rs = 1.0f / sqrtf(ss[r] / (float)a.IC + a.eps);
            for (int c = threadIdx.x; c < C8; c += blockDim.x) {
                float v[8], wv[8], o[8];
                unpack8f(xs[r * C8 + c], v);
                unpack8f(w4[c], wv);
#pragma unroll
                for (int k = 0; k < 8; k++) o[k] = wv[k] * (v[k] * rs);
                xs[r * C8 + c] = pack8f(o);
            }
        }
        __syncthreads();
    }
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, n_warps = (gridDim.x * blockDim.x) >> 5;
    const int n_out = SWIGLU || ROPE ? a.OC / 2 : a.OC;
    constexpr int M = SWIGLU || ROPE ? 2 : 1;   // weight rows per output: gate and up, or a RoPE pair
    const int half = ROPE ? a.D / 2 : 0;
    for (int o = warp; o < n_out; o += n_warps) {
        // Weight rows of this output: o; o and o + n_out (gate, up); t D + i and t D + i + D/2 (head t, pair i).
        const int t = ROPE ? o / half : 0, pi = ROPE ? o % half : 0;
        const int row0 = ROPE ? t * a.D + pi : o, row1 = ROPE ? row0 + half : o + n_out;
        const uint4 *wr[M];
        wr[0] = reinterpret_cast<const uint4 *>(a.w + (size_t)row0 * a.IC);
        if (M == 2) wr[M - 1] = reinterpret_cast<const uint4 *>(a.w + (size_t)row1 * a.IC);
        float acc[M][NR];
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int r = 0; r < NR; r++) acc[m][r] = 0.0f;
        for (int c0 = lane; c0 < C8; c0 += 32 * GEMV_UNROLL) {
            uint4 wv[M][GEMV_UNROLL];
#pragma unroll
            for (int m = 0; m < M; m++)
#pragma unroll
                for (int u = 0; u < GEMV_UNROLL; u++) {
                    const int c = c0 + 32 * u;
                    wv[m][u] = c < C8 ? load_stream(wr[m] + c) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                const int c = c0 + 32 * u;
                if (c < C8) {
#pragma unroll
                    for (int m = 0; m < M; m++)
#pragma unroll
                        for (int r = 0; r < NR; r++) acc[m][r] = dot8_acc(wv[m][u], xs[r * C8 + c], acc[m][r]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int r = 0; r < NR; r++) acc[m][r] = warp_sum(acc[m][r]);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (ROPE) {
                    const float y0 = bf2f(f2bf(acc[0][r] + (a.bias ? bf2f(a.bias[row0]) : 0.0f)));
                    const float y1 = bf2f(f2bf(acc[M - 1][r] + (a.bias ? bf2f(a.bias[row1]) : 0.0f)));
                    const int Hq = a.Hq, Hkv = a.Hkv, D = a.D;
                    bf16 o1 = f2bf(y0), o2 = f2bf(y1);
                    if (t < Hq + Hkv) {  // q and k heads turn; v heads are copied
                        float sn, cs;
                        sincosf(__fmul_rn((float)a.positions[r], a.inv_freq[pi]), &sn, &cs);
                        o1 = f2bf(rot1(y0, y1, cs, sn));
                        o2 = f2bf(rot2(y0, y1, cs, sn));
                    }
                    bf16 *dst = NULL;
                    if (t < Hq) {
                        dst = a.out + ((size_t)r * Hq + t) * D + pi;
                    } else if (a.slots[r] >= 0) {  // a negative slot stores nothing (padding)
                        const int kvh = t < Hq + Hkv ? t - Hq : t - Hq - Hkv;
                        dst = (t < Hq + Hkv ? a.k_cache : a.v_cache) + ((size_t)a.slots[r] * Hkv + kvh) * D + pi;
                    }
                    if (dst) {
                        dst[0] = o1;
                        dst[half] = o2;
                    }
                } else if (SWIGLU) {
                    const float g = bf2f(f2bf(acc[0][r] + (a.bias ? bf2f(a.bias[o]) : 0.0f)));
                    const float u = bf2f(f2bf(acc[M - 1][r] + (a.bias ? bf2f(a.bias[o + n_out]) : 0.0f)));
                    a.out[(size_t)r * n_out + o] = f2bf(silu_f(g) * u);
                } else {
                    const float y = acc[0][r] + (a.bias ? bf2f(a.bias[o]) : 0.0f);
                    const size_t e = (size_t)r * a.OC + o;
                    a.out[e] = a.residual ? f2bf(bf2f(a.residual[e]) + bf2f(f2bf(y))) : f2bf(y);
                }
            }
        }
    }
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

int cuda_gemv_applies(const CudaState *st, const void *out, const void *in, const void *w, const void *bias, int N,
                      int IC) {
    (void)st;
    const size_t smem = (size_t)N * IC * 2;   // the input rows, staged in shared memory
    return N >= 1 && N <= GEMV_MAX_ROWS && IC % 8 == 0 && aligned16(out) && aligned16(in) && aligned16(w) &&
           ((uintptr_t)bias & 1) == 0 && smem <= GEMV_MAX_SMEM;
}

template <int NR, int MODE>
static void gemv_launch(OpsCtx *ctx, CudaState *st, const GemvArgs &a) {
    const size_t smem = (size_t)NR * a.IC * 2;
    // Enough warps to keep every SM streaming (as many blocks per SM as the staged rows let fit, at most 64 warps
    // an SM); each warp then walks the outputs with a grid stride.
    const long max_per_sm = 64 / GEMV_WARPS;
    long per_sm = smem ? (long)((200 * 1024) / smem) : max_per_sm;
    per_sm = per_sm < 1 ? 1 : per_sm > max_per_sm ? max_per_sm : per_sm;
    const long n_out = MODE == GEMV_PLAIN ? a.OC : a.OC / 2;
    long blocks = (n_out + GEMV_WARPS - 1) / GEMV_WARPS;
    if (blocks > (long)st->sm_count * per_sm) blocks = (long)st->sm_count * per_sm;
    gemv_kernel<NR, MODE><<<(unsigned)blocks, GEMV_THREADS, smem, st->stream>>>(a);
    CUDA_CHECK_LAUNCH(ctx);
}

static void gemv_run(OpsCtx *ctx, CudaState *st, const GemvArgs &a, int N, int mode) {
    switch (mode) {
    case GEMV_SWIGLU: N == 1 ? gemv_launch<1, GEMV_SWIGLU>(ctx, st, a) : gemv_launch<2, GEMV_SWIGLU>(ctx, st, a); break;
    case GEMV_ROPE: N == 1 ? gemv_launch<1, GEMV_ROPE>(ctx, st, a) : gemv_launch<2, GEMV_ROPE>(ctx, st, a); break;
    default: N == 1 ? gemv_launch<1, GEMV_PLAIN>(ctx, st, a) : gemv_launch<2, GEMV_PLAIN>(ctx, st, a); break;
    }
}

void cuda_gemv_fwd(OpsCtx *ctx, CudaState *st, void *out, const void *in, const void *w, const void *bias, int N,
                   int IC, int OC) {
    GemvArgs a = {};
    a.out = (bf16 *)out;
    a.in = (const bf16 *)in;
    a.w = (const bf16 *)w;
    a.bias = (const bf16 *)bias;
    a.IC = IC;
    a.OC = OC;
    gemv_run(ctx, st, a, N, GEMV_PLAIN);
}

int cuda_matmul_fused_fwd(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N, int IC,
                          int OC, const OpsProjFusion *f) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return 1;   // the error is recorded
    if (!cuda_gemv_applies(st, out, in, w, bias, N, IC) || !aligned16(f->norm_w) ||
        ((uintptr_t)f->residual & 1) != 0 || (f->rope_store && f->D % 2 != 0))
        return 0;
    GemvArgs a = {};
    a.out = (bf16 *)out;
    a.in = (const bf16 *)in;
    a.w = (const bf16 *)w;
    a.bias = (const bf16 *)bias;
    a.norm_w = (const bf16 *)f->norm_w;
    a.eps = f->eps;
    a.residual = (const bf16 *)f->residual;
    a.IC = IC;
    a.OC = OC;
    if (f->rope_store) {
        a.positions = f->positions;
        a.slots = f->slot_mapping;
        a.inv_freq = f->inv_freq;
        a.k_cache = (bf16 *)f->k_cache;
        a.v_cache = (bf16 *)f->v_cache;
        a.Hq = f->Hq;
        a.Hkv = f->Hkv;
        a.D = f->D;
    }
    gemv_run(ctx, st, a, N, f->rope_store ? GEMV_ROPE : f->swiglu ? GEMV_SWIGLU : GEMV_PLAIN);
    return 1;
}
