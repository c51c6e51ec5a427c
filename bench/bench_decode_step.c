// bench_decode_step — GPU (or CPU) time of the rollout server's decode step alone, without HTTP, scheduling or
// the engine thread: the model's padded decode step (CUDA graphs where the backend has them) plus the greedy
// sampling op and the 8-byte-per-sequence download, the same calls rollout_server/engine.c makes each step.
//   bench_decode_step MODEL_DIR [--device cpu|cuda] [--batches 1,64,256,512] [--ctx 512] [--steps 64]
//                     [--warmup 8] [--eager] [--unpadded] [--lora-r R]
// MODEL_DIR needs only config.json (random weights). Every sequence starts at position --ctx (its cache filled
// with zeros up to there) and decodes --steps tokens, each fed its own sampled token. One JSON line per batch
// size: {"batch", "ctx", "step_ms", "tokens_per_s", "weight_bytes", "kv_bytes_per_step", "graphs"}; kv bytes are
// the K and V read by attention in one step at the run's mean context. bench/bench_decode_gpu.py turns them into
// a share of the bandwidth roofline. With TANDEM_PROFILE_OPS=1 (graphs off) the per-op GPU times follow.
// --unpadded runs model_decode_step instead (no padding, no graphs: the path of the server's steps that mix adapters);
// --lora-r R adds a LoRA adapter of rank R on every projection (alpha 2R) to every row, as tandem-serve runs a
// --lora one or a low-rank adapter update ("path": "lora"; padded and graph-replayed unless --unpadded).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "kernels/ops.h"
#include "shared/model.h"
#include "shared/model_lora.h"

enum { BLOCK = 16, MAX_BATCHES = 16 };

static void usage(void) {
    fprintf(stderr,
            "usage: bench_decode_step MODEL_DIR [options]\n"
            "  --device cpu|cuda   backend (default cpu)\n"
            "  --batches LIST      comma-separated decode batch sizes (default 1,64,256,512)\n"
            "  --ctx N             tokens already in every sequence's cache (default 512)\n"
            "  --steps N           timed decode steps per batch size (default 64)\n"
            "  --warmup N          untimed steps first (records the graphs; default 8)\n"
            "  --eager             no CUDA graphs (default: graphs where the backend has them)\n"
            "  --unpadded          model_decode_step: no padding, no graphs\n"
            "  --lora-r R          a rank-R LoRA adapter on every projection of every row\n");
}

// One batch size: a cache of B sequences x ceil((ctx + warmup + steps) / BLOCK) blocks, sequence b owning a
// contiguous run of blocks. Returns 0 or 1 with a message on stderr.
static int run_batch(Model *m, UnitSource *src, int B, int ctx, int warmup, int steps, int graphs, int unpadded) {
    OpsCtx *o = m->ops;
    const ModelConfig *cfg = &m->cfg;
    const int total = ctx + warmup + steps, max_blocks = (total + BLOCK - 1) / BLOCK;
    char err[1024];
    KVCache kv;
    DecodeBufs *bufs = NULL;
    if (kv_cache_create(&kv, m, B * max_blocks, BLOCK, err, sizeof err) != 0 ||
        decode_bufs_create(&bufs, m, B, B, max_blocks, B, err, sizeof err) != 0 ||
        (!unpadded && decode_bufs_enable_padded(bufs, m, B, graphs, err, sizeof err) < 0)) {
        fprintf(stderr, "bench_decode_step: batch %d: %s\n", B, err);
        return 1;
    }
    int32_t *tok = malloc((size_t)B * 4), *pos = malloc((size_t)B * 4), *slot = malloc((size_t)B * 4);
    int32_t *tables = malloc((size_t)B * max_blocks * 4);
    float *lp = malloc((size_t)B * 4);
    int32_t *seq = malloc((size_t)B * 4);   // unpadded steps: sequence b is row b, its own logits row
    for (int b = 0; seq && b < B; b++) seq[b] = b;
    OpsSampleParams *params = calloc((size_t)B, sizeof *params);
    int32_t *d_tok = ops_malloc(o, (size_t)B * 4);
    float *d_lp = ops_malloc(o, (size_t)B * 4);
    OpsSampleParams *d_params = ops_malloc(o, (size_t)B * sizeof *params);
    int32_t *d_off = ops_malloc(o, (size_t)(B + 1) * 4);
    if (!tok || !pos || !slot || !tables || !lp || !seq || !params || !d_tok || !d_lp || !d_params || !d_off) {
        fprintf(stderr, "bench_decode_step: batch %d: out of memory (%s)\n", B, ops_error(o));
        return 1;
    }
    for (int b = 0; b < B; b++) {
        for (int j = 0; j < max_blocks; j++) tables[b * max_blocks + j] = b * max_blocks + j;
        tok[b] = (int32_t)((b * 7919 + 13) % cfg->vocab_size);
        params[b] = (OpsSampleParams){.temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 1.0f,
                                      .logits_row = b};
    }
    ops_copy_to_device(o, d_params, params, (size_t)B * sizeof *params);
    ops_memset_zero(o, d_off, (size_t)(B + 1) * 4);
    double t0 = 0;
    for (int it = 0; it < warmup + steps; it++) {
        if (it == warmup) {
            ops_synchronize(o);
            t0 = bench_now_s();
        }
        for (int b = 0; b < B; b++) {
            pos[b] = ctx + it;
            slot[b] = tables[b * max_blocks + pos[b] / BLOCK] * BLOCK + pos[b] % BLOCK;
        }
        const int rc = unpadded ? model_decode_step(m, bufs, src, &kv, B, tok, seq, pos, slot, tables, B, max_blocks,
                                                    seq, B, NULL, err, sizeof err)
                                : model_decode_step_padded(m, bufs, src, &kv, B, tok, pos, slot, tables, max_blocks,
                                                           NULL, err, sizeof err);
        if (rc != 0) {
            fprintf(stderr, "bench_decode_step: batch %d step %d: %s\n", B, it, err);
            return 1;
        }
        ops_sample_rows(o, d_tok, d_lp, decode_bufs_logits(bufs), d_params, NULL, d_off, B, B, cfg->vocab_size, 0);
        ops_copy_to_host(o, tok, d_tok, (size_t)B * 4);
        ops_copy_to_host(o, lp, d_lp, (size_t)B * 4);
        if (ops_status(o)) {
            fprintf(stderr, "bench_decode_step: batch %d step %d: %s\n", B, it, ops_error(o));
            return 1;
        }
        for (int b = 0; b < B; b++)
            if (tok[b] < 0 || tok[b] >= cfg->vocab_size) {
                fprintf(stderr, "bench_decode_step: batch %d step %d: sampled id %d\n", B, it, tok[b]);
                return 1;
            }
    }
    const double dt = (bench_now_s() - t0) / steps;
    const double mean_ctx = ctx + warmup + (steps + 1) / 2.0;
    const double kv_bytes = (double)B * mean_ctx * cfg->num_layers * 2.0 * cfg->num_kv_heads * cfg->head_dim *
                            (double)ops_dtype_size(o);
    DecodeGraphStats gs;
    decode_bufs_graph_stats(bufs, &gs);
    const char *path = m->lora_rows ? (unpadded ? "lora-unpadded" : "lora") : unpadded ? "unpadded" : "padded";
    printf("{\"batch\": %d, \"ctx\": %d, \"path\": \"%s\", \"step_ms\": %.4f, \"tokens_per_s\": %.1f, "
           "\"weight_bytes\": %zu, \"kv_bytes_per_step\": %.0f, \"graphs\": %d, \"graph_replays\": %lld}\n",
           B, ctx, path, dt * 1e3, B / dt, m->layout.n_params * ops_dtype_size(o), kv_bytes,
           !unpadded && decode_bufs_graphs_on(bufs), (long long)gs.replays);
    fflush(stdout);
    ops_free(o, d_tok);
    ops_free(o, d_lp);
    ops_free(o, d_params);
    ops_free(o, d_off);
    free(tok), free(pos), free(slot), free(tables), free(lp), free(seq), free(params);
    decode_bufs_free(bufs, m);
    kv_cache_free(&kv, m);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    int batches[MAX_BATCHES] = {1, 64, 256, 512}, n_batches = 4, ctx = 512, steps = 64, warmup = 8, graphs = 1;
    int unpadded = 0, lora_r = 0;
    OpsBackend backend = OPS_BACKEND_CPU;
    for (int i = 2; i < argc; i++) {
        const int has = i + 1 < argc;
        if (!strcmp(argv[i], "--batches") && has) {
            n_batches = bench_parse_list(argv[++i], batches, MAX_BATCHES);
            if (n_batches < 1) { fprintf(stderr, "bench_decode_step: bad --batches %s\n", argv[i]); return 2; }
        } else if (!strcmp(argv[i], "--ctx") && has) ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && has) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && has) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--eager")) graphs = 0;
        else if (!strcmp(argv[i], "--unpadded")) unpadded = 1;
        else if (!strcmp(argv[i], "--lora-r") && has) lora_r = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--device") && has) {
            const char *d = argv[++i];
            if (!strcmp(d, "cuda")) backend = OPS_BACKEND_CUDA;
            else if (strcmp(d, "cpu")) { fprintf(stderr, "bench_decode_step: --device cpu|cuda, not %s\n", d); return 2; }
        } else {
            fprintf(stderr, "bench_decode_step: unknown option %s\n", argv[i]);
            usage();
            return 2;
        }
    }
    if (ctx < 0 || steps < 1 || warmup < 0 || lora_r < 0) {
        fprintf(stderr, "bench_decode_step: need --ctx >= 0, --steps >= 1, --warmup >= 0, --lora-r >= 0\n");
        return 2;
    }
    // The context's settings from the environment bench/bench_*_gpu.py sets (kernels/cuda/README.md):
    // TANDEM_PROFILE_OPS=1 times every op, TANDEM_GEMM_AUTOTUNE=0|1|2 the GEMM autotuning.
    const char *profile = getenv("TANDEM_PROFILE_OPS"), *tune = getenv("TANDEM_GEMM_AUTOTUNE");
    OpsSettings settings = {.profile_ops = profile && *profile && strcmp(profile, "0") != 0};
    if (tune && *tune && ops_gemm_autotune_parse(tune, &settings.gemm_autotune) != 0) {
        fprintf(stderr, "bench_decode_step: TANDEM_GEMM_AUTOTUNE=%s: expected 0, 1 or 2\n", tune);
        return 2;
    }
    char err[1024];
    ModelConfig cfg;
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    if (config_load(&cfg, argv[1], err, sizeof err) != 0 ||
        ops_create_with_settings(&ops, backend, 0, &settings, err, sizeof err) != 0 ||
        model_init(&m, &cfg, ops, err, sizeof err) != 0 || resident_alloc(&w, &m, 0, err, sizeof err) != 0) {
        fprintf(stderr, "bench_decode_step: %s\n", err);
        return 1;
    }
    model_init_random(&m, &w, 1234, 0.02f);
    UnitSource src = resident_source(&w);
    ModelLora *lora = NULL;
    ModelLoraRows rows = {0};
    if (lora_r > 0) {
        int most = 0;
        for (int i = 0; i < n_batches; i++) most = batches[i] > most ? batches[i] : most;
        const LoraConfig lc = {.r = lora_r, .alpha = 2.0f * lora_r, .targets = LORA_ALL_TARGETS};
        float **host = NULL;
        int ok = model_lora_create(&lora, &m, &lc, 0, err, sizeof err) == 0 &&
                 (host = calloc((size_t)cfg.num_layers, sizeof *host)) != NULL;
        for (int l = 0; ok && l < cfg.num_layers; l++) {   // PEFT's init for A, B as A: nothing zero
            ok = (host[l] = malloc(lora->unit_numel * sizeof(float))) != NULL;
            if (ok) model_lora_init_unit(lora, 99, l, host[l]);
            for (int i = 0; ok && i < LORA_N_MODULES; i++)
                if (lora->b_off[i] != SIZE_MAX)
                    memcpy(host[l] + lora->b_off[i], host[l] + lora->a_off[i],
                           (size_t)(lora->out[i] < lora->in[i] ? lora->out[i] : lora->in[i]) * lora_r * sizeof(float));
        }
        // As tandem-serve holds its adapters (model_lora_serve_from).
        if (!ok || model_lora_serve_from(lora, host, err, sizeof err) != 0 ||
            model_lora_rows_reserve(&rows, &m, most, lora_r, err, sizeof err) != 0) {
            fprintf(stderr, "bench_decode_step: LoRA adapter: %s\n", ok ? err : "out of memory");
            return 1;
        }
        for (int l = 0; l < cfg.num_layers; l++) free(host[l]);
        free(host);
        rows.n_ranges = 1;
        m.lora_rows = &rows;
    }
    for (int i = 0; i < n_batches; i++) {
        if (lora) rows.ranges[0] = (LoraRowRange){0, batches[i], lora};
        if (run_batch(&m, &src, batches[i], ctx, warmup, steps, graphs, unpadded) != 0) return 1;
    }
    ops_profile_print(ops);   // TANDEM_PROFILE_OPS=1: where the steps went, op by op
    return 0;
}
