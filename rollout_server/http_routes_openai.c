// rollout_server/http_routes_openai.c — the OpenAI-compatible routes: POST /v1/completions, POST
// /v1/chat/completions (whole answers or server-sent events), GET /v1/models and /v1/models/{id}. Field list:
// docs/http-api.md.
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout_server/http_internal.h"
#include "shared/tool_calls.h"

// One generation request being answered, whole or streamed.
typedef struct {
    HttpServer *srv;
    HttpApi api;
    json_t *req;                // keeps the stop strings SamplingParams points at alive
    HttpGenOptions o;
    HttpPromptList pl;
    int32_t **ids;              // (n_prompts) prompt token ids
    int *lens;
    HttpGen g;
    HttpTokenText tt;
    char id[64];
    int64_t created;
    // streaming state
    const char *model;          // the model the request named (its adapter's name, or the served model's)
    int phase;                  // 0 preamble chunks, 1 events, 2 finished
    size_t *text_offset;        // (n_choices) completions logprobs offsets
    int error_sent;
} GenCall;

static int n_choices(const GenCall *c) { return c->pl.n * c->o.sp.n; }

static void gencall_free(GenCall *c) {
    if (!c) return;
    http_gen_release(&c->g);
    http_free_ids(c->ids, c->lens, c->pl.n);
    http_prompts_free(&c->pl);
    http_gen_options_free(&c->o);
    json_decref(c->req);
    free(c->text_offset);
    free(c);
}

static json_t *ids_json(const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

static const char *model_name(const GenCall *c) { return c->model ? c->model : c->srv->model_name; }

// The adapter of a model name: 0 for the served model, k for the k-th --lora adapter, -1 for neither.
static int adapter_of(HttpServer *s, const char *name) {
    if (strcmp(name, s->model_name) == 0) return 0;
    for (int k = 1; k <= engine_group_adapter_count(s->engines); k++)
        if (strcmp(name, engine_group_adapter_name(s->engines, k)) == 0) return k;
    return -1;
}

// The request's "model", when given, must name this server's model or one of its LoRA adapters (vLLM's multi-LoRA:
// the adapter is picked by name). *adapter: which (0 when absent), *model the name to echo.
static int check_model(HttpServer *s, const json_t *req, int *adapter, const char **model, HttpError *e) {
    const char *m = NULL;
    *adapter = 0;
    *model = s->model_name;
    int rc = http_get_string(req, "model", &m, NULL, e);
    if (rc < 0) return -1;
    if (rc == 1 && (*adapter = adapter_of(s, m)) < 0) {
        const int n = engine_group_adapter_count(s->engines);
        return http_error_set(e, 404, "model", "the model '%s' does not exist here; this server serves '%s'%s (GET "
                              "/v1/models lists them)", m, s->model_name, n > 0 ? " and its LoRA adapters" : "");
    }
    if (rc == 1) *model = m;
    return 0;
}

// Text of a prompt for echo: as sent, or decoded when it came as token ids.
static char *prompt_text(const GenCall *c, int p, size_t *len) {
    const HttpPrompt *pr = &c->pl.items[p];
    if (pr->text) {
        *len = pr->text_len;
        return strndup(pr->text, pr->text_len);
    }
    char *t = NULL;
    if (tokenizer_decode(engine_group_tokenizer(c->srv->engines), c->ids[p], (size_t)c->lens[p],
                         c->o.sp.skip_special_tokens, &t, len, NULL, 0) != 0) {
        free(t);
        *len = 0;
        return strdup("");
    }
    return t;
}

// Parses, tokenizes and submits. Returns NULL with e set on any refusal.
static GenCall *gencall_start(HttpReq *r, HttpApi api, HttpError *e) {
    HttpServer *s = r->srv;
    GenCall *c = calloc(1, sizeof *c);
    if (!c) {
        http_error_set(e, 500, NULL, "out of memory");
        return NULL;
    }
    c->srv = s;
    c->api = api;
    c->tt.text = http_token_text;
    c->tt.user = (void *)engine_group_tokenizer(s->engines);
    c->created = (int64_t)time(NULL);
    http_make_id(c->id, sizeof c->id, api == HTTP_API_CHAT ? "chatcmpl" : "cmpl");
    char *rendered = NULL;
    if (http_body_parse(r->body.data, r->body.len, &c->req, e) < 0) goto fail;
    int adapter;
    if (check_model(s, c->req, &adapter, &c->model, e) < 0) goto fail;
    if (http_parse_generation(c->req, api, s->vocab_size, &c->o, e) < 0) goto fail;
    c->o.sp.adapter = adapter;
    if (http_encode_bad_words(engine_group_tokenizer(s->engines), &c->o, e) < 0) goto fail;
    if (c->o.return_tokens_as_token_ids) c->tt.text = http_token_id_text;
    if (api == HTTP_API_CHAT) {
        size_t len = 0;
        if (http_render_messages(s, c->req, c->o.add_generation_prompt, &rendered, &len, e) < 0) goto fail;
        c->pl.items = calloc(1, sizeof *c->pl.items);
        if (!c->pl.items) {
            http_error_set(e, 500, NULL, "out of memory");
            goto fail;
        }
        c->pl.n = 1;
        c->pl.items[0].text = rendered;
        c->pl.items[0].text_len = len;
    } else {
        if (http_parse_prompts(json_object_get(c->req, "prompt"), "prompt", s->vocab_size, 1, &c->pl, e) < 0)
            goto fail;
    }
    if ((long)c->pl.n * c->o.sp.n > HTTP_MAX_COMPLETIONS) {
        http_error_set(e, 400, "n", "%d prompts x n=%d completions is over the limit of %d per request", c->pl.n,
                       c->o.sp.n, HTTP_MAX_COMPLETIONS);
        goto fail;
    }
    if (http_tokenize_prompts(engine_group_tokenizer(s->engines), &c->pl, c->o.add_special_tokens, &c->ids, &c->lens,
                              e) < 0)
        goto fail;
    if (api == HTTP_API_CHAT) { // the rendered text is no longer needed once tokenized
        free(rendered);
        rendered = NULL;
        c->pl.items[0].text = NULL;
        c->pl.items[0].text_len = 0;
        if (!c->o.max_tokens_given) { // OpenAI's default for chat: whatever the context leaves
            int left = s->max_model_len - c->lens[0];
            if (left < 1) {
                http_error_set(e, 400, "messages", "the conversation is %d tokens; the model's context is %d tokens",
                               c->lens[0], s->max_model_len);
                goto fail;
            }
            c->o.sp.max_tokens = left;
            if (http_check_min_tokens(&c->o, e) < 0) goto fail;
        }
    }
    c->text_offset = calloc((size_t)n_choices(c), sizeof *c->text_offset);
    if (!c->text_offset) {
        http_error_set(e, 500, NULL, "out of memory");
        goto fail;
    }
    if (http_gen_submit(&c->g, s, r->fd, c->ids, c->lens, c->pl.n, &c->o.sp, e) < 0) goto fail;
    return c;
fail:
    if (api == HTTP_API_CHAT && rendered && c->pl.items) c->pl.items[0].text = NULL;
    free(rendered);
    gencall_free(c);
    return NULL;
}

static json_t *usage_of(const GenCall *c) {
    return http_usage_json(http_gen_prompt_tokens(&c->g), http_gen_completion_tokens(&c->g),
                           http_gen_cached_tokens(&c->g));
}

// ---- whole answers ---------------------------------------------------------------------------------

static json_t *completion_answer(GenCall *c) {
    json_t *choices = json_array();
    for (int k = 0; k < n_choices(c); k++) {
        const HttpChoice *ch = &c->g.choices[k];
        int p = k / c->o.sp.n;
        json_t *o = json_object();
        json_object_set_new(o, "index", json_integer(k));
        if (c->o.echo) {
            size_t pl = 0;
            char *pt = prompt_text(c, p, &pl);
            HttpBuf b = {0};
            http_buf_append(&b, pt ? pt : "", pt ? pl : 0);
            http_buf_append(&b, ch->text ? ch->text : "", ch->text_len);
            json_object_set_new(o, "text", json_stringn(b.data ? b.data : "", b.len));
            http_buf_free(&b);
            free(pt);
        } else {
            json_object_set_new(o, "text", json_stringn(ch->text ? ch->text : "", ch->text_len));
        }
        size_t off = 0;
        const float *plp = NULL;
        const TokenLogprob *ptop = NULL;
        const int32_t *prank = NULL;
        const int pk = c->g.reqs[p] ? engine_request_prompt_logprobs(c->g.reqs[p], &plp, &ptop, &prank) : -1;
        json_t *lps = json_null();
        if (c->o.logprobs >= 0 && c->o.echo && pk >= 0)
            lps = http_echo_logprobs(c->ids[p], c->lens[p], plp, ptop, pk, c->o.logprobs, ch, &c->tt);
        else if (c->o.logprobs >= 0)
            lps = http_completion_logprobs(ch, 0, ch->n_tokens, &c->tt, &off);
        json_object_set_new(o, "logprobs", lps);
        if (c->o.prompt_logprobs >= 0 && pk >= 0)
            json_object_set_new(o, "prompt_logprobs", http_prompt_logprobs_json(c->ids[p], c->lens[p], plp, ptop, pk,
                                                                                 c->o.prompt_logprobs, prank, &c->tt));
        json_object_set_new(o, "finish_reason", http_finish_json(ch->finish));
        json_object_set_new(o, "stop_reason", http_stop_reason_json(ch, &c->o.sp));
        if (c->o.return_token_ids) {
            json_object_set_new(o, "prompt_token_ids", ids_json(c->ids[p], c->lens[p]));
            json_object_set_new(o, "token_ids", ids_json(ch->tokens, ch->n_tokens));
        }
        json_array_append_new(choices, o);
    }
    json_t *out = http_envelope(c->id, "text_completion", c->created, model_name(c), choices);
    json_object_set_new(out, "usage", usage_of(c));
    return out;
}

// The tool calls of an answer, in the format of the template's family (hermes for Qwen2.5 / Qwen3, llama3 for Llama
// 3.1, mistral for Mistral v0.3: vLLM's hermes, llama3_json and mistral parsers), as OpenAI's message.tool_calls, with
// the text outside them as the message's content (null when there is none). NULL when the answer holds no call that
// reads (the text is then the content, as vLLM's tool parsers leave it).
static json_t *tool_calls_json(const GenCall *c, const char *text, size_t len, json_t *msg) {
    ToolCallParse tp;
    char err[256];
    const ToolCallFormat f = tool_call_format_of_family(chat_template_family(c->srv->chat));
    if (tool_calls_parse(f, text ? text : "", text ? len : 0, &tp, err, sizeof err) != 0) return NULL;
    json_t *calls = NULL;
    if (tp.n_calls > 0 && (calls = json_array())) {
        for (size_t k = 0; k < tp.n_calls; k++) {
            // arguments as Python's json.dumps writes them (", " and ": ", non-ASCII kept), as vLLM's parsers do
            char id[192], *args = json_dumps(tp.calls[k].arguments, 0);
            if (tp.calls[k].id) snprintf(id, sizeof id, "%s", tp.calls[k].id);   // Mistral writes its own
            else snprintf(id, sizeof id, "%s-tool-%zu", c->id, k);
            json_array_append_new(calls, json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", id, "type", "function",
                                                   "function", "name", tp.calls[k].name, "arguments",
                                                   args ? args : "{}"));
            free(args);
        }
        json_object_set_new(msg, "content", tp.content && tp.content[0] ? json_string(tp.content) : json_null());
        json_object_set_new(msg, "tool_calls", calls);
    }
    tool_call_parse_free(&tp);
    return calls;
}

static json_t *chat_answer(GenCall *c) {
    json_t *choices = json_array();
    for (int k = 0; k < n_choices(c); k++) {
        const HttpChoice *ch = &c->g.choices[k];
        json_t *o = json_object(), *msg = json_object();
        json_object_set_new(o, "index", json_integer(k));
        json_object_set_new(msg, "role", json_string("assistant"));
        json_t *calls = c->o.tools && !c->o.tool_choice_none ? tool_calls_json(c, ch->text, ch->text_len, msg) : NULL;
        if (!calls) json_object_set_new(msg, "content", json_stringn(ch->text ? ch->text : "", ch->text_len));
        json_object_set_new(o, "message", msg);
        json_object_set_new(o, "logprobs",
                            c->o.logprobs >= 0 ? http_chat_logprobs(ch, 0, ch->n_tokens, &c->tt) : json_null());
        json_object_set_new(o, "finish_reason", calls && ch->finish == FINISH_STOP ? json_string("tool_calls")
                                                                                   : http_finish_json(ch->finish));
        json_object_set_new(o, "stop_reason", http_stop_reason_json(ch, &c->o.sp));
        if (c->o.return_token_ids) json_object_set_new(o, "token_ids", ids_json(ch->tokens, ch->n_tokens));
        json_array_append_new(choices, o);
    }
    json_t *out = http_envelope(c->id, "chat.completion", c->created, model_name(c), choices);
    json_object_set_new(out, "usage", usage_of(c));
    if (c->o.return_token_ids) json_object_set_new(out, "prompt_token_ids", ids_json(c->ids[0], c->lens[0]));
    return out;
}

// ---- streaming -------------------------------------------------------------------------------------

static int emit(HttpBuf *out, json_t *obj) {
    size_t n = 0;
    char *s = http_sse_format(obj, &n);
    json_decref(obj);
    if (!s) return -1;
    http_buf_append(out, s, n);
    free(s);
    return 0;
}

static json_t *chunk(const GenCall *c, json_t *choice) {
    json_t *choices = json_array();
    if (choice) json_array_append_new(choices, choice);
    return http_envelope(c->id, c->api == HTTP_API_CHAT ? "chat.completion.chunk" : "text_completion", c->created,
                         model_name(c), choices);
}

// First chunk of each choice: the assistant role (chat), the echoed prompt (completions with echo), and the
// prompt ids when return_token_ids asks for them.
static int emit_preamble(GenCall *c, HttpBuf *out) {
    for (int k = 0; k < n_choices(c); k++) {
        int p = k / c->o.sp.n;
        json_t *o = json_object();
        json_object_set_new(o, "index", json_integer(k));
        if (c->api == HTTP_API_CHAT) {
            json_t *delta = json_object();
            json_object_set_new(delta, "role", json_string("assistant"));
            json_object_set_new(delta, "content", json_string(""));
            json_object_set_new(o, "delta", delta);
            json_object_set_new(o, "logprobs", json_null());
        } else {
            if (!c->o.echo && !c->o.return_token_ids) {
                json_decref(o);
                continue;
            }
            size_t pl = 0;
            char *pt = c->o.echo ? prompt_text(c, p, &pl) : NULL;
            json_object_set_new(o, "text", json_stringn(pt ? pt : "", pt ? pl : 0));
            free(pt);
            json_object_set_new(o, "logprobs", json_null());
        }
        json_object_set_new(o, "finish_reason", json_null());
        if (c->o.return_token_ids) json_object_set_new(o, "prompt_token_ids", ids_json(c->ids[p], c->lens[p]));
        if (emit(out, chunk(c, o)) < 0) return -1;
    }
    return 0;
}

static int emit_event(GenCall *c, int k, const EngineEvent *ev, HttpBuf *out) {
    HttpChoice *ch = &c->g.choices[k];
    int from = ch->n_tokens;
    if (http_choice_append(ch, ev) != 0) return -1;
    if (ev->finish == FINISH_ERROR) { // OpenAI clients raise on an {"error": ...} event
        HttpError e;
        http_error_set(&e, 500, NULL, "generation failed in the engine (completion %d); the server log has the "
                       "details", k);
        c->error_sent = 1;
        return emit(out, http_error_json(&e));
    }
    if (ev->n_tokens == 0 && ev->text_len == 0 && ev->finish == FINISH_NONE) return 0;
    json_t *o = json_object();
    json_object_set_new(o, "index", json_integer(k));
    json_t *text = json_stringn(ev->text ? ev->text : "", ev->text_len);
    if (c->api == HTTP_API_CHAT) {
        json_t *delta = json_object();
        if (ev->text_len > 0 || ev->finish == FINISH_NONE) json_object_set_new(delta, "content", text);
        else json_decref(text);
        json_object_set_new(o, "delta", delta);
        json_object_set_new(o, "logprobs",
                            c->o.logprobs >= 0 ? http_chat_logprobs(ch, from, ev->n_tokens, &c->tt) : json_null());
    } else {
        json_object_set_new(o, "text", text);
        json_object_set_new(o, "logprobs", c->o.logprobs >= 0 ? http_completion_logprobs(ch, from, ev->n_tokens,
                                                                                         &c->tt, &c->text_offset[k])
                                                              : json_null());
    }
    json_object_set_new(o, "finish_reason", http_finish_json(ev->finish));
    if (ev->finish != FINISH_NONE) json_object_set_new(o, "stop_reason", http_stop_reason_json(ch, &c->o.sp));
    if (c->o.return_token_ids) json_object_set_new(o, "token_ids", ids_json(ev->tokens, ev->n_tokens));
    return emit(out, chunk(c, o));
}

static int stream_fill(void *user, HttpBuf *out) {
    GenCall *c = user;
    if (c->phase == 0) {
        c->phase = 1;
        if (emit_preamble(c, out) < 0) return -1;
        if (out->len > 0) return 0;
    }
    for (;;) {
        EngineEvent ev;
        int k;
        int rc = http_gen_next(&c->g, &ev, &k);
        if (rc < 0) return -1; // client gone or server stopping: end the stream, destroy releases the requests
        if (rc == 0) break;
        if (k < 0 || k >= n_choices(c)) return -1;
        if (emit_event(c, k, &ev, out) < 0) return -1;
        if (out->len > 0) return 0;
    }
    if (c->o.include_usage) {
        json_t *u = chunk(c, NULL);
        json_object_set_new(u, "usage", usage_of(c));
        if (emit(out, u) < 0) return -1;
    }
    http_buf_append(out, HTTP_SSE_DONE, strlen(HTTP_SSE_DONE));
    c->phase = 2;
    return 1;
}

static void stream_destroy(void *user) { gencall_free(user); }

// ---- routes ------------------------------------------------------------------------------------------

static void generate_route(HttpReq *r, HttpApi api) {
    HttpError e = {0};
    GenCall *c = gencall_start(r, api, &e);
    if (!c) {
        http_reply_error(r, &e);
        return;
    }
    c->g.answers_abort = 1; // finish_reason "abort" says that a completion was cut short
    if (c->o.stream) {
        HttpStreamOps ops = {stream_fill, stream_destroy, c};
        http_reply_stream(r, &ops);
        return;
    }
    if (http_gen_collect(&c->g, &e) < 0) {
        gencall_free(c);
        http_reply_error(r, &e);
        return;
    }
    r->prompt_tokens = http_gen_prompt_tokens(&c->g);
    r->completion_tokens = http_gen_completion_tokens(&c->g);
    json_t *out = api == HTTP_API_CHAT ? chat_answer(c) : completion_answer(c);
    gencall_free(c);
    http_reply_json(r, 200, out);
}

void http_route_completions(HttpReq *r) { generate_route(r, HTTP_API_COMPLETIONS); }

void http_route_chat(HttpReq *r) { generate_route(r, HTTP_API_CHAT); }

// The model object of adapter k (0: the served model), as vLLM lists a LoRA module: its root is the adapter's
// name (vLLM: its path) and its parent the base model's name.
static json_t *model_object(HttpServer *s, int k) {
    json_t *m = json_object();
    const char *id = k == 0 ? s->model_name : engine_group_adapter_name(s->engines, k);
    json_object_set_new(m, "id", json_string(id));
    json_object_set_new(m, "object", json_string("model"));
    json_object_set_new(m, "created", json_integer(s->started));
    json_object_set_new(m, "owned_by", json_string("tandem"));
    json_object_set_new(m, "root", json_string(k == 0 ? engine_group_model_id(s->engines) : id));
    json_object_set_new(m, "parent", k == 0 ? json_null() : json_string(s->model_name));
    json_object_set_new(m, "max_model_len", json_integer(s->max_model_len));
    return m;
}

// GET /v1/models lists the served model and its LoRA adapters; GET /v1/models/{id} answers with one object, or a
// 404 naming the id.
void http_route_models(HttpReq *r) {
    HttpServer *s = r->srv;
    static const char prefix[] = "/v1/models/";
    const int one = strncmp(r->path, prefix, sizeof prefix - 1) == 0;
    if (one) {
        const int k = adapter_of(s, r->path + sizeof prefix - 1);
        if (k < 0) {
            HttpError e;
            http_error_set(&e, 404, "model", "The model '%s' does not exist; this server serves '%s'%s",
                           r->path + sizeof prefix - 1, s->model_name,
                           engine_group_adapter_count(s->engines) > 0 ? " and its LoRA adapters" : "");
            http_reply_error(r, &e);
            return;
        }
        http_reply_json(r, 200, model_object(s, k));
        return;
    }
    json_t *data = json_array();
    for (int k = 0; k <= engine_group_adapter_count(s->engines); k++) json_array_append_new(data, model_object(s, k));
    json_t *o = json_object();
    json_object_set_new(o, "object", json_string("list"));
    json_object_set_new(o, "data", data);
    http_reply_json(r, 200, o);
}
