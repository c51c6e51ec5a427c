// shared/tokenizer/tokenizer_decode.c — ids -> text through the decoder chain (ByteLevel, Metaspace, Replace,
// ByteFallback, Fuse, Strip). The streaming decoder built on it is in tokenizer_stream.c.
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/tokenizer_internal.h"

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes take the
// code points 256.. in byte order.
const uint16_t tok_bytelevel_char[256] = {
    256, 257, 258, 259, 260, 261, 262, 263, 264, 265, 266, 267, 268, 269, 270, 271, 272, 273, 274, 275, 276,
    277, 278, 279, 280, 281, 282, 283, 284, 285, 286, 287, 288, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44,
    45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71,
    72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98,
    99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117, 118, 119, 120,
    121, 122, 123, 124, 125, 126, 289, 290, 291, 292, 293, 294, 295, 296, 297, 298, 299, 300, 301, 302, 303,
    304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317, 318, 319, 320, 321, 322, 161, 162,
    163, 164, 165, 166, 167, 168, 169, 170, 171, 172, 323, 174, 175, 176, 177, 178, 179, 180, 181, 182, 183,
    184, 185, 186, 187, 188, 189, 190, 191, 192, 193, 194, 195, 196, 197, 198, 199, 200, 201, 202, 203, 204,
    205, 206, 207, 208, 209, 210, 211, 212, 213, 214, 215, 216, 217, 218, 219, 220, 221, 222, 223, 224, 225,
    226, 227, 228, 229, 230, 231, 232, 233, 234, 235, 236, 237, 238, 239, 240, 241, 242, 243, 244, 245, 246,
    247, 248, 249, 250, 251, 252, 253, 254, 255};

int tok_bytelevel_byte(uint32_t cp) {
    if ((cp >= 33 && cp <= 126) || (cp >= 161 && cp <= 172) || (cp >= 174 && cp <= 255)) return (int)cp;
    // The 68 others in byte order: 0..32 -> 256..288, 127..160 -> 289..322, 173 -> 323.
    if (cp >= 256 && cp <= 288) return (int)(cp - 256);
    if (cp >= 289 && cp <= 322) return (int)(cp - 289 + 127);
    if (cp == 323) return 173;
    return -1;
}

// A list of strings stored back to back (the token list each decoder maps to a new list).
typedef struct { TokBuf text; size_t *off, *len; size_t n, cap; } StrList;

static int list_push(StrList *l, const char *s, size_t n) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 32;
        size_t *o = realloc(l->off, cap * sizeof(size_t));
        if (!o) return TOK_ENOMEM;
        l->off = o;
        size_t *q = realloc(l->len, cap * sizeof(size_t));
        if (!q) return TOK_ENOMEM;
        l->len = q;
        l->cap = cap;
    }
    l->off[l->n] = l->text.n;
    l->len[l->n] = n;
    l->n++;
    return tok_buf_append(&l->text, s, n);
}

// Appends to the last string of the list (which must be the most recent push).
static int list_extend_last(StrList *l, const char *s, size_t n) {
    l->len[l->n - 1] += n;
    return tok_buf_append(&l->text, s, n);
}

static void list_free(StrList *l) {
    tok_buf_free(&l->text);
    free(l->off);
    free(l->len);
    memset(l, 0, sizeof(*l));
}

#define ITEM(l, i) ((l)->text.p + (l)->off[i])

size_t tok_bytelevel_token(const char *s, size_t n, char *out) {
    size_t w = 0;
    for (size_t k = 0; k < n;) {
        uint32_t cp;
        k += (size_t)tok_utf8_decode(s + k, n - k, &cp);
        int b = tok_bytelevel_byte(cp);
        if (b < 0) {   // a token with characters outside the byte alphabet passes through as UTF-8
            memcpy(out, s, n);
            return n;
        }
        out[w++] = (char)b;
    }
    return w;
}

static int dec_bytelevel(const StrList *in, StrList *out) {
    TokBuf raw = {0};
    int rc = 0;
    for (size_t i = 0; i < in->n && !rc; i++) {
        rc = tok_buf_reserve(&raw, in->len[i]);
        if (!rc) raw.n += tok_bytelevel_token(ITEM(in, i), in->len[i], raw.p + raw.n);
    }
    if (!rc) {
        TokBuf fixed = {0};
        rc = tok_utf8_lossy_append(&fixed, raw.p ? raw.p : "", raw.n);
        if (!rc) rc = list_push(out, fixed.p ? fixed.p : "", fixed.n);
        tok_buf_free(&fixed);
    }
    tok_buf_free(&raw);
    return rc;
}

static int dec_metaspace(const TokDecOp *op, const StrList *in, StrList *out) {
    for (size_t i = 0; i < in->n; i++) {
        const char *s = ITEM(in, i);
        size_t n = in->len[i];
        if (list_push(out, "", 0)) return TOK_ENOMEM;
        for (size_t k = 0; k < n;) {
            uint32_t cp;
            int cl = tok_utf8_decode(s + k, n - k, &cp);
            int rc = 0;
            if (cp != op->repl_cp) rc = list_extend_last(out, s + k, (size_t)cl);
            else if (!(i == 0 && op->prepend != PREPEND_NEVER)) rc = list_extend_last(out, " ", 1);
            if (rc) return rc;
            k += (size_t)cl;
        }
    }
    return 0;
}

static int dec_replace(const TokDecOp *op, const StrList *in, StrList *out, TokRegexScratch *rs, char *err,
                       size_t err_len) {
    TokSpans sp = {0};
    int rc = 0;
    for (size_t i = 0; i < in->n && !rc; i++) {
        const char *s = ITEM(in, i);
        rc = tok_pattern_find(&op->pat, s, in->len[i], &sp, rs, err, err_len);
        if (!rc) rc = list_push(out, "", 0);
        for (size_t k = 0; k < sp.n && !rc; k++)
            rc = sp.p[k].is_match ? list_extend_last(out, op->content, op->content_len)
                                  : list_extend_last(out, s + sp.p[k].start, sp.p[k].end - sp.p[k].start);
    }
    tok_spans_free(&sp);
    return rc;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// "<0xHH>" -> byte, as Rust's u8::from_str_radix(&tok[3..5], 16) reads it (a leading '+' is accepted).
static int byte_token_value(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    if (s[3] == '+') return hexval(s[4]);
    int h = hexval(s[3]), l = hexval(s[4]);
    return (h < 0 || l < 0) ? -1 : h * 16 + l;
}

static int flush_bytes(StrList *out, TokBuf *bytes) {
    int rc = 0;
    if (bytes->n == 0) return 0;
    if (tok_utf8_valid_prefix(bytes->p, bytes->n) == bytes->n) rc = list_push(out, bytes->p, bytes->n);
    else   // an invalid run gives one U+FFFD per byte (ByteFallback's rule, not the lossy one)
        for (size_t i = 0; i < bytes->n && !rc; i++) rc = list_push(out, "\xEF\xBF\xBD", 3);
    bytes->n = 0;
    return rc;
}

static int dec_bytefallback(const StrList *in, StrList *out) {
    TokBuf bytes = {0};
    int rc = 0;
    for (size_t i = 0; i < in->n && !rc; i++) {
        int b = byte_token_value(ITEM(in, i), in->len[i]);
        if (b >= 0) {
            unsigned char c = (unsigned char)b;
            rc = tok_buf_append(&bytes, &c, 1);
        } else {
            rc = flush_bytes(out, &bytes);
            if (!rc) rc = list_push(out, ITEM(in, i), in->len[i]);
        }
    }
    if (!rc) rc = flush_bytes(out, &bytes);
    tok_buf_free(&bytes);
    return rc;
}

static int dec_fuse(const StrList *in, StrList *out) {
    if (list_push(out, "", 0)) return TOK_ENOMEM;
    for (size_t i = 0; i < in->n; i++)
        if (list_extend_last(out, ITEM(in, i), in->len[i])) return TOK_ENOMEM;
    return 0;
}

static int dec_strip(const TokDecOp *op, const StrList *in, StrList *out) {
    for (size_t i = 0; i < in->n; i++) {
        const char *s = ITEM(in, i);
        size_t n = in->len[i];
        size_t a = 0, z = n;   // byte bounds of the kept part
        for (size_t k = 0; k < op->strip_start && a < n; k++) {
            uint32_t cp;
            int cl = tok_utf8_decode(s + a, n - a, &cp);
            if (cp != op->strip_cp) break;
            a += (size_t)cl;
        }
        for (size_t k = 0; k < op->strip_stop && z > a; k++) {
            size_t b = z - 1;
            while (b > a && ((unsigned char)s[b] & 0xC0) == 0x80) b--;
            uint32_t cp;
            tok_utf8_decode(s + b, z - b, &cp);
            if (cp != op->strip_cp) break;
            z = b;
        }
        if (list_push(out, s + a, z - a)) return TOK_ENOMEM;
    }
    return 0;
}

int tokenizer_decode(const Tokenizer *t, const int32_t *ids, size_t n, int skip_special_tokens, char **text,
                     size_t *len, char *err, size_t err_len) {
    if (!t || !text || (!ids && n)) {
        tok_set_err(err, err_len, "tokenizer_decode: NULL argument");
        return TOK_EINVAL;
    }
    *text = NULL;
    if (len) *len = 0;
    StrList cur = {0}, next = {0};
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || !t->id_str[id]) continue;   // unknown ids vanish, as in HF
        const char *s = t->id_str[id];
        size_t l = t->id_len[id];
        if (skip_special_tokens && tok_strmap_get(&t->special_set, s, l) >= 0) continue;
        rc = list_push(&cur, s, l);
    }
    TokRegexScratch rs = {0};
    if (!rc && t->has_decoder) rc = tok_regex_scratch_init(&rs);
    for (size_t k = 0; !rc && t->has_decoder && k < t->n_dec; k++) {
        const TokDecOp *op = &t->dec[k];
        next.n = 0;
        next.text.n = 0;
        switch (op->type) {
        case DEC_BYTELEVEL: rc = dec_bytelevel(&cur, &next); break;
        case DEC_METASPACE: rc = dec_metaspace(op, &cur, &next); break;
        case DEC_REPLACE: rc = dec_replace(op, &cur, &next, &rs, err, err_len); break;
        case DEC_BYTEFALLBACK: rc = dec_bytefallback(&cur, &next); break;
        case DEC_FUSE: rc = dec_fuse(&cur, &next); break;
        case DEC_STRIP: rc = dec_strip(op, &cur, &next); break;
        }
        StrList tmp = cur;
        cur = next;
        next = tmp;
    }
    tok_regex_scratch_free(&rs);
    TokBuf joined = {0};
    // No decoder: HF joins the token strings with spaces.
    for (size_t i = 0; i < cur.n && !rc; i++) {
        if (!t->has_decoder && i > 0) rc = tok_buf_append(&joined, " ", 1);
        if (!rc) rc = tok_buf_append(&joined, ITEM(&cur, i), cur.len[i]);
    }
    if (!rc && !joined.p) rc = tok_buf_append(&joined, "", 0);
    list_free(&cur);
    list_free(&next);
    if (rc) {
        if (rc == TOK_ENOMEM) tok_set_err(err, err_len, "tokenizer_decode: out of memory");
        tok_buf_free(&joined);
        return rc;
    }
    *text = joined.p;
    if (len) *len = joined.n;
    return 0;
}
