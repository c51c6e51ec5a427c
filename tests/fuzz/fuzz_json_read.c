// tests/fuzz/fuzz_json_read.c — libFuzzer target for json_read_buffer (shared/json_read.h), checked against jansson
// on the same bytes. The first input byte picks the flags (bit 0 JSON_DECODE_ANY, bit 1 JSON_DISABLE_EOF_CHECK,
// bit 2 JSON_DECODE_INT_AS_REAL, bit 3 JSON_REJECT_DUPLICATES, bit 4 JSON_ALLOW_NUL); the rest is the text.
//   - jansson accepts it: the same value here, and the same position;
//   - jansson refuses it for any reason but a number it cannot hold: the same error here (line, column, position,
//     text, code), since nothing before that point was respelled;
//   - jansson refuses a number (or meets bad UTF-8 right after one, which hides that): accepted here, or refused at
//     or after that number;
//   - every real accepted here is finite.
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "shared/json_read.h"
#include "tests/unit/json_testlib.h"

#define REQUIRE(c) do { if (!(c)) { fprintf(stderr, "invariant failed: %s\n", #c); __builtin_trap(); } } while (0)

static int all_finite(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_REAL: return isfinite(json_real_value(v));
    case JSON_ARRAY:
        for (size_t i = 0; i < json_array_size(v); i++)
            if (!all_finite(json_array_get(v, i))) return 0;
        return 1;
    case JSON_OBJECT: {
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)v, k, x) if (!all_finite(x)) return 0;
        return 1;
    }
    default: return 1;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    static const size_t flag_bits[] = {JSON_DECODE_ANY, JSON_DISABLE_EOF_CHECK, JSON_DECODE_INT_AS_REAL,
                                       JSON_REJECT_DUPLICATES, JSON_ALLOW_NUL};
    size_t flags = 0;
    for (int i = 0; i < 5; i++)
        if (data[0] >> i & 1) flags |= flag_bits[i];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    json_error_t mine, theirs;
    json_t *a = json_read_buffer(text, len, flags, &mine);
    json_t *b = json_loadb(text, len, flags, &theirs);
    if (a) REQUIRE(all_finite(a));
    // jansson keeps the first error it meets: bad UTF-8 right after a number (read to see where the number ends)
    // hides a "too big integer" or "real number overflow" that follows it.
    int after_number = json_error_code(&theirs) == json_error_invalid_utf8 && theirs.position > 0 &&
                       (size_t)theirs.position <= len && text[theirs.position - 1] >= '0' &&
                       text[theirs.position - 1] <= '9';
    if (b) {
        REQUIRE(a && json_same_value(a, b) && mine.position == theirs.position);
    } else if (json_error_code(&theirs) != json_error_numeric_overflow && !after_number) {
        REQUIRE(!a && mine.line == theirs.line && mine.column == theirs.column && mine.position == theirs.position &&
                strcmp(mine.text, theirs.text) == 0 && json_error_code(&mine) == json_error_code(&theirs));
    } else if (!a) {
        REQUIRE(mine.position >= theirs.position);
    }
    json_decref(a);
    json_decref(b);
    return 0;
}
