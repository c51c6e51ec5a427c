// shared/tokenizer/chat_template.c — recognising a chat template's family from its Jinja source, and reading the
// literals that vary within a family. Rendering is in chat_template_render.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/chat_template_internal.h"

#define OVERRIDE_HINT \
    "pass --chat-template with one of: chatml, qwen3, llama3, llama3.1, llama2, mistral, mistral-v1, zephyr"

static void set_err(char *err, size_t err_len, const char *msg, const char *detail) {
    if (err && err_len) snprintf(err, err_len, "%s%s", msg, detail ? detail : "");
}

static const struct { const char *name; ChatFamily f; } NAMES[] = {
    {"chatml", CHAT_FAMILY_CHATML},   {"qwen3", CHAT_FAMILY_QWEN3},     {"llama3", CHAT_FAMILY_LLAMA3},
    {"llama3.1", CHAT_FAMILY_LLAMA31}, {"llama2", CHAT_FAMILY_LLAMA2},  {"mistral", CHAT_FAMILY_MISTRAL},
    {"mistral-v1", CHAT_FAMILY_MISTRAL_V1}, {"zephyr", CHAT_FAMILY_ZEPHYR},
};

const char *chat_family_name(ChatFamily f) {
    for (size_t i = 0; i < sizeof(NAMES) / sizeof(NAMES[0]); i++)
        if (NAMES[i].f == f) return NAMES[i].name;
    return "unknown";
}

static int has(const char *s, const char *needle) { return strstr(s, needle) != NULL; }

// Decodes a Jinja (Python) string-literal body: \n \t \r \\ \' \" \xHH \uXXXX \UXXXXXXXX; other escapes
// stay as written, as Python's unicode-escape leaves them.
static char *unescape(const char *s, size_t n) {
    char *o = malloc(n * 4 + 1), *w = o;
    if (!o) return NULL;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 >= n) { *w++ = s[i]; continue; }
        char e = s[++i];
        int hex = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (hex && i + (size_t)hex < n) {
            unsigned long cp = 0;
            int ok = 1;
            for (int k = 1; k <= hex; k++) {
                char c = s[i + k];
                int v = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                        : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
                if (v < 0) { ok = 0; break; }
                cp = cp * 16 + (unsigned long)v;
            }
            if (ok && cp < 0x110000 && !(cp >= 0xD800 && cp < 0xE000)) {
                unsigned char *u = (unsigned char *)w;
                if (cp < 0x80) { u[0] = (unsigned char)cp; w += 1; }
                else if (cp < 0x800) { u[0] = 0xC0 | (cp >> 6); u[1] = 0x80 | (cp & 63); w += 2; }
                else if (cp < 0x10000) { u[0] = 0xE0 | (cp >> 12); u[1] = 0x80 | ((cp >> 6) & 63); u[2] = 0x80 | (cp & 63); w += 3; }
                else { u[0] = 0xF0 | (cp >> 18); u[1] = 0x80 | ((cp >> 12) & 63); u[2] = 0x80 | ((cp >> 6) & 63); u[3] = 0x80 | (cp & 63); w += 4; }
                i += (size_t)hex;
                continue;
            }
        }
        switch (e) {
        case 'n': *w++ = '\n'; break;
        case 't': *w++ = '\t'; break;
        case 'r': *w++ = '\r'; break;
        case '\\': case '\'': case '"': *w++ = e; break;
        default: *w++ = '\\'; *w++ = e; break;
        }
    }
    *w = 0;
    return o;
}

// The text between `start` and `end` inside one string literal: no unescaped quote and no template
// syntax in between. Returns a malloc'd unescaped copy, or NULL when there is no such occurrence.
static char *literal_between(const char *src, const char *start, const char *end) {
    size_t sl = strlen(start);
    for (const char *p = strstr(src, start); p; p = strstr(p + 1, start)) {
        const char *a = p + sl, *z = strstr(a, end);
        if (!z || z == a) continue;
        int clean = 1;
        for (const char *q = a; q < z; q++) {
            if (*q == '\\' && q + 1 < z) { q++; continue; }
            if (*q == '\'' || *q == '"' || *q == '{' || *q == '}') { clean = 0; break; }
        }
        if (clean) return unescape(a, (size_t)(z - a));
    }
    return NULL;
}

// ChatML's injected system prompt: '<|im_start|>system\n...<|im_end|>' written as one literal.
static char *chatml_default_system(const char *src) {
    char *s = literal_between(src, "<|im_start|>system\\n", "<|im_end|>");
    return s ? s : literal_between(src, "<|im_start|>system\n", "<|im_end|>");
}

// `set date_string = "26 Jul 2024"`
static char *llama_default_date(const char *src) {
    const char *p = strstr(src, "date_string = ");
    while (p) {
        const char *q = p + strlen("date_string = ");
        if (*q == '"' || *q == '\'') {
            const char *z = strchr(q + 1, *q);
            if (z) return unescape(q + 1, (size_t)(z - q - 1));
        }
        p = strstr(p + 1, "date_string = ");
    }
    return NULL;
}

static int detect(const char *s, ChatFamily *f, char *err, size_t err_len) {
    if (has(s, "<|im_start|>") && has(s, "<|im_end|>")) {
        if (has(s, "<think>") || has(s, "enable_thinking") || has(s, "reasoning_content")) {
            if (has(s, "enable_thinking") && has(s, "reasoning_content") && has(s, "last_query_index")) {
                *f = CHAT_FAMILY_QWEN3;
                return 0;
            }
            set_err(err, err_len, "chat template not recognised: ChatML with a <think> scheme that is not Qwen3's; ",
                    OVERRIDE_HINT);
            return TOK_EFORMAT;
        }
        // ChatML variants that add bos/eos, or drop <|im_end|> after the last turn, render differently.
        if (has(s, "bos_token") || has(s, "eos_token") || has(s, "not loop.last")) {
            set_err(err, err_len, "chat template not recognised: a ChatML variant that tandem does not render; ",
                    OVERRIDE_HINT);
            return TOK_EFORMAT;
        }
        *f = CHAT_FAMILY_CHATML;
        return 0;
    }
    if (has(s, "<|start_header_id|>") && has(s, "<|end_header_id|>") && has(s, "<|eot_id|>")) {
        if (has(s, "Cutting Knowledge Date") && has(s, "Today Date") && has(s, "bos_token")) {
            *f = CHAT_FAMILY_LLAMA31;
            return 0;
        }
        if (has(s, "bos_token") && has(s, "loop.index0 == 0") && !has(s, "Cutting Knowledge")) {
            *f = CHAT_FAMILY_LLAMA3;
            return 0;
        }
    } else if (has(s, "[INST]") && has(s, "[/INST]")) {
        if (has(s, "<<SYS>>") && has(s, "bos_token + '[INST] '") && has(s, "content.strip()")) {
            *f = CHAT_FAMILY_LLAMA2;
            return 0;
        }
        if (has(s, "loop.last and system_message is defined") && has(s, "\"[INST] \" + system_message")) {
            *f = CHAT_FAMILY_MISTRAL;
            return 0;
        }
        if (!has(s, "system") && has(s, "'[INST] ' + message['content'] + ' [/INST]'") &&
            has(s, "{{ bos_token }}")) {
            *f = CHAT_FAMILY_MISTRAL_V1;
            return 0;
        }
    } else if (has(s, "<|user|>") && has(s, "<|assistant|>") && has(s, "eos_token") &&
               has(s, "loop.last and add_generation_prompt")) {
        *f = CHAT_FAMILY_ZEPHYR;
        return 0;
    }
    set_err(err, err_len, "chat template not recognised (tandem renders ChatML, Qwen3, Llama 3, Llama 2, Mistral "
                          "and Zephyr templates); ", OVERRIDE_HINT);
    return TOK_EFORMAT;
}

static char *dup_or_empty(const char *s) {
    size_t n = s ? strlen(s) : 0;
    char *p = malloc(n + 1);
    if (p) { if (n) memcpy(p, s, n); p[n] = 0; }
    return p;
}

int chat_template_create(ChatTemplate **out, const char *src, const char *force_name, const char *bos_token,
                         const char *eos_token, char *err, size_t err_len) {
    if (!out) { set_err(err, err_len, "chat_template_create: NULL argument", NULL); return TOK_EINVAL; }
    *out = NULL;
    // Literals are copied from the template into prompts (Llama 3.1's knowledge cutoff and date, ChatML's default
    // system prompt): text that is not UTF-8 would end up in them.
    if (src && tok_utf8_valid_prefix(src, strlen(src)) != strlen(src)) {
        set_err(err, err_len, "the chat template is not valid UTF-8; ", OVERRIDE_HINT);
        return TOK_EFORMAT;
    }
    ChatFamily f = 0;
    if (force_name) {
        for (size_t i = 0; i < sizeof(NAMES) / sizeof(NAMES[0]); i++)
            if (strcmp(NAMES[i].name, force_name) == 0) f = NAMES[i].f;
        if (!f) {
            set_err(err, err_len, "--chat-template: unknown name; expected one of chatml, qwen3, llama3, llama3.1, "
                                  "llama2, mistral, mistral-v1, zephyr", NULL);
            return TOK_EINVAL;
        }
    } else if (!src) {
        set_err(err, err_len, "the model has no chat_template (tokenizer_config.json or chat_template.jinja); ",
                OVERRIDE_HINT);
        return TOK_EFORMAT;
    } else {
        int rc = detect(src, &f, err, err_len);
        if (rc) return rc;
    }
    ChatTemplate *ct = calloc(1, sizeof(*ct));
    if (!ct) return TOK_ENOMEM;
    ct->family = f;
    ct->bos = dup_or_empty(bos_token);
    ct->eos = dup_or_empty(eos_token);
    int oom = !ct->bos || !ct->eos;
    if (src && f == CHAT_FAMILY_CHATML) ct->default_system = chatml_default_system(src);
    if (src && f == CHAT_FAMILY_CHATML)
        ct->qwen_tools = has(src, "<tool_call>") && has(src, "<tool_response>") && has(src, "message.tool_calls");
    // A forced "mistral" without a template is the v0.3 form, which has tool definitions.
    if (f == CHAT_FAMILY_MISTRAL) ct->mistral_tools = !src || has(src, "[AVAILABLE_TOOLS]");
    if (f == CHAT_FAMILY_LLAMA31) {
        ct->default_date = src ? llama_default_date(src) : NULL;
        if (!ct->default_date) ct->default_date = dup_or_empty("26 Jul 2024");
        ct->knowledge_cutoff = src ? literal_between(src, "Cutting Knowledge Date: ", "\\n") : NULL;
        if (!ct->knowledge_cutoff) ct->knowledge_cutoff = dup_or_empty("December 2023");
        ct->date_from_clock = src && has(src, "strftime_now");
        oom |= !ct->default_date || !ct->knowledge_cutoff;
    }
    if (src && f == CHAT_FAMILY_LLAMA3) ct->gen_prompt_always = !has(src, "add_generation_prompt");
    if (src && f == CHAT_FAMILY_MISTRAL_V1) ct->eos_space = has(src, "eos_token + ' '");
    if (oom) {
        chat_template_free(ct);
        set_err(err, err_len, "chat_template_create: out of memory", NULL);
        return TOK_ENOMEM;
    }
    *out = ct;
    return 0;
}

int chat_template_from_tokenizer(ChatTemplate **out, const Tokenizer *tok, const char *force_name, char *err,
                                 size_t err_len) {
    if (!tok) { set_err(err, err_len, "chat_template_from_tokenizer: NULL tokenizer", NULL); return TOK_EINVAL; }
    return chat_template_create(out, tokenizer_chat_template(tok), force_name, tokenizer_bos_token(tok),
                                tokenizer_eos_token(tok), err, err_len);
}

void chat_template_free(ChatTemplate *ct) {
    if (!ct) return;
    free(ct->bos);
    free(ct->eos);
    free(ct->default_system);
    free(ct->default_date);
    free(ct->knowledge_cutoff);
    free(ct);
}

ChatFamily chat_template_family(const ChatTemplate *ct) { return ct ? ct->family : 0; }
const char *chat_template_default_system(const ChatTemplate *ct) { return ct ? ct->default_system : NULL; }

int chat_template_writes_tools(const ChatTemplate *ct) {
    if (!ct) return 0;
    switch (ct->family) {
    case CHAT_FAMILY_CHATML: return ct->qwen_tools;
    case CHAT_FAMILY_QWEN3:
    case CHAT_FAMILY_LLAMA31: return 1;
    case CHAT_FAMILY_MISTRAL: return ct->mistral_tools;
    default: return 0;
    }
}
