// rollout_server/http_json.c — request parsing and validation for the HTTP API (see http_json.h).
#include "rollout_server/http_json.h"

#include <ctype.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/json_read.h"
#include "shared/tokenizer/tokenizer.h"

int http_error_set(HttpError *e, int status, const char *param, const char *fmt, ...) {
    if (!e) return -1;
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

const char *http_error_type(int status) {
    switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 405: return "method_not_allowed_error";
    case 408: return "request_timeout_error";
    case 413: return "request_too_large_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return status >= 500 ? "internal_server_error" : "invalid_request_error";
    }
}

// A JSON string of an error's text, which need not be valid UTF-8: a message may quote bytes of a body that is
// not valid JSON, and vsnprintf cuts a long one wherever its buffer ends, inside a character too. jansson
// refuses invalid UTF-8 (json_string gives NULL, and the key would be missing from the answer): invalid bytes
// become U+FFFD, as Python's bytes.decode(errors="replace") does.
static json_t *text_json(const char *s) {
    json_t *v = json_string(s);
    if (v) return v;
    size_t n = 0;
    char *fixed = tokenizer_utf8_repair(s, strlen(s), &n);
    v = fixed ? json_stringn(fixed, n) : NULL;
    free(fixed);
    return v ? v : json_string("(out of memory)");
}

json_t *http_error_json(const HttpError *e) {
    json_t *inner = json_object();
    json_object_set_new(inner, "message", text_json(e->message[0] ? e->message : "error"));
    json_object_set_new(inner, "type", json_string(http_error_type(e->status)));
    json_object_set_new(inner, "param", e->param[0] ? text_json(e->param) : json_null());
    json_object_set_new(inner, "code", json_integer(e->status));
    json_t *outer = json_object();
    json_object_set_new(outer, "error", inner);
    return outer;
}

char *http_error_body(const HttpError *e, size_t *len) {
    json_t *j = http_error_json(e);
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (s && len) *len = strlen(s);
    return s;
}

int http_status_for_engine(int code) {
    switch (code) {
    case ENGINE_EINVAL:
    case ENGINE_ETOOLONG: return 400;
    case ENGINE_EQUEUE_FULL: return 429;
    case ENGINE_ESHUTDOWN: return 503;
    default: return 500;
    }
}

// After a parse error at byte `pos`, finds the key whose value is the bad token ("key": NaN): skips the token
// backwards, then ':' and the quoted key. Writes "" when the shape is anything else (e.g. inside an array).
static void key_before(const char *s, size_t len, size_t pos, char *key, size_t key_cap) {
    key[0] = 0;
    if (pos > len) pos = len;
    size_t i = pos;
    while (i > 0 && (isalnum((unsigned char)s[i - 1]) || s[i - 1] == '-' || s[i - 1] == '+' || s[i - 1] == '.'))
        i--;
    while (i > 0 && (s[i - 1] == ' ' || s[i - 1] == '\t' || s[i - 1] == '\n' || s[i - 1] == '\r')) i--;
    if (i == 0 || s[i - 1] != ':') return;
    i--;
    while (i > 0 && (s[i - 1] == ' ' || s[i - 1] == '\t' || s[i - 1] == '\n' || s[i - 1] == '\r')) i--;
    if (i == 0 || s[i - 1] != '"') return;
    size_t end = i - 1, start = end;
    while (start > 0 && !(s[start - 1] == '"' && (start < 2 || s[start - 2] != '\\'))) start--;
    if (start == 0) return;
    size_t n = end - start;
    if (n >= key_cap) n = key_cap - 1;
    memcpy(key, s + start, n);
    key[n] = 0;
}

int http_body_parse(const char *body, size_t len, json_t **out, HttpError *err) {
    *out = NULL;
    if (!body || len == 0) return http_error_set(err, 400, NULL, "request body is empty: expected a JSON object");
    json_error_t je;
    json_t *j = json_read_buffer(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!j) {
        char key[64];
        size_t pos = je.position > 0 ? (size_t)je.position : 0;
        key_before(body, len, pos, key, sizeof key);
        // Numbers beyond a double are read as +-DBL_MAX (shared/json_read.h): only NaN / Infinity get here.
        int nonfinite = strstr(je.text, "NaN") || strstr(je.text, "Infinity") ||
                        (strstr(je.text, "near '-'") && pos < len && body[pos] == 'I');
        if (nonfinite && key[0])
            return http_error_set(err, 400, key, "'%s' must be a finite number (malformed JSON at byte %d: %s)", key,
                                  je.position, je.text);
        return http_error_set(err, 400, key[0] ? key : NULL, "malformed JSON at line %d column %d: %s", je.line,
                              je.column, je.text);
    }
    if (!json_is_object(j)) {
        json_decref(j);
        return http_error_set(err, 400, NULL, "request body must be a JSON object");
    }
    *out = j;
    return 0;
}

static const char *json_kind(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

// Readers taking a display name (the key with a prefix such as "generation_kwargs.").
static int get_bool_n(const json_t *obj, const char *key, const char *name, int *out, HttpError *err) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v))
        return http_error_set(err, 400, name, "'%s' must be a boolean, not %s", name, json_kind(v));
    *out = json_is_true(v);
    return 1;
}

static int get_int_n(const json_t *obj, const char *key, const char *name, int64_t min, int64_t max, int64_t *out,
                     HttpError *err) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return 0;
    int64_t x;
    if (json_is_integer(v)) {
        x = (int64_t)json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9.0e15) {
        x = (int64_t)json_real_value(v); // 4.0 is an integer to Python clients too
    } else if (json_is_real(v) && fabs(json_real_value(v)) >= 0x1p63) {
        // An integer beyond int64 arrives as a real (shared/json_read.h): out of range, not of the wrong type.
        return http_error_set(err, 400, name, "'%s' must be in [%lld, %lld], got %.17g", name, (long long)min,
                              (long long)max, json_real_value(v));
    } else {
        return http_error_set(err, 400, name, "'%s' must be an integer, not %s", name, json_kind(v));
    }
    if (x < min || x > max)
        return http_error_set(err, 400, name, "'%s' must be in [%lld, %lld], got %lld", name, (long long)min,
                              (long long)max, (long long)x);
    *out = x;
    return 1;
}

static int get_number_n(const json_t *obj, const char *key, const char *name, double *out, HttpError *err) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) return http_error_set(err, 400, name, "'%s' must be a number, not %s", name, json_kind(v));
    double x = json_number_value(v);
    if (!isfinite(x)) return http_error_set(err, 400, name, "'%s' must be a finite number", name);
    *out = x;
    return 1;
}

int http_get_bool(const json_t *obj, const char *key, int *out, HttpError *err) {
    return get_bool_n(obj, key, key, out, err);
}
int http_get_int(const json_t *obj, const char *key, int64_t min, int64_t max, int64_t *out, HttpError *err) {
    return get_int_n(obj, key, key, min, max, out, err);
}
int http_get_number(const json_t *obj, const char *key, double *out, HttpError *err) {
    return get_number_n(obj, key, key, out, err);
}
int http_get_string(const json_t *obj, const char *key, const char **out, size_t *len, HttpError *err) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v)) return http_error_set(err, 400, key, "'%s' must be a string, not %s", key, json_kind(v));
    *out = json_string_value(v);
    if (len) *len = json_string_length(v);
    return 1;
}

int http_parse_id_list(const json_t *val, const char *field, int vocab_size, int32_t **ids, int *n, HttpError *err) {
    *ids = NULL;
    *n = 0;
    if (!json_is_array(val))
        return http_error_set(err, 400, field, "'%s' must be a list of token ids, not %s", field, json_kind(val));
    size_t cnt = json_array_size(val);
    int32_t *a = malloc((cnt ? cnt : 1) * sizeof *a);
    if (!a) return http_error_set(err, 500, field, "out of memory reading '%s'", field);
    for (size_t i = 0; i < cnt; i++) {
        const json_t *x = json_array_get(val, i);
        if (!json_is_integer(x)) {
            free(a);
            return http_error_set(err, 400, field, "'%s'[%zu] must be an integer token id, not %s", field, i,
                                  json_kind(x));
        }
        json_int_t id = json_integer_value(x);
        if (id < 0 || id >= vocab_size) {
            free(a);
            return http_error_set(err, 400, field, "'%s'[%zu] = %lld is not a token id (vocabulary size %d)", field, i,
                                  (long long)id, vocab_size);
        }
        a[i] = (int32_t)id;
    }
    *ids = a;
    *n = (int)cnt;
    return 0;
}

void http_prompts_free(HttpPromptList *l) {
    if (!l) return;
    for (int i = 0; i < l->n; i++) free(l->items[i].ids);
    free(l->items);
    memset(l, 0, sizeof *l);
}

int http_parse_prompts(const json_t *val, const char *field, int vocab_size, int allow_single, HttpPromptList *out,
                       HttpError *err) {
    memset(out, 0, sizeof *out);
    if (!val || json_is_null(val)) return http_error_set(err, 400, field, "'%s' is required", field);
    if (json_is_string(val)) {
        if (!allow_single)
            return http_error_set(err, 400, field, "'%s' must be a list of texts or a list of token-id lists", field);
        if (json_string_length(val) == 0) return http_error_set(err, 400, field, "'%s' is empty", field);
        out->items = calloc(1, sizeof *out->items);
        if (!out->items) return http_error_set(err, 500, field, "out of memory");
        out->items[0].text = json_string_value(val);
        out->items[0].text_len = json_string_length(val);
        out->n = 1;
        return 0;
    }
    if (!json_is_array(val))
        return http_error_set(err, 400, field, "'%s' must be a string, a list of strings, a list of token ids or a "
                              "list of token-id lists, not %s", field, json_kind(val));
    size_t cnt = json_array_size(val);
    if (cnt == 0) return http_error_set(err, 400, field, "'%s' is empty", field);
    const json_t *first = json_array_get(val, 0);
    if (json_is_integer(first)) { // one prompt of token ids
        if (!allow_single)
            return http_error_set(err, 400, field, "'%s' must be a list of texts or a list of token-id lists", field);
        out->items = calloc(1, sizeof *out->items);
        if (!out->items) return http_error_set(err, 500, field, "out of memory");
        out->n = 1;
        out->is_ids = 1;
        if (http_parse_id_list(val, field, vocab_size, &out->items[0].ids, &out->items[0].n_ids, err) < 0) {
            http_prompts_free(out);
            return -1;
        }
        return 0;
    }
    if (cnt > HTTP_MAX_PROMPTS)
        return http_error_set(err, 400, field, "'%s' has %zu prompts; at most %d per request", field, cnt,
                              HTTP_MAX_PROMPTS);
    int is_ids = json_is_array(first);
    if (!is_ids && !json_is_string(first))
        return http_error_set(err, 400, field, "'%s'[0] must be a string or a list of token ids, not %s", field,
                              json_kind(first));
    out->items = calloc(cnt, sizeof *out->items);
    if (!out->items) return http_error_set(err, 500, field, "out of memory");
    out->n = (int)cnt;
    out->is_ids = is_ids;
    for (size_t i = 0; i < cnt; i++) {
        const json_t *x = json_array_get(val, i);
        char name[96];
        snprintf(name, sizeof name, "%s[%zu]", field, i);
        if (is_ids) {
            if (!json_is_array(x)) {
                http_error_set(err, 400, field, "'%s' must be a list of token ids like the first prompt, not %s",
                               name, json_kind(x));
                goto fail;
            }
            if (json_array_size(x) == 0) {
                http_error_set(err, 400, field, "'%s' is empty", name);
                goto fail;
            }
            if (http_parse_id_list(x, name, vocab_size, &out->items[i].ids, &out->items[i].n_ids, err) < 0) {
                snprintf(err->param, sizeof err->param, "%s", field);
                goto fail;
            }
        } else {
            if (!json_is_string(x)) {
                http_error_set(err, 400, field, "'%s' must be a string like the first prompt, not %s", name,
                               json_kind(x));
                goto fail;
            }
            if (json_string_length(x) == 0) {
                http_error_set(err, 400, field, "'%s' is empty", name);
                goto fail;
            }
            out->items[i].text = json_string_value(x);
            out->items[i].text_len = json_string_length(x);
        }
    }
    return 0;
fail:
    http_prompts_free(out);
    return -1;
}

// ---- sampling fields ----------------------------------------------------------------------------

static void join_name(char *dst, size_t cap, const char *prefix, const char *key) {
    snprintf(dst, cap, "%s%s", prefix, key);
}

static int parse_stop(const json_t *obj, const char *prefix, SamplingParams *sp, HttpError *err) {
    char name[96];
    join_name(name, sizeof name, prefix, "stop");
    const json_t *v = json_object_get(obj, "stop");
    if (!v || json_is_null(v)) return 0;
    sp->n_stop = 0;
    if (json_is_string(v)) {
        if (json_string_length(v) == 0) return http_error_set(err, 400, name, "'%s' must not be an empty string", name);
        if (json_string_length(v) > HTTP_MAX_STOP_BYTES)
            return http_error_set(err, 400, name, "'%s' is longer than %d bytes", name, HTTP_MAX_STOP_BYTES);
        sp->stop[sp->n_stop++] = (char *)json_string_value(v);
        return 0;
    }
    if (!json_is_array(v))
        return http_error_set(err, 400, name, "'%s' must be a string or a list of strings, not %s", name, json_kind(v));
    if (json_array_size(v) > ENGINE_MAX_STOP)
        return http_error_set(err, 400, name, "'%s' has %zu entries; at most %d", name, json_array_size(v),
                              ENGINE_MAX_STOP);
    for (size_t i = 0; i < json_array_size(v); i++) {
        const json_t *s = json_array_get(v, i);
        if (!json_is_string(s))
            return http_error_set(err, 400, name, "'%s'[%zu] must be a string, not %s", name, i, json_kind(s));
        if (json_string_length(s) == 0 || json_string_length(s) > HTTP_MAX_STOP_BYTES)
            return http_error_set(err, 400, name, "'%s'[%zu] must be 1 to %d bytes long", name, i,
                                  HTTP_MAX_STOP_BYTES);
        sp->stop[sp->n_stop++] = (char *)json_string_value(s);
    }
    return 0;
}

static int parse_stop_ids(const json_t *obj, const char *prefix, int vocab_size, SamplingParams *sp, HttpError *err) {
    char name[96];
    join_name(name, sizeof name, prefix, "stop_token_ids");
    const json_t *v = json_object_get(obj, "stop_token_ids");
    if (!v || json_is_null(v)) return 0;
    if (json_is_array(v) && json_array_size(v) > ENGINE_MAX_STOP)
        return http_error_set(err, 400, name, "'%s' has %zu entries; at most %d", name, json_array_size(v),
                              ENGINE_MAX_STOP);
    int32_t *ids;
    int n;
    if (http_parse_id_list(v, name, vocab_size, &ids, &n, err) < 0) return -1;
    memcpy(sp->stop_token_ids, ids, (size_t)n * sizeof *ids);
    sp->n_stop_token_ids = n;
    free(ids);
    return 0;
}

// A feature we do not implement may still be sent with its neutral value (clients often send defaults).
static int refuse_unless_neutral(const json_t *obj, const char *key, HttpError *err) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return 0;
    if (json_is_number(v) && json_number_value(v) == 0.0) return 0;
    if ((json_is_object(v) && json_object_size(v) == 0) || (json_is_array(v) && json_array_size(v) == 0)) return 0;
    return http_error_set(err, 400, key, "'%s' is not supported by this server (send it as null or leave it out)", key);
}

// The engine samples with floats: a finite number beyond FLT_MAX would become inf, so it is out of range.
static int fits_float(double x, const char *name, HttpError *err) {
    if (fabs(x) > FLT_MAX) return http_error_set(err, 400, name, "'%s' must be at most %g, got %g", name, FLT_MAX, x);
    return 0;
}

// The fields every API shares; prefix names them in errors (TRL's generation_kwargs).
static int parse_common(const json_t *obj, const char *prefix, int vocab_size, HttpGenOptions *o, HttpError *err) {
    SamplingParams *sp = &o->sp;
    char name[96];
    int64_t iv;
    double dv;
    int bv = 0, r;
#define NAME(k) (join_name(name, sizeof name, prefix, k), name)
    if ((r = get_int_n(obj, "n", NAME("n"), 1, HTTP_MAX_N, &iv, err)) < 0) return -1;
    if (r) sp->n = (int)iv;
    if ((r = get_int_n(obj, "max_tokens", NAME("max_tokens"), 1, INT32_MAX, &iv, err)) < 0) return -1;
    if (r) sp->max_tokens = (int)iv, o->max_tokens_given = 1;
    if ((r = get_number_n(obj, "temperature", NAME("temperature"), &dv, err)) < 0) return -1;
    if (r) {
        if (dv < 0) return http_error_set(err, 400, name, "'%s' must be >= 0, got %g", name, dv);
        if (fits_float(dv, name, err) < 0) return -1;
        sp->temperature = (float)dv;
    }
    if ((r = get_number_n(obj, "top_p", NAME("top_p"), &dv, err)) < 0) return -1;
    if (r) {
        // Checked as the float the engine gets: a positive double below the smallest float would become 0.
        if (!((float)dv > 0 && dv <= 1)) return http_error_set(err, 400, name, "'%s' must be in (0, 1], got %g", name, dv);
        sp->top_p = (float)dv;
    }
    if ((r = get_int_n(obj, "top_k", NAME("top_k"), -1, INT32_MAX, &iv, err)) < 0) return -1;
    if (r) sp->top_k = (int)iv;
    if ((r = get_number_n(obj, "min_p", NAME("min_p"), &dv, err)) < 0) return -1;
    if (r) {
        if (!(dv >= 0 && dv <= 1)) return http_error_set(err, 400, name, "'%s' must be in [0, 1], got %g", name, dv);
        sp->min_p = (float)dv;
    }
    if ((r = get_number_n(obj, "repetition_penalty", NAME("repetition_penalty"), &dv, err)) < 0) return -1;
    if (r) {
        if (fits_float(dv, name, err) < 0) return -1;
        if (!((float)dv > 0)) return http_error_set(err, 400, name, "'%s' must be > 0, got %g", name, dv);
        sp->repetition_penalty = (float)dv;
    }
    if ((r = get_int_n(obj, "seed", NAME("seed"), INT64_MIN, INT64_MAX, &iv, err)) < 0) return -1;
    if (r) sp->has_seed = 1, sp->seed = (uint64_t)iv;
    if (parse_stop(obj, prefix, sp, err) < 0) return -1;
    if (parse_stop_ids(obj, prefix, vocab_size, sp, err) < 0) return -1;
    if ((r = get_bool_n(obj, "ignore_eos", NAME("ignore_eos"), &bv, err)) < 0) return -1;
    if (r) sp->ignore_eos = bv;
    if ((r = get_bool_n(obj, "include_stop_str_in_output", NAME("include_stop_str_in_output"), &bv, err)) < 0)
        return -1;
    if (r) sp->include_stop_str = bv;
    if ((r = get_bool_n(obj, "skip_special_tokens", NAME("skip_special_tokens"), &bv, err)) < 0) return -1;
    if (r) sp->skip_special_tokens = bv;
#undef NAME
    return 0;
}

static int parse_stream_fields(const json_t *req, HttpGenOptions *o, HttpError *err) {
    if (http_get_bool(req, "stream", &o->stream, err) < 0) return -1;
    const json_t *so = json_object_get(req, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so))
            return http_error_set(err, 400, "stream_options", "'stream_options' must be an object, not %s",
                                  json_kind(so));
        if (!o->stream)
            return http_error_set(err, 400, "stream_options", "'stream_options' is only allowed with stream=true");
        if (get_bool_n(so, "include_usage", "stream_options.include_usage", &o->include_usage, err) < 0) return -1;
    }
    return 0;
}

static int parse_unsupported(const json_t *req, HttpError *err) {
    static const char *const keys[] = {"frequency_penalty", "presence_penalty", "logit_bias", "tools"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (refuse_unless_neutral(req, keys[i], err) < 0) return -1;
    return 0;
}

static int parse_trl_kwargs(const json_t *req, int vocab_size, HttpGenOptions *o, HttpError *err) {
    const json_t *images = json_object_get(req, "images");
    if (images && !json_is_null(images)) {
        if (!json_is_array(images))
            return http_error_set(err, 400, "images", "'images' must be null or a list, not %s", json_kind(images));
        for (size_t i = 0; i < json_array_size(images); i++)
            if (!json_is_null(json_array_get(images, i)))
                return http_error_set(err, 400, "images", "'images'[%zu]: images are not supported (text models "
                                      "only); send null", i);
    }
    const json_t *rx = json_object_get(req, "structured_outputs_regex");
    if (rx && !json_is_null(rx))
        return http_error_set(err, 400, "structured_outputs_regex",
                              "'structured_outputs_regex' is not supported by this server; send null");
    const json_t *kw = json_object_get(req, "generation_kwargs");
    if (!kw || json_is_null(kw)) return 0;
    if (!json_is_object(kw))
        return http_error_set(err, 400, "generation_kwargs", "'generation_kwargs' must be an object, not %s",
                              json_kind(kw));
    // TRL lets these override the top-level fields; anything else would be silently ignored, so refuse it.
    static const char *const known[] = {"n", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                                        "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                                        "include_stop_str_in_output", "skip_special_tokens", "logprobs"};
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)kw, key, val) {
        int ok = 0;
        for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) ok |= strcmp(key, known[i]) == 0;
        if (!ok) {
            char name[96];
            snprintf(name, sizeof name, "generation_kwargs.%s", key);
            return http_error_set(err, 400, name, "'%s' is not supported by this server", name);
        }
    }
    if (parse_common(kw, "generation_kwargs.", vocab_size, o, err) < 0) return -1;
    int64_t iv;
    int r = get_int_n(kw, "logprobs", "generation_kwargs.logprobs", 0, ENGINE_MAX_TOP_LOGPROBS, &iv, err);
    if (r < 0) return -1;
    if (r) o->logprobs = (int)iv;
    else if (json_object_get(kw, "logprobs")) o->logprobs = -1; // explicit null
    return 0;
}

int http_parse_generation(const json_t *req, HttpApi api, int vocab_size, HttpGenOptions *o, HttpError *err) {
    memset(o, 0, sizeof *o);
    sampling_params_default(&o->sp);
    o->logprobs = -1;
    o->add_generation_prompt = 1;
    o->add_special_tokens = api == HTTP_API_CHAT ? 0 : 1;
    if (api == HTTP_API_TRL) {
        o->sp.top_k = -1;
        o->logprobs = 0; // TRL's default: the sampled token's logprob only
    }
    int64_t iv;
    int r;
    if (parse_common(req, "", vocab_size, o, err) < 0) return -1;
    if (api != HTTP_API_TRL) {
        if (parse_unsupported(req, err) < 0) return -1;
        if (parse_stream_fields(req, o, err) < 0) return -1;
        if (http_get_bool(req, "return_token_ids", &o->return_token_ids, err) < 0) return -1;
        if (http_get_bool(req, "add_special_tokens", &o->add_special_tokens, err) < 0) return -1;
    }
    switch (api) {
    case HTTP_API_COMPLETIONS:
        if ((r = http_get_int(req, "logprobs", 0, ENGINE_MAX_TOP_LOGPROBS, &iv, err)) < 0) return -1;
        if (r) o->logprobs = (int)iv;
        if (http_get_bool(req, "echo", &o->echo, err) < 0) return -1;
        if (o->echo && o->logprobs >= 0)
            return http_error_set(err, 400, "echo", "'echo' together with 'logprobs' is not supported (this server "
                                  "does not compute prompt logprobs)");
        {
            const json_t *sfx = json_object_get(req, "suffix");
            if (sfx && !json_is_null(sfx))
                return http_error_set(err, 400, "suffix", "'suffix' is not supported by this server");
            if ((r = http_get_int(req, "best_of", 1, HTTP_MAX_N, &iv, err)) < 0) return -1;
            if (r && iv != o->sp.n)
                return http_error_set(err, 400, "best_of", "'best_of' other than n is not supported");
        }
        break;
    case HTTP_API_CHAT: {
        if ((r = http_get_int(req, "max_completion_tokens", 1, INT32_MAX, &iv, err)) < 0) return -1;
        if (r) o->sp.max_tokens = (int)iv, o->max_tokens_given = 1;
        int want = 0;
        if (http_get_bool(req, "logprobs", &want, err) < 0) return -1;
        int64_t top = 0;
        if ((r = http_get_int(req, "top_logprobs", 0, ENGINE_MAX_TOP_LOGPROBS, &top, err)) < 0) return -1;
        if (r && top > 0 && !want)
            return http_error_set(err, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
        o->logprobs = want ? (int)top : -1;
        if (http_get_bool(req, "add_generation_prompt", &o->add_generation_prompt, err) < 0) return -1;
        if (http_get_bool(req, "continue_final_message", &o->continue_final_message, err) < 0) return -1;
        if (o->continue_final_message)
            return http_error_set(err, 400, "continue_final_message", "'continue_final_message' is not supported");
        const json_t *rf = json_object_get(req, "response_format");
        if (rf && !json_is_null(rf)) {
            const json_t *t = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
            if (!json_is_string(t) || strcmp(json_string_value(t), "text") != 0)
                return http_error_set(err, 400, "response_format", "only {\"type\": \"text\"} is supported in "
                                      "'response_format'");
        }
        break;
    }
    case HTTP_API_TRL: {
        const json_t *lp = json_object_get(req, "logprobs");
        if (lp && json_is_null(lp)) o->logprobs = -1;
        else if ((r = http_get_int(req, "logprobs", 0, ENGINE_MAX_TOP_LOGPROBS, &iv, err)) < 0) return -1;
        else if (r) o->logprobs = (int)iv;
        if (parse_trl_kwargs(req, vocab_size, o, err) < 0) return -1;
        break;
    }
    }
    o->sp.top_logprobs = o->logprobs > 0 ? o->logprobs : 0;
    return 0;
}
