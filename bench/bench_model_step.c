// bench_model_step — training-step tokens/s of the model core on a config with random weights.
//   bench_model_step MODEL_DIR [--device cpu|cuda] [--batch B] [--seq T] [--steps S] [--warmup W] [--checkpoint]
//                    [--adamw] [--keep-logits]
// A step is forward + backward; with --adamw also the policy update as the trainer runs it on one rank: the
// global gradient norm (sum of squares of every fp32 gradient), clipping to 1.0 and AdamW on fp32 master weights,
// m and v, writing the storage-dtype parameters. --keep-logits keeps the forward's logits for the backward (the
// trainer's default) instead of recomputing them.
// MODEL_DIR needs only config.json. Prints one JSON line: {"tokens_per_s": ..., "step_s": ..., ...}.
// bench/bench_model.py runs it beside a PyTorch step of the same model and prints the ratio.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "kernels/ops.h"
#include "shared/model.h"

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0) {
        fprintf(stderr, "usage: bench_model_step MODEL_DIR [--batch 4] [--seq 256] [--steps 3] [--warmup 1] [--checkpoint] [--adamw] [--keep-logits] [--device cpu|cuda]\n");
        return 2;
    }
    int B = 4, T = 256, steps = 3, warmup = 1, checkpoint = 0, adamw = 0, keep_logits = 0;
    OpsBackend backend = OPS_BACKEND_CPU;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--batch") && i + 1 < argc) B = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seq") && i + 1 < argc) T = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--checkpoint")) checkpoint = 1;
        else if (!strcmp(argv[i], "--adamw")) adamw = 1;
        else if (!strcmp(argv[i], "--keep-logits")) keep_logits = 1;
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) backend = !strcmp(argv[++i], "cuda") ? OPS_BACKEND_CUDA : OPS_BACKEND_CPU;
        else { fprintf(stderr, "bench_model_step: unknown option %s\n", argv[i]); return 2; }
    }
    // The context's settings from the environment bench/bench_*_gpu.py sets (kernels/cuda/README.md):
    // TANDEM_PROFILE_OPS=1 times every op, TANDEM_GEMM_AUTOTUNE=0|1|2 the GEMM autotuning.
    const char *profile = getenv("TANDEM_PROFILE_OPS"), *tune = getenv("TANDEM_GEMM_AUTOTUNE");
    OpsSettings settings = {.profile_ops = profile && *profile && strcmp(profile, "0") != 0};
    if (tune && *tune && ops_gemm_autotune_parse(tune, &settings.gemm_autotune) != 0) {
        fprintf(stderr, "bench_model_step: TANDEM_GEMM_AUTOTUNE=%s: expected 0, 1 or 2\n", tune);
        return 2;
    }
    char err[1024];
    ModelConfig cfg;
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    TrainActs *acts;
    if (config_load(&cfg, argv[1], err, sizeof err) != 0 ||
        ops_create_with_settings(&ops, backend, 0, &settings, err, sizeof err) != 0 ||
        model_init(&m, &cfg, ops, err, sizeof err) != 0 || resident_alloc(&w, &m, 1, err, sizeof err) != 0 ||
        train_acts_create(&acts, &m, B * T, B,
                          (checkpoint ? TRAIN_ACTS_CHECKPOINT : 0) | (keep_logits ? TRAIN_ACTS_KEEP_LOGITS : 0), err,
                          sizeof err) != 0) {
        fprintf(stderr, "bench_model_step: %s\n", err);
        return 1;
    }
    model_init_random(&m, &w, 1234, 0.02f);
    // AdamW state (fp32 master, m, v per unit), as zero3 keeps it on one rank.
    const int U = m.layout.n_units;
    float **master = calloc(U, sizeof *master), **am = calloc(U, sizeof *am), **av = calloc(U, sizeof *av);
    float *sumsq = adamw ? ops_malloc(ops, 4) : NULL;
    for (int u = 0; adamw && u < U; u++) {
        size_t n = m.layout.unit_numel[u];
        float *host = malloc(n * 4);
        master[u] = ops_malloc(ops, n * 4), am[u] = ops_malloc(ops, n * 4), av[u] = ops_malloc(ops, n * 4);
        ops_download_f32(ops, host, w.params[u], n);
        ops_copy_to_device(ops, master[u], host, n * 4);
        ops_memset_zero(ops, am[u], n * 4);
        ops_memset_zero(ops, av[u], n * 4);
        ops_synchronize(ops);
        free(host);
    }
    if (ops_status(ops)) {
        fprintf(stderr, "bench_model_step: AdamW state: %s\n", ops_error(ops));
        return 1;
    }
    const int N = B * T;
    int32_t *tokens = malloc(N * 4), *targets = malloc(N * 4), *cu = malloc((B + 1) * 4);
    float *lp = malloc(N * 4), *dlp = malloc(N * 4);
    uint64_t s = 42;
    for (int i = 0; i < N; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        tokens[i] = (int32_t)((s >> 33) % (uint64_t)cfg.vocab_size);
    }
    for (int b = 0; b <= B; b++) cu[b] = b * T;
    for (int i = 0; i < N; i++) {
        targets[i] = (i + 1) % T ? tokens[i + 1] : -1;
        dlp[i] = targets[i] >= 0 ? -1.0f / (float)(N - B) : 0.0f;
    }
    Batch batch = {.n_seqs = B, .n_tokens = N, .tokens = tokens, .targets = targets, .cu_seqlens = cu};
    UnitSource src = resident_source(&w);
    double t0 = 0;
    for (int it = 0; it < warmup + steps; it++) {
        if (it == warmup) t0 = bench_now_s();
        resident_zero_grads(&w, &m);
        if (model_forward(&m, acts, &src, &batch, 1.0f, lp, NULL, NULL, err, sizeof err) != 0 ||
            model_backward(&m, acts, &src, dlp, err, sizeof err) != 0) {
            fprintf(stderr, "bench_model_step: %s\n", err);
            return 1;
        }
        if (adamw) {
            ops_memset_zero(ops, sumsq, 4);
            for (int u = 0; u < U; u++) ops_sum_squares(ops, sumsq, w.grads[u], m.layout.unit_numel[u]);
            float sq = 0;
            ops_copy_to_host(ops, &sq, sumsq, 4);
            float norm = sqrtf(sq), coef = 1.0f / (norm + 1e-6f), scale = coef < 1 ? coef : 1;
            for (int u = 0; u < U; u++)
                ops_adamw_step(ops, master[u], am[u], av[u], w.grads[u], w.params[u], m.layout.unit_numel[u], 1e-6f,
                               0.9f, 0.999f, 1e-8f, 0.0f, it + 1, scale);
        }
    }
    ops_synchronize(ops);
    if (ops_status(ops)) {
        fprintf(stderr, "bench_model_step: %s\n", ops_error(ops));
        return 1;
    }
    double dt = (bench_now_s() - t0) / steps;
    ops_profile_print(ops);   // TANDEM_PROFILE_OPS=1: where the warm-up and timed steps went
    printf("{\"tokens_per_s\": %.1f, \"step_s\": %.4f, \"batch\": %d, \"seq\": %d, \"params\": %zu, "
           "\"activation_bytes\": %zu, \"checkpoint\": %d, \"adamw\": %d, \"keep_logits\": %d}\n",
           N / dt, dt, B, T, m.layout.n_params, train_acts_bytes(acts), checkpoint, adamw, keep_logits);
    return 0;
}
