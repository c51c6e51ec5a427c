// rollout_server/http_json_constraints.c — the request fields that constrain what may be generated: vLLM's token
// masks (min_tokens, allowed_token_ids, bad_words), structured outputs (a regex, a choice or a JSON schema, compiled
// by the engine: guided_regex.h), and OpenAI tools on chat (see http_json.h).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/guided_json.h"
#include "rollout_server/guided_regex.h"
#include "rollout_server/http_json_internal.h"
#include "shared/tokenizer/tokenizer.h"

// A JSON schema given as an object or as JSON text (vLLM takes both): its regex into o->structured.
static int schema_regex(const json_t *schema, const char *given, HttpGenOptions *o, HttpError *err) {
    json_t *parsed = NULL;
    if (json_is_string(schema)) {
        json_error_t je;
        if (!(parsed = json_loadb(json_string_value(schema), json_string_length(schema), 0, &je)))
            return http_error_set(err, 400, given, "the json schema of '%s' is not JSON: %s", given, je.text);
        schema = parsed;
    }
    char msg[400];
    o->structured = guide_json_schema_regex(schema, &o->structured_len, msg, sizeof msg);
    json_decref(parsed);
    if (!o->structured) return http_error_set(err, 400, given, "'%s': %s", given, msg);
    return 0;
}

// One constraint per request, made into a regex the engine compiles (guided_regex.h); grammars and structural tags
// are refused by name, as is a second constraint or allowed_token_ids beside one.
int http_parse_structured(const JsonAt *req, HttpGenOptions *o, HttpError *err) {
    const json_t *regex = NULL, *choice = NULL, *schema = NULL;
    const char *given = NULL;
    JsonAt so;
    if (json_get_object(req, "structured_outputs", JSON_GET_OPTIONAL, &so)) return http_json_refused(req, "structured_outputs", err);
    if (so.json) {
        const char *key;
        const json_t *val;
        json_object_foreach((json_t *)so.json, key, val) {
            if (json_is_null(val) || json_is_false(val)) continue;
            if (!strcmp(key, "regex")) regex = val;
            else if (!strcmp(key, "choice")) choice = val;
            else if (!strcmp(key, "json")) schema = val;
            else if (!strcmp(key, "grammar") || !strcmp(key, "json_object") || !strcmp(key, "structural_tag"))
                return http_error_set(err, 400, "structured_outputs", "'structured_outputs'.%s is not supported by "
                                      "this server (regex, choice and json are)", key);
            else if (strcmp(key, "disable_fallback") && strcmp(key, "disable_any_whitespace") &&
                     strcmp(key, "disable_additional_properties") && strcmp(key, "whitespace_pattern"))
                return http_error_set(err, 400, "structured_outputs", "'structured_outputs'.%s is not a field this "
                                      "server knows", key);
            if ((regex ? 1 : 0) + (choice ? 1 : 0) + (schema ? 1 : 0) > 1)
                return http_error_set(err, 400, "structured_outputs", "'structured_outputs' takes one of regex, "
                                      "choice and json");
        }
        given = "structured_outputs";
    }
    if (json_get_present(req, "guided_regex")) {
        if (given) return REFUSE(req, "guided_regex", err, "cannot be given with '%s'", given);
        regex = json_object_get(req->json, "guided_regex");
        given = "guided_regex";
    }
    if (json_get_present(req, "guided_choice")) {
        if (given) return REFUSE(req, "guided_choice", err, "cannot be given with '%s'", given);
        choice = json_object_get(req->json, "guided_choice");
        given = "guided_choice";
    }
    if (json_get_present(req, "guided_json")) {
        if (given) return REFUSE(req, "guided_json", err, "cannot be given with '%s'", given);
        schema = json_object_get(req->json, "guided_json");
        given = "guided_json";
    }
    const json_t *rf = json_object_get(req->json, "response_format");
    const json_t *rft = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
    if (json_is_string(rft) && !strcmp(json_string_value(rft), "json_schema")) {   // OpenAI's form
        if (given) return REFUSE(req, "response_format", err, "cannot be given with '%s'", given);
        const json_t *js = json_object_get(rf, "json_schema");
        schema = json_is_object(js) ? json_object_get(js, "schema") : NULL;
        given = "response_format";
        if (!schema)
            return http_error_set(err, 400, given, "'response_format' of type json_schema needs json_schema.schema");
    }
    if (!regex && !choice && !schema) return 0;
    if (o->sp.n_allowed > 0)
        return REFUSE(req, given, err, "cannot be combined with 'allowed_token_ids'");
    if (schema) {
        if (schema_regex(schema, given, o, err) < 0) return -1;
    } else if (regex) {
        if (!json_is_string(regex) || json_string_length(regex) == 0)
            return http_error_set(err, 400, given, "the regex of '%s' must be a non-empty string", given);
        if (!(o->structured = strndup(json_string_value(regex), json_string_length(regex))))
            return http_error_set(err, 500, NULL, "out of memory");
        o->structured_len = json_string_length(regex);
    } else {
        const size_t n = json_is_array(choice) ? json_array_size(choice) : 0;
        if (n == 0 || n > 4096)
            return http_error_set(err, 400, given, "the choice of '%s' must be a list of 1 to 4096 strings", given);
        const char **items = calloc(n, sizeof *items);
        size_t *lens = calloc(n, sizeof *lens);
        if (!items || !lens) {
            free(items);
            free(lens);
            return http_error_set(err, 500, NULL, "out of memory");
        }
        for (size_t i = 0; i < n; i++) {
            const json_t *c = json_array_get(choice, i);
            if (!json_is_string(c) || json_string_length(c) == 0) {
                free(items);
                free(lens);
                return http_error_set(err, 400, given, "choice %zu of '%s' must be a non-empty string", i, given);
            }
            items[i] = json_string_value(c);
            lens[i] = json_string_length(c);
        }
        o->structured = guide_choice_regex(items, lens, (int)n, &o->structured_len);
        free(items);
        free(lens);
        if (!o->structured) return http_error_set(err, 500, NULL, "out of memory");
    }
    o->sp.structured_regex = o->structured;
    o->sp.structured_regex_len = o->structured_len;
    return 0;
}

// vLLM's token masks: min_tokens, allowed_token_ids (ids), bad_words (strings, encoded by http_encode_bad_words
// once the tokenizer is at hand).
int http_parse_token_masks(const JsonAt *req, int vocab_size, HttpGenOptions *o, HttpError *err) {
    SamplingParams *sp = &o->sp;
    if (json_get_int(req, "min_tokens", JSON_GET_OPTIONAL, 0, 0, INT32_MAX, &sp->min_tokens))
        return http_json_refused(req, "min_tokens", err);
    if (json_get_present(req, "allowed_token_ids")) {
        int32_t *ids;
        int n;
        if (http_parse_id_list(json_object_get(req->json, "allowed_token_ids"), "allowed_token_ids", vocab_size, &ids,
                               &n, err) < 0)
            return -1;
        o->allowed_ids = ids;
        if (n == 0)
            return REFUSE(req, "allowed_token_ids", err, "must hold at least one token id (leave it out to allow "
                          "every id)");
        sp->allowed_token_ids = ids;
        sp->n_allowed = n;
    }
    if (!json_get_present(req, "bad_words")) return 0;
    const json_t *v = json_object_get(req->json, "bad_words");
    if (!json_is_array(v))
        return REFUSE(req, "bad_words", err, "must be a list of strings, not %s", json_kind_name(v));
    if (json_array_size(v) > HTTP_MAX_BAD_WORDS)
        return REFUSE(req, "bad_words", err, "has %zu entries; at most %d", json_array_size(v), HTTP_MAX_BAD_WORDS);
    JsonAt list = json_at_value(req, v, "bad_words");
    for (size_t i = 0; i < json_array_size(v); i++) {
        JsonAt item = json_at_element(&list, i);
        const char *text;
        size_t len;
        if (json_get_string(&item, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &text, &len))
            return http_json_refused(&list, NULL, err);
        size_t lead = strspn(text, " \t\n\r\f\v");
        if (lead == len || len > HTTP_MAX_STOP_BYTES) {
            json_get_fail(&item, NULL, "must hold a word (not only whitespace) of at most %d bytes",
                          HTTP_MAX_STOP_BYTES);
            return http_json_refused(&list, NULL, err);
        }
    }
    o->bad_words = json_array_size(v) > 0 ? v : NULL;
    return 0;
}

int http_check_min_tokens(const HttpGenOptions *o, HttpError *err) {
    if (o->sp.min_tokens <= o->sp.max_tokens) return 0;
    return http_error_set(err, 400, "min_tokens", "'min_tokens' (%d) must be at most max_tokens (%d)",
                          o->sp.min_tokens, o->sp.max_tokens);
}

// Appends the ids of text (len bytes, no special tokens) to o's bad-word ids as word o->sp.n_bad_words.
static int add_bad_word(const Tokenizer *tok, const char *text, size_t len, size_t *cap, HttpGenOptions *o,
                        int32_t **ids_out, size_t *n_out, HttpError *err) {
    char msg[256];
    int32_t *ids = NULL;
    size_t n = 0;
    if (tokenizer_encode(tok, text, len, 0, &ids, &n, msg, sizeof msg) != 0)
        return http_error_set(err, 400, "bad_words", "'bad_words': '%.*s' cannot be tokenized: %s", (int)len, text,
                              msg);
    if (n == 0) {
        free(ids);
        return http_error_set(err, 400, "bad_words", "'bad_words': '%.*s' tokenizes to no tokens", (int)len, text);
    }
    const int w = o->sp.n_bad_words, at = o->bad_offsets[w];
    if ((size_t)at + n > *cap) {
        size_t c = *cap * 2 > at + n ? *cap * 2 : at + n;
        int32_t *grown = realloc(o->bad_ids, c * sizeof *grown);
        if (!grown) {
            free(ids);
            return http_error_set(err, 500, "bad_words", "out of memory encoding 'bad_words'");
        }
        o->bad_ids = grown;
        *cap = c;
    }
    memcpy(o->bad_ids + at, ids, n * sizeof *ids);
    o->bad_offsets[w + 1] = at + (int32_t)n;
    o->sp.n_bad_words = w + 1;
    *ids_out = ids;
    *n_out = n;
    return 0;
}

int http_encode_bad_words(const Tokenizer *tok, HttpGenOptions *o, HttpError *err) {
    if (!o->bad_words) return 0;
    if (!tok)
        return http_error_set(err, 400, "bad_words", "'bad_words' needs the model's tokenizer, and this model folder "
                              "has none");
    const size_t words = json_array_size(o->bad_words);
    size_t cap = 16 * words;
    o->bad_offsets = malloc((2 * words + 1) * sizeof *o->bad_offsets);
    o->bad_ids = malloc(cap * sizeof *o->bad_ids);
    if (!o->bad_offsets || !o->bad_ids) return http_error_set(err, 500, "bad_words", "out of memory");
    o->bad_offsets[0] = 0;
    o->sp.n_bad_words = 0;
    char *spaced = malloc(HTTP_MAX_STOP_BYTES + 2);
    if (!spaced) return http_error_set(err, 500, "bad_words", "out of memory");
    int rc = 0;
    for (size_t i = 0; i < words && rc == 0; i++) {
        const char *text = json_string_value(json_array_get(o->bad_words, i));
        const size_t len = json_string_length(json_array_get(o->bad_words, i));
        const size_t lead = strspn(text, " \t\n\r\f\v");
        int32_t *plain = NULL, *with_space = NULL;
        size_t n_plain = 0, n_space = 0;
        rc = add_bad_word(tok, text + lead, len - lead, &cap, o, &plain, &n_plain, err);
        if (rc == 0) {
            spaced[0] = ' ';
            memcpy(spaced + 1, text + lead, len - lead);
            rc = add_bad_word(tok, spaced, len - lead + 1, &cap, o, &with_space, &n_space, err);
            // Kept only when it starts with another id and has as many ids (vLLM's rule); else taken back.
            if (rc == 0 && (with_space[0] == plain[0] || n_space != n_plain)) o->sp.n_bad_words--;
        }
        free(plain);
        free(with_space);
    }
    free(spaced);
    if (rc < 0) return -1;
    o->sp.bad_words_ids = o->bad_ids;
    o->sp.bad_words_offsets = o->bad_offsets;
    return 0;
}

// OpenAI tools on chat: definitions the chat template writes into the prompt (http_chat.c), and the calls in the
// answer read back (hermes format: the templates that take tools are Qwen2.5's and Qwen3's). tool_choice auto (the
// default) or none; "required" and a named function would need the output constrained and are refused.
int http_parse_tools(const JsonAt *req, HttpGenOptions *o, HttpError *err) {
    const json_t *tools = json_object_get(req->json, "tools");
    if (!json_get_present(req, "tools")) return 0;
    if (!json_is_array(tools) || json_array_size(tools) == 0 || json_array_size(tools) > 128)
        return REFUSE(req, "tools", err, "must be a list of 1 to 128 tool definitions");
    for (size_t i = 0; i < json_array_size(tools); i++) {
        const json_t *t = json_array_get(tools, i), *fn = json_object_get(t, "function");
        const json_t *type = json_object_get(t, "type");
        if (!json_is_object(t) || !json_is_string(type) || strcmp(json_string_value(type), "function") != 0 ||
            !json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
            return http_error_set(err, 400, "tools", "'tools'[%zu] must be {\"type\": \"function\", \"function\": "
                                  "{\"name\": ..., \"parameters\": ...}}", i);
    }
    o->tools = 1;
    const json_t *tc = json_object_get(req->json, "tool_choice");
    if (json_get_present(req, "tool_choice")) {
        if (!json_is_string(tc) ||
            (strcmp(json_string_value(tc), "auto") != 0 && strcmp(json_string_value(tc), "none") != 0))
            return REFUSE(req, "tool_choice", err, "is supported as \"auto\" or \"none\" (\"required\" and a named "
                          "function are not)");
        o->tool_choice_none = strcmp(json_string_value(tc), "none") == 0;
    }
    if (o->stream) return REFUSE(req, "tools", err, "is not supported when streaming (send stream=false)");
    return 0;
}

