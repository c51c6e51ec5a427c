// tests/unit/test_kernels_attention.c — causal GQA attention of the fp32 CPU backend.
//   forward  : out and lse against a direct double-precision softmax(Q K^T * scale) V per (sequence, head),
//              GQA (Hq=4, Hkv=2) and plain multi-head (Hq=Hkv), packed sequences of different lengths
//              including length 1, and sequences spanning several of the kernel's tiles (64 queries x 128 keys).
//   backward : dq, dk, dv against central finite differences (in double) of f = <out, r> on small shapes;
//              on the long shapes against the closed-form double gradient, itself checked against the
//              finite differences here first.
//   paged    : ops of the KV cache (store through a slot mapping, attention through block tables) give the
//              training attention's output on the same tokens, with the cache filled through scattered,
//              non-contiguous block tables, for a whole prefill and for decode tokens mid-sequence.
//   threads  : results are bitwise the same with 1 and 2 OpenMP threads, and OpenBLAS's thread count is
//              restored after each call.
// Tolerances: forward rtol 1e-5 with an absolute floor of 1e-6 x max|out| (fp32 vs double); backward rtol 1e-4
// with a floor of 1e-5 x max|grad| (the fp32 kernel accumulates over a whole sequence); paged vs training
// 1e-5 (two fp32 computations of the same softmax that sum in different orders).
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_parallel.h"
#include "kernels_testlib.h"

// The OpenMP runtime comes with the kernels library (when the build found OpenMP); this file is not compiled
// with -fopenmp, so the thread-count setter is a weak reference: NULL when no runtime is linked.
extern void omp_set_num_threads(int n) __attribute__((weak));

typedef struct {
    const int32_t *cu;
    int B, N, Hq, Hkv, D;
    double scale;
    const double *r; // weights of f = <out, r>
} Att;

// out (N, Hq, D), lse (N, Hq) from q (N, Hq, D), k, v (N, Hkv, D), all double.
static void attn_ref(double *out, double *lse, const double *q, const double *k, const double *v, const Att *a) {
    const int G = a->Hq / a->Hkv, D = a->D;
    double *s = kt_dalloc((size_t)a->N);
    for (int b = 0; b < a->B; b++) {
        const int s0 = a->cu[b], L = a->cu[b + 1] - s0;
        for (int h = 0; h < a->Hq; h++) {
            const int g = h / G;
            for (int i = 0; i < L; i++) {
                const double *qi = q + ((size_t)(s0 + i) * a->Hq + h) * D;
                double m = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    const double *kj = k + ((size_t)(s0 + j) * a->Hkv + g) * D;
                    double d = 0.0;
                    for (int e = 0; e < D; e++) d += qi[e] * kj[e];
                    s[j] = d * a->scale;
                    m = fmax(m, s[j]);
                }
                double z = 0.0;
                for (int j = 0; j <= i; j++) z += exp(s[j] - m);
                double *oi = out + ((size_t)(s0 + i) * a->Hq + h) * D;
                for (int e = 0; e < D; e++) oi[e] = 0.0;
                for (int j = 0; j <= i; j++) {
                    const double p = exp(s[j] - m) / z;
                    const double *vj = v + ((size_t)(s0 + j) * a->Hkv + g) * D;
                    for (int e = 0; e < D; e++) oi[e] += p * vj[e];
                }
                if (lse) lse[(size_t)(s0 + i) * a->Hq + h] = m + log(z);
            }
        }
    }
    free(s);
}

// Closed-form gradient of f = <out, dout> in double: P from the scores, dV_j += P_ij dO_i,
// dS_ij = P_ij (dO_i . V_j - sum_l P_il dO_i . V_l), dQ_i += scale dS_ij K_j, dK_j += scale dS_ij Q_i.
static void attn_ref_bwd(double *dq, double *dk, double *dv, const double *dout, const double *q, const double *k,
                         const double *v, const Att *a) {
    const int G = a->Hq / a->Hkv, D = a->D;
    memset(dq, 0, (size_t)a->N * a->Hq * D * sizeof(double));
    memset(dk, 0, (size_t)a->N * a->Hkv * D * sizeof(double));
    memset(dv, 0, (size_t)a->N * a->Hkv * D * sizeof(double));
    double *p = kt_dalloc((size_t)a->N), *dp = kt_dalloc((size_t)a->N);
    for (int b = 0; b < a->B; b++) {
        const int s0 = a->cu[b], L = a->cu[b + 1] - s0;
        for (int h = 0; h < a->Hq; h++) {
            const int g = h / G;
            for (int i = 0; i < L; i++) {
                const size_t qo = ((size_t)(s0 + i) * a->Hq + h) * D;
                double m = -INFINITY, z = 0.0, pdp = 0.0;
                for (int j = 0; j <= i; j++) {
                    const size_t ko = ((size_t)(s0 + j) * a->Hkv + g) * D;
                    double d = 0.0, e2 = 0.0;
                    for (int e = 0; e < D; e++) { d += q[qo + e] * k[ko + e]; e2 += dout[qo + e] * v[ko + e]; }
                    p[j] = d * a->scale;
                    dp[j] = e2;
                    m = fmax(m, p[j]);
                }
                for (int j = 0; j <= i; j++) z += exp(p[j] - m);
                for (int j = 0; j <= i; j++) { p[j] = exp(p[j] - m) / z; pdp += p[j] * dp[j]; }
                for (int j = 0; j <= i; j++) {
                    const size_t ko = ((size_t)(s0 + j) * a->Hkv + g) * D;
                    const double ds = p[j] * (dp[j] - pdp);
                    for (int e = 0; e < D; e++) {
                        dv[ko + e] += p[j] * dout[qo + e];
                        dq[qo + e] += a->scale * ds * k[ko + e];
                        dk[ko + e] += a->scale * ds * q[qo + e];
                    }
                }
            }
        }
    }
    free(p), free(dp);
}

// f = <attention(q, k, v), r> with params = [q | k | v].
static double f_attn(const double *params, void *vc) {
    const Att *a = vc;
    const size_t nq = (size_t)a->N * a->Hq * a->D, nk = (size_t)a->N * a->Hkv * a->D;
    double *out = kt_dalloc(nq);
    attn_ref(out, NULL, params, params + nq, params + nq + nk, a);
    const double f = kt_dot(out, a->r, nq);
    free(out);
    return f;
}

// One shape: forward against the reference, backward against finite differences (fd = 1) or the closed form.
static void check_attention(const char *name, const int32_t *cu, int B, int Hq, int Hkv, int D, int fd) {
    Att a = {.cu = cu, .B = B, .N = cu[B], .Hq = Hq, .Hkv = Hkv, .D = D, .scale = 1.0 / sqrt((double)D)};
    const size_t nq = (size_t)a.N * Hq * D, nk = (size_t)a.N * Hkv * D;
    float *q = kt_falloc(nq), *k = kt_falloc(nk), *v = kt_falloc(nk), *dout = kt_falloc(nq);
    kt_fill(q, nq, 2.0);
    kt_fill(k, nk, 2.0);
    kt_fill(v, nk, 1.0);
    kt_fill(dout, nq, 1.0);
    double *params = kt_dalloc(nq + 2 * nk);
    for (size_t i = 0; i < nq; i++) params[i] = q[i];
    for (size_t i = 0; i < nk; i++) { params[nq + i] = k[i]; params[nq + nk + i] = v[i]; }
    const double *qd = params, *kd = params + nq, *vd = params + nq + nk;

    double *want_out = kt_dalloc(nq), *want_lse = kt_dalloc((size_t)a.N * Hq);
    attn_ref(want_out, want_lse, qd, kd, vd, &a);
    float *out = kt_falloc(nq), *lse = kt_falloc((size_t)a.N * Hq);
    for (size_t i = 0; i < nq; i++) out[i] = NAN; // must be overwritten
    cpu_attention_fwd(out, lse, q, k, v, cu, B, a.N, Hq, Hkv, D, (float)a.scale);
    char what[160];
    snprintf(what, sizeof what, "%s: attention out", name);
    check_close(what, out, want_out, nq, 1e-5, 1e-6);
    snprintf(what, sizeof what, "%s: attention lse", name);
    check_close(what, lse, want_lse, (size_t)a.N * Hq, 1e-5, 1e-6);

    double *g = kt_dalloc(nq + 2 * nk), *r = kt_to_double(dout, nq);
    attn_ref_bwd(g, g + nq, g + nq + nk, r, qd, kd, vd, &a);
    if (fd) {
        // The closed form used for the long shapes must itself match finite differences.
        double *gfd = kt_dalloc(nq + 2 * nk);
        a.r = r;
        kt_fd_grad(f_attn, params, nq + 2 * nk, &a, gfd);
        float *gf = kt_falloc(nq + 2 * nk);
        for (size_t i = 0; i < nq + 2 * nk; i++) gf[i] = (float)g[i];
        snprintf(what, sizeof what, "%s: closed-form gradient vs finite differences", name);
        check_close(what, gf, gfd, nq + 2 * nk, 1e-6, 1e-6);
        memcpy(g, gfd, (nq + 2 * nk) * sizeof(double));
        free(gfd), free(gf);
    }
    float *dq = kt_falloc(nq), *dk = kt_falloc(nk), *dv = kt_falloc(nk);
    for (size_t i = 0; i < nq; i++) dq[i] = NAN; // overwrite semantics
    for (size_t i = 0; i < nk; i++) dk[i] = dv[i] = NAN;
    cpu_attention_bwd(dq, dk, dv, dout, q, k, v, out, lse, cu, B, a.N, Hq, Hkv, D, (float)a.scale);
    // One absolute floor for all three gradients: with a one-token sequence dq and dk are exactly zero in
    // exact arithmetic and fp32 leaves ~1e-9 there, which only makes sense against the gradients' scale.
    const double atol = 1e-5 * check_max_abs(g, nq + 2 * nk);
    snprintf(what, sizeof what, "%s: attention dq", name);
    check_close_abs(what, dq, g, nq, 1e-4, atol);
    snprintf(what, sizeof what, "%s: attention dk", name);
    check_close_abs(what, dk, g + nq, nk, 1e-4, atol);
    snprintf(what, sizeof what, "%s: attention dv", name);
    check_close_abs(what, dv, g + nq + nk, nk, 1e-4, atol);
    free(q), free(k), free(v), free(dout), free(params), free(want_out), free(want_lse), free(out), free(lse);
    free(g), free(r), free(dq), free(dk), free(dv);
}

// ---- paged KV cache -----------------------------------------------------------------------------------------

// Sequences of lengths lens[] in one packed batch; each gets a block table of physical blocks drawn at random
// (without replacement) from a pool of n_blocks, unused table entries -1. The cache is filled in two store
// calls (an early chunk, then the rest) with a padded token whose slot is -1 and whose k/v are NaN.
static void check_paged(const char *name, const int *lens, int B, int Hq, int Hkv, int D, int block_size,
                        int n_blocks) {
    int32_t cu[9] = {0};
    for (int b = 0; b < B; b++) cu[b + 1] = cu[b] + lens[b];
    const int N = cu[B];
    int max_blocks = 0;
    for (int b = 0; b < B; b++) {
        const int nb = (lens[b] + block_size - 1) / block_size;
        max_blocks = nb > max_blocks ? nb : max_blocks;
    }
    max_blocks += 1; // a spare -1 entry at the end of every table
    const float scale = 1.0f / sqrtf((float)D);
    const size_t nq = (size_t)N * Hq * D, nk = (size_t)N * Hkv * D, row = (size_t)Hkv * D;
    float *q = kt_falloc(nq), *k = kt_falloc(nk), *v = kt_falloc(nk), *out_train = kt_falloc(nq), *lse = kt_falloc((size_t)N * Hq);
    kt_fill(q, nq, 2.0);
    kt_fill(k, nk, 2.0);
    kt_fill(v, nk, 1.0);
    cpu_attention_fwd(out_train, lse, q, k, v, cu, B, N, Hq, Hkv, D, scale);

    // Scattered block tables: a random permutation of the pool.
    int32_t *perm = malloc(sizeof(int32_t) * n_blocks), *tables = malloc(sizeof(int32_t) * B * max_blocks);
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        const int j = kt_randint(0, i + 1);
        const int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int next = 0;
    for (int b = 0; b < B; b++)
        for (int lb = 0; lb < max_blocks; lb++)
            tables[b * max_blocks + lb] = lb * block_size < lens[b] ? perm[next++] : -1;
    CHECK(next <= n_blocks, "%s: pool too small for the test", name);

    // Token i -> (seq, pos, slot); plus one padding token (slot -1, NaN k/v) in the first store call.
    int32_t *seq = malloc(sizeof(int32_t) * N), *pos = malloc(sizeof(int32_t) * N), *slot = malloc(sizeof(int32_t) * (N + 1));
    for (int b = 0; b < B; b++)
        for (int p = 0; p < lens[b]; p++) {
            const int i = cu[b] + p;
            seq[i] = b, pos[i] = p;
            slot[i] = tables[b * max_blocks + p / block_size] * block_size + p % block_size;
        }
    const size_t n_slots = (size_t)n_blocks * block_size;
    float *kc = kt_falloc(n_slots * row), *vc = kt_falloc(n_slots * row);
    const int first = N / 2;
    float *k1 = kt_falloc((first + 1) * row), *v1 = kt_falloc((first + 1) * row);
    int32_t *slot1 = malloc(sizeof(int32_t) * (first + 1));
    for (int i = 0; i < first; i++) {
        memcpy(k1 + (size_t)i * row, k + (size_t)i * row, row * sizeof(float));
        memcpy(v1 + (size_t)i * row, v + (size_t)i * row, row * sizeof(float));
        slot1[i] = slot[i];
    }
    for (size_t e = 0; e < row; e++) k1[first * row + e] = v1[first * row + e] = NAN;
    slot1[first] = -1;
    cpu_kv_cache_store(kc, vc, k1, v1, slot1, first + 1, Hkv, D);
    cpu_kv_cache_store(kc, vc, k + (size_t)first * row, v + (size_t)first * row, slot + first, N - first, Hkv, D);

    // Prefill: every token of every sequence through the block tables.
    double *want = kt_to_double(out_train, nq);
    float *out = kt_falloc(nq);
    cpu_attention_paged_fwd(out, q, kc, vc, tables, seq, pos, N, Hq, Hkv, D, block_size, max_blocks, scale);
    char what[160];
    snprintf(what, sizeof what, "%s: paged prefill vs training attention", name);
    check_close(what, out, want, nq, 1e-5, 1e-5);

    // Decodes mid-sequence: one token per sequence at a position inside it, in a shuffled batch order. The
    // cache also holds the later positions, which must stay invisible.
    int32_t dseq[8], dpos[8];
    float *dq = kt_falloc((size_t)B * Hq * D), *dout = kt_falloc((size_t)B * Hq * D);
    double *dwant = kt_dalloc((size_t)B * Hq * D);
    for (int t = 0; t < B; t++) {
        const int b = B - 1 - t;
        dseq[t] = b;
        dpos[t] = lens[b] > 2 ? lens[b] / 2 + 1 : 0;
        const size_t src = ((size_t)cu[b] + dpos[t]) * Hq * D;
        memcpy(dq + (size_t)t * Hq * D, q + src, (size_t)Hq * D * sizeof(float));
        for (int e = 0; e < Hq * D; e++) dwant[(size_t)t * Hq * D + e] = out_train[src + e];
    }
    cpu_attention_paged_fwd(dout, dq, kc, vc, tables, dseq, dpos, B, Hq, Hkv, D, block_size, max_blocks, scale);
    snprintf(what, sizeof what, "%s: paged decode mid-sequence vs training attention", name);
    check_close(what, dout, dwant, (size_t)B * Hq * D, 1e-5, 1e-5);

    // A position past the block table has no cache behind it: NaN output, no out-of-bounds read.
    int32_t bad_seq = 0, bad_pos = max_blocks * block_size;
    cpu_attention_paged_fwd(dout, dq, kc, vc, tables, &bad_seq, &bad_pos, 1, Hq, Hkv, D, block_size, max_blocks, scale);
    CHECK(isnan(dout[0]) && isnan(dout[(size_t)Hq * D - 1]), "%s: position past the block table must give NaN", name);

    free(q), free(k), free(v), free(out_train), free(lse), free(perm), free(tables), free(seq), free(pos), free(slot);
    free(kc), free(vc), free(k1), free(v1), free(slot1), free(want), free(out), free(dq), free(dout), free(dwant);
}

// Work is split over (sequence, head) with one writer per output element: 1 and 2 threads must agree bit for
// bit. The OpenBLAS thread count lowered around the tiles must come back.
static void check_threads(void) {
    const int32_t cu[4] = {0, 200, 201, 330};
    const int B = 3, N = 330, Hq = 4, Hkv = 2, D = 16;
    const size_t nq = (size_t)N * Hq * D, nk = (size_t)N * Hkv * D;
    float *q = kt_falloc(nq), *k = kt_falloc(nk), *v = kt_falloc(nk), *dout = kt_falloc(nq);
    kt_fill(q, nq, 2.0), kt_fill(k, nk, 2.0), kt_fill(v, nk, 1.0), kt_fill(dout, nq, 1.0);
    float *out[2], *lse[2], *dq[2], *dk[2], *dv[2];
    const int blas_before = openblas_get_num_threads();
    for (int r = 0; r < 2; r++) {
        if (omp_set_num_threads) omp_set_num_threads(r + 1);
        out[r] = kt_falloc(nq), lse[r] = kt_falloc((size_t)N * Hq), dq[r] = kt_falloc(nq);
        dk[r] = kt_falloc(nk), dv[r] = kt_falloc(nk);
        cpu_attention_fwd(out[r], lse[r], q, k, v, cu, B, N, Hq, Hkv, D, 0.25f);
        cpu_attention_bwd(dq[r], dk[r], dv[r], dout, q, k, v, out[r], lse[r], cu, B, N, Hq, Hkv, D, 0.25f);
    }
    CHECK(memcmp(out[0], out[1], nq * sizeof(float)) == 0 && memcmp(lse[0], lse[1], (size_t)N * Hq * sizeof(float)) == 0,
          "attention forward differs between 1 and 2 threads");
    CHECK(memcmp(dq[0], dq[1], nq * sizeof(float)) == 0 && memcmp(dk[0], dk[1], nk * sizeof(float)) == 0 &&
                 memcmp(dv[0], dv[1], nk * sizeof(float)) == 0,
          "attention backward differs between 1 and 2 threads");
    CHECK(openblas_get_num_threads() == blas_before, "OpenBLAS thread count %d after attention, %d before",
          openblas_get_num_threads(), blas_before);
    for (int r = 0; r < 2; r++) free(out[r]), free(lse[r]), free(dq[r]), free(dk[r]), free(dv[r]);
    free(q), free(k), free(v), free(dout);
}

int main(void) {
    kt_seed(4242);
    check_threads();
    // Small shapes: backward against finite differences.
    const int32_t cu_gqa[4] = {0, 5, 6, 13};            // lengths 5, 1, 7
    check_attention("GQA Hq=4 Hkv=2", cu_gqa, 3, 4, 2, 8, 1);
    const int32_t cu_mha[3] = {0, 3, 9};                // lengths 3, 6; odd head size
    check_attention("MHA Hq=Hkv=3", cu_mha, 2, 3, 3, 5, 1);
    const int32_t cu_one[2] = {0, 1};                   // a lone one-token sequence: out = v, lse = score
    check_attention("single token", cu_one, 1, 2, 1, 4, 1);
    // Long shapes: several query and key tiles per sequence, lengths not multiples of the tile sizes.
    const int32_t cu_long[4] = {0, 300, 301, 431};      // lengths 300, 1, 130
    check_attention("long GQA Hq=4 Hkv=2", cu_long, 3, 4, 2, 16, 0);
    const int32_t cu_long_mha[2] = {0, 257};
    check_attention("long MHA Hq=Hkv=2", cu_long_mha, 1, 2, 2, 12, 0);

    const int lens_a[3] = {37, 1, 20};
    check_paged("paged GQA bs=8", lens_a, 3, 4, 2, 16, 8, 16);
    const int lens_b[2] = {200, 9}; // blocks larger than the kernel's 128-position chunk
    check_paged("paged MHA bs=160", lens_b, 2, 2, 2, 8, 160, 4);
    const int lens_c[4] = {16, 17, 3, 33}; // lengths at and just past block boundaries
    check_paged("paged GQA bs=16 Hq=6 Hkv=2", lens_c, 4, 6, 2, 10, 16, 12);
    return check_exit_code("test_kernels_attention");
}
