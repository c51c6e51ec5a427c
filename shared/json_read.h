// shared/json_read.h — the one JSON reader of tandem: jansson's json_loadb / json_load_file, except that every
// number RFC 8259 allows is accepted.
//
// jansson refuses two kinds of valid numbers: integer literals beyond int64 ("too big integer"; transformers
// writes "model_max_length": 1000000000000000019884624838656 in tokenizer_config.json) and reals whose
// magnitude overflows a double ("real number overflow", e.g. 1e400). Here
//   - an integer literal outside int64 becomes a real: the double nearest to it (json_is_real, not
//     json_is_integer, so a field that needs an integer still refuses it);
//   - a real (or an integer beyond the double range) whose magnitude overflows a double becomes -DBL_MAX or
//     +DBL_MAX, keeping its sign: finite, so callers need no Infinity check;
//   - everything else is exactly what jansson gives, errors included: the same flags, and on invalid JSON the
//     same line, column, position and text (positions count bytes of the text as given).
// How: one pass over the text that knows strings and their escapes finds such number literals and respells
// them as a real jansson accepts (padded with spaces where shorter), then jansson parses the result and error
// positions are mapped back to the text as given. Text without such numbers goes to jansson untouched.
#ifndef TANDEM_SHARED_JSON_READ_H
#define TANDEM_SHARED_JSON_READ_H

#include <jansson.h>
#include <stddef.h>

// As json_loadb(buffer, len, flags, error).
json_t *json_read_buffer(const char *buffer, size_t len, size_t flags, json_error_t *error);
// As json_load_file(path, flags, error): the whole file is read first.
json_t *json_read_file(const char *path, size_t flags, json_error_t *error);

#endif
