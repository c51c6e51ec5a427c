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
//   exact copies                 0     (embedding rows, KV cache slots)
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

static OpsCtx *cpu, *gpu;
static int failures;

// ---- random numbers, bf16 rounding ------------------------------------------------------------------

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_next(void) {  // splitmix64
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float urand(float lo, float hi) { return lo + (hi - lo) * (float)((rng_next() >> 40) * (1.0 / 16777216.0)); }
static int irand(int n) { return (int)(rng_next() % (uint64_t)n); }

// Round-to-nearest-even to bf16, kept in an fp32 (what the CUDA upload would do; done here so that the CPU
// backend sees the same values).
static float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float *rand_host(size_t n, float lo, float hi) {
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = round_bf16(urand(lo, hi));
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

static void expect_ok(const char *what) {
    ops_synchronize(gpu);
    if (ops_status(cpu) || ops_status(gpu)) {
        printf("FAIL %-22s unexpected error: cpu \"%s\" cuda \"%s\"\n", what, ops_error(cpu), ops_error(gpu));
        failures++;
        ops_clear_error(cpu);
        ops_clear_error(gpu);
    }
}

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
static void test_matmul_case(int N, int IC, int OC, int bias_mode) {
    char name[64];
    snprintf(name, sizeof name, "matmul %dx%dx%d%s", N, IC, OC, bias_mode == 2 ? " b+1" : bias_mode ? " b" : "");
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

static void test_matmul(void) {
    test_matmul_case(37, 67, 45, 1);    // odd everything: unaligned rows for cuBLASLt
    test_matmul_case(64, 128, 96, 1);   // aligned
    test_matmul_case(33, 64, 24, 2);    // misaligned bias pointer
    test_matmul_case(1, 256, 130, 0);   // a single row, no bias
    test_matmul_case(300, 40, 8, 1);    // long and thin (dw reduces over 300 rows)
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
    for (size_t i = 0; i < out.n; i++) out_h[i] = round_bf16(out_h[i]);
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

static void test_paged(void) {
    test_paged_case(6, 2, 64, 16);
    test_paged_case(4, 1, 80, 8);  // D not a multiple of 32: lanes with partial dims
}

static void test_swiglu(void) {
    const int N = 33, I = 77;
    Buf gu = buf_rand((size_t)N * 2 * I, -6, 6), out = buf_new(STORAGE, (size_t)N * I);
    Buf dout = buf_rand((size_t)N * I, -1, 1), dgu = buf_rand((size_t)N * 2 * I, -9, 9);
    ops_swiglu_fwd(cpu, out.c, gu.c, N, I);
    ops_swiglu_fwd(gpu, out.g, gu.g, N, I);
    ops_swiglu_bwd(cpu, dgu.c, dout.c, gu.c, N, I);
    ops_swiglu_bwd(gpu, dgu.g, dout.g, gu.g, N, I);
    expect_ok("swiglu");
    check("swiglu_fwd", "out", out, 1e-2);
    check("swiglu_bwd", "dgu", dgu, 1e-2);
    buf_free(gu), buf_free(out), buf_free(dout), buf_free(dgu);
}

static void test_logprobs_case(int N, int V, float inv_t, float offset) {
    char name[64];
    snprintf(name, sizeof name, "logprobs V=%d", V);
    int32_t tg[32];
    for (int i = 0; i < N; i++) tg[i] = i % 5 == 2 ? -1 : irand(V);  // some ignored rows
    float *lg = rand_host((size_t)N * V, -8, 8);
    for (int j = 0; j < V; j++) lg[j] = round_bf16(lg[j] + offset);  // row 0 shifted: large logits stay stable
    Buf logits = buf_from(STORAGE, lg, (size_t)N * V), targets = buf_from(I32, tg, N);
    free(lg);
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
    buf_free(dent);
    buf_free(logits), buf_free(targets), buf_free(lp), buf_free(lse), buf_free(ent), buf_free(dlp), buf_free(dlogits);
}

static void test_logprobs(void) {
    test_logprobs_case(13, 1003, 1.0f / 0.7f, 0.0f);
    test_logprobs_case(7, 5000, 1.0f, 1000.0f);
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
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        printf("SKIP: no CUDA device\n");
        return 77;
    }
    char err[256];
    if (ops_create(&cpu, OPS_BACKEND_CPU, 0, err, sizeof err) != 0 ||
        ops_create(&gpu, OPS_BACKEND_CUDA, 0, err, sizeof err) != 0) {
        printf("FAIL: cannot create the contexts: %s\n", err);
        return 1;
    }
    printf("%-4s %-20s %-10s %8s  %-18s  %-14s  %s\n", "", "op", "tensor", "n", "max abs error", "scaled error",
           "tolerance");
    test_add();
    test_embedding();
    test_rmsnorm();
    test_rope();
    test_matmul();
    test_attention();
    test_paged();
    test_swiglu();
    test_logprobs();
    test_adamw();
    test_sum_squares();
    ops_destroy(cpu);
    ops_destroy(gpu);
    if (failures) {
        printf("FAIL: %d check(s) out of tolerance or erroring\n", failures);
        return 1;
    }
    printf("PASS: every CUDA op matches its CPU twin within the stated tolerances\n");
    return 0;
}
