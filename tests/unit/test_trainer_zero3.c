// test_trainer_zero3.c — ZeRO on N ranks computes what 1 rank computes (host backend, CPU, fp32).
//
// For every stage (1, 2, 3) and N in {1, 2, 4} this forks N rank processes on 127.0.0.1 (tests/unit/
// zero3_testlib.h). Each trains a tiny random model (Qwen3-style: q/k norm, bias, tied embeddings — so the tied
// unit 0 is gathered twice per step) for 5 AdamW steps with clipping.
// Checks: N ranks equal 1 rank within 1e-5 relative (only the summation order of reductions differs), the loss
// goes down, and a resident single-process run (no ZeRO) gives the same losses. overlap_comm false (collectives
// serialised with compute: no prefetch, every reduce-scatter finished at once) gives what the overlapped run gives,
// bit for bit, at every stage on 2 ranks: the same collectives on the same buffers, only queued at other times.
#include "check_macros.h"
#include "testlib.h"
#include "zero3_testlib.h"

static const Z3Case CASE = {
    .config = "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 61, \"hidden_size\": 32, "
              "\"intermediate_size\": 40, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
              "\"num_key_value_heads\": 2, \"head_dim\": 8, \"max_position_embeddings\": 64, "
              "\"tie_word_embeddings\": true, \"attention_bias\": true, \"hidden_act\": \"silu\"}",
    .vocab = 61, .n_seq = 8, .base_len = 3, .len_spread = 7,
    .ops = OPS_BACKEND_CPU, .comm = COMM_BACKEND_HOST,
    .init_std = 0.2f,
    .hp = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .max_grad_norm = 0.5f},
};
#define STEPS Z3_STEPS
#define N_SEQ 8

// The same training without ZeRO or a communicator: resident weights and plain AdamW.
static void resident_losses(double *losses) {
    char err[512];
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    if (ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) ||
        tiny_model_init(&m, &w, ops, CASE.config, 1, 99, CASE.init_std, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        exit(1);
    }
    int U = m.layout.n_units;
    float *master[16], *mm[16], *vv[16];
    for (int u = 0; u < U; u++) {
        size_t n = m.layout.unit_numel[u];
        master[u] = ops_malloc(ops, n * 4), mm[u] = ops_malloc(ops, n * 4), vv[u] = ops_malloc(ops, n * 4);
        memcpy(master[u], w.params[u], n * 4);
    }
    int32_t tok[128], tgt[128], cu[N_SEQ + 1];
    float lp[128], dlp[128];
    Batch b = z3_make_batch(&CASE, 0, N_SEQ, tok, tgt, cu, dlp);
    TrainActs *acts;
    train_acts_create(&acts, &m, b.n_tokens, b.n_seqs, 0, err, sizeof err);
    UnitSource src = resident_source(&w);
    for (int step = 1; step <= STEPS; step++) {
        resident_zero_grads(&w, &m);
        model_forward(&m, acts, &src, &b, 1.0f, lp, NULL, NULL, err, sizeof err);
        model_backward(&m, acts, &src, dlp, err, sizeof err);
        losses[step - 1] = z3_local_loss(&CASE, &b, lp);
        double sq = 0;
        for (int u = 0; u < U; u++)
            for (size_t i = 0; i < m.layout.unit_numel[u]; i++) sq += (double)w.grads[u][i] * w.grads[u][i];
        const AdamWParams HP = CASE.hp;
        float norm = (float)sqrt(sq), coef = HP.max_grad_norm / (norm + 1e-6f), scale = coef < 1 ? coef : 1;
        for (int u = 0; u < U; u++)
            ops_adamw_step(ops, master[u], mm[u], vv[u], w.grads[u], w.params[u], m.layout.unit_numel[u], HP.lr, HP.beta1,
                           HP.beta2, HP.eps, HP.weight_decay, step, scale);
    }
    for (int u = 0; u < U; u++) ops_free(ops, master[u]), ops_free(ops, mm[u]), ops_free(ops, vv[u]);
    train_acts_free(acts, &m);
    tiny_model_free(&m, &w);
    ops_destroy(ops);
}

int main(void) {
    // The parent runs no kernel before the forks: the CPU kernels' OpenMP thread pool does not survive fork().
    Z3Result ones[4] = {{0}};
    for (int stage = 1; stage <= 3; stage++) {
        Z3Result one = {0};
        if (z3_run_world(&CASE, 1, stage, &one) != 0) {
            fprintf(stderr, "stage %d: single-rank run failed\n", stage);
            return 1;
        }
        const double *l1 = one.v + Z3_HEAD;
        CHECK(l1[STEPS - 1] < l1[0], "stage %d: loss did not go down (%g -> %g)", stage, l1[0], l1[STEPS - 1]);
        Z3Case serial = CASE;
        serial.serialised = 1;
        Z3Result on = {0}, off = {0};
        const int both = z3_run_world(&CASE, 2, stage, &on) == 0 && z3_run_world(&serial, 2, stage, &off) == 0 &&
                         on.n == off.n;
        CHECK(both, "stage %d: the 2-rank runs with and without overlap failed or differ in size", stage);
        if (both) {
            double worst = z3_worst(&on, &off);
            printf("stage %d, 2 ranks, overlap_comm false vs true: max relative difference %.3g\n", stage, worst);
            CHECK(worst == 0, "stage %d: overlap_comm false differs from true by %.3g", stage, worst);
        }
        free(on.v);
        free(off.v);
        for (int world = 2; world <= 4; world *= 2) {
            Z3Result many = {0};
            const int ran = z3_run_world(&CASE, world, stage, &many) == 0 && many.n == one.n;
            CHECK(ran, "stage %d world %d: run failed or wrote %zu values (1 rank: %zu)", stage, world, many.n, one.n);
            if (!ran) {
                free(many.v);
                continue;
            }
            double worst = z3_worst(&one, &many);
            fflush(stdout);
            printf("stage %d, %d ranks vs 1: max relative difference %.3g (losses %.6f -> %.6f)\n", stage, world, worst,
                   many.v[Z3_HEAD], many.v[Z3_HEAD + STEPS - 1]);
            CHECK(worst <= 1e-5, "stage %d world %d: %.3g over 1e-5", stage, world, worst);
            free(many.v);
        }
        ones[stage] = one;
    }
    double base_losses[STEPS];
    resident_losses(base_losses);
    for (int stage = 1; stage <= 3; stage++) {
        for (int i = 0; i < STEPS; i++) {
            double e = fabs(ones[stage].v[Z3_HEAD + i] - base_losses[i]) / fabs(base_losses[i]);
            CHECK(e <= 1e-5, "stage %d step %d: ZeRO loss %.9g vs resident %.9g", stage, i, ones[stage].v[Z3_HEAD + i],
                  base_losses[i]);
        }
        free(ones[stage].v);
    }
    return check_exit_code("test_trainer_zero3");
}
