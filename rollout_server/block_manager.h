// rollout_server/block_manager.h — the paged KV cache's block pool: which physical block holds which part of
// which sequence.
//
// The pool has n_blocks blocks of block_size token slots each (the K/V memory itself is the model runner's; this
// module only hands out block ids and asks for blocks to be copied). Blocks are reference-counted: sequences forked from one prompt
// share its blocks, and a shared block is copied (copy-on-write) before a sequence writes into it.
//
// Prefix caching: once every token of a block has its K/V computed, the block is registered under a hash of
// (hash of the previous block, the block's token ids), so a later sequence starting with the same tokens reuses
// it instead of recomputing. A registered block whose last user lets go stays cached (and counts as free): it
// is evicted least-recently-released first when a new block is needed. Every registered block also keeps its
// token ids and its parent's hash, so a hash collision can never hand out the wrong K/V.
//
// Block states: free (refcount 0, no hash), cached (refcount 0, hash), used (refcount > 0, hash or not).
// Not thread-safe: the engine thread owns it.
#ifndef TANDEM_ROLLOUT_BLOCK_MANAGER_H
#define TANDEM_ROLLOUT_BLOCK_MANAGER_H

#include <stddef.h>
#include <stdint.h>

// One sequence's block table: logical block j (tokens [j*bs, (j+1)*bs)) lives in physical block ids[j].
typedef struct {
    int32_t *ids;       // (cap) physical block ids
    int n, cap;         // blocks held, capacity of ids
    int n_hashed;       // leading full blocks whose chained hash has been computed (registered or matched)
    uint64_t last_hash; // chained hash of block n_hashed - 1 (root when n_hashed == 0)
    uint64_t epoch;     // the pool's cache epoch when the table got its first block: stale tables never register
    uint64_t root;      // parent hash of block 0: what else the K/V depend on besides the tokens (the LoRA adapter
                        // the sequence runs through: rollout_server/engine_request.c); 0 for the base model
} BlockTable;

typedef struct BlockManager BlockManager;

// Copies the first `rows` token rows of block src into block dst, K and V of every layer (runner_copy_kv_rows).
typedef void (*BmCopyRows)(void *user, int32_t dst, int32_t src, int rows);

// copy_rows (called with copy_user) copies the K/V of a shared block that copy-on-write replaces; NULL moves block
// ids only, for tests of the bookkeeping alone.
int bm_create(BlockManager **out, int n_blocks, int block_size, int enable_prefix_caching, BmCopyRows copy_rows,
              void *copy_user, char *err, size_t err_len);
void bm_destroy(BlockManager *bm);

int bm_block_size(const BlockManager *bm);
int bm_num_blocks(const BlockManager *bm);
int bm_num_free(const BlockManager *bm);    // allocatable now: free + cached (evictable)
int bm_num_used(const BlockManager *bm);    // referenced by at least one table
int bm_num_cached(const BlockManager *bm);  // unreferenced but holding a registered prefix
int bm_refcount(const BlockManager *bm, int block);
int bm_prefix_caching(const BlockManager *bm);

// Table storage: reserve capacity for max_blocks ids up front (no growth later). Returns 0 or -1 (no memory).
int bm_table_init(BlockTable *t, int max_blocks);
// Sets an empty table's root (BlockTable.root): its blocks then match and register only among tables of that root.
void bm_table_set_root(BlockTable *t, uint64_t root);
void bm_table_destroy(BlockTable *t);

// Reuses cached blocks for the start of a sequence whose table is empty: at most (n_tokens - 1) / block_size
// full blocks, so the last token is always computed (its logits are needed). Takes a reference on each hit.
// Returns the number of tokens covered (a multiple of block_size; 0 when prefix caching is off).
int bm_match_prefix(BlockManager *bm, BlockTable *t, const int32_t *tokens, int n_tokens);

// Blocks bm_ensure(t, first_write, n_total) would take from the pool.
int bm_blocks_needed(const BlockManager *bm, const BlockTable *t, int first_write, int n_total);
// Makes t cover n_total tokens when the positions first_write.. will be written: appends new blocks and
// replaces any shared block at or after first_write by a private copy (its K/V rows copied for every layer).
// All or nothing: 0, or -1 when the pool lacks blocks (t unchanged). Evicts cached blocks LRU-first.
int bm_ensure(BlockManager *bm, BlockTable *t, int first_write, int n_total);

// dst (empty) becomes a copy of src sharing every block (each block's refcount + 1).
void bm_fork(BlockManager *bm, BlockTable *dst, const BlockTable *src);
// Drops t's references: blocks nobody uses become cached (registered prefix) or free. t ends empty.
void bm_release(BlockManager *bm, BlockTable *t);

// Registers for prefix caching every full block among the first n_computed tokens (tokens = the sequence's ids).
void bm_commit(BlockManager *bm, BlockTable *t, const int32_t *tokens, int n_computed);

// Forgets every registered prefix (weights changed, or on request): cached blocks become free, used blocks lose
// their hash, and tables built before the reset never register blocks again.
void bm_reset_prefix_cache(BlockManager *bm);

// Chained hash of one block: (parent's hash, block_size token ids); block 0's parent is its table's root.
uint64_t bm_block_hash(uint64_t parent, const int32_t *tokens, int n);

#endif
