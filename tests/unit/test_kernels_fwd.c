// tests/unit/test_kernels_fwd.c — every forward of the fp32 CPU backend (kernels/cpu/) against a direct
// double-precision implementation written here, on random inputs with odd sizes.
// Tolerances: fp32 kernels vs double references agree to ~1e-6 relative; the checks use rtol 1e-5 with an
// absolute floor of 1e-6 x the tensor's largest value (elements near zero carry absolute, not relative, error).
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "kernels/cpu/cpu_vecmath.h"
#include "kernels_testlib.h"

#define RTOL 1e-5
#define ATOL 1e-6

// cpu_vexp: within 1 ulp of exp everywhere its result is a normal float, exact 0 / inf / NaN at the edges.
static void test_vexp(void) {
    enum { M = 1 << 16 };
    static float xs[M], ys[M];
    double worst_ulps = 0.0;
    float worst_x = 0.0f;
    for (int block = 0; block < 32; block++) {
        for (int i = 0; i < M; i++) xs[i] = (float)(-110.0 + 200.0 * (block * (double)M + i) / (32.0 * M));
        for (int i = 0; i < M; i++) ys[i] = cpu_vexp(xs[i]);
        for (int i = 0; i < M; i++) {
            const double t = exp((double)xs[i]);
            const float tf = (float)t;
            if (tf == 0.0f || isinf(tf) || tf < 1.17549435e-38f) {
                // Subnormal and edge results: within one subnormal step (2^-149) of the exact value.
                CHECK(fabs((double)ys[i] - t) <= 1.4012984643e-45 || (isinf(tf) && isinf(ys[i])),
                      "vexp(%.9g) = %.9g, want %.9g", xs[i], ys[i], t);
                continue;
            }
            const double ulp = ldexp(1.0, ilogb(tf) - 23);
            const double e = fabs((double)ys[i] - t) / ulp;
            if (e > worst_ulps) { worst_ulps = e; worst_x = xs[i]; }
        }
    }
    CHECK(worst_ulps <= 1.0, "vexp error %.3f ulp at x = %.9g (bound 1 ulp)", worst_ulps, worst_x);
    CHECK(isnan(cpu_vexp(NAN)), "vexp(NaN) must be NaN");
    CHECK(cpu_vexp(-INFINITY) == 0.0f, "vexp(-inf) must be 0");
    CHECK(isinf(cpu_vexp(INFINITY)), "vexp(inf) must be inf");
    CHECK(cpu_vexp(0.0f) == 1.0f && cpu_vexp(-0.0f) == 1.0f, "vexp(0) must be exactly 1");
    CHECK(cpu_vexp(-1e30f) == 0.0f && isinf(cpu_vexp(1e30f)), "vexp of huge arguments must saturate");
}

static void test_vmax(void) {
    float x[37];
    for (int n = 0; n <= 37; n++) {
        kt_fill(x, 37, 100.0);
        double want = -INFINITY;
        for (int i = 0; i < n; i++) want = fmax(want, x[i]);
        CHECK(cpu_vmax(x, n) == (float)want, "vmax of %d elements: got %g want %g", n, cpu_vmax(x, n), want);
    }
    float neg[5] = {-3.0f, -0.0f, -7.5f, -1e-30f, -2.0f};
    CHECK(cpu_vmax(neg, 5) == 0.0f, "vmax of negatives with -0 must be 0 (got %g)", cpu_vmax(neg, 5));
    float inf_row[3] = {-INFINITY, -INFINITY, -5.0f};
    CHECK(cpu_vmax(inf_row, 3) == -5.0f, "vmax must skip -inf");
    float nan_row[4] = {1.0f, NAN, 3.0f, 2.0f};
    CHECK(isnan(cpu_vmax(nan_row, 4)), "a NaN in the row must make the max NaN");
}

// Seeded dropout: every element is in / (1 - p) or 0 as keep() says, the same mask for the same seed (in place or
// not), another mask for another seed, about p dropped, and p = 0 the identity.
static void test_dropout(void) {
    const size_t n = 100003;
    const float p = 0.1f;
    float *x = kt_falloc(n), *y = kt_falloc(n), *z = kt_falloc(n);
    kt_fill(x, n, 2.0);
    for (size_t i = 0; i < n; i++) x[i] += x[i] == 0.0f ? 1.0f : 0.0f;  // no zero inputs: a zero output is a drop
    cpu_dropout(y, x, n, p, 1234);
    size_t dropped = 0, wrong = 0, differ = 0;
    for (size_t i = 0; i < n; i++) {
        const int keep = cpu_dropout_keep(1234, i, (uint32_t)(0.1 * 16777216.0 + 0.5));
        dropped += !keep;
        wrong += y[i] != (keep ? x[i] * (1.0f / (1.0f - p)) : 0.0f);
    }
    CHECK(wrong == 0, "dropout: %zu elements differ from keep() * x / (1 - p)", wrong);
    CHECK(fabs((double)dropped / n - p) < 0.005, "dropout: dropped %.4f, want about %.2f", (double)dropped / n, p);
    memcpy(z, x, n * sizeof(float));
    cpu_dropout(z, z, n, p, 1234);
    CHECK(memcmp(y, z, n * sizeof(float)) == 0, "dropout in place differs");
    memcpy(z, x, n * sizeof(float));
    cpu_dropout(z, z, n, p, 1235);
    for (size_t i = 0; i < n; i++) differ += (y[i] == 0.0f) != (z[i] == 0.0f);
    CHECK(differ > n / 10, "dropout: seeds 1234 and 1235 gave nearly the same mask (%zu differ)", differ);
    cpu_dropout(z, x, n, 0.0f, 99);
    CHECK(memcmp(x, z, n * sizeof(float)) == 0, "dropout with p = 0 must copy");
    free(x), free(y), free(z);
}

static void test_add_inplace(void) {
    const size_t n = 1031;
    float *y = kt_falloc(n), *x = kt_falloc(n);
    kt_fill(y, n, 2.0);
    kt_fill(x, n, 2.0);
    double *want = kt_dalloc(n);
    for (size_t i = 0; i < n; i++) want[i] = (double)y[i] + x[i];
    cpu_add_inplace(y, x, n);
    check_close("add_inplace", y, want, n, 1e-7, 0.0); // one fp32 rounding
    for (size_t i = 0; i < n; i++) want[i] = (double)y[i] + x[i];
    cpu_add_f32(y, x, n);
    check_close("add_f32", y, want, n, 1e-7, 0.0);
    for (size_t i = 0; i < n; i++) want[i] = (double)y[i] * 1.75;
    cpu_scale_inplace(y, 1.75f, n);
    check_close("scale_inplace", y, want, n, 1e-7, 0.0);
    free(y), free(x), free(want);
}

static void test_embedding(void) {
    const int N = 9, C = 13, V = 11;
    float *table = kt_falloc((size_t)V * C), *out = kt_falloc((size_t)N * C);
    kt_fill(table, (size_t)V * C, 1.0);
    int32_t tokens[9] = {3, 0, 10, 3, 7, 1, 10, 5, 2};
    int bad = -1;
    CHECK(cpu_embedding_fwd(out, tokens, table, N, C, V, &bad) == 0, "valid ids must succeed");
    for (int i = 0; i < N; i++)
        CHECK(memcmp(out + (size_t)i * C, table + (size_t)tokens[i] * C, C * sizeof(float)) == 0,
              "embedding row %d is not table row %d", i, tokens[i]);
    // An id outside [0, V) fails with its row, before anything is written.
    float *out2 = kt_falloc((size_t)N * C);
    for (int trial = 0; trial < 2; trial++) {
        int32_t badtok[9];
        memcpy(badtok, tokens, sizeof badtok);
        badtok[6] = trial == 0 ? V : -1;
        bad = -1;
        CHECK(cpu_embedding_fwd(out2, badtok, table, N, C, V, &bad) == -1, "id %d must be refused", badtok[6]);
        CHECK(bad == 6, "bad row reported as %d, want 6", bad);
        for (size_t i = 0; i < (size_t)N * C; i++)
            if (out2[i] != 0.0f) { CHECK(0, "out written although an id was invalid"); break; }
    }
    // Shards of the vocabulary: each shard's table holds rows [begin, begin + rows) of the whole; ids of other
    // shards give zero rows, so the shards' outputs add up to the whole lookup (the last shard is short: 11 = 4+4+3).
    float *sum = kt_falloc((size_t)N * C), *part = kt_falloc((size_t)N * C);
    for (int s = 0; s < 3; s++) {
        const int begin = 4 * s, rows = begin + 4 <= V ? 4 : V - begin;
        CHECK(cpu_embedding_shard_fwd(part, tokens, table + (size_t)begin * C, N, C, begin, rows, V, &bad) == 0,
              "shard %d: valid ids must succeed", s);
        for (int i = 0; i < N; i++) {
            const int mine = tokens[i] >= begin && tokens[i] < begin + rows;
            for (int c = 0; c < C; c++) {
                const float want = mine ? table[(size_t)tokens[i] * C + c] : 0.0f;
                if (part[(size_t)i * C + c] != want) {
                    CHECK(0, "shard %d row %d (id %d) col %d: %g, want %g", s, i, tokens[i], c,
                          part[(size_t)i * C + c], want);
                    break;
                }
                sum[(size_t)i * C + c] += part[(size_t)i * C + c];
            }
        }
    }
    CHECK(memcmp(sum, out, (size_t)N * C * sizeof(float)) == 0, "the shards' rows do not add up to the whole lookup");
    int32_t badtok[9];
    memcpy(badtok, tokens, sizeof badtok);
    badtok[2] = V;
    bad = -1;
    CHECK(cpu_embedding_shard_fwd(part, badtok, table, N, C, 0, 4, V, &bad) == -1 && bad == 2,
          "a shard must refuse id %d outside the whole vocabulary (bad row %d)", V, bad);
    free(table), free(out), free(out2), free(sum), free(part);
}

static void test_rmsnorm(void) {
    const int N = 7, C = 37;
    const float eps = 1e-5f;
    float *x = kt_falloc((size_t)N * C), *w = kt_falloc(C), *out = kt_falloc((size_t)N * C), rstd[7];
    kt_fill(x, (size_t)N * C, 3.0);
    kt_fill(w, C, 1.5);
    double *want = kt_dalloc((size_t)N * C), want_r[7];
    for (int n = 0; n < N; n++) {
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)x[n * C + c] * x[n * C + c];
        const double r = 1.0 / sqrt(ss / C + eps);
        want_r[n] = r;
        for (int c = 0; c < C; c++) want[n * C + c] = (double)w[c] * x[n * C + c] * r;
    }
    cpu_rmsnorm_fwd(out, rstd, x, w, N, C, eps);
    check_close("rmsnorm out", out, want, (size_t)N * C, RTOL, ATOL);
    check_close("rmsnorm rstd", rstd, want_r, N, RTOL, 0.0);
    cpu_rmsnorm_fwd(out, NULL, x, w, N, C, eps); // rstd is optional
    check_close("rmsnorm out (rstd NULL)", out, want, (size_t)N * C, RTOL, ATOL);
    free(x), free(w), free(out), free(want);
}

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

// Fused residual add + RMSNorm: against the double reference of x_out = x + residual and its norm, and against the
// unfused pair (cpu_add_inplace, then cpu_rmsnorm_fwd) bit for bit — the contract of ops_residual_rmsnorm_fwd —
// in place on either input, and without a residual (a plain norm that leaves x_out alone).
static void test_residual_rmsnorm(void) {
    const int Cs[3] = {37, 64, 1};
    for (int ci = 0; ci < 3; ci++) {
        const int N = 6, C = Cs[ci];
        const size_t n = (size_t)N * C;
        const float eps = 1e-6f;
        float *x = kt_falloc(n), *res = kt_falloc(n), *w = kt_falloc(C), *x_out = kt_falloc(n), *out = kt_falloc(n);
        float rstd[6], rstd2[6];
        kt_fill(x, n, 3.0);
        kt_fill(res, n, 3.0);
        kt_fill(w, C, 1.5);
        double *want_sum = kt_dalloc(n), *want = kt_dalloc(n), want_r[6];
        for (int r = 0; r < N; r++) {
            double ss = 0.0;
            for (int c = 0; c < C; c++) {
                const double v = (double)x[r * C + c] + res[r * C + c];
                want_sum[r * C + c] = v;
                ss += v * v;
            }
            want_r[r] = 1.0 / sqrt(ss / C + eps);
            for (int c = 0; c < C; c++) want[r * C + c] = (double)w[c] * want_sum[r * C + c] * want_r[r];
        }
        char what[64];
        cpu_residual_rmsnorm_fwd(x_out, out, rstd, x, res, w, N, C, eps);
        snprintf(what, sizeof what, "residual_rmsnorm C=%d x_out", C);
        check_close(what, x_out, want_sum, n, 1.2e-7, 0.0); // one fp32 rounding (2^-24 relative, twice for margin)
        snprintf(what, sizeof what, "residual_rmsnorm C=%d out", C);
        check_close(what, out, want, n, RTOL, ATOL);
        snprintf(what, sizeof what, "residual_rmsnorm C=%d rstd", C);
        check_close(what, rstd, want_r, N, RTOL, 0.0);

        // The unfused pair on a copy.
        float *y = kt_falloc(n), *out2 = kt_falloc(n);
        memcpy(y, x, n * sizeof(float));
        cpu_add_inplace(y, res, n);
        cpu_rmsnorm_fwd(out2, rstd2, y, w, N, C, eps);
        CHECK(same_bits(x_out, y, n) && same_bits(out, out2, n) && same_bits(rstd, rstd2, N),
              "C=%d: fused residual + rmsnorm differs from add_inplace + rmsnorm_fwd", C);

        // In place on x, then on residual: the same bits.
        float *xi = kt_falloc(n), *ri = kt_falloc(n);
        memcpy(xi, x, n * sizeof(float));
        memcpy(ri, res, n * sizeof(float));
        cpu_residual_rmsnorm_fwd(xi, out2, rstd2, xi, res, w, N, C, eps);
        CHECK(same_bits(xi, x_out, n) && same_bits(out2, out, n) && same_bits(rstd2, rstd, N),
              "C=%d: x_out aliasing x changes the result", C);
        cpu_residual_rmsnorm_fwd(ri, out2, NULL, x, ri, w, N, C, eps);
        CHECK(same_bits(ri, x_out, n) && same_bits(out2, out, n), "C=%d: x_out aliasing residual changes the result",
              C);

        // No residual: the plain norm of x_out repeats the fused out and rstd; x_out is not written.
        float *untouched = kt_falloc(n);
        for (size_t i = 0; i < n; i++) untouched[i] = NAN;
        cpu_residual_rmsnorm_fwd(untouched, out2, rstd2, x_out, NULL, w, N, C, eps);
        CHECK(same_bits(out2, out, n) && same_bits(rstd2, rstd, N),
              "C=%d: a plain norm of the stored x_out differs from the fused op's", C);
        int written = 0;
        for (size_t i = 0; i < n; i++) written |= !isnan(untouched[i]);
        CHECK(!written, "C=%d: x_out written although residual is NULL", C);
        free(x), free(res), free(w), free(x_out), free(out), free(want_sum), free(want), free(y), free(out2), free(xi),
            free(ri), free(untouched);
    }
}

// The angle is pos * inv_freq rounded to fp32 (as transformers computes it); cos/sin of it in double.
// Through the ops API: a residual without somewhere to put x_out, or a bad shape, is refused with a message.
static void test_residual_rmsnorm_errors(void) {
    OpsCtx *ctx = NULL;
    char err[256];
    if (ops_create(&ctx, OPS_BACKEND_CPU, 0, err, sizeof err) != 0) {
        CHECK(0, "ops_create(cpu) failed: %s", err);
        return;
    }
    float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, res[8] = {0}, w[4] = {1, 1, 1, 1}, out[8], rstd[2];
    ops_residual_rmsnorm_fwd(ctx, NULL, out, rstd, x, res, w, 2, 4, 1e-6f);
    CHECK(ops_status(ctx) < 0 && strstr(ops_error(ctx), "without x_out"),
          "a residual without x_out must be refused: \"%s\"", ops_error(ctx));
    ops_clear_error(ctx);
    ops_residual_rmsnorm_bwd(ctx, out, NULL, NULL, x, x, w, rstd, 2, 0);
    CHECK(ops_status(ctx) < 0 && strstr(ops_error(ctx), "C=0"), "C = 0 must be refused: \"%s\"", ops_error(ctx));
    ops_clear_error(ctx);
    ops_residual_rmsnorm_fwd(ctx, NULL, out, rstd, x, NULL, w, 2, 4, 1e-6f); // no residual: x_out may be NULL
    CHECK(ops_status(ctx) == 0, "a plain norm through the fused op failed: %s", ops_error(ctx));
    ops_destroy(ctx);
}

static void rope_ref(double *out, const float *x, const int32_t *pos, const float *inv_freq, int N, int H, int D) {
    const int half = D / 2;
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < half; i++) {
                const double angle = (double)((float)pos[n] * inv_freq[i]);
                const size_t base = ((size_t)n * H + h) * D;
                const double x1 = x[base + i], x2 = x[base + i + half];
                out[base + i] = x1 * cos(angle) - x2 * sin(angle);
                out[base + i + half] = x2 * cos(angle) + x1 * sin(angle);
            }
}

static void test_rope(void) {
    const int N = 6, H = 3, D = 18;
    const size_t n = (size_t)N * H * D;
    int32_t pos[6] = {0, 1, 5, 17, 1000, 4095};
    float inv_freq[9];
    for (int i = 0; i < D / 2; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / D);
    float *x = kt_falloc(n);
    kt_fill(x, n, 1.0);
    double *want = kt_dalloc(n);
    rope_ref(want, x, pos, inv_freq, N, H, D);
    cpu_rope_fwd(x, pos, inv_freq, N, H, D);
    check_close("rope fwd", x, want, n, RTOL, ATOL);
    free(x), free(want);
}

static void test_matmul(void) {
    const int N = 13, IC = 29, OC = 17;
    float *in = kt_falloc((size_t)N * IC), *w = kt_falloc((size_t)OC * IC), *bias = kt_falloc(OC);
    float *out = kt_falloc((size_t)N * OC);
    kt_fill(in, (size_t)N * IC, 1.0);
    kt_fill(w, (size_t)OC * IC, 1.0);
    kt_fill(bias, OC, 1.0);
    double *want = kt_dalloc((size_t)N * OC);
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        for (int r = 0; r < N; r++)
            for (int o = 0; o < OC; o++) {
                double s = with_bias ? bias[o] : 0.0;
                for (int i = 0; i < IC; i++) s += (double)in[r * IC + i] * w[o * IC + i];
                want[r * OC + o] = s;
            }
        for (size_t i = 0; i < (size_t)N * OC; i++) out[i] = NAN; // overwrite semantics: old contents ignored
        cpu_matmul_fwd(out, in, w, with_bias ? bias : NULL, N, IC, OC);
        check_close(with_bias ? "matmul fwd (bias)" : "matmul fwd", out, want, (size_t)N * OC, RTOL, ATOL);
    }
    free(in), free(w), free(bias), free(out), free(want);
}

static void test_swiglu(void) {
    const int N = 5, I = 41;
    float *gu = kt_falloc((size_t)N * 2 * I), *out = kt_falloc((size_t)N * I);
    kt_fill(gu, (size_t)N * 2 * I, 6.0);
    gu[0] = -95.0f; // sigmoid underflows: silu -> -0
    gu[1] = 95.0f;
    double *want = kt_dalloc((size_t)N * I);
    for (int n = 0; n < N; n++)
        for (int i = 0; i < I; i++) {
            const double g = gu[n * 2 * I + i], u = gu[n * 2 * I + I + i];
            want[n * I + i] = g / (1.0 + exp(-g)) * u;
        }
    cpu_swiglu_fwd(out, gu, N, I);
    check_close("swiglu fwd", out, want, (size_t)N * I, RTOL, ATOL);
    free(gu), free(out), free(want);
}

// Double-precision log-softmax of logits * inv_t: lse, gathered logprob (0 for ignored rows), entropy.
static void logprobs_ref(double *lp, double *lse, double *ent, const float *logits, const int32_t *targets, int N,
                         int V, float inv_t) {
    for (int n = 0; n < N; n++) {
        const float *row = logits + (size_t)n * V;
        double m = -INFINITY;
        for (int j = 0; j < V; j++) m = fmax(m, (double)row[j] * inv_t);
        double s = 0.0;
        for (int j = 0; j < V; j++) s += exp((double)row[j] * inv_t - m);
        lse[n] = m + log(s);
        double h = 0.0;
        for (int j = 0; j < V; j++) {
            const double logp = (double)row[j] * inv_t - lse[n];
            h -= exp(logp) * logp;
        }
        ent[n] = h;
        lp[n] = targets[n] < 0 ? 0.0 : (double)row[targets[n]] * inv_t - lse[n];
    }
}

static void test_logprobs(void) {
    enum { N = 6, V = 2500 }; // V spans several of the kernel's 1024-wide chunks and a ragged tail
    float *logits = kt_falloc((size_t)N * V);
    float lp[N], lse[N], ent[N];
    double wlp[N], wlse[N], went[N];
    int32_t targets[N] = {7, -1, 2499, 0, -100, 1234};
    const float temps[2] = {1.0f, 0.7f};
    for (int ti = 0; ti < 2; ti++) {
        const float inv_t = 1.0f / temps[ti];
        kt_fill(logits, (size_t)N * V, 8.0);
        logprobs_ref(wlp, wlse, went, logits, targets, N, V, inv_t);
        for (int n = 0; n < N; n++) lp[n] = lse[n] = ent[n] = NAN;
        cpu_logprobs_fwd(lp, lse, ent, logits, targets, N, V, inv_t);
        check_close("logprobs", lp, wlp, N, RTOL, ATOL);
        check_close("logprobs lse", lse, wlse, N, RTOL, ATOL);
        check_close("logprobs entropy", ent, went, N, RTOL, ATOL);
        CHECK(lp[1] == 0.0f && lp[4] == 0.0f, "ignored rows must have logprob exactly 0");
        cpu_logprobs_fwd(lp, lse, NULL, logits, targets, N, V, inv_t); // entropy is optional
        check_close("logprobs (entropy NULL)", lp, wlp, N, RTOL, ATOL);
    }
    // Large logits (|z| ~ 1e4): everything stays finite and accurate; targets include the row's argmax,
    // whose logprob is a small number computed from huge ones.
    kt_fill(logits, (size_t)N * V, 1e4);
    for (int n = 0; n < N; n++) {
        if (n == 1 || n == 4) continue;
        int am = 0;
        for (int j = 1; j < V; j++) am = logits[(size_t)n * V + j] > logits[(size_t)n * V + am] ? j : am;
        if (n % 2 == 0) targets[n] = am;
        logits[(size_t)n * V + (am + 1) % V] = logits[(size_t)n * V + am] - 0.5f; // a close runner-up
    }
    logprobs_ref(wlp, wlse, went, logits, targets, N, V, 1.0f);
    cpu_logprobs_fwd(lp, lse, ent, logits, targets, N, V, 1.0f);
    for (int n = 0; n < N; n++)
        CHECK(isfinite(lp[n]) && isfinite(lse[n]) && isfinite(ent[n]), "large logits: row %d not finite", n);
    check_close("logprobs large", lp, wlp, N, RTOL, ATOL);
    check_close("logprobs large lse", lse, wlse, N, RTOL, 0.0);
    // The entropy of these rows is O(1) while the logits are O(1e4): an absolute bound scaled by the logits'
    // fp32 resolution (ulp(1e4) ~ 1e-3) is the meaningful one.
    for (int n = 0; n < N; n++)
        CHECK(fabs(ent[n] - went[n]) <= 2e-3, "large logits: entropy row %d got %g want %g", n, ent[n], went[n]);
    free(logits);
}

static void test_sum_squares(void) {
    const size_t n = 100003;
    float *x = kt_falloc(n);
    kt_fill(x, n, 1.0);
    double want = 1.5;
    for (size_t i = 0; i < n; i++) want += (double)x[i] * x[i];
    float out = 1.5f; // accumulates onto what is there
    cpu_sum_squares(&out, x, n);
    CHECK(fabs(out - want) <= 1e-6 * want, "sum_squares got %.9g want %.9g", out, want);
    // Many tiny squares after one large one: a float running sum would drop all of them.
    for (size_t i = 0; i < n; i++) x[i] = 1e-3f;
    x[0] = 100.0f;
    want = 0.0;
    for (size_t i = 0; i < n; i++) want += (double)x[i] * x[i];
    out = 0.0f;
    cpu_sum_squares(&out, x, n);
    CHECK(fabs(out - want) <= 1e-6 * want, "sum_squares (tiny terms) got %.9g want %.9g", out, want);
    free(x);
}

int main(void) {
    kt_seed(12345);
    test_vexp();
    test_vmax();
    test_add_inplace();
    test_dropout();
    test_embedding();
    test_rmsnorm();
    test_residual_rmsnorm();
    test_residual_rmsnorm_errors();
    test_rope();
    test_matmul();
    test_swiglu();
    test_logprobs();
    test_sum_squares();
    return check_exit_code("test_kernels_fwd");
}
