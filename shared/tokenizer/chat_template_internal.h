// shared/tokenizer/chat_template_internal.h — the ChatTemplate record shared by chat_template.c (recognition) and
// chat_template_render.c (rendering). Not a public API.
#ifndef TANDEM_SHARED_CHAT_TEMPLATE_INTERNAL_H
#define TANDEM_SHARED_CHAT_TEMPLATE_INTERNAL_H

#include "shared/tokenizer/chat_template.h"
#include "shared/tokenizer/tokenizer_internal.h"

struct ChatTemplate {
    ChatFamily family;
    char *bos, *eos;              // what the template calls bos_token / eos_token
    char *default_system;         // chatml: system prompt used when the conversation has none (or NULL)
    char *default_date;           // llama3.1: the template's fallback date_string
    char *knowledge_cutoff;       // llama3.1: "December 2023"
    int date_from_clock;          // llama3.1: the template prefers strftime_now("%d %b %Y")
    int gen_prompt_always;        // llama3: early templates append the assistant header unconditionally
    int eos_space;                // mistral-v1: answers end with eos_token + ' '
    int qwen_tools;               // chatml: Qwen2.5's template, which wraps tool results and tool calls
    int mistral_tools;            // mistral: the v0.3 template with [AVAILABLE_TOOLS] (tool definitions)
};

// The `tojson` filter (chat_template_json.c): appends json_text re-serialised as transformers writes it. 0,
// TOK_EINVAL (not JSON; err says so) or TOK_ENOMEM.
int chat_tojson(const char *json_text, TokBuf *out, char *err, size_t err_len);
// The same with `tojson(indent=N)`: json.dumps(indent=N), one member a line (Llama 3.1's tool definitions).
int chat_tojson_indent(const char *json_text, int indent, TokBuf *out, char *err, size_t err_len);

#endif
