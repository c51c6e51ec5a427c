// test_rollout_blocks.c — the rollout server's KV block manager and scheduler, without a model:
//   - allocation, reference counts, release, exhaustion (all-or-nothing);
//   - fork + copy-on-write of the shared last partial block (K/V rows really copied, every layer);
//   - prefix caching: chained hashes hit only identical prefixes, never the last token, LRU eviction order,
//     no double registration, reset (and tables from before a reset never register);
//   - a randomised run against a shadow model of every block's contents: every prefix hit hands out blocks
//     that hold exactly the queried tokens, and refcounts always equal the references held by tables;
//   - the scheduler: token budget and max_num_seqs respected, decodes never starved by prefills, preemption of
//     the newest sequence when the pool is short, and every sequence completes; a weight update's re-queue
//     (sched_requeue_all) gives back every block and puts the running sequences, oldest first, ahead of the queue.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/block_manager.h"
#include "rollout_server/scheduler.h"
#include "tests/unit/check_macros.h"

static BlockManager *make_bm(int n_blocks, int bs, int prefix) {
    char err[256];
    BlockManager *bm;
    if (bm_create(&bm, n_blocks, bs, prefix, NULL, NULL, err, sizeof err) != 0) {
        fprintf(stderr, "bm_create: %s\n", err);
        exit(1);
    }
    return bm;
}

static void check_totals(BlockManager *bm, const char *where) {
    CHECK(bm_num_used(bm) + bm_num_free(bm) == bm_num_blocks(bm), "%s: used %d + free %d != %d", where,
          bm_num_used(bm), bm_num_free(bm), bm_num_blocks(bm));
}

static void test_alloc_release_exhaustion(void) {
    BlockManager *bm = make_bm(8, 4, 0);
    BlockTable a, b;
    bm_table_init(&a, 8);
    bm_table_init(&b, 8);
    CHECK(bm_ensure(bm, &a, 0, 10) == 0, "10 tokens in 8 free blocks");
    CHECK(a.n == 3 && bm_num_used(bm) == 3 && bm_num_free(bm) == 5, "n %d used %d free %d", a.n, bm_num_used(bm),
          bm_num_free(bm));
    for (int j = 0; j < a.n; j++) CHECK(bm_refcount(bm, a.ids[j]) == 1, "block %d refcount", a.ids[j]);
    CHECK(bm_blocks_needed(bm, &a, 10, 12) == 0, "12 tokens still fit in 3 blocks");
    CHECK(bm_ensure(bm, &a, 10, 13) == 0 && a.n == 4, "a grows to 4 blocks");
    // b wants 20 tokens = 5 blocks, only 4 free: refused, nothing taken.
    CHECK(bm_ensure(bm, &b, 0, 20) == -1, "5 blocks out of 4 free must fail");
    CHECK(b.n == 0 && bm_num_free(bm) == 4, "a failed ensure takes nothing (n %d free %d)", b.n, bm_num_free(bm));
    CHECK(bm_ensure(bm, &b, 0, 16) == 0 && bm_num_free(bm) == 0, "exactly the 4 free blocks");
    CHECK(bm_ensure(bm, &b, 16, 17) == -1, "pool exhausted");
    // Distinct blocks everywhere.
    int seen[8] = {0};
    for (int j = 0; j < a.n; j++) seen[a.ids[j]]++;
    for (int j = 0; j < b.n; j++) seen[b.ids[j]]++;
    for (int i = 0; i < 8; i++) CHECK(seen[i] == 1, "block %d held %d times", i, seen[i]);
    bm_release(bm, &a);
    CHECK(a.n == 0 && bm_num_free(bm) == 4 && bm_num_used(bm) == 4, "release gives back 4");
    bm_release(bm, &b);
    CHECK(bm_num_free(bm) == 8 && bm_num_cached(bm) == 0, "all free, nothing cached without prefix caching");
    // Table capacity is a hard limit too.
    BlockTable small;
    bm_table_init(&small, 2);
    CHECK(bm_ensure(bm, &small, 0, 9) == -1, "9 tokens need 3 blocks, the table holds 2");
    check_totals(bm, "alloc");
    bm_table_destroy(&a);
    bm_table_destroy(&b);
    bm_table_destroy(&small);
    bm_destroy(bm);
}

// A K/V pool on the host standing in for the model runner's: the block manager's copy-on-write asks it to copy
// rows (BmCopyRows), which it does for every layer and counts.
typedef struct {
    int n_layers, bs, row;      // row = Hkv * D floats per token
    float *k[2], *v[2];         // (n_blocks * bs, row) per layer
    int copies;
} HostKv;

static void host_copy_rows(void *user, int32_t dst, int32_t src, int rows) {
    HostKv *kv = user;
    const size_t blk = (size_t)kv->bs * kv->row, bytes = (size_t)rows * kv->row * sizeof(float);
    for (int l = 0; l < kv->n_layers; l++) {
        memcpy(kv->k[l] + dst * blk, kv->k[l] + src * blk, bytes);
        memcpy(kv->v[l] + dst * blk, kv->v[l] + src * blk, bytes);
    }
    kv->copies++;
}

// Fork shares every block; the first write into the shared partial block copies its valid rows (all layers).
static void test_fork_cow(void) {
    char err[256];
    const int n_blocks = 6, bs = 4, L = 2, row = 3;
    HostKv kv = {.n_layers = L, .bs = bs, .row = row};
    for (int l = 0; l < L; l++) {
        kv.k[l] = malloc((size_t)n_blocks * bs * row * sizeof(float));
        kv.v[l] = malloc((size_t)n_blocks * bs * row * sizeof(float));
        for (int i = 0; i < n_blocks * bs * row; i++) {
            kv.k[l][i] = 1000.0f * l + i;
            kv.v[l][i] = -1000.0f * l - i;
        }
    }
    BlockManager *bm;
    CHECK(bm_create(&bm, n_blocks, bs, 1, host_copy_rows, &kv, err, sizeof err) == 0, "%s", err);
    BlockTable p, c1, c2;
    bm_table_init(&p, 4);
    bm_table_init(&c1, 4);
    bm_table_init(&c2, 4);
    CHECK(bm_ensure(bm, &p, 0, 6) == 0, "prompt of 6 tokens");
    bm_fork(bm, &c1, &p);
    bm_fork(bm, &c2, &p);
    CHECK(bm_refcount(bm, p.ids[0]) == 3 && bm_refcount(bm, p.ids[1]) == 3, "3 holders of both blocks");
    CHECK(bm_num_used(bm) == 2, "forks take no new blocks (used %d)", bm_num_used(bm));
    CHECK(bm_blocks_needed(bm, &c1, 6, 7) == 1, "writing position 6 needs a private copy of block 1");
    CHECK(bm_ensure(bm, &c1, 6, 7) == 0, "c1 writes its first token");
    CHECK(c1.ids[0] == p.ids[0] && c1.ids[1] != p.ids[1] && kv.copies == 1, "only the partial block is copied "
          "(%d copies)", kv.copies);
    CHECK(bm_refcount(bm, p.ids[1]) == 2 && bm_refcount(bm, c1.ids[1]) == 1 && bm_refcount(bm, p.ids[0]) == 3,
          "refcounts after copy-on-write");
    for (int l = 0; l < L; l++) {
        const float *k = kv.k[l], *v = kv.v[l];
        const size_t src = (size_t)p.ids[1] * bs * row, dst = (size_t)c1.ids[1] * bs * row;
        int same = 1;
        for (int i = 0; i < 2 * row; i++) same &= k[dst + i] == k[src + i] && v[dst + i] == v[src + i];
        CHECK(same, "layer %d: the 2 valid rows of the shared block are copied", l);
    }
    // A block-aligned prefix needs no copy: position 8 opens a fresh block.
    CHECK(bm_ensure(bm, &c1, 7, 9) == 0 && c1.n == 3, "c1 grows into a third block");
    CHECK(bm_ensure(bm, &c2, 6, 7) == 0, "c2 copies too");
    CHECK(bm_refcount(bm, p.ids[1]) == 1, "p holds its partial block alone now");
    CHECK(bm_ensure(bm, &p, 6, 7) == 0 && bm_refcount(bm, p.ids[1]) == 1, "p writes in place (sole holder)");
    CHECK(kv.copies == 2, "one copy each for c1 and c2, none for a fresh block or the sole holder (%d)", kv.copies);
    bm_release(bm, &c1);
    bm_release(bm, &c2);
    bm_release(bm, &p);
    CHECK(bm_num_used(bm) == 0, "everything released (used %d)", bm_num_used(bm));
    check_totals(bm, "cow");
    bm_table_destroy(&p);
    bm_table_destroy(&c1);
    bm_table_destroy(&c2);
    bm_destroy(bm);
    for (int l = 0; l < L; l++) {
        free(kv.k[l]);
        free(kv.v[l]);
    }
}

static void fill_tokens(int32_t *t, int n, int base) {
    for (int i = 0; i < n; i++) t[i] = base + i;
}

static void test_prefix_cache(void) {
    const int bs = 4;
    BlockManager *bm = make_bm(10, bs, 1);
    BlockTable a, b;
    bm_table_init(&a, 8);
    bm_table_init(&b, 8);
    int32_t ta[12], tb[12];
    fill_tokens(ta, 12, 100);
    CHECK(bm_match_prefix(bm, &a, ta, 10) == 0, "empty cache: no hit");
    CHECK(bm_ensure(bm, &a, 0, 10) == 0, "a: 10 tokens");
    bm_commit(bm, &a, ta, 10); // 2 full blocks registered, the partial third is not
    CHECK(a.n_hashed == 2, "two full blocks hashed (%d)", a.n_hashed);
    // b shares the first 9 tokens: both full blocks hit, while a still holds them.
    memcpy(tb, ta, sizeof tb);
    tb[9] = 7;
    CHECK(bm_match_prefix(bm, &b, tb, 10) == 8, "2 blocks hit");
    CHECK(b.ids[0] == a.ids[0] && b.ids[1] == a.ids[1] && bm_refcount(bm, a.ids[0]) == 2, "hits share a's blocks");
    bm_release(bm, &b);
    // Differs inside block 1: only block 0 hits.
    tb[5] = 9999;
    CHECK(bm_match_prefix(bm, &b, tb, 10) == 4, "1 block hit");
    bm_release(bm, &b);
    // Same block-1 tokens behind a different block 0: the chain misses at once.
    memcpy(tb, ta, sizeof tb);
    tb[0] = 5;
    CHECK(bm_match_prefix(bm, &b, tb, 10) == 0, "a different first block misses everything");
    bm_release(bm, &b);
    // Exactly 8 identical tokens: the last token must be computed, so only block 0 may hit.
    CHECK(bm_match_prefix(bm, &b, ta, 8) == 4, "8-token prompt reuses 1 block, not 2");
    bm_release(bm, &b);
    CHECK(bm_match_prefix(bm, &b, ta, 9) == 8, "9-token prompt reuses 2 blocks");
    bm_release(bm, &b);

    // Release a: its 2 registered blocks stay cached (still counted free), the partial one is free.
    bm_release(bm, &a);
    CHECK(bm_num_cached(bm) == 2 && bm_num_used(bm) == 0 && bm_num_free(bm) == 10, "cached %d used %d free %d",
          bm_num_cached(bm), bm_num_used(bm), bm_num_free(bm));
    CHECK(bm_match_prefix(bm, &b, ta, 12) == 8, "hits survive the release");
    CHECK(bm_num_cached(bm) == 0 && bm_num_used(bm) == 2, "hit blocks leave the LRU");
    bm_release(bm, &b);

    // Duplicate content computed without a hit is not registered twice.
    BlockTable d1, d2;
    bm_table_init(&d1, 8);
    bm_table_init(&d2, 8);
    int32_t td[8];
    fill_tokens(td, 8, 500);
    bm_ensure(bm, &d1, 0, 8);
    bm_ensure(bm, &d2, 0, 8);
    bm_commit(bm, &d1, td, 8);
    bm_commit(bm, &d2, td, 8);
    bm_release(bm, &d1);
    bm_release(bm, &d2);
    CHECK(bm_num_cached(bm) == 2 + 2, "a's 2 + one copy of d's 2 cached (%d)", bm_num_cached(bm));

    // Reset: nothing hits, cached blocks are free; a table from before the reset never registers.
    bm_ensure(bm, &d1, 0, 4);
    bm_reset_prefix_cache(bm);
    CHECK(bm_num_cached(bm) == 0 && bm_num_free(bm) == 9, "reset frees the cache (free %d)", bm_num_free(bm));
    CHECK(bm_match_prefix(bm, &b, ta, 12) == 0, "no hit after reset");
    bm_release(bm, &b);
    bm_commit(bm, &d1, td, 4);
    CHECK(bm_match_prefix(bm, &b, td, 8) == 0, "a stale table did not register");
    bm_release(bm, &b);
    bm_release(bm, &d1);
    check_totals(bm, "prefix");
    bm_table_destroy(&a);
    bm_table_destroy(&b);
    bm_table_destroy(&d1);
    bm_table_destroy(&d2);
    bm_destroy(bm);
}

// Cached blocks are evicted least recently released first, and a sequence's tail before its head.
// Tables of another root (another LoRA adapter: rollout_server/engine_request.c) share no cached block with these,
// whatever their tokens; tables of the same root do, also after a release and in a fork.
static void test_prefix_roots(void) {
    const int bs = 4;
    BlockManager *bm = make_bm(12, bs, 1);
    BlockTable a, b, c, f;
    bm_table_init(&a, 8);
    bm_table_init(&b, 8);
    bm_table_init(&c, 8);
    bm_table_init(&f, 8);
    int32_t t[12];
    fill_tokens(t, 12, 300);
    bm_table_set_root(&a, 11);
    CHECK(bm_ensure(bm, &a, 0, 12) == 0, "a: 12 tokens");
    bm_commit(bm, &a, t, 12);
    CHECK(a.n_hashed == 3, "a: three blocks hashed (%d)", a.n_hashed);
    CHECK(bm_match_prefix(bm, &b, t, 12) == 0, "root 0 does not hit root 11's blocks");
    bm_table_set_root(&c, 22);
    CHECK(bm_match_prefix(bm, &c, t, 12) == 0, "root 22 does not hit root 11's blocks");
    bm_release(bm, &c);
    bm_table_set_root(&c, 11);
    CHECK(bm_match_prefix(bm, &c, t, 12) == 8, "root 11 hits root 11's blocks");
    bm_fork(bm, &f, &c);
    CHECK(f.root == 11, "a fork keeps the root");
    bm_release(bm, &c);
    bm_release(bm, &f);
    CHECK(c.last_hash == 11 && c.n_hashed == 0, "a released table starts again from its root");
    CHECK(bm_match_prefix(bm, &c, t, 12) == 8, "root 11 hits again after the release");
    bm_release(bm, &c);
    bm_release(bm, &a);
    bm_release(bm, &b);
    bm_table_destroy(&a);
    bm_table_destroy(&b);
    bm_table_destroy(&c);
    bm_table_destroy(&f);
    bm_destroy(bm);
}

static void test_lru_eviction(void) {
    const int bs = 2;
    BlockManager *bm = make_bm(6, bs, 1);
    BlockTable s1, s2, x;
    bm_table_init(&s1, 8);
    bm_table_init(&s2, 8);
    bm_table_init(&x, 8);
    int32_t t1[5] = {1, 2, 3, 4, 5}, t2[5] = {9, 8, 7, 6, 5};
    bm_ensure(bm, &s1, 0, 5);
    bm_commit(bm, &s1, t1, 5); // blocks [1 2] [3 4] registered, [5] not
    bm_ensure(bm, &s2, 0, 5);
    bm_commit(bm, &s2, t2, 5);
    bm_release(bm, &s1); // LRU: s1.[3 4], s1.[1 2]
    bm_release(bm, &s2); // then s2.[7 6], s2.[9 8]
    CHECK(bm_num_cached(bm) == 4 && bm_num_free(bm) == 6, "4 cached, 6 allocatable");
    // 4 fresh blocks: the 2 plain free blocks first, then the two oldest cached (s1's tail, then s1's head).
    bm_ensure(bm, &x, 0, 7);
    CHECK(x.n == 4 && bm_num_cached(bm) == 2, "2 cached left (%d)", bm_num_cached(bm));
    CHECK(bm_match_prefix(bm, &s1, t1, 5) == 0, "s1's prefix was evicted");
    bm_release(bm, &s1);
    CHECK(bm_match_prefix(bm, &s2, t2, 5) == 4, "s2's prefix survives");
    bm_release(bm, &s2);
    // One more block: the oldest cached is now s2's tail [7 6]; its head [9 8] still hits.
    BlockTable y;
    bm_table_init(&y, 4);
    CHECK(bm_ensure(bm, &y, 0, 1) == 0, "one more block");
    CHECK(bm_match_prefix(bm, &s2, t2, 5) == 2, "head survives, tail evicted");
    bm_release(bm, &s2);
    bm_release(bm, &x);
    bm_release(bm, &y);
    check_totals(bm, "lru");
    bm_table_destroy(&s1);
    bm_table_destroy(&s2);
    bm_table_destroy(&x);
    bm_table_destroy(&y);
    bm_destroy(bm);
}

// Random operations against a shadow of what every block holds: content written by a sequence at position
// p is its token p. Every hit must return blocks whose shadow equals the queried tokens.
static uint64_t rng_state = 12345;
static uint32_t rnd(void) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 33);
}

static void test_random_against_shadow(void) {
    enum { NB = 24, BS = 3, NSEQ = 6, MAXT = 30 };
    BlockManager *bm = make_bm(NB, BS, 1);
    BlockTable t[NSEQ];
    int32_t tok[NSEQ][MAXT];
    int len[NSEQ] = {0}, computed[NSEQ] = {0};
    int32_t shadow[NB][BS];
    for (int s = 0; s < NSEQ; s++) bm_table_init(&t[s], MAXT / BS + 1);
    int hits = 0, bad_hits = 0, bad_refs = 0;
    for (int it = 0; it < 4000; it++) {
        int s = rnd() % NSEQ, op = rnd() % 10;
        if (op < 2 && len[s] > 0) { // finish
            bm_release(bm, &t[s]);
            len[s] = computed[s] = 0;
        } else if (op == 2 && rnd() % 20 == 0) {
            bm_reset_prefix_cache(bm);
        } else if (len[s] == 0) { // start: tokens from a tiny alphabet so that prefixes repeat
            len[s] = 4 + rnd() % (MAXT - 4);
            for (int i = 0; i < len[s]; i++) tok[s][i] = (i < 6 ? 0 : (int)(rnd() % 2)) + (rnd() % 3 == 0);
            int hit = bm_match_prefix(bm, &t[s], tok[s], len[s]);
            hits += hit > 0;
            for (int p = 0; p < hit; p++) bad_hits += shadow[t[s].ids[p / BS]][p % BS] != tok[s][p];
            computed[s] = hit;
        } else if (computed[s] < len[s]) { // compute a chunk, writing the shadow
            int want = 1 + rnd() % 5;
            if (computed[s] + want > len[s]) want = len[s] - computed[s];
            int32_t before[MAXT / BS + 1];
            const int n_before = t[s].n;
            memcpy(before, t[s].ids, (size_t)n_before * sizeof *before);
            if (bm_ensure(bm, &t[s], computed[s], computed[s] + want) == 0) {
                // A copy-on-write moved a block: the copy holds the original's rows below the first write.
                for (int j = 0; j < n_before; j++)
                    if (t[s].ids[j] != before[j])
                        for (int r = 0; r < BS && j * BS + r < computed[s]; r++) shadow[t[s].ids[j]][r] = shadow[before[j]][r];
                for (int p = computed[s]; p < computed[s] + want; p++) shadow[t[s].ids[p / BS]][p % BS] = tok[s][p];
                computed[s] += want;
                bm_commit(bm, &t[s], tok[s], computed[s]);
            }
        } else if (len[s] > 0 && len[s] < MAXT && t[s].n > 0 && rnd() % 2) { // fork into an idle slot
            for (int d = 0; d < NSEQ; d++)
                if (len[d] == 0 && d != s) {
                    bm_fork(bm, &t[d], &t[s]);
                    memcpy(tok[d], tok[s], sizeof tok[s]);
                    len[d] = len[s] + 1;
                    tok[d][len[s]] = 1;
                    computed[d] = computed[s];
                    break;
                }
        }
        int refs[NB] = {0};
        for (int q = 0; q < NSEQ; q++)
            for (int j = 0; j < t[q].n; j++) refs[t[q].ids[j]]++;
        for (int b = 0; b < NB; b++) bad_refs += refs[b] != bm_refcount(bm, b);
        if (bm_num_used(bm) + bm_num_free(bm) != NB) bad_refs++;
    }
    CHECK(hits > 50, "the random run exercised prefix hits (%d)", hits);
    CHECK(bad_hits == 0, "%d hit tokens differ from the block contents", bad_hits);
    CHECK(bad_refs == 0, "%d refcount / total mismatches", bad_refs);
    for (int s = 0; s < NSEQ; s++) {
        bm_release(bm, &t[s]);
        bm_table_destroy(&t[s]);
    }
    CHECK(bm_num_used(bm) == 0, "all released");
    bm_destroy(bm);
}

// ---- scheduler -----------------------------------------------------------------------------------

typedef struct {
    Sequence s;
    int target; // total length at which the sequence is done
} FakeSeq;

// Drives the scheduler like the engine does (compute, then append one token to each sequence whose computed
// tokens reached its length) until every sequence is done. Checks the step invariants on the way.
static void run_sched(int n_blocks, int bs, int max_seqs, int max_tokens, int n_seqs, int64_t *preempts,
                      int *steps_out) {
    BlockManager *bm = make_bm(n_blocks, bs, 1);
    Scheduler sc;
    sched_init(&sc, bm, max_seqs, max_tokens);
    FakeSeq *f = calloc((size_t)n_seqs, sizeof *f);
    for (int i = 0; i < n_seqs; i++) {
        Sequence *q = &f[i].s;
        q->n_prompt = q->n_tokens = 3 + (i * 7) % 11;
        f[i].target = q->n_prompt + 2 + (i * 5) % 9;
        q->cap = f[i].target;
        q->tokens = calloc((size_t)q->cap, sizeof(int32_t));
        for (int p = 0; p < q->n_tokens; p++) q->tokens[p] = i * 100 + p;
        bm_table_init(&q->table, (q->cap + bs - 1) / bs);
        sched_add_waiting(&sc, q, 0);
    }
    int done = 0, steps = 0, bad = 0, decode_starved = 0;
    while (done < n_seqs && steps < 10000) {
        int n_decodes_before = 0;
        for (Sequence *q = sc.running.head; q; q = q->next) n_decodes_before += q->n_tokens - q->n_computed == 1;
        int n = sched_step(&sc);
        steps++;
        if (n == 0) continue;
        int sum = 0, decodes = 0;
        for (int i = 0; i < sc.n_step; i++) {
            Sequence *q = sc.step[i];
            sum += q->sched;
            decodes += q->n_tokens - q->n_computed == 1;
            bad += q->table.n * bs < q->n_computed + q->sched; // blocks cover the written positions
        }
        bad += sum != n || n > max_tokens || sc.running.count > max_seqs;
        // Without preemption in this step, every decode that was running got its token (budget permitting).
        if (sc.preemptions == *preempts && n_decodes_before <= max_tokens && decodes < n_decodes_before)
            decode_starved++;
        *preempts = sc.preemptions;
        sched_commit(&sc);
        for (int i = 0; i < sc.n_step; i++) {
            Sequence *q = sc.step[i];
            if (q->n_computed != q->n_tokens) continue;
            FakeSeq *fs = (FakeSeq *)q;
            if (q->n_tokens == fs->target) {
                sched_remove(&sc, q);
                done++;
            } else {
                q->tokens[q->n_tokens] = (int32_t)(fs - f) * 100 + q->n_tokens;
                q->n_tokens++;
            }
        }
    }
    CHECK(done == n_seqs, "%d of %d sequences completed in %d steps", done, n_seqs, steps);
    CHECK(bad == 0, "%d step invariant violations", bad);
    CHECK(decode_starved == 0, "%d steps left running decodes out", decode_starved);
    CHECK(bm_num_used(bm) == 0, "blocks leaked: %d used", bm_num_used(bm));
    *steps_out = steps;
    for (int i = 0; i < n_seqs; i++) {
        free(f[i].s.tokens);
        bm_table_destroy(&f[i].s.table);
    }
    free(f);
    sched_destroy(&sc);
    bm_destroy(bm);
}

static void test_scheduler(void) {
    int64_t pre = 0;
    int steps;
    run_sched(64, 4, 8, 16, 20, &pre, &steps);
    CHECK(pre == 0, "a roomy pool preempts nothing (%lld)", (long long)pre);
    pre = 0;
    run_sched(6, 4, 8, 16, 20, &pre, &steps); // 24 slots; sequences reach 22 tokens
    CHECK(pre > 0, "a tiny pool preempts");
}

// The victim is the newest running sequence, which goes back to the front of the queue without blocks.
static void test_preempt_newest(void) {
    BlockManager *bm = make_bm(4, 2, 0);
    Scheduler sc;
    sched_init(&sc, bm, 4, 8);
    Sequence a = {0}, b = {0};
    int32_t ta[8] = {1, 2, 3, 4, 5, 6, 7, 8}, tb[8] = {9, 9, 9, 9, 9, 9, 9, 9};
    Sequence *qs[2] = {&a, &b};
    int32_t *ts[2] = {ta, tb};
    for (int i = 0; i < 2; i++) {
        qs[i]->tokens = ts[i];
        qs[i]->cap = 8;
        qs[i]->n_prompt = qs[i]->n_tokens = 4;
        bm_table_init(&qs[i]->table, 4);
        sched_add_waiting(&sc, qs[i], 0);
    }
    CHECK(sched_step(&sc) == 8 && sc.n_step == 2, "both prompts prefill in one step");
    sched_commit(&sc);
    a.n_tokens = b.n_tokens = 5; // each sampled a token; both need a third block, and no block is free
    CHECK(sched_step(&sc) == 1 && sc.n_step == 1 && sc.step[0] == &a, "a decodes, b (newer) is preempted");
    CHECK(sc.preemptions == 1 && b.status == SEQ_WAITING && b.table.n == 0 && b.n_computed == 0 &&
          sc.waiting.head == &b, "b waits at the front with no blocks");
    sched_remove(&sc, &a);
    CHECK(sched_step(&sc) == 5 && sc.step[0] == &b, "b recomputes its 5 tokens once a is gone");
    sched_remove(&sc, &b);
    bm_table_destroy(&a.table);
    bm_table_destroy(&b.table);
    sched_destroy(&sc);
    bm_destroy(bm);
}

// A weight update: every sequence gives its blocks back and recomputes everything; the running ones (oldest first)
// go ahead of those that were waiting; nothing counts as a preemption.
static void test_requeue_all(void) {
    BlockManager *bm = make_bm(16, 2, 1);
    Scheduler sc;
    sched_init(&sc, bm, 2, 16);
    Sequence q[3] = {{0}};
    int32_t t[3][8] = {{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}, {11, 12, 13, 14, 15}};
    for (int i = 0; i < 3; i++) {
        q[i].tokens = t[i];
        q[i].cap = 8;
        q[i].n_prompt = q[i].n_tokens = 5;
        bm_table_init(&q[i].table, 4);
        sched_add_waiting(&sc, &q[i], 0);
    }
    CHECK(sched_step(&sc) == 10 && sc.n_step == 2, "max_num_seqs 2: q0 and q1 prefill, q2 waits");
    sched_commit(&sc);
    q[0].n_tokens = q[1].n_tokens = 6;
    CHECK(sched_step(&sc) == 2, "both decode");
    sched_commit(&sc);
    CHECK(bm_num_used(bm) > 0 && bm_num_cached(bm) == 0, "blocks in use");
    sched_requeue_all(&sc);
    CHECK(sc.running.count == 0 && sc.waiting.count == 3 && sc.waiting.head == &q[0] &&
              sc.waiting.head->next == &q[1] && sc.waiting.tail == &q[2],
          "waiting: q0, q1 (the running ones, oldest first), then q2");
    for (int i = 0; i < 3; i++)
        CHECK(q[i].status == SEQ_WAITING && q[i].table.n == 0 && q[i].n_computed == 0, "q%d: no blocks, recomputes", i);
    CHECK(bm_num_used(bm) == 0 && sc.preemptions == 0, "every block given back (%d used), no preemption",
          bm_num_used(bm));
    bm_reset_prefix_cache(bm);
    CHECK(sched_step(&sc) == 12 && sc.n_step == 2 && sc.step[0] == &q[0] && sc.step[1] == &q[1] &&
              q[0].sched == 6 && q[1].sched == 6,
          "q0 and q1 recompute their 6 tokens first (no prefix hit after the reset)");
    for (int i = 0; i < 3; i++) {
        sched_remove(&sc, &q[i]);
        bm_table_destroy(&q[i].table);
    }
    sched_destroy(&sc);
    bm_destroy(bm);
}

int main(void) {
    test_alloc_release_exhaustion();
    test_fork_cow();
    test_prefix_cache();
    test_prefix_roots();
    test_lru_eviction();
    test_random_against_shadow();
    test_scheduler();
    test_preempt_newest();
    test_requeue_all();
    if (failures) {
        fprintf(stderr, "test_rollout_blocks: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_rollout_blocks: all passed\n");
    return 0;
}
