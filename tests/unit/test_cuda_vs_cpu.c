// tests/unit/test_cuda_vs_cpu.c — every op of kernels/ops.h on the CUDA backend against its CPU twin.
//
// For each op: random inputs with awkward shapes (odd sizes, GQA, several packed sequences of different
// lengths including 1, scattered paged block tables, misaligned pointers), rounded to bf16 on the host so
// that both backends start from identical values, run through an OPS_BACKEND_CPU context (fp32) and an
// OPS_BACKEND_CUDA context (bf16 storage, fp32 math), and compared.
//
// Error measure, per tensor: e = max_i |gpu_i - cpu_i| / (|cpu_i| + rms(cpu)). It is a relative error for
// elements of typical size and an error relative to the tensor's scale for elements near zero (where a
// relative error is meaningless). Tolerances, stated at each check:
//   bf16 outputs                 1e-2  one bf16 rounding is <= 2^-8 = 3.9e-3 relative (8 significant bits);
//                                      a second rounding inside cuBLASLt's beta = 1 path, or attention's
//                                      bf16 probabilities in the forward's P V, stay within 2.5 of those.
//   exact copies                 0     (embedding rows, KV cache slots, strided 2-D copies)
//   GPU vs GPU, two ways         0     (the fused residual RMSNorm vs the unfused pair, in place vs not: the same
//                                      roundings in the same order, so the same bits)
//   fp32 from our own kernels    1e-5  both sides add exactly-representable products in fp32/double,
//                                      only the summation order differs.
//   fp32 from cuBLASLt (dw)      1e-5  tensor-core fp32 accumulation in an order we do not control
//                                      (measured on an H200: <= 3.2e-7).
//   AdamW state                  1e-6  the same float operations in the same order on both sides.
// Each check prints one row of a table (op, tensor, size, max abs error, e, tolerance); the test fails if
// any row is over its tolerance or any context records an unexpected error.
//
// Without a CUDA device (or in a build without the CUDA backend) the test prints "SKIP: no CUDA device" and
// returns 77, which ctest reports as skipped.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "kernels_testlib.h"
#include "paged_testlib.h"
#include "ops_testlib.h"

static OpsCtx *cpu, *gpu;

// ---- random numbers, bf16 rounding ------------------------------------------------------------------

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_next(void) { return kt_splitmix_next(&rng_state); }
static float urand(float lo, float hi) { return kt_uniform_in(rng_next(), lo, hi); }
static int irand(int n) { return (int)(rng_next() % (uint64_t)n); }

static float *rand_host(size_t n, float lo, float hi) {
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = kt_round_bf16(urand(lo, hi));
    return h;
}

// ---- paired buffers: the same tensor on both backends -----------------------------------------------

enum { STORAGE, F32, I32 };
typedef struct {
    void *c, *g;    // cpu and cuda allocations
    size_t n;       // elements
    int kind;
} Buf;

static size_t elem_size(OpsCtx *ctx, int kind) { return kind == STORAGE ? ops_dtype_size(ctx) : 4; }

static Buf buf_new(int kind, size_t n) {
    Buf b = {ops_malloc(cpu, n * elem_size(cpu, kind) + 64), ops_malloc(gpu, n * elem_size(gpu, kind) + 64), n, kind};
    if (!b.c || !b.g) {
        fprintf(stderr, "FATAL: allocation failed: %s %s\n", ops_error(cpu), ops_error(gpu));
        exit(1);
    }
    return b;
}
// Element pointer at offset `off` on each backend (used to pass misaligned views).
static void *at_c(Buf b, size_t off) { return (char *)b.c + off * elem_size(cpu, b.kind); }
static void *at_g(Buf b, size_t off) { return (char *)b.g + off * elem_size(gpu, b.kind); }

// Uploads host values (n, starting at element off) to both backends; storage values must be bf16-exact.
static void buf_set(Buf b, size_t off, const void *host, size_t n) {
    if (b.kind == STORAGE) {
        ops_upload_f32(cpu, at_c(b, off), host, n);
        ops_upload_f32(gpu, at_g(b, off), host, n);
    } else {
        ops_copy_to_device(cpu, at_c(b, off), host, n * 4);
        ops_copy_to_device(gpu, at_g(b, off), host, n * 4);
    }
}
static Buf buf_from(int kind, const void *host, size_t n) {
    Buf b = buf_new(kind, n);
    buf_set(b, 0, host, n);
    return b;
}
static Buf buf_rand(size_t n, float lo, float hi) {
    float *h = rand_host(n, lo, hi);
    Buf b = buf_from(STORAGE, h, n);
    free(h);
    return b;
}
static Buf buf_rand_f32(size_t n, float lo, float hi) {
    float *h = rand_host(n, lo, hi);
    Buf b = buf_from(F32, h, n);
    free(h);
    return b;
}
static void buf_free(Buf b) {
    ops_free(cpu, b.c);
    ops_free(gpu, b.g);
}

// Host fp32 copies of n elements from element off, from one backend.
static float *fetch(OpsCtx *ctx, void *base, int kind, size_t n) {
    float *h = malloc((n ? n : 1) * sizeof *h);
    if (kind == STORAGE) ops_download_f32(ctx, h, base, n);
    else ops_copy_to_host(ctx, h, base, n * 4);
    return h;
}

static void expect_ok(const char *what) { kt_expect_no_errors(cpu, gpu, what); }

// Compares n elements from element off of both sides and prints a table row. NaN matches only NaN.
static void check_view(const char *op, const char *tensor, Buf b, size_t off, size_t n, double tol) {
    float *c = fetch(cpu, at_c(b, off), b.kind, n);
    float *g = fetch(gpu, at_g(b, off), b.kind, n);
    double ss = 0.0;
    size_t finite = 0;
    for (size_t i = 0; i < n; i++)
        if (!isnan(c[i])) {
            ss += (double)c[i] * c[i];
            finite++;
        }
    const double rms = finite ? sqrt(ss / finite) : 0.0;
    double max_abs = 0.0, max_rel = 0.0;
    size_t worst = 0, nan_mismatch = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(c[i]) || isnan(g[i])) {
            if (isnan(c[i]) != isnan(g[i])) nan_mismatch++;
            continue;
        }
        const double d = fabs((double)g[i] - c[i]);
        const double r = d / (fabs(c[i]) + rms + 1e-30);
        if (d > max_abs) max_abs = d;
        if (r > max_rel) {
            max_rel = r;
            worst = i;
        }
    }
    const int ok = max_rel <= tol && nan_mismatch == 0;
    printf("%-4s %-20s %-10s %8zu  max_abs %10.3e  err %10.3e  tol %7.1e", ok ? "ok" : "FAIL", op, tensor, n, max_abs,
           max_rel, tol);
    if (nan_mismatch) printf("  (%zu NaN mismatches)", nan_mismatch);
    if (!ok && n) printf("  worst [%zu] cpu %.7g cuda %.7g", worst, c[worst], g[worst]);
    printf("\n");
    if (!ok) failures++;
    free(c);
    free(g);
}
static void check(const char *op, const char *tensor, Buf b, double tol) { check_view(op, tensor, b, 0, b.n, tol); }

// ---- ops --------------------------------------------------------------------------------------------

static void test_add(void) {
    const size_t n = 4103;  // vector body + tail
    Buf y = buf_rand(n + 1, -4, 4), x = buf_rand(n + 1, -4, 4);
    ops_add_inplace(cpu, y.c, x.c, n);
    ops_add_inplace(gpu, y.g, x.g, n);
    expect_ok("add_inplace");
    check("add_inplace", "y", y, 1e-2);
    // Misaligned views (element 1): the scalar path.
    ops_add_inplace(cpu, at_c(y, 1), at_c(x, 1), n - 7);
    ops_add_inplace(gpu, at_g(y, 1), at_g(x, 1), n - 7);
    expect_ok("add_inplace (offset)");
    check("add_inplace offset", "y", y, 1e-2);
    buf_free(y);
    buf_free(x);
    // fp32 accumulation: both sides add in fp32, one rounding each (1e-6 relative).
    Buf yf = buf_rand_f32(n, -4, 4), xf = buf_rand_f32(n, -4, 4);
    ops_add_f32(cpu, yf.c, xf.c, n);
    ops_add_f32(gpu, yf.g, xf.g, n);
    expect_ok("add_f32");
    check("add_f32", "y", yf, 1e-6);
    buf_free(yf);
    buf_free(xf);
    // Scaling storage elements (the LoRA scale): one bf16 rounding on the GPU.
    Buf xs = buf_rand(n, -4, 4);
    ops_scale_inplace(cpu, xs.c, 2.8284271f, n);
    ops_scale_inplace(gpu, xs.g, 2.8284271f, n);
    expect_ok("scale_inplace");
    check("scale_inplace", "x", xs, 1e-2);
    // Seeded dropout: the same mask on both (a mask off by one element is an error of the element's size).
    ops_dropout(cpu, xs.c, xs.c, n, 0.25f, 0xC0FFEEULL);
    ops_dropout(gpu, xs.g, xs.g, n, 0.25f, 0xC0FFEEULL);
    expect_ok("dropout");
    check("dropout", "x", xs, 1e-2);
    buf_free(xs);
}

static void test_embedding(void) {
    const int V = 97, N = 53;
    const int Cs[2] = {72, 37};  // 16-byte vector copies; element copies
    for (int ci = 0; ci < 2; ci++) {
        const int C = Cs[ci];
        int32_t tok[53];
        for (int i = 0; i < N; i++) tok[i] = i % 7 == 3 ? 5 : irand(V);  // repeated ids accumulate in backward
        tok[N - 1] = V - 1;
        Buf table = buf_rand((size_t)V * C, -1, 1), tokens = buf_from(I32, tok, N);
        Buf out = buf_new(STORAGE, (size_t)N * C);
        ops_embedding_fwd(cpu, out.c, tokens.c, table.c, N, C, V);
        ops_embedding_fwd(gpu, out.g, tokens.g, table.g, N, C, V);
        expect_ok("embedding_fwd");
        check(C % 8 ? "embedding_fwd C=37" : "embedding_fwd C=72", "out", out, 0.0);  // exact copy
        // A tensor-parallel shard of the table (rows [40, 80)): other ids give zero rows.
        ops_embedding_shard_fwd(cpu, out.c, tokens.c, (const char *)table.c + (size_t)40 * C * ops_dtype_size(cpu), N,
                                C, 40, 40, V);
        ops_embedding_shard_fwd(gpu, out.g, tokens.g, (const char *)table.g + (size_t)40 * C * ops_dtype_size(gpu), N,
                                C, 40, 40, V);
        expect_ok("embedding_shard_fwd");
        check(C % 8 ? "embedding_shard_fwd C=37" : "embedding_shard_fwd C=72", "out", out, 0.0);
        Buf dout = buf_rand((size_t)N * C, -1, 1), dtable = buf_rand_f32((size_t)V * C, -1, 1);
        ops_embedding_bwd(cpu, dtable.c, dout.c, tokens.c, N, C);
        ops_embedding_bwd(gpu, dtable.g, dout.g, tokens.g, N, C);
        expect_ok("embedding_bwd");
        check("embedding_bwd", "dtable", dtable, 1e-5);  // fp32 sums of bf16 values, atomics reorder them
        // A token outside [0, V) is an error on both backends (the CUDA one at the next synchronization).
        int32_t bad = V;
        buf_set(tokens, 11, &bad, 1);
        ops_embedding_fwd(cpu, out.c, tokens.c, table.c, N, C, V);
        ops_embedding_fwd(gpu, out.g, tokens.g, table.g, N, C, V);
        ops_synchronize(gpu);
        const int ok = ops_status(cpu) < 0 && ops_status(gpu) < 0 && strstr(ops_error(gpu), "outside the vocabulary") &&
                       strstr(ops_error(gpu), "row 11");
        printf("%-4s %-20s bad token id reported: cuda \"%s\"\n", ok ? "ok" : "FAIL", "embedding_fwd", ops_error(gpu));
        if (!ok) failures++;
        ops_clear_error(cpu);
        ops_clear_error(gpu);
        buf_free(table), buf_free(tokens), buf_free(out), buf_free(dout), buf_free(dtable);
    }
}

static void test_rmsnorm(void) {
    const int N = 37, C = 1000;
    const float eps = 1e-6f;
    Buf x = buf_rand((size_t)N * C, -3, 3), w = buf_rand(C, 0.5f, 1.5f);
    Buf out = buf_new(STORAGE, (size_t)N * C), rstd = buf_new(F32, N);
    ops_rmsnorm_fwd(cpu, out.c, rstd.c, x.c, w.c, N, C, eps);
    ops_rmsnorm_fwd(gpu, out.g, rstd.g, x.g, w.g, N, C, eps);
    expect_ok("rmsnorm_fwd");
    check("rmsnorm_fwd", "out", out, 1e-2);
    check("rmsnorm_fwd", "rstd", rstd, 1e-5);
    Buf dout = buf_rand((size_t)N * C, -1, 1), dx = buf_rand((size_t)N * C, -1, 1), dw = buf_rand_f32(C, -1, 1);
    ops_rmsnorm_bwd(cpu, dx.c, dw.c, dout.c, x.c, w.c, rstd.c, N, C);
    ops_rmsnorm_bwd(gpu, dx.g, dw.g, dout.g, x.g, w.g, rstd.g, N, C);
    expect_ok("rmsnorm_bwd");
    check("rmsnorm_bwd", "dx (+=)", dx, 1e-2);
    check("rmsnorm_bwd", "dw (+=)", dw, 1e-5);
    buf_free(x), buf_free(w), buf_free(out), buf_free(rstd), buf_free(dout), buf_free(dx), buf_free(dw);
}

// Inputs whose residual sums are exact in bf16: multiples of 1/32 below 2 in magnitude add up to multiples of 1/32
// below 4 (at most 7 significant bits), so both backends hold the same x_out and the check isolates the norm.
static float *grid_host(size_t n) {
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = (float)(irand(127) - 63) / 32.0f;
    return h;
}

// n elements of two CUDA-context buffers, bit for bit (downloaded as fp32: bf16 widens exactly).
static void check_same_gpu(const char *op, const char *what, const void *a, const void *b, size_t n, int kind) {
    float *ha = fetch(gpu, (void *)a, kind, n), *hb = fetch(gpu, (void *)b, kind, n);
    size_t diff = 0;
    for (size_t i = 0; i < n; i++) diff += memcmp(&ha[i], &hb[i], 4) != 0;
    printf("%-4s %-20s %-10s %8zu  bit-identical on the GPU: %zu elements differ\n", diff ? "FAIL" : "ok", op, what, n,
           diff);
    if (diff) failures++;
    free(ha);
    free(hb);
}

// ops_copy_2d_batch: 70 items (two launches on the GPU: 64 a launch), blocks of 1..40 rows and 1..24 columns from a
// random source into their own places of a zeroed destination with wider pitches, half of them scaled by a factor
// that is not a power of two. CUDA vs CPU (1e-2: one bf16 rounding of the scaled elements), and on the GPU the batch
// gives the bits of the same blocks moved by ops_copy_2d then scaled by ops_scale_inplace (the destination's
// untouched elements stay zero in both).
static void test_copy_2d_batch(void) {
    enum { ITEMS = 70, COLS = 24, ROWS = 40, DPITCH = 32 };
    const size_t src_n = (size_t)ITEMS * ROWS * COLS, dst_n = (size_t)ITEMS * ROWS * DPITCH;
    Buf src = buf_rand(src_n, -4, 4), dst = buf_new(STORAGE, dst_n), ref = buf_new(STORAGE, dst_n);
    OpsCopy2D ic[ITEMS], ig[ITEMS];
    for (int k = 0; k < ITEMS; k++) {
        const size_t rows = 1 + (size_t)irand(ROWS), cols = 1 + (size_t)irand(COLS);
        const size_t s_off = (size_t)k * ROWS * COLS, d_off = (size_t)k * ROWS * DPITCH + (size_t)irand(DPITCH - (int)cols + 1);
        const float scale = k % 2 ? 1.7320508f : 1.0f;
        ic[k] = (OpsCopy2D){at_c(dst, d_off), at_c(src, s_off), DPITCH, COLS, rows, cols, scale};
        ig[k] = ic[k];
        ig[k].dst = at_g(dst, d_off);
        ig[k].src = at_g(src, s_off);
        ops_copy_2d(gpu, at_g(ref, d_off), DPITCH, at_g(src, s_off), COLS, rows, cols);
        for (size_t r = 0; r < rows && scale != 1.0f; r++)
            ops_scale_inplace(gpu, (char *)at_g(ref, d_off) + r * DPITCH * ops_dtype_size(gpu), scale, cols);
    }
    ops_copy_2d_batch(cpu, ic, ITEMS);
    ops_copy_2d_batch(gpu, ig, ITEMS);
    expect_ok("copy_2d_batch");
    check("copy_2d_batch", "dst", dst, 1e-2);
    check_same_gpu("copy_2d_batch", "vs 2d+scale", dst.g, ref.g, dst_n, STORAGE);
    // A bad item is refused with a message naming it, and nothing runs.
    OpsCopy2D bad = ig[0];
    bad.dst_pitch = bad.cols - 1;
    ops_copy_2d_batch(gpu, &bad, 1);
    if (ops_status(gpu) == 0 || !strstr(ops_error(gpu), "bad item 0")) {
        printf("FAIL copy_2d_batch: a pitch below cols was not refused (%s)\n", ops_error(gpu));
        failures++;
    }
    ops_clear_error(gpu);
    buf_free(src);
    buf_free(dst);
    buf_free(ref);
}

// ops_upload_f32 on CUDA converts on the device (fp32 chunks of 4 Mi values): every value's bf16 bits are the host
// rule's (round to nearest even, NaN quiet with its top payload bits), across a chunk boundary (4 Mi + 5 values of
// random bits, among them ties, NaNs, infinities, the largest float and negative zero).
static void test_upload_rounding(void) {
    const size_t n = ((size_t)4 << 20) + 5;
    uint32_t *bits = malloc(n * sizeof *bits);
    uint16_t *got = malloc(n * sizeof *got);
    uint64_t own = 0x5DEECE66Dull;   // its own stream: the other cases' inputs stay as they were
    for (size_t i = 0; i < n; i++) bits[i] = (uint32_t)kt_splitmix_next(&own);
    const uint32_t special[] = {0x3F808000u, 0x3F818000u, 0x3F808001u, 0x7FC12345u, 0x7F812345u, 0xFF800001u,
                                0x7F800000u, 0xFF800000u, 0x7F7FFFFFu, 0x80000000u, 0x00008000u, 0x00018000u};
    for (size_t k = 0; k < sizeof special / sizeof *special; k++) bits[((size_t)4 << 20) - 7 + k] = special[k];
    void *dev = ops_malloc(gpu, n * 2);
    ops_upload_f32(gpu, dev, (const float *)bits, n);
    ops_copy_to_host(gpu, got, dev, n * 2);
    expect_ok("upload_f32");
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++) {
        const uint32_t u = bits[i];
        const uint16_t want = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x0040u)
                                                              : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        if (got[i] != want && bad++ == 0) first = i;
    }
    printf("%-4s %-20s %-10s %8zu  bits as the host rule: %s\n", bad ? "FAIL" : "ok", "upload_f32", "dst", n,
           bad ? "no" : "yes");
    if (bad) {
        printf("     %zu differ, first at %zu: 0x%08x -> 0x%04x\n", bad, first, bits[first], got[first]);
        failures++;
    }
    ops_free(gpu, dev);
    free(bits);
    free(got);
}

// ops_fill_hashed_uniform: a (37, 53) block of a wider tensor (index pitch 70, first index 10^10 + 5), CUDA vs the
// CPU twin rounded to bf16: the same bits. Also what --load-format random relies on: the block equals that block of
// the whole tensor filled at once, and the values cover [-scale, scale) roughly evenly.
static void test_fill_hashed_uniform(void) {
    enum { ROWS = 37, COLS = 53, PITCH = 70 };
    const uint64_t first = 10000000005ull, seed = 0x1234ABCDull;
    const float scale = 0.0346f;
    Buf blk = buf_new(STORAGE, (size_t)ROWS * COLS), whole = buf_new(STORAGE, (size_t)(ROWS + 1) * PITCH);
    ops_fill_hashed_uniform(cpu, blk.c, ROWS, COLS, first, PITCH, seed, scale);
    ops_fill_hashed_uniform(gpu, blk.g, ROWS, COLS, first, PITCH, seed, scale);
    ops_fill_hashed_uniform(gpu, whole.g, ROWS + 1, PITCH, first - 3, PITCH, seed, scale);   // from 3 columns before
    expect_ok("fill_hashed_uniform");
    float *c = fetch(cpu, blk.c, STORAGE, (size_t)ROWS * COLS), *g = fetch(gpu, blk.g, STORAGE, (size_t)ROWS * COLS);
    float *w = fetch(gpu, whole.g, STORAGE, (size_t)(ROWS + 1) * PITCH);
    int bad = 0, low = 0, high = 0;
    for (size_t r = 0; r < ROWS; r++)
        for (size_t k = 0; k < COLS; k++) {
            const size_t i = r * COLS + k;
            bad += g[i] != kt_round_bf16(c[i]) || g[i] != w[r * PITCH + k + 3] || !(fabsf(c[i]) <= scale);
            low += c[i] < -scale / 2, high += c[i] >= scale / 2;
        }
    const int n = ROWS * COLS;
    printf("%-4s %-20s %-10s %8d  bits equal: %s; quarters below/above: %d / %d\n", bad ? "FAIL" : "ok",
           "fill_hashed_uniform", "dst", n, bad ? "no" : "yes", low, high);
    if (bad || low < n / 5 || high < n / 5) failures++;
    free(c);
    free(g);
    free(w);
    buf_free(blk);
    buf_free(whole);
}

// ops_residual_rmsnorm_fwd/bwd, CUDA vs CPU, N rows of width C; views start at element `off` of their buffers
// (off = 1 forces the element path on widths that are multiples of 8). Tolerances:
//   x_out  0 with exact sums, else 1e-2 (one bf16 rounding of the sum; the CPU keeps it in fp32);
//   out    1e-2 (bf16 output; with inexact sums the norm also reads the rounded x_out);
//   rstd   1e-5 with exact sums (fp32 sums in another order), else 4e-3: the CUDA norm reads the bf16-rounded sum,
//          each square off by <= 2^-8 relative, so r by <= 2^-9 = 2e-3;
//   dres   1e-2 (bf16 output), dw 1e-5 (fp32 sums of the same products in another order).
// On the GPU itself: the unfused pair (add_inplace, rmsnorm_fwd) and the fused op in place give the same bits, and
// a plain norm of the stored x_out repeats out and rstd exactly (what activation-checkpoint recompute relies on).
static void test_residual_rmsnorm_case(int N, int C, int exact_sum, size_t off) {
    char name[48];
    snprintf(name, sizeof name, "res_rmsnorm C=%d%s", C, off ? "+1" : "");
    const float eps = 1e-6f;
    const size_t n = (size_t)N * C;
    float *xh = exact_sum ? grid_host(n) : rand_host(n, -3, 3), *rh = exact_sum ? grid_host(n) : rand_host(n, -3, 3);
    Buf x = buf_new(STORAGE, n + off), res = buf_new(STORAGE, n + off), w = buf_new(STORAGE, C + off);
    buf_set(x, off, xh, n);
    buf_set(res, off, rh, n);
    free(xh);
    free(rh);
    float *wh = rand_host(C, 0.5f, 1.5f);
    buf_set(w, off, wh, C);
    free(wh);
    Buf x_out = buf_new(STORAGE, n + off), out = buf_new(STORAGE, n + off), rstd = buf_new(F32, N);
    ops_residual_rmsnorm_fwd(cpu, at_c(x_out, off), at_c(out, off), rstd.c, at_c(x, off), at_c(res, off), at_c(w, off),
                             N, C, eps);
    ops_residual_rmsnorm_fwd(gpu, at_g(x_out, off), at_g(out, off), rstd.g, at_g(x, off), at_g(res, off), at_g(w, off),
                             N, C, eps);
    expect_ok(name);
    check_view(name, "x_out", x_out, off, n, exact_sum ? 0.0 : 1e-2);
    check_view(name, "out", out, off, n, 1e-2);
    check(name, "rstd", rstd, exact_sum ? 1e-5 : 4e-3);

    const size_t es = ops_dtype_size(gpu);
    Buf y = buf_new(STORAGE, n + off), out2 = buf_new(STORAGE, n + off), rstd2 = buf_new(F32, N);
    ops_copy(gpu, at_g(y, off), at_g(x, off), n * es);
    ops_add_inplace(gpu, at_g(y, off), at_g(res, off), n);
    ops_rmsnorm_fwd(gpu, at_g(out2, off), rstd2.g, at_g(y, off), at_g(w, off), N, C, eps);
    expect_ok(name);
    check_same_gpu(name, "x_out/pair", at_g(x_out, off), at_g(y, off), n, STORAGE);
    check_same_gpu(name, "out/pair", at_g(out, off), at_g(out2, off), n, STORAGE);
    check_same_gpu(name, "rstd/pair", rstd.g, rstd2.g, N, F32);
    ops_copy(gpu, at_g(y, off), at_g(x, off), n * es);
    ops_residual_rmsnorm_fwd(gpu, at_g(y, off), at_g(out2, off), rstd2.g, at_g(y, off), at_g(res, off), at_g(w, off),
                             N, C, eps);
    expect_ok(name);
    check_same_gpu(name, "x_out/inpl", at_g(x_out, off), at_g(y, off), n, STORAGE);
    check_same_gpu(name, "out/inpl", at_g(out, off), at_g(out2, off), n, STORAGE);
    ops_residual_rmsnorm_fwd(gpu, NULL, at_g(out2, off), rstd2.g, at_g(x_out, off), NULL, at_g(w, off), N, C, eps);
    expect_ok(name);
    check_same_gpu(name, "out/plain", at_g(out, off), at_g(out2, off), n, STORAGE);
    check_same_gpu(name, "rstd/plain", rstd.g, rstd2.g, N, F32);

    // Backward on identical inputs: a random bf16 x_out, and the CPU's rstd of it on both sides.
    Buf xo = buf_new(STORAGE, n + off), rs = buf_new(F32, N);
    float *xoh = rand_host(n, -3, 3);
    buf_set(xo, off, xoh, n);
    free(xoh);
    ops_rmsnorm_fwd(cpu, at_c(out2, off), rs.c, at_c(xo, off), at_c(w, off), N, C, eps);
    float *rsh = fetch(cpu, rs.c, F32, N);
    buf_set(rs, 0, rsh, N);
    free(rsh);
    Buf dout = buf_new(STORAGE, n + off), din = buf_new(STORAGE, n + off), dres = buf_new(STORAGE, n + off);
    float *h = rand_host(n, -1, 1);
    buf_set(dout, off, h, n);
    free(h);
    h = rand_host(n, -1, 1);
    buf_set(din, off, h, n);
    free(h);
    h = rand_host(n, -9, 9);  // garbage that must be overwritten
    buf_set(dres, off, h, n);
    free(h);
    Buf dw = buf_rand_f32(C, -1, 1);
    ops_residual_rmsnorm_bwd(cpu, at_c(dres, off), dw.c, at_c(din, off), at_c(dout, off), at_c(xo, off), at_c(w, off),
                             rs.c, N, C);
    ops_residual_rmsnorm_bwd(gpu, at_g(dres, off), dw.g, at_g(din, off), at_g(dout, off), at_g(xo, off), at_g(w, off),
                             rs.g, N, C);
    expect_ok(name);
    check_view(name, "dres", dres, off, n, 1e-2);
    check(name, "dw (+=)", dw, 1e-5);
    ops_copy(gpu, at_g(y, off), at_g(din, off), n * es);
    ops_residual_rmsnorm_bwd(gpu, at_g(y, off), NULL, at_g(y, off), at_g(dout, off), at_g(xo, off), at_g(w, off), rs.g,
                             N, C);
    expect_ok(name);
    check_same_gpu(name, "dres/inpl", at_g(dres, off), at_g(y, off), n, STORAGE);
    ops_residual_rmsnorm_bwd(cpu, at_c(dres, off), NULL, NULL, at_c(dout, off), at_c(xo, off), at_c(w, off),
                             rs.c, N, C);
    ops_residual_rmsnorm_bwd(gpu, at_g(dres, off), NULL, NULL, at_g(dout, off), at_g(xo, off), at_g(w, off),
                             rs.g, N, C);
    expect_ok(name);
    check_view(name, "dres (no in)", dres, off, n, 1e-2);
    buf_free(x), buf_free(res), buf_free(w), buf_free(x_out), buf_free(out), buf_free(rstd), buf_free(y);
    buf_free(out2), buf_free(rstd2), buf_free(xo), buf_free(rs), buf_free(dout), buf_free(din), buf_free(dres);
    buf_free(dw);
}

// Widths: the 1.5B and 0.5B hidden sizes with enough rows that backward blocks loop over several rows; odd and
// not-multiple-of-8 widths (element path); a misaligned view; narrow rows of the q/k norms (several rows per
// block); and the wider geometries (2, 4 and 8 vectors per thread).
static void test_residual_rmsnorm(void) {
    test_residual_rmsnorm_case(3001, 1536, 0, 0);
    test_residual_rmsnorm_case(2999, 896, 1, 0);
    test_residual_rmsnorm_case(37, 1003, 0, 0);
    test_residual_rmsnorm_case(45, 1030, 1, 0);
    test_residual_rmsnorm_case(301, 1536, 0, 1);
    test_residual_rmsnorm_case(10001, 128, 0, 0);
    test_residual_rmsnorm_case(1001, 12, 1, 0);
    test_residual_rmsnorm_case(777, 3000, 0, 0);
    test_residual_rmsnorm_case(300, 4100, 1, 0);
    test_residual_rmsnorm_case(200, 8200, 0, 0);
}

static void test_rope(void) {
    const int N = 29, H = 5;
    const int Ds[2] = {34, 7};  // even; odd (the last element of each head stays put)
    for (int di = 0; di < 2; di++) {
        const int D = Ds[di];
        int32_t pos[29];
        for (int i = 0; i < N; i++) pos[i] = i == 0 ? 0 : irand(6000);
        float inv[32];
        for (int i = 0; i < D / 2; i++) inv[i] = powf(10000.0f, -2.0f * i / D);
        Buf positions = buf_from(I32, pos, N), inv_freq = buf_from(F32, inv, D / 2);
        Buf x = buf_rand((size_t)N * H * D, -2, 2), dx = buf_rand((size_t)N * H * D, -2, 2);
        ops_rope_fwd(cpu, x.c, positions.c, inv_freq.c, N, H, D);
        ops_rope_fwd(gpu, x.g, positions.g, inv_freq.g, N, H, D);
        ops_rope_bwd(cpu, dx.c, positions.c, inv_freq.c, N, H, D);
        ops_rope_bwd(gpu, dx.g, positions.g, inv_freq.g, N, H, D);
        expect_ok("rope");
        check(D % 2 ? "rope_fwd D=7" : "rope_fwd D=34", "x", x, 1e-2);
        check(D % 2 ? "rope_bwd D=7" : "rope_bwd D=34", "dx", dx, 1e-2);
        buf_free(positions), buf_free(inv_freq), buf_free(x), buf_free(dx);
    }
}

// bias_mode: 0 none, 1 aligned bias, 2 bias at an odd element offset (cuBLASLt epilogue may refuse it).
// label: which GEMM plans the CUDA context picks ("" autotuned, "h" the heuristic's first pick).
static void test_matmul_case(int N, int IC, int OC, int bias_mode, const char *label) {
    char name[64];
    snprintf(name, sizeof name, "matmul %dx%dx%d%s%s", N, IC, OC, bias_mode == 2 ? " b+1" : bias_mode ? " b" : "",
             label);
    Buf in = buf_rand((size_t)N * IC, -1, 1), w = buf_rand((size_t)OC * IC, -1, 1), bias = buf_rand(OC + 1, -1, 1);
    const size_t boff = bias_mode == 2 ? 1 : 0;
    Buf out = buf_new(STORAGE, (size_t)N * OC);
    ops_matmul_fwd(cpu, out.c, in.c, w.c, bias_mode ? at_c(bias, boff) : NULL, N, IC, OC);
    ops_matmul_fwd(gpu, out.g, in.g, w.g, bias_mode ? at_g(bias, boff) : NULL, N, IC, OC);
    expect_ok(name);
    check(name, "out", out, 1e-2);
    Buf dout = buf_rand((size_t)N * OC, -1, 1), din = buf_rand((size_t)N * IC, -1, 1);
    Buf dw = buf_rand_f32((size_t)OC * IC, -1, 1), dbias = buf_rand_f32(OC, -1, 1);
    // Accumulating din, then overwriting it.
    ops_matmul_bwd(cpu, din.c, dw.c, bias_mode ? dbias.c : NULL, dout.c, in.c, w.c, N, IC, OC, 1);
    ops_matmul_bwd(gpu, din.g, dw.g, bias_mode ? dbias.g : NULL, dout.g, in.g, w.g, N, IC, OC, 1);
    expect_ok(name);
    check(name, "din (+=)", din, 1e-2);
    check(name, "dw (+=)", dw, 1e-5);
    if (bias_mode) check(name, "dbias (+=)", dbias, 1e-5);
    ops_matmul_bwd(cpu, din.c, NULL, NULL, dout.c, in.c, w.c, N, IC, OC, 0);
    ops_matmul_bwd(gpu, din.g, NULL, NULL, dout.g, in.g, w.g, N, IC, OC, 0);
    expect_ok(name);
    check(name, "din (=)", din, 1e-2);
    buf_free(in), buf_free(w), buf_free(bias), buf_free(out), buf_free(dout), buf_free(din), buf_free(dw),
        buf_free(dbias);
}

static void test_matmul_cases(const char *label) {
    test_matmul_case(37, 67, 45, 1, label);     // odd everything: unaligned rows for cuBLASLt
    test_matmul_case(64, 128, 96, 1, label);    // aligned
    test_matmul_case(33, 64, 24, 2, label);     // misaligned bias pointer
    test_matmul_case(1, 256, 130, 0, label);    // a single row, no bias
    test_matmul_case(300, 40, 8, 1, label);     // long and thin (dw reduces over 300 rows)
    // 1 or 2 rows with IC % 8 == 0 run the forward through cuda_gemv.cu: decode shapes, a misaligned bias, the
    // longest staged rows; then 3 and 8 rows and an IC % 8 != 0 on cuBLASLt as before.
    test_matmul_case(1, 896, 1152, 1, label);
    test_matmul_case(2, 1536, 2000, 2, label);
    test_matmul_case(1, 64, 7, 1, label);
    test_matmul_case(2, 8960, 300, 0, label);
    test_matmul_case(3, 1536, 2000, 2, label);
    test_matmul_case(8, 8960, 300, 0, label);
    test_matmul_case(2, 68, 45, 1, label);
    // Large enough (>= 1 GFLOP each) for cuda_matmul.cu to time the heuristic's candidates on first use: the
    // accumulating din and dw checks fail if a trial run touched the caller's output, the others if the kept
    // algorithm computes something else. The second has 4-byte-aligned rows and an odd bias address.
    test_matmul_case(512, 1024, 1024, 1, label);
    test_matmul_case(520, 1000, 1030, 2, label);
}

// Every case twice: on a context that autotunes its GEMM plans (and logs each decision on stderr), and on one that
// keeps the heuristic's first pick.
static void test_matmul(void) {
    OpsCtx *gpu_default = gpu;
    const OpsGemmAutotune modes[2] = {OPS_GEMM_AUTOTUNE_LOG, OPS_GEMM_AUTOTUNE_OFF};
    const char *labels[2] = {"", " h"};
    for (int i = 0; i < 2; i++) {
        char err[256];
        const OpsSettings settings = {.gemm_autotune = modes[i]};
        if (ops_create_with_settings(&gpu, OPS_BACKEND_CUDA, 0, &settings, err, sizeof err) != 0) {
            printf("FAIL matmul: cannot create a CUDA context: %s\n", err);
            failures++;
            gpu = gpu_default;
            continue;
        }
        test_matmul_cases(labels[i]);
        ops_destroy(gpu);
        gpu = gpu_default;
    }
}

// Training attention over packed sequences of the given lengths.
static void test_attention_case(const int *lens, int B, int Hq, int Hkv, int D) {
    char name[64];
    snprintf(name, sizeof name, "attention D=%d %d/%d", D, Hq, Hkv);
    int32_t cu[16];
    cu[0] = 0;
    for (int b = 0; b < B; b++) cu[b + 1] = cu[b] + lens[b];
    const int N = cu[B];
    const float scale = 1.0f / sqrtf((float)D);
    Buf q = buf_rand((size_t)N * Hq * D, -2, 2), k = buf_rand((size_t)N * Hkv * D, -2, 2),
        v = buf_rand((size_t)N * Hkv * D, -1, 1), cus = buf_from(I32, cu, B + 1);
    Buf out = buf_new(STORAGE, (size_t)N * Hq * D), lse = buf_new(F32, (size_t)N * Hq);
    ops_attention_fwd(cpu, out.c, lse.c, q.c, k.c, v.c, cus.c, B, N, Hq, Hkv, D, scale);
    ops_attention_fwd(gpu, out.g, lse.g, q.g, k.g, v.g, cus.g, B, N, Hq, Hkv, D, scale);
    expect_ok(name);
    check(name, "out", out, 1e-2);
    check(name, "lse", lse, 1e-5);
    // Backward from the CPU's forward output and lse on both sides (the op's inputs, bf16-exact), so the
    // comparison isolates the backward kernels.
    float *out_h = fetch(cpu, out.c, STORAGE, out.n), *lse_h = fetch(cpu, lse.c, F32, lse.n);
    for (size_t i = 0; i < out.n; i++) out_h[i] = kt_round_bf16(out_h[i]);
    buf_set(out, 0, out_h, out.n);
    buf_set(lse, 0, lse_h, lse.n);
    free(out_h), free(lse_h);
    Buf dout = buf_rand((size_t)N * Hq * D, -1, 1);
    Buf dq = buf_rand((size_t)N * Hq * D, -9, 9), dk = buf_rand((size_t)N * Hkv * D, -9, 9),
        dv = buf_rand((size_t)N * Hkv * D, -9, 9);  // garbage: the op overwrites
    ops_attention_bwd(cpu, dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lse.c, cus.c, B, N, Hq, Hkv, D, scale);
    ops_attention_bwd(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, cus.g, B, N, Hq, Hkv, D, scale);
    expect_ok(name);
    check(name, "dq", dq, 1e-2);
    check(name, "dk", dk, 1e-2);
    check(name, "dv", dv, 1e-2);
    buf_free(q), buf_free(k), buf_free(v), buf_free(cus), buf_free(out), buf_free(lse), buf_free(dout), buf_free(dq),
        buf_free(dk), buf_free(dv);
}

static void test_attention(void) {
    const int lens_a[5] = {37, 1, 100, 5, 64};  // tiles straddle sequence boundaries; a length-1 sequence
    test_attention_case(lens_a, 5, 6, 2, 64);   // GQA 3:1, vectorized loads
    const int lens_b[3] = {1, 150, 20};
    test_attention_case(lens_b, 3, 4, 4, 20);   // MHA, D=20: element loads, head dim padded to 32
    const int lens_c[4] = {70, 3, 1, 44};
    test_attention_case(lens_c, 4, 8, 1, 96);   // MQA, D=96 padded to 128
    const int lens_d[3] = {33, 40, 1};
    test_attention_case(lens_d, 3, 4, 2, 136);  // D=136: zero-padded to the 256-wide tiles
    // A head dim beyond the CUDA kernels' reach is a clear error, not a crash.
    Buf big = buf_new(STORAGE, 4 * 300), l = buf_new(F32, 4);
    int32_t cu[2] = {0, 4};
    Buf cus = buf_from(I32, cu, 2);
    ops_attention_fwd(gpu, big.g, l.g, big.g, big.g, big.g, cus.g, 1, 4, 1, 1, 300, 1.0f);
    const int ok = ops_status(gpu) < 0 && strstr(ops_error(gpu), "head_dim 300");
    printf("%-4s %-20s head_dim 300 refused: \"%s\"\n", ok ? "ok" : "FAIL", "attention_fwd", ops_error(gpu));
    if (!ok) failures++;
    ops_clear_error(gpu);
    buf_free(big), buf_free(l), buf_free(cus);
}

static void test_paged_case(int Hq, int Hkv, int D, int block_size) {
    char name[64];
    snprintf(name, sizeof name, "paged D=%d %d/%d bs%d", D, Hq, Hkv, block_size);
    enum { NSEQ = 4, MAXB = 8, NBLK = 24 };
    const int ctx_len[NSEQ] = {1, 17, 50, 33};
    // Scattered block tables: a random permutation of the pool, unused entries -1.
    int32_t perm[NBLK], tables[NSEQ * MAXB];
    for (int i = 0; i < NBLK; i++) perm[i] = i;
    for (int i = NBLK - 1; i > 0; i--) {
        int j = irand(i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int used = 0;
    for (int s = 0; s < NSEQ; s++)
        for (int b = 0; b < MAXB; b++)
            tables[s * MAXB + b] = b * block_size < ctx_len[s] ? perm[used++] : -1;
    // Store every context token (plus padding tokens with slot -1 that must not land anywhere).
    int32_t slots[128];
    int n_store = 0;
    for (int s = 0; s < NSEQ; s++)
        for (int p = 0; p < ctx_len[s]; p++) {
            if (p % 9 == 4) slots[n_store++] = -1;
            slots[n_store++] = tables[s * MAXB + p / block_size] * block_size + p % block_size;
        }
    const size_t row = (size_t)Hkv * D, n_slots = (size_t)NBLK * block_size;
    Buf kc = buf_rand(n_slots * row, -1, 1), vc = buf_rand(n_slots * row, -1, 1);
    Buf k = buf_rand(n_store * row, -2, 2), v = buf_rand(n_store * row, -1, 1), sm = buf_from(I32, slots, n_store);
    ops_kv_cache_store(cpu, kc.c, vc.c, k.c, v.c, sm.c, n_store, Hkv, D);
    ops_kv_cache_store(gpu, kc.g, vc.g, k.g, v.g, sm.g, n_store, Hkv, D);
    expect_ok(name);
    check("kv_cache_store", "k_cache", kc, 0.0);  // exact copies, untouched slots unchanged
    check("kv_cache_store", "v_cache", vc, 0.0);
    // Queries: each sequence's decode token, a prefill chunk of sequence 2 (positions 20..35), and one token
    // without a sequence (NaN on both backends).
    int32_t tseq[32], tpos[32];
    int N = 0;
    for (int s = 0; s < NSEQ; s++) tseq[N] = s, tpos[N++] = ctx_len[s] - 1;
    for (int p = 20; p <= 35; p++) tseq[N] = 2, tpos[N++] = p;
    tseq[N] = -1, tpos[N++] = 3;
    Buf ts = buf_from(I32, tseq, N), tp = buf_from(I32, tpos, N), bt = buf_from(I32, tables, NSEQ * MAXB);
    Buf q = buf_rand((size_t)N * Hq * D, -2, 2), out = buf_new(STORAGE, (size_t)N * Hq * D);
    const float scale = 1.0f / sqrtf((float)D);
    ops_attention_paged_fwd(cpu, out.c, q.c, kc.c, vc.c, bt.c, ts.c, tp.c, N, Hq, Hkv, D, block_size, MAXB, scale);
    ops_attention_paged_fwd(gpu, out.g, q.g, kc.g, vc.g, bt.g, ts.g, tp.g, N, Hq, Hkv, D, block_size, MAXB, scale);
    expect_ok(name);
    check(name, "out", out, 1e-2);
    buf_free(kc), buf_free(vc), buf_free(k), buf_free(v), buf_free(sm), buf_free(ts), buf_free(tp), buf_free(bt),
        buf_free(q), buf_free(out);
}

// Paged attention alone over a random cache: n_seqs sequences of ctx_len[s] positions in scattered blocks of
// a pool (tables (n_seqs, max_blocks), unused entries -1). Queries: every sequence's decode token (position
// ctx_len - 1); with chunk_seq >= 0 also a prefill chunk of that sequence (positions chunk_from ..
// ctx_len - 2); with nan_tokens also three tokens without cache (no sequence, a negative position, a position
// past the block table). hole_seq >= 0 unassigns a block in the middle of that sequence's context, so its
// tokens that reach it get NaN on both backends. q is read at element offset q_off (1: a misaligned q).
// The CUDA backend splits the context over blocks (and merges the splits) when tokens x kv heads are few,
// decided from N, Hkv and the table size, so the cases below cover both: one token with a long context, a few
// dozen sequences, a prefill chunk beside decodes; and over a thousand decode tokens or a 640-token prompt,
// which an H100/H200 (132 SMs) does not split.
// Tolerance 1e-2 as for every bf16 output: the outputs are rounded to bf16 once; the fp32 sums differ only
// in order (and exp2 of log2-domain scores vs exp), orders of magnitude below that.
static void paged_attend_case(const char *what, int Hq, int Hkv, int D, int block_size, int max_blocks, int n_seqs,
                              const int *ctx_len, int hole_seq, int chunk_seq, int chunk_from, int nan_tokens,
                              size_t q_off) {
    char name[96];
    snprintf(name, sizeof name, "paged %s D=%d %d/%d bs%d", what, D, Hq, Hkv, block_size);
    int n_blk;
    char err[160];
    int32_t *tables = kt_paged_tables(n_seqs, ctx_len, block_size, max_blocks, 4, hole_seq, irand, &n_blk, err,
                                      sizeof err);
    if (!tables) {
        printf("FAIL %-22s %s\n", name, err);
        failures++;
        return;
    }
    int n_q = n_seqs + 3 + (chunk_seq >= 0 ? ctx_len[chunk_seq] : 0);
    int32_t *tseq = malloc((size_t)n_q * 4), *tpos = malloc((size_t)n_q * 4);
    int N = 0;
    for (int s = 0; s < n_seqs; s++) tseq[N] = s, tpos[N++] = ctx_len[s] - 1;
    if (chunk_seq >= 0)
        for (int p = chunk_from; p < ctx_len[chunk_seq] - 1; p++) tseq[N] = chunk_seq, tpos[N++] = p;
    if (nan_tokens) {
        tseq[N] = -1, tpos[N++] = 3;
        tseq[N] = 0, tpos[N++] = -1;
        tseq[N] = 0, tpos[N++] = max_blocks * block_size;
    }
    const size_t row = (size_t)Hkv * D, n_slots = (size_t)n_blk * block_size;
    Buf kc = buf_rand(n_slots * row, -2, 2), vc = buf_rand(n_slots * row, -1, 1);
    Buf bt = buf_from(I32, tables, (size_t)n_seqs * max_blocks);
    Buf ts = buf_from(I32, tseq, N), tp = buf_from(I32, tpos, N);
    Buf q = buf_rand((size_t)N * Hq * D + q_off, -2, 2), out = buf_new(STORAGE, (size_t)N * Hq * D);
    const float scale = 1.0f / sqrtf((float)D);
    ops_attention_paged_fwd(cpu, out.c, at_c(q, q_off), kc.c, vc.c, bt.c, ts.c, tp.c, N, Hq, Hkv, D, block_size,
                            max_blocks, scale);
    ops_attention_paged_fwd(gpu, out.g, at_g(q, q_off), kc.g, vc.g, bt.g, ts.g, tp.g, N, Hq, Hkv, D, block_size,
                            max_blocks, scale);
    expect_ok(name);
    check(name, "out", out, 1e-2);
    buf_free(kc), buf_free(vc), buf_free(bt), buf_free(ts), buf_free(tp), buf_free(q), buf_free(out);
    free(tables), free(tseq), free(tpos);
}

static void test_paged(void) {
    test_paged_case(6, 2, 64, 16);
    test_paged_case(4, 1, 80, 8);  // D not a multiple of 32: lanes with partial dims
    test_paged_case(14, 2, 36, 16);  // D not a multiple of 8: the per-head kernel

    // One decode token with a long context: one split per tile, some left empty by a table longer than it.
    const int one_long[1] = {2500}, one_longer[1] = {3001};
    paged_attend_case("batch 1", 14, 2, 64, 16, 256, 1, one_long, -1, -1, 0, 0, 0);
    paged_attend_case("batch 1 q+1", 14, 2, 64, 16, 160, 1, one_long, -1, -1, 0, 0, 1);  // misaligned q
    paged_attend_case("batch 1", 12, 2, 128, 32, 100, 1, one_longer, -1, -1, 0, 0, 0);
    paged_attend_case("batch 1 hole", 12, 2, 128, 16, 200, 1, one_longer, 0, -1, 0, 0, 0);

    // Many short sequences (no split), NaN tokens and a sequence with an unassigned block.
    enum { MANY = 1100 };
    int *many = malloc(MANY * sizeof *many);
    for (int s = 0; s < MANY; s++) many[s] = 1 + irand(70);
    many[5] = 40;  // the hole (block 1 of 3) lies inside the context
    paged_attend_case("many", 14, 2, 64, 16, 8, MANY, many, 5, -1, 0, 1, 0);
    for (int s = 0; s < MANY; s++) many[s] = 1 + irand(100);
    many[7] = 90;
    paged_attend_case("many", 12, 2, 128, 32, 4, MANY, many, 7, -1, 0, 1, 0);
    free(many);

    // A few dozen sequences of a few hundred to 1600 positions (splits), with NaN tokens and a hole.
    enum { SOME = 24 };
    int some[SOME];
    for (int s = 0; s < SOME; s++) some[s] = 200 + irand(1400);
    paged_attend_case("some", 12, 2, 128, 16, 128, SOME, some, 3, -1, 0, 1, 0);
    paged_attend_case("some", 14, 2, 64, 32, 64, SOME, some, 3, -1, 0, 1, 0);

    // Prefill chunks: a whole 640-token prompt (no split) and its last 200 positions beside other decodes.
    const int prompt[1] = {640}, mixed[5] = {1, 33, 500, 97, 1200};
    paged_attend_case("prefill", 14, 2, 64, 16, 48, 1, prompt, -1, 0, 0, 0, 0);
    paged_attend_case("prefill", 12, 2, 128, 16, 48, 1, prompt, -1, 0, 0, 0, 0);
    paged_attend_case("chunk", 14, 2, 64, 16, 48, 1, prompt, -1, 0, 440, 0, 0);
    paged_attend_case("chunk", 12, 2, 96, 32, 40, 5, mixed, -1, 4, 1000, 1, 0);  // 12 of 16 lanes per row

    // Other group sizes (1, 3 of 4 padded heads, 16 and 12 as two blocks per kv head, 5, 2), head dims (40,
    // 256), block sizes larger than a tile, smaller ones, and one that is not a power of two.
    paged_attend_case("mha", 4, 4, 128, 16, 80, 5, mixed, 2, -1, 0, 1, 0);
    paged_attend_case("g3", 6, 2, 64, 128, 10, 5, mixed, -1, 2, 400, 1, 0);
    paged_attend_case("g16", 16, 1, 64, 8, 160, 5, mixed, 4, -1, 0, 1, 0);
    paged_attend_case("g12", 12, 1, 128, 32, 40, 5, mixed, -1, 4, 1100, 1, 0);
    paged_attend_case("g5", 5, 1, 40, 24, 60, 5, mixed, -1, 1, 0, 1, 0);
    paged_attend_case("d256", 8, 2, 256, 16, 80, 5, mixed, 3, 3, 20, 1, 0);
    paged_attend_case("g2", 4, 2, 64, 16, 80, 5, mixed, -1, -1, 0, 1, 0);
}

// I = 77: the element path; I = 64 and 4480: 16-byte vectors; a misaligned view (element 1): the element path on a
// vector width. The large shapes have more work items than the grid has threads, so each thread walks several
// (row, column) steps.
static void test_swiglu_case(int N, int I, size_t off) {
    char fwd[48], bwd[48];
    snprintf(fwd, sizeof fwd, "swiglu_fwd I=%d%s", I, off ? "+1" : "");
    snprintf(bwd, sizeof bwd, "swiglu_bwd I=%d%s", I, off ? "+1" : "");
    const size_t ngu = (size_t)N * 2 * I, nout = (size_t)N * I;
    Buf gu = buf_new(STORAGE, ngu + off), out = buf_new(STORAGE, nout + off);
    Buf dout = buf_new(STORAGE, nout + off), dgu = buf_new(STORAGE, ngu + off);
    float *h = rand_host(ngu, -6, 6);
    buf_set(gu, off, h, ngu);
    free(h);
    h = rand_host(nout, -1, 1);
    buf_set(dout, off, h, nout);
    free(h);
    h = rand_host(ngu, -9, 9);  // overwritten
    buf_set(dgu, off, h, ngu);
    free(h);
    ops_swiglu_fwd(cpu, at_c(out, off), at_c(gu, off), N, I);
    ops_swiglu_fwd(gpu, at_g(out, off), at_g(gu, off), N, I);
    ops_swiglu_bwd(cpu, at_c(dgu, off), at_c(dout, off), at_c(gu, off), N, I);
    ops_swiglu_bwd(gpu, at_g(dgu, off), at_g(dout, off), at_g(gu, off), N, I);
    expect_ok(fwd);
    check_view(fwd, "out", out, off, nout, 1e-2);
    check_view(bwd, "dgu", dgu, off, ngu, 1e-2);
    buf_free(gu), buf_free(out), buf_free(dout), buf_free(dgu);
}

static void test_swiglu(void) {
    test_swiglu_case(33, 77, 0);
    test_swiglu_case(20001, 77, 0);
    test_swiglu_case(31, 64, 0);
    test_swiglu_case(2049, 4480, 0);
    test_swiglu_case(129, 4480, 1);
}

// ops_copy_2d: (rows, cols) from a src of pitch sp to a dst of pitch dp, at element offsets doff / soff (odd ones:
// rows that start 2-byte aligned in bf16). The whole dst buffer is compared, so a write outside the block shows.
static void test_copy_2d_case(const char *label, size_t rows, size_t cols, size_t dp, size_t sp, size_t doff,
                              size_t soff) {
    char name[48];
    snprintf(name, sizeof name, "copy_2d %s", label);
    const size_t n_dst = doff + (rows - 1) * dp + cols + 3, n_src = soff + (rows - 1) * sp + cols + 3;
    Buf dst = buf_rand(n_dst, -2, 2), src = buf_rand(n_src, -2, 2);
    ops_copy_2d(cpu, at_c(dst, doff), dp, at_c(src, soff), sp, rows, cols);
    ops_copy_2d(gpu, at_g(dst, doff), dp, at_g(src, soff), sp, rows, cols);
    expect_ok(name);
    check(name, "dst", dst, 0.0);  // exact copy; untouched elsewhere
    buf_free(dst), buf_free(src);
}

static void test_copy_2d(void) {
    // The fused q/k/v projection of Qwen2.5-1.5B (QD 1536, KVD 256): split into q, k, v, and the gradients packed.
    const size_t QD = 1536, KVD = 256, QKV = QD + 2 * KVD;
    test_copy_2d_case("split q", 1031, QD, QD, QKV, 0, 0);
    test_copy_2d_case("split k", 1031, KVD, KVD, QKV, 0, QD);
    test_copy_2d_case("split v", 1031, KVD, KVD, QKV, 0, QD + KVD);
    test_copy_2d_case("pack dv", 1031, KVD, QKV, KVD, QD + KVD, 0);
    test_copy_2d_case("contig", 7, 40, 40, 40, 0, 0);
    test_copy_2d_case("odd", 33, 13, 21, 17, 1, 3);
    test_copy_2d_case("one row", 1, 77, 77, 90, 5, 0);
}

static void test_logprobs_case(int N, int V, float inv_t, float offset) {
    char name[64];
    snprintf(name, sizeof name, "logprobs V=%d", V);
    int32_t tg[32];
    for (int i = 0; i < N; i++) tg[i] = i % 5 == 2 ? -1 : irand(V);  // some ignored rows
    float *lg = rand_host((size_t)N * V, -8, 8);
    for (int j = 0; j < V; j++) lg[j] = kt_round_bf16(lg[j] + offset);  // row 0 shifted: large logits stay stable
    Buf logits = buf_from(STORAGE, lg, (size_t)N * V), targets = buf_from(I32, tg, N);
    Buf lp = buf_new(F32, N), lse = buf_new(F32, N), ent = buf_new(F32, N);
    ops_logprobs_fwd(cpu, lp.c, lse.c, ent.c, logits.c, targets.c, N, V, inv_t);
    ops_logprobs_fwd(gpu, lp.g, lse.g, ent.g, logits.g, targets.g, N, V, inv_t);
    expect_ok(name);
    check(name, "logprobs", lp, 1e-5);  // fp32 results of fp32/double sums over exact inputs
    check(name, "lse", lse, 1e-5);
    check(name, "entropy", ent, 1e-5);
    Buf dlp = buf_rand_f32(N, -1, 1), dlogits = buf_rand((size_t)N * V, -9, 9);
    ops_logprobs_bwd(cpu, dlogits.c, dlp.c, NULL, NULL, logits.c, targets.c, lse.c, N, V, inv_t);
    ops_logprobs_bwd(gpu, dlogits.g, dlp.g, NULL, NULL, logits.g, targets.g, lse.g, N, V, inv_t);
    expect_ok(name);
    check(name, "dlogits", dlogits, 1e-2);
    // With the entropy term (GRPO's entropy bonus).
    Buf dent = buf_rand_f32(N, -1, 1);
    ops_logprobs_bwd(cpu, dlogits.c, dlp.c, dent.c, ent.c, logits.c, targets.c, lse.c, N, V, inv_t);
    ops_logprobs_bwd(gpu, dlogits.g, dlp.g, dent.g, ent.g, logits.g, targets.g, lse.g, N, V, inv_t);
    expect_ok(name);
    check(name, "dlogits+entropy", dlogits, 1e-2);
    // In place: the logits become their gradient (the trainer's kept logits).
    Buf inplace = buf_from(STORAGE, lg, (size_t)N * V);
    free(lg);
    ops_logprobs_bwd(cpu, inplace.c, dlp.c, dent.c, ent.c, inplace.c, targets.c, lse.c, N, V, inv_t);
    ops_logprobs_bwd(gpu, inplace.g, dlp.g, dent.g, ent.g, inplace.g, targets.g, lse.g, N, V, inv_t);
    expect_ok(name);
    check(name, "dlogits+entropy in place", inplace, 1e-2);
    buf_free(inplace);
    buf_free(dent);
    buf_free(logits), buf_free(targets), buf_free(lp), buf_free(lse), buf_free(ent), buf_free(dlp), buf_free(dlogits);
}

static void test_logprobs(void) {
    test_logprobs_case(13, 1003, 1.0f / 0.7f, 0.0f);
    test_logprobs_case(7, 5000, 1.0f, 1000.0f);
    test_logprobs_case(4, 33, 1.0f, 0.0f);                    // shorter than a vector or two: head and tail only
    test_logprobs_case(3, 151936, 1.0f / 0.6f, -20.0f);       // Qwen2.5's vocabulary, the size the kernels are tuned for
}

static void test_adamw(void) {
    const size_t n = 10007;
    Buf master = buf_rand_f32(n, -1, 1), m = buf_new(F32, n), v = buf_new(F32, n), p = buf_new(STORAGE, n);
    for (int step = 1; step <= 3; step++) {
        Buf grad = buf_rand_f32(n, -2, 2);
        ops_adamw_step(cpu, master.c, m.c, v.c, grad.c, p.c, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, step, 0.5f);
        ops_adamw_step(gpu, master.g, m.g, v.g, grad.g, p.g, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, step, 0.5f);
        buf_free(grad);
    }
    // One more step without a parameter copy and without weight decay.
    Buf grad = buf_rand_f32(n, -2, 2);
    ops_adamw_step(cpu, master.c, m.c, v.c, grad.c, NULL, n, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.0f, 4, 1.0f);
    ops_adamw_step(gpu, master.g, m.g, v.g, grad.g, NULL, n, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.0f, 4, 1.0f);
    expect_ok("adamw_step");
    check("adamw_step x4", "master", master, 1e-6);
    check("adamw_step x4", "m", m, 1e-6);
    check("adamw_step x4", "v", v, 1e-6);
    check("adamw_step x3", "param_out", p, 1e-2);  // bf16 of the step-3 master
    buf_free(master), buf_free(m), buf_free(v), buf_free(p), buf_free(grad);
}

static void test_sum_squares(void) {
    const size_t n = 100003;
    Buf x = buf_rand_f32(n, -3, 3);
    float init = 1.5f;
    Buf out = buf_from(F32, &init, 1);
    ops_sum_squares(cpu, out.c, x.c, n);
    ops_sum_squares(gpu, out.g, x.g, n);
    ops_sum_squares(cpu, out.c, x.c, n - 5);
    ops_sum_squares(gpu, out.g, x.g, n - 5);
    expect_ok("sum_squares");
    check("sum_squares", "out (+=)", out, 1e-6);  // double sums on both sides
    buf_free(x), buf_free(out);
}

int main(void) {
    const int opened = kt_open_cpu_gpu(&cpu, &gpu);
    if (opened) return opened;
    printf("%-4s %-20s %-10s %8s  %-18s  %-14s  %s\n", "", "op", "tensor", "n", "max abs error", "scaled error",
           "tolerance");
    test_add();
    test_copy_2d_batch();
    test_fill_hashed_uniform();
    test_upload_rounding();
    test_embedding();
    test_rmsnorm();
    test_residual_rmsnorm();
    test_rope();
    test_matmul();
    test_attention();
    test_paged();
    test_swiglu();
    test_copy_2d();
    test_logprobs();
    test_adamw();
    test_sum_squares();
    ops_destroy(cpu);
    ops_destroy(gpu);
    return check_exit_code("test_cuda_vs_cpu");
}
