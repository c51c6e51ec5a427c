// bench_server_steps — the CPU rollout server's steps alone, as rollout_server/engine.c runs them on the CPU backend
// (model_decode_step, unpadded, then the sampling op): one prefill step of B prompts of P tokens each (their last
// tokens' logits), then D decode steps of the B sequences (one token each). No HTTP, scheduling or engine thread.
//   bench_server_steps MODEL_DIR [--batches 1,8,64,512] [--prompt 32] [--decode 16] [--repeat 5]
// MODEL_DIR needs only config.json (random weights). Each batch size runs --repeat times; the best run counts (the
// development box is shared). One JSON line per batch size: {"batch", "prompt", "prefill_ms", "prefill_tokens_per_s",
// "decode_step_ms", "decode_tokens_per_s"}. Threads: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, as the server.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "kernels/ops.h"
#include "shared/model.h"

enum { BLOCK = 16, MAX_BATCHES = 16 };

typedef struct {
    int32_t *tok, *seq, *pos, *slot, *rows, *tables;
    OpsSampleParams *params;
    int32_t *off, *sampled;
    float *lp;
} StepArrays;

// One run: the prefill step and the decode steps of B sequences. Returns 0 (times in *prefill_s, *decode_s: the
// prefill step, the mean decode step) or 1 with a message.
static int run_once(Model *m, UnitSource *src, int B, int P, int D, double *prefill_s, double *decode_s) {
    OpsCtx *o = m->ops;
    const int V = m->cfg.vocab_size, max_blocks = (P + D + BLOCK - 1) / BLOCK, N = B * P;
    char err[1024];
    KVCache kv;
    DecodeBufs *bufs = NULL;
    if (kv_cache_create(&kv, m, B * max_blocks, BLOCK, err, sizeof err) != 0) {
        fprintf(stderr, "bench_server_steps: batch %d: %s\n", B, err);
        return 1;
    }
    if (decode_bufs_create(&bufs, m, N, B, max_blocks, B, err, sizeof err) != 0) {
        fprintf(stderr, "bench_server_steps: batch %d: %s\n", B, err);
        kv_cache_free(&kv, m);
        return 1;
    }
    StepArrays a = {.tok = malloc((size_t)N * 4), .seq = malloc((size_t)N * 4), .pos = malloc((size_t)N * 4),
                    .slot = malloc((size_t)N * 4), .rows = malloc((size_t)B * 4),
                    .tables = malloc((size_t)B * max_blocks * 4), .params = calloc((size_t)B, sizeof *a.params),
                    .off = calloc((size_t)B + 1, 4), .sampled = malloc((size_t)B * 4), .lp = malloc((size_t)B * 4)};
    int rc = 1;
    if (!a.tok || !a.seq || !a.pos || !a.slot || !a.rows || !a.tables || !a.params || !a.off || !a.sampled || !a.lp) {
        fprintf(stderr, "bench_server_steps: batch %d: out of memory\n", B);
        goto out;
    }
    for (int b = 0; b < B; b++) {
        for (int j = 0; j < max_blocks; j++) a.tables[b * max_blocks + j] = b * max_blocks + j;
        for (int i = 0; i < P; i++) {
            const int n = b * P + i;
            a.tok[n] = (int32_t)((b * 7919 + i * 104729 + 13) % V);
            a.seq[n] = b;
            a.pos[n] = i;
            a.slot[n] = a.tables[b * max_blocks + i / BLOCK] * BLOCK + i % BLOCK;
        }
        a.rows[b] = b * P + P - 1;
        a.params[b] = (OpsSampleParams){.u = 0.5, .temperature = 1.0f, .top_p = 1.0f, .repetition_penalty = 1.0f,
                                        .logits_row = b};
    }
    // The prefill step, then the decode steps: each sequence fed its own sampled token.
    for (int it = 0; it <= D; it++) {
        const double t0 = bench_now_s();
        const int n = it == 0 ? N : B;
        if (model_decode_step(m, bufs, src, &kv, n, a.tok, a.seq, a.pos, a.slot, a.tables, B, max_blocks,
                              it == 0 ? a.rows : a.seq, B, NULL, err, sizeof err) != 0) {
            fprintf(stderr, "bench_server_steps: batch %d step %d: %s\n", B, it, err);
            goto out;
        }
        ops_sample_rows(o, a.sampled, a.lp, decode_bufs_logits(bufs), a.params, NULL, a.off, B, B, V, 0);
        if (ops_status(o)) {
            fprintf(stderr, "bench_server_steps: batch %d step %d: %s\n", B, it, ops_error(o));
            goto out;
        }
        const double dt = bench_now_s() - t0;
        if (it == 0) *prefill_s = dt, *decode_s = 0.0;
        else *decode_s += dt / D;
        for (int b = 0; b < B; b++) {   // the next step: token b is sequence b's, at its next position
            a.tok[b] = a.sampled[b];
            a.seq[b] = b;
            a.pos[b] = P + it;
            a.slot[b] = a.tables[b * max_blocks + a.pos[b] / BLOCK] * BLOCK + a.pos[b] % BLOCK;
        }
    }
    rc = 0;
out:
    free(a.tok), free(a.seq), free(a.pos), free(a.slot), free(a.rows), free(a.tables), free(a.params), free(a.off);
    free(a.sampled), free(a.lp);
    decode_bufs_free(bufs, m);
    kv_cache_free(&kv, m);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fprintf(stderr, "usage: bench_server_steps MODEL_DIR [--batches 1,8,64,512] [--prompt 32] [--decode 16] "
                        "[--repeat 5]\n");
        return argc < 2 ? 2 : 0;
    }
    int batches[MAX_BATCHES] = {1, 8, 64, 512}, n_batches = 4, prompt = 32, decode = 16, repeat = 5;
    for (int i = 2; i < argc; i++) {
        const int has = i + 1 < argc;
        if (!strcmp(argv[i], "--batches") && has) {
            n_batches = bench_parse_list(argv[++i], batches, MAX_BATCHES);
            if (n_batches < 1) { fprintf(stderr, "bench_server_steps: bad --batches %s\n", argv[i]); return 2; }
        } else if (!strcmp(argv[i], "--prompt") && has) prompt = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--decode") && has) decode = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeat") && has) repeat = atoi(argv[++i]);
        else {
            fprintf(stderr, "bench_server_steps: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (prompt < 1 || decode < 1 || repeat < 1) {
        fprintf(stderr, "bench_server_steps: need --prompt, --decode and --repeat >= 1\n");
        return 2;
    }
    char err[1024];
    ModelConfig cfg;
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    if (config_load(&cfg, argv[1], err, sizeof err) != 0 || ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) != 0 ||
        model_init(&m, &cfg, ops, err, sizeof err) != 0 || resident_alloc(&w, &m, 0, err, sizeof err) != 0) {
        fprintf(stderr, "bench_server_steps: %s\n", err);
        return 1;
    }
    if (prompt + decode > cfg.max_seq_len) {
        fprintf(stderr, "bench_server_steps: --prompt + --decode = %d exceeds the model's context of %d\n",
                prompt + decode, cfg.max_seq_len);
        return 2;
    }
    model_init_random(&m, &w, 1234, 0.02f);
    UnitSource src = resident_source(&w);
    for (int i = 0; i < n_batches; i++) {
        double best_prefill = 1e30, best_decode = 1e30;
        for (int r = 0; r < repeat; r++) {
            double p, d;
            if (run_once(&m, &src, batches[i], prompt, decode, &p, &d) != 0) return 1;
            best_prefill = p < best_prefill ? p : best_prefill;
            best_decode = d < best_decode ? d : best_decode;
        }
        const int B = batches[i];
        printf("{\"batch\": %d, \"prompt\": %d, \"prefill_ms\": %.3f, \"prefill_tokens_per_s\": %.0f, "
               "\"decode_step_ms\": %.3f, \"decode_tokens_per_s\": %.0f}\n",
               B, prompt, best_prefill * 1e3, B * prompt / best_prefill, best_decode * 1e3, B / best_decode);
        fflush(stdout);
    }
    resident_free(&w, &m);
    model_free(&m);
    ops_destroy(ops);
    return 0;
}
