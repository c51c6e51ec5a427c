// shared/tokenizer/chat_template_render.c — renders messages exactly as each family's Jinja template does
// (transformers renders with trim_blocks and lstrip_blocks; the strings below are the results).
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/tokenizer/chat_template_internal.h"
#include "shared/tokenizer/tokenizer_internal.h"

typedef struct { const char *s; size_t n; } Str;

static Str str(const char *s) { return (Str){s, strlen(s)}; }
static int out_s(TokBuf *b, Str s) { return tok_buf_append(b, s.s, s.n); }
static int out_c(TokBuf *b, const char *s) { return tok_buf_append(b, s, strlen(s)); }

// Python str.isspace(), which str.strip() and Jinja's trim filter use.
static int py_space(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

static int is_nl(uint32_t cp) { return cp == '\n'; }

// Strips code points matching `pred` from the left and/or right end (Python's str.strip family).
static Str strip_by(Str s, int left, int right, int (*pred)(uint32_t)) {
    size_t a = 0, z = s.n;
    while (left && a < z) {
        uint32_t cp;
        int l = tok_utf8_decode(s.s + a, z - a, &cp);
        if (!pred(cp)) break;
        a += (size_t)l;
    }
    while (right && z > a) {
        size_t b = z - 1;
        while (b > a && ((unsigned char)s.s[b] & 0xC0) == 0x80) b--;
        uint32_t cp;
        tok_utf8_decode(s.s + b, z - b, &cp);
        if (!pred(cp)) break;
        z = b;
    }
    return (Str){s.s + a, z - a};
}

static Str trim(Str s) { return strip_by(s, 1, 1, py_space); }

static const char *find_in(Str s, const char *needle, int last) {
    size_t nl = strlen(needle);
    const char *hit = NULL;
    for (size_t i = 0; i + nl <= s.n; i++)
        if (memcmp(s.s + i, needle, nl) == 0) {
            hit = s.s + i;
            if (!last) break;
        }
    return hit;
}

static int role_is(const ChatMessage *m, const char *r) { return strcmp(m->role, r) == 0; }

static void fail(char *err, size_t err_len, const char *msg) { tok_set_err(err, err_len, "chat template: %s", msg); }

// ---- families ---------------------------------------------------------------------------------------

// A tool result as Qwen's templates write it: consecutive "tool" messages share one user turn.
static int out_tool_response(const ChatMessage *m, size_t n, size_t i, TokBuf *o) {
    int rc = 0;
    if (i == 0 || !role_is(&m[i - 1], "tool")) rc = out_c(o, "<|im_start|>user");
    rc = rc || out_c(o, "\n<tool_response>\n") || out_c(o, m[i].content) || out_c(o, "\n</tool_response>");
    if (!rc && (i == n - 1 || !role_is(&m[i + 1], "tool"))) rc = out_c(o, "<|im_end|>\n");
    return rc;
}

// One call as Qwen's templates write it: <tool_call>\n{"name": "NAME", "arguments": ARGS | tojson}\n</tool_call>.
// Returns 0, TOK_ENOMEM, or TOK_EINVAL (arguments are not JSON).
static int out_tool_call(const ChatToolCall *c, TokBuf *o, char *err, size_t err_len) {
    if (out_c(o, "<tool_call>\n{\"name\": \"") || out_c(o, c->name ? c->name : "") ||
        out_c(o, "\", \"arguments\": "))
        return TOK_ENOMEM;
    int rc = chat_tojson(c->arguments && *c->arguments ? c->arguments : "{}", o, err, err_len);
    if (rc) return rc;
    return out_c(o, "}\n</tool_call>") ? TOK_ENOMEM : 0;
}

// The `tools` block of Qwen2.5's and Qwen3's system turn: each tool as the template's `tojson` writes it, in <tools>,
// then how to call them; the caller has written the turn's start (and any system text).
static int out_tools(const char *const *tools, size_t n_tools, TokBuf *o, char *err, size_t err_len) {
    if (out_c(o, "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>"))
        return TOK_ENOMEM;
    for (size_t k = 0; k < n_tools; k++) {
        if (out_c(o, "\n")) return TOK_ENOMEM;
        const int rc = chat_tojson(tools[k], o, err, err_len);
        if (rc) return rc;
    }
    return out_c(o, "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                    "<args-json-object>}\n</tool_call><|im_end|>\n") ? TOK_ENOMEM : 0;
}

static int render_chatml(const ChatTemplate *ct, const ChatMessage *m, size_t n, int gen, const ChatRenderOptions *opt,
                         TokBuf *o, char *err, size_t err_len) {
    int rc = 0;
    const int with_tools = opt && opt->n_tools > 0;   // Qwen2.5 (chat_render_ex checks)
    size_t first = 0;
    if (with_tools) {   // the system text (the first message's, else the default), then the tools; then no system turn
        const int sys = role_is(&m[0], "system");
        rc = out_c(o, "<|im_start|>system\n") || out_c(o, sys ? m[0].content : ct->default_system ? ct->default_system
                                                                                                   : "") ||
             out_c(o, "\n\n");
        if (!rc && (rc = out_tools(opt->tools, opt->n_tools, o, err, err_len)) != 0) return rc;
        first = sys;
    } else if (ct->default_system && !role_is(&m[0], "system")) {
        rc = out_c(o, "<|im_start|>system\n") || out_c(o, ct->default_system) || out_c(o, "<|im_end|>\n");
    }
    for (size_t i = first; i < n && !rc; i++) {
        if (ct->qwen_tools && role_is(&m[i], "tool")) {
            rc = out_tool_response(m, n, i, o);
        } else if (ct->qwen_tools && role_is(&m[i], "assistant") && m[i].n_tool_calls > 0) {
            // Qwen2.5: "<|im_start|>assistant", the text after a newline when there is any, each call after one.
            rc = out_c(o, "<|im_start|>assistant") || (m[i].content[0] && (out_c(o, "\n") || out_c(o, m[i].content)));
            for (size_t k = 0; k < m[i].n_tool_calls && !rc; k++) {
                if (out_c(o, "\n")) return TOK_ENOMEM;
                if ((rc = out_tool_call(&m[i].tool_calls[k], o, err, err_len)) != 0) return rc;
            }
            rc = rc || out_c(o, "<|im_end|>\n");
        } else { // plain ChatML writes any role as it is, and no tool calls
            rc = out_c(o, "<|im_start|>") || out_c(o, m[i].role) || out_c(o, "\n") || out_c(o, m[i].content) ||
                 out_c(o, "<|im_end|>\n");
        }
    }
    if (!rc && gen) rc = out_c(o, "<|im_start|>assistant\n");
    return rc ? TOK_ENOMEM : 0;
}

static int render_qwen3(const ChatMessage *m, size_t n, int gen, int thinking, const ChatRenderOptions *opt,
                        TokBuf *o, char *err, size_t err_len) {
    int rc = 0;
    if (opt && opt->n_tools > 0) {   // the system text and a blank line when there is one, then the tools
        rc = out_c(o, "<|im_start|>system\n") ||
             (role_is(&m[0], "system") && (out_c(o, m[0].content) || out_c(o, "\n\n")));
        if (!rc && (rc = out_tools(opt->tools, opt->n_tools, o, err, err_len)) != 0) return rc;
    } else if (role_is(&m[0], "system")) {
        rc = out_c(o, "<|im_start|>system\n") || out_c(o, m[0].content) || out_c(o, "<|im_end|>\n");
    }
    // The last user turn that is not a wrapped tool response: assistant turns after it keep their reasoning.
    size_t last_query = n - 1;
    for (size_t k = n; k-- > 0;) {
        Str c = str(m[k].content);
        int wrapped = c.n >= 15 && memcmp(c.s, "<tool_response>", 15) == 0 && c.n >= 16 &&
                      memcmp(c.s + c.n - 16, "</tool_response>", 16) == 0;
        if (role_is(&m[k], "user") && !wrapped) { last_query = k; break; }
    }
    for (size_t i = 0; i < n && !rc; i++) {
        if (role_is(&m[i], "user") || (role_is(&m[i], "system") && i != 0)) {
            rc = out_c(o, "<|im_start|>") || out_c(o, m[i].role) || out_c(o, "\n") || out_c(o, m[i].content) ||
                 out_c(o, "<|im_end|>\n");
            continue;
        }
        if (role_is(&m[i], "tool")) {
            rc = out_tool_response(m, n, i, o);
            continue;
        }
        if (!role_is(&m[i], "assistant")) continue;
        Str content = str(m[i].content), reasoning = {"", 0};
        const char *close_last = find_in(content, "</think>", 1);
        if (close_last) {
            const char *close_first = find_in(content, "</think>", 0);
            Str after = {close_last + 8, (size_t)(content.s + content.n - close_last - 8)};
            Str before = strip_by((Str){content.s, (size_t)(close_first - content.s)}, 0, 1, is_nl);
            const char *open = find_in(before, "<think>", 1);
            if (open) before = (Str){open + 7, (size_t)(before.s + before.n - open - 7)};
            reasoning = strip_by(before, 1, 0, is_nl);
            content = strip_by(after, 1, 0, is_nl);
        }
        rc = out_c(o, "<|im_start|>assistant\n");
        if (i > last_query && (i == n - 1 || reasoning.n > 0)) {
            rc = rc || out_c(o, "<think>\n") || out_s(o, strip_by(reasoning, 1, 1, is_nl)) || out_c(o, "\n</think>\n\n") ||
                 out_s(o, strip_by(content, 1, 0, is_nl));
        } else {
            rc = rc || out_s(o, content);
        }
        // Calls follow the text, on a new line when there is text (the template tests the content it split off).
        for (size_t k = 0; k < m[i].n_tool_calls && !rc; k++) {
            if ((k > 0 || content.n > 0) && out_c(o, "\n")) return TOK_ENOMEM;
            int crc = out_tool_call(&m[i].tool_calls[k], o, err, err_len);
            if (crc) return crc;
        }
        rc = rc || out_c(o, "<|im_end|>\n");
    }
    if (!rc && gen) rc = out_c(o, "<|im_start|>assistant\n") || (!thinking && out_c(o, "<think>\n\n</think>\n\n"));
    return rc ? TOK_ENOMEM : 0;
}

static int llama_turn(TokBuf *o, const char *role, Str content) {
    return out_c(o, "<|start_header_id|>") || out_c(o, role) || out_c(o, "<|end_header_id|>\n\n") ||
           out_s(o, trim(content)) || out_c(o, "<|eot_id|>");
}

static int render_llama3(const ChatTemplate *ct, const ChatMessage *m, size_t n, int gen, TokBuf *o) {
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        if (i == 0) rc = out_c(o, ct->bos);
        rc = rc || llama_turn(o, m[i].role, str(m[i].content));
    }
    if (!rc && (gen || ct->gen_prompt_always)) rc = out_c(o, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return rc ? TOK_ENOMEM : 0;
}

// Llama 3.1's custom tools (tools_in_user_message, the template's default): each definition as
// tojson(indent=4), written before the first message after the system message, inside a user turn.
static int out_llama_tools(const char *const *tools, size_t n_tools, Str first_user, TokBuf *o, char *err,
                           size_t err_len) {
    if (out_c(o, "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a "
                 "JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond "
                 "in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}."
                 "Do not use variables.\n\n"))
        return TOK_ENOMEM;
    for (size_t k = 0; k < n_tools; k++) {
        const int rc = chat_tojson_indent(tools[k], 4, o, err, err_len);
        if (rc) return rc;
        if (out_c(o, "\n\n")) return TOK_ENOMEM;
    }
    return out_s(o, first_user) || out_c(o, "<|eot_id|>") ? TOK_ENOMEM : 0;
}

static int render_llama31(const ChatTemplate *ct, const ChatMessage *m, size_t n, int gen, const char *date,
                          const ChatRenderOptions *opt, TokBuf *o, char *err, size_t err_len) {
    char today[64];
    if (!date && ct->date_from_clock) {   // strftime_now("%d %b %Y"), as transformers provides it
        time_t now = time(NULL);
        struct tm tmv;
        localtime_r(&now, &tmv);
        strftime(today, sizeof(today), "%d %b %Y", &tmv);
        date = today;
    }
    if (!date) date = ct->default_date;
    const int with_tools = opt && opt->n_tools > 0;
    size_t first = 0;
    Str sys = {"", 0};
    if (role_is(&m[0], "system")) { sys = trim(str(m[0].content)); first = 1; }
    if (with_tools && first == n) {
        fail(err, err_len, "Cannot put tools in the first user message when there's no first user message!");
        return TOK_EINVAL;
    }
    int rc = out_c(o, ct->bos) || out_c(o, "<|start_header_id|>system<|end_header_id|>\n\n") ||
             (with_tools && out_c(o, "Environment: ipython\n")) ||
             out_c(o, "Cutting Knowledge Date: ") || out_c(o, ct->knowledge_cutoff) || out_c(o, "\n") ||
             out_c(o, "Today Date: ") || out_c(o, date) || out_c(o, "\n\n") || out_s(o, sys) || out_c(o, "<|eot_id|>");
    if (rc) return TOK_ENOMEM;
    if (with_tools) {   // the first message after the system message becomes the tools' user turn, whatever its role
        const int trc = out_llama_tools(opt->tools, opt->n_tools, trim(str(m[first].content)), o, err, err_len);
        if (trc) return trc;
        first++;
    }
    for (size_t i = first; i < n && !rc; i++) rc = llama_turn(o, m[i].role, str(m[i].content));
    if (!rc && gen) rc = out_c(o, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return rc ? TOK_ENOMEM : 0;
}

static const char ALTERNATE[] = "Conversation roles must alternate user/assistant/user/assistant/...";

static int render_llama2(const ChatTemplate *ct, const ChatMessage *m, size_t n, TokBuf *o, char *err, size_t err_len) {
    size_t first = role_is(&m[0], "system") ? 1 : 0;
    const char *sys = first ? m[0].content : NULL;
    for (size_t i = first; i < n; i++) {
        size_t k = i - first;
        if (role_is(&m[i], "user") != (k % 2 == 0)) { fail(err, err_len, ALTERNATE); return TOK_EINVAL; }
    }
    int rc = 0;
    TokBuf content = {0};
    for (size_t i = first; i < n && !rc; i++) {
        content.n = 0;
        if (i == first && sys)
            rc = out_c(&content, "<<SYS>>\n") || out_c(&content, sys) || out_c(&content, "\n<</SYS>>\n\n");
        rc = rc || out_c(&content, m[i].content);
        if (rc) break;
        Str c = trim((Str){content.p, content.n});
        if (role_is(&m[i], "user"))
            rc = out_c(o, ct->bos) || out_c(o, "[INST] ") || out_s(o, c) || out_c(o, " [/INST]");
        else if (role_is(&m[i], "assistant"))
            rc = out_c(o, " ") || out_s(o, c) || out_c(o, " ") || out_c(o, ct->eos);
    }
    tok_buf_free(&content);
    return rc ? TOK_ENOMEM : 0;
}

// Mistral v0.3's [AVAILABLE_TOOLS] block: each definition's "function" members (but "return") written as the
// template writes them: a string value between quotes as it is (not escaped), any other value as `tojson`.
static int out_mistral_tools(const char *const *tools, size_t n_tools, TokBuf *o, char *err, size_t err_len) {
    if (out_c(o, "[AVAILABLE_TOOLS] [")) return TOK_ENOMEM;
    for (size_t k = 0; k < n_tools; k++) {
        json_error_t je;
        json_t *tool = json_loads(tools[k], 0, &je);
        const json_t *fn = json_is_object(tool) ? json_object_get(tool, "function") : NULL;
        if (!json_is_object(fn)) {
            json_decref(tool);
            tok_set_err(err, err_len, "chat template: tool definition %zu has no \"function\" object", k);
            return TOK_EINVAL;
        }
        int rc = out_c(o, "{\"type\": \"function\", \"function\": {") ? TOK_ENOMEM : 0;
        const char *key;
        const json_t *val;
        int first = 1;
        json_object_foreach((json_t *)fn, key, val) {
            if (rc || strcmp(key, "return") == 0) continue;
            rc = (!first && out_c(o, ", ")) || out_c(o, "\"") || out_c(o, key) || out_c(o, "\": ") ? TOK_ENOMEM : 0;
            first = 0;
            if (rc) break;
            if (json_is_string(val)) {
                rc = out_c(o, "\"") || tok_buf_append(o, json_string_value(val), json_string_length(val)) ||
                     out_c(o, "\"") ? TOK_ENOMEM : 0;
            } else {
                char *text = json_dumps(val, JSON_COMPACT | JSON_ENCODE_ANY);
                rc = text ? chat_tojson(text, o, err, err_len) : TOK_ENOMEM;
                free(text);
            }
        }
        json_decref(tool);
        if (rc) return rc;
        if (out_c(o, "}}") || out_c(o, k + 1 < n_tools ? ", " : "]")) return TOK_ENOMEM;
    }
    return out_c(o, "[/AVAILABLE_TOOLS]") ? TOK_ENOMEM : 0;
}

static int render_mistral(const ChatTemplate *ct, const ChatMessage *m, size_t n, const ChatRenderOptions *opt,
                          TokBuf *o, char *err, size_t err_len) {
    size_t first = role_is(&m[0], "system") ? 1 : 0;
    for (size_t i = first; i < n; i++)
        if (role_is(&m[i], "user") != ((i - first) % 2 == 0)) {
            fail(err, err_len, "After the optional system message, conversation roles must alternate "
                               "user/assistant/user/assistant/...");
            return TOK_EINVAL;
        }
    // The template writes the tools before the user message that equals the last one (Jinja compares the message
    // objects, so an earlier user message with the same content gets them too).
    const ChatMessage *last_user = NULL;
    for (size_t i = first; i < n; i++)
        if (role_is(&m[i], "user")) last_user = &m[i];
    int rc = out_c(o, ct->bos);
    for (size_t i = first; i < n && !rc; i++) {
        if (role_is(&m[i], "user")) {
            if (opt && opt->n_tools > 0 && last_user && strcmp(m[i].content, last_user->content) == 0) {
                const int trc = out_mistral_tools(opt->tools, opt->n_tools, o, err, err_len);
                if (trc) return trc;
            }
            rc = out_c(o, "[INST] ");
            if (i == n - 1 && first) rc = rc || out_c(o, m[0].content) || out_c(o, "\n\n");
            rc = rc || out_c(o, m[i].content) || out_c(o, "[/INST]");
        } else if (role_is(&m[i], "assistant")) {
            rc = out_c(o, " ") || out_s(o, trim(str(m[i].content))) || out_c(o, ct->eos);
        } else {
            fail(err, err_len, "Only user and assistant roles are supported, with the exception of an initial "
                               "optional system message!");
            return TOK_EINVAL;
        }
    }
    return rc ? TOK_ENOMEM : 0;
}

static int render_mistral_v1(const ChatTemplate *ct, const ChatMessage *m, size_t n, TokBuf *o, char *err,
                             size_t err_len) {
    int rc = out_c(o, ct->bos);
    for (size_t i = 0; i < n && !rc; i++) {
        if (role_is(&m[i], "user") != (i % 2 == 0)) { fail(err, err_len, ALTERNATE); return TOK_EINVAL; }
        if (role_is(&m[i], "user")) {
            rc = out_c(o, "[INST] ") || out_c(o, m[i].content) || out_c(o, " [/INST]");
        } else if (role_is(&m[i], "assistant")) {
            rc = out_c(o, m[i].content) || out_c(o, ct->eos) || (ct->eos_space && out_c(o, " "));
        } else {
            fail(err, err_len, "Only user and assistant roles are supported!");
            return TOK_EINVAL;
        }
    }
    return rc ? TOK_ENOMEM : 0;
}

static int render_zephyr(const ChatTemplate *ct, const ChatMessage *m, size_t n, int gen, TokBuf *o) {
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const char *tag = role_is(&m[i], "user") ? "<|user|>\n" : role_is(&m[i], "system") ? "<|system|>\n"
                          : role_is(&m[i], "assistant") ? "<|assistant|>\n" : NULL;
        if (tag) rc = out_c(o, tag) || out_c(o, m[i].content) || out_c(o, ct->eos) || out_c(o, "\n");
        if (!rc && i == n - 1 && gen) rc = out_c(o, "<|assistant|>\n");
    }
    return rc ? TOK_ENOMEM : 0;
}

int chat_render_ex(const ChatTemplate *ct, const ChatMessage *m, size_t n, int gen, const ChatRenderOptions *opt,
                   char **out, size_t *out_len, char *err, size_t err_len) {
    if (!ct || !out || (!m && n)) { fail(err, err_len, "NULL argument"); return TOK_EINVAL; }
    *out = NULL;
    if (out_len) *out_len = 0;
    if (n == 0) { fail(err, err_len, "no messages to render"); return TOK_EINVAL; }
    // Families whose tool formats tandem renders (see chat_template.h).
    const int tools_rendered = ct->family == CHAT_FAMILY_CHATML || ct->family == CHAT_FAMILY_QWEN3 ||
                               ct->family == CHAT_FAMILY_LLAMA3;
    for (size_t i = 0; i < n; i++) {
        if (!m[i].role || !m[i].content) { fail(err, err_len, "a message has no role or no content"); return TOK_EINVAL; }
        if (!role_is(&m[i], "system") && !role_is(&m[i], "user") && !role_is(&m[i], "assistant") &&
            !role_is(&m[i], "tool")) {
            tok_set_err(err, err_len, "chat template: role \"%.32s\" is not supported (system, user, assistant, "
                        "tool)", m[i].role);
            return TOK_EINVAL;
        }
        if ((role_is(&m[i], "tool") || m[i].n_tool_calls > 0) && !tools_rendered) {
            tok_set_err(err, err_len, "chat template: message %zu: tandem does not render tool %s for the %s template "
                        "family (it does for chatml, qwen3 and llama3)", i, m[i].n_tool_calls ? "calls" : "results",
                        chat_family_name(ct->family));
            return TOK_EINVAL;
        }
        if (m[i].n_tool_calls > 0 && !role_is(&m[i], "assistant")) {
            tok_set_err(err, err_len, "chat template: message %zu: only assistant messages carry tool calls", i);
            return TOK_EINVAL;
        }
        size_t cl = strlen(m[i].content);
        if (tok_utf8_valid_prefix(m[i].content, cl) != cl) {
            tok_set_err(err, err_len, "chat template: message %zu content is not valid UTF-8", i);
            return TOK_EINVAL;
        }
    }
    if (opt && opt->n_tools > 0 && !chat_template_writes_tools(ct)) {
        tok_set_err(err, err_len, "chat template: tandem writes tool definitions into the prompt for Qwen2.5's, "
                    "Qwen3's, Llama 3.1's and Mistral v0.3's templates, not for this %s template",
                    chat_family_name(ct->family));
        return TOK_EINVAL;
    }
    int thinking = opt ? opt->enable_thinking : 1;
    const char *date = opt ? opt->date_string : NULL;
    TokBuf o = {0};
    int rc;
    switch (ct->family) {
    case CHAT_FAMILY_CHATML: rc = render_chatml(ct, m, n, gen, opt, &o, err, err_len); break;
    case CHAT_FAMILY_QWEN3: rc = render_qwen3(m, n, gen, thinking, opt, &o, err, err_len); break;
    case CHAT_FAMILY_LLAMA3: rc = render_llama3(ct, m, n, gen, &o); break;
    case CHAT_FAMILY_LLAMA31: rc = render_llama31(ct, m, n, gen, date, opt, &o, err, err_len); break;
    case CHAT_FAMILY_LLAMA2: rc = render_llama2(ct, m, n, &o, err, err_len); break;
    case CHAT_FAMILY_MISTRAL: rc = render_mistral(ct, m, n, opt, &o, err, err_len); break;
    case CHAT_FAMILY_MISTRAL_V1: rc = render_mistral_v1(ct, m, n, &o, err, err_len); break;
    case CHAT_FAMILY_ZEPHYR: rc = render_zephyr(ct, m, n, gen, &o); break;
    default: fail(err, err_len, "unknown family"); rc = TOK_EINVAL; break;
    }
    if (!rc && !o.p) rc = tok_buf_append(&o, "", 0) ? TOK_ENOMEM : 0;
    if (rc) {
        if (rc == TOK_ENOMEM) fail(err, err_len, "out of memory");
        tok_buf_free(&o);
        return rc;
    }
    *out = o.p;
    if (out_len) *out_len = o.n;
    return 0;
}

int chat_render(const ChatTemplate *ct, const ChatMessage *msgs, size_t n, int add_generation_prompt, char **out,
                size_t *out_len, char *err, size_t err_len) {
    return chat_render_ex(ct, msgs, n, add_generation_prompt, NULL, out, out_len, err, err_len);
}
