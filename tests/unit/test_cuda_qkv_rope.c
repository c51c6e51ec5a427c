// tests/unit/test_cuda_qkv_rope.c — the fused q/k/v split + RoPE (ops_qkv_rope_fwd / _bwd) and the vectorised
// optimizer ops (ops_adamw_step, ops_sum_squares).
//
// CPU part (always runs):
//   1. On the CPU backend the fused ops give exactly (bit for bit) what the unfused sequence gives: three
//      ops_copy_2d then ops_rope_fwd on q and k; ops_rope_bwd on dq and dk then three ops_copy_2d. The whole
//      output buffers are compared, slack around the written rows included (nothing written outside), and the
//      backward's inputs must be left as they were. Shapes: GQA and not, D odd (the last element stays put), D 1,
//      D 128 (the 1.5B model's heads), one token (decode), a misaligned view.
//   2. Bad shapes and NULL buffers record an error; N = 0 is a no-op. The cache-store variant
//      (ops_qkv_rope_store_fwd) == ops_qkv_rope_fwd + ops_kv_cache_store, q and the whole caches bit for bit
//      (scattered slots, tokens without one), here and on the CUDA backend.
// CUDA part (without a device: "SKIP", exit 77, after the CPU part passed):
//   3. The same bit-for-bit comparison on the CUDA backend (the fused kernel against cudaMemcpy2D plus the in-place
//      rope kernel) on the vectorised path (D % 16 == 0, 16-byte aligned rows) and the one-pair-per-thread path
//      (D 34, D 7, element-offset views).
//   4. The CUDA fused ops against the CPU fused ops: e = max |gpu - cpu| / (|cpu| + rms(cpu)) <= 1e-2 (one bf16
//      rounding of a rotation is <= 2^-8 relative; the copied v is exact, 0).
//   5. AdamW: CUDA against CPU over four steps (tolerance 1e-6 on master, m, v as in test_cuda_vs_cpu.c, 1e-2 on the
//      bf16 parameters) for n of 1 to 100003 with the buffers at element offsets 0-3, same and different phases;
//      and the 16-byte vector path against the one-at-a-time path on the same inputs: identical bits.
//   6. Sum of squares: CUDA against CPU (*out += sum; double sums on both sides, only the order differs: 1e-6) for
//      n of 1 to 1000003 at element offsets 0-3.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "kernels_testlib.h"

enum { SLACK = 9 };  // elements before (the view's offset + slack) and after each buffer that no op may touch

typedef struct {
    int N, Hq, Hkv, D, off;  // off: element offset of every buffer's view (odd: rows not 16-byte aligned on cuda)
} Shape;

// bf16 round-to-nearest-even kept in an fp32, so that both backends start from the same values.
static float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}
static float *rand_bf16(size_t n, double scale) {
    float *h = kt_falloc(n);
    for (size_t i = 0; i < n; i++) h[i] = round_bf16((float)(scale * kt_uniform()));
    return h;
}

// A storage buffer of `off + n + SLACK` elements on ctx, every element from host (which has that many).
static void *store_up(OpsCtx *ctx, const float *host, size_t total) {
    void *p = ops_malloc(ctx, total * ops_dtype_size(ctx));
    if (p) ops_upload_f32(ctx, p, host, total);
    return p;
}
static float *store_down(OpsCtx *ctx, const void *p, size_t total) {
    float *h = kt_falloc(total);
    ops_download_f32(ctx, h, p, total);
    return h;
}
static void *view(OpsCtx *ctx, void *p, size_t off) { return (char *)p + off * ops_dtype_size(ctx); }
static void *f32_up(OpsCtx *ctx, const void *host, size_t bytes) {
    void *p = ops_malloc(ctx, bytes);
    if (p) ops_copy_to_device(ctx, p, host, bytes);
    return p;
}

// Host inputs of one shape. Buffers are indexed [0, total) with the tensor at [off, off + rows * cols).
typedef struct {
    Shape s;
    size_t QD, KVD, QKV, t_qkv, t_q, t_kv;  // t_*: total elements of a buffer (slack included)
    float *qkv, *dq, *dk, *dv;             // inputs
    float *fill_q, *fill_kv, *fill_qkv;    // the outputs' contents before the op (random: overwrites show)
    int32_t *pos;
    float *inv_freq;
} Case;

static Case case_make(Shape s) {
    Case c = {.s = s};
    c.QD = (size_t)s.Hq * s.D;
    c.KVD = (size_t)s.Hkv * s.D;
    c.QKV = c.QD + 2 * c.KVD;
    c.t_qkv = s.off + (size_t)s.N * c.QKV + SLACK;
    c.t_q = s.off + (size_t)s.N * c.QD + SLACK;
    c.t_kv = s.off + (size_t)s.N * c.KVD + SLACK;
    c.qkv = rand_bf16(c.t_qkv, 2.0);
    c.dq = rand_bf16(c.t_q, 2.0);
    c.dk = rand_bf16(c.t_kv, 2.0);
    c.dv = rand_bf16(c.t_kv, 2.0);
    c.fill_q = rand_bf16(c.t_q, 3.0);
    c.fill_kv = rand_bf16(c.t_kv, 3.0);
    c.fill_qkv = rand_bf16(c.t_qkv, 3.0);
    c.pos = malloc((size_t)s.N * sizeof *c.pos);
    // Position 0 (no turn), then up to 32768: angles of tens of thousands of radians (full-range sincos).
    for (int i = 0; i < s.N; i++) c.pos[i] = i == 0 ? 0 : i == 1 ? 32767 : kt_randint(0, 6000);
    const int half = s.D / 2 > 0 ? s.D / 2 : 1;
    c.inv_freq = kt_falloc((size_t)half);
    for (int i = 0; i < s.D / 2; i++) c.inv_freq[i] = powf(1000000.0f, -2.0f * i / s.D);
    return c;
}
static void case_free(Case *c) {
    free(c->qkv), free(c->dq), free(c->dk), free(c->dv), free(c->fill_q), free(c->fill_kv), free(c->fill_qkv);
    free(c->pos), free(c->inv_freq);
}

// Results of one path on one backend, downloaded: q, k, v, dqkv, and dq, dk after the backward.
typedef struct {
    float *q, *k, *v, *dqkv, *dq_after, *dk_after;
} Result;

static void result_free(Result *r) {
    free(r->q), free(r->k), free(r->v), free(r->dqkv), free(r->dq_after), free(r->dk_after);
}

// Runs the forward and the backward on ctx, fused or as the unfused sequence the model ran before.
static Result run_case(OpsCtx *ctx, const Case *c, int fused) {
    const Shape *s = &c->s;
    const size_t N = s->N, off = s->off;
    void *qkv = store_up(ctx, c->qkv, c->t_qkv), *q = store_up(ctx, c->fill_q, c->t_q);
    void *k = store_up(ctx, c->fill_kv, c->t_kv), *v = store_up(ctx, c->fill_kv, c->t_kv);
    void *dq = store_up(ctx, c->dq, c->t_q), *dk = store_up(ctx, c->dk, c->t_kv), *dv = store_up(ctx, c->dv, c->t_kv);
    void *dqkv = store_up(ctx, c->fill_qkv, c->t_qkv);
    int32_t *pos = f32_up(ctx, c->pos, N * sizeof *c->pos);
    float *inv = f32_up(ctx, c->inv_freq, (size_t)(s->D / 2 > 0 ? s->D / 2 : 1) * sizeof(float));
    void *vqkv = view(ctx, qkv, off), *vq = view(ctx, q, off), *vk = view(ctx, k, off), *vv = view(ctx, v, off);
    void *vdq = view(ctx, dq, off), *vdk = view(ctx, dk, off), *vdv = view(ctx, dv, off), *vdqkv = view(ctx, dqkv, off);
    if (fused) {
        ops_qkv_rope_fwd(ctx, vq, vk, vv, vqkv, pos, inv, s->N, s->Hq, s->Hkv, s->D);
        ops_qkv_rope_bwd(ctx, vdqkv, vdq, vdk, vdv, pos, inv, s->N, s->Hq, s->Hkv, s->D);
    } else {
        ops_copy_2d(ctx, vq, c->QD, vqkv, c->QKV, N, c->QD);
        ops_copy_2d(ctx, vk, c->KVD, view(ctx, vqkv, c->QD), c->QKV, N, c->KVD);
        ops_copy_2d(ctx, vv, c->KVD, view(ctx, vqkv, c->QD + c->KVD), c->QKV, N, c->KVD);
        ops_rope_fwd(ctx, vq, pos, inv, s->N, s->Hq, s->D);
        ops_rope_fwd(ctx, vk, pos, inv, s->N, s->Hkv, s->D);
        // The reference turns copies of dq, dk (the fused op must leave its inputs alone).
        void *dq2 = store_up(ctx, c->dq, c->t_q), *dk2 = store_up(ctx, c->dk, c->t_kv);
        ops_rope_bwd(ctx, view(ctx, dq2, off), pos, inv, s->N, s->Hq, s->D);
        ops_rope_bwd(ctx, view(ctx, dk2, off), pos, inv, s->N, s->Hkv, s->D);
        ops_copy_2d(ctx, vdqkv, c->QKV, view(ctx, dq2, off), c->QD, N, c->QD);
        ops_copy_2d(ctx, view(ctx, vdqkv, c->QD), c->QKV, view(ctx, dk2, off), c->KVD, N, c->KVD);
        ops_copy_2d(ctx, view(ctx, vdqkv, c->QD + c->KVD), c->QKV, vdv, c->KVD, N, c->KVD);
        ops_synchronize(ctx);
        ops_free(ctx, dq2);
        ops_free(ctx, dk2);
    }
    Result r = {store_down(ctx, q, c->t_q),    store_down(ctx, k, c->t_kv),  store_down(ctx, v, c->t_kv),
                store_down(ctx, dqkv, c->t_qkv), store_down(ctx, dq, c->t_q), store_down(ctx, dk, c->t_kv)};
    CHECK(ops_status(ctx) == 0, "qkv_rope N=%d Hq=%d Hkv=%d D=%d off=%d (%s): unexpected error \"%s\"", s->N,
          s->Hq, s->Hkv, s->D, s->off, fused ? "fused" : "unfused", ops_error(ctx));
    ops_clear_error(ctx);
    void *bufs[] = {qkv, q, k, v, dq, dk, dv, dqkv, pos, inv};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) ops_free(ctx, bufs[i]);
    return r;
}

static void expect_same_bits(const char *backend, const Shape *s, const char *what, const float *got,
                             const float *want, size_t n) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof *got) != 0 && !bad++) first = i;
    CHECK(bad == 0, "%s N=%d Hq=%d Hkv=%d D=%d off=%d: %s differs from the unfused ops in %zu of %zu elements "
          "(first [%zu]: %.9g vs %.9g)", backend, s->N, s->Hq, s->Hkv, s->D, s->off, what, bad, n, first,
          bad ? got[first] : 0.0, bad ? want[first] : 0.0);
}

// Fused against unfused on one backend: every output buffer and the backward's inputs, bit for bit.
static void check_fused_equals_unfused(OpsCtx *ctx, const char *backend, Shape s) {
    Case c = case_make(s);
    Result f = run_case(ctx, &c, 1), u = run_case(ctx, &c, 0);
    expect_same_bits(backend, &s, "q", f.q, u.q, c.t_q);
    expect_same_bits(backend, &s, "k", f.k, u.k, c.t_kv);
    expect_same_bits(backend, &s, "v", f.v, u.v, c.t_kv);
    expect_same_bits(backend, &s, "dqkv", f.dqkv, u.dqkv, c.t_qkv);
    expect_same_bits(backend, &s, "dq after the backward", f.dq_after, c.dq, c.t_q);
    expect_same_bits(backend, &s, "dk after the backward", f.dk_after, c.dk, c.t_kv);
    result_free(&f);
    result_free(&u);
    case_free(&c);
}

// ops_qkv_rope_store_fwd against ops_qkv_rope_fwd + ops_kv_cache_store on one backend, bit for bit: q and the
// whole k and v caches (rows never named keep their contents), slots scattered, some tokens without one (-1).
static void check_store_equals_unfused(OpsCtx *ctx, const char *backend, Shape s) {
    Case c = case_make(s);
    const size_t N = s.N, n_slots = 2 * N + 3, t_cache = n_slots * c.KVD;
    int32_t *slots = malloc(N * sizeof *slots);
    for (size_t i = 0; i < N; i++) slots[i] = i % 4 == 3 ? -1 : (int32_t)((i * 7 + 2) % n_slots);
    for (size_t i = 0; i < N; i++)   // distinct slots: a repeated one would make the order of writes matter
        for (size_t j = 0; j < i; j++)
            if (slots[i] >= 0 && slots[i] == slots[j]) slots[i] = -1;
    float *fill = rand_bf16(t_cache, 3.0);
    float *out[2][3];
    for (int fused = 0; fused < 2; fused++) {
        void *qkv = store_up(ctx, c.qkv, c.t_qkv), *q = store_up(ctx, c.fill_q, c.t_q);
        void *k = store_up(ctx, c.fill_kv, c.t_kv), *v = store_up(ctx, c.fill_kv, c.t_kv);
        void *kc = store_up(ctx, fill, t_cache), *vc = store_up(ctx, fill, t_cache);
        int32_t *pos = f32_up(ctx, c.pos, N * sizeof *c.pos), *sl = f32_up(ctx, slots, N * sizeof *slots);
        float *inv = f32_up(ctx, c.inv_freq, (size_t)(s.D / 2 > 0 ? s.D / 2 : 1) * sizeof(float));
        void *vqkv = view(ctx, qkv, s.off), *vq = view(ctx, q, s.off);
        if (fused) {
            ops_qkv_rope_store_fwd(ctx, vq, kc, vc, sl, vqkv, pos, inv, s.N, s.Hq, s.Hkv, s.D);
        } else {
            ops_qkv_rope_fwd(ctx, vq, view(ctx, k, s.off), view(ctx, v, s.off), vqkv, pos, inv, s.N, s.Hq, s.Hkv, s.D);
            ops_kv_cache_store(ctx, kc, vc, view(ctx, k, s.off), view(ctx, v, s.off), sl, s.N, s.Hkv, s.D);
        }
        out[fused][0] = store_down(ctx, q, c.t_q);
        out[fused][1] = store_down(ctx, kc, t_cache);
        out[fused][2] = store_down(ctx, vc, t_cache);
        CHECK(ops_status(ctx) == 0, "qkv_rope_store N=%d (%s): unexpected error \"%s\"", s.N,
              fused ? "fused" : "unfused", ops_error(ctx));
        ops_clear_error(ctx);
        void *bufs[] = {qkv, q, k, v, kc, vc, pos, sl, inv};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) ops_free(ctx, bufs[i]);
    }
    expect_same_bits(backend, &s, "q (store)", out[1][0], out[0][0], c.t_q);
    expect_same_bits(backend, &s, "k cache", out[1][1], out[0][1], t_cache);
    expect_same_bits(backend, &s, "v cache", out[1][2], out[0][2], t_cache);
    for (int f = 0; f < 2; f++)
        for (int i = 0; i < 3; i++) free(out[f][i]);
    free(fill);
    free(slots);
    case_free(&c);
}

static const Shape SHAPES[] = {
    {29, 6, 2, 34, 0},   // GQA, D even but not a multiple of 16
    {5, 3, 3, 7, 0},     // no GQA, odd D
    {3, 2, 1, 1, 0},     // D 1: nothing turns, all copied
    {37, 12, 2, 128, 0}, // Qwen2.5-1.5B heads
    {37, 12, 2, 128, 1}, // the same through views one element off
    {1, 12, 2, 128, 0},  // one token (decode)
    {2, 14, 2, 64, 3},   // Qwen2.5-0.5B heads, views three elements off
    {300, 4, 4, 16, 0},  // many tokens, the smallest vectorised head
};
enum { N_SHAPES = sizeof SHAPES / sizeof SHAPES[0] };

static void test_errors(OpsCtx *ctx) {
    float one[64] = {0};
    int32_t pos[2] = {0, 1};
    ops_qkv_rope_fwd(ctx, one, one, one, one, pos, one, 0, 2, 1, 4);  // N 0: nothing to do, no error
    CHECK(ops_status(ctx) == 0, "qkv_rope_fwd with N=0 recorded \"%s\"", ops_error(ctx));
    ops_qkv_rope_fwd(ctx, one, one, one, one, pos, one, 2, 2, 0, 4);
    CHECK(ops_status(ctx) != 0 && strstr(ops_error(ctx), "Hkv=0"), "qkv_rope_fwd with Hkv=0: \"%s\"",
          ops_error(ctx));
    ops_clear_error(ctx);
    ops_qkv_rope_bwd(ctx, one, one, NULL, one, pos, one, 2, 2, 1, 4);
    CHECK(ops_status(ctx) != 0 && strstr(ops_error(ctx), "NULL"), "qkv_rope_bwd with dk NULL: \"%s\"",
          ops_error(ctx));
    ops_clear_error(ctx);
}

// ---- CUDA against CPU ------------------------------------------------------------------------------------------

// e = max |g - c| / (|c| + rms(c)) over n elements.
static double scaled_error(const float *g, const float *c, size_t n) {
    double ss = 0.0, e = 0.0;
    for (size_t i = 0; i < n; i++) ss += (double)c[i] * c[i];
    const double rms = n ? sqrt(ss / n) : 0.0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)g[i] - c[i]) / (fabs(c[i]) + rms + 1e-30);
        if (!(d <= e)) e = isnan(d) ? INFINITY : d;
    }
    return e;
}

static void expect_close(const char *op, const Shape *s, const char *what, const float *g, const float *c, size_t n,
                         double tol) {
    const double e = scaled_error(g, c, n);
    printf("%-4s %-14s N=%-4d Hq=%-2d Hkv=%-2d D=%-3d off=%d %-5s err %9.3e tol %7.1e\n", e <= tol ? "ok" : "FAIL", op,
           s->N, s->Hq, s->Hkv, s->D, s->off, what, e, tol);
    CHECK(e <= tol, "%s %s: cuda vs cpu error %g over %g", op, what, e, tol);
}

static void check_cuda_vs_cpu(OpsCtx *cpu, OpsCtx *gpu, Shape s) {
    Case c = case_make(s);
    Result g = run_case(gpu, &c, 1), h = run_case(cpu, &c, 1);
    expect_close("qkv_rope_fwd", &s, "q", g.q, h.q, c.t_q, 1e-2);
    expect_close("qkv_rope_fwd", &s, "k", g.k, h.k, c.t_kv, 1e-2);
    expect_close("qkv_rope_fwd", &s, "v", g.v, h.v, c.t_kv, 0.0);
    expect_close("qkv_rope_bwd", &s, "dqkv", g.dqkv, h.dqkv, c.t_qkv, 1e-2);
    result_free(&g);
    result_free(&h);
    case_free(&c);
}

// fp32 buffers on both backends at element offsets: [0, off + n + SLACK).
typedef struct {
    float *c, *g;
    size_t off;
} F32Pair;

static F32Pair f32_pair(OpsCtx *cpu, OpsCtx *gpu, const float *host, size_t off, size_t n) {
    const size_t bytes = (off + n + SLACK) * sizeof(float);
    F32Pair p = {f32_up(cpu, host, bytes), f32_up(gpu, host, bytes), off};
    return p;
}
static float *down_f32(OpsCtx *ctx, const float *p, size_t n) {
    float *h = kt_falloc(n);
    ops_copy_to_host(ctx, h, p, n * sizeof(float));
    return h;
}

// Four AdamW steps on n elements with master, m, v, grad, param_out at element offsets o[0..4].
static void check_adamw_case(OpsCtx *cpu, OpsCtx *gpu, size_t n, const size_t o[5]) {
    const size_t span = 4 + n + SLACK;
    float *h_master = rand_bf16(span, 1.0), *h_zero = kt_falloc(span);
    F32Pair master = f32_pair(cpu, gpu, h_master, o[0], n), m = f32_pair(cpu, gpu, h_zero, o[1], n);
    F32Pair v = f32_pair(cpu, gpu, h_zero, o[2], n);
    // bf16 parameters on cuda (2-byte elements: offset o[4] of them), fp32 on cpu.
    void *p_c = ops_malloc(cpu, span * 4), *p_g = ops_malloc(gpu, span * 2);
    for (int step = 1; step <= 4; step++) {
        float *h_grad = rand_bf16(span, 0.5);
        F32Pair grad = f32_pair(cpu, gpu, h_grad, o[3], n);
        const float wd = step == 4 ? 0.0f : 0.1f;
        ops_adamw_step(cpu, master.c + o[0], m.c + o[1], v.c + o[2], grad.c + o[3], (float *)p_c + o[4], n, 1e-3f,
                       0.9f, 0.95f, 1e-8f, wd, step, 0.5f);
        ops_adamw_step(gpu, master.g + o[0], m.g + o[1], v.g + o[2], grad.g + o[3], (char *)p_g + 2 * o[4], n, 1e-3f,
                       0.9f, 0.95f, 1e-8f, wd, step, 0.5f);
        ops_synchronize(gpu);
        ops_free(cpu, grad.c), ops_free(gpu, grad.g);
        free(h_grad);
    }
    CHECK(ops_status(cpu) == 0 && ops_status(gpu) == 0, "adamw n=%zu: errors \"%s\" \"%s\"", n, ops_error(cpu),
          ops_error(gpu));
    const char *names[3] = {"master", "m", "v"};
    F32Pair *bufs[3] = {&master, &m, &v};
    char label[64];
    snprintf(label, sizeof label, "adamw %zu@%zu%zu%zu%zu%zu", n, o[0], o[1], o[2], o[3], o[4]);
    for (int b = 0; b < 3; b++) {
        const size_t total = bufs[b]->off + n + SLACK;
        float *c = down_f32(cpu, bufs[b]->c, total), *g = down_f32(gpu, bufs[b]->g, total);
        const double e = scaled_error(g, c, total);  // slack included: nothing written outside
        printf("%-4s %-28s %-6s err %9.3e tol %7.1e\n", e <= 1e-6 ? "ok" : "FAIL", label, names[b], e, 1e-6);
        CHECK(e <= 1e-6, "%s %s: error %g", label, names[b], e);
        free(c), free(g);
    }
    float *pc = kt_falloc(n), *pg = kt_falloc(n);
    ops_download_f32(cpu, pc, (float *)p_c + o[4], n);
    ops_download_f32(gpu, pg, (char *)p_g + 2 * o[4], n);
    const double e = scaled_error(pg, pc, n);
    printf("%-4s %-28s %-6s err %9.3e tol %7.1e\n", e <= 1e-2 ? "ok" : "FAIL", label, "param", e, 1e-2);
    CHECK(e <= 1e-2, "%s param_out: error %g", label, e);
    free(pc), free(pg), free(h_master), free(h_zero);
    ops_free(cpu, p_c), ops_free(gpu, p_g);
    ops_free(cpu, master.c), ops_free(gpu, master.g), ops_free(cpu, m.c), ops_free(gpu, m.g);
    ops_free(cpu, v.c), ops_free(gpu, v.g);
}

// The same AdamW step twice on cuda: every buffer 16-byte aligned (vector path), and with m one element off (the
// phases disagree: one element at a time). The results must be the same bits.
static void check_adamw_paths_agree(OpsCtx *gpu, size_t n) {
    const size_t span = n + 8;
    float *h_master = rand_bf16(span, 1.0), *h_m = rand_bf16(span, 0.01), *h_v = kt_falloc(span);
    float *h_grad = rand_bf16(span, 0.5);
    for (size_t i = 0; i < span; i++) h_v[i] = h_m[i] * h_m[i];
    float *res[2][3];
    uint16_t *par[2];
    for (int path = 0; path < 2; path++) {
        const size_t mo = path;  // m's element offset
        float *master = f32_up(gpu, h_master, span * 4), *v = f32_up(gpu, h_v, span * 4);
        float *grad = f32_up(gpu, h_grad, span * 4), *m = ops_malloc(gpu, span * 4);
        ops_copy_to_device(gpu, m + mo, h_m, n * 4);
        void *p = ops_malloc(gpu, span * 2);
        ops_adamw_step(gpu, master, m + mo, v, grad, p, n, 3e-4f, 0.9f, 0.999f, 1e-8f, 0.1f, 3, 0.25f);
        res[path][0] = down_f32(gpu, master, n);
        float *mh = down_f32(gpu, m, n + 1);
        res[path][1] = kt_falloc(n);
        memcpy(res[path][1], mh + mo, n * 4);
        free(mh);
        res[path][2] = down_f32(gpu, v, n);
        par[path] = malloc(n * 2);
        ops_copy_to_host(gpu, par[path], p, n * 2);
        ops_free(gpu, master), ops_free(gpu, v), ops_free(gpu, grad), ops_free(gpu, m), ops_free(gpu, p);
    }
    CHECK(ops_status(gpu) == 0, "adamw paths n=%zu: error \"%s\"", n, ops_error(gpu));
    const char *names[3] = {"master", "m", "v"};
    for (int b = 0; b < 3; b++) {
        const int same = memcmp(res[0][b], res[1][b], n * 4) == 0;
        printf("%-4s adamw n=%-7zu vector vs single %-6s identical bits\n", same ? "ok" : "FAIL", n, names[b]);
        CHECK(same, "adamw n=%zu: %s differs between the vector and the one-at-a-time path", n, names[b]);
        free(res[0][b]), free(res[1][b]);
    }
    const int same = memcmp(par[0], par[1], n * 2) == 0;
    printf("%-4s adamw n=%-7zu vector vs single %-6s identical bits\n", same ? "ok" : "FAIL", n, "param");
    CHECK(same, "adamw n=%zu: param_out differs between the paths", n);
    free(par[0]), free(par[1]), free(h_master), free(h_m), free(h_v), free(h_grad);
}

static void check_sum_squares_case(OpsCtx *cpu, OpsCtx *gpu, size_t n, size_t off) {
    float *h = rand_bf16(off + n + SLACK, 3.0);
    F32Pair x = f32_pair(cpu, gpu, h, off, n);
    float init[SLACK] = {1.5f};
    F32Pair out = f32_pair(cpu, gpu, init, 0, 0);  // one float, 1.5 (slack after it)
    ops_sum_squares(cpu, out.c, x.c + off, n);
    ops_sum_squares(gpu, out.g, x.g + off, n);
    ops_sum_squares(cpu, out.c, x.c + off, n);  // += twice
    ops_sum_squares(gpu, out.g, x.g + off, n);
    float c, g;
    ops_copy_to_host(cpu, &c, out.c, 4);
    ops_copy_to_host(gpu, &g, out.g, 4);
    const double e = fabs((double)g - c) / fabs(c);
    printf("%-4s sum_squares n=%-8zu off=%zu  cpu %.9g cuda %.9g err %9.3e tol 1.0e-06\n", e <= 1e-6 ? "ok" : "FAIL",
           n, off, c, g, e);
    CHECK(e <= 1e-6 && ops_status(gpu) == 0, "sum_squares n=%zu off=%zu: cpu %.9g cuda %.9g (\"%s\")", n, off, c,
          g, ops_error(gpu));
    ops_free(cpu, x.c), ops_free(gpu, x.g), ops_free(cpu, out.c), ops_free(gpu, out.g);
    free(h);
}

static void test_optimizer(OpsCtx *cpu, OpsCtx *gpu) {
    static const size_t offsets[][5] = {
        {0, 0, 0, 0, 0}, {1, 1, 1, 1, 1}, {3, 3, 3, 3, 3}, {2, 2, 2, 2, 0}, {0, 1, 0, 0, 0}, {0, 0, 0, 0, 1},
    };
    static const size_t sizes[] = {1, 3, 4, 7, 4099, 100003};
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
        for (size_t oi = 0; oi < sizeof offsets / sizeof *offsets; oi++)
            check_adamw_case(cpu, gpu, sizes[si], offsets[oi]);
    check_adamw_paths_agree(gpu, 7);
    check_adamw_paths_agree(gpu, 100003);
    static const size_t ss_sizes[] = {1, 2, 3, 5, 8, 4099, 1000003};
    for (size_t si = 0; si < sizeof ss_sizes / sizeof *ss_sizes; si++)
        for (size_t off = 0; off < 4; off++) check_sum_squares_case(cpu, gpu, ss_sizes[si], off);
}

int main(void) {
    kt_seed(0x51D3);
    char err[256];
    OpsCtx *cpu = NULL, *gpu = NULL;
    REQUIRE(ops_create(&cpu, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "cpu context: %s", err);
    for (int i = 0; i < N_SHAPES; i++) check_fused_equals_unfused(cpu, "cpu", SHAPES[i]);
    for (int i = 0; i < N_SHAPES; i++) check_store_equals_unfused(cpu, "cpu", SHAPES[i]);
    test_errors(cpu);
    printf("%s: cpu fused split/pack + RoPE == copy_2d + rope on %d shapes\n", failures ? "FAIL" : "ok", N_SHAPES);
    if (failures) {
        ops_destroy(cpu);
        return 1;
    }
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        printf("SKIP: no CUDA device (the CPU checks passed)\n");
        ops_destroy(cpu);
        return 77;
    }
    REQUIRE(ops_create(&gpu, OPS_BACKEND_CUDA, 0, err, sizeof err) == 0, "cuda context: %s", err);
    for (int i = 0; i < N_SHAPES; i++) check_fused_equals_unfused(gpu, "cuda", SHAPES[i]);
    for (int i = 0; i < N_SHAPES; i++) check_store_equals_unfused(gpu, "cuda", SHAPES[i]);
    printf("%s: cuda fused split/pack + RoPE == cudaMemcpy2D + rope on %d shapes\n", failures ? "FAIL" : "ok",
           N_SHAPES);
    for (int i = 0; i < N_SHAPES; i++) check_cuda_vs_cpu(cpu, gpu, SHAPES[i]);
    test_errors(gpu);
    test_optimizer(cpu, gpu);
    ops_destroy(gpu);
    ops_destroy(cpu);
    return check_exit_code("test_cuda_qkv_rope");
}
