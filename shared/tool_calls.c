// shared/tool_calls.c — tool calls out of assistant text (formats in tool_calls.h).
#include "shared/tool_calls.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"

#define HERMES_OPEN "<tool_call>"
#define HERMES_CLOSE "</tool_call>"
#define LLAMA_PYTHON_TAG "<|python_tag|>"
#define MISTRAL_CALLS "[TOOL_CALLS]"
#define MISTRAL_ARGS "[ARGS]"
#define MISTRAL_CALL_ID "[CALL_ID]"
#define EXCERPT_CHARS 60

// End-of-turn tokens a decoded turn may still end with; they are not part of the message.
static const char *const TURN_ENDS[] = {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<|endoftext|>",
                                        "<|end_of_text|>"};

static const struct {
    const char *name;
    ToolCallFormat format;
} FORMATS[] = {{"hermes", TOOL_FORMAT_HERMES}, {"llama3", TOOL_FORMAT_LLAMA3}, {"mistral", TOOL_FORMAT_MISTRAL}};

ToolCallFormat tool_call_format_of_family(ChatFamily family) {
    switch (family) {
    case CHAT_FAMILY_LLAMA31: return TOOL_FORMAT_LLAMA3;
    case CHAT_FAMILY_MISTRAL: return TOOL_FORMAT_MISTRAL;
    default: return TOOL_FORMAT_HERMES;
    }
}

int tool_call_format_from_name(const char *name, ToolCallFormat *out, char *err, size_t err_len) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (name && strcmp(name, FORMATS[i].name) == 0) {
            *out = FORMATS[i].format;
            return 0;
        }
    return err_fail(err, err_len, "unknown tool-call format '%s': use hermes (Qwen, Hermes), llama3 (Llama 3.1+) "
                    "or mistral", name ? name : "(null)");
}

const char *tool_call_format_name(ToolCallFormat f) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (FORMATS[i].format == f) return FORMATS[i].name;
    return "unknown";
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static void trim(const char **s, size_t *n) {
    while (*n && is_space(**s)) (*s)++, (*n)--;
    while (*n && is_space((*s)[*n - 1])) (*n)--;
}

// Removes trailing end-of-turn tokens and white space.
static void trim_turn_end(const char *s, size_t *n) {
    for (int again = 1; again;) {
        again = 0;
        while (*n && is_space(s[*n - 1])) (*n)--;
        for (size_t i = 0; i < sizeof TURN_ENDS / sizeof TURN_ENDS[0]; i++) {
            size_t k = strlen(TURN_ENDS[i]);
            if (*n >= k && memcmp(s + *n - k, TURN_ENDS[i], k) == 0) {
                *n -= k;
                again = 1;
            }
        }
    }
}

static const char *find(const char *s, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(s + i, needle, k) == 0) return s + i;
    return NULL;
}

typedef struct {
    ToolCallParse *p;
    size_t cap;
    int oom;
} Builder;

// Sets the parse error once (the first broken call is the one reported).
static void set_error(Builder *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(Builder *b, const char *fmt, ...) {
    if (b->p->error) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (!(b->p->error = strdup(buf))) b->oom = 1;
}

// A printable excerpt of the text of a broken call, for the error the policy reads.
static void excerpt(const char *s, size_t n, char *out, size_t cap) {
    size_t k = n < cap - 4 ? n : cap - 4;
    if (n > EXCERPT_CHARS) k = k < EXCERPT_CHARS ? k : EXCERPT_CHARS;
    while (k > 0 && k < n && ((unsigned char)s[k] & 0xC0) == 0x80) k--;  // do not cut a UTF-8 character
    memcpy(out, s, k);
    strcpy(out + k, k < n ? "..." : "");
}

static int add_call(Builder *b, const char *name, json_t *args, const char *id) {
    ToolCallParse *p = b->p;
    if (p->n_calls == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 4;
        ToolCall *c = realloc(p->calls, cap * sizeof *c);
        if (!c) return b->oom = 1, -1;
        p->calls = c, b->cap = cap;
    }
    ToolCall *c = &p->calls[p->n_calls];
    memset(c, 0, sizeof *c);
    if (!(c->name = strdup(name)) || (id && !(c->id = strdup(id)))) {
        free(c->name);
        return b->oom = 1, -1;
    }
    c->arguments = json_incref(args);
    p->n_calls++;
    return 0;
}

// Arguments as given: an object, a JSON string holding an object, or absent/null (no arguments). The result is a
// new reference, or NULL with the error set.
static json_t *arguments_object(Builder *b, json_t *v, int idx, const char *name) {
    if (!v || json_is_null(v)) return json_object();
    if (json_is_object(v)) return json_incref(v);
    if (json_is_string(v)) {
        json_error_t je;
        json_t *o = json_loadb(json_string_value(v), json_string_length(v), 0, &je);
        if (o && json_is_object(o)) return o;
        json_decref(o);
        set_error(b, "tool call %d (%s): \"arguments\" is a string that does not hold a JSON object", idx, name);
        return NULL;
    }
    set_error(b, "tool call %d (%s): \"arguments\" must be a JSON object of argument names to values", idx, name);
    return NULL;
}

// One call object {"name": ..., "arguments"|"parameters": ..., "id"?: ...}. 0, or -1 (error set).
static int take_call_object(Builder *b, json_t *o, int idx) {
    if (!json_is_object(o)) {
        set_error(b, "tool call %d is not a JSON object: write {\"name\": ..., \"arguments\": {...}}", idx);
        return -1;
    }
    json_t *fn = json_object_get(o, "function");   // the OpenAI shape {"type": "function", "function": {...}}
    if (json_is_object(fn)) o = fn;
    json_t *name = json_object_get(o, "name");
    if (!json_is_string(name) || json_string_length(name) == 0) {
        set_error(b, "tool call %d has no \"name\" string: write {\"name\": ..., \"arguments\": {...}}", idx);
        return -1;
    }
    json_t *raw = json_object_get(o, "arguments");
    if (!raw) raw = json_object_get(o, "parameters");
    json_t *args = arguments_object(b, raw, idx, json_string_value(name));
    if (!args) return -1;
    json_t *id = json_object_get(o, "id");
    int rc = add_call(b, json_string_value(name), args, json_is_string(id) ? json_string_value(id) : NULL);
    json_decref(args);
    return rc;
}

// Parses one JSON value at the start of s (n bytes); *used receives its length. NULL with je filled when invalid.
static json_t *json_prefix(const char *s, size_t n, size_t *used, json_error_t *je) {
    json_t *v = json_loadb(s, n, JSON_DISABLE_EOF_CHECK | JSON_DECODE_ANY, je);
    *used = v ? (size_t)je->position : 0;
    return v;
}

static void bad_json(Builder *b, int idx, const char *s, size_t n, const json_error_t *je) {
    char ex[EXCERPT_CHARS + 8];
    excerpt(s, n, ex, sizeof ex);
    set_error(b, "tool call %d is not valid JSON (%s): %s", idx, je->text, ex);
}

static int append_content(char **content, size_t *len, const char *s, size_t n) {
    trim(&s, &n);
    if (!n) return 0;
    char *c = realloc(*content, *len + n + 2);
    if (!c) return -1;
    if (*len) c[(*len)++] = '\n';
    memcpy(c + *len, s, n);
    *len += n;
    c[*len] = '\0';
    *content = c;
    return 0;
}

static int parse_hermes(Builder *b, const char *s, size_t n) {
    char *content = NULL;
    size_t clen = 0;
    int idx = 0;
    const char *end = s + n;
    while (s < end) {
        const char *open = find(s, (size_t)(end - s), HERMES_OPEN);
        if (append_content(&content, &clen, s, open ? (size_t)(open - s) : (size_t)(end - s)) != 0) goto oom;
        if (!open) break;
        idx++;
        const char *body = open + strlen(HERMES_OPEN);
        const char *close = find(body, (size_t)(end - body), HERMES_CLOSE);
        const char *body_end = close ? close : end;
        const char *js = body;
        size_t jn = (size_t)(body_end - body);
        trim(&js, &jn);
        if (!close) {
            char ex[EXCERPT_CHARS + 8];
            excerpt(js, jn, ex, sizeof ex);
            set_error(b, "tool call %d has no closing " HERMES_CLOSE ": %s", idx, ex);
            break;
        }
        json_error_t je;
        json_t *o = json_loadb(js, jn, JSON_DECODE_ANY, &je);
        if (!o) {
            bad_json(b, idx, js, jn, &je);
        } else {
            take_call_object(b, o, idx);
            json_decref(o);
        }
        if (b->oom) goto oom;
        s = close + strlen(HERMES_CLOSE);
    }
    b->p->content = content ? content : strdup("");
    return b->p->content ? 0 : -1;
oom:
    free(content);
    return -1;
}

static int parse_llama3(Builder *b, const char *s, size_t n) {
    const char *all = s;
    size_t all_n = n;
    trim(&s, &n);
    int tagged = 0;
    size_t tag = strlen(LLAMA_PYTHON_TAG);
    if (n >= tag && memcmp(s, LLAMA_PYTHON_TAG, tag) == 0) {
        s += tag, n -= tag, tagged = 1;
        trim(&s, &n);
    }
    int calls = tagged || (n && s[0] == '{');
    if (calls && !tagged) {  // a JSON object without "name" is an answer in JSON, not a call
        size_t used;
        json_error_t je;
        json_t *o = json_prefix(s, n, &used, &je);
        int named = o && json_is_object(o) && json_is_string(json_object_get(o, "name"));
        json_decref(o);
        if (!named) calls = o == NULL && find(s, n < 16 ? n : 16, "\"name\"") != NULL;
    }
    if (!calls) {
        trim(&all, &all_n);
        b->p->content = strndup(all, all_n);
        return b->p->content ? 0 : -1;
    }
    if (!(b->p->content = strdup(""))) return -1;
    if (tagged && (!n || s[0] != '{')) {
        char ex[EXCERPT_CHARS + 8];
        excerpt(s, n, ex, sizeof ex);
        set_error(b, "tool call 1 after " LLAMA_PYTHON_TAG " is not a JSON function call (built-in code tools are "
                  "not available): write {\"name\": ..., \"parameters\": {...}}: %s", ex);
        return 0;
    }
    for (int idx = 1; n; idx++) {
        size_t used;
        json_error_t je;
        json_t *o = json_prefix(s, n, &used, &je);
        if (!o) {
            bad_json(b, idx, s, n, &je);
            break;
        }
        int rc = take_call_object(b, o, idx);
        json_decref(o);
        if (rc != 0) break;
        s += used, n -= used;
        while (n && (is_space(*s) || *s == ';')) s++, n--;
    }
    return b->oom ? -1 : 0;
}

static int parse_mistral(Builder *b, const char *s, size_t n) {
    const char *end = s + n;
    const char *mark = find(s, n, MISTRAL_CALLS);
    size_t cn = mark ? (size_t)(mark - s) : n;
    const char *c = s;
    trim(&c, &cn);
    if (!(b->p->content = strndup(c, cn))) return -1;
    int idx = 0;
    while (mark) {
        const char *p = mark + strlen(MISTRAL_CALLS);
        while (p < end && is_space(*p)) p++;
        size_t used;
        json_error_t je;
        if (p < end && *p == '[') {  // v0.3: a JSON list of calls
            json_t *list = json_prefix(p, (size_t)(end - p), &used, &je);
            if (!list) {
                bad_json(b, idx + 1, p, (size_t)(end - p), &je);
                break;
            }
            if (!json_is_array(list)) {
                json_decref(list);
                break;
            }
            size_t i;
            json_t *o;
            json_array_foreach(list, i, o) {
                if (take_call_object(b, o, ++idx) != 0) break;
            }
            json_decref(list);
            p += used;
        } else {  // v11: name[CALL_ID]id[ARGS]{...}
            idx++;
            const char *args = find(p, (size_t)(end - p), MISTRAL_ARGS);
            if (!args) {
                char ex[EXCERPT_CHARS + 8];
                excerpt(p, (size_t)(end - p), ex, sizeof ex);
                set_error(b, "tool call %d after " MISTRAL_CALLS " is neither a JSON list nor name" MISTRAL_ARGS
                          "{...}: %s", idx, ex);
                break;
            }
            const char *idm = find(p, (size_t)(args - p), MISTRAL_CALL_ID);
            const char *name_end = idm ? idm : args;
            const char *nm = p;
            size_t nn = (size_t)(name_end - p);
            trim(&nm, &nn);
            char *name = strndup(nm, nn);
            char *id = idm ? strndup(idm + strlen(MISTRAL_CALL_ID), (size_t)(args - idm) - strlen(MISTRAL_CALL_ID))
                           : NULL;
            if (!name || (idm && !id)) {
                free(name), free(id);
                return -1;
            }
            p = args + strlen(MISTRAL_ARGS);
            json_t *a = json_prefix(p, (size_t)(end - p), &used, &je);
            if (!a) {
                bad_json(b, idx, p, (size_t)(end - p), &je);
            } else if (!nn) {
                set_error(b, "tool call %d has no function name before " MISTRAL_ARGS, idx);
            } else {
                // The name and id are the model's raw text: not necessarily UTF-8, which JSON strings must be.
                json_t *jn = json_string(name), *ji = id ? json_string(id) : NULL;
                if (!jn || (id && !ji)) {
                    set_error(b, "tool call %d: the function name or call id before " MISTRAL_ARGS
                              " is not valid UTF-8 text", idx);
                    json_decref(jn), json_decref(ji);
                } else {
                    json_t *o = json_pack("{s:o, s:O}", "name", jn, "arguments", a);
                    if (!o || (ji && json_object_set_new(o, "id", ji) != 0)) b->oom = 1;
                    else take_call_object(b, o, idx);
                    if (!o) json_decref(ji);
                    json_decref(o);
                }
            }
            json_decref(a);
            free(name), free(id);
            if (b->oom) return -1;
            if (!a || b->p->error) break;
            p += used;
        }
        if (b->p->error) break;
        mark = find(p, (size_t)(end - p), MISTRAL_CALLS);
    }
    return b->oom ? -1 : 0;
}

int tool_calls_parse(ToolCallFormat f, const char *text, size_t len, ToolCallParse *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    Builder b = {.p = out};
    trim_turn_end(text, &len);
    int rc;
    switch (f) {
    case TOOL_FORMAT_HERMES: rc = parse_hermes(&b, text, len); break;
    case TOOL_FORMAT_LLAMA3: rc = parse_llama3(&b, text, len); break;
    case TOOL_FORMAT_MISTRAL: rc = parse_mistral(&b, text, len); break;
    default: return err_fail(err, err_len, "tool_calls_parse: unknown format %d", (int)f);
    }
    if (rc != 0 || b.oom) {
        tool_call_parse_free(out);
        return err_fail(err, err_len, "tool_calls_parse: out of memory");
    }
    return 0;
}

void tool_call_parse_free(ToolCallParse *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n_calls; i++) {
        free(p->calls[i].name);
        free(p->calls[i].id);
        json_decref(p->calls[i].arguments);
    }
    free(p->calls);
    free(p->content);
    free(p->error);
    memset(p, 0, sizeof *p);
}
