// test_rollout_engine.c — the generation engine end to end on a tiny random model (CPU backend), written to a
// temporary model folder together with a 64-character tokenizer (one character per id, Fuse decoder):
//   - greedy output equals the model core's model_generate_greedy, eos included; every reported logprob equals
//     the training forward's log-softmax of the same tokens (what the trainer computes); text = decode(tokens);
//   - n completions with seed s equal n separate n=1 requests with seeds s, s+1, ... (batch independence), bit for
//     bit: tokens and logprobs (the model's paged forward is batch-invariant, shared/model_layer.c);
//   - a tiny KV pool that forces preemption (with and without prefix caching) changes no output, not a bit, and the
//     stats count the preemptions; no block leaks;
//   - prefix-cache hits give the outputs of misses, bit for bit, and are reported; reset and a weight commit drop
//     them; a committed weight update gives exactly the new weights' greedy output, tagged with the new version;
//   - many concurrent requests of mixed lengths from several threads all complete correctly, each with the tokens
//     and logprobs it gets alone, bit for bit (which requests share a step is up to timing);
//   - stop strings (earliest match, include_stop_str), stop token ids, and text held back around them;
//   - clients that read ids only (no_text) get the same ids, logprobs and finishes without text (stop strings
//     still apply); a client waiting for finishes only (engine_request_wake_on_finish) gets each completion
//     whole, in one event;
//   - refusals (too long, bad parameters, queue full, stop strings without a tokenizer, bad configs), pause and
//     resume, a client that lets go early, and destroy with drain or abort.
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "rollout_server/engine.h"
#include "tests/unit/check_macros.h"
#include "tests/unit/testlib.h"

#define V 64
#define EOS 63
static const char *VOCAB_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .";
static const char *CONFIG =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 64, \"hidden_size\": 32, \"intermediate_size\": 48,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"max_position_embeddings\": 160,"
    " \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": false, \"eos_token_id\": 63, \"bos_token_id\": 0}";

static char dir_tok[256], dir_notok[256];

// ---- the model folder and a reference copy of the model -----------------------------------------

typedef struct {
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
} Ref;

static void die(const char *what, const char *err) {
    fprintf(stderr, "set-up failed: %s: %s\n", what, err);
    exit(1);
}

static void make_model_dirs(void) {
    char err[512];
    if (temp_dir_make("tandem_engine", dir_tok, sizeof dir_tok)) die("mkdtemp", strerror(errno));
    snprintf(dir_notok, sizeof dir_notok, "%.200s/notok", dir_tok);
    // The same random model (seed 11, std 0.5) twice; one character per id in the first folder's tokenizer.
    if (tiny_model_write_random(dir_tok, CONFIG, 11, 0.5f, err, sizeof err) ||
        tiny_model_write_random(dir_notok, CONFIG, 11, 0.5f, err, sizeof err))
        die("model", err);
    if (tiny_tokenizer_write(dir_tok, VOCAB_CHARS, err, sizeof err)) die("tokenizer", err);
}

static void ref_load(Ref *r, const char *dir) {
    char err[512];
    if (ops_create(&r->ops, OPS_BACKEND_CPU, 0, err, sizeof err) || model_load(&r->m, &r->w, r->ops, dir, err, sizeof err))
        die("reference model", err);
}

static void ref_free(Ref *r) {
    resident_free(&r->w, &r->m);
    model_free(&r->m);
    ops_destroy(r->ops);
}

// Greedy continuation of one prompt by the model core (stops after eos, which it keeps). Returns its length.
static int ref_greedy(Ref *r, const int32_t *prompt, int n, int max_new, int32_t *out) {
    char err[512];
    UnitSource src = resident_source(&r->w);
    const int32_t eos = EOS;
    if (model_generate_greedy(&r->m, &src, 1, &prompt, &n, max_new, &eos, 1, out, err, sizeof err)) die("greedy", err);
    int len = 0;
    while (len < max_new && out[len] >= 0) len++;
    return len;
}

// Training-forward logprobs (T = 1) of gen[0..n_gen) after prompt: what the trainer would compute.
static void ref_logprobs(Ref *r, const int32_t *prompt, int n_prompt, const int32_t *gen, int n_gen, float *out) {
    char err[512];
    const int N = n_prompt + n_gen;
    int32_t tok[512], tgt[512], cu[2] = {0, N};
    float lp[512];
    memcpy(tok, prompt, n_prompt * 4);
    memcpy(tok + n_prompt, gen, n_gen * 4);
    for (int i = 0; i < N; i++) tgt[i] = (i >= n_prompt - 1 && i < N - 1) ? tok[i + 1] : -1;
    TrainActs *a;
    if (train_acts_create(&a, &r->m, N, 1, 0, err, sizeof err)) die("acts", err);
    Batch b = {.n_seqs = 1, .n_tokens = N, .tokens = tok, .targets = tgt, .cu_seqlens = cu};
    UnitSource src = resident_source(&r->w);
    if (model_forward(&r->m, a, &src, &b, 1.0f, lp, NULL, NULL, err, sizeof err)) die("forward", err);
    train_acts_free(a, &r->m);
    for (int j = 0; j < n_gen; j++) out[j] = lp[n_prompt - 1 + j];
}

// ---- engine helpers -----------------------------------------------------------------------------

static Engine *make_engine(const char *dir, int n_blocks, int bs, int max_seqs, int max_tokens, int prefix) {
    EngineConfig c;
    engine_config_default(&c);
    c.model_dir = dir;
    c.block_size = bs;
    c.kv_cache_bytes = (size_t)n_blocks * 2 * 2 * bs * 2 * 8 * 4; // 2 (K,V) x 2 layers x bs x Hkv 2 x D 8 x fp32
    c.max_num_seqs = max_seqs;
    c.max_num_batched_tokens = max_tokens;
    c.enable_prefix_caching = prefix;
    c.seed = 5;
    Engine *e;
    char err[512];
    if (engine_create(&e, &c, err, sizeof err)) die("engine_create", err);
    return e;
}

typedef struct {
    int32_t tok[256];
    float lp[256];
    TokenLogprob top[256][3];
    int n, events;
    FinishReason fin;
    char text[1024];
    size_t text_len;
    char stop_reason[64];
    int32_t stop_token;
    int64_t version;
} Comp;

// Pops every event of r into comps (n of them). Returns 0, or -1 when an event did not come within 20 s.
static int collect(EngineRequest *r, Comp *c, int n) {
    memset(c, 0, sizeof *c * n);
    EngineEvent ev;
    int rc;
    while ((rc = engine_request_next(r, &ev, 20000)) == 1) {
        Comp *x = &c[ev.index];
        for (int i = 0; i < ev.n_tokens && x->n < 256; i++, x->n++) {
            x->tok[x->n] = ev.tokens[i];
            x->lp[x->n] = ev.logprobs[i];
            if (ev.top) memcpy(x->top[x->n], ev.top + i * 3, sizeof x->top[0]);
        }
        if (x->text_len + ev.text_len < sizeof x->text) {
            memcpy(x->text + x->text_len, ev.text, ev.text_len);
            x->text_len += ev.text_len;
        }
        x->events++;
        x->version = ev.policy_version;
        if (ev.finish != FINISH_NONE) {
            x->fin = ev.finish;
            x->stop_token = ev.stop_token;
            snprintf(x->stop_reason, sizeof x->stop_reason, "%s", ev.stop_reason ? ev.stop_reason : "");
        }
    }
    return rc == -1 ? 0 : -1;
}

static EngineRequest *submit(Engine *e, const int32_t *prompt, int n, const SamplingParams *p) {
    EngineRequest *r;
    char err[512];
    int rc = engine_submit(e, prompt, n, p, &r, err, sizeof err);
    CHECK(rc == 0, "submit: %s", err);
    return rc == 0 ? r : NULL;
}

static void run_one(Engine *e, const int32_t *prompt, int n, const SamplingParams *p, Comp *c) {
    EngineRequest *r = submit(e, prompt, n, p);
    if (!r) return;
    CHECK(collect(r, c, p->n) == 0, "request timed out");
    engine_request_release(r);
}

static void greedy_params(SamplingParams *p, int max_tokens) {
    sampling_params_default(p);
    p->temperature = 0.0f;
    p->max_tokens = max_tokens;
}

static void sample_params(SamplingParams *p, int n, int max_tokens, uint64_t seed) {
    sampling_params_default(p);
    p->n = n;
    p->max_tokens = max_tokens;
    p->temperature = 0.9f;
    p->top_k = 30;
    p->top_p = 0.95f;
    p->min_p = 0.02f;
    p->repetition_penalty = 1.1f;
    p->has_seed = 1;
    p->seed = seed;
}

static void random_prompt(int32_t *t, int n, unsigned seed) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((seed * 2654435761u + i * 40503u) >> 7) % (V - 1);
}

static int same_comp(const Comp *a, const Comp *b, double lp_tol) {
    if (a->n != b->n || a->fin != b->fin || memcmp(a->tok, b->tok, a->n * 4) != 0) return 0;
    for (int i = 0; i < a->n; i++)
        if (fabs(a->lp[i] - b->lp[i]) > lp_tol) return 0;
    return 1;
}

static void wait_idle(Engine *e) {
    EngineStats s;
    for (int i = 0; i < 5000; i++) {
        engine_stats(e, &s);
        if (s.requests_running == 0 && s.sequences_running == 0 && s.requests_waiting == 0) return;
        usleep(1000);
    }
}

// ---- tests --------------------------------------------------------------------------------------

static void test_greedy_reference(Ref *ref) {
    Engine *e = make_engine(dir_tok, 64, 16, 8, 64, 1);
    const int lens[4] = {3, 17, 40, 64};
    int32_t prompts[4][64];
    EngineRequest *r[4];
    SamplingParams p;
    greedy_params(&p, 24);
    p.top_logprobs = 3;
    for (int i = 0; i < 4; i++) { // all at once: they share steps
        random_prompt(prompts[i], lens[i], 100 + i);
        r[i] = submit(e, prompts[i], lens[i], &p);
    }
    for (int i = 0; i < 4; i++) {
        Comp c;
        int32_t want[24];
        float lp[24];
        CHECK(collect(r[i], &c, 1) == 0, "timeout");
        engine_request_release(r[i]);
        int n = ref_greedy(ref, prompts[i], lens[i], 24, want);
        CHECK(c.n == n && memcmp(c.tok, want, n * 4) == 0, "prompt %d: engine greedy differs from model_generate_greedy "
              "(%d vs %d tokens)", i, c.n, n);
        const int ended_by_eos = n > 0 && want[n - 1] == EOS;
        CHECK(c.fin == (ended_by_eos ? FINISH_STOP : FINISH_LENGTH), "prompt %d finish %s", i, finish_reason_name(c.fin));
        CHECK(!ended_by_eos || c.stop_token == EOS, "eos reported as the stop token");
        ref_logprobs(ref, prompts[i], lens[i], c.tok, c.n, lp);
        double worst = 0;
        for (int j = 0; j < c.n; j++) {
            worst = fmax(worst, fabs(c.lp[j] - lp[j]));
            CHECK(c.top[j][0].id == c.tok[j] && c.top[j][0].logprob == c.lp[j] && c.top[j][1].logprob <= c.top[j][0].logprob,
                  "greedy token is the best top logprob");
        }
        CHECK(worst < 1e-4, "prompt %d: logprobs differ from the training forward by %g", i, worst);
        char want_text[64];
        int nt = c.n - ended_by_eos; // the eos token's text is not part of the output
        for (int j = 0; j < nt; j++) want_text[j] = VOCAB_CHARS[c.tok[j]];
        CHECK(c.text_len == (size_t)nt && memcmp(c.text, want_text, nt) == 0, "prompt %d text '%.*s'", i,
              (int)c.text_len, c.text);
        CHECK(c.version == 0, "policy version 0 before any update");
    }
    EngineStats s;
    wait_idle(e);
    engine_stats(e, &s);
    CHECK(s.prompt_tokens_total == 3 + 17 + 40 + 64 && s.steps_total > 0 && s.step_seconds_buckets[11] == s.steps_total,
          "stats: %lld prompt tokens, %lld steps", (long long)s.prompt_tokens_total, (long long)s.steps_total);
    CHECK(s.kv_blocks_used == 0 && s.kv_blocks_total == 64, "blocks used %lld", (long long)s.kv_blocks_used);
    engine_destroy(e, 1000);
}

static void test_n_equals_separate(void) {
    Engine *e = make_engine(dir_tok, 64, 16, 16, 64, 1);
    int32_t prompt[21];
    random_prompt(prompt, 21, 7);
    SamplingParams p;
    sample_params(&p, 4, 24, 1234);
    Comp grouped[4], single[4];
    EngineRequest *g = submit(e, prompt, 21, &p), *s[4];
    for (int i = 0; i < 4; i++) {
        SamplingParams q;
        sample_params(&q, 1, 24, 1234 + i);
        s[i] = submit(e, prompt, 21, &q);
    }
    CHECK(collect(g, grouped, 4) == 0, "timeout");
    for (int i = 0; i < 4; i++) {
        CHECK(collect(s[i], &single[i], 1) == 0, "timeout");
        CHECK(same_comp(&grouped[i], &single[i], 0), "completion %d of n=4 differs from the n=1 request with seed+%d",
              i, i);
        engine_request_release(s[i]);
    }
    engine_request_release(g);
    int distinct = 0;
    for (int i = 1; i < 4; i++) distinct += memcmp(grouped[i].tok, grouped[0].tok, sizeof grouped[0].tok) != 0;
    CHECK(distinct == 3, "the 4 completions differ from each other");
    engine_destroy(e, 1000);
    // n larger than max_num_seqs: the forked completions that do not fit wait (holding the shared prompt blocks)
    // and run as seats free up. Same outputs.
    e = make_engine(dir_tok, 64, 16, 2, 64, 1);
    Comp narrow[4];
    g = submit(e, prompt, 21, &p);
    CHECK(collect(g, narrow, 4) == 0, "timeout");
    engine_request_release(g);
    for (int i = 0; i < 4; i++) CHECK(same_comp(&narrow[i], &single[i], 0), "max_num_seqs 2: completion %d differs", i);
    engine_destroy(e, 1000);
}

// The same batch of requests on a roomy pool and on tiny pools (which must preempt): identical outputs.
#define NPRE 6
static void run_mix(Engine *e, Comp out[NPRE][3]) {
    EngineRequest *r[NPRE];
    for (int i = 0; i < NPRE; i++) {
        int32_t prompt[32];
        const int len = 5 + 3 * i, max_new = 30 - 2 * i;
        random_prompt(prompt, len, 300 + i % 3); // requests 0 and 3 (1 and 4, ...) share a prefix
        SamplingParams p;
        if (i % 2) greedy_params(&p, max_new);
        else sample_params(&p, 3, max_new, 77 + i);
        r[i] = submit(e, prompt, len, &p);
    }
    for (int i = 0; i < NPRE; i++) {
        CHECK(collect(r[i], out[i], 3) == 0, "timeout");
        engine_request_release(r[i]);
    }
}

static void test_preemption(void) {
    static Comp big[NPRE][3], small[NPRE][3];
    Engine *e = make_engine(dir_tok, 256, 4, 8, 16, 1);
    run_mix(e, big);
    EngineStats s;
    engine_stats(e, &s);
    CHECK(s.preemptions_total == 0, "a roomy pool preempts nothing");
    engine_destroy(e, 1000);
    for (int prefix = 0; prefix < 2; prefix++) {
        e = make_engine(dir_tok, 12, 4, 8, 16, prefix); // 48 token slots; one request needs up to 35
        run_mix(e, small);
        wait_idle(e);
        engine_stats(e, &s);
        CHECK(s.preemptions_total > 0, "prefix %d: the tiny pool must preempt", prefix);
        CHECK(s.kv_blocks_used == 0, "prefix %d: %lld blocks leaked", prefix, (long long)s.kv_blocks_used);
        for (int i = 0; i < NPRE; i++)
            for (int j = 0; j < (i % 2 ? 1 : 3); j++)
                CHECK(same_comp(&big[i][j], &small[i][j], 0), "prefix %d: request %d completion %d changed under "
                      "preemption (%d vs %d tokens)", prefix, i, j, big[i][j].n, small[i][j].n);
        engine_destroy(e, 1000);
    }
}

static void test_prefix_cache_and_weights(Ref *ref) {
    Engine *e = make_engine(dir_tok, 64, 16, 8, 64, 1);
    int32_t prompt[40], other[40];
    random_prompt(prompt, 40, 9);
    memcpy(other, prompt, sizeof other);
    for (int i = 20; i < 40; i++) other[i] = (prompt[i] + 1) % (V - 1);
    SamplingParams p;
    sample_params(&p, 2, 12, 42);
    Comp a[2], b[2], c[2], d[2];
    EngineRequest *r = submit(e, prompt, 40, &p);
    collect(r, a, 2);
    CHECK(engine_request_cached_tokens(r) == 0, "first request: no hit");
    engine_request_release(r);
    r = submit(e, prompt, 40, &p);
    collect(r, b, 2);
    CHECK(engine_request_cached_tokens(r) == 32, "second request: 2 blocks hit (%d)", engine_request_cached_tokens(r));
    engine_request_release(r);
    CHECK(same_comp(&a[0], &b[0], 0) && same_comp(&a[1], &b[1], 0), "prefix hits change the output");
    r = submit(e, other, 40, &p);
    collect(r, c, 2);
    CHECK(engine_request_cached_tokens(r) == 16, "shared first block only (%d)", engine_request_cached_tokens(r));
    engine_request_release(r);
    EngineStats s;
    engine_stats(e, &s);
    CHECK(s.cached_prompt_tokens_total == 48 && s.kv_blocks_cached > 0, "cached prompt tokens %lld",
          (long long)s.cached_prompt_tokens_total);
    engine_reset_prefix_cache(e);
    engine_stats(e, &s);
    CHECK(s.kv_blocks_cached == 0, "reset empties the cache");
    r = submit(e, prompt, 40, &p);
    collect(r, d, 2);
    CHECK(engine_request_cached_tokens(r) == 0 && same_comp(&a[0], &d[0], 0), "after reset: a miss, same output");
    engine_request_release(r);

    // Weight update: stage every unit from a new random init, commit as version 7.
    Ref nw;
    ref_load(&nw, dir_tok);
    model_init_random(&nw.m, &nw.w, 999, 0.5f);
    for (int u = 0; u < nw.m.layout.n_units; u++) {
        float *st = engine_weights_staging(e, u);
        CHECK(st != NULL, "staging unit %d", u);
        if (st) ops_download_f32(nw.ops, st, nw.w.params[u], nw.m.layout.unit_numel[u]);
    }
    CHECK(engine_weights_staging(e, nw.m.layout.n_units) == NULL && engine_weights_staging(e, -1) == NULL,
          "no staging for a unit that does not exist");
    char err[256];
    CHECK(engine_commit_weights(e, 7, ENGINE_UPDATE_KEEP, NULL, err, sizeof err) == 0, "commit: %s", err);
    CHECK(engine_policy_version(e) == 7, "version 7");
    SamplingParams g;
    greedy_params(&g, 16);
    Comp x;
    r = submit(e, prompt, 40, &g);
    collect(r, &x, 1);
    CHECK(engine_request_cached_tokens(r) == 0, "a weight update drops the prefix cache");
    engine_request_release(r);
    int32_t want_new[16], want_old[16];
    int n_new = ref_greedy(&nw, prompt, 40, 16, want_new), n_old = ref_greedy(ref, prompt, 40, 16, want_old);
    CHECK(x.n == n_new && memcmp(x.tok, want_new, n_new * 4) == 0, "output of the new weights");
    CHECK(n_new != n_old || memcmp(want_new, want_old, n_new * 4) != 0, "the new weights must generate differently");
    CHECK(x.version == 7, "events carry version 7 (%lld)", (long long)x.version);
    ref_free(&nw);
    engine_destroy(e, 1000);
}

#define WORKER_REQUESTS 10
typedef struct {
    Engine *e;
    int id, bad;
    Comp out[WORKER_REQUESTS][3];   // each request's completions
} Worker;

// Request k of worker id: a prompt of 1..60 ids, 1..3 completions of up to 1..40 tokens, greedy every third.
static void worker_request(int id, int k, int32_t *prompt, int *len, SamplingParams *p) {
    const unsigned h = (unsigned)(id * 131 + k * 17);
    *len = 1 + h % 60;
    random_prompt(prompt, *len, h);
    sample_params(p, 1 + (h / 3) % 3, 1 + (h / 7) % 40, h);
    if (k % 3 == 0) p->temperature = 0.0f;
}

static void *worker(void *arg) {
    Worker *w = arg;
    for (int k = 0; k < WORKER_REQUESTS; k++) {
        int32_t prompt[64];
        int len;
        SamplingParams p;
        worker_request(w->id, k, prompt, &len, &p);
        Comp *c = w->out[k];
        EngineRequest *r;
        char err[256];
        if (engine_submit(w->e, prompt, len, &p, &r, err, sizeof err) != 0) {
            w->bad++;
            continue;
        }
        if (collect(r, c, p.n) != 0) w->bad++;
        for (int i = 0; i < p.n; i++) {
            const int ok_len = c[i].fin == FINISH_LENGTH && c[i].n == p.max_tokens;
            const int ok_eos = c[i].fin == FINISH_STOP && c[i].n > 0 && c[i].n <= p.max_tokens &&
                               c[i].tok[c[i].n - 1] == EOS;
            w->bad += !(ok_len || ok_eos);
        }
        engine_request_release(r);
    }
    return NULL;
}

static void test_concurrency(void) {
    Engine *e = make_engine(dir_tok, 40, 4, 6, 12, 1);
    pthread_t t[3];
    static Worker w[3];
    for (int i = 0; i < 3; i++) {
        w[i] = (Worker){.e = e, .id = i};
        pthread_create(&t[i], NULL, worker, &w[i]);
    }
    int bad = 0;
    for (int i = 0; i < 3; i++) {
        pthread_join(t[i], NULL);
        bad += w[i].bad;
    }
    CHECK(bad == 0, "%d of 30 concurrent requests went wrong", bad);
    EngineStats s;
    wait_idle(e);
    engine_stats(e, &s);
    CHECK(s.kv_blocks_used == 0 && s.requests_running == 0 && s.sequences_running == 0,
          "idle engine: %lld blocks used, %lld requests running", (long long)s.kv_blocks_used, (long long)s.requests_running);
    engine_destroy(e, 1000);
    // Each request again, alone on a fresh engine: the same tokens and logprobs, bit for bit, as among the others.
    e = make_engine(dir_tok, 40, 4, 6, 12, 1);
    int differ = 0;
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < WORKER_REQUESTS; k++) {
            int32_t prompt[64];
            int len;
            SamplingParams p;
            worker_request(i, k, prompt, &len, &p);
            Comp alone[3];
            run_one(e, prompt, len, &p, alone);
            for (int j = 0; j < p.n; j++) differ += !same_comp(&alone[j], &w[i].out[k][j], 0);
        }
    CHECK(differ == 0, "%d completions of the concurrent requests differ from the same requests run alone", differ);
    engine_destroy(e, 1000);
}

static void test_stops(void) {
    Engine *e = make_engine(dir_tok, 64, 16, 8, 64, 1);
    int32_t prompt[12];
    random_prompt(prompt, 12, 21);
    SamplingParams p;
    greedy_params(&p, 60);
    p.ignore_eos = 1;
    Comp base, c;
    run_one(e, prompt, 12, &p, &base);
    CHECK(base.n == 60 && base.text_len == 60, "60 tokens of one character each (%d, %zu)", base.n, base.text_len);
    // A stop string taken from the middle of the text: the output ends before its first occurrence.
    char stop[4] = {0}, stop2[3] = {0};
    memcpy(stop, base.text + 30, 3);
    const char *first = strstr(base.text, stop);
    const int at = (int)(first - base.text);
    p.stop[0] = stop;
    p.n_stop = 1;
    run_one(e, prompt, 12, &p, &c);
    CHECK(c.fin == FINISH_STOP && strcmp(c.stop_reason, stop) == 0 && c.stop_token == -1, "stop string reported");
    CHECK(c.text_len == (size_t)at && memcmp(c.text, base.text, at) == 0, "text cut before '%s' at %d (got %zu)", stop,
          at, c.text_len);
    CHECK(c.n == at + 3 && memcmp(c.tok, base.tok, c.n * 4) == 0, "tokens up to the one completing the stop (%d)", c.n);
    p.include_stop_str = 1;
    run_one(e, prompt, 12, &p, &c);
    CHECK(c.text_len == (size_t)at + 3 && memcmp(c.text, base.text, at + 3) == 0, "include_stop_str keeps it");
    // Two stop strings: the earliest match wins even when listed second.
    p.include_stop_str = 0;
    memcpy(stop2, base.text + 4, 2);
    const int at2 = (int)(strstr(base.text, stop2) - base.text);
    p.stop[1] = stop2;
    p.n_stop = 2;
    run_one(e, prompt, 12, &p, &c);
    CHECK(c.text_len == (size_t)(at2 < at ? at2 : at) && strcmp(c.stop_reason, at2 < at ? stop2 : stop) == 0,
          "earliest stop wins");
    // A stop token id: included in tokens and logprobs, not in the text.
    p.n_stop = 0;
    p.stop_token_ids[0] = base.tok[20];
    p.n_stop_token_ids = 1;
    int k = 0;
    while (base.tok[k] != base.tok[20]) k++;
    run_one(e, prompt, 12, &p, &c);
    CHECK(c.fin == FINISH_STOP && c.stop_token == base.tok[20] && c.n == k + 1 && c.text_len == (size_t)k,
          "stop token at %d: %d tokens, %zu chars", k, c.n, c.text_len);
    engine_destroy(e, 1000);
}

// Resumes the engine, pauses it for 200 ms once it has run two steps, and resumes it again.
static void *resume_pause_resume(void *arg) {
    Engine *e = arg;
    EngineStats s;
    engine_stats(e, &s);
    const int64_t steps0 = s.steps_total;
    usleep(20000); // the client is waiting by now
    engine_resume(e);
    do engine_stats(e, &s);
    while (s.steps_total < steps0 + 2);
    engine_pause(e);
    usleep(200000);
    engine_resume(e);
    return NULL;
}

static void test_quiet_clients(void) {
    Engine *e = make_engine(dir_tok, 64, 16, 8, 64, 1);
    int32_t prompt[12];
    random_prompt(prompt, 12, 33);
    SamplingParams p;
    sample_params(&p, 2, 40, 9);
    p.ignore_eos = 1;
    Comp base[2], c[2];
    run_one(e, prompt, 12, &p, base);
    p.no_text = 1;
    run_one(e, prompt, 12, &p, c);
    for (int j = 0; j < 2; j++)
        CHECK(same_comp(&base[j], &c[j], 0) && base[j].text_len == 40 && c[j].text_len == 0,
              "no_text, completion %d: %d vs %d tokens, text %zu vs %zu bytes", j, c[j].n, base[j].n, c[j].text_len,
              base[j].text_len);
    // A stop string needs the text: with no_text it still ends the completion where it did.
    char stop[4] = {0};
    memcpy(stop, base[0].text + 25, 3);
    p.stop[0] = stop;
    p.n_stop = 1;
    p.no_text = 0;
    run_one(e, prompt, 12, &p, base);
    p.no_text = 1;
    run_one(e, prompt, 12, &p, c);
    CHECK(base[0].fin == FINISH_STOP && same_comp(&base[0], &c[0], 0) && c[0].text_len == base[0].text_len &&
          memcmp(c[0].text, base[0].text, c[0].text_len) == 0, "no_text with a stop string: %s after %d tokens",
          finish_reason_name(c[0].fin), c[0].n);
    // Waiting from before the first step, a wake-on-finish client sleeps through all the steps, and through a
    // pause with tokens queued (a client woken per step would take them then): both completions (finishing in the
    // same step) come whole.
    p.n_stop = 0;
    p.max_tokens = 140;
    run_one(e, prompt, 12, &p, base);
    engine_pause(e);
    EngineRequest *r = submit(e, prompt, 12, &p);
    engine_request_wake_on_finish(r);
    pthread_t th;
    if (pthread_create(&th, NULL, resume_pause_resume, e) != 0) die("pthread_create", "resume thread");
    EngineEvent ev;
    int got[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        const int rc = engine_request_next(r, &ev, 20000);
        CHECK(rc == 1 && ev.n_tokens == 140 && ev.finish == FINISH_LENGTH &&
                  memcmp(ev.tokens, base[ev.index].tok, 140 * 4) == 0,
              "event %d: rc %d, completion %d, %d tokens, %s", k, rc, ev.index, ev.n_tokens,
              finish_reason_name(ev.finish));
        if (rc == 1) got[ev.index & 1]++;
    }
    CHECK(got[0] == 1 && got[1] == 1 && engine_request_next(r, &ev, 1000) == -1, "one event per completion, then done");
    pthread_join(th, NULL);
    engine_request_release(r);
    engine_destroy(e, 1000);
}

static void test_refusals(void) {
    Engine *e = make_engine(dir_tok, 8, 16, 4, 64, 1); // 128 token slots; context 160
    int32_t prompt[200];
    random_prompt(prompt, 200, 3);
    SamplingParams p;
    EngineRequest *r;
    char err[256];
    greedy_params(&p, 10);
    CHECK(engine_submit(e, prompt, 155, &p, &r, err, sizeof err) == ENGINE_ETOOLONG, "beyond the context");
    CHECK(strstr(err, "context") != NULL, "message names the context: %s", err);
    CHECK(engine_submit(e, prompt, 125, &p, &r, err, sizeof err) == ENGINE_ETOOLONG, "beyond the cache");
    CHECK(strstr(err, "--kv-cache-memory") != NULL, "message names the flag: %s", err);
    struct {
        const char *what;
        SamplingParams p;
    } bad[12];
    for (int i = 0; i < 12; i++) greedy_params(&bad[i].p, 4);
    bad[0].p.n = 0, bad[0].what = "n";
    bad[1].p.max_tokens = 0, bad[1].what = "max_tokens";
    bad[2].p.temperature = -1, bad[2].what = "temperature";
    bad[3].p.temperature = NAN, bad[3].what = "temperature";
    bad[4].p.top_p = 0, bad[4].what = "top_p";
    bad[5].p.top_p = 1.5f, bad[5].what = "top_p";
    bad[6].p.min_p = 2, bad[6].what = "min_p";
    bad[7].p.repetition_penalty = 0, bad[7].what = "repetition_penalty";
    bad[8].p.top_logprobs = 21, bad[8].what = "logprobs";
    bad[9].p.stop[0] = "", bad[9].p.n_stop = 1, bad[9].what = "stop";
    bad[10].p.stop_token_ids[0] = V, bad[10].p.n_stop_token_ids = 1, bad[10].what = "stop token";
    bad[11].p.top_k = -2, bad[11].what = "top_k";
    for (int i = 0; i < 12; i++) {
        CHECK(engine_submit(e, prompt, 5, &bad[i].p, &r, err, sizeof err) == ENGINE_EINVAL, "bad %s accepted", bad[i].what);
        CHECK(strstr(err, bad[i].what) != NULL, "message '%s' names %s", err, bad[i].what);
    }
    int32_t oov[2] = {1, V};
    CHECK(engine_submit(e, oov, 2, &p, &r, err, sizeof err) == ENGINE_EINVAL, "token outside the vocabulary");
    CHECK(engine_submit(e, prompt, 0, &p, &r, err, sizeof err) == ENGINE_EINVAL, "empty prompt");
    engine_destroy(e, 1000);

    // No tokenizer: stop strings are refused, text is empty, stop ids still work.
    e = make_engine(dir_notok, 16, 16, 4, 64, 1);
    CHECK(engine_tokenizer(e) == NULL && strcmp(engine_model_id(e), "notok") == 0, "no tokenizer, id from the folder");
    p.stop[0] = "x";
    p.n_stop = 1;
    CHECK(engine_submit(e, prompt, 5, &p, &r, err, sizeof err) == ENGINE_EINVAL && strstr(err, "tokenizer"),
          "stop strings need a tokenizer: %s", err);
    p.n_stop = 0;
    Comp c;
    run_one(e, prompt, 5, &p, &c);
    CHECK(c.n > 0 && c.text_len == 0, "tokens without text");
    engine_destroy(e, 1000);

    // Configurations that cannot work say which flag to change.
    EngineConfig cfg;
    engine_config_default(&cfg);
    cfg.model_dir = dir_tok;
    cfg.kv_cache_bytes = 4096; // one block of 16 tokens; a step needs 2048 / 16
    CHECK(engine_create(&e, &cfg, err, sizeof err) == ENGINE_EINVAL && strstr(err, "--kv-cache-memory"), "%s", err);
    engine_config_default(&cfg);
    cfg.model_dir = dir_tok;
    cfg.max_num_batched_tokens = 8;
    CHECK(engine_create(&e, &cfg, err, sizeof err) == ENGINE_EINVAL && strstr(err, "--max-num-batched-tokens"), "%s", err);
    cfg.model_dir = "/nonexistent/model";
    cfg.max_num_batched_tokens = 2048;
    CHECK(engine_create(&e, &cfg, err, sizeof err) != 0 && strstr(err, "/nonexistent/model"), "%s", err);
}

static void test_control(void) {
    EngineConfig cfg;
    engine_config_default(&cfg);
    cfg.model_dir = dir_tok;
    cfg.kv_cache_bytes = 64 * 4096;
    cfg.max_num_seqs = 4;
    cfg.max_num_batched_tokens = 64;
    cfg.max_queued_requests = 2;
    Engine *e;
    char err[256];
    if (engine_create(&e, &cfg, err, sizeof err)) die("engine", err);
    int32_t prompt[8];
    random_prompt(prompt, 8, 5);
    SamplingParams p;
    greedy_params(&p, 8);
    p.ignore_eos = 1;
    EngineRequest *r[3];
    EngineEvent ev;
    engine_pause(e);
    r[0] = submit(e, prompt, 8, &p);
    r[1] = submit(e, prompt, 8, &p);
    CHECK(engine_submit(e, prompt, 8, &p, &r[2], err, sizeof err) == ENGINE_EQUEUE_FULL, "queue of 2 is full");
    CHECK(engine_request_next(r[0], &ev, 100) == 0, "nothing runs while paused");
    EngineStats s;
    engine_stats(e, &s);
    CHECK(s.paused == 1 && s.requests_waiting == 2 && s.steps_total == 0, "paused stats");
    engine_resume(e);
    Comp c0, c1;
    CHECK(collect(r[0], &c0, 1) == 0 && collect(r[1], &c1, 1) == 0 && c0.n == 8 && same_comp(&c0, &c1, 0),
          "after resume: %d and %d tokens, %s", c0.n, c1.n, finish_reason_name(c0.fin));
    engine_request_release(r[0]);
    engine_request_release(r[1]);

    // A client that lets go before its request runs, and one that lets go while it runs (the engine is paused
    // around the release, so the token counts are exact): the engine generates nothing more and frees the blocks.
    p.max_tokens = 150;
    wait_idle(e); // the stats are published after the step that emitted the last event
    engine_stats(e, &s);
    const int64_t g0 = s.generation_tokens_total;
    engine_pause(e);
    r[0] = submit(e, prompt, 8, &p);
    SamplingParams p5 = p;
    p5.max_tokens = 5;
    r[1] = submit(e, prompt, 8, &p5); // queued behind r[0]: releasing r[0] must not lose it
    engine_request_release(r[0]);
    engine_resume(e);
    CHECK(collect(r[1], &c1, 1) == 0 && c1.n == 5 && c1.fin == FINISH_LENGTH, "the request queued behind completes");
    engine_request_release(r[1]);
    wait_idle(e);
    engine_stats(e, &s);
    CHECK(s.generation_tokens_total == g0 + 5 && s.kv_blocks_used == 0 && s.requests_waiting == 0,
          "released before admission: %lld tokens", (long long)(s.generation_tokens_total - g0));
    r[0] = submit(e, prompt, 8, &p);
    CHECK(engine_request_next(r[0], &ev, 20000) == 1, "first event");
    engine_pause(e);
    engine_stats(e, &s);
    const int64_t g1 = s.generation_tokens_total;
    engine_request_release(r[0]);
    engine_resume(e);
    wait_idle(e);
    engine_stats(e, &s);
    CHECK(s.requests_running == 0 && s.kv_blocks_used == 0, "an abandoned request frees everything");
    CHECK(s.generation_tokens_total == g1, "nothing generated after the release (%lld more)",
          (long long)(s.generation_tokens_total - g1));

    // Destroy with a drain: a short request finishes normally. Then destroy without one: requests are aborted.
    p.max_tokens = 6;
    r[0] = submit(e, prompt, 8, &p);
    engine_destroy(e, 20000);
    CHECK(collect(r[0], &c0, 1) == 0 && c0.fin == FINISH_LENGTH && c0.n == 6, "drained: %s with %d tokens",
          finish_reason_name(c0.fin), c0.n);
    engine_request_release(r[0]); // after destroy: the handle outlives the engine

    if (engine_create(&e, &cfg, err, sizeof err)) die("engine", err);
    p.max_tokens = 150;
    r[0] = submit(e, prompt, 8, &p);
    CHECK(engine_request_next(r[0], &ev, 20000) == 1, "running");
    const int got = ev.n_tokens;
    const FinishReason first_fin = ev.finish;
    engine_pause(e); // r[1] is queued behind the pause: it never runs
    p.n = 2;
    r[1] = submit(e, prompt, 8, &p);
    engine_destroy(e, 0);
    Comp a[2];
    CHECK(collect(r[0], a, 1) == 0, "r[0] ends");
    if (first_fin != FINISH_NONE) a[0].fin = first_fin;
    // r[0] is aborted mid-way, unless it raced to its end before the pause (then it is complete).
    CHECK(a[0].fin == FINISH_ABORT || (a[0].fin == FINISH_LENGTH && got + a[0].n == 150), "r[0]: %s after %d tokens",
          finish_reason_name(a[0].fin), got + a[0].n);
    int rc1 = collect(r[1], a, 2);
    CHECK(rc1 == 0 && a[0].fin == FINISH_ABORT && a[1].fin == FINISH_ABORT && a[0].n == 0,
          "both completions of the queued request aborted (rc %d, %s %s, %d tokens)", rc1, finish_reason_name(a[0].fin),
          finish_reason_name(a[1].fin), a[0].n);
    engine_request_release(r[0]);
    engine_request_release(r[1]);
}

int main(void) {
    make_model_dirs();
    Ref ref;
    ref_load(&ref, dir_tok);
    test_greedy_reference(&ref);
    test_n_equals_separate();
    test_preemption();
    test_prefix_cache_and_weights(&ref);
    test_concurrency();
    test_stops();
    test_quiet_clients();
    test_refusals();
    test_control();
    ref_free(&ref);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir_tok);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir_tok);
    if (failures) {
        fprintf(stderr, "test_rollout_engine: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_rollout_engine: all passed\n");
    return 0;
}
