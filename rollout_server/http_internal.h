// rollout_server/http_internal.h — what the HTTP server core shares with its route files: the server and
// request structs, reply helpers, streaming, and the engine glue (submit prompts, wait for events while
// watching for the client going away or the server stopping).
#ifndef TANDEM_ROLLOUT_HTTP_INTERNAL_H
#define TANDEM_ROLLOUT_HTTP_INTERNAL_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "rollout_server/engine_group.h"
#include "rollout_server/http_json.h"
#include "rollout_server/http_metrics.h"
#include "rollout_server/http_response.h"
#include "rollout_server/http_server.h"

struct MHD_Daemon;
struct MHD_Connection;
struct ChatTemplate;
struct HttpConnTracker;
struct HttpConn;

struct HttpServer {
    struct MHD_Daemon *daemon;
    EngineGroup *engines;
    HttpConfig cfg;             // strings below are owned copies
    char *host, *api_key, *model_name, *chat_template;
    int port;
    HttpMetrics metrics;
    atomic_int draining;        // new requests get 503
    atomic_int aborting;        // requests in flight stop waiting and release their engine requests
    pthread_mutex_t mu;         // guards the drain wait
    pthread_cond_t idle;        // signalled when metrics.in_flight drops to 0
    struct ChatTemplate *chat;  // NULL when the model has no usable template (chat_err says why)
    char chat_err[512];
    int vocab_size;             // the model's embedding rows: token ids must lie below
    int max_model_len;          // the model's usable context
    int64_t started;            // unix time the server started (/v1/models "created")
    struct HttpConnTracker *conns; // read deadlines of the open connections (http_conn_deadline.h)
};

typedef struct HttpReq {
    HttpServer *srv;
    struct MHD_Connection *conn;
    int fd;                     // the client socket, for noticing a disconnect while waiting
    HttpRoute route;
    char method[16];
    char path[256];
    HttpBuf body;
    size_t body_seen;           // bytes received (also beyond the limit, which are discarded)
    long long content_length;   // the Content-Length header, -1 when absent (a chunked upload)
    int too_large;
    HttpError early;            // an answer decided before the body was read (status 0 = none)
    int status;                 // status sent (0 = none yet)
    int gone;                   // the client went away (counted as 499)
    struct HttpConn *tracked;   // this connection's read deadline (NULL: untracked)
    int read_timed_out;         // closed for not arriving in full within --request-read-timeout (counted as 408)
    struct timespec t0;
    int64_t prompt_tokens, completion_tokens; // for the access log
} HttpReq;

// ---- replies (each request gets exactly one) --------------------------------------------------------
void http_reply_json(HttpReq *r, int status, json_t *body);          // steals body
void http_reply_error(HttpReq *r, const HttpError *e);
void http_reply_data(HttpReq *r, int status, const char *content_type, char *data, size_t len); // takes data

// A streamed (chunked) 200 answer. fill appends the next bytes to out, blocking until it has some, and
// returns 0 (more to come), 1 (that was the end) or -1 (stop now: client gone or server stopping). destroy
// runs exactly once when the connection is done with the stream, whatever happened.
typedef struct {
    int (*fill)(void *user, HttpBuf *out);
    void (*destroy)(void *user);
    void *user;
} HttpStreamOps;
void http_reply_stream(HttpReq *r, const HttpStreamOps *ops);

// 1 when the peer closed the socket (a request handler runs on the connection's own thread, so nothing else
// reads the socket meanwhile). A client that half-closes its sending side after the request counts as gone,
// as HTTP/1.1 clients do not do that while they still want the answer.
int http_client_gone(int fd);

// ---- engine glue (http_generate.c) --------------------------------------------------------------
typedef struct {
    HttpServer *srv;
    int fd;
    EngineRequest **reqs;       // (n_reqs) one per prompt
    int *engine_of;             // (n_reqs) the engine each was routed to
    int n_reqs, n;              // n completions per prompt
    HttpChoice *choices;        // (n_reqs * n) prompt-major
    unsigned char *req_done;    // (n_reqs) the engine said nothing more will come
    int n_left, cursor;
    int interrupted;            // 1: client gone, 2: server stopping
    int answers_abort;          // the answer can say finish_reason "abort" (the OpenAI routes): a completion cut by
                                // the shutdown's drain timeout is answered with what it had, as /pause?mode=abort
                                // is; else (TRL's ids-only answer) it is a 503
} HttpGen;

// Submits one engine request per prompt (token ids). On a refusal every request already submitted is
// released and err carries the engine's message with its status (400 / 429 / 503 / 500).
int http_gen_submit(HttpGen *g, HttpServer *srv, int fd, int32_t *const *prompts, const int *lens, int n_prompts,
                    const SamplingParams *sp, HttpError *err);
// Next event of any of the requests: 1 with *ev and *choice (index into choices; the event is NOT appended),
// 0 when every request has finished, -1 when interrupted (g->interrupted says why).
int http_gen_next(HttpGen *g, EngineEvent *ev, int *choice);
// Runs every request to its end, appending events to the choices. 0, or -1 with err (500 when a completion
// finished with an engine error or memory ran out; 499 / 503 when interrupted, 503 when a completion was aborted
// by the shutdown and g->answers_abort is 0; one aborted by /pause?mode=abort, or by the shutdown with
// answers_abort, is answered, finish_reason "abort").
int http_gen_collect(HttpGen *g, HttpError *err);
int64_t http_gen_prompt_tokens(const HttpGen *g);
int64_t http_gen_cached_tokens(const HttpGen *g);
int64_t http_gen_completion_tokens(const HttpGen *g);
void http_gen_release(HttpGen *g);

// Token text for logprobs: tokenizer_decode of the single id, special tokens kept (user = Tokenizer).
char *http_token_text(void *tokenizer, int32_t id, size_t *len);
// Token text under vLLM's return_tokens_as_token_ids: "token_id:<id>" (malloc'd), whatever the tokenizer.
char *http_token_id_text(void *unused, int32_t id, size_t *len);

// A server without a tokenizer (no tokenizer.json in the model folder) serves token ids only: 0 when tok is
// there, else -1 with a 400 naming param that says so, what cannot be done ("take text prompts", ...) and what
// works instead.
int http_need_tokenizer(const Tokenizer *tok, const char *param, const char *cannot, HttpError *err);

// Tokenizes every prompt of l that is text (add_special_tokens as HF); id prompts are copied. *ids and
// *lens are malloc'd arrays of l->n entries (free with http_free_ids). A text prompt without a tokenizer is a
// 400 (http_need_tokenizer).
int http_tokenize_prompts(const Tokenizer *tok, const HttpPromptList *l, int add_special_tokens, int32_t ***ids,
                          int **lens, HttpError *err);
void http_free_ids(int32_t **ids, int *lens, int n);

// Renders the messages http_parse_messages reads with the server's chat template: *text malloc'd. Request errors
// come first, then a server without a tokenizer or a chat template is a 400 naming "messages".
int http_render_messages(HttpServer *s, const json_t *req, int add_generation_prompt, char **text, size_t *len,
                         HttpError *err);

// ---- routes ---------------------------------------------------------------------------------------
void http_route_completions(HttpReq *r);
void http_route_chat(HttpReq *r);
void http_route_models(HttpReq *r);
void http_route_health(HttpReq *r);
void http_route_tokenize(HttpReq *r);
void http_route_detokenize(HttpReq *r);
void http_route_metrics(HttpReq *r);
void http_route_trl_health(HttpReq *r);
void http_route_trl_world_size(HttpReq *r);
void http_route_trl_generate(HttpReq *r);
// vLLM's native routes that TRL >= 1.11's VLLMClient calls (http_routes_vllm.c).
void http_route_vllm_server_info(HttpReq *r);
void http_route_vllm_reset_prefix_cache(HttpReq *r);
void http_route_vllm_pause(HttpReq *r);
void http_route_vllm_resume(HttpReq *r);
void http_route_vllm_is_paused(HttpReq *r);
void http_route_vllm_weight_transfer(HttpReq *r);
void http_route_vllm_multimodal(HttpReq *r);

#endif
