// rollout_server/guided_regex_internal.h — the pieces of structured outputs' regex compiler shared by
// guided_regex_nfa.c (the pattern parsed into a tree, then a Thompson NFA over bytes) and guided_regex.c (the NFA
// made deterministic, and the token masks). Not an API: see guided_regex.h.
#ifndef TANDEM_ROLLOUT_GUIDED_REGEX_INTERNAL_H
#define TANDEM_ROLLOUT_GUIDED_REGEX_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

// A set of bytes, one bit each.
typedef struct {
    uint64_t bits[4];
} ByteSet;

static inline int byteset_has(const ByteSet *s, int b) { return (int)((s->bits[b >> 6] >> (b & 63)) & 1); }

// An NFA state: on a byte of set `set` go to `out`; set -1: epsilon moves to eps[].
typedef struct {
    int set;
    int out;
    int *eps, n_eps, cap_eps;
} NState;

typedef struct {
    NState *s;
    int n, cap;
    int failed;
} Nfa;

// Parses pattern (len bytes, guided_regex.h's syntax) into an NFA over bytes: *a (free with guided_nfa_free) from
// *start to the accepting state *accept, its transitions naming the byte sets *sets (n_sets of them, malloc'd).
// Returns 0, or -1 with a message (the offset and the construct).
int guided_nfa_build(const char *pattern, size_t len, Nfa *a, ByteSet **sets, int *n_sets, int *start, int *accept,
                     char *err, size_t err_len);
void guided_nfa_free(Nfa *a, ByteSet *sets);

#endif
