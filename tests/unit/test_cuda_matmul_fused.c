// test_cuda_matmul_fused.c — ops_matmul_fused_fwd (a projection with its RMSNorm prologue, SwiGLU epilogue or
// residual-add epilogue), the decode step's fused projections (kernels/cuda/cuda_gemv.cu, shared/model_layer.c
// layer_decode_small).
//
// CPU part (always runs): misuse is refused with a message (no fusion struct, a norm without its h scratch, SwiGLU
// with a residual or an odd OC, SwiGLU without gu scratch, rope_store without its buffers or with a wrong OC) and
// leaves the output untouched; N = 0 does nothing.
// CUDA part (without a device: "SKIP", exit 77, after the CPU part passed): for 1 and 2 rows (the fused kernel) and
// 3 rows (the unfused sequence on the GPU), the Qwen2.5-0.5B/1.5B projection shapes and odd small ones, every
// fusion with and without bias (the q/k/v projection with RoPE and the KV cache store too: q and both caches), against
// the CPU backend running the unfused sequence on the same bf16 inputs:
// e = max |gpu - cpu| / (|cpu| + rms(cpu)) <= 2e-2 (bf16 outputs, bf16-rounded intermediates on the GPU; the norm's
// h may differ from ops_rmsnorm_fwd's in its last bit). An output that is the residual is refused (the unfused
// order would overwrite the residual before adding it). Then chains of MLP blocks whose every projection reads the
// one before's output (check_chain): eagerly against the CPU within the same bound, and replayed from a CUDA graph
// against the eager kernels bit for bit.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "kernels_testlib.h"

static float *rand_bf16(size_t n, double scale) {
    float *x = kt_falloc(n);
    kt_fill(x, n, scale);
    for (size_t i = 0; i < n; i++) x[i] = kt_round_bf16(x[i]);
    return x;
}

static void *up(OpsCtx *ctx, const float *host, size_t n) {
    void *p = ops_malloc(ctx, n * ops_dtype_size(ctx));
    if (p && host) ops_upload_f32(ctx, p, host, n);
    return p;
}

static float *down(OpsCtx *ctx, const void *p, size_t n) {
    float *h = kt_falloc(n);
    ops_download_f32(ctx, h, p, n);
    return h;
}

enum { NORM = 1, SWIGLU = 2, RESIDUAL = 4, BIAS = 8 };

// out on one backend, downloaded (n_out = OC, or OC / 2 with SWIGLU).
static float *run(OpsCtx *ctx, int flags, int N, int IC, int OC, const float *in, const float *w, const float *bias,
                  const float *norm_w, const float *res) {
    const size_t n_out = (size_t)N * (flags & SWIGLU ? OC / 2 : OC);
    void *d_in = up(ctx, in, (size_t)N * IC), *d_w = up(ctx, w, (size_t)OC * IC);
    void *d_bias = flags & BIAS ? up(ctx, bias, OC) : NULL, *d_nw = flags & NORM ? up(ctx, norm_w, IC) : NULL;
    void *d_res = flags & RESIDUAL ? up(ctx, res, n_out) : NULL;
    void *d_out = up(ctx, NULL, n_out);
    void *h = up(ctx, NULL, (size_t)N * IC), *gu = up(ctx, NULL, (size_t)N * OC);
    OpsProjFusion f = {.norm_w = d_nw, .eps = 1e-6f, .h = h, .swiglu = !!(flags & SWIGLU), .gu = gu,
                       .residual = d_res};
    ops_matmul_fused_fwd(ctx, d_out, d_in, d_w, d_bias, N, IC, OC, &f);
    float *out = down(ctx, d_out, n_out);
    CHECK(ops_status(ctx) == 0, "matmul_fused flags %d N=%d IC=%d OC=%d: unexpected error \"%s\"", flags, N, IC, OC,
          ops_error(ctx));
    ops_clear_error(ctx);
    void *bufs[] = {d_in, d_w, d_bias, d_nw, d_out, d_res, h, gu};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) ops_free(ctx, bufs[i]);
    return out;
}

static void check_case(OpsCtx *cpu, OpsCtx *gpu, int flags, int N, int IC, int OC) {
    const size_t n_out = (size_t)N * (flags & SWIGLU ? OC / 2 : OC);
    // Inputs of rms ~1 (a residual stream) or ~0.3, weights ~1/sqrt(IC): outputs of order 1.
    float *in = rand_bf16((size_t)N * IC, flags & NORM ? 3.0 : 1.0), *w = rand_bf16((size_t)OC * IC, 1.7 / sqrt(IC));
    float *bias = rand_bf16(OC, 0.5), *norm_w = rand_bf16(IC, 1.0), *res = rand_bf16(n_out, 2.0);
    for (int i = 0; i < IC; i++) norm_w[i] = kt_round_bf16(1.0f + 0.5f * norm_w[i]);
    float *c = run(cpu, flags, N, IC, OC, in, w, bias, norm_w, res);
    float *g = run(gpu, flags, N, IC, OC, in, w, bias, norm_w, res);
    double rms = 0, e = 0;
    for (size_t i = 0; i < n_out; i++) rms += (double)c[i] * c[i];
    rms = sqrt(rms / (double)n_out);
    for (size_t i = 0; i < n_out; i++) {
        const double d = fabs((double)g[i] - c[i]) / (fabs(c[i]) + rms);
        if (!(d <= e)) e = d;   // NaN propagates
    }
    CHECK(e <= 2e-2, "matmul_fused %s%s%s%s N=%d IC=%d OC=%d: error %.3g > 2e-2", flags & NORM ? "norm " : "",
          flags & SWIGLU ? "swiglu " : "", flags & RESIDUAL ? "residual " : "", flags & BIAS ? "bias " : "", N, IC,
          OC, e);
    free(in), free(w), free(bias), free(norm_w), free(res), free(c), free(g);
}

// Largest e = |g - c| / (|c| + rms(c)) over n values (NaN propagates).
static double scaled_err(const float *c, const float *g, size_t n) {
    double rms = 0, e = 0;
    for (size_t i = 0; i < n; i++) rms += (double)c[i] * c[i];
    rms = sqrt(rms / (double)n);
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)g[i] - c[i]) / (fabs(c[i]) + rms);
        if (!(d <= e)) e = d;
    }
    return e;
}

// The q/k/v projection with its norm, RoPE and KV cache store (rope_store) on one backend: q (N, Hq, D) and both
// caches (N_SLOTS, Hkv, D, random before) downloaded into *q, *kc, *vc. Row r's position pos[r], its slot slot[r].
enum { N_SLOTS = 6 };
static void run_rope(OpsCtx *ctx, int N, int IC, int Hq, int Hkv, int D, const float *in, const float *w,
                     const float *bias, const float *norm_w, const float *cache0, const int32_t *pos,
                     const int32_t *slot, const float *inv_freq, float **q, float **kc, float **vc) {
    const int OC = (Hq + 2 * Hkv) * D;
    const size_t n_cache = (size_t)N_SLOTS * Hkv * D;
    void *d_in = up(ctx, in, (size_t)N * IC), *d_w = up(ctx, w, (size_t)OC * IC), *d_bias = up(ctx, bias, OC);
    void *d_nw = up(ctx, norm_w, IC), *d_q = up(ctx, NULL, (size_t)N * Hq * D), *h = up(ctx, NULL, (size_t)N * IC);
    void *qkv = up(ctx, NULL, (size_t)N * OC), *d_kc = up(ctx, cache0, n_cache), *d_vc = up(ctx, cache0 + n_cache, n_cache);
    int32_t *d_pos = ops_malloc(ctx, (size_t)N * 4), *d_slot = ops_malloc(ctx, (size_t)N * 4);
    float *d_if = ops_malloc(ctx, (size_t)(D / 2) * 4);
    ops_copy_to_device(ctx, d_pos, pos, (size_t)N * 4);
    ops_copy_to_device(ctx, d_slot, slot, (size_t)N * 4);
    ops_copy_to_device(ctx, d_if, inv_freq, (size_t)(D / 2) * 4);
    OpsProjFusion f = {.norm_w = d_nw, .eps = 1e-6f, .h = h, .rope_store = 1, .qkv = qkv, .positions = d_pos,
                       .slot_mapping = d_slot, .inv_freq = d_if, .k_cache = d_kc, .v_cache = d_vc, .Hq = Hq,
                       .Hkv = Hkv, .D = D};
    ops_matmul_fused_fwd(ctx, d_q, d_in, d_w, d_bias, N, IC, OC, &f);
    *q = down(ctx, d_q, (size_t)N * Hq * D);
    *kc = down(ctx, d_kc, n_cache);
    *vc = down(ctx, d_vc, n_cache);
    CHECK(ops_status(ctx) == 0, "matmul_fused rope_store N=%d IC=%d %d/%d D=%d: unexpected error \"%s\"", N, IC, Hq,
          Hkv, D, ops_error(ctx));
    ops_clear_error(ctx);
    void *bufs[] = {d_in, d_w, d_bias, d_nw, d_q, h, qkv, d_kc, d_vc, d_pos, d_slot, d_if};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) ops_free(ctx, bufs[i]);
}

// rope_store against the CPU's unfused sequence (projection, then ops_qkv_rope_store_fwd): q, and both caches
// whole (the slot of each row written, a negative slot and the other slots untouched).
static void check_rope_case(OpsCtx *cpu, OpsCtx *gpu, int N, int IC, int Hq, int Hkv, int D) {
    const int OC = (Hq + 2 * Hkv) * D;
    const size_t n_cache = (size_t)N_SLOTS * Hkv * D;
    float *in = rand_bf16((size_t)N * IC, 3.0), *w = rand_bf16((size_t)OC * IC, 1.7 / sqrt(IC));
    float *bias = rand_bf16(OC, 0.5), *norm_w = rand_bf16(IC, 1.0), *cache0 = rand_bf16(2 * n_cache, 1.0);
    for (int i = 0; i < IC; i++) norm_w[i] = kt_round_bf16(1.0f + 0.5f * norm_w[i]);
    const int32_t pos[3] = {4093, 7, 0}, slot[3] = {4, N == 1 ? 1 : -1, 0};
    float *inv_freq = kt_falloc((size_t)D / 2);
    for (int i = 0; i < D / 2; i++) inv_freq[i] = (float)pow(1e6, -2.0 * i / D);
    float *cq, *ck, *cv, *gq, *gk, *gv;
    run_rope(cpu, N, IC, Hq, Hkv, D, in, w, bias, norm_w, cache0, pos, slot, inv_freq, &cq, &ck, &cv);
    run_rope(gpu, N, IC, Hq, Hkv, D, in, w, bias, norm_w, cache0, pos, slot, inv_freq, &gq, &gk, &gv);
    const double eq = scaled_err(cq, gq, (size_t)N * Hq * D), ek = scaled_err(ck, gk, n_cache),
                 ev = scaled_err(cv, gv, n_cache);
    CHECK(eq <= 2e-2 && ek <= 2e-2 && ev <= 2e-2,
          "matmul_fused rope_store N=%d IC=%d %d/%d D=%d: error q %.3g k cache %.3g v cache %.3g > 2e-2", N, IC, Hq,
          Hkv, D, eq, ek, ev);
    free(in), free(w), free(bias), free(norm_w), free(cache0), free(inv_freq);
    free(cq), free(ck), free(cv), free(gq), free(gk), free(gv);
}

// CHAIN_LAYERS MLP blocks back to back, each projection reading what the launch before it wrote (a decode step's
// order): x <- x + swiglu(rmsnorm(x) Wgu^T) Wd^T, unfused on the CPU, fused on the GPU, eagerly and replayed twice
// from a CUDA graph.
enum { CHAIN_LAYERS = 6 };
static float *run_chain(OpsCtx *ctx, int use_graph, int N, int C, int I, const float *x0, float *const *wgu,
                        float *const *wd, float *const *norm_w) {
    void *x = up(ctx, x0, (size_t)N * C), *xmid = up(ctx, NULL, (size_t)N * C), *act = up(ctx, NULL, (size_t)N * I);
    void *h = up(ctx, NULL, (size_t)N * C), *gu = up(ctx, NULL, (size_t)N * 2 * I);
    void *d_gu[CHAIN_LAYERS], *d_d[CHAIN_LAYERS], *d_nw[CHAIN_LAYERS];
    for (int l = 0; l < CHAIN_LAYERS; l++) {
        d_gu[l] = up(ctx, wgu[l], (size_t)2 * I * C);
        d_d[l] = up(ctx, wd[l], (size_t)C * I);
        d_nw[l] = up(ctx, norm_w[l], C);
    }
    OpsGraph *graph = NULL;
    const int recording = use_graph && ops_graph_begin(ctx) == 0;
    CHECK(!use_graph || recording, "chain: the graph recording did not start (\"%s\")", ops_error(ctx));
    for (int l = 0; l < CHAIN_LAYERS; l++) {
        void *in = l % 2 ? xmid : x, *out = l % 2 ? x : xmid;
        ops_matmul_fused_fwd(ctx, act, in, d_gu[l], NULL, N, C, 2 * I,
                             &(OpsProjFusion){.norm_w = d_nw[l], .eps = 1e-6f, .h = h, .swiglu = 1, .gu = gu});
        ops_matmul_fused_fwd(ctx, out, act, d_d[l], NULL, N, I, C, &(OpsProjFusion){.residual = in});
    }
    if (recording) {
        CHECK(ops_graph_end(ctx, &graph) == 0, "chain: recording failed: %s", ops_error(ctx));
        // Each replay runs the blocks over what the one before left: two replays from x0 make 2 CHAIN_LAYERS
        // blocks, which the caller compares with the CPU running them as often.
        for (int r = 0; r < 2 && graph; r++) ops_graph_launch(ctx, graph);
        ops_graph_destroy(ctx, graph);
    }
    float *res = down(ctx, CHAIN_LAYERS % 2 ? xmid : x, (size_t)N * C);
    CHECK(ops_status(ctx) == 0, "chain N=%d: unexpected error \"%s\"", N, ops_error(ctx));
    ops_clear_error(ctx);
    ops_free(ctx, x), ops_free(ctx, xmid), ops_free(ctx, act), ops_free(ctx, h), ops_free(ctx, gu);
    for (int l = 0; l < CHAIN_LAYERS; l++) ops_free(ctx, d_gu[l]), ops_free(ctx, d_d[l]), ops_free(ctx, d_nw[l]);
    return res;
}

static void check_chain(OpsCtx *cpu, OpsCtx *gpu, int N, int C, int I) {
    float *x0 = rand_bf16((size_t)N * C, 1.0), *wgu[CHAIN_LAYERS], *wd[CHAIN_LAYERS], *norm_w[CHAIN_LAYERS];
    for (int l = 0; l < CHAIN_LAYERS; l++) {
        wgu[l] = rand_bf16((size_t)2 * I * C, 1.7 / sqrt(C));
        wd[l] = rand_bf16((size_t)C * I, 0.5 / sqrt(I));
        norm_w[l] = rand_bf16(C, 1.0);
        for (int i = 0; i < C; i++) norm_w[l][i] = kt_round_bf16(1.0f + 0.5f * norm_w[l][i]);
    }
    float *c = run_chain(cpu, 0, N, C, I, x0, wgu, wd, norm_w);
    float *g = run_chain(gpu, 0, N, C, I, x0, wgu, wd, norm_w);
    const double e = scaled_err(c, g, (size_t)N * C);
    CHECK(e <= 2e-2, "chain of %d MLP blocks N=%d C=%d I=%d, eager: error %.3g > 2e-2", CHAIN_LAYERS, N, C, I, e);
    // Two graph replays from x0 against the eager kernels run over the first pass's output: the same kernels in the
    // same order, so bit for bit.
    float *g2 = run_chain(gpu, 1, N, C, I, x0, wgu, wd, norm_w);
    float *e2 = run_chain(gpu, 0, N, C, I, g, wgu, wd, norm_w);
    size_t diff = 0;
    for (size_t i = 0; i < (size_t)N * C; i++) diff += memcmp(&g2[i], &e2[i], sizeof(float)) != 0;
    CHECK(diff == 0, "chain of %d MLP blocks N=%d C=%d I=%d: two graph replays differ from the eager kernels in %zu "
          "of %zu values", 2 * CHAIN_LAYERS, N, C, I, diff, (size_t)N * C);
    free(x0), free(c), free(g), free(g2), free(e2);
    for (int l = 0; l < CHAIN_LAYERS; l++) free(wgu[l]), free(wd[l]), free(norm_w[l]);
}

static void test_misuse(OpsCtx *ctx) {
    float buf[64] = {0};
    void *d = up(ctx, buf, 64);
    const struct {
        OpsProjFusion f;
        int oc;
        const char *what;
    } bad[] = {
        {{.norm_w = d}, 4, "norm without h"},
        {{.swiglu = 1, .gu = d, .residual = d}, 4, "swiglu with a residual"},
        {{.swiglu = 1, .gu = d}, 3, "swiglu with an odd OC"},
        {{.swiglu = 1}, 4, "swiglu without gu"},
        {{.residual = d}, 4, "out is the residual"},
        {{.rope_store = 1, .Hq = 1, .Hkv = 1, .D = 2}, 6, "rope_store without its buffers"},
        {{.rope_store = 1, .qkv = d, .positions = (const int32_t *)d, .slot_mapping = (const int32_t *)d,
          .inv_freq = (const float *)d, .k_cache = d, .v_cache = d, .Hq = 1, .Hkv = 1, .D = 2}, 4,
         "rope_store with OC != (Hq + 2 Hkv) D"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ops_matmul_fused_fwd(ctx, d, d, d, NULL, 1, 4, bad[i].oc, &bad[i].f);
        CHECK(ops_status(ctx) != 0 && strstr(ops_error(ctx), "matmul_fused_fwd"), "%s: not refused (\"%s\")",
              bad[i].what, ops_error(ctx));
        ops_clear_error(ctx);
    }
    ops_matmul_fused_fwd(ctx, d, d, d, NULL, 1, 4, 4, NULL);
    CHECK(ops_status(ctx) != 0, "NULL fusion: not refused");
    ops_clear_error(ctx);
    ops_matmul_fused_fwd(ctx, d, d, d, NULL, 0, 4, 4, &(OpsProjFusion){0});
    CHECK(ops_status(ctx) == 0, "N = 0 recorded \"%s\"", ops_error(ctx));
    ops_free(ctx, d);
}

int main(void) {
    kt_seed(0xF05E);
    char err[256];
    OpsCtx *cpu = NULL, *gpu = NULL;
    REQUIRE(ops_create(&cpu, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "cpu context: %s", err);
    test_misuse(cpu);
    printf("%s: cpu misuse refused\n", failures ? "FAIL" : "ok");
    if (failures) return 1;
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        printf("SKIP: no CUDA device (the CPU checks passed)\n");
        ops_destroy(cpu);
        return 77;
    }
    REQUIRE(ops_create(&gpu, OPS_BACKEND_CUDA, 0, err, sizeof err) == 0, "cuda context: %s", err);
    test_misuse(gpu);
    // (IC, OC) of the decode projections: 0.5B qkv, o, gate/up, down; 1.5B gate/up, down; odd small shapes (IC % 8
    // != 0 takes the unfused sequence on the GPU too).
    const int shapes[][2] = {{896, 1152}, {896, 896}, {896, 9728}, {4864, 896}, {1536, 17920}, {8960, 1536},
                             {64, 10}, {40, 6}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
        for (int N = 1; N <= 3; N++) {
            const int IC = shapes[s][0], OC = shapes[s][1];
            check_case(cpu, gpu, 0, N, IC, OC);
            check_case(cpu, gpu, NORM | BIAS, N, IC, OC);
            check_case(cpu, gpu, NORM, N, IC, OC);
            check_case(cpu, gpu, NORM | SWIGLU, N, IC, OC);
            check_case(cpu, gpu, SWIGLU | BIAS, N, IC, OC);
            check_case(cpu, gpu, RESIDUAL, N, IC, OC);
        }
    // The q/k/v projection with RoPE and the cache store: Qwen2.5-0.5B (14/2 heads of 64) and 1.5B (12/2 of 128)
    // shapes, and a small one with IC % 8 != 0 (the unfused sequence on the GPU too).
    for (int N = 1; N <= 3; N++) {
        check_rope_case(cpu, gpu, N, 896, 14, 2, 64);
        check_rope_case(cpu, gpu, N, 1536, 12, 2, 128);
        check_rope_case(cpu, gpu, N, 36, 2, 1, 6);
    }
    // Back-to-back dependent projections (Qwen2.5-1.5B's MLP, and a narrow one whose kernels are shortest).
    for (int N = 1; N <= 2; N++) {
        check_chain(cpu, gpu, N, 1536, 8960);
        check_chain(cpu, gpu, N, 256, 512);
    }
    ops_destroy(gpu);
    ops_destroy(cpu);
    return check_exit_code("test_cuda_matmul_fused");
}
