// test_decode_batch_invariance.c — the rollout server's forward on the CPU is batch-invariant: a sequence's logits
// (and so the logprob the server reports for its sampled token) come out bit for bit the same whatever else shares
// its steps. Continuous batching decides by timing which requests share a step, so without this two identical GRPO
// runs diverge (the importance-sampling correction feeds the server's logprobs into the loss).
//
// A target sequence (a 23-token prompt, then 9 fixed decode tokens) runs through model_decode_step alone — its
// prompt in one step, each decode token alone — and that gives the reference: 10 logits rows of V, the first after
// the prompt, one after each decode token. Then the same sequence runs in randomised schedules: its prompt cut into
// chunks, every step shared with up to 40 other sequences (prompts of 2..41 tokens, some in prefill chunks, some
// decoding), the target at a random place in the step, and the OpenBLAS and OpenMP thread counts at 1 or 2. Every
// schedule must reproduce the reference rows bit for bit, and so must the sampling op's token and logprob of each row.
// Three shapes of model: Llama (untied lm_head), Qwen2 (q/k/v bias, tied embeddings) and Qwen3 (q/k norms), with
// inner sizes that leave remainders for the kernels' tiles (intermediate 172, vocabulary 517).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/model.h"
#include "testlib.h"

// OpenBLAS's and OpenMP's thread counts are process-wide; the library is linked through tandem_kernels, OpenMP only
// where the compiler has it (weak: NULL without it).
void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);
extern void omp_set_num_threads(int num_threads) __attribute__((weak));

static const char *const CONFIGS[][2] = {
    {"llama", "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 517, \"hidden_size\": 96,"
              " \"intermediate_size\": 172, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
              " \"num_key_value_heads\": 2, \"max_position_embeddings\": 128, \"tie_word_embeddings\": false}"},
    {"qwen2", "{\"architectures\": [\"Qwen2ForCausalLM\"], \"vocab_size\": 517, \"hidden_size\": 96,"
              " \"intermediate_size\": 172, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
              " \"num_key_value_heads\": 2, \"max_position_embeddings\": 128, \"tie_word_embeddings\": true}"},
    {"qwen3", "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 517, \"hidden_size\": 96,"
              " \"intermediate_size\": 172, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
              " \"num_key_value_heads\": 2, \"head_dim\": 32, \"max_position_embeddings\": 128,"
              " \"tie_word_embeddings\": false}"},
};

enum {
    N_SEQS = 41,        // the target (sequence 0) and 40 others
    BS = 8,             // KV block size
    MAX_LEN = 96,       // tokens a sequence may reach
    MB = MAX_LEN / BS,  // blocks per sequence
    PROMPT = 23,        // the target's prompt
    ROWS = 10,          // the target's logits rows: after the prompt, then after each of 9 decode tokens
    MAX_CHUNK = 24,     // prompt tokens another sequence computes in one step, at most
    MAX_STEP = 1024,    // tokens in one step
};

// One sequence: its tokens (prompt, then what it decodes), how many are known and how many have K/V in the cache.
typedef struct {
    int32_t tok[MAX_LEN];
    int prompt, len, done;
} Seq;

typedef struct {
    Model m;
    ResidentWeights w;
    UnitSource src;
    KVCache kv;
    DecodeBufs *b;
    int V;
    float *logits;   // (N_SEQS, V) the step's logits rows
} Rig;

static uint64_t rng_next(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

// Block j of sequence s, scattered over the pool (37 is prime to N_SEQS * MB).
static int32_t block_of(int s, int j) { return (int32_t)(((s * MB + j) * 37) % (N_SEQS * MB)); }

// Norms 1 and biases 0 (model_init_random) would leave the norm-weight and bias paths untested: perturb them.
static void perturb(Rig *r, int unit, size_t off, size_t n, float base, uint64_t seed) {
    if (off == SIZE_MAX) return;
    float *p = (float *)r->w.params[unit] + off;
    for (size_t i = 0; i < n; i++) p[i] = base + 0.2f * ((float)(rng_next(&seed) % 2001) / 1000.0f - 1.0f);
}

static void rig_init(Rig *r, OpsCtx *o, const char *json) {
    char err[512];
    REQUIRE(tiny_model_init(&r->m, &r->w, o, json, 0, 5, 0.08f, err, sizeof err) == 0, "%s", err);
    const ModelConfig cfg = r->m.cfg;
    const LayerOffsets *lo = &r->m.layout.layer;
    const size_t C = cfg.hidden_size, D = cfg.head_dim, QKV = (cfg.num_heads + 2 * (size_t)cfg.num_kv_heads) * D;
    for (int l = 0; l < cfg.num_layers; l++) {
        const int u = layout_layer_unit(l);
        perturb(r, u, lo->ln1, C, 1.0f, 100 + l);
        perturb(r, u, lo->ln2, C, 1.0f, 200 + l);
        perturb(r, u, lo->bq, QKV, 0.0f, 300 + l);
        perturb(r, u, lo->q_norm, D, 1.0f, 400 + l);
        perturb(r, u, lo->k_norm, D, 1.0f, 500 + l);
    }
    perturb(r, layout_final_unit(&r->m.layout), r->m.layout.final_norm, C, 1.0f, 600);
    r->src = resident_source(&r->w);
    r->V = cfg.vocab_size;
    REQUIRE(kv_cache_create(&r->kv, &r->m, N_SEQS * MB, BS, err, sizeof err) == 0, "%s", err);
    REQUIRE(decode_bufs_create(&r->b, &r->m, MAX_STEP, N_SEQS, MB, N_SEQS, err, sizeof err) == 0, "%s", err);
    r->logits = malloc((size_t)N_SEQS * r->V * sizeof *r->logits);
    REQUIRE(r->logits, "out of memory");
}

static void rig_free(Rig *r) {
    free(r->logits);
    decode_bufs_free(r->b, &r->m);
    kv_cache_free(&r->kv, &r->m);
    tiny_model_free(&r->m, &r->w);
}

// Fresh sequences: the target's prompt and decode tokens are fixed; the others' prompts come from `seed`.
static void seqs_init(Seq *q, uint64_t seed, int V) {
    memset(q, 0, sizeof *q * N_SEQS);
    for (int i = 0; i < PROMPT + ROWS - 1; i++) q[0].tok[i] = (int32_t)((i * 131 + 7) % V);
    q[0].prompt = PROMPT;
    q[0].len = PROMPT;
    for (int s = 1; s < N_SEQS; s++) {
        q[s].prompt = q[s].len = 2 + (int)(rng_next(&seed) % 40);
        for (int i = 0; i < MAX_LEN; i++) q[s].tok[i] = (int32_t)(rng_next(&seed) % V);
    }
}

// One step: sequence sel[i] computes its next n[i] tokens, in that order. A sequence whose last known token is
// among them gets a logits row (rows in step order); *target_row receives the target's, or -1.
static void step(Rig *r, Seq *q, const int *sel, const int *n, int count, int *target_row) {
    static int32_t tok[MAX_STEP], seq[MAX_STEP], pos[MAX_STEP], slot[MAX_STEP], rows[N_SEQS];
    static int32_t tables[N_SEQS * MB];
    char err[512];
    int N = 0, n_rows = 0;
    *target_row = -1;
    for (int i = 0; i < count; i++) {
        Seq *s = &q[sel[i]];
        for (int t = 0; t < n[i]; t++, N++) {
            const int p = s->done + t;
            tok[N] = s->tok[p];
            seq[N] = i;
            pos[N] = p;
            slot[N] = block_of(sel[i], p / BS) * BS + p % BS;
        }
        for (int j = 0; j < MB; j++) tables[i * MB + j] = block_of(sel[i], j);
        s->done += n[i];
        if (s->done == s->len) {
            if (sel[i] == 0) *target_row = n_rows;
            rows[n_rows++] = N - 1;
        }
    }
    REQUIRE(model_decode_step(&r->m, r->b, &r->src, &r->kv, N, tok, seq, pos, slot, tables, count, MB, rows, n_rows,
                              r->logits, err, sizeof err) == 0,
            "decode step: %s", err);
}

// The sampling op on one logits row (temperature 1, a fixed draw): the token and logprob the server would report.
static void sample_row(Rig *r, const float *row, int32_t *tok, float *lp) {
    OpsSampleParams p = {.u = 0.37, .temperature = 1.0f, .top_p = 1.0f, .min_p = 0.0f, .repetition_penalty = 1.0f,
                         .top_k = 0, .logits_row = 0};
    const int32_t off[2] = {0, 0};
    ops_sample_rows(r->m.ops, tok, lp, row, &p, NULL, off, 1, 1, r->V, 0);
}

static void set_threads(int blas, int omp) {
    openblas_set_num_threads(blas);
    if (omp_set_num_threads) omp_set_num_threads(omp);
}

// The target alone: its prompt in one step, then each decode token alone. out (ROWS, V).
static void run_alone(Rig *r, float *out) {
    Seq q[N_SEQS];
    seqs_init(q, 1, r->V);
    const int sel = 0;
    int n = PROMPT, row;
    for (int k = 0; k < ROWS; k++) {
        step(r, q, &sel, &n, 1, &row);
        REQUIRE(row == 0, "the target got no logits row");
        memcpy(out + (size_t)k * r->V, r->logits, (size_t)r->V * sizeof *out);
        q[0].len++;
        n = 1;
    }
}

// The target in a randomised schedule from `seed`: its prompt in random chunks, each step shared with a random set
// of the others (each computing a random chunk of its prompt, or decoding one token), in random order. out (ROWS, V).
static void run_shared(Rig *r, uint64_t seed, int max_company, float *out) {
    Seq q[N_SEQS];
    seqs_init(q, seed, r->V);
    int got = 0;
    while (got < ROWS) {
        int sel[N_SEQS], n[N_SEQS], count = 0, tokens = 0;
        const int company = (int)(rng_next(&seed) % (unsigned)(max_company + 1));
        for (int s = 1; s < N_SEQS && count < company; s++) {
            if (rng_next(&seed) % 3 == 0 || q[s].len >= MAX_LEN) continue;   // this one sits out
            if (q[s].done == q[s].len) q[s].len++;                            // decoding: one more token known
            const int left = q[s].len - q[s].done;
            sel[count] = s;
            n[count] = 1 + (int)(rng_next(&seed) % (unsigned)(left < MAX_CHUNK ? left : MAX_CHUNK));
            tokens += n[count++];
        }
        // The target: a chunk of what is left of its prompt, or its next decode token, at a random place.
        if (q[0].done == q[0].len) q[0].len++;
        const int left = q[0].len - q[0].done;
        const int at = (int)(rng_next(&seed) % (unsigned)(count + 1));
        memmove(sel + at + 1, sel + at, (size_t)(count - at) * sizeof *sel);
        memmove(n + at + 1, n + at, (size_t)(count - at) * sizeof *n);
        sel[at] = 0;
        n[at] = 1 + (int)(rng_next(&seed) % (unsigned)left);
        count++;
        REQUIRE(tokens + n[at] <= MAX_STEP, "step of %d tokens", tokens + n[at]);
        int row;
        step(r, q, sel, n, count, &row);
        if (row >= 0) memcpy(out + (size_t)got++ * r->V, r->logits + (size_t)row * r->V, (size_t)r->V * sizeof *out);
    }
}

// Rows that differ from the reference (bits of the logits, or the sampled token and its logprob).
static int count_mismatches(Rig *r, const float *ref, const float *got, double *worst) {
    int bad = 0;
    *worst = 0.0;
    for (int k = 0; k < ROWS; k++) {
        const float *a = ref + (size_t)k * r->V, *b = got + (size_t)k * r->V;
        int32_t ta, tb;
        float la, lb;
        sample_row(r, a, &ta, &la);
        sample_row(r, b, &tb, &lb);
        if (memcmp(a, b, (size_t)r->V * sizeof *a) != 0 || ta != tb || memcmp(&la, &lb, sizeof la) != 0) bad++;
        for (int v = 0; v < r->V; v++) {
            const double d = a[v] > b[v] ? a[v] - b[v] : b[v] - a[v];
            *worst = d > *worst ? d : *worst;
        }
    }
    return bad;
}

static void test_config(OpsCtx *o, const char *name, const char *json) {
    Rig r;
    rig_init(&r, o, json);
    float *ref = malloc((size_t)ROWS * r.V * sizeof *ref), *got = malloc((size_t)ROWS * r.V * sizeof *got);
    REQUIRE(ref && got, "out of memory");
    set_threads(1, 1);
    run_alone(&r, ref);
    // Threads (OpenBLAS, OpenMP), most sequences sharing a step, schedules.
    static const int THREADS[][2] = {{1, 1}, {2, 1}, {1, 2}, {2, 2}};
    static const int COMPANY[] = {1, 3, 8, 40};
    int schedules = 0, failed = 0;
    for (size_t t = 0; t < sizeof THREADS / sizeof *THREADS; t++) {
        set_threads(THREADS[t][0], THREADS[t][1]);
        run_alone(&r, got);
        double worst;
        int bad = count_mismatches(&r, ref, got, &worst);
        CHECK(bad == 0, "%s: alone, %d OpenBLAS / %d OpenMP threads: %d of %d rows differ (by up to %.3g)", name,
              THREADS[t][0], THREADS[t][1], bad, ROWS, worst);
        for (size_t c = 0; c < sizeof COMPANY / sizeof *COMPANY; c++)
            for (uint64_t seed = 1; seed <= 3; seed++) {
                run_shared(&r, 1000 * seed + 17 * c + t, COMPANY[c], got);
                bad = count_mismatches(&r, ref, got, &worst);
                schedules++;
                failed += bad != 0;
                CHECK(bad == 0,
                      "%s: shared with up to %d others (schedule %llu), %d OpenBLAS / %d OpenMP threads: %d of %d "
                      "rows differ from the target alone (by up to %.3g)",
                      name, COMPANY[c], (unsigned long long)seed, THREADS[t][0], THREADS[t][1], bad, ROWS, worst);
            }
    }
    printf("%s: %d shared schedules, %d differ from the target alone\n", name, schedules, failed);
    set_threads(1, 1);
    free(ref);
    free(got);
    rig_free(&r);
}

int main(void) {
    char err[512];
    OpsCtx *o;
    REQUIRE(ops_create(&o, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "%s", err);
    const int blas_threads = openblas_get_num_threads();
    for (size_t i = 0; i < sizeof CONFIGS / sizeof *CONFIGS; i++) test_config(o, CONFIGS[i][0], CONFIGS[i][1]);
    openblas_set_num_threads(blas_threads);
    ops_destroy(o);
    return check_exit_code("test_decode_batch_invariance");
}
