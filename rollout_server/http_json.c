// rollout_server/http_json.c — request parsing and validation for the HTTP API (see http_json.h).
#include "rollout_server/http_json.h"

#include <ctype.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/http_json_internal.h"
#include "shared/json_get.h"
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
    case 501: return "not_implemented_error";
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

// A request object (or one inside it) read with shared/json_get.h in the HTTP API's wording: null is absent, a
// whole real is an integer (Python clients send 4.0), and a failure's message goes straight into err->message.
static JsonAt request_at(const json_t *obj, HttpError *err) {
    JsonAt at = json_at_document(obj, NULL, 1, -1, err ? err->message : NULL, err ? sizeof err->message : 0);
    at.integral_reals = 1;
    at.request_wording = 1;
    return at;
}

// The 400 of a failed json_get call on member `key` of at (key NULL: at itself): json_get wrote the message,
// param names the member by its full path ("generation_kwargs.temperature").
int http_json_refused(const JsonAt *at, const char *key, HttpError *err) {
    if (!err) return -1;
    err->status = 400;
    const char *sep = at->path[0] && key ? "." : "";
    if (snprintf(err->param, sizeof err->param, "%s%s%s", at->path, sep, key ? key : "") >= (int)sizeof err->param)
        memcpy(err->param + sizeof err->param - 4, "...", 4);
    return -1;
}


int http_get_bool(const json_t *obj, const char *key, int *out, HttpError *err) {
    JsonAt at = request_at(obj, err);
    if (!json_get_present(&at, key)) return 0;
    return json_get_bool(&at, key, JSON_GET_REQUIRED, 0, out) ? http_json_refused(&at, key, err) : 1;
}

int http_get_string(const json_t *obj, const char *key, const char **out, size_t *len, HttpError *err) {
    JsonAt at = request_at(obj, err);
    if (!json_get_present(&at, key)) return 0;
    return json_get_string(&at, key, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, out, len) ? http_json_refused(&at, key, err) : 1;
}

int http_parse_id_list(const json_t *val, const char *field, int vocab_size, int32_t **ids, int *n, HttpError *err) {
    *ids = NULL;
    *n = 0;
    if (!json_is_array(val))
        return http_error_set(err, 400, field, "'%s' must be a list of token ids, not %s", field, json_kind_name(val));
    size_t cnt = json_array_size(val);
    int32_t *a = malloc((cnt ? cnt : 1) * sizeof *a);
    if (!a) return http_error_set(err, 500, field, "out of memory reading '%s'", field);
    for (size_t i = 0; i < cnt; i++) {
        const json_t *x = json_array_get(val, i);
        if (!json_is_integer(x)) {
            free(a);
            return http_error_set(err, 400, field, "'%s'[%zu] must be an integer token id, not %s", field, i,
                                  json_kind_name(x));
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
                              "list of token-id lists, not %s", field, json_kind_name(val));
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
                              json_kind_name(first));
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
                               name, json_kind_name(x));
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
                               json_kind_name(x));
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

static int parse_stop(const JsonAt *at, SamplingParams *sp, HttpError *err) {
    if (!json_get_present(at, "stop")) return 0;
    sp->n_stop = 0;
    const json_t *v = json_object_get(at->json, "stop");
    if (json_is_string(v)) {
        if (json_string_length(v) == 0) return REFUSE(at, "stop", err, "must not be an empty string");
        if (json_string_length(v) > HTTP_MAX_STOP_BYTES)
            return REFUSE(at, "stop", err, "is longer than %d bytes", HTTP_MAX_STOP_BYTES);
        sp->stop[sp->n_stop++] = (char *)json_string_value(v);
        return 0;
    }
    if (!json_is_array(v))
        return REFUSE(at, "stop", err, "must be a string or a list of strings, not %s", json_kind_name(v));
    JsonAt list = json_at_value(at, v, "stop");
    if (json_array_size(v) > ENGINE_MAX_STOP)
        return REFUSE(at, "stop", err, "has %zu entries; at most %d", json_array_size(v), ENGINE_MAX_STOP);
    for (size_t i = 0; i < json_array_size(v); i++) {
        JsonAt item = json_at_element(&list, i);
        const char *text;
        size_t len;
        if (json_get_string(&item, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &text, &len))
            return http_json_refused(&list, NULL, err);
        if (len == 0 || len > HTTP_MAX_STOP_BYTES) {
            json_get_fail(&item, NULL, "must be 1 to %d bytes long", HTTP_MAX_STOP_BYTES);
            return http_json_refused(&list, NULL, err);
        }
        sp->stop[sp->n_stop++] = (char *)text;
    }
    return 0;
}

static int parse_stop_ids(const JsonAt *at, int vocab_size, SamplingParams *sp, HttpError *err) {
    if (!json_get_present(at, "stop_token_ids")) return 0;
    const json_t *v = json_object_get(at->json, "stop_token_ids");
    if (json_is_array(v) && json_array_size(v) > ENGINE_MAX_STOP)
        return REFUSE(at, "stop_token_ids", err, "has %zu entries; at most %d", json_array_size(v), ENGINE_MAX_STOP);
    char name[JSON_AT_PATH_MAX + sizeof "stop_token_ids"];
    snprintf(name, sizeof name, "%s%sstop_token_ids", at->path, at->path[0] ? "." : "");
    int32_t *ids;
    int n;
    if (http_parse_id_list(v, name, vocab_size, &ids, &n, err) < 0) return -1;
    memcpy(sp->stop_token_ids, ids, (size_t)n * sizeof *ids);
    sp->n_stop_token_ids = n;
    free(ids);
    return 0;
}

// A feature we do not implement may still be sent with its neutral value (clients often send defaults).
static int refuse_unless_neutral(const JsonAt *at, const char *key, HttpError *err) {
    if (!json_get_present(at, key)) return 0;
    const json_t *v = json_object_get(at->json, key);
    if (json_is_number(v) && json_number_value(v) == 0.0) return 0;
    if ((json_is_object(v) && json_object_size(v) == 0) || (json_is_array(v) && json_array_size(v) == 0)) return 0;
    return REFUSE(at, key, err, "is not supported by this server (send it as null or leave it out)");
}

// A finite number, left alone when absent.
static int get_number(const JsonAt *at, const char *key, double *inout, HttpError *err) {
    return json_get_double(at, key, JSON_GET_OPTIONAL, *inout, -DBL_MAX, DBL_MAX, inout) ? http_json_refused(at, key, err) : 0;
}

// The engine samples with floats: a finite number beyond FLT_MAX would become inf, so it is out of range.
static int fits_float(const JsonAt *at, const char *key, double x, HttpError *err) {
    return fabs(x) > FLT_MAX ? REFUSE(at, key, err, "must be at most %g, got %g", FLT_MAX, x) : 0;
}

// The fields every API shares, read from at (the request, or TRL's generation_kwargs).
static int parse_common(const JsonAt *at, int vocab_size, HttpGenOptions *o, HttpError *err) {
    SamplingParams *sp = &o->sp;
    if (json_get_int(at, "n", JSON_GET_OPTIONAL, sp->n, 1, HTTP_MAX_N, &sp->n)) return http_json_refused(at, "n", err);
    if (json_get_int(at, "max_tokens", JSON_GET_OPTIONAL, sp->max_tokens, 1, INT32_MAX, &sp->max_tokens))
        return http_json_refused(at, "max_tokens", err);
    o->max_tokens_given |= json_get_present(at, "max_tokens");
    double dv = sp->temperature;
    if (get_number(at, "temperature", &dv, err) < 0) return -1;
    if (dv < 0) return REFUSE(at, "temperature", err, "must be >= 0, got %g", dv);
    if (fits_float(at, "temperature", dv, err) < 0) return -1;
    sp->temperature = (float)dv;
    dv = sp->top_p;
    if (get_number(at, "top_p", &dv, err) < 0) return -1;
    // Checked as the float the engine gets: a positive double below the smallest float would become 0.
    if (!((float)dv > 0 && dv <= 1)) return REFUSE(at, "top_p", err, "must be in (0, 1], got %g", dv);
    sp->top_p = (float)dv;
    if (json_get_int(at, "top_k", JSON_GET_OPTIONAL, sp->top_k, -1, INT32_MAX, &sp->top_k))
        return http_json_refused(at, "top_k", err);
    dv = sp->min_p;
    if (get_number(at, "min_p", &dv, err) < 0) return -1;
    if (!(dv >= 0 && dv <= 1)) return REFUSE(at, "min_p", err, "must be in [0, 1], got %g", dv);
    sp->min_p = (float)dv;
    dv = sp->repetition_penalty;
    if (get_number(at, "repetition_penalty", &dv, err) < 0) return -1;
    if (fits_float(at, "repetition_penalty", dv, err) < 0) return -1;
    if (!((float)dv > 0)) return REFUSE(at, "repetition_penalty", err, "must be > 0, got %g", dv);
    sp->repetition_penalty = (float)dv;
    if (json_get_present(at, "seed")) {
        int64_t seed = 0;
        if (json_get_int64(at, "seed", JSON_GET_REQUIRED, 0, INT64_MIN, INT64_MAX, &seed))
            return http_json_refused(at, "seed", err);
        sp->has_seed = 1, sp->seed = (uint64_t)seed;
    }
    if (parse_stop(at, sp, err) < 0) return -1;
    if (parse_stop_ids(at, vocab_size, sp, err) < 0) return -1;
    if (json_get_bool(at, "ignore_eos", JSON_GET_OPTIONAL, sp->ignore_eos, &sp->ignore_eos))
        return http_json_refused(at, "ignore_eos", err);
    if (json_get_bool(at, "include_stop_str_in_output", JSON_GET_OPTIONAL, sp->include_stop_str,
                      &sp->include_stop_str))
        return http_json_refused(at, "include_stop_str_in_output", err);
    if (json_get_bool(at, "skip_special_tokens", JSON_GET_OPTIONAL, sp->skip_special_tokens,
                      &sp->skip_special_tokens))
        return http_json_refused(at, "skip_special_tokens", err);
    return 0;
}

// A boolean member, left alone when absent.
int http_json_get_bool(const JsonAt *at, const char *key, int *inout, HttpError *err) {
    return json_get_bool(at, key, JSON_GET_OPTIONAL, *inout, inout) ? http_json_refused(at, key, err) : 0;
}

static int parse_stream_fields(const JsonAt *req, HttpGenOptions *o, HttpError *err) {
    if (http_json_get_bool(req, "stream", &o->stream, err) < 0) return -1;
    JsonAt so;
    if (json_get_object(req, "stream_options", JSON_GET_OPTIONAL, &so)) return http_json_refused(req, "stream_options", err);
    if (!so.json) return 0;
    if (!o->stream) return REFUSE(req, "stream_options", err, "is only allowed with stream=true");
    return http_json_get_bool(&so, "include_usage", &o->include_usage, err);
}

// vLLM fields that would change the output and that this server does not implement: refused by name (null,
// 0, [] and {} pass as "not asked for"), never dropped. TRL's VLLMClient sends "structured_outputs" for its
// structured_outputs_regex.
static int parse_unsupported(const JsonAt *req, HttpError *err) {
    static const char *const keys[] = {"frequency_penalty", "presence_penalty", "logit_bias", "guided_grammar"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (refuse_unless_neutral(req, keys[i], err) < 0) return -1;
    // 0 asks for something here (a cut to 0 tokens): only null is neutral.
    static const char *const null_only[] = {"truncate_prompt_tokens"};
    for (size_t i = 0; i < sizeof null_only / sizeof null_only[0]; i++)
        if (json_get_present(req, null_only[i]))
            return REFUSE(req, null_only[i], err, "is not supported by this server (send it as null or leave it "
                          "out)");
    const json_t *rf = json_object_get(req->json, "response_format");
    if (json_get_present(req, "response_format")) {
        const json_t *t = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
        if (!json_is_string(t) || (strcmp(json_string_value(t), "text") != 0 &&
                                   strcmp(json_string_value(t), "json_schema") != 0))
            return http_error_set(err, 400, "response_format", "only {\"type\": \"text\"} and {\"type\": "
                                  "\"json_schema\", \"json_schema\": {\"schema\": ...}} are supported in "
                                  "'response_format' (json_object is not)");
    }
    return 0;
}

void http_gen_options_free(HttpGenOptions *o) {
    if (!o) return;
    free(o->allowed_ids);
    free(o->structured);
    o->structured = NULL;
    o->sp.structured_regex = NULL;
    free(o->bad_ids);
    free(o->bad_offsets);
    o->allowed_ids = o->bad_ids = o->bad_offsets = NULL;
    o->sp.allowed_token_ids = o->sp.bad_words_ids = o->sp.bad_words_offsets = NULL;
    o->sp.n_allowed = o->sp.n_bad_words = 0;
}

static int parse_trl_kwargs(const JsonAt *req, int vocab_size, HttpGenOptions *o, HttpError *err) {
    const json_t *images = json_object_get(req->json, "images");
    if (json_get_present(req, "images")) {
        if (!json_is_array(images))
            return REFUSE(req, "images", err, "must be null or a list, not %s", json_kind_name(images));
        for (size_t i = 0; i < json_array_size(images); i++)
            if (!json_is_null(json_array_get(images, i)))
                return http_error_set(err, 400, "images", "'images'[%zu]: images are not supported (text models "
                                      "only); send null", i);
    }
    if (json_get_present(req, "structured_outputs_regex")) {   // TRL <= 1.10's guided decoding
        const json_t *re = json_object_get(req->json, "structured_outputs_regex");
        if (!json_is_string(re) || json_string_length(re) == 0)
            return REFUSE(req, "structured_outputs_regex", err, "must be a non-empty string or null");
        if (!(o->structured = strndup(json_string_value(re), json_string_length(re))))
            return http_error_set(err, 500, NULL, "out of memory");
        o->structured_len = json_string_length(re);
        o->sp.structured_regex = o->structured;
        o->sp.structured_regex_len = o->structured_len;
    }
    JsonAt kw;
    if (json_get_object(req, "generation_kwargs", JSON_GET_OPTIONAL, &kw))
        return http_json_refused(req, "generation_kwargs", err);
    if (!kw.json) return 0;
    // TRL lets these override the top-level fields; anything else would be silently ignored, so refuse it.
    static const char *const known[] = {"n", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                                        "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                                        "include_stop_str_in_output", "skip_special_tokens", "logprobs"};
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)kw.json, key, val) {
        int ok = 0;
        for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) ok |= strcmp(key, known[i]) == 0;
        if (!ok) return REFUSE(&kw, key, err, "is not supported by this server");
    }
    if (parse_common(&kw, vocab_size, o, err) < 0) return -1;
    if (json_get_int(&kw, "logprobs", JSON_GET_OPTIONAL, o->logprobs, 0, ENGINE_MAX_TOP_LOGPROBS, &o->logprobs))
        return http_json_refused(&kw, "logprobs", err);
    if (json_is_null(json_object_get(kw.json, "logprobs"))) o->logprobs = -1; // explicit null
    return 0;
}

static int parse_completions(const JsonAt *req, HttpGenOptions *o, HttpError *err) {
    if (json_get_int(req, "logprobs", JSON_GET_OPTIONAL, o->logprobs, 0, ENGINE_MAX_TOP_LOGPROBS, &o->logprobs))
        return http_json_refused(req, "logprobs", err);
    if (http_json_get_bool(req, "echo", &o->echo, err) < 0) return -1;
    // Prompt scoring (vLLM): prompt_logprobs=k gives each prompt token's logprob and k alternatives in the choice's
    // "prompt_logprobs"; echo with logprobs=k puts the prompt's tokens, logprobs and alternatives in front of the
    // completion's in "logprobs" (OpenAI's legacy completions, what lm-evaluation-harness reads).
    if (json_get_int(req, "prompt_logprobs", JSON_GET_OPTIONAL, -1, 0, ENGINE_MAX_TOP_LOGPROBS, &o->prompt_logprobs))
        return http_json_refused(req, "prompt_logprobs", err);
    if (!json_get_present(req, "prompt_logprobs")) o->prompt_logprobs = -1;
    o->sp.prompt_logprobs = o->prompt_logprobs;
    if (o->echo && o->logprobs >= 0) {
        if (o->stream)
            return REFUSE(req, "echo", err, "together with 'logprobs' is not supported when streaming (send "
                          "stream=false)");
        if (o->logprobs > o->sp.prompt_logprobs) o->sp.prompt_logprobs = o->logprobs;
    }
    if (json_get_present(req, "suffix")) return REFUSE(req, "suffix", err, "is not supported by this server");
    int best_of = o->sp.n;
    if (json_get_int(req, "best_of", JSON_GET_OPTIONAL, best_of, 1, HTTP_MAX_N, &best_of))
        return http_json_refused(req, "best_of", err);
    if (best_of != o->sp.n) return REFUSE(req, "best_of", err, "other than n is not supported");
    return 0;
}

static int parse_chat(const JsonAt *req, HttpGenOptions *o, HttpError *err) {
    if (http_parse_tools(req, o, err) < 0) return -1;
    if (json_get_present(req, "prompt_logprobs"))
        return REFUSE(req, "prompt_logprobs", err, "is supported on /v1/completions only (send the rendered prompt "
                      "there); send null here");
    if (json_get_int(req, "max_completion_tokens", JSON_GET_OPTIONAL, o->sp.max_tokens, 1, INT32_MAX,
                     &o->sp.max_tokens))
        return http_json_refused(req, "max_completion_tokens", err);
    o->max_tokens_given |= json_get_present(req, "max_completion_tokens");
    int want = 0, top = 0;
    if (http_json_get_bool(req, "logprobs", &want, err) < 0) return -1;
    if (json_get_int(req, "top_logprobs", JSON_GET_OPTIONAL, 0, 0, ENGINE_MAX_TOP_LOGPROBS, &top))
        return http_json_refused(req, "top_logprobs", err);
    if (top > 0 && !want) return REFUSE(req, "top_logprobs", err, "needs 'logprobs': true");
    o->logprobs = want ? top : -1;
    if (http_json_get_bool(req, "add_generation_prompt", &o->add_generation_prompt, err) < 0) return -1;
    if (http_json_get_bool(req, "continue_final_message", &o->continue_final_message, err) < 0) return -1;
    if (o->continue_final_message) return REFUSE(req, "continue_final_message", err, "is not supported");
    return 0;
}

int http_parse_generation(const json_t *body, HttpApi api, int vocab_size, HttpGenOptions *o, HttpError *err) {
    memset(o, 0, sizeof *o);
    sampling_params_default(&o->sp);
    o->logprobs = -1;
    o->add_generation_prompt = 1;
    o->add_special_tokens = api == HTTP_API_CHAT ? 0 : 1;
    if (api == HTTP_API_TRL) {
        o->sp.top_k = -1;
        o->logprobs = 0; // TRL's default: the sampled token's logprob only
    }
    JsonAt req = request_at(body, err);
    if (parse_common(&req, vocab_size, o, err) < 0) return -1;
    if (api != HTTP_API_TRL) {
        if (parse_unsupported(&req, err) < 0) return -1;
        if (http_parse_token_masks(&req, vocab_size, o, err) < 0) return -1;
        if (http_parse_structured(&req, o, err) < 0) return -1;
        if (parse_stream_fields(&req, o, err) < 0) return -1;
        if (http_json_get_bool(&req, "return_token_ids", &o->return_token_ids, err) < 0) return -1;
        if (http_json_get_bool(&req, "return_tokens_as_token_ids", &o->return_tokens_as_token_ids, err) < 0) return -1;
        if (http_json_get_bool(&req, "add_special_tokens", &o->add_special_tokens, err) < 0) return -1;
    }
    int rc = 0;
    switch (api) {
    case HTTP_API_COMPLETIONS:
        if (json_get_present(&req, "tools"))
            return REFUSE(&req, "tools", err, "is taken by /v1/chat/completions only (its chat template writes them)");
        rc = parse_completions(&req, o, err);
        break;
    case HTTP_API_CHAT: rc = parse_chat(&req, o, err); break;
    case HTTP_API_TRL:
        if (json_get_int(&req, "logprobs", JSON_GET_OPTIONAL, o->logprobs, 0, ENGINE_MAX_TOP_LOGPROBS, &o->logprobs))
            return http_json_refused(&req, "logprobs", err);
        if (json_is_null(json_object_get(body, "logprobs"))) o->logprobs = -1;
        if (http_json_get_bool(&req, "return_policy_versions", &o->return_policy_versions, err) < 0) return -1;
        rc = parse_trl_kwargs(&req, vocab_size, o, err);
        break;
    }
    if (rc < 0) return -1;
    o->sp.top_logprobs = o->logprobs > 0 ? o->logprobs : 0;
    // Chat without max_tokens gets what the context leaves, known once the messages are rendered: checked then.
    if ((api != HTTP_API_CHAT || o->max_tokens_given) && http_check_min_tokens(o, err) < 0) return -1;
    return 0;
}
