// shared/tokenizer/chat_template_internal.h — the ChatTemplate record shared by chat_template.c (recognition) and
// chat_template_render.c (rendering). Not a public API.
#ifndef TANDEM_SHARED_CHAT_TEMPLATE_INTERNAL_H
#define TANDEM_SHARED_CHAT_TEMPLATE_INTERNAL_H

#include "shared/tokenizer/chat_template.h"

struct ChatTemplate {
    ChatFamily family;
    char *bos, *eos;              // what the template calls bos_token / eos_token
    char *default_system;         // chatml: system prompt used when the conversation has none (or NULL)
    char *default_date;           // llama3.1: the template's fallback date_string
    char *knowledge_cutoff;       // llama3.1: "December 2023"
    int date_from_clock;          // llama3.1: the template prefers strftime_now("%d %b %Y")
    int gen_prompt_always;        // llama3: early templates append the assistant header unconditionally
    int eos_space;                // mistral-v1: answers end with eos_token + ' '
};

#endif
