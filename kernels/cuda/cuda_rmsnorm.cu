// kernels/cuda/cuda_rmsnorm.cu — RMSNorm as Hugging Face's LlamaRMSNorm computes it, alone or with the
// residual add before it fused in: bf16 storage, fp32 math, r = 1 / sqrt(mean(x^2) + eps), out = w * (x * r).
//
// Work layout. A row of C elements is nvec = ceil(C / 8) vectors of 8 bf16 (16 bytes). A group of G threads
// owns a row; thread t of the group owns vectors t, t + G, ..., t + (VPT - 1) G, for every row it visits, and
// keeps them in registers between the row's reduction and its outputs, so each tensor crosses memory once.
// Narrow rows (nvec <= 32: the q/k norms over head_dim) give G = the next power of two of nvec and several rows
// per 256-thread block, reduced with shuffles inside the group; wider rows give one row per block, G a multiple
// of 32 of at most 256 threads, VPT = 1, 2, 4 or 8 (C up to 16384), reduced across warps through shared memory.
// Rows whose width is a multiple of 8 on 16-byte aligned buffers move as 16-byte vectors; others element by
// element into the same registers, so the arithmetic (and its order) depends on C alone.
//
// Rounding, the same as the unfused ops: the residual sum is rounded to bf16 once, stored, and the norm reads
// the rounded value; out is rounded once. A plain norm of a stored x_out therefore repeats the fused op's out and
// rstd bit for bit (activation-checkpoint recompute relies on it). The backward rounds dres_out once.
#include "kernels/cuda/cuda_common.cuh"

enum { RMS_MAX_VPT = 8, RMS_MAX_GROUP = 256, RMS_NARROW_BLOCK = 256 };
// Backward blocks loop over rows and keep their dw partial in registers. 1024 / VPT resident threads per SM (with
// the next row's loads in flight while a row is processed) cover memory latency, and fewer blocks mean fewer
// partial rows for the final column sum. The launch bounds cap registers at 64 x VPT per thread so that this many
// fit on an SM — the grid is exactly one wave without asking the occupancy API at every call.
enum { RMS_BWD_THREADS_PER_SM = 1024 };
#define RMS_BWD_MIN_BLOCKS(VPT) ((VPT) < 4 ? 4 / (VPT) : 1)

typedef struct {
    int G;        // threads per row
    int vpt;      // vectors per thread
    int threads;  // per block
    int rows;     // rows per block (threads / G)
} RowGeom;

static int row_geom(int C, RowGeom *g) {
    const int nvec = (C + 7) / 8;
    if (nvec <= 32) {
        int G = 1;
        while (G < nvec) G *= 2;
        *g = (RowGeom){G, 1, RMS_NARROW_BLOCK, RMS_NARROW_BLOCK / G};
        return 0;
    }
    int vpt = 1;
    while (vpt < RMS_MAX_VPT && nvec > vpt * RMS_MAX_GROUP) vpt *= 2;
    if (nvec > vpt * RMS_MAX_GROUP) return -1;
    const int G = (nvec + 32 * vpt - 1) / (32 * vpt) * 32;
    *g = (RowGeom){G, vpt, G, 1};
    return 0;
}

// ---- 8-element vectors ------------------------------------------------------------------------------

// Vector v of a row (8 bf16 as packed bits; zeros past C). vec: C % 8 == 0 and the row is 16-byte aligned.
__device__ __forceinline__ uint4 load8(const bf16 *row, int v, int C, bool vec) {
    uint4 r = make_uint4(0u, 0u, 0u, 0u);
    const int c0 = v * 8;
    if (c0 >= C) return r;
    if (vec) return *reinterpret_cast<const uint4 *>(row + c0);
    unsigned short h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < 8; k++)
        if (c0 + k < C) h[k] = __bfloat16_as_ushort(row[c0 + k]);
    r.x = h[0] | (unsigned)h[1] << 16;
    r.y = h[2] | (unsigned)h[3] << 16;
    r.z = h[4] | (unsigned)h[5] << 16;
    r.w = h[6] | (unsigned)h[7] << 16;
    return r;
}

__device__ __forceinline__ void store8(bf16 *row, int v, int C, bool vec, uint4 val) {
    const int c0 = v * 8;
    if (c0 >= C) return;
    if (vec) {
        *reinterpret_cast<uint4 *>(row + c0) = val;
        return;
    }
    const unsigned words[4] = {val.x, val.y, val.z, val.w};
#pragma unroll
    for (int k = 0; k < 8; k++)
        if (c0 + k < C) row[c0 + k] = __ushort_as_bfloat16((unsigned short)(words[k / 2] >> (16 * (k % 2))));
}

// Element k (0..7, a constant after unrolling) of a packed vector, widened to fp32.
__device__ __forceinline__ float bf_at(uint4 u, int k) {
    const unsigned word = k < 2 ? u.x : k < 4 ? u.y : k < 6 ? u.z : u.w;
    return __uint_as_float(k % 2 ? word & 0xffff0000u : word << 16);
}

// Sum over the G threads of a row group; all of them get it. Groups of up to 32 threads are aligned inside a
// warp (xor shuffles stay in the group; every lane of the warp takes part); a larger group is the whole block
// and meets in red[parity] — alternate the parity between consecutive calls and one barrier per call suffices.
__device__ __forceinline__ float group_sum(float v, int G, float (*red)[32], int parity) {
    if (G <= 32) {
        for (int o = G >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    }
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[parity][threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < (G >> 5); i++) s += red[parity][i];
    return s;
}

// ---- forward ------------------------------------------------------------------------------------------

// x_out, out, x, res (N, C); w (C); rstd (N) or NULL. res NULL: plain norm, x_out unused. x_out may alias x or
// res: every element is loaded before any store of the thread, and only its own thread touches it.
template <int VPT>
__global__ void __launch_bounds__(RMS_NARROW_BLOCK) rmsnorm_fwd_kernel(bf16 *x_out, bf16 *out, float *rstd,
                                                                      const bf16 *x, const bf16 *res, const bf16 *w,
                                                                      int N, int C, int G, float eps, int vec) {
    __shared__ float red[2][32];
    const int t = threadIdx.x % G;
    const int row = blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
    const bool live = row < N;
    const size_t off = (size_t)(live ? row : 0) * C;
    uint4 a[VPT], b[VPT], wp[VPT];  // all loads issued up front; w's before the reduction hides its latency
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        a[j] = live ? load8(x + off, t + j * G, C, vec) : make_uint4(0u, 0u, 0u, 0u);
        b[j] = live && res ? load8(res + off, t + j * G, C, vec) : make_uint4(0u, 0u, 0u, 0u);
        wp[j] = load8(w, t + j * G, C, vec);
    }
    float v[VPT][8];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        unpack8f(a[j], v[j]);
        if (res) {
            float r8[8];
            unpack8f(b[j], r8);
#pragma unroll
            for (int k = 0; k < 8; k++) r8[k] += v[j][k];
            const uint4 s = pack8f(r8);
            if (live) store8(x_out + off, t + j * G, C, vec, s);
            unpack8f(s, v[j]);  // the norm sees the rounded sum, as it would read it back
        }
#pragma unroll
        for (int k = 0; k < 8; k++) ss += v[j][k] * v[j][k];
    }
    ss = group_sum(ss, G, red, 0);
    const float r = 1.0f / sqrtf(ss / (float)C + eps);
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        float wv[8], o[8];
        unpack8f(wp[j], wv);
#pragma unroll
        for (int k = 0; k < 8; k++) o[k] = wv[k] * (v[j][k] * r);
        if (live) store8(out + off, t + j * G, C, vec, pack8f(o));
    }
    if (rstd && live && t == 0) rstd[row] = r;
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

void cuda_residual_rmsnorm_fwd(OpsCtx *ctx, void *x_out, void *out, float *rstd, const void *x, const void *residual,
                               const void *w, int N, int C, float eps) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    RowGeom g;
    CUDA_ARG_CHECK(ctx, N >= 0 && C > 0 && row_geom(C, &g) == 0,
                   "rmsnorm_fwd: bad shape N=%d C=%d (C at most %d)", N, C, 8 * RMS_MAX_VPT * RMS_MAX_GROUP);
    if (N == 0) return;
    const int vec = C % 8 == 0 && aligned16(out) && aligned16(x) && aligned16(w) &&
                    (!residual || (aligned16(x_out) && aligned16(residual)));
    const unsigned blocks = (unsigned)((N + g.rows - 1) / g.rows);
    typedef void (*Kernel)(bf16 *, bf16 *, float *, const bf16 *, const bf16 *, const bf16 *, int, int, int, float,
                           int);
    const Kernel k = g.vpt == 1   ? rmsnorm_fwd_kernel<1>
                     : g.vpt == 2 ? rmsnorm_fwd_kernel<2>
                     : g.vpt == 4 ? rmsnorm_fwd_kernel<4>
                                  : rmsnorm_fwd_kernel<8>;
    k<<<blocks, g.threads, 0, st->stream>>>((bf16 *)x_out, (bf16 *)out, rstd, (const bf16 *)x, (const bf16 *)residual,
                                            (const bf16 *)w, N, C, g.G, eps, vec);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_rmsnorm_fwd(OpsCtx *ctx, void *out, float *rstd, const void *x, const void *w, int N, int C, float eps) {
    cuda_residual_rmsnorm_fwd(ctx, NULL, out, rstd, x, NULL, w, N, C, eps);
}

// ---- backward -----------------------------------------------------------------------------------------

// One row's inputs as loaded (packed bf16) plus its rstd: loaded one row ahead of its use.
template <int VPT>
struct BwdRow {
    uint4 g[VPT], x[VPT], d[VPT];
    float r;
};

template <int VPT>
__device__ __forceinline__ void bwd_load(BwdRow<VPT> &b, const bf16 *dout, const bf16 *x, const bf16 *din,
                                         const float *rstd, int row, int N, int C, int t, int G, bool vec) {
    const bool live = row < N;
    const size_t off = (size_t)(live ? row : 0) * C;
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        b.g[j] = live ? load8(dout + off, t + j * G, C, vec) : z;
        b.x[j] = live ? load8(x + off, t + j * G, C, vec) : z;
        b.d[j] = live && din ? load8(din + off, t + j * G, C, vec) : z;
    }
    b.r = live ? rstd[row] : 0.0f;
}

// With g = dout, x = x_out, r = rstd[n]:
//   dres_out_i = dres_in_i + (r w_i g_i - x_i k),  k = r^3 / C * sum_j g_j w_j x_j ;   dw_i += g_i x_i r.
// Blocks stride over rows (every thread of a block runs the same number of iterations, so the group
// reductions stay converged); each thread accumulates dw for the columns it owns, the block's groups add theirs
// in group order, and the block writes one row of partials (gridDim.x, C), summed in block order by
// column_sum_kernel — dw is deterministic. partials NULL: no dw.
template <int VPT>
__global__ void __launch_bounds__(RMS_NARROW_BLOCK, RMS_BWD_MIN_BLOCKS(VPT))
    rmsnorm_bwd_kernel(bf16 *dres_out, float *partials, const bf16 *dres_in, const bf16 *dout, const bf16 *x,
                       const bf16 *w, const float *rstd, int N, int C, int G, int vec) {
    extern __shared__ float dw_rows[];  // (rows per block, nvec * 8), used when a block holds several groups
    __shared__ float red[2][32];
    const int R = blockDim.x / G, t = threadIdx.x % G, gi = threadIdx.x / G;
    uint4 wp[VPT];
    float dw[VPT][8];
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        wp[j] = load8(w, t + j * G, C, vec);
#pragma unroll
        for (int k = 0; k < 8; k++) dw[j][k] = 0.0f;
    }
    const int stride = gridDim.x * R;
    int base = blockIdx.x * R, parity = 0;
    BwdRow<VPT> cur, nxt;
    bwd_load<VPT>(cur, dout, x, dres_in, rstd, base + gi, N, C, t, G, vec);
    for (; base < N; base += stride) {
        const int row = base + gi;
        if (base + stride < N) bwd_load<VPT>(nxt, dout, x, dres_in, rstd, base + stride + gi, N, C, t, G, vec);
        // Elements are widened from the packed vectors where they are used (an exact conversion), which keeps the
        // registers within the launch bounds.
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < VPT; j++)
#pragma unroll
            for (int k = 0; k < 8; k++) s += bf_at(cur.g[j], k) * bf_at(wp[j], k) * bf_at(cur.x[j], k);
        s = group_sum(s, G, red, parity);
        parity ^= 1;
        const float r = cur.r, kk = s * r * r * r / (float)C;
        const size_t off = (size_t)(row < N ? row : 0) * C;
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            float d[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const float g = bf_at(cur.g[j], k), xv = bf_at(cur.x[j], k);
                d[k] = bf_at(cur.d[j], k) + (r * bf_at(wp[j], k) * g - xv * kk);  // d is zero without dres_in
                dw[j][k] += g * xv * r;
            }
            if (row < N) store8(dres_out + off, t + j * G, C, vec, pack8f(d));
        }
        cur = nxt;
    }
    if (!partials) return;
    float *p = partials + (size_t)blockIdx.x * C;
    if (R == 1) {
#pragma unroll
        for (int j = 0; j < VPT; j++)
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int c = (t + j * G) * 8 + k;
                if (c < C) p[c] = dw[j][k];
            }
        return;
    }
    // Several groups per block only for narrow rows, which have VPT = 1; lanes past the row's vectors hold nothing.
    const int C8 = (C + 7) / 8 * 8;
    if (t * 8 < C8)
#pragma unroll
        for (int k = 0; k < 8; k++) dw_rows[gi * C8 + t * 8 + k] = dw[0][k];
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float s = 0.0f;
        for (int i = 0; i < R; i++) s += dw_rows[i * C8 + c];
        p[c] = s;
    }
}

// dw (C) += column sums of partials (n, C). A block covers 8 columns with 64 thread rows: thread row y adds
// partial rows y, y + 64, ... in order, then a fixed tree adds the 64 sums: the same order on every run.
enum { COLSUM_X = 8, COLSUM_Y = 64 };
__global__ void column_sum_kernel(float *dw, const float *partials, int n, int C) {
    __shared__ float s[COLSUM_Y][COLSUM_X];
    const int c = blockIdx.x * COLSUM_X + threadIdx.x, y = threadIdx.y;
    float acc = 0.0f;
    if (c < C) {
#pragma unroll 4
        for (int b = y; b < n; b += COLSUM_Y) acc += partials[(size_t)b * C + c];
    }
    s[y][threadIdx.x] = acc;
    __syncthreads();
    for (int h = COLSUM_Y / 2; h > 0; h >>= 1) {
        if (y < h) s[y][threadIdx.x] += s[y + h][threadIdx.x];
        __syncthreads();
    }
    if (y == 0 && c < C) dw[c] += s[0][threadIdx.x];
}

void cuda_residual_rmsnorm_bwd(OpsCtx *ctx, void *dres_out, float *dw, const void *dres_in, const void *dout,
                               const void *x_out, const void *w, const float *rstd, int N, int C) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    RowGeom g;
    CUDA_ARG_CHECK(ctx, N >= 0 && C > 0 && row_geom(C, &g) == 0,
                   "rmsnorm_bwd: bad shape N=%d C=%d (C at most %d)", N, C, 8 * RMS_MAX_VPT * RMS_MAX_GROUP);
    if (N == 0) return;
    const int vec = C % 8 == 0 && aligned16(dres_out) && aligned16(dout) && aligned16(x_out) && aligned16(w) &&
                    (!dres_in || aligned16(dres_in));
    typedef void (*Kernel)(bf16 *, float *, const bf16 *, const bf16 *, const bf16 *, const bf16 *, const float *, int,
                           int, int, int);
    const Kernel k = g.vpt == 1   ? rmsnorm_bwd_kernel<1>
                     : g.vpt == 2 ? rmsnorm_bwd_kernel<2>
                     : g.vpt == 4 ? rmsnorm_bwd_kernel<4>
                                  : rmsnorm_bwd_kernel<8>;
    const size_t smem = g.rows > 1 ? (size_t)g.rows * ((C + 7) / 8 * 8) * sizeof(float) : 0;
    // One wave of blocks (see RMS_BWD_THREADS_PER_SM): a second, partial wave would leave most SMs idle at the end,
    // since every block loops over about the same number of rows.
    int per_sm = RMS_BWD_THREADS_PER_SM / g.vpt / g.threads;
    if (per_sm < 1) per_sm = 1;
    const int groups = (N + g.rows - 1) / g.rows;
    const int blocks = st->sm_count * per_sm < groups ? st->sm_count * per_sm : groups;
    float *partials = NULL;
    if (dw) {
        partials = (float *)cuda_scratch(ctx, st, (size_t)blocks * C * sizeof(float));
        if (!partials) return;
    }
    k<<<blocks, g.threads, smem, st->stream>>>((bf16 *)dres_out, partials, (const bf16 *)dres_in, (const bf16 *)dout,
                                               (const bf16 *)x_out, (const bf16 *)w, rstd, N, C, g.G, vec);
    CUDA_CHECK_LAUNCH(ctx);
    if (!dw) return;
    const dim3 sum_block(COLSUM_X, COLSUM_Y);
    column_sum_kernel<<<(C + COLSUM_X - 1) / COLSUM_X, sum_block, 0, st->stream>>>(dw, partials, blocks, C);
    CUDA_CHECK_LAUNCH(ctx);
}

void cuda_rmsnorm_bwd(OpsCtx *ctx, void *dx, float *dw, const void *dout, const void *x, const void *w,
                      const float *rstd, int N, int C) {
    cuda_residual_rmsnorm_bwd(ctx, dx, dw, dx, dout, x, w, rstd, N, C);
}
