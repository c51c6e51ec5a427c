// test_rollout_guided_regex.c — structured outputs' automaton and token masks (rollout_server/guided_regex.c):
//   - the language: strings a pattern matches and does not (fullmatch, as Python's re.fullmatch), through
//     guide_text / guide_accepting, for literals, classes and their negations, '.', escapes, groups, alternation and
//     every quantifier, UTF-8 literals (a multi-byte character is one '.');
//   - token masks on a byte-level tokenizer (ids 0..255 the bytes, then merged tokens "12", "34", "345", "ab", "abc" and a
//     special "<eos>"): a token is allowed exactly when its bytes keep the text a prefix of a match, the
//     end-of-sequence id exactly where the text is a match, alone where nothing can follow; masks of more than half
//     the vocabulary come as ban lists; choices (guide_choice_regex) escape their punctuation;
//   - refusals with a message: syntax errors, unsupported constructs, oversize repeats and automata, a pattern no
//     text matches, a tokenizer that is not byte-level.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "rollout_server/guided_cache.h"
#include "rollout_server/guided_json.h"
#include "rollout_server/guided_regex.h"
#include "shared/tokenizer/tokenizer_internal.h"

enum { T12 = 256, T34, T345, TAB, TABC, TEOS, V = 263 };   // V: one id past the tokenizer's, as a model's vocabulary may be

static char *bytelevel_json(void) {
    static char buf[32768];
    char *w = buf;
    w += sprintf(w, "{\"version\":\"1.0\",\"added_tokens\":[{\"id\":%d,\"content\":\"<eos>\",\"single_word\":false,"
                    "\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":true}],\"normalizer\":null,"
                    "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,"
                    "\"use_regex\":true},\"post_processor\":null,\"decoder\":{\"type\":\"ByteLevel\"},"
                    "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"byte_fallback\":false,"
                    "\"vocab\":{", TEOS);
    for (int b = 0; b < 256; b++) {
        const unsigned cp = tok_bytelevel_char[b];
        *w++ = '"';
        if (cp == '"' || cp == '\\') *w++ = '\\';
        if (cp < 0x80) *w++ = (char)cp;
        else *w++ = (char)(0xC0 | (cp >> 6)), *w++ = (char)(0x80 | (cp & 0x3F));
        w += sprintf(w, "\":%d,", b);
    }
    w += sprintf(w, "\"12\":%d,\"34\":%d,\"345\":%d,\"ab\":%d,\"abc\":%d},\"merges\":[\"1 2\",\"3 4\",\"34 5\","
                    "\"a b\",\"ab c\"]}}", T12, T34, T345, TAB, TABC);
    return buf;
}

static Tokenizer *tok;
static const int32_t EOS = TEOS;

static Guide *compile(const char *re) {
    char err[512];
    Guide *g = NULL;
    if (guide_create(&g, re, strlen(re), tok, V, &EOS, 1, err, sizeof err) != 0) {
        CHECK(0, "/%s/ refused: %s", re, err);
        return NULL;
    }
    return g;
}

static int matches(const Guide *g, const char *s) {
    const int st = guide_text(g, guide_start(g), s, strlen(s));
    return st >= 0 && guide_accepting(g, st);
}

static void language(const char *re, const char *const *yes, const char *const *no) {
    Guide *g = compile(re);
    if (!g) return;
    for (int i = 0; yes[i]; i++) CHECK(matches(g, yes[i]), "/%s/ must match '%s'", re, yes[i]);
    for (int i = 0; no[i]; i++) CHECK(!matches(g, no[i]), "/%s/ must not match '%s'", re, no[i]);
    guide_free(g);
}

static void test_languages(void) {
#define L(re, ...) language(re, (const char *const[]){__VA_ARGS__}, NO)
    const char *const *NO;
    NO = (const char *const[]){"", "12", "1234", "abc", "12a", NULL};
    L("[0-9]{3}", "123", "000", NULL);
    NO = (const char *const[]){"", "01", "1.", "-", ".5", "--1", "1e5", NULL};
    L("-?(0|[1-9][0-9]*)(\\.[0-9]+)?", "0", "-12.5", "7", "10.01", NULL);
    NO = (const char *const[]){"yes ", "Yes", "maybe", "", NULL};
    L("yes|no|maybe so", "yes", "no", "maybe so", NULL);
    NO = (const char *const[]){"a\nb", "ab", "a12b", NULL};
    L("a.b", "a-b", "a b", "a\xc3\xa9" "b", "a\xe2\x82\xac" "b", NULL);   // é and € are one character each
    NO = (const char *const[]){"\"ab", "\"a\"b\"", NULL};
    L("\"[^\"]*\"", "\"\"", "\"ab c\"", "\"\xc3\xa9t\xc3\xa9\"", NULL);
    NO = (const char *const[]){"x", "xxxxx", "", NULL};
    L("x{2,4}", "xx", "xxx", "xxxx", NULL);
    NO = (const char *const[]){"", NULL};
    L("(?:ab)+c*?|\\d\\s\\w", "ab", "ababcc", "1 _", "9\tZ", NULL);
    NO = (const char *const[]){"a", NULL};
    L("^a{0}b?$", "", "b", NULL);
    NO = (const char *const[]){"{", "a{", NULL};
    L("a{,2}", "", "a", "aa", NULL);
    NO = (const char *const[]){"ab", NULL};
    L("a\\{b\\}|\\x41\\u00e9\\.", "a{b}", "A\xc3\xa9.", NULL);
    NO = (const char *const[]){"5", "a", NULL};
    L("[^0-9a-f]\\D", " x", "\xc3\xa9-", "zz", NULL);
#undef L
}

// The ids of a mask as a set (allowed), whatever form it takes.
static void allowed_set(const Guide *g, int s, unsigned char *out) {
    const int32_t *ids;
    int n, ban;
    guide_mask(g, s, &ids, &n, &ban);
    memset(out, ban, V);
    for (int i = 0; i < n; i++) out[ids[i]] = !ban;
}

static void test_masks(void) {
    Guide *g = compile("[0-9]{3}");
    if (!g) return;
    unsigned char a[V];
    allowed_set(g, guide_start(g), a);
    for (int id = 0; id < V; id++) {
        const int want = (id >= '0' && id <= '9') || id == T12 || id == T34 || id == T345;
        CHECK(a[id] == want, "[0-9]{3} at the start: id %d %s", id, want ? "must be allowed" : "must not be");
    }
    int s = guide_advance(g, guide_start(g), T12);   // "12": one digit left, "12" and "345" no longer fit
    allowed_set(g, s, a);
    CHECK(a['5'] && !a[T12] && !a[T34] && !a[T345] && !a[TEOS], "after '12'");
    s = guide_advance(g, s, '7');
    allowed_set(g, s, a);
    int n_allowed = 0;
    for (int id = 0; id < V; id++) n_allowed += a[id];
    CHECK(s >= 0 && a[TEOS] && n_allowed == 1, "after '127' only the end of sequence: %d ids", n_allowed);
    CHECK(guide_advance(g, s, TEOS) == -1 && guide_advance(g, guide_start(g), TAB) == -1, "leaving the language");
    CHECK(guide_state_after(g, (const int32_t[]){'1', T12}, 2) == s, "state after ids");
    guide_free(g);

    // A choice: its punctuation escaped, a choice that is a prefix of another one ends there or goes on.
    const char *ch[] = {"abc", "ab", "a.b(c)"};
    const size_t lens[] = {3, 2, 6};
    size_t rl;
    char *re = guide_choice_regex(ch, lens, 3, &rl);
    CHECK(re && strcmp(re, "abc|ab|a\\.b\\(c\\)") == 0, "choice regex '%s'", re ? re : "(null)");
    g = compile(re);
    free(re);
    if (!g) return;
    allowed_set(g, guide_start(g), a);
    CHECK(a['a'] && a[TAB] && a[TABC] && !a['b'] && !a[TEOS], "choice start");
    s = guide_advance(g, guide_start(g), TAB);
    allowed_set(g, s, a);
    CHECK(a['c'] && a[TEOS] && !a['.'] && !a[TAB], "after 'ab': 'c' or the end");
    CHECK(matches(g, "a.b(c)") && !matches(g, "aXb(c)"), "the escaped choice is literal");
    guide_free(g);

    // Most of the vocabulary allowed: the mask lists the banned ids (the special token, and '\n' for '.').
    g = compile(".*");
    if (!g) return;
    const int32_t *ids;
    int n, ban;
    guide_mask(g, guide_start(g), &ids, &n, &ban);
    allowed_set(g, guide_start(g), a);
    CHECK(ban && n < V / 2 && !a['\n'] && a['x'] && a[TEOS] && !a[V - 1], ".* mask: ban list of %d, eos allowed", n);
    guide_free(g);
}

static void refused(const char *re, const char *why) {
    char err[512] = "";
    Guide *g = NULL;
    const int rc = guide_create(&g, re, strlen(re), tok, V, &EOS, 1, err, sizeof err);
    CHECK(rc != 0 && strstr(err, why), "/%s/: rc %d, message '%s' (wanted '%s')", re, rc, err, why);
    guide_free(g);
}

static void test_refusals(void) {
    refused("(ab", "missing ')'");
    refused("ab)", "unmatched ')'");
    refused("a{3,1}", "maximum below");
    refused("(?=a)b", "only (?:...) groups");
    refused("(a)\\1", "backreferences");
    refused("[\xc3\xa9]", "non-ASCII");
    refused("a{1001}", "repeats above 1000");
    refused("*a", "repeats nothing");
    refused("a\\b", "anchor");
    refused("[a-", "unterminated");
    refused("[ab]*a[ab]{12}", "automaton states");   // 2^13 subsets: past GUIDED_MAX_STATES
    refused("a|(b", "missing ')'");
    Tokenizer *fused = NULL;
    char err[512];
    const char *json = "{\"version\":\"1.0\",\"added_tokens\":[],\"normalizer\":null,\"pre_tokenizer\":null,"
                       "\"post_processor\":null,\"decoder\":{\"type\":\"Fuse\"},\"model\":{\"type\":\"BPE\","
                       "\"dropout\":null,\"unk_token\":null,\"vocab\":{\"a\":0,\"b\":1},\"merges\":[]}}";
    if (tokenizer_load_json(&fused, json, strlen(json), err, sizeof err) == 0) {
        Guide *g = NULL;
        CHECK(guide_create(&g, "a+", 2, fused, 2, &EOS, 0, err, sizeof err) != 0 && strstr(err, "byte-level"),
              "a tokenizer without byte-level tokens must be refused: %s", err);
        tokenizer_free(fused);
    } else {
        CHECK(0, "the Fuse tokenizer did not load: %s", err);
    }
}

// JSON schemas as regexes (guided_json.c): what json.dumps writes for valid values matches, invalid values do not;
// keywords that would let forbidden values through are refused by name.
static void schema_case(const char *schema_text, const char *const *yes, const char *const *no) {
    json_error_t je;
    json_t *s = json_loads(schema_text, 0, &je);
    REQUIRE(s, "schema %s: %s", schema_text, je.text);
    char err[512];
    size_t len;
    char *re = guide_json_schema_regex(s, &len, err, sizeof err);
    json_decref(s);
    CHECK(re, "schema %s: %s", schema_text, err);
    if (!re) return;
    Guide *g = compile(re);
    free(re);
    if (!g) return;
    for (int i = 0; yes[i]; i++) CHECK(matches(g, yes[i]), "%s must take %s", schema_text, yes[i]);
    for (int i = 0; no[i]; i++) CHECK(!matches(g, no[i]), "%s must not take %s", schema_text, no[i]);
    guide_free(g);
}

static void test_json_schemas(void) {
#define S(schema, ...) schema_case(schema, (const char *const[]){__VA_ARGS__}, NO)
    const char *const *NO;
    NO = (const char *const[]){"{\"n\": \"x\", \"a\": 1}", "{\"a\": 1, \"n\": \"x\"}", "{\"n\": \"x\", \"a\": 1.5}",
                               "{\"n\": \"x\"}", NULL};
    S("{\"type\": \"object\", \"properties\": {\"n\": {\"type\": \"string\"}, \"a\": {\"type\": \"integer\"}, "
      "\"b\": {\"type\": \"boolean\"}}, \"required\": [\"n\"]}",
      "{\"n\": \"x\", \"a\": -12, \"b\": true}", "{\"n\": \"q\\\"\\\\\\u00e9\", \"a\": 0, \"b\": false}", NULL);
    NO = (const char *const[]){"[]", "[1, 2, 3, 4]", "[1,2]", "[1.5]", NULL};
    S("{\"type\": \"array\", \"items\": {\"type\": \"integer\"}, \"minItems\": 1, \"maxItems\": 3}", "[1]", "[1, 2, 3]", NULL);
    NO = (const char *const[]){"\"blue\"", "4", "null ", NULL};
    S("{\"enum\": [\"red\", 3, null, true]}", "\"red\"", "3", "null", "true", NULL);
    NO = (const char *const[]){"\"\"", "\"abcd\"", "1", NULL};
    S("{\"anyOf\": [{\"type\": \"string\", \"minLength\": 1, \"maxLength\": 3}, {\"type\": \"null\"}]}", "\"a\"",
      "\"abc\"", "null", NULL);
    NO = (const char *const[]){"1e", "01", "-", NULL};
    S("{\"type\": [\"number\", \"null\"]}", "1.5e-3", "-0", "null", "42", NULL);
#undef S
    static const char *const bad[][2] = {{"{\"type\": \"integer\", \"minimum\": 0}", "'minimum'"},
                                         {"{\"type\": \"string\", \"pattern\": \"a\"}", "'pattern'"},
                                         {"{\"oneOf\": [{\"type\": \"null\"}]}", "'oneOf'"},
                                         {"{\"type\": \"array\"}", "'items'"},
                                         {"{\"type\": \"object\", \"properties\": {}, \"required\": [\"x\"]}", "required"},
                                         {"{\"type\": \"date\"}", "not a JSON schema type"},
                                         {"{}", "needs 'type'"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *s = json_loads(bad[i][0], 0, NULL);
        char err[512] = "";
        size_t len;
        char *re = guide_json_schema_regex(s, &len, err, sizeof err);
        CHECK(!re && strstr(err, bad[i][1]), "%s: '%s' (wanted '%s')", bad[i][0], err, bad[i][1]);
        free(re);
        json_decref(s);
    }
}

// The engine's cache: one compilation per pattern while held or kept; more patterns than it keeps evict the least
// recently used unheld one; with every entry held a new pattern still compiles (the request's own guide).
static void test_cache(void) {
    GuideCache c;
    guide_cache_init(&c);
    char err[512];
    Guide *a, *b, *x;
    CHECK(guide_cache_get(&c, "[0-9]+", 6, tok, V, &EOS, 1, &a, err, sizeof err) == 0, "%s", err);
    CHECK(guide_cache_get(&c, "[0-9]+", 6, tok, V, &EOS, 1, &b, err, sizeof err) == 0 && a == b,
          "the same pattern must share its guide");
    CHECK(c.compiled == 1 && c.reused == 1, "compiled %lld, reused %lld", (long long)c.compiled, (long long)c.reused);
    CHECK(guide_cache_get(&c, "(a", 2, tok, V, &EOS, 1, &x, err, sizeof err) != 0 && !x && strstr(err, "missing"),
          "a bad pattern: %s", err);
    guide_cache_put(&c, a);
    guide_cache_put(&c, b);
    Guide *held[GUIDE_CACHE_SIZE];
    char pat[GUIDE_CACHE_SIZE][16];
    for (int i = 0; i < GUIDE_CACHE_SIZE; i++) {   // fills the cache (evicting "[0-9]+", now unheld) and holds all
        snprintf(pat[i], sizeof pat[i], "x{%d}", i + 1);
        CHECK(guide_cache_get(&c, pat[i], strlen(pat[i]), tok, V, &EOS, 1, &held[i], err, sizeof err) == 0, "%s", err);
    }
    Guide *own;
    CHECK(guide_cache_get(&c, "[0-9]+", 6, tok, V, &EOS, 1, &own, err, sizeof err) == 0 && c.compiled == 2 +
          GUIDE_CACHE_SIZE, "a full, held cache still compiles: %lld compilations", (long long)c.compiled);
    guide_cache_put(&c, own);   // freed: not kept
    for (int i = 0; i < GUIDE_CACHE_SIZE; i++) guide_cache_put(&c, held[i]);
    guide_cache_destroy(&c);
}

int main(void) {
    char err[512];
    const char *json = bytelevel_json();
    REQUIRE(tokenizer_load_json(&tok, json, strlen(json), err, sizeof err) == 0, "%s", err);
    test_languages();
    test_masks();
    test_refusals();
    test_json_schemas();
    test_cache();
    tokenizer_free(tok);
    return check_exit_code("test_rollout_guided_regex");
}
