// kernels/cpu/cpu_matmul_batch_invariant.c — the Linear forward of the rollout server's steps: out (N, OC) =
// in (N, IC) @ w^T (+ bias), w (OC, IC) as PyTorch stores it, where every output is summed in one fixed order that
// depends on IC alone: not on N, not on the row's place among the N, not on the thread count.
//
// Why not OpenBLAS: its sgemm picks other micro-kernels and splits for other M (and for the row's place in a tile,
// and for another thread count), so one row's result moves by an ulp or so with the rows around it. In the server
// continuous batching decides by timing which sequences share a step, so a sequence's logprobs — which GRPO's
// importance-sampling correction feeds into the loss — would change from run to run (issue 22).
//
// The order, for out[n][o] with K = IC:
//   - k runs in blocks of KC = 512 (the last one shorter); within a block, 8 lanes: lane j accumulates
//     in[n][k] * w[o][k] for the k = j (mod 8) of the block, in increasing k, each a fused multiply-add
//     (a multiply, then an add, on targets without FMA: this file is compiled with -ffp-contract=off);
//   - the block's lanes are summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then its last K % 8
//     products (only the last block has them) are added one by one, the same way;
//   - the blocks' sums are added in order, and the bias last.
// Every tile shape below computes each of its outputs with exactly these operations (they differ only in how many
// outputs share the loads), so a row computed in a 3 x 4 tile of a big step equals the same row computed alone.
//
// Where it is used (bench/notes/cpu.md, issue 22, has the figures): one row (a decode step of one sequence) streams
// w once, which beats OpenBLAS's sgemm with M = 1 (it runs its GEMM kernels on one row); from tens of rows on, a
// 3-row x 4-column register tile comes near OpenBLAS without packing (both operands are read in place). Training
// keeps OpenBLAS (kernels/cpu/cpu_matmul.c): its micro-batches are packed the same way run to run, and its
// thousands of rows are where OpenBLAS is ahead.
#include <stddef.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_tasks.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

// Block sizes, tried on the development box's Zen 3 (bench/notes/cpu.md): KC 256 / 512 / 1024, W_BLOCK 8 / 16 / 32 KiB,
// ROW_BLOCK 48 / 96 / 192. KC is part of the summation order: changing it changes the bits (not their invariance).
enum {
    KC = 512,            // k block (a multiple of 8): a 3 x 4 tile's rows of `in` and `w` (14 KiB) stay in L1 over it
    W_BLOCK = 16384,     // bytes of w a task's column block spans over one k block (half an L1d)
    ROW_BLOCK = 96,      // rows of one task (a multiple of the 3-row tile)
    // Multiply-adds per thread before a product is split across threads, enough that each thread's share outweighs
    // what a split costs, a wake-up and a wait (kernels/cpu/cpu_tasks.h). OpenBLAS splits from 2^18
    // (interface/gemm.c).
    MACS_PER_THREAD = 1 << 21,
};

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v8 v8_load(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

// acc + a * b, rounded once where the target has FMA.
static inline v8 v8_fma(v8 a, v8 b, v8 acc) {
#if defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return a * b + acc;
#endif
}

static inline float f_fma(float a, float b, float acc) {
#if defined(__FMA__)
    return __builtin_fmaf(a, b, acc);
#else
    return a * b + acc;
#endif
}

// The four vectors' lane sums, each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
static inline v4 lane_sums4(v8 a, v8 b, v8 c, v8 d) {
#if defined(__AVX__)
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]; twice, then the two halves.
    const __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b), cd = _mm256_hadd_ps((__m256)c, (__m256)d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    return (v4)_mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
#else
    const v8 x[4] = {a, b, c, d};
    v4 s;
    for (int i = 0; i < 4; i++)
        s[i] = ((x[i][0] + x[i][1]) + (x[i][2] + x[i][3])) + ((x[i][4] + x[i][5]) + (x[i][6] + x[i][7]));
    return s;
#endif
}

// Keeps a loaded vector in a register: without it GCC folds the load into every FMA that reads it (a 3 x 4 tile then
// issues 15 loads per 12 FMAs instead of 7, and runs at half speed).
#if defined(__AVX__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif

// out (R, S) (row stride OC) = the block k0..k1 of in (R rows, stride K) . w (S rows, stride K), overwritten when
// `first`, else added. R x S accumulators of 8 lanes, padded with zero vectors to whole groups of 4 columns (SP of
// them) for the lane sums; the loops over r and s unroll (R and S are constants), so the accumulators live in
// registers.
#define DEFINE_TILE(R, S)                                                                                          \
    static void tile_##R##x##S(float *restrict out, const float *restrict in, const float *restrict w, int K,       \
                               int OC, int k0, int k1, int first) {                                                \
        enum { SP = (S + 3) / 4 * 4 };                                                                             \
        v8 acc[R][SP];                                                                                             \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                      \
            _Pragma("GCC unroll 16") for (int s = 0; s < SP; s++) acc[r][s] = (v8){0};                           \
        int k = k0;                                                                                                \
        for (; k + 8 <= k1; k += 8) {                                                                              \
            v8 a[R];                                                                                               \
            for (int r = 0; r < R; r++) {                                                                          \
                a[r] = v8_load(in + (size_t)r * K + k);                                                            \
                KEEP_IN_REGISTER(a[r]);                                                                            \
            }                                                                                                      \
            for (int s = 0; s < S; s++) {                                                                          \
                v8 b = v8_load(w + (size_t)s * K + k);                                                             \
                KEEP_IN_REGISTER(b);                                                                               \
                for (int r = 0; r < R; r++) acc[r][s] = v8_fma(a[r], b, acc[r][s]);                                \
            }                                                                                                      \
        }                                                                                                          \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                      \
            _Pragma("GCC unroll 16") for (int s0 = 0; s0 < SP; s0 += 4) {                                        \
                v4 x = lane_sums4(acc[r][s0], acc[r][s0 + 1], acc[r][s0 + 2], acc[r][s0 + 3]);                     \
                float *o = out + (size_t)r * OC + s0;                                                              \
                if (S - s0 >= 4 && k == k1) { /* four whole sums: one vector store (or add) */                     \
                    if (!first) {                                                                                  \
                        v4 prev;                                                                                   \
                        memcpy(&prev, o, sizeof prev);                                                             \
                        x = prev + x;                                                                              \
                    }                                                                                              \
                    memcpy(o, &x, sizeof x);                                                                       \
                    continue;                                                                                      \
                }                                                                                                  \
                for (int s = s0; s < S && s < s0 + 4; s++) {                                                       \
                    float y = x[s - s0];                                                                           \
                    for (int t = k; t < k1; t++) y = f_fma(in[(size_t)r * K + t], w[(size_t)s * K + t], y);        \
                    o[s - s0] = first ? y : o[s - s0] + y;                                                         \
                }                                                                                                  \
            }                                                                                                      \
    }

DEFINE_TILE(3, 4)   // the body: 12 accumulators + 3 rows + 1 column of w = the 16 vector registers of AVX2
DEFINE_TILE(3, 1)   // its last columns
DEFINE_TILE(2, 4)   // the last two rows of a task
DEFINE_TILE(2, 1)
DEFINE_TILE(1, 8)   // a single row (a decode step of one sequence): w streamed once, 8 independent chains
DEFINE_TILE(1, 1)

typedef void (*TileFn)(float *restrict, const float *restrict, const float *restrict, int, int, int, int, int);

// Rows n0..n1 x columns o0..o1, over the whole of k: tiles of `rows` rows, `cols` columns (`tile`), the columns
// left over by `tail` one at a time.
static void rows_times_block(float *out, const float *in, const float *w, int K, int OC, int n0, int n1, int o0,
                             int o1, int k0, int k1, int first, int rows, int cols, TileFn tile, TileFn tail) {
    for (int n = n0; n + rows <= n1; n += rows) {
        float *o_row = out + (size_t)n * OC;
        const float *i_row = in + (size_t)n * K;
        int o = o0;
        for (; o + cols <= o1; o += cols) tile(o_row + o, i_row, w + (size_t)o * K, K, OC, k0, k1, first);
        for (; o < o1; o++) tail(o_row + o, i_row, w + (size_t)o * K, K, OC, k0, k1, first);
    }
}

// One task: rows n0..n1 x columns o0..o1, k block by k block.
static void task(float *out, const float *in, const float *w, const float *bias, int K, int OC, int n0, int n1,
                 int o0, int o1) {
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int k1 = K - k0 < KC ? K : k0 + KC, first = k0 == 0;
        const int n3 = n0 + (n1 - n0) / 3 * 3;
        rows_times_block(out, in, w, K, OC, n0, n3, o0, o1, k0, k1, first, 3, 4, tile_3x4, tile_3x1);
        if (n1 - n3 == 2) rows_times_block(out, in, w, K, OC, n3, n1, o0, o1, k0, k1, first, 2, 4, tile_2x4, tile_2x1);
        if (n1 - n3 == 1) rows_times_block(out, in, w, K, OC, n3, n1, o0, o1, k0, k1, first, 1, 8, tile_1x8, tile_1x1);
    }
    if (bias)
        for (int n = n0; n < n1; n++)
            for (int o = o0; o < o1; o++) out[(size_t)n * OC + o] += bias[o];
}

// The product's tasks: ROW_BLOCK rows x `cols` columns each, row blocks outer.
typedef struct {
    float *out;
    const float *in, *w, *bias;
    int N, IC, OC, cols, n_col_blocks;
} Product;

static void product_task(void *arg, long t) {
    const Product *p = arg;
    const int rb = (int)(t / p->n_col_blocks), cb = (int)(t % p->n_col_blocks);
    const int n0 = rb * ROW_BLOCK, o0 = cb * p->cols;
    const int n1 = p->N - n0 < ROW_BLOCK ? p->N : n0 + ROW_BLOCK, o1 = p->OC - o0 < p->cols ? p->OC : o0 + p->cols;
    task(p->out, p->in, p->w, p->bias, p->IC, p->OC, n0, n1, o0, o1);
}

void cpu_matmul_fwd_batch_invariant(float *out, const float *in, const float *w, const float *bias, int N, int IC,
                                    int OC) {
    if (N <= 0 || OC <= 0) return;
    if (IC <= 0) { // an empty inner product: out is just the bias (or zero)
        for (int n = 0; n < N; n++) {
            if (bias) memcpy(out + (size_t)n * OC, bias, (size_t)OC * sizeof(float));
            else memset(out + (size_t)n * OC, 0, (size_t)OC * sizeof(float));
        }
        return;
    }
    // Tasks of ROW_BLOCK rows x cols columns, cols = a multiple of 8 near W_BLOCK bytes of w per k block. Which
    // thread runs a task changes nothing in its numbers.
    const int kc = IC < KC ? IC : KC;
    int cols = W_BLOCK / (kc * (int)sizeof(float)) / 8 * 8;
    if (cols < 8) cols = 8;
    Product p = {.out = out, .in = in, .w = w, .bias = bias, .N = N, .IC = IC, .OC = OC, .cols = cols,
                 .n_col_blocks = (OC + cols - 1) / cols};
    const long n_tasks = (long)((N + ROW_BLOCK - 1) / ROW_BLOCK) * p.n_col_blocks;
    const long by_work = (long)N * IC * OC / MACS_PER_THREAD, max_threads = cpu_max_threads();
    cpu_run_tasks(product_task, &p, n_tasks, (int)(by_work < max_threads ? by_work : max_threads));
}
