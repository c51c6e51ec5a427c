// shared/tokenizer/chat_template_json.c — the `tojson` filter of chat templates: JSON text re-serialised the way
// transformers' filter writes it (Python's json.dumps with ensure_ascii=False and the default separators ", " and
// ": ", or with indent=N: "," and ": ", each member on its own line indented N spaces per level, empty containers
// as {} and []): keys in their order, non-ASCII kept as UTF-8, only '"', '\\' and control characters escaped
// (\n, \r, \t, \b, \f, else \u00xx), integers as written, reals as Python's repr (the shortest digits that read
// back, fixed notation for exponents -4 .. 15 with ".0" on whole numbers, else d.ddde+XX).
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/chat_template_internal.h"
#include "shared/tokenizer/tokenizer_internal.h"

static int put(TokBuf *o, const char *s) { return tok_buf_append(o, s, strlen(s)); }

static int put_string(TokBuf *o, const char *s, size_t n) {
    int rc = put(o, "\"");
    for (size_t i = 0; i < n && !rc; i++) {
        const unsigned char c = (unsigned char)s[i];
        char esc[8];
        switch (c) {
        case '"': rc = put(o, "\\\""); break;
        case '\\': rc = put(o, "\\\\"); break;
        case '\n': rc = put(o, "\\n"); break;
        case '\r': rc = put(o, "\\r"); break;
        case '\t': rc = put(o, "\\t"); break;
        case '\b': rc = put(o, "\\b"); break;
        case '\f': rc = put(o, "\\f"); break;
        default:
            if (c < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", c);
                rc = put(o, esc);
            } else {
                rc = tok_buf_append(o, &s[i], 1);
            }
        }
    }
    return rc || put(o, "\"");
}

// Python's repr of a finite double.
static int put_real(TokBuf *o, double x) {
    char digits[40];
    int prec = 1;
    for (; prec <= 17; prec++) { // the fewest significant digits that read back as x
        snprintf(digits, sizeof digits, "%.*e", prec - 1, x);
        if (strtod(digits, NULL) == x) break;
    }
    // digits: [-]d[.ddd]e[+-]XX -> sign, mantissa digits, exponent
    const char *p = digits;
    int neg = *p == '-';
    if (neg) p++;
    char mant[24];
    int nm = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') mant[nm++] = *p;
    while (nm > 1 && mant[nm - 1] == '0') nm--;
    mant[nm] = 0;
    const int exp = atoi(p + 1);
    char out[64];
    int w = 0;
    if (neg) out[w++] = '-';
    if (exp >= -4 && exp < 16) {
        if (exp < 0) {
            w += snprintf(out + w, sizeof out - w, "0.");
            for (int k = 0; k < -exp - 1; k++) out[w++] = '0';
            w += snprintf(out + w, sizeof out - w, "%s", mant);
        } else {
            for (int k = 0; k <= exp; k++) out[w++] = k < nm ? mant[k] : '0';
            out[w++] = '.';
            if (nm > exp + 1) w += snprintf(out + w, sizeof out - w, "%s", mant + exp + 1);
            else out[w++] = '0';
        }
        out[w] = 0;
    } else {
        out[w++] = mant[0];
        if (nm > 1) {
            out[w++] = '.';
            w += snprintf(out + w, sizeof out - w, "%s", mant + 1);
        }
        snprintf(out + w, sizeof out - w, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    }
    return put(o, out);
}

// Before a member: ", " inline; with an indent, "," (not for the first) then a newline and the member's depth.
static int put_member_sep(TokBuf *o, int first, int indent, int depth) {
    if (indent < 0) return !first && put(o, ", ");
    if (!first && put(o, ",")) return 1;
    if (put(o, "\n")) return 1;
    for (int k = 0; k < indent * depth; k++)
        if (put(o, " ")) return 1;
    return 0;
}

// After the last member of a non-empty container: with an indent, a newline back to the container's depth.
static int put_close_sep(TokBuf *o, int indent, int depth) {
    return indent >= 0 && put_member_sep(o, 1, indent, depth);
}

// indent < 0: inline; else json.dumps(indent=indent) at depth.
static int put_value(TokBuf *o, const json_t *v, int indent, int depth) {
    char num[32];
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        int rc = put(o, "{"), first = 1;
        const char *key;
        const json_t *val;
        json_object_foreach((json_t *)v, key, val) {
            rc = rc || put_member_sep(o, first, indent, depth + 1) || put_string(o, key, strlen(key)) ||
                 put(o, ": ") || put_value(o, val, indent, depth + 1);
            first = 0;
        }
        return rc || (!first && put_close_sep(o, indent, depth)) || put(o, "}");
    }
    case JSON_ARRAY: {
        int rc = put(o, "[");
        for (size_t i = 0; i < json_array_size(v) && !rc; i++)
            rc = put_member_sep(o, i == 0, indent, depth + 1) || put_value(o, json_array_get(v, i), indent, depth + 1);
        return rc || (json_array_size(v) > 0 && put_close_sep(o, indent, depth)) || put(o, "]");
    }
    case JSON_STRING: return put_string(o, json_string_value(v), json_string_length(v));
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        return put(o, num);
    case JSON_REAL: return put_real(o, json_real_value(v));
    case JSON_TRUE: return put(o, "true");
    case JSON_FALSE: return put(o, "false");
    default: return put(o, "null");
    }
}

int chat_tojson_indent(const char *json_text, int indent, TokBuf *out, char *err, size_t err_len) {
    json_error_t je;
    json_t *v = json_loads(json_text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!v) {
        tok_set_err(err, err_len, "chat template: tool call arguments or tool definition are not JSON (%s)", je.text);
        return TOK_EINVAL;
    }
    const int rc = put_value(out, v, indent, 0);
    json_decref(v);
    return rc ? TOK_ENOMEM : 0;
}

int chat_tojson(const char *json_text, TokBuf *out, char *err, size_t err_len) {
    return chat_tojson_indent(json_text, -1, out, err, err_len);
}
