// trainer/tool_prompt.h — the tools' definitions in the prompt of a multi-turn run, as TRL's GRPOTrainer renders
// its prompts when given tools=[...]: apply_chat_template(prompt, tools=<the tools' JSON schemas>,
// add_generation_prompt=True), so the policy reads which tools exist and what arguments they take.
//
// The definitions are the environment's (env_tool_schemas: the built-in tools' own schemas, or those an
// environment service answers POST <url>/tools with). They are written only where the model's chat template
// writes `tools` (chat_template_writes_tools: Qwen2.5, Qwen3, Llama 3.1, Mistral v0.3); a template without a
// `tools` block (plain ChatML, Llama 3.0, ...) renders the prompt as it would without them — what transformers does
// with such a template — and the prompt must describe the tools itself. Plain-text prompts never get them (TRL's
// tools need conversational prompts).
#ifndef TANDEM_TRAINER_TOOL_PROMPT_H
#define TANDEM_TRAINER_TOOL_PROMPT_H

#include <stddef.h>

#include "shared/tokenizer/chat_template.h"
#include "trainer/environment.h"

typedef struct {
    char **texts;             // (n) each definition's JSON text
    size_t n;
    ChatRenderOptions opt;    // the render options of message prompts: opt.tools = texts when written, else none
    int written;              // 1: the definitions go into the prompt; 0: the environment gave none, or the template
                              // has no `tools` block
} ToolPrompt;

// Fills tp from env (may be NULL: no tools) and the chat template (may be NULL). 0, or -1 when out of memory.
int tool_prompt_init(ToolPrompt *tp, const Environment *env, const ChatTemplate *ct, char *err, size_t err_len);
void tool_prompt_free(ToolPrompt *tp);

#endif
