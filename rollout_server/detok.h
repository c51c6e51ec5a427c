// rollout_server/detok.h — one completion's text and stop conditions, fed one sampled token at a time.
//
// Stop conditions, checked in this order on every token once min_tokens tokens were generated (vLLM):
//   - a stop token id, or an eos id unless ignore_eos: the completion ends (FINISH_STOP, stop_token set). The
//     token stays in the completion's tokens and logprobs (as vLLM reports it) but its text is not added,
//     unless include_stop_str asks for the stop to be kept in the text.
//   - a stop string in the text: the text ends just before it (or after it with include_stop_str). A match must
//     end in text that tokens after the first min_tokens added (vLLM's stop-check offset): the text of those is
//     not searched, except as the start of a match.
// Text comes from the tokenizer's streaming decoder (incomplete UTF-8 is held back there). On top of that, any
// suffix of the not-yet-emitted text that could still be the start of a stop string is held back until the
// next tokens decide. When the completion ends for any reason, everything held back is flushed (re-checked
// for stop strings first).
// Without a tokenizer there is no text: only the token-id conditions apply.
#ifndef TANDEM_ROLLOUT_DETOK_H
#define TANDEM_ROLLOUT_DETOK_H

#include <stddef.h>
#include <stdint.h>

#include "rollout_server/engine.h"
#include "shared/tokenizer/tokenizer.h"

// A growable byte buffer (grows by doubling; never shrinks, so steady state allocates nothing).
typedef struct {
    char *data;
    size_t len, cap;
} TextBuf;

int textbuf_append(TextBuf *b, const char *s, size_t n);
void textbuf_free(TextBuf *b);

typedef struct {
    const Tokenizer *tok;        // NULL: no text
    TokenizerStream *stream;
    const SamplingParams *p;     // the request's parameters (stop strings, stop ids, ignore_eos, ...)
    const int32_t *eos_ids;      // the model's eos ids (not owned)
    int n_eos;
    TextBuf held;                // decoded text not emitted yet (might start a stop string)
    size_t max_stop_len;
    size_t protect;              // no stop string may end within the first `protect` held bytes (min_tokens)
    int n_tokens;                // tokens fed so far
    int finished;
} Detok;

int detok_init(Detok *d, const Tokenizer *tok, const SamplingParams *p, const int32_t *eos_ids, int n_eos,
               char *err, size_t err_len);
void detok_free(Detok *d);
// Back to the state detok_init left: no text decoded, nothing held back (a completion that starts over). Returns
// 0, or -1 with a message (no memory for a new decoder stream); then d is unchanged.
int detok_restart(Detok *d, char *err, size_t err_len);

typedef struct {
    FinishReason finish;         // FINISH_NONE, FINISH_STOP, or FINISH_LENGTH (echoes `last`)
    const char *stop_reason;     // the matched stop string (points into the request's parameters) or NULL
    int32_t stop_token;          // the matched stop / eos id, or -1
} DetokResult;

// Feeds one sampled token. `last` says the completion ends after it whatever it is (max_tokens or the
// context); then the result is FINISH_LENGTH unless a stop condition matched. Appends the text that became
// final to `out`. Returns 0, or a negative code with a message (tokenizer failure, out of memory).
int detok_step(Detok *d, int32_t token, int last, TextBuf *out, DetokResult *res, char *err, size_t err_len);

#endif
