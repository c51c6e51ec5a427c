// kernels/cuda/cuda_rope.cu — rotary embedding, Hugging Face "rotate_half" layout, on bf16: in place
// (ops_rope_fwd/bwd), and fused with the split of the q/k/v projection's output and the pack of its gradients
// (ops_qkv_rope_fwd/bwd), or with the split and the KV cache store (ops_qkv_rope_store_fwd). Within each head of D values element i pairs with i + D/2 (i < D/2) and the pair turns by
// angle = pos * inv_freq[i], the fp32 product as transformers computes it; cos/sin in fp32 (full-range sincosf:
// angles reach tens of thousands of radians). An odd D leaves the last element as is (CPU twin).
//
// One thread takes one token and VEC consecutive pairs and sweeps a run of that token's heads: the angles are the
// same for every head, so their sincosf (the costly part) runs once per run instead of once per head. With D a
// multiple of 16 and 16-byte aligned rows a thread moves its 8 pairs of a head as two 16-byte vectors.
#include "kernels/cuda/cuda_common.cuh"

// rot1 / rot2 (cuda_common.cuh) spell out the rotation's roundings.

// Where the heads of a token live: q's Hq heads are turned; k's Hkv heads are turned and v's beside them copied.
// Head h of a part for token n starts at base + n * pitch + h * D (pitches in elements). In place: src == dst and
// no k, v (Hkv = 0).
// kv_slots (N) or NULL: k and v of token n go to row kv_slots[n] of dst_k / dst_v (a paged KV cache; rows of
// dst_pitch_kv) instead of row n, and nowhere when it is negative (padding).
typedef struct {
    const bf16 *src_q, *src_k, *src_v;
    bf16 *dst_q, *dst_k, *dst_v;
    size_t src_pitch_q, src_pitch_kv, dst_pitch_q, dst_pitch_kv;
    const int32_t *kv_slots;
} RopeParts;

// Turns VEC pairs of one head: x1 at src[0, VEC), x2 at src[half, half + VEC), written to the same places of dst.
template <int VEC>
__device__ __forceinline__ void turn(bf16 *dst, const bf16 *src, int half, const float *c, const float *s) {
    if (VEC == 8) {
        float a[8], b[8], o1[8], o2[8];
        unpack8f(*reinterpret_cast<const uint4 *>(src), a);
        unpack8f(*reinterpret_cast<const uint4 *>(src + half), b);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            o1[j] = rot1(a[j], b[j], c[j], s[j]);
            o2[j] = rot2(a[j], b[j], c[j], s[j]);
        }
        *reinterpret_cast<uint4 *>(dst) = pack8f(o1);
        *reinterpret_cast<uint4 *>(dst + half) = pack8f(o2);
    } else {
        const float a = bf2f(src[0]), b = bf2f(src[half]);
        dst[0] = f2bf(rot1(a, b, c[0], s[0]));
        dst[half] = f2bf(rot2(a, b, c[0], s[0]));
    }
}

template <int VEC>
__device__ __forceinline__ void copy_pairs(bf16 *dst, const bf16 *src, int half) {
    if (VEC == 8) {
        *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
        *reinterpret_cast<uint4 *>(dst + half) = *reinterpret_cast<const uint4 *>(src + half);
    } else {
        dst[0] = src[0];
        dst[half] = src[half];
    }
}

// Work items (token n, run of heads, group of VEC pairs), the group fastest so that neighbouring threads touch
// neighbouring 16-byte pieces of a head. Runs split the Hq + Hkv heads of a token when there are too few tokens to
// fill the GPU (decode). VEC 1 has one extra group per head when D is odd: the last element, copied.
// sign = +1 forward, -1 the transpose (backward).
template <int VEC>
__global__ void rope_heads_kernel(RopeParts p, const int32_t *positions, const float *inv_freq, int N, int Hq,
                                  int Hkv, int D, int n_runs, int run_len, float sign) {
    const int half = D / 2;
    const int groups = VEC == 1 ? (D + 1) / 2 : half / VEC;
    const int T = Hq + Hkv;
    const size_t total = (size_t)N * n_runs * groups;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const int i0 = (int)(idx % groups) * VEC;
        const size_t rest = idx / groups;
        const int t0 = (int)(rest % n_runs) * run_len, t1 = min(t0 + run_len, T);
        const size_t n = rest / n_runs;
        const bf16 *sq = p.src_q + n * p.src_pitch_q + i0;
        bf16 *dq = p.dst_q + n * p.dst_pitch_q + i0;
        const size_t skv = n * p.src_pitch_kv + i0;
        const int slot = p.kv_slots ? p.kv_slots[n] : (int)n;
        const size_t dkv = (size_t)(slot < 0 ? 0 : slot) * p.dst_pitch_kv + i0;
        const int t_end = slot < 0 ? min(t1, Hq) : t1;   // no cache row: q's heads only
        if (VEC == 1 && i0 == half) {  // odd D: the last element of each head (i0 + half = D - 1) stays as it is
            for (int t = t0; t < t_end; t++) {
                if (t < Hq) {
                    dq[(size_t)t * D + half] = sq[(size_t)t * D + half];
                } else {
                    const size_t o = (size_t)(t - Hq) * D + half;
                    p.dst_k[dkv + o] = p.src_k[skv + o];
                    p.dst_v[dkv + o] = p.src_v[skv + o];
                }
            }
            continue;
        }
        float c[VEC], s[VEC];
        const float pos = (float)positions[n];
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            sincosf(__fmul_rn(pos, inv_freq[i0 + j]), &s[j], &c[j]);
            s[j] *= sign;
        }
        for (int t = t0; t < t_end; t++) {
            if (t < Hq) {
                turn<VEC>(dq + (size_t)t * D, sq + (size_t)t * D, half, c, s);
            } else {
                const size_t o = (size_t)(t - Hq) * D;
                turn<VEC>(p.dst_k + dkv + o, p.src_k + skv + o, half, c, s);
                copy_pairs<VEC>(p.dst_v + dkv + o, p.src_v + skv + o, half);
            }
        }
    }
}

static int aligned16(const void *ptr) { return ptr == NULL || ((uintptr_t)ptr & 15u) == 0; }

static void rope_heads_launch(OpsCtx *ctx, const RopeParts *p, const int32_t *positions, const float *inv_freq,
                              int N, int Hq, int Hkv, int D, float sign, const char *name) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && Hq >= 0 && Hkv >= 0 && D >= 0, "%s: bad shape N=%d Hq=%d Hkv=%d D=%d", name, N, Hq,
                   Hkv, D);
    const int T = Hq + Hkv;
    if (N == 0 || T == 0 || D == 0) return;
    const int vec8 = D % 16 == 0 && p->src_pitch_q % 8 == 0 && p->src_pitch_kv % 8 == 0 && p->dst_pitch_q % 8 == 0 &&
                     p->dst_pitch_kv % 8 == 0 && aligned16(p->src_q) && aligned16(p->src_k) && aligned16(p->src_v) &&
                     aligned16(p->dst_q) && aligned16(p->dst_k) && aligned16(p->dst_v);
    const size_t groups = vec8 ? (size_t)D / 16 : (size_t)(D + 1) / 2;
    // Whole tokens per thread while the tokens alone give about a full GPU of threads; fewer heads per thread
    // (more sincosf) only when they do not.
    const size_t want = (size_t)st->sm_count * 1024, have = (size_t)N * groups;
    size_t n_runs = (want + have - 1) / have;
    if (n_runs > (size_t)T) n_runs = T;
    const int run_len = (int)((T + n_runs - 1) / n_runs);
    n_runs = (T + run_len - 1) / run_len;
    const size_t total = have * n_runs;
    const unsigned blocks = cuda_grid_1d(total, 256, st);
    if (vec8)
        rope_heads_kernel<8><<<blocks, 256, 0, st->stream>>>(*p, positions, inv_freq, N, Hq, Hkv, D, (int)n_runs,
                                                             run_len, sign);
    else
        rope_heads_kernel<1><<<blocks, 256, 0, st->stream>>>(*p, positions, inv_freq, N, Hq, Hkv, D, (int)n_runs,
                                                             run_len, sign);
    CUDA_CHECK_LAUNCH(ctx);
}

static void rope_inplace(OpsCtx *ctx, void *x, const int32_t *positions, const float *inv_freq, int N, int H, int D,
                         float sign, const char *name) {
    const size_t pitch = (size_t)(H > 0 ? H : 0) * (D > 0 ? D : 0);
    RopeParts p = {(const bf16 *)x, NULL, NULL, (bf16 *)x, NULL, NULL, pitch, 0, pitch, 0, NULL};
    rope_heads_launch(ctx, &p, positions, inv_freq, N, H, 0, D, sign, name);
}

void cuda_rope_fwd(OpsCtx *ctx, void *x, const int32_t *positions, const float *inv_freq, int N, int H, int D) {
    rope_inplace(ctx, x, positions, inv_freq, N, H, D, 1.0f, "rope_fwd");
}
void cuda_rope_bwd(OpsCtx *ctx, void *dx, const int32_t *positions, const float *inv_freq, int N, int H, int D) {
    rope_inplace(ctx, dx, positions, inv_freq, N, H, D, -1.0f, "rope_bwd");
}

void cuda_qkv_rope_fwd(OpsCtx *ctx, void *q, void *k, void *v, const void *qkv, const int32_t *positions,
                       const float *inv_freq, int N, int Hq, int Hkv, int D) {
    const size_t QD = (size_t)Hq * D, KVD = (size_t)Hkv * D, QKV = QD + 2 * KVD;
    const bf16 *src = (const bf16 *)qkv;
    RopeParts p = {src, src + QD, src + QD + KVD, (bf16 *)q, (bf16 *)k, (bf16 *)v, QKV, QKV, QD, KVD, NULL};
    rope_heads_launch(ctx, &p, positions, inv_freq, N, Hq, Hkv, D, 1.0f, "qkv_rope_fwd");
}
void cuda_qkv_rope_store_fwd(OpsCtx *ctx, void *q, void *k_cache, void *v_cache, const int32_t *slot_mapping,
                             const void *qkv, const int32_t *positions, const float *inv_freq, int N, int Hq, int Hkv,
                             int D) {
    const size_t QD = (size_t)Hq * D, KVD = (size_t)Hkv * D, QKV = QD + 2 * KVD;
    const bf16 *src = (const bf16 *)qkv;
    RopeParts p = {src, src + QD, src + QD + KVD, (bf16 *)q, (bf16 *)k_cache, (bf16 *)v_cache, QKV, QKV, QD, KVD,
                   slot_mapping};
    rope_heads_launch(ctx, &p, positions, inv_freq, N, Hq, Hkv, D, 1.0f, "qkv_rope_store_fwd");
}
void cuda_qkv_rope_bwd(OpsCtx *ctx, void *dqkv, const void *dq, const void *dk, const void *dv,
                       const int32_t *positions, const float *inv_freq, int N, int Hq, int Hkv, int D) {
    const size_t QD = (size_t)Hq * D, KVD = (size_t)Hkv * D, QKV = QD + 2 * KVD;
    bf16 *dst = (bf16 *)dqkv;
    RopeParts p = {(const bf16 *)dq, (const bf16 *)dk, (const bf16 *)dv, dst, dst + QD, dst + QD + KVD, QD, KVD, QKV,
                   QKV, NULL};
    rope_heads_launch(ctx, &p, positions, inv_freq, N, Hq, Hkv, D, -1.0f, "qkv_rope_bwd");
}
