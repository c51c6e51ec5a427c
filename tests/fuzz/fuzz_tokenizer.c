// tests/fuzz/fuzz_tokenizer.c — libFuzzer target over the tokenizer.json loader, encode, decode, the
// streaming decoder and chat-template recognition/rendering.
//
// The first input byte picks what the rest is:
//   0: a tokenizer.json text (loaded; when it loads, a few strings are encoded and ids decoded)
//   1: text for a byte-level BPE tokenizer: decode(encode(text)) must give back the text after U+FFFD
//      repair (byte-level BPE is lossless), and the streaming chunks must add up to the full decode
//   2: little-endian int32 ids for decode / stream decode (any value, negatives included)
//   3: text for a SentencePiece-style tokenizer (Prepend/Replace normalizer, byte fallback, unk)
//   4: a chat template text plus messages split on NUL bytes, recognised and rendered
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/tokenizer/chat_template.h"
#include "shared/tokenizer/tokenizer.h"

#define REQUIRE(c) do { if (!(c)) { fprintf(stderr, "invariant failed: %s\n", #c); __builtin_trap(); } } while (0)

static unsigned bl_cp(int b) {
    int keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    if (keep) return (unsigned)b;
    unsigned n = 0;
    for (int x = 0; x < b; x++)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
    return 256 + n;
}

// Byte-level BPE with the Llama 3 pre-tokenizer, a few merges and added tokens (no strip flags, so the
// round trip is exact).
static char *bytelevel_json(void) {
    static char buf[32768];
    char *w = buf;
    w += sprintf(w, "{\"added_tokens\":[{\"id\":270,\"content\":\"<|eot|>\",\"special\":true,\"normalized\":false},"
                    "{\"id\":271,\"content\":\"hello\",\"single_word\":true,\"normalized\":true}],"
                    "\"normalizer\":{\"type\":\"NFC\"},"
                    "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":"
                    "\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| ?[^\\\\s\\\\p{L}"
                    "\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"},\"behavior\":\"Isolated\","
                    "\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false},"
                    "{\"type\":\"Digits\",\"individual_digits\":true}]},"
                    "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"ignore_merges\":true,\"vocab\":{");
    for (int b = 0; b < 256; b++) {
        unsigned cp = bl_cp(b);
        *w++ = '"';
        if (cp == '"' || cp == '\\') *w++ = '\\';
        if (cp < 0x80) *w++ = (char)cp;
        else { *w++ = (char)(0xC0 | (cp >> 6)); *w++ = (char)(0x80 | (cp & 0x3F)); }
        w += sprintf(w, "\":%d,", b);
    }
    sprintf(w, "\"th\":256,\"the\":257,\"\\u0120t\":258,\"\\u0120the\":259,\"in\":260,\"ing\":261,\"he\":262},"
               "\"merges\":[\"t h\",\"h e\",\"th e\",\"\\u0120 t\",[\"\\u0120t\",\"he\"],\"i n\",\"in g\"]}}");
    return buf;
}

static const char *SP_JSON =
    "{\"added_tokens\":[{\"id\":0,\"content\":\"<unk>\",\"special\":true,\"normalized\":false},"
    "{\"id\":1,\"content\":\"<s>\",\"special\":true,\"normalized\":false,\"lstrip\":true,\"rstrip\":true}],"
    "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"},"
    "{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"\\u2581\"}]},\"pre_tokenizer\":null,"
    "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},"
    "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[1],\"tokens\":[\"<s>\"]}}},"
    "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":\"\\u2581\"},"
    "\"content\":\" \"},{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" \","
    "\"start\":1,\"stop\":1}]},"
    "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":true,\"byte_fallback\":true,"
    "\"vocab\":{\"<unk>\":0,\"<s>\":1,\"<0x41>\":2,\"<0xC3>\":3,\"<0xA9>\":4,\"<0xE6>\":5,\"\\u2581\":6,\"a\":7,"
    "\"b\":8,\"\\u2581a\":9,\"\\u2581ab\":10,\"<0x+1>\":11},\"merges\":[\"\\u2581 a\",\"\\u2581a b\"]}}";

static Tokenizer *g_bl, *g_sp;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    char err[256];
    const char *bl = bytelevel_json();
    if (tokenizer_load_json(&g_bl, bl, strlen(bl), err, sizeof(err)) ||
        tokenizer_load_json(&g_sp, SP_JSON, strlen(SP_JSON), err, sizeof(err))) {
        fprintf(stderr, "fuzz setup: %s\n", err);
        __builtin_trap();
    }
    return 0;
}

static int valid_utf8(const char *s, size_t n) {
    size_t l = 0;
    char *r = tokenizer_utf8_repair(s, n, &l);
    int ok = r && l == n && memcmp(r, s, n) == 0;
    free(r);
    return ok;
}

// Decodes ids whole and through the stream; both must be valid UTF-8 and agree.
static void check_decode(const Tokenizer *t, const int32_t *ids, size_t n, int skip) {
    char err[256], *full = NULL;
    size_t fl = 0;
    REQUIRE(tokenizer_decode(t, ids, n, skip, &full, &fl, err, sizeof(err)) == 0);
    REQUIRE(valid_utf8(full, fl));
    TokenizerStream *st = NULL;
    REQUIRE(tokenizer_stream_create(&st, t, skip, err, sizeof(err)) == 0);
    size_t cap = fl + 64, used = 0;
    char *acc = malloc(cap);
    REQUIRE(acc);
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) {
        char *c = NULL;
        size_t cl = 0;
        if (tokenizer_stream_step(st, ids[i], &c, &cl, err, sizeof(err)) != 0) { ok = 0; break; }
        if (c) {
            REQUIRE(valid_utf8(c, cl));
            if (used + cl > cap) { cap = (used + cl) * 2; acc = realloc(acc, cap); REQUIRE(acc); }
            memcpy(acc + used, c, cl);
            used += cl;
        }
        free(c);
    }
    // The stream refuses (with an error, not a crash) when a decoder rewrites already-emitted text.
    if (ok) {
        char *rest = NULL;
        size_t rl = 0;
        REQUIRE(tokenizer_stream_flush(st, &rest, &rl, err, sizeof(err)) == 0);
        if (rest) {
            if (used + rl > cap) { cap = used + rl; acc = realloc(acc, cap); REQUIRE(acc); }
            memcpy(acc + used, rest, rl);
            used += rl;
        }
        free(rest);
        if (t == g_bl) REQUIRE(used == fl && memcmp(acc, full, fl) == 0);
    }
    tokenizer_stream_free(st);
    free(acc);
    free(full);
}

static void encode_decode(const Tokenizer *t, const char *s, size_t n, int roundtrip) {
    char err[256];
    int32_t *ids = NULL;
    size_t k = 0;
    REQUIRE(tokenizer_encode(t, s, n, 0, &ids, &k, err, sizeof(err)) == 0);
    if (roundtrip) {
        // Byte-level BPE loses nothing but the NFC step and invalid bytes (which become U+FFFD).
        char *out = NULL, *fixed;
        size_t ol = 0, fl = 0;
        REQUIRE(tokenizer_decode(t, ids, k, 0, &out, &ol, err, sizeof(err)) == 0);
        fixed = tokenizer_utf8_repair(s, n, &fl);
        REQUIRE(fixed);
        int32_t *ids2 = NULL;
        size_t k2 = 0;
        // NFC is idempotent: re-encoding the decoded text must give the same ids.
        REQUIRE(tokenizer_encode(t, out, ol, 0, &ids2, &k2, err, sizeof(err)) == 0);
        REQUIRE(k2 == k && memcmp(ids2, ids, k * sizeof(int32_t)) == 0);
        free(ids2);
        free(fixed);
        free(out);
    }
    check_decode(t, ids, k, 0);
    check_decode(t, ids, k, 1);
    free(ids);
    REQUIRE(tokenizer_encode(t, s, n, 1, &ids, &k, err, sizeof(err)) == 0);
    free(ids);
}

static void fuzz_chat(const char *s, size_t n) {
    // template \0 role \0 content \0 role \0 content ...
    char *buf = malloc(n + 1);
    REQUIRE(buf);
    memcpy(buf, s, n);
    buf[n] = 0;
    const char *tmpl = buf;
    ChatMessage msgs[8];
    ChatToolCall calls[8];
    size_t nm = 0;
    const char *p = buf + strlen(buf) + 1;
    static const char *roles[] = {"system", "user", "assistant", "tool"};
    while (p < buf + n && nm < 8) {
        const char *content = p + 1 <= buf + n ? p + 1 : "";
        msgs[nm] = (ChatMessage){.role = roles[(unsigned char)p[0] % 4], .content = content};
        // An assistant turn whose role byte has bit 2 set also calls a tool, its content as the arguments' JSON text.
        if (!strcmp(msgs[nm].role, "assistant") && ((unsigned char)p[0] & 4)) {
            calls[nm] = (ChatToolCall){.name = "f", .arguments = content};
            msgs[nm].tool_calls = &calls[nm];
            msgs[nm].n_tool_calls = 1;
        }
        p += strlen(p) + 1;
        nm++;
    }
    static const char *names[] = {NULL, "chatml", "qwen3", "llama3", "llama3.1", "llama2", "mistral", "mistral-v1",
                                  "zephyr"};
    for (size_t f = 0; f < sizeof(names) / sizeof(names[0]); f++) {
        ChatTemplate *ct = NULL;
        char err[256];
        if (chat_template_create(&ct, tmpl, names[f], "<s>", "</s>", err, sizeof(err)) != 0) continue;
        for (int gen = 0; gen < 2; gen++) {
            ChatRenderOptions opt = {.enable_thinking = gen, .date_string = gen ? NULL : "01 Jan 2025"};
            char *out = NULL;
            size_t ol = 0;
            if (chat_render_ex(ct, msgs, nm, gen, &opt, &out, &ol, err, sizeof(err)) == 0) REQUIRE(valid_utf8(out, ol));
            free(out);
        }
        chat_template_free(ct);
    }
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const char *s = (const char *)data + 1;
    size_t n = size - 1;
    char err[256];
    switch (data[0] % 5) {
    case 0: {
        Tokenizer *t = NULL;
        if (tokenizer_load_json(&t, s, n, err, sizeof(err)) == 0) {
            static const char *probe[] = {"Hello world!", " 日本語 123 ", "<s>x</s>\n\n", "\xff\xfe", ""};
            for (size_t k = 0; k < sizeof(probe) / sizeof(probe[0]); k++) {
                int32_t *ids = NULL;
                size_t m = 0;
                if (tokenizer_encode(t, probe[k], strlen(probe[k]), 1, &ids, &m, err, sizeof(err)) == 0)
                    check_decode(t, ids, m, k & 1);
                free(ids);
            }
            int32_t range[64];
            for (int k = 0; k < 64; k++) range[k] = k * 7 - 20;
            check_decode(t, range, 64, 0);
            tokenizer_free(t);
        } else {
            REQUIRE(err[0] != 0);   // every refusal explains itself
        }
        break;
    }
    case 1:
        encode_decode(g_bl, s, n, 1);
        break;
    case 2: {
        size_t k = n / 4;
        int32_t *ids = malloc((k + 1) * sizeof(int32_t));
        REQUIRE(ids);
        memcpy(ids, s, k * 4);
        check_decode(g_bl, ids, k, 0);
        check_decode(g_sp, ids, k, 1);
        for (size_t i = 0; i < k; i++) ids[i] = (int32_t)((uint32_t)ids[i] % 300u);   // mostly valid ids
        check_decode(g_bl, ids, k, 1);
        check_decode(g_sp, ids, k, 0);
        free(ids);
        break;
    }
    case 3:
        encode_decode(g_sp, s, n, 0);
        break;
    default:
        fuzz_chat(s, n);
        break;
    }
    return 0;
}
