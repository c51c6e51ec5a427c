// rollout_server/http_json.h — the request side of the HTTP API, free of sockets and of the engine thread:
// body text -> JSON object, typed field readers that name the field they refuse (shared/json_get.h), the
// OpenAI / vLLM / TRL sampling fields -> SamplingParams, prompt shapes, and the OpenAI-style error object
// {"error": {"message", "type", "param", "code"}} every failure is answered with.
#ifndef TANDEM_ROLLOUT_HTTP_JSON_H
#define TANDEM_ROLLOUT_HTTP_JSON_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "rollout_server/engine.h"
#include "shared/tokenizer/chat_template.h"

// Bounds that keep one HTTP request from monopolising the engine; the engine applies its own limits too.
#define HTTP_MAX_N 1024                 // completions per prompt
#define HTTP_MAX_PROMPTS 1024           // prompts per request
#define HTTP_MAX_COMPLETIONS 4096       // prompts x n per request
#define HTTP_MAX_STOP_BYTES 512         // length of one stop string (and of one bad word)
#define HTTP_MAX_BAD_WORDS 256          // bad_words entries

// Which API's field names and defaults apply.
typedef enum { HTTP_API_COMPLETIONS = 0, HTTP_API_CHAT, HTTP_API_TRL } HttpApi;

typedef struct {
    int status;         // HTTP status: 400, 401, 404, 405, 413, 429, 500, 503
    char message[512];
    char param[64];     // the offending field ("" -> null)
} HttpError;

// Fills e and returns -1 (so `return http_error_set(...)` reads naturally).
int http_error_set(HttpError *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
// OpenAI error "type" for a status: invalid_request_error, authentication_error, not_found_error, ...
const char *http_error_type(int status);
// {"error": {"message", "type", "param", "code": status}} as a new reference.
json_t *http_error_json(const HttpError *e);
// The same as compact text (malloc'd, NUL-terminated; *len its length). NULL only on out of memory.
char *http_error_body(const HttpError *e, size_t *len);
// Status for an engine_submit / engine error code: EINVAL, ETOOLONG 400; EQUEUE_FULL 429; ESHUTDOWN 503; else 500.
int http_status_for_engine(int engine_code);

// Parses a request body that must be one JSON object. Malformed text (including NaN / Infinity, which some
// JSON writers emit) is a 400 whose message says where, and names the field when one can be found.
int http_body_parse(const char *body, size_t len, json_t **out, HttpError *err);

// Typed readers of the routes' own fields (shared/json_get.h in the API's wording). Return 1 when the field is
// present and valid (*out set), 0 when absent or null (*out left alone), -1 with err filled (400 naming the
// field) when the type is wrong.
int http_get_bool(const json_t *obj, const char *key, int *out, HttpError *err);
int http_get_string(const json_t *obj, const char *key, const char **out, size_t *len, HttpError *err);

// Everything a generation request asks for besides its prompts.
typedef struct {
    SamplingParams sp;          // stop strings point into the request JSON: keep it alive while sp is used
    int max_tokens_given;       // 0: the caller picks the default (chat: what is left of the context)
    int stream;
    int include_usage;          // stream_options.include_usage
    int echo;                   // completions: prefix the prompt to the text (with logprobs: its logprobs too)
    int tools;                  // chat: "tools" given (the chat template writes them; the answer's calls are read)
    int tool_choice_none;       // chat: tool_choice "none": the answer stays text
    int prompt_logprobs;        // completions: -1 = none, else "prompt_logprobs" with this many alternatives
    int return_token_ids;       // vLLM extension: prompt_token_ids and token_ids in each choice
    int return_tokens_as_token_ids; // vLLM extension: logprobs name tokens "token_id:<id>" instead of their text
    int logprobs;               // completions: -1 = none, else alternatives per token (0..20)
                                // chat: -1 = none, else top_logprobs (0..20); TRL: -1 = None, else N
    int add_generation_prompt;  // chat (default 1)
    int continue_final_message; // chat (default 0)
    int add_special_tokens;     // completions default 1, chat default 0
    int return_policy_versions; // TRL (tandem extension): the weights version of every completion token
    // vLLM's token masks (sp.min_tokens is read here too). sp.allowed_token_ids points at allowed_ids; bad_words is
    // the request's list of strings until http_encode_bad_words turns it into sp.bad_words_* (bad_ids,
    // bad_offsets). Free with http_gen_options_free.
    int32_t *allowed_ids;
    char *structured;           // the structured-output regex (a choice made into one); sp.structured_regex
    size_t structured_len;
    const json_t *bad_words;
    int32_t *bad_ids, *bad_offsets;
} HttpGenOptions;

// Reads the sampling fields of a request for `api` (see docs/http-api.md for the list, defaults and ranges)
// and checks them: every refusal is a 400 naming the field. vocab_size bounds stop_token_ids and
// allowed_token_ids. Call http_gen_options_free afterwards, whatever it returned.
int http_parse_generation(const json_t *req, HttpApi api, int vocab_size, HttpGenOptions *o, HttpError *err);
void http_gen_options_free(HttpGenOptions *o);
// min_tokens against the max_tokens the request ends up with (chat's default is only known after rendering): 0,
// or -1 with a 400 naming min_tokens.
int http_check_min_tokens(const HttpGenOptions *o, HttpError *err);
// The ids of o->bad_words as vLLM takes them: each word with its leading whitespace stripped, encoded without
// special tokens, and encoded once more after a space when that gives another first id and as many ids (the
// word in the middle of a sentence). Sets o->sp.bad_words_*. 0, or -1 with a 400 naming bad_words.
int http_encode_bad_words(const Tokenizer *tok, HttpGenOptions *o, HttpError *err);

// Prompts as given: either all texts or all token-id lists.
typedef struct {
    const char *text;   // points into the request JSON (NULL for an id prompt)
    size_t text_len;
    int32_t *ids;       // malloc'd (NULL for a text prompt)
    int n_ids;
} HttpPrompt;

typedef struct {
    HttpPrompt *items;
    int n;
    int is_ids;
} HttpPromptList;

// Accepts "text", ["text", ...], [id, ...] or [[id, ...], ...] (allow_single = 0: only the list forms, as TRL
// declares list[str] | list[list[int]]). Ids must lie in [0, vocab_size); no prompt may be empty.
int http_parse_prompts(const json_t *val, const char *field, int vocab_size, int allow_single, HttpPromptList *out,
                       HttpError *err);
void http_prompts_free(HttpPromptList *l);

// Reads a list of token ids (field named in errors) into a malloc'd array; ids must lie in [0, vocab_size).
int http_parse_id_list(const json_t *val, const char *field, int vocab_size, int32_t **ids, int *n, HttpError *err);

// The chat request's messages as the chat template takes them (rollout_server/http_chat.c).
typedef struct {
    ChatMessage *items;         // (n) role points into the request JSON ("developer" reads "system"), content into
                                // owned, tool_calls into calls
    char **owned;               // (n) each message's content: a string, "" for null, text parts joined by '\n'
    size_t n;
    ChatToolCall *calls;        // every assistant tool call; name and arguments point into the request JSON, or
    char **owned_args;          // (n_calls) into these: arguments sent as an object, as JSON text (else NULL)
    size_t n_calls;
    ChatRenderOptions opt;      // chat_template_kwargs: enable_thinking (default true), date_string; tools
    char **tool_texts;          // (opt.n_tools) each tool definition's JSON text (opt.tools points here)
} HttpChatMessages;

// Reads req["messages"] (a non-empty list of {role, content}, with "tool_calls" on assistant turns and
// "tool_call_id" on tool turns) and chat_template_kwargs; a per-request "chat_template" is refused. OpenAI's
// "developer" role is the system role (as vLLM renders it). 0, or -1 with err (400 naming the field) and nothing to
// free.
int http_parse_messages(const json_t *req, HttpChatMessages *out, HttpError *err);
void http_chat_messages_free(HttpChatMessages *m);

#endif
