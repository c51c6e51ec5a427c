// shared/tokenizer/tokenizer_util.c — buffers, UTF-8 helpers and hash maps used by the tokenizer.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "shared/err.h"
#include "shared/tokenizer/tokenizer_internal.h"

void tok_set_err(char *err, size_t err_len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    err_vset(err, err_len, fmt, ap);
    va_end(ap);
}

// ---- buffers ----------------------------------------------------------------------------------------

int tok_buf_reserve(TokBuf *b, size_t extra) {
    if (b->n + extra + 1 <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra + 1) {
        if (cap > SIZE_MAX / 2) return TOK_ENOMEM;
        cap *= 2;
    }
    char *p = realloc(b->p, cap);
    if (!p) return TOK_ENOMEM;
    b->p = p;
    b->cap = cap;
    return 0;
}

int tok_buf_append(TokBuf *b, const void *src, size_t len) {
    if (tok_buf_reserve(b, len)) return TOK_ENOMEM;
    if (len) memcpy(b->p + b->n, src, len);
    b->n += len;
    b->p[b->n] = 0;   // always NUL-terminated for callers that hand the text out
    return 0;
}

void tok_buf_free(TokBuf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

int tok_ids_push(TokIds *v, int32_t id) { return tok_ids_append(v, &id, 1); }

int tok_ids_append(TokIds *v, const int32_t *ids, size_t n) {
    if (v->n + n > v->cap) {
        size_t cap = v->cap ? v->cap : 64;
        while (cap < v->n + n) {
            if (cap > SIZE_MAX / 8) return TOK_ENOMEM;
            cap *= 2;
        }
        int32_t *p = realloc(v->p, cap * sizeof(int32_t));
        if (!p) return TOK_ENOMEM;
        v->p = p;
        v->cap = cap;
    }
    if (n) memcpy(v->p + v->n, ids, n * sizeof(int32_t));
    v->n += n;
    return 0;
}

void tok_ids_free(TokIds *v) {
    free(v->p);
    v->p = NULL;
    v->n = v->cap = 0;
}

char *tok_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    TokBuf b = {0};
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0)
        if (tok_buf_append(&b, chunk, n)) { fclose(f); tok_buf_free(&b); return NULL; }
    int bad = ferror(f);
    fclose(f);
    if (bad || (!b.p && tok_buf_append(&b, "", 0))) { tok_buf_free(&b); return NULL; }
    *len = b.n;
    return b.p;
}

// ---- UTF-8 ------------------------------------------------------------------------------------------

int tok_utf8_decode(const char *s, size_t n, uint32_t *cp) {
    const unsigned char *u = (const unsigned char *)s;
    if (n == 0) { *cp = 0; return 1; }
    if (u[0] < 0x80) { *cp = u[0]; return 1; }
    if (u[0] < 0xE0 && n >= 2) { *cp = ((uint32_t)(u[0] & 0x1F) << 6) | (u[1] & 0x3F); return 2; }
    if (u[0] < 0xF0 && n >= 3) {
        *cp = ((uint32_t)(u[0] & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
        return 3;
    }
    if (n >= 4) {
        *cp = ((uint32_t)(u[0] & 0x07) << 18) | ((uint32_t)(u[1] & 0x3F) << 12) |
              ((uint32_t)(u[2] & 0x3F) << 6) | (u[3] & 0x3F);
        return 4;
    }
    *cp = 0xFFFD;   // truncated input: callers only pass valid UTF-8, this keeps a bad call memory-safe
    return (int)n;
}

int tok_utf8_encode(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) { o[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { o[0] = 0xC0 | (cp >> 6); o[1] = 0x80 | (cp & 0x3F); return 2; }
    if (cp < 0x10000) {
        o[0] = 0xE0 | (cp >> 12); o[1] = 0x80 | ((cp >> 6) & 0x3F); o[2] = 0x80 | (cp & 0x3F);
        return 3;
    }
    o[0] = 0xF0 | (cp >> 18); o[1] = 0x80 | ((cp >> 12) & 0x3F);
    o[2] = 0x80 | ((cp >> 6) & 0x3F); o[3] = 0x80 | (cp & 0x3F);
    return 4;
}

size_t tok_utf8_char_len(const char *s, size_t n) {
    if (n == 0) return 1;
    unsigned char c = (unsigned char)s[0];
    size_t l = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    return l > n ? n : l;
}

// Length of the valid sequence starting at s, or 0 with *bad set to the length of the maximal invalid
// subpart (the bytes one U+FFFD replaces, per Unicode's "maximal subpart" practice that Python and Rust
// both follow).
static size_t utf8_step(const unsigned char *s, size_t n, size_t *bad) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c == 0xE0) { need = 2; lo = 0xA0; }
    else if (c >= 0xE1 && c <= 0xEC) need = 2;
    else if (c == 0xED) { need = 2; hi = 0x9F; }
    else if (c >= 0xEE && c <= 0xEF) need = 2;
    else if (c == 0xF0) { need = 3; lo = 0x90; }
    else if (c >= 0xF1 && c <= 0xF3) need = 3;
    else if (c == 0xF4) { need = 3; hi = 0x8F; }
    else { *bad = 1; return 0; }
    size_t i = 1;
    for (; i <= need; i++) {
        if (i >= n) { *bad = i; return 0; }
        unsigned char b = s[i];
        unsigned char l = (i == 1) ? lo : 0x80, h = (i == 1) ? hi : 0xBF;
        if (b < l || b > h) { *bad = i; return 0; }
    }
    return need + 1;
}

size_t tok_utf8_valid_prefix(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) { i++; continue; }
        size_t bad = 0, l = utf8_step(u + i, n - i, &bad);
        if (!l) return i;
        i += l;
    }
    return n;
}

int tok_utf8_lossy_append(TokBuf *out, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, run = 0;   // run: start of the pending valid stretch
    while (i < n) {
        if (u[i] < 0x80) { i++; continue; }
        size_t bad = 0, l = utf8_step(u + i, n - i, &bad);
        if (l) { i += l; continue; }
        if (tok_buf_append(out, s + run, i - run)) return TOK_ENOMEM;
        if (tok_buf_append(out, "\xEF\xBF\xBD", 3)) return TOK_ENOMEM;
        i += bad;
        run = i;
    }
    return tok_buf_append(out, s + run, n - run);
}

char *tokenizer_utf8_repair(const char *s, size_t len, size_t *out_len) {
    TokBuf b = {0};
    if (tok_buf_reserve(&b, len) || tok_utf8_lossy_append(&b, s ? s : "", s ? len : 0)) {
        tok_buf_free(&b);
        return NULL;
    }
    if (out_len) *out_len = b.n;
    return b.p;
}

int tok_is_white_space(uint32_t cp) {
    if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
    if (cp < 0x85) return 0;
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

int tok_is_word_char(uint32_t cp) {
    if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
    if (cp == 0x200C || cp == 0x200D) return 1;   // Join_Control
    // Other_Alphabetic symbols (circled and squared Latin letters) count as alphabetic.
    if ((cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F149) || (cp >= 0x1F150 && cp <= 0x1F169) ||
        (cp >= 0x1F170 && cp <= 0x1F189))
        return 1;
    switch (utf8proc_category((utf8proc_int32_t)cp)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_PC:
        return 1;
    default:
        return 0;
    }
}

int tok_is_numeric(uint32_t cp) {
    if (cp < 0x80) return cp >= '0' && cp <= '9';
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

// ---- hashing and maps -----------------------------------------------------------------------------

uint32_t tok_hash_bytes(const char *s, size_t len) {
    // FNV-1a over 8-byte words then bytes, finished with a murmur mix: fast for short tokens.
    uint64_t h = 0xcbf29ce484222325ULL ^ (uint64_t)len;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
    }
    for (; i < len; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001b3ULL;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return (uint32_t)h;
}

static int strmap_grow(TokStrMap *m) {
    uint32_t cap = m->slot ? (m->mask + 1) * 2 : 64;
    uint32_t *slot = calloc(cap, sizeof(uint32_t));
    if (!slot) return TOK_ENOMEM;
    for (uint32_t i = 0; i < m->n; i++) {
        uint32_t j = m->e[i].hash & (cap - 1);
        while (slot[j]) j = (j + 1) & (cap - 1);
        slot[j] = i + 1;
    }
    free(m->slot);
    m->slot = slot;
    m->mask = cap - 1;
    return 0;
}

int tok_strmap_put(TokStrMap *m, const char *key, uint32_t len, int32_t val) {
    uint32_t h = tok_hash_bytes(key, len);
    if (m->slot) {
        uint32_t j = h & m->mask;
        while (m->slot[j]) {
            TokStrEntry *e = &m->e[m->slot[j] - 1];
            if (e->hash == h && e->len == len && memcmp(e->key, key, len) == 0) {
                e->val = val;
                return 0;
            }
            j = (j + 1) & m->mask;
        }
    }
    if (!m->slot || (uint64_t)(m->n + 1) * 4 > (uint64_t)(m->mask + 1) * 3)
        if (strmap_grow(m)) return TOK_ENOMEM;
    if (m->n == m->e_cap) {
        uint32_t cap = m->e_cap ? m->e_cap * 2 : 64;
        TokStrEntry *e = realloc(m->e, (size_t)cap * sizeof(TokStrEntry));
        if (!e) return TOK_ENOMEM;
        m->e = e;
        m->e_cap = cap;
    }
    m->e[m->n] = (TokStrEntry){key, len, h, val};
    uint32_t j = h & m->mask;
    while (m->slot[j]) j = (j + 1) & m->mask;
    m->slot[j] = ++m->n;
    return 0;
}

int32_t tok_strmap_get(const TokStrMap *m, const char *key, size_t len) {
    if (!m->slot) return -1;
    uint32_t h = tok_hash_bytes(key, len);
    uint32_t j = h & m->mask;
    while (m->slot[j]) {
        const TokStrEntry *e = &m->e[m->slot[j] - 1];
        if (e->hash == h && e->len == len && memcmp(e->key, key, len) == 0) return e->val;
        j = (j + 1) & m->mask;
    }
    return -1;
}

void tok_strmap_free(TokStrMap *m) {
    free(m->e);
    free(m->slot);
    memset(m, 0, sizeof(*m));
}

static uint64_t mix64(uint64_t x) {
    x ^= x >> 31;
    x *= 0x7fb5d329728ea185ULL;
    x ^= x >> 27;
    x *= 0x81dadef4bc2dd44dULL;
    return x ^ (x >> 33);
}

int tok_mergemap_put(TokMergeMap *m, int32_t a, int32_t b, uint32_t rank, int32_t new_id) {
    if (!m->slot || (uint64_t)(m->n + 1) * 2 > (uint64_t)(m->mask + 1)) {
        uint32_t cap = m->slot ? (m->mask + 1) * 2 : 64;
        TokMergeEntry *slot = malloc((size_t)cap * sizeof(TokMergeEntry));
        if (!slot) return TOK_ENOMEM;
        for (uint32_t i = 0; i < cap; i++) slot[i].rank = UINT32_MAX;
        if (m->slot) {
            for (uint32_t i = 0; i <= m->mask; i++) {
                if (m->slot[i].rank == UINT32_MAX) continue;
                uint32_t j = (uint32_t)mix64(m->slot[i].key) & (cap - 1);
                while (slot[j].rank != UINT32_MAX) j = (j + 1) & (cap - 1);
                slot[j] = m->slot[i];
            }
        }
        free(m->slot);
        m->slot = slot;
        m->mask = cap - 1;
    }
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t j = (uint32_t)mix64(key) & m->mask;
    while (m->slot[j].rank != UINT32_MAX) {
        if (m->slot[j].key == key) {   // a later duplicate merge overwrites (HF collects into a HashMap)
            m->slot[j].rank = rank;
            m->slot[j].new_id = new_id;
            return 0;
        }
        j = (j + 1) & m->mask;
    }
    m->slot[j] = (TokMergeEntry){key, rank, new_id};
    m->n++;
    return 0;
}

const TokMergeEntry *tok_mergemap_get(const TokMergeMap *m, int32_t a, int32_t b) {
    if (!m->slot) return NULL;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t j = (uint32_t)mix64(key) & m->mask;
    while (m->slot[j].rank != UINT32_MAX) {
        if (m->slot[j].key == key) return &m->slot[j];
        j = (j + 1) & m->mask;
    }
    return NULL;
}

void tok_mergemap_free(TokMergeMap *m) {
    free(m->slot);
    memset(m, 0, sizeof(*m));
}
