// rollout_server/http_chat.c — OpenAI chat "messages" -> prompt text through the model's chat template
// (shared/chat_template.h), for /v1/chat/completions and /tokenize.
#include <stdlib.h>
#include <string.h>

#include "rollout_server/http_internal.h"
#include "shared/chat_template.h"

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

int http_render_messages(HttpServer *s, const json_t *req, int add_generation_prompt, char **text, size_t *len,
                         HttpError *err) {
    *text = NULL;
    const json_t *msgs = json_object_get(req, "messages");
    if (!msgs || json_is_null(msgs)) return http_error_set(err, 400, "messages", "'messages' is required");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return http_error_set(err, 400, "messages", "'messages' must be a non-empty list of {role, content}");
    const json_t *custom = json_object_get(req, "chat_template");
    if (custom && !json_is_null(custom))
        return http_error_set(err, 400, "chat_template", "a per-request 'chat_template' is not supported; the "
                              "server uses the model's template or --chat-template");
    if (http_need_tokenizer(engine_group_tokenizer(s->engines), "messages", "render chat messages", err) < 0) return -1;
    if (!s->chat)
        return http_error_set(err, 400, "messages", "this server has no chat template: %s", s->chat_err);
    ChatRenderOptions opt;
    if (render_options(req, &opt, err) < 0) return -1;
    size_t n = json_array_size(msgs);
    ChatMessage *cm = calloc(n, sizeof *cm);
    char **owned = calloc(n, sizeof *owned);
    int rc = -1;
    if (!cm || !owned) {
        http_error_set(err, 500, NULL, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *m = json_array_get(msgs, i);
        if (!json_is_object(m)) {
            http_error_set(err, 400, "messages", "'messages'[%zu] must be an object {role, content}", i);
            goto done;
        }
        const json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) {
            http_error_set(err, 400, "messages", "'messages'[%zu].role must be a string", i);
            goto done;
        }
        if (!(owned[i] = message_content(json_object_get(m, "content"), i, err))) goto done;
        cm[i].role = json_string_value(role);
        cm[i].content = owned[i];
    }
    char msg[512];
    msg[0] = 0;
    if (chat_render_ex(s->chat, cm, n, add_generation_prompt, &opt, text, len, msg, sizeof msg) != 0) {
        http_error_set(err, 400, "messages", "chat template (%s): %s", chat_family_name(chat_template_family(s->chat)),
                       msg);
        goto done;
    }
    rc = 0;
done:
    for (size_t i = 0; owned && i < n; i++) free(owned[i]);
    free(owned);
    free(cm);
    return rc;
}
