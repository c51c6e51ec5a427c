// kernels/cuda/cuda_attention_bwd.cu — causal GQA attention backward for training over packed
// variable-length sequences (flash attention on bf16 tensor cores).
//
// Layout: q, dq, out, dout (N, Hq, D); k, v, dk, dv (N, Hkv, D); lse (N, Hq) fp32 from the forward.
// With P = exp(scale Q K^T - lse), dP = dO V^T, Delta_i = rowsum(dO_i * O_i) and dS = P (dP - Delta):
//   dV = P^T dO,  dK = scale dS^T Q,  dQ = scale dS K   (dK, dV summed over the query heads of a group).
//
// Passes (all on the context's stream):
//   1. Delta (N, Hq) = rowsum(dO * O); the same kernel zeroes the fp32 accumulators dQacc (N, Hq, W),
//      dKacc, dVacc (N, Hkv, W) (W = D rounded up to 4).
//   2. the main kernel, key-tile major: one block = one (sequence, tile of BN keys, query head, chunk of DC
//      output columns). K and V stay in shared memory; query tiles of BM rows (Q, dO, lse, Delta) stream
//      through a double-buffered cp.async pipeline from the tile's first key to the sequence's end. Each
//      warp owns MR x 16 keys and computes S^T = K Q^T and dP^T = V dO^T in registers, turns them into P^T
//      and dS^T, and accumulates dV += P^T dO and dK += dS^T Q in registers (the fp32 accumulators become
//      the bf16 A operand directly). dS^T goes to shared memory, and after a barrier the block computes
//      dQ (BM, DC) = dS K and adds it into dQacc with fp32 vector atomics. At the end the block adds its
//      dK, dV rows into dKacc, dVacc (atomics: the query heads of a group run in different blocks, which
//      is what keeps the grid large enough with 2 kv heads).
//   3. dq = bf16(scale dQacc), dk = bf16(scale dKacc), dv = bf16(dVacc); tokens outside every sequence
//      come out zero (overwrite semantics, as the CPU twin).
// The atomics make the summation order (and so the last bits of dq, dk, dv) vary from run to run.
//
// Precision: the products behind dV, dK and dQ take P and dS as bf16 pairs (x = hi + lo, 16 significant
// bits) when SPLIT: a single bf16 rounding of P or dS (8 bits) put the gradients 1-2 % (max over elements,
// relative to |x| + rms) off the fp32 reference on sequences of 100 to 2000 tokens, the tail of a sum of
// many independently rounded terms. The forward's P V keeps a single bf16 P (one product, errors <= 1.2 %).
//
// Head dims are padded with zero columns to DP in {32, 64, 128, 256}; DP = 256 runs as two column chunks
// of 128 (S and dP computed once per chunk) to bound the registers the dK, dV accumulators need. The tile
// shapes of 64 and 128 were picked by timing candidates against PyTorch's flash backend in the same run (Qwen2.5
// heads, 8 x 1024 tokens, bench/bench_attention_gpu.py; the figures are in bench/notes/).
#include "kernels/cuda/cuda_attention.cuh"

// NW warps of MR x 16 keys each; query tiles of BM rows; DC output columns per block.
template <int DP, int DC, int NW, int MR, int BM, bool SPLIT> struct BwdCfg {
    static constexpr int WK = 16 * MR;    // keys per warp
    static constexpr int BN = WK * NW;    // keys per block
    static constexpr int LD = DP + 8;     // pitch of the bf16 (rows, DP) tiles
    static constexpr int LDS = BM + 8;    // pitch of the bf16 dS^T tile (BN, BM)
    static constexpr int THREADS = 32 * NW;
    static constexpr int NCH = DP / DC;   // column chunks
    static constexpr int WM = BM / 16;    // dQ: warps per column group (16 query rows each) ...
    static constexpr int WN = NW / WM;    // ... and column groups of CW columns
    static constexpr int CW = DC / WN;
    static constexpr int SMEM = (2 * BN * LD + 4 * BM * LD + (SPLIT ? 2 : 1) * BN * LDS) * 2 + 4 * BM * 4;
    static_assert(NW % WM == 0 && CW % 16 == 0 && DP % DC == 0, "unsupported tile shape");
};

// Adds a C fragment pair of 4 floats per lane pair as one float4: lanes 2u and 2u + 1 of a quad swap halves
// so that the even lane holds row g, columns 4u..4u+3 and the odd lane row g + 8, the same columns.
// dst0 / dst8: rows g and g + 8 at column 0 of this fragment; the write happens when ok0 / ok8.
__device__ static __forceinline__ void attn_red4(float *dst0, float *dst8, const float c[4], int tq, bool ok0,
                                                 bool ok8) {
    const bool odd = tq & 1;
    const float s0 = odd ? c[0] : c[2], s1 = odd ? c[1] : c[3];
    const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
    const int col = (tq & ~1) * 2;
    float *dst = (odd ? dst8 : dst0) + col;
    if (!(odd ? ok8 : ok0)) return;
    const float4 val = odd ? make_float4(r0, r1, c[2], c[3]) : make_float4(c[0], c[1], r0, r1);
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4 *>(dst), val);
#else
    atomicAdd(dst, val.x), atomicAdd(dst + 1, val.y), atomicAdd(dst + 2, val.z), atomicAdd(dst + 3, val.w);
#endif
}

// grid: (work items of the key-tile map) x Hq x NCH, item-major.
// dq_acc (N, Hq, W), dk_acc / dv_acc (N, Hkv, W) fp32, W = ldw.
template <int DP, int DC, int NW, int MR, int BM, bool SPLIT>
__global__ static void __launch_bounds__(32 * NW)
attn_bwd_kernel(float *dq_acc, float *dk_acc, float *dv_acc, const bf16 *dout, const bf16 *q, const bf16 *k,
                const bf16 *v, const float *lse, const float *delta, const int32_t *cu, const int2 *map, int Hq,
                int group, int D, int ldw, float scale_log2, int vec) {
    typedef BwdCfg<DP, DC, NW, MR, BM, SPLIT> C;
    constexpr int BN = C::BN, WK = C::WK, LD = C::LD, LDS = C::LDS, KC = DP / 16, QT = BM / 8, DT = DC / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16 *Ks = (bf16 *)smem;            // (BN, LD)
    bf16 *Vs = Ks + BN * LD;            // (BN, LD)
    bf16 *Qs = Vs + BN * LD;            // (2, BM, LD)
    bf16 *dOs = Qs + 2 * BM * LD;       // (2, BM, LD)
    bf16 *dSh = dOs + 2 * BM * LD;      // (BN, LDS) dS^T, high part
    bf16 *dSl = dSh + BN * LDS;         // (BN, LDS) remainder (SPLIT only)
    float *lse_s = (float *)(dSh + (SPLIT ? 2 : 1) * BN * LDS);  // (2, BM)
    float *dl_s = lse_s + 2 * BM;                                   // (2, BM)

    const int per_item = Hq * C::NCH;
    const int item = blockIdx.x / per_item, h = (blockIdx.x % per_item) / C::NCH;
    const int c0 = (blockIdx.x % C::NCH) * DC;
    if (item >= map[0].x) return;
    const int2 bt = map[1 + item];
    const int s0 = cu[bt.x], L = cu[bt.x + 1] - s0;
    const int k0 = bt.y * BN;                    // first key of the tile, within the sequence
    const int n_qt = (L - k0 + BM - 1) / BM;     // query tiles start at k0: earlier queries see none of these keys
    const int Hkv = Hq / group, g = h / group;
    const size_t qstride = (size_t)Hq * D, kstride = (size_t)Hkv * D;
    const bf16 *qh = q + (size_t)s0 * qstride + (size_t)h * D;
    const bf16 *doh = dout + (size_t)s0 * qstride + (size_t)h * D;
    const float *lseh = lse + (size_t)s0 * Hq + h, *dlh = delta + (size_t)s0 * Hq + h;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wrow = warp * WK, gr = lane >> 2, tq = lane & 3;

    attn_load_tile<DP, BN, C::THREADS>(Ks, k + ((size_t)s0 + k0) * kstride + (size_t)g * D, L - k0, kstride, D, vec);
    attn_load_tile<DP, BN, C::THREADS>(Vs, v + ((size_t)s0 + k0) * kstride + (size_t)g * D, L - k0, kstride, D, vec);
    // Query tile m (rows k0 + m BM ..) into buffer `buf`: Q, dO, lse and Delta (zero past the sequence's end).
    auto load_q = [&](int m, int buf) {
        const int qs = k0 + m * BM;
        attn_load_tile<DP, BM, C::THREADS>(Qs + buf * BM * LD, qh + (size_t)qs * qstride, L - qs, qstride, D, vec);
        attn_load_tile<DP, BM, C::THREADS>(dOs + buf * BM * LD, doh + (size_t)qs * qstride, L - qs, qstride, D, vec);
        for (int r = threadIdx.x; r < 2 * BM; r += C::THREADS) {
            const int rr = r % BM, i = qs + rr;
            const bool ok = i < L;
            if (r < BM) attn_cp_async4(lse_s + buf * BM + rr, ok ? lseh + (size_t)i * Hq : lseh, ok);
            else attn_cp_async4(dl_s + buf * BM + rr, ok ? dlh + (size_t)i * Hq : dlh, ok);
        }
    };
    load_q(0, 0);
    attn_cp_async_commit();

    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;   // A, non-transposed
    const int bn_row = (lane & 7) + (lane >> 4) * 8, bn_col = ((lane >> 3) & 1) * 8; // B with n as the row
    const int bt_row = (lane & 7) + ((lane >> 3) & 1) * 8, bt_col = (lane >> 4) * 8; // B with k as the row
    const int kw0 = k0 + wrow;  // this warp's first key
    const int rg = warp % C::WM, cg = warp / C::WM;  // dQ: 16 query rows x CW columns of this warp

    float dk[MR][DT][4], dv[MR][DT][4];
#pragma unroll
    for (int mr = 0; mr < MR; mr++)
#pragma unroll
        for (int i = 0; i < DT; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) dk[mr][i][e] = dv[mr][i][e] = 0.0f;

    for (int m = 0; m < n_qt; m++) {
        const int buf = m & 1, qs = k0 + m * BM;
        if (m + 1 < n_qt) load_q(m + 1, buf ^ 1);
        attn_cp_async_commit();
        attn_cp_async_wait<1>();
        __syncthreads();
        const bf16 *Qb = Qs + buf * BM * LD, *dOb = dOs + buf * BM * LD;
        // Some query of the tile sees some key of the warp (and the warp has a key inside the sequence).
        if (qs + BM - 1 >= kw0 && kw0 < L) {
            float st[MR][QT][4], dpt[MR][QT][4];
#pragma unroll
            for (int mr = 0; mr < MR; mr++)
#pragma unroll
                for (int i = 0; i < QT; i++)
#pragma unroll
                    for (int e = 0; e < 4; e++) st[mr][i][e] = dpt[mr][i][e] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < KC; kc++) {
                uint32_t ak[MR][4], av[MR][4];
#pragma unroll
                for (int mr = 0; mr < MR; mr++) {
                    attn_ldsm4(ak[mr], Ks + (wrow + mr * 16 + a_row) * LD + kc * 16 + a_col);
                    attn_ldsm4(av[mr], Vs + (wrow + mr * 16 + a_row) * LD + kc * 16 + a_col);
                }
#pragma unroll
                for (int np = 0; np < QT / 2; np++) {
                    uint32_t b[4];
                    attn_ldsm4(b, Qb + (np * 16 + bn_row) * LD + kc * 16 + bn_col);
#pragma unroll
                    for (int mr = 0; mr < MR; mr++) {
                        attn_mma(st[mr][2 * np], ak[mr], b[0], b[1]);
                        attn_mma(st[mr][2 * np + 1], ak[mr], b[2], b[3]);
                    }
                    attn_ldsm4(b, dOb + (np * 16 + bn_row) * LD + kc * 16 + bn_col);
#pragma unroll
                    for (int mr = 0; mr < MR; mr++) {
                        attn_mma(dpt[mr][2 * np], av[mr], b[0], b[1]);
                        attn_mma(dpt[mr][2 * np + 1], av[mr], b[2], b[3]);
                    }
                }
            }
            // P^T and dS^T in place of S^T and dP^T; entries of a query before the key, or past the
            // sequence's end, are zero (selected, not multiplied: their dP - Delta is not meaningful).
            const bool need_mask = qs < kw0 + WK - 1 || qs + BM > L;
            const float *lb = lse_s + buf * BM, *db = dl_s + buf * BM;
#pragma unroll
            for (int nt = 0; nt < QT; nt++) {
                const int col = nt * 8 + 2 * tq;
                const float2 ls = *reinterpret_cast<const float2 *>(lb + col);
                const float2 dd = *reinterpret_cast<const float2 *>(db + col);
                const float l2[2] = {ls.x * ATTN_LOG2E, ls.y * ATTN_LOG2E};
#pragma unroll
                for (int mr = 0; mr < MR; mr++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float p = attn_exp2(fmaf(st[mr][nt][e], scale_log2, -l2[e & 1]));
                        float ds = p * (dpt[mr][nt][e] - ((e & 1) ? dd.y : dd.x));
                        if (need_mask) {
                            const int i = qs + col + (e & 1), j = kw0 + mr * 16 + gr + (e >> 1) * 8;
                            if (i < j || i >= L) p = ds = 0.0f;
                        }
                        st[mr][nt][e] = p;
                        dpt[mr][nt][e] = ds;
                    }
                }
            }
            // dV += P^T dO, dK += dS^T Q over this chunk's columns; dS^T to shared memory for dQ.
#pragma unroll
            for (int kk = 0; kk < BM / 16; kk++) {
                uint32_t ph[MR][4], pl[MR][4], sh[MR][4], sl[MR][4];
#pragma unroll
                for (int mr = 0; mr < MR; mr++) {
                    const float(*x)[4] = st[mr], (*y)[4] = dpt[mr];
                    if constexpr (SPLIT) {
                        attn_pack_split(x[2 * kk][0], x[2 * kk][1], ph[mr][0], pl[mr][0]);
                        attn_pack_split(x[2 * kk][2], x[2 * kk][3], ph[mr][1], pl[mr][1]);
                        attn_pack_split(x[2 * kk + 1][0], x[2 * kk + 1][1], ph[mr][2], pl[mr][2]);
                        attn_pack_split(x[2 * kk + 1][2], x[2 * kk + 1][3], ph[mr][3], pl[mr][3]);
                        attn_pack_split(y[2 * kk][0], y[2 * kk][1], sh[mr][0], sl[mr][0]);
                        attn_pack_split(y[2 * kk][2], y[2 * kk][3], sh[mr][1], sl[mr][1]);
                        attn_pack_split(y[2 * kk + 1][0], y[2 * kk + 1][1], sh[mr][2], sl[mr][2]);
                        attn_pack_split(y[2 * kk + 1][2], y[2 * kk + 1][3], sh[mr][3], sl[mr][3]);
                    } else {
                        ph[mr][0] = attn_pack(x[2 * kk][0], x[2 * kk][1]);
                        ph[mr][1] = attn_pack(x[2 * kk][2], x[2 * kk][3]);
                        ph[mr][2] = attn_pack(x[2 * kk + 1][0], x[2 * kk + 1][1]);
                        ph[mr][3] = attn_pack(x[2 * kk + 1][2], x[2 * kk + 1][3]);
                        sh[mr][0] = attn_pack(y[2 * kk][0], y[2 * kk][1]);
                        sh[mr][1] = attn_pack(y[2 * kk][2], y[2 * kk][3]);
                        sh[mr][2] = attn_pack(y[2 * kk + 1][0], y[2 * kk + 1][1]);
                        sh[mr][3] = attn_pack(y[2 * kk + 1][2], y[2 * kk + 1][3]);
                    }
                    const int r = wrow + mr * 16 + gr, cs = kk * 16 + 2 * tq;
                    *reinterpret_cast<uint32_t *>(dSh + r * LDS + cs) = sh[mr][0];
                    *reinterpret_cast<uint32_t *>(dSh + (r + 8) * LDS + cs) = sh[mr][1];
                    *reinterpret_cast<uint32_t *>(dSh + r * LDS + cs + 8) = sh[mr][2];
                    *reinterpret_cast<uint32_t *>(dSh + (r + 8) * LDS + cs + 8) = sh[mr][3];
                    if constexpr (SPLIT) {
                        *reinterpret_cast<uint32_t *>(dSl + r * LDS + cs) = sl[mr][0];
                        *reinterpret_cast<uint32_t *>(dSl + (r + 8) * LDS + cs) = sl[mr][1];
                        *reinterpret_cast<uint32_t *>(dSl + r * LDS + cs + 8) = sl[mr][2];
                        *reinterpret_cast<uint32_t *>(dSl + (r + 8) * LDS + cs + 8) = sl[mr][3];
                    }
                }
#pragma unroll
                for (int dp = 0; dp < DC / 16; dp++) {
                    uint32_t b[4];
                    attn_ldsm4_t(b, dOb + (kk * 16 + bt_row) * LD + c0 + dp * 16 + bt_col);
#pragma unroll
                    for (int mr = 0; mr < MR; mr++) {
                        attn_mma(dv[mr][2 * dp], ph[mr], b[0], b[1]);
                        attn_mma(dv[mr][2 * dp + 1], ph[mr], b[2], b[3]);
                        if constexpr (SPLIT) {
                            attn_mma(dv[mr][2 * dp], pl[mr], b[0], b[1]);
                            attn_mma(dv[mr][2 * dp + 1], pl[mr], b[2], b[3]);
                        }
                    }
                    attn_ldsm4_t(b, Qb + (kk * 16 + bt_row) * LD + c0 + dp * 16 + bt_col);
#pragma unroll
                    for (int mr = 0; mr < MR; mr++) {
                        attn_mma(dk[mr][2 * dp], sh[mr], b[0], b[1]);
                        attn_mma(dk[mr][2 * dp + 1], sh[mr], b[2], b[3]);
                        if constexpr (SPLIT) {
                            attn_mma(dk[mr][2 * dp], sl[mr], b[0], b[1]);
                            attn_mma(dk[mr][2 * dp + 1], sl[mr], b[2], b[3]);
                        }
                    }
                }
            }
        } else {  // nothing visible: dS^T rows of this warp are zero
            for (int idx = lane; idx < WK * BM / 2; idx += 32) {
                const int r = idx / (BM / 2), c = (idx % (BM / 2)) * 2;
                *reinterpret_cast<uint32_t *>(dSh + (wrow + r) * LDS + c) = 0u;
                if constexpr (SPLIT) *reinterpret_cast<uint32_t *>(dSl + (wrow + r) * LDS + c) = 0u;
            }
        }
        __syncthreads();

        // dQ (BM, DC) += dS (BM, BN) K (BN, DC): this warp's 16 rows x CW columns, then into dQacc.
        {
            float acc[C::CW / 8][4];
#pragma unroll
            for (int i = 0; i < C::CW / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
            const int cb = c0 + cg * C::CW;
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                uint32_t ah[4], al[4];
                attn_ldsm4_t(ah, dSh + (kk * 16 + bn_row) * LDS + rg * 16 + bn_col);
                if constexpr (SPLIT) attn_ldsm4_t(al, dSl + (kk * 16 + bn_row) * LDS + rg * 16 + bn_col);
#pragma unroll
                for (int dp = 0; dp < C::CW / 16; dp++) {
                    uint32_t b[4];
                    attn_ldsm4_t(b, Ks + (kk * 16 + bt_row) * LD + cb + dp * 16 + bt_col);
                    attn_mma(acc[2 * dp], ah, b[0], b[1]);
                    attn_mma(acc[2 * dp + 1], ah, b[2], b[3]);
                    if constexpr (SPLIT) {
                        attn_mma(acc[2 * dp], al, b[0], b[1]);
                        attn_mma(acc[2 * dp + 1], al, b[2], b[3]);
                    }
                }
            }
            const int i0 = qs + rg * 16 + gr;
            float *d0 = dq_acc + (((size_t)s0 + i0) * Hq + h) * ldw + cb;
            float *d8 = d0 + (size_t)8 * Hq * ldw;
#pragma unroll
            for (int nt = 0; nt < C::CW / 8; nt++) {
                const bool col_ok = cb + nt * 8 + (tq & ~1) * 2 < D;
                attn_red4(d0 + nt * 8, d8 + nt * 8, acc[nt], tq, col_ok && i0 < L, col_ok && i0 + 8 < L);
            }
        }
    }

    // This block's share of dK, dV (its query head) into the group's accumulators.
#pragma unroll
    for (int mr = 0; mr < MR; mr++) {
        const int j0 = kw0 + mr * 16 + gr;
        if (kw0 + mr * 16 >= L) break;
        const size_t o0 = (((size_t)s0 + j0) * Hkv + g) * ldw + c0, o8 = o0 + (size_t)8 * Hkv * ldw;
#pragma unroll
        for (int nt = 0; nt < DT; nt++) {
            const bool col_ok = c0 + nt * 8 + (tq & ~1) * 2 < D;
            attn_red4(dk_acc + o0 + nt * 8, dk_acc + o8 + nt * 8, dk[mr][nt], tq, col_ok && j0 < L,
                      col_ok && j0 + 8 < L);
            attn_red4(dv_acc + o0 + nt * 8, dv_acc + o8 + nt * 8, dv[mr][nt], tq, col_ok && j0 < L,
                      col_ok && j0 + 8 < L);
        }
    }
}

// ---- passes 1 and 3 -----------------------------------------------------------------------------------

// Delta (rows) = rowsum(dout * out) over rows of D, and the fp32 accumulators zeroed: row r of dq_acc (rows of
// ldw) and, for r < kv_rows, of dk_acc and dv_acc. lpr lanes per row (a power of two dividing 32); vec: each
// lane reads 16-byte chunks (D % 8 == 0, aligned), otherwise single elements.
__global__ static void attn_bwd_prep_kernel(float *delta, float *dq_acc, float *dk_acc, float *dv_acc,
                                            const bf16 *dout, const bf16 *out, size_t rows, size_t kv_rows, int D,
                                            int ldw, int lpr, int vec) {
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t row = tid / lpr;
    const int sub = (int)(tid % lpr);
    const bool live = row < rows;
    float s = 0.0f;
    if (live) {
        const bf16 *a = dout + row * D, *b = out + row * D;
        if (vec) {
            for (int c = sub * 8; c < D; c += lpr * 8) {
                const uint4 ua = *reinterpret_cast<const uint4 *>(a + c), ub = *reinterpret_cast<const uint4 *>(b + c);
                const __nv_bfloat162 *pa = reinterpret_cast<const __nv_bfloat162 *>(&ua);
                const __nv_bfloat162 *pb = reinterpret_cast<const __nv_bfloat162 *>(&ub);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 fa = __bfloat1622float2(pa[j]), fb = __bfloat1622float2(pb[j]);
                    s = fmaf(fa.x, fb.x, s);
                    s = fmaf(fa.y, fb.y, s);
                }
            }
        } else {
            for (int c = sub; c < D; c += lpr) s = fmaf(bf2f(a[c]), bf2f(b[c]), s);
        }
        const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int c = sub * 4; c < ldw; c += lpr * 4) {
            *reinterpret_cast<float4 *>(dq_acc + row * ldw + c) = z;
            if (row < kv_rows) {
                *reinterpret_cast<float4 *>(dk_acc + row * ldw + c) = z;
                *reinterpret_cast<float4 *>(dv_acc + row * ldw + c) = z;
            }
        }
    }
    for (int o = lpr / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (live && sub == 0) delta[row] = s;
}

// dst (rows, D) bf16 = mul * src (rows, ldw) fp32 for the three gradients (blockIdx.y picks one). flat: ldw == D
// and the destinations 8-byte aligned, so both are flat arrays of rows * D that go four elements at a time.
__global__ static void attn_bwd_convert_kernel(bf16 *dst0, bf16 *dst1, bf16 *dst2, const float *src0,
                                               const float *src1, const float *src2, size_t rows0, size_t rows12,
                                               float mul01, float mul2, int D, int ldw, int flat) {
    const int t = blockIdx.y;
    bf16 *dst = t == 0 ? dst0 : t == 1 ? dst1 : dst2;
    const float *src = t == 0 ? src0 : t == 1 ? src1 : src2;
    const float mul = t == 2 ? mul2 : mul01;
    const size_t n = (t == 0 ? rows0 : rows12) * D, stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (flat) {
        for (size_t e = first * 4; e < n; e += stride * 4) {
            const float4 x = *reinterpret_cast<const float4 *>(src + e);
            *reinterpret_cast<uint2 *>(dst + e) =
                make_uint2(attn_pack(x.x * mul, x.y * mul), attn_pack(x.z * mul, x.w * mul));
        }
    } else {
        for (size_t e = first; e < n; e += stride) dst[e] = __float2bfloat16_rn(src[e / D * ldw + e % D] * mul);
    }
}

// ---- host side ----------------------------------------------------------------------------------------

static size_t align256(size_t x) { return (x + 255) / 256 * 256; }

template <int DP, int DC, int NW, int MR, int BM, bool SPLIT>
static void bwd_launch(OpsCtx *ctx, CudaState *st, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q,
                       const bf16 *k, const bf16 *v, const bf16 *out, const float *lse, const int32_t *cu, int B,
                       int N, int Hq, int Hkv, int D, float scale) {
    typedef BwdCfg<DP, DC, NW, MR, BM, SPLIT> C;
    if (attn_set_smem(ctx, st, attn_bwd_kernel<DP, DC, NW, MR, BM, SPLIT>, C::SMEM, "attention_bwd") != 0) return;
    const int ldw = (D + 3) & ~3;
    const size_t rq = (size_t)N * Hq, rk = (size_t)N * Hkv;
    const size_t b_delta = align256(rq * 4), b_dq = align256(rq * ldw * 4), b_dkv = align256(rk * ldw * 4);
    char *scratch = (char *)cuda_scratch(ctx, st, b_delta + b_dq + 2 * b_dkv + attn_tile_map_bytes(N, B, C::BN));
    if (!scratch) return;
    float *delta = (float *)scratch;
    float *dq_acc = (float *)(scratch + b_delta), *dk_acc = (float *)(scratch + b_delta + b_dq);
    float *dv_acc = (float *)(scratch + b_delta + b_dq + b_dkv);
    int lpr = 32;
    const int vec_prep = attn_vec_ok(D, dout, out, dout, out);
    if (vec_prep && 32 % (D / 8) == 0) lpr = D / 8;  // one 16-byte chunk per lane per row
    const size_t threads = rq * lpr;
    attn_bwd_prep_kernel<<<(unsigned)((threads + 255) / 256), 256, 0, st->stream>>>(
        delta, dq_acc, dk_acc, dv_acc, dout, out, rq, rk, D, ldw, lpr, vec_prep);
    CUDA_CHECK_LAUNCH(ctx);

    const int2 *map = attn_tile_map(ctx, st, scratch + b_delta + b_dq + 2 * b_dkv, cu, B, N, C::BN, 0);
    if (!map) return;
    const size_t blocks = attn_tile_bound(N, B, C::BN) * Hq * C::NCH;
    attn_bwd_kernel<DP, DC, NW, MR, BM, SPLIT><<<(unsigned)blocks, C::THREADS, C::SMEM, st->stream>>>(
        dq_acc, dk_acc, dv_acc, dout, q, k, v, lse, delta, cu, map, Hq, Hq / Hkv, D, ldw, scale * ATTN_LOG2E,
        attn_vec_ok(D, q, k, v, dout));
    CUDA_CHECK_LAUNCH(ctx);

    const int flat = ldw == D && ((((uintptr_t)dq) | ((uintptr_t)dk) | ((uintptr_t)dv)) & 7) == 0;
    const size_t items = flat ? rq * D / 4 : rq * D;
    attn_bwd_convert_kernel<<<dim3(cuda_grid_1d(items, 256, st), 3), 256, 0, st->stream>>>(
        dq, dk, dv, dq_acc, dk_acc, dv_acc, rq, rk, scale, 1.0f, D, ldw, flat);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_attention_bwd(OpsCtx *ctx, void *dq, void *dk, void *dv, const void *dout, const void *q,
                        const void *k, const void *v, const void *out, const float *lse,
                        const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale) {
    CudaState *st = cuda_enter(ctx);
    if (!st || attn_check_shape(ctx, "attention_bwd", B, N, Hq, Hkv, D) != 0) return;
    if (N == 0) return;
    if (B == 0) {  // no sequence: every gradient is zero (overwrite semantics)
        CUDA_CHECK(ctx, cudaMemsetAsync(dq, 0, (size_t)N * Hq * D * sizeof(bf16), st->stream));
        CUDA_CHECK(ctx, cudaMemsetAsync(dk, 0, (size_t)N * Hkv * D * sizeof(bf16), st->stream));
        CUDA_CHECK(ctx, cudaMemsetAsync(dv, 0, (size_t)N * Hkv * D * sizeof(bf16), st->stream));
        return;
    }
    bf16 *dqb = (bf16 *)dq, *dkb = (bf16 *)dk, *dvb = (bf16 *)dv;
    const bf16 *dob = (const bf16 *)dout, *qb = (const bf16 *)q, *kb = (const bf16 *)k, *vb = (const bf16 *)v;
    const bf16 *ob = (const bf16 *)out;
    // Tile shapes per padded head dim: <DP, DC, NW, MR, BM, SPLIT> (see BwdCfg).
#define ATTN_BWD(...) \
    bwd_launch<__VA_ARGS__>(ctx, st, dqb, dkb, dvb, dob, qb, kb, vb, ob, lse, cu_seqlens, B, N, Hq, Hkv, D, scale)
    if (D <= 32) ATTN_BWD(32, 32, 4, 1, 64, true);
    else if (D <= 64) ATTN_BWD(64, 64, 4, 2, 32, true);
    else if (D <= 128) ATTN_BWD(128, 128, 4, 1, 32, true);
    else ATTN_BWD(256, 128, 4, 1, 32, true);
#undef ATTN_BWD
}
