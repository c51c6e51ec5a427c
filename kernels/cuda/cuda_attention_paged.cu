// kernels/cuda/cuda_attention_paged.cu — the rollout server's paged KV cache on the GPU: storing new tokens'
// k/v into their slots, and attention of query tokens (prefill chunks and decodes alike) through block tables.
//
// Cache layout: k_cache, v_cache (n_slots, Hkv, D) bf16; position pos of a sequence with block table T lives
// in slot T[pos / block_size] * block_size + pos % block_size.
//
// Attention: head dims up to 128 (every Qwen2.5 model) take the tensor-core kernel of cuda_attention_decode.cu,
// whose host side (its split rule) is here too. Larger head dims take the grouped kernel below, which the
// tensor-core one replaced where it can: the grouped kernel's fp32 dot products on CUDA cores, not memory, bound
// it well below the bandwidth that the tensor-core kernel reaches.
// The grouped kernel: one block of 4 warps per (query token, kv head[, split of the context]) handles every
// query head of the GQA group (up to GP = 8 at a time), so a K/V row is read from memory once
// per token and reused by the whole group. The context streams through shared memory in tiles of TP
// positions by a double-buffered 16-byte cp.async pipeline (block tables looked up per row). Per tile:
//   scores: a lane owns 8 dims of a row (LPR = 8/16/32 lanes per row for D <= 64/128/256) and holds the
//     group's q for those dims in registers; its GP partial dot products are summed over the row's lanes by
//     a reduce-scatter (GP - 1 + log2(LPR / GP) shuffles instead of GP log2(LPR)) that leaves the sum of head
//     (lane % GP) in each lane;
//   softmax: one warp per head takes the tile max, rescales its running (m, l) and turns the scores into
//     probabilities, in the log2 domain (q is pre-scaled by scale * log2(e));
//   P V: the lane layout of the scores again, each lane accumulating GP x 8 outputs over its rows.
// At the end the lanes and warps that share dims are summed. fp32 math throughout.
//
// Flash decoding: when tokens x kv heads cannot fill the GPU (batch 1, a few long sequences), the context
// of each token is also split over gridDim.z blocks. The number of splits depends only on the op's
// arguments (N, Hkv, the group size, max_blocks * block_size) and the device, never on the sequence lengths
// that live in device memory, so a launch can be captured into a CUDA graph and replayed as contexts grow:
// each block divides its token's actual tiles among the splits at run time, and a split left without tiles
// contributes nothing. Splits write unnormalised (acc, m, l) per query head to the context's scratch and a
// merge kernel combines them.
//
// A token whose sequence or positions have no cache behind them (negative ids, a position past the block
// table, an unassigned block inside its context) gets NaN outputs, as on the CPU: no error channel at this
// level, and NaN makes the mistake visible in the logits instead of reading memory outside the cache.
//
// The first kernel (one block per query token and query head, scalar loads) remains for what the other two
// do not take (D not a multiple of 8, caches not 16-byte aligned).
#include <math.h>

#include "kernels/cuda/cuda_attention.cuh"

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

// ---- the per-head kernel (the fallback) ----------------------------------------------------------------

static const int PA_WARPS = 4;
static const int PA_MAX_D = 256;  // a lane holds up to PA_MAX_D / 32 accumulator dims

// out, q (N, Hq, D); block_tables (n_seqs, max_blocks); token_seq, token_pos (N).
// One block per (query token, query head); its warps take the context positions round-robin, each warp keeps
// an online softmax (lane owns dims lane, lane + 32, ...), and the warps' partial states are merged at the end.
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
        for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = f2bf(PG_NAN);
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
        for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = f2bf(PG_NAN);
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

// ---- the grouped kernel ------------------------------------------------------------------------------

static const int PG_THREADS = 128;       // 4 warps
static const int PG_WARPS = PG_THREADS / 32;
static const int PG_MAX_SPLITS = 256;    // bounds the merge's weights in shared memory
static const int PG_MERGE_THREADS = 128;

// Positions per tile: 64 rows of up to 128 dims, 32 rows of up to 256 (16 or 32 KiB of K and V per stage).
template <int LPR> struct PgShape {
    static constexpr int DP = 8 * LPR;                 // padded row length in shared memory (elements)
    static constexpr int R = 32 / LPR;                 // rows a warp covers at once
    static constexpr int RB = PG_WARPS * R;            // rows the block covers at once
    static constexpr int TP = LPR == 32 ? 32 : 64;     // positions per tile
    static constexpr int STAGE = 2 * TP * DP;          // K then V of one tile (elements)
};
template <int LPR, int GP> static constexpr int pg_smem_bytes() {
    return 2 * PgShape<LPR>::STAGE * (int)sizeof(bf16) + PgShape<LPR>::TP * GP * (int)sizeof(float);
}

// 8 bf16 (one 16-byte chunk) -> fp32; element 2k is the low half of word k.
__device__ __forceinline__ void pg_unpack8(const uint4 u, float f[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}

// v[0..GP) are a lane's partial sums for GP heads; the LPR lanes of a row (lane bits below log2(LPR)) hold
// partials of the same GP sums. Returns, in every lane, the full sum for head (lane % GP): each round on lane
// bit w keeps the half of the heads selected by that bit and adds the partner's copy of the same half.
template <int GP, int LPR> __device__ __forceinline__ float pg_reduce_scatter(float (&v)[GP], int lane) {
#pragma unroll
    for (int w = GP / 2; w >= 1; w /= 2) {
        const bool up = lane & w;
#pragma unroll
        for (int k = 0; k < w; k++) {
            const float send = up ? v[k] : v[k + w];
            const float keep = up ? v[k + w] : v[k];
            v[k] = keep + __shfl_xor_sync(0xffffffffu, send, w);
        }
    }
    float r = v[0];
#pragma unroll
    for (int w = GP; w < LPR; w *= 2) r += __shfl_xor_sync(0xffffffffu, r, w);
    return r;
}

// GP consecutive floats of shared memory (16-byte aligned for GP >= 4).
template <int GP> __device__ __forceinline__ void pg_load_probs(float (&p)[GP], const float *src) {
    if constexpr (GP % 4 == 0) {
#pragma unroll
        for (int k = 0; k < GP / 4; k++) {
            const float4 x = reinterpret_cast<const float4 *>(src)[k];
            p[4 * k] = x.x, p[4 * k + 1] = x.y, p[4 * k + 2] = x.z, p[4 * k + 3] = x.w;
        }
    } else if constexpr (GP == 2) {
        const float2 x = *reinterpret_cast<const float2 *>(src);
        p[0] = x.x, p[1] = x.y;
    } else {
        p[0] = src[0];
    }
}

// Issues the cp.async copies of positions p0 .. p0 + TP - 1 (K rows to Ks, V rows to Vs, row r at r * DP);
// positions at or past n_ctx are zero-filled. Returns 1 when this thread met an unassigned block.
// bs_shift: log2(block_size) when it is a power of two (shifts instead of divisions), else -1.
template <int LPR>
__device__ __forceinline__ int pg_load_tile(bf16 *Ks, bf16 *Vs, const bf16 *k_cache, const bf16 *v_cache,
                                            const int32_t *table, int p0, int n_ctx, int block_size, int bs_shift,
                                            size_t row, size_t head_off, int nc) {
    using S = PgShape<LPR>;
    static_assert(S::TP * LPR % PG_THREADS == 0, "a tile's chunks are a whole number per thread");
    int bad = 0;
#pragma unroll
    for (int it = 0; it < S::TP * LPR / PG_THREADS; it++) {
        const int idx = it * PG_THREADS + threadIdx.x, r = idx / LPR, cc = idx % LPR;
        if (cc >= nc) continue;
        const int p = p0 + r;
        bool ok = p < n_ctx;
        size_t off = 0;
        if (ok) {
            const long long o = pg_cache_offset(table, p, block_size, bs_shift, row, head_off, cc);
            if (o < 0) {
                bad = 1;
                ok = false;
            } else {
                off = (size_t)o;
            }
        }
        attn_cp_async16(Ks + r * S::DP + cc * 8, k_cache + off, ok);
        attn_cp_async16(Vs + r * S::DP + cc * 8, v_cache + off, ok);
    }
    return bad;
}

// out, q (N, Hq, D); block_tables (n_seqs, max_blocks); token_seq, token_pos (N).
// grid (N, Hkv * n_hsub, n_splits): block (i, g * n_hsub + hs, s) takes query heads g * G + hs * GP + [0, gh)
// of token i over its share s of the context. D % 8 == 0, D <= 8 * LPR; caches 16-byte aligned; q_vec: q too.
// n_splits == 1: out written directly. Otherwise, per query head hq and split s (index (i * Hq + hq) * n_splits
// + s): part_acc (.., D) the unnormalised output, part_ml (.., 2) the max m (log2 domain) and sum l; an empty
// split writes (m, l) = (-inf, 0), a token without cache (NaN, NaN).
template <int LPR, int GP>
__global__ void __launch_bounds__(PG_THREADS)
paged_grouped_kernel(bf16 *out, float *part_acc, float *part_ml, const bf16 *q, const bf16 *k_cache,
                     const bf16 *v_cache, const int32_t *block_tables, const int32_t *token_seq,
                     const int32_t *token_pos, int Hq, int Hkv, int D, int block_size, int bs_shift,
                     int max_blocks, float scale_log2, int G, int n_hsub, int n_splits, int q_vec) {
    using S = PgShape<LPR>;
    constexpr int TP = S::TP, DP = S::DP, R = S::R, RB = S::RB;
    extern __shared__ __align__(16) unsigned char pg_smem[];
    bf16 *kv_s = reinterpret_cast<bf16 *>(pg_smem);                  // 2 stages of [K tile | V tile]
    float *p_s = reinterpret_cast<float *>(kv_s + 2 * S::STAGE);     // (TP, GP) scores, then probabilities
    __shared__ float m_s[GP], l_s[GP], alpha_s[GP];

    const int i = blockIdx.x, g = blockIdx.y / n_hsub, h0 = (blockIdx.y % n_hsub) * GP, split = blockIdx.z;
    const int gh = min(GP, G - h0);  // query heads this block serves
    const int hq0 = g * G + h0;      // the first of them
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = lane % LPR, rw = lane / LPR;  // this lane's 8-dim chunk and row within the warp
    const int nc = D / 8;
    const int seq = token_seq[i], pos = token_pos[i];
    const bool token_bad = seq < 0 || pos < 0 || pos / block_size >= max_blocks;

    // This split's tiles [t_begin, t_end) of the token's ceil((pos + 1) / TP).
    int n_ctx = 0, t_begin = 0, t_end = 0;
    if (!token_bad) {
        n_ctx = pos + 1;
        const int n_tiles = pos / TP + 1;  // ceil(n_ctx / TP) without overflow
        const int per = (n_tiles + n_splits - 1) / n_splits;
        t_begin = split * per;
        t_end = min(n_tiles, t_begin + per);
    }
    const size_t ml_base = ((size_t)i * Hq + hq0) * n_splits + split;  // + h * n_splits for head h0 + h
    if (token_bad || t_begin >= t_end) {
        if (n_splits == 1) {  // only a bad token gets here: every token has at least one tile
            for (int idx = tid; idx < gh * D; idx += PG_THREADS)
                out[((size_t)i * Hq + hq0) * D + idx] = f2bf(PG_NAN);
        } else if (tid < gh) {
            part_ml[(ml_base + (size_t)tid * n_splits) * 2] = token_bad ? PG_NAN : -INFINITY;
            part_ml[(ml_base + (size_t)tid * n_splits) * 2 + 1] = token_bad ? PG_NAN : 0.0f;
        }
        return;
    }

    const int32_t *table = block_tables + (size_t)seq * max_blocks;
    const size_t row = (size_t)Hkv * D, head_off = (size_t)g * D;
    int my_bad = pg_load_tile<LPR>(kv_s, kv_s + TP * DP, k_cache, v_cache, table, t_begin * TP, n_ctx, block_size,
                                   bs_shift, row, head_off, nc);
    attn_cp_async_commit();

    // The group's q for this lane's dims, scaled into the log2 domain; zero for absent heads and dims.
    float qr[GP][8], acc[GP][8];
#pragma unroll
    for (int h = 0; h < GP; h++) {
#pragma unroll
        for (int k = 0; k < 8; k++) qr[h][k] = acc[h][k] = 0.0f;
        if (h < gh && c < nc) {
            const bf16 *qh = q + ((size_t)i * Hq + hq0 + h) * D + c * 8;
            if (q_vec) {
                pg_unpack8(*reinterpret_cast<const uint4 *>(qh), qr[h]);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) qr[h][k] = bf2f(qh[k]);
            }
#pragma unroll
            for (int k = 0; k < 8; k++) qr[h][k] *= scale_log2;
        }
    }
    if (tid < GP) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }

    bool bad = false;
    for (int t = t_begin, b = 0; t < t_end; t++, b ^= 1) {
        attn_cp_async_wait<0>();
        // Tile t is in place for every thread; the previous tile's P V is done with the other buffer and p_s.
        if (__syncthreads_or(my_bad)) {
            bad = true;
            break;
        }
        if (t + 1 < t_end) {
            bf16 *nxt = kv_s + (b ^ 1) * S::STAGE;
            my_bad |= pg_load_tile<LPR>(nxt, nxt + TP * DP, k_cache, v_cache, table, (t + 1) * TP, n_ctx, block_size,
                                        bs_shift, row, head_off, nc);
        }
        attn_cp_async_commit();
        const bf16 *Kt = kv_s + b * S::STAGE, *Vt = Kt + TP * DP;
        const int p0 = t * TP;

        // Scores: row r = j * RB + warp * R + rw; the lane with c = h < gh stores head h's.
#pragma unroll
        for (int j = 0; j < TP / RB; j++) {
            const int r = j * RB + warp * R + rw;
            float part[GP];
#pragma unroll
            for (int h = 0; h < GP; h++) part[h] = 0.0f;
            if (c < nc) {
                float kf[8];
                pg_unpack8(*reinterpret_cast<const uint4 *>(Kt + r * DP + c * 8), kf);
#pragma unroll
                for (int h = 0; h < GP; h++) {
                    if (h < gh) {
                        float a = 0.0f;
#pragma unroll
                        for (int k = 0; k < 8; k++) a = fmaf(qr[h][k], kf[k], a);
                        part[h] = a;
                    }
                }
            }
            const float sc = pg_reduce_scatter<GP, LPR>(part, lane);
            if (c < gh) p_s[r * GP + c] = p0 + r < n_ctx ? sc : -INFINITY;
        }
        __syncthreads();

        // Softmax, one warp per head: running max, rescale factor, probabilities in place.
        for (int h = warp; h < gh; h += PG_WARPS) {
            float mx = -INFINITY;
#pragma unroll
            for (int r = lane; r < TP; r += 32) mx = fmaxf(mx, p_s[r * GP + h]);
            mx = warp_max(mx);
            const float m_old = m_s[h], m_new = fmaxf(m_old, mx);  // finite: the tile has a position in range
            float sum = 0.0f;
#pragma unroll
            for (int r = lane; r < TP; r += 32) {
                const float e = exp2f(p_s[r * GP + h] - m_new);  // 0 for masked positions
                p_s[r * GP + h] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float alpha = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
                alpha_s[h] = alpha;
                l_s[h] = l_s[h] * alpha + sum;
                m_s[h] = m_new;
            }
        }
        __syncthreads();

        // P V over the same rows.
#pragma unroll
        for (int h = 0; h < GP; h++) {
            if (h < gh) {
                const float al = alpha_s[h];
                if (al != 1.0f) {
#pragma unroll
                    for (int k = 0; k < 8; k++) acc[h][k] *= al;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < TP / RB; j++) {
            const int r = j * RB + warp * R + rw;
            if (c < nc) {
                float vf[8], pr[GP];
                pg_unpack8(*reinterpret_cast<const uint4 *>(Vt + r * DP + c * 8), vf);
                pg_load_probs<GP>(pr, p_s + r * GP);
#pragma unroll
                for (int h = 0; h < GP; h++) {
                    if (h < gh) {
#pragma unroll
                        for (int k = 0; k < 8; k++) acc[h][k] = fmaf(pr[h], vf[k], acc[h][k]);
                    }
                }
            }
        }
    }
    attn_cp_async_wait<0>();
    __syncthreads();  // copies landed and every read of kv_s is done: it becomes the reduction buffer

    if (bad) {
        if (n_splits == 1) {
            for (int idx = tid; idx < gh * D; idx += PG_THREADS)
                out[((size_t)i * Hq + hq0) * D + idx] = f2bf(PG_NAN);
        } else if (tid < gh) {
            part_ml[(ml_base + (size_t)tid * n_splits) * 2] = PG_NAN;
            part_ml[(ml_base + (size_t)tid * n_splits) * 2 + 1] = PG_NAN;
        }
        return;
    }

    // Sum the rows' partial outputs: over the lanes of a warp that share c, then over warps via shared memory.
#pragma unroll
    for (int w = LPR; w < 32; w *= 2) {
#pragma unroll
        for (int h = 0; h < GP; h++) {
            if (h < gh) {
#pragma unroll
                for (int k = 0; k < 8; k++) acc[h][k] += __shfl_xor_sync(0xffffffffu, acc[h][k], w);
            }
        }
    }
    float *red = reinterpret_cast<float *>(pg_smem);  // (PG_WARPS, GP, DP)
    if (rw == 0 && c < nc) {
#pragma unroll
        for (int h = 0; h < GP; h++) {
            if (h < gh) {
                float4 *dst = reinterpret_cast<float4 *>(red + (warp * GP + h) * DP + c * 8);
                dst[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
                dst[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
            }
        }
    }
    __syncthreads();
    for (int idx = tid; idx < gh * D; idx += PG_THREADS) {
        const int h = idx / D, d = idx % D;
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < PG_WARPS; w++) a += red[(w * GP + h) * DP + d];
        if (n_splits == 1) out[((size_t)i * Hq + hq0) * D + idx] = f2bf(a / l_s[h]);
        else part_acc[(ml_base + (size_t)h * n_splits) * D + d] = a;
    }
    if (n_splits > 1 && tid < gh) {
        part_ml[(ml_base + (size_t)tid * n_splits) * 2] = m_s[tid];
        part_ml[(ml_base + (size_t)tid * n_splits) * 2 + 1] = l_s[tid];
    }
}

// Max over the block (blockDim.x a multiple of 32); every thread gets it. Syncs before reusing `red`.
__device__ __forceinline__ float pg_block_max(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_max(lane < nwarps ? red[lane] : -INFINITY);
}

// out (N, Hq, D) from the splits' partials (layout above); grid (N, Hq), dynamic shared memory n_splits floats.
// out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits that saw positions (l_s > 0); NaN when
// any split found the token without cache.
__global__ void __launch_bounds__(PG_MERGE_THREADS)
paged_merge_kernel(bf16 *out, const float *part_acc, const float *part_ml, int Hq, int D, int n_splits) {
    extern __shared__ float w_s[];
    __shared__ float red[32];
    const size_t base = (size_t)blockIdx.x * Hq + blockIdx.y;
    const float *ml = part_ml + base * n_splits * 2;
    const float *acc = part_acc + base * n_splits * D;
    bf16 *o = out + base * D;
    float mx = -INFINITY;
    int bad = 0;
    for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
        const float l = ml[2 * s + 1];
        if (isnan(l)) bad = 1;
        else if (l > 0.0f) mx = fmaxf(mx, ml[2 * s]);
    }
    if (__syncthreads_or(bad)) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = f2bf(PG_NAN);
        return;
    }
    const float M = pg_block_max(mx, red);
    float lsum = 0.0f;
    for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
        const float l = ml[2 * s + 1];
        const float w = l > 0.0f ? exp2f(ml[2 * s] - M) : 0.0f;  // empty splits never wrote their acc
        w_s[s] = w;
        lsum += w * l;
    }
    const float inv = 1.0f / block_sum(lsum, red);  // its barriers also publish w_s
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            const float w = w_s[s];
            if (w != 0.0f) a += w * acc[(size_t)s * D + d];
        }
        o[d] = f2bf(a * inv);
    }
}

// ---- host side ---------------------------------------------------------------------------------------

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

template <int LPR, int GP> static void pg_launch(OpsCtx *ctx, CudaState *st, const PgArgs *a, dim3 grid) {
    const int smem = pg_smem_bytes<LPR, GP>();
    // The shared-memory opt-in is made once per device (bit d of opted_in), so that the launches a decode step
    // replays from a CUDA graph make no attribute call while being captured.
    static unsigned long long opted_in;
    const unsigned long long bit = st->device < 64 ? 1ull << st->device : 0;
    if (smem > 48 * 1024 && !(__atomic_load_n(&opted_in, __ATOMIC_ACQUIRE) & bit)) {
        if (attn_set_smem(ctx, st, paged_grouped_kernel<LPR, GP>, smem, "attention_paged_fwd")) return;
        __atomic_fetch_or(&opted_in, bit, __ATOMIC_RELEASE);
    }
    paged_grouped_kernel<LPR, GP><<<grid, PG_THREADS, smem, st->stream>>>(
        a->out, a->part_acc, a->part_ml, a->q, a->k_cache, a->v_cache, a->block_tables, a->token_seq, a->token_pos,
        a->Hq, a->Hkv, a->D, a->block_size, a->bs_shift, a->max_blocks, a->scale_log2, a->G, a->n_hsub, a->n_splits,
        a->q_vec);
    CUDA_CHECK_LAUNCH(ctx);
}

template <int LPR> static void pg_launch_gp(OpsCtx *ctx, CudaState *st, const PgArgs *a, dim3 grid, int GP) {
    switch (GP) {
    case 1: pg_launch<LPR, 1>(ctx, st, a, grid); break;
    case 2: pg_launch<LPR, 2>(ctx, st, a, grid); break;
    case 4: pg_launch<LPR, 4>(ctx, st, a, grid); break;
    default: pg_launch<LPR, 8>(ctx, st, a, grid); break;
    }
}

// The grouped kernel's launch: its own split rule and scratch.
static void pg_launch_grouped(OpsCtx *ctx, CudaState *st, PgArgs *ap, int N) {
    PgArgs a = *ap;
    const int G = a.G, Hkv = a.Hkv, D = a.D, max_blocks = a.max_blocks, block_size = a.block_size;
    const int GP = G > 4 ? 8 : G > 2 ? 4 : G;  // heads per block (at most 8), padded to a power of two
    const int n_hsub = (G + GP - 1) / GP;
    const int LPR = D <= 64 ? 8 : D <= 128 ? 16 : 32;
    const int TP = LPR == 32 ? PgShape<32>::TP : PgShape<8>::TP;
    // Split the context when the (token, kv head, head group) blocks would not reach 4 per SM (about the
    // resident count); never more splits than the longest possible context has tiles.
    const long long work = (long long)N * Hkv * n_hsub, target = 4LL * st->sm_count;
    const long long max_tiles = ((long long)max_blocks * block_size + TP - 1) / TP;
    long long n_splits = 1;
    if (work < target) {
        n_splits = (target + work - 1) / work;
        if (n_splits > max_tiles) n_splits = max_tiles;
        if (n_splits > PG_MAX_SPLITS) n_splits = PG_MAX_SPLITS;
    }
    a.n_hsub = n_hsub;
    a.n_splits = (int)n_splits;
    if (n_splits > 1) {
        // Sized by the arguments alone: after one call with them, a replay or a capture allocates nothing.
        const size_t parts = (size_t)N * a.Hq * n_splits;
        float *scratch = (float *)cuda_scratch(ctx, st, parts * (D + 2) * sizeof(float));
        if (!scratch) return;
        a.part_acc = scratch;
        a.part_ml = scratch + parts * D;
    }
    const dim3 grid(N, Hkv * n_hsub, (unsigned)n_splits);
    switch (LPR) {
    case 8: pg_launch_gp<8>(ctx, st, &a, grid, GP); break;
    case 16: pg_launch_gp<16>(ctx, st, &a, grid, GP); break;
    default: pg_launch_gp<32>(ctx, st, &a, grid, GP); break;
    }
    *ap = a;
}

// Context splits for the tensor-core kernel: `work` (token, kv head, head group) blocks, `slots` of them
// resident at once. A batch that leaves resident places empty is split as far as one wave of blocks allows
// (batch 1: one tile per split), never into more splits than the longest possible context has tiles; a batch
// that fills the GPU is not split (the block scheduler balances sequences of different lengths, and every
// split costs a partial write, a merge and a pipeline start). Depends on the arguments and the device alone,
// never on the lengths in device memory (graph capture).
static int pm_choose_splits(long long work, long long slots, long long max_tiles) {
    long long n = slots / work;
    if (n > max_tiles) n = max_tiles;
    if (n > PG_MAX_SPLITS) n = PG_MAX_SPLITS;
    return n < 1 ? 1 : (int)n;
}

// The paged attention launch; inv_freq / slots non-NULL: the tensor-core kernel's decode variant reading q from the
// fused projection qkv (q is then that, q_pitch its row), which the caller has checked it can take.
static void paged_fwd(OpsCtx *ctx, void *out, const void *q, size_t q_pitch, const void *k_cache, const void *v_cache,
                      const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos,
                      const float *inv_freq, const int32_t *slots, int N, int Hq, int Hkv, int D, int block_size,
                      int max_blocks, float scale) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && Hq > 0 && Hkv > 0 && Hq % Hkv == 0 && D > 0 && block_size > 0 && max_blocks > 0,
                   "attention_paged_fwd: bad shape N=%d Hq=%d Hkv=%d D=%d block_size=%d max_blocks=%d", N, Hq, Hkv, D,
                   block_size, max_blocks);
    CUDA_ARG_CHECK(ctx, D <= PA_MAX_D, "attention_paged_fwd: head_dim %d is larger than the CUDA kernel supports (%d)",
                   D, PA_MAX_D);
    CUDA_ARG_CHECK(ctx, Hq <= 65535, "attention_paged_fwd: %d query heads exceed the grid limit", Hq);
    if (N == 0) return;
    const int rope = inv_freq != NULL;
    if (!rope && !attn_vec_ok(D, k_cache, v_cache, k_cache, v_cache)) {
        dim3 grid(N, Hq);
        attention_paged_kernel<<<grid, PA_WARPS * 32, 0, st->stream>>>(
            (bf16 *)out, (const bf16 *)q, (const bf16 *)k_cache, (const bf16 *)v_cache, block_tables, token_seq,
            token_pos, Hq, Hkv, D, block_size, max_blocks, scale);
        CUDA_CHECK_LAUNCH(ctx);
        return;
    }
    const int G = Hq / Hkv;
    int bs_shift = -1;
    if ((block_size & (block_size - 1)) == 0) {
        bs_shift = 0;
        while ((1 << bs_shift) < block_size) bs_shift++;
    }
    PgArgs a = {(bf16 *)out, NULL, NULL, (const bf16 *)q, (const bf16 *)k_cache, (const bf16 *)v_cache, block_tables,
                token_seq, token_pos, Hq, Hkv, D, block_size, bs_shift, max_blocks, scale * ATTN_LOG2E, G, 0, 1,
                ((uintptr_t)q & 15) == 0 && q_pitch % 8 == 0, q_pitch, inv_freq, slots};
    if (rope || D <= PM_MAX_D) {
        a.n_hsub = (G + PM_HEADS - 1) / PM_HEADS;
        CUDA_ARG_CHECK(ctx, (long long)N * Hkv * a.n_hsub <= 0x7fffffffLL,
                       "attention_paged_fwd: %d tokens x %d kv heads exceed the grid limit", N, Hkv);
        // The plain kernel's residency decides the splits of both variants, so that they give the same bits.
        const long long slots_resident = cuda_paged_mma_slots(ctx, st, D);
        if (!slots_resident) return;
        const long long max_tiles = ((long long)max_blocks * block_size + PM_TP - 1) / PM_TP;
        a.n_splits = pm_choose_splits((long long)N * Hkv * a.n_hsub, slots_resident, max_tiles);
        if (a.n_splits > 1) {
            const size_t parts = (size_t)N * Hq * a.n_splits;
            float *scratch = (float *)cuda_scratch(ctx, st, parts * (D + 2) * sizeof(float));
            if (!scratch) return;
            a.part_acc = scratch;
            a.part_ml = scratch + parts * D;
        }
        cuda_paged_mma_launch(ctx, st, &a, N, rope);
    } else {
        pg_launch_grouped(ctx, st, &a, N);
    }
    if (a.n_splits == 1 || ops_status(ctx)) return;
    paged_merge_kernel<<<dim3(N, Hq), PG_MERGE_THREADS, a.n_splits * sizeof(float), st->stream>>>(
        (bf16 *)out, a.part_acc, a.part_ml, Hq, D, a.n_splits);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_attention_paged_fwd(OpsCtx *ctx, void *out, const void *q, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos,
                              int N, int Hq, int Hkv, int D, int block_size, int max_blocks, float scale) {
    paged_fwd(ctx, out, q, (size_t)(Hq > 0 ? Hq : 0) * (D > 0 ? D : 0), k_cache, v_cache, block_tables, token_seq,
              token_pos, NULL, NULL, N, Hq, Hkv, D, block_size, max_blocks, scale);
}

// A decode step's split + RoPE + cache store + attention in one launch where the tensor-core kernel takes the
// shape (head dim a multiple of 16 up to 128, 16-byte aligned rows); otherwise the two ops it stands for.
void cuda_attention_paged_decode_fwd(OpsCtx *ctx, void *out, void *q, void *k_cache, void *v_cache,
                                     const int32_t *slot_mapping, const void *qkv, const int32_t *block_tables,
                                     const int32_t *token_seq, const int32_t *token_pos, const float *inv_freq, int N,
                                     int Hq, int Hkv, int D, int block_size, int max_blocks, float scale) {
    const size_t QKV = (size_t)(Hq + 2 * Hkv) * (size_t)(D > 0 ? D : 0);
    const int fused = D > 0 && D <= PM_MAX_D && D % 16 == 0 && attn_vec_ok(D, k_cache, v_cache, k_cache, v_cache) &&
                      ((uintptr_t)qkv & 15) == 0;
    if (fused) {
        paged_fwd(ctx, out, qkv, QKV, k_cache, v_cache, block_tables, token_seq, token_pos, inv_freq, slot_mapping, N,
                  Hq, Hkv, D, block_size, max_blocks, scale);
        return;
    }
    cuda_qkv_rope_store_fwd(ctx, q, k_cache, v_cache, slot_mapping, qkv, token_pos, inv_freq, N, Hq, Hkv, D);
    if (ops_status(ctx)) return;
    cuda_attention_paged_fwd(ctx, out, q, k_cache, v_cache, block_tables, token_seq, token_pos, N, Hq, Hkv, D,
                             block_size, max_blocks, scale);
}
