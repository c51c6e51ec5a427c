// shared/tokenizer/tokenizer_config.c — tokenizer_config.json and generation_config.json: special token ids,
// add_bos_token, chat template.
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/tokenizer_internal.h"
#include "shared/json_read.h"

// A special token in tokenizer_config.json: "text" or {"content": "text", ...} (an AddedToken dict).
static int token_string(json_t *cfg, const char *key, char **out, char *err, size_t err_len) {
    json_t *v = json_object_get(cfg, key);
    *out = NULL;
    if (!v || json_is_null(v)) return 0;
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!json_is_string(v)) {
        tok_set_err(err, err_len, "tokenizer_config.json: %s: expected a string or {\"content\": ...}", key);
        return TOK_EFORMAT;
    }
    *out = malloc(json_string_length(v) + 1);
    if (!*out) return TOK_ENOMEM;
    memcpy(*out, json_string_value(v), json_string_length(v) + 1);
    return 0;
}

static int push_eos(Tokenizer *t, int32_t id) {
    for (size_t i = 0; i < t->n_eos; i++)
        if (t->eos_ids[i] == id) return 0;
    int32_t *p = realloc(t->eos_ids, (t->n_eos + 1) * sizeof(int32_t));
    if (!p) return TOK_ENOMEM;
    t->eos_ids = p;
    t->eos_ids[t->n_eos++] = id;
    return 0;
}

static int id_field(json_t *g, const char *key, int32_t *out, char *err, size_t err_len) {
    json_t *v = json_object_get(g, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
        tok_set_err(err, err_len, "generation_config.json: %s: expected a token id", key);
        return TOK_EFORMAT;
    }
    *out = (int32_t)json_integer_value(v);
    return 0;
}

static int load_generation_config(Tokenizer *t, const char *dir, char *err, size_t err_len) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/generation_config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;   // optional file
    fclose(f);
    json_error_t je;
    json_t *g = json_read_file(path, 0, &je);
    if (!json_is_object(g)) {
        tok_set_err(err, err_len, "%s: invalid JSON at line %d: %s", path, je.line, je.text);
        json_decref(g);
        return TOK_EFORMAT;
    }
    int rc = 0;
    int32_t bos = -1, pad = -1;
    if ((rc = id_field(g, "bos_token_id", &bos, err, err_len)) || (rc = id_field(g, "pad_token_id", &pad, err, err_len)))
        goto out;
    if (t->bos_id < 0) t->bos_id = bos;
    if (t->pad_id < 0) t->pad_id = pad;
    json_t *eos = json_object_get(g, "eos_token_id");
    if (json_is_array(eos)) {
        size_t i;
        json_t *v;
        json_array_foreach(eos, i, v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
                tok_set_err(err, err_len, "generation_config.json: eos_token_id[%zu]: expected a token id", i);
                rc = TOK_EFORMAT;
                goto out;
            }
            if ((rc = push_eos(t, (int32_t)json_integer_value(v)))) goto out;
        }
    } else if (eos && !json_is_null(eos)) {
        int32_t id = -1;
        if ((rc = id_field(g, "eos_token_id", &id, err, err_len))) goto out;
        rc = push_eos(t, id);
    }
out:
    json_decref(g);
    return rc;
}

int tok_load_configs(Tokenizer *t, const char *dir, char *err, size_t err_len) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
    json_t *cfg = NULL;
    FILE *f = fopen(path, "rb");
    int rc = 0;
    int32_t eos_from_cfg = -1;
    if (f) {
        fclose(f);
        json_error_t je;
        cfg = json_read_file(path, JSON_ALLOW_NUL, &je);
        if (!json_is_object(cfg)) {
            tok_set_err(err, err_len, "%s: invalid JSON at line %d: %s", path, je.line, je.text);
            json_decref(cfg);
            return TOK_EFORMAT;
        }
        char *pad = NULL;
        if ((rc = token_string(cfg, "bos_token", &t->bos_token, err, err_len)) ||
            (rc = token_string(cfg, "eos_token", &t->eos_token, err, err_len)) ||
            (rc = token_string(cfg, "pad_token", &pad, err, err_len)))
            goto out;
        if (t->bos_token) t->bos_id = tokenizer_token_to_id(t, t->bos_token, strlen(t->bos_token));
        if (t->eos_token) eos_from_cfg = tokenizer_token_to_id(t, t->eos_token, strlen(t->eos_token));
        if (pad) t->pad_id = tokenizer_token_to_id(t, pad, strlen(pad));
        free(pad);
        json_t *ab = json_object_get(cfg, "add_bos_token"), *ae = json_object_get(cfg, "add_eos_token");
        if (ab && !json_is_null(ab) && !json_is_boolean(ab)) {
            tok_set_err(err, err_len, "tokenizer_config.json: add_bos_token: expected true/false");
            rc = TOK_EFORMAT;
            goto out;
        }
        if (ae && !json_is_null(ae) && !json_is_boolean(ae)) {
            tok_set_err(err, err_len, "tokenizer_config.json: add_eos_token: expected true/false");
            rc = TOK_EFORMAT;
            goto out;
        }
        // Reported to callers only: as in transformers 5, tokenizer.json's post-processor alone decides
        // what encode(add_special_tokens=True) adds.
        if (json_is_boolean(ab)) t->add_bos_token = json_is_true(ab);
        json_t *ct = json_object_get(cfg, "chat_template");
        if (json_is_array(ct)) {   // [{"name": "default", "template": "..."}, ...]: the default one
            size_t i;
            json_t *e;
            json_array_foreach(ct, i, e) {
                json_t *nm = json_object_get(e, "name");
                if (json_is_string(nm) && strcmp(json_string_value(nm), "default") == 0) {
                    ct = json_object_get(e, "template");
                    break;
                }
            }
        }
        if (json_is_string(ct)) {
            t->chat_template = malloc(json_string_length(ct) + 1);
            if (!t->chat_template) { rc = TOK_ENOMEM; goto out; }
            memcpy(t->chat_template, json_string_value(ct), json_string_length(ct) + 1);
        }
    }
    if (!t->chat_template) {   // transformers >= 4.47 writes the template to its own file
        size_t n = 0;
        snprintf(path, sizeof(path), "%s/chat_template.jinja", dir);
        t->chat_template = tok_read_file(path, &n);
    }
    rc = load_generation_config(t, dir, err, err_len);
    if (!rc && eos_from_cfg >= 0) rc = push_eos(t, eos_from_cfg);
out:
    json_decref(cfg);
    return rc;
}

void tok_free_configs(Tokenizer *t) {
    free(t->eos_ids);
    free(t->bos_token);
    free(t->eos_token);
    free(t->chat_template);
    t->eos_ids = NULL;
    t->n_eos = 0;
}

int32_t tokenizer_bos_id(const Tokenizer *t) { return t ? t->bos_id : -1; }
int32_t tokenizer_pad_id(const Tokenizer *t) { return t ? t->pad_id : -1; }
int32_t tokenizer_eos_id(const Tokenizer *t) { return t && t->n_eos ? t->eos_ids[0] : -1; }

size_t tokenizer_eos_ids(const Tokenizer *t, int32_t *ids, size_t cap) {
    if (!t) return 0;
    for (size_t i = 0; ids && i < t->n_eos && i < cap; i++) ids[i] = t->eos_ids[i];
    return t->n_eos;
}

int tokenizer_is_eos(const Tokenizer *t, int32_t id) {
    for (size_t i = 0; t && i < t->n_eos; i++)
        if (t->eos_ids[i] == id) return 1;
    return 0;
}

int tokenizer_add_bos_token(const Tokenizer *t) { return t ? t->add_bos_token : -1; }
const char *tokenizer_bos_token(const Tokenizer *t) { return t && t->bos_token ? t->bos_token : ""; }
const char *tokenizer_eos_token(const Tokenizer *t) { return t && t->eos_token ? t->eos_token : ""; }
const char *tokenizer_chat_template(const Tokenizer *t) { return t ? t->chat_template : NULL; }
