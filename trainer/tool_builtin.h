// trainer/tool_builtin.h — the tools tandem runs itself, without an environment service:
//   calculator(expression: string)   arithmetic, exact on integers (tool_calculator.h)
//   lookup(key: string)              the value stored under key in a small table (a JSON object of key -> value)
// A call with an unknown name, missing or mistyped arguments, or a failing evaluation answers an error text the
// policy reads ({"error": "..."}), as TRL answers a tool that raises; it is counted as a tool failure.
#ifndef TANDEM_TRAINER_TOOL_BUILTIN_H
#define TANDEM_TRAINER_TOOL_BUILTIN_H

#include <jansson.h>
#include <stddef.h>

#include "shared/tool_calls.h"

typedef struct ToolBox ToolBox;

// lookup_table: a JSON object (borrowed; copied), or NULL for a box without the lookup tool.
int toolbox_create(ToolBox **out, const json_t *lookup_table, char *err, size_t err_len);
void toolbox_free(ToolBox *tb);

// The tools' JSON schemas in the OpenAI / transformers form [{"type": "function", "function": {...}}] (new
// reference), what a chat template's `tools` argument takes.
json_t *toolbox_schemas(const ToolBox *tb);

// Runs one call. Returns the answer text (malloc'd; NULL only when out of memory); *failed = 1 when it is an error.
char *toolbox_run(const ToolBox *tb, const ToolCall *call, int *failed);

// The error text the policy reads for a failure (malloc'd): {"error": "<message>"}.
char *tool_error_text(const char *message);

#endif
