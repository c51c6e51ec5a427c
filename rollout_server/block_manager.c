// rollout_server/block_manager.c — reference-counted KV blocks, copy-on-write, and the prefix cache (a hash
// table of registered full blocks plus an LRU list of the unreferenced ones). See block_manager.h.
#include "rollout_server/block_manager.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct BlockManager {
    int n_blocks, block_size, prefix_caching;
    BmCopyRows copy_rows;   // NULL: bookkeeping only
    void *copy_user;
    int32_t *ref;           // (n_blocks) reference counts
    uint8_t *hashed;        // (n_blocks) 1 when registered in the prefix table
    uint64_t *hash;         // (n_blocks) chained hash of a registered block
    uint64_t *parent;       // (n_blocks) its parent's chained hash
    int32_t *toks;          // (n_blocks, block_size) its token ids (collision check)
    int32_t *free_stack;    // (n_blocks) free blocks, popped from the end
    int n_free;
    int32_t *lru_prev, *lru_next; // (n_blocks) cached blocks, head = least recently released
    int lru_head, lru_tail, n_cached;
    int32_t *ht;            // (ht_mask + 1) open addressing (linear probing) of registered block ids, -1 empty
    uint32_t ht_mask;
    int n_used;
    uint64_t epoch;         // bumped by every prefix-cache reset
};

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

uint64_t bm_block_hash(uint64_t parent, const int32_t *tokens, int n) {
    uint64_t h = mix64(parent + 0x9E3779B97F4A7C15ULL * (uint64_t)(n + 1));
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)tokens[i]) * 0x100000001B3ULL;
    return mix64(h);
}

int bm_create(BlockManager **out, int n_blocks, int block_size, int enable_prefix_caching, BmCopyRows copy_rows,
              void *copy_user, char *err, size_t err_len) {
    *out = NULL;
    if (n_blocks < 1 || block_size < 1) {
        snprintf(err, err_len, "block pool of %d blocks x %d tokens: both must be >= 1", n_blocks, block_size);
        return -1;
    }
    BlockManager *bm = calloc(1, sizeof *bm);
    if (!bm) goto oom;
    bm->n_blocks = n_blocks;
    bm->block_size = block_size;
    bm->prefix_caching = enable_prefix_caching != 0;
    bm->copy_rows = copy_rows;
    bm->copy_user = copy_user;
    uint32_t cap = 16;
    while (cap < 2u * (uint32_t)n_blocks) cap <<= 1;
    bm->ht_mask = cap - 1;
    const size_t n = (size_t)n_blocks;
    bm->ref = calloc(n, sizeof *bm->ref);
    bm->hashed = calloc(n, 1);
    bm->hash = calloc(n, sizeof *bm->hash);
    bm->parent = calloc(n, sizeof *bm->parent);
    bm->toks = malloc(n * block_size * sizeof *bm->toks);
    bm->free_stack = malloc(n * sizeof *bm->free_stack);
    bm->lru_prev = malloc(n * sizeof *bm->lru_prev);
    bm->lru_next = malloc(n * sizeof *bm->lru_next);
    bm->ht = malloc((size_t)cap * sizeof *bm->ht);
    if (!bm->ref || !bm->hashed || !bm->hash || !bm->parent || !bm->toks || !bm->free_stack || !bm->lru_prev ||
        !bm->lru_next || !bm->ht)
        goto oom;
    for (uint32_t i = 0; i < cap; i++) bm->ht[i] = -1;
    // Popped from the end: block 0 is handed out first.
    for (int i = 0; i < n_blocks; i++) bm->free_stack[i] = n_blocks - 1 - i;
    bm->n_free = n_blocks;
    bm->lru_head = bm->lru_tail = -1;
    *out = bm;
    return 0;
oom:
    snprintf(err, err_len, "out of host memory for the bookkeeping of %d KV blocks", n_blocks);
    bm_destroy(bm);
    return -1;
}

void bm_destroy(BlockManager *bm) {
    if (!bm) return;
    free(bm->ref);
    free(bm->hashed);
    free(bm->hash);
    free(bm->parent);
    free(bm->toks);
    free(bm->free_stack);
    free(bm->lru_prev);
    free(bm->lru_next);
    free(bm->ht);
    free(bm);
}

int bm_block_size(const BlockManager *bm) { return bm->block_size; }
int bm_num_blocks(const BlockManager *bm) { return bm->n_blocks; }
int bm_num_free(const BlockManager *bm) { return bm->n_free + bm->n_cached; }
int bm_num_used(const BlockManager *bm) { return bm->n_used; }
int bm_num_cached(const BlockManager *bm) { return bm->n_cached; }
int bm_refcount(const BlockManager *bm, int block) { return bm->ref[block]; }
int bm_prefix_caching(const BlockManager *bm) { return bm->prefix_caching; }

int bm_table_init(BlockTable *t, int max_blocks) {
    memset(t, 0, sizeof *t);
    t->ids = malloc((size_t)(max_blocks > 0 ? max_blocks : 1) * sizeof *t->ids);
    if (!t->ids) return -1;
    t->cap = max_blocks;
    return 0;
}

void bm_table_set_root(BlockTable *t, uint64_t root) {
    if (t->n != 0) return;
    t->root = root;
    t->last_hash = root;
}

void bm_table_destroy(BlockTable *t) {
    free(t->ids);
    memset(t, 0, sizeof *t);
}

// ---- prefix hash table --------------------------------------------------------------------------

static int ht_lookup(const BlockManager *bm, uint64_t h, uint64_t parent, const int32_t *tokens) {
    const int bs = bm->block_size;
    for (uint32_t i = (uint32_t)h & bm->ht_mask;; i = (i + 1) & bm->ht_mask) {
        int32_t b = bm->ht[i];
        if (b < 0) return -1;
        if (bm->hash[b] == h && bm->parent[b] == parent &&
            memcmp(bm->toks + (size_t)b * bs, tokens, (size_t)bs * sizeof *tokens) == 0)
            return b;
    }
}

static void ht_insert(BlockManager *bm, int32_t b) {
    uint32_t i = (uint32_t)bm->hash[b] & bm->ht_mask;
    while (bm->ht[i] >= 0) i = (i + 1) & bm->ht_mask;
    bm->ht[i] = b;
}

// Removes b and shifts later entries of its probe run back so every lookup still finds its entry.
static void ht_remove(BlockManager *bm, int32_t b) {
    uint32_t i = (uint32_t)bm->hash[b] & bm->ht_mask;
    while (bm->ht[i] != b) i = (i + 1) & bm->ht_mask;
    bm->ht[i] = -1;
    for (uint32_t j = (i + 1) & bm->ht_mask; bm->ht[j] >= 0; j = (j + 1) & bm->ht_mask) {
        uint32_t home = (uint32_t)bm->hash[bm->ht[j]] & bm->ht_mask;
        // Entry j may move to the hole at i unless its home lies cyclically in (i, j].
        int stays = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            bm->ht[i] = bm->ht[j];
            bm->ht[j] = -1;
            i = j;
        }
    }
}

static void unregister(BlockManager *bm, int32_t b) {
    ht_remove(bm, b);
    bm->hashed[b] = 0;
}

// ---- LRU of cached blocks -----------------------------------------------------------------------

static void lru_push_tail(BlockManager *bm, int32_t b) {
    bm->lru_prev[b] = bm->lru_tail;
    bm->lru_next[b] = -1;
    if (bm->lru_tail >= 0) bm->lru_next[bm->lru_tail] = b;
    else bm->lru_head = b;
    bm->lru_tail = b;
    bm->n_cached++;
}

static void lru_unlink(BlockManager *bm, int32_t b) {
    int32_t p = bm->lru_prev[b], n = bm->lru_next[b];
    if (p >= 0) bm->lru_next[p] = n;
    else bm->lru_head = n;
    if (n >= 0) bm->lru_prev[n] = p;
    else bm->lru_tail = p;
    bm->n_cached--;
}

// ---- allocation ---------------------------------------------------------------------------------

// A block with refcount 1: a free one, else the least recently released cached one. -1 when none.
static int32_t take_block(BlockManager *bm) {
    int32_t b;
    if (bm->n_free > 0) {
        b = bm->free_stack[--bm->n_free];
    } else if (bm->lru_head >= 0) {
        b = bm->lru_head;
        lru_unlink(bm, b);
        unregister(bm, b);
    } else {
        return -1;
    }
    bm->ref[b] = 1;
    bm->n_used++;
    return b;
}

static void add_ref(BlockManager *bm, int32_t b) {
    if (bm->ref[b] == 0) { // a cached block comes back into use
        lru_unlink(bm, b);
        bm->n_used++;
    }
    bm->ref[b]++;
}

static void drop_ref(BlockManager *bm, int32_t b) {
    if (--bm->ref[b] > 0) return;
    bm->n_used--;
    if (bm->hashed[b]) lru_push_tail(bm, b);
    else bm->free_stack[bm->n_free++] = b;
}

int bm_match_prefix(BlockManager *bm, BlockTable *t, const int32_t *tokens, int n_tokens) {
    if (!bm->prefix_caching || t->n != 0 || n_tokens < 1) return 0;
    const int bs = bm->block_size;
    int n_full = (n_tokens - 1) / bs;
    if (n_full > t->cap) n_full = t->cap;
    uint64_t parent = t->root;
    t->epoch = bm->epoch;
    for (int j = 0; j < n_full; j++) {
        uint64_t h = bm_block_hash(parent, tokens + (size_t)j * bs, bs);
        int32_t b = ht_lookup(bm, h, parent, tokens + (size_t)j * bs);
        if (b < 0) break;
        add_ref(bm, b);
        t->ids[t->n++] = b;
        t->n_hashed = t->n;
        t->last_hash = h;
        parent = h;
    }
    return t->n * bs;
}

int bm_blocks_needed(const BlockManager *bm, const BlockTable *t, int first_write, int n_total) {
    const int bs = bm->block_size;
    int want = (n_total + bs - 1) / bs, need = want > t->n ? want - t->n : 0;
    for (int j = first_write / bs; j < t->n && j < want; j++)
        if (bm->ref[t->ids[j]] > 1) need++;
    return need;
}

// dst's first `rows` token rows of every layer's K and V <- src's.
static void copy_block_rows(BlockManager *bm, int32_t dst, int32_t src, int rows) {
    if (bm->copy_rows && rows > 0) bm->copy_rows(bm->copy_user, dst, src, rows);
}

int bm_ensure(BlockManager *bm, BlockTable *t, int first_write, int n_total) {
    const int bs = bm->block_size;
    const int want = (n_total + bs - 1) / bs;
    if (want > t->cap || bm_blocks_needed(bm, t, first_write, n_total) > bm_num_free(bm)) return -1;
    if (t->n == 0) t->epoch = bm->epoch;
    // Copy-on-write: written positions must live in blocks this table alone holds. Registered blocks are full
    // and lie below every write (registration covers computed tokens only), so they are never written.
    for (int j = first_write / bs; j < t->n && j < want; j++) {
        int32_t old = t->ids[j];
        if (bm->ref[old] <= 1) continue;
        int32_t nb = take_block(bm);
        int valid = first_write - j * bs; // rows before the first write keep their K/V
        copy_block_rows(bm, nb, old, valid > bs ? bs : valid);
        drop_ref(bm, old);
        t->ids[j] = nb;
    }
    while (t->n < want) t->ids[t->n++] = take_block(bm);
    return 0;
}

void bm_fork(BlockManager *bm, BlockTable *dst, const BlockTable *src) {
    for (int j = 0; j < src->n; j++) {
        add_ref(bm, src->ids[j]);
        dst->ids[j] = src->ids[j];
    }
    dst->n = src->n;
    dst->n_hashed = src->n_hashed;
    dst->last_hash = src->last_hash;
    dst->epoch = src->epoch;
    dst->root = src->root;
}

void bm_release(BlockManager *bm, BlockTable *t) {
    // Last block first: a sequence's tail is the least likely to be shared by a later prompt, so it should be
    // evicted before the head of the prefix (the LRU evicts from the earliest release).
    for (int j = t->n - 1; j >= 0; j--) drop_ref(bm, t->ids[j]);
    t->n = 0;
    t->n_hashed = 0;
    t->last_hash = t->root;
}

void bm_commit(BlockManager *bm, BlockTable *t, const int32_t *tokens, int n_computed) {
    if (!bm->prefix_caching || t->epoch != bm->epoch) return;
    const int bs = bm->block_size;
    while (t->n_hashed < t->n && (t->n_hashed + 1) * bs <= n_computed) {
        const int j = t->n_hashed;
        const int32_t *tk = tokens + (size_t)j * bs;
        uint64_t h = bm_block_hash(t->last_hash, tk, bs);
        int32_t b = t->ids[j];
        // A block already registered (shared by a fork, or reused from the cache) stays as it is; a block whose
        // content another block already holds is not registered twice.
        if (!bm->hashed[b] && ht_lookup(bm, h, t->last_hash, tk) < 0) {
            bm->hash[b] = h;
            bm->parent[b] = t->last_hash;
            memcpy(bm->toks + (size_t)b * bs, tk, (size_t)bs * sizeof *tk);
            bm->hashed[b] = 1;
            ht_insert(bm, b);
        }
        t->last_hash = h;
        t->n_hashed++;
    }
}

void bm_reset_prefix_cache(BlockManager *bm) {
    for (uint32_t i = 0; i <= bm->ht_mask; i++) bm->ht[i] = -1;
    memset(bm->hashed, 0, (size_t)bm->n_blocks);
    for (int32_t b = bm->lru_head; b >= 0; b = bm->lru_next[b]) bm->free_stack[bm->n_free++] = b;
    bm->lru_head = bm->lru_tail = -1;
    bm->n_cached = 0;
    bm->epoch++;
}
