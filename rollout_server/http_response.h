// rollout_server/http_response.h — the answer side of the HTTP API, free of sockets and of the engine thread:
// per-completion accumulation of engine events, the OpenAI completions / chat logprobs objects, choices,
// usage, server-sent-event framing, and TRL's /generate/ answer.
#ifndef TANDEM_ROLLOUT_HTTP_RESPONSE_H
#define TANDEM_ROLLOUT_HTTP_RESPONSE_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "rollout_server/engine.h"

// Growable byte buffer; `oom` latches an allocation failure so callers check once at the end.
typedef struct {
    char *data;
    size_t len, cap;
    int oom;
} HttpBuf;

void http_buf_append(HttpBuf *b, const void *p, size_t n);
// printf into the buffer (any length).
void http_buf_appendf(HttpBuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void http_buf_free(HttpBuf *b);

// Everything one completion produced so far.
typedef struct {
    int32_t *tokens;        // (n_tokens)
    float *logprobs;        // (n_tokens) the sampled tokens' logprobs
    TokenLogprob *top;      // (n_tokens, n_top) alternatives, best first; NULL when n_top == 0
    int n_tokens, cap, n_top;
    char *text;             // UTF-8, NUL-terminated
    size_t text_len, text_cap;
    FinishReason finish;
    char *stop_str;         // matched stop string (malloc'd) or NULL
    int32_t stop_token;     // matched stop / eos token or -1
    int64_t *versions;      // (n_tokens) the policy version that sampled each token
} HttpChoice;

void http_choice_init(HttpChoice *c, int n_top);
// Copies an event's tokens, logprobs, versions, alternatives and text, and its finish data; a restarted event (a
// weight update started the completion over) first drops what the choice held. 0, or -1 on out of memory.
int http_choice_append(HttpChoice *c, const EngineEvent *ev);
void http_choice_free(HttpChoice *c);

// The text of one token on its own (for logprobs "tokens" / "token"): malloc'd, NUL-terminated.
typedef struct {
    char *(*text)(void *user, int32_t id, size_t *len);
    void *user;
} HttpTokenText;

// "length", "stop", "abort", "error" (null for FINISH_NONE).
json_t *http_finish_json(FinishReason r);
// vLLM's stop_reason: the matched stop string, the matched id when it came from sp->stop_token_ids, else null
// (end of sequence, length).
json_t *http_stop_reason_json(const HttpChoice *c, const SamplingParams *sp);

// OpenAI completions logprobs {tokens, token_logprobs, top_logprobs, text_offset} for tokens [from, from+count)
// of c. top_logprobs maps token text -> logprob for the n_top alternatives plus the sampled token. Offsets
// count Unicode code points from *offset (updated past the last token, so stream chunks continue it).
json_t *http_completion_logprobs(const HttpChoice *c, int from, int count, const HttpTokenText *tt, size_t *offset);
// Completions with echo and logprobs: the prompt's tokens in front of the completion's, in one {tokens,
// token_logprobs, top_logprobs, text_offset}; the first prompt token's logprob and alternatives are null (no
// context). prompt_lp / prompt_top as engine_request_prompt_logprobs gives them (stride alternatives per token), of
// which the first k are reported.
json_t *http_echo_logprobs(const int32_t *prompt, int n_prompt, const float *prompt_lp, const TokenLogprob *prompt_top,
                           int stride, int k, const HttpChoice *completion, const HttpTokenText *tt);
// vLLM's "prompt_logprobs" of a choice: [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...], each
// position's own token first, then its first k alternatives of stride (rank 1 = the most likely id).
json_t *http_prompt_logprobs_json(const int32_t *prompt, int n_prompt, const float *lp, const TokenLogprob *top,
                                  int stride, int k, const int32_t *rank, const HttpTokenText *tt);
// OpenAI chat logprobs {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
json_t *http_chat_logprobs(const HttpChoice *c, int from, int count, const HttpTokenText *tt);

// {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"}}
json_t *http_usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

// "data: <compact json>\n\n" (malloc'd; *len its length). NULL on out of memory.
char *http_sse_format(const json_t *obj, size_t *len);
#define HTTP_SSE_DONE "data: [DONE]\n\n"

// Response envelopes: {"id", "object", "created", "model", "choices": [...]} (choices stolen).
json_t *http_envelope(const char *id, const char *object, int64_t created, const char *model, json_t *choices);
// "<prefix>-<32 hex>" from a per-process random stream; buf of at least 48 bytes.
void http_make_id(char *buf, size_t cap, const char *prefix);

// TRL vllm-serve /generate/ answer for n_prompts prompts with n completions each (choices prompt-major:
// choice p*n + i is completion i of prompt p):
//   {"prompt_ids": [[...] x n_prompts], "completion_ids": [[...] x n_prompts*n],
//    "logprobs": [[[lp, ...] per token] per completion] | null, "logprob_token_ids": same shape | null}
// logprobs < 0: both null. logprobs == 0: one entry per token (the sampled one). logprobs = N > 0: the N
// alternatives plus the sampled token when it is not among them, sorted by descending logprob — vLLM's shape.
// with_versions adds "policy_versions": the weights version of every completion token, shaped as completion_ids.
json_t *http_trl_response(const int32_t *const *prompt_ids, const int *prompt_lens, int n_prompts, int n,
                          const HttpChoice *choices, int logprobs,
                          int with_versions);

// Merges a token's alternatives with the sampled token as TRL/vLLM report them (see above): writes at most
// n_top + 1 entries into out and returns their count.
int http_merge_top(const TokenLogprob *top, int n_top, int32_t sampled, float sampled_lp, TokenLogprob *out);

#endif
