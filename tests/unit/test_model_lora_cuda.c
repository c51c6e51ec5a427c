// test_model_lora_cuda.c — the LoRA adapter path on the CUDA backend against the CPU backend (GPU machines only;
// exit 77 = skipped elsewhere). The same bf16-representable base and adapters (every projection adapted, r 8,
// nonzero A and B, rsLoRA scale alpha / sqrt(r) so that the scale is not a power of two) on both sides, a frozen
// base (no base gradients), the same packed batch; the GPU side checkpoints activations (the recompute runs the
// gate/up adapters again), the CPU side keeps them. For Llama-style (GQA, untied) and Qwen3-style (q/k norm, bias):
//   logits:                max |cuda - cpu| / max |cpu| <= 3e-2
//   logprobs:              max |cuda - cpu| <= 5e-2 nats
//   every adapter tensor's gradient: ||cuda - cpu|| / ||cpu|| <= 5e-2
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/dtype.h"
#include "shared/model.h"
#include "shared/model_lora.h"
#include "model_testlib.h"

static const char *CONFIGS[2] = {SMALL_LLAMA_CONFIG, SMALL_QWEN3_CONFIG};

typedef struct {
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    ModelLora *lora;
    TrainActs *acts;
} Side;

static float bf16_round(float x) { return dtype_bf16_to_f32(dtype_f32_to_bf16(x)); }

static void side_init(Side *s, OpsBackend be, const ModelConfig *cfg, const LoraConfig *lc, float *const *units,
                      float *const *adapters, int N, int B) {
    char err[512];
    const int flags = be == OPS_BACKEND_CUDA ? TRAIN_ACTS_CHECKPOINT | TRAIN_ACTS_KEEP_LOGITS : 0;
    if (ops_create(&s->ops, be, 0, err, sizeof err) || model_init(&s->m, cfg, s->ops, err, sizeof err) ||
        resident_alloc(&s->w, &s->m, 0, err, sizeof err) || model_lora_create(&s->lora, &s->m, lc, 1, err, sizeof err)) {
        fprintf(stderr, "set-up failed: %s\n", err);
        exit(1);
    }
    s->m.lora = s->lora;
    if (train_acts_create(&s->acts, &s->m, N, B, flags, err, sizeof err)) {
        fprintf(stderr, "activations: %s\n", err);
        exit(1);
    }
    for (int u = 0; u < s->m.layout.n_units; u++) ops_upload_f32(s->ops, s->w.params[u], units[u], s->m.layout.unit_numel[u]);
    for (int l = 0; l < s->lora->n_layers; l++) ops_upload_f32(s->ops, s->lora->params[l], adapters[l], s->lora->unit_numel);
    model_lora_zero_grads(s->lora);
}

int main(void) {
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        printf("SKIP: no CUDA device (or a build without the CUDA backend)\n");
        return 77;
    }
    for (int c = 0; c < 2; c++) {
        char err[512];
        ModelConfig cfg;
        if (config_parse(&cfg, CONFIGS[c], strlen(CONFIGS[c]), err, sizeof err)) { fprintf(stderr, "%s\n", err); return 1; }
        LoraConfig lc = {.r = 8, .alpha = 16, .use_rslora = 1, .targets = LORA_ALL_TARGETS};
        Model tmp;
        OpsCtx *cpu0;
        ModelLora *shape;
        ops_create(&cpu0, OPS_BACKEND_CPU, 0, err, sizeof err);
        model_init(&tmp, &cfg, cpu0, err, sizeof err);
        if (model_lora_create(&shape, &tmp, &lc, 0, err, sizeof err)) { fprintf(stderr, "%s\n", err); return 1; }
        const int U = tmp.layout.n_units, L = cfg.num_layers;
        float **units = calloc(U, sizeof *units), **adapters = calloc(L, sizeof *adapters);
        for (int u = 0; u < U; u++) {
            size_t n = tmp.layout.unit_numel[u];
            units[u] = malloc(n * 4);
            model_random_unit_f32(&tmp, 11, 0.05f, u, units[u]);
            for (size_t i = 0; i < n; i++) units[u][i] = bf16_round(units[u][i]);
        }
        // Adapters: PEFT's init for A, and B drawn like A at a fifth of its size (B = 0 would leave A without a gradient).
        for (int l = 0; l < L; l++) {
            adapters[l] = malloc(shape->unit_numel * 4);
            float *b_src = malloc(shape->unit_numel * 4);
            model_lora_init_unit(shape, 7, l, adapters[l]);
            model_lora_init_unit(shape, 1007, l, b_src);
            for (int m = 0; m < LORA_N_MODULES; m++) {
                const size_t nb = (size_t)shape->out[m] * lc.r;
                for (size_t i = 0; i < nb; i++) adapters[l][shape->b_off[m] + i] =
                        0.2f * b_src[shape->a_off[m] + i % ((size_t)lc.r * shape->in[m])];
            }
            for (size_t i = 0; i < shape->unit_numel; i++) adapters[l][i] = bf16_round(adapters[l][i]);
            free(b_src);
        }
        const int lens[3] = {37, 1, 90}, B = 3;
        PackedBatch pb;
        if (packed_batch_make(&pb, lens, B, cfg.vocab_size)) { fprintf(stderr, "out of memory\n"); return 1; }
        const int N = pb.batch.n_tokens;
        const float *dlp = pb.dlp;
        Side s[2];
        float *logits[2], *lp[2];
        for (int k = 0; k < 2; k++) {
            side_init(&s[k], k ? OPS_BACKEND_CUDA : OPS_BACKEND_CPU, &cfg, &lc, units, adapters, N, B);
            logits[k] = malloc((size_t)N * cfg.vocab_size * 4);
            lp[k] = malloc(N * 4);
            UnitSource src = resident_source(&s[k].w);  // no gradient buffers: a frozen base
            if (model_forward(&s[k].m, s[k].acts, &src, &pb.batch, 1.0f, lp[k], NULL, logits[k], err, sizeof err) ||
                model_backward(&s[k].m, s[k].acts, &src, dlp, err, sizeof err)) {
                fprintf(stderr, "config %d backend %d: %s\n", c, k, err);
                return 1;
            }
        }
        double dmax = 0, rmax = 0, lpmax = 0;
        for (size_t i = 0; i < (size_t)N * cfg.vocab_size; i++) {
            dmax = fmax(dmax, fabs(logits[1][i] - logits[0][i]));
            rmax = fmax(rmax, fabs(logits[0][i]));
        }
        for (int i = 0; i < N; i++) lpmax = fmax(lpmax, fabs(lp[1][i] - lp[0][i]));
        printf("config %d: logits rel %.3g, logprobs abs %.3g\n", c, dmax / rmax, lpmax);
        CHECK(dmax / rmax <= 3e-2, "config %d: logits differ by %.3g", c, dmax / rmax);
        CHECK(lpmax <= 5e-2, "config %d: logprobs differ by %.3g", c, lpmax);
        double worst = 0;
        float *g = malloc(shape->unit_numel * 4);
        for (int t = 0; t < shape->n_tensors; t++) {
            const LayoutTensor *lt = &shape->tensors[t];
            ops_copy_to_host(s[1].ops, g, s[1].lora->grads[lt->unit], shape->unit_numel * 4);
            ops_synchronize(s[1].ops);
            const float *ref = s[0].lora->grads[lt->unit] + lt->offset, *got = g + lt->offset;
            double d = 0, r = 0;
            for (size_t i = 0; i < lt->numel; i++) {
                d += (got[i] - ref[i]) * (double)(got[i] - ref[i]);
                r += ref[i] * (double)ref[i];
            }
            const double e = sqrt(d / (r > 0 ? r : 1));
            worst = fmax(worst, e);
            CHECK(r > 0, "config %d: %s has a zero gradient on the CPU", c, lt->name);
            CHECK(e <= 5e-2, "config %d: gradient of %s differs by %.3g", c, lt->name, e);
        }
        printf("config %d: worst adapter gradient rel %.3g over %d tensors\n", c, worst, shape->n_tensors);
        free(g);
        for (int k = 0; k < 2; k++) {
            train_acts_free(s[k].acts, &s[k].m);
            model_lora_free(s[k].lora);
            resident_free(&s[k].w, &s[k].m);
            model_free(&s[k].m);
            ops_destroy(s[k].ops);
            free(logits[k]);
            free(lp[k]);
        }
        for (int u = 0; u < U; u++) free(units[u]);
        for (int l = 0; l < L; l++) free(adapters[l]);
        free(units), free(adapters);
        packed_batch_free(&pb);
        model_lora_free(shape);
        model_free(&tmp);
        ops_destroy(cpu0);
    }
    return check_exit_code("test_model_lora_cuda");
}
