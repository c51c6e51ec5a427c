// shared/json_read.c — JSON numbers jansson refuses, respelled before jansson parses the text (json_read.h).
#include "shared/json_read.h"

#include <errno.h>
#include <float.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// One number literal of the text as given that jansson would refuse, and the real it reads instead.
typedef struct {
    size_t at, len;         // the literal: bytes [at, at + len) of the text as given
    char token[32];         // its replacement: [-]DIGITSe[-]EXP, at most 23 bytes
    size_t token_len;
} NumberEdit;

typedef struct {
    NumberEdit *v;
    size_t n, cap;
} EditList;

// Bytes an edit takes in the respelled text: the replacement, after spaces that pad it to the literal's length
// (before it, so that the token ends where the literal ends and jansson reads the same byte after it).
static size_t edit_span(const NumberEdit *e) { return e->token_len > e->len ? e->token_len : e->len; }

static int is_digit(char c) { return c >= '0' && c <= '9'; }

// Fills an error the way jansson does for failures that have no position (line and column -1).
static void set_error(json_error_t *error, const char *source, enum json_error_code code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void set_error(json_error_t *error, const char *source, enum json_error_code code, const char *fmt, ...) {
    if (!error) return;
    error->line = -1;
    error->column = -1;
    error->position = 0;
    // A long source keeps its tail behind "...", as jansson shortens it.
    size_t n = strlen(source);
    if (n < JSON_ERROR_SOURCE_LENGTH) memcpy(error->source, source, n + 1);
    else snprintf(error->source, sizeof error->source, "...%s", source + n - JSON_ERROR_SOURCE_LENGTH + 4);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(error->text, JSON_ERROR_TEXT_LENGTH - 1, fmt, ap);
    va_end(ap);
    // jansson keeps the error code in the last byte of text (json_error_code reads it there).
    error->text[JSON_ERROR_TEXT_LENGTH - 2] = '\0';
    error->text[JSON_ERROR_TEXT_LENGTH - 1] = (char)code;
}

// Length of the JSON number starting at s, lexed as jansson lexes it; 0 when the text there is no valid
// number (jansson will refuse the document at that token). *is_integer: no fraction and no exponent.
static size_t number_length(const char *s, size_t n, int *is_integer) {
    size_t i = 0;
    if (i < n && s[i] == '-') i++;
    if (i < n && s[i] == '0') i++;
    else if (i < n && is_digit(s[i]))
        while (i < n && is_digit(s[i])) i++;
    else return 0;
    if (i < n && is_digit(s[i])) return 0; // "01"
    *is_integer = 1;
    if (i < n && s[i] == '.') {
        if (++i >= n || !is_digit(s[i])) return 0; // "1."
        while (i < n && is_digit(s[i])) i++;
        *is_integer = 0;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        if (++i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= n || !is_digit(s[i])) return 0; // "1e", "1e+"
        while (i < n && is_digit(s[i])) i++;
        *is_integer = 0;
    }
    return i;
}

// Whether jansson refuses the number literal lit (NUL-terminated, valid JSON): an integer outside int64 (unless
// flags read integers as reals) or a real that overflows a double. If so *value is the double it stands for,
// +-DBL_MAX in place of an overflow.
static int refused_number(char *lit, int is_integer, size_t flags, double *value) {
    if (is_integer && !(flags & JSON_DECODE_INT_AS_REAL)) {
        errno = 0;
        (void)strtoll(lit, NULL, 10); // jansson's json_int_t is long long
        if (errno != ERANGE) return 0;
        double d = strtod(lit, NULL);
        *value = isinf(d) ? copysign(DBL_MAX, d) : d;
        return 1;
    }
    // jansson reads reals with strtod after swapping '.' for the locale's decimal point: the same here, so that
    // both agree on what overflows.
    const char *point = localeconv()->decimal_point;
    char *dot = strchr(lit, '.');
    if (dot && point[0] && point[0] != '.') *dot = point[0];
    errno = 0;
    double d = strtod(lit, NULL);
    if (!(isinf(d) && errno == ERANGE)) return 0;
    *value = copysign(DBL_MAX, d);
    return 1;
}

// d as [-]DIGITSe[-]EXP with 17 significant digits (enough to read back exactly d) and no trailing zeros in
// DIGITS: a real to jansson (it has an exponent), independent of the locale (no decimal point). Returns its length.
static size_t real_token(double d, char out[32]) {
    char e[40];
    snprintf(e, sizeof e, "%.16e", fabs(d)); // "d.dddddddddddddddde+NNN" (17 significant digits); the point as the locale spells it
    char digits[17];
    int nd = 0;
    const char *p = e;
    for (; *p && *p != 'e'; p++)
        if (is_digit(*p) && nd < (int)sizeof digits) digits[nd++] = *p;
    int exp10 = atoi(p + (*p == 'e')) - (nd - 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--, exp10++;
    return (size_t)snprintf(out, 32, "%s%.*se%d", signbit(d) ? "-" : "", nd, digits, exp10);
}

static int push_edit(EditList *l, size_t at, size_t len, double value) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 8;
        NumberEdit *v = realloc(l->v, cap * sizeof *v);
        if (!v) return -1;
        l->v = v;
        l->cap = cap;
    }
    NumberEdit *e = &l->v[l->n++];
    e->at = at;
    e->len = len;
    e->token_len = real_token(value, e->token);
    return 0;
}

// Finds the number literals of s that jansson refuses, in order. Strings (with their escapes) are skipped;
// the scan ends at the first malformed number, where jansson itself stops with its error. -1: out of memory.
static int find_refused_numbers(const char *s, size_t n, size_t flags, EditList *edits) {
    char small[64];
    size_t i = 0;
    while (i < n) {
        if (s[i] == '"') {
            for (i++; i < n && s[i] != '"'; i++)
                if (s[i] == '\\') i++;
            i++;
            continue;
        }
        if (s[i] != '-' && !is_digit(s[i])) {
            i++;
            continue;
        }
        int is_integer = 0;
        size_t len = number_length(s + i, n - i, &is_integer);
        if (len == 0) return 0;
        // An integer of up to 18 digits fits int64: no copy, no strtoll.
        size_t digits = len - (s[i] == '-');
        if (!(is_integer && !(flags & JSON_DECODE_INT_AS_REAL) && digits <= 18)) {
            char *lit = len < sizeof small ? small : malloc(len + 1);
            if (!lit) return -1;
            memcpy(lit, s + i, len);
            lit[len] = '\0';
            double value;
            int refused = refused_number(lit, is_integer, flags, &value);
            if (lit != small) free(lit);
            if (refused && push_edit(edits, i, len, value) != 0) return -1;
        }
        i += len;
    }
    return 0;
}

// The text with every edit applied (malloc'd); *out_len its length.
static char *respell(const char *s, size_t n, const EditList *edits, size_t *out_len) {
    size_t total = n;
    for (size_t k = 0; k < edits->n; k++) total += edit_span(&edits->v[k]) - edits->v[k].len;
    char *t = malloc(total ? total : 1);
    if (!t) return NULL;
    size_t from = 0, to = 0;
    for (size_t k = 0; k < edits->n; k++) {
        const NumberEdit *e = &edits->v[k];
        memcpy(t + to, s + from, e->at - from);
        to += e->at - from;
        memset(t + to, ' ', edit_span(e) - e->token_len);
        memcpy(t + to + edit_span(e) - e->token_len, e->token, e->token_len);
        to += edit_span(e);
        from = e->at + e->len;
    }
    memcpy(t + to, s + from, n - from);
    *out_len = total;
    return t;
}

// Moves jansson's position and column from the respelled text t back to the text s as given (the line is the
// same: edits hold no newline). When the error is about a respelled literal itself (its token ends at the error
// position), the "near '...'" context quotes the literal as given, as jansson does: only when up to 20 bytes.
// Errors never fall inside an edit (jansson does not stop inside a valid number or in the padding before it).
static void map_error_back(json_error_t *error, const char *s, const char *t, const EditList *edits, int failed) {
    size_t pos = error->position > 0 ? (size_t)error->position : 0;
    size_t line_start = pos;
    while (line_start > 0 && t[line_start - 1] != '\n') line_start--;
    long long shift = 0, line_shift = 0; // how much further pos is in t than in s: all edits, this line's
    const NumberEdit *quoted = NULL;
    for (size_t k = 0; k < edits->n; k++) {
        const NumberEdit *e = &edits->v[k];
        size_t at_new = (size_t)((long long)e->at + shift);
        if (pos < at_new + edit_span(e)) break;
        long long d = (long long)edit_span(e) - (long long)e->len;
        if (failed && pos == at_new + edit_span(e)) quoted = e;
        if (at_new >= line_start) line_shift += d;
        shift += d;
    }
    error->position = (int)((long long)pos - shift);
    if (!failed || error->line < 0) return;
    error->column -= (int)line_shift;
    if (!quoted) return;
    // jansson quoted the replacement token when it is up to 20 bytes; the literal as given replaces it. An
    // error "near end of file" right after the token is about the end, not the token.
    size_t xl = strlen(error->text), keep = xl;
    const char *eof = " near end of file";
    if (xl >= strlen(eof) && strcmp(error->text + xl - strlen(eof), eof) == 0) return;
    if (quoted->token_len <= 20) {
        char near[sizeof quoted->token + 16];
        snprintf(near, sizeof near, " near '%s'", quoted->token);
        size_t nl = strlen(near);
        if (xl < nl || strcmp(error->text + xl - nl, near) != 0) return;
        keep = xl - nl;
    }
    char code = error->text[JSON_ERROR_TEXT_LENGTH - 1];
    char text[JSON_ERROR_TEXT_LENGTH - 1]; // the last byte of error->text is the code's
    if (quoted->len <= 20)
        snprintf(text, sizeof text, "%.*s near '%.*s'", (int)keep, error->text, (int)quoted->len, s + quoted->at);
    else
        snprintf(text, sizeof text, "%.*s", (int)keep, error->text);
    memcpy(error->text, text, sizeof text);
    error->text[JSON_ERROR_TEXT_LENGTH - 1] = code;
}

json_t *json_read_buffer(const char *buffer, size_t len, size_t flags, json_error_t *error) {
    if (!buffer) return json_loadb(buffer, len, flags, error); // jansson's own "wrong arguments"
    EditList edits = {0};
    if (find_refused_numbers(buffer, len, flags, &edits) != 0) {
        free(edits.v);
        set_error(error, "<buffer>", json_error_out_of_memory, "out of memory");
        return NULL;
    }
    if (edits.n == 0) return json_loadb(buffer, len, flags, error);
    size_t tlen = 0;
    char *t = respell(buffer, len, &edits, &tlen);
    if (!t) {
        free(edits.v);
        set_error(error, "<buffer>", json_error_out_of_memory, "out of memory");
        return NULL;
    }
    json_t *root = json_loadb(t, tlen, flags, error);
    if (error) map_error_back(error, buffer, t, &edits, root == NULL);
    free(t);
    free(edits.v);
    return root;
}

json_t *json_read_file(const char *path, size_t flags, json_error_t *error) {
    if (!path) return json_load_file(path, flags, error); // jansson's own "wrong arguments"
    FILE *f = fopen(path, "rb");
    if (!f) {
        set_error(error, path, json_error_cannot_open_file, "unable to open %s: %s", path, strerror(errno));
        return NULL;
    }
    char *text = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            size_t grow = cap ? 2 * cap : 1 << 16;
            char *p = realloc(text, grow);
            if (!p) {
                free(text);
                fclose(f);
                set_error(error, path, json_error_out_of_memory, "out of memory reading %s", path);
                return NULL;
            }
            text = p;
            cap = grow;
        }
        size_t got = fread(text + len, 1, cap - len, f);
        len += got;
        if (got == 0) break;
    }
    int read_failed = ferror(f);
    int read_errno = errno;
    fclose(f);
    if (read_failed) {
        free(text);
        set_error(error, path, json_error_cannot_open_file, "unable to read %s: %s", path, strerror(read_errno));
        return NULL;
    }
    json_t *root = json_read_buffer(text, len, flags, error);
    free(text);
    // json_load_file names the stream, not the path, once the file is open.
    if (error) snprintf(error->source, sizeof error->source, "<stream>");
    return root;
}
