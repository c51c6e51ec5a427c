// shared/json_get.c — typed reads of JSON members with messages that name the member's path (see json_get.h).
#include "shared/json_get.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "shared/err.h"

#define FULL_PATH_MAX (2 * JSON_AT_PATH_MAX)
#define PREDICATE_MAX 512

const char *json_kind_name(const json_t *value) {
    if (!value) return "nothing";
    switch (json_typeof(value)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

// dst = base, then name joined as json_at_value says; a path longer than cap - 1 bytes is cut and ends in "...".
static void join_path(char *dst, size_t cap, const char *base, const char *name) {
    const char *sep = (base[0] && name[0] && name[0] != '[') ? "." : "";
    if (snprintf(dst, cap, "%s%s%s", base, sep, name) >= (int)cap && cap > 3) memcpy(dst + cap - 4, "...", 4);
}

JsonAt json_at_document(const json_t *json, const char *doc, int null_is_absent, int fail_code, char *err,
                        size_t err_len) {
    JsonAt at;
    memset(&at, 0, sizeof at);
    at.json = json;
    at.doc = doc;
    at.null_is_absent = null_is_absent;
    at.fail_code = fail_code ? fail_code : -1;
    at.err = err;
    at.err_len = err_len;
    return at;
}

JsonAt json_at_value(const JsonAt *parent, const json_t *value, const char *name) {
    JsonAt at = *parent;
    at.json = value;
    join_path(at.path, sizeof at.path, parent->path, name ? name : "");
    return at;
}

JsonAt json_at_element(const JsonAt *array, size_t index) {
    char name[32];
    snprintf(name, sizeof name, "[%zu]", index);
    return json_at_value(array, json_is_array(array->json) ? json_array_get(array->json, index) : NULL, name);
}

// How the value at `path` is named in a message: `field "a.b"[2]` (trailing indexes outside the quotes; `'a.b'[2]`
// with request_wording), `element [2]` when the path is only indexes, "the top level" when it is empty.
static void subject_of(const char *path, int request_wording, char *out, size_t cap) {
    size_t n = strlen(path), name_end = n;
    while (name_end > 0 && path[name_end - 1] == ']') {
        size_t open = name_end - 1;
        while (open > 0 && path[open - 1] >= '0' && path[open - 1] <= '9') open--;
        if (open == 0 || path[open - 1] != '[' || open == name_end - 1) break;
        name_end = open - 1;
    }
    if (n == 0)
        snprintf(out, cap, "the top level");
    else if (name_end == 0)
        snprintf(out, cap, "element %s", path);
    else if (request_wording)
        snprintf(out, cap, "'%.*s'%s", (int)name_end, path, path + name_end);
    else
        snprintf(out, cap, "field \"%.*s\"%s", (int)name_end, path, path + name_end);
}

// The message's start: "<doc>: " (nothing without a document name) in doc, the value's name in subject.
static void describe(const JsonAt *at, const char *key, const char **doc, const char **colon, char *subject,
                     size_t cap) {
    char path[FULL_PATH_MAX];
    join_path(path, sizeof path, at->path, key ? key : "");
    subject_of(path, at->request_wording, subject, cap);
    const int has_doc = at->doc && at->doc[0];
    *doc = has_doc ? at->doc : "";
    *colon = has_doc ? ": " : "";
}

int json_get_fail(const JsonAt *at, const char *key, const char *fmt, ...) {
    const char *doc, *colon;
    char subject[FULL_PATH_MAX + 32], predicate[PREDICATE_MAX];
    describe(at, key, &doc, &colon, subject, sizeof subject);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(predicate, sizeof predicate, fmt, ap);
    va_end(ap);
    return err_fail_code(at->fail_code, at->err, at->err_len, "%s%s%s %s", doc, colon, subject, predicate);
}

static int fail_missing(const JsonAt *at, const char *key) {
    const char *doc, *colon;
    char subject[FULL_PATH_MAX + 32];
    describe(at, key, &doc, &colon, subject, sizeof subject);
    if (at->request_wording)
        return err_fail_code(at->fail_code, at->err, at->err_len, "%s%s%s is required", doc, colon, subject);
    return err_fail_code(at->fail_code, at->err, at->err_len, "%s%smissing %s", doc, colon, subject);
}

// "must be an integer, got a string"; with request_wording "must be an integer, not a string".
static int wrong_type(const JsonAt *at, const char *key, const char *want, const json_t *v) {
    return json_get_fail(at, key, at->request_wording ? "must be %s, not %s" : "must be %s, got %s", want,
                         json_kind_name(v));
}

// "is 5000, outside [1, 4096]"; with request_wording "must be in [1, 4096], got 5000". value is printed already.
static int out_of_range(const JsonAt *at, const char *key, const char *value, const char *min, const char *max) {
    if (at->request_wording) return json_get_fail(at, key, "must be in [%s, %s], got %s", min, max, value);
    return json_get_fail(at, key, "is %s, outside [%s, %s]", value, min, max);
}

// "true or false"; with request_wording "a boolean".
static const char *bool_want(const JsonAt *at) { return at->request_wording ? "a boolean" : "true or false"; }

static const json_t *raw_member(const JsonAt *at, const char *key) {
    if (!key) return at->json;
    return json_is_object(at->json) ? json_object_get(at->json, key) : NULL;
}

int json_get_present(const JsonAt *at, const char *key) {
    const json_t *v = raw_member(at, key);
    return v && !(json_is_null(v) && at->null_is_absent);
}

// The member to check in *v, NULL when it is absent and optional (the caller then stores its default). A required
// member that is absent is missing; one that is null is of the wrong type (`want` says what it must be).
static int lookup(const JsonAt *at, const char *key, JsonPresence presence, const char *want, const json_t **v) {
    *v = raw_member(at, key);
    if (*v && json_is_null(*v) && at->null_is_absent) {
        if (presence == JSON_GET_REQUIRED) return wrong_type(at, key, want, *v);
        *v = NULL;
    }
    if (!*v && presence == JSON_GET_REQUIRED) return fail_missing(at, key);
    return 0;
}

int json_get_int64(const JsonAt *at, const char *key, JsonPresence presence, int64_t default_value, int64_t min,
                   int64_t max, int64_t *out) {
    const json_t *v;
    int rc = lookup(at, key, presence, "an integer", &v);
    if (rc) return rc;
    if (!v) {
        *out = default_value;
        return 0;
    }
    char value[32], lo[24], hi[24];
    snprintf(lo, sizeof lo, "%lld", (long long)min);
    snprintf(hi, sizeof hi, "%lld", (long long)max);
    const double r = json_is_real(v) ? json_real_value(v) : 0;
    // An integer beyond int64 arrives as a real (shared/json_read.h): out of range, not of the wrong type.
    if (json_is_real(v) && fabs(r) >= 0x1p63) {
        snprintf(value, sizeof value, "%.17g", r);
        return out_of_range(at, key, value, lo, hi);
    }
    const int whole_real = at->integral_reals && json_is_real(v) && r == floor(r);
    if (!json_is_integer(v) && !whole_real) return wrong_type(at, key, "an integer", v);
    const int64_t x = whole_real ? (int64_t)r : (int64_t)json_integer_value(v);
    if (x < min || x > max) {
        snprintf(value, sizeof value, "%lld", (long long)x);
        return out_of_range(at, key, value, lo, hi);
    }
    *out = x;
    return 0;
}

int json_get_int(const JsonAt *at, const char *key, JsonPresence presence, int default_value, int min, int max,
                 int *out) {
    int64_t x = 0;
    int rc = json_get_int64(at, key, presence, default_value, min, max, &x);
    if (rc == 0) *out = (int)x;
    return rc;
}

int json_get_double(const JsonAt *at, const char *key, JsonPresence presence, double default_value, double min,
                    double max, double *out) {
    const json_t *v;
    int rc = lookup(at, key, presence, "a number", &v);
    if (rc) return rc;
    if (!v) {
        *out = default_value;
        return 0;
    }
    if (!json_is_number(v)) return wrong_type(at, key, "a number", v);
    double x = json_number_value(v);
    if (!isfinite(x)) return json_get_fail(at, key, "must be %s", at->request_wording ? "a finite number" : "finite");
    if (!(x >= min && x <= max)) {
        char value[32], lo[32], hi[32];
        snprintf(value, sizeof value, "%g", x);
        snprintf(lo, sizeof lo, "%g", min);
        snprintf(hi, sizeof hi, "%g", max);
        return out_of_range(at, key, value, lo, hi);
    }
    *out = x;
    return 0;
}

int json_get_bool(const JsonAt *at, const char *key, JsonPresence presence, int default_value, int *out) {
    const json_t *v;
    int rc = lookup(at, key, presence, bool_want(at), &v);
    if (rc) return rc;
    if (!v) {
        *out = default_value;
        return 0;
    }
    if (!json_is_boolean(v)) return wrong_type(at, key, bool_want(at), v);
    *out = json_is_true(v);
    return 0;
}

int json_get_string(const JsonAt *at, const char *key, JsonPresence presence, const char *default_value,
                    size_t max_bytes, const char **out, size_t *len) {
    const json_t *v;
    int rc = lookup(at, key, presence, "a string", &v);
    if (rc) return rc;
    if (!v) {
        *out = default_value;
        if (len) *len = default_value ? strlen(default_value) : 0;
        return 0;
    }
    if (!json_is_string(v)) return wrong_type(at, key, "a string", v);
    size_t n = json_string_length(v);
    if (n > max_bytes) return json_get_fail(at, key, "is %zu bytes long, at most %zu allowed", n, max_bytes);
    *out = json_string_value(v);
    if (len) *len = n;
    return 0;
}

// An object or an array member (of JSON type `kind`) as a JsonAt for reading inside it.
static int get_container(const JsonAt *at, const char *key, JsonPresence presence, json_type kind, const char *want,
                         JsonAt *out) {
    const json_t *v;
    int rc = lookup(at, key, presence, want, &v);
    if (rc) return rc;
    if (v && json_typeof(v) != kind) return wrong_type(at, key, want, v);
    *out = json_at_value(at, v, key ? key : "");
    return 0;
}

int json_get_object(const JsonAt *at, const char *key, JsonPresence presence, JsonAt *out) {
    return get_container(at, key, presence, JSON_OBJECT, "an object", out);
}

int json_get_array(const JsonAt *at, const char *key, JsonPresence presence, JsonAt *out) {
    return get_container(at, key, presence, JSON_ARRAY, "an array", out);
}
