// tests/unit/test_kernels_matmul_invariant.c — cpu_matmul_fwd_batch_invariant (kernels/cpu/
// cpu_matmul_batch_invariant.c), the rollout server's Linear forward:
//   - it is the product: against a double-precision reference, with and without bias, over shapes that leave
//     remainders everywhere (rows not a multiple of the 3-row tile, columns not a multiple of 4 or 8, inner sizes
//     below 8, not a multiple of 8, over one and several 512-wide k blocks, zero);
//   - every row is the same bits computed alone, in any slice of the rows at any offset, and under 1, 2 or 3
//     OpenMP threads;
//   - where the target has FMA, every output equals the order the file documents, replayed here one scalar
//     fused multiply-add at a time (so the comment and the code cannot drift apart).
#include "kernels/cpu/cpu_ops.h"
#include "kernels_testlib.h"

extern void omp_set_num_threads(int num_threads) __attribute__((weak));

#define RTOL 1e-5
#define ATOL 1e-6

typedef struct {
    int N, IC, OC;
} Shape;

static const Shape SHAPES[] = {
    {1, 1, 1}, {1, 7, 3}, {2, 8, 9}, {5, 29, 17}, {13, 300, 37}, {50, 1032, 70}, {97, 64, 130}, {7, 777, 11},
    {301, 520, 203},   // enough work for the product to be split across threads
};

static void reference(double *want, const float *in, const float *w, const float *bias, int N, int IC, int OC) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int k = 0; k < IC; k++) s += (double)in[(size_t)n * IC + k] * w[(size_t)o * IC + k];
            want[(size_t)n * OC + o] = s;
        }
}

#if defined(__FMA__)
// The documented order for one output: k blocks of 512; in a block 8 lanes of fused multiply-adds in increasing k,
// the lanes summed ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), the block's last K % 8 products fused in one
// by one; the blocks' sums in order; the bias last.
static float documented_order(const float *a, const float *b, const float *bias, int K) {
    float total = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 512) {
        const int k1 = K - k0 < 512 ? K : k0 + 512;
        float lane[8] = {0};
        int k = k0;
        for (; k + 8 <= k1; k += 8)
            for (int j = 0; j < 8; j++) lane[j] = fmaf(a[k + j], b[k + j], lane[j]);
        float x = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
        for (; k < k1; k++) x = fmaf(a[k], b[k], x);
        total = k0 == 0 ? x : total + x;
    }
    return bias ? total + *bias : total;
}
#endif

static void test_shape(const Shape *s, int with_bias) {
    const int N = s->N, IC = s->IC, OC = s->OC;
    float *in = kt_falloc((size_t)N * IC), *w = kt_falloc((size_t)OC * IC), *bias = kt_falloc(OC);
    float *out = kt_falloc((size_t)N * OC), *part = kt_falloc((size_t)N * OC);
    double *want = kt_dalloc((size_t)N * OC);
    kt_fill(in, (size_t)N * IC, 1.0);
    kt_fill(w, (size_t)OC * IC, 1.0);
    kt_fill(bias, OC, 1.0);
    const float *b = with_bias ? bias : NULL;
    char name[96];
    snprintf(name, sizeof name, "matmul %d x %d x %d%s", N, IC, OC, with_bias ? " (bias)" : "");

    for (size_t i = 0; i < (size_t)N * OC; i++) out[i] = NAN; // overwrite semantics: old contents ignored
    cpu_matmul_fwd_batch_invariant(out, in, w, b, N, IC, OC);
    reference(want, in, w, b, N, IC, OC);
    check_close(name, out, want, (size_t)N * OC, RTOL, ATOL);

    // Slices of every length at several offsets, and every row alone: the same bits.
    int mismatched_slices = 0;
    for (int len = 1; len <= N; len += len < 8 ? 1 : len)
        for (int at = 0; at + len <= N; at += (len > 3 ? len : 1) * (N > 100 ? 7 : 1)) {
            cpu_matmul_fwd_batch_invariant(part, in + (size_t)at * IC, w, b, len, IC, OC);
            mismatched_slices += memcmp(part, out + (size_t)at * OC, (size_t)len * OC * sizeof *part) != 0;
        }
    CHECK(mismatched_slices == 0, "%s: %d slices of the rows differ from the whole", name, mismatched_slices);
    if (omp_set_num_threads)
        for (int t = 1; t <= 3; t++) {
            omp_set_num_threads(t);
            cpu_matmul_fwd_batch_invariant(part, in, w, b, N, IC, OC);
            CHECK(memcmp(part, out, (size_t)N * OC * sizeof *part) == 0, "%s: %d OpenMP threads change the bits",
                  name, t);
        }
#if defined(__FMA__)
    int off_order = 0;
    for (int n = 0; n < N; n += N > 100 ? 10 : 1) // every row of the small shapes, every tenth of the big one
        for (int o = 0; o < OC; o++) {
            const float x = documented_order(in + (size_t)n * IC, w + (size_t)o * IC, b ? b + o : NULL, IC);
            off_order += memcmp(&x, out + (size_t)n * OC + o, sizeof x) != 0;
        }
    CHECK(off_order == 0, "%s: %d outputs are not summed in the documented order", name, off_order);
#endif
    free(in), free(w), free(bias), free(out), free(part), free(want);
}

// IC = 0: out is the bias, or zero.
static void test_empty_inner(void) {
    float bias[3] = {1.5f, -2.0f, 0.25f}, out[6];
    for (int i = 0; i < 6; i++) out[i] = NAN;
    cpu_matmul_fwd_batch_invariant(out, NULL, NULL, bias, 2, 0, 3);
    CHECK(memcmp(out, bias, sizeof bias) == 0 && memcmp(out + 3, bias, sizeof bias) == 0, "IC = 0 with bias");
    cpu_matmul_fwd_batch_invariant(out, NULL, NULL, NULL, 2, 0, 3);
    int zeros = 0;
    for (int i = 0; i < 6; i++) zeros += out[i] == 0.0f;
    CHECK(zeros == 6, "IC = 0 without bias: zeros");
}

int main(void) {
    kt_seed(22);
    for (size_t i = 0; i < sizeof SHAPES / sizeof *SHAPES; i++)
        for (int with_bias = 0; with_bias < 2; with_bias++) test_shape(&SHAPES[i], with_bias);
    test_empty_inner();
    if (omp_set_num_threads) omp_set_num_threads(1);
    return check_exit_code("test_kernels_matmul_invariant");
}
