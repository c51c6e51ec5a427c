// shared/tool_calls.h — the tool calls in an assistant message, in the formats models are trained to write.
//
// It lives in shared/ because both binaries read tool calls: the trainer to run an episode's tools, the server to
// answer an OpenAI chat request with "tool_calls".
//
// Formats (text is the decoded assistant turn, special tokens kept, end-of-turn token optional):
//   hermes   Hermes / Qwen2.5 / Qwen3: one or several <tool_call>{"name": ..., "arguments": {...}}</tool_call>
//            blocks; the text outside them is the content.
//   llama3   Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole message (after an optional <|python_tag|>) is
//            {"name": ..., "parameters": {...}}, or several such objects separated by ';' or white space. A
//            message that does not start with '{' (after the tag) is plain content.
//   mistral  [TOOL_CALLS] followed by a JSON list [{"name": ..., "arguments": {...}, "id": "..."}] (v0.3), or by
//            name[ARGS]{...} (v11 tokenizers; [TOOL_CALLS] repeated before each call); the text before it is the
//            content.
// "arguments" may also be a JSON string holding the object (as OpenAI sends them); "parameters" is accepted where
// "arguments" is expected and the other way round.
//
// A call that cannot be read (broken JSON, no name, arguments not an object, an unclosed <tool_call>) is not a
// failure of the parser: parse->error says what is wrong, in words the policy can act on, and the caller shows it
// to the policy as the tool's answer. Calls before the broken one are kept. Only running out of memory fails.
#ifndef TANDEM_SHARED_TOOL_CALLS_H
#define TANDEM_SHARED_TOOL_CALLS_H

#include <jansson.h>
#include <stddef.h>

#include "shared/tokenizer/chat_template.h"

typedef enum {
    TOOL_FORMAT_HERMES = 1,
    TOOL_FORMAT_LLAMA3,
    TOOL_FORMAT_MISTRAL,
} ToolCallFormat;

typedef struct {
    char *name;          // malloc'd
    json_t *arguments;   // a JSON object (owned reference)
    char *id;            // malloc'd, or NULL: the call id the model wrote (Mistral)
} ToolCall;

typedef struct {
    char *content;       // malloc'd: the message text outside the calls, surrounding white space removed
    ToolCall *calls;
    size_t n_calls;
    char *error;         // malloc'd, or NULL: why a call in the message could not be read
} ToolCallParse;

// "hermes", "llama3", "mistral" -> the format; -1 with a message listing the names when unknown.
int tool_call_format_from_name(const char *name, ToolCallFormat *out, char *err, size_t err_len);
// The format the models of a chat template family write their calls in: llama3 for Llama 3.1, mistral for Mistral,
// hermes for the others (Qwen2.5 / Qwen3 / ChatML).
ToolCallFormat tool_call_format_of_family(ChatFamily family);
const char *tool_call_format_name(ToolCallFormat f);

// Parses len bytes of text. 0 (out filled; free with tool_call_parse_free), or -1 when out of memory or f unknown.
int tool_calls_parse(ToolCallFormat f, const char *text, size_t len, ToolCallParse *out, char *err, size_t err_len);
void tool_call_parse_free(ToolCallParse *p);

#endif
