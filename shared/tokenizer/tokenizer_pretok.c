// shared/tokenizer/tokenizer_pretok.c — pre-tokenizers (Split, ByteLevel, Metaspace, Digits), run depth first on
// one normalized segment: each piece a pre-tokenizer produces goes through the next one and finally
// through the BPE model. Equivalent to HF applying each pre-tokenizer to all splits in turn, because every
// pre-tokenizer acts on one split at a time.
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/tokenizer_internal.h"

static int run_level(const Tokenizer *t, TokEncodeCtx *x, size_t level, const char *s, size_t len,
                     int at_origin, TokIds *out, char *err, size_t err_len);

static int spans_push(TokSpans *s, size_t a, size_t b, int m) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 32;
        TokSpan *p = realloc(s->p, cap * sizeof(TokSpan));
        if (!p) return TOK_ENOMEM;
        s->p = p;
        s->cap = cap;
    }
    s->p[s->n++] = (TokSpan){a, b, m};
    return 0;
}

// NormalizedString::split's behaviours, applied in place to the match list (is_match flags).
static void apply_behavior(TokSpans *sp, TokSplitBehavior b) {
    size_t n = sp->n, w = 0;
    TokSpan *p = sp->p;
    int prev_match = 0;
    switch (b) {
    case SPLIT_ISOLATED:
        break;
    case SPLIT_REMOVED:
        for (size_t i = 0; i < n; i++)
            if (!p[i].is_match) p[w++] = p[i];
        sp->n = w;
        break;
    case SPLIT_CONTIGUOUS:
        for (size_t i = 0; i < n; i++) {
            if (p[i].is_match == prev_match && w > 0) p[w - 1].end = p[i].end;
            else p[w++] = p[i];
            prev_match = p[i].is_match;
        }
        sp->n = w;
        break;
    case SPLIT_MERGED_PREV:
        for (size_t i = 0; i < n; i++) {
            if (p[i].is_match && !prev_match && w > 0) p[w - 1].end = p[i].end;
            else p[w++] = p[i];
            prev_match = p[i].is_match;
        }
        sp->n = w;
        break;
    case SPLIT_MERGED_NEXT: {
        // Fold from the right: a match glues onto the piece that follows it. Built at the tail, then moved.
        size_t r = n;   // write position from the end
        for (size_t k = n; k-- > 0;) {
            TokSpan cur = p[k];
            if (cur.is_match && !prev_match && r < n) p[r].start = cur.start;
            else p[--r] = cur;
            prev_match = cur.is_match;
        }
        memmove(p, p + r, (n - r) * sizeof(TokSpan));
        sp->n = n - r;
        break;
    }
    }
}

static int for_each_piece(const Tokenizer *t, TokEncodeCtx *x, size_t level, const char *s, const TokSpans *sp,
                          int at_origin, TokIds *out, char *err, size_t err_len) {
    for (size_t i = 0; i < sp->n; i++) {
        const TokSpan *p = &sp->p[i];
        if (p->end <= p->start) continue;   // HF drops empty splits
        int rc = run_level(t, x, level + 1, s + p->start, p->end - p->start, at_origin && p->start == 0, out, err,
                           err_len);
        if (rc) return rc;
    }
    return 0;
}

// The 256 bytes as the printable characters GPT-2's byte-level BPE spells them with.
static int bytelevel_map(const char *s, size_t len, TokBuf *out) {
    out->n = 0;
    if (tok_buf_reserve(out, 2 * len)) return TOK_ENOMEM;
    char *o = out->p;
    for (size_t i = 0; i < len; i++) o += tok_utf8_encode(tok_bytelevel_char[(unsigned char)s[i]], o);
    out->n = (size_t)(o - out->p);
    out->p[out->n] = 0;
    return 0;
}

static int do_bytelevel(const Tokenizer *t, TokEncodeCtx *x, size_t level, const TokPreOp *op, const char *s,
                        size_t len, int at_origin, TokIds *out, char *err, size_t err_len) {
    TokBuf *pre = &x->level_buf[2 * level], *mapped = &x->level_buf[2 * level + 1];
    if (op->add_prefix_space && s[0] != ' ') {
        pre->n = 0;
        if (tok_buf_append(pre, " ", 1) || tok_buf_append(pre, s, len)) return TOK_ENOMEM;
        s = pre->p;
        len = pre->n;
    }
    TokSpans *sp = &x->level_spans[level];
    if (op->use_regex) {
        int rc = tok_pattern_find(&op->pat, s, len, sp, &x->rs, err, err_len);
        if (rc) return rc;
    } else {
        sp->n = 0;
        if (spans_push(sp, 0, len, 0)) return TOK_ENOMEM;
    }
    for (size_t i = 0; i < sp->n; i++) {
        const TokSpan *p = &sp->p[i];
        if (p->end <= p->start) continue;
        if (bytelevel_map(s + p->start, p->end - p->start, mapped)) return TOK_ENOMEM;
        int rc = run_level(t, x, level + 1, mapped->p, mapped->n, at_origin && p->start == 0, out, err, err_len);
        if (rc) return rc;
    }
    return 0;
}

static int do_metaspace(const Tokenizer *t, TokEncodeCtx *x, size_t level, const TokPreOp *op, const char *s,
                        size_t len, int at_origin, TokIds *out, char *err, size_t err_len) {
    TokBuf *b = &x->level_buf[2 * level];
    b->n = 0;
    if (tok_buf_reserve(b, len * 3 + 4)) return TOK_ENOMEM;
    // HF replaces spaces first, then asks whether the text starts with the replacement: a leading space
    // therefore counts as the replacement.
    uint32_t cp0;
    tok_utf8_decode(s, len, &cp0);
    int starts_with_repl = cp0 == op->repl_cp || s[0] == ' ';
    if (!starts_with_repl && (op->prepend == PREPEND_ALWAYS || (op->prepend == PREPEND_FIRST && at_origin)))
        if (tok_buf_append(b, op->repl, (size_t)op->repl_len)) return TOK_ENOMEM;
    size_t run = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] != ' ') continue;
        if (tok_buf_append(b, s + run, i - run) || tok_buf_append(b, op->repl, (size_t)op->repl_len))
            return TOK_ENOMEM;
        run = i + 1;
    }
    if (tok_buf_append(b, s + run, len - run)) return TOK_ENOMEM;
    TokSpans *sp = &x->level_spans[level];
    sp->n = 0;
    if (!op->split) {
        if (spans_push(sp, 0, b->n, 0)) return TOK_ENOMEM;
    } else {
        // Split on each replacement character, the character staying with the text after it.
        size_t prev = 0, i = 0;
        while (i < b->n) {
            uint32_t cp;
            int cl = tok_utf8_decode(b->p + i, b->n - i, &cp);
            if (cp == op->repl_cp) {
                if (prev < i && spans_push(sp, prev, i, 0)) return TOK_ENOMEM;
                if (spans_push(sp, i, i + (size_t)cl, 1)) return TOK_ENOMEM;
                prev = i + (size_t)cl;
            }
            i += (size_t)cl;
        }
        if (prev < b->n && spans_push(sp, prev, b->n, 0)) return TOK_ENOMEM;
        if (sp->n == 0 && spans_push(sp, 0, 0, 0)) return TOK_ENOMEM;
        apply_behavior(sp, SPLIT_MERGED_NEXT);
    }
    return for_each_piece(t, x, level, b->p, sp, at_origin, out, err, err_len);
}

static int do_digits(const Tokenizer *t, TokEncodeCtx *x, size_t level, const TokPreOp *op, const char *s,
                     size_t len, int at_origin, TokIds *out, char *err, size_t err_len) {
    TokSpans *sp = &x->level_spans[level];
    sp->n = 0;
    size_t last = 0, i = 0;
    while (i < len) {
        uint32_t cp;
        int cl = tok_utf8_decode(s + i, len - i, &cp);
        if (tok_is_numeric(cp)) {
            if (last < i && spans_push(sp, last, i, 0)) return TOK_ENOMEM;
            if (spans_push(sp, i, i + (size_t)cl, 1)) return TOK_ENOMEM;
            last = i + (size_t)cl;
        }
        i += (size_t)cl;
    }
    if (len > last && spans_push(sp, last, len, 0)) return TOK_ENOMEM;
    apply_behavior(sp, op->individual_digits ? SPLIT_ISOLATED : SPLIT_CONTIGUOUS);
    return for_each_piece(t, x, level, s, sp, at_origin, out, err, err_len);
}

static int run_level(const Tokenizer *t, TokEncodeCtx *x, size_t level, const char *s, size_t len,
                     int at_origin, TokIds *out, char *err, size_t err_len) {
    if (len == 0) return 0;
    if (level == t->n_pre) return tok_bpe_word(t, x, s, len, out, err, err_len);
    const TokPreOp *op = &t->pre[level];
    switch (op->type) {
    case PRE_SPLIT: {
        TokSpans *sp = &x->level_spans[level];
        int rc = tok_pattern_find(&op->pat, s, len, sp, &x->rs, err, err_len);
        if (rc) return rc;
        if (op->invert)
            for (size_t i = 0; i < sp->n; i++) sp->p[i].is_match = !sp->p[i].is_match;
        apply_behavior(sp, op->behavior);
        return for_each_piece(t, x, level, s, sp, at_origin, out, err, err_len);
    }
    case PRE_BYTELEVEL:
        return do_bytelevel(t, x, level, op, s, len, at_origin, out, err, err_len);
    case PRE_METASPACE:
        return do_metaspace(t, x, level, op, s, len, at_origin, out, err, err_len);
    case PRE_DIGITS:
        return do_digits(t, x, level, op, s, len, at_origin, out, err, err_len);
    }
    return TOK_EFORMAT;
}

int tok_pretokenize_and_encode(const Tokenizer *t, TokEncodeCtx *x, const char *s, size_t len, int at_origin,
                               TokIds *out, char *err, size_t err_len) {
    return run_level(t, x, 0, s, len, at_origin, out, err, err_len);
}
