// shared/tokenizer/tokenizer_added.c — added/special tokens: matched in the text before the model sees it, as HF's
// AddedVocabulary::find_matches does (leftmost-longest, then single_word / lstrip / rstrip).
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/tokenizer_internal.h"

static int trie_new_node(TokTrie *tr) {
    if (tr->n_nodes == tr->cap_nodes) {
        uint32_t cap = tr->cap_nodes ? tr->cap_nodes * 2 : 64;
        int32_t *t = realloc(tr->terminal, (size_t)cap * sizeof(int32_t));
        if (!t) return -1;
        tr->terminal = t;
        tr->cap_nodes = cap;
    }
    tr->terminal[tr->n_nodes] = -1;
    return (int)tr->n_nodes++;
}

static int32_t trie_child(const TokTrie *tr, uint32_t node, unsigned char byte) {
    const TokMergeEntry *e = tok_mergemap_get(&tr->edges, (int32_t)node, byte);
    return e ? e->new_id : -1;
}

int tok_trie_build(TokTrie *tr, const Tokenizer *t, int normalized_set) {
    memset(tr, 0, sizeof(*tr));
    if (trie_new_node(tr) < 0) return TOK_ENOMEM;   // root
    for (size_t k = 0; k < t->n_added; k++) {
        const TokAddedToken *a = &t->added[k];
        if (a->normalized != normalized_set) continue;
        const char *s = normalized_set ? a->norm : a->content;
        size_t n = normalized_set ? a->norm_len : a->len;
        if (n == 0) continue;   // an empty pattern never matches (HF skips empty contents)
        uint32_t node = 0;
        for (size_t i = 0; i < n; i++) {
            unsigned char b = (unsigned char)s[i];
            int32_t c = trie_child(tr, node, b);
            if (c < 0) {
                c = trie_new_node(tr);
                if (c < 0 || tok_mergemap_put(&tr->edges, (int32_t)node, b, 0, c)) return TOK_ENOMEM;
            }
            node = (uint32_t)c;
        }
        if (tr->terminal[node] < 0) tr->terminal[node] = (int32_t)k;   // first token with this text wins
        tr->first_byte[(unsigned char)s[0]] = 1;
    }
    return 0;
}

void tok_trie_free(TokTrie *tr) {
    tok_mergemap_free(&tr->edges);
    free(tr->terminal);
    memset(tr, 0, sizeof(*tr));
}

// Longest token starting at s[i]; returns its length (0: none) and its added[] index.
static size_t longest_at(const TokTrie *tr, const char *s, size_t len, size_t i, int32_t *which) {
    uint32_t node = 0;
    size_t best = 0;
    for (size_t j = i; j < len; j++) {
        int32_t c = trie_child(tr, node, (unsigned char)s[j]);
        if (c < 0) break;
        node = (uint32_t)c;
        if (tr->terminal[node] >= 0) { best = j + 1 - i; *which = tr->terminal[node]; }
    }
    return best;
}

// Code point that ends at byte `end` (exclusive) of valid UTF-8 text.
static uint32_t cp_before(const char *s, size_t end) {
    size_t b = end - 1;
    while (b > 0 && ((unsigned char)s[b] & 0xC0) == 0x80) b--;
    uint32_t cp;
    tok_utf8_decode(s + b, end - b, &cp);
    return cp;
}

static int push(TokSpans *s, size_t a, size_t b, int m) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        TokSpan *p = realloc(s->p, cap * sizeof(TokSpan));
        if (!p) return TOK_ENOMEM;
        s->p = p;
        s->cap = cap;
    }
    s->p[s->n++] = (TokSpan){a, b, m};
    return 0;
}

int tok_added_split(const Tokenizer *t, const TokTrie *tr, const char *s, size_t len, TokSpans *out) {
    out->n = 0;
    if (len == 0) return push(out, 0, 0, 0);
    if (tr->n_nodes <= 1) return push(out, 0, len, 0);
    size_t start_offset = 0;
    size_t i = 0;
    while (i < len) {
        if (!tr->first_byte[(unsigned char)s[i]]) { i++; continue; }
        int32_t k = -1;
        size_t l = longest_at(tr, s, len, i, &k);
        if (l == 0) { i++; continue; }
        size_t start = i, stop = i + l;
        i = stop;   // matching resumes after the raw match, whatever strip does below
        const TokAddedToken *a = &t->added[k];
        if (a->single_word) {
            uint32_t cp;
            int start_space = start == 0 || !tok_is_word_char(cp_before(s, start));
            int stop_space = stop == len || (tok_utf8_decode(s + stop, len - stop, &cp), !tok_is_word_char(cp));
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) {
            size_t ns = start;   // start of the whitespace run that ends at `start`
            while (ns > 0) {
                size_t b = ns - 1;
                while (b > 0 && ((unsigned char)s[b] & 0xC0) == 0x80) b--;
                uint32_t cp;
                tok_utf8_decode(s + b, ns - b, &cp);
                if (!tok_is_white_space(cp)) break;
                ns = b;
            }
            start = ns > start_offset ? ns : start_offset;
        }
        if (a->rstrip) {
            while (stop < len) {
                uint32_t cp;
                int cl = tok_utf8_decode(s + stop, len - stop, &cp);
                if (!tok_is_white_space(cp)) break;
                stop += (size_t)cl;
            }
        }
        if (start_offset < start && push(out, start_offset, start, 0)) return TOK_ENOMEM;
        if (push(out, start, stop, 1 + k)) return TOK_ENOMEM;
        start_offset = stop;
    }
    if (start_offset != len && push(out, start_offset, len, 0)) return TOK_ENOMEM;
    return 0;
}
