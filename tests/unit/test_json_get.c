// tests/unit/test_json_get.c — the typed JSON getters of shared/json_get.h: each type read, defaults of absent
// optional members, null as absent or as a value, range and length refusals, missing required members, wrong
// types, every valid JSON number (big integers and exponents, as shared/json_read.h reads them), whole reals as
// integers where asked, the HTTP API's wording, and the full path of the value, the document's name and the
// caller's failure code in every message.
#include <float.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "shared/json_get.h"
#include "shared/json_read.h"
#include "tests/unit/check_macros.h"

static char err[512];

// Parses text with tandem's reader (every valid JSON number accepted); NULL bytes in strings allowed.
static json_t *parse(const char *text) {
    json_error_t je;
    json_t *j = json_read_buffer(text, strlen(text), JSON_ALLOW_NUL, &je);
    REQUIRE(j != NULL, "cannot parse %s: %s", text, je.text);
    return j;
}

// A document named "doc.json", null read as absent, failures returned as -7.
static JsonAt doc_at(const json_t *root) { return json_at_document(root, "doc.json", 1, -7, err, sizeof err); }

// The call failed with the document's code and exactly the message `want`.
#define CHECK_REFUSED(call, want)                                                                                      \
    do {                                                                                                               \
        err[0] = '\0';                                                                                                 \
        int rc_ = (call);                                                                                              \
        CHECK(rc_ == -7 && strcmp(err, want) == 0, "%s: rc %d, message '%s', want '%s'", #call, rc_, err, want);      \
    } while (0)

static void test_each_type(void) {
    json_t *root = parse("{\"i\": -12, \"x\": 2.5, \"n\": 7, \"b\": true, \"f\": false, \"s\": \"text\", "
                         "\"o\": {\"k\": 1}, \"a\": [1, 2, 3]}");
    JsonAt at = doc_at(root);
    int64_t i64 = 0;
    int i = 0, b = -1;
    double x = 0;
    const char *s = NULL;
    size_t len = 0;
    CHECK(json_get_int64(&at, "i", JSON_GET_REQUIRED, 0, -100, 100, &i64) == 0 && i64 == -12, "int64 %lld",
          (long long)i64);
    CHECK(json_get_int(&at, "n", JSON_GET_REQUIRED, 0, 0, 10, &i) == 0 && i == 7, "int %d", i);
    CHECK(json_get_double(&at, "x", JSON_GET_REQUIRED, 0, 0, 10, &x) == 0 && x == 2.5, "double %g", x);
    CHECK(json_get_double(&at, "n", JSON_GET_REQUIRED, 0, 0, 10, &x) == 0 && x == 7.0, "an integer as a number: %g", x);
    CHECK(json_get_bool(&at, "b", JSON_GET_REQUIRED, 0, &b) == 0 && b == 1, "true read as %d", b);
    CHECK(json_get_bool(&at, "f", JSON_GET_REQUIRED, 1, &b) == 0 && b == 0, "false read as %d", b);
    CHECK(json_get_string(&at, "s", JSON_GET_REQUIRED, NULL, 4, &s, &len) == 0 && s && strcmp(s, "text") == 0 &&
              len == 4,
          "string '%s' (%zu bytes), at its longest allowed", s ? s : "(null)", len);
    JsonAt o, a;
    CHECK(json_get_object(&at, "o", JSON_GET_REQUIRED, &o) == 0 && json_is_object(o.json) &&
              strcmp(o.path, "o") == 0,
          "object at '%s'", o.path);
    CHECK(json_get_int(&o, "k", JSON_GET_REQUIRED, 0, 0, 5, &i) == 0 && i == 1, "member of the object: %d", i);
    CHECK(json_get_array(&at, "a", JSON_GET_REQUIRED, &a) == 0 && json_array_size(a.json) == 3, "array");
    JsonAt third = json_at_element(&a, 2);
    CHECK(json_get_int(&third, NULL, JSON_GET_REQUIRED, 0, 0, 5, &i) == 0 && i == 3, "element [2] read as %d", i);
    CHECK(strcmp(third.path, "a[2]") == 0, "element path '%s'", third.path);
    json_decref(root);
}

static void test_absent_and_null(void) {
    json_t *root = parse("{\"z\": null, \"s\": \"v\"}");
    JsonAt at = doc_at(root);
    int64_t i64 = 0;
    int b = -1;
    double x = 0;
    const char *s = "unset";
    size_t len = 99;
    // absent and null optional members take their defaults where null is absent
    CHECK(json_get_int64(&at, "missing", JSON_GET_OPTIONAL, 42, 0, 1, &i64) == 0 && i64 == 42,
          "default outside the range is kept as given: %lld", (long long)i64);
    CHECK(json_get_double(&at, "z", JSON_GET_OPTIONAL, 0.5, 0, 1, &x) == 0 && x == 0.5, "null -> default %g", x);
    CHECK(json_get_bool(&at, "z", JSON_GET_OPTIONAL, 1, &b) == 0 && b == 1, "null -> default %d", b);
    CHECK(json_get_string(&at, "z", JSON_GET_OPTIONAL, "dflt", JSON_ANY_LENGTH, &s, &len) == 0 &&
              strcmp(s, "dflt") == 0 && len == 4,
          "null -> default string '%s' %zu", s, len);
    CHECK(json_get_string(&at, "missing", JSON_GET_OPTIONAL, NULL, JSON_ANY_LENGTH, &s, &len) == 0 && !s && len == 0,
          "absent -> NULL default");
    JsonAt o;
    CHECK(json_get_object(&at, "z", JSON_GET_OPTIONAL, &o) == 0 && o.json == NULL, "null object -> absent");
    CHECK(json_get_present(&at, "s") == 1 && json_get_present(&at, "z") == 0 && json_get_present(&at, "missing") == 0,
          "presence where null is absent");
    // required: absent is missing, null is of the wrong type
    CHECK_REFUSED(json_get_int64(&at, "missing", JSON_GET_REQUIRED, 0, 0, 1, &i64),
                  "doc.json: missing field \"missing\"");
    CHECK_REFUSED(json_get_int64(&at, "z", JSON_GET_REQUIRED, 0, 0, 1, &i64),
                  "doc.json: field \"z\" must be an integer, got null");

    // where null is a value (the ZeroMQ messages), an optional null is of the wrong type, and present
    JsonAt strict = json_at_document(root, "generate", 0, -1, err, sizeof err);
    CHECK(json_get_present(&strict, "z") == 1, "null is present where it is a value");
    CHECK(json_get_bool(&strict, "z", JSON_GET_OPTIONAL, 0, &b) == -1 &&
              strcmp(err, "generate: field \"z\" must be true or false, got null") == 0,
          "strict null: '%s'", err);
    CHECK(json_get_bool(&strict, "missing", JSON_GET_OPTIONAL, 1, &b) == 0 && b == 1, "absent still optional");
    json_decref(root);
}

static void test_wrong_types(void) {
    json_t *root = parse("{\"s\": \"1\", \"r\": 1.5, \"two\": 2.0, \"i\": 1, \"b\": false, \"o\": {}, \"a\": []}");
    JsonAt at = doc_at(root);
    int64_t i64 = 123;
    int b = 5;
    double x = 9;
    const char *s = NULL;
    JsonAt sub;
    CHECK_REFUSED(json_get_int64(&at, "s", JSON_GET_REQUIRED, 0, 0, 9, &i64),
                  "doc.json: field \"s\" must be an integer, got a string");
    CHECK_REFUSED(json_get_int64(&at, "r", JSON_GET_REQUIRED, 0, 0, 9, &i64),
                  "doc.json: field \"r\" must be an integer, got a real number");
    CHECK_REFUSED(json_get_int64(&at, "two", JSON_GET_OPTIONAL, 0, 0, 9, &i64),
                  "doc.json: field \"two\" must be an integer, got a real number");
    CHECK_REFUSED(json_get_int64(&at, "b", JSON_GET_REQUIRED, 0, 0, 9, &i64),
                  "doc.json: field \"b\" must be an integer, got a boolean");
    CHECK(i64 == 123, "a refusal leaves *out alone (%lld)", (long long)i64);
    CHECK_REFUSED(json_get_double(&at, "s", JSON_GET_REQUIRED, 0, 0, 9, &x),
                  "doc.json: field \"s\" must be a number, got a string");
    CHECK_REFUSED(json_get_double(&at, "o", JSON_GET_OPTIONAL, 0, 0, 9, &x),
                  "doc.json: field \"o\" must be a number, got an object");
    CHECK(x == 9, "a refusal leaves *out alone (%g)", x);
    CHECK_REFUSED(json_get_bool(&at, "i", JSON_GET_REQUIRED, 0, &b),
                  "doc.json: field \"i\" must be true or false, got an integer");
    CHECK(b == 5, "a refusal leaves *out alone (%d)", b);
    CHECK_REFUSED(json_get_string(&at, "a", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL),
                  "doc.json: field \"a\" must be a string, got an array");
    CHECK_REFUSED(json_get_object(&at, "a", JSON_GET_REQUIRED, &sub),
                  "doc.json: field \"a\" must be an object, got an array");
    CHECK_REFUSED(json_get_array(&at, "o", JSON_GET_REQUIRED, &sub),
                  "doc.json: field \"o\" must be an array, got an object");
    json_decref(root);
}

static void test_ranges(void) {
    json_t *root = parse("{\"small\": -3, \"big\": 70000, \"x\": 1.25, \"name\": \"abcdef\", \"edge\": 4}");
    JsonAt at = doc_at(root);
    int i = 0;
    int64_t i64 = 0;
    double x = 0;
    const char *s = NULL;
    CHECK_REFUSED(json_get_int(&at, "small", JSON_GET_REQUIRED, 0, 0, 10, &i),
                  "doc.json: field \"small\" is -3, outside [0, 10]");
    CHECK_REFUSED(json_get_int(&at, "big", JSON_GET_REQUIRED, 0, 1, 65536, &i),
                  "doc.json: field \"big\" is 70000, outside [1, 65536]");
    CHECK(json_get_int(&at, "edge", JSON_GET_REQUIRED, 0, 4, 4, &i) == 0 && i == 4, "both bounds inclusive");
    CHECK(json_get_int64(&at, "big", JSON_GET_REQUIRED, 0, INT64_MIN, INT64_MAX, &i64) == 0 && i64 == 70000,
          "the whole int64 range");
    CHECK_REFUSED(json_get_double(&at, "x", JSON_GET_REQUIRED, 0, 0, 1, &x),
                  "doc.json: field \"x\" is 1.25, outside [0, 1]");
    CHECK(json_get_double(&at, "x", JSON_GET_REQUIRED, 0, 1.25, 1.25, &x) == 0 && x == 1.25, "inclusive bounds");
    CHECK_REFUSED(json_get_string(&at, "name", JSON_GET_REQUIRED, NULL, 5, &s, NULL),
                  "doc.json: field \"name\" is 6 bytes long, at most 5 allowed");
    json_decref(root);
}

// Every valid JSON number is read (shared/json_read.h): integers beyond int64 arrive as reals, so an integer
// member calls them out of range; overflowing exponents are +-DBL_MAX.
static void test_numbers(void) {
    json_t *root = parse("{\"max\": 9223372036854775807, \"min\": -9223372036854775808, \"over\": 9223372036854775808, "
                         "\"huge\": 1000000000000000019884624838656, \"neg_huge\": -1e30, \"e_int\": 2e3, "
                         "\"e_big\": 1e400, \"e_neg\": -1E+400, \"e_small\": 5e-324, \"exp_frac\": 1.5e2}");
    JsonAt at = doc_at(root);
    int64_t i64 = 0;
    double x = 0;
    CHECK(json_get_int64(&at, "max", JSON_GET_REQUIRED, 0, INT64_MIN, INT64_MAX, &i64) == 0 && i64 == INT64_MAX,
          "INT64_MAX read exactly");
    CHECK(json_get_int64(&at, "min", JSON_GET_REQUIRED, 0, INT64_MIN, INT64_MAX, &i64) == 0 && i64 == INT64_MIN,
          "INT64_MIN read exactly");
    CHECK_REFUSED(json_get_int64(&at, "over", JSON_GET_REQUIRED, 0, INT64_MIN, INT64_MAX, &i64),
                  "doc.json: field \"over\" is 9.2233720368547758e+18, outside [-9223372036854775808, "
                  "9223372036854775807]");
    CHECK_REFUSED(json_get_int(&at, "huge", JSON_GET_REQUIRED, 0, 1, 100, &(int){0}),
                  "doc.json: field \"huge\" is 1e+30, outside [1, 100]");
    CHECK_REFUSED(json_get_int(&at, "neg_huge", JSON_GET_REQUIRED, 0, 1, 100, &(int){0}),
                  "doc.json: field \"neg_huge\" is -1e+30, outside [1, 100]");
    CHECK(json_get_double(&at, "huge", JSON_GET_REQUIRED, 0, -DBL_MAX, DBL_MAX, &x) == 0 && x == 1e30,
          "a big integer as a number: %.17g", x);
    // an exponent makes a real: not an integer, though its value is whole
    CHECK_REFUSED(json_get_int(&at, "e_int", JSON_GET_REQUIRED, 0, 0, 5000, &(int){0}),
                  "doc.json: field \"e_int\" must be an integer, got a real number");
    CHECK(json_get_double(&at, "e_int", JSON_GET_REQUIRED, 0, 0, 5000, &x) == 0 && x == 2000.0, "2e3 = %g", x);
    CHECK(json_get_double(&at, "exp_frac", JSON_GET_REQUIRED, 0, 0, 500, &x) == 0 && x == 150.0, "1.5e2 = %g", x);
    CHECK(json_get_double(&at, "e_big", JSON_GET_REQUIRED, 0, -DBL_MAX, DBL_MAX, &x) == 0 && x == DBL_MAX,
          "1e400 reads as DBL_MAX: %g", x);
    CHECK(json_get_double(&at, "e_neg", JSON_GET_REQUIRED, 0, -DBL_MAX, DBL_MAX, &x) == 0 && x == -DBL_MAX,
          "-1E+400 reads as -DBL_MAX: %g", x);
    CHECK_REFUSED(json_get_double(&at, "e_big", JSON_GET_REQUIRED, 0, 0, 1e300, &x),
                  "doc.json: field \"e_big\" is 1.79769e+308, outside [0, 1e+300]");
    CHECK_REFUSED(json_get_int64(&at, "e_big", JSON_GET_REQUIRED, 0, 0, 10, &i64),
                  "doc.json: field \"e_big\" is 1.7976931348623157e+308, outside [0, 10]");
    CHECK(json_get_double(&at, "e_small", JSON_GET_REQUIRED, 0, 0, 1, &x) == 0 && x > 0 && x < 1e-300,
          "the smallest subnormal: %g", x);
    json_decref(root);
}

// Paths: nested objects joined with '.', indexes as [i] (outside the quotes at the end), the top level by name,
// no document name, long paths cut.
static void test_paths(void) {
    json_t *root = parse("{\"rope_scaling\": {\"factor\": \"8\"}, \"ids\": [1, -2], "
                         "\"added_tokens\": [{\"content\": \"a\"}, {\"content\": 5}], \"grid\": [[0, [1, \"x\"]]]}");
    JsonAt at = doc_at(root);
    JsonAt rope, ids, tokens, grid;
    double x;
    int i;
    const char *s;
    REQUIRE(json_get_object(&at, "rope_scaling", JSON_GET_REQUIRED, &rope) == 0, "%s", err);
    CHECK_REFUSED(json_get_double(&rope, "factor", JSON_GET_REQUIRED, 0, 0, 100, &x),
                  "doc.json: field \"rope_scaling.factor\" must be a number, got a string");
    CHECK_REFUSED(json_get_double(&rope, "low_freq_factor", JSON_GET_REQUIRED, 0, 0, 100, &x),
                  "doc.json: missing field \"rope_scaling.low_freq_factor\"");
    REQUIRE(json_get_array(&at, "ids", JSON_GET_REQUIRED, &ids) == 0, "%s", err);
    JsonAt second = json_at_element(&ids, 1);
    CHECK_REFUSED(json_get_int(&second, NULL, JSON_GET_REQUIRED, 0, 0, 9, &i),
                  "doc.json: field \"ids\"[1] is -2, outside [0, 9]");
    JsonAt past_end = json_at_element(&ids, 7);
    CHECK_REFUSED(json_get_int(&past_end, NULL, JSON_GET_REQUIRED, 0, 0, 9, &i), "doc.json: missing field \"ids\"[7]");
    REQUIRE(json_get_array(&at, "added_tokens", JSON_GET_REQUIRED, &tokens) == 0, "%s", err);
    JsonAt token = json_at_element(&tokens, 1);
    CHECK_REFUSED(json_get_string(&token, "content", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL),
                  "doc.json: field \"added_tokens[1].content\" must be a string, got an integer");
    CHECK_REFUSED(json_get_fail(&token, NULL, "gets id %d, which is too large", 99),
                  "doc.json: field \"added_tokens\"[1] gets id 99, which is too large");
    REQUIRE(json_get_array(&at, "grid", JSON_GET_REQUIRED, &grid) == 0, "%s", err);
    JsonAt row = json_at_element(&grid, 0), cell = json_at_element(&row, 1), inner = json_at_element(&cell, 1);
    CHECK_REFUSED(json_get_int(&inner, NULL, JSON_GET_REQUIRED, 0, 0, 9, &i),
                  "doc.json: field \"grid\"[0][1][1] must be an integer, got a string");
    JsonAt top;
    CHECK_REFUSED(json_get_array(&at, NULL, JSON_GET_REQUIRED, &top),
                  "doc.json: the top level must be an array, got an object");

    // a value handed over alone, named by the caller (the GRPO options)
    JsonAt options = json_at_document(NULL, NULL, 0, -7, err, sizeof err);
    json_t *v = json_string("0.1");
    JsonAt beta = json_at_value(&options, v, "beta");
    CHECK_REFUSED(json_get_double(&beta, NULL, JSON_GET_REQUIRED, 0, 0, 1, &x),
                  "field \"beta\" must be a number, got a string");
    JsonAt nothing = json_at_value(&options, NULL, "beta");
    CHECK_REFUSED(json_get_double(&nothing, NULL, JSON_GET_REQUIRED, 0, 0, 1, &x), "missing field \"beta\"");
    json_decref(v);

    // a top-level array's elements, and a path longer than JSON_AT_PATH_MAX
    json_t *list = parse("[true]");
    JsonAt list_at = doc_at(list);
    JsonAt first = json_at_element(&list_at, 0);
    CHECK_REFUSED(json_get_int(&first, NULL, JSON_GET_REQUIRED, 0, 0, 9, &i),
                  "doc.json: element [0] must be an integer, got a boolean");
    char long_key[300];
    memset(long_key, 'k', sizeof long_key - 1);
    long_key[sizeof long_key - 1] = '\0';
    JsonAt deep = json_at_value(&at, NULL, long_key);
    CHECK(strlen(deep.path) == JSON_AT_PATH_MAX - 1 && strcmp(deep.path + JSON_AT_PATH_MAX - 4, "...") == 0,
          "a long path is cut and ends in '...': %zu bytes", strlen(deep.path));
    json_decref(list);
    json_decref(root);
}

// integral_reals: an integer member takes a whole real (4.0, 2e3) and still refuses 1.5, a real beyond int64 and one
// out of range; request_wording: the HTTP API's wording ('path' in quotes, "must be in [..], got ..", "not ..").
static void test_integral_reals_and_request_wording(void) {
    json_t *root = parse("{\"four\": 4.0, \"e_int\": 2e3, \"half\": 1.5, \"neg\": -3.0, \"huge\": 1e20, "
                         "\"s\": \"x\", \"kw\": {\"b\": 1}, \"list\": [2.0], \"inf\": 1e400}");
    JsonAt at = doc_at(root);
    at.integral_reals = 1;
    int i = 0;
    int64_t i64 = 0;
    CHECK(json_get_int(&at, "four", JSON_GET_REQUIRED, 0, 0, 10, &i) == 0 && i == 4, "4.0 read as %d", i);
    CHECK(json_get_int64(&at, "e_int", JSON_GET_REQUIRED, 0, 0, 5000, &i64) == 0 && i64 == 2000, "2e3 read as %lld",
          (long long)i64);
    CHECK_REFUSED(json_get_int(&at, "half", JSON_GET_REQUIRED, 0, 0, 10, &i),
                  "doc.json: field \"half\" must be an integer, got a real number");
    CHECK_REFUSED(json_get_int(&at, "neg", JSON_GET_REQUIRED, 0, 0, 10, &i),
                  "doc.json: field \"neg\" is -3, outside [0, 10]");
    CHECK_REFUSED(json_get_int64(&at, "huge", JSON_GET_REQUIRED, 0, 1, 100, &i64),
                  "doc.json: field \"huge\" is 1e+20, outside [1, 100]");
    JsonAt list, first;
    REQUIRE(json_get_array(&at, "list", JSON_GET_REQUIRED, &list) == 0, "%s", err);
    first = json_at_element(&list, 0);
    CHECK(json_get_int(&first, NULL, JSON_GET_REQUIRED, 0, 0, 10, &i) == 0 && i == 2, "an element 2.0 read as %d", i);

    JsonAt req = json_at_document(root, NULL, 1, -7, err, sizeof err);
    req.integral_reals = 1;
    req.request_wording = 1;
    CHECK_REFUSED(json_get_int(&req, "neg", JSON_GET_OPTIONAL, 1, 1, 1024, &i), "'neg' must be in [1, 1024], got -3");
    CHECK_REFUSED(json_get_int64(&req, "huge", JSON_GET_OPTIONAL, 1, 1, 2147483647, &i64),
                  "'huge' must be in [1, 2147483647], got 1e+20");
    CHECK_REFUSED(json_get_int(&req, "s", JSON_GET_OPTIONAL, 0, 0, 9, &i), "'s' must be an integer, not a string");
    CHECK_REFUSED(json_get_int(&req, "half", JSON_GET_OPTIONAL, 0, 0, 9, &i),
                  "'half' must be an integer, not a real number");
    CHECK_REFUSED(json_get_int(&req, "absent", JSON_GET_REQUIRED, 0, 0, 9, &i), "'absent' is required");
    CHECK_REFUSED(json_get_double(&req, "half", JSON_GET_OPTIONAL, 0, 0, 1, &(double){0}),
                  "'half' must be in [0, 1], got 1.5");
    CHECK_REFUSED(json_get_double(&req, "inf", JSON_GET_OPTIONAL, 0, 0, 1, &(double){0}),
                  "'inf' must be in [0, 1], got 1.79769e+308");
    JsonAt kw;
    REQUIRE(json_get_object(&req, "kw", JSON_GET_REQUIRED, &kw) == 0, "%s", err);
    CHECK_REFUSED(json_get_bool(&kw, "b", JSON_GET_OPTIONAL, 0, &i), "'kw.b' must be a boolean, not an integer");
    CHECK_REFUSED(json_get_object(&req, "s", JSON_GET_OPTIONAL, &kw), "'s' must be an object, not a string");
    JsonAt rlist, relem;
    REQUIRE(json_get_array(&req, "list", JSON_GET_REQUIRED, &rlist) == 0, "%s", err);
    relem = json_at_element(&rlist, 0);
    CHECK_REFUSED(json_get_string(&relem, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &(const char *){0}, NULL),
                  "'list'[0] must be a string, not a real number");
    CHECK_REFUSED(json_get_fail(&req, "top_p", "must be in (0, 1], got %g", 1.5), "'top_p' must be in (0, 1], got 1.5");
    json_decref(root);
}

// The failure code is the caller's (0 taken as -1); a NULL message buffer is allowed; strings keep NUL bytes.
static void test_codes_and_buffers(void) {
    json_t *root = parse("{\"s\": \"a\\u0000b\", \"n\": \"x\"}");
    const char *s = NULL;
    size_t len = 0;
    int i = 0;
    JsonAt at = json_at_document(root, "tokenizer.json", 1, -3, err, sizeof err);
    CHECK(json_get_string(&at, "s", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, &len) == 0 && len == 3 &&
              memcmp(s, "a\0b", 3) == 0,
          "a string with a NUL byte: %zu bytes", len);
    CHECK(json_get_int(&at, "n", JSON_GET_REQUIRED, 0, 0, 1, &i) == -3, "the caller's code");
    JsonAt zero = json_at_document(root, "x", 1, 0, err, sizeof err);
    CHECK(json_get_int(&zero, "n", JSON_GET_REQUIRED, 0, 0, 1, &i) == -1, "a code of 0 is taken as -1");
    JsonAt quiet = json_at_document(root, "x", 1, -1, NULL, 0);
    CHECK(json_get_int(&quiet, "n", JSON_GET_REQUIRED, 0, 0, 1, &i) == -1, "no message buffer");
    char small[16];
    JsonAt cut = json_at_document(root, "doc.json", 1, -1, small, sizeof small);
    CHECK(json_get_int(&cut, "n", JSON_GET_REQUIRED, 0, 0, 1, &i) == -1 && strcmp(small, "doc.json: field") == 0,
          "a short buffer gets the message's start: '%s'", small);
    CHECK(strcmp(json_kind_name(NULL), "nothing") == 0 && strcmp(json_kind_name(json_null()), "null") == 0,
          "kind names");
    json_decref(root);
}

int main(void) {
    test_each_type();
    test_absent_and_null();
    test_wrong_types();
    test_ranges();
    test_numbers();
    test_paths();
    test_integral_reals_and_request_wording();
    test_codes_and_buffers();
    if (failures) {
        fprintf(stderr, "test_json_get: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_json_get: all passed\n");
    return 0;
}
