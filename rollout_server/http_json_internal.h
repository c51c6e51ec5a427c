// rollout_server/http_json_internal.h — what http_json.c (the request fields) and http_json_constraints.c (the fields
// that constrain the output: vLLM's token masks, structured outputs, OpenAI tools) share. Not an API: see
// http_json.h.
#ifndef TANDEM_ROLLOUT_HTTP_JSON_INTERNAL_H
#define TANDEM_ROLLOUT_HTTP_JSON_INTERNAL_H

#include "rollout_server/http_json.h"
#include "shared/json_get.h"

// The 400 of a failed json_get call on member `key` of at (key NULL: at itself): json_get wrote the message,
// param names the member by its full path ("generation_kwargs.temperature"). Returns -1.
int http_json_refused(const JsonAt *at, const char *key, HttpError *err);
// A refusal of the HTTP layer's own in json_get's form: `'<path>' <printf message>`, a 400 naming the member.
#define REFUSE(at, key, err, ...) (json_get_fail((at), (key), __VA_ARGS__), http_json_refused((at), (key), (err)))
// A boolean member, left alone when absent. 0 or -1 (refused).
int http_json_get_bool(const JsonAt *at, const char *key, int *inout, HttpError *err);

// vLLM's min_tokens, allowed_token_ids and bad_words (kept as strings until http_encode_bad_words).
int http_parse_token_masks(const JsonAt *req, int vocab_size, HttpGenOptions *o, HttpError *err);
// Structured outputs: structured_outputs {regex | choice | json}, guided_regex / guided_choice / guided_json and
// OpenAI's response_format json_schema, made into one regex (o->structured).
int http_parse_structured(const JsonAt *req, HttpGenOptions *o, HttpError *err);
// OpenAI tools and tool_choice on chat.
int http_parse_tools(const JsonAt *req, HttpGenOptions *o, HttpError *err);

#endif
