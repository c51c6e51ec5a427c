// tests/unit/test_tokenizer_stream.c — the ByteLevel streaming fast path against the reference path (HF's
// step_decode_stream run literally over tokenizer_decode): the same chunk, or the same "nothing yet", at every
// step of many random id sequences over a byte-level vocabulary built to hit every awkward case (byte tokens
// that split characters, invalid and overlong sequences, a literal U+FFFD, tokens outside the byte alphabet,
// added tokens that are and are not byte-mapped, special tokens with skip on and off, unknown ids inside the
// vocab and ids outside it, flushes in mid-stream). Also a few sequences whose chunks were taken from HF
// tokenizers 0.23.3's DecodeStream, and the fast path being chosen only for a pure ByteLevel decoder. (The
// reference path itself is checked against HF in tests/reference/test_tokenizer.py.)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "shared/tokenizer/tokenizer.h"
#include "shared/tokenizer/tokenizer_internal.h"

// Appends a byte string to the JSON as a vocab key spelled in GPT-2's byte alphabet.
static char *put_bytelevel_key(char *w, const char *raw, size_t n) {
    *w++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned cp = tok_bytelevel_char[(unsigned char)raw[i]];
        if (cp == '"' || cp == '\\') *w++ = '\\';
        w += tok_utf8_encode(cp, w);
    }
    *w++ = '"';
    return w;
}

// Multi-byte model tokens, as raw bytes (the vocab spells them in the byte alphabet).
static const char *const MULTI[] = {
    "\xE6\x97\xA5",       // 日, whole
    "\xE6\x9C\xAC",       // 本, whole
    "\xE6\x97",           // 日 without its last byte
    "\x97\xA5",           // 日 without its lead byte
    "\xF0\x9F",           // start of a 4-byte emoji
    "\x91\xA9",           // its continuation
    "\xF0\x9F\x91\xA9",   // 👩, whole
    "a\xE6",              // ASCII then a lead byte
    "\xA5" "b",           // a continuation then ASCII
    " hello",
    "\r\n",
    "\xEF\xBF\xBD",       // a literal U+FFFD: the held-back test sees it too
    "\xC3(",              // lead byte then a non-continuation
    "\xED\xA0\x80",       // a surrogate: invalid
    "\xF4\x90\x80\x80",   // above U+10FFFF: invalid
    "\xC0\x80",           // overlong: invalid
    "\xC3\xA9",           // é
    "\xE2\x80",           // part of a general punctuation character
    "\xFF\xFE",
};
#define N_MULTI (sizeof(MULTI) / sizeof(MULTI[0]))
#define FIRST_MULTI 256
// Model tokens written with characters outside the byte alphabet: the decoder passes them through as UTF-8.
#define ID_RAW_CJK (FIRST_MULTI + (int)N_MULTI)   // "日本"
#define ID_RAW_NL (ID_RAW_CJK + 1)                // "\n!"
// Added tokens. HF gives an added token the id of a model token with the same string, and the next free id
// after the model vocab otherwise (whatever id tokenizer.json writes), so the ids below follow that rule.
#define ID_END (ID_RAW_CJK + 2)                   // "<|end|>" special, also a model token
#define ID_ZZ 400                                 // model token "zz"; ids between the added ones and it are unknown
#define ID_IM (ID_RAW_CJK + 4)                    // "<|im_start|>" special (model vocab has ID_RAW_CJK + 4 entries)
#define ID_E_G (ID_IM + 1)                        // "éĠ" special, byte-mapped to E9 20 (invalid E9)
#define ID_G_X_A (ID_IM + 2)                      // "ĠxÃ" not special, byte-mapped to " x" C3
#define ID_TOOL (ID_IM + 3)                       // "<tool>" not special
#define ID_CJK_SPECIAL (ID_IM + 4)                // "<|日|>" special, passes through as UTF-8

static char *stream_json(const char *decoder) {
    static char buf[65536];
    char *w = buf;
    w += sprintf(w, "{\"version\":\"1.0\",\"added_tokens\":["
                    "{\"id\":%d,\"content\":\"<|end|>\",\"special\":true,\"normalized\":false},"
                    "{\"id\":%d,\"content\":\"<|im_start|>\",\"special\":true,\"normalized\":false},"
                    "{\"id\":%d,\"content\":\"\\u00e9\\u0120\",\"special\":true,\"normalized\":false},"
                    "{\"id\":%d,\"content\":\"\\u0120x\\u00c3\",\"special\":false,\"normalized\":false},"
                    "{\"id\":%d,\"content\":\"<tool>\",\"special\":false,\"normalized\":false},"
                    "{\"id\":%d,\"content\":\"<|\\u65e5|>\",\"special\":true,\"normalized\":false}],"
                    "\"normalizer\":null,\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
                    "\"trim_offsets\":true,\"use_regex\":true},\"post_processor\":null,\"decoder\":%s,"
                    "\"model\":{\"type\":\"BPE\",\"unk_token\":null,\"byte_fallback\":false,\"vocab\":{",
                 ID_END, ID_IM, ID_E_G, ID_G_X_A, ID_TOOL, ID_CJK_SPECIAL, decoder);
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        w = put_bytelevel_key(w, &c, 1);
        w += sprintf(w, ":%d,", b);
    }
    for (size_t i = 0; i < N_MULTI; i++) {
        w = put_bytelevel_key(w, MULTI[i], strlen(MULTI[i]));
        w += sprintf(w, ":%d,", FIRST_MULTI + (int)i);
    }
    w += sprintf(w, "\"\\u65e5\\u672c\":%d,\"\\n!\":%d,\"<|end|>\":%d,\"zz\":%d},\"merges\":[]}}", ID_RAW_CJK,
                 ID_RAW_NL, ID_END, ID_ZZ);
    return buf;
}

static Tokenizer *load(const char *json) {
    char err[256];
    Tokenizer *t = NULL;
    int rc = tokenizer_load_json(&t, json, strlen(json), err, sizeof(err));
    CHECK(rc == 0, "load: %s", err);
    return t;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(uint32_t n) {   // xorshift64*, uniform enough for picking ids
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32) % n;
}

static int32_t random_id(void) {
    static const int32_t added[] = {ID_END, ID_IM, ID_E_G, ID_G_X_A, ID_TOOL, ID_CJK_SPECIAL, ID_ZZ,
                                    ID_RAW_CJK, ID_RAW_NL};
    uint32_t r = rnd(100);
    if (r < 30) return 0x80 + (int32_t)rnd(128);              // lead, continuation and never-valid bytes
    if (r < 50) return 'a' + (int32_t)rnd(26);                // ASCII letters
    if (r < 55) return (int32_t)rnd(0x80);                    // any ASCII byte, controls included
    if (r < 80) return FIRST_MULTI + (int32_t)rnd(N_MULTI);
    if (r < 95) return added[rnd(sizeof(added) / sizeof(added[0]))];
    if (r < 97) return ID_CJK_SPECIAL + 1 + (int32_t)rnd(ID_ZZ - ID_CJK_SPECIAL - 1);   // unknown, in range
    return r < 98 ? -1 - (int32_t)rnd(5) : ID_ZZ + 1 + (int32_t)rnd(1000);              // out of range
}

// Steps (or flushes, id == INT32_MIN) both streams and checks they answer alike. Appends the fast chunk to
// *acc (for the whole-decode check). Returns 0 when they differ.
static int step_both(TokenizerStream *fast, TokenizerStream *ref, int32_t id, char *acc, size_t *acc_n,
                     const char *where) {
    char err1[256] = "", err2[256] = "";
    char *a = NULL, *b = NULL;
    size_t al = 7, bl = 9;
    int ra, rb;
    if (id == INT32_MIN) {
        ra = tokenizer_stream_flush(fast, &a, &al, err1, sizeof(err1));
        rb = tokenizer_stream_flush(ref, &b, &bl, err2, sizeof(err2));
    } else {
        ra = tokenizer_stream_step(fast, id, &a, &al, err1, sizeof(err1));
        rb = tokenizer_stream_step(ref, id, &b, &bl, err2, sizeof(err2));
    }
    int same = ra == rb && (a == NULL) == (b == NULL) && al == bl && (!a || memcmp(a, b, al) == 0) &&
               (!a || a[al] == 0) && (ra == 0 || strcmp(err1, err2) == 0);
    CHECK(same, "%s id %d: fast rc %d \"%s\" (%zu) [%s], reference rc %d \"%s\" (%zu) [%s]", where, id, ra,
          a ? a : "(null)", al, err1, rb, b ? b : "(null)", bl, err2);
    if (a && *acc_n + al < 65536) { memcpy(acc + *acc_n, a, al); *acc_n += al; }
    free(a);
    free(b);
    return same;
}

static void test_random_sequences(const Tokenizer *t, int n_seq) {
    char err[256], where[64];
    static char acc[65536];
    int32_t ids[128];
    long steps = 0, emitted_ffd = 0;
    for (int s = 0; s < n_seq && failures < 20; s++) {
        int skip = s & 1;
        TokenizerStream *fast = NULL, *ref = NULL;
        CHECK(tokenizer_stream_create(&fast, t, skip, err, sizeof(err)) == 0, "create: %s", err);
        CHECK(tok_stream_create_reference(&ref, t, skip, err, sizeof(err)) == 0, "create: %s", err);
        if (!fast || !ref) { tokenizer_stream_free(fast); tokenizer_stream_free(ref); return; }
        CHECK(tok_stream_is_fast(fast) && !tok_stream_is_fast(ref), "path choice");
        int len = 1 + (int)rnd(s % 10 == 0 ? 120 : 40);
        size_t acc_n = 0, n_ids = 0;
        snprintf(where, sizeof(where), "seq %d skip %d", s, skip);
        for (int i = 0; i < len; i++) {
            int32_t id = random_id();
            ids[n_ids++] = id;
            int ok = step_both(fast, ref, id, acc, &acc_n, where);
            steps++;
            int flush = rnd(100) < 3 || i == len - 1;
            if (ok && flush) ok = step_both(fast, ref, INT32_MIN, acc, &acc_n, where);
            if (!ok) break;
            if (flush) {
                // Everything the fast stream handed out since the last flush equals the decode of those ids.
                char *whole = NULL;
                size_t wl = 0;
                CHECK(tokenizer_decode(t, ids, n_ids, skip, &whole, &wl, err, sizeof(err)) == 0, "decode");
                CHECK(whole && wl == acc_n && memcmp(whole, acc, wl) == 0, "%s: chunks + flush != decode", where);
                for (size_t k = 0; whole && k + 3 <= wl; k++) emitted_ffd += memcmp(whole + k, "\xEF\xBF\xBD", 3) == 0;
                free(whole);
                acc_n = 0;
                n_ids = 0;
            }
        }
        tokenizer_stream_free(fast);
        tokenizer_stream_free(ref);
    }
    // The sequences must actually exercise replacement characters, or they prove little about invalid input.
    CHECK(emitted_ffd > n_seq / 4, "only %ld U+FFFD in %d sequences", emitted_ffd, n_seq);
    printf("random sequences: %d, %ld steps compared\n", n_seq, steps);
}

// Chunks from HF tokenizers 0.23.3 (DecodeStream.step on an equivalent byte-level tokenizer); NULL = None.
typedef struct { int skip; int32_t ids[6]; const char *chunks[6]; int n; } HfCase;
static const HfCase HF_CASES[] = {
    {0, {0x80, 'a', 0x80, 0x80, 'a'}, {NULL, "\xEF\xBF\xBD" "a", NULL, NULL, "\xEF\xBF\xBD\xEF\xBF\xBD" "a"}, 5},
    {0, {0xE6, 0x97, 'a'}, {NULL, NULL, "\xEF\xBF\xBD" "a"}, 3},
    {0, {0xE6, 0x97, 0xA5, 'a'}, {NULL, NULL, "\xE6\x97\xA5", "a"}, 4},
    {0, {0xFF, 0xE6, 0x97, 0xA5}, {NULL, NULL, NULL, "\xEF\xBF\xBD\xE6\x97\xA5"}, 4},
    {0, {0xE6, ID_END, 'a'}, {NULL, "\xEF\xBF\xBD<|end|>", "a"}, 3},
    {1, {0xE6, ID_END, 'a'}, {NULL, NULL, "\xEF\xBF\xBD" "a"}, 3},
    {0, {0xE6, ID_E_G, 'a'}, {NULL, "\xEF\xBF\xBD\xEF\xBF\xBD ", "a"}, 3},
    {1, {0xE6, ID_E_G, 'a'}, {NULL, NULL, "\xEF\xBF\xBD" "a"}, 3},
    {0, {0xE6, ID_G_X_A, 'a'}, {NULL, NULL, "\xEF\xBF\xBD x\xEF\xBF\xBD" "a"}, 3},
    {1, {0xE6, ID_RAW_NL, 'a'}, {NULL, "\xEF\xBF\xBD\n!", "a"}, 3},
};

static void test_hf_cases(const Tokenizer *t) {
    char err[256];
    for (size_t c = 0; c < sizeof(HF_CASES) / sizeof(HF_CASES[0]); c++) {
        const HfCase *hc = &HF_CASES[c];
        for (int fast = 1; fast >= 0; fast--) {
            TokenizerStream *st = NULL;
            int rc = fast ? tokenizer_stream_create(&st, t, hc->skip, err, sizeof(err))
                          : tok_stream_create_reference(&st, t, hc->skip, err, sizeof(err));
            CHECK(rc == 0 && tok_stream_is_fast(st) == fast, "create");
            for (int i = 0; st && i < hc->n; i++) {
                char *chunk = NULL;
                size_t cl = 0;
                CHECK(tokenizer_stream_step(st, hc->ids[i], &chunk, &cl, err, sizeof(err)) == 0, "step: %s", err);
                const char *want = hc->chunks[i];
                CHECK((chunk == NULL) == (want == NULL) && (!want || strcmp(chunk, want) == 0),
                      "case %zu step %d (%s path): got \"%s\" want \"%s\"", c, i, fast ? "fast" : "reference",
                      chunk ? chunk : "(null)", want ? want : "(null)");
                free(chunk);
            }
            tokenizer_stream_free(st);
        }
    }
}

static void test_path_choice(void) {
    char err[256];
    static const char *const NOT_PURE[] = {
        "{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"ByteLevel\"},{\"type\":\"Fuse\"}]}",
        "{\"type\":\"Fuse\"}",
        "null",
    };
    Tokenizer *t = load(stream_json("{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"ByteLevel\"}]}"));
    TokenizerStream *st = NULL;
    if (t) {
        CHECK(tokenizer_stream_create(&st, t, 0, err, sizeof(err)) == 0 && tok_stream_is_fast(st),
              "a Sequence of one ByteLevel is pure ByteLevel");
        tokenizer_stream_free(st);
        tokenizer_free(t);
    }
    for (size_t i = 0; i < sizeof(NOT_PURE) / sizeof(NOT_PURE[0]); i++) {
        t = load(stream_json(NOT_PURE[i]));
        if (!t) continue;
        st = NULL;
        CHECK(tokenizer_stream_create(&st, t, 0, err, sizeof(err)) == 0 && !tok_stream_is_fast(st),
              "decoder %s must take the reference path", NOT_PURE[i]);
        // The reference path still streams: with ByteLevel in the chain, "日" split over three byte ids comes
        // out once, whole (Fuse alone or no decoder emit each id's token string as it comes).
        char *c = NULL;
        size_t cl = 0;
        int32_t ids[] = {0xE6, 0x97, 0xA5};
        int got = 0;
        for (int k = 0; st && k < 3; k++) {
            CHECK(tokenizer_stream_step(st, ids[k], &c, &cl, err, sizeof(err)) == 0, "step: %s", err);
            got += c != NULL;
            free(c);
        }
        if (i == 0) CHECK(got == 1, "decoder %s: %d chunks", NOT_PURE[i], got);
        tokenizer_stream_free(st);
        tokenizer_free(t);
    }
}

int main(void) {
    Tokenizer *t = load(stream_json("{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"trim_offsets\":true,"
                                    "\"use_regex\":true}"));
    if (!t) return 1;
    // The fixture's ids are what the loader assigned.
    static const struct { int32_t id; const char *s; int special; } FIX[] = {
        {ID_RAW_CJK, "\u65e5\u672c", 0}, {ID_RAW_NL, "\n!", 0}, {ID_END, "<|end|>", 1}, {ID_ZZ, "zz", 0},
        {ID_IM, "<|im_start|>", 1}, {ID_E_G, "\u00e9\u0120", 1}, {ID_G_X_A, "\u0120x\u00c3", 0},
        {ID_TOOL, "<tool>", 0}, {ID_CJK_SPECIAL, "<|\u65e5|>", 1}};
    for (size_t i = 0; i < sizeof(FIX) / sizeof(FIX[0]); i++) {
        size_t l = 0;
        const char *s = tokenizer_id_to_token(t, FIX[i].id, &l);
        CHECK(s && l == strlen(FIX[i].s) && memcmp(s, FIX[i].s, l) == 0 && tokenizer_is_special(t, FIX[i].id) ==
              FIX[i].special, "fixture id %d", FIX[i].id);
    }
    CHECK(tokenizer_id_to_token(t, ID_CJK_SPECIAL + 1, NULL) == NULL && tokenizer_vocab_size(t) == ID_ZZ + 1,
          "fixture gap");
    test_hf_cases(t);
    test_random_sequences(t, 20000);
    tokenizer_free(t);
    test_path_choice();
    return check_exit_code("test_tokenizer_stream");
}
