// shared/tokenizer/chat_template.h — chat messages -> prompt text, equal to transformers' apply_chat_template with
// the model's own Jinja template, for the template families tandem knows.
//
// tandem does not interpret Jinja. It recognises the family of tokenizer_config.json's chat_template from
// markers that only that family's templates contain, reads the few literals that vary inside a family
// (ChatML's default system prompt, Llama 3.1's default date), and renders with C code that reproduces the
// template's output. A template it does not recognise is an error that names the --chat-template option,
// never a guess. Families (the names --chat-template accepts):
//   chatml      <|im_start|>role\n...<|im_end|>\n, optional default system prompt (Qwen2, Qwen2.5, SmolLM2)
//   qwen3       ChatML with <think> blocks and enable_thinking (Qwen3)
//   llama3      Llama 3.0: <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>
//   llama3.1    Llama 3.1 / 3.2 / 3.3: same, always preceded by a system header with the knowledge cutoff and date
//   llama2      Llama 2 chat: <s>[INST] <<SYS>>...<</SYS>> ... [/INST] answer </s>
//   mistral     Mistral 7B Instruct v0.3 form: <s>[INST] ...[/INST] answer</s>, system prompt before the last
//               user message
//   mistral-v1  Mistral / Mixtral Instruct v0.1 form: <s>[INST] ... [/INST]answer</s>
//   zephyr      <|user|>\n...</s>\n (Zephyr, TinyLlama chat)
// Roles are "system", "user", "assistant" and "tool"; a role the family's template would reject, or an order it
// would reject (Llama 2 and Mistral require user/assistant alternation), is an error carrying the message
// the template raises. Tool results (role "tool") and assistant tool calls render as the template does: Qwen2.5's
// ChatML (tool markers in the template) and Qwen3 wrap them in <tool_response> / <tool_call> blocks, plain ChatML
// and Llama 3.0 write a "tool" turn like any other and do not show tool calls; the other families' tool formats
// are not rendered (an error that says so). Tool definitions (ChatRenderOptions.tools, the templates' `tools`) are
// written as each template writes them: Qwen2.5 and Qwen3 in the system turn (<tools> block), Llama 3.1 / 3.2 /
// 3.3 as "Environment: ipython" in the system header and the definitions (tojson(indent=4)) in the first user turn
// (tools_in_user_message, the template's default), Mistral v0.3 as [AVAILABLE_TOOLS] before the last user turn;
// other templates (chat_template_writes_tools() == 0) refuse them.
//
// The rendered text already holds the BOS the template writes, so encode it with add_special_tokens = 0
// (which is what apply_chat_template(tokenize=True) does).
#ifndef TANDEM_SHARED_CHAT_TEMPLATE_H
#define TANDEM_SHARED_CHAT_TEMPLATE_H

#include <stddef.h>

#include "shared/tokenizer/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    CHAT_FAMILY_CHATML = 1,
    CHAT_FAMILY_QWEN3,
    CHAT_FAMILY_LLAMA3,
    CHAT_FAMILY_LLAMA31,
    CHAT_FAMILY_LLAMA2,
    CHAT_FAMILY_MISTRAL,
    CHAT_FAMILY_MISTRAL_V1,
    CHAT_FAMILY_ZEPHYR,
} ChatFamily;

typedef struct {
    const char *name;       // the function called
    const char *arguments;  // JSON text of its arguments (OpenAI's string), rendered as the template's `tojson` of
                            // the parsed value (vLLM parses it before rendering)
} ChatToolCall;

typedef struct {
    const char *role;      // "system", "user", "assistant" or "tool"
    const char *content;   // UTF-8, NUL-terminated
    const ChatToolCall *tool_calls; // an assistant turn's calls (n_tool_calls of them), or NULL
    size_t n_tool_calls;
} ChatMessage;

typedef struct {
    int enable_thinking;      // qwen3: 0 appends an empty <think></think> block to the generation prompt
    const char *date_string;  // llama3.1: "Today Date" (NULL: the template's default, or today for templates
                              // that call strftime_now)
    const char *const *tools; // tool definitions as JSON texts (n_tools; OpenAI's {"type": "function", "function":
    size_t n_tools;           // {"name", "description", "parameters"}}), written as the template's `tools` (see above;
                              // templates without chat_template_writes_tools refuse them)
} ChatRenderOptions;

typedef struct ChatTemplate ChatTemplate;

// template_src: the Jinja template text (may be NULL when force_name is given). force_name: NULL to
// recognise the family from template_src, else one of the names above. bos_token / eos_token: the strings
// the template sees as bos_token / eos_token (NULL = "").
int chat_template_create(ChatTemplate **out, const char *template_src, const char *force_name, const char *bos_token,
                         const char *eos_token, char *err, size_t err_len);
// Same, with the template and special tokens of a tokenizer loaded from a model folder.
int chat_template_from_tokenizer(ChatTemplate **out, const Tokenizer *tok, const char *force_name, char *err,
                                 size_t err_len);
void chat_template_free(ChatTemplate *ct);

ChatFamily chat_template_family(const ChatTemplate *ct);
const char *chat_family_name(ChatFamily f);
// The default system prompt a chatml template injects when the conversation has none (NULL if none).
const char *chat_template_default_system(const ChatTemplate *ct);

// Whether the template writes tool definitions (ChatRenderOptions.tools): Qwen2.5's ChatML, Qwen3, Llama 3.1 and
// Mistral v0.3. A template that does not would leave `tools` out of the text in transformers too.
int chat_template_writes_tools(const ChatTemplate *ct);

// Renders messages. *out is malloc'd and NUL-terminated; *out_len (may be NULL) excludes the NUL.
int chat_render(const ChatTemplate *ct, const ChatMessage *msgs, size_t n, int add_generation_prompt, char **out,
                size_t *out_len, char *err, size_t err_len);
// With per-request options (opt may be NULL for the defaults: thinking on, the template's date).
int chat_render_ex(const ChatTemplate *ct, const ChatMessage *msgs, size_t n, int add_generation_prompt,
                   const ChatRenderOptions *opt, char **out, size_t *out_len, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif
#endif
