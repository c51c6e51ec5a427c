// shared/tokenizer/tokenizer_internal.h — data structures shared by the tokenizer_*.c files (not a public API).
//
// The pipeline mirrors HF tokenizers step by step so each stage can be checked against its Rust twin:
//   text -> added-token split (raw) -> per segment: normalizer -> added-token split (normalized)
//        -> pre-tokenizers (depth first, one scratch level each) -> BPE word -> ids -> post-processor.
#ifndef TANDEM_SHARED_TOKENIZER_INTERNAL_H
#define TANDEM_SHARED_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "shared/tokenizer/tokenizer.h"

// ---- small growable buffers -----------------------------------------------------------------------

typedef struct { char *p; size_t n, cap; } TokBuf;        // bytes
typedef struct { int32_t *p; size_t n, cap; } TokIds;     // token ids

int tok_buf_reserve(TokBuf *b, size_t extra);
int tok_buf_append(TokBuf *b, const void *src, size_t len);
void tok_buf_free(TokBuf *b);
int tok_ids_push(TokIds *v, int32_t id);
int tok_ids_append(TokIds *v, const int32_t *ids, size_t n);
void tok_ids_free(TokIds *v);

// Whole file into a malloc'd NUL-terminated buffer (NULL on any failure; errno tells why).
char *tok_read_file(const char *path, size_t *len);

void tok_set_err(char *err, size_t err_len, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

// ---- UTF-8 ---------------------------------------------------------------------------------------

// Decodes one code point of valid UTF-8 at s (n bytes available); returns its byte length (>= 1).
int tok_utf8_decode(const char *s, size_t n, uint32_t *cp);
int tok_utf8_encode(uint32_t cp, char *out);                 // returns 1..4
size_t tok_utf8_char_len(const char *s, size_t n);            // length of the char at s (1 if at end)
// Length of the longest prefix of s that is valid UTF-8 (whole string valid iff == n).
size_t tok_utf8_valid_prefix(const char *s, size_t n);
// Appends s to out replacing invalid subsequences by U+FFFD (maximal subpart rule).
int tok_utf8_lossy_append(TokBuf *out, const char *s, size_t n);
// White_Space property (what Rust's \s and Oniguruma's \s match).
int tok_is_white_space(uint32_t cp);
// Rust regex \w: alphabetic, marks, decimal digits, connector punctuation, join controls.
int tok_is_word_char(uint32_t cp);
// Rust char::is_numeric: general category Nd, Nl or No.
int tok_is_numeric(uint32_t cp);

// ---- string -> id map (open addressing; keys point into memory owned elsewhere) ------------------

typedef struct { const char *key; uint32_t len; uint32_t hash; int32_t val; } TokStrEntry;
typedef struct {
    TokStrEntry *e;      // (n) entries in insertion order
    uint32_t n, e_cap;
    uint32_t *slot;      // (mask + 1) entry index + 1, 0 = empty
    uint32_t mask;
} TokStrMap;

uint32_t tok_hash_bytes(const char *s, size_t len);
// Inserts or overwrites key -> val. The key bytes must outlive the map.
int tok_strmap_put(TokStrMap *m, const char *key, uint32_t len, int32_t val);
int32_t tok_strmap_get(const TokStrMap *m, const char *key, size_t len);   // -1 when absent
void tok_strmap_free(TokStrMap *m);

// ---- (left id, right id) -> (rank, merged id) ----------------------------------------------------

typedef struct { uint64_t key; uint32_t rank; int32_t new_id; } TokMergeEntry;
typedef struct { TokMergeEntry *slot; uint32_t mask, n; } TokMergeMap;   // empty slot: rank == UINT32_MAX

int tok_mergemap_put(TokMergeMap *m, int32_t a, int32_t b, uint32_t rank, int32_t new_id);
const TokMergeEntry *tok_mergemap_get(const TokMergeMap *m, int32_t a, int32_t b);
void tok_mergemap_free(TokMergeMap *m);

// ---- patterns (Split / Replace): literal strings or PCRE2 regexes --------------------------------

typedef struct { size_t start, end; int is_match; } TokSpan;
typedef struct { TokSpan *p; size_t n, cap; } TokSpans;

typedef struct {
    char *src;            // pattern as written in tokenizer.json (literal text or regex)
    size_t src_len;
    int literal;          // 1: String pattern (matched as plain bytes when non-empty)
    pcre2_code *re;       // compiled regex (also for an empty literal, which matches everywhere)
} TokPattern;

// Per-call regex scratch: match data and a JIT stack grown on demand. Owned by one thread.
typedef struct {
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit_stack;
} TokRegexScratch;

// Compiles `src` (a regex in Oniguruma syntax, as HF writes them, or a literal when literal=1).
int tok_pattern_compile(TokPattern *p, const char *src, size_t len, int literal, const char *field,
                        char *err, size_t err_len);
void tok_pattern_free(TokPattern *p);
// HF Pattern::find_matches: spans covering [0, len) in order, matches flagged (empty input -> one
// empty non-match span). Empty matches follow Oniguruma's find_iter rules.
int tok_pattern_find(const TokPattern *p, const char *s, size_t len, TokSpans *out, TokRegexScratch *rs,
                     char *err, size_t err_len);
int tok_regex_scratch_init(TokRegexScratch *rs);
void tok_regex_scratch_free(TokRegexScratch *rs);
void tok_spans_free(TokSpans *s);

// ---- pipeline components ----------------------------------------------------------------------

typedef enum { NORM_NFC, NORM_NFD, NORM_NFKC, NORM_NFKD, NORM_PREPEND, NORM_REPLACE } TokNormType;
typedef struct {
    TokNormType type;
    char *str; size_t str_len;   // Prepend: the prefix; Replace: the content
    TokPattern pat;              // Replace
} TokNormOp;

typedef enum { PRE_SPLIT, PRE_BYTELEVEL, PRE_METASPACE, PRE_DIGITS } TokPreType;
typedef enum { SPLIT_REMOVED, SPLIT_ISOLATED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT, SPLIT_CONTIGUOUS } TokSplitBehavior;
typedef enum { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER } TokPrependScheme;
typedef struct {
    TokPreType type;
    TokPattern pat;                 // Split (ByteLevel with use_regex uses the tokenizer's GPT-2 regex)
    TokSplitBehavior behavior;
    int invert;
    int add_prefix_space, use_regex; // ByteLevel
    char repl[5]; int repl_len;      // Metaspace replacement char (UTF-8)
    uint32_t repl_cp;
    TokPrependScheme prepend;        // Metaspace
    int split;                       // Metaspace
    int individual_digits;           // Digits
} TokPreOp;

typedef enum { DEC_BYTELEVEL, DEC_METASPACE, DEC_REPLACE, DEC_BYTEFALLBACK, DEC_FUSE, DEC_STRIP } TokDecType;
typedef struct {
    TokDecType type;
    TokPattern pat; char *content; size_t content_len;   // Replace
    uint32_t repl_cp; TokPrependScheme prepend;          // Metaspace
    uint32_t strip_cp; size_t strip_start, strip_stop;   // Strip
} TokDecOp;

// One TemplateProcessing "single" template: pieces are either the sequence or special ids.
typedef struct { int is_sequence; int32_t *ids; size_t n_ids; } TokTemplatePiece;
typedef struct { TokTemplatePiece *pieces; size_t n; } TokTemplate;

typedef struct {
    char *content; size_t len;          // as written
    char *norm; size_t norm_len;        // content after the normalizer (== content when unchanged)
    int32_t id;
    int single_word, lstrip, rstrip, normalized, special;
} TokAddedToken;

// Trie over added-token contents for leftmost-longest matching.
typedef struct {
    TokMergeMap edges;      // key (node, byte) -> child node in new_id, rank unused
    int32_t *terminal;      // (n_nodes) index into added[] or -1
    uint32_t n_nodes, cap_nodes;
    uint8_t first_byte[256];
} TokTrie;

// Striped word cache: word bytes -> ids. Bounded; full stripes stop inserting (as HF's cache does).
#define TOK_CACHE_STRIPES 64
typedef struct {
    pthread_mutex_t lock;
    TokStrMap map;          // word -> index into spans
    TokBuf keys;            // word bytes (never reallocated while referenced: see tokenizer_bpe.c)
    char **key_blocks; size_t n_key_blocks;
    TokIds ids;             // all cached ids back to back
    uint32_t *span_off, *span_len; size_t n_spans, cap_spans;
} TokCacheStripe;

struct Tokenizer {
    // model (BPE)
    TokStrMap vocab;                 // token -> id (keys in vocab_keys)
    char *vocab_keys;                // all vocab strings back to back
    TokMergeMap merges;
    int32_t unk_id;                  // -1: none
    char *unk_token;
    int fuse_unk, byte_fallback, ignore_merges;
    char *cont_prefix; size_t cont_prefix_len;    // continuing_subword_prefix
    char *eow_suffix; size_t eow_suffix_len;      // end_of_word_suffix
    int32_t byte_token[256];         // byte_fallback: id of "<0xHH>" or -1
    int32_t *char_id;                // (TOK_CHAR_TABLE) id of each single code point token, -1 none
    int32_t model_vocab_size;        // number of vocab entries

    // id -> token string (model vocab first, then added tokens override for decode)
    const char **id_str; uint32_t *id_len; uint8_t *id_flags;   // (n_ids) flags: TOK_ID_* below
    int32_t n_ids;

    // Streaming fast path (tokenizer_stream.c), built at load when the decoder chain is exactly ByteLevel
    // (GPT-2, Llama 3, Qwen2): the bytes each id contributes to a decode, so a stream step appends bytes
    // instead of re-running the decoder. NULL for every other decoder chain.
    char *stream_bytes;              // all ids' bytes back to back
    uint32_t *stream_off;            // (n_ids + 1) id i's bytes: stream_bytes[stream_off[i] .. stream_off[i+1])

    TokAddedToken *added; size_t n_added;
    TokStrMap added_map;             // content -> id
    TokStrMap special_set;           // contents of special added tokens
    TokTrie trie_raw, trie_norm;     // non-normalized / normalized added tokens

    TokNormOp *norm; size_t n_norm;
    TokPreOp *pre; size_t n_pre;
    TokDecOp *dec; size_t n_dec; int has_decoder;
    TokTemplate *post; size_t n_post;   // templates applied in order when add_special_tokens

    // tokenizer_config.json / generation_config.json
    int32_t bos_id, pad_id;
    int32_t *eos_ids; size_t n_eos;
    int add_bos_token;               // -1 unknown
    char *bos_token, *eos_token, *chat_template;

    int nul_keys;                    // while loading: vocab keys spell U+0000 as U+FDD0 (see tokenizer_load.c)

    TokCacheStripe cache[TOK_CACHE_STRIPES];
    size_t cache_stripe_cap;         // entries per stripe
};

#define TOK_ID_ADDED 1               // id_flags: an added token
#define TOK_ID_SPECIAL 2             // id_flags: an added token flagged special
#define TOK_ID_SKIPPED 4             // id_flags: its string is a special token's (skip_special_tokens drops it)

#define TOK_CHAR_TABLE 0x3000        // code points below this get a direct symbol table
#define TOK_MAX_PRE 16               // pre-tokenizers after flattening Sequences

// ---- functions implemented across files -----------------------------------------------------------

// tokenizer_load_pipeline.c: parse normalizer / pre_tokenizer / decoder / post_processor JSON.
struct json_t;
int tok_parse_normalizer(Tokenizer *t, struct json_t *j, char *err, size_t err_len);
int tok_parse_pre_tokenizer(Tokenizer *t, struct json_t *j, char *err, size_t err_len);
int tok_parse_decoder(Tokenizer *t, struct json_t *j, char *err, size_t err_len);
int tok_parse_post_processor(Tokenizer *t, struct json_t *j, char *err, size_t err_len);
void tok_free_pipeline(Tokenizer *t);
// tokenizer_config.c
int tok_load_configs(Tokenizer *t, const char *dir, char *err, size_t err_len);
void tok_free_configs(Tokenizer *t);

// tokenizer_normalize.c: applies the normalizer chain to text (valid UTF-8) into out.
int tok_normalize(const Tokenizer *t, const char *s, size_t len, TokBuf *out, TokRegexScratch *rs,
                  char *err, size_t err_len);

// tokenizer_added.c
int tok_trie_build(TokTrie *tr, const Tokenizer *t, int normalized_set);
void tok_trie_free(TokTrie *tr);
// Splits s into spans: is_match = 1 + index into t->added for a token, 0 for text (find_matches of
// AddedVocabulary, with lstrip/rstrip/single_word applied).
int tok_added_split(const Tokenizer *t, const TokTrie *tr, const char *s, size_t len, TokSpans *out);

// tokenizer_bpe.c: appends the ids of one pre-tokenized word.
typedef struct TokEncodeCtx TokEncodeCtx;
int tok_bpe_word(const Tokenizer *t, TokEncodeCtx *ctx, const char *w, size_t len, TokIds *out,
                 char *err, size_t err_len);
int tok_cache_init(Tokenizer *t);
void tok_cache_free(Tokenizer *t);

// tokenizer_pretok.c: runs the pre-tokenizers on one normalized segment and BPE-encodes each piece.
int tok_pretokenize_and_encode(const Tokenizer *t, TokEncodeCtx *ctx, const char *s, size_t len,
                               int at_origin, TokIds *out, char *err, size_t err_len);

// Per-call encode scratch (one per tokenizer_encode call; never shared between threads).
struct TokEncodeCtx {
    TokRegexScratch rs;
    TokBuf level_buf[2 * (TOK_MAX_PRE + 1)];   // two text buffers per pre-tokenizer level
    TokSpans level_spans[TOK_MAX_PRE + 1];
    TokBuf norm;                    // the normalized segment
    TokSpans raw_spans, norm_spans; // added-token splits
    TokBuf word;                    // BPE scratch: prefixed/suffixed character strings
    // BPE symbols of the word being merged: (n) id, byte length (0 = merged away), linked list
    int32_t *sym_id, *sym_prev, *sym_next; uint32_t *sym_len; size_t sym_cap;
    uint64_t *heap; size_t heap_cap;   // merge queue storage (tokenizer_bpe.c's HeapItem), in 8-byte units
};

// ByteLevel tables (tokenizer_decode.c).
extern const uint16_t tok_bytelevel_char[256];   // byte -> code point
int tok_bytelevel_byte(uint32_t cp);             // code point -> byte, or -1
// The bytes the ByteLevel decoder makes of one token string (n bytes of UTF-8): each character mapped back
// to its byte, or the string itself when a character is outside the byte alphabet. Writes at most n bytes
// to out; returns how many.
size_t tok_bytelevel_token(const char *s, size_t n, char *out);

// tokenizer_stream.c
// Builds stream_bytes / stream_off and the TOK_ID_SKIPPED flags (after the id table and the decoder).
int tok_stream_prepare(Tokenizer *t);
// A stream that always re-decodes its window through tokenizer_decode, as HF's step_decode_stream does: the
// reference the ByteLevel fast path is tested and benchmarked against.
int tok_stream_create_reference(TokenizerStream **out, const Tokenizer *tok, int skip_special_tokens,
                                char *err, size_t err_len);
int tok_stream_is_fast(const TokenizerStream *st);   // 1 when st runs the ByteLevel fast path

#endif
