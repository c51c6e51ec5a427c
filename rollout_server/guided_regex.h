// rollout_server/guided_regex.h — structured outputs (vLLM's structured_outputs regex / choice): a regular
// expression compiled to a deterministic automaton over UTF-8 bytes, and from it, for each automaton state, the
// token ids that keep the generated text a prefix of a match (the token-mask automaton of outlines / llguidance,
// read for the idea; written here).
//
// The regex is Python's `re` syntax with fullmatch semantics (the whole completion must match), in this subset:
// literals and escapes (\n \t \r \f \v \\ \. and the other punctuation, \d \D \w \W \s \S, \xHH, \uHHHH), '.' (any
// character but a newline), classes [...] and [^...] with ranges (members ASCII, or escapes; the negated ones and
// '.' match any non-ASCII character too), groups (...) and (?:...), alternation |, quantifiers * + ? {n} {n,} {n,m}
// (a lazy '?' after them changes nothing for a fullmatch), and ^ / $ at the ends (a fullmatch is anchored anyway).
// Refused with a message naming the construct: backreferences, lookarounds, named groups, flags, non-ASCII class
// members, an automaton past GUIDED_MAX_STATES states.
//
// A token's bytes come from tokenizer_token_bytes (byte-level BPE tokenizers: GPT-2, Llama 3, Qwen); other
// tokenizers are refused. Special tokens never match text; the end-of-sequence ids are allowed exactly where the
// text so far is a whole match, and where nothing else can follow they are all that is allowed.
#ifndef TANDEM_ROLLOUT_GUIDED_REGEX_H
#define TANDEM_ROLLOUT_GUIDED_REGEX_H

#include <stddef.h>
#include <stdint.h>

#include "shared/tokenizer/tokenizer.h"

#define GUIDED_MAX_STATES 4096

typedef struct Guide Guide;

// Compiles pattern (len bytes) for a vocabulary of V ids (tok's, the model's V >= the tokenizer's) with the given
// end-of-sequence ids. Returns 0, or -1 with a message (syntax, unsupported construct, a regex no text matches, a
// tokenizer whose tokens have no fixed bytes).
int guide_create(Guide **out, const char *pattern, size_t len, const Tokenizer *tok, int V, const int32_t *eos,
                 int n_eos, char *err, size_t err_len);
// The regex of a choice among strings (vLLM's structured_outputs choice): it matches exactly one of them (each
// escaped). malloc'd (*len bytes, NUL-terminated); NULL when out of memory.
char *guide_choice_regex(const char *const *choices, const size_t *lens, int n, size_t *len);
// 1 when byte c is written with a backslash in front inside a literal: every ASCII character but letters, digits
// and '_' (the JSON schema's enum and const values are escaped the same way).
int guide_regex_escapes(unsigned char c);
void guide_free(Guide *g);

// The automaton's start state.
int guide_start(const Guide *g);
// What state s allows, ascending ids (*n of them; made at guide_create, read-only after: any thread): the allowed
// ids (*ban 0), or, where more than half of the vocabulary is allowed, the ids not allowed (*ban 1), so that no
// mask holds more than V / 2 ids. s -1 (past a complete match, or an id the mask did not allow) allows the
// end-of-sequence ids only.
void guide_mask(const Guide *g, int s, const int32_t **ids, int *n, int *ban);
// The most ids any state's mask holds (the room a mask needs).
int guide_max_mask(const Guide *g);
// The state after token id in state s: -1 when id is an end-of-sequence id (the match is complete) or not allowed.
int guide_advance(const Guide *g, int s, int32_t id);
// The state after the ids (n) from the start state; -1 as above.
int guide_state_after(const Guide *g, const int32_t *ids, int n);
// The state after the bytes text (n) from state s: -1 when no match can continue them.
int guide_text(const Guide *g, int s, const char *text, size_t n);
// 1 when the text that led to state s is a whole match.
int guide_accepting(const Guide *g, int s);
// Automaton states made (for tests and logs).
int guide_num_states(const Guide *g);

#endif
