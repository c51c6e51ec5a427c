// shared/tokenizer/tokenizer_bpe.c — the BPE model: one pre-tokenized word -> ids, as HF's BPE::tokenize does
// (symbols per character, unk / byte_fallback, then merges by rank), behind a striped word cache.
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/tokenizer_internal.h"

#define CACHE_MAX_WORD 256          // HF caches words shorter than this
#define CACHE_BLOCK (64 * 1024)     // word bytes live in fixed blocks so map keys never move

typedef struct { uint32_t rank, pos; int32_t new_id; } HeapItem;

// ---- word cache ----------------------------------------------------------------------------------

int tok_cache_init(Tokenizer *t) {
    t->cache_stripe_cap = 2048;     // 64 stripes x 2048 words: covers the working vocabulary of a corpus
    for (int i = 0; i < TOK_CACHE_STRIPES; i++)
        if (pthread_mutex_init(&t->cache[i].lock, NULL)) return TOK_ENOMEM;
    return 0;
}

void tok_cache_free(Tokenizer *t) {
    for (int i = 0; i < TOK_CACHE_STRIPES; i++) {
        TokCacheStripe *c = &t->cache[i];
        pthread_mutex_destroy(&c->lock);
        tok_strmap_free(&c->map);
        for (size_t b = 0; b < c->n_key_blocks; b++) free(c->key_blocks[b]);
        free(c->key_blocks);
        tok_ids_free(&c->ids);
        free(c->span_off);
        free(c->span_len);
    }
}

static int cache_get(const Tokenizer *t, uint32_t h, const char *w, size_t len, TokIds *out, int *hit) {
    TokCacheStripe *c = (TokCacheStripe *)&t->cache[h % TOK_CACHE_STRIPES];
    int rc = 0;
    *hit = 0;
    pthread_mutex_lock(&c->lock);
    int32_t k = tok_strmap_get(&c->map, w, len);
    if (k >= 0) {
        rc = tok_ids_append(out, c->ids.p + c->span_off[k], c->span_len[k]);
        *hit = 1;
    }
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static void cache_put(const Tokenizer *t, uint32_t h, const char *w, size_t len, const int32_t *ids, size_t n) {
    TokCacheStripe *c = (TokCacheStripe *)&t->cache[h % TOK_CACHE_STRIPES];
    pthread_mutex_lock(&c->lock);
    if (c->n_spans >= t->cache_stripe_cap || tok_strmap_get(&c->map, w, len) >= 0) goto done;
    // Word bytes: append to the current block, or open a new one.
    if (c->n_key_blocks == 0 || c->keys.n + len > CACHE_BLOCK) {
        char **kb = realloc(c->key_blocks, (c->n_key_blocks + 1) * sizeof(char *));
        if (!kb) goto done;
        c->key_blocks = kb;
        kb[c->n_key_blocks] = malloc(CACHE_BLOCK);
        if (!kb[c->n_key_blocks]) goto done;
        c->n_key_blocks++;
        c->keys.n = 0;
    }
    if (c->n_spans == c->cap_spans) {
        size_t cap = c->cap_spans ? c->cap_spans * 2 : 64;
        uint32_t *o = realloc(c->span_off, cap * sizeof(uint32_t));
        if (!o) goto done;
        c->span_off = o;
        uint32_t *l = realloc(c->span_len, cap * sizeof(uint32_t));
        if (!l) goto done;
        c->span_len = l;
        c->cap_spans = cap;
    }
    char *key = c->key_blocks[c->n_key_blocks - 1] + c->keys.n;
    memcpy(key, w, len);
    size_t off = c->ids.n;
    if (tok_ids_append(&c->ids, ids, n)) goto done;
    if (tok_strmap_put(&c->map, key, (uint32_t)len, (int32_t)c->n_spans)) { c->ids.n = off; goto done; }
    c->keys.n += len;
    c->span_off[c->n_spans] = (uint32_t)off;
    c->span_len[c->n_spans] = (uint32_t)n;
    c->n_spans++;
done:   // a failed insert only loses a cache entry, never a result
    pthread_mutex_unlock(&c->lock);
}

// ---- symbols and merges --------------------------------------------------------------------------

static int sym_reserve(TokEncodeCtx *x, size_t n) {
    if (n <= x->sym_cap) return 0;
    size_t cap = x->sym_cap ? x->sym_cap : 64;
    while (cap < n) cap *= 2;
    int32_t *a = realloc(x->sym_id, cap * sizeof(int32_t));
    if (!a) return TOK_ENOMEM;
    x->sym_id = a;
    int32_t *p = realloc(x->sym_prev, cap * sizeof(int32_t));
    if (!p) return TOK_ENOMEM;
    x->sym_prev = p;
    int32_t *q = realloc(x->sym_next, cap * sizeof(int32_t));
    if (!q) return TOK_ENOMEM;
    x->sym_next = q;
    uint32_t *l = realloc(x->sym_len, cap * sizeof(uint32_t));
    if (!l) return TOK_ENOMEM;
    x->sym_len = l;
    x->sym_cap = cap;
    return 0;
}

// Word::add: appends a symbol linked to the previous one.
static int sym_add(TokEncodeCtx *x, size_t *n, int32_t id, uint32_t len) {
    if (sym_reserve(x, *n + 1)) return TOK_ENOMEM;
    size_t i = (*n)++;
    x->sym_id[i] = id;
    x->sym_len[i] = len;
    x->sym_prev[i] = (int32_t)i - 1;
    x->sym_next[i] = -1;
    if (i > 0) x->sym_next[i - 1] = (int32_t)i;
    return 0;
}

static int heap_less(const HeapItem *a, const HeapItem *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static int heap_push(TokEncodeCtx *x, size_t *n, HeapItem it) {
    size_t need = (*n + 1) * sizeof(HeapItem);
    if (need > x->heap_cap * sizeof(uint64_t)) {
        size_t cap = x->heap_cap ? x->heap_cap * 2 : 128;
        while (cap * sizeof(uint64_t) < need) cap *= 2;
        uint64_t *h = realloc(x->heap, cap * sizeof(uint64_t));
        if (!h) return TOK_ENOMEM;
        x->heap = h;
        x->heap_cap = cap;
    }
    HeapItem *hp = (HeapItem *)(void *)x->heap;
    size_t i = (*n)++;
    hp[i] = it;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&hp[i], &hp[p])) break;
        HeapItem tmp = hp[i]; hp[i] = hp[p]; hp[p] = tmp;
        i = p;
    }
    return 0;
}

static HeapItem heap_pop(TokEncodeCtx *x, size_t *n) {
    HeapItem *hp = (HeapItem *)(void *)x->heap;
    HeapItem top = hp[0];
    hp[0] = hp[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < *n && heap_less(&hp[l], &hp[m])) m = l;
        if (r < *n && heap_less(&hp[r], &hp[m])) m = r;
        if (m == i) break;
        HeapItem tmp = hp[i]; hp[i] = hp[m]; hp[m] = tmp;
        i = m;
    }
    return top;
}

// Word::merge_all: always merges the lowest (rank, position) pair present, skipping queue entries made
// stale by earlier merges — the same order HF's priority queue produces.
static int merge_all(const Tokenizer *t, TokEncodeCtx *x, size_t nsym) {
    size_t nh = 0;
    for (size_t i = 0; i + 1 < nsym; i++) {
        const TokMergeEntry *m = tok_mergemap_get(&t->merges, x->sym_id[i], x->sym_id[i + 1]);
        if (m && heap_push(x, &nh, (HeapItem){m->rank, (uint32_t)i, m->new_id})) return TOK_ENOMEM;
    }
    while (nh > 0) {
        HeapItem top = heap_pop(x, &nh);
        size_t p = top.pos;
        if (x->sym_len[p] == 0 || x->sym_next[p] < 0) continue;
        size_t r = (size_t)x->sym_next[p];
        const TokMergeEntry *m = tok_mergemap_get(&t->merges, x->sym_id[p], x->sym_id[r]);
        if (!m || m->new_id != top.new_id) continue;
        x->sym_id[p] = top.new_id;
        x->sym_len[p] += x->sym_len[r];
        x->sym_next[p] = x->sym_next[r];
        x->sym_len[r] = 0;
        if (x->sym_next[r] >= 0) x->sym_prev[x->sym_next[r]] = (int32_t)p;
        if (x->sym_prev[p] >= 0) {
            size_t q = (size_t)x->sym_prev[p];
            m = tok_mergemap_get(&t->merges, x->sym_id[q], x->sym_id[p]);
            if (m && heap_push(x, &nh, (HeapItem){m->rank, (uint32_t)q, m->new_id})) return TOK_ENOMEM;
        }
        if (x->sym_next[p] >= 0) {
            m = tok_mergemap_get(&t->merges, x->sym_id[p], x->sym_id[x->sym_next[p]]);
            if (m && heap_push(x, &nh, (HeapItem){m->rank, (uint32_t)p, m->new_id})) return TOK_ENOMEM;
        }
    }
    return 0;
}

// Vocab id of one character of the word (with the subword prefix / word suffix HF adds), or -1.
static int32_t char_symbol(const Tokenizer *t, TokEncodeCtx *x, const char *c, size_t cl, int first, int last,
                           const char **s_out, size_t *n_out) {
    int plain = (first || !t->cont_prefix) && (!last || !t->eow_suffix);
    if (plain) {
        *s_out = c;
        *n_out = cl;
        uint32_t cp;
        tok_utf8_decode(c, cl, &cp);
        if (cp < TOK_CHAR_TABLE) return t->char_id[cp];
        return tok_strmap_get(&t->vocab, c, cl);
    }
    x->word.n = 0;
    if ((!first && t->cont_prefix && tok_buf_append(&x->word, t->cont_prefix, t->cont_prefix_len)) ||
        tok_buf_append(&x->word, c, cl) ||
        (last && t->eow_suffix && tok_buf_append(&x->word, t->eow_suffix, t->eow_suffix_len))) {
        *s_out = NULL;
        return -2;
    }
    *s_out = x->word.p;
    *n_out = x->word.n;
    return tok_strmap_get(&t->vocab, x->word.p, x->word.n);
}

static int merge_word(const Tokenizer *t, TokEncodeCtx *x, const char *w, size_t len, size_t *nsym_out, char *err,
                      size_t err_len) {
    size_t nsym = 0;
    int32_t unk_pending = -1;
    uint32_t unk_len = 0;
    for (size_t i = 0; i < len;) {
        size_t cl = tok_utf8_char_len(w + i, len - i);
        const char *s;
        size_t sn;
        int32_t id = char_symbol(t, x, w + i, cl, i == 0, i + cl >= len, &s, &sn);
        if (id == -2) return TOK_ENOMEM;
        if (id >= 0) {
            if (unk_pending >= 0) {
                if (sym_add(x, &nsym, unk_pending, unk_len)) return TOK_ENOMEM;
                unk_pending = -1;
            }
            if (sym_add(x, &nsym, id, (uint32_t)cl)) return TOK_ENOMEM;
            i += cl;
            continue;
        }
        if (t->byte_fallback) {
            size_t b = 0;
            while (b < sn && t->byte_token[(unsigned char)s[b]] >= 0) b++;
            if (b == sn) {
                for (b = 0; b < sn; b++)
                    if (sym_add(x, &nsym, t->byte_token[(unsigned char)s[b]], 1)) return TOK_ENOMEM;
                i += cl;
                continue;
            }
        }
        if (t->unk_token) {
            if (t->unk_id < 0) {
                tok_set_err(err, err_len, "model.unk_token \"%s\" is not in model.vocab", t->unk_token);
                return TOK_EUNK;
            }
            if (unk_pending >= 0 && t->fuse_unk) {
                unk_len += (uint32_t)cl;
            } else {
                if (unk_pending >= 0 && sym_add(x, &nsym, unk_pending, unk_len)) return TOK_ENOMEM;
                unk_pending = t->unk_id;
                unk_len = (uint32_t)cl;
            }
        }
        // Without unk_token (and no byte fallback) HF drops the character silently; so do we.
        i += cl;
    }
    if (unk_pending >= 0 && sym_add(x, &nsym, unk_pending, unk_len)) return TOK_ENOMEM;
    *nsym_out = nsym;
    return merge_all(t, x, nsym);
}

int tok_bpe_word(const Tokenizer *t, TokEncodeCtx *x, const char *w, size_t len, TokIds *out, char *err,
                 size_t err_len) {
    if (len == 0) return 0;
    if (t->ignore_merges) {
        int32_t id = tok_strmap_get(&t->vocab, w, len);
        if (id >= 0) return tok_ids_push(out, id);
    }
    uint32_t h = 0;
    int cacheable = len < CACHE_MAX_WORD;
    if (cacheable) {
        int hit = 0;
        h = tok_hash_bytes(w, len);
        int rc = cache_get(t, h, w, len, out, &hit);
        if (rc || hit) return rc;
    }
    size_t nsym = 0;
    int rc = merge_word(t, x, w, len, &nsym, err, err_len);
    if (rc) return rc;
    size_t first = out->n;
    for (size_t i = 0; i < nsym; i++)
        if (x->sym_len[i] != 0 && tok_ids_push(out, x->sym_id[i])) return TOK_ENOMEM;
    if (cacheable) cache_put(t, h, w, len, out->p + first, out->n - first);
    return 0;
}
