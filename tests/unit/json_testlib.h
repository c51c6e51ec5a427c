// tests/unit/json_testlib.h — comparing parsed JSON documents in the JSON reader's test and fuzz target.
#ifndef TANDEM_TESTS_JSON_TESTLIB_H
#define TANDEM_TESTS_JSON_TESTLIB_H

#include <jansson.h>
#include <string.h>

// Equal values, reals compared bit for bit (json_equal takes -0.0 for 0.0); keys may hold NUL bytes.
static int json_same_value(const json_t *a, const json_t *b) {
    if (!a || !b || json_typeof(a) != json_typeof(b)) return 0;
    switch (json_typeof(a)) {
    case JSON_REAL: {
        double x = json_real_value(a), y = json_real_value(b);
        return memcmp(&x, &y, sizeof x) == 0;
    }
    case JSON_INTEGER: return json_integer_value(a) == json_integer_value(b);
    case JSON_STRING:
        return json_string_length(a) == json_string_length(b) &&
               memcmp(json_string_value(a), json_string_value(b), json_string_length(a)) == 0;
    case JSON_ARRAY:
        if (json_array_size(a) != json_array_size(b)) return 0;
        for (size_t i = 0; i < json_array_size(a); i++)
            if (!json_same_value(json_array_get(a, i), json_array_get(b, i))) return 0;
        return 1;
    case JSON_OBJECT: {
        if (json_object_size(a) != json_object_size(b)) return 0;
        const char *k;
        size_t klen;
        json_t *v;
        json_object_keylen_foreach((json_t *)a, k, klen, v) {
            const json_t *w = json_object_getn(b, k, klen);
            if (!w || !json_same_value(v, w)) return 0;
        }
        return 1;
    }
    default: return 1;
    }
}

#endif
