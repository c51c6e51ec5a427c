// tests/unit/test_cuda_attention.c — the CUDA training attention (ops_attention_fwd / ops_attention_bwd)
// against its CPU twin on the shapes the model runs and on the awkward ones the kernels must still handle:
//   Qwen2.5-0.5B heads (14 query / 2 kv, GQA 7:1, head_dim 64) and 1.5B heads (12 / 2, head_dim 128) over
//   packed sequences of 1 to 2048 tokens; many short random-length sequences; head dims that are padded
//   (8, 20, 80) or split into column chunks (256); element-wise loads (head_dim 20); tokens outside every
//   sequence and an empty sequence (the forward leaves their rows alone, the backward zeroes them).
// Inputs are random, rounded to bf16 on the host so both backends start from the same values; the backward
// runs on both sides from the CPU forward's out and lse, so it is compared in isolation.
//
// Error measure per tensor (as tests/unit/test_cuda_vs_cpu.c): e = max_i |gpu_i - cpu_i| / (|cpu_i| + rms(cpu)).
// Tolerances:
//   out       2e-2  the P V product takes the probabilities in bf16 (8 significant bits): the max over a
//                   million elements of that rounding, summed over up to 2048 keys, reaches 1.0-1.2e-2 in a
//                   float64 simulation of these shapes, plus the output's own bf16 rounding (<= 3.9e-3).
//   lse       1e-5  fp32 on both sides; only the summation order differs.
//   dq dk dv  1e-2  P and dS enter their products as bf16 pairs (16 bits), so what remains is the outputs'
//                   bf16 rounding (<= 3.9e-3) and fp32 summation order.
// Without a CUDA device the test prints "SKIP: no CUDA device" and returns 77 (ctest: skipped).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "kernels_testlib.h"
#include "ops_testlib.h"

static OpsCtx *cpu, *gpu;

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static uint64_t rng_next(void) { return kt_splitmix_next(&rng_state); }
static float urand(float lo, float hi) { return kt_uniform_in(rng_next(), lo, hi); }

// The same tensor on both backends: storage dtype (bf16 / fp32) unless f32.
typedef struct {
    void *c, *g;
    size_t n;
    int f32;
} Buf;

static Buf buf_new(size_t n, int f32) {
    const size_t es_c = 4, es_g = f32 ? 4 : ops_dtype_size(gpu);
    Buf b = {ops_malloc(cpu, n * es_c + 16), ops_malloc(gpu, n * es_g + 16), n, f32};
    if (!b.c || !b.g) {
        fprintf(stderr, "FATAL: allocation of %zu elements failed: %s %s\n", n, ops_error(cpu), ops_error(gpu));
        exit(1);
    }
    return b;
}
static void buf_set(Buf b, const float *h) {
    if (b.f32) {
        ops_copy_to_device(cpu, b.c, h, b.n * 4);
        ops_copy_to_device(gpu, b.g, h, b.n * 4);
    } else {
        ops_upload_f32(cpu, b.c, h, b.n);
        ops_upload_f32(gpu, b.g, h, b.n);
    }
}
static Buf buf_rand(size_t n, float lo, float hi) {
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = kt_round_bf16(urand(lo, hi));
    Buf b = buf_new(n, 0);
    buf_set(b, h);
    free(h);
    return b;
}
static void buf_free(Buf b) {
    ops_free(cpu, b.c);
    ops_free(gpu, b.g);
}
static float *fetch(OpsCtx *ctx, const void *p, size_t n, int f32) {
    float *h = malloc((n ? n : 1) * sizeof *h);
    if (f32) ops_copy_to_host(ctx, h, p, n * 4);
    else ops_download_f32(ctx, h, p, n);
    return h;
}

static void check(const char *name, const char *tensor, Buf b, double tol) {
    float *c = fetch(cpu, b.c, b.n, b.f32), *g = fetch(gpu, b.g, b.n, b.f32);
    double ss = 0.0;
    for (size_t i = 0; i < b.n; i++) ss += (double)c[i] * c[i];
    const double rms = b.n ? sqrt(ss / b.n) : 0.0;
    double max_abs = 0.0, max_rel = 0.0;
    size_t worst = 0, nonfinite = 0;
    for (size_t i = 0; i < b.n; i++) {
        if (!isfinite(g[i]) || !isfinite(c[i])) {
            nonfinite++;
            continue;
        }
        const double d = fabs((double)g[i] - c[i]), r = d / (fabs(c[i]) + rms + 1e-30);
        if (d > max_abs) max_abs = d;
        if (r > max_rel) max_rel = r, worst = i;
    }
    const int ok = max_rel <= tol && nonfinite == 0;
    printf("%-4s %-28s %-4s %9zu  max_abs %9.3e  err %9.3e  tol %6.0e", ok ? "ok" : "FAIL", name, tensor, b.n, max_abs,
           max_rel, tol);
    if (nonfinite) printf("  (%zu non-finite)", nonfinite);
    if (!ok && b.n) printf("  worst [%zu] cpu %.7g cuda %.7g", worst, c[worst], g[worst]);
    printf("\n");
    if (!ok) failures++;
    free(c);
    free(g);
}

// Rows [r0, r1) of a (rows, width) gradient that no sequence covers must be exactly zero on the GPU.
static void check_zero_rows(const char *name, const char *tensor, Buf b, size_t width, size_t r0, size_t r1) {
    float *g = fetch(gpu, b.g, b.n, b.f32);
    size_t bad = 0;
    for (size_t i = r0 * width; i < r1 * width; i++) bad += g[i] != 0.0f;
    printf("%-4s %-28s %-4s rows [%zu, %zu) outside every sequence are zero (%zu nonzero)\n", bad ? "FAIL" : "ok", name,
           tensor, r0, r1, bad);
    if (bad) failures++;
    free(g);
}

// cu (B + 1) offsets; N >= cu[B] tokens (the rest outside every sequence).
static void run_case(const char *name, const int32_t *cu, int B, int N, int Hq, int Hkv, int D) {
    const float scale = 1.0f / sqrtf((float)D);
    const size_t nq = (size_t)N * Hq * D, nk = (size_t)N * Hkv * D;
    Buf q = buf_rand(nq, -2, 2), k = buf_rand(nk, -2, 2), v = buf_rand(nk, -1, 1);
    Buf cus = buf_new((size_t)B + 1, 1);
    buf_set(cus, (const float *)(const void *)cu);  // raw 4-byte copy of the int32 offsets
    Buf out = buf_rand(nq, -5, 5);                  // rows outside every sequence keep these values
    Buf lse = buf_new((size_t)N * Hq, 1);
    ops_attention_fwd(cpu, out.c, lse.c, q.c, k.c, v.c, cus.c, B, N, Hq, Hkv, D, scale);
    ops_attention_fwd(gpu, out.g, lse.g, q.g, k.g, v.g, cus.g, B, N, Hq, Hkv, D, scale);
    kt_expect_no_errors(cpu, gpu, name);
    check(name, "out", out, 2e-2);
    {  // lse rows outside every sequence are never written: compare the covered range only.
        Buf view = lse;
        view.n = (size_t)cu[B] * Hq;
        check(name, "lse", view, 1e-5);
    }
    float *out_h = fetch(cpu, out.c, nq, 0), *lse_h = fetch(cpu, lse.c, (size_t)N * Hq, 1);
    for (size_t i = 0; i < nq; i++) out_h[i] = kt_round_bf16(out_h[i]);
    buf_set(out, out_h);
    buf_set(lse, lse_h);
    free(out_h), free(lse_h);
    Buf dout = buf_rand(nq, -1, 1);
    Buf dq = buf_rand(nq, -9, 9), dk = buf_rand(nk, -9, 9), dv = buf_rand(nk, -9, 9);  // overwritten
    ops_attention_bwd(cpu, dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lse.c, cus.c, B, N, Hq, Hkv, D, scale);
    ops_attention_bwd(gpu, dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, cus.g, B, N, Hq, Hkv, D, scale);
    kt_expect_no_errors(cpu, gpu, name);
    check(name, "dq", dq, 1e-2);
    check(name, "dk", dk, 1e-2);
    check(name, "dv", dv, 1e-2);
    if (cu[0] > 0) {
        check_zero_rows(name, "dq", dq, (size_t)Hq * D, 0, (size_t)cu[0]);
        check_zero_rows(name, "dk", dk, (size_t)Hkv * D, 0, (size_t)cu[0]);
    }
    if (cu[B] < N) {
        check_zero_rows(name, "dq", dq, (size_t)Hq * D, (size_t)cu[B], (size_t)N);
        check_zero_rows(name, "dv", dv, (size_t)Hkv * D, (size_t)cu[B], (size_t)N);
    }
    buf_free(q), buf_free(k), buf_free(v), buf_free(cus), buf_free(out), buf_free(lse), buf_free(dout);
    buf_free(dq), buf_free(dk), buf_free(dv);
}

// Packs sequences of the given lengths back to back from token 0.
static void run_lens(const char *name, const int *lens, int B, int Hq, int Hkv, int D) {
    int32_t *cu = malloc(((size_t)B + 1) * sizeof *cu);
    cu[0] = 0;
    for (int b = 0; b < B; b++) cu[b + 1] = cu[b] + lens[b];
    run_case(name, cu, B, cu[B], Hq, Hkv, D);
    free(cu);
}

int main(void) {
    const int opened = kt_open_cpu_gpu(&cpu, &gpu);
    if (opened) return opened;
    const int qwen05[4] = {1024, 1024, 37, 1};
    run_lens("Qwen2.5-0.5B 14/2 D=64", qwen05, 4, 14, 2, 64);
    const int qwen15[4] = {2048, 129, 1, 500};
    run_lens("Qwen2.5-1.5B 12/2 D=128", qwen15, 4, 12, 2, 128);
    enum { NR = 40 };
    int rnd[NR];
    for (int b = 0; b < NR; b++) rnd[b] = 1 + (int)(rng_next() % 300);
    run_lens("40 random lengths 8/2 D=64", rnd, NR, 8, 2, 64);
    run_lens("40 random lengths 6/6 D=128", rnd, NR, 6, 6, 128);
    const int mixed[3] = {300, 77, 1};
    run_lens("MQA 4/1 D=80 (padded)", mixed, 3, 4, 1, 80);
    run_lens("GQA 4/2 D=256 (2 chunks)", mixed, 3, 4, 2, 256);
    run_lens("MHA 3/3 D=20 (element loads)", mixed, 3, 3, 3, 20);
    run_lens("GQA 6/2 D=8", mixed, 3, 6, 2, 8);
    // Tokens [0, 5) and [300, 320) outside every sequence; sequence 1 is empty.
    const int32_t gaps[4] = {5, 100, 100, 300};
    run_case("gaps and an empty sequence", gaps, 3, 320, 4, 2, 64);
    ops_destroy(cpu);
    ops_destroy(gpu);
    return check_exit_code("test_cuda_attention");
}
