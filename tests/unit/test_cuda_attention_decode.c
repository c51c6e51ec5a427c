// tests/unit/test_cuda_attention_decode.c — ops_attention_paged_decode_fwd (a decode step's q/k/v split, RoPE,
// KV cache store and paged attention as one op) on the CUDA backend, where the tensor-core attention kernel does
// all of it in one launch, against
//   (a) the same backend's two ops it stands for (ops_qkv_rope_store_fwd, then ops_attention_paged_fwd on copies
//       of the caches): the outputs and both caches must be equal bit for bit;
//   (b) the CPU twin (the same two ops on the CPU backend): outputs and caches within 1e-2 of max_i |gpu - cpu| /
//       (|cpu| + rms(cpu)) — the bf16 rounding of q, k, v and of the output (test_cuda_attention_paged's measure).
// Each case: n_seqs sequences whose decode token sits at the last position of its context (its slot the one its
// block table gives), plus what a padded decode step adds: padding rows (position 0 of a table row of their own,
// slot -1: no store, the cache read as it is), a token with a slot but no sequence (stores, NaN output), and a
// sequence with an unassigned block inside its context (stores, NaN output). Head dims 64 and 128 with the
// Qwen2.5 groups (7 and 6 query heads per kv head), batch 1 (the context split over many blocks, contexts 1 ..
// 4096), batch 300 (no split), groups 1, 16, 24 (two blocks per kv head, both storing the same row), head dims
// 32 and 96 (padded to the kernel's 128), block sizes 8, 24, 32, and head dim 40 (not a multiple of 16: the CUDA
// op runs the two ops itself). Without a CUDA device it prints "SKIP: no CUDA device" and returns 77.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "kernels_testlib.h"
#include "ops_testlib.h"
#include "paged_testlib.h"

static OpsCtx *cpu, *gpu;
static int n_cases;
static double worst_err;
static const double TOL = 1e-2;

static float urand(float lo, float hi) { return kt_uniform_in(kt_next(), lo, hi); }
static int irand(int n) { return kt_randint(0, n); }

// Positions where the bits differ (NaN equals NaN).
static size_t bit_mismatches(const float *a, const float *b, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (!(isnan(a[i]) && isnan(b[i])) && memcmp(&a[i], &b[i], sizeof a[i]) != 0) bad++;
    return bad;
}

// The scaled error against the CPU (NaN must meet NaN); *nan_bad counts NaN mismatches.
static double scaled_err(const float *g, const float *c, size_t n, size_t *nan_bad) {
    double ss = 0.0, worst = 0.0;
    size_t finite = 0;
    for (size_t i = 0; i < n; i++)
        if (!isnan(c[i])) ss += (double)c[i] * c[i], finite++;
    const double rms = finite ? sqrt(ss / finite) : 0.0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(c[i]) || isnan(g[i])) {
            *nan_bad += isnan(c[i]) != isnan(g[i]);
            continue;
        }
        const double e = fabs((double)g[i] - c[i]) / (fabs(c[i]) + rms + 1e-30);
        if (e > worst) worst = e;
    }
    return worst;
}

static void run_case(const char *what, int Hq, int Hkv, int D, int block_size, int max_blocks, int n_seqs,
                     const int *ctx_len, int hole_seq, int n_pad) {
    char name[128];
    snprintf(name, sizeof name, "%s D=%d %d/%d bs%d", what, D, Hq, Hkv, block_size);
    int n_blk;
    char err[160];
    int32_t *seq_tables = kt_paged_tables(n_seqs, ctx_len, block_size, max_blocks, 3, hole_seq, irand, &n_blk, err,
                                          sizeof err);
    if (!seq_tables) {
        printf("FAIL %-44s %s\n", name, err);
        failures++;
        return;
    }
    // A block no sequence uses: slot 1 of it takes the token without a sequence, and the padding rows' table row
    // points at it (the server's points at block 0; here no real token's store can race with their read of slot 0).
    char *used = calloc((size_t)n_blk, 1);
    for (size_t e = 0; e < (size_t)n_seqs * max_blocks; e++)
        if (seq_tables[e] >= 0) used[seq_tables[e]] = 1;
    int spare = 0;
    while (spare < n_blk - 1 && used[spare]) spare++;
    int32_t *tables = malloc((size_t)(n_seqs + 1) * max_blocks * 4);
    memcpy(tables, seq_tables, (size_t)n_seqs * max_blocks * 4);
    for (int b = 0; b < max_blocks; b++) tables[(size_t)n_seqs * max_blocks + b] = spare;

    const int N = n_seqs + 1 + n_pad;
    int32_t *tseq = malloc((size_t)N * 4), *tpos = malloc((size_t)N * 4), *slots = malloc((size_t)N * 4);
    int n = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int pos = ctx_len[s] - 1, blk = seq_tables[(size_t)s * max_blocks + pos / block_size];
        tseq[n] = s, tpos[n] = pos;
        // The hole sequence's last block is assigned (the hole lies inside the context), so it has a slot too.
        slots[n++] = blk * block_size + pos % block_size;
    }
    tseq[n] = -1, tpos[n] = 3, slots[n++] = spare * block_size + 1;  // no sequence: stores, NaN out
    for (int k = 0; k < n_pad; k++) tseq[n] = n_seqs, tpos[n] = 0, slots[n++] = -1;

    const size_t QKV = (size_t)(Hq + 2 * Hkv) * D, row = (size_t)Hkv * D, n_slots = (size_t)n_blk * block_size;
    const size_t n_out = (size_t)N * Hq * D, n_cache = n_slots * row;
    float *h_qkv = malloc((size_t)N * QKV * sizeof(float)), *h_k = malloc(n_cache * sizeof(float));
    float *h_v = malloc(n_cache * sizeof(float)), *inv_freq = malloc((size_t)(D / 2 + 1) * sizeof(float));
    for (size_t i = 0; i < (size_t)N * QKV; i++) h_qkv[i] = kt_round_bf16(urand(-2, 2));
    for (size_t i = 0; i < n_cache; i++) h_k[i] = kt_round_bf16(urand(-2, 2)), h_v[i] = kt_round_bf16(urand(-1, 1));
    for (int j = 0; j < D / 2; j++) inv_freq[j] = (float)pow(1000000.0, -2.0 * j / D);
    const float scale = 1.0f / sqrtf((float)D);

    // CPU twin; CUDA fused; CUDA as the two ops on copies of the caches.
    void *c_qkv = kt_upload(cpu, h_qkv, (size_t)N * QKV), *c_k = kt_upload(cpu, h_k, n_cache);
    void *c_v = kt_upload(cpu, h_v, n_cache);
    void *c_q = kt_upload(cpu, h_qkv, n_out), *c_out = kt_upload(cpu, h_qkv, n_out);
    void *g_qkv = kt_upload(gpu, h_qkv, (size_t)N * QKV), *g_k = kt_upload(gpu, h_k, n_cache);
    void *g_v = kt_upload(gpu, h_v, n_cache);
    void *g_q = kt_upload(gpu, h_qkv, n_out), *g_out = kt_upload(gpu, h_qkv, n_out);
    void *u_k = kt_upload(gpu, h_k, n_cache), *u_v = kt_upload(gpu, h_v, n_cache);
    void *u_q = kt_upload(gpu, h_qkv, n_out), *u_out = kt_upload(gpu, h_qkv, n_out);
    void *c_bt = kt_upload_words(cpu, tables, (size_t)(n_seqs + 1) * max_blocks), *c_ts = kt_upload_words(cpu, tseq, N);
    void *c_tp = kt_upload_words(cpu, tpos, N), *c_sl = kt_upload_words(cpu, slots, N);
    void *g_bt = kt_upload_words(gpu, tables, (size_t)(n_seqs + 1) * max_blocks), *g_ts = kt_upload_words(gpu, tseq, N);
    void *g_tp = kt_upload_words(gpu, tpos, N), *g_sl = kt_upload_words(gpu, slots, N);
    float *c_if = kt_upload_words(cpu, (const int32_t *)inv_freq, (size_t)D / 2);
    float *g_if = kt_upload_words(gpu, (const int32_t *)inv_freq, (size_t)D / 2);

    ops_attention_paged_decode_fwd(cpu, c_out, c_q, c_k, c_v, c_sl, c_qkv, c_bt, c_ts, c_tp, c_if, N, Hq, Hkv, D,
                                   block_size, max_blocks, scale);
    ops_attention_paged_decode_fwd(gpu, g_out, g_q, g_k, g_v, g_sl, g_qkv, g_bt, g_ts, g_tp, g_if, N, Hq, Hkv, D,
                                   block_size, max_blocks, scale);
    ops_qkv_rope_store_fwd(gpu, u_q, u_k, u_v, g_sl, g_qkv, g_tp, g_if, N, Hq, Hkv, D);
    ops_attention_paged_fwd(gpu, u_out, u_q, u_k, u_v, g_bt, g_ts, g_tp, N, Hq, Hkv, D, block_size, max_blocks, scale);
    n_cases++;
    if (kt_expect_no_errors(cpu, gpu, name)) {
        float *co = kt_download(cpu, c_out, n_out), *go = kt_download(gpu, g_out, n_out);
        float *uo = kt_download(gpu, u_out, n_out);
        float *ck = kt_download(cpu, c_k, n_cache), *gk = kt_download(gpu, g_k, n_cache);
        float *uk = kt_download(gpu, u_k, n_cache);
        float *cv = kt_download(cpu, c_v, n_cache), *gv = kt_download(gpu, g_v, n_cache);
        float *uv = kt_download(gpu, u_v, n_cache);
        const size_t bits = bit_mismatches(go, uo, n_out) + bit_mismatches(gk, uk, n_cache) +
                            bit_mismatches(gv, uv, n_cache);
        size_t nan_bad = 0;
        double e = scaled_err(go, co, n_out, &nan_bad);
        const double ek = scaled_err(gk, ck, n_cache, &nan_bad), ev = scaled_err(gv, cv, n_cache, &nan_bad);
        if (ek > e) e = ek;
        if (ev > e) e = ev;
        // NaN rows: the token without a sequence, and the hole sequence's token.
        size_t n_nan = 0;
        for (size_t i = 0; i < n_out; i++) n_nan += isnan(go[i]) != 0;
        const size_t want_nan = (size_t)(1 + (hole_seq >= 0)) * Hq * D;
        const int ok = bits == 0 && e <= TOL && nan_bad == 0 && n_nan == want_nan;
        if (e > worst_err) worst_err = e;
        printf("%-4s %-44s N %4d  vs two ops: %zu bits differ  vs CPU: err %9.3e  NaN %zu/%zu\n", ok ? "ok" : "FAIL",
               name, N, bits, e, n_nan, want_nan);
        if (!ok) failures++;
        free(co), free(go), free(uo), free(ck), free(gk), free(uk), free(cv), free(gv), free(uv);
    }
    void *cbufs[] = {c_qkv, c_k, c_v, c_q, c_out, c_bt, c_ts, c_tp, c_sl, c_if};
    void *gbufs[] = {g_qkv, g_k, g_v, g_q, g_out, u_k, u_v, u_q, u_out, g_bt, g_ts, g_tp, g_sl, g_if};
    for (size_t i = 0; i < sizeof cbufs / sizeof *cbufs; i++) ops_free(cpu, cbufs[i]);
    for (size_t i = 0; i < sizeof gbufs / sizeof *gbufs; i++) ops_free(gpu, gbufs[i]);
    free(h_qkv), free(h_k), free(h_v), free(inv_freq), free(tables), free(seq_tables), free(used);
    free(tseq), free(tpos), free(slots);
}

int main(void) {
    kt_seed(0x13198A2E03707344ull);
    const int opened = kt_open_cpu_gpu(&cpu, &gpu);
    if (opened) return opened;
    enum { N_CTX = 7, BATCH = 300, BS = 16, MAXB = 4096 / BS };
    const int ctxs[N_CTX] = {1, 17, 64, 65, 129, 1000, 4096}, groups[2] = {7, 6}, dims[2] = {64, 128};
    int *lens = malloc(BATCH * sizeof *lens);
    for (int di = 0; di < 2; di++) {
        const int D = dims[di], Hkv = 2, Hq = groups[di] * Hkv;
        char what[48];
        for (int c = 0; c < N_CTX; c++) {
            snprintf(what, sizeof what, "batch 1 ctx %d", ctxs[c]);
            run_case(what, Hq, Hkv, D, BS, MAXB, 1, &ctxs[c], -1, 2);
        }
        for (int s = 0; s < BATCH; s++) lens[s] = ctxs[s % N_CTX];
        lens[5] = 1000;  // the hole (block 31 of 63) lies inside its context
        run_case("batch 300", Hq, Hkv, D, BS, MAXB, BATCH, lens, 5, 20);
    }
    const int some[7] = {700, 1, 64, 65, 129, 1500, 33};
    run_case("g1", 2, 2, 64, BS, 128, 7, some, 3, 3);
    run_case("g16", 16, 1, 128, 8, 256, 7, some, -1, 1);
    run_case("g24", 48, 2, 64, BS, 128, 7, some, 2, 4);
    run_case("g3 d96", 6, 2, 96, 24, 70, 7, some, -1, 2);
    run_case("g4 d32", 8, 2, 32, 32, 50, 7, some, 4, 2);
    run_case("g5 d40 (two ops)", 5, 1, 40, BS, 128, 7, some, -1, 2);
    free(lens);
    ops_destroy(cpu);
    ops_destroy(gpu);
    printf("%d cases, largest scaled error %.3e (tolerance %.0e)\n", n_cases, worst_err, TOL);
    if (failures) {
        printf("FAIL: %d case(s) differ\n", failures);
        return 1;
    }
    printf("PASS: the fused decode attention equals the two ops on CUDA bit for bit and the CPU twin within "
           "tolerance\n");
    return 0;
}
