// tests/reference/tools/tok_cli.c — drives the C tokenizer for the Python reference tests.
//
//   tok_cli <model folder | tokenizer.json> [--chat-template NAME]
//
// Reads one JSON request per line on stdin and writes one JSON answer per line on stdout:
//   {"op":"encode","text":"..."| "hex":"..", "add_special_tokens":bool}   -> {"ids":[...]}
//   {"op":"decode","ids":[...],"skip_special_tokens":bool}                -> {"text":"..."}
//   {"op":"stream","ids":[...],"skip_special_tokens":bool}                -> {"chunks":[...],"rest":"..."}
//   {"op":"info"}                       -> vocab size, special ids, bos/eos strings, chat family
//   {"op":"chat","messages":[{"role","content","tool_calls"}],"add_generation_prompt":bool,
//    "template":NAME?,"source":TEXT?,"enable_thinking":bool?,"date_string":TEXT?}   -> {"text":"..."}
// Any failure answers {"error":"..."}. A tokenizer that does not load prints {"error":...} and exits 2.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/chat_template.h"
#include "shared/tokenizer/tokenizer.h"

static json_t *error_obj(const char *msg) { return json_pack("{s:s}", "error", msg); }

static json_t *ids_json(const int32_t *ids, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

static int32_t *ids_from(json_t *arr, size_t *n) {
    *n = json_array_size(arr);
    int32_t *ids = malloc((*n + 1) * sizeof(int32_t));
    for (size_t i = 0; ids && i < *n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    return ids;
}

static char *hex_decode(const char *h, size_t *n) {
    size_t l = strlen(h) / 2;
    char *o = malloc(l + 1);
    for (size_t i = 0; o && i < l; i++) {
        unsigned v;
        sscanf(h + 2 * i, "%2x", &v);
        o[i] = (char)v;
    }
    *n = l;
    return o;
}

static json_t *do_encode(const Tokenizer *tok, json_t *req) {
    char err[512];
    size_t len = 0;
    char *owned = NULL;
    const char *text;
    if (json_is_string(json_object_get(req, "hex"))) {
        owned = hex_decode(json_string_value(json_object_get(req, "hex")), &len);
        text = owned;
    } else {
        json_t *t = json_object_get(req, "text");
        text = json_string_value(t);
        len = json_string_length(t);
    }
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = tokenizer_encode(tok, text, len, json_is_true(json_object_get(req, "add_special_tokens")), &ids, &n, err,
                              sizeof(err));
    free(owned);
    if (rc) return error_obj(err);
    json_t *r = json_pack("{s:o}", "ids", ids_json(ids, n));
    free(ids);
    return r;
}

static json_t *do_decode(const Tokenizer *tok, json_t *req) {
    char err[512];
    size_t n;
    int32_t *ids = ids_from(json_object_get(req, "ids"), &n);
    char *text = NULL;
    size_t len = 0;
    int rc = tokenizer_decode(tok, ids, n, json_is_true(json_object_get(req, "skip_special_tokens")), &text, &len, err,
                              sizeof(err));
    free(ids);
    if (rc) return error_obj(err);
    json_t *r = json_pack("{s:s%}", "text", text, len);
    free(text);
    return r;
}

static json_t *do_stream(const Tokenizer *tok, json_t *req) {
    char err[512];
    size_t n;
    int32_t *ids = ids_from(json_object_get(req, "ids"), &n);
    TokenizerStream *st = NULL;
    json_t *chunks = json_array();
    int rc = tokenizer_stream_create(&st, tok, json_is_true(json_object_get(req, "skip_special_tokens")), err, sizeof(err));
    for (size_t i = 0; rc == 0 && i < n; i++) {
        char *text = NULL;
        size_t len = 0;
        rc = tokenizer_stream_step(st, ids[i], &text, &len, err, sizeof(err));
        json_array_append_new(chunks, text ? json_stringn(text, len) : json_null());
        free(text);
    }
    char *rest = NULL;
    size_t rest_len = 0;
    if (rc == 0) rc = tokenizer_stream_flush(st, &rest, &rest_len, err, sizeof(err));
    tokenizer_stream_free(st);
    free(ids);
    if (rc) { json_decref(chunks); free(rest); return error_obj(err); }
    json_t *r = json_pack("{s:o,s:s%}", "chunks", chunks, "rest", rest ? rest : "", rest ? rest_len : 0);
    free(rest);
    return r;
}

static json_t *do_info(const Tokenizer *tok, const char *force) {
    int32_t eos[16];
    size_t ne = tokenizer_eos_ids(tok, eos, 16);
    ChatTemplate *ct = NULL;
    char err[512];
    json_t *fam = chat_template_from_tokenizer(&ct, tok, force, err, sizeof(err)) == 0
                      ? json_string(chat_family_name(chat_template_family(ct)))
                      : json_null();
    json_t *sys = ct && chat_template_default_system(ct) ? json_string(chat_template_default_system(ct)) : json_null();
    chat_template_free(ct);
    return json_pack("{s:i,s:i,s:i,s:i,s:o,s:i,s:s,s:s,s:o,s:o}", "vocab_size", tokenizer_vocab_size(tok), "bos_id",
                     tokenizer_bos_id(tok), "pad_id", tokenizer_pad_id(tok), "eos_id", tokenizer_eos_id(tok), "eos_ids",
                     ids_json(eos, ne < 16 ? ne : 16), "add_bos_token", tokenizer_add_bos_token(tok), "bos_token",
                     tokenizer_bos_token(tok), "eos_token", tokenizer_eos_token(tok), "chat_family", fam,
                     "default_system", sys);
}

static json_t *do_chat(const Tokenizer *tok, const char *force, json_t *req) {
    char err[512];
    json_t *name = json_object_get(req, "template"), *src = json_object_get(req, "source");
    const char *use_force = json_is_string(name) ? json_string_value(name) : force;
    ChatTemplate *ct = NULL;
    int rc = json_is_string(src) ? chat_template_create(&ct, json_string_value(src), use_force, tokenizer_bos_token(tok),
                                                        tokenizer_eos_token(tok), err, sizeof(err))
                                 : chat_template_from_tokenizer(&ct, tok, use_force, err, sizeof(err));
    if (rc) return error_obj(err);
    json_t *arr = json_object_get(req, "messages");
    size_t n = json_array_size(arr);
    ChatMessage *m = calloc(n + 1, sizeof(ChatMessage));
    size_t n_calls = 0; // tool calls: [{"function": {"name", "arguments": JSON text}}] as OpenAI sends them
    for (size_t i = 0; i < n; i++) n_calls += json_array_size(json_object_get(json_array_get(arr, i), "tool_calls"));
    ChatToolCall *calls = calloc(n_calls + 1, sizeof(ChatToolCall)), *next = calls;
    for (size_t i = 0; m && calls && i < n; i++) {
        const json_t *msg = json_array_get(arr, i), *tc = json_object_get(msg, "tool_calls");
        m[i].role = json_string_value(json_object_get(msg, "role"));
        m[i].content = json_string_value(json_object_get(msg, "content"));
        if (!m[i].content) m[i].content = ""; // an assistant turn with tool calls only
        m[i].tool_calls = next;
        m[i].n_tool_calls = json_array_size(tc);
        for (size_t k = 0; k < json_array_size(tc); k++, next++) {
            const json_t *fn = json_object_get(json_array_get(tc, k), "function");
            next->name = json_string_value(json_object_get(fn, "name"));
            next->arguments = json_string_value(json_object_get(fn, "arguments"));
        }
    }
    ChatRenderOptions opt = {.enable_thinking = 1};
    json_t *th = json_object_get(req, "enable_thinking"), *ds = json_object_get(req, "date_string");
    if (json_is_boolean(th)) opt.enable_thinking = json_is_true(th);
    if (json_is_string(ds)) opt.date_string = json_string_value(ds);
    const json_t *tools = json_object_get(req, "tools");   // tool definitions, each passed as its JSON text
    char *tool_text[16] = {0};
    size_t n_tools = json_is_array(tools) ? json_array_size(tools) : 0;
    if (n_tools > 16) n_tools = 16;
    for (size_t k = 0; k < n_tools; k++) tool_text[k] = json_dumps(json_array_get(tools, k), JSON_COMPACT);
    opt.tools = (const char *const *)tool_text;
    opt.n_tools = n_tools;
    char *out = NULL;
    size_t len = 0;
    rc = chat_render_ex(ct, m, n, json_is_true(json_object_get(req, "add_generation_prompt")), &opt, &out, &len, err,
                        sizeof(err));
    free(m);
    free(calls);
    for (size_t k = 0; k < n_tools; k++) free(tool_text[k]);
    chat_template_free(ct);
    if (rc) return error_obj(err);
    json_t *r = json_pack("{s:s%}", "text", out, len);
    free(out);
    return r;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s <model folder | tokenizer.json> [--chat-template NAME]\n", argv[0]);
        return 2;
    }
    const char *force = NULL;
    for (int i = 2; i + 1 < argc; i++)
        if (strcmp(argv[i], "--chat-template") == 0) force = argv[i + 1];
    char err[512];
    Tokenizer *tok = NULL;
    if (tokenizer_load(&tok, argv[1], err, sizeof(err))) {
        json_t *e = error_obj(err);
        char *s = json_dumps(e, JSON_COMPACT);
        printf("%s\n", s);
        free(s);
        json_decref(e);
        return 2;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    while ((got = getline(&line, &cap, stdin)) > 0) {
        json_error_t je;
        json_t *req = json_loadb(line, (size_t)got, JSON_ALLOW_NUL, &je), *resp;
        const char *op = json_string_value(json_object_get(req, "op"));
        if (!req || !op) resp = error_obj("bad request line");
        else if (strcmp(op, "encode") == 0) resp = do_encode(tok, req);
        else if (strcmp(op, "decode") == 0) resp = do_decode(tok, req);
        else if (strcmp(op, "stream") == 0) resp = do_stream(tok, req);
        else if (strcmp(op, "info") == 0) resp = do_info(tok, force);
        else if (strcmp(op, "chat") == 0) resp = do_chat(tok, force, req);
        else resp = error_obj("unknown op");
        char *s = json_dumps(resp, JSON_COMPACT);
        printf("%s\n", s ? s : "{\"error\":\"unprintable answer\"}");
        fflush(stdout);
        free(s);
        json_decref(resp);
        json_decref(req);
    }
    free(line);
    tokenizer_free(tok);
    return 0;
}
