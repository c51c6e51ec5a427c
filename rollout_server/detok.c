// rollout_server/detok.c — streaming text with stop strings and stop / eos ids (see detok.h).
#include "rollout_server/detok.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int textbuf_append(TextBuf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->data, cap);
        if (!p) return -1;
        b->data = p;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
    return 0;
}

void textbuf_free(TextBuf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

int detok_init(Detok *d, const Tokenizer *tok, const SamplingParams *p, const int32_t *eos_ids, int n_eos,
               char *err, size_t err_len) {
    memset(d, 0, sizeof *d);
    d->tok = tok;
    d->p = p;
    d->eos_ids = eos_ids;
    d->n_eos = n_eos;
    for (int i = 0; i < p->n_stop; i++) {
        size_t n = strlen(p->stop[i]);
        if (n > d->max_stop_len) d->max_stop_len = n;
    }
    if (tok && tokenizer_stream_create(&d->stream, tok, p->skip_special_tokens, err, err_len) != 0) return -1;
    // Room for the usual hold-back up front, so steady-state steps do not allocate.
    if (textbuf_append(&d->held, "", 0) != 0) {
        snprintf(err, err_len, "out of memory for a completion's text");
        detok_free(d);
        return -1;
    }
    return 0;
}

void detok_free(Detok *d) {
    if (d->stream) tokenizer_stream_free(d->stream);
    textbuf_free(&d->held);
    memset(d, 0, sizeof *d);
}

int detok_restart(Detok *d, char *err, size_t err_len) {
    TokenizerStream *fresh = NULL;
    if (d->tok && tokenizer_stream_create(&fresh, d->tok, d->p->skip_special_tokens, err, err_len) != 0) return -1;
    if (d->stream) tokenizer_stream_free(d->stream);
    d->stream = fresh;
    d->held.len = 0;
    d->protect = 0;
    d->n_tokens = 0;
    d->finished = 0;
    return 0;
}

static int is_stop_token(const Detok *d, int32_t t) {
    for (int i = 0; i < d->p->n_stop_token_ids; i++)
        if (d->p->stop_token_ids[i] == t) return 1;
    if (!d->p->ignore_eos)
        for (int i = 0; i < d->n_eos; i++)
            if (d->eos_ids[i] == t) return 1;
    return 0;
}

static const char *find_bytes(const char *hay, size_t n, const char *needle, size_t m) {
    if (m == 0 || m > n) return NULL;
    for (size_t i = 0; i + m <= n; i++)
        if (hay[i] == needle[0] && memcmp(hay + i, needle, m) == 0) return hay + i;
    return NULL;
}

// Earliest stop-string match in the held text that ends past the protected bytes (ties: the first listed string).
// Returns its index or -1.
static int match_stop(const Detok *d, size_t *at) {
    int best = -1;
    size_t best_at = 0;
    for (int i = 0; i < d->p->n_stop; i++) {
        const size_t m = strlen(d->p->stop[i]), from = d->protect >= m ? d->protect - m + 1 : 0;
        if (from >= d->held.len) continue;
        const char *hit = find_bytes(d->held.data + from, d->held.len - from, d->p->stop[i], m);
        if (hit && (best < 0 || (size_t)(hit - d->held.data) < best_at)) {
            best = i;
            best_at = (size_t)(hit - d->held.data);
        }
    }
    *at = best_at;
    return best;
}

// Length of the longest suffix of the held text that is a proper prefix of some stop string.
static size_t holdback_len(const Detok *d) {
    size_t best = 0;
    for (int i = 0; i < d->p->n_stop; i++) {
        const char *s = d->p->stop[i];
        size_t m = strlen(s), lim = m - 1 < d->held.len ? m - 1 : d->held.len;
        for (size_t L = lim; L > best; L--)
            if (memcmp(d->held.data + d->held.len - L, s, L) == 0) {
                best = L;
                break;
            }
    }
    return best;
}

// Moves the first n held bytes to out.
static int emit(Detok *d, TextBuf *out, size_t n) {
    if (textbuf_append(out, d->held.data, n) != 0) return -1;
    memmove(d->held.data, d->held.data + n, d->held.len - n);
    d->held.len -= n;
    d->protect = d->protect > n ? d->protect - n : 0;
    d->held.data[d->held.len] = '\0';
    return 0;
}

// Ends the text at a stop-string match if there is one. Returns 1 when it matched, 0 when not, -1 on no memory.
static int stop_string_end(Detok *d, TextBuf *out, DetokResult *res) {
    size_t at;
    int i = match_stop(d, &at);
    if (i < 0) return 0;
    size_t keep = at + (d->p->include_stop_str ? strlen(d->p->stop[i]) : 0);
    if (emit(d, out, keep) != 0) return -1;
    d->held.len = 0;
    res->finish = FINISH_STOP;
    res->stop_reason = d->p->stop[i];
    res->stop_token = -1;
    return 1;
}

static int append_piece(Detok *d, char *piece, size_t n) {
    int rc = piece ? textbuf_append(&d->held, piece, n) : 0;
    free(piece);
    return rc;
}

int detok_step(Detok *d, int32_t token, int last, TextBuf *out, DetokResult *res, char *err, size_t err_len) {
    res->finish = FINISH_NONE;
    res->stop_reason = NULL;
    res->stop_token = -1;
    if (d->finished) {
        snprintf(err, err_len, "token after the completion finished");
        return ENGINE_EINTERNAL;
    }
    // Before min_tokens generated tokens nothing stops the completion but its length (the sampler's mask keeps
    // stop and eos ids out; vLLM's check_stop does not look either), and their text is searched by no match's end.
    const int early = ++d->n_tokens < d->p->min_tokens;
    const int protected_text = d->p->min_tokens > 0 && d->n_tokens <= d->p->min_tokens;
    const int stop_tok = !early && is_stop_token(d, token);
    if (stop_tok) {
        res->finish = FINISH_STOP;
        res->stop_token = token;
    } else if (last) {
        res->finish = FINISH_LENGTH;
    }
    if (!d->stream) {
        d->finished = res->finish != FINISH_NONE;
        return 0;
    }
    char *piece = NULL;
    size_t n = 0;
    if (!stop_tok || d->p->include_stop_str) {
        if (tokenizer_stream_step(d->stream, token, &piece, &n, err, err_len) != 0) return ENGINE_EINTERNAL;
        if (append_piece(d, piece, n) != 0) goto oom;
    }
    if (protected_text) d->protect = d->held.len;
    int m = protected_text ? 0 : stop_string_end(d, out, res);
    if (m < 0) goto oom;
    if (m == 0 && res->finish != FINISH_NONE) {
        // The end: whatever the decoder still holds (an incomplete character) is part of the text.
        piece = NULL;
        if (tokenizer_stream_flush(d->stream, &piece, &n, err, err_len) != 0) return ENGINE_EINTERNAL;
        if (append_piece(d, piece, n) != 0) goto oom;
        if (!protected_text && (m = stop_string_end(d, out, res)) < 0) goto oom;
        if (m == 0 && emit(d, out, d->held.len) != 0) goto oom;
    } else if (m == 0) {
        if (emit(d, out, d->held.len - holdback_len(d)) != 0) goto oom;
    }
    d->finished = res->finish != FINISH_NONE;
    return 0;
oom:
    snprintf(err, err_len, "out of memory for a completion's text");
    return ENGINE_ENOMEM;
}
