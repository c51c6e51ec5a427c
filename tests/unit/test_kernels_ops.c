// tests/unit/test_kernels_ops.c — the public kernels/ops.h API end to end on the CPU backend (ops_create,
// ops_malloc, uploads, every op dispatched through the context, errors).
//   1. A small transformer block built from the ops (embedding, RMSNorm, q/k/v projections, RoPE, causal GQA
//      attention over two packed sequences, residual adds, SwiGLU MLP, final norm, LM head, log-softmax with
//      temperature and an ignored row), then its backward through the ops; the gradients of the embedding
//      table and of W_q match central finite differences of the same block written in double here.
//      Tolerance rtol 1e-4, absolute floor 1e-5 x max|grad| (fp32 chain vs double finite differences).
//   2. Errors: an out-of-range token records an error that names the row, later ops are no-ops until
//      ops_clear_error, a bad head grouping is refused, an unavailable CUDA backend is refused with a message.
//   3. Settings: ops_gemm_autotune_parse's words, and ops_create_with_settings refusing settings out of range
//      (with a message, no context) and taking valid ones on the CPU backend, which ignores them.
#include "kernels/ops.h"
#include "kernels_testlib.h"

enum { N = 7, B = 2, C = 8, HQ = 2, HKV = 1, HD = 4, I = 6, V = 11 };
static const int32_t cu_seqlens[B + 1] = {0, 4, 7};
static const int32_t tokens[N] = {3, 10, 0, 3, 7, 1, 5};
static const int32_t positions[N] = {0, 1, 2, 3, 0, 1, 2};
static const int32_t targets[N] = {10, 0, 3, -1, 1, 5, 2};
static const float eps = 1e-5f, inv_t = 1.0f / 0.8f;
static float inv_freq[HD / 2];

// Parameters, fp32 (the kernels' view) and double (the finite differences' view), in one flat vector.
enum {
    P_TABLE = 0,
    P_WN = P_TABLE + V * C,
    P_WQ = P_WN + C,
    P_WK = P_WQ + HQ * HD * C,
    P_WV = P_WK + HKV * HD * C,
    P_WO = P_WV + HKV * HD * C,
    P_WGU = P_WO + C * HQ * HD,
    P_WD = P_WGU + 2 * I * C,
    P_WF = P_WD + C * I,
    P_WLM = P_WF + C,
    P_TOTAL = P_WLM + V * C
};

static void d_linear(double *out, const double *in, const double *w, int n, int ic, int oc) {
    for (int r = 0; r < n; r++)
        for (int o = 0; o < oc; o++) {
            double s = 0.0;
            for (int i = 0; i < ic; i++) s += in[r * ic + i] * w[o * ic + i];
            out[r * oc + o] = s;
        }
}
static void d_rmsnorm(double *out, const double *x, const double *w) {
    for (int n = 0; n < N; n++) {
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += x[n * C + c] * x[n * C + c];
        const double r = 1.0 / sqrt(ss / C + eps);
        for (int c = 0; c < C; c++) out[n * C + c] = w[c] * x[n * C + c] * r;
    }
}
static void d_rope(double *x, int H) {
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < HD / 2; i++) {
                const double a = (double)((float)positions[n] * inv_freq[i]);
                double *p = x + ((size_t)n * H + h) * HD;
                const double x1 = p[i], x2 = p[i + HD / 2];
                p[i] = x1 * cos(a) - x2 * sin(a);
                p[i + HD / 2] = x2 * cos(a) + x1 * sin(a);
            }
}

// f = sum_n r_n * logprob_n of the block, in double. The finite differences perturb one slice of the
// parameter vector in place (the x argument); the block reads the whole vector through the context.
typedef struct {
    const double *P, *r;
} BlockCtx;

static double f_block(const double *slice, void *vctx) {
    (void)slice;
    const BlockCtx *bc = vctx;
    const double *P = bc->P, *r = bc->r;
    double x[N * C], h[N * C], q[N * HQ * HD], k[N * HKV * HD], v[N * HKV * HD], att[N * HQ * HD] = {0};
    double o[N * C], gu[N * 2 * I], a[N * I], mlp[N * C], hf[N * C], logits[N * V];
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) x[n * C + c] = P[P_TABLE + tokens[n] * C + c];
    d_rmsnorm(h, x, P + P_WN);
    d_linear(q, h, P + P_WQ, N, C, HQ * HD);
    d_linear(k, h, P + P_WK, N, C, HKV * HD);
    d_linear(v, h, P + P_WV, N, C, HKV * HD);
    d_rope(q, HQ);
    d_rope(k, HKV);
    const double scale = 1.0 / sqrt((double)HD);
    for (int b = 0; b < B; b++)
        for (int i = cu_seqlens[b]; i < cu_seqlens[b + 1]; i++)
            for (int hh = 0; hh < HQ; hh++) {
                const int g = hh / (HQ / HKV);
                double s[N], m = -INFINITY, z = 0.0;
                for (int j = cu_seqlens[b]; j <= i; j++) {
                    double d = 0.0;
                    for (int e = 0; e < HD; e++) d += q[(i * HQ + hh) * HD + e] * k[(j * HKV + g) * HD + e];
                    s[j] = d * scale;
                    m = fmax(m, s[j]);
                }
                for (int j = cu_seqlens[b]; j <= i; j++) z += exp(s[j] - m);
                for (int j = cu_seqlens[b]; j <= i; j++)
                    for (int e = 0; e < HD; e++) att[(i * HQ + hh) * HD + e] += exp(s[j] - m) / z * v[(j * HKV + g) * HD + e];
            }
    d_linear(o, att, P + P_WO, N, HQ * HD, C);
    for (int e = 0; e < N * C; e++) x[e] += o[e];
    d_linear(gu, x, P + P_WGU, N, C, 2 * I);
    for (int n = 0; n < N; n++)
        for (int i = 0; i < I; i++) {
            const double g = gu[n * 2 * I + i];
            a[n * I + i] = g / (1.0 + exp(-g)) * gu[n * 2 * I + I + i];
        }
    d_linear(mlp, a, P + P_WD, N, I, C);
    for (int e = 0; e < N * C; e++) x[e] += mlp[e];
    d_rmsnorm(hf, x, P + P_WF);
    d_linear(logits, hf, P + P_WLM, N, C, V);
    double f = 0.0;
    for (int n = 0; n < N; n++) {
        if (targets[n] < 0) continue;
        double m = -INFINITY, z = 0.0;
        for (int j = 0; j < V; j++) m = fmax(m, logits[n * V + j] * inv_t);
        for (int j = 0; j < V; j++) z += exp(logits[n * V + j] * inv_t - m);
        f += r[n] * (logits[n * V + targets[n]] * inv_t - m - log(z));
    }
    return f;
}

// Device (here: host) buffer holding a copy of a host fp32 array.
static void *up(OpsCtx *ctx, const float *src, size_t n) {
    void *p = ops_malloc(ctx, n * sizeof(float));
    ops_upload_f32(ctx, p, src, n);
    return p;
}
static void *zeros(OpsCtx *ctx, size_t n) { return ops_malloc(ctx, n * sizeof(float)); }

static void test_block(OpsCtx *ctx) {
    float P[P_TOTAL], dlp[N];
    kt_fill(P, P_TOTAL, 0.7);
    for (int c = 0; c < C; c++) P[P_WN + c] = P[P_WF + c] = 1.0f + 0.3f * (float)kt_uniform();
    kt_fill(dlp, N, 1.0);
    for (int i = 0; i < HD / 2; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / HD);

    // Parameters and integer inputs in backend memory.
    void *table = up(ctx, P + P_TABLE, V * C), *wn = up(ctx, P + P_WN, C), *wq = up(ctx, P + P_WQ, HQ * HD * C);
    void *wk = up(ctx, P + P_WK, HKV * HD * C), *wv = up(ctx, P + P_WV, HKV * HD * C), *wo = up(ctx, P + P_WO, C * HQ * HD);
    void *wgu = up(ctx, P + P_WGU, 2 * I * C), *wd = up(ctx, P + P_WD, C * I), *wf = up(ctx, P + P_WF, C);
    void *wlm = up(ctx, P + P_WLM, V * C);
    int32_t *d_tok = ops_malloc(ctx, sizeof tokens), *d_pos = ops_malloc(ctx, sizeof positions);
    int32_t *d_tgt = ops_malloc(ctx, sizeof targets), *d_cu = ops_malloc(ctx, sizeof cu_seqlens);
    float *d_freq = ops_malloc(ctx, sizeof inv_freq), *d_dlp = ops_malloc(ctx, sizeof dlp);
    ops_copy_to_device(ctx, d_tok, tokens, sizeof tokens);
    ops_copy_to_device(ctx, d_pos, positions, sizeof positions);
    ops_copy_to_device(ctx, d_tgt, targets, sizeof targets);
    ops_copy_to_device(ctx, d_cu, cu_seqlens, sizeof cu_seqlens);
    ops_copy_to_device(ctx, d_freq, inv_freq, sizeof inv_freq);
    ops_copy_to_device(ctx, d_dlp, dlp, sizeof dlp);

    // Forward. x0 (N, C) embedding; x1 = x0 + attn; x2 = x1 + mlp.
    void *x0 = zeros(ctx, N * C), *h = zeros(ctx, N * C), *q = zeros(ctx, N * HQ * HD), *k = zeros(ctx, N * HKV * HD);
    void *v = zeros(ctx, N * HKV * HD), *att = zeros(ctx, N * HQ * HD), *x1 = zeros(ctx, N * C), *o = zeros(ctx, N * C);
    void *gu = zeros(ctx, N * 2 * I), *a = zeros(ctx, N * I), *x2 = zeros(ctx, N * C), *mlp = zeros(ctx, N * C);
    void *hf = zeros(ctx, N * C), *logits = zeros(ctx, N * V);
    float *rstd0 = zeros(ctx, N), *rstdf = zeros(ctx, N), *lse_att = zeros(ctx, N * HQ);
    float *lp = zeros(ctx, N), *lse = zeros(ctx, N), *ent = zeros(ctx, N);
    const float scale = 1.0f / sqrtf((float)HD);
    ops_embedding_fwd(ctx, x0, d_tok, table, N, C, V);
    ops_rmsnorm_fwd(ctx, h, rstd0, x0, wn, N, C, eps);
    ops_matmul_fwd(ctx, q, h, wq, NULL, N, C, HQ * HD);
    ops_matmul_fwd(ctx, k, h, wk, NULL, N, C, HKV * HD);
    ops_matmul_fwd(ctx, v, h, wv, NULL, N, C, HKV * HD);
    ops_rope_fwd(ctx, q, d_pos, d_freq, N, HQ, HD);
    ops_rope_fwd(ctx, k, d_pos, d_freq, N, HKV, HD);
    ops_attention_fwd(ctx, att, lse_att, q, k, v, d_cu, B, N, HQ, HKV, HD, scale);
    ops_matmul_fwd(ctx, o, att, wo, NULL, N, HQ * HD, C);
    ops_copy(ctx, x1, x0, N * C * sizeof(float));
    ops_add_inplace(ctx, x1, o, N * C);
    ops_matmul_fwd(ctx, gu, x1, wgu, NULL, N, C, 2 * I);
    ops_swiglu_fwd(ctx, a, gu, N, I);
    ops_matmul_fwd(ctx, mlp, a, wd, NULL, N, I, C);
    ops_copy(ctx, x2, x1, N * C * sizeof(float));
    ops_add_inplace(ctx, x2, mlp, N * C);
    ops_rmsnorm_fwd(ctx, hf, rstdf, x2, wf, N, C, eps);
    ops_matmul_fwd(ctx, logits, hf, wlm, NULL, N, C, V);
    ops_logprobs_fwd(ctx, lp, lse, ent, logits, d_tgt, N, V, inv_t);

    // Backward (parameter gradients fp32, zero-initialized by ops_malloc; activation gradients as the
    // contracts say: rmsnorm accumulates into dx, matmul overwrites or accumulates din on request).
    void *dlogits = zeros(ctx, N * V), *dhf = zeros(ctx, N * C), *dx2 = zeros(ctx, N * C), *da = zeros(ctx, N * I);
    void *dgu = zeros(ctx, N * 2 * I), *dx1 = zeros(ctx, N * C), *datt = zeros(ctx, N * HQ * HD);
    void *dq = zeros(ctx, N * HQ * HD), *dk = zeros(ctx, N * HKV * HD), *dv = zeros(ctx, N * HKV * HD);
    void *dh = zeros(ctx, N * C), *dx0 = zeros(ctx, N * C);
    float *g_table = zeros(ctx, V * C), *g_wn = zeros(ctx, C), *g_wq = zeros(ctx, HQ * HD * C);
    float *g_wk = zeros(ctx, HKV * HD * C), *g_wv = zeros(ctx, HKV * HD * C), *g_wo = zeros(ctx, C * HQ * HD);
    float *g_wgu = zeros(ctx, 2 * I * C), *g_wd = zeros(ctx, C * I), *g_wf = zeros(ctx, C), *g_wlm = zeros(ctx, V * C);
    ops_logprobs_bwd(ctx, dlogits, d_dlp, NULL, NULL, logits, d_tgt, lse, N, V, inv_t);
    ops_matmul_bwd(ctx, dhf, g_wlm, NULL, dlogits, hf, wlm, N, C, V, 0);
    ops_rmsnorm_bwd(ctx, dx2, g_wf, dhf, x2, wf, rstdf, N, C);
    ops_matmul_bwd(ctx, da, g_wd, NULL, dx2, a, wd, N, I, C, 0);
    ops_swiglu_bwd(ctx, dgu, da, gu, N, I);
    ops_copy(ctx, dx1, dx2, N * C * sizeof(float));                       // residual path
    ops_matmul_bwd(ctx, dx1, g_wgu, NULL, dgu, x1, wgu, N, C, 2 * I, 1);  // + MLP path
    ops_matmul_bwd(ctx, datt, g_wo, NULL, dx1, att, wo, N, HQ * HD, C, 0);
    ops_attention_bwd(ctx, dq, dk, dv, datt, q, k, v, att, lse_att, d_cu, B, N, HQ, HKV, HD, scale);
    ops_rope_bwd(ctx, dq, d_pos, d_freq, N, HQ, HD);
    ops_rope_bwd(ctx, dk, d_pos, d_freq, N, HKV, HD);
    ops_matmul_bwd(ctx, dh, g_wq, NULL, dq, h, wq, N, C, HQ * HD, 0);
    ops_matmul_bwd(ctx, dh, g_wk, NULL, dk, h, wk, N, C, HKV * HD, 1);
    ops_matmul_bwd(ctx, dh, g_wv, NULL, dv, h, wv, N, C, HKV * HD, 1);
    ops_copy(ctx, dx0, dx1, N * C * sizeof(float));                       // residual path
    ops_rmsnorm_bwd(ctx, dx0, g_wn, dh, x0, wn, rstd0, N, C);            // + attention path
    ops_embedding_bwd(ctx, g_table, dx0, d_tok, N, C);
    ops_synchronize(ctx);
    CHECK(ops_status(ctx) == 0, "block through ops.h failed: %s", ops_error(ctx));

    // Reference gradients by finite differences of the double block.
    double Pd[P_TOTAL], r[N];
    for (int i = 0; i < P_TOTAL; i++) Pd[i] = P[i];
    for (int i = 0; i < N; i++) r[i] = dlp[i];
    double want_table[V * C], want_wq[HQ * HD * C];
    BlockCtx bc = {Pd, r};
    kt_fd_grad(f_block, Pd + P_TABLE, V * C, &bc, want_table);
    kt_fd_grad(f_block, Pd + P_WQ, HQ * HD * C, &bc, want_wq);
    float got_table[V * C], got_wq[HQ * HD * C], got_lp[N];
    ops_download_f32(ctx, got_table, g_table, V * C);
    ops_download_f32(ctx, got_wq, g_wq, HQ * HD * C);
    ops_download_f32(ctx, got_lp, lp, N);
    check_close("block: d embedding table", got_table, want_table, V * C, 1e-4, 1e-5);
    check_close("block: d W_q", got_wq, want_wq, HQ * HD * C, 1e-4, 1e-5);
    CHECK(got_lp[3] == 0.0f, "block: the ignored row's logprob must be 0");

    void *bufs[] = {table, wn, wq, wk, wv, wo, wgu, wd, wf, wlm, d_tok, d_pos, d_tgt, d_cu, d_freq, d_dlp, x0, h, q, k, v,
                    att, x1, o, gu, a, x2, mlp, hf, logits, rstd0, rstdf, lse_att, lp, lse, ent, dlogits, dhf, dx2, da,
                    dgu, dx1, datt, dq, dk, dv, dh, dx0, g_table, g_wn, g_wq, g_wk, g_wv, g_wo, g_wgu, g_wd, g_wf, g_wlm};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) ops_free(ctx, bufs[i]);
}

static void test_errors(OpsCtx *ctx) {
    float table[V * C], out[N * C], y[4] = {1, 2, 3, 4}, x[4] = {1, 1, 1, 1};
    kt_fill(table, V * C, 1.0);
    int32_t bad[N];
    memcpy(bad, tokens, sizeof bad);
    bad[3] = V + 5;
    for (int i = 0; i < N * C; i++) out[i] = -7.0f;
    ops_embedding_fwd(ctx, out, bad, table, N, C, V);
    CHECK(ops_status(ctx) < 0, "an out-of-range token must record an error");
    CHECK(strstr(ops_error(ctx), "row 3") != NULL, "the error must name the row: \"%s\"", ops_error(ctx));
    CHECK(strstr(ops_error(ctx), "16") != NULL, "the error must name the token id: \"%s\"", ops_error(ctx));
    CHECK(out[0] == -7.0f, "a refused embedding must not write its output");
    ops_add_inplace(ctx, y, x, 4); // after an error every op is a no-op
    CHECK(y[0] == 1.0f && y[3] == 4.0f, "ops after an error must not run");
    CHECK(ops_malloc(ctx, 16) == NULL, "ops_malloc after an error must return NULL");
    ops_clear_error(ctx);
    CHECK(ops_status(ctx) == 0 && ops_error(ctx)[0] == 0, "ops_clear_error must reset the context");
    ops_add_inplace(ctx, y, x, 4);
    CHECK(y[0] == 2.0f && y[3] == 5.0f, "ops must run again after ops_clear_error");

    float q[3 * 6], kv[2 * 6], o[3 * 6], lse[3 * 3];
    const int32_t cu[2] = {0, 1};
    ops_attention_fwd(ctx, o, lse, q, kv, kv, cu, 1, 1, 3, 2, 6, 1.0f);
    CHECK(ops_status(ctx) < 0 && strstr(ops_error(ctx), "Hq=3") && strstr(ops_error(ctx), "Hkv=2"),
          "Hq not a multiple of Hkv must be refused with both named: \"%s\"", ops_error(ctx));
    ops_clear_error(ctx);

    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        OpsCtx *cuda = NULL;
        char err[256] = "";
        CHECK(ops_create(&cuda, OPS_BACKEND_CUDA, 0, err, sizeof err) < 0 && cuda == NULL && err[0],
              "creating an unavailable CUDA context must fail with a message");
    }
}

static void test_settings(void) {
    static const struct {
        const char *text;
        int ok;
        OpsGemmAutotune want;
    } cases[] = {{"1", 1, OPS_GEMM_AUTOTUNE_ON},  {"on", 1, OPS_GEMM_AUTOTUNE_ON},   {"0", 1, OPS_GEMM_AUTOTUNE_OFF},
                 {"off", 1, OPS_GEMM_AUTOTUNE_OFF}, {"2", 1, OPS_GEMM_AUTOTUNE_LOG}, {"log", 1, OPS_GEMM_AUTOTUNE_LOG},
                 {"", 0, OPS_GEMM_AUTOTUNE_ON},   {"3", 0, OPS_GEMM_AUTOTUNE_ON},    {"yes", 0, OPS_GEMM_AUTOTUNE_ON},
                 {NULL, 0, OPS_GEMM_AUTOTUNE_ON}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        OpsGemmAutotune got = (OpsGemmAutotune)-1;
        const int rc = ops_gemm_autotune_parse(cases[i].text, &got);
        CHECK(cases[i].ok ? rc == 0 && got == cases[i].want : rc == -1 && got == (OpsGemmAutotune)-1,
              "ops_gemm_autotune_parse(\"%s\"): rc %d, setting %d", cases[i].text ? cases[i].text : "(null)", rc,
              (int)got);
    }
    const OpsSettings bad[] = {{.gemm_autotune = (OpsGemmAutotune)3}, {.gemm_autotune = (OpsGemmAutotune)-1},
                               {.gemm_workspace_mib = -1}, {.gemm_workspace_mib = 4097}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        OpsCtx *ctx = NULL;
        char err[256] = "";
        CHECK(ops_create_with_settings(&ctx, OPS_BACKEND_CPU, 0, &bad[i], err, sizeof err) < 0 && ctx == NULL &&
                     err[0],
              "settings %zu out of range must be refused with a message (got \"%s\")", i, err);
    }
    OpsCtx *ctx = NULL;
    char err[256] = "";
    const OpsSettings valid = {.gemm_autotune = OPS_GEMM_AUTOTUNE_LOG, .gemm_workspace_mib = 4096, .profile_ops = 1};
    CHECK(ops_create_with_settings(&ctx, OPS_BACKEND_CPU, 0, &valid, err, sizeof err) == 0 && ctx != NULL,
          "valid settings on the CPU backend: %s", err);
    if (ctx) {
        CHECK(ops_graph_supported(ctx) == 0, "the CPU backend records no graphs, profiled or not");
        ops_profile_print(ctx);
        ops_destroy(ctx);
    }
}

int main(void) {
    kt_seed(2024);
    OpsCtx *ctx = NULL;
    char err[256];
    REQUIRE(ops_create(&ctx, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "cpu context: %s", err);
    CHECK(ops_backend(ctx) == OPS_BACKEND_CPU && ops_dtype_size(ctx) == 4 && ops_backend_available(OPS_BACKEND_CPU),
          "a CPU context stores fp32");
    test_block(ctx);
    test_errors(ctx);
    ops_destroy(ctx);
    test_settings();
    return check_exit_code("test_kernels_ops");
}
