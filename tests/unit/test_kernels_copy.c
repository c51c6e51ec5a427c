// tests/unit/test_kernels_copy.c — ops_copy_2d on the CPU backend (its CUDA twin is compared against this one in
// test_cuda_vs_cpu.c).
//   1. Blocks of assorted shapes (one row, one column, pitch == cols, wide pitches on either side, offset views)
//      land exactly where a direct row-by-row loop in the test puts them, and nothing outside the block changes.
//   2. The model's use: a fused (N, QD + 2 KVD) projection split into contiguous q, k, v and packed back gives the
//      original bits.
//   3. rows or cols 0 is a no-op; cols above a pitch or a NULL buffer records an error that names the shape.
#include "kernels/ops.h"
#include "kernels_testlib.h"

// Copies (rows, cols) from src (pitch sp) to dst (pitch dp) through the op and checks the whole dst buffer
// (n_dst elements) against the expected result: dst's old values outside the block, src's inside it.
static void check_block(OpsCtx *ctx, size_t rows, size_t cols, size_t dp, size_t sp, size_t doff, size_t soff) {
    const size_t n_dst = doff + (rows - 1) * dp + cols + 5, n_src = soff + (rows - 1) * sp + cols + 5;
    float *dst = kt_falloc(n_dst), *src = kt_falloc(n_src), *want = kt_falloc(n_dst);
    kt_fill(dst, n_dst, 3.0);
    kt_fill(src, n_src, 3.0);
    memcpy(want, dst, n_dst * sizeof(float));
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++) want[doff + r * dp + c] = src[soff + r * sp + c];
    ops_copy_2d(ctx, dst + doff, dp, src + soff, sp, rows, cols);
    CHECK(ops_status(ctx) == 0, "copy_2d %zux%zu pitches %zu/%zu: unexpected error \"%s\"", rows, cols, dp, sp,
          ops_error(ctx));
    size_t bad = 0;
    for (size_t i = 0; i < n_dst; i++) bad += memcmp(&dst[i], &want[i], sizeof(float)) != 0;
    CHECK(bad == 0, "copy_2d %zux%zu pitches dst %zu src %zu (offsets %zu/%zu): %zu elements differ", rows, cols,
          dp, sp, doff, soff, bad);
    free(dst);
    free(src);
    free(want);
}

static void test_blocks(OpsCtx *ctx) {
    check_block(ctx, 1, 1, 1, 1, 0, 0);
    check_block(ctx, 1, 37, 37, 37, 0, 0);
    check_block(ctx, 29, 1, 3, 7, 1, 2);
    check_block(ctx, 17, 24, 24, 24, 0, 0);    // contiguous: one run of memory
    check_block(ctx, 17, 24, 40, 24, 3, 0);    // packing into a wider row
    check_block(ctx, 17, 24, 24, 56, 0, 5);    // extracting from a wider row
    check_block(ctx, 13, 11, 19, 23, 7, 9);    // both strided, odd sizes, misaligned starts
}

// The fused projection's round trip: split [q | k | v] rows into contiguous buffers and pack them back.
static void test_split_pack(OpsCtx *ctx) {
    enum { N = 9, QD = 24, KVD = 8, QKV = QD + 2 * KVD };
    float qkv[N * QKV], back[N * QKV], q[N * QD], k[N * KVD], v[N * KVD];
    kt_fill(qkv, N * QKV, 2.0);
    kt_fill(back, N * QKV, 2.0);
    ops_copy_2d(ctx, q, QD, qkv, QKV, N, QD);
    ops_copy_2d(ctx, k, KVD, qkv + QD, QKV, N, KVD);
    ops_copy_2d(ctx, v, KVD, qkv + QD + KVD, QKV, N, KVD);
    int bad = 0;
    for (int n = 0; n < N; n++) {
        for (int i = 0; i < QD; i++) bad += q[n * QD + i] != qkv[n * QKV + i];
        for (int i = 0; i < KVD; i++) bad += k[n * KVD + i] != qkv[n * QKV + QD + i];
        for (int i = 0; i < KVD; i++) bad += v[n * KVD + i] != qkv[n * QKV + QD + KVD + i];
    }
    CHECK(bad == 0, "split of the fused projection: %d elements misplaced", bad);
    ops_copy_2d(ctx, back, QKV, q, QD, N, QD);
    ops_copy_2d(ctx, back + QD, QKV, k, KVD, N, KVD);
    ops_copy_2d(ctx, back + QD + KVD, QKV, v, KVD, N, KVD);
    CHECK(memcmp(back, qkv, sizeof qkv) == 0, "packing q, k, v back must rebuild the fused rows bit for bit");
    CHECK(ops_status(ctx) == 0, "split/pack: unexpected error \"%s\"", ops_error(ctx));
}

static void test_errors(OpsCtx *ctx) {
    float a[16], b[16];
    kt_fill(a, 16, 1.0);
    memcpy(b, a, sizeof a);
    float c[16];
    kt_fill(c, 16, 1.0);
    ops_copy_2d(ctx, a, 4, c, 4, 0, 4);
    ops_copy_2d(ctx, a, 4, c, 4, 4, 0);
    CHECK(ops_status(ctx) == 0 && memcmp(a, b, sizeof a) == 0, "rows or cols 0 must be a no-op");
    ops_copy_2d(ctx, a, 4, c, 3, 2, 4);
    CHECK(ops_status(ctx) < 0 && strstr(ops_error(ctx), "4 elements") && strstr(ops_error(ctx), "src 3"),
          "cols above the source pitch must be refused with the shape named: \"%s\"", ops_error(ctx));
    CHECK(memcmp(a, b, sizeof a) == 0, "a refused copy must not write");
    ops_clear_error(ctx);
    ops_copy_2d(ctx, a, 3, c, 4, 2, 4);
    CHECK(ops_status(ctx) < 0 && strstr(ops_error(ctx), "dst 3"),
          "cols above the destination pitch must be refused: \"%s\"", ops_error(ctx));
    ops_clear_error(ctx);
    ops_copy_2d(ctx, NULL, 4, c, 4, 2, 4);
    CHECK(ops_status(ctx) < 0 && strstr(ops_error(ctx), "NULL"), "a NULL buffer must be refused: \"%s\"",
          ops_error(ctx));
    ops_clear_error(ctx);
}

int main(void) {
    kt_seed(77);
    OpsCtx *ctx = NULL;
    char err[256];
    REQUIRE(ops_create(&ctx, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "cpu context: %s", err);
    test_blocks(ctx);
    test_split_pack(ctx);
    test_errors(ctx);
    ops_destroy(ctx);
    return check_exit_code("test_kernels_copy");
}
