// trainer/tool_turn_render.c — the tool turn's text per chat family (tool_turn_render.h).
#include "trainer/tool_turn_render.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"

int tool_turn_style(ToolTurnStyle *out, const ChatTemplate *ct, const Tokenizer *tok, int enable_thinking, char *err,
                    size_t err_len) {
    memset(out, 0, sizeof *out);
    out->family = chat_template_family(ct);
    out->enable_thinking = enable_thinking;
    const char *eos = tokenizer_eos_token(tok);
    const char *src = tokenizer_chat_template(tok);
    switch (out->family) {
    case CHAT_FAMILY_CHATML:
    case CHAT_FAMILY_QWEN3:
        out->tool_response_tags = out->family == CHAT_FAMILY_QWEN3 || (src && strstr(src, "<tool_response>"));
        out->turn_end_is_eos = eos && strcmp(eos, "<|im_end|>") == 0;
        return 0;
    case CHAT_FAMILY_LLAMA31:
    case CHAT_FAMILY_MISTRAL:
        out->turn_end_is_eos = 1;   // their assistant blocks end with the end-of-turn token itself
        return 0;
    default:
        return err_fail(err, err_len, "the %s chat template has no tool messages, so environment answers cannot be "
                        "rendered: use a model whose template renders tool results (chatml/Qwen, qwen3, llama3.1, "
                        "mistral v0.3), or --chat-template to name one", chat_family_name(out->family));
    }
}

typedef struct {
    char *s;
    size_t n, cap;
    int oom;
} Buf;

static void put(Buf *b, const char *s) {
    size_t k = strlen(s);
    if (b->oom) return;
    if (b->n + k + 1 > b->cap) {
        size_t cap = (b->n + k + 1) * 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->s = p, b->cap = cap;
    }
    memcpy(b->s + b->n, s, k + 1);
    b->n += k;
}

// Jinja's tojson as transformers defines it (json.dumps, ensure_ascii False) on a string.
static void put_json_string(Buf *b, const char *s) {
    json_t *v = json_string(s);
    char *t = v ? json_dumps(v, JSON_ENCODE_ANY) : NULL;
    if (!t) b->oom = 1;
    else put(b, t);
    free(t);
    json_decref(v);
}

static int valid_mistral_id(const char *id) { return id && strlen(id) == 9; }

int tool_turn_render(const ToolTurnStyle *s, const ToolMessage *msgs, size_t n, char **out, char *err,
                     size_t err_len) {
    *out = NULL;
    if (n == 0) return err_fail(err, err_len, "tool_turn_render: no tool messages");
    Buf b = {0};
    put(&b, "");
    switch (s->family) {
    case CHAT_FAMILY_CHATML:
    case CHAT_FAMILY_QWEN3:
        if (s->turn_end_is_eos) put(&b, "\n");
        if (s->tool_response_tags) {
            put(&b, "<|im_start|>user");
            for (size_t i = 0; i < n; i++) {
                put(&b, "\n<tool_response>\n");
                put(&b, msgs[i].content);
                put(&b, "\n</tool_response>");
            }
            put(&b, "<|im_end|>\n");
        } else {
            for (size_t i = 0; i < n; i++) {
                put(&b, "<|im_start|>tool\n");
                put(&b, msgs[i].content);
                put(&b, "<|im_end|>\n");
            }
        }
        put(&b, "<|im_start|>assistant\n");
        if (s->family == CHAT_FAMILY_QWEN3 && !s->enable_thinking) put(&b, "<think>\n\n</think>\n\n");
        break;
    case CHAT_FAMILY_LLAMA31:
        for (size_t i = 0; i < n; i++) {
            put(&b, "<|start_header_id|>ipython<|end_header_id|>\n\n");
            put_json_string(&b, msgs[i].content);
            put(&b, "<|eot_id|>");
        }
        put(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case CHAT_FAMILY_MISTRAL:
        for (size_t i = 0; i < n; i++) {
            if (!valid_mistral_id(msgs[i].call_id)) {
                free(b.s);
                return err_fail(err, err_len, "the mistral chat template needs each tool answer's call id to be 9 "
                                "characters (\"Tool call IDs should be alphanumeric strings with length 9!\"); "
                                "tool answer %zu has %s", i + 1, msgs[i].call_id ? msgs[i].call_id : "none");
            }
            put(&b, "[TOOL_RESULTS] {\"content\": ");
            put(&b, msgs[i].content);
            put(&b, ", \"call_id\": \"");
            put(&b, msgs[i].call_id);
            put(&b, "\"}[/TOOL_RESULTS]");
        }
        break;
    default:
        free(b.s);
        return err_fail(err, err_len, "the %s chat template has no tool messages", chat_family_name(s->family));
    }
    if (b.oom) {
        free(b.s);
        return err_fail(err, err_len, "tool_turn_render: out of memory");
    }
    *out = b.s;
    return 0;
}
