// test_rollout_engine_masks.c — vLLM's token masks (min_tokens, bad_words, allowed_token_ids) in the rollout
// server: sample_mask_build on its own, then the engine end to end on a tiny random model (CPU backend, a
// 64-character tokenizer: one character per id):
//   - sample_mask_build: eos and stop ids banned until min_tokens generated tokens, single-token bad words always,
//     multi-token ones where the generated tail (never the prompt) holds their prefix, allowed ids less the bans;
//   - allowed_token_ids: every sampled token is allowed; greedy picks the best allowed id, and the reported logprobs
//     are the unmasked distribution's (the training forward's, vLLM's raw_logprobs);
//   - min_tokens: with eos among three allowed ids, seeded completions that end before 5 tokens without it never
//     do with min_tokens = 5; a stop token id is not drawn before, and a stop string in the first min_tokens
//     characters does not match (vLLM's stop-check offset) while one ending after them does;
//   - bad_words: a banned id and a banned two-token sequence of the greedy output never appear;
//   - n seeded masked completions equal n separate requests with seeds s, s + 1, ... bit for bit (the mask depends
//     on a completion's own tokens only);
//   - refusals: min_tokens above max_tokens, allowed ids outside the vocabulary or all stop ids under min_tokens,
//     an empty or out-of-vocabulary bad word, masks over ENGINE_MAX_MASK_IDS ids a step.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "rollout_server/engine.h"
#include "rollout_server/sample_mask.h"
#include "tests/unit/check_macros.h"
#include "tests/unit/testlib.h"

#define V 64
#define EOS 63
static const char *VOCAB_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .";
static const char *CONFIG =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 64, \"hidden_size\": 32, \"intermediate_size\": 48,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"max_position_embeddings\": 160,"
    " \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": false, \"eos_token_id\": 63, \"bos_token_id\": 0}";

static char dir[256];

static void die(const char *what, const char *err) {
    fprintf(stderr, "set-up failed: %s: %s\n", what, err);
    exit(1);
}

typedef struct {
    int32_t tok[160];
    float lp[160];
    int n;
    FinishReason fin;
    char text[512];
    size_t text_len;
    int32_t stop_token;
} Comp;

static Engine *make_engine(void) {
    EngineConfig c;
    engine_config_default(&c);
    c.model_dir = dir;
    c.block_size = 16;
    c.kv_cache_bytes = (size_t)64 * 2 * 2 * 16 * 2 * 8 * 4; // 64 blocks: 2 (K,V) x 2 layers x 16 x Hkv 2 x D 8 x fp32
    c.max_num_seqs = 8;
    c.max_num_batched_tokens = 64;
    c.seed = 5;
    Engine *e;
    char err[512];
    if (engine_create(&e, &c, err, sizeof err)) die("engine_create", err);
    return e;
}

// Runs one request to the end; its p->n completions land in c. Returns 0, or -1 when it was refused or timed out.
static int run(Engine *e, const int32_t *prompt, int n_prompt, const SamplingParams *p, Comp *c) {
    EngineRequest *r;
    char err[512];
    if (engine_submit(e, prompt, n_prompt, p, &r, err, sizeof err) != 0) {
        fprintf(stderr, "submit refused: %s\n", err);
        failures++;
        return -1;
    }
    memset(c, 0, sizeof *c * p->n);
    EngineEvent ev;
    int rc;
    while ((rc = engine_request_next(r, &ev, 20000)) == 1) {
        Comp *x = &c[ev.index];
        for (int i = 0; i < ev.n_tokens && x->n < 160; i++, x->n++) {
            x->tok[x->n] = ev.tokens[i];
            x->lp[x->n] = ev.logprobs[i];
        }
        if (x->text_len + ev.text_len < sizeof x->text) {
            memcpy(x->text + x->text_len, ev.text, ev.text_len);
            x->text_len += ev.text_len;
        }
        if (ev.finish != FINISH_NONE) x->fin = ev.finish, x->stop_token = ev.stop_token;
    }
    engine_request_release(r);
    CHECK(rc == -1, "request timed out");
    return rc == -1 ? 0 : -1;
}

static void prompt_of(int32_t *t, int n, unsigned seed) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((seed * 2654435761u + i * 40503u) >> 7) % (V - 1);
}

static int in_list(const int32_t *ids, int n, int32_t id) {
    for (int i = 0; i < n; i++)
        if (ids[i] == id) return 1;
    return 0;
}

// ---- sample_mask_build ---------------------------------------------------------------------------

static void test_build(void) {
    const int32_t eos[2] = {63, 62};
    SamplingParams p;
    sampling_params_default(&p);
    int32_t out[64], mode;
    CHECK(sample_mask_cap(&p, NULL, 2) == 0 && sample_mask_build(&p, NULL, eos, 2, NULL, 0, out, &mode) == 0 &&
          mode == OPS_SAMPLE_MASK_NONE, "no mask asked for");
    p.min_tokens = 2;
    p.stop_token_ids[0] = 7;
    p.n_stop_token_ids = 1;
    const int32_t gen[4] = {5, 9, 5, 9};
    int n = sample_mask_build(&p, NULL, eos, 2, gen, 1, out, &mode);
    CHECK(mode == OPS_SAMPLE_MASK_BAN && n == 3 && in_list(out, n, 63) && in_list(out, n, 62) && in_list(out, n, 7),
          "min_tokens bans eos and stop ids after 1 of 2 tokens (%d ids)", n);
    n = sample_mask_build(&p, NULL, eos, 2, gen, 2, out, &mode);
    CHECK(n == 0 && mode == OPS_SAMPLE_MASK_NONE, "nothing banned once min_tokens tokens are out");
    // Bad words: {4} always; {5, 9, 11} after a tail 5 9; {9, 12} after a tail 9.
    const int32_t words[] = {4, 5, 9, 11, 9, 12}, offs[] = {0, 1, 4, 6};
    p.min_tokens = 0;
    p.bad_words_ids = words;
    p.bad_words_offsets = offs;
    p.n_bad_words = 3;
    CHECK(sample_mask_cap(&p, NULL, 2) == 3, "room for one id per bad word");
    n = sample_mask_build(&p, NULL, eos, 2, gen, 0, out, &mode);
    CHECK(mode == OPS_SAMPLE_MASK_BAN && n == 1 && out[0] == 4, "no tokens yet: the single-token word only (%d)", n);
    n = sample_mask_build(&p, NULL, eos, 2, gen, 2, out, &mode);
    CHECK(n == 3 && in_list(out, n, 4) && in_list(out, n, 11) && in_list(out, n, 12), "tail 5 9 completes two prefixes");
    n = sample_mask_build(&p, NULL, eos, 2, gen, 3, out, &mode);
    CHECK(n == 1 && out[0] == 4, "tail 9 5: neither prefix");
    // Allowed ids less the bans.
    const int32_t allowed[] = {4, 11, 20, 63};
    p.allowed_token_ids = allowed;
    p.n_allowed = 4;
    p.min_tokens = 3;
    CHECK(sample_mask_cap(&p, NULL, 2) == 4 + 3 + 3, "room for the allowed ids and every ban");
    n = sample_mask_build(&p, NULL, eos, 2, gen, 2, out, &mode);
    CHECK(mode == OPS_SAMPLE_MASK_ALLOW && n == 1 && out[0] == 20, "allowed {4, 11, 20, 63} less bans: {20} (%d)", n);
    n = sample_mask_build(&p, NULL, eos, 2, gen, 4, out, &mode);
    CHECK(mode == OPS_SAMPLE_MASK_ALLOW && n == 2 && in_list(out, n, 20) && in_list(out, n, 63),
          "after 5 9 5 9 (min_tokens met; 4, 11 and 12 bad words): {20, 63}");
}

// ---- the engine ----------------------------------------------------------------------------------

static void test_allowed(Engine *e, Model *m, ResidentWeights *w) {
    int32_t prompt[10];
    prompt_of(prompt, 10, 3);
    const int32_t allowed[] = {2, 17, 30, 44, 58};
    SamplingParams p;
    sampling_params_default(&p);
    p.max_tokens = 24;
    p.n = 4;
    p.temperature = 1.3f;
    p.has_seed = 1;
    p.seed = 77;
    p.ignore_eos = 1;
    p.allowed_token_ids = allowed;
    p.n_allowed = 5;
    Comp c[4];
    if (run(e, prompt, 10, &p, c)) return;
    int outside = 0, distinct = 0;
    unsigned char seen[V] = {0};
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < c[k].n; i++) {
            outside += !in_list(allowed, 5, c[k].tok[i]);
            distinct += !seen[c[k].tok[i]]++;
        }
    CHECK(outside == 0, "%d sampled tokens outside allowed_token_ids", outside);
    CHECK(distinct >= 3, "only %d distinct allowed ids drawn at T = 1.3: the draw is not over the allowed set",
          distinct);
    // Greedy: the best allowed id each step, with the unmasked distribution's logprobs.
    p.n = 1;
    p.temperature = 0.0f;
    if (run(e, prompt, 10, &p, c)) return;
    float ref[160];
    char err[512];
    if (tiny_model_completion_logprobs(m, w, prompt, 10, c[0].tok, c[0].n, ref, err, sizeof err)) die("logprobs", err);
    int bad_lp = 0;
    for (int i = 0; i < c[0].n; i++) bad_lp += !(fabsf(c[0].lp[i] - ref[i]) <= 2e-5f) || !in_list(allowed, 5, c[0].tok[i]);
    CHECK(c[0].n == 24 && bad_lp == 0, "greedy under allowed_token_ids: %d of %d tokens off the set or not reporting "
          "the raw logprob", bad_lp, c[0].n);
}

static void test_min_tokens(Engine *e) {
    int32_t prompt[10];
    prompt_of(prompt, 10, 8);
    const int32_t allowed[] = {5, 40, EOS};
    SamplingParams p;
    sampling_params_default(&p);
    p.max_tokens = 40;
    p.n = 8;
    p.temperature = 1.0f;
    p.has_seed = 1;
    p.seed = 123;
    p.allowed_token_ids = allowed;
    p.n_allowed = 3;
    Comp c[8];
    if (run(e, prompt, 10, &p, c)) return;
    int early = 0;
    for (int k = 0; k < 8; k++) early += c[k].fin == FINISH_STOP && c[k].n < 5;
    CHECK(early > 0, "no completion stops within 4 tokens without min_tokens: the test does not exercise it");
    p.min_tokens = 5;
    if (run(e, prompt, 10, &p, c)) return;
    int eos_early = 0, stopped = 0;
    for (int k = 0; k < 8; k++) {
        for (int i = 0; i < 5 && i < c[k].n; i++) eos_early += c[k].tok[i] == EOS;
        CHECK(c[k].n >= 5, "completion %d has %d tokens under min_tokens = 5", k, c[k].n);
        stopped += c[k].fin == FINISH_STOP && c[k].tok[c[k].n - 1] == EOS && c[k].stop_token == EOS;
    }
    CHECK(eos_early == 0, "eos drawn %d times within min_tokens", eos_early);
    CHECK(stopped > 0, "no completion stopped at eos after min_tokens");

    // A stop token id is masked as well; a stop string may only end after the first min_tokens characters.
    sampling_params_default(&p);
    p.temperature = 0.0f;
    p.max_tokens = 40;
    p.ignore_eos = 1;
    Comp base, x;
    if (run(e, prompt, 10, &p, &base)) return;
    p.stop_token_ids[0] = base.tok[0];
    p.n_stop_token_ids = 1;
    p.min_tokens = 6;
    if (run(e, prompt, 10, &p, &x)) return;
    int drawn = 0;
    for (int i = 0; i < 6 && i < x.n; i++) drawn += x.tok[i] == base.tok[0];
    CHECK(drawn == 0 && x.n >= 6, "stop token id %d drawn %d times within min_tokens (%d tokens)", base.tok[0], drawn,
          x.n);
    p.n_stop_token_ids = 0;
    char stop[3] = {base.text[1], base.text[2], 0}; // ends at character 3, within min_tokens = 6
    p.stop[0] = stop;
    p.n_stop = 1;
    if (run(e, prompt, 10, &p, &x)) return;
    int want = -1; // the first match ending past character 6
    for (int i = 0; i + 2 <= (int)base.text_len && want < 0; i++)
        if (i + 2 > 6 && memcmp(base.text + i, stop, 2) == 0) want = i;
    if (want >= 0)
        CHECK(x.fin == FINISH_STOP && x.text_len == (size_t)want && memcmp(x.text, base.text, want) == 0,
              "stop '%s' under min_tokens = 6: cut at %zu, want %d", stop, x.text_len, want);
    else
        CHECK(x.fin == FINISH_LENGTH && x.text_len == base.text_len, "stop '%s' only within min_tokens: no cut", stop);
    p.min_tokens = 0;
    if (run(e, prompt, 10, &p, &x)) return;
    const size_t first = (size_t)(strstr(base.text, stop) - base.text);
    CHECK(x.fin == FINISH_STOP && x.text_len == first, "without min_tokens the same stop cuts at %zu (got %zu)", first,
          x.text_len);
}

static void test_bad_words(Engine *e) {
    int32_t prompt[10];
    prompt_of(prompt, 10, 13);
    SamplingParams p;
    sampling_params_default(&p);
    p.temperature = 0.0f;
    p.max_tokens = 40;
    p.ignore_eos = 1;
    Comp base, x;
    if (run(e, prompt, 10, &p, &base)) return;
    // The first token alone, and the pair at 3..4 (a two-token word).
    const int32_t words[3] = {base.tok[0], base.tok[3], base.tok[4]}, offs[3] = {0, 1, 3};
    p.bad_words_ids = words;
    p.bad_words_offsets = offs;
    p.n_bad_words = 2;
    if (run(e, prompt, 10, &p, &x)) return;
    int single = 0, pair = 0;
    for (int i = 0; i < x.n; i++) {
        single += x.tok[i] == words[0];
        pair += i > 0 && x.tok[i - 1] == words[1] && x.tok[i] == words[2];
    }
    CHECK(x.n == 40 && single == 0 && pair == 0, "bad words: token %d drawn %d times, pair %d %d %d times", words[0],
          single, words[1], words[2], pair);
    CHECK(x.tok[0] != base.tok[0], "the banned first token changed the output");
}

static void test_batch_independence(Engine *e) {
    int32_t prompt[10];
    prompt_of(prompt, 10, 21);
    const int32_t allowed[] = {1, 3, 9, 27, 50, EOS}, words[] = {9, 9, 3}, offs[] = {0, 2, 3};
    SamplingParams p;
    sampling_params_default(&p);
    p.max_tokens = 30;
    p.n = 4;
    p.temperature = 0.9f;
    p.top_k = 4;
    p.repetition_penalty = 1.2f;
    p.has_seed = 1;
    p.seed = 1000;
    p.min_tokens = 8;
    p.allowed_token_ids = allowed;
    p.n_allowed = 6;
    p.bad_words_ids = words;
    p.bad_words_offsets = offs;
    p.n_bad_words = 2;
    Comp together[4], alone;
    if (run(e, prompt, 10, &p, together)) return;
    for (int k = 0; k < 4; k++) {
        SamplingParams q = p;
        q.n = 1;
        q.seed = p.seed + (uint64_t)k;
        if (run(e, prompt, 10, &q, &alone)) return;
        CHECK(alone.n == together[k].n && memcmp(alone.tok, together[k].tok, (size_t)alone.n * 4) == 0 &&
                  memcmp(alone.lp, together[k].lp, (size_t)alone.n * 4) == 0,
              "completion %d of n = 4 differs from its seed alone", k);
        int pair = 0;
        for (int i = 1; i < alone.n; i++) pair += alone.tok[i - 1] == 9 && alone.tok[i] == 9;
        CHECK(pair == 0 && alone.n >= 8, "completion %d: %d banned pairs, %d tokens", k, pair, alone.n);
    }
}

static void test_refusals(Engine *e) {
    int32_t prompt[4] = {1, 2, 3, 4};
    const int32_t only_eos[] = {EOS}, oov[] = {3, V}, words[] = {V}, offs_empty[] = {0, 0}, offs[] = {0, 1};
    static int32_t many[16385]; // id 0, 16385 times: with n = 1024 just over ENGINE_MAX_MASK_IDS
    struct {
        const char *what;
        SamplingParams p;
    } bad[6];
    for (int i = 0; i < 6; i++) sampling_params_default(&bad[i].p);
    bad[5].p.allowed_token_ids = many, bad[5].p.n_allowed = 16385, bad[5].p.n = 1024, bad[5].what = "mask ids";
    bad[0].p.min_tokens = 17, bad[0].what = "min_tokens"; // max_tokens is 16
    bad[1].p.allowed_token_ids = oov, bad[1].p.n_allowed = 2, bad[1].what = "allowed token id";
    bad[2].p.allowed_token_ids = only_eos, bad[2].p.n_allowed = 1, bad[2].p.min_tokens = 1,
    bad[2].what = "allowed_token_ids";
    bad[3].p.bad_words_ids = words, bad[3].p.bad_words_offsets = offs_empty, bad[3].p.n_bad_words = 1,
    bad[3].what = "bad word 0";
    bad[4].p.bad_words_ids = words, bad[4].p.bad_words_offsets = offs, bad[4].p.n_bad_words = 1,
    bad[4].what = "bad word 0";
    for (int i = 0; i < 6; i++) {
        EngineRequest *r;
        char err[256] = "";
        CHECK(engine_submit(e, prompt, 4, &bad[i].p, &r, err, sizeof err) == ENGINE_EINVAL, "bad %s accepted",
              bad[i].what);
        CHECK(strstr(err, bad[i].what) != NULL, "message '%s' names %s", err, bad[i].what);
    }
}

int main(void) {
    char err[512];
    if (temp_dir_make("tandem_masks", dir, sizeof dir)) die("mkdtemp", strerror(errno));
    if (tiny_model_write_random(dir, CONFIG, 11, 0.5f, err, sizeof err)) die("model", err);
    if (tiny_tokenizer_write(dir, VOCAB_CHARS, err, sizeof err)) die("tokenizer", err);
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    if (ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) || model_load(&m, &w, ops, dir, err, sizeof err))
        die("reference model", err);
    test_build();
    Engine *e = make_engine();
    test_allowed(e, &m, &w);
    test_min_tokens(e);
    test_bad_words(e);
    test_batch_independence(e);
    test_refusals(e);
    engine_destroy(e, 1000);
    resident_free(&w, &m);
    model_free(&m);
    ops_destroy(ops);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    if (failures) {
        fprintf(stderr, "test_rollout_engine_masks: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_rollout_engine_masks: all passed\n");
    return 0;
}
