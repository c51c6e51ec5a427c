// shared/tokenizer/tokenizer_stream.c — the streaming decoder (HF's DecodeStream / step_decode_stream).
//
// HF keeps a window of ids (the ids of the last emitted chunk plus those not yet emitted) and, per id,
// decodes the window up to three times: to refresh an empty prefix, to see what the new id adds, and to
// recompute the prefix after sliding the window. Done literally (the reference path below) that is two or
// three runs of the decoder chain per id, about a microsecond each.
//
// When the decoder chain is exactly ByteLevel, decode(ids) is lossy_utf8(bytes(id_1) ++ ... ++ bytes(id_n))
// where bytes(id) depends on the id alone (its token string mapped back through the byte alphabet, or the
// string itself when it has characters outside the alphabet; nothing for unknown ids and, when skipping,
// for special tokens). The fast path therefore keeps the window as bytes, with each id's end offset, and
// runs the same step algorithm with "decode" replaced by a lossy UTF-8 conversion of a window slice: same
// window, same prefix, same chunks, same errors, by construction, with no decoder run and no allocation
// except the returned chunk.
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/tokenizer_internal.h"

int tok_stream_prepare(Tokenizer *t) {
    for (int32_t id = 0; t->special_set.n > 0 && id < t->n_ids; id++)
        if (t->id_str[id] && tok_strmap_get(&t->special_set, t->id_str[id], t->id_len[id]) >= 0)
            t->id_flags[id] |= TOK_ID_SKIPPED;   // the test tokenizer_decode applies, made once per id
    if (!(t->has_decoder && t->n_dec == 1 && t->dec[0].type == DEC_BYTELEVEL)) return 0;
    // A token's bytes are never longer than its string (one byte per character, or the string itself).
    size_t total = 0;
    for (int32_t id = 0; id < t->n_ids; id++) total += t->id_str[id] ? t->id_len[id] : 0;
    if (total > UINT32_MAX) return 0;   // offsets would not fit: streams take the reference path
    t->stream_off = malloc(((size_t)t->n_ids + 1) * sizeof(uint32_t));
    t->stream_bytes = malloc(total ? total : 1);
    if (!t->stream_off || !t->stream_bytes) return TOK_ENOMEM;
    uint32_t w = 0;
    for (int32_t id = 0; id < t->n_ids; id++) {
        t->stream_off[id] = w;
        if (t->id_str[id]) w += (uint32_t)tok_bytelevel_token(t->id_str[id], t->id_len[id], t->stream_bytes + w);
    }
    t->stream_off[t->n_ids] = w;
    return 0;
}

struct TokenizerStream {
    const Tokenizer *tok;
    int skip;
    int fast;            // ByteLevel fast path (t->stream_bytes)
    size_t prefix_index; // how many window ids the prefix covers
    // reference path
    TokIds ids;          // the window HF keeps: ids from prefix_index's origin onwards
    char *prefix;        // decode of the window's already-emitted part
    size_t prefix_len;
    // fast path
    TokBuf win;          // the window's bytes
    size_t *ends;        // (n_win) byte end of each window id in win
    size_t n_win, cap_win;
    TokBuf pre;          // the prefix (lossy UTF-8 of the window's first prefix_index ids)
    TokBuf text;         // scratch: lossy UTF-8 of the whole window
};

static int stream_new(TokenizerStream **out, const Tokenizer *tok, int skip_special_tokens, int fast, char *err,
                      size_t err_len) {
    if (!out || !tok) { tok_set_err(err, err_len, "tokenizer_stream_create: NULL argument"); return TOK_EINVAL; }
    TokenizerStream *st = calloc(1, sizeof(*st));
    if (!st) { tok_set_err(err, err_len, "tokenizer_stream_create: out of memory"); return TOK_ENOMEM; }
    st->tok = tok;
    st->skip = skip_special_tokens;
    st->fast = fast && tok->stream_bytes != NULL;
    *out = st;
    return 0;
}

int tokenizer_stream_create(TokenizerStream **out, const Tokenizer *tok, int skip_special_tokens, char *err,
                            size_t err_len) {
    return stream_new(out, tok, skip_special_tokens, 1, err, err_len);
}

int tok_stream_create_reference(TokenizerStream **out, const Tokenizer *tok, int skip_special_tokens,
                                char *err, size_t err_len) {
    return stream_new(out, tok, skip_special_tokens, 0, err, err_len);
}

int tok_stream_is_fast(const TokenizerStream *st) { return st && st->fast; }

void tokenizer_stream_free(TokenizerStream *st) {
    if (!st) return;
    tok_ids_free(&st->ids);
    free(st->prefix);
    tok_buf_free(&st->win);
    free(st->ends);
    tok_buf_free(&st->pre);
    tok_buf_free(&st->text);
    free(st);
}

static int ends_with_replacement(const char *s, size_t n) {
    return n >= 3 && memcmp(s + n - 3, "\xEF\xBF\xBD", 3) == 0;
}

// A malloc'd NUL-terminated copy of s[0..n) for the caller.
static char *chunk_dup(const char *s, size_t n) {
    char *c = malloc(n + 1);
    if (!c) return NULL;
    memcpy(c, s, n);
    c[n] = 0;
    return c;
}

// ---- reference path: HF's step_decode_stream over tokenizer_decode --------------------------------------

// Decode the window, emit what extends the prefix unless it ends in U+FFFD (an incomplete character), then
// slide the window so it starts at the previous read position.
static int ref_step(TokenizerStream *st, int32_t id, char **text, size_t *len, char *err, size_t err_len) {
    const Tokenizer *t = st->tok;
    char *s = NULL;
    size_t sl = 0;
    int rc;
    if (st->prefix_len == 0 && st->ids.n > 0) {
        rc = tokenizer_decode(t, st->ids.p, st->ids.n, st->skip, &s, &sl, err, err_len);
        if (rc) return rc;
        if (!ends_with_replacement(s, sl)) {
            free(st->prefix);
            st->prefix = s;
            st->prefix_len = sl;
            st->prefix_index = st->ids.n;
        } else {
            free(s);
        }
    }
    if (tok_ids_push(&st->ids, id)) { tok_set_err(err, err_len, "stream: out of memory"); return TOK_ENOMEM; }
    rc = tokenizer_decode(t, st->ids.p, st->ids.n, st->skip, &s, &sl, err, err_len);
    if (rc) return rc;
    if (sl > st->prefix_len && !ends_with_replacement(s, sl)) {
        if (st->prefix_len && memcmp(s, st->prefix, st->prefix_len) != 0) {
            tok_set_err(err, err_len, "stream: decoded text no longer starts with the emitted prefix (id %d)", id);
            free(s);
            return TOK_EFORMAT;
        }
        size_t nl = sl - st->prefix_len;
        char *chunk = chunk_dup(s + st->prefix_len, nl);
        free(s);
        if (!chunk) { tok_set_err(err, err_len, "stream: out of memory"); return TOK_ENOMEM; }
        size_t new_prefix_index = st->ids.n - st->prefix_index;
        memmove(st->ids.p, st->ids.p + st->prefix_index, new_prefix_index * sizeof(int32_t));
        st->ids.n = new_prefix_index;
        free(st->prefix);
        st->prefix = NULL;
        rc = tokenizer_decode(t, st->ids.p, st->ids.n, st->skip, &st->prefix, &st->prefix_len, err, err_len);
        if (rc) { free(chunk); st->prefix_len = 0; return rc; }
        st->prefix_index = new_prefix_index;
        *text = chunk;
        if (len) *len = nl;
        return 0;
    }
    free(s);
    return 0;
}

static int ref_flush(TokenizerStream *st, char **text, size_t *len, char *err, size_t err_len) {
    char *s = NULL;
    size_t sl = 0;
    int rc = tokenizer_decode(st->tok, st->ids.p, st->ids.n, st->skip, &s, &sl, err, err_len);
    if (rc) return rc;
    if (sl > st->prefix_len && (st->prefix_len == 0 || memcmp(s, st->prefix, st->prefix_len) == 0)) {
        memmove(s, s + st->prefix_len, sl - st->prefix_len + 1);
        *text = s;
        if (len) *len = sl - st->prefix_len;
    } else {
        free(s);
    }
    st->ids.n = 0;
    free(st->prefix);
    st->prefix = NULL;
    st->prefix_len = 0;
    st->prefix_index = 0;
    return 0;
}

// ---- ByteLevel fast path: the same algorithm on the window's bytes --------------------------------------

// out = decode of the window's first n_ids ids = lossy UTF-8 of their bytes.
static int window_text(const TokenizerStream *st, size_t n_ids, TokBuf *out) {
    out->n = 0;
    size_t nb = n_ids ? st->ends[n_ids - 1] : 0;
    return tok_utf8_lossy_append(out, nb ? st->win.p : "", nb);
}

static int fast_step(TokenizerStream *st, int32_t id, char **text, size_t *len, char *err, size_t err_len) {
    const Tokenizer *t = st->tok;
    int rc = 0;
    if (st->pre.n == 0 && st->n_win > 0) {
        rc = window_text(st, st->n_win, &st->text);
        if (!rc && !ends_with_replacement(st->text.p, st->text.n)) {
            TokBuf tmp = st->pre;   // the prefix becomes this text; its old buffer becomes scratch
            st->pre = st->text;
            st->text = tmp;
            st->prefix_index = st->n_win;
        }
    }
    // Push the id: its bytes, or none when unknown or a special token being skipped (as tokenizer_decode).
    const char *b = "";
    size_t bl = 0;
    if (id >= 0 && id < t->n_ids && !(st->skip && (t->id_flags[id] & TOK_ID_SKIPPED))) {
        b = t->stream_bytes + t->stream_off[id];
        bl = t->stream_off[id + 1] - t->stream_off[id];
    }
    if (!rc && st->n_win == st->cap_win) {
        size_t cap = st->cap_win ? st->cap_win * 2 : 16;
        size_t *e = realloc(st->ends, cap * sizeof(size_t));
        if (!e) rc = TOK_ENOMEM;
        else { st->ends = e; st->cap_win = cap; }
    }
    if (!rc) rc = tok_buf_append(&st->win, b, bl);
    if (!rc) {
        st->ends[st->n_win++] = st->win.n;
        rc = window_text(st, st->n_win, &st->text);
    }
    if (rc) { tok_set_err(err, err_len, "stream: out of memory"); return rc; }
    const TokBuf *s = &st->text;
    if (s->n > st->pre.n && !ends_with_replacement(s->p, s->n)) {
        if (st->pre.n && memcmp(s->p, st->pre.p, st->pre.n) != 0) {
            tok_set_err(err, err_len, "stream: decoded text no longer starts with the emitted prefix (id %d)", id);
            return TOK_EFORMAT;
        }
        size_t nl = s->n - st->pre.n;
        char *chunk = chunk_dup(s->p + st->pre.n, nl);
        if (!chunk) { tok_set_err(err, err_len, "stream: out of memory"); return TOK_ENOMEM; }
        // Slide: drop the prefix's ids and their bytes; the new prefix is the decode of what is left.
        size_t k = st->prefix_index, new_prefix_index = st->n_win - k;
        size_t drop = k ? st->ends[k - 1] : 0;
        memmove(st->win.p, st->win.p + drop, st->win.n - drop);
        st->win.n -= drop;
        for (size_t i = 0; i < new_prefix_index; i++) st->ends[i] = st->ends[i + k] - drop;
        st->n_win = new_prefix_index;
        if (window_text(st, st->n_win, &st->pre)) {
            free(chunk);
            st->pre.n = 0;
            tok_set_err(err, err_len, "stream: out of memory");
            return TOK_ENOMEM;
        }
        st->prefix_index = new_prefix_index;
        *text = chunk;
        if (len) *len = nl;
    }
    return 0;
}

static int fast_flush(TokenizerStream *st, char **text, size_t *len, char *err, size_t err_len) {
    if (window_text(st, st->n_win, &st->text)) { tok_set_err(err, err_len, "stream: out of memory"); return TOK_ENOMEM; }
    const TokBuf *s = &st->text;
    if (s->n > st->pre.n && (st->pre.n == 0 || memcmp(s->p, st->pre.p, st->pre.n) == 0)) {
        size_t nl = s->n - st->pre.n;
        char *chunk = chunk_dup(s->p + st->pre.n, nl);
        if (!chunk) { tok_set_err(err, err_len, "stream: out of memory"); return TOK_ENOMEM; }
        *text = chunk;
        if (len) *len = nl;
    }
    st->win.n = 0;
    st->n_win = 0;
    st->pre.n = 0;
    st->prefix_index = 0;
    return 0;
}

// ---- public entry points ------------------------------------------------------------------------------

int tokenizer_stream_step(TokenizerStream *st, int32_t id, char **text, size_t *len, char *err, size_t err_len) {
    if (!st || !text) { tok_set_err(err, err_len, "tokenizer_stream_step: NULL argument"); return TOK_EINVAL; }
    *text = NULL;
    if (len) *len = 0;
    return st->fast ? fast_step(st, id, text, len, err, err_len) : ref_step(st, id, text, len, err, err_len);
}

int tokenizer_stream_flush(TokenizerStream *st, char **text, size_t *len, char *err, size_t err_len) {
    if (!st || !text) { tok_set_err(err, err_len, "tokenizer_stream_flush: NULL argument"); return TOK_EINVAL; }
    *text = NULL;
    if (len) *len = 0;
    return st->fast ? fast_flush(st, text, len, err, err_len) : ref_flush(st, text, len, err, err_len);
}

int tokenizer_token_bytes(const Tokenizer *t, int32_t id, const char **bytes, size_t *len) {
    if (!t->stream_bytes) return -2;
    if (id < 0 || id >= t->n_ids || !t->id_str[id] || (t->id_flags[id] & TOK_ID_SKIPPED)) return -1;
    *bytes = t->stream_bytes + t->stream_off[id];
    *len = t->stream_off[id + 1] - t->stream_off[id];
    return 0;
}
