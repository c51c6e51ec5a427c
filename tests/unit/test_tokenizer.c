// tests/unit/test_tokenizer.c — tokenizer behaviour that needs no Python: BPE merge order, added-token
// stripping, byte fallback, invalid UTF-8 (never a crash, U+FFFD as Python's errors="replace"), streaming
// decode, configs, malformed input errors, chat-template refusals, and concurrent encodes from several
// threads giving the single-thread answer. (Equality with HF itself is proven in tests/reference.)
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_macros.h"
#include "shared/tokenizer/chat_template.h"
#include "shared/tokenizer/tokenizer.h"
#include "testlib.h"

// GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the other 68 take 256.. in order.
static unsigned bytelevel_cp(int b) {
    int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    if (printable) return (unsigned)b;
    unsigned n = 0;
    for (int x = 0; x < b; x++)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
    return 256 + n;
}

static void put_cp(char **w, unsigned cp) {
    if (cp < 0x80) *(*w)++ = (char)cp;
    else { *(*w)++ = (char)(0xC0 | (cp >> 6)); *(*w)++ = (char)(0x80 | (cp & 0x3F)); }
}

// A byte-level BPE: ids 0..255 are the bytes, then merges h+e, l+l, he+ll, hell+o, a+a; added tokens
// "<|end|>" (special), "<tool>" (lstrip+rstrip) and " x" (not normalized).
static char *bytelevel_json(void) {
    static char buf[32768];
    char *w = buf;
    w += sprintf(w, "{\"version\":\"1.0\",\"added_tokens\":["
                    "{\"id\":261,\"content\":\"<|end|>\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"
                    "\"normalized\":false,\"special\":true},"
                    "{\"id\":262,\"content\":\"<tool>\",\"single_word\":false,\"lstrip\":true,\"rstrip\":true,"
                    "\"normalized\":false,\"special\":false}],"
                    "\"normalizer\":null,\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
                    "\"trim_offsets\":true,\"use_regex\":true},\"post_processor\":{\"type\":\"TemplateProcessing\","
                    "\"single\":[{\"SpecialToken\":{\"id\":\"<|end|>\",\"type_id\":0}},{\"Sequence\":{\"id\":\"A\","
                    "\"type_id\":0}}],\"pair\":[],\"special_tokens\":{\"<|end|>\":{\"id\":\"<|end|>\",\"ids\":[261],"
                    "\"tokens\":[\"<|end|>\"]}}},\"decoder\":{\"type\":\"ByteLevel\"},"
                    "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"byte_fallback\":false,"
                    "\"vocab\":{");
    for (int b = 0; b < 256; b++) {
        unsigned cp = bytelevel_cp(b);
        *w++ = '"';
        if (cp == '"' || cp == '\\') *w++ = '\\';
        put_cp(&w, cp);
        w += sprintf(w, "\":%d,", b);
    }
    w += sprintf(w, "\"he\":256,\"ll\":257,\"hell\":258,\"hello\":259,\"aa\":260},"
                    "\"merges\":[\"h e\",[\"l\",\"l\"],\"he ll\",\"hell o\",\"a a\"]}}");
    return buf;
}

// SentencePiece-style: Metaspace, byte fallback, unk, decoder Replace/ByteFallback/Fuse/Strip.
static const char *SP_JSON =
    "{\"added_tokens\":[{\"id\":0,\"content\":\"<unk>\",\"special\":true,\"normalized\":false},"
    "{\"id\":1,\"content\":\"<s>\",\"special\":true,\"normalized\":false}],"
    "\"normalizer\":null,\"pre_tokenizer\":{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\","
    "\"prepend_scheme\":\"first\",\"split\":false},\"post_processor\":null,"
    "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":\"\\u2581\"},"
    "\"content\":\" \"},{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" \","
    "\"start\":1,\"stop\":0}]},"
    "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":true,\"byte_fallback\":true,"
    "\"vocab\":{\"<unk>\":0,\"<s>\":1,\"<0xE6>\":2,\"<0x97>\":3,\"<0xA5>\":4,\"\\u2581\":5,\"h\":6,\"i\":7,"
    "\"\\u2581h\":8,\"\\u2581hi\":9},\"merges\":[\"\\u2581 h\",\"\\u2581h i\"]}}";

static Tokenizer *load(const char *json) {
    char err[256];
    Tokenizer *t = NULL;
    int rc = tokenizer_load_json(&t, json, strlen(json), err, sizeof(err));
    CHECK(rc == 0, "load failed: %s", err);
    return t;
}

static size_t enc(const Tokenizer *t, const char *s, size_t len, int add, int32_t *out, size_t cap) {
    char err[256];
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = tokenizer_encode(t, s, len, add, &ids, &n, err, sizeof(err));
    CHECK(rc == 0, "encode failed: %s", err);
    for (size_t i = 0; i < n && i < cap; i++) out[i] = ids[i];
    free(ids);
    return n;
}

static char *dec(const Tokenizer *t, const int32_t *ids, size_t n, int skip) {
    char err[256], *s = NULL;
    size_t len = 0;
    int rc = tokenizer_decode(t, ids, n, skip, &s, &len, err, sizeof(err));
    CHECK(rc == 0, "decode failed: %s", err);
    return s;
}

static void test_bpe_and_added(void) {
    Tokenizer *t = load(bytelevel_json());
    if (!t) return;
    int32_t ids[64];
    size_t n = enc(t, "hello", 5, 0, ids, 64);
    CHECK(n == 1 && ids[0] == 259, "hello -> [259], got n=%zu id0=%d", n, ids[0]);
    // "aaa": the leftmost a+a merges first, leaving a lone 'a'.
    n = enc(t, "aaa", 3, 0, ids, 64);
    CHECK(n == 2 && ids[0] == 260 && ids[1] == 'a', "aaa -> [aa, a]");
    // Post-processor prepends <|end|> only with add_special_tokens.
    n = enc(t, "hello", 5, 1, ids, 64);
    CHECK(n == 2 && ids[0] == 261 && ids[1] == 259, "add_special_tokens prepends 261");
    // <tool> swallows the spaces around it (lstrip/rstrip); <|end|> inside text is one token.
    n = enc(t, "a  <tool>  b<|end|>", 19, 0, ids, 64);
    CHECK(n == 4 && ids[0] == 'a' && ids[1] == 262 && ids[2] == 'b' && ids[3] == 261, "added token split, n=%zu", n);
    char *s = dec(t, ids, n, 0);
    CHECK(s && strcmp(s, "a<tool>b<|end|>") == 0, "decode keeps added tokens: %s", s);
    free(s);
    s = dec(t, ids, n, 1);
    CHECK(s && strcmp(s, "a<tool>b") == 0, "skip_special_tokens drops <|end|>: %s", s);
    free(s);
    CHECK(tokenizer_is_special(t, 261) && !tokenizer_is_special(t, 262), "special flags");
    CHECK(tokenizer_token_to_id(t, "hello", 5) == 259 && tokenizer_vocab_size(t) == 263, "vocab queries");
    size_t tl = 0;
    const char *ts = tokenizer_id_to_token(t, 256, &tl);
    CHECK(ts && tl == 2 && memcmp(ts, "he", 2) == 0, "id_to_token");
    CHECK(tokenizer_id_to_token(t, 9999, &tl) == NULL && tokenizer_id_to_token(t, -1, &tl) == NULL, "unknown ids");
    // Round trips, including every byte value and multi-byte text.
    const char *texts[] = {"hello world", "  spaced\t\ttext\n\n", "日本語 👩‍👧 ok", "x", ""};
    for (size_t k = 0; k < sizeof(texts) / sizeof(texts[0]); k++) {
        n = enc(t, texts[k], strlen(texts[k]), 0, ids, 64);
        s = dec(t, ids, n < 64 ? n : 64, 0);
        CHECK(s && strcmp(s, texts[k]) == 0, "round trip \"%s\" -> \"%s\"", texts[k], s);
        free(s);
    }
    // Unknown ids are skipped by decode, as HF does.
    int32_t odd[3] = {'o', 123456, 'k'};
    s = dec(t, odd, 3, 0);
    CHECK(s && strcmp(s, "ok") == 0, "unknown id skipped: %s", s);
    free(s);
    tokenizer_free(t);
}

static void test_invalid_utf8(void) {
    Tokenizer *t = load(bytelevel_json());
    if (!t) return;
    // Invalid input encodes exactly like the text Python's errors="replace" would give.
    struct { const char *bad; const char *fixed; } cases[] = {
        {"\xff", "\xEF\xBF\xBD"},
        {"abc\xe4\xb8", "abc\xEF\xBF\xBD"},                            // truncated sequence: one U+FFFD
        {"\xed\xa0\x80x", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBDx"},   // surrogate: one per byte
        {"\xe0\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},     // overlong
        {"\xf0\x9f\x98 ok", "\xEF\xBF\xBD ok"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        int32_t a[64], b[64];
        size_t na = enc(t, cases[k].bad, strlen(cases[k].bad), 0, a, 64);
        size_t nb = enc(t, cases[k].fixed, strlen(cases[k].fixed), 0, b, 64);
        CHECK(na == nb && memcmp(a, b, na * sizeof(int32_t)) == 0, "invalid utf-8 case %zu", k);
    }
    size_t fl = 0;
    char *fixed = tokenizer_utf8_repair("a\x80" "b", 3, &fl);
    CHECK(fixed && fl == 5 && memcmp(fixed, "a\xEF\xBF\xBD" "b", 5) == 0, "repair");
    free(fixed);
    // Random bytes: no crash, and decode always yields valid UTF-8.
    unsigned seed = 12345;
    for (int r = 0; r < 300; r++) {
        char buf[96];
        size_t len = (size_t)(r % 96);
        for (size_t i = 0; i < len; i++) { seed = seed * 1103515245u + 12345u; buf[i] = (char)(seed >> 16); }
        int32_t *ids = NULL;
        size_t n = 0;
        char err[256];
        int rc = tokenizer_encode(t, buf, len, r & 1, &ids, &n, err, sizeof(err));
        CHECK(rc == 0, "random bytes encode: %s", err);
        char *s = dec(t, ids, n, 0);
        size_t sl = s ? strlen(s) : 0;
        char *again = tokenizer_utf8_repair(s, sl, &fl);
        CHECK(again && fl == sl && memcmp(again, s, sl) == 0, "decode output is valid UTF-8");
        free(again);
        free(s);
        free(ids);
    }
    tokenizer_free(t);
}

static void test_sentencepiece_and_stream(void) {
    Tokenizer *t = load(SP_JSON);
    if (!t) return;
    int32_t ids[32];
    // "hi 日": ▁hi, then ▁ (the space), then 日 via its three byte tokens.
    const char *text = "hi \xE6\x97\xA5";
    size_t n = enc(t, text, strlen(text), 0, ids, 32);
    CHECK(n == 5 && ids[0] == 9 && ids[1] == 5 && ids[2] == 2 && ids[3] == 3 && ids[4] == 4, "byte fallback n=%zu", n);
    char *s = dec(t, ids, n, 0);
    CHECK(s && strcmp(s, text) == 0, "sentencepiece round trip: %s", s);
    free(s);
    // A character with no vocab entry and no byte tokens becomes <unk>; consecutive ones fuse.
    n = enc(t, "hi\xC3\xA9\xC3\xA9", 6, 0, ids, 32);
    CHECK(n == 2 && ids[0] == 9 && ids[1] == 0, "fused unk, n=%zu", n);
    // Streaming: the three byte tokens of 日 produce nothing until the last, then the whole character.
    int32_t seq[5] = {9, 5, 2, 3, 4};
    TokenizerStream *st = NULL;
    char err[256];
    CHECK(tokenizer_stream_create(&st, t, 0, err, sizeof(err)) == 0, "stream create");
    char joined[64] = "";
    int nulls = 0;
    for (int i = 0; st && i < 5; i++) {
        char *chunk = NULL;
        size_t cl = 0;
        CHECK(tokenizer_stream_step(st, seq[i], &chunk, &cl, err, sizeof(err)) == 0, "step: %s", err);
        if (!chunk) { nulls++; continue; }
        CHECK(strstr(chunk, "\xEF\xBF\xBD") == NULL, "no U+FFFD mid-character: %s", chunk);
        strncat(joined, chunk, sizeof(joined) - strlen(joined) - 1);
        free(chunk);
    }
    char *rest = NULL;
    size_t rl = 0;
    if (st) CHECK(tokenizer_stream_flush(st, &rest, &rl, err, sizeof(err)) == 0, "flush");
    if (rest) strncat(joined, rest, sizeof(joined) - strlen(joined) - 1);
    free(rest);
    CHECK(strcmp(joined, text) == 0 && nulls >= 2, "stream total \"%s\" nulls=%d", joined, nulls);
    // A stream cut inside a character hands the remainder back on flush, as U+FFFD.
    if (st) {
        char *c0 = NULL;
        size_t l0;
        tokenizer_stream_step(st, 2, &c0, &l0, err, sizeof(err));
        CHECK(c0 == NULL, "incomplete char held back");
        free(c0);
        tokenizer_stream_flush(st, &rest, &rl, err, sizeof(err));
        CHECK(rest && strcmp(rest, "\xEF\xBF\xBD") == 0, "flush of a cut character");
        free(rest);
    }
    tokenizer_stream_free(st);
    tokenizer_free(t);
}

static void expect_load_error(const char *json, const char *field) {
    char err[256] = "";
    Tokenizer *t = NULL;
    int rc = tokenizer_load_json(&t, json, strlen(json), err, sizeof(err));
    CHECK(rc < 0 && t == NULL && strstr(err, field), "expected error naming %s, got rc=%d \"%s\"", field, rc, err);
    tokenizer_free(t);
}

static void test_errors(void) {
    expect_load_error("{\"version\":\"1.0\"}", "model");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a b\"]}}", "model.merges[0]");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":\"x\"},\"merges\":[]}}", "model.vocab");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[1]}}", "model.merges[0]");
    expect_load_error("{\"model\":{\"type\":\"Unigram\",\"vocab\":[]}}", "model.type");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]},\"pre_tokenizer\":"
                      "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[\"},\"behavior\":\"Isolated\",\"invert\":false}}",
                      "pre_tokenizer.pattern");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[],\"dropout\":0.5}}", "model.dropout");
    expect_load_error("{\"model\": [", "invalid JSON");
    char err[256];
    Tokenizer *t = NULL;
    CHECK(tokenizer_load(&t, "/nonexistent/folder", err, sizeof(err)) == TOK_EIO, "missing folder");
    CHECK(tokenizer_load(NULL, "x", err, sizeof(err)) == TOK_EINVAL, "NULL out");
    // A vocab that names an unk_token it does not contain fails at encode time, as in HF.
    const char *badunk = "{\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"vocab\":{\"a\":0},\"merges\":[]}}";
    t = load(badunk);
    int32_t *ids = NULL;
    size_t n;
    if (t) CHECK(tokenizer_encode(t, "ab", 2, 0, &ids, &n, err, sizeof(err)) == TOK_EUNK && strstr(err, "unk_token"),
                 "unk error: %s", err);
    free(ids);
    if (t) CHECK(tokenizer_encode(t, NULL, 3, 0, &ids, &n, err, sizeof(err)) == TOK_EINVAL, "NULL text");
    tokenizer_free(t);
}

static void test_configs(void) {
    char dir[] = "/tmp/tandem_tok_XXXXXX", path[512];
    if (!mkdtemp(dir)) { CHECK(0, "mkdtemp"); return; }
    snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
    write_text_file(path, bytelevel_json());
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
    // model_max_length as transformers writes it when the model sets none (int(1e30)): beyond int64, still valid JSON.
    write_text_file(path, "{\"bos_token\":{\"content\":\"<|end|>\"},\"eos_token\":\"<|end|>\",\"pad_token\":\"aa\","
                     "\"add_bos_token\":false,\"chat_template\":\"{% for m in messages %}{{ m }}{% endfor %}\",\n"
                     "\"model_max_length\": 1000000000000000019884624838656}");
    snprintf(path, sizeof(path), "%s/generation_config.json", dir);
    write_text_file(path, "{\"eos_token_id\":[259,261]}");
    char err[256];
    Tokenizer *t = NULL;
    CHECK(tokenizer_load(&t, dir, err, sizeof(err)) == 0, "load dir: %s", err);
    if (t) {
        int32_t eos[4];
        CHECK(tokenizer_bos_id(t) == 261 && tokenizer_pad_id(t) == 260, "bos/pad");
        CHECK(tokenizer_eos_ids(t, eos, 4) == 2 && eos[0] == 259 && eos[1] == 261, "eos list");
        CHECK(tokenizer_is_eos(t, 261) && !tokenizer_is_eos(t, 1) && tokenizer_add_bos_token(t) == 0, "eos/add_bos");
        ChatTemplate *ct = NULL;
        CHECK(chat_template_from_tokenizer(&ct, t, NULL, err, sizeof(err)) < 0 && strstr(err, "--chat-template"),
              "unknown template names the override: %s", err);
        CHECK(chat_template_from_tokenizer(&ct, t, "zephyr", err, sizeof(err)) == 0, "forced family");
        ChatMessage msgs[2] = {{.role = "user", .content = "hi"}, {.role = "user", .content = "again"}};
        char *out = NULL;
        CHECK(ct && chat_render(ct, msgs, 2, 1, &out, NULL, err, sizeof(err)) == 0 && out && strstr(out, "<|end|>"),
              "zephyr render uses the config's eos");
        free(out);
        out = NULL;
        ChatMessage robot = {.role = "robot", .content = "x"}, tool = {.role = "tool", .content = "x"};
        CHECK(chat_render(ct, &robot, 1, 1, &out, NULL, err, sizeof(err)) < 0 && strstr(err, "role"), "bad role");
        CHECK(chat_render(ct, &tool, 1, 1, &out, NULL, err, sizeof(err)) < 0 && strstr(err, "tool results") &&
              strstr(err, "zephyr"), "zephyr does not render tool results: %s", err);
        CHECK(chat_render(ct, msgs, 0, 1, &out, NULL, err, sizeof(err)) < 0, "no messages");
        chat_template_free(ct);
        CHECK(chat_template_create(&ct, NULL, "llama2", "<s>", "</s>", err, sizeof(err)) == 0, "llama2 by name");
        CHECK(ct && chat_render(ct, msgs, 2, 1, &out, NULL, err, sizeof(err)) < 0 && strstr(err, "alternate"),
              "llama2 refuses user,user: %s", err);
        chat_template_free(ct);
        CHECK(chat_template_create(&ct, NULL, "gemma", "", "", err, sizeof(err)) < 0 && strstr(err, "--chat-template"),
              "unknown family name");
        tokenizer_free(t);
    }
    // A token id must still be an integer: one beyond int64 is refused, naming the field.
    snprintf(path, sizeof(path), "%s/generation_config.json", dir);
    write_text_file(path, "{\"eos_token_id\": 99999999999999999999}");
    t = NULL;
    CHECK(tokenizer_load(&t, dir, err, sizeof(err)) != 0 && strstr(err, "eos_token_id"), "huge eos id: %s", err);
    tokenizer_free(t);
    snprintf(path, sizeof(path), "%s/tokenizer.json", dir); unlink(path);
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir); unlink(path);
    snprintf(path, sizeof(path), "%s/generation_config.json", dir); unlink(path);
    rmdir(dir);
}

// ---- concurrent encodes ---------------------------------------------------------------------------

static const char *THREAD_TEXTS[] = {"hello hello world", "aaa aaaa <|end|> x", "日本語のテキスト 123",
                                     "  <tool>  spaced\n\n", "emoji 👩‍👩‍👧 hello"};
#define N_THREAD_TEXTS 5

typedef struct { const Tokenizer *t; int32_t want[N_THREAD_TEXTS][128]; size_t want_n[N_THREAD_TEXTS]; int bad; } Shared;

static void *worker(void *arg) {
    Shared *sh = arg;
    char err[256];
    for (int it = 0; it < 300; it++) {
        int k = it % N_THREAD_TEXTS;
        int32_t *ids = NULL;
        size_t n = 0;
        if (tokenizer_encode(sh->t, THREAD_TEXTS[k], strlen(THREAD_TEXTS[k]), 1, &ids, &n, err, sizeof(err)) != 0 ||
            n != sh->want_n[k] || memcmp(ids, sh->want[k], n * sizeof(int32_t)) != 0)
            __atomic_store_n(&sh->bad, 1, __ATOMIC_RELAXED);
        free(ids);
    }
    return NULL;
}

static void test_threads(void) {
    // Reference answers from a separately loaded tokenizer whose cache no other thread touches.
    Tokenizer *ref = load(bytelevel_json()), *t = load(bytelevel_json());
    if (!ref || !t) { tokenizer_free(ref); tokenizer_free(t); return; }
    static Shared sh;
    sh.t = t;
    for (int k = 0; k < N_THREAD_TEXTS; k++)
        sh.want_n[k] = enc(ref, THREAD_TEXTS[k], strlen(THREAD_TEXTS[k]), 1, sh.want[k], 128);
    pthread_t th[4];
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, worker, &sh);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    CHECK(!sh.bad, "concurrent encodes disagree with the single-thread answer");
    tokenizer_free(ref);
    tokenizer_free(t);
}

int main(void) {
    test_bpe_and_added();
    test_invalid_utf8();
    test_sentencepiece_and_stream();
    test_errors();
    test_configs();
    test_threads();
    return check_exit_code("test_tokenizer");
}
