// shared/tokenizer/tokenizer_normalize.c — the normalizer chain (NFC/NFD/NFKC/NFKD via utf8proc, Prepend, Replace),
// applied to each text segment between added tokens, as HF's Normalizer::normalize does.
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "shared/tokenizer/tokenizer_internal.h"

// HF normalizes with the `unicode-normalization-alignments` crate, whose tables stop at Unicode 9.0: code
// points assigned later carry no normalization data there (combining class 0, no decomposition, no
// composition). These are the ones among them that do carry data in utf8proc's Unicode 15 tables (combining
// marks, compatibility decompositions, the Dives Akuru composition); we pass them through untouched and
// normalize the text between them, which is exactly what "class 0, no mappings" means for NF(K)C/D.
static const uint32_t HF_UNKNOWN[][2] = {
    {0x7FD, 0x7FD}, {0x898, 0x89F}, {0x8CA, 0x8D3}, {0x9FE, 0x9FE}, {0xC3C, 0xC3C}, {0xD3B, 0xD3C},
    {0xEBA, 0xEBA}, {0x1715, 0x1715}, {0x1ABF, 0x1ACE}, {0x1DF6, 0x1DFA}, {0x32FF, 0x32FF}, {0xA7F2, 0xA7F4},
    {0xA82C, 0xA82C}, {0xAB69, 0xAB69}, {0x10781, 0x10785}, {0x10787, 0x107B0}, {0x107B2, 0x107BA},
    {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF}, {0x10F46, 0x10F50}, {0x10F82, 0x10F85},
    {0x11070, 0x11070}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E}, {0x11839, 0x1183A}, {0x11930, 0x11930},
    {0x11935, 0x11935}, {0x11938, 0x11938}, {0x1193D, 0x1193E}, {0x11943, 0x11943}, {0x119E0, 0x119E0},
    {0x11A34, 0x11A34}, {0x11A47, 0x11A47}, {0x11A99, 0x11A99}, {0x11D42, 0x11D42}, {0x11D44, 0x11D45},
    {0x11D97, 0x11D97}, {0x11F41, 0x11F42}, {0x16FF0, 0x16FF1}, {0x1E030, 0x1E06D}, {0x1E08F, 0x1E08F},
    {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF}, {0x1E4EC, 0x1E4EF}, {0x1F16C, 0x1F16C},
    {0x1FBF0, 0x1FBF9},
};

static int hf_unknown(uint32_t cp) {
    if (cp < 0x7FD) return 0;
    size_t lo = 0, hi = sizeof(HF_UNKNOWN) / sizeof(HF_UNKNOWN[0]);
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < HF_UNKNOWN[mid][0]) hi = mid;
        else if (cp > HF_UNKNOWN[mid][1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

static int utf8proc_form(utf8proc_option_t opt, const char *s, size_t len, TokBuf *out, char *err, size_t err_len) {
    if (len == 0) return 0;
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &dst, opt);
    if (n < 0) {
        tok_set_err(err, err_len, "normalizer: utf8proc failed: %s", utf8proc_errmsg(n));
        return n == UTF8PROC_ERROR_NOMEM ? TOK_ENOMEM : TOK_EFORMAT;
    }
    int rc = tok_buf_append(out, dst, (size_t)n);
    free(dst);
    return rc;
}

static int unicode_form(TokNormType type, const char *s, size_t len, TokBuf *out, char *err, size_t err_len) {
    utf8proc_option_t opt = UTF8PROC_STABLE;
    switch (type) {
    case NORM_NFC: opt |= UTF8PROC_COMPOSE; break;
    case NORM_NFD: opt |= UTF8PROC_DECOMPOSE; break;
    case NORM_NFKC: opt |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    default: opt |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
    }
    size_t run = 0, i = 0;
    while (i < len) {
        uint32_t cp;
        int cl = tok_utf8_decode(s + i, len - i, &cp);
        if (hf_unknown(cp)) {
            int rc = utf8proc_form(opt, s + run, i - run, out, err, err_len);
            if (rc || tok_buf_append(out, s + i, (size_t)cl)) return rc ? rc : TOK_ENOMEM;
            run = i + (size_t)cl;
        }
        i += (size_t)cl;
    }
    return utf8proc_form(opt, s + run, len - run, out, err, err_len);
}

static int replace(const TokNormOp *op, const char *s, size_t len, TokBuf *out, TokRegexScratch *rs, char *err,
                   size_t err_len) {
    TokSpans spans = {0};
    int rc = tok_pattern_find(&op->pat, s, len, &spans, rs, err, err_len);
    for (size_t i = 0; rc == 0 && i < spans.n; i++) {
        const TokSpan *sp = &spans.p[i];
        rc = sp->is_match ? tok_buf_append(out, op->str, op->str_len)
                          : tok_buf_append(out, s + sp->start, sp->end - sp->start);
    }
    tok_spans_free(&spans);
    return rc;
}

int tok_normalize(const Tokenizer *t, const char *s, size_t len, TokBuf *out, TokRegexScratch *rs, char *err,
                  size_t err_len) {
    out->n = 0;
    if (tok_buf_append(out, s, len)) return TOK_ENOMEM;
    TokBuf tmp = {0};
    int rc = 0;
    for (size_t k = 0; k < t->n_norm && rc == 0; k++) {
        const TokNormOp *op = &t->norm[k];
        tmp.n = 0;
        if (tok_buf_reserve(&tmp, out->n)) { rc = TOK_ENOMEM; break; }
        switch (op->type) {
        case NORM_PREPEND:
            if (out->n == 0) continue;   // HF prepends only to non-empty text
            rc = tok_buf_append(&tmp, op->str, op->str_len);
            if (!rc) rc = tok_buf_append(&tmp, out->p, out->n);
            break;
        case NORM_REPLACE:
            rc = replace(op, out->p, out->n, &tmp, rs, err, err_len);
            break;
        default:
            rc = unicode_form(op->type, out->p, out->n, &tmp, err, err_len);
            break;
        }
        if (rc) break;
        TokBuf swap = *out;
        *out = tmp;
        tmp = swap;
    }
    tok_buf_free(&tmp);
    if (!out->p && tok_buf_reserve(out, 0)) return TOK_ENOMEM;
    return rc;
}
