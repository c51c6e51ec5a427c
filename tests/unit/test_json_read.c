// tests/unit/test_json_read.c — json_read_buffer / json_read_file (shared/json_read.h): every valid JSON number is
// accepted (integers beyond int64 as the nearest double, overflowing reals as +-DBL_MAX), everything else is
// jansson's answer, errors included.
//
// Besides fixed cases, a property loop generates documents (nested objects and arrays; strings holding digits,
// exponents and escaped quotes; big integers, exponents up to +-450, negative zeros) and checks:
//   - the value read is the expected one bit for bit (jansson's value for each literal jansson accepts, the
//     clamped strtod value for the others);
//   - the same document with each refused literal swapped for an accepted one of the same length (its twin)
//     reads the same with jansson, and truncated or corrupted versions of the document fail here with exactly
//     the error (line, column, position, text, code) jansson gives for the twin corrupted the same way.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shared/json_read.h"
#include "tests/unit/check_macros.h"
#include "tests/unit/json_testlib.h"
#include "tests/unit/testlib.h"

// ---- comparing values and errors --------------------------------------------------------------------------

static int same_error(const json_error_t *a, const json_error_t *b) {
    return a->line == b->line && a->column == b->column && a->position == b->position &&
           strcmp(a->text, b->text) == 0 && json_error_code(a) == json_error_code(b);
}

static void show_error(const char *who, const json_error_t *e) {
    fprintf(stderr, "  %s: line %d column %d position %d code %d: %s\n", who, e->line, e->column, e->position,
            (int)json_error_code(e), e->text);
}

// Reads text (NUL-terminated) with json_read_buffer; NULL with a FAIL when refused.
static json_t *read_ok(const char *text, size_t flags) {
    json_error_t e;
    json_t *j = json_read_buffer(text, strlen(text), flags, &e);
    CHECK(j, "refused %s: %s", text, e.text);
    return j;
}

// A document that both jansson and json_read_buffer refuse, with the same error.
static void refused_like_jansson(const char *text, size_t flags) {
    json_error_t mine, theirs;
    json_t *a = json_read_buffer(text, strlen(text), flags, &mine);
    json_t *b = json_loadb(text, strlen(text), flags, &theirs);
    CHECK(!a && !b && same_error(&mine, &theirs), "'%s': not refused as jansson refuses it", text);
    if (a || b || !same_error(&mine, &theirs)) {
        show_error("json_read_buffer", &mine);
        show_error("json_loadb", &theirs);
    }
    json_decref(a);
    json_decref(b);
}

// ---- fixed cases ------------------------------------------------------------------------------------------

static double real_at(const json_t *root, size_t i) {
    const json_t *v = json_array_get(root, i);
    CHECK(json_is_real(v), "element %zu is not a real", i);
    return json_real_value(v);
}

static void test_numbers_jansson_refuses(void) {
    json_t *j = read_ok("{\"model_max_length\": 1000000000000000019884624838656}", 0);
    const json_t *m = json_object_get(j, "model_max_length");
    CHECK(json_is_real(m) && json_real_value(m) == 1000000000000000019884624838656.0, "model_max_length");
    json_decref(j);

    j = read_ok("[9223372036854775807, -9223372036854775808, 9223372036854775808, -9223372036854775809,"
                " 1e400, -1E+400, 1e309, 123456789012345678901234567890e300]",
                0);
    CHECK(json_is_integer(json_array_get(j, 0)) && json_integer_value(json_array_get(j, 0)) == INT64_MAX, "max");
    CHECK(json_is_integer(json_array_get(j, 1)) && json_integer_value(json_array_get(j, 1)) == INT64_MIN, "min");
    CHECK(real_at(j, 2) == 9223372036854775808.0 && real_at(j, 3) == -9223372036854775808.0, "past int64");
    CHECK(real_at(j, 4) == DBL_MAX && real_at(j, 5) == -DBL_MAX && real_at(j, 6) == DBL_MAX, "overflow");
    CHECK(real_at(j, 7) == DBL_MAX, "overflow through the mantissa");
    json_decref(j);

    // An integer of 400 digits overflows a double too.
    char big[420] = "[-";
    memset(big + 2, '7', 400);
    strcpy(big + 402, "]");
    j = read_ok(big, 0);
    CHECK(real_at(j, 0) == -DBL_MAX, "400-digit integer");
    json_decref(j);

    // What jansson accepts stays as jansson gives it: underflow to (negative) zero, negative zeros, exponents.
    j = read_ok("[-1e-400, 0.5e-3, 1e5, -0, -0.0, 2.5E-2, 1e-310]", 0);
    CHECK(real_at(j, 0) == 0 && signbit(real_at(j, 0)), "-1e-400 is -0.0");
    CHECK(real_at(j, 1) == 0.5e-3 && real_at(j, 2) == 1e5 && real_at(j, 5) == 2.5e-2, "exponents");
    CHECK(json_is_integer(json_array_get(j, 3)) && json_integer_value(json_array_get(j, 3)) == 0, "-0");
    CHECK(signbit(real_at(j, 4)), "-0.0 keeps its sign");
    CHECK(real_at(j, 6) > 0 && real_at(j, 6) < DBL_MIN, "subnormal");
    json_decref(j);

    // Flags pass through: top-level scalars, integers read as reals, duplicate keys.
    json_error_t e;
    j = json_read_buffer("1e400", 5, JSON_DECODE_ANY, &e);
    CHECK(json_is_real(j) && json_real_value(j) == DBL_MAX, "top-level 1e400");
    json_decref(j);
    j = read_ok("[1, 99999999999999999999]", JSON_DECODE_INT_AS_REAL);
    CHECK(real_at(j, 0) == 1.0 && real_at(j, 1) == 1e20, "JSON_DECODE_INT_AS_REAL");
    json_decref(j);
    j = json_read_buffer("{\"a\": 99999999999999999999, \"a\": 1}", 35, JSON_REJECT_DUPLICATES, &e);
    CHECK(!j && json_error_code(&e) == json_error_duplicate_key && e.position == 31, "duplicate key: %s", e.text);

    // Digits inside strings are text, escaped quotes included.
    j = read_ok("[\"\\\"99999999999999999999\\\" 1e400\", \"\\\\\", 99999999999999999999, \"e\\u00411\"]", 0);
    CHECK(strcmp(json_string_value(json_array_get(j, 0)), "\"99999999999999999999\" 1e400") == 0, "string");
    CHECK(strcmp(json_string_value(json_array_get(j, 1)), "\\") == 0, "backslash");
    CHECK(real_at(j, 2) == 1e20, "number after strings");
    json_decref(j);
}

static void test_invalid_numbers(void) {
    const char *bad[] = {"[01]", "[1.]", "[.5]", "[+1]", "[1e]", "[1e+]", "[-]", "[--1]", "[1.e5]", "[0x10]",
                         "[-01]", "[1E-]", "[Infinity]", "[NaN]", "[1 2]", "[1,]", "{\"a\" 1}", "[1e400",
                         "[99999999999999999999,", "", "  ", "[\"1e400]"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        json_error_t e;
        json_t *j = json_read_buffer(bad[i], strlen(bad[i]), 0, &e);
        CHECK(!j && e.text[0], "'%s' accepted", bad[i]);
        json_decref(j);
    }
    // With nothing refused before them, the errors are jansson's.
    for (size_t i = 0; i < 17; i++) refused_like_jansson(bad[i], 0);
}

// A document with literals jansson refuses fails like its twin (each such literal swapped for an accepted one of
// the same length) does with jansson.
static void fails_like_twin(const char *text, const char *twin) {
    json_error_t mine, theirs;
    json_t *a = json_read_buffer(text, strlen(text), 0, &mine);
    json_t *b = json_loadb(twin, strlen(twin), 0, &theirs);
    CHECK(!a && !b && same_error(&mine, &theirs), "'%s' does not fail as its twin '%s'", text, twin);
    if (a || b || !same_error(&mine, &theirs)) {
        show_error("json_read_buffer", &mine);
        show_error("json_loadb (twin)", &theirs);
    }
    json_decref(a);
    json_decref(b);
}

// Errors after a respelled literal point at the text as given.
static void test_error_positions(void) {
    json_error_t e;
    const char *t = "[1e400, 99999999999999999999, }";
    json_t *j = json_read_buffer(t, strlen(t), 0, &e);
    CHECK(!j && e.line == 1 && e.column == 31 && e.position == 31 && strcmp(e.text, "unexpected token near '}'") == 0,
          "after two literals: column %d position %d '%s'", e.column, e.position, e.text);
    fails_like_twin(t, "[0.000, 0.000000000000000000, }");
    fails_like_twin("{\"a\": [1e400,\n  -1e999, 99999999999999999999999],\n \"b\": 2 3}",
                    "{\"a\": [0.000,\n  -0.000, 0.000000000000000000000],\n \"b\": 2 3}");
    fails_like_twin("[-99999999999999999999999999999999999999999, \"\\\"1e400\", tru]",
                    "[-0.000000000000000000000000000000000000000, \"\\\"1e400\", tru]");
    // The error is about the literal itself: it is quoted as given (up to 20 bytes, as jansson quotes tokens).
    t = "{99999999999999999999: 1}";
    j = json_read_buffer(t, strlen(t), 0, &e);
    CHECK(!j && e.column == 21 && e.position == 21 &&
              strcmp(e.text, "string or '}' expected near '99999999999999999999'") == 0 &&
              json_error_code(&e) == json_error_invalid_syntax,
          "literal as key: column %d position %d '%s'", e.column, e.position, e.text);
    t = "[1e400, 1e400 1e400, 1]";
    j = json_read_buffer(t, strlen(t), 0, &e);
    CHECK(!j && e.column == 19 && e.position == 19 && strcmp(e.text, "']' expected near '1e400'") == 0, "'%s'", e.text);
    t = "[1] 1e400";
    j = json_read_buffer(t, strlen(t), 0, &e);
    CHECK(!j && e.position == 9 && strcmp(e.text, "end of file expected near '1e400'") == 0, "'%s'", e.text);
    t = "[1] 999999999999999999999";
    j = json_read_buffer(t, strlen(t), 0, &e);
    CHECK(!j && e.position == 25 && strcmp(e.text, "end of file expected") == 0, "'%s'", e.text);
    // On success, JSON_DISABLE_EOF_CHECK reports how far the value went, in the text as given.
    t = "[1e400, 99999999999999999999] trailing";
    j = json_read_buffer(t, strlen(t), JSON_DISABLE_EOF_CHECK, &e);
    CHECK(j && e.position == 29, "position after the value: %d", e.position);
    json_decref(j);
}

static void test_file(void) {
    char path[] = "/tmp/tandem_json_read_XXXXXX";
    int fd = mkstemp(path);
    REQUIRE(fd >= 0, "mkstemp");
    const char *text = "{\"model_max_length\": 1000000000000000019884624838656,\n \"x\": [1e400]}";
    REQUIRE(write(fd, text, strlen(text)) == (ssize_t)strlen(text), "write");
    close(fd);
    json_error_t e;
    json_t *j = json_read_file(path, 0, &e);
    CHECK(j && json_real_value(json_object_get(j, "model_max_length")) == 1e30, "file: %s", j ? "" : e.text);
    CHECK(strcmp(e.source, "<stream>") == 0, "source '%s'", e.source);
    json_decref(j);
    write_text_file(path, "{\"a\": 1e400,\n \"b\": }");
    j = json_read_file(path, 0, &e);
    CHECK(!j && e.line == 2 && e.column == 7 && e.position == 20 && strcmp(e.text, "unexpected token near '}'") == 0 &&
              strcmp(e.source, "<stream>") == 0,
          "file error: line %d column %d position %d '%s' from '%s'", e.line, e.column, e.position, e.text, e.source);
    json_error_t theirs;
    unlink(path);
    j = json_read_file(path, 0, &e);
    json_t *k = json_load_file(path, 0, &theirs);
    CHECK(!j && !k && same_error(&e, &theirs) && strcmp(e.source, theirs.source) == 0 &&
              json_error_code(&e) == json_error_cannot_open_file,
          "missing file: '%s'", e.text);
}

// ---- the property loop ------------------------------------------------------------------------------------

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static uint64_t next_random(void) { // xorshift64*
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 2685821657736338717ULL;
}
static int below(int n) { return (int)(next_random() % (uint64_t)n); }

typedef struct {
    char *s;
    size_t n, cap;
} Text;

static void put_n(Text *t, const char *s, size_t n) {
    if (t->n + n + 1 > t->cap) {
        t->cap = 2 * (t->n + n + 1);
        t->s = realloc(t->s, t->cap);
        REQUIRE(t->s, "out of memory");
    }
    memcpy(t->s + t->n, s, n);
    t->n += n;
    t->s[t->n] = '\0';
}
static void put(Text *t, const char *s) { put_n(t, s, strlen(s)); }

#define MAX_SPANS 512
typedef struct {
    size_t at, len;
    int refused;
} Span;

// A document and its twin, written in step (same lengths everywhere), and where their number literals are.
typedef struct {
    Text doc, twin;
    Span numbers[MAX_SPANS];
    int n_numbers;
    int n_keys;
} Gen;

static void put_both(Gen *g, const char *s) {
    put(&g->doc, s);
    put(&g->twin, s);
}

static void put_digits(Text *t, int count, int first_nonzero) {
    for (int i = 0; i < count; i++) {
        char c = (char)('0' + (i == 0 && first_nonzero ? 1 + below(9) : below(10)));
        put_n(t, &c, 1);
    }
}

// A random number literal: small and boundary integers, integers of 19-45 and 305-420 digits, reals with
// exponents up to +-450, zeros of both signs.
static void number_literal(Text *lit) {
    static const char *fixed[] = {"9223372036854775807", "-9223372036854775808", "9223372036854775808",
                                  "-9223372036854775809", "18446744073709551616", "-0", "-0.0", "0.0", "0e0",
                                  "-0E-0", "1e5", "1E+400", "-1e-400", "0.5e-3", "1e308", "1.8e308", "-1e309"};
    switch (below(6)) {
    case 0: {
        char b[32];
        snprintf(b, sizeof b, "%lld", (long long)(next_random() % 2000000000000000ULL) - 1000000000000000LL);
        put(lit, b);
        return;
    }
    case 1: put(lit, fixed[below((int)(sizeof fixed / sizeof *fixed))]); return;
    case 2:
        if (below(2)) put(lit, "-");
        put_digits(lit, 19 + below(27), 1);
        return;
    case 3:
        if (below(2)) put(lit, "-");
        put_digits(lit, 305 + below(116), 1);
        return;
    default:
        if (below(2)) put(lit, "-");
        if (below(3)) put_digits(lit, 1 + below(6), 1);
        else put(lit, "0");
        if (below(2)) {
            put(lit, ".");
            put_digits(lit, 1 + below(20), 0);
        }
        put(lit, below(2) ? "e" : "E");
        put(lit, below(3) == 0 ? "+" : below(2) ? "-" : "");
        char b[8];
        snprintf(b, sizeof b, "%d", below(451));
        put(lit, b);
        return;
    }
}

// Appends a number to both texts; returns the value a reader must give for it.
static json_t *gen_number(Gen *g) {
    Text lit = {0};
    number_literal(&lit);
    json_t *theirs = json_loadb(lit.s, lit.n, JSON_DECODE_ANY, NULL);
    int refused = theirs == NULL;
    if (refused) {
        double d = strtod(lit.s, NULL);
        theirs = json_real(isinf(d) ? copysign(DBL_MAX, d) : d);
    }
    REQUIRE(g->n_numbers < MAX_SPANS, "too many numbers");
    g->numbers[g->n_numbers++] = (Span){g->doc.n, lit.n, refused};
    put(&g->doc, lit.s);
    if (refused) { // the twin: an accepted literal of the same length, 0.000... (lengths here are >= 5)
        int neg = lit.s[0] == '-';
        put(&g->twin, neg ? "-0." : "0.");
        for (size_t i = (size_t)neg + 2; i < lit.n; i++) put(&g->twin, "0");
    } else {
        put(&g->twin, lit.s);
    }
    free(lit.s);
    return theirs;
}

// A string with digits, exponents, escaped quotes and backslashes; returns its value.
static json_t *gen_string(Gen *g, const char *prefix) {
    static const char *piece[][2] = {{"7", "7"}, {"1e400", "1e400"}, {"99999999999999999999", "99999999999999999999"},
                                     {"\\\"", "\""}, {"\\\\", "\\"}, {"\\u0041", "A"}, {"\\n", "\n"}, {"-", "-"},
                                     {"e", "e"}, {"\\\"5\\\"", "\"5\""}, {" ", " "}, {"\\/", "/"}};
    Text value = {0};
    put_both(g, "\"");
    put(&value, "");
    if (prefix) {
        put_both(g, prefix);
        put(&value, prefix);
    }
    for (int i = below(6); i > 0; i--) {
        int k = below((int)(sizeof piece / sizeof *piece));
        put_both(g, piece[k][0]);
        put(&value, piece[k][1]);
    }
    put_both(g, "\"");
    json_t *v = json_stringn(value.s, value.n);
    free(value.s);
    return v;
}

static void gen_space(Gen *g) {
    static const char *ws[] = {"", "", " ", "\n", "\t", "\r\n  ", "  "};
    put_both(g, ws[below((int)(sizeof ws / sizeof *ws))]);
}

static json_t *gen_value(Gen *g, int depth);

static json_t *gen_container(Gen *g, int depth, int object) {
    json_t *v = object ? json_object() : json_array();
    put_both(g, object ? "{" : "[");
    int n = below(6);
    for (int i = 0; i < n; i++) {
        if (i) put_both(g, ",");
        gen_space(g);
        if (object) {
            char key[16];
            snprintf(key, sizeof key, "k%d_", g->n_keys++); // unique keys: the expected object keeps them all
            json_t *k = gen_string(g, key);
            gen_space(g);
            put_both(g, ":");
            gen_space(g);
            json_object_set_new(v, json_string_value(k), gen_value(g, depth + 1));
            json_decref(k);
        } else {
            json_array_append_new(v, gen_value(g, depth + 1));
        }
        gen_space(g);
    }
    put_both(g, object ? "}" : "]");
    return v;
}

static json_t *gen_value(Gen *g, int depth) {
    int k = below(depth >= 4 ? 6 : 8);
    switch (k) {
    case 0:
    case 1:
    case 2: return gen_number(g);
    case 3: return gen_string(g, NULL);
    case 4: put_both(g, "true"); return json_true();
    case 5:
        if (below(2)) {
            put_both(g, "null");
            return json_null();
        }
        put_both(g, "false");
        return json_false();
    default: return gen_container(g, depth, k == 6);
    }
}

// Reads `doc` here and `twin` with jansson, both corrupted the same way. Where jansson accepts the twin (a
// corruption inside a string), the document must be accepted too; otherwise both fail with the same error, except
// that where jansson quotes the twin's token "near '...'", the quote is the document's bytes at that place (a
// refused literal is quoted as given). Returns 1 when checked; 0 when the twin holds a literal jansson refuses, which
// leaves no oracle.
static int corrupted_like_twin(const Text *doc, const Text *twin, const char *what) {
    json_error_t mine, theirs;
    json_t *a = json_read_buffer(doc->s, doc->n, 0, &mine);
    json_t *b = json_loadb(twin->s, twin->n, 0, &theirs);
    int ok;
    if (!b && json_error_code(&theirs) == json_error_numeric_overflow) { // a stray '"' made string digits a number
        json_decref(a);
        return 0;
    }
    if (b) {
        ok = a != NULL;
    } else {
        char expected[JSON_ERROR_TEXT_LENGTH];
        snprintf(expected, sizeof expected, "%s", theirs.text);
        char *near = strstr(expected, " near '");
        size_t pos = (size_t)theirs.position, qlen = near ? strlen(near + 7) - 1 : 0;
        if (near && near[7 + qlen] == '\'' && qlen <= pos && pos <= doc->n)
            memcpy(near + 7, doc->s + pos - qlen, qlen);
        ok = !a && mine.line == theirs.line && mine.column == theirs.column && mine.position == theirs.position &&
             json_error_code(&mine) == json_error_code(&theirs) && strcmp(mine.text, expected) == 0;
    }
    CHECK(ok, "%s: document %s\n  twin %s", what, doc->s, twin->s);
    if (!ok) {
        show_error("json_read_buffer", &mine);
        show_error("jansson (twin)", &theirs);
    }
    json_decref(a);
    json_decref(b);
    return ok;
}

static void test_generated_documents(void) {
    static const char *bad_tokens[] = {"01", "1.", ".5", "+1", "1e", "-", "1e+", "--1", "1.e5", "-01", "1E-"};
    int docs = 0, with_refused = 0, corrupted = 0;
    for (int round = 0; round < 3000 && failures < 20; round++) {
        Gen g = {0};
        put_both(&g, below(2) ? " " : "");
        json_t *expected = gen_container(&g, 0, below(2));
        gen_space(&g);
        int refused = 0;
        for (int i = 0; i < g.n_numbers; i++) refused += g.numbers[i].refused;
        with_refused += refused > 0;
        docs++;

        json_error_t e;
        json_t *mine = json_read_buffer(g.doc.s, g.doc.n, 0, &e);
        CHECK(mine && json_same_value(mine, expected), "document %s: %s", g.doc.s, mine ? "other values" : e.text);
        json_t *twin = json_loadb(g.twin.s, g.twin.n, 0, &e);
        REQUIRE(twin, "twin refused by jansson: %s (%s)", g.twin.s, e.text);
        if (!refused) CHECK(json_same_value(mine, twin), "no refused literal, yet not jansson's values: %s", g.doc.s);
        json_decref(mine);
        json_decref(twin);
        json_decref(expected);

        // Truncated anywhere before the closing bracket (but not inside a refused literal).
        size_t end = g.doc.n;
        while (end > 0 && strchr(" \t\r\n", g.doc.s[end - 1])) end--;
        size_t cut = (size_t)below((int)end);
        int inside = 0;
        for (int i = 0; i < g.n_numbers; i++)
            inside |= g.numbers[i].refused && cut > g.numbers[i].at && cut < g.numbers[i].at + g.numbers[i].len;
        if (!inside) {
            Text d = {0}, t = {0};
            put_n(&d, g.doc.s, cut);
            put_n(&t, g.twin.s, cut);
            corrupted += corrupted_like_twin(&d, &t, "truncated");
            free(d.s);
            free(t.s);
        }
        // One number literal replaced by a malformed one.
        if (g.n_numbers > 0) {
            const Span *sp = &g.numbers[below(g.n_numbers)];
            const char *bad = bad_tokens[below((int)(sizeof bad_tokens / sizeof *bad_tokens))];
            Text d = {0}, t = {0};
            put_n(&d, g.doc.s, sp->at);
            put(&d, bad);
            put(&d, g.doc.s + sp->at + sp->len);
            put_n(&t, g.twin.s, sp->at);
            put(&t, bad);
            put(&t, g.twin.s + sp->at + sp->len);
            corrupted += corrupted_like_twin(&d, &t, "malformed number");
            free(d.s);
            free(t.s);
        }
        // A stray byte anywhere but inside a refused literal.
        {
            size_t at = (size_t)below((int)g.doc.n + 1);
            inside = 0;
            for (int i = 0; i < g.n_numbers; i++)
                inside |= g.numbers[i].refused && at > g.numbers[i].at && at < g.numbers[i].at + g.numbers[i].len;
            if (!inside) {
                char stray[2] = {",:]}x[{\"\\"[below(9)], 0};
                Text d = {0}, t = {0};
                put_n(&d, g.doc.s, at);
                put(&d, stray);
                put(&d, g.doc.s + at);
                put_n(&t, g.twin.s, at);
                put(&t, stray);
                put(&t, g.twin.s + at);
                corrupted += corrupted_like_twin(&d, &t, "stray byte");
                free(d.s);
                free(t.s);
            }
        }
        free(g.doc.s);
        free(g.twin.s);
    }
    CHECK(with_refused > docs / 3, "only %d of %d documents had a literal jansson refuses", with_refused, docs);
    CHECK(corrupted > 2 * docs, "only %d corrupted documents checked", corrupted);
    printf("generated documents: %d (%d with literals jansson refuses), %d corrupted versions\n", docs, with_refused,
           corrupted);
}

int main(void) {
    test_numbers_jansson_refuses();
    test_invalid_numbers();
    test_error_positions();
    test_file();
    test_generated_documents();
    return check_exit_code("test_json_read");
}
