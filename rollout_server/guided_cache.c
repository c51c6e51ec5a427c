// rollout_server/guided_cache.c — the engine's compiled guides by pattern (see guided_cache.h).
#include "rollout_server/guided_cache.h"

#include <stdlib.h>
#include <string.h>

void guide_cache_init(GuideCache *c) {
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
}

void guide_cache_destroy(GuideCache *c) {
    for (int i = 0; i < GUIDE_CACHE_SIZE; i++) {
        guide_free(c->entries[i].guide);
        free(c->entries[i].pattern);
    }
    pthread_mutex_destroy(&c->mu);
}

int guide_cache_get(GuideCache *c, const char *pattern, size_t len, const Tokenizer *tok, int V, const int32_t *eos,
                    int n_eos, Guide **out, char *err, size_t err_len) {
    *out = NULL;
    pthread_mutex_lock(&c->mu);
    c->clock++;
    for (int i = 0; i < GUIDE_CACHE_SIZE; i++) {
        GuideCacheEntry *e = &c->entries[i];
        if (e->guide && e->len == len && memcmp(e->pattern, pattern, len) == 0) {
            e->refs++;
            e->used = c->clock;
            c->reused++;
            *out = e->guide;
            pthread_mutex_unlock(&c->mu);
            return 0;
        }
    }
    // Compiled under the lock: two requests with a new pattern wait for one compilation, not two.
    Guide *g;
    if (guide_create(&g, pattern, len, tok, V, eos, n_eos, err, err_len) != 0) {
        pthread_mutex_unlock(&c->mu);
        return -1;
    }
    c->compiled++;
    GuideCacheEntry *slot = NULL;
    for (int i = 0; i < GUIDE_CACHE_SIZE; i++) {
        GuideCacheEntry *e = &c->entries[i];
        if (!e->guide) {
            slot = e;
            break;
        }
        if (e->refs == 0 && (!slot || e->used < slot->used)) slot = e;
    }
    char *copy = slot ? malloc(len + 1) : NULL;
    if (copy) {   // kept for the next request with this pattern
        guide_free(slot->guide);
        free(slot->pattern);
        memcpy(copy, pattern, len);
        copy[len] = '\0';
        *slot = (GuideCacheEntry){.pattern = copy, .len = len, .guide = g, .refs = 1, .used = c->clock};
    }
    // Otherwise every entry is held (or there is no memory for the key): the guide is this request's own, freed
    // when it is put back.
    *out = g;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

void guide_cache_put(GuideCache *c, Guide *g) {
    if (!g) return;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < GUIDE_CACHE_SIZE; i++)
        if (c->entries[i].guide == g) {
            c->entries[i].refs--;
            pthread_mutex_unlock(&c->mu);
            return;
        }
    pthread_mutex_unlock(&c->mu);
    guide_free(g);   // not kept (the cache was full of held guides when it was made)
}
