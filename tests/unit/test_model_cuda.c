// test_model_cuda.c — the whole model on the CUDA backend against the CPU backend (GPU machines only; exit 77
// = skipped elsewhere). Same bf16-representable weights on both sides (a random init rounded to bf16), the
// same packed batch of 3 sequences; for Llama-style (GQA, untied) and Qwen3-style (q/k norm, bias, tied):
//   logits:          max |cuda - cpu| / max |cpu| <= 3e-2   (bf16 activations through every layer)
//   logprobs:        max |cuda - cpu| <= 5e-2 nats
//   every gradient:  ||cuda - cpu|| / ||cpu|| <= 5e-2 per unit (bf16 activation gradients, fp32 accumulation)
//   greedy decoding: the first 4 tokens agree (later ones may diverge on near-ties under bf16)
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/dtype.h"
#include "shared/model.h"
#include "model_testlib.h"

static const char *CONFIGS[2] = {SMALL_LLAMA_CONFIG, SMALL_QWEN3_CONFIG};

typedef struct {
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    TrainActs *acts;
} Side;

// The GPU side keeps the forward's logits for the backward (the trainer's default), the CPU side recomputes them.
static void side_init(Side *s, OpsBackend be, const ModelConfig *cfg, float *const *units, int N, int B) {
    char err[512];
    const int flags = be == OPS_BACKEND_CUDA ? TRAIN_ACTS_KEEP_LOGITS : 0;
    if (ops_create(&s->ops, be, 0, err, sizeof err) || model_init(&s->m, cfg, s->ops, err, sizeof err) ||
        resident_alloc(&s->w, &s->m, 1, err, sizeof err) ||
        train_acts_create(&s->acts, &s->m, N, B, flags, err, sizeof err)) {
        fprintf(stderr, "set-up failed: %s\n", err);
        exit(1);
    }
    for (int u = 0; u < s->m.layout.n_units; u++) ops_upload_f32(s->ops, s->w.params[u], units[u], s->m.layout.unit_numel[u]);
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
        // Random weights rounded to bf16 so both backends hold the same values.
        Model tmp;
        OpsCtx *cpu0;
        ops_create(&cpu0, OPS_BACKEND_CPU, 0, err, sizeof err);
        model_init(&tmp, &cfg, cpu0, err, sizeof err);
        int U = tmp.layout.n_units;
        float **units = calloc(U, sizeof *units);
        for (int u = 0; u < U; u++) {
            size_t n = tmp.layout.unit_numel[u];
            units[u] = malloc(n * 4);
            model_random_unit_f32(&tmp, 11, 0.05f, u, units[u]);
            for (size_t i = 0; i < n; i++) units[u][i] = dtype_bf16_to_f32(dtype_f32_to_bf16(units[u][i]));
        }
        const int lens[3] = {37, 1, 90}, B = 3;
        PackedBatch pb;
        if (packed_batch_make(&pb, lens, B, cfg.vocab_size)) { fprintf(stderr, "out of memory\n"); return 1; }
        const int N = pb.batch.n_tokens;
        const float *dlp = pb.dlp;
        Side s[2];
        float *logits[2], *lp[2];
        for (int k = 0; k < 2; k++) {
            side_init(&s[k], k ? OPS_BACKEND_CUDA : OPS_BACKEND_CPU, &cfg, units, N, B);
            logits[k] = malloc((size_t)N * cfg.vocab_size * 4);
            lp[k] = malloc(N * 4);
            UnitSource src = resident_source(&s[k].w);
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
        for (int u = 0; u < U; u++) {
            size_t n = tmp.layout.unit_numel[u];
            float *g = malloc(n * 4);
            ops_copy_to_host(s[1].ops, g, s[1].w.grads[u], n * 4);
            ops_synchronize(s[1].ops);
            double d = 0, r = 0;
            for (size_t i = 0; i < n; i++) {
                d += (g[i] - s[0].w.grads[u][i]) * (double)(g[i] - s[0].w.grads[u][i]);
                r += s[0].w.grads[u][i] * (double)s[0].w.grads[u][i];
            }
            double e = sqrt(d / (r > 0 ? r : 1));
            printf("config %d unit %d: gradient rel %.3g\n", c, u, e);
            CHECK(e <= 5e-2, "config %d unit %d: gradient differs by %.3g", c, u, e);
            free(g);
        }
        // Greedy decoding through the paged cache on both backends.
        int32_t prompt[5] = {3, 17, 29, 41, 5}, out[2][8];
        const int32_t *pp[1] = {prompt};
        int pl[1] = {5};
        for (int k = 0; k < 2; k++) {
            UnitSource src = resident_source(&s[k].w);
            if (model_generate_greedy(&s[k].m, &src, 1, pp, pl, 8, NULL, 0, out[k], err, sizeof err)) {
                fprintf(stderr, "generate: %s\n", err);
                return 1;
            }
        }
        CHECK(memcmp(out[0], out[1], 4 * 4) == 0, "config %d: greedy tokens differ: %d %d %d %d vs %d %d %d %d", c,
              out[0][0], out[0][1], out[0][2], out[0][3], out[1][0], out[1][1], out[1][2], out[1][3]);
        for (int k = 0; k < 2; k++) {
            train_acts_free(s[k].acts, &s[k].m);
            resident_free(&s[k].w, &s[k].m);
            model_free(&s[k].m);
            ops_destroy(s[k].ops);
            free(logits[k]);
            free(lp[k]);
        }
        for (int u = 0; u < U; u++) free(units[u]);
        free(units);
        packed_batch_free(&pb);
        model_free(&tmp);
        ops_destroy(cpu0);
    }
    return check_exit_code("test_model_cuda");
}
