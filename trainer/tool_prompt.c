// trainer/tool_prompt.c — the tools' definitions as the chat template's `tools` (tool_prompt.h).
#include "trainer/tool_prompt.h"

#include <stdlib.h>
#include <string.h>

#include "shared/err.h"

int tool_prompt_init(ToolPrompt *tp, const Environment *env, const ChatTemplate *ct, char *err, size_t err_len) {
    memset(tp, 0, sizeof *tp);
    tp->opt.enable_thinking = 1;   // the template's default, as chat_render
    const json_t *schemas = env_tool_schemas(env);
    const size_t n = json_array_size(schemas);
    if (n == 0 || !chat_template_writes_tools(ct)) return 0;
    if (!(tp->texts = calloc(n, sizeof *tp->texts))) return err_fail(err, err_len, "tool definitions: out of memory");
    for (size_t i = 0; i < n; i++) {
        // Key order is kept (jansson keeps insertion order): the templates' tojson writes the keys as given.
        if (!(tp->texts[i] = json_dumps(json_array_get(schemas, i), JSON_COMPACT))) {
            tool_prompt_free(tp);
            return err_fail(err, err_len, "tool definitions: out of memory");
        }
        tp->n++;
    }
    tp->opt.tools = (const char *const *)tp->texts;
    tp->opt.n_tools = tp->n;
    tp->written = 1;
    return 0;
}

void tool_prompt_free(ToolPrompt *tp) {
    if (!tp) return;
    for (size_t i = 0; i < tp->n; i++) free(tp->texts[i]);
    free(tp->texts);
    memset(tp, 0, sizeof *tp);
    tp->opt.enable_thinking = 1;
}
