// kernels/cuda/cuda_attention_fwd.cu — causal GQA attention forward for training over packed
// variable-length sequences (flash attention on bf16 tensor cores), and the tile map both directions use.
//
// Layout: q, out (N, Hq, D); k, v (N, Hkv, D); lse (N, Hq) fp32; sequence b holds tokens
// [cu_seqlens[b], cu_seqlens[b+1]); query head h reads kv head h / (Hq / Hkv).
//
// One block = one (sequence, query tile of BM rows, query head); each of its NW warps owns MR x 16 query
// rows (two 16-row strips share every K and V fragment read from shared memory). Q is loaded once (kept in
// registers as mma A fragments when they fit); K/V tiles of BN keys stream through a double-buffered
// cp.async pipeline, from the diagonal tile down to key 0 so that only the first tiles need the causal
// mask, and a warp skips a tile whose keys all lie past its rows. Per tile:
//   S = Q K^T (fp32 accumulators); online softmax per row in the log2 domain (running max m and a
//   per-thread partial sum l, rescaled by exp2(m_old - m_new); p = exp2(s * scale log2(e) - m) as one
//   FMA and one MUFU op); O += P V with P packed to bf16 straight from the S accumulators.
//   At the end out = O / l and lse = (m + log2 l) ln 2.
// Blocks come heaviest first from the tile map (cuda_attention.cuh); there is no (T x T) matrix anywhere.
//
// Head dims are padded with zero columns to DP in {32, 64, 128, 256}. The tile shapes of 64 and 128 were
// picked by timing candidates against PyTorch's flash backend in the same run (Qwen2.5 heads, 8 x 1024 tokens,
// bench/bench_attention_gpu.py; the figures are in bench/notes/).

#include <limits.h>

#include "kernels/cuda/cuda_attention.cuh"

// ---- tile map -------------------------------------------------------------------------------------

// In place over a[0..n): a[i] = sum of a[j] for j >= i, by one block (blockDim.x a multiple of 32).
__device__ static void block_suffix_sum(int *a, int n, int *warp_tot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int carry = 0;
    for (int base = ((n - 1) / (int)blockDim.x) * blockDim.x; base >= 0; base -= blockDim.x) {
        // Thread order runs from the end of the chunk to its start, so a prefix scan over threads is a suffix
        // scan over the array.
        const int i = base + (int)blockDim.x - 1 - (int)threadIdx.x;
        int x = i < n ? a[i] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) warp_tot[warp] = x;
        __syncthreads();
        if (warp == 0) {
            int t = lane < nw ? warp_tot[lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, t, o);
                if (lane >= o) t += y;
            }
            warp_tot[lane] = t;
        }
        __syncthreads();
        x += (warp > 0 ? warp_tot[warp - 1] : 0) + carry;
        if (i < n) a[i] = x;
        carry += warp_tot[nw - 1];
        __syncthreads();
    }
}

// One block. work: 3 * (maxT + 2) ints (maxT = most tiles one sequence can have) in global memory, or NULL to
// use that much dynamic shared memory (the common case: the kernel is a chain of dependent steps, and shared
// memory takes global round trips out of each). A counting sort of the tiles by weight w (0 = lightest):
// hist[n] = sequences with n tiles; cnt[w] = sequences having a tile of weight w; start[w] = tiles heavier
// than w; each tile takes the next free place of its weight.
__global__ static void attn_tile_map_kernel(int2 *map, int *work, const int32_t *cu, int B, int N, int tile, int maxT,
                                            int heavy_last) {
    extern __shared__ int map_smem[];
    __shared__ int warp_tot[32];
    __shared__ int total;
    if (!work) work = map_smem;
    int *hist = work, *cnt = work + (maxT + 2), *cursor = work + 2 * (maxT + 2);
    for (int i = threadIdx.x; i < maxT + 2; i += blockDim.x) hist[i] = cursor[i] = 0;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    for (int b = threadIdx.x; b < B; b += blockDim.x) {
        const int s0 = cu[b], s1 = cu[b + 1];
        if (s0 < 0 || s1 > N || s1 <= s0) continue;
        const int n = (s1 - s0 + tile - 1) / tile;
        atomicAdd(&hist[n], 1);
        atomicAdd(&total, n);
    }
    __syncthreads();
    block_suffix_sum(hist, maxT + 1, warp_tot);  // hist[w] = sequences with at least w tiles
    for (int w = threadIdx.x; w < maxT + 1; w += blockDim.x) cnt[w] = w + 1 <= maxT ? hist[w + 1] : 0;
    __syncthreads();
    block_suffix_sum(cnt, maxT + 1, warp_tot);  // cnt[w] = tiles of weight >= w
    for (int b = threadIdx.x; b < B; b += blockDim.x) {
        const int s0 = cu[b], s1 = cu[b + 1];
        if (s0 < 0 || s1 > N || s1 <= s0) continue;
        const int n = (s1 - s0 + tile - 1) / tile;
        for (int w = 0; w < n; w++) {
            const int slot = cnt[w + 1] + atomicAdd(&cursor[w], 1);  // after every heavier tile
            map[1 + slot] = make_int2(b, heavy_last ? w : n - 1 - w);
        }
    }
    if (threadIdx.x == 0) map[0] = make_int2(total, 0);
}

size_t attn_tile_map_bytes(int N, int B, int tile) {
    const size_t maxT = (size_t)N / tile + 1;
    return (1 + attn_tile_bound(N, B, tile)) * sizeof(int2) + 3 * (maxT + 2) * sizeof(int);
}

const int2 *attn_tile_map(OpsCtx *ctx, CudaState *st, void *scratch, const int32_t *cu_seqlens, int B, int N,
                          int tile, int heavy_last) {
    int2 *map = (int2 *)scratch;
    const int maxT = N / tile + 1;
    const size_t work_bytes = 3 * ((size_t)maxT + 2) * sizeof(int);
    const bool in_smem = work_bytes <= 32768;
    int *work = in_smem ? NULL : (int *)(map + 1 + attn_tile_bound(N, B, tile));
    attn_tile_map_kernel<<<1, 512, in_smem ? work_bytes : 0, st->stream>>>(map, work, cu_seqlens, B, N, tile, maxT,
                                                                          heavy_last);
    CUDA_CHECK_RET(ctx, cudaGetLastError(), NULL);
    return map;
}

int attn_check_shape(OpsCtx *ctx, const char *name, int B, int N, int Hq, int Hkv, int D) {
    if (B < 0 || N < 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || Hq % Hkv != 0)
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "%s: bad shape B=%d N=%d Hq=%d Hkv=%d D=%d", name, B, N, Hq,
                             Hkv, D);
    if (D > 256)
        return ops_set_error(ctx, -1, __FILE__, __LINE__,
                             "%s: head_dim %d is larger than the CUDA attention kernels support (256)", name, D);
    // The grids are (work items x heads) in one dimension.
    if ((double)(attn_tile_bound(N, B, 16) + 1) * Hq * 2 > (double)INT_MAX)
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "%s: %d tokens x %d heads exceed the grid limit", name, N,
                             Hq);
    return 0;
}

// ---- forward kernel ---------------------------------------------------------------------------------

// NW warps of MR x 16 query rows each; BN keys per K/V tile. QREG: Q fragments stay in registers
// (MR * DP / 4 of them), otherwise they are re-read from shared memory for every K tile.
template <int DP, int NW, int BN, int MR, bool QREG> struct FwdCfg {
    static constexpr int WR = 16 * MR;   // query rows per warp
    static constexpr int BM = WR * NW;   // query rows per block
    static constexpr int LD = DP + 8;    // shared tile pitch (bf16)
    static constexpr int THREADS = 32 * NW;
    static constexpr int SMEM = (BM + 4 * BN) * LD * 2;  // Q, then K and V twice
};

// grid: (work items of the map) x Hq, item-major, so the heads of one tile run side by side and share K/V in L2.
template <int DP, int NW, int BN, int MR, bool QREG>
__global__ static void __launch_bounds__(32 * NW)
attn_fwd_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const int32_t *cu,
                const int2 *map, int Hq, int group, int D, float scale_log2, int vec) {
    typedef FwdCfg<DP, NW, BN, MR, QREG> C;
    constexpr int BM = C::BM, WR = C::WR, LD = C::LD, KC = DP / 16, NT = BN / 8, OT = DP / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16 *Qs = (bf16 *)smem;     // (BM, LD)
    bf16 *Ks = Qs + BM * LD;     // (2, BN, LD)
    bf16 *Vs = Ks + 2 * BN * LD; // (2, BN, LD)

    const int item = blockIdx.x / Hq, h = blockIdx.x % Hq;
    if (item >= map[0].x) return;
    const int2 bt = map[1 + item];
    const int s0 = cu[bt.x], L = cu[bt.x + 1] - s0;
    const int q0 = bt.y * BM;                // first query row of the tile, within the sequence
    const int kend = min(q0 + BM, L);        // keys [0, kend) are visible to some row
    const int n_kt = (kend + BN - 1) / BN;
    const int Hkv = Hq / group, g = h / group;
    const size_t qstride = (size_t)Hq * D, kstride = (size_t)Hkv * D;
    const bf16 *qh = q + ((size_t)s0 + q0) * qstride + (size_t)h * D;
    const bf16 *kh = k + (size_t)s0 * kstride + (size_t)g * D;
    const bf16 *vh = v + (size_t)s0 * kstride + (size_t)g * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wrow = warp * WR, gr = lane >> 2, tq = lane & 3;
    // The softmax max is taken over raw scores and scaled once, which needs a positive scale: a negative
    // one is moved into Q's sign bits instead. The floor keeps masked scores (-inf) at -inf for scale 0.
    const uint32_t qsign = scale_log2 < 0.0f ? 0x80008000u : 0u;
    const float sl2 = fmaxf(fabsf(scale_log2), 1.17549435e-38f);

    attn_load_tile<DP, BM, C::THREADS>(Qs, qh, L - q0, qstride, D, vec);
    attn_cp_async_commit();
    {
        const int kt = n_kt - 1;
        attn_load_tile<DP, BN, C::THREADS>(Ks, kh + (size_t)kt * BN * kstride, kend - kt * BN, kstride, D, vec);
        attn_load_tile<DP, BN, C::THREADS>(Vs, vh + (size_t)kt * BN * kstride, kend - kt * BN, kstride, D, vec);
        attn_cp_async_commit();
    }
    attn_cp_async_wait<1>();
    __syncthreads();

    // ldmatrix row / column of this lane inside a 16 x 16 block: A operand, B with n as the stored row
    // (K), B with k as the stored row (V).
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
    const int bn_row = (lane & 7) + (lane >> 4) * 8, bn_col = ((lane >> 3) & 1) * 8;
    const int bt_row = (lane & 7) + ((lane >> 3) & 1) * 8, bt_col = (lane >> 4) * 8;
    uint32_t qf[QREG ? MR : 1][QREG ? KC : 1][4];
    if constexpr (QREG) {
#pragma unroll
        for (int mr = 0; mr < MR; mr++)
#pragma unroll
            for (int kc = 0; kc < KC; kc++) {
                attn_ldsm4(qf[mr][kc], Qs + (wrow + mr * 16 + a_row) * LD + kc * 16 + a_col);
#pragma unroll
                for (int j = 0; j < 4; j++) qf[mr][kc][j] ^= qsign;
            }
    }

    float o[MR][OT][4];
#pragma unroll
    for (int mr = 0; mr < MR; mr++)
#pragma unroll
        for (int i = 0; i < OT; i++) o[mr][i][0] = o[mr][i][1] = o[mr][i][2] = o[mr][i][3] = 0.0f;
    // Rows wrow + mr * 16 + gr (+ 8): running max (scaled, log2 domain) and per-thread partial sums.
    float m[MR][2], l[MR][2];
#pragma unroll
    for (int mr = 0; mr < MR; mr++) m[mr][0] = m[mr][1] = -INFINITY, l[mr][0] = l[mr][1] = 0.0f;

    for (int it = 0; it < n_kt; it++) {
        const int kt = n_kt - 1 - it, buf = it & 1;
        if (it + 1 < n_kt) {  // prefetch the next (lower) tile into the other buffer
            const int nk = kt - 1;
            attn_load_tile<DP, BN, C::THREADS>(Ks + (buf ^ 1) * BN * LD, kh + (size_t)nk * BN * kstride,
                                               kend - nk * BN, kstride, D, vec);
            attn_load_tile<DP, BN, C::THREADS>(Vs + (buf ^ 1) * BN * LD, vh + (size_t)nk * BN * kstride,
                                               kend - nk * BN, kstride, D, vec);
        }
        attn_cp_async_commit();
        attn_cp_async_wait<1>();
        __syncthreads();
        const int key0 = kt * BN;
        // Every key of the tile lies past every row of this warp: nothing to add.
        if (key0 <= q0 + wrow + WR - 1) {
            const bf16 *Kb = Ks + buf * BN * LD, *Vb = Vs + buf * BN * LD;
            float s[MR][NT][4];
#pragma unroll
            for (int mr = 0; mr < MR; mr++)
#pragma unroll
                for (int i = 0; i < NT; i++) s[mr][i][0] = s[mr][i][1] = s[mr][i][2] = s[mr][i][3] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < KC; kc++) {
                uint32_t a[MR][4];
#pragma unroll
                for (int mr = 0; mr < MR; mr++) {
                    if constexpr (QREG) {
#pragma unroll
                        for (int j = 0; j < 4; j++) a[mr][j] = qf[mr][kc][j];
                    } else {
                        attn_ldsm4(a[mr], Qs + (wrow + mr * 16 + a_row) * LD + kc * 16 + a_col);
#pragma unroll
                        for (int j = 0; j < 4; j++) a[mr][j] ^= qsign;
                    }
                }
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    attn_ldsm4(b, Kb + (np * 16 + bn_row) * LD + kc * 16 + bn_col);
#pragma unroll
                    for (int mr = 0; mr < MR; mr++) {
                        attn_mma(s[mr][2 * np], a[mr], b[0], b[1]);
                        attn_mma(s[mr][2 * np + 1], a[mr], b[2], b[3]);
                    }
                }
            }
            const bool need_mask = key0 + BN - 1 > q0 + wrow;  // some key lies past some row of the warp
#pragma unroll
            for (int mr = 0; mr < MR; mr++) {
                const int row_lo = q0 + wrow + mr * 16 + gr;  // sequence position of row gr
                float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        if (need_mask) {
                            const int key = key0 + nt * 8 + 2 * tq + (e & 1), row = row_lo + (e >> 1) * 8;
                            if (key > row) s[mr][nt][e] = -INFINITY;
                        }
                        mx[e >> 1] = fmaxf(mx[e >> 1], s[mr][nt][e]);
                    }
                }
                float alpha[2], mu[2];
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                    const float m_new = fmaxf(m[mr][r], mx[r] * sl2);
                    mu[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no visible key yet keeps p = 0
                    alpha[r] = attn_exp2(m[mr][r] - mu[r]);
                    m[mr][r] = m_new;
                }
                float rs[2] = {0.0f, 0.0f};
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float p = attn_exp2(fmaf(s[mr][nt][e], sl2, -mu[e >> 1]));
                        s[mr][nt][e] = p;
                        rs[e >> 1] += p;
                    }
                }
                l[mr][0] = l[mr][0] * alpha[0] + rs[0];
                l[mr][1] = l[mr][1] * alpha[1] + rs[1];
#pragma unroll
                for (int i = 0; i < OT; i++) {
                    o[mr][i][0] *= alpha[0], o[mr][i][1] *= alpha[0];
                    o[mr][i][2] *= alpha[1], o[mr][i][3] *= alpha[1];
                }
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                uint32_t a[MR][4];
#pragma unroll
                for (int mr = 0; mr < MR; mr++) {
                    a[mr][0] = attn_pack(s[mr][2 * kk][0], s[mr][2 * kk][1]);
                    a[mr][1] = attn_pack(s[mr][2 * kk][2], s[mr][2 * kk][3]);
                    a[mr][2] = attn_pack(s[mr][2 * kk + 1][0], s[mr][2 * kk + 1][1]);
                    a[mr][3] = attn_pack(s[mr][2 * kk + 1][2], s[mr][2 * kk + 1][3]);
                }
#pragma unroll
                for (int dp = 0; dp < DP / 16; dp++) {
                    uint32_t b[4];
                    attn_ldsm4_t(b, Vb + (kk * 16 + bt_row) * LD + dp * 16 + bt_col);
#pragma unroll
                    for (int mr = 0; mr < MR; mr++) {
                        attn_mma(o[mr][2 * dp], a[mr], b[0], b[1]);
                        attn_mma(o[mr][2 * dp + 1], a[mr], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();  // this buffer is refilled two iterations on
    }

    // Row totals, lse, and out = O / l staged through this warp's own Q rows for 16-byte stores.
    bf16 *Os = Qs + wrow * LD;
#pragma unroll
    for (int mr = 0; mr < MR; mr++) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float lr = l[mr][r];
            lr += __shfl_xor_sync(0xffffffffu, lr, 1);
            lr += __shfl_xor_sync(0xffffffffu, lr, 2);
            inv[r] = lr > 0.0f ? 1.0f / lr : 0.0f;
            const int row = q0 + wrow + mr * 16 + gr + r * 8;
            if (tq == 0 && row < L) lse[((size_t)s0 + row) * Hq + h] = (m[mr][r] + log2f(lr)) * ATTN_LN2;
        }
#pragma unroll
        for (int i = 0; i < OT; i++) {
            const int c = i * 8 + 2 * tq, r = mr * 16 + gr;
            *reinterpret_cast<uint32_t *>(Os + r * LD + c) = attn_pack(o[mr][i][0] * inv[0], o[mr][i][1] * inv[0]);
            *reinterpret_cast<uint32_t *>(Os + (r + 8) * LD + c) =
                attn_pack(o[mr][i][2] * inv[1], o[mr][i][3] * inv[1]);
        }
    }
    __syncwarp();
    const int rows = min(WR, L - (q0 + wrow));
    bf16 *oh = out + ((size_t)s0 + q0 + wrow) * qstride + (size_t)h * D;
    if (vec) {
        for (int idx = lane; idx < WR * (DP / 8); idx += 32) {
            const int r = idx / (DP / 8), c = (idx % (DP / 8)) * 8;
            if (r < rows && c < D)
                *reinterpret_cast<uint4 *>(oh + (size_t)r * qstride + c) =
                    *reinterpret_cast<const uint4 *>(Os + r * LD + c);
        }
    } else {
        for (int idx = lane; idx < WR * D; idx += 32) {
            const int r = idx / D, c = idx % D;
            if (r < rows) oh[(size_t)r * qstride + c] = Os[r * LD + c];
        }
    }
}

// ---- host side ----------------------------------------------------------------------------------------

template <int DP, int NW, int BN, int MR, bool QREG>
static void fwd_launch(OpsCtx *ctx, CudaState *st, bf16 *out, float *lse, const bf16 *q, const bf16 *k,
                       const bf16 *v, const int32_t *cu, int B, int N, int Hq, int Hkv, int D, float scale) {
    typedef FwdCfg<DP, NW, BN, MR, QREG> C;
    if (attn_set_smem(ctx, st, attn_fwd_kernel<DP, NW, BN, MR, QREG>, C::SMEM, "attention_fwd") != 0) return;
    void *scratch = cuda_scratch(ctx, st, attn_tile_map_bytes(N, B, C::BM));
    if (!scratch) return;
    const int2 *map = attn_tile_map(ctx, st, scratch, cu, B, N, C::BM, 1);
    if (!map) return;
    const size_t blocks = attn_tile_bound(N, B, C::BM) * Hq;
    attn_fwd_kernel<DP, NW, BN, MR, QREG><<<(unsigned)blocks, C::THREADS, C::SMEM, st->stream>>>(
        out, lse, q, k, v, cu, map, Hq, Hq / Hkv, D, scale * ATTN_LOG2E, attn_vec_ok(D, q, k, v, out));
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_attention_fwd(OpsCtx *ctx, void *out, float *lse, const void *q, const void *k, const void *v,
                        const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale) {
    CudaState *st = cuda_enter(ctx);
    if (!st || attn_check_shape(ctx, "attention_fwd", B, N, Hq, Hkv, D) != 0) return;
    if (N == 0 || B == 0) return;
    bf16 *o = (bf16 *)out;
    const bf16 *qb = (const bf16 *)q, *kb = (const bf16 *)k, *vb = (const bf16 *)v;
    // Tile shapes per padded head dim: <DP, NW, BN, MR, QREG> (see FwdCfg).
#define ATTN_FWD(...) fwd_launch<__VA_ARGS__>(ctx, st, o, lse, qb, kb, vb, cu_seqlens, B, N, Hq, Hkv, D, scale)
    if (D <= 32) ATTN_FWD(32, 4, 64, 1, true);
    else if (D <= 64) ATTN_FWD(64, 4, 64, 2, true);
    else if (D <= 128) ATTN_FWD(128, 4, 64, 2, false);
    else ATTN_FWD(256, 4, 32, 1, false);
#undef ATTN_FWD
}
