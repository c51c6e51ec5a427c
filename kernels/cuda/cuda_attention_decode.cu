// kernels/cuda/cuda_attention_decode.cu — paged attention on bf16 tensor cores: the kernel that
// ops_attention_paged_fwd takes for head dims up to 128 (decodes and prefill chunks alike; the host side,
// the split choice and the merge of splits are in cuda_attention_paged.cu).
//
// Why: a decode step reads every cached K/V row once per (token, kv head), so the op's roofline is memory
// bandwidth. The grouped kernel computed its dot products in fp32 on CUDA cores (a lane per 8 dims, shuffle
// reductions) and that arithmetic, not memory, bound it, well below the bandwidth. Here the query heads of
// one GQA group (up to 16) are the M rows of mma.sync m16n8k16 (rows past the group are zero), context
// positions the N dimension, so one K/V row costs a few tensor-core instructions shared by the whole group.
//
// One block of 4 warps per (query token, kv head[, group of 16 query heads], split of the context). The
// context streams through shared memory in tiles of PM_TP = 64 positions by an NS-stage 16-byte cp.async
// pipeline (block tables looked up per row; rows padded to DP + 8 elements so that ldmatrix rows fall in
// different banks). Warp w owns positions 16w .. 16w + 15 of every tile and keeps its own online softmax:
//   S (16 heads x 16 positions) = Q K^T, fp32 accumulators, scaled into the log2 domain, masked past the
//     token's position;
//   running max m and sum l per row (fp32), p = 2^(s - m), the output rescaled by 2^(m_old - m_new);
//   O (16 x DP) += P V with P packed straight from the S accumulators (the training forward's trick: two
//     C tiles side by side are the A fragment of the next product), as a hi + lo pair of bf16 fragments
//     like the training backward's (16 significant bits instead of 8, so that the output is as accurate as
//     its final bf16 rounding; the training forward's single bf16 P costs it up to ~1.2e-2 relative).
// At the end the four warps' (m, l, O) are merged through shared memory. The only per-tile barrier is the
// pipeline's.
//
// Splits, empty splits, tokens without cache (NaN), and the partial layout are exactly the grouped kernel's
// (see cuda_attention_paged.cu and PgArgs in cuda_attention.cuh), so the same merge kernel combines them.
#include "kernels/cuda/cuda_attention.cuh"

static const int PM_THREADS = 128;
static const int PM_WARPS = PM_THREADS / 32;

// DP: head dim padded to 32, 64 or 128; NS: pipeline stages.
template <int DP, int NS> struct PmCfg {
    static constexpr int LD = DP + 8;               // shared-memory row pitch (elements)
    static constexpr int CPR = DP / 8;              // 16-byte chunks per row
    static constexpr int STAGE = 2 * PM_TP * LD;    // K then V of one tile (elements)
    static constexpr int SMEM = NS * STAGE * (int)sizeof(bf16);
    // Resident blocks the register budget must allow (the shared memory allows about as many on an H100/H200:
    // a cp.async stage in flight per block is what keeps memory busy).
    static constexpr int MIN_BLOCKS = DP == 128 ? (NS == 2 ? 3 : 2) : (NS == 2 ? 4 : 3);
    static_assert(PM_TP == PM_WARPS * 16, "a warp owns 16 positions of a tile");
    static_assert(PM_TP * CPR % PM_THREADS == 0, "a tile's chunks are a whole number per thread");
    static_assert(PM_WARPS * PM_HEADS * DP * (int)sizeof(float) <= SMEM, "the final sum fits in the stages");
};

// Issues the cp.async copies of positions p0 .. p0 + PM_TP - 1 (K rows to Ks, V rows to Vs, row r at r * LD);
// positions at or past n_ctx and dims at or past D are zero-filled. Returns 1 when this thread met an
// unassigned block.
template <int DP>
__device__ __forceinline__ int pm_load_tile(bf16 *Ks, bf16 *Vs, const bf16 *k_cache, const bf16 *v_cache,
                                            const int32_t *table, int p0, int n_ctx, int block_size, int bs_shift,
                                            size_t row, size_t head_off, int nc) {
    constexpr int CPR = DP / 8, LD = DP + 8;
    int bad = 0;
#pragma unroll
    for (int it = 0; it < PM_TP * CPR / PM_THREADS; it++) {
        const int idx = it * PM_THREADS + threadIdx.x, r = idx / CPR, cc = idx % CPR;
        const int p = p0 + r;
        bool ok = p < n_ctx && cc < nc;
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
        attn_cp_async16(Ks + r * LD + cc * 8, k_cache + off, ok);
        attn_cp_async16(Vs + r * LD + cc * 8, v_cache + off, ok);
    }
    return bad;
}

// The token's RoPE angles as rope_heads_kernel computes them (cuda_rope.cu: the fp32 product, sincosf), one
// per pair index j < D/2, into shared memory; the caller synchronises before use.
__device__ __forceinline__ void pm_angles(float *cs, float *sn, int pos, const float *inv_freq, int D) {
    for (int j = threadIdx.x; j < D / 2; j += PM_THREADS) sincosf(__fmul_rn((float)pos, inv_freq[j]), &sn[j], &cs[j]);
}

// RoPE of the 8 pairs (dims d0 + j, d0 + j + D/2) of one head with those angles, rounded as rope_heads_kernel
// rounds them: x1 / x2 hold the two halves in, and the turned values out.
__device__ __forceinline__ void pm_turn8(uint4 &x1, uint4 &x2, const float *cs, const float *sn, int d0) {
    float a[8], b[8], o1[8], o2[8];
    unpack8f(x1, a);
    unpack8f(x2, b);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        o1[j] = rot1(a[j], b[j], cs[d0 + j], sn[d0 + j]);
        o2[j] = rot2(a[j], b[j], cs[d0 + j], sn[d0 + j]);
    }
    x1 = pack8f(o1);
    x2 = pack8f(o2);
}

// The decode variant's rotation work for token i, as items (nc = D / 8): item w < n_q (= gh * nc / 2) turns the
// pair of chunks (cc, cc + nc / 2) of q row r (query head hq0 + r) into q_s; then, when the block stores,
// PM_KV_ITEMS(nc) items write the token's k (kv head g, 8 pairs turned per item) and v (a chunk per item) to cache
// row `slot`, as ops_qkv_rope_store_fwd writes them. An item's loads (pm_item_load) are issued before the angles
// are ready; pm_item_finish turns and stores.
#define PM_KV_ITEMS(nc) ((nc) / 2 + (nc))
struct PmItem {
    const PgArgs &a;
    const bf16 *row;  // token i's q|k|v row
    int D, nc, n_q, hq0, g;
};

__device__ __forceinline__ void pm_item_load(const PmItem &it, int w, uint4 &x1, uint4 &x2) {
    const int half = it.D / 2;
    const bf16 *src;
    if (w < it.n_q) {
        src = it.row + (size_t)(it.hq0 + w / (it.nc / 2)) * it.D + (w % (it.nc / 2)) * 8;
    } else if (w - it.n_q < it.nc / 2) {
        src = it.row + (size_t)(it.a.Hq + it.g) * it.D + (w - it.n_q) * 8;
    } else {
        x1 = *reinterpret_cast<const uint4 *>(it.row + (size_t)(it.a.Hq + it.a.Hkv + it.g) * it.D +
                                              (w - it.n_q - it.nc / 2) * 8);
        return;
    }
    x1 = *reinterpret_cast<const uint4 *>(src);
    x2 = *reinterpret_cast<const uint4 *>(src + half);
}

template <int LD>
__device__ __forceinline__ void pm_item_finish(const PmItem &it, int w, uint4 x1, uint4 x2, bf16 *q_s, int slot,
                                               const float *cs, const float *sn) {
    const int half = it.D / 2;
    const size_t kv_off = (size_t)slot * it.a.Hkv * it.D + (size_t)it.g * it.D;
    if (w < it.n_q) {
        const int r = w / (it.nc / 2), cc = w % (it.nc / 2);
        pm_turn8(x1, x2, cs, sn, cc * 8);
        *reinterpret_cast<uint4 *>(q_s + r * LD + cc * 8) = x1;
        *reinterpret_cast<uint4 *>(q_s + r * LD + half + cc * 8) = x2;
    } else if (w - it.n_q < it.nc / 2) {
        const int t = w - it.n_q;
        pm_turn8(x1, x2, cs, sn, t * 8);
        bf16 *dk = const_cast<bf16 *>(it.a.k_cache) + kv_off;
        *reinterpret_cast<uint4 *>(dk + t * 8) = x1;
        *reinterpret_cast<uint4 *>(dk + half + t * 8) = x2;
    } else {
        *reinterpret_cast<uint4 *>(const_cast<bf16 *>(it.a.v_cache) + kv_off + (w - it.n_q - it.nc / 2) * 8) = x1;
    }
}

// Runs the block's items [0, n_items) (it.n_q = 0: the store alone), each thread's first one loaded before the
// angles are computed (a barrier makes those visible; none follows the items).
template <int LD>
__device__ __forceinline__ void pm_rope_items(const PmItem &it, int n_items, bf16 *q_s, int slot, int pos, float *cs,
                                              float *sn) {
    const int tid = threadIdx.x;
    uint4 x1 = make_uint4(0, 0, 0, 0), x2 = x1;
    if (tid < n_items) pm_item_load(it, tid, x1, x2);
    pm_angles(cs, sn, pos, it.a.inv_freq, it.D);
    __syncthreads();
    for (int w = tid; w < n_items; w += PM_THREADS) {
        if (w != tid) pm_item_load(it, w, x1, x2);
        pm_item_finish<LD>(it, w, x1, x2, q_s, slot, cs, sn);
    }
}

// grid (N * Hkv * n_hsub, n_splits): block (i * Hkv * n_hsub + g * n_hsub + hs, s) takes query heads
// g * G + 16 hs + [0, gh) of token i over its share s of the context (PgArgs describes the outputs).
// ROPE (a decode step, cuda_attention_paged_decode_fwd): every block of the split that holds the token's own
// position (split 0 for a token without cache) stores the token's k and v to its slot — the same bits from each
// such block — while its first tiles load, and loads the tile holding that row only after a barrier has made the
// store visible; no other block reads the row (each token is its sequence's only one in the call), so no
// grid-wide order is needed. q is turned on its way into shared memory.
template <int DP, int NS, bool ROPE>
__global__ void __launch_bounds__(PM_THREADS, PmCfg<DP, NS>::MIN_BLOCKS) paged_mma_kernel(const PgArgs a) {
    using C = PmCfg<DP, NS>;
    constexpr int LD = C::LD, TP = PM_TP, KC = DP / 16;
    extern __shared__ __align__(16) unsigned char pm_smem[];
    bf16 *kv_s = reinterpret_cast<bf16 *>(pm_smem);  // NS stages of [K tile | V tile]
    __shared__ __align__(16) bf16 q_s[PM_HEADS * LD];
    __shared__ float m_s[PM_WARPS][PM_HEADS], l_s[PM_WARPS][PM_HEADS], M_s[PM_HEADS], L_s[PM_HEADS];
    __shared__ float cs_s[ROPE ? DP / 2 : 1], sn_s[ROPE ? DP / 2 : 1];  // ROPE: the token's angles

    const int HB = a.Hkv * a.n_hsub;
    const int i = blockIdx.x / HB, hb = blockIdx.x % HB, split = blockIdx.y, n_splits = a.n_splits;
    const int g = hb / a.n_hsub, h0 = (hb % a.n_hsub) * PM_HEADS;
    const int gh = min(PM_HEADS, a.G - h0);  // query heads this block serves
    const int hq0 = g * a.G + h0;            // the first of them
    const int D = a.D, Hq = a.Hq, nc = D / 8;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tq = lane & 3;
    const int seq = a.token_seq[i], pos = a.token_pos[i];
    const bool token_bad = seq < 0 || pos < 0 || pos / a.block_size >= a.max_blocks;

    // This split's tiles [t_begin, t_end) of the token's ceil((pos + 1) / TP).
    int n_ctx = 0, t_begin = 0, t_end = 0;
    if (!token_bad) {
        n_ctx = pos + 1;
        const int n_tiles = pos / TP + 1;
        const int per = (n_tiles + n_splits - 1) / n_splits;
        t_begin = split * per;
        t_end = min(n_tiles, t_begin + per);
    }
    const int own_tile = token_bad ? -1 : pos / TP;  // the tile holding the token's own position
    bool store = false;
    int slot = -1;
    if (ROPE) {
        slot = a.slots[i];
        store = slot >= 0 && (token_bad ? split == 0 : t_begin <= own_tile && own_tile < t_end);
    }
    const size_t ml_base = ((size_t)i * Hq + hq0) * n_splits + split;  // + h * n_splits for head hq0 + h
    bf16 *out = a.out + ((size_t)i * Hq + hq0) * D;
    if (token_bad || t_begin >= t_end) {
        if (ROPE && store) {  // block-uniform
            const PmItem it = {a, a.q + (size_t)i * a.q_pitch, D, nc, 0, hq0, g};
            pm_rope_items<LD>(it, PM_KV_ITEMS(nc), q_s, slot, pos, cs_s, sn_s);
        }
        if (n_splits == 1) {  // only a bad token gets here: every token has at least one tile
            for (int idx = tid; idx < gh * D; idx += PM_THREADS) out[idx] = f2bf(PG_NAN);
        } else if (tid < gh) {
            a.part_ml[(ml_base + (size_t)tid * n_splits) * 2] = token_bad ? PG_NAN : -INFINITY;
            a.part_ml[(ml_base + (size_t)tid * n_splits) * 2 + 1] = token_bad ? PG_NAN : 0.0f;
        }
        return;
    }

    const int32_t *table = a.block_tables + (size_t)seq * a.max_blocks;
    const size_t row = (size_t)a.Hkv * D, head_off = (size_t)g * D;
    int my_bad = 0;
    int deferred = -1;  // ROPE: the prologue stage whose tile holds the row this block stores (loaded once visible)
#pragma unroll
    for (int s = 0; s < NS - 1; s++) {
        if (ROPE && store && t_begin + s == own_tile) {
            deferred = s;
        } else if (t_begin + s < t_end) {
            bf16 *dst = kv_s + s * C::STAGE;
            my_bad |= pm_load_tile<DP>(dst, dst + TP * LD, a.k_cache, a.v_cache, table, (t_begin + s) * TP, n_ctx,
                                       a.block_size, a.bs_shift, row, head_off, nc);
        }
        attn_cp_async_commit();  // empty groups too: the wait below counts groups
    }

    // The group's q rows (zero past gh and past D) into shared memory, then as A fragments into registers.
    // ROPE: an item turns the pair of chunks (cc, cc + nc / 2) of a row and writes both; the items after the q
    // rows' store this token's k and v (the loads of every item in flight together, after the tiles').
    if (ROPE) {
        const int n_q = gh * (nc / 2);
        const PmItem it = {a, a.q + (size_t)i * a.q_pitch, D, nc, n_q, hq0, g};
        pm_rope_items<LD>(it, n_q + (store ? PM_KV_ITEMS(nc) : 0), q_s, slot, pos, cs_s, sn_s);
    }
    for (int idx = tid; idx < PM_HEADS * C::CPR; idx += PM_THREADS) {
        const int r = idx / C::CPR, cc = idx % C::CPR;
        if (ROPE) {  // the rows and dims the items left: zero
            if (r >= gh || cc >= nc) *reinterpret_cast<uint4 *>(q_s + r * LD + cc * 8) = make_uint4(0, 0, 0, 0);
            continue;
        }
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < gh && cc < nc) {
            const bf16 *src = a.q + (size_t)i * a.q_pitch + (size_t)(hq0 + r) * D + cc * 8;
            if (a.q_vec) {
                v = *reinterpret_cast<const uint4 *>(src);
            } else {
                __align__(16) bf16 t[8];
#pragma unroll
                for (int k = 0; k < 8; k++) t[k] = src[k];
                v = *reinterpret_cast<const uint4 *>(t);
            }
        }
        *reinterpret_cast<uint4 *>(q_s + r * LD + cc * 8) = v;
    }
    __syncthreads();  // q_s complete; ROPE: this block's k / v store is visible to all its threads
    if (ROPE && deferred >= 0) {
        bf16 *dst = kv_s + deferred * C::STAGE;
        my_bad |= pm_load_tile<DP>(dst, dst + TP * LD, a.k_cache, a.v_cache, table, own_tile * TP, n_ctx,
                                   a.block_size, a.bs_shift, row, head_off, nc);
        attn_cp_async_commit();
        attn_cp_async_wait<0>();  // a later group than the loop's first wait expects: wait for it here
    }
    // ldmatrix row / column of this lane inside a 16 x 16 block: A operand, B with n as the stored row (K),
    // B with k as the stored row (V) — the training forward's addressing.
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
    const int bn_row = (lane & 7) + (lane >> 4) * 8, bn_col = ((lane >> 3) & 1) * 8;
    const int bt_row = (lane & 7) + ((lane >> 3) & 1) * 8, bt_col = (lane >> 4) * 8;
    uint32_t qf[KC][4];
#pragma unroll
    for (int kc = 0; kc < KC; kc++) attn_ldsm4(qf[kc], q_s + a_row * LD + kc * 16 + a_col);

    // Rows gr and gr + 8 (query heads hq0 + gr, + 8): running max (log2 domain), this thread's partial sum,
    // and output columns 8 j + 2 tq, + 1.
    float o[DP / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < DP / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    const float sl2 = a.scale_log2;

    bool bad = false;
    for (int t = t_begin; t < t_end; t++) {
        const int it = t - t_begin;
        attn_cp_async_wait<NS - 2>();
        // Tile t is in place for every thread, and every warp is done with tile t - 1, whose buffer is refilled.
        if (__syncthreads_or(my_bad)) {
            bad = true;
            break;
        }
        if (t + NS - 1 < t_end) {
            bf16 *dst = kv_s + ((it + NS - 1) % NS) * C::STAGE;
            my_bad |= pm_load_tile<DP>(dst, dst + TP * LD, a.k_cache, a.v_cache, table, (t + NS - 1) * TP, n_ctx,
                                       a.block_size, a.bs_shift, row, head_off, nc);
        }
        attn_cp_async_commit();
        const int key0 = t * TP + warp * 16;  // this warp's first position
        if (key0 >= n_ctx) continue;          // all of them past the token
        const bf16 *Kb = kv_s + (it % NS) * C::STAGE + warp * 16 * LD, *Vb = Kb + TP * LD;

        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int kc = 0; kc < KC; kc++) {
            uint32_t b[4];
            attn_ldsm4(b, Kb + bn_row * LD + kc * 16 + bn_col);
            attn_mma(s[0], qf[kc], b[0], b[1]);
            attn_mma(s[1], qf[kc], b[2], b[3]);
        }
        // s[nt][e]: row gr + 8 (e >> 1), position key0 + 8 nt + 2 tq + (e & 1).
        const bool need_mask = key0 + 15 >= n_ctx;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = s[nt][e] * sl2;
                if (need_mask && key0 + nt * 8 + 2 * tq + (e & 1) >= n_ctx) x = -INFINITY;
                s[nt][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        float alpha[2], mu[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m[r], mx[r]);  // finite: position key0 is in range
            mu[r] = m_new == -INFINITY ? 0.0f : m_new;
            alpha[r] = attn_exp2(m[r] - mu[r]);  // 0 on this warp's first tile (m = -inf)
            m[r] = m_new;
        }
        float rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float p = attn_exp2(s[nt][e] - mu[e >> 1]);  // 0 for masked positions
                s[nt][e] = p;
                rs[e >> 1] += p;
            }
        l[0] = l[0] * alpha[0] + rs[0];
        l[1] = l[1] * alpha[1] + rs[1];
#pragma unroll
        for (int j = 0; j < DP / 8; j++) {
            o[j][0] *= alpha[0], o[j][1] *= alpha[0];
            o[j][2] *= alpha[1], o[j][3] *= alpha[1];
        }
        // P as a pair of bf16 fragments (hi + lo, 16 significant bits): the extra products are free in a
        // kernel that waits on memory, and the output error is then the final bf16 rounding alone.
        uint32_t ph[4], pl[4];
        attn_pack_split(s[0][0], s[0][1], ph[0], pl[0]);
        attn_pack_split(s[0][2], s[0][3], ph[1], pl[1]);
        attn_pack_split(s[1][0], s[1][1], ph[2], pl[2]);
        attn_pack_split(s[1][2], s[1][3], ph[3], pl[3]);
#pragma unroll
        for (int dp = 0; dp < DP / 16; dp++) {
            uint32_t b[4];
            attn_ldsm4_t(b, Vb + bt_row * LD + dp * 16 + bt_col);
            attn_mma(o[2 * dp], ph, b[0], b[1]);
            attn_mma(o[2 * dp + 1], ph, b[2], b[3]);
            attn_mma(o[2 * dp], pl, b[0], b[1]);
            attn_mma(o[2 * dp + 1], pl, b[2], b[3]);
        }
    }
    attn_cp_async_wait<0>();
    __syncthreads();  // copies landed and every read of kv_s is done: it becomes the reduction buffer

    if (bad) {
        if (n_splits == 1) {
            for (int idx = tid; idx < gh * D; idx += PM_THREADS) out[idx] = f2bf(PG_NAN);
        } else if (tid < gh) {
            a.part_ml[(ml_base + (size_t)tid * n_splits) * 2] = PG_NAN;
            a.part_ml[(ml_base + (size_t)tid * n_splits) * 2 + 1] = PG_NAN;
        }
        return;
    }

    // Merge the warps: per row M = max m_w, L = sum l_w 2^(m_w - M); a warp that saw no position (m_w = -inf,
    // l_w = 0) weighs 0, and warp 0 saw the split's first position, so M is finite.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    if (tq == 0) {
        m_s[warp][gr] = m[0], m_s[warp][gr + 8] = m[1];
        l_s[warp][gr] = l[0], l_s[warp][gr + 8] = l[1];
    }
    __syncthreads();
    if (tid < PM_HEADS) {
        float M = -INFINITY, L = 0.0f;
#pragma unroll
        for (int w = 0; w < PM_WARPS; w++) M = fmaxf(M, m_s[w][tid]);
#pragma unroll
        for (int w = 0; w < PM_WARPS; w++) L += l_s[w][tid] * attn_exp2(m_s[w][tid] - M);
        M_s[tid] = M;
        L_s[tid] = L;
    }
    __syncthreads();
    float *red = reinterpret_cast<float *>(pm_smem);  // (PM_WARPS, PM_HEADS, DP)
    {
        const float w0 = attn_exp2(m[0] - M_s[gr]), w1 = attn_exp2(m[1] - M_s[gr + 8]);
        float *r0 = red + (warp * PM_HEADS + gr) * DP + 2 * tq, *r1 = r0 + 8 * DP;
#pragma unroll
        for (int j = 0; j < DP / 8; j++) {
            *reinterpret_cast<float2 *>(r0 + 8 * j) = make_float2(o[j][0] * w0, o[j][1] * w0);
            *reinterpret_cast<float2 *>(r1 + 8 * j) = make_float2(o[j][2] * w1, o[j][3] * w1);
        }
    }
    __syncthreads();
    for (int idx = tid; idx < gh * D; idx += PM_THREADS) {
        const int h = idx / D, d = idx % D;
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < PM_WARPS; w++) acc += red[(w * PM_HEADS + h) * DP + d];
        if (n_splits == 1) out[idx] = f2bf(acc / L_s[h]);
        else a.part_acc[(ml_base + (size_t)h * n_splits) * D + d] = acc;
    }
    if (n_splits > 1 && tid < gh) {
        a.part_ml[(ml_base + (size_t)tid * n_splits) * 2] = M_s[tid];
        a.part_ml[(ml_base + (size_t)tid * n_splits) * 2 + 1] = L_s[tid];
    }
}

// ---- host side ---------------------------------------------------------------------------------------

// Pipeline stages per padded head dim: more stages per block means fewer blocks resident per SM, and which keeps
// more of the cache in flight was measured, not derived (bench_attention_paged, Qwen2.5 heads, batch 64-512;
// bench/notes/gpu-passes-h100.md): up to head dim 64 two stages (four blocks an SM) beat three (three blocks); at
// head dim 128 three stages (two blocks) beat two (three blocks), most clearly at batch 256.
template <int DP> struct PmStages {
    static constexpr int NS = DP <= 64 ? 2 : 3;
};

// Shared-memory opt-in and residency, once per device and variant (per[d] = blocks per SM + 1, 0 while unknown),
// so that the launches a decode step replays from a CUDA graph make no attribute or occupancy call while captured.
template <int DP, int NS, bool ROPE> static long long pm_slots(OpsCtx *ctx, CudaState *st) {
    static int per[64];
    const int dev = st->device;
    int known = dev < 64 ? __atomic_load_n(&per[dev], __ATOMIC_ACQUIRE) : 0;
    if (!known) {
        const int smem = PmCfg<DP, NS>::SMEM;
        if (smem > 48 * 1024 &&
            attn_set_smem(ctx, st, paged_mma_kernel<DP, NS, ROPE>, smem, "attention_paged_fwd"))
            return 0;
        int n = 0;
        CUDA_CHECK_RET(
            ctx, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, paged_mma_kernel<DP, NS, ROPE>, PM_THREADS, smem),
            0);
        if (n < 1) n = 1;
        known = n + 1;
        if (dev < 64) __atomic_store_n(&per[dev], known, __ATOMIC_RELEASE);
    }
    return (long long)(known - 1) * st->sm_count;
}

template <int DP, int NS, bool ROPE> static void pm_launch(OpsCtx *ctx, CudaState *st, const PgArgs *a, int N) {
    if (!pm_slots<DP, NS, ROPE>(ctx, st)) return;  // makes the opt-in when the caller did not ask for the slots
    const dim3 grid((unsigned)((long long)N * a->Hkv * a->n_hsub), (unsigned)a->n_splits);
    paged_mma_kernel<DP, NS, ROPE><<<grid, PM_THREADS, PmCfg<DP, NS>::SMEM, st->stream>>>(*a);
    CUDA_CHECK_LAUNCH(ctx);
}

static int pm_dp(int D) { return D <= 32 ? 32 : D <= 64 ? 64 : 128; }

template <bool ROPE> static long long pm_slots_for(OpsCtx *ctx, CudaState *st, int DP) {
    if (DP == 32) return pm_slots<32, PmStages<32>::NS, ROPE>(ctx, st);
    if (DP == 64) return pm_slots<64, PmStages<64>::NS, ROPE>(ctx, st);
    return pm_slots<128, PmStages<128>::NS, ROPE>(ctx, st);
}

template <bool ROPE> static void pm_launch_for(OpsCtx *ctx, CudaState *st, const PgArgs *a, int N, int DP) {
    if (DP == 32) pm_launch<32, PmStages<32>::NS, ROPE>(ctx, st, a, N);
    else if (DP == 64) pm_launch<64, PmStages<64>::NS, ROPE>(ctx, st, a, N);
    else pm_launch<128, PmStages<128>::NS, ROPE>(ctx, st, a, N);
}

long long cuda_paged_mma_slots(OpsCtx *ctx, CudaState *st, int D) { return pm_slots_for<false>(ctx, st, pm_dp(D)); }

void cuda_paged_mma_launch(OpsCtx *ctx, CudaState *st, const PgArgs *a, int N, int rope) {
    const int DP = pm_dp(a->D);
    if (rope) pm_launch_for<true>(ctx, st, a, N, DP);
    else pm_launch_for<false>(ctx, st, a, N, DP);
}
