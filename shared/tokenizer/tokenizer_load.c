// shared/tokenizer/tokenizer_load.c — tokenizer.json: top level, BPE model (vocab, merges) and added tokens.
// The pipeline parts (normalizer, pre-tokenizer, decoder, post-processor) are in tokenizer_load_pipeline.c.
#define _GNU_SOURCE   // memmem
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "shared/tokenizer/tokenizer_internal.h"
#include "shared/json_get.h"
#include "shared/json_read.h"

#define MAX_TOKEN_ID 0x3FFFFFF   // ids above this are refused rather than allocated for (64M entries)

static char *dup_bytes(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) return NULL;
    if (n) memcpy(p, s, n);
    p[n] = 0;
    return p;
}

// A string member copied (it may hold NUL bytes); absent or null: NULL.
static int get_string_copy(const JsonAt *at, const char *key, char **out, size_t *len) {
    const char *s;
    size_t n;
    *out = NULL;
    if (len) *len = 0;
    int rc = json_get_string(at, key, JSON_GET_OPTIONAL, NULL, JSON_ANY_LENGTH, &s, &n);
    if (rc || !s) return rc;
    if (!(*out = dup_bytes(s, n))) return TOK_ENOMEM;
    if (len) *len = n;
    return 0;
}

// ---- U+0000 inside object keys ----------------------------------------------------------------------
// jansson refuses "\u0000" inside an object key, yet a SentencePiece-style vocab may hold the NUL character
// as a token. Before parsing we respell it U+FDD0 (a noncharacter, same escape length) in keys only, and
// turn it back into NUL in the vocab; a file that already uses U+FDD0 in a key is refused as ambiguous.

static int is_hex_at(const char *s, size_t n, size_t i, const char *want) {
    if (i + 4 > n) return 0;
    for (int k = 0; k < 4; k++) {
        char c = s[i + k], w = want[k];
        if (c != w && !(w >= 'A' && w <= 'F' && c == w - 'A' + 'a')) return 0;
    }
    return 1;
}

// Returns 1 when some key was rewritten, 0 when none needed it, -1 when a key already holds U+FDD0.
static int escape_nul_keys(char *s, size_t n) {
    int changed = 0, conflict = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '"') continue;
        size_t j = i + 1;
        while (j < n && s[j] != '"') j += (s[j] == '\\') ? 2 : 1;   // end of this string literal
        size_t k = j + 1;
        while (k < n && (s[k] == ' ' || s[k] == '\t' || s[k] == '\n' || s[k] == '\r')) k++;
        if (k < n && s[k] == ':') {
            for (size_t p = i + 1; p < j && p < n; p++) {
                if (s[p] == '\\' && p + 1 < n && s[p + 1] == 'u') {
                    if (is_hex_at(s, n, p + 2, "0000")) { memcpy(s + p + 2, "FDD0", 4); changed = 1; }
                    else if (is_hex_at(s, n, p + 2, "FDD0")) conflict = 1;
                    p += 5;
                } else if (s[p] == '\\') {
                    p++;
                } else if (p + 2 < j && (unsigned char)s[p] == 0xEF && (unsigned char)s[p + 1] == 0xB7 &&
                           (unsigned char)s[p + 2] == 0x90) {
                    conflict = 1;
                }
            }
        }
        i = j;
    }
    return conflict && changed ? -1 : changed;
}

static size_t fdd0_to_nul(char *w, size_t n) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (i + 2 < n && (unsigned char)w[i] == 0xEF && (unsigned char)w[i + 1] == 0xB7 &&
            (unsigned char)w[i + 2] == 0x90) {
            w[o++] = 0;
            i += 2;
        } else {
            w[o++] = w[i];
        }
    }
    w[o] = 0;
    return o;
}

static int parse_vocab(Tokenizer *t, json_t *vocab, int32_t *max_id, char *err, size_t err_len) {
    if (!json_is_object(vocab)) {
        tok_set_err(err, err_len, "model.vocab: expected an object mapping token -> id");
        return TOK_EFORMAT;
    }
    size_t total = 0;
    void *iter;
    for (iter = json_object_iter(vocab); iter; iter = json_object_iter_next(vocab, iter))
        total += json_object_iter_key_len(iter) + 1;
    t->vocab_keys = malloc(total ? total : 1);
    if (!t->vocab_keys) return TOK_ENOMEM;
    char *w = t->vocab_keys;
    for (iter = json_object_iter(vocab); iter; iter = json_object_iter_next(vocab, iter)) {
        const char *key = json_object_iter_key(iter);
        json_t *val = json_object_iter_value(iter);
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) > MAX_TOKEN_ID) {
            tok_set_err(err, err_len, "model.vocab[\"%.64s\"]: expected an integer id in [0, %d]", key,
                        MAX_TOKEN_ID);
            return TOK_EFORMAT;
        }
        size_t n = json_object_iter_key_len(iter);
        memcpy(w, key, n);
        w[n] = 0;
        if (t->nul_keys) n = fdd0_to_nul(w, n);
        int32_t id = (int32_t)json_integer_value(val);
        if (tok_strmap_put(&t->vocab, w, (uint32_t)n, id)) return TOK_ENOMEM;
        if (id > *max_id) *max_id = id;
        w += n + 1;
    }
    t->model_vocab_size = (int32_t)t->vocab.n;
    return 0;
}

// One merge rule; `a`/`b` are the two parts. Builds (a_id, b_id) -> (rank, id of a + b-without-prefix).
static int add_merge(Tokenizer *t, const char *a, size_t na, const char *b, size_t nb, uint32_t rank, TokBuf *tmp,
                     char *err, size_t err_len) {
    int32_t ia = tok_strmap_get(&t->vocab, a, na), ib = tok_strmap_get(&t->vocab, b, nb);
    if (ia < 0 || ib < 0) {
        tok_set_err(err, err_len, "model.merges[%u]: token \"%.64s\" is not in model.vocab", rank,
                    ia < 0 ? a : b);
        return TOK_EFORMAT;
    }
    size_t skip = t->cont_prefix_len;
    if (nb < skip) {
        tok_set_err(err, err_len, "model.merges[%u]: \"%.64s\" is shorter than continuing_subword_prefix", rank, b);
        return TOK_EFORMAT;
    }
    tmp->n = 0;
    if (tok_buf_append(tmp, a, na) || tok_buf_append(tmp, b + skip, nb - skip)) return TOK_ENOMEM;
    int32_t im = tok_strmap_get(&t->vocab, tmp->p, tmp->n);
    if (im < 0) {
        tok_set_err(err, err_len, "model.merges[%u]: merged token \"%.64s\" is not in model.vocab", rank, tmp->p);
        return TOK_EFORMAT;
    }
    return tok_mergemap_put(&t->merges, ia, ib, rank, im);
}

static int parse_merges(Tokenizer *t, json_t *merges, char *err, size_t err_len) {
    if (!json_is_array(merges)) {
        tok_set_err(err, err_len, "model.merges: expected an array");
        return TOK_EFORMAT;
    }
    TokBuf tmp = {0};
    uint32_t rank = 0;
    int rc = 0;
    size_t i;
    json_t *m;
    json_array_foreach(merges, i, m) {
        if (json_is_string(m)) {   // legacy "a b" form; "#version" lines are comments
            const char *s = json_string_value(m);
            size_t n = json_string_length(m);
            if (n >= 8 && memcmp(s, "#version", 8) == 0) continue;
            const char *sp = memchr(s, ' ', n);
            if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s))) {
                tok_set_err(err, err_len, "model.merges[%zu]: \"%.64s\" is not two tokens separated by one space", i, s);
                rc = TOK_EFORMAT;
                break;
            }
            rc = add_merge(t, s, (size_t)(sp - s), sp + 1, n - (size_t)(sp + 1 - s), rank, &tmp, err, err_len);
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            json_t *a = json_array_get(m, 0), *b = json_array_get(m, 1);
            rc = add_merge(t, json_string_value(a), json_string_length(a), json_string_value(b), json_string_length(b),
                           rank, &tmp, err, err_len);
        } else {
            tok_set_err(err, err_len, "model.merges[%zu]: expected \"a b\" or [\"a\", \"b\"]", i);
            rc = TOK_EFORMAT;
        }
        if (rc) break;
        rank++;
    }
    tok_buf_free(&tmp);
    return rc;
}

static int parse_model(Tokenizer *t, const JsonAt *root, int32_t *max_id, char *err, size_t err_len) {
    JsonAt model;
    if (json_get_object(root, "model", JSON_GET_REQUIRED, &model)) return TOK_EFORMAT;
    json_t *type = json_object_get(model.json, "type");
    if (type && !(json_is_string(type) && strcmp(json_string_value(type), "BPE") == 0)) {
        tok_set_err(err, err_len, "model.type: \"%s\" is not supported (only BPE)",
                    json_is_string(type) ? json_string_value(type) : "(not a string)");
        return TOK_EFORMAT;
    }
    double dropout;
    int rc;
    if ((rc = json_get_double(&model, "dropout", JSON_GET_OPTIONAL, 0.0, 0.0, 1.0, &dropout))) return rc;
    if (dropout > 0) {
        tok_set_err(err, err_len, "model.dropout: %g is not supported (BPE dropout makes encoding random)", dropout);
        return TOK_EFORMAT;
    }
    if ((rc = get_string_copy(&model, "unk_token", &t->unk_token, NULL)) ||
        (rc = get_string_copy(&model, "continuing_subword_prefix", &t->cont_prefix, &t->cont_prefix_len)) ||
        (rc = get_string_copy(&model, "end_of_word_suffix", &t->eow_suffix, &t->eow_suffix_len)) ||
        (rc = json_get_bool(&model, "fuse_unk", JSON_GET_OPTIONAL, 0, &t->fuse_unk)) ||
        (rc = json_get_bool(&model, "byte_fallback", JSON_GET_OPTIONAL, 0, &t->byte_fallback)) ||
        (rc = json_get_bool(&model, "ignore_merges", JSON_GET_OPTIONAL, 0, &t->ignore_merges)))
        return rc;
    json_t *vocab = json_object_get(model.json, "vocab"), *merges = json_object_get(model.json, "merges");
    if (!vocab || !merges) {
        tok_set_err(err, err_len, "model: missing %s", !vocab ? "vocab" : "merges");
        return TOK_EFORMAT;
    }
    if ((rc = parse_vocab(t, vocab, max_id, err, err_len))) return rc;
    if ((rc = parse_merges(t, merges, err, err_len))) return rc;
    t->unk_id = t->unk_token ? tok_strmap_get(&t->vocab, t->unk_token, strlen(t->unk_token)) : -1;
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        t->byte_token[b] = tok_strmap_get(&t->vocab, name, 6);
    }
    return 0;
}

// AddedVocabulary::add_tokens: ids come from the vocab when the content is known, else are appended.
static int parse_added(Tokenizer *t, const JsonAt *root, int32_t *max_id, char *err, size_t err_len) {
    JsonAt arr;
    int rc;
    if ((rc = json_get_array(root, "added_tokens", JSON_GET_OPTIONAL, &arr)) || !arr.json) return rc;
    t->added = calloc(json_array_size(arr.json) + 1, sizeof(TokAddedToken));
    if (!t->added) return TOK_ENOMEM;
    int32_t next_id = t->model_vocab_size;
    for (size_t i = 0; i < json_array_size(arr.json); i++) {
        JsonAt entry;
        const char *content;
        size_t n;
        TokAddedToken tk = {0};
        int special;
        const JsonAt element = json_at_element(&arr, i);
        if ((rc = json_get_object(&element, NULL, JSON_GET_REQUIRED, &entry)) ||
            (rc = json_get_string(&entry, "content", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &content, &n)) ||
            (rc = json_get_bool(&entry, "special", JSON_GET_OPTIONAL, 0, &special)) ||
            (rc = json_get_bool(&entry, "single_word", JSON_GET_OPTIONAL, 0, &tk.single_word)) ||
            (rc = json_get_bool(&entry, "lstrip", JSON_GET_OPTIONAL, 0, &tk.lstrip)) ||
            (rc = json_get_bool(&entry, "rstrip", JSON_GET_OPTIONAL, 0, &tk.rstrip)) ||
            (rc = json_get_bool(&entry, "normalized", JSON_GET_OPTIONAL, !special, &tk.normalized)))
            return rc;
        tk.special = special;
        if (n == 0) continue;   // HF ignores empty tokens
        int32_t id = tok_strmap_get(&t->added_map, content, n);
        int32_t existing = -1;
        for (size_t k = 0; id >= 0 && k < t->n_added; k++)
            if (t->added[k].id == id) existing = (int32_t)k;
        if (id < 0) id = tok_strmap_get(&t->vocab, content, n);
        if (id < 0) id = next_id++;
        if (id > MAX_TOKEN_ID) return json_get_fail(&entry, NULL, "gets id %d, which is too large", id);
        TokAddedToken *dst;
        if (existing >= 0) {   // same content again: the later flags win, the id and the string stay
            dst = &t->added[existing];
            tk.content = dst->content;
        } else {
            dst = &t->added[t->n_added++];
            tk.content = dup_bytes(content, n);
            if (!tk.content) { t->n_added--; return TOK_ENOMEM; }
        }
        tk.len = n;
        tk.norm = tk.content;
        tk.norm_len = n;
        tk.id = id;
        *dst = tk;
        if (tok_strmap_put(&t->added_map, dst->content, (uint32_t)n, id)) return TOK_ENOMEM;
        if (tk.special && tok_strmap_put(&t->special_set, dst->content, (uint32_t)n, id)) return TOK_ENOMEM;
        if (id > *max_id) *max_id = id;
    }
    return 0;
}

// Added tokens flagged normalized are matched, and decoded, in their normalized form.
static int normalize_added(Tokenizer *t, char *err, size_t err_len) {
    if (t->n_norm == 0) return 0;
    TokRegexScratch rs;
    if (tok_regex_scratch_init(&rs)) return TOK_ENOMEM;
    TokBuf b = {0};
    int rc = 0;
    for (size_t k = 0; k < t->n_added && !rc; k++) {
        TokAddedToken *a = &t->added[k];
        if (!a->normalized) continue;
        rc = tok_normalize(t, a->content, a->len, &b, &rs, err, err_len);
        if (rc || (b.n == a->len && memcmp(b.p, a->content, b.n) == 0)) continue;
        a->norm = dup_bytes(b.p, b.n);
        if (!a->norm) { a->norm = a->content; rc = TOK_ENOMEM; }
        a->norm_len = b.n;
    }
    tok_buf_free(&b);
    tok_regex_scratch_free(&rs);
    return rc;
}

static int build_id_table(Tokenizer *t, int32_t max_id) {
    t->n_ids = max_id + 1;
    t->id_str = calloc((size_t)t->n_ids, sizeof(char *));
    t->id_len = calloc((size_t)t->n_ids, sizeof(uint32_t));
    t->id_flags = calloc((size_t)t->n_ids, 1);
    t->char_id = malloc(TOK_CHAR_TABLE * sizeof(int32_t));
    if (!t->id_str || !t->id_len || !t->id_flags || !t->char_id) return TOK_ENOMEM;
    for (int i = 0; i < TOK_CHAR_TABLE; i++) t->char_id[i] = -1;
    for (uint32_t i = 0; i < t->vocab.n; i++) {
        const TokStrEntry *e = &t->vocab.e[i];
        if (!t->id_str[e->val]) { t->id_str[e->val] = e->key; t->id_len[e->val] = e->len; }
        uint32_t cp;
        if (e->len > 0 && (size_t)tok_utf8_decode(e->key, e->len, &cp) == e->len && cp < TOK_CHAR_TABLE)
            t->char_id[cp] = e->val;
    }
    for (size_t k = 0; k < t->n_added; k++) {
        const TokAddedToken *a = &t->added[k];
        t->id_str[a->id] = a->norm;
        t->id_len[a->id] = (uint32_t)a->norm_len;
        t->id_flags[a->id] = (uint8_t)(1 | (a->special ? 2 : 0));
    }
    return 0;
}

static int load_from_json(Tokenizer **out, json_t *root, const char *dir, int nul_keys, char *err, size_t err_len) {
    if (!json_is_object(root)) {
        tok_set_err(err, err_len, "tokenizer.json: top level is not an object");
        return TOK_EFORMAT;
    }
    json_t *ver = json_object_get(root, "version");
    if (ver && !(json_is_string(ver) && strcmp(json_string_value(ver), "1.0") == 0)) {
        tok_set_err(err, err_len, "version: unknown tokenizer.json version (expected \"1.0\")");
        return TOK_EFORMAT;
    }
    // Members read through shared/json_get.h: messages name their path ("model.byte_fallback"); null is absent.
    const JsonAt at = json_at_document(root, NULL, 1, TOK_EFORMAT, err, err_len);
    Tokenizer *t = calloc(1, sizeof(Tokenizer));
    if (!t) return TOK_ENOMEM;
    t->unk_id = t->bos_id = t->pad_id = -1;
    t->add_bos_token = -1;
    t->nul_keys = nul_keys;
    int32_t max_id = -1;
    json_t *post = json_object_get(root, "post_processor");
    int rc = tok_cache_init(t);
    if (!rc) rc = parse_model(t, &at, &max_id, err, err_len);
    if (!rc) rc = tok_parse_normalizer(t, json_object_get(root, "normalizer"), err, err_len);
    if (!rc) rc = tok_parse_pre_tokenizer(t, json_object_get(root, "pre_tokenizer"), err, err_len);
    if (!rc) rc = tok_parse_decoder(t, json_object_get(root, "decoder"), err, err_len);
    if (!rc) rc = parse_added(t, &at, &max_id, err, err_len);
    if (!rc) rc = normalize_added(t, err, err_len);
    if (!rc) rc = tok_parse_post_processor(t, post, err, err_len);
    if (!rc) rc = build_id_table(t, max_id);
    if (!rc) rc = tok_stream_prepare(t);
    if (!rc) rc = tok_trie_build(&t->trie_raw, t, 0);
    if (!rc) rc = tok_trie_build(&t->trie_norm, t, 1);
    if (!rc && dir) rc = tok_load_configs(t, dir, err, err_len);
    if (rc) {
        if (rc == TOK_ENOMEM) tok_set_err(err, err_len, "tokenizer: out of memory while loading");
        tokenizer_free(t);
        return rc;
    }
    *out = t;
    return 0;
}

// Parses tokenizer.json text (modified in place by the key respelling above).
static int load_text(Tokenizer **out, char *text, size_t len, const char *name, const char *dir, char *err,
                     size_t err_len) {
    int nul_keys = memmem(text, len, "\\u0000", 6) ? escape_nul_keys(text, len) : 0;
    if (nul_keys < 0) {
        tok_set_err(err, err_len, "%s: a key holds both U+0000 and U+FDD0, which tandem cannot tell apart", name);
        return TOK_EFORMAT;
    }
    json_error_t je;
    json_t *root = json_read_buffer(text, len, JSON_ALLOW_NUL, &je);
    if (!root) {
        tok_set_err(err, err_len, "%s: invalid JSON at line %d column %d: %s", name, je.line, je.column, je.text);
        return TOK_EFORMAT;
    }
    int rc = load_from_json(out, root, dir, nul_keys, err, err_len);
    json_decref(root);
    return rc;
}

int tokenizer_load_json(Tokenizer **out, const char *json, size_t len, char *err, size_t err_len) {
    if (!out || (!json && len)) { tok_set_err(err, err_len, "tokenizer_load_json: NULL argument"); return TOK_EINVAL; }
    *out = NULL;
    char *copy = dup_bytes(json ? json : "", len);
    if (!copy) { tok_set_err(err, err_len, "tokenizer_load_json: out of memory"); return TOK_ENOMEM; }
    int rc = load_text(out, copy, len, "tokenizer.json", NULL, err, err_len);
    free(copy);
    return rc;
}

int tokenizer_load(Tokenizer **out, const char *path, char *err, size_t err_len) {
    if (!out || !path) { tok_set_err(err, err_len, "tokenizer_load: NULL argument"); return TOK_EINVAL; }
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0) {
        tok_set_err(err, err_len, "%s: %s", path, strerror(errno));
        return TOK_EIO;
    }
    char *file = NULL, *dir = NULL;
    size_t pl = strlen(path);
    if (S_ISDIR(st.st_mode)) {
        file = malloc(pl + 16);
        dir = dup_bytes(path, pl);
        if (file) snprintf(file, pl + 16, "%s/tokenizer.json", path);
    } else {
        file = dup_bytes(path, pl);
    }
    if (!file || (S_ISDIR(st.st_mode) && !dir)) { free(file); free(dir); return TOK_ENOMEM; }
    size_t len = 0;
    char *text = tok_read_file(file, &len);
    int rc;
    if (!text) {
        tok_set_err(err, err_len, "%s: cannot read: %s", file, strerror(errno));
        rc = TOK_EIO;
    } else {
        rc = load_text(out, text, len, file, dir, err, err_len);
    }
    free(text);
    free(file);
    free(dir);
    return rc;
}

void tokenizer_free(Tokenizer *t) {
    if (!t) return;
    tok_strmap_free(&t->vocab);
    free(t->vocab_keys);
    tok_mergemap_free(&t->merges);
    free(t->unk_token);
    free(t->cont_prefix);
    free(t->eow_suffix);
    free(t->char_id);
    free(t->id_str);
    free(t->id_len);
    free(t->id_flags);
    free(t->stream_bytes);
    free(t->stream_off);
    for (size_t k = 0; k < t->n_added; k++) {
        if (t->added[k].norm != t->added[k].content) free(t->added[k].norm);
        free(t->added[k].content);
    }
    free(t->added);
    tok_strmap_free(&t->added_map);
    tok_strmap_free(&t->special_set);
    tok_trie_free(&t->trie_raw);
    tok_trie_free(&t->trie_norm);
    tok_free_pipeline(t);
    tok_free_configs(t);
    tok_cache_free(t);
    free(t);
}

// ---- vocabulary queries ---------------------------------------------------------------------------

int32_t tokenizer_vocab_size(const Tokenizer *t) { return t ? t->n_ids : 0; }

int32_t tokenizer_token_to_id(const Tokenizer *t, const char *token, size_t len) {
    if (!t || !token) return -1;
    int32_t id = tok_strmap_get(&t->added_map, token, len);
    return id >= 0 ? id : tok_strmap_get(&t->vocab, token, len);
}

const char *tokenizer_id_to_token(const Tokenizer *t, int32_t id, size_t *len) {
    if (!t || id < 0 || id >= t->n_ids || !t->id_str[id]) return NULL;
    if (len) *len = t->id_len[id];
    return t->id_str[id];
}

int tokenizer_is_special(const Tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->n_ids && (t->id_flags[id] & 2) != 0;
}
