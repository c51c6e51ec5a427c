// kernels/cuda/cuda_attention_paged.cu — the rollout server's paged KV cache on the GPU: storing new tokens'
// k/v into their slots, and attention of query tokens (prefill chunks and decodes alike) through block tables.
//
// Cache layout: k_cache, v_cache (n_slots, Hkv, D) bf16; position pos of a sequence with block table T lives
// in slot T[pos / block_size] * block_size + pos % block_size.
//
// Attention: one block per (query token, query head); its warps take the context positions round-robin,
// each warp keeps an online softmax (running max m, sum l, output accumulator spread over its lanes: lane
// owns dims lane, lane + 32, ...), and the warps' partial states are merged at the end. fp32 throughout.
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

static const int PA_WARPS = 4;
static const int PA_MAX_D = 256;  // a lane holds up to PA_MAX_D / 32 accumulator dims

// k, v (N, Hkv, D) -> slots slot_mapping (N); a negative slot (padding) is skipped.
__global__ void kv_cache_store_kernel(bf16 *k_cache, bf16 *v_cache, const bf16 *k, const bf16 *v,
                                      const int32_t *slot_mapping, int N, int row) {
    const size_t total = (size_t)N * row;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t i = idx / row, e = idx % row;
        const int slot = slot_mapping[i];
        if (slot < 0) continue;
        k_cache[(size_t)slot * row + e] = k[idx];
        v_cache[(size_t)slot * row + e] = v[idx];
    }
}

// out, q (N, Hq, D); block_tables (n_seqs, max_blocks); token_seq, token_pos (N).
// A token whose sequence or positions have no cache behind them (negative ids, a position past the block
// table, an unassigned block) gets NaN outputs, as on the CPU: no error channel at this level, and NaN
// makes the mistake visible in the logits instead of reading memory outside the cache.
__global__ void __launch_bounds__(PA_WARPS * 32)
attention_paged_kernel(bf16 *out, const bf16 *q, const bf16 *k_cache, const bf16 *v_cache,
                       const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos, int Hq,
                       int Hkv, int D, int block_size, int max_blocks, float scale) {
    constexpr int PER_LANE = PA_MAX_D / 32;
    __shared__ float q_s[PA_MAX_D];
    __shared__ float m_w[PA_WARPS], l_w[PA_WARPS];
    __shared__ float acc_w[PA_WARPS][PA_MAX_D];
    __shared__ int bad;
    const int i = blockIdx.x, h = blockIdx.y, g = h / (Hq / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int seq = token_seq[i], pos = token_pos[i];
    const bf16 *qh = q + ((size_t)i * Hq + h) * D;
    bf16 *o = out + ((size_t)i * Hq + h) * D;
    if (threadIdx.x == 0) bad = seq < 0 || pos < 0 || pos / block_size >= max_blocks;
    for (int d = threadIdx.x; d < D; d += blockDim.x) q_s[d] = bf2f(qh[d]) * scale;
    __syncthreads();
    if (bad) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = f2bf(__int_as_float(0x7fc00000));
        return;
    }
    const int32_t *table = block_tables + (size_t)seq * max_blocks;
    const size_t row = (size_t)Hkv * D;
    float m = -INFINITY, l = 0.0f, acc[PER_LANE];
#pragma unroll
    for (int t = 0; t < PER_LANE; t++) acc[t] = 0.0f;
    for (int p = warp; p <= pos; p += PA_WARPS) {
        const int blk = table[p / block_size];
        if (blk < 0) {  // unassigned block inside the context
            bad = 1;    // benign race: every writer stores 1
            break;
        }
        const size_t base = ((size_t)blk * block_size + p % block_size) * row + (size_t)g * D;
        const bf16 *kr = k_cache + base, *vr = v_cache + base;
        float part = 0.0f;
#pragma unroll
        for (int t = 0; t < PER_LANE; t++) {
            const int d = lane + 32 * t;
            if (d < D) part += q_s[d] * bf2f(kr[d]);
        }
        const float s = warp_sum(part);
        const float m_new = fmaxf(m, s);
        const float alpha = expf(m - m_new);  // 0 at the first position (m = -inf)
        const float e = expf(s - m_new);
        l = l * alpha + e;
#pragma unroll
        for (int t = 0; t < PER_LANE; t++) {
            const int d = lane + 32 * t;
            if (d < D) acc[t] = acc[t] * alpha + e * bf2f(vr[d]);
        }
        m = m_new;
    }
    if (lane == 0) {
        m_w[warp] = m;
        l_w[warp] = l;
    }
#pragma unroll
    for (int t = 0; t < PER_LANE; t++) {
        const int d = lane + 32 * t;
        if (d < D) acc_w[warp][d] = acc[t];
    }
    __syncthreads();
    if (bad) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = f2bf(__int_as_float(0x7fc00000));
        return;
    }
    // Merge: M = max m_w, L = sum l_w e^(m_w - M), out = sum acc_w e^(m_w - M) / L. A warp that saw no
    // position has m_w = -inf and weighs 0; warp 0 always sees position 0.
    float M = -INFINITY;
    for (int w = 0; w < PA_WARPS; w++) M = fmaxf(M, m_w[w]);
    float L = 0.0f, wt[PA_WARPS];
    for (int w = 0; w < PA_WARPS; w++) {
        wt[w] = expf(m_w[w] - M);
        L += l_w[w] * wt[w];
    }
    const float inv = 1.0f / L;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < PA_WARPS; w++) s += acc_w[w][d] * wt[w];
        o[d] = f2bf(s * inv);
    }
}

void cuda_kv_cache_store(OpsCtx *ctx, void *k_cache, void *v_cache, const void *k, const void *v,
                         const int32_t *slot_mapping, int N, int Hkv, int D) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && Hkv > 0 && D > 0, "kv_cache_store: bad shape N=%d Hkv=%d D=%d", N, Hkv, D);
    if (N == 0) return;
    const size_t total = (size_t)N * Hkv * D;
    kv_cache_store_kernel<<<cuda_grid_1d(total, 256, st), 256, 0, st->stream>>>(
        (bf16 *)k_cache, (bf16 *)v_cache, (const bf16 *)k, (const bf16 *)v, slot_mapping, N, Hkv * D);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_attention_paged_fwd(OpsCtx *ctx, void *out, const void *q, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos,
                              int N, int Hq, int Hkv, int D, int block_size, int max_blocks, float scale) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && Hq > 0 && Hkv > 0 && Hq % Hkv == 0 && D > 0 && block_size > 0 && max_blocks > 0,
                   "attention_paged_fwd: bad shape N=%d Hq=%d Hkv=%d D=%d block_size=%d max_blocks=%d", N, Hq, Hkv, D,
                   block_size, max_blocks);
    CUDA_ARG_CHECK(ctx, D <= PA_MAX_D, "attention_paged_fwd: head_dim %d is larger than the CUDA kernel supports (%d)",
                   D, PA_MAX_D);
    CUDA_ARG_CHECK(ctx, Hq <= 65535, "attention_paged_fwd: %d query heads exceed the grid limit", Hq);
    if (N == 0) return;
    dim3 grid(N, Hq);
    attention_paged_kernel<<<grid, PA_WARPS * 32, 0, st->stream>>>(
        (bf16 *)out, (const bf16 *)q, (const bf16 *)k_cache, (const bf16 *)v_cache, block_tables, token_seq, token_pos,
        Hq, Hkv, D, block_size, max_blocks, scale);
    CUDA_CHECK_LAUNCH(ctx);
}
