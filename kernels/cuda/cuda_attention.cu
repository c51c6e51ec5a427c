// kernels/cuda/cuda_attention.cu — causal GQA attention for training over packed variable-length
// sequences, flash-attention style: tiles of queries and keys in shared memory, bf16 tensor-core products
// (WMMA 16x16x16, fp32 accumulation), online softmax, no (T x T) matrix in global memory.
//
// Layout: q, out, dq (N, Hq, D); k, v, dk, dv (N, Hkv, D); lse, Delta (N, Hq) fp32; sequence b holds tokens
// [cu_seqlens[b], cu_seqlens[b+1]); query head h reads kv head h / (Hq / Hkv).
//
// Tiles are cut in the packed token space (BM tokens), not per sequence, so the grid is known without
// reading cu_seqlens on the host. A tile may straddle sequences: every score carries the mask
//   key j is visible to query i  <=>  seq_start(i) <= j <= i        (equivalently j <= i < seq_end(j))
// and the key (or query) range a tile visits is the union over its rows.
//
//   forward  (grid: query tiles x Hq): S = Q K^T; online softmax with running max m and sum l per row
//            (log2 domain: exp2 of scores pre-scaled by scale * log2 e); O += P V with P in bf16;
//            out = O / l, lse = (m + log2 l) * ln 2.
//   backward: Delta_i = rowsum(dO_i * O_i) (preprocess kernel), then two kernels that recompute
//            P = exp(S - lse) and dP = dO V^T, dS = P (dP - Delta):
//            dq kernel   (grid: query tiles x Hq):  dQ = scale dS K
//            dkdv kernel (grid: key tiles x Hkv):   dV = sum over the group's heads of P^T dO,
//                                                   dK = scale sum of dS^T Q
//            Each output element is owned by one block, so there are no atomics and results are deterministic.
//            The probabilities and score gradients that feed the dq/dk/dv products are split into a bf16
//            high part and a bf16 remainder (x = hi + lo to ~16 mantissa bits) and multiplied twice: the sums
//            behind dQ and dK cancel heavily (every row of dS sums to zero), and a single bf16 rounding of
//            dS measurably degraded them (1-2 % of their scale against the fp32 reference).
//
// Each warp owns 16 rows of the block's tile (BM = 16 x warps), so the softmax and the accumulators of a
// strip need only warp synchronization; blocks synchronize around the shared K/V (or Q/dO) tile loads.
// Head dims are padded to DP (a multiple of 16) with zeros: D <= 32, 64, 128 use BM = 64, D <= 256 BM = 32.
#include <limits.h>
#include <math.h>
#include <mma.h>

#include "kernels/cuda/cuda_common.cuh"

using namespace nvcuda;

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragBRow;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBCol;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

// Shared-memory tile geometry for head dim padding DP and tile rows BM. Row pitches are padded (+8 bf16,
// +4 fp32) against bank conflicts while keeping every 16x16 fragment 32-byte aligned as WMMA requires.
template <int DP, int BM> struct AttnGeom {
    static constexpr int LDH = DP + 8;  // bf16 (BM, DP) tiles: Q, K, V, dO
    static constexpr int LDS = BM + 4;  // fp32 (BM, BM) score tiles: S, dP
    static constexpr int LDP = BM + 8;  // bf16 (BM, BM) tiles: P, dS
    static constexpr int LDO = DP + 4;  // fp32 (BM, DP) accumulators: O, dQ, dK, dV
    static constexpr int H_BYTES = BM * LDH * 2;
    static constexpr int S_BYTES = BM * LDS * 4;
    static constexpr int P_BYTES = BM * LDP * 2;
    static constexpr int O_BYTES = BM * LDO * 4;
    static constexpr int NW = BM / 16;
    static constexpr int THREADS = NW * 32;
    static constexpr int FWD_SMEM = 3 * H_BYTES + S_BYTES + P_BYTES + O_BYTES;
    static constexpr int DQ_SMEM = 4 * H_BYTES + 2 * S_BYTES + 2 * P_BYTES + O_BYTES;
    static constexpr int DKDV_SMEM = 4 * H_BYTES + 2 * S_BYTES + 4 * P_BYTES + 2 * O_BYTES;
};

// Sequence of packed token i: b with cu[b] <= i < cu[b+1] (cu ascending), or -1 when no sequence holds i.
__device__ __forceinline__ int find_sequence(const int32_t *cu, int B, int i) {
    if (B <= 0 || i < cu[0]) return -1;
    int lo = 0, hi = B - 1;  // last b with cu[b] <= i
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return i < cu[lo + 1] ? lo : -1;
}

// Copies rows [row0, row0 + BM) of one head of a (N, H, D) bf16 tensor into a (BM, DP) shared tile with
// pitch LDH; rows at or past row_end and columns at or past D become zero. `src` points at the head's
// first element (tensor + h * D); `stride` = H * D. vec: D % 8 == 0 and src 16-byte aligned.
template <int DP, int BM>
__device__ __forceinline__ void load_tile(bf16 *dst, const bf16 *src, int row0, int row_end, int stride, int D,
                                          int vec) {
    constexpr int LDH = AttnGeom<DP, BM>::LDH;
    if (vec) {
        constexpr int CPR = DP / 8;  // 16-byte chunks per row
        for (int idx = threadIdx.x; idx < BM * CPR; idx += blockDim.x) {
            const int r = idx / CPR, c = (idx % CPR) * 8, gr = row0 + r;
            uint4 val = make_uint4(0, 0, 0, 0);
            if (gr < row_end && c < D) val = *reinterpret_cast<const uint4 *>(src + (size_t)gr * stride + c);
            *reinterpret_cast<uint4 *>(dst + r * LDH + c) = val;
        }
    } else {
        for (int idx = threadIdx.x; idx < BM * DP; idx += blockDim.x) {
            const int r = idx / DP, c = idx % DP, gr = row0 + r;
            dst[r * LDH + c] = (gr < row_end && c < D) ? src[(size_t)gr * stride + c] : __float2bfloat16_rn(0.0f);
        }
    }
}

// C (16, 16 * NCOL) strip of `out` (fp32, pitch ldo) = A (16, 16 * KT) @ B^T where B rows are the columns:
// A row-major (pitch lda), B stored row-major as (16 * NCOL, 16 * KT) with pitch ldb (read col-major).
template <int NCOL, int KT>
__device__ __forceinline__ void mma_abt(float *out, int ldo, const bf16 *a, int lda, const bf16 *b, int ldb) {
#pragma unroll
    for (int j = 0; j < NCOL; j++) {
        FragC acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            FragA fa;
            FragBCol fb;
            wmma::load_matrix_sync(fa, a + kk * 16, lda);
            wmma::load_matrix_sync(fb, b + (size_t)j * 16 * ldb + kk * 16, ldb);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(out + j * 16, acc, ldo, wmma::mem_row_major);
    }
}

// acc (16, 16 * NCOL) fp32 strip (pitch ldo) += A (16, 16 * KT) @ B with B row-major (16 * KT, 16 * NCOL).
template <int NCOL, int KT>
__device__ __forceinline__ void mma_ab_acc(float *acc_s, int ldo, const bf16 *a, int lda, const bf16 *b, int ldb) {
#pragma unroll
    for (int n = 0; n < NCOL; n++) {
        FragC acc;
        wmma::load_matrix_sync(acc, acc_s + n * 16, ldo, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            FragA fa;
            FragBRow fb;
            wmma::load_matrix_sync(fa, a + kk * 16, lda);
            wmma::load_matrix_sync(fb, b + (size_t)kk * 16 * ldb + n * 16, ldb);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(acc_s + n * 16, acc, ldo, wmma::mem_row_major);
    }
}

// acc strip += (A_hi + A_lo) @ B: the same product with A carried as two bf16 parts (see the header).
template <int NCOL, int KT>
__device__ __forceinline__ void mma_ab2_acc(float *acc_s, int ldo, const bf16 *a_hi, const bf16 *a_lo, int lda,
                                            const bf16 *b, int ldb) {
#pragma unroll
    for (int n = 0; n < NCOL; n++) {
        FragC acc;
        wmma::load_matrix_sync(acc, acc_s + n * 16, ldo, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            FragA fh, fl;
            FragBRow fb;
            wmma::load_matrix_sync(fb, b + (size_t)kk * 16 * ldb + n * 16, ldb);
            wmma::load_matrix_sync(fh, a_hi + kk * 16, lda);
            wmma::load_matrix_sync(fl, a_lo + kk * 16, lda);
            wmma::mma_sync(acc, fh, fb, acc);
            wmma::mma_sync(acc, fl, fb, acc);
        }
        wmma::store_matrix_sync(acc_s + n * 16, acc, ldo, wmma::mem_row_major);
    }
}

// Stores x as a bf16 pair: hi = bf16(x), lo = bf16(x - hi).
__device__ __forceinline__ void store_split(bf16 *hi, bf16 *lo, float x) {
    const bf16 h = __float2bfloat16_rn(x);
    *hi = h;
    *lo = __float2bfloat16_rn(x - __bfloat162float(h));
}

// ---- forward ----------------------------------------------------------------------------------------

template <int DP, int BM>
__global__ void __launch_bounds__(AttnGeom<DP, BM>::THREADS)
attn_fwd_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const int32_t *cu, int B, int N,
                int Hq, int Hkv, int D, float scale_log2, int vec) {
    typedef AttnGeom<DP, BM> G;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *Qs = (bf16 *)smem;
    bf16 *Ks = (bf16 *)(smem + G::H_BYTES);
    bf16 *Vs = (bf16 *)(smem + 2 * G::H_BYTES);
    float *Ss = (float *)(smem + 3 * G::H_BYTES);
    bf16 *Ps = (bf16 *)(smem + 3 * G::H_BYTES + G::S_BYTES);
    float *Os = (float *)(smem + 3 * G::H_BYTES + G::S_BYTES + G::P_BYTES);
    __shared__ int seq_lo[BM];  // first visible key of each row, or INT_MAX for a row outside every sequence
    __shared__ float alpha_s[BM];
    __shared__ int kv_lo_s, kv_hi_s;

    const int h = blockIdx.y, g = h / (Hq / Hkv);
    const int q0 = blockIdx.x * BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        kv_lo_s = INT_MAX;
        kv_hi_s = 0;
    }
    for (int idx = threadIdx.x; idx < BM * G::LDO; idx += blockDim.x) Os[idx] = 0.0f;
    __syncthreads();
    for (int r = threadIdx.x; r < BM; r += blockDim.x) {
        const int i = q0 + r;
        const int b = i < N ? find_sequence(cu, B, i) : -1;
        seq_lo[r] = b >= 0 ? cu[b] : INT_MAX;
        if (b >= 0) {
            atomicMin(&kv_lo_s, cu[b]);
            atomicMax(&kv_hi_s, i + 1);
        }
    }
    load_tile<DP, BM>(Qs, q + (size_t)h * D, q0, N, Hq * D, D, vec);
    __syncthreads();
    const int kv_lo = kv_lo_s, kv_hi = kv_hi_s;

    // Row statistics of the warp's 16 rows live in lanes 0..15 (lane r holds row warp * 16 + r).
    float m_reg = -INFINITY, l_reg = 0.0f;
    const int wrow = warp * 16;
    for (int kt = kv_lo; kt < kv_hi; kt += BM) {
        load_tile<DP, BM>(Ks, k + (size_t)g * D, kt, kv_hi, Hkv * D, D, vec);
        load_tile<DP, BM>(Vs, v + (size_t)g * D, kt, kv_hi, Hkv * D, D, vec);
        __syncthreads();
        mma_abt<BM / 16, DP / 16>(Ss + wrow * G::LDS, G::LDS, Qs + wrow * G::LDH, G::LDH, Ks, G::LDH);
        __syncwarp();
        for (int r = 0; r < 16; r++) {
            const int row = wrow + r, i = q0 + row, lo = seq_lo[row];
            float sv[BM / 32];
            float mx = -INFINITY;
#pragma unroll
            for (int t = 0; t < BM / 32; t++) {
                const int c = lane + 32 * t, key = kt + c;
                const bool ok = key >= lo && key <= i && key < kv_hi;
                sv[t] = ok ? Ss[row * G::LDS + c] * scale_log2 : -INFINITY;
                mx = fmaxf(mx, sv[t]);
            }
            mx = warp_max(mx);
            const float m_old = __shfl_sync(0xffffffffu, m_reg, r);
            const float m_new = fmaxf(m_old, mx);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no visible key yet
            float sum = 0.0f;
#pragma unroll
            for (int t = 0; t < BM / 32; t++) {
                const float p = exp2f(sv[t] - m_use);
                Ps[row * G::LDP + lane + 32 * t] = __float2bfloat16_rn(p);
                sum += p;
            }
            sum = warp_sum(sum);
            const float alpha = exp2f(m_old - m_use);
            if (lane == r) {
                l_reg = l_reg * alpha + sum;
                m_reg = m_new;
                alpha_s[row] = alpha;
            }
        }
        __syncwarp();
        for (int idx = lane; idx < 16 * DP; idx += 32) {
            const int r = idx / DP, d = idx % DP;
            Os[(wrow + r) * G::LDO + d] *= alpha_s[wrow + r];
        }
        __syncwarp();
        mma_ab_acc<DP / 16, BM / 16>(Os + wrow * G::LDO, G::LDO, Ps + wrow * G::LDP, G::LDP, Vs, G::LDH);
        __syncthreads();  // K/V tiles are overwritten next iteration
    }
    // Lanes 0..15 publish 1 / l through alpha_s for the output pass of their warp and write lse.
    if (lane < 16) {
        const int row = wrow + lane, i = q0 + row;
        const bool valid = seq_lo[row] != INT_MAX;
        alpha_s[row] = valid ? 1.0f / l_reg : 0.0f;
        if (valid) lse[(size_t)i * Hq + h] = m_reg * LN2_F + logf(l_reg);
    }
    __syncwarp();
    for (int idx = lane; idx < 16 * D; idx += 32) {
        const int r = idx / D, d = idx % D, row = wrow + r, i = q0 + row;
        if (seq_lo[row] != INT_MAX) out[((size_t)i * Hq + h) * D + d] = __float2bfloat16_rn(Os[row * G::LDO + d] * alpha_s[row]);
    }
}

// ---- backward -----------------------------------------------------------------------------------------

// Delta (N, Hq) = rowsum(dout * out) per (token, head), one warp each; zero for tokens outside every sequence
// does not matter (their P is zero).
__global__ void attn_bwd_delta_kernel(float *delta, const bf16 *dout, const bf16 *out, size_t rows, int D) {
    const size_t row = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const bf16 *a = dout + row * D, *b = out + row * D;
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s += bf2f(a[d]) * bf2f(b[d]);
    s = warp_sum(s);
    if (lane == 0) delta[row] = s;
}

template <int DP, int BM>
__global__ void __launch_bounds__(AttnGeom<DP, BM>::THREADS)
attn_bwd_dq_kernel(bf16 *dq, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v, const float *lse,
                   const float *delta, const int32_t *cu, int B, int N, int Hq, int Hkv, int D, float scale,
                   float scale_log2, int vec) {
    typedef AttnGeom<DP, BM> G;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *Qs = (bf16 *)smem;
    bf16 *dOs = (bf16 *)(smem + G::H_BYTES);
    bf16 *Ks = (bf16 *)(smem + 2 * G::H_BYTES);
    bf16 *Vs = (bf16 *)(smem + 3 * G::H_BYTES);
    float *Ss = (float *)(smem + 4 * G::H_BYTES);
    float *dPs = (float *)(smem + 4 * G::H_BYTES + G::S_BYTES);
    bf16 *dSs = (bf16 *)(smem + 4 * G::H_BYTES + 2 * G::S_BYTES);                 // dS, high part
    bf16 *dSls = (bf16 *)(smem + 4 * G::H_BYTES + 2 * G::S_BYTES + G::P_BYTES);   // dS, remainder
    float *dQs = (float *)(smem + 4 * G::H_BYTES + 2 * G::S_BYTES + 2 * G::P_BYTES);
    __shared__ int seq_lo[BM];
    __shared__ float lse2_s[BM], delta_s[BM];
    __shared__ int kv_lo_s, kv_hi_s;

    const int h = blockIdx.y, g = h / (Hq / Hkv);
    const int q0 = blockIdx.x * BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        kv_lo_s = INT_MAX;
        kv_hi_s = 0;
    }
    for (int idx = threadIdx.x; idx < BM * G::LDO; idx += blockDim.x) dQs[idx] = 0.0f;
    __syncthreads();
    for (int r = threadIdx.x; r < BM; r += blockDim.x) {
        const int i = q0 + r;
        const int b = i < N ? find_sequence(cu, B, i) : -1;
        seq_lo[r] = b >= 0 ? cu[b] : INT_MAX;
        lse2_s[r] = b >= 0 ? lse[(size_t)i * Hq + h] * LOG2E_F : 0.0f;
        delta_s[r] = b >= 0 ? delta[(size_t)i * Hq + h] : 0.0f;
        if (b >= 0) {
            atomicMin(&kv_lo_s, cu[b]);
            atomicMax(&kv_hi_s, i + 1);
        }
    }
    load_tile<DP, BM>(Qs, q + (size_t)h * D, q0, N, Hq * D, D, vec);
    load_tile<DP, BM>(dOs, dout + (size_t)h * D, q0, N, Hq * D, D, vec);
    __syncthreads();
    const int kv_lo = kv_lo_s, kv_hi = kv_hi_s;
    const int wrow = warp * 16;
    for (int kt = kv_lo; kt < kv_hi; kt += BM) {
        load_tile<DP, BM>(Ks, k + (size_t)g * D, kt, kv_hi, Hkv * D, D, vec);
        load_tile<DP, BM>(Vs, v + (size_t)g * D, kt, kv_hi, Hkv * D, D, vec);
        __syncthreads();
        mma_abt<BM / 16, DP / 16>(Ss + wrow * G::LDS, G::LDS, Qs + wrow * G::LDH, G::LDH, Ks, G::LDH);
        mma_abt<BM / 16, DP / 16>(dPs + wrow * G::LDS, G::LDS, dOs + wrow * G::LDH, G::LDH, Vs, G::LDH);
        __syncwarp();
        for (int idx = lane; idx < 16 * BM; idx += 32) {
            const int r = idx / BM, c = idx % BM, row = wrow + r, i = q0 + row, key = kt + c;
            float ds = 0.0f;
            if (key >= seq_lo[row] && key <= i && key < kv_hi) {
                const float p = exp2f(Ss[row * G::LDS + c] * scale_log2 - lse2_s[row]);
                ds = p * (dPs[row * G::LDS + c] - delta_s[row]);
            }
            store_split(&dSs[row * G::LDP + c], &dSls[row * G::LDP + c], ds);
        }
        __syncwarp();
        mma_ab2_acc<DP / 16, BM / 16>(dQs + wrow * G::LDO, G::LDO, dSs + wrow * G::LDP, dSls + wrow * G::LDP, G::LDP,
                                      Ks, G::LDH);
        __syncthreads();
    }
    __syncwarp();
    for (int idx = lane; idx < 16 * D; idx += 32) {
        const int r = idx / D, d = idx % D, row = wrow + r, i = q0 + row;
        if (i < N) {  // rows outside every sequence get zero, as the CPU twin's overwrite leaves them
            const float val = seq_lo[row] != INT_MAX ? dQs[row * G::LDO + d] * scale : 0.0f;
            dq[((size_t)i * Hq + h) * D + d] = __float2bfloat16_rn(val);
        }
    }
}

template <int DP, int BM>
__global__ void __launch_bounds__(AttnGeom<DP, BM>::THREADS)
attn_bwd_dkdv_kernel(bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                     const float *lse, const float *delta, const int32_t *cu, int B, int N, int Hq, int Hkv, int D,
                     float scale, float scale_log2, int vec) {
    typedef AttnGeom<DP, BM> G;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *Ks = (bf16 *)smem;
    bf16 *Vs = (bf16 *)(smem + G::H_BYTES);
    bf16 *Qs = (bf16 *)(smem + 2 * G::H_BYTES);
    bf16 *dOs = (bf16 *)(smem + 3 * G::H_BYTES);
    float *Ss = (float *)(smem + 4 * G::H_BYTES);                 // S^T: rows keys, columns queries
    float *dPs = (float *)(smem + 4 * G::H_BYTES + G::S_BYTES);   // dP^T
    bf16 *Pts = (bf16 *)(smem + 4 * G::H_BYTES + 2 * G::S_BYTES);                  // P^T high / remainder
    bf16 *Ptls = (bf16 *)(smem + 4 * G::H_BYTES + 2 * G::S_BYTES + G::P_BYTES);
    bf16 *dSts = (bf16 *)(smem + 4 * G::H_BYTES + 2 * G::S_BYTES + 2 * G::P_BYTES); // dS^T high / remainder
    bf16 *dStls = (bf16 *)(smem + 4 * G::H_BYTES + 2 * G::S_BYTES + 3 * G::P_BYTES);
    float *dKs = (float *)(smem + 4 * G::H_BYTES + 2 * G::S_BYTES + 4 * G::P_BYTES);
    float *dVs = (float *)(smem + 4 * G::H_BYTES + 2 * G::S_BYTES + 4 * G::P_BYTES + G::O_BYTES);
    __shared__ int seq_hi[BM];  // end of each key's sequence (0 for a key outside every sequence)
    __shared__ float lse2_s[BM], delta_s[BM];
    __shared__ int q_lo_s, q_hi_s;

    const int g = blockIdx.y, group = Hq / Hkv;
    const int k0 = blockIdx.x * BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        q_lo_s = INT_MAX;
        q_hi_s = 0;
    }
    for (int idx = threadIdx.x; idx < BM * G::LDO; idx += blockDim.x) {
        dKs[idx] = 0.0f;
        dVs[idx] = 0.0f;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < BM; r += blockDim.x) {
        const int j = k0 + r;
        const int b = j < N ? find_sequence(cu, B, j) : -1;
        seq_hi[r] = b >= 0 ? min(cu[b + 1], N) : 0;
        if (b >= 0) {
            atomicMin(&q_lo_s, j);
            atomicMax(&q_hi_s, min(cu[b + 1], N));
        }
    }
    load_tile<DP, BM>(Ks, k + (size_t)g * D, k0, N, Hkv * D, D, vec);
    load_tile<DP, BM>(Vs, v + (size_t)g * D, k0, N, Hkv * D, D, vec);
    __syncthreads();
    const int q_lo = q_lo_s, q_hi = q_hi_s;
    const int wrow = warp * 16;
    for (int hh = 0; hh < group; hh++) {
        const int h = g * group + hh;
        for (int qt = q_lo; qt < q_hi; qt += BM) {
            load_tile<DP, BM>(Qs, q + (size_t)h * D, qt, q_hi, Hq * D, D, vec);
            load_tile<DP, BM>(dOs, dout + (size_t)h * D, qt, q_hi, Hq * D, D, vec);
            for (int c = threadIdx.x; c < BM; c += blockDim.x) {
                const int i = qt + c;
                lse2_s[c] = i < q_hi ? lse[(size_t)i * Hq + h] * LOG2E_F : 0.0f;
                delta_s[c] = i < q_hi ? delta[(size_t)i * Hq + h] : 0.0f;
            }
            __syncthreads();
            mma_abt<BM / 16, DP / 16>(Ss + wrow * G::LDS, G::LDS, Ks + wrow * G::LDH, G::LDH, Qs, G::LDH);
            mma_abt<BM / 16, DP / 16>(dPs + wrow * G::LDS, G::LDS, Vs + wrow * G::LDH, G::LDH, dOs, G::LDH);
            __syncwarp();
            for (int idx = lane; idx < 16 * BM; idx += 32) {
                const int r = idx / BM, c = idx % BM, row = wrow + r, j = k0 + row, i = qt + c;
                float p = 0.0f, ds = 0.0f;
                if (i >= j && i < seq_hi[row]) {
                    p = exp2f(Ss[row * G::LDS + c] * scale_log2 - lse2_s[c]);
                    ds = p * (dPs[row * G::LDS + c] - delta_s[c]);
                }
                store_split(&Pts[row * G::LDP + c], &Ptls[row * G::LDP + c], p);
                store_split(&dSts[row * G::LDP + c], &dStls[row * G::LDP + c], ds);
            }
            __syncwarp();
            mma_ab2_acc<DP / 16, BM / 16>(dVs + wrow * G::LDO, G::LDO, Pts + wrow * G::LDP, Ptls + wrow * G::LDP,
                                          G::LDP, dOs, G::LDH);
            mma_ab2_acc<DP / 16, BM / 16>(dKs + wrow * G::LDO, G::LDO, dSts + wrow * G::LDP, dStls + wrow * G::LDP,
                                          G::LDP, Qs, G::LDH);
            __syncthreads();  // Q/dO tiles are overwritten next iteration
        }
    }
    for (int idx = lane; idx < 16 * D; idx += 32) {
        const int r = idx / D, d = idx % D, row = wrow + r, j = k0 + row;
        if (j < N) {
            const bool valid = seq_hi[row] > 0;
            const size_t o = ((size_t)j * Hkv + g) * D + d;
            dk[o] = __float2bfloat16_rn(valid ? dKs[row * G::LDO + d] * scale : 0.0f);
            dv[o] = __float2bfloat16_rn(valid ? dVs[row * G::LDO + d] : 0.0f);
        }
    }
}

// ---- host side ----------------------------------------------------------------------------------------

static int attn_common_checks(OpsCtx *ctx, const char *name, int B, int N, int Hq, int Hkv, int D) {
    if (B < 0 || N < 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || Hq % Hkv != 0)
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "%s: bad shape B=%d N=%d Hq=%d Hkv=%d D=%d", name, B, N, Hq,
                             Hkv, D);
    if (D > 256)
        return ops_set_error(ctx, -1, __FILE__, __LINE__,
                             "%s: head_dim %d is larger than the CUDA attention kernels support (256)", name, D);
    if (Hq > 65535)
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "%s: %d query heads exceed the grid limit", name, Hq);
    return 0;
}

template <typename Kernel>
static int set_smem(OpsCtx *ctx, CudaState *st, Kernel kernel, int bytes, const char *name) {
    if ((size_t)bytes > st->max_smem_optin)
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "%s: needs %d bytes of shared memory, the device offers %zu",
                             name, bytes, st->max_smem_optin);
    CUDA_CHECK_RET(ctx, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), -1);
    return 0;
}

static int vec_ok(int D, const void *a, const void *b, const void *c, const void *d) {
    return D % 8 == 0 && ((((uintptr_t)a) | ((uintptr_t)b) | ((uintptr_t)c) | ((uintptr_t)d)) & 15) == 0;
}

template <int DP, int BM>
static void fwd_launch(OpsCtx *ctx, CudaState *st, bf16 *out, float *lse, const bf16 *q, const bf16 *k,
                       const bf16 *v, const int32_t *cu, int B, int N, int Hq, int Hkv, int D, float scale) {
    typedef AttnGeom<DP, BM> G;
    if (set_smem(ctx, st, attn_fwd_kernel<DP, BM>, G::FWD_SMEM, "attention_fwd") != 0) return;
    dim3 grid((N + BM - 1) / BM, Hq);
    attn_fwd_kernel<DP, BM><<<grid, G::THREADS, G::FWD_SMEM, st->stream>>>(out, lse, q, k, v, cu, B, N, Hq, Hkv, D,
                                                                           scale * LOG2E_F, vec_ok(D, q, k, v, q));
    CUDA_CHECK_LAUNCH(ctx);
}

template <int DP, int BM>
static void bwd_launch(OpsCtx *ctx, CudaState *st, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q,
                       const bf16 *k, const bf16 *v, const float *lse, const float *delta, const int32_t *cu, int B,
                       int N, int Hq, int Hkv, int D, float scale) {
    typedef AttnGeom<DP, BM> G;
    if (set_smem(ctx, st, attn_bwd_dq_kernel<DP, BM>, G::DQ_SMEM, "attention_bwd (dq)") != 0) return;
    if (set_smem(ctx, st, attn_bwd_dkdv_kernel<DP, BM>, G::DKDV_SMEM, "attention_bwd (dk, dv)") != 0) return;
    const int vec = vec_ok(D, q, k, v, dout);
    dim3 grid_q((N + BM - 1) / BM, Hq);
    attn_bwd_dq_kernel<DP, BM><<<grid_q, G::THREADS, G::DQ_SMEM, st->stream>>>(
        dq, dout, q, k, v, lse, delta, cu, B, N, Hq, Hkv, D, scale, scale * LOG2E_F, vec);
    CUDA_CHECK_LAUNCH(ctx);
    dim3 grid_k((N + BM - 1) / BM, Hkv);
    attn_bwd_dkdv_kernel<DP, BM><<<grid_k, G::THREADS, G::DKDV_SMEM, st->stream>>>(
        dk, dv, dout, q, k, v, lse, delta, cu, B, N, Hq, Hkv, D, scale, scale * LOG2E_F, vec);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_attention_fwd(OpsCtx *ctx, void *out, float *lse, const void *q, const void *k, const void *v,
                        const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale) {
    CudaState *st = cuda_enter(ctx);
    if (!st || attn_common_checks(ctx, "attention_fwd", B, N, Hq, Hkv, D) != 0) return;
    if (N == 0 || B == 0) return;
    bf16 *o = (bf16 *)out;
    const bf16 *qb = (const bf16 *)q, *kb = (const bf16 *)k, *vb = (const bf16 *)v;
    if (D <= 32) fwd_launch<32, 64>(ctx, st, o, lse, qb, kb, vb, cu_seqlens, B, N, Hq, Hkv, D, scale);
    else if (D <= 64) fwd_launch<64, 64>(ctx, st, o, lse, qb, kb, vb, cu_seqlens, B, N, Hq, Hkv, D, scale);
    else if (D <= 128) fwd_launch<128, 64>(ctx, st, o, lse, qb, kb, vb, cu_seqlens, B, N, Hq, Hkv, D, scale);
    else fwd_launch<256, 32>(ctx, st, o, lse, qb, kb, vb, cu_seqlens, B, N, Hq, Hkv, D, scale);
}

void cuda_attention_bwd(OpsCtx *ctx, void *dq, void *dk, void *dv, const void *dout, const void *q,
                        const void *k, const void *v, const void *out, const float *lse,
                        const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale) {
    CudaState *st = cuda_enter(ctx);
    if (!st || attn_common_checks(ctx, "attention_bwd", B, N, Hq, Hkv, D) != 0) return;
    if (N == 0) return;
    if (B == 0) {  // no sequence: every gradient is zero (overwrite semantics)
        CUDA_CHECK(ctx, cudaMemsetAsync(dq, 0, (size_t)N * Hq * D * sizeof(bf16), st->stream));
        CUDA_CHECK(ctx, cudaMemsetAsync(dk, 0, (size_t)N * Hkv * D * sizeof(bf16), st->stream));
        CUDA_CHECK(ctx, cudaMemsetAsync(dv, 0, (size_t)N * Hkv * D * sizeof(bf16), st->stream));
        return;
    }
    const size_t rows = (size_t)N * Hq;
    float *delta = (float *)cuda_scratch(ctx, st, rows * sizeof(float));
    if (!delta) return;
    attn_bwd_delta_kernel<<<(unsigned)((rows * 32 + 255) / 256), 256, 0, st->stream>>>(delta, (const bf16 *)dout,
                                                                                         (const bf16 *)out, rows, D);
    CUDA_CHECK_LAUNCH(ctx);
    bf16 *dqb = (bf16 *)dq, *dkb = (bf16 *)dk, *dvb = (bf16 *)dv;
    const bf16 *dob = (const bf16 *)dout, *qb = (const bf16 *)q, *kb = (const bf16 *)k, *vb = (const bf16 *)v;
    if (D <= 32)
        bwd_launch<32, 64>(ctx, st, dqb, dkb, dvb, dob, qb, kb, vb, lse, delta, cu_seqlens, B, N, Hq, Hkv, D, scale);
    else if (D <= 64)
        bwd_launch<64, 64>(ctx, st, dqb, dkb, dvb, dob, qb, kb, vb, lse, delta, cu_seqlens, B, N, Hq, Hkv, D, scale);
    else if (D <= 128)
        bwd_launch<128, 64>(ctx, st, dqb, dkb, dvb, dob, qb, kb, vb, lse, delta, cu_seqlens, B, N, Hq, Hkv, D, scale);
    else
        bwd_launch<256, 32>(ctx, st, dqb, dkb, dvb, dob, qb, kb, vb, lse, delta, cu_seqlens, B, N, Hq, Hkv, D, scale);
}
