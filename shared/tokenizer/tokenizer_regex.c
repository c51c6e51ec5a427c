// shared/tokenizer/tokenizer_regex.c — Split/Replace patterns: HF writes Oniguruma (Ruby syntax) regexes; we run
// them on PCRE2 (UTF, UCP, JIT) after rewriting the spellings whose meaning differs between the engines.
#define _GNU_SOURCE   // memmem
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/tokenizer_internal.h"

// White_Space, which Oniguruma's \s matches (PCRE2's UCP \s also takes U+180E, so we spell it out).
static const char WS_CLASS_BODY[] =
    "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

// Letters and numbers assigned in Unicode 15.0-16.0. Oniguruma inside `tokenizers` knows Unicode 16;
// PCRE2 10.42 stops at Unicode 14, so \p{L} and \p{N} get these ranges added to stay identical.
static const char EXTRA_L[] =
    "\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CD}\\x{A7DA}-\\x{A7DC}\\x{105C0}-\\x{105F3}\\x{10D4A}-\\x{10D65}"
    "\\x{10D6F}-\\x{10D85}\\x{10EC2}-\\x{10EC4}\\x{1123F}-\\x{11240}\\x{11380}-\\x{11389}\\x{1138B}"
    "\\x{1138E}\\x{11390}-\\x{113B5}\\x{113B7}\\x{113D1}\\x{113D3}\\x{11BC0}-\\x{11BE0}\\x{11F02}"
    "\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}\\x{1342F}\\x{13441}-\\x{13446}\\x{13460}-\\x{143FA}"
    "\\x{16100}-\\x{1611D}\\x{16D40}-\\x{16D6C}\\x{18CFF}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}"
    "\\x{1E030}-\\x{1E06D}\\x{1E4D0}-\\x{1E4EB}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}\\x{2B739}"
    "\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{323AF}";
static const char EXTRA_N[] =
    "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}"
    "\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}"
    "\\x{1E4F0}-\\x{1E4F9}\\x{1E5F1}-\\x{1E5FA}";

static int put(TokBuf *b, const char *s) { return tok_buf_append(b, s, strlen(s)); }

// Property escape at p (after the backslash and 'p'/'P'): returns its name length consumed and sets
// *which to 'L', 'N' or 0 (other property).
static size_t prop_name(const char *p, size_t n, char *which) {
    *which = 0;
    if (n == 0) return 0;
    if (p[0] != '{') {   // \pL form
        if (p[0] == 'L' || p[0] == 'N') *which = p[0];
        return 1;
    }
    size_t i = 1;
    while (i < n && p[i] != '}') i++;
    if (i >= n) return n;
    if (i == 2 && (p[1] == 'L' || p[1] == 'N')) *which = p[1];
    return i + 1;
}

// Rewrites an Oniguruma pattern into PCRE2 syntax (see the file comment). Unknown constructs are copied.
static int onig_to_pcre2(const char *src, size_t n, TokBuf *out) {
    int in_class = 0;
    size_t i = 0;
    while (i < n) {
        char c = src[i];
        if (c == '\\' && i + 1 < n) {
            char e = src[i + 1];
            if (e == 's' || e == 'S' || e == 'h' || e == 'H') {
                int neg = (e == 'S' || e == 'H');
                const char *body = (e == 's' || e == 'S') ? WS_CLASS_BODY : "0-9a-fA-F";
                if (in_class && neg) {   // a negated set cannot be inlined into a class: keep PCRE2's
                    if (tok_buf_append(out, src + i, 2)) return TOK_ENOMEM;
                } else if (in_class) {
                    if (put(out, body)) return TOK_ENOMEM;
                } else {
                    if (put(out, neg ? "[^" : "[") || put(out, body) || put(out, "]")) return TOK_ENOMEM;
                }
                i += 2;
                continue;
            }
            if (e == 'p' || e == 'P') {
                char which;
                size_t l = prop_name(src + i + 2, n - i - 2, &which);
                const char *extra = which == 'L' ? EXTRA_L : which == 'N' ? EXTRA_N : NULL;
                if (!extra || (in_class && e == 'P')) {
                    if (tok_buf_append(out, src + i, 2 + l)) return TOK_ENOMEM;
                } else if (in_class) {
                    if (put(out, which == 'L' ? "\\p{L}" : "\\p{N}") || put(out, extra)) return TOK_ENOMEM;
                } else {
                    if (put(out, e == 'P' ? "[^" : "[") || put(out, which == 'L' ? "\\p{L}" : "\\p{N}") ||
                        put(out, extra) || put(out, "]"))
                        return TOK_ENOMEM;
                }
                i += 2 + l;
                continue;
            }
            if (e == 'u' && i + 5 < n) {   // Oniguruma's \uHHHH is PCRE2's \x{HHHH}
                if (put(out, "\\x{") || tok_buf_append(out, src + i + 2, 4) || put(out, "}")) return TOK_ENOMEM;
                i += 6;
                continue;
            }
            if (e == 'x' && i + 2 < n && src[i + 2] == '{') {   // \x{...}: copy whole
                size_t j = i + 3;
                while (j < n && src[j] != '}') j++;
                size_t end = j < n ? j + 1 : n;
                if (tok_buf_append(out, src + i, end - i)) return TOK_ENOMEM;
                i = end;
                continue;
            }
            if (tok_buf_append(out, src + i, 2)) return TOK_ENOMEM;
            i += 2;
            continue;
        }
        if (!in_class && c == '(' && i + 1 < n && src[i + 1] == '?') {
            // Inline options: Ruby's (?m) is "dot matches newline", PCRE2's (?s).
            size_t j = i + 2;
            if (tok_buf_append(out, "(?", 2)) return TOK_ENOMEM;
            while (j < n && ((src[j] >= 'a' && src[j] <= 'z') || src[j] == '-')) {
                char o = src[j] == 'm' ? 's' : src[j];
                if (tok_buf_append(out, &o, 1)) return TOK_ENOMEM;
                j++;
            }
            i = j;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = 1;
            if (tok_buf_append(out, "[", 1)) return TOK_ENOMEM;
            i++;
            if (i < n && src[i] == '^') { if (tok_buf_append(out, "^", 1)) return TOK_ENOMEM; i++; }
            if (i < n && src[i] == ']') { if (tok_buf_append(out, "]", 1)) return TOK_ENOMEM; i++; }
            continue;
        }
        if (in_class && c == '[' && i + 1 < n && src[i + 1] == ':') {   // POSIX class [:alpha:]
            size_t j = i + 2;
            while (j + 1 < n && !(src[j] == ':' && src[j + 1] == ']')) j++;
            size_t end = j + 1 < n ? j + 2 : n;
            if (tok_buf_append(out, src + i, end - i)) return TOK_ENOMEM;
            i = end;
            continue;
        }
        if (in_class && c == ']') in_class = 0;
        if (tok_buf_append(out, &c, 1)) return TOK_ENOMEM;
        i++;
    }
    return 0;
}

int tok_pattern_compile(TokPattern *p, const char *src, size_t len, int literal, const char *field,
                        char *err, size_t err_len) {
    memset(p, 0, sizeof(*p));
    p->src = malloc(len + 1);
    if (!p->src) return TOK_ENOMEM;
    memcpy(p->src, src, len);
    p->src[len] = 0;
    p->src_len = len;
    p->literal = literal;
    if (literal && len > 0) return 0;   // plain byte search, no regex needed

    TokBuf pat = {0};
    int rc = literal ? 0 : onig_to_pcre2(src, len, &pat);
    if (rc) { tok_buf_free(&pat); return rc; }
    int ecode = 0;
    PCRE2_SIZE eoff = 0;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE | PCRE2_NO_UTF_CHECK;
    if (literal) opts |= PCRE2_LITERAL;
    p->re = pcre2_compile((PCRE2_SPTR)(literal ? "" : pat.p ? pat.p : ""), literal ? 0 : pat.n, opts, &ecode, &eoff,
                          NULL);
    tok_buf_free(&pat);
    if (!p->re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ecode, msg, sizeof(msg));
        tok_set_err(err, err_len, "%s: regex does not compile at offset %zu: %s", field, (size_t)eoff,
                    (const char *)msg);
        return TOK_EREGEX;
    }
    // JIT is an accelerator only: when it is unavailable the interpreter gives the same matches.
    pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE);
    return 0;
}

void tok_pattern_free(TokPattern *p) {
    free(p->src);
    if (p->re) pcre2_code_free(p->re);
    memset(p, 0, sizeof(*p));
}

int tok_regex_scratch_init(TokRegexScratch *rs) {
    memset(rs, 0, sizeof(*rs));
    rs->md = pcre2_match_data_create(1, NULL);
    rs->mctx = pcre2_match_context_create(NULL);
    if (!rs->md || !rs->mctx) { tok_regex_scratch_free(rs); return TOK_ENOMEM; }
    return 0;
}

void tok_regex_scratch_free(TokRegexScratch *rs) {
    if (rs->md) pcre2_match_data_free(rs->md);
    if (rs->mctx) pcre2_match_context_free(rs->mctx);
    if (rs->jit_stack) pcre2_jit_stack_free(rs->jit_stack);
    memset(rs, 0, sizeof(*rs));
}

void tok_spans_free(TokSpans *s) {
    free(s->p);
    s->p = NULL;
    s->n = s->cap = 0;
}

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

// One regex search from `start`; returns 1 (match, bounds in *ms/*me), 0 (none) or a negative error.
// The default 32 KiB JIT stack overflows on very long runs that the pattern backtracks over; we then
// retry with a large stack, and finally with the interpreter, which gives the same answer.
static int regex_search(const pcre2_code *re, const char *s, size_t len, size_t start, TokRegexScratch *rs,
                        size_t *ms, size_t *me) {
    int rc = pcre2_match(re, (PCRE2_SPTR)s, len, start, PCRE2_NO_UTF_CHECK, rs->md, rs->mctx);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
        if (!rs->jit_stack) {
            rs->jit_stack = pcre2_jit_stack_create(64 * 1024, 256 * 1024 * 1024, NULL);
            if (rs->jit_stack) pcre2_jit_stack_assign(rs->mctx, NULL, rs->jit_stack);
        }
        rc = pcre2_match(re, (PCRE2_SPTR)s, len, start, PCRE2_NO_UTF_CHECK, rs->md, rs->mctx);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(re, (PCRE2_SPTR)s, len, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, rs->md,
                             rs->mctx);
    }
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) return rc;   // rc == 0 only means "ovector too small": the match itself is there
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(rs->md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}

int tok_pattern_find(const TokPattern *p, const char *s, size_t len, TokSpans *out, TokRegexScratch *rs,
                     char *err, size_t err_len) {
    out->n = 0;
    if (len == 0) return spans_push(out, 0, 0, 0);
    size_t prev = 0;
    if (p->literal && p->src_len > 0) {
        size_t i = 0;
        while (i + p->src_len <= len) {
            const char *hit = memmem(s + i, len - i, p->src, p->src_len);
            if (!hit) break;
            size_t a = (size_t)(hit - s);
            if (prev != a && spans_push(out, prev, a, 0)) return TOK_ENOMEM;
            if (spans_push(out, a, a + p->src_len, 1)) return TOK_ENOMEM;
            prev = i = a + p->src_len;
        }
    } else {
        // Oniguruma's find_iter: an empty match right where the previous match ended is skipped by
        // stepping one character forward.
        size_t last_end = 0;
        int have_last = 0;
        size_t last_match_end = 0;
        while (last_end <= len) {
            size_t a, b;
            int rc = regex_search(p->re, s, len, last_end, rs, &a, &b);
            if (rc < 0) {
                PCRE2_UCHAR msg[160];
                pcre2_get_error_message(rc, msg, sizeof(msg));
                tok_set_err(err, err_len, "regex /%s/ failed: %s", p->src, (const char *)msg);
                return TOK_EREGEX;
            }
            if (rc == 0) break;
            if (a == b && have_last && last_match_end == b) {
                last_end += last_end < len ? tok_utf8_char_len(s + last_end, len - last_end) : 1;
                continue;
            }
            last_end = b;
            last_match_end = b;
            have_last = 1;
            if (prev != a && spans_push(out, prev, a, 0)) return TOK_ENOMEM;
            if (spans_push(out, a, b, 1)) return TOK_ENOMEM;
            prev = b;
        }
    }
    if (prev != len && spans_push(out, prev, len, 0)) return TOK_ENOMEM;
    return 0;
}
