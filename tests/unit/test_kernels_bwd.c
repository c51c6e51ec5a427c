// tests/unit/test_kernels_bwd.c — every backward of the fp32 CPU backend (kernels/cpu/) against central
// finite differences of a scalar function: f = <forward(inputs), r> for a random tensor r (so df/d output = r
// is the dout handed to the kernel). The forward inside f is a double-precision implementation written here
// (the forward tests tie it to the kernels), so the finite difference is accurate to ~1e-9 and the tolerance
// only has to cover the kernels' fp32 arithmetic: rtol 1e-4 with an absolute floor of 1e-5 x the gradient's
// largest element. Accumulate-vs-overwrite contracts are checked by seeding outputs with random values
// (must be added to) or NaN (must be overwritten).
#include "kernels/cpu/cpu_ops.h"
#include "kernels_testlib.h"

#define RTOL 1e-4
#define ATOL 1e-5

typedef struct {
    int N, C, V, H, D, I, IC, OC;
    float eps, inv_t;
    const double *r;                // weights of the scalar function, shaped like the forward's output
    const int32_t *ints;            // tokens / positions / targets
    const float *inv_freq;
} Ctx;

static float *seeded(size_t n, double scale) {
    float *p = kt_falloc(n);
    kt_fill(p, n, scale);
    return p;
}
static float *nan_filled(size_t n) {
    float *p = kt_falloc(n);
    for (size_t i = 0; i < n; i++) p[i] = NAN;
    return p;
}
static double *grad_plus(const float *base, const double *grad, size_t n) {
    double *w = kt_dalloc(n);
    for (size_t i = 0; i < n; i++) w[i] = (base ? base[i] : 0.0) + grad[i];
    return w;
}

// ---- RMSNorm: params = [x (N, C) | w (C)] --------------------------------------------------------------
static double f_rmsnorm(const double *p, void *vc) {
    const Ctx *c = vc;
    const double *x = p, *w = p + (size_t)c->N * c->C;
    double f = 0.0;
    for (int n = 0; n < c->N; n++) {
        double ss = 0.0;
        for (int j = 0; j < c->C; j++) ss += x[n * c->C + j] * x[n * c->C + j];
        const double r = 1.0 / sqrt(ss / c->C + c->eps);
        for (int j = 0; j < c->C; j++) f += c->r[n * c->C + j] * w[j] * x[n * c->C + j] * r;
    }
    return f;
}

static void test_rmsnorm_bwd(void) {
    Ctx c = {.N = 5, .C = 37, .eps = 1e-6f};
    const size_t nx = (size_t)c.N * c.C;
    float *x = seeded(nx, 2.0), *w = seeded(c.C, 1.5), *dout = seeded(nx, 1.0), *out = kt_falloc(nx), rstd[5];
    double *r = kt_to_double(dout, nx), *p = kt_dalloc(nx + c.C), *g = kt_dalloc(nx + c.C);
    for (size_t i = 0; i < nx; i++) p[i] = x[i];
    for (int j = 0; j < c.C; j++) p[nx + j] = w[j];
    c.r = r;
    kt_fd_grad(f_rmsnorm, p, nx + c.C, &c, g);
    cpu_rmsnorm_fwd(out, rstd, x, w, c.N, c.C, c.eps);
    float *dx = seeded(nx, 1.0), *dw = seeded(c.C, 1.0); // both accumulate
    double *want_dx = grad_plus(dx, g, nx), *want_dw = grad_plus(dw, g + nx, c.C);
    cpu_rmsnorm_bwd(dx, dw, dout, x, w, rstd, c.N, c.C);
    check_close("rmsnorm dx (accumulated)", dx, want_dx, nx, RTOL, ATOL);
    check_close("rmsnorm dw (accumulated)", dw, want_dw, c.C, RTOL, ATOL);
    free(x), free(w), free(dout), free(out), free(r), free(p), free(g), free(dx), free(dw), free(want_dx), free(want_dw);
}

// ---- fused residual + RMSNorm: params = [x (N, C) | residual (N, C) | w (C)] ---------------------------------
// f = <rmsnorm(x + residual) w, r> + <x + residual, r2>: the second term is the residual stream carrying on past
// the norm, so df/dx = df/dresidual = r2 + the norm's input gradient — what the fused backward merges.
static double f_residual_rmsnorm(const double *p, void *vc) {
    const Ctx *c = vc;
    const size_t nx = (size_t)c->N * c->C;
    const double *x = p, *res = p + nx, *w = p + 2 * nx, *r2 = c->r + nx;
    double f = 0.0;
    for (int n = 0; n < c->N; n++) {
        double ss = 0.0;
        for (int j = 0; j < c->C; j++) {
            const double v = x[n * c->C + j] + res[n * c->C + j];
            ss += v * v;
        }
        const double r = 1.0 / sqrt(ss / c->C + c->eps);
        for (int j = 0; j < c->C; j++) {
            const double v = x[n * c->C + j] + res[n * c->C + j];
            f += c->r[n * c->C + j] * w[j] * v * r + r2[n * c->C + j] * v;
        }
    }
    return f;
}

static void test_residual_rmsnorm_bwd(void) {
    Ctx c = {.N = 5, .C = 37, .eps = 1e-6f};
    const size_t nx = (size_t)c.N * c.C, np = 2 * nx + c.C;
    float *x = seeded(nx, 2.0), *res = seeded(nx, 2.0), *w = seeded(c.C, 1.5), *dout = seeded(nx, 1.0);
    float *dres_in = seeded(nx, 1.0), *x_out = kt_falloc(nx), *out = kt_falloc(nx), rstd[5];
    double *r = kt_dalloc(2 * nx), *p = kt_dalloc(np), *g = kt_dalloc(np);
    for (size_t i = 0; i < nx; i++) r[i] = dout[i], r[nx + i] = dres_in[i], p[i] = x[i], p[nx + i] = res[i];
    for (int j = 0; j < c.C; j++) p[2 * nx + j] = w[j];
    c.r = r;
    kt_fd_grad(f_residual_rmsnorm, p, np, &c, g);
    cpu_residual_rmsnorm_fwd(x_out, out, rstd, x, res, w, c.N, c.C, c.eps);

    // dres_out overwritten (NaN seed), dw accumulated (random seed).
    float *dres = nan_filled(nx), *dw = seeded(c.C, 1.0);
    double *want_dw = grad_plus(dw, g + 2 * nx, c.C);
    cpu_residual_rmsnorm_bwd(dres, dw, dres_in, dout, x_out, w, rstd, c.N, c.C);
    check_close("residual_rmsnorm dres vs d/dx", dres, g, nx, RTOL, ATOL);
    check_close("residual_rmsnorm dres vs d/dresidual", dres, g + nx, nx, RTOL, ATOL);
    check_close("residual_rmsnorm dw (accumulated)", dw, want_dw, c.C, RTOL, ATOL);

    // The unfused backward (rmsnorm_bwd accumulating into a copy of dres_in) gives the same bits; so does the fused
    // op in place on dres_in.
    float *dx = kt_falloc(nx), *inplace = kt_falloc(nx);
    memcpy(dx, dres_in, nx * sizeof(float));
    memcpy(inplace, dres_in, nx * sizeof(float));
    cpu_rmsnorm_bwd(dx, NULL, dout, x_out, w, rstd, c.N, c.C);
    cpu_residual_rmsnorm_bwd(inplace, NULL, inplace, dout, x_out, w, rstd, c.N, c.C);
    CHECK(memcmp(dx, dres, nx * sizeof(float)) == 0, "fused backward differs from rmsnorm_bwd's accumulation");
    CHECK(memcmp(inplace, dres, nx * sizeof(float)) == 0, "fused backward in place on dres_in differs");

    // dres_in NULL: the norm's input gradient alone (the r2 term's gradient, r2 itself, taken away).
    float *alone = nan_filled(nx);
    double *want_alone = kt_dalloc(nx);
    for (size_t i = 0; i < nx; i++) want_alone[i] = g[i] - r[nx + i];
    cpu_residual_rmsnorm_bwd(alone, NULL, NULL, dout, x_out, w, rstd, c.N, c.C);
    check_close("residual_rmsnorm dres (dres_in NULL, overwrite)", alone, want_alone, nx, RTOL, ATOL);
    free(x), free(res), free(w), free(dout), free(dres_in), free(x_out), free(out), free(r), free(p), free(g);
    free(dres), free(dw), free(want_dw), free(dx), free(inplace), free(alone), free(want_alone);
}

// ---- RoPE: params = x (N, H, D) -------------------------------------------------------------------------
static double f_rope(const double *x, void *vc) {
    const Ctx *c = vc;
    const int half = c->D / 2;
    double f = 0.0;
    for (int n = 0; n < c->N; n++)
        for (int h = 0; h < c->H; h++)
            for (int i = 0; i < half; i++) {
                const double a = (double)((float)c->ints[n] * c->inv_freq[i]);
                const size_t b = ((size_t)n * c->H + h) * c->D;
                f += c->r[b + i] * (x[b + i] * cos(a) - x[b + i + half] * sin(a));
                f += c->r[b + i + half] * (x[b + i + half] * cos(a) + x[b + i] * sin(a));
            }
    return f;
}

static void test_rope_bwd(void) {
    int32_t pos[4] = {0, 3, 250, 2047};
    float inv_freq[7];
    Ctx c = {.N = 4, .H = 3, .D = 14, .ints = pos, .inv_freq = inv_freq};
    for (int i = 0; i < c.D / 2; i++) inv_freq[i] = (float)pow(500000.0, -2.0 * i / c.D);
    const size_t n = (size_t)c.N * c.H * c.D;
    float *x = seeded(n, 1.0), *dx = seeded(n, 1.0);
    double *r = kt_to_double(dx, n), *p = kt_to_double(x, n), *g = kt_dalloc(n);
    c.r = r;
    kt_fd_grad(f_rope, p, n, &c, g);
    cpu_rope_bwd(dx, pos, inv_freq, c.N, c.H, c.D); // in place: dout becomes dx
    check_close("rope dx", dx, g, n, RTOL, ATOL);
    // Forward then backward is the identity (a rotation's transpose is its inverse).
    float *y = kt_falloc(n);
    memcpy(y, x, n * sizeof(float));
    cpu_rope_fwd(y, pos, inv_freq, c.N, c.H, c.D);
    cpu_rope_bwd(y, pos, inv_freq, c.N, c.H, c.D);
    check_close("rope bwd(fwd(x)) == x", y, p, n, 1e-6, 1e-6);
    free(x), free(dx), free(r), free(p), free(g), free(y);
}

// ---- Linear: params = [in (N, IC) | w (OC, IC) | bias (OC)] ------------------------------------------------
static double f_matmul(const double *p, void *vc) {
    const Ctx *c = vc;
    const double *in = p, *w = p + (size_t)c->N * c->IC, *bias = w + (size_t)c->OC * c->IC;
    double f = 0.0;
    for (int n = 0; n < c->N; n++)
        for (int o = 0; o < c->OC; o++) {
            double s = bias[o];
            for (int i = 0; i < c->IC; i++) s += in[n * c->IC + i] * w[o * c->IC + i];
            f += c->r[n * c->OC + o] * s;
        }
    return f;
}

static void test_matmul_bwd(void) {
    Ctx c = {.N = 11, .IC = 23, .OC = 19};
    const size_t nin = (size_t)c.N * c.IC, nw = (size_t)c.OC * c.IC, np = nin + nw + c.OC;
    float *in = seeded(nin, 1.0), *w = seeded(nw, 1.0), *bias = seeded(c.OC, 1.0), *dout = seeded((size_t)c.N * c.OC, 1.0);
    double *r = kt_to_double(dout, (size_t)c.N * c.OC), *p = kt_dalloc(np), *g = kt_dalloc(np);
    for (size_t i = 0; i < nin; i++) p[i] = in[i];
    for (size_t i = 0; i < nw; i++) p[nin + i] = w[i];
    for (int i = 0; i < c.OC; i++) p[nin + nw + i] = bias[i];
    c.r = r;
    kt_fd_grad(f_matmul, p, np, &c, g);

    // din overwritten (old contents NaN), dw and dbias accumulated.
    float *din = nan_filled(nin), *dw = seeded(nw, 1.0), *dbias = seeded(c.OC, 1.0);
    double *want_dw = grad_plus(dw, g + nin, nw), *want_db = grad_plus(dbias, g + nin + nw, c.OC);
    cpu_matmul_bwd(din, dw, dbias, dout, in, w, c.N, c.IC, c.OC, 0);
    check_close("matmul din (overwrite)", din, g, nin, RTOL, ATOL);
    check_close("matmul dw (accumulated)", dw, want_dw, nw, RTOL, ATOL);
    check_close("matmul dbias (accumulated)", dbias, want_db, c.OC, RTOL, ATOL);

    // din accumulated; dw and dbias skipped when NULL.
    float *din2 = seeded(nin, 1.0);
    double *want_din2 = grad_plus(din2, g, nin);
    cpu_matmul_bwd(din2, NULL, NULL, dout, in, w, c.N, c.IC, c.OC, 1);
    check_close("matmul din (accumulated)", din2, want_din2, nin, RTOL, ATOL);
    // din skipped when NULL: only dw grows (by one more gradient).
    for (size_t i = 0; i < nw; i++) want_dw[i] += g[nin + i];
    cpu_matmul_bwd(NULL, dw, NULL, dout, in, w, c.N, c.IC, c.OC, 0);
    check_close("matmul dw (second accumulation, din NULL)", dw, want_dw, nw, RTOL, ATOL);
    free(in), free(w), free(bias), free(dout), free(r), free(p), free(g), free(din), free(dw), free(dbias);
    free(want_dw), free(want_db), free(din2), free(want_din2);
}

// ---- SwiGLU: params = gu (N, 2I) ------------------------------------------------------------------------
static double f_swiglu(const double *gu, void *vc) {
    const Ctx *c = vc;
    double f = 0.0;
    for (int n = 0; n < c->N; n++)
        for (int i = 0; i < c->I; i++) {
            const double g = gu[n * 2 * c->I + i], u = gu[n * 2 * c->I + c->I + i];
            f += c->r[n * c->I + i] * g / (1.0 + exp(-g)) * u;
        }
    return f;
}

static void test_swiglu_bwd(void) {
    Ctx c = {.N = 4, .I = 29};
    const size_t ngu = (size_t)c.N * 2 * c.I, nout = (size_t)c.N * c.I;
    float *gu = seeded(ngu, 5.0), *dout = seeded(nout, 1.0), *dgu = nan_filled(ngu);
    double *r = kt_to_double(dout, nout), *p = kt_to_double(gu, ngu), *g = kt_dalloc(ngu);
    c.r = r;
    kt_fd_grad(f_swiglu, p, ngu, &c, g);
    cpu_swiglu_bwd(dgu, dout, gu, c.N, c.I);
    check_close("swiglu dgu (overwrite)", dgu, g, ngu, RTOL, ATOL);
    free(gu), free(dout), free(dgu), free(r), free(p), free(g);
}

// ---- log-softmax gather: params = logits (N, V); f = sum_n r_n logprob_n ---------------------------------
static double f_logprobs(const double *x, void *vc) {
    const Ctx *c = vc;
    double f = 0.0;
    for (int n = 0; n < c->N; n++) {
        if (c->ints[n] < 0) continue;
        const double *row = x + (size_t)n * c->V;
        double m = -INFINITY, s = 0.0;
        for (int j = 0; j < c->V; j++) m = fmax(m, row[j] * c->inv_t);
        for (int j = 0; j < c->V; j++) s += exp(row[j] * c->inv_t - m);
        f += c->r[n] * (row[c->ints[n]] * c->inv_t - m - log(s));
    }
    return f;
}

// f = sum_n r_n logprob_n + s_n entropy_n (the GRPO entropy bonus adds the second term); s in c->r + N.
static double f_logprobs_entropy(const double *x, void *vc) {
    const Ctx *c = vc;
    double f = 0.0;
    for (int n = 0; n < c->N; n++) {
        const double *row = x + (size_t)n * c->V;
        double m = -INFINITY, s = 0.0, h = 0.0;
        for (int j = 0; j < c->V; j++) m = fmax(m, row[j] * c->inv_t);
        for (int j = 0; j < c->V; j++) s += exp(row[j] * c->inv_t - m);
        const double lse = m + log(s);
        for (int j = 0; j < c->V; j++) {
            const double lp = row[j] * c->inv_t - lse;
            h -= exp(lp) * lp;
        }
        if (c->ints[n] >= 0) f += c->r[n] * (row[c->ints[n]] * c->inv_t - lse);
        f += c->r[c->N + n] * h;
    }
    return f;
}

static void test_logprobs_entropy_bwd(void) {
    int32_t targets[4] = {3, -1, 0, 30};
    Ctx c = {.N = 4, .V = 31, .inv_t = 1.0f / 0.8f, .ints = targets};
    const size_t n = (size_t)c.N * c.V;
    float *logits = seeded(n, 2.0), dlp[4] = {0.7f, 0.3f, -1.1f, 0.4f}, dent[4] = {0.5f, -0.9f, 0.25f, 1.3f};
    float lp[4], lse[4], ent[4];
    double r[8];
    for (int i = 0; i < 4; i++) r[i] = dlp[i], r[4 + i] = dent[i];
    double *p = kt_to_double(logits, n), *g = kt_dalloc(n);
    c.r = r;
    kt_fd_grad(f_logprobs_entropy, p, n, &c, g);
    cpu_logprobs_fwd(lp, lse, ent, logits, targets, c.N, c.V, c.inv_t);
    float *dlogits = nan_filled(n);
    cpu_logprobs_bwd(dlogits, dlp, dent, ent, logits, targets, lse, c.N, c.V, c.inv_t);
    check_close("logprobs+entropy dlogits (overwrite)", dlogits, g, n, RTOL, ATOL);
    free(logits), free(p), free(g), free(dlogits);
}

static void test_logprobs_bwd(void) {
    int32_t targets[5] = {3, -1, 0, 46, 20};
    Ctx c = {.N = 5, .V = 47, .inv_t = 1.0f / 0.6f, .ints = targets};
    const size_t n = (size_t)c.N * c.V;
    float *logits = seeded(n, 3.0), dlp[5], lp[5], lse[5];
    kt_fill(dlp, 5, 1.0);
    double r[5];
    for (int i = 0; i < 5; i++) r[i] = dlp[i];
    double *p = kt_to_double(logits, n), *g = kt_dalloc(n);
    c.r = r;
    kt_fd_grad(f_logprobs, p, n, &c, g);
    cpu_logprobs_fwd(lp, lse, NULL, logits, targets, c.N, c.V, c.inv_t);
    float *dlogits = nan_filled(n);
    cpu_logprobs_bwd(dlogits, dlp, NULL, NULL, logits, targets, lse, c.N, c.V, c.inv_t);
    check_close("logprobs dlogits (overwrite)", dlogits, g, n, RTOL, ATOL);
    for (int j = 0; j < c.V; j++)
        if (dlogits[c.V + j] != 0.0f) { CHECK(0, "ignored row 1 must get an all-zero gradient"); break; }
    // In place (the trainer's kept logits become their gradient): the same bits, with and without an entropy term.
    float ent[5], dent[5];
    kt_fill(dent, 5, 1.0);
    cpu_logprobs_fwd(lp, lse, ent, logits, targets, c.N, c.V, c.inv_t);
    for (int with_ent = 0; with_ent < 2; with_ent++) {
        float *inplace = malloc(n * sizeof *inplace);
        memcpy(inplace, logits, n * sizeof *inplace);
        cpu_logprobs_bwd(dlogits, dlp, with_ent ? dent : NULL, ent, logits, targets, lse, c.N, c.V, c.inv_t);
        cpu_logprobs_bwd(inplace, dlp, with_ent ? dent : NULL, ent, inplace, targets, lse, c.N, c.V, c.inv_t);
        CHECK(memcmp(inplace, dlogits, n * sizeof *inplace) == 0, "logprobs_bwd in place differs (entropy %d)",
              with_ent);
        free(inplace);
    }
    free(logits), free(p), free(g), free(dlogits);
}

// ---- embedding: params = table (V, C); f = sum r * table[tokens] ----------------------------------------
static double f_embedding(const double *table, void *vc) {
    const Ctx *c = vc;
    double f = 0.0;
    for (int n = 0; n < c->N; n++)
        for (int j = 0; j < c->C; j++) f += c->r[n * c->C + j] * table[(size_t)c->ints[n] * c->C + j];
    return f;
}

static void test_embedding_bwd(void) {
    int32_t tokens[8] = {4, 1, 4, 0, 6, 4, 1, 2}; // repeats must add up
    Ctx c = {.N = 8, .C = 15, .V = 7, .ints = tokens};
    const size_t nt = (size_t)c.V * c.C, no = (size_t)c.N * c.C;
    float *table = seeded(nt, 1.0), *dout = seeded(no, 1.0), *dtable = seeded(nt, 1.0);
    double *r = kt_to_double(dout, no), *p = kt_to_double(table, nt), *g = kt_dalloc(nt);
    c.r = r;
    kt_fd_grad(f_embedding, p, nt, &c, g);
    double *want = grad_plus(dtable, g, nt);
    cpu_embedding_bwd(dtable, dout, tokens, c.N, c.C);
    check_close("embedding dtable (accumulated)", dtable, want, nt, RTOL, ATOL);
    free(table), free(dout), free(dtable), free(r), free(p), free(g), free(want);
}

int main(void) {
    kt_seed(777);
    test_rmsnorm_bwd();
    test_residual_rmsnorm_bwd();
    test_rope_bwd();
    test_matmul_bwd();
    test_swiglu_bwd();
    test_logprobs_bwd();
    test_logprobs_entropy_bwd();
    test_embedding_bwd();
    return check_exit_code("test_kernels_bwd");
}
