// trainer/tool_turn_render.h — the environment's turn as the model's chat template renders it: the text that
// follows the assistant turn's end-of-turn token, holding the tool messages and the next generation prompt.
//
// It equals what TRL's GRPOTrainer._get_tool_suffix_ids takes out of apply_chat_template: the conversation
// [user, assistant with tool_calls] + tool messages rendered with add_generation_prompt, minus the same
// conversation without the tool messages cut after its last eos token. So when the tokenizer's eos is the family's
// end-of-turn token, the text starts right after it (ChatML: "\n<|im_start|>user..."); otherwise after the whole
// assistant block. Encoded with add_special_tokens = 0, its ids equal TRL's slice: the special token before it
// splits the text there.
//
// The chat-template renderer in shared/tokenizer has no tool role on this branch, so the tool turn is rendered
// here, per family, from each family's real template:
//   chatml (Qwen2.5 and other templates with <tool_response>) and qwen3:
//       <|im_start|>user\n<tool_response>\n{content}\n</tool_response>...<|im_end|>\n<|im_start|>assistant\n
//   chatml templates without tool support render the role generically: <|im_start|>tool\n{content}<|im_end|>\n
//   llama3.1: <|start_header_id|>ipython<|end_header_id|>\n\n{content as a JSON string}<|eot_id|> per message
//   mistral (v0.3): [TOOL_RESULTS] {"content": {content}, "call_id": "{9-character id}"}[/TOOL_RESULTS]
// Other families (llama3 3.0, llama2, mistral-v1, zephyr) have no tool messages: an error says so.
#ifndef TANDEM_TRAINER_TOOL_TURN_RENDER_H
#define TANDEM_TRAINER_TOOL_TURN_RENDER_H

#include <stddef.h>

#include "shared/tokenizer/chat_template.h"
#include "shared/tokenizer/tokenizer.h"
#include "trainer/environment.h"

typedef struct {
    ChatFamily family;
    int tool_response_tags;   // chatml: the template wraps tool answers in <tool_response> (Qwen2.5 style)
    int turn_end_is_eos;      // the tokenizer's eos is the family's end-of-turn token
    int enable_thinking;      // qwen3: 0 opens the next turn with an empty <think></think> block
} ToolTurnStyle;

// The style of the model's template. -1 with a message when the family has no tool messages.
int tool_turn_style(ToolTurnStyle *out, const ChatTemplate *ct, const Tokenizer *tok, int enable_thinking, char *err,
                    size_t err_len);

// Renders n tool messages (n >= 1). *out malloc'd, NUL-terminated. -1 with a message (a Mistral message without a
// 9-character call id, as the template refuses; out of memory).
int tool_turn_render(const ToolTurnStyle *s, const ToolMessage *msgs, size_t n, char **out, char *err,
                     size_t err_len);

#endif
