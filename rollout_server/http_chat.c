// rollout_server/http_chat.c — OpenAI chat "messages" -> prompt text through the model's chat template
// (shared/tokenizer/chat_template.h), for /v1/chat/completions and /tokenize.
#include <stdlib.h>
#include <string.h>

#include "rollout_server/http_internal.h"
#include "shared/tokenizer/chat_template.h"

// Content is a string, null (an assistant turn without text), or a list of {"type": "text", "text": ...}
// parts, which are joined with newlines as vLLM does. Returns a malloc'd string or NULL with err set.
static char *message_content(const json_t *c, size_t idx, HttpError *err) {
    if (!c || json_is_null(c)) return strdup("");
    if (json_is_string(c)) return strndup(json_string_value(c), json_string_length(c));
    if (!json_is_array(c)) {
        http_error_set(err, 400, "messages", "'messages'[%zu].content must be a string or a list of text parts", idx);
        return NULL;
    }
    HttpBuf b = {0};
    for (size_t k = 0; k < json_array_size(c); k++) {
        const json_t *part = json_array_get(c, k);
        const json_t *type = json_is_object(part) ? json_object_get(part, "type") : NULL;
        const json_t *text = json_is_object(part) ? json_object_get(part, "text") : NULL;
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0 || !json_is_string(text)) {
            http_buf_free(&b);
            http_error_set(err, 400, "messages", "'messages'[%zu].content[%zu]: only {\"type\": \"text\", \"text\": "
                           "...} parts are supported", idx, k);
            return NULL;
        }
        if (k > 0) http_buf_append(&b, "\n", 1);
        http_buf_append(&b, json_string_value(text), json_string_length(text));
    }
    if (b.oom) {
        http_buf_free(&b);
        http_error_set(err, 500, NULL, "out of memory");
        return NULL;
    }
    return b.data ? b.data : strdup("");
}

static int render_options(const json_t *req, ChatRenderOptions *opt, HttpError *err) {
    opt->enable_thinking = 1;
    opt->date_string = NULL;
    const json_t *kw = json_object_get(req, "chat_template_kwargs");
    if (!kw || json_is_null(kw)) return 0;
    if (!json_is_object(kw))
        return http_error_set(err, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)kw, key, v) {
        if (strcmp(key, "enable_thinking") == 0) {
            if (!json_is_boolean(v))
                return http_error_set(err, 400, "chat_template_kwargs", "'chat_template_kwargs.enable_thinking' must "
                                      "be a boolean");
            opt->enable_thinking = json_is_true(v);
        } else if (strcmp(key, "date_string") == 0) {
            if (!json_is_string(v))
                return http_error_set(err, 400, "chat_template_kwargs", "'chat_template_kwargs.date_string' must be "
                                      "a string");
            opt->date_string = json_string_value(v);
        } else {
            return http_error_set(err, 400, "chat_template_kwargs", "'chat_template_kwargs.%s' is not supported "
                                  "(supported: enable_thinking, date_string)", key);
        }
    }
    return 0;
}

void http_chat_messages_free(HttpChatMessages *m) {
    if (!m) return;
    for (size_t i = 0; m->owned && i < m->n; i++) free(m->owned[i]);
    for (size_t k = 0; m->owned_args && k < m->n_calls; k++) free(m->owned_args[k]);
    for (size_t k = 0; m->tool_texts && k < m->opt.n_tools; k++) free(m->tool_texts[k]);
    free(m->tool_texts);
    free(m->owned);
    free(m->owned_args);
    free(m->calls);
    free(m->items);
    memset(m, 0, sizeof *m);
}

// messages[i].tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}] into out->calls from
// *next on. arguments is OpenAI's JSON text, or an object (taken as its JSON text).
static int parse_tool_calls(const json_t *tc, size_t i, HttpChatMessages *out, size_t *next, HttpError *err) {
    ChatMessage *msg = &out->items[i];
    msg->tool_calls = out->calls + *next;
    msg->n_tool_calls = json_array_size(tc);
    for (size_t k = 0; k < json_array_size(tc); k++, (*next)++) {
        const json_t *call = json_array_get(tc, k);
        const json_t *type = json_is_object(call) ? json_object_get(call, "type") : NULL;
        const json_t *fn = json_is_object(call) ? json_object_get(call, "function") : NULL;
        const json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
        const json_t *args = json_is_object(fn) ? json_object_get(fn, "arguments") : NULL;
        if ((type && !json_is_null(type) && !(json_is_string(type) && !strcmp(json_string_value(type), "function"))) ||
            !json_is_string(name) || !(json_is_string(args) || json_is_object(args) || !args || json_is_null(args)))
            return http_error_set(err, 400, "messages", "'messages'[%zu].tool_calls[%zu] must be {\"type\": "
                                  "\"function\", \"function\": {\"name\": string, \"arguments\": JSON text}}", i,
                                  k);
        ChatToolCall *c = &out->calls[*next];
        c->name = json_string_value(name);
        if (json_is_object(args)) {
            if (!(out->owned_args[*next] = json_dumps(args, JSON_COMPACT | JSON_ENCODE_ANY)))
                return http_error_set(err, 500, NULL, "out of memory");
            c->arguments = out->owned_args[*next];
        } else {
            c->arguments = json_is_string(args) ? json_string_value(args) : "";
            json_error_t je;
            json_t *parsed = c->arguments[0] ? json_loads(c->arguments, JSON_DECODE_ANY, &je) : NULL;
            if (c->arguments[0] && !parsed)
                return http_error_set(err, 400, "messages", "'messages'[%zu].tool_calls[%zu].function.arguments is "
                                      "not JSON: %s", i, k, je.text);
            json_decref(parsed);
        }
    }
    return 0;
}

int http_parse_messages(const json_t *req, HttpChatMessages *out, HttpError *err) {
    memset(out, 0, sizeof *out);
    const json_t *msgs = json_object_get(req, "messages");
    if (!msgs || json_is_null(msgs)) return http_error_set(err, 400, "messages", "'messages' is required");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return http_error_set(err, 400, "messages", "'messages' must be a non-empty list of {role, content}");
    const json_t *custom = json_object_get(req, "chat_template");
    if (custom && !json_is_null(custom))
        return http_error_set(err, 400, "chat_template", "a per-request 'chat_template' is not supported; the "
                              "server uses the model's template or --chat-template");
    if (render_options(req, &out->opt, err) < 0) return -1;
    const json_t *tools = json_object_get(req, "tools");   // checked by http_parse_generation
    if (json_is_array(tools) && json_array_size(tools) > 0) {
        const size_t nt = json_array_size(tools);
        if (!(out->tool_texts = calloc(nt, sizeof *out->tool_texts)))
            return http_error_set(err, 500, NULL, "out of memory");
        out->opt.tools = (const char *const *)out->tool_texts;
        out->opt.n_tools = nt;
        for (size_t k = 0; k < nt; k++)
            if (!(out->tool_texts[k] = json_dumps(json_array_get(tools, k), JSON_COMPACT))) {
                http_chat_messages_free(out);
                return http_error_set(err, 500, NULL, "out of memory");
            }
    }
    size_t n = json_array_size(msgs), n_calls = 0;
    for (size_t i = 0; i < n; i++) {
        const json_t *m = json_array_get(msgs, i);
        n_calls += json_is_object(m) ? json_array_size(json_object_get(m, "tool_calls")) : 0;
    }
    out->items = calloc(n, sizeof *out->items);
    out->owned = calloc(n, sizeof *out->owned);
    out->calls = calloc(n_calls + 1, sizeof *out->calls);
    out->owned_args = calloc(n_calls + 1, sizeof *out->owned_args);
    out->n = n;
    out->n_calls = n_calls;
    if (!out->items || !out->owned || !out->calls || !out->owned_args) {
        http_chat_messages_free(out);
        return http_error_set(err, 500, NULL, "out of memory");
    }
    size_t next_call = 0;
    for (size_t i = 0; i < n; i++) {
        const json_t *m = json_array_get(msgs, i);
        if (!json_is_object(m)) {
            http_error_set(err, 400, "messages", "'messages'[%zu] must be an object {role, content}", i);
            goto fail;
        }
        const json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) {
            http_error_set(err, 400, "messages", "'messages'[%zu].role must be a string", i);
            goto fail;
        }
        if (!(out->owned[i] = message_content(json_object_get(m, "content"), i, err))) goto fail;
        const char *r = json_string_value(role);
        out->items[i].role = strcmp(r, "developer") == 0 ? "system" : r;
        out->items[i].content = out->owned[i];
        const json_t *tc = json_object_get(m, "tool_calls");
        if (tc && !json_is_null(tc)) {
            if (!json_is_array(tc) || strcmp(r, "assistant") != 0) {
                http_error_set(err, 400, "messages", "'messages'[%zu].tool_calls must be a list, on an assistant "
                               "message", i);
                goto fail;
            }
            if (parse_tool_calls(tc, i, out, &next_call, err) < 0) goto fail;
        }
    }
    return 0;
fail:
    http_chat_messages_free(out);
    return -1;
}

int http_render_messages(HttpServer *s, const json_t *req, int add_generation_prompt, char **text, size_t *len,
                         HttpError *err) {
    *text = NULL;
    HttpChatMessages cm;
    if (http_parse_messages(req, &cm, err) < 0) return -1;
    int rc = -1;
    if (http_need_tokenizer(engine_group_tokenizer(s->engines), "messages", "render chat messages", err) < 0)
        goto done;
    if (!s->chat) {
        http_error_set(err, 400, "messages", "this server has no chat template: %s", s->chat_err);
        goto done;
    }
    char msg[512];
    msg[0] = 0;
    if (chat_render_ex(s->chat, cm.items, cm.n, add_generation_prompt, &cm.opt, text, len, msg, sizeof msg) != 0) {
        http_error_set(err, 400, "messages", "chat template (%s): %s", chat_family_name(chat_template_family(s->chat)),
                       msg);
        goto done;
    }
    rc = 0;
done:
    http_chat_messages_free(&cm);
    return rc;
}
