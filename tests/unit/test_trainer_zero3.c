// test_trainer_zero3.c — ZeRO on N ranks computes what 1 rank computes (host backend, CPU, fp32).
//
// For every stage (1, 2, 3) and N in {1, 2, 4} this forks N rank processes on 127.0.0.1. Each trains a tiny
// random model (Qwen3-style: q/k norm, bias, tied embeddings — so the tied unit 0 is gathered twice per step)
// for 5 AdamW steps with clipping; the global batch of 8 sequences is split across ranks and every rank's
// dL/dlogprob is -1/(global scored tokens), so the sum over ranks is the full batch's mean cross-entropy.
// Rank 0 reports the 5 losses (summed over ranks with an all-reduce) and the final weights (gathered).
// Checks: N ranks equal 1 rank within 1e-5 relative (only the summation order of reductions differs), the loss
// goes down, and a resident single-process run (no ZeRO) gives the same losses.
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/ops.h"
#include "shared/comm.h"
#include "shared/model.h"
#include "trainer/zero3.h"

#define STEPS 5
#define N_SEQ 8

static const char *CONFIG =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 61, \"hidden_size\": 32, \"intermediate_size\": 40,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 8,"
    " \"max_position_embeddings\": 64, \"tie_word_embeddings\": true, \"attention_bias\": true,"
    " \"hidden_act\": \"silu\"}";

static const AdamWParams HP = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f,
                               .max_grad_norm = 0.5f};

static int seq_len(int s) { return 3 + (s * 5) % 7; }
static int32_t tok_of(int s, int i) { return (int32_t)((s * 17 + i * 7 + 3) % 61); }

static int global_scored(void) {
    int n = 0;
    for (int s = 0; s < N_SEQ; s++) n += seq_len(s) - 1;
    return n;
}

// Packs sequences [s0, s1) into a batch with next-token targets.
static Batch make_batch(int s0, int s1, int32_t *tok, int32_t *tgt, int32_t *cu, float *dlp) {
    int n = 0, b = 0;
    cu[0] = 0;
    for (int s = s0; s < s1; s++) {
        for (int i = 0; i < seq_len(s); i++, n++) {
            tok[n] = tok_of(s, i);
            tgt[n] = i + 1 < seq_len(s) ? tok_of(s, i + 1) : -1;
            dlp[n] = tgt[n] >= 0 ? -1.0f / (float)global_scored() : 0.0f;
        }
        cu[++b] = n;
    }
    return (Batch){.n_seqs = s1 - s0, .n_tokens = n, .tokens = tok, .targets = tgt, .cu_seqlens = cu};
}

static double local_loss(const Batch *b, const float *lp) {
    double l = 0;
    for (int i = 0; i < b->n_tokens; i++)
        if (b->targets[i] >= 0) l -= lp[i];
    return l / global_scored();
}

#define FAIL(...) do { fprintf(stderr, "rank %d: ", rank); fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); _exit(1); } while (0)

// One rank: writes "loss0 .. loss4" then every parameter (rank 0 only) to out_path.
static void run_rank(int rank, int world, int port, int stage, const char *out_path) {
    char err[1024], buf[32];
    setenv("RANK", (snprintf(buf, sizeof buf, "%d", rank), buf), 1);
    setenv("WORLD_SIZE", (snprintf(buf, sizeof buf, "%d", world), buf), 1);
    setenv("LOCAL_RANK", (snprintf(buf, sizeof buf, "%d", rank), buf), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", (snprintf(buf, sizeof buf, "%d", port), buf), 1);
    CommInit ci;
    Comm *c;
    OpsCtx *ops;
    ModelConfig cfg;
    Model m;
    Zero3 *z;
    if (comm_init_from_env(&ci, 20000, err, sizeof err) != 0 || comm_create(&c, COMM_BACKEND_HOST, &ci, NULL, err, sizeof err) != 0)
        FAIL("%s", err);
    if (ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) != 0 || config_parse(&cfg, CONFIG, strlen(CONFIG), err, sizeof err) != 0 ||
        model_init(&m, &cfg, ops, err, sizeof err) != 0 || zero3_create(&z, &m, c, stage, err, sizeof err) != 0 ||
        zero3_init_random(z, 99, 0.2f, err, sizeof err) != 0)
        FAIL("%s", err);
    int per = N_SEQ / world, s0 = rank * per, s1 = s0 + per;
    int32_t tok[128], tgt[128], cu[N_SEQ + 1];
    float lp[128], dlp[128];
    Batch b = make_batch(s0, s1, tok, tgt, cu, dlp);
    TrainActs *acts;
    if (train_acts_create(&acts, &m, b.n_tokens, b.n_seqs, stage == 3, err, sizeof err) != 0) FAIL("%s", err);
    UnitSource src = zero3_source(z);
    double losses[STEPS];
    for (int step = 1; step <= STEPS; step++) {
        if (model_forward(&m, acts, &src, &b, 1.0f, lp, NULL, NULL, err, sizeof err) != 0 ||
            model_backward(&m, acts, &src, dlp, err, sizeof err) != 0)
            FAIL("step %d: %s", step, err);
        double l = local_loss(&b, lp);
        if (comm_all_reduce(c, &l, 1, COMM_F64, COMM_SUM) != 0) FAIL("%s", comm_error(c));
        losses[step - 1] = l;
        float norm;
        if (zero3_step(z, &HP, HP.lr, step, &norm, err, sizeof err) != 0) FAIL("%s", err);
    }
    FILE *f = rank == 0 ? fopen(out_path, "w") : NULL;
    if (rank == 0 && !f) FAIL("cannot write %s", out_path);
    if (f)
        for (int i = 0; i < STEPS; i++) fprintf(f, "%.9g\n", losses[i]);
    for (int u = 0; u < m.layout.n_units; u++) {
        size_t padded = zero3_shard_count(z, u) * world;
        float *host = malloc(padded * 4);
        if (zero3_gather_unit_f32(z, u, host, err, sizeof err) != 0) FAIL("%s", err);
        if (f)
            for (size_t i = 0; i < m.layout.unit_numel[u]; i++) fprintf(f, "%.9g\n", host[i]);
        free(host);
    }
    if (f) fclose(f);
    comm_barrier(c);
    train_acts_free(acts, &m);
    zero3_destroy(z);
    comm_destroy(c);
    _exit(0);
}

static int free_port(int k) { return 20000 + (getpid() * 7 + k * 13) % 20000; }

// Runs N ranks; returns the values rank 0 wrote (malloc'd, *n receives their count), or NULL.
static double *run_world(int world, int stage, int k, size_t *n) {
    char path[256];
    snprintf(path, sizeof path, "/tmp/tandem_zero3_%d_%d_%d.txt", (int)getpid(), world, stage);
    int port = free_port(k);
    pid_t pids[8];
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        if (pids[r] == 0) run_rank(r, world, port, stage, path);
    }
    int ok = 1;
    for (int r = 0; r < world; r++) {
        int st;
        waitpid(pids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = 0;
    }
    if (!ok) {
        fprintf(stderr, "world %d stage %d: a rank failed\n", world, stage);
        return NULL;
    }
    FILE *f = fopen(path, "r");
    size_t cap = 1 << 16, cnt = 0;
    double *v = malloc(cap * sizeof *v);
    while (f && cnt < cap && fscanf(f, "%lf", &v[cnt]) == 1) cnt++;
    if (f) fclose(f);
    remove(path);
    *n = cnt;
    return v;
}

// The same training without ZeRO or a communicator: resident weights and plain AdamW.
static void resident_losses(double *losses) {
    char err[512];
    OpsCtx *ops;
    ModelConfig cfg;
    Model m;
    ResidentWeights w;
    if (ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) || config_parse(&cfg, CONFIG, strlen(CONFIG), err, sizeof err) ||
        model_init(&m, &cfg, ops, err, sizeof err) || resident_alloc(&w, &m, 1, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        exit(1);
    }
    model_init_random(&m, &w, 99, 0.2f);
    int U = m.layout.n_units;
    float *master[16], *mm[16], *vv[16];
    for (int u = 0; u < U; u++) {
        size_t n = m.layout.unit_numel[u];
        master[u] = ops_malloc(ops, n * 4), mm[u] = ops_malloc(ops, n * 4), vv[u] = ops_malloc(ops, n * 4);
        memcpy(master[u], w.params[u], n * 4);
    }
    int32_t tok[128], tgt[128], cu[N_SEQ + 1];
    float lp[128], dlp[128];
    Batch b = make_batch(0, N_SEQ, tok, tgt, cu, dlp);
    TrainActs *acts;
    train_acts_create(&acts, &m, b.n_tokens, b.n_seqs, 0, err, sizeof err);
    UnitSource src = resident_source(&w);
    for (int step = 1; step <= STEPS; step++) {
        resident_zero_grads(&w, &m);
        model_forward(&m, acts, &src, &b, 1.0f, lp, NULL, NULL, err, sizeof err);
        model_backward(&m, acts, &src, dlp, err, sizeof err);
        losses[step - 1] = local_loss(&b, lp);
        double sq = 0;
        for (int u = 0; u < U; u++)
            for (size_t i = 0; i < m.layout.unit_numel[u]; i++) sq += (double)w.grads[u][i] * w.grads[u][i];
        float norm = (float)sqrt(sq), coef = HP.max_grad_norm / (norm + 1e-6f), scale = coef < 1 ? coef : 1;
        for (int u = 0; u < U; u++)
            ops_adamw_step(ops, master[u], mm[u], vv[u], w.grads[u], w.params[u], m.layout.unit_numel[u], HP.lr, HP.beta1,
                           HP.beta2, HP.eps, HP.weight_decay, step, scale);
    }
}

int main(void) {
    int failures = 0, k = 0;
    // The parent runs no kernel before the forks: the CPU kernels' OpenMP thread pool does not survive fork().
    double *ones[4] = {0};
    for (int stage = 1; stage <= 3; stage++) {
        size_t n1 = 0;
        double *one = run_world(1, stage, k++, &n1);
        if (!one || n1 <= STEPS) {
            fprintf(stderr, "stage %d: single-rank run failed\n", stage);
            return 1;
        }
        if (!(one[STEPS - 1] < one[0])) {
            fprintf(stderr, "stage %d: loss did not go down (%g -> %g)\n", stage, one[0], one[STEPS - 1]);
            failures++;
        }
        for (int world = 2; world <= 4; world *= 2) {
            size_t nw = 0;
            double *many = run_world(world, stage, k++, &nw);
            if (!many || nw != n1) {
                fprintf(stderr, "stage %d world %d: run failed or wrote %zu values (1 rank: %zu)\n", stage, world, nw, n1);
                failures++;
                free(many);
                continue;
            }
            double worst = 0, scale = 0;
            for (size_t i = STEPS; i < n1; i++) scale = fmax(scale, fabs(one[i]));
            for (size_t i = 0; i < n1; i++) {
                double ref = i < STEPS ? fabs(one[i]) : scale;
                worst = fmax(worst, fabs(many[i] - one[i]) / ref);
            }
            fflush(stdout);
            printf("stage %d, %d ranks vs 1: max relative difference %.3g (losses %.6f -> %.6f)\n", stage, world, worst,
                   many[0], many[STEPS - 1]);
            if (worst > 1e-5) failures++;
            free(many);
        }
        ones[stage] = one;
    }
    double base_losses[STEPS];
    resident_losses(base_losses);
    for (int stage = 1; stage <= 3; stage++) {
        for (int i = 0; i < STEPS; i++) {
            double e = fabs(ones[stage][i] - base_losses[i]) / fabs(base_losses[i]);
            if (e > 1e-5) {
                fprintf(stderr, "stage %d step %d: ZeRO loss %.9g vs resident %.9g\n", stage, i, ones[stage][i],
                        base_losses[i]);
                failures++;
            }
        }
        free(ones[stage]);
    }
    if (failures) {
        fprintf(stderr, "test_trainer_zero3: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_trainer_zero3: all checks passed\n");
    return 0;
}
