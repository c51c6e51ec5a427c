// shared/tokenizer/tokenizer_encode.c — tokenizer_encode: added tokens, normalizer, pre-tokenizers, BPE and the
// post-processor, in HF's order (TokenizerImpl::encode_single_sequence + post_process).
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/tokenizer_internal.h"

static void ctx_free(TokEncodeCtx *x) {
    tok_regex_scratch_free(&x->rs);
    for (size_t i = 0; i < 2 * (TOK_MAX_PRE + 1); i++) tok_buf_free(&x->level_buf[i]);
    for (size_t i = 0; i < TOK_MAX_PRE + 1; i++) tok_spans_free(&x->level_spans[i]);
    tok_buf_free(&x->norm);
    tok_spans_free(&x->raw_spans);
    tok_spans_free(&x->norm_spans);
    tok_buf_free(&x->word);
    free(x->sym_id);
    free(x->sym_prev);
    free(x->sym_next);
    free(x->sym_len);
    free(x->heap);
}

// One text segment between raw-matched added tokens: normalize, match normalized added tokens, then
// pre-tokenize and run the model on what remains.
static int encode_segment(const Tokenizer *t, TokEncodeCtx *x, const char *s, size_t len, int at_origin,
                          TokIds *out, char *err, size_t err_len) {
    const char *ns = s;
    size_t nlen = len;
    if (t->n_norm > 0) {
        int rc = tok_normalize(t, s, len, &x->norm, &x->rs, err, err_len);
        if (rc) return rc;
        ns = x->norm.p;
        nlen = x->norm.n;
    }
    int rc = tok_added_split(t, &t->trie_norm, ns, nlen, &x->norm_spans);
    if (rc) return rc;
    for (size_t i = 0; i < x->norm_spans.n; i++) {
        const TokSpan *sp = &x->norm_spans.p[i];
        if (sp->is_match) {
            rc = tok_ids_push(out, t->added[sp->is_match - 1].id);
        } else {
            if (sp->end <= sp->start) continue;
            rc = tok_pretokenize_and_encode(t, x, ns + sp->start, sp->end - sp->start, at_origin && sp->start == 0,
                                            out, err, err_len);
        }
        if (rc) return rc;
    }
    return 0;
}

// TemplateProcessing "single" templates, innermost first (a post_processor Sequence applies each in turn).
static int post_process(const Tokenizer *t, TokIds *ids) {
    for (size_t k = 0; k < t->n_post; k++) {
        const TokTemplate *tp = &t->post[k];
        TokIds next = {0};
        for (size_t i = 0; i < tp->n; i++) {
            const TokTemplatePiece *p = &tp->pieces[i];
            int rc = p->is_sequence ? tok_ids_append(&next, ids->p, ids->n) : tok_ids_append(&next, p->ids, p->n_ids);
            if (rc) { tok_ids_free(&next); return rc; }
        }
        tok_ids_free(ids);
        *ids = next;
    }
    return 0;
}

int tokenizer_encode(const Tokenizer *t, const char *text, size_t len, int add_special_tokens, int32_t **ids,
                     size_t *n_ids, char *err, size_t err_len) {
    if (!t || !ids || !n_ids || (!text && len)) {
        tok_set_err(err, err_len, "tokenizer_encode: NULL argument");
        return TOK_EINVAL;
    }
    *ids = NULL;
    *n_ids = 0;
    if (!text) text = "";
    // Invalid UTF-8 becomes U+FFFD first: a Python caller gets the same str from bytes.decode(errors="replace").
    char *repaired = NULL;
    if (tok_utf8_valid_prefix(text, len) != len) {
        repaired = tokenizer_utf8_repair(text, len, &len);
        if (!repaired) { tok_set_err(err, err_len, "tokenizer_encode: out of memory"); return TOK_ENOMEM; }
        text = repaired;
    }
    TokEncodeCtx x;
    memset(&x, 0, sizeof(x));
    TokIds out = {0};
    int rc = tok_regex_scratch_init(&x.rs);
    if (!rc) rc = tok_added_split(t, &t->trie_raw, text, len, &x.raw_spans);
    for (size_t i = 0; rc == 0 && i < x.raw_spans.n; i++) {
        const TokSpan *sp = &x.raw_spans.p[i];
        if (sp->is_match) rc = tok_ids_push(&out, t->added[sp->is_match - 1].id);
        else if (sp->end > sp->start)
            rc = encode_segment(t, &x, text + sp->start, sp->end - sp->start, sp->start == 0, &out, err, err_len);
    }
    if (rc == 0 && add_special_tokens) rc = post_process(t, &out);
    ctx_free(&x);
    free(repaired);
    if (rc) {
        if (rc == TOK_ENOMEM) tok_set_err(err, err_len, "tokenizer_encode: out of memory");
        tok_ids_free(&out);
        return rc;
    }
    if (!out.p) out.p = malloc(sizeof(int32_t));   // a valid pointer even for zero ids
    if (!out.p) { tok_set_err(err, err_len, "tokenizer_encode: out of memory"); return TOK_ENOMEM; }
    *ids = out.p;
    *n_ids = out.n;
    return 0;
}
