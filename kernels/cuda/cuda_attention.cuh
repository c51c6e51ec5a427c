// kernels/cuda/cuda_attention.cuh — what the training attention kernels (cuda_attention_fwd.cu,
// cuda_attention_bwd.cu) share: PTX wrappers for bf16 tensor-core tiles (mma.sync m16n8k16, ldmatrix,
// cp.async), the shared-memory tile loader, and the tile map that turns packed variable-length sequences
// into a list of (sequence, tile) work items.
//
// Register fragments of mma.sync.m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16 x 16, row-major)  a0: (g, 2t..2t+1)   a1: (g+8, 2t..2t+1)   a2: (g, 2t+8..)   a3: (g+8, 2t+8..)
//   B (16 x 8,  k x n)      b0: (k 2t..2t+1, n g)                     b1: (k 2t+8.., n g)
//   C (16 x 8,  fp32)       c0, c1: (g, 2t..2t+1)                      c2, c3: (g+8, 2t..2t+1)
// Two C tiles side by side (columns 0..7 and 8..15) hold exactly the A fragment of the 16 x 16 block they
// form once packed to bf16: that is how score tiles become the left operand of the next product without
// a trip through shared memory.
#ifndef TANDEM_KERNELS_CUDA_ATTENTION_CUH
#define TANDEM_KERNELS_CUDA_ATTENTION_CUH

#include "kernels/cuda/cuda_common.cuh"

#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

__device__ __forceinline__ uint32_t attn_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16-byte global -> shared copy that bypasses L1; with valid == false the destination is zero-filled and
// nothing is read.
__device__ __forceinline__ void attn_cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(attn_smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
// 4-byte copy (through L1), zero-filled when !valid.
__device__ __forceinline__ void attn_cp_async4(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(attn_smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void attn_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void attn_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 bf16 matrices; lane l supplies the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void attn_ldsm4(uint32_t r[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(attn_smem_addr(p)));
}
// The same, each matrix transposed on the way into registers.
__device__ __forceinline__ void attn_ldsm4_t(uint32_t r[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(attn_smem_addr(p)));
}

// c (16 x 8 fp32) += a (16 x 16 bf16) b (16 x 8 bf16).
__device__ __forceinline__ void attn_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x with subnormal results flushed to zero: one MUFU instruction (exp2f adds a subnormal fix-up around it,
// which costs more than the exponential itself in the softmax; probabilities below 2^-126 do not matter).
__device__ __forceinline__ float attn_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats as a bf16 pair (x0 in the low half, the lower column of a fragment).
__device__ __forceinline__ uint32_t attn_pack(float x0, float x1) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
    return *reinterpret_cast<uint32_t *>(&v);
}
// x = hi + lo with both parts bf16: hi carries the top 8 significant bits, lo the next 8 (see the backward).
__device__ __forceinline__ void attn_pack_split(float x0, float x1, uint32_t &hi, uint32_t &lo) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    const float2 hf = __bfloat1622float2(h);
    __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
    hi = *reinterpret_cast<uint32_t *>(&h);
    lo = *reinterpret_cast<uint32_t *>(&l);
}

// Copies `rows` rows of one head of a (tokens, H, D) bf16 tensor into a shared tile (rows, DP) with pitch
// DP + 8 (the 16 extra bytes per row put the 8 rows of every ldmatrix in different banks). `src` points at
// the first row's head (row stride `stride` elements); rows at or past `valid` and columns at or past D are
// zero-filled. vec: D % 8 == 0 and every row start 16-byte aligned, so rows go by 16-byte cp.async;
// otherwise element by element (the caller's cp.async wait + barrier covers both).
template <int DP, int ROWS, int THREADS>
__device__ __forceinline__ void attn_load_tile(bf16 *dst, const bf16 *src, int valid, size_t stride, int D, int vec) {
    constexpr int LD = DP + 8;
    if (vec) {
        constexpr int CPR = DP / 8;  // 16-byte chunks per row
#pragma unroll
        for (int idx = threadIdx.x; idx < ROWS * CPR; idx += THREADS) {
            const int r = idx / CPR, c = (idx % CPR) * 8;
            const bool ok = r < valid && c < D;
            attn_cp_async16(dst + r * LD + c, ok ? src + (size_t)r * stride + c : src, ok);
        }
    } else {
        for (int idx = threadIdx.x; idx < ROWS * DP; idx += THREADS) {
            const int r = idx / DP, c = idx % DP;
            dst[r * LD + c] = (r < valid && c < D) ? src[(size_t)r * stride + c] : __float2bfloat16_rn(0.0f);
        }
    }
}

// The tile map: map[0].x = number of work items; map[1 + i] = (sequence b, tile index t within b) for
// i < map[0].x, ordered heaviest first so that the longest blocks start in the first wave and the tail
// of the grid is made of short ones. Query tiles (forward) grow heavier with t (more keys before them),
// key tiles (backward) grow lighter with t (fewer queries after them). Sequences whose range is not a
// valid non-empty range inside [0, N) get no tiles, as the CPU twin skips them.
// Upper bound on the number of work items, the grid size the kernels are launched with.
static inline size_t attn_tile_bound(int N, int B, int tile) {
    return ((size_t)N + (size_t)B * (tile - 1)) / tile;
}
// Bytes of scratch attn_tile_map needs (the map plus its counting-sort work arrays).
size_t attn_tile_map_bytes(int N, int B, int tile);
// Builds the map into `scratch` (attn_tile_map_bytes of it) on the context's stream; returns the map or
// NULL with the context's error set.
const int2 *attn_tile_map(OpsCtx *ctx, CudaState *st, void *scratch, const int32_t *cu_seqlens, int B, int N,
                          int tile, int heavy_last);

// Shape checks both directions share; 0 or the context's error code.
int attn_check_shape(OpsCtx *ctx, const char *name, int B, int N, int Hq, int Hkv, int D);

// Opts a kernel into `bytes` of dynamic shared memory; 0 or an error naming the op.
template <typename Kernel>
static int attn_set_smem(OpsCtx *ctx, CudaState *st, Kernel kernel, int bytes, const char *name) {
    if ((size_t)bytes > st->max_smem_optin)
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "%s: needs %d bytes of shared memory, the device offers %zu",
                             name, bytes, st->max_smem_optin);
    CUDA_CHECK_RET(ctx, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), -1);
    return 0;
}

// 16-byte loads are possible when every row of every head starts 16-byte aligned.
static inline int attn_vec_ok(int D, const void *a, const void *b, const void *c, const void *d) {
    return D % 8 == 0 && ((((uintptr_t)a) | ((uintptr_t)b) | ((uintptr_t)c) | ((uintptr_t)d)) & 15) == 0;
}

// Element offset of dims [8 cc, 8 cc + 8) of position p's row in a paged cache (rows of `row` elements, this kv
// head's at head_off), found through the sequence's block table; -1 when p's block is unassigned (a negative
// entry). bs_shift: log2(block_size) when it is a power of two, else -1. Both paged kernels' tile loaders use it.
__device__ __forceinline__ long long pg_cache_offset(const int32_t *table, int p, int block_size, int bs_shift,
                                                     size_t row, size_t head_off, int cc) {
    const int lb = bs_shift >= 0 ? p >> bs_shift : p / block_size;
    const int in_blk = bs_shift >= 0 ? p & (block_size - 1) : p % block_size;
    const int blk = table[lb];
    if (blk < 0) return -1;
    return (long long)(((size_t)blk * block_size + in_blk) * row + head_off + (size_t)cc * 8);
}

// ---- paged attention (cuda_attention_paged.cu: host side, per-head and grouped kernels, merge;
// cuda_attention_decode.cu: the tensor-core kernel) -------------------------------------------------

// NaN as a float (the output of tokens without cache).
#define PG_NAN __int_as_float(0x7fc00000)

// Everything one paged attention launch needs. out, q (N, Hq, D); caches (n_slots, Hkv, D); block_tables
// (n_seqs, max_blocks); token_seq, token_pos (N). scale_log2 = scale * log2(e). Blocks serve query heads
// g * G + hs * (heads per block) + [0, ..) of kv head g for hs < n_hsub. n_splits > 1: per query head hq and
// split s (index (i * Hq + hq) * n_splits + s) part_acc (.., D) holds the unnormalised output and part_ml
// (.., 2) the max m (log2 domain) and sum l; an empty split writes (-inf, 0), a token without cache (NaN, NaN).
// bs_shift: log2(block_size) when it is a power of two, else -1. q_vec: q 16-byte aligned.
typedef struct {
    bf16 *out;
    float *part_acc, *part_ml;
    const bf16 *q, *k_cache, *v_cache;
    const int32_t *block_tables, *token_seq, *token_pos;
    int Hq, Hkv, D, block_size, bs_shift, max_blocks;
    float scale_log2;
    int G, n_hsub, n_splits, q_vec;
    // Query rows of token i start at q + i * q_pitch (Hq * D for a plain q). The tensor-core kernel's decode
    // variant (cuda_attention_paged_decode_fwd) reads q from the fused q|k|v projection instead (q_pitch =
    // (Hq + 2 Hkv) D) and turns it by RoPE at token_pos with inv_freq; it also turns k and copies v of each
    // token into cache row slots[i] (none when negative) before any of its blocks reads that row.
    size_t q_pitch;
    const float *inv_freq;
    const int32_t *slots;
} PgArgs;

// The tensor-core kernel (cuda_attention_decode.cu) takes D <= PM_MAX_D (D % 8 == 0, caches 16-byte aligned),
// up to PM_HEADS query heads per block, PM_TP context positions per tile.
#define PM_MAX_D 128
#define PM_HEADS 16
#define PM_TP 64
// Blocks of the kernel for head dim D that the device holds at once (resident per SM x SMs), making the
// kernel's shared-memory opt-in on first use per device; 0 with the context's error set.
long long cuda_paged_mma_slots(OpsCtx *ctx, CudaState *st, int D);
// Launches it over grid (N * Hkv * n_hsub, n_splits); rope: the decode variant (a->inv_freq, a->slots set).
void cuda_paged_mma_launch(OpsCtx *ctx, CudaState *st, const PgArgs *a, int N, int rope);

#endif
