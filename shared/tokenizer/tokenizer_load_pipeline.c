// shared/tokenizer/tokenizer_load_pipeline.c — tokenizer.json's normalizer, pre_tokenizer, decoder and
// post_processor sections. Sequences are flattened (applying a Sequence is applying its parts in order).
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/tokenizer_internal.h"

// GPT-2's pre-tokenizer regex, which HF's ByteLevel uses when use_regex is true.
static const char GPT2_REGEX[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static const char *type_of(json_t *o) {
    json_t *t = json_object_get(o, "type");
    return json_is_string(t) ? json_string_value(t) : NULL;
}

static int want_bool(json_t *o, const char *key, int def, int *out, const char *where, char *err, size_t err_len) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) { *out = def; return 0; }
    if (!json_is_boolean(v)) { tok_set_err(err, err_len, "%s.%s: expected true/false", where, key); return TOK_EFORMAT; }
    *out = json_is_true(v);
    return 0;
}

static int want_string(json_t *o, const char *key, const char **s, size_t *n, const char *where, char *err,
                       size_t err_len) {
    json_t *v = json_object_get(o, key);
    if (!json_is_string(v)) { tok_set_err(err, err_len, "%s.%s: expected a string", where, key); return TOK_EFORMAT; }
    *s = json_string_value(v);
    *n = json_string_length(v);
    return 0;
}

// A serde `char`: exactly one code point.
static int want_char(json_t *o, const char *key, uint32_t *cp, char *utf8, int *utf8_len, const char *where,
                     char *err, size_t err_len) {
    const char *s;
    size_t n;
    if (want_string(o, key, &s, &n, where, err, err_len)) return TOK_EFORMAT;
    if (n == 0 || (size_t)tok_utf8_decode(s, n, cp) != n) {
        tok_set_err(err, err_len, "%s.%s: expected exactly one character", where, key);
        return TOK_EFORMAT;
    }
    if (utf8) { memcpy(utf8, s, n); utf8[n] = 0; }
    if (utf8_len) *utf8_len = (int)n;
    return 0;
}

// {"String": "..."} or {"Regex": "..."}
static int want_pattern(json_t *o, const char *key, TokPattern *p, const char *where, char *err, size_t err_len) {
    json_t *v = json_object_get(o, key);
    json_t *s = json_object_get(v, "String"), *r = json_object_get(v, "Regex");
    char field[96];
    snprintf(field, sizeof(field), "%s.%s", where, key);
    if (!json_is_object(v) || (json_is_string(s) == json_is_string(r))) {
        tok_set_err(err, err_len, "%s: expected {\"String\": ...} or {\"Regex\": ...}", field);
        return TOK_EFORMAT;
    }
    json_t *src = json_is_string(s) ? s : r;
    return tok_pattern_compile(p, json_string_value(src), json_string_length(src), json_is_string(s), field, err,
                               err_len);
}

// Metaspace's prepend_scheme, with the legacy add_prefix_space key folded in as HF does.
static int want_prepend(json_t *o, TokPrependScheme *out, const char *where, char *err, size_t err_len) {
    json_t *v = json_object_get(o, "prepend_scheme");
    *out = PREPEND_ALWAYS;
    if (v && !json_is_null(v)) {
        const char *s = json_is_string(v) ? json_string_value(v) : "";
        if (strcmp(s, "always") == 0) *out = PREPEND_ALWAYS;
        else if (strcmp(s, "first") == 0) *out = PREPEND_FIRST;
        else if (strcmp(s, "never") == 0) *out = PREPEND_NEVER;
        else {
            tok_set_err(err, err_len, "%s.prepend_scheme: expected \"always\", \"first\" or \"never\"", where);
            return TOK_EFORMAT;
        }
    }
    json_t *aps = json_object_get(o, "add_prefix_space");
    if (json_is_false(aps)) {
        if (*out != PREPEND_NEVER && v && !json_is_null(v)) {
            tok_set_err(err, err_len, "%s: add_prefix_space does not match declared prepend_scheme", where);
            return TOK_EFORMAT;
        }
        *out = PREPEND_NEVER;
    }
    return 0;
}

// ---- normalizer -------------------------------------------------------------------------------------

static int add_norm(Tokenizer *t, json_t *j, const char *where, char *err, size_t err_len) {
    if (!json_is_object(j)) { tok_set_err(err, err_len, "%s: expected an object", where); return TOK_EFORMAT; }
    const char *type = type_of(j);
    if (type && strcmp(type, "Sequence") == 0) {
        json_t *arr = json_object_get(j, "normalizers");
        if (!json_is_array(arr)) { tok_set_err(err, err_len, "%s.normalizers: expected an array", where); return TOK_EFORMAT; }
        size_t i;
        json_t *c;
        json_array_foreach(arr, i, c) {
            char sub[96];
            snprintf(sub, sizeof(sub), "%s.normalizers[%zu]", where, i);
            int rc = add_norm(t, c, sub, err, err_len);
            if (rc) return rc;
        }
        return 0;
    }
    TokNormOp op;
    memset(&op, 0, sizeof(op));
    const char *s;
    size_t n;
    if (!type) { tok_set_err(err, err_len, "%s.type: missing", where); return TOK_EFORMAT; }
    if (strcmp(type, "NFC") == 0) op.type = NORM_NFC;
    else if (strcmp(type, "NFD") == 0) op.type = NORM_NFD;
    else if (strcmp(type, "NFKC") == 0) op.type = NORM_NFKC;
    else if (strcmp(type, "NFKD") == 0) op.type = NORM_NFKD;
    else if (strcmp(type, "Prepend") == 0) {
        op.type = NORM_PREPEND;
        if (want_string(j, "prepend", &s, &n, where, err, err_len)) return TOK_EFORMAT;
    } else if (strcmp(type, "Replace") == 0) {
        op.type = NORM_REPLACE;
        if (want_string(j, "content", &s, &n, where, err, err_len)) return TOK_EFORMAT;
        int rc = want_pattern(j, "pattern", &op.pat, where, err, err_len);
        if (rc) return rc;
    } else {
        tok_set_err(err, err_len, "%s.type: normalizer \"%s\" is not supported", where, type);
        return TOK_EFORMAT;
    }
    if (op.type == NORM_PREPEND || op.type == NORM_REPLACE) {
        op.str = malloc(n + 1);
        if (!op.str) { tok_pattern_free(&op.pat); return TOK_ENOMEM; }
        memcpy(op.str, s, n);
        op.str[n] = 0;
        op.str_len = n;
    }
    TokNormOp *arr = realloc(t->norm, (t->n_norm + 1) * sizeof(TokNormOp));
    if (!arr) { free(op.str); tok_pattern_free(&op.pat); return TOK_ENOMEM; }
    t->norm = arr;
    t->norm[t->n_norm++] = op;
    return 0;
}

int tok_parse_normalizer(Tokenizer *t, json_t *j, char *err, size_t err_len) {
    if (!j || json_is_null(j)) return 0;
    return add_norm(t, j, "normalizer", err, err_len);
}

// ---- pre-tokenizer ----------------------------------------------------------------------------------

static int add_pre(Tokenizer *t, json_t *j, const char *where, char *err, size_t err_len) {
    if (!json_is_object(j)) { tok_set_err(err, err_len, "%s: expected an object", where); return TOK_EFORMAT; }
    const char *type = type_of(j);
    if (!type) { tok_set_err(err, err_len, "%s.type: missing", where); return TOK_EFORMAT; }
    if (strcmp(type, "Sequence") == 0) {
        json_t *arr = json_object_get(j, "pretokenizers");
        if (!json_is_array(arr)) { tok_set_err(err, err_len, "%s.pretokenizers: expected an array", where); return TOK_EFORMAT; }
        size_t i;
        json_t *c;
        json_array_foreach(arr, i, c) {
            char sub[96];
            snprintf(sub, sizeof(sub), "%s.pretokenizers[%zu]", where, i);
            int rc = add_pre(t, c, sub, err, err_len);
            if (rc) return rc;
        }
        return 0;
    }
    if (t->n_pre >= TOK_MAX_PRE) {
        tok_set_err(err, err_len, "%s: more than %d pre-tokenizers", where, TOK_MAX_PRE);
        return TOK_EFORMAT;
    }
    TokPreOp op;
    memset(&op, 0, sizeof(op));
    int rc = 0;
    if (strcmp(type, "Split") == 0) {
        op.type = PRE_SPLIT;
        json_t *b = json_object_get(j, "behavior");
        const char *bs = json_is_string(b) ? json_string_value(b) : "";
        if (strcmp(bs, "Removed") == 0) op.behavior = SPLIT_REMOVED;
        else if (strcmp(bs, "Isolated") == 0) op.behavior = SPLIT_ISOLATED;
        else if (strcmp(bs, "MergedWithPrevious") == 0) op.behavior = SPLIT_MERGED_PREV;
        else if (strcmp(bs, "MergedWithNext") == 0) op.behavior = SPLIT_MERGED_NEXT;
        else if (strcmp(bs, "Contiguous") == 0) op.behavior = SPLIT_CONTIGUOUS;
        else {
            tok_set_err(err, err_len, "%s.behavior: expected Removed, Isolated, MergedWithPrevious, MergedWithNext or "
                        "Contiguous", where);
            return TOK_EFORMAT;
        }
        if (!json_is_boolean(json_object_get(j, "invert"))) {
            tok_set_err(err, err_len, "%s.invert: expected true/false", where);
            return TOK_EFORMAT;
        }
        op.invert = json_is_true(json_object_get(j, "invert"));
        rc = want_pattern(j, "pattern", &op.pat, where, err, err_len);
    } else if (strcmp(type, "ByteLevel") == 0) {
        op.type = PRE_BYTELEVEL;
        rc = want_bool(j, "add_prefix_space", 1, &op.add_prefix_space, where, err, err_len);
        if (!rc) rc = want_bool(j, "use_regex", 1, &op.use_regex, where, err, err_len);
        if (!rc && op.use_regex)
            rc = tok_pattern_compile(&op.pat, GPT2_REGEX, strlen(GPT2_REGEX), 0, where, err, err_len);
    } else if (strcmp(type, "Metaspace") == 0) {
        op.type = PRE_METASPACE;
        rc = want_char(j, "replacement", &op.repl_cp, op.repl, &op.repl_len, where, err, err_len);
        if (!rc) rc = want_prepend(j, &op.prepend, where, err, err_len);
        if (!rc) rc = want_bool(j, "split", 1, &op.split, where, err, err_len);
    } else if (strcmp(type, "Digits") == 0) {
        op.type = PRE_DIGITS;
        rc = want_bool(j, "individual_digits", 0, &op.individual_digits, where, err, err_len);
    } else {
        tok_set_err(err, err_len, "%s.type: pre-tokenizer \"%s\" is not supported", where, type);
        return TOK_EFORMAT;
    }
    if (rc) { tok_pattern_free(&op.pat); return rc; }
    t->pre[t->n_pre++] = op;
    return 0;
}

int tok_parse_pre_tokenizer(Tokenizer *t, json_t *j, char *err, size_t err_len) {
    if (!j || json_is_null(j)) return 0;
    t->pre = calloc(TOK_MAX_PRE, sizeof(TokPreOp));
    if (!t->pre) return TOK_ENOMEM;
    return add_pre(t, j, "pre_tokenizer", err, err_len);
}

// ---- decoder ----------------------------------------------------------------------------------------

static int add_dec(Tokenizer *t, json_t *j, const char *where, char *err, size_t err_len) {
    if (!json_is_object(j)) { tok_set_err(err, err_len, "%s: expected an object", where); return TOK_EFORMAT; }
    const char *type = type_of(j);
    if (!type) { tok_set_err(err, err_len, "%s.type: missing", where); return TOK_EFORMAT; }
    if (strcmp(type, "Sequence") == 0) {
        json_t *arr = json_object_get(j, "decoders");
        if (!json_is_array(arr)) { tok_set_err(err, err_len, "%s.decoders: expected an array", where); return TOK_EFORMAT; }
        size_t i;
        json_t *c;
        json_array_foreach(arr, i, c) {
            char sub[96];
            snprintf(sub, sizeof(sub), "%s.decoders[%zu]", where, i);
            int rc = add_dec(t, c, sub, err, err_len);
            if (rc) return rc;
        }
        return 0;
    }
    TokDecOp op;
    memset(&op, 0, sizeof(op));
    int rc = 0;
    if (strcmp(type, "ByteLevel") == 0) op.type = DEC_BYTELEVEL;
    else if (strcmp(type, "ByteFallback") == 0) op.type = DEC_BYTEFALLBACK;
    else if (strcmp(type, "Fuse") == 0) op.type = DEC_FUSE;
    else if (strcmp(type, "Metaspace") == 0) {
        op.type = DEC_METASPACE;
        rc = want_char(j, "replacement", &op.repl_cp, NULL, NULL, where, err, err_len);
        if (!rc) rc = want_prepend(j, &op.prepend, where, err, err_len);
    } else if (strcmp(type, "Replace") == 0) {
        op.type = DEC_REPLACE;
        const char *s;
        size_t n;
        rc = want_string(j, "content", &s, &n, where, err, err_len);
        if (!rc) {
            op.content = malloc(n + 1);
            if (!op.content) return TOK_ENOMEM;
            memcpy(op.content, s, n);
            op.content[n] = 0;
            op.content_len = n;
            rc = want_pattern(j, "pattern", &op.pat, where, err, err_len);
        }
    } else if (strcmp(type, "Strip") == 0) {
        op.type = DEC_STRIP;
        rc = want_char(j, "content", &op.strip_cp, NULL, NULL, where, err, err_len);
        json_t *a = json_object_get(j, "start"), *b = json_object_get(j, "stop");
        if (!rc && (!json_is_integer(a) || !json_is_integer(b) || json_integer_value(a) < 0 ||
                    json_integer_value(b) < 0)) {
            tok_set_err(err, err_len, "%s.start/stop: expected non-negative integers", where);
            rc = TOK_EFORMAT;
        }
        if (!rc) {
            op.strip_start = (size_t)json_integer_value(a);
            op.strip_stop = (size_t)json_integer_value(b);
        }
    } else {
        tok_set_err(err, err_len, "%s.type: decoder \"%s\" is not supported", where, type);
        return TOK_EFORMAT;
    }
    if (rc) { free(op.content); tok_pattern_free(&op.pat); return rc; }
    TokDecOp *arr = realloc(t->dec, (t->n_dec + 1) * sizeof(TokDecOp));
    if (!arr) { free(op.content); tok_pattern_free(&op.pat); return TOK_ENOMEM; }
    t->dec = arr;
    t->dec[t->n_dec++] = op;
    return 0;
}

int tok_parse_decoder(Tokenizer *t, json_t *j, char *err, size_t err_len) {
    if (!j || json_is_null(j)) return 0;
    t->has_decoder = 1;
    return add_dec(t, j, "decoder", err, err_len);
}

// ---- post-processor ---------------------------------------------------------------------------------

static int parse_template(Tokenizer *t, json_t *j, const char *where, char *err, size_t err_len) {
    json_t *single = json_object_get(j, "single"), *specials = json_object_get(j, "special_tokens");
    if (!json_is_array(single)) { tok_set_err(err, err_len, "%s.single: expected an array of pieces", where); return TOK_EFORMAT; }
    if (specials && !json_is_null(specials) && !json_is_object(specials)) {
        tok_set_err(err, err_len, "%s.special_tokens: expected an object", where);
        return TOK_EFORMAT;
    }
    TokTemplate tp = {calloc(json_array_size(single) + 1, sizeof(TokTemplatePiece)), 0};
    if (!tp.pieces) return TOK_ENOMEM;
    TokTemplate *arr = realloc(t->post, (t->n_post + 1) * sizeof(TokTemplate));
    if (!arr) { free(tp.pieces); return TOK_ENOMEM; }
    t->post = arr;
    t->post[t->n_post++] = tp;   // owned by t from here on, so a later error frees it with t
    TokTemplate *dst = &t->post[t->n_post - 1];
    size_t i;
    json_t *p;
    json_array_foreach(single, i, p) {
        json_t *seq = json_object_get(p, "Sequence"), *sp = json_object_get(p, "SpecialToken");
        TokTemplatePiece *piece = &dst->pieces[dst->n];
        if (json_is_object(seq)) {
            json_t *id = json_object_get(seq, "id");
            if (!json_is_string(id) || strcmp(json_string_value(id), "A") != 0) {
                tok_set_err(err, err_len, "%s.single[%zu]: a single-sequence template can only hold sequence \"A\"",
                            where, i);
                return TOK_EFORMAT;
            }
            piece->is_sequence = 1;
        } else if (json_is_object(sp) && json_is_string(json_object_get(sp, "id"))) {
            const char *name = json_string_value(json_object_get(sp, "id"));
            json_t *def = json_object_get(specials, name), *ids = json_object_get(def, "ids");
            if (!json_is_array(ids)) {
                tok_set_err(err, err_len, "%s.special_tokens: no ids for \"%.64s\"", where, name);
                return TOK_EFORMAT;
            }
            piece->ids = malloc((json_array_size(ids) + 1) * sizeof(int32_t));
            if (!piece->ids) return TOK_ENOMEM;
            size_t k;
            json_t *v;
            json_array_foreach(ids, k, v) {
                if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
                    free(piece->ids);
                    piece->ids = NULL;
                    tok_set_err(err, err_len, "%s.special_tokens[\"%.64s\"].ids[%zu]: expected a token id", where, name, k);
                    return TOK_EFORMAT;
                }
                piece->ids[k] = (int32_t)json_integer_value(v);
            }
            piece->n_ids = json_array_size(ids);
        } else {
            tok_set_err(err, err_len, "%s.single[%zu]: expected {\"Sequence\": ...} or {\"SpecialToken\": ...}", where, i);
            return TOK_EFORMAT;
        }
        dst->n++;
    }
    return 0;
}

static int add_post(Tokenizer *t, json_t *j, const char *where, char *err, size_t err_len) {
    if (!json_is_object(j)) { tok_set_err(err, err_len, "%s: expected an object", where); return TOK_EFORMAT; }
    const char *type = type_of(j);
    if (!type) { tok_set_err(err, err_len, "%s.type: missing", where); return TOK_EFORMAT; }
    if (strcmp(type, "Sequence") == 0) {
        json_t *arr = json_object_get(j, "processors");
        if (!json_is_array(arr)) { tok_set_err(err, err_len, "%s.processors: expected an array", where); return TOK_EFORMAT; }
        size_t i;
        json_t *c;
        json_array_foreach(arr, i, c) {
            char sub[96];
            snprintf(sub, sizeof(sub), "%s.processors[%zu]", where, i);
            int rc = add_post(t, c, sub, err, err_len);
            if (rc) return rc;
        }
        return 0;
    }
    if (strcmp(type, "ByteLevel") == 0) return 0;   // only trims offsets; ids are untouched
    if (strcmp(type, "TemplateProcessing") == 0) return parse_template(t, j, where, err, err_len);
    tok_set_err(err, err_len, "%s.type: post-processor \"%s\" is not supported", where, type);
    return TOK_EFORMAT;
}

int tok_parse_post_processor(Tokenizer *t, json_t *j, char *err, size_t err_len) {
    if (!j || json_is_null(j)) return 0;
    return add_post(t, j, "post_processor", err, err_len);
}

void tok_free_pipeline(Tokenizer *t) {
    for (size_t i = 0; i < t->n_norm; i++) {
        free(t->norm[i].str);
        tok_pattern_free(&t->norm[i].pat);
    }
    free(t->norm);
    for (size_t i = 0; i < t->n_pre; i++) tok_pattern_free(&t->pre[i].pat);
    free(t->pre);
    for (size_t i = 0; i < t->n_dec; i++) {
        free(t->dec[i].content);
        tok_pattern_free(&t->dec[i].pat);
    }
    free(t->dec);
    for (size_t i = 0; i < t->n_post; i++) {
        for (size_t k = 0; k < t->post[i].n; k++) free(t->post[i].pieces[k].ids);
        free(t->post[i].pieces);
    }
    free(t->post);
    t->norm = NULL; t->pre = NULL; t->dec = NULL; t->post = NULL;
    t->n_norm = t->n_pre = t->n_dec = t->n_post = 0;
}
