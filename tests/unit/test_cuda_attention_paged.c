// tests/unit/test_cuda_attention_paged.c — ops_attention_paged_fwd on the CUDA backend (the tensor-core kernel
// for head dims up to 128, the grouped kernel beyond) against its CPU twin (kernels/cpu/cpu_attention_paged.c).
//
// Cache: random bf16 K/V in blocks scattered over a pool by a random permutation (unused table entries -1).
// Cases, for head dims 64 and 128 and GQA groups 1, 2, 6, 7, 8 (two kv heads):
//   batch 1 with contexts 1, 15, 16, 17, 1000, 4096 in tables sized for 4096 positions (the context split over
//     blocks, most splits empty for the short ones);
//   batch 300 with the same contexts in turn (no split), three tokens without cache (no sequence, a negative
//     position, a position past the table: NaN on both sides) and a sequence with an unassigned block inside
//     its context (NaN);
//   a prefill chunk (positions 600..998 of a 1000-position sequence, causal through token_pos) beside decodes.
// Then group sizes of 12, 16 (both halves of the 16 MMA rows) and 24 (two blocks per kv head), head dims 32,
// 40, 96 (zero-padded dims), 256 (the grouped kernel), block sizes 8, 24, 32, a whole 700-token prompt, a q
// that is not 16-byte aligned, and a negative scale.
// Inputs are bf16-exact on both sides. Error measure per case: max_i |gpu_i - cpu_i| / (|cpu_i| + rms(cpu)),
// NaN matching only NaN. Tolerance 1e-2 (as test_cuda_vs_cpu's for bf16 outputs): the output is rounded to bf16
// once (<= 3.9e-3 relative); scores, softmax and sums are fp32 and P enters P V as a hi + lo bf16 pair (16
// significant bits). Measured on an H200: largest error 3.4e-3 (with P as one bf16, as the training forward
// has it, the long prefill chunks reached 1.3e-2). The largest error seen is printed last.
// Without a CUDA device the test prints "SKIP: no CUDA device" and returns 77.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "kernels_testlib.h"
#include "paged_testlib.h"
#include "ops_testlib.h"

static OpsCtx *cpu, *gpu;
static int n_cases;
static double worst_err;
static const double TOL = 1e-2;

static float urand(float lo, float hi) { return kt_uniform_in(kt_next(), lo, hi); }
static int irand(int n) { return kt_randint(0, n); }

// A storage tensor (n elements, plus `pad` before it) on both backends with the same random values.
typedef struct {
    void *c, *g;
} Pair;
static Pair pair_rand(size_t n, size_t pad, float lo, float hi) {
    const size_t es_c = ops_dtype_size(cpu), es_g = ops_dtype_size(gpu);
    Pair p = {ops_malloc(cpu, (n + pad) * es_c), ops_malloc(gpu, (n + pad) * es_g)};
    float *h = malloc((n ? n : 1) * sizeof *h);
    if (!p.c || !p.g || !h) {
        fprintf(stderr, "FATAL: allocation of %zu elements failed: %s %s\n", n, ops_error(cpu), ops_error(gpu));
        exit(1);
    }
    for (size_t i = 0; i < n; i++) h[i] = kt_round_bf16(urand(lo, hi));
    p.c = (char *)p.c + pad * es_c, p.g = (char *)p.g + pad * es_g;
    ops_upload_f32(cpu, p.c, h, n);
    ops_upload_f32(gpu, p.g, h, n);
    free(h);
    return p;
}
static Pair pair_i32(const int32_t *h, size_t n) {
    Pair p = {ops_malloc(cpu, n * 4 + 4), ops_malloc(gpu, n * 4 + 4)};
    if (!p.c || !p.g) {
        fprintf(stderr, "FATAL: allocation failed: %s %s\n", ops_error(cpu), ops_error(gpu));
        exit(1);
    }
    ops_copy_to_device(cpu, p.c, h, n * 4);
    ops_copy_to_device(gpu, p.g, h, n * 4);
    return p;
}
static void pair_free(Pair p, size_t pad) {
    ops_free(cpu, (char *)p.c - pad * ops_dtype_size(cpu));
    ops_free(gpu, (char *)p.g - pad * ops_dtype_size(gpu));
}

typedef struct {
    int chunk_from;  // >= 0: also query positions chunk_from .. ctx_len[0] - 2 of sequence 0
    int nan_tokens;  // three tokens without cache
    int hole_seq;    // >= 0: that sequence loses a block in the middle of its context
    int q_off;       // q read at this element offset (1: not 16-byte aligned)
    float scale_mul; // scale = scale_mul / sqrt(D) (0: 1)
} Opts;

// n_seqs sequences of ctx_len[s] positions, tables (n_seqs, max_blocks); every sequence's decode token at
// position ctx_len - 1, plus what `o` asks for. Compares the outputs and prints one row.
static void run_case(const char *what, int Hq, int Hkv, int D, int block_size, int max_blocks, int n_seqs,
                     const int *ctx_len, Opts o) {
    char name[128];
    snprintf(name, sizeof name, "%s D=%d %d/%d bs%d", what, D, Hq, Hkv, block_size);
    int n_blk;
    char err[160];
    int32_t *tables = kt_paged_tables(n_seqs, ctx_len, block_size, max_blocks, 3, o.hole_seq, irand, &n_blk, err,
                                      sizeof err);
    if (!tables) {
        printf("FAIL %-40s %s\n", name, err);
        failures++;
        return;
    }
    const int n_chunk = o.chunk_from >= 0 ? ctx_len[0] - 1 - o.chunk_from : 0;
    const int n_q = n_seqs + n_chunk + 3;
    int32_t *tseq = malloc((size_t)n_q * 4), *tpos = malloc((size_t)n_q * 4);
    int N = 0;
    // The chunk first (a prefill batch leads with its prompt tokens), then the decodes, then tokens without cache.
    for (int p = o.chunk_from; o.chunk_from >= 0 && p < ctx_len[0] - 1; p++) tseq[N] = 0, tpos[N++] = p;
    for (int s = 0; s < n_seqs; s++) tseq[N] = s, tpos[N++] = ctx_len[s] - 1;
    if (o.nan_tokens) {
        tseq[N] = -1, tpos[N++] = 3;
        tseq[N] = 0, tpos[N++] = -1;
        tseq[N] = 0, tpos[N++] = max_blocks * block_size;
    }
    const size_t row = (size_t)Hkv * D, n_slots = (size_t)n_blk * block_size, n_out = (size_t)N * Hq * D;
    Pair kc = pair_rand(n_slots * row, 0, -2, 2), vc = pair_rand(n_slots * row, 0, -1, 1);
    Pair q = pair_rand(n_out, (size_t)o.q_off, -2, 2), out = pair_rand(n_out, 0, 0, 0);
    Pair bt = pair_i32(tables, (size_t)n_seqs * max_blocks), ts = pair_i32(tseq, N), tp = pair_i32(tpos, N);
    const float scale = (o.scale_mul != 0.0f ? o.scale_mul : 1.0f) / sqrtf((float)D);
    ops_attention_paged_fwd(cpu, out.c, q.c, kc.c, vc.c, bt.c, ts.c, tp.c, N, Hq, Hkv, D, block_size, max_blocks,
                            scale);
    ops_attention_paged_fwd(gpu, out.g, q.g, kc.g, vc.g, bt.g, ts.g, tp.g, N, Hq, Hkv, D, block_size, max_blocks,
                            scale);
    n_cases++;
    if (kt_expect_no_errors(cpu, gpu, name)) {
        float *c = malloc(n_out * sizeof *c), *g = malloc(n_out * sizeof *g);
        ops_download_f32(cpu, c, out.c, n_out);
        ops_download_f32(gpu, g, out.g, n_out);
        double ss = 0.0;
        size_t finite = 0, n_nan = 0, nan_mismatch = 0, worst = 0;
        for (size_t i = 0; i < n_out; i++)
            if (!isnan(c[i])) ss += (double)c[i] * c[i], finite++;
        const double rms = finite ? sqrt(ss / finite) : 0.0;
        double max_abs = 0.0, max_err = 0.0;
        for (size_t i = 0; i < n_out; i++) {
            if (isnan(c[i]) || isnan(g[i])) {
                n_nan += isnan(c[i]);
                nan_mismatch += isnan(c[i]) != isnan(g[i]);
                continue;
            }
            const double d = fabs((double)g[i] - c[i]), e = d / (fabs(c[i]) + rms + 1e-30);
            if (d > max_abs) max_abs = d;
            if (e > max_err) max_err = e, worst = i;
        }
        // Every query head of a token without cache is NaN, and nothing else is.
        const size_t want_nan = (size_t)(o.nan_tokens ? 3 : 0) * Hq * D;
        const int ok = max_err <= TOL && nan_mismatch == 0 && (o.hole_seq >= 0 || n_nan == want_nan);
        if (max_err > worst_err) worst_err = max_err;
        printf("%-4s %-40s N %5d  max_abs %9.3e  err %9.3e  NaN %7zu", ok ? "ok" : "FAIL", name, N, max_abs, max_err,
               n_nan);
        if (nan_mismatch) printf("  (%zu NaN mismatches)", nan_mismatch);
        if (!ok) printf("  worst [%zu] cpu %.7g cuda %.7g", worst, c[worst], g[worst]);
        printf("\n");
        if (!ok) failures++;
        free(c), free(g);
    }
    pair_free(kc, 0), pair_free(vc, 0), pair_free(q, (size_t)o.q_off), pair_free(out, 0);
    pair_free(bt, 0), pair_free(ts, 0), pair_free(tp, 0);
    free(tables), free(tseq), free(tpos);
}

static const Opts PLAIN = {-1, 0, -1, 0, 0.0f};

int main(void) {
    kt_seed(0x243F6A8885A308D3ull);
    const int opened = kt_open_cpu_gpu(&cpu, &gpu);
    if (opened) return opened;
    enum { N_CTX = 6, BATCH = 300, BS = 16, MAXB = 4096 / BS };
    const int ctxs[N_CTX] = {1, 15, 16, 17, 1000, 4096}, groups[5] = {1, 2, 6, 7, 8}, dims[2] = {64, 128};
    int *lens = malloc(BATCH * sizeof *lens);
    for (int di = 0; di < 2; di++)
        for (int gi = 0; gi < 5; gi++) {
            const int D = dims[di], Hkv = 2, Hq = groups[gi] * Hkv;
            char what[48];
            for (int c = 0; c < N_CTX; c++) {
                snprintf(what, sizeof what, "batch 1 ctx %d", ctxs[c]);
                run_case(what, Hq, Hkv, D, BS, MAXB, 1, &ctxs[c], PLAIN);
            }
            for (int s = 0; s < BATCH; s++) lens[s] = ctxs[s % N_CTX];
            lens[7] = 1000;  // the hole (block 31 of 63) lies inside its context
            run_case("batch 300", Hq, Hkv, D, BS, MAXB, BATCH, lens, (Opts){-1, 1, 7, 0, 0.0f});
            const int mixed[6] = {1000, 1, 17, 300, 64, 2049};
            run_case("chunk 600.. + decodes", Hq, Hkv, D, BS, MAXB, 6, mixed, (Opts){600, 1, -1, 0, 0.0f});
        }
    // Other shapes. Contexts past a few tiles, short ones, and one exactly on a tile boundary.
    const int some[7] = {700, 1, 64, 65, 129, 1500, 33};
    run_case("prompt 0..698", 14, 2, 64, BS, 64, 1, some, (Opts){0, 0, -1, 0, 0.0f});
    run_case("prompt 0..698", 12, 2, 128, 32, 32, 1, some, (Opts){0, 0, -1, 0, 0.0f});
    run_case("g12", 12, 1, 128, BS, 128, 7, some, (Opts){-1, 1, 5, 0, 0.0f});
    run_case("g16", 16, 1, 64, 8, 256, 7, some, (Opts){300, 1, -1, 0, 0.0f});
    run_case("g24", 48, 2, 64, BS, 128, 7, some, (Opts){-1, 1, 3, 0, 0.0f});
    run_case("g3 d96", 6, 2, 96, 24, 70, 7, some, (Opts){-1, 1, -1, 0, 0.0f});
    run_case("g5 d40", 5, 1, 40, 32, 50, 7, some, (Opts){200, 1, -1, 0, 0.0f});
    run_case("g4 d32", 8, 2, 32, BS, 128, 7, some, (Opts){-1, 1, -1, 0, 0.0f});
    run_case("g2 d256", 4, 2, 256, BS, 128, 7, some, (Opts){-1, 1, 2, 0, 0.0f});
    run_case("q+1", 14, 2, 64, BS, 128, 7, some, (Opts){-1, 1, -1, 1, 0.0f});
    run_case("q+1", 12, 2, 128, BS, 128, 7, some, (Opts){650, 0, -1, 1, 0.0f});
    run_case("scale -0.7", 14, 2, 64, BS, 128, 7, some, (Opts){-1, 0, -1, 0, -0.7f});
    run_case("scale 3", 12, 2, 128, BS, 128, 7, some, (Opts){-1, 0, -1, 0, 3.0f});
    free(lens);
    ops_destroy(cpu);
    ops_destroy(gpu);
    printf("%d cases, largest scaled error %.3e (tolerance %.0e)\n", n_cases, worst_err, TOL);
    return check_exit_code("test_cuda_attention_paged");
}
