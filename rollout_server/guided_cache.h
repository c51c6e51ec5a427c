// rollout_server/guided_cache.h — compiled structured-output guides (guided_regex.h) kept per engine by pattern: a
// GRPO step sends the same regex with every prompt, and compiling one costs a pass over the vocabulary per automaton
// state, so each pattern is compiled once and shared (guides are read-only once made). GUIDE_CACHE_SIZE patterns
// are kept; the least recently used one that no request holds makes room.
#ifndef TANDEM_ROLLOUT_GUIDED_CACHE_H
#define TANDEM_ROLLOUT_GUIDED_CACHE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "rollout_server/guided_regex.h"

#define GUIDE_CACHE_SIZE 32

typedef struct {
    char *pattern;
    size_t len;
    Guide *guide;
    int refs;            // requests holding it
    uint64_t used;       // clock of its last use
} GuideCacheEntry;

typedef struct {
    pthread_mutex_t mu;
    GuideCacheEntry entries[GUIDE_CACHE_SIZE];
    uint64_t clock;
    int64_t compiled, reused;   // counts, for tests and logs
} GuideCache;

void guide_cache_init(GuideCache *c);
void guide_cache_destroy(GuideCache *c);   // every guide must have been put back
// The guide of pattern (len bytes), compiled now or shared; hold it until guide_cache_put. Returns 0, or -1 with
// guide_create's message (nothing held).
int guide_cache_get(GuideCache *c, const char *pattern, size_t len, const Tokenizer *tok, int V, const int32_t *eos,
                    int n_eos, Guide **out, char *err, size_t err_len);
void guide_cache_put(GuideCache *c, Guide *g);

#endif
