// rollout_server/guided_json.h — structured outputs from a JSON schema: the schema turned into a regex (the idea of
// outlines' JSON-schema-to-regex; written here) that guided_regex.h compiles like any other. A completion that
// matches is JSON that validates against the schema, written with Python json.dumps's separators (", " and ": ").
//
// What a schema may say: type (string, integer, number, boolean, null, object, array, or a list of the scalar
// ones), properties (every listed property is written, in order: a present optional property is still valid),
// required (names among the properties), additionalProperties (none are written), items, minItems, maxItems,
// minLength, maxLength, enum and const (of strings, numbers, booleans, null), anyOf, and the annotations title,
// description, default, examples, $schema, $id, $comment. Anything else (minimum, pattern, format, $ref, oneOf,
// allOf, uniqueItems, ...) would let output through that the schema forbids, so it is refused by name.
#ifndef TANDEM_ROLLOUT_GUIDED_JSON_H
#define TANDEM_ROLLOUT_GUIDED_JSON_H

#include <jansson.h>
#include <stddef.h>

// The regex of schema (malloc'd, NUL-terminated, *len bytes), or NULL with a message naming the keyword and its
// path in the schema.
char *guide_json_schema_regex(const json_t *schema, size_t *len, char *err, size_t err_len);

#endif
