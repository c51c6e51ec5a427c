// test_cuda_graph_decode.c — decode-only steps padded to the ladder of batch sizes and replayed as CUDA graphs
// (shared/model_decode.c, kernels/cuda/cuda_graph.cu).
//
// Everywhere (CPU backend): the graph API says "not supported" and records no error; the ladder; a padded step
// runs eagerly and agrees with the unpadded model_decode_step; misuse is refused with a message.
// GPU only (exit 77 = skipped elsewhere, after the CPU part passed): the graph API itself (refused on a context
// created with profile_ops, replay, in-place update with new pointers, refusal of unrecordable calls with a named
// error, scratch kept alive for a graph, another thread allocating meanwhile); then for a Llama-style (GQA, untied) and a Qwen3-style (q/k norm, bias, tied, odd
// vocabulary) random model, decode steps at batch sizes on and off the ladder, several rounds so that each size is
// recorded once and then replayed:
//   graph-path logits (hence tokens) == eager padded logits, bit for bit, every step;
//   a real row's logits do not depend on the other rows (5 sequences alone == the same 5 inside a batch of 8);
//   padded logits stay close to the unpadded model_decode_step's (other GEMM shapes: not bit-exact);
//   weight swaps by exchanging buffers (the NCCL commit): a new buffer set records a graph beside the old one, going
//   back replays the old one, a third set records over the least recently used; every time graph == eager, and
//   the logits follow the weights; new values uploaded in place (the HTTP commit) are read by a replay without
//   recording.
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/dtype.h"
#include "shared/model.h"
#include "testlib.h"

static const char *LLAMA =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 512, \"hidden_size\": 256,"
    " \"intermediate_size\": 512, \"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
    " \"max_position_embeddings\": 256, \"hidden_act\": \"silu\", \"tie_word_embeddings\": false}";
static const char *QWEN3 =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 517, \"hidden_size\": 128, \"intermediate_size\": 320,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 64,"
    " \"max_position_embeddings\": 256, \"hidden_act\": \"silu\", \"tie_word_embeddings\": true,"
    " \"attention_bias\": true}";

// ---- a model, a paged cache with S sequences (sequence s owns blocks [s * mb, (s + 1) * mb)) ---------------

enum { S = 20, BS = 16, MAX_LEN = 160, MB = MAX_LEN / BS };

typedef struct {
    OpsCtx *o;
    Model m;
    ResidentWeights w;
    UnitSource src;
    KVCache kv;
    DecodeBufs *b;
    int V, cap;
    int len[S];          // tokens in the cache
    int32_t next[S];     // each sequence's next token
    // one step's inputs (rows = sequences sel[0..n-1])
    int32_t tok[S], pos[S], slot[S], tab[S * MB];
} Rig;

static void rig_init(Rig *r, OpsBackend be, const char *json, uint64_t seed, int cap) {
    char err[512];
    memset(r, 0, sizeof *r);
    REQUIRE(ops_create(&r->o, be, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(tiny_model_init(&r->m, &r->w, r->o, json, 0, seed, 0.05f, err, sizeof err) == 0, "%s", err);
    r->src = resident_source(&r->w);
    r->V = r->m.cfg.vocab_size;
    REQUIRE(kv_cache_create(&r->kv, &r->m, S * MB, BS, err, sizeof err) == 0, "%s", err);
    REQUIRE(decode_bufs_create(&r->b, &r->m, S * 16, S, MB, S, err, sizeof err) == 0, "%s", err);
    r->cap = cap;
    // Prompts of 3..15 tokens, prefilled in one unpadded step; each sequence's next token is its argmax.
    int32_t tok[S * 16], seq[S * 16], pos[S * 16], slot[S * 16], rows[S], tables[S * MB];
    int N = 0;
    for (int s = 0; s < S; s++) {
        const int plen = 3 + (s * 7) % 13;
        for (int i = 0; i < plen; i++, N++) {
            tok[N] = (int32_t)((s * 131 + i * 17 + 5) % r->V);
            seq[N] = s;
            pos[N] = i;
            slot[N] = s * MB * BS + i;
        }
        rows[s] = N - 1;
        r->len[s] = plen;
        for (int j = 0; j < MB; j++) tables[s * MB + j] = s * MB + j;
    }
    float *logits = malloc((size_t)S * r->V * sizeof *logits);
    REQUIRE(logits, "out of memory");
    REQUIRE(model_decode_step(&r->m, r->b, &r->src, &r->kv, N, tok, seq, pos, slot, tables, S, MB, rows, S, logits, err,
                              sizeof err) == 0,
            "prefill: %s", err);
    for (int s = 0; s < S; s++) {
        int best = 0;
        for (int v = 1; v < r->V; v++)
            if (logits[(size_t)s * r->V + v] > logits[(size_t)s * r->V + best]) best = v;
        r->next[s] = best;
    }
    free(logits);
}

static void rig_free(Rig *r) {
    decode_bufs_free(r->b, &r->m);
    kv_cache_free(&r->kv, &r->m);
    tiny_model_free(&r->m, &r->w);
    ops_destroy(r->o);
}

// Inputs of a decode step of sequences sel[0..n-1]: each one's next token at its current length.
static void rig_inputs(Rig *r, const int *sel, int n) {
    for (int i = 0; i < n; i++) {
        const int s = sel[i];
        REQUIRE(r->len[s] < MAX_LEN, "sequence %d is full", s);
        r->tok[i] = r->next[s];
        r->pos[i] = r->len[s];
        r->slot[i] = s * MB * BS + r->len[s];
        for (int j = 0; j < MB; j++) r->tab[i * MB + j] = s * MB + j;
    }
}

// After a step: each sequence keeps its token and takes the argmax of its row as the next one.
static void rig_advance(Rig *r, const int *sel, int n, const float *logits) {
    for (int i = 0; i < n; i++) {
        const float *row = logits + (size_t)i * r->V;
        int best = 0;
        for (int v = 1; v < r->V; v++)
            if (row[v] > row[best]) best = v;
        r->len[sel[i]]++;
        r->next[sel[i]] = best;
    }
}

static int rig_padded(Rig *r, int n, int graphs, float *logits) {
    char err[512];
    REQUIRE(decode_bufs_enable_padded(r->b, &r->m, r->cap, graphs, err, sizeof err) == r->cap, "%s", err);
    const int rc = model_decode_step_padded(&r->m, r->b, &r->src, &r->kv, n, r->tok, r->pos, r->slot, r->tab, MB,
                                            logits, err, sizeof err);
    if (rc != 0) fprintf(stderr, "padded step of %d: %s\n", n, err);
    return rc;
}

static int rig_unpadded(Rig *r, int n, float *logits) {
    char err[512];
    int32_t seq[S], rows[S];
    for (int i = 0; i < n; i++) seq[i] = rows[i] = i;
    const int rc = model_decode_step(&r->m, r->b, &r->src, &r->kv, n, r->tok, seq, r->pos, r->slot, r->tab, n, MB, rows,
                                     n, logits, err, sizeof err);
    if (rc != 0) fprintf(stderr, "unpadded step of %d: %s\n", n, err);
    return rc;
}

static double max_abs(const float *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}
static double max_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

// ---- CPU: no graphs, padded steps eager ---------------------------------------------------------------------

static void test_cpu(void) {
    int ladder[64];
    const int expect512[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512};
    int n = decode_ladder(512, ladder, 64);
    CHECK(n == 15 && memcmp(ladder, expect512, sizeof expect512) == 0, "ladder up to 512 has %d rungs", n);
    n = decode_ladder(20, ladder, 64);
    CHECK(n == 6 && ladder[4] == 16 && ladder[5] == 20, "ladder up to 20: %d rungs, last %d", n, ladder[n - 1]);
    n = decode_ladder(1, ladder, 64);
    CHECK(n == 1 && ladder[0] == 1, "ladder up to 1");
    CHECK(decode_ladder(0, ladder, 64) == 0, "ladder up to 0 is empty");

    Rig r;
    rig_init(&r, OPS_BACKEND_CPU, LLAMA, 7, S);
    CHECK(ops_graph_supported(r.o) == 0, "the cpu backend claims graph support");
    CHECK(ops_graph_begin(r.o) == OPS_GRAPH_UNSUPPORTED && ops_status(r.o) == 0,
          "cpu ops_graph_begin: expected OPS_GRAPH_UNSUPPORTED without an error");
    char err[512];
    CHECK(decode_bufs_padded_size(r.b, 3) == 0, "padded sizes before decode_bufs_enable_padded");
    CHECK(model_decode_step_padded(&r.m, r.b, &r.src, &r.kv, 1, r.tok, r.pos, r.slot, r.tab, MB, NULL, err,
                                   sizeof err) != 0 && strstr(err, "not set up"),
          "a padded step before set-up must be refused: '%s'", err);
    CHECK(decode_bufs_enable_padded(r.b, &r.m, 1000, 1, err, sizeof err) == S, "enable is capped at max_seqs %d", S);
    CHECK(decode_bufs_graphs_on(r.b) == 0, "graphs on with the cpu backend");
    CHECK(decode_bufs_padded_size(r.b, 3) == 4 && decode_bufs_padded_size(r.b, 17) == 20 &&
              decode_bufs_padded_size(r.b, 21) == 0,
          "padded sizes");
    float *a = malloc((size_t)S * r.V * 4), *u = malloc((size_t)S * r.V * 4);
    REQUIRE(a && u, "out of memory");
    int sel[S];
    const int sizes[] = {1, 3, 5, 8, 13, 20};
    for (int k = 0; k < 6; k++) {
        const int nn = sizes[k];
        for (int i = 0; i < nn; i++) sel[i] = (k * 3 + i) % S;
        rig_inputs(&r, sel, nn);
        CHECK(rig_unpadded(&r, nn, u) == 0, "unpadded step");
        CHECK(rig_padded(&r, nn, 1, a) == 0, "padded step");
        const double d = max_diff(a, u, (size_t)nn * r.V), ref = max_abs(u, (size_t)nn * r.V);
        CHECK(d <= 1e-4 * ref, "cpu: padded vs unpadded step of %d: max diff %g (max |logit| %g)", nn, d, ref);
        rig_advance(&r, sel, nn, a);
    }
    DecodeGraphStats gs;
    decode_bufs_graph_stats(r.b, &gs);
    CHECK(gs.graphs == 0 && gs.recordings == 0 && gs.replays == 0 && gs.eager_steps == 6,
          "cpu stats: %d graphs, %lld recordings, %lld replays, %lld eager", gs.graphs, (long long)gs.recordings,
          (long long)gs.replays, (long long)gs.eager_steps);
    rig_inputs(&r, sel, 1);
    r.tok[0] = r.V;  // outside the vocabulary
    CHECK(model_decode_step_padded(&r.m, r.b, &r.src, &r.kv, 1, r.tok, r.pos, r.slot, r.tab, MB, NULL, err,
                                   sizeof err) != 0 && strstr(err, "out of range"),
          "a token outside the vocabulary must be refused: '%s'", err);
    CHECK(model_decode_step_padded(&r.m, r.b, &r.src, &r.kv, S + 1, r.tok, r.pos, r.slot, r.tab, MB, NULL, err,
                                   sizeof err) != 0 && strstr(err, "largest rung"),
          "a batch beyond the ladder must be refused: '%s'", err);
    free(a);
    free(u);
    rig_free(&r);
}

// ---- GPU: the graph API ------------------------------------------------------------------------------------

typedef struct {
    OpsCtx *o;
    void *p;
} AllocArg;

// What the rollout server's weight receiver does while the engine thread may be recording.
static void *alloc_elsewhere(void *arg) {
    AllocArg *a = arg;
    a->p = ops_malloc(a->o, 1 << 20);
    return NULL;
}

static void test_graph_api(void) {
    char err[512];
    OpsCtx *o;
    // Per-op profiling times each op with events, which a replay would not reproduce: such a context refuses graphs.
    REQUIRE(ops_create_with_settings(&o, OPS_BACKEND_CUDA, 0, &(OpsSettings){.profile_ops = 1}, err, sizeof err) == 0,
            "%s", err);
    CHECK(ops_graph_supported(o) == 0 && ops_graph_begin(o) == OPS_GRAPH_UNSUPPORTED && ops_status(o) == 0,
          "a context created with profile_ops must refuse graphs, without an error");
    ops_destroy(o);
    REQUIRE(ops_create(&o, OPS_BACKEND_CUDA, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(ops_graph_supported(o), "a CUDA context with the default settings refuses graphs");
    const int n = 1000;
    float *h = malloc(n * 4), *got = malloc(n * 4);
    for (int i = 0; i < n; i++) h[i] = (float)(i % 7) - 3.0f;  // small integers: exact in bf16 sums
    void *x = ops_malloc(o, n * 2), *y = ops_malloc(o, n * 2), *y2 = ops_malloc(o, n * 2);
    ops_upload_f32(o, x, h, n);
    REQUIRE(ops_status(o) == 0, "%s", ops_error(o));

    // Another thread allocates on the context while this one records (the weight receiver beside the engine
    // thread): the allocation must work and stay out of the graph. CUDA may invalidate the recording when that
    // thread synchronizes on the same device; the recording then fails cleanly and is simply made again.
    OpsGraph *g = NULL;
    CHECK(ops_graph_begin(o) == 0, "begin: %s", ops_error(o));
    ops_add_inplace(o, y, x, n);
    ops_add_inplace(o, y, x, n);
    AllocArg aa = {o, NULL};
    pthread_t th;
    pthread_create(&th, NULL, alloc_elsewhere, &aa);
    pthread_join(th, NULL);
    const int end_rc = ops_graph_end(o, &g);
    CHECK(aa.p != NULL, "another thread's ops_malloc during a recording failed: %s", ops_error(o));
    if (end_rc != 0) {
        printf("note: another thread's allocation invalidated the recording (%s); recording again\n", ops_error(o));
        CHECK(g == NULL, "a failed recording left a graph");
        ops_clear_error(o);
    }
    ops_free(o, aa.p);
    ops_download_f32(o, got, y, n);
    CHECK(max_abs(got, n) == 0, "recording ran the ops");
    if (!g) {  // y += x twice, recorded without interference
        CHECK(ops_graph_begin(o) == 0, "begin: %s", ops_error(o));
        ops_add_inplace(o, y, x, n);
        ops_add_inplace(o, y, x, n);
        CHECK(ops_graph_end(o, &g) == 0 && g, "end: %s", ops_error(o));
    }
    // Nothing ran while recording; 3 replays add 6 x.
    ops_download_f32(o, got, y, n);
    CHECK(max_abs(got, n) == 0, "recording ran the ops");
    for (int k = 0; k < 3; k++) CHECK(ops_graph_launch(o, g) == 0, "launch: %s", ops_error(o));
    ops_download_f32(o, got, y, n);
    double d = 0;
    for (int i = 0; i < n; i++) d = fmax(d, fabs(got[i] - 6 * h[i]));
    CHECK(d == 0, "3 replays of y += 2x: max error %g", d);

    // Recorded again on y2: the executable graph is updated (or replaced) and now writes y2 only.
    CHECK(ops_graph_begin(o) == 0, "begin: %s", ops_error(o));
    ops_add_inplace(o, y2, x, n);
    ops_add_inplace(o, y2, x, n);
    OpsGraph *before = g;
    CHECK(ops_graph_end(o, &g) == 0 && g == before, "re-recording: %s", ops_error(o));
    CHECK(ops_graph_launch(o, g) == 0, "launch: %s", ops_error(o));
    ops_download_f32(o, got, y2, n);
    d = 0;
    for (int i = 0; i < n; i++) d = fmax(d, fabs(got[i] - 2 * h[i]));
    CHECK(d == 0, "replay after re-recording: max error %g", d);
    ops_download_f32(o, got, y, n);
    d = 0;
    for (int i = 0; i < n; i++) d = fmax(d, fabs(got[i] - 6 * h[i]));
    CHECK(d == 0, "the re-recorded graph still wrote the old buffer: max error %g", d);

    // Unrecordable calls are refused by name; the recording ends with that error; the context works afterwards.
    // (The scratch is still empty here, so the RMSNorm backward's weight-gradient reduction would have to grow it.)
    float *dw = ops_malloc(o, 100 * sizeof(float));
    const char *what[3] = {"ops_malloc", "ops_synchronize", "growing the stream scratch"};
    for (int k = 0; k < 3; k++) {
        OpsGraph *bad = NULL;
        CHECK(ops_graph_begin(o) == 0, "begin: %s", ops_error(o));
        if (k == 0) {
            CHECK(ops_malloc(o, 64) == NULL, "ops_malloc while recording succeeded");
        } else if (k == 1) {
            ops_synchronize(o);
        } else {  // RMSNorm backward reduces its weight gradient through stream scratch
            ops_rmsnorm_bwd(o, y2, dw, x, x, x, (const float *)y, 10, 100);
        }
        CHECK(ops_graph_end(o, &bad) != 0 && bad == NULL && strstr(ops_error(o), what[k]) &&
                  strstr(ops_error(o), "cannot be recorded"),
              "case %d: expected a refusal naming '%s', got '%s'", k, what[k], ops_error(o));
        ops_clear_error(o);
    }
    ops_add_inplace(o, y2, x, n);
    ops_download_f32(o, got, y2, n);
    d = 0;
    for (int i = 0; i < n; i++) d = fmax(d, fabs(got[i] - 3 * h[i]));
    CHECK(d == 0 && ops_status(o) == 0, "eager op after refused recordings: max error %g, '%s'", d, ops_error(o));

    // Scratch a graph recorded stays valid when a later op grows the scratch (the old buffer is retired, not
    // freed): sum of squares (fp32 partials through scratch) of small integers is exact.
    const size_t big = (size_t)1 << 22;
    float *xs = ops_malloc(o, big * sizeof(float)), *acc = ops_malloc(o, sizeof(float)), *hx = malloc(big * 4);
    REQUIRE(xs && acc && hx, "out of memory");
    double want_small = 0, want_big = 0;
    for (size_t i = 0; i < big; i++) {
        hx[i] = (float)(i % 5);
        want_big += (double)hx[i] * hx[i];
        if (i < 1000) want_small += (double)hx[i] * hx[i];
    }
    ops_copy_to_device(o, xs, hx, big * 4);
    ops_sum_squares(o, acc, xs, 1000);  // eager first: sizes the (small) scratch
    OpsGraph *gs = NULL;
    CHECK(ops_graph_begin(o) == 0, "begin: %s", ops_error(o));
    ops_sum_squares(o, acc, xs, 1000);
    CHECK(ops_graph_end(o, &gs) == 0 && gs, "recording a sum of squares: %s", ops_error(o));
    ops_memset_zero(o, acc, sizeof(float));
    ops_sum_squares(o, acc, xs, big);  // needs more scratch: grows it, retiring the recorded buffer
    ops_graph_launch(o, gs);
    ops_graph_launch(o, gs);
    float got_acc = 0;
    ops_copy_to_host(o, &got_acc, acc, sizeof got_acc);
    CHECK(ops_status(o) == 0 && got_acc == (float)(want_big + 2 * want_small),
          "sum of squares after scratch growth + 2 replays: %.1f, expected %.1f ('%s')", got_acc,
          want_big + 2 * want_small, ops_error(o));
    ops_graph_destroy(o, gs);
    ops_free(o, xs);
    ops_free(o, acc);
    ops_free(o, dw);
    free(hx);
    ops_graph_destroy(o, g);
    ops_free(o, x);
    ops_free(o, y);
    ops_free(o, y2);
    free(h);
    free(got);
    ops_destroy(o);
}

// ---- GPU: padded decode steps through graphs ----------------------------------------------------------------

// Exchanges every unit's buffer between the live weights and another set (what the NCCL commit does).
static void exchange(ResidentWeights *live, ResidentWeights *other) {
    for (int u = 0; u < live->n_units; u++) {
        void *t = live->params[u];
        live->params[u] = other->params[u];
        other->params[u] = t;
    }
}

// A padded step of the 5 sequences in sel after a weight change, through the graph path (G) and eagerly (E):
// G == E bit for bit, and the stats moved by exactly `recorded` recordings, `replayed` replays and `new_graphs`
// graphs. The sequences then advance.
static void swap_step(Rig *r, const char *name, const char *what, const int *sel, int recorded, int replayed,
                      int new_graphs, float *G, float *E) {
    const size_t V = (size_t)r->V;
    DecodeGraphStats a, b;
    decode_bufs_graph_stats(r->b, &a);
    rig_inputs(r, sel, 5);
    CHECK(rig_padded(r, 5, 1, G) == 0 && rig_padded(r, 5, 0, E) == 0, "%s: %s: steps", name, what);
    decode_bufs_graph_stats(r->b, &b);
    CHECK(b.recordings - a.recordings == recorded && b.replays - a.replays == replayed &&
              b.graphs - a.graphs == new_graphs && b.failures == 0,
          "%s: %s: %lld recordings, %lld replays, %d new graphs (expected %d, %d, %d); failures %lld '%s'", name, what,
          (long long)(b.recordings - a.recordings), (long long)(b.replays - a.replays), b.graphs - a.graphs, recorded,
          replayed, new_graphs, (long long)b.failures, b.last_error);
    if (recorded) CHECK(b.last_again == 1, "%s: %s: the recording should be for a size that had a graph", name, what);
    CHECK(memcmp(G, E, 5 * V * 4) == 0, "%s: %s: graph != eager (max diff %g)", name, what, max_diff(G, E, 5 * V));
    rig_advance(r, sel, 5, G);
}

static void test_decode(const char *name, const char *json) {
    Rig r;
    rig_init(&r, OPS_BACKEND_CUDA, json, 21, S);
    char err[512];
    REQUIRE(decode_bufs_enable_padded(r.b, &r.m, r.cap, 1, err, sizeof err) == S, "%s", err);
    if (!decode_bufs_graphs_on(r.b)) {
        printf("note: %s: graphs unsupported on this context: decode graph tests skipped\n", name);
        rig_free(&r);
        return;
    }
    const size_t V = (size_t)r.V;
    float *G = malloc(S * V * 4), *E = malloc(S * V * 4), *U = malloc(S * V * 4), *O = malloc(S * V * 4);
    REQUIRE(G && E && U && O, "out of memory");
    int sel[S];
    // Sizes on the ladder (1, 8, 16, 20 = the cap) and off it (3 -> 4, 5 -> 8, 13 -> 16, 17 -> 20).
    const int sizes[] = {1, 3, 5, 8, 13, 16, 17, 20};
    const int n_sizes = (int)(sizeof sizes / sizeof *sizes);
    int steps = 0, worst_step = -1;
    double worst_rel = 0;
    for (int round = 0; round < 3; round++) {
        for (int k = 0; k < n_sizes; k++) {
            const int n = sizes[k];
            for (int i = 0; i < n; i++) sel[i] = (round * 5 + k * 3 + i) % S;
            rig_inputs(&r, sel, n);
            // Unpadded first; graph and eager padded last, so the cache keeps the padded path's k/v (both write
            // the same bits into the same slots).
            CHECK(rig_unpadded(&r, n, U) == 0, "unpadded step");
            CHECK(rig_padded(&r, n, 1, G) == 0, "graph step");
            CHECK(rig_padded(&r, n, 0, E) == 0, "eager step");
            CHECK(memcmp(G, E, n * V * 4) == 0, "%s: round %d, batch %d: graph logits != eager logits (max diff %g)",
                  name, round, n, max_diff(G, E, n * V));
            const double rel = max_diff(G, U, n * V) / max_abs(U, n * V);
            if (rel > worst_rel) worst_rel = rel, worst_step = steps;
            rig_advance(&r, sel, n, G);
            steps++;
        }
    }
    CHECK(worst_rel <= 3e-2, "%s: padded vs unpadded logits: max relative diff %g (step %d)", name, worst_rel,
          worst_step);
    DecodeGraphStats gs;
    decode_bufs_graph_stats(r.b, &gs);
    // 5 padded sizes (1, 4, 8, 16, 20; 5 and 13 pad to 8 and 16 too): each recorded once, then replayed.
    CHECK(gs.failures == 0, "%s: %lld recordings failed: %s", name, (long long)gs.failures, gs.last_error);
    CHECK(gs.recordings == 5 && gs.graphs == 5, "%s: %lld recordings, %d graphs (expected 5)", name,
          (long long)gs.recordings, gs.graphs);
    CHECK(gs.replays == steps - 5, "%s: %lld replays of %d graph steps", name, (long long)gs.replays, steps);
    printf("%s: %d steps, graph == eager bit for bit; padded vs unpadded max rel diff %.2e; %d graphs recorded in "
           "%.1f ms\n", name, steps, worst_rel, gs.graphs, gs.record_seconds * 1e3);

    // A real row does not depend on the other rows: 5 sequences (padded to 8) == the same 5 inside 8 real ones.
    for (int i = 0; i < 8; i++) sel[i] = (7 + i) % S;
    rig_inputs(&r, sel, 8);
    CHECK(rig_padded(&r, 5, 1, O) == 0, "graph step of 5");
    CHECK(rig_padded(&r, 8, 1, G) == 0, "graph step of 8");
    CHECK(memcmp(O, G, 5 * V * 4) == 0, "%s: rows of 5 sequences change when 3 others join (max diff %g)", name,
          max_diff(O, G, 5 * V));
    rig_advance(&r, sel, 8, G);

    // Weight swaps by exchanging buffers (what the NCCL commit does): a graph of other pointers must never replay.
    ResidentWeights wb, wc;
    REQUIRE(resident_alloc(&wb, &r.m, 0, err, sizeof err) == 0 && resident_alloc(&wc, &r.m, 0, err, sizeof err) == 0,
            "%s", err);
    model_init_random(&r.m, &wb, 99, 0.05f);
    model_init_random(&r.m, &wc, 77, 0.05f);
    for (int i = 0; i < 5; i++) sel[i] = (11 + i) % S;
    rig_inputs(&r, sel, 5);
    CHECK(rig_padded(&r, 5, 0, O) == 0, "eager step with the old weights");
    // A -> B: no graph has B's pointers, so the step runs eagerly and records one beside A's.
    exchange(&r.w, &wb);
    swap_step(&r, name, "A -> B", sel, 1, 0, 1, G, E);
    CHECK(max_diff(G, O, 5 * V) > 1e-2 * max_abs(O, 5 * V), "%s: after a swap the logits did not change", name);
    swap_step(&r, name, "B again", sel, 0, 1, 0, G, E);
    // B -> A (the next NCCL update lands in A's buffers): A's graph is still held, so it replays.
    exchange(&r.w, &wb);
    swap_step(&r, name, "B -> A", sel, 0, 1, 0, G, E);
    // A -> C, a third set: recorded over the least recently used graph of the size (B's); back to A replays.
    exchange(&r.w, &wc);
    swap_step(&r, name, "A -> C", sel, 1, 0, 0, G, E);
    exchange(&r.w, &wc);
    swap_step(&r, name, "C -> A", sel, 0, 1, 0, G, E);

    // New values uploaded in place (what the HTTP commit does): same pointers, so a replay reads them.
    rig_inputs(&r, sel, 5);
    CHECK(rig_padded(&r, 5, 0, O) == 0, "eager step before the upload");
    for (int u = 0; u < r.m.layout.n_units; u++) {
        float *hu = malloc(r.m.layout.unit_numel[u] * 4);
        REQUIRE(hu, "out of memory");
        model_random_unit_f32(&r.m, 1234, 0.05f, u, hu);
        ops_upload_f32(r.o, r.w.params[u], hu, r.m.layout.unit_numel[u]);
        free(hu);
    }
    decode_bufs_graph_stats(r.b, &gs);
    const int64_t rec1 = gs.recordings, rep1 = gs.replays;
    CHECK(rig_padded(&r, 5, 1, G) == 0 && rig_padded(&r, 5, 0, E) == 0, "steps after the upload");
    decode_bufs_graph_stats(r.b, &gs);
    CHECK(gs.recordings == rec1 && gs.replays == rep1 + 1,
          "%s: an in-place upload must replay without recording: %lld recordings (%lld before), %lld replays (%lld)",
          name, (long long)gs.recordings, (long long)rec1, (long long)gs.replays, (long long)rep1);
    CHECK(memcmp(G, E, 5 * V * 4) == 0, "%s: after an upload: graph != eager (max diff %g)", name,
          max_diff(G, E, 5 * V));
    CHECK(max_diff(G, O, 5 * V) > 1e-2 * max_abs(O, 5 * V), "%s: the replay did not see the uploaded weights", name);

    resident_free(&wb, &r.m);
    resident_free(&wc, &r.m);
    free(G);
    free(E);
    free(U);
    free(O);
    rig_free(&r);
}

int main(void) {
    test_cpu();
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        printf("CPU part passed. SKIP: no CUDA device (or a build without the CUDA backend): the CUDA graph tests "
               "did not run\n");
        return 77;
    }
    test_graph_api();
    test_decode("llama", LLAMA);
    test_decode("qwen3", QWEN3);
    return check_exit_code("test_cuda_graph_decode");
}
