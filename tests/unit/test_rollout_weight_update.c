// test_rollout_weight_update.c — weight updates that land while sequences are running (issue 24: in-flight
// updates), on a tiny random model (CPU backend) and a second random set of weights for the update:
//   - mode keep, the update landing while the engine is paused mid-generation: every in-flight completion finishes
//     with all its tokens; each records exactly one version change, at the first token sampled after the commit;
//     the tokens before it are the old weights' greedy tokens, the tokens after it the new weights' greedy
//     continuation of the prompt plus that prefix (so the K/V of the prefix was recomputed under the new weights),
//     and every logprob is the training forward's under the weights of its version; the commit leaves no KV block
//     of the old weights in use or cached, and a request after it gets the new weights' output;
//   - mode abort, the update landing while the engine runs: completions of requests that take restarts start over
//     (one `restarted` event each) and end equal, tokens, logprobs and text, to a fresh run under the new weights;
//     a request that does not take restarts (a stream) is kept, as in mode keep;
//   - mode keep_kv: the completions keep their blocks and run no prefill after the update, still recording the
//     change, and a request after it gets the new weights' output (no prefix hit);
//   - the commit report, the stats counters and the pause histogram (a pause held across the commit is counted).
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rollout_server/engine.h"
#include "tests/unit/check_macros.h"
#include "tests/unit/testlib.h"

#define V 64
#define EOS 63
#define NEW_VERSION 7
#define MAX_NEW 400   // tokens per completion: long enough that an update posted while the engine runs lands
                      // inside every completion
static const char *VOCAB_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .";
static const char *CONFIG =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 64, \"hidden_size\": 32, \"intermediate_size\": 48,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"max_position_embeddings\": 512,"
    " \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": false, \"eos_token_id\": 63, \"bos_token_id\": 0}";

static char model_dir[256];

static void die(const char *what, const char *err) {
    fprintf(stderr, "set-up failed: %s: %s\n", what, err);
    exit(1);
}

// ---- reference models: the old weights (from the folder) and the new ones (random seed 999) ----------------

typedef struct {
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
} Ref;

static void ref_load(Ref *r, uint64_t new_seed) {
    char err[512];
    if (ops_create(&r->ops, OPS_BACKEND_CPU, 0, err, sizeof err) ||
        model_load(&r->m, &r->w, r->ops, model_dir, err, sizeof err))
        die("reference model", err);
    if (new_seed) model_init_random(&r->m, &r->w, new_seed, 0.5f);
}

static void ref_free(Ref *r) {
    resident_free(&r->w, &r->m);
    model_free(&r->m);
    ops_destroy(r->ops);
}

// Greedy continuation (max_new tokens, eos ignored as the requests here ignore it) of prompt[0..n).
static void ref_greedy(Ref *r, const int32_t *prompt, int n, int max_new, int32_t *out) {
    char err[512];
    UnitSource src = resident_source(&r->w);
    if (model_generate_greedy(&r->m, &src, 1, &prompt, &n, max_new, NULL, 0, out, err, sizeof err))
        die("greedy", err);
}

// Training-forward logprobs (T = 1) of gen[0..n_gen) after prompt: what the trainer computes.
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

// ---- engine side --------------------------------------------------------------------------------

static Engine *make_engine(void) {
    EngineConfig c;
    engine_config_default(&c);
    c.model_dir = model_dir;
    c.block_size = 4;
    c.kv_cache_bytes = (size_t)2048 * 2 * 2 * 4 * 2 * 8 * 4; // 2048 blocks: 2 (K,V) x 2 layers x bs x Hkv 2 x D 8 x fp32
    c.max_num_seqs = 8;
    c.max_num_batched_tokens = 64;
    c.enable_prefix_caching = 1;
    c.seed = 5;
    Engine *e;
    char err[512];
    if (engine_create(&e, &c, err, sizeof err)) die("engine_create", err);
    return e;
}

static EngineRequest *submit(Engine *e, const int32_t *prompt, int n, const SamplingParams *p, int restartable) {
    EngineRequest *r;
    char err[512];
    if (engine_submit(e, prompt, n, p, &r, err, sizeof err)) die("submit", err);
    if (restartable) engine_request_allow_restart(r);
    return r;
}

static void greedy_params(SamplingParams *p) {
    sampling_params_default(p);
    p->temperature = 0.0f;
    p->max_tokens = MAX_NEW;
    p->ignore_eos = 1;
}

static void sampled_params(SamplingParams *p, int n, uint64_t seed) {
    sampling_params_default(p);
    p->n = n;
    p->max_tokens = MAX_NEW;
    p->ignore_eos = 1;
    p->has_seed = 1;
    p->seed = seed;
}

// One completion as the client sees it, with the version of every token.
typedef struct {
    int32_t tok[MAX_NEW];
    float lp[MAX_NEW];
    int64_t ver[MAX_NEW];
    char text[4 * MAX_NEW];
    size_t text_len;
    int n, restarts;
    FinishReason fin;
} Comp;

static void take(Comp *comps, const EngineEvent *ev) {
    Comp *c = &comps[ev->index];
    if (ev->restarted) { // what came before is void
        c->n = 0;
        c->text_len = 0;
        c->restarts++;
    }
    for (int i = 0; i < ev->n_tokens && c->n < MAX_NEW; i++, c->n++) {
        c->tok[c->n] = ev->tokens[i];
        c->lp[c->n] = ev->logprobs[i];
        c->ver[c->n] = ev->policy_version;
    }
    if (c->text_len + ev->text_len <= sizeof c->text) {
        memcpy(c->text + c->text_len, ev->text, ev->text_len);
        c->text_len += ev->text_len;
    }
    if (ev->finish != FINISH_NONE) c->fin = ev->finish;
}

// Takes every event queued now.
static void drain(EngineRequest *r, Comp *comps) {
    EngineEvent ev;
    while (engine_request_next(r, &ev, 0) == 1) take(comps, &ev);
}

// Takes every event to the end. Returns 0, or -1 when an event did not come within 20 s.
static int collect(EngineRequest *r, Comp *comps) {
    EngineEvent ev;
    int rc;
    while ((rc = engine_request_next(r, &ev, 20000)) == 1) take(comps, &ev);
    return rc == -1 ? 0 : -1;
}

// Takes events of r until completion 0 has at least n tokens.
static void wait_tokens(EngineRequest *r, Comp *comps, int n) {
    EngineEvent ev;
    while (comps[0].n < n)
        if (engine_request_next(r, &ev, 20000) != 1) die("wait_tokens", "no event within 20 s");
        else take(comps, &ev);
}

static void stage_weights(Engine *e, Ref *nw) {
    for (int u = 0; u < nw->m.layout.n_units; u++) {
        float *st = engine_weights_staging(e, u);
        if (!st) die("staging", "no staging buffer");
        ops_download_f32(nw->ops, st, nw->w.params[u], nw->m.layout.unit_numel[u]);
    }
}

// Where completion c switched to NEW_VERSION: the index of its first such token, -1 when its versions are not
// exactly 0 .. 0 then NEW_VERSION .. NEW_VERSION, with both present.
static int change_point(const Comp *c) {
    int m = 0;
    while (m < c->n && c->ver[m] == 0) m++;
    for (int i = m; i < c->n; i++)
        if (c->ver[i] != NEW_VERSION) return -1;
    return m > 0 && m < c->n ? m : -1;
}

static void random_prompt(int32_t *t, int n, unsigned seed) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((seed * 2654435761u + i * 40503u) >> 7) % (V - 1);
}

// Greedy completion c of prompt: its tokens before the change are the old weights', after it the new weights'
// continuation of prompt + that prefix; each logprob is that of its version's weights on the whole prefix.
static void check_kept_greedy(const char *name, const Comp *c, int m, const int32_t *prompt, int n_prompt, Ref *old,
                              Ref *nw) {
    int32_t want_old[MAX_NEW], ctx[512], want_new[MAX_NEW];
    ref_greedy(old, prompt, n_prompt, m, want_old);
    CHECK(memcmp(c->tok, want_old, (size_t)m * 4) == 0, "%s: the %d tokens before the update are not the old "
          "weights' greedy tokens", name, m);
    memcpy(ctx, prompt, (size_t)n_prompt * 4);
    memcpy(ctx + n_prompt, c->tok, (size_t)m * 4);
    ref_greedy(nw, ctx, n_prompt + m, MAX_NEW - m, want_new);
    CHECK(memcmp(c->tok + m, want_new, (size_t)(MAX_NEW - m) * 4) == 0, "%s: the tokens after the update (from %d) "
          "are not the new weights' greedy continuation of the prefix", name, m);
}

// Every logprob of c equals the training forward's under the weights of its token's version.
static void check_logprobs(const char *name, const Comp *c, int m, const int32_t *prompt, int n_prompt, Ref *old,
                           Ref *nw) {
    float lp_old[MAX_NEW], lp_new[MAX_NEW];
    ref_logprobs(old, prompt, n_prompt, c->tok, c->n, lp_old);
    ref_logprobs(nw, prompt, n_prompt, c->tok, c->n, lp_new);
    double worst = 0;
    for (int i = 0; i < c->n; i++) worst = fmax(worst, fabs(c->lp[i] - (i < m ? lp_old[i] : lp_new[i])));
    CHECK(worst < 1e-4, "%s: logprobs differ from the training forward of their version by %g", name, worst);
}

static void test_keep(Ref *old, Ref *nw) {
    Engine *e = make_engine();
    int32_t pa[12], pb[9], pc[14];
    random_prompt(pa, 12, 1);
    random_prompt(pb, 9, 2);
    random_prompt(pc, 14, 3);
    SamplingParams g, s;
    greedy_params(&g);
    sampled_params(&s, 2, 77);
    // pa's blocks go into the prefix cache under the old weights.
    Comp warm[1] = {0};
    EngineRequest *w = submit(e, pa, 12, &g, 0);
    CHECK(collect(w, warm) == 0, "warm-up request timed out");
    engine_request_release(w);

    engine_pause(e);
    Comp a[1] = {0}, b[2] = {0}, c[2] = {0};
    SamplingParams g2 = g;
    g2.n = 2;
    EngineRequest *ra = submit(e, pa, 12, &g, 0), *rb = submit(e, pb, 9, &g2, 0), *rc = submit(e, pc, 14, &s, 0);
    engine_resume(e);
    wait_tokens(ra, a, 4);
    engine_pause(e); // after this step nothing runs: what the clients have now is what the old weights made
    drain(ra, a);
    drain(rb, b);
    drain(rc, c);
    const int m_a = a[0].n, m_b[2] = {b[0].n, b[1].n}, m_c[2] = {c[0].n, c[1].n};
    REQUIRE(m_a < MAX_NEW && m_b[0] > 0 && m_b[1] > 0 && m_c[0] > 0 && m_c[1] > 0,
            "the update must land inside every completion (tokens before it: %d, %d %d, %d %d)", m_a, m_b[0], m_b[1],
            m_c[0], m_c[1]);

    stage_weights(e, nw);
    EngineCommitReport rep;
    char err[256];
    CHECK(engine_commit_weights(e, NEW_VERSION, ENGINE_UPDATE_KEEP, &rep, err, sizeof err) == 0, "commit: %s", err);
    CHECK(rep.sequences_kept == 5 && rep.sequences_requeued == 0, "report: %lld kept, %lld re-queued (want 5, 0)",
          (long long)rep.sequences_kept, (long long)rep.sequences_requeued);
    EngineStats st;
    engine_stats(e, &st);
    CHECK(st.kv_blocks_used == 0 && st.kv_blocks_cached == 0, "after the commit no block of the old weights is in "
          "use or cached (%lld used, %lld cached)", (long long)st.kv_blocks_used, (long long)st.kv_blocks_cached);
    CHECK(st.weight_updates_total == 1 && st.weight_update_sequences_kept_total == 5, "stats: %lld updates, %lld kept",
          (long long)st.weight_updates_total, (long long)st.weight_update_sequences_kept_total);
    usleep(50000); // the pause held across the commit counts as the update's pause
    engine_resume(e);
    CHECK(collect(ra, a) == 0 && collect(rb, b) == 0 && collect(rc, c) == 0, "requests timed out");

    const Comp *all[5] = {&a[0], &b[0], &b[1], &c[0], &c[1]};
    const int m_all[5] = {m_a, m_b[0], m_b[1], m_c[0], m_c[1]};
    for (int k = 0; k < 5; k++)
        CHECK(all[k]->n == MAX_NEW && all[k]->fin == FINISH_LENGTH && all[k]->restarts == 0 &&
                  change_point(all[k]) == m_all[k],
              "completion %d: %d tokens, %s, %d restarts; version change at %d, the update landed after token %d", k,
              all[k]->n, finish_reason_name(all[k]->fin), all[k]->restarts, change_point(all[k]), m_all[k]);
    check_kept_greedy("A", &a[0], m_a, pa, 12, old, nw);
    check_kept_greedy("B0", &b[0], m_b[0], pb, 9, old, nw);
    check_kept_greedy("B1", &b[1], m_b[1], pb, 9, old, nw);
    check_logprobs("A", &a[0], m_a, pa, 12, old, nw);
    check_logprobs("C0", &c[0], m_c[0], pc, 14, old, nw);
    check_logprobs("C1", &c[1], m_c[1], pc, 14, old, nw);
    engine_request_release(ra);
    engine_request_release(rb);
    engine_request_release(rc);

    // A request after the update gets the new weights' output: no K/V of the old weights is matched.
    Comp d[1] = {0};
    int32_t want[MAX_NEW];
    EngineRequest *rd = submit(e, pa, 12, &g, 0);
    CHECK(collect(rd, d) == 0, "request after the update timed out");
    engine_request_release(rd);
    ref_greedy(nw, pa, 12, MAX_NEW, want);
    CHECK(d[0].n == MAX_NEW && memcmp(d[0].tok, want, sizeof want) == 0 && d[0].ver[0] == NEW_VERSION,
          "a request after the update: not the new weights' greedy output");
    engine_stats(e, &st);
    CHECK(st.weight_update_pause_buckets[10] == 1 && st.weight_update_pause_seconds_sum >= 0.05 &&
              st.weight_update_pause_buckets[0] == 0,
          "pause histogram: %lld updates, %g s (the engine stood still for >= 50 ms)",
          (long long)st.weight_update_pause_buckets[10], st.weight_update_pause_seconds_sum);
    engine_destroy(e, 1000);
}

static void test_abort(Ref *old, Ref *nw) {
    Engine *e = make_engine();
    int32_t pa[12], pb[9], pc[14];
    random_prompt(pa, 12, 4);
    random_prompt(pb, 9, 5);
    random_prompt(pc, 14, 6);
    SamplingParams g, s;
    greedy_params(&g);
    sampled_params(&s, 2, 1234);
    Comp a[1] = {0}, b[1] = {0}, c[2] = {0};
    stage_weights(e, nw);
    engine_pause(e);
    EngineRequest *ra = submit(e, pa, 12, &g, 1), *rb = submit(e, pb, 9, &g, 0), *rc = submit(e, pc, 14, &s, 1);
    engine_resume(e);
    wait_tokens(ra, a, 4);
    // The update lands while the engine runs (no pause): between two of its steps.
    EngineCommitReport rep;
    char err[256];
    CHECK(engine_commit_weights(e, NEW_VERSION, ENGINE_UPDATE_ABORT, &rep, err, sizeof err) == 0, "commit: %s", err);
    CHECK(rep.sequences_requeued == 3 && rep.sequences_kept == 1, "report: %lld kept, %lld re-queued (want 1, 3)",
          (long long)rep.sequences_kept, (long long)rep.sequences_requeued);
    CHECK(collect(ra, a) == 0 && collect(rb, b) == 0 && collect(rc, c) == 0, "requests timed out");

    // Re-queued: one restart each, then exactly a fresh run under the new weights.
    int32_t want[MAX_NEW];
    ref_greedy(nw, pa, 12, MAX_NEW, want);
    CHECK(a[0].restarts == 1 && a[0].n == MAX_NEW && memcmp(a[0].tok, want, sizeof want) == 0 &&
              a[0].ver[0] == NEW_VERSION && change_point(&a[0]) == -1 && a[0].ver[MAX_NEW - 1] == NEW_VERSION,
          "A (re-queued): %d restarts, %d tokens; not the new weights' greedy output", a[0].restarts, a[0].n);
    check_logprobs("A", &a[0], 0, pa, 12, old, nw);
    Comp fresh[2] = {0};
    EngineRequest *rf = submit(e, pc, 14, &s, 1);
    CHECK(collect(rf, fresh) == 0, "fresh request timed out");
    engine_request_release(rf);
    for (int i = 0; i < 2; i++)
        CHECK(c[i].restarts == 1 && c[i].n == fresh[i].n && memcmp(c[i].tok, fresh[i].tok, sizeof c[i].tok) == 0 &&
                  memcmp(c[i].lp, fresh[i].lp, sizeof c[i].lp) == 0 && c[i].text_len == fresh[i].text_len &&
                  memcmp(c[i].text, fresh[i].text, c[i].text_len) == 0 && c[i].ver[0] == NEW_VERSION &&
                  c[i].ver[c[i].n - 1] == NEW_VERSION,
              "C%d (re-queued, sampled): %d restarts; tokens, logprobs or text differ from a fresh run under the new "
              "weights", i, c[i].restarts);
    // Not restartable: kept, with its change point.
    const int m_b = change_point(&b[0]);
    CHECK(b[0].restarts == 0 && b[0].n == MAX_NEW && m_b > 0, "B (kept): %d restarts, %d tokens, change at %d",
          b[0].restarts, b[0].n, m_b);
    if (m_b > 0) check_kept_greedy("B", &b[0], m_b, pb, 9, old, nw);
    engine_request_release(ra);
    engine_request_release(rb);
    engine_request_release(rc);
    EngineStats st;
    engine_stats(e, &st);
    CHECK(st.weight_updates_total == 1 && st.weight_update_sequences_requeued_total == 3 &&
              st.weight_update_sequences_kept_total == 1 && st.weight_update_pause_buckets[10] == 1,
          "stats: %lld updates, %lld re-queued, %lld kept, %lld pauses", (long long)st.weight_updates_total,
          (long long)st.weight_update_sequences_requeued_total, (long long)st.weight_update_sequences_kept_total,
          (long long)st.weight_update_pause_buckets[10]);
    engine_destroy(e, 1000);
}

// Mode keep_kv: the completions go on with the K/V of the old weights (no recompute: the engine runs no prefill
// step for them), still recording the change; the prefix cache holds nothing of the old weights.
static void test_keep_kv(Ref *old, Ref *nw) {
    Engine *e = make_engine();
    int32_t pa[12];
    random_prompt(pa, 12, 7);
    SamplingParams g;
    greedy_params(&g);
    g.n = 2;
    Comp a[2] = {0};
    stage_weights(e, nw);
    engine_pause(e);
    EngineRequest *ra = submit(e, pa, 12, &g, 1);
    engine_resume(e);
    wait_tokens(ra, a, 4);
    engine_pause(e);
    drain(ra, a);
    const int m[2] = {a[0].n, a[1].n};
    REQUIRE(m[0] < MAX_NEW && m[1] < MAX_NEW && m[1] > 0, "the update must land inside the completions (%d, %d)",
            m[0], m[1]);
    EngineCommitReport rep;
    char err[256];
    CHECK(engine_commit_weights(e, NEW_VERSION, ENGINE_UPDATE_KEEP_KV, &rep, err, sizeof err) == 0, "commit: %s", err);
    CHECK(rep.sequences_kept == 2 && rep.sequences_requeued == 0, "report: %lld kept, %lld re-queued (want 2, 0)",
          (long long)rep.sequences_kept, (long long)rep.sequences_requeued);
    EngineStats st;
    engine_stats(e, &st);
    const int64_t prefills = st.steps_by_kind[ENGINE_STEP_PREFILL];
    CHECK(st.kv_blocks_used > 0 && st.kv_blocks_cached == 0, "the completions keep their blocks (%lld), nothing is "
          "cached (%lld)", (long long)st.kv_blocks_used, (long long)st.kv_blocks_cached);
    engine_resume(e);
    CHECK(collect(ra, a) == 0, "request timed out");
    engine_request_release(ra);
    engine_stats(e, &st);
    CHECK(st.steps_by_kind[ENGINE_STEP_PREFILL] == prefills, "keep_kv recomputed something (%lld prefill steps after "
          "the update)", (long long)(st.steps_by_kind[ENGINE_STEP_PREFILL] - prefills));
    int32_t want_old[MAX_NEW];
    ref_greedy(old, pa, 12, MAX_NEW, want_old);
    for (int i = 0; i < 2; i++)
        CHECK(a[i].n == MAX_NEW && a[i].restarts == 0 && change_point(&a[i]) == m[i] &&
                  memcmp(a[i].tok, want_old, (size_t)m[i] * 4) == 0,
              "completion %d: %d tokens, %d restarts, change at %d (the update landed after token %d)", i, a[i].n,
              a[i].restarts, change_point(&a[i]), m[i]);
    // A request after the update matches no block of the old weights: the new weights' greedy output.
    Comp d[1] = {0};
    int32_t want[MAX_NEW];
    g.n = 1;
    EngineRequest *rd = submit(e, pa, 12, &g, 0);
    CHECK(collect(rd, d) == 0, "request after the update timed out");
    CHECK(engine_request_cached_tokens(rd) == 0, "a prefix-cache hit after the update (%d tokens)",
          engine_request_cached_tokens(rd));
    engine_request_release(rd);
    ref_greedy(nw, pa, 12, MAX_NEW, want);
    CHECK(d[0].n == MAX_NEW && memcmp(d[0].tok, want, sizeof want) == 0, "a request after the update: not the new "
          "weights' greedy output");
    engine_destroy(e, 1000);
}

static void test_mode_names(void) {
    EngineUpdateMode m = ENGINE_UPDATE_ABORT;
    CHECK(engine_update_mode_parse("keep", &m) == 0 && m == ENGINE_UPDATE_KEEP, "keep");
    CHECK(engine_update_mode_parse("abort", &m) == 0 && m == ENGINE_UPDATE_ABORT, "abort");
    CHECK(engine_update_mode_parse("keep_kv", &m) == 0 && m == ENGINE_UPDATE_KEEP_KV, "keep_kv");
    CHECK(engine_update_mode_parse("drain", &m) == -1 && engine_update_mode_parse(NULL, &m) == -1, "refusals");
    CHECK(!strcmp(engine_update_mode_name(ENGINE_UPDATE_KEEP), "keep") &&
              !strcmp(engine_update_mode_name(ENGINE_UPDATE_ABORT), "abort") &&
              !strcmp(engine_update_mode_name(ENGINE_UPDATE_KEEP_KV), "keep_kv"),
          "names");
}

int main(void) {
    char err[512];
    if (temp_dir_make("tandem_wupdate", model_dir, sizeof model_dir)) die("mkdtemp", strerror(errno));
    if (tiny_model_write_random(model_dir, CONFIG, 11, 0.5f, err, sizeof err)) die("model", err);
    if (tiny_tokenizer_write(model_dir, VOCAB_CHARS, err, sizeof err)) die("tokenizer", err);
    Ref old, nw;
    ref_load(&old, 0);
    ref_load(&nw, 999);
    test_mode_names();
    test_keep(&old, &nw);
    test_abort(&old, &nw);
    test_keep_kv(&old, &nw);
    ref_free(&old);
    ref_free(&nw);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", model_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", model_dir);
    return check_exit_code("test_rollout_weight_update");
}
