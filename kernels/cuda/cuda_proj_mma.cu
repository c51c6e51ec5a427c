// kernels/cuda/cuda_proj_mma.cu — ops_matmul_fused_fwd on bf16 tensor cores for decode steps of 3 .. PJ_MAX_ROWS
// rows: out (N, n_out) = epilogue(prologue(in) (N, IC) @ w^T (OC, IC) + bias), one kernel per projection.
//
// Why: a decode step of a few hundred sequences runs each projection as a cuBLASLt GEMM of 3-18 us with an RMSNorm
// (4 us) before the q|k|v and gate/up projections and a SwiGLU (7 us) after gate/up; the norm and SwiGLU kernels
// move little data and mostly pay their launch and drain. Here the norm, SwiGLU and the residual add ride inside
// the GEMM, so a decode layer is five kernels (q|k|v, attention, o, gate/up, down) instead of eight.
//
// The GEMM: a block computes BM rows x PJ_BN weight rows, 4 or 8 warps of 32 x 32 or 64 x 32 output tiles
// (mma.sync m16n8k16, fp32 accumulators); k tiles of PJ_BK stream through a 3- or 4-deep cp.async pipeline, rows
// padded to PJ_BK + 8 elements so the ldmatrix rows fall in different banks (as in the attention kernels).
//   prologue RMSNorm: y = r (sum_k (g_k x_k) w_k) with r = 1 / sqrt(mean x^2 + eps) of the row: every block streams
//     its rows' whole K anyway, so it sums x^2 from the tiles it loads and multiplies the A tile by the norm weight
//     g in shared memory (rounded to bf16) before the products; r scales the fp32 sums in the epilogue. The
//     unfused sequence rounds h = g (x r) to bf16 instead, so the two differ by a bf16 rounding of the input;
//   epilogue SwiGLU: the block's weight rows interleave gate row j and up row I + j, so one thread holds both sums
//     of output j; each rounded to bf16 as the stored projection would be, then silu(g) u (cuda_swiglu.cu);
//   epilogue residual: the projection rounded to bf16, plus the residual, rounded again (ops_add_inplace's).
// Tiles: 32, 64 or 128 rows (the smallest that holds N, up to 128: each weight tile is then read from L2 once per
// 128 rows at most). Few rows make few tiles, so K is split until about two blocks per SM stream the weights
// (split-K); each split writes its fp32 sums (and its share of the rows' x^2) to scratch, and the last block of a
// tile to arrive (a counter per tile in CudaState.split_count, re-armed by that block) adds the splits in split
// order — the same bits whichever block is last — and runs the epilogue.
// TANDEM_PROJ_MMA=0 turns it off (the unfused sequence runs; for comparisons).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_attention.cuh"   // cp.async, ldmatrix and mma.sync helpers
#include "kernels/cuda/cuda_ops.h"

#define PJ_BN 128           // weight rows per block (SwiGLU: 64 gate rows interleaved with their 64 up rows)
#define PJ_BK 64            // k per pipeline stage
#define PJ_LD (PJ_BK + 8)   // shared-memory row pitch (elements)
#define PJ_MAX_SPLITS 16

enum { PJ_PLAIN = 0, PJ_SWIGLU = 1, PJ_RESIDUAL = 2 };

struct ProjArgs {
    bf16 *out;                        // (N, OC), or (N, OC / 2) with SwiGLU
    const bf16 *in, *w, *bias;        // (N, IC), (OC, IC), (OC) or NULL
    const bf16 *norm_w;               // (IC) prologue RMSNorm weight or NULL
    const bf16 *residual;             // (N, OC) epilogue residual (PJ_RESIDUAL)
    float eps;
    int N, IC, OC;
    int splits, kt_per;               // split-K: blockIdx.z takes k tiles [z kt_per, (z + 1) kt_per)
    float *part;                      // splits > 1: (tiles, splits, BM * PJ_BN + BM) fp32 partial sums and x^2
    int *count;                       // splits > 1: (tiles) arrivals, 0 between launches
};

// BM rows per block: WARPS_M x 4 warps, each WM x 32 outputs (MT m16 tiles x 4 n8 tiles).
template <int BM> struct PjCfg {
    static constexpr int WARPS_M = BM >= 64 ? 2 : 1;
    static constexpr int THREADS = WARPS_M * 4 * 32;
    static constexpr int WM = BM / WARPS_M, MT = WM / 16;
    static constexpr int A_PER = BM * (PJ_BK / 8) / THREADS;      // 16-byte A chunks a thread copies per stage
    static constexpr int B_PER = PJ_BN * (PJ_BK / 8) / THREADS;   // and B chunks
    static constexpr int ROW_STEP = THREADS / (PJ_BK / 8);        // rows between a thread's chunks
    static constexpr int STAGES = BM == 128 ? 3 : 4;              // deep enough to keep ~100 KB per SM in flight
    static constexpr int STAGE = (BM + PJ_BN) * PJ_LD;            // elements: A tile then B tile
    static constexpr int SMEM = STAGES * STAGE * (int)sizeof(bf16);
    static constexpr int PART = BM * PJ_BN + BM;                  // floats of one split's partial tile
    static_assert(WM % 16 == 0 && A_PER >= 1 && B_PER >= 1, "tile shape");
};

template <int BM, int MODE, bool NORM>
__global__ void __launch_bounds__(PjCfg<BM>::THREADS) proj_mma_kernel(const ProjArgs a) {
    using C = PjCfg<BM>;
    constexpr int MT = C::MT, WM = C::WM;
    extern __shared__ __align__(16) unsigned char pj_smem[];
    bf16 *smem = reinterpret_cast<bf16 *>(pj_smem);
    __shared__ float r_s[BM];   // NORM: each row's 1 / rms

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tq = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * PJ_BN;   // first row, first weight row (tile space)
    const int I = a.OC / 2;
    const int cc = tid & 7, r0 = tid >> 3;   // this thread's chunk of a tile row, its first row

    // Sources of this thread's chunks (row r0 + j ROW_STEP of the A and B tiles); rows past N or OC are zero-filled.
    const bf16 *asrc[C::A_PER], *bsrc[C::B_PER];
    bool aok[C::A_PER], bok[C::B_PER];
#pragma unroll
    for (int j = 0; j < C::A_PER; j++) {
        const int row = m0 + r0 + j * C::ROW_STEP;
        aok[j] = row < a.N;
        asrc[j] = a.in + (size_t)(aok[j] ? row : 0) * a.IC + cc * 8;
    }
#pragma unroll
    for (int j = 0; j < C::B_PER; j++) {
        const int n = r0 + j * C::ROW_STEP;
        int wrow;
        if (MODE == PJ_SWIGLU) {   // tile row n: gate row (n0 + n) / 2 when n is even, its up row when odd
            const int o = (n0 + n) >> 1;
            bok[j] = o < I;
            wrow = (n & 1) ? I + o : o;
        } else {
            wrow = n0 + n;
            bok[j] = wrow < a.OC;
        }
        bsrc[j] = a.w + (size_t)(bok[j] ? wrow : 0) * a.IC + cc * 8;
    }
    const int KT = (a.IC + PJ_BK - 1) / PJ_BK;
    const int kt0 = blockIdx.z * a.kt_per, kt1 = min(KT, kt0 + a.kt_per);   // this split's k tiles
    auto load_stage = [&](int kt) {
        bf16 *sa = smem + ((kt - kt0) % C::STAGES) * C::STAGE, *sb = sa + BM * PJ_LD;
        const int k = kt * PJ_BK;
        const bool kok = k + cc * 8 < a.IC;
#pragma unroll
        for (int j = 0; j < C::A_PER; j++)
            attn_cp_async16(sa + (r0 + j * C::ROW_STEP) * PJ_LD + cc * 8, asrc[j] + k, aok[j] && kok);
#pragma unroll
        for (int j = 0; j < C::B_PER; j++)
            attn_cp_async16(sb + (r0 + j * C::ROW_STEP) * PJ_LD + cc * 8, bsrc[j] + k, bok[j] && kok);
    };
#pragma unroll
    for (int s = 0; s < C::STAGES - 1; s++) {
        if (kt0 + s < kt1) load_stage(kt0 + s);
        attn_cp_async_commit();   // empty groups too: the wait below counts groups
    }

    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;   // ldmatrix: A operand
    const int b_row = (lane & 7) + (lane >> 4) * 8, b_col = ((lane >> 3) & 1) * 8;   // B with n as the stored row
    float acc[MT][4][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
    float ss[C::A_PER];   // NORM: this thread's share of each of its rows' sum of squares
#pragma unroll
    for (int j = 0; j < C::A_PER; j++) ss[j] = 0.0f;

    for (int kt = kt0; kt < kt1; kt++) {
        uint4 g = make_uint4(0, 0, 0, 0);
        const int kc = kt * PJ_BK + cc * 8;
        if (NORM && kc < a.IC) g = __ldg(reinterpret_cast<const uint4 *>(a.norm_w + kc));
        attn_cp_async_wait<C::STAGES - 2>();
        __syncthreads();   // tile kt is in place for every thread; every warp is done with tile kt - 1's buffer
        if (kt + C::STAGES - 1 < kt1) load_stage(kt + C::STAGES - 1);
        attn_cp_async_commit();
        bf16 *sa = smem + ((kt - kt0) % C::STAGES) * C::STAGE, *sb = sa + BM * PJ_LD;
        if (NORM) {   // x -> g x in place (the chunks this thread copied), x^2 summed
            float gf[8];
            unpack8f(g, gf);
#pragma unroll
            for (int j = 0; j < C::A_PER; j++) {
                uint4 *p = reinterpret_cast<uint4 *>(sa + (r0 + j * C::ROW_STEP) * PJ_LD + cc * 8);
                float x[8];
                unpack8f(*p, x);
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    ss[j] = fmaf(x[e], x[e], ss[j]);
                    x[e] *= gf[e];
                }
                *p = pack8f(x);
            }
            __syncthreads();
        }
        const bf16 *wa = sa + wm * WM * PJ_LD, *wb = sb + wn * 32 * PJ_LD;
#pragma unroll
        for (int kk = 0; kk < PJ_BK / 16; kk++) {
            uint32_t af[MT][4], bfr[2][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) attn_ldsm4(af[mt], wa + (mt * 16 + a_row) * PJ_LD + kk * 16 + a_col);
#pragma unroll
            for (int p = 0; p < 2; p++) attn_ldsm4(bfr[p], wb + (p * 16 + b_row) * PJ_LD + kk * 16 + b_col);
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
                    attn_mma(acc[mt][nt], af[mt], bfr[nt >> 1][(nt & 1) * 2], bfr[nt >> 1][(nt & 1) * 2 + 1]);
        }
    }
    attn_cp_async_wait<0>();
    if (NORM) {   // the 8 threads of a row (lanes differing in their low 3 bits) add their shares
#pragma unroll
        for (int j = 0; j < C::A_PER; j++) {
            ss[j] += __shfl_xor_sync(0xffffffffu, ss[j], 1);
            ss[j] += __shfl_xor_sync(0xffffffffu, ss[j], 2);
            ss[j] += __shfl_xor_sync(0xffffffffu, ss[j], 4);
        }
    }
    if (a.splits > 1) {   // split-K: publish this split's sums; the tile's last block adds them all
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        float *tile_part = a.part + (size_t)tile * a.splits * C::PART;
        float *mine = tile_part + (size_t)blockIdx.z * C::PART;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) __stcg(mine + ((mt * 4 + nt) * 4 + e) * C::THREADS + tid, acc[mt][nt][e]);
        if (NORM && cc == 0)
#pragma unroll
            for (int j = 0; j < C::A_PER; j++) __stcg(mine + BM * PJ_BN + r0 + j * C::ROW_STEP, ss[j]);
        __threadfence();
        __syncthreads();
        __shared__ int last;
        if (tid == 0) last = atomicAdd(a.count + tile, 1) == a.splits - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();   // the other splits' sums, published before their arrivals, are visible from here
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mt][nt][e] = 0.0f;
#pragma unroll
        for (int j = 0; j < C::A_PER; j++) ss[j] = 0.0f;
        for (int z = 0; z < a.splits; z++) {   // in split order, whichever block got here
            const float *pz = tile_part + (size_t)z * C::PART;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        acc[mt][nt][e] += __ldcg(pz + ((mt * 4 + nt) * 4 + e) * C::THREADS + tid);
            if (NORM)
#pragma unroll
                for (int j = 0; j < C::A_PER; j++) ss[j] += __ldcg(pz + BM * PJ_BN + r0 + j * C::ROW_STEP);
        }
        if (tid == 0) a.count[tile] = 0;   // re-armed for the next launch (stream order: no block of it runs yet)
    }
    if (NORM) {
        if (cc == 0)
#pragma unroll
            for (int j = 0; j < C::A_PER; j++) r_s[r0 + j * C::ROW_STEP] = 1.0f / sqrtf(ss[j] / (float)a.IC + a.eps);
        __syncthreads();
    }

    // acc[mt][nt][2 h + e]: row wm WM + 16 mt + gr + 8 h, tile column wn 32 + 8 nt + 2 tq + e.
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int lrow = wm * WM + mt * 16 + gr + 8 * h, row = m0 + lrow;
            if (row >= a.N) continue;
            const float rs = NORM ? r_s[lrow] : 1.0f;
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const int n = wn * 32 + nt * 8 + 2 * tq;
                const float v0 = acc[mt][nt][2 * h] * rs, v1 = acc[mt][nt][2 * h + 1] * rs;
                if (MODE == PJ_SWIGLU) {
                    const int o = (n0 + n) >> 1;
                    if (o >= I) continue;
                    const float gv = bf2f(f2bf(v0 + (a.bias ? bf2f(a.bias[o]) : 0.0f)));
                    const float uv = bf2f(f2bf(v1 + (a.bias ? bf2f(a.bias[I + o]) : 0.0f)));
                    a.out[(size_t)row * I + o] = f2bf(silu_f(gv) * uv);
                } else {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int col = n0 + n + e;
                        if (col >= a.OC) continue;
                        const float y = (e ? v1 : v0) + (a.bias ? bf2f(a.bias[col]) : 0.0f);
                        const size_t idx = (size_t)row * a.OC + col;
                        a.out[idx] = MODE == PJ_RESIDUAL ? f2bf(bf2f(a.residual[idx]) + bf2f(f2bf(y))) : f2bf(y);
                    }
                }
            }
        }
}

// ---- host side ---------------------------------------------------------------------------------------

static int proj_mma_enabled(void) {
    static int on = -1;   // read once per process
    if (on < 0) {
        const char *v = getenv("TANDEM_PROJ_MMA");
        on = !(v && strcmp(v, "0") == 0);
    }
    return on;
}

// The shared-memory opt-in of one variant, once per device (so a launch recorded into a CUDA graph makes no
// attribute call while captured). Returns 0, or 1 with the error recorded.
template <int BM, int MODE, bool NORM> static int pj_opt_in(OpsCtx *ctx, CudaState *st) {
    static int done[64];
    const int dev = st->device;
    if (dev < 64 && __atomic_load_n(&done[dev], __ATOMIC_ACQUIRE)) return 0;
    if (attn_set_smem(ctx, st, proj_mma_kernel<BM, MODE, NORM>, PjCfg<BM>::SMEM, "matmul_fused_fwd (tensor cores)"))
        return 1;
    if (dev < 64) __atomic_store_n(&done[dev], 1, __ATOMIC_RELEASE);
    return 0;
}

template <int BM, int MODE, bool NORM> static void pj_launch(OpsCtx *ctx, CudaState *st, const ProjArgs &a) {
    if (pj_opt_in<BM, MODE, NORM>(ctx, st)) return;
    const dim3 grid((unsigned)((a.OC + PJ_BN - 1) / PJ_BN), (unsigned)((a.N + BM - 1) / BM), (unsigned)a.splits);
    proj_mma_kernel<BM, MODE, NORM><<<grid, PjCfg<BM>::THREADS, PjCfg<BM>::SMEM, st->stream>>>(a);
    CUDA_CHECK_LAUNCH(ctx);
}

template <int MODE, bool NORM> static void pj_launch_bm(OpsCtx *ctx, CudaState *st, const ProjArgs &a, int bm) {
    if (bm == 128) pj_launch<128, MODE, NORM>(ctx, st, a);
    else if (bm == 64) pj_launch<64, MODE, NORM>(ctx, st, a);
    else pj_launch<32, MODE, NORM>(ctx, st, a);
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

int cuda_proj_mma_fwd(OpsCtx *ctx, CudaState *st, void *out, const void *in, const void *w, const void *bias, int N,
                      int IC, int OC, const OpsProjFusion *f) {
    if (!proj_mma_enabled() || N < 1 || N > PJ_MAX_ROWS || IC < 8 || IC % 8 || f->rope_store || !aligned16(in) ||
        !aligned16(w) || (f->norm_w && !aligned16(f->norm_w)) || ((uintptr_t)bias & 1) ||
        ((uintptr_t)f->residual & 1) || ((uintptr_t)out & 1))
        return 0;
    ProjArgs a = {};
    a.out = (bf16 *)out;
    a.in = (const bf16 *)in;
    a.w = (const bf16 *)w;
    a.bias = (const bf16 *)bias;
    a.norm_w = (const bf16 *)f->norm_w;
    a.residual = (const bf16 *)f->residual;
    a.eps = f->eps;
    a.N = N;
    a.IC = IC;
    a.OC = OC;
    // The smallest tile height that holds the rows (up to 128), then K split until about two blocks per SM stream
    // the weights, each split at least two k tiles long.
    const int bm = N <= 32 ? 32 : N <= 64 ? 64 : 128;
    const long tiles = (long)((OC + PJ_BN - 1) / PJ_BN) * ((N + bm - 1) / bm);
    const int KT = (IC + PJ_BK - 1) / PJ_BK;
    long splits = (2L * st->sm_count + tiles - 1) / tiles;
    if (splits > KT / 2) splits = KT / 2;
    if (splits > PJ_MAX_SPLITS) splits = PJ_MAX_SPLITS;
    if (splits < 1 || tiles > SPLIT_COUNT_WORDS) splits = 1;
    a.kt_per = (int)((KT + splits - 1) / splits);
    a.splits = (KT + a.kt_per - 1) / a.kt_per;   // no empty split
    if (a.splits > 1) {
        a.part = (float *)cuda_scratch(ctx, st, (size_t)tiles * a.splits * ((size_t)bm * PJ_BN + bm) * sizeof(float));
        if (!a.part) return 1;   // the error is recorded
        a.count = st->split_count;
    }
    const int mode = f->swiglu ? PJ_SWIGLU : f->residual ? PJ_RESIDUAL : PJ_PLAIN;
    const bool norm = f->norm_w != NULL;
    if (mode == PJ_SWIGLU) norm ? pj_launch_bm<PJ_SWIGLU, true>(ctx, st, a, bm)
                                : pj_launch_bm<PJ_SWIGLU, false>(ctx, st, a, bm);
    else if (mode == PJ_RESIDUAL) norm ? pj_launch_bm<PJ_RESIDUAL, true>(ctx, st, a, bm)
                                       : pj_launch_bm<PJ_RESIDUAL, false>(ctx, st, a, bm);
    else norm ? pj_launch_bm<PJ_PLAIN, true>(ctx, st, a, bm) : pj_launch_bm<PJ_PLAIN, false>(ctx, st, a, bm);
    return 1;
}
