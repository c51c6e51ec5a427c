// shared/json_get.h — typed reads of JSON object members (and array elements) whose error messages name the full
// path of the value in its document, the one set of JSON getters of config.json, tokenizer.json, the ZeroMQ
// control messages, the GRPO options and the HTTP API's requests.
//
// A JsonAt is a JSON value and where it sits: the document's name, the path from the document's top (member names
// joined by '.', array indexes as [i]), whether null counts as absent, and how a failure is reported (the code to
// return, the message buffer). A getter reads one member of the object at->json (or, with key NULL, at->json
// itself), checks its type and range, and returns 0 with the value in *out — an absent optional member gives the
// default — or at->fail_code with one of these messages in at->err (shared/err.h's convention):
//   <doc>: missing field "<path>"
//   <doc>: field "<path>" must be an integer, got a string
//   <doc>: field "<path>" is 5000, outside [1, 4096]
//   <doc>: field "<path>" is 300 bytes long, at most 255 allowed
// e.g. `config.json: field "rope_scaling.factor" must be a number, got a string`. Indexes at the end of a path
// stay outside the quotes (`field "stop_token_ids"[3] is -1, outside [0, 2147483647]`); the empty path is
// "the top level"; with no document name the message starts at "field".
//
// Numbers: tandem reads every valid JSON number (shared/json_read.h), so an integer literal beyond int64 arrives
// as a real: an integer member holding a real of magnitude 2^63 or more is out of range, any other real (1.5, and
// 2.0 too, unless integral_reals) is of the wrong type. A number member takes integers and reals alike.
//
// With request_wording (the HTTP API's 400s, OpenAI-style), messages name the path in single quotes and word
// refusals as that API always has: 'n' must be in [1, 1024], got 0; 'n' must be an integer, not a string;
// 'stop'[1] must be a string, not an integer; 'prompt' is required.
#ifndef TANDEM_SHARED_JSON_GET_H
#define TANDEM_SHARED_JSON_GET_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#define JSON_AT_PATH_MAX 192   // a longer path is cut in messages

typedef struct {
    const json_t *json;            // the object whose members are read, or the value itself (key NULL); NULL: absent
    const char *doc;               // the document's name, first in messages ("config.json", "generate"); NULL: none
    char path[JSON_AT_PATH_MAX];   // json's path from the document's top ("rope_scaling", "added_tokens[3]"); "": top
    int null_is_absent;            // 1: a member set to null reads as absent (Hugging Face files); 0: null is a value
    int integral_reals;            // 1: an integer member takes a whole real (4.0 -> 4, as Python clients send); 0: not
    int request_wording;           // 1: the HTTP API's message wording (above); 0: the files' wording
    int fail_code;                 // what a failing call returns (-1, CONFIG_ERR_INVALID, TOK_EFORMAT, ...); never 0
    char *err;                     // the message of a failure; NULL for none
    size_t err_len;
} JsonAt;

typedef enum {
    JSON_GET_OPTIONAL = 0,   // absent (or null, where null_is_absent): the default, and 0
    JSON_GET_REQUIRED = 1,   // absent: `missing field "<path>"`; null: of the wrong type
} JsonPresence;

#define JSON_ANY_LENGTH SIZE_MAX   // json_get_string's max_bytes for no limit

// The top of a document: `json` is its root value, `doc` its name in messages. A fail_code of 0 is taken as -1.
JsonAt json_at_document(const json_t *json, const char *doc, int null_is_absent, int fail_code, char *err,
                        size_t err_len);
// A value inside parent's (found by the caller) named `name` after parent's path: a member name ("factor") is
// joined with '.', an index ("[3]") appended as it is. Same document, null rule and failure reporting as parent.
JsonAt json_at_value(const JsonAt *parent, const json_t *value, const char *name);
// Element `index` of the array at->json (json NULL when the index is past the end or at->json is not an array).
JsonAt json_at_element(const JsonAt *array, size_t index);

// 1 when the member is there (not null, where null_is_absent), else 0. key NULL: at->json itself.
int json_get_present(const JsonAt *at, const char *key);

// An integer in [min, max].
int json_get_int64(const JsonAt *at, const char *key, JsonPresence presence, int64_t default_value, int64_t min,
                   int64_t max, int64_t *out);
int json_get_int(const JsonAt *at, const char *key, JsonPresence presence, int default_value, int min, int max,
                 int *out);
// A finite number (integer or real) in [min, max]; pass -DBL_MAX, DBL_MAX for any finite number.
int json_get_double(const JsonAt *at, const char *key, JsonPresence presence, double default_value, double min,
                    double max, double *out);
// true or false, as 1 or 0.
int json_get_bool(const JsonAt *at, const char *key, JsonPresence presence, int default_value, int *out);
// A string of at most max_bytes bytes (JSON_ANY_LENGTH: any). *out points into the JSON value (it may hold NUL
// bytes where the document allowed them: *len tells its length); absent optional: default_value (may be NULL) and
// its strlen. len may be NULL.
int json_get_string(const JsonAt *at, const char *key, JsonPresence presence, const char *default_value,
                    size_t max_bytes, const char **out, size_t *len);
// An object or an array, as a JsonAt for reading inside it (its path is at's path + key); absent optional: 0 with
// out->json NULL.
int json_get_object(const JsonAt *at, const char *key, JsonPresence presence, JsonAt *out);
int json_get_array(const JsonAt *at, const char *key, JsonPresence presence, JsonAt *out);

// A refusal of the caller's own, in the getters' form: writes "<doc>: field \"<path>\" " ("'<path>' " with
// request_wording) followed by the printf message into at->err and returns at->fail_code, e.g.
// json_get_fail(&at, "top_p", "must be in (0, 1], got %g", x).
int json_get_fail(const JsonAt *at, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

// "an object", "an array", "a string", "an integer", "a real number", "a boolean" or "null" (NULL: "nothing").
const char *json_kind_name(const json_t *value);

#endif
