// shared/tokenizer/tokenizer.h — Hugging Face compatible tokenizer (tokenizer.json) with no Python at run time.
//
// What is supported (anything else in a tokenizer.json is a load error naming the field):
//   model          BPE: vocab, merges as "a b" strings or ["a","b"] pairs, ignore_merges, byte_fallback
//                  (<0xNN> tokens), unk_token / fuse_unk, continuing_subword_prefix, end_of_word_suffix.
//   normalizer     NFC, NFD, NFKC, NFKD (utf8proc), Prepend, Replace (string or regex), Sequence.
//   pre_tokenizer  Split (regex or string; every behavior; invert), ByteLevel (add_prefix_space, use_regex),
//                  Metaspace (prepend_scheme always/first/never, split), Digits, Sequence.
//   added tokens   matched before the model, leftmost-longest, with lstrip/rstrip/single_word/normalized/special.
//   post_processor TemplateProcessing, ByteLevel, Sequence (honouring add_special_tokens).
//   decoder        ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence.
// Regexes run on PCRE2 (UTF + UCP, JIT) after translating the few Oniguruma spellings that differ.
//
// Results equal the Rust `tokenizers` library (the engine behind transformers' fast tokenizers): same ids
// from encode, same text from decode, same chunks from the streaming decoder. Input text that is not valid
// UTF-8 is first repaired the way Python's bytes.decode("utf-8", "replace") does (each maximal invalid
// subsequence becomes U+FFFD), which is what a Python caller would have to do before calling HF.
//
// Thread safety: a loaded Tokenizer is immutable except for its word cache, which is guarded by striped
// mutexes, so any number of threads may encode and decode concurrently. A TokenizerStream belongs to one
// thread at a time.
//
// Errors: every function returning int gives 0 on success or a negative TOK_E* code and writes a message
// into err (when err is not NULL). Nothing here exits or aborts.
#ifndef TANDEM_SHARED_TOKENIZER_H
#define TANDEM_SHARED_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    TOK_OK = 0,
    TOK_EIO = -1,        // file missing or unreadable
    TOK_EFORMAT = -2,    // malformed or unsupported tokenizer.json / config content
    TOK_ENOMEM = -3,
    TOK_EINVAL = -4,     // bad argument (NULL pointer, id out of range, ...)
    TOK_EREGEX = -5,     // regex failed to compile or to run
    TOK_EUNK = -6,       // the model needs its unk_token but the vocab lacks it
};

typedef struct Tokenizer Tokenizer;

// Loads a tokenizer. `path` is either a model folder (reads tokenizer.json, and when present
// tokenizer_config.json and generation_config.json) or the path of a tokenizer.json file.
int tokenizer_load(Tokenizer **out, const char *path, char *err, size_t err_len);
// Loads from tokenizer.json text held in memory (no config files). `len` bytes, need not be NUL-terminated.
int tokenizer_load_json(Tokenizer **out, const char *json, size_t len, char *err, size_t err_len);
void tokenizer_free(Tokenizer *tok);

// Encodes `len` bytes of text. add_special_tokens applies the post-processor (e.g. a leading BOS), exactly
// as HF's encode(text, add_special_tokens=...). *ids is malloc'd (caller frees); *n_ids its length.
int tokenizer_encode(const Tokenizer *tok, const char *text, size_t len, int add_special_tokens,
                     int32_t **ids, size_t *n_ids, char *err, size_t err_len);
// Decodes ids to text (malloc'd, NUL-terminated, valid UTF-8; *len excludes the NUL). Unknown ids are
// skipped, as HF does. skip_special_tokens drops added tokens marked special.
int tokenizer_decode(const Tokenizer *tok, const int32_t *ids, size_t n, int skip_special_tokens,
                     char **text, size_t *len, char *err, size_t err_len);

// ---- vocabulary ---------------------------------------------------------------------------------
// One past the largest id of the model vocab and the added tokens (the embedding rows a model needs).
int32_t tokenizer_vocab_size(const Tokenizer *tok);
// Id of a token string (added tokens first, then the model vocab); -1 when unknown.
int32_t tokenizer_token_to_id(const Tokenizer *tok, const char *token, size_t len);
// Token string of an id (not NUL-terminated: *len gives its length); NULL when the id is unknown.
const char *tokenizer_id_to_token(const Tokenizer *tok, int32_t id, size_t *len);
// The bytes id stands for in any text, when the decoder is ByteLevel alone (GPT-2, Llama 3, Qwen: a token's bytes
// do not depend on its neighbours): *bytes (not NUL-terminated, *len of them) valid while the tokenizer lives.
// Returns 0; -1 for an unknown id or a special token (no text of its own); -2 when the decoder is another one
// (SentencePiece's Metaspace and byte fallback spell a token differently at the start of a text).
int tokenizer_token_bytes(const Tokenizer *tok, int32_t id, const char **bytes, size_t *len);
// 1 when id is an added token flagged special (what skip_special_tokens removes).
int tokenizer_is_special(const Tokenizer *tok, int32_t id);

// ---- special ids from tokenizer_config.json / generation_config.json -----------------------------
// -1 when not configured. eos may be several ids (generation_config's eos_token_id list first, then the
// tokenizer_config eos_token when not already listed); tokenizer_eos_ids returns how many and fills at
// most `cap` of them into ids (ids may be NULL to query the count).
int32_t tokenizer_bos_id(const Tokenizer *tok);
int32_t tokenizer_pad_id(const Tokenizer *tok);
int32_t tokenizer_eos_id(const Tokenizer *tok);  // first of the eos list, or -1
size_t tokenizer_eos_ids(const Tokenizer *tok, int32_t *ids, size_t cap);
int tokenizer_is_eos(const Tokenizer *tok, int32_t id);
// tokenizer_config.json's add_bos_token (-1 when the file does not say). Informational: as in
// transformers 5, what encode(add_special_tokens=1) adds is decided by tokenizer.json's post-processor.
int tokenizer_add_bos_token(const Tokenizer *tok);
// Strings for chat templates: tokenizer_config's bos_token / eos_token ("" when absent), and its
// chat_template (or chat_template.jinja next to it); NULL when the folder has none.
const char *tokenizer_bos_token(const Tokenizer *tok);
const char *tokenizer_eos_token(const Tokenizer *tok);
const char *tokenizer_chat_template(const Tokenizer *tok);

// ---- streaming decode ---------------------------------------------------------------------------
// Feeds ids one at a time and returns the text they complete. Text that ends in an incomplete UTF-8
// sequence is held back until the sequence completes, so a chunk never ends with a replacement character
// that a later id would have turned into a real character. The chunks equal HF's DecodeStream.step
// results; their concatenation plus tokenizer_stream_flush equals tokenizer_decode of all the ids.
typedef struct TokenizerStream TokenizerStream;
int tokenizer_stream_create(TokenizerStream **out, const Tokenizer *tok, int skip_special_tokens,
                            char *err, size_t err_len);
void tokenizer_stream_free(TokenizerStream *st);
// *text (malloc'd, NUL-terminated) receives the new text, or NULL when this id completes nothing yet.
int tokenizer_stream_step(TokenizerStream *st, int32_t id, char **text, size_t *len, char *err, size_t err_len);
// Returns whatever is still held back (possibly ending in U+FFFD) and resets the stream. *text may be NULL.
int tokenizer_stream_flush(TokenizerStream *st, char **text, size_t *len, char *err, size_t err_len);

// ---- UTF-8 helper shared with callers -----------------------------------------------------------
// Replaces every maximal invalid UTF-8 subsequence with U+FFFD (Python's errors="replace", Rust's
// from_utf8_lossy). Returns a malloc'd NUL-terminated copy (NULL on out of memory); *out_len its length.
char *tokenizer_utf8_repair(const char *s, size_t len, size_t *out_len);

#ifdef __cplusplus
}
#endif
#endif
