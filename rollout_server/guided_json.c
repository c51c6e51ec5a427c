// rollout_server/guided_json.c — a JSON schema as a regex (see guided_json.h).
#include "rollout_server/guided_json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/guided_regex.h"
#include "rollout_server/http_response.h"
#include "shared/err.h"

#define MAX_DEPTH 32

// One JSON string's characters: anything but '"', '\' and control characters, or an escape.
#define JSON_CHAR "(?:[^\"\\\\\\x00-\\x1f]|\\\\[\"\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4})"
#define JSON_INT "-?(?:0|[1-9][0-9]*)"
#define JSON_NUMBER JSON_INT "(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"

typedef struct {
    HttpBuf re;   // the regex so far
    char *err;
    size_t err_len;
    int failed;
} Out;

#define MAX_REGEX_BYTES ((size_t)1 << 18)

static void put(Out *o, const char *s, size_t n) {
    if (o->re.oom || o->failed) return;
    if (o->re.len + n > MAX_REGEX_BYTES) {
        o->failed = 1;
        snprintf(o->err, o->err_len, "json schema: its regex would be over %zu bytes (nested arrays repeat their item "
                 "schema): simplify the schema", MAX_REGEX_BYTES);
        return;
    }
    http_buf_append(&o->re, s, n);
}
static void puts_(Out *o, const char *s) { put(o, s, strlen(s)); }

static void fail(Out *o, const char *path, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(Out *o, const char *path, const char *fmt, ...) {
    if (o->failed) return;
    o->failed = 1;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    err_vset(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(o->err, o->err_len, "json schema at %s: %s", path[0] ? path : "the top", msg);
}

// A literal, escaped as guide_choice_regex escapes a choice.
static void put_literal(Out *o, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (guide_regex_escapes((unsigned char)s[i])) put(o, "\\", 1);
        put(o, s + i, 1);
    }
}

// A scalar JSON value written as json.dumps writes it (strings escaped, non-ASCII kept).
static int put_value_literal(Out *o, const json_t *v, const char *path) {
    if (!(json_is_string(v) || json_is_number(v) || json_is_boolean(v) || json_is_null(v))) {
        fail(o, path, "enum and const values must be strings, numbers, booleans or null");
        return -1;
    }
    char *text = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!text) {
        o->re.oom = 1;
        return -1;
    }
    put_literal(o, text, strlen(text));
    free(text);
    return 0;
}

static int known_annotation(const char *k) {
    static const char *const keys[] = {"title", "description", "default", "examples", "$schema", "$id", "$comment"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!strcmp(k, keys[i])) return 1;
    return 0;
}

static int get_count(Out *o, const json_t *s, const char *key, const char *path, long dflt, long *out) {
    const json_t *v = json_object_get(s, key);
    *out = dflt;
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 1000) {
        fail(o, path, "'%s' must be an integer in [0, 1000]", key);
        return -1;
    }
    *out = (long)json_integer_value(v);
    return 0;
}

// "{m,n}" (n < 0: unbounded) after the group just written.
static void put_repeat(Out *o, long m, long n) {
    char b[48];
    if (n < 0) snprintf(b, sizeof b, "{%ld,}", m);
    else snprintf(b, sizeof b, "{%ld,%ld}", m, n);
    puts_(o, b);
}

static void schema(Out *o, const json_t *s, const char *path, int depth);

static void type_regex(Out *o, const json_t *s, const char *type, const char *path, int depth) {
    if (!strcmp(type, "string")) {
        long lo, hi;
        if (get_count(o, s, "minLength", path, 0, &lo) || get_count(o, s, "maxLength", path, -1, &hi)) return;
        if (hi >= 0 && hi < lo) return fail(o, path, "maxLength is below minLength");
        puts_(o, "\"" JSON_CHAR);
        if (lo == 0 && hi < 0) puts_(o, "*");
        else put_repeat(o, lo, hi);
        puts_(o, "\"");
    } else if (!strcmp(type, "integer")) {
        puts_(o, JSON_INT);
    } else if (!strcmp(type, "number")) {
        puts_(o, JSON_NUMBER);
    } else if (!strcmp(type, "boolean")) {
        puts_(o, "(?:true|false)");
    } else if (!strcmp(type, "null")) {
        puts_(o, "null");
    } else if (!strcmp(type, "array")) {
        const json_t *items = json_object_get(s, "items");
        long lo, hi;
        if (get_count(o, s, "minItems", path, 0, &lo) || get_count(o, s, "maxItems", path, -1, &hi)) return;
        if (hi >= 0 && hi < lo) return fail(o, path, "maxItems is below minItems");
        if (!json_is_object(items)) return fail(o, path, "an array needs an 'items' schema (an object)");
        char sub[512];
        snprintf(sub, sizeof sub, "%s/items", path);
        // "[" item (", " item){lo-1,hi-1} "]", the whole list optional when lo is 0.
        const size_t start = o->re.len;
        schema(o, items, sub, depth + 1);
        if (o->failed || o->re.oom) return;
        const size_t item_len = o->re.len - start;
        char *item = malloc(item_len + 1);
        if (!item) {
            o->re.oom = 1;
            return;
        }
        memcpy(item, o->re.data + start, item_len);
        o->re.len = start;
        puts_(o, "\\[");
        if (hi != 0) {
            if (lo == 0) puts_(o, "(?:");
            puts_(o, "(?:");
            put(o, item, item_len);
            puts_(o, ")(?:, (?:");
            put(o, item, item_len);
            puts_(o, "))");
            put_repeat(o, lo > 0 ? lo - 1 : 0, hi < 0 ? -1 : hi - 1);
            if (lo == 0) puts_(o, ")?");
        }
        puts_(o, "\\]");
        free(item);
    } else if (!strcmp(type, "object")) {
        const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
        if (props && !json_is_object(props)) return fail(o, path, "'properties' must be an object");
        if (req && !json_is_array(req)) return fail(o, path, "'required' must be a list of names");
        for (size_t i = 0; req && i < json_array_size(req); i++) {
            const json_t *name = json_array_get(req, i);
            if (!json_is_string(name) || !json_object_get(props, json_string_value(name)))
                return fail(o, path, "required property %zu is not among 'properties'", i);
        }
        puts_(o, "\\{");
        const char *key;
        const json_t *val;
        int first = 1;
        json_object_foreach((json_t *)props, key, val) {
            if (!first) puts_(o, ", ");
            first = 0;
            json_t *name = json_string(key);
            if (!name) {
                o->re.oom = 1;
                return;
            }
            put_value_literal(o, name, path);
            json_decref(name);
            puts_(o, ": ");
            char sub[512];
            snprintf(sub, sizeof sub, "%s/properties/%s", path, key);
            schema(o, val, sub, depth + 1);
        }
        puts_(o, "\\}");
    } else {
        fail(o, path, "type '%s' is not a JSON schema type", type);
    }
}

static void schema(Out *o, const json_t *s, const char *path, int depth) {
    if (o->failed || o->re.oom) return;
    if (depth > MAX_DEPTH) return fail(o, path, "nested more than %d levels", MAX_DEPTH);
    if (!json_is_object(s)) return fail(o, path, "a schema must be an object");
    static const char *const handled[] = {"type", "properties", "required", "additionalProperties", "items",
                                          "minItems", "maxItems", "minLength", "maxLength", "enum", "const", "anyOf"};
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)s, key, val) {
        int ok = known_annotation(key);
        for (size_t i = 0; i < sizeof handled / sizeof handled[0] && !ok; i++) ok = !strcmp(key, handled[i]);
        if (!ok) return fail(o, path, "the keyword '%s' is not supported by structured outputs", key);
    }
    const json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const"),
                 *any = json_object_get(s, "anyOf"), *type = json_object_get(s, "type");
    if (cn || en) {
        if (en && (!json_is_array(en) || json_array_size(en) == 0)) return fail(o, path, "'enum' must be a non-empty list");
        puts_(o, "(?:");
        for (size_t i = 0; i < (cn ? 1 : json_array_size(en)); i++) {
            if (i) puts_(o, "|");
            if (put_value_literal(o, cn ? cn : json_array_get(en, i), path) != 0) return;
        }
        puts_(o, ")");
        return;
    }
    if (any) {
        if (!json_is_array(any) || json_array_size(any) == 0) return fail(o, path, "'anyOf' must be a non-empty list");
        if (type) return fail(o, path, "'anyOf' beside 'type' is not supported (move the type into each choice)");
        puts_(o, "(?:");
        for (size_t i = 0; i < json_array_size(any); i++) {
            char sub[512];
            snprintf(sub, sizeof sub, "%s/anyOf/%zu", path, i);
            if (i) puts_(o, "|");
            schema(o, json_array_get(any, i), sub, depth + 1);
        }
        puts_(o, ")");
        return;
    }
    if (json_is_string(type)) return type_regex(o, s, json_string_value(type), path, depth);
    if (json_is_array(type) && json_array_size(type) > 0) {
        puts_(o, "(?:");
        for (size_t i = 0; i < json_array_size(type); i++) {
            const json_t *t = json_array_get(type, i);
            if (!json_is_string(t)) return fail(o, path, "'type' entries must be strings");
            const char *name = json_string_value(t);
            if (!strcmp(name, "object") || !strcmp(name, "array"))
                return fail(o, path, "a list of types may hold scalar types only (use anyOf)");
            if (i) puts_(o, "|");
            type_regex(o, s, name, path, depth);
        }
        puts_(o, ")");
        return;
    }
    fail(o, path, "a schema needs 'type', 'enum', 'const' or 'anyOf'");
}

char *guide_json_schema_regex(const json_t *s, size_t *len, char *err, size_t err_len) {
    Out o = {.err = err, .err_len = err_len};
    schema(&o, s, "", 0);
    if (o.re.oom && !o.failed) snprintf(err, err_len, "out of memory turning the json schema into a regex");
    if (o.failed || o.re.oom) {
        http_buf_free(&o.re);
        return NULL;
    }
    *len = o.re.len;
    return o.re.data;
}
