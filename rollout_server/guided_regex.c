// rollout_server/guided_regex.c — regex -> byte NFA (Thompson) -> DFA (subset construction over byte classes,
// dead states pruned) -> per-state token masks (see guided_regex.h).
#include "rollout_server/guided_regex.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_NFA_STATES 200000
#define MAX_REPEAT 1000

// ---- the regex as a tree --------------------------------------------------------------------------------------

typedef enum { N_SET, N_CAT, N_ALT, N_REP } NodeKind;

typedef struct Node {
    NodeKind kind;
    int set;                 // N_SET: index of its byte set
    struct Node **kids;      // N_CAT, N_ALT: n_kids; N_REP: one
    int n_kids, cap_kids;
    int min, max;            // N_REP: max -1 = unbounded
    struct Node *next_alloc; // every node, for freeing
} Node;

typedef struct {
    uint64_t bits[4];
} ByteSet;

typedef struct {
    const unsigned char *p, *end, *start;
    Node *nodes;             // allocation list
    ByteSet *sets;
    int n_sets, cap_sets;
    char *err;
    size_t err_len;
    int failed;
} Parser;

static void fail(Parser *ps, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(Parser *ps, const char *fmt, ...) {
    if (ps->failed) return;
    ps->failed = 1;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(ps->err, ps->err_len, "regex at offset %ld: %s", (long)(ps->p - ps->start), msg);
}

static Node *node_new(Parser *ps, NodeKind kind) {
    Node *n = calloc(1, sizeof *n);
    if (!n) {
        fail(ps, "out of memory");
        return NULL;
    }
    n->kind = kind;
    n->next_alloc = ps->nodes;
    ps->nodes = n;
    return n;
}

static int add_kid(Parser *ps, Node *n, Node *kid) {
    if (!n || !kid) return -1;
    if (n->n_kids == n->cap_kids) {
        int cap = n->cap_kids ? 2 * n->cap_kids : 4;
        Node **k = realloc(n->kids, (size_t)cap * sizeof *k);
        if (!k) return fail(ps, "out of memory"), -1;
        n->kids = k;
        n->cap_kids = cap;
    }
    n->kids[n->n_kids++] = kid;
    return 0;
}

static int set_new(Parser *ps) {
    if (ps->n_sets == ps->cap_sets) {
        int cap = ps->cap_sets ? 2 * ps->cap_sets : 16;
        ByteSet *s = realloc(ps->sets, (size_t)cap * sizeof *s);
        if (!s) return fail(ps, "out of memory"), -1;
        ps->sets = s;
        ps->cap_sets = cap;
    }
    memset(&ps->sets[ps->n_sets], 0, sizeof ps->sets[0]);
    return ps->n_sets++;
}

static void set_add(ByteSet *s, int lo, int hi) {
    for (int b = lo; b <= hi; b++) s->bits[b >> 6] |= 1ull << (b & 63);
}
static int set_has(const ByteSet *s, int b) { return (int)((s->bits[b >> 6] >> (b & 63)) & 1); }

// A node matching one byte in [lo, hi].
static Node *byte_range(Parser *ps, int lo, int hi) {
    const int k = set_new(ps);
    Node *n = node_new(ps, N_SET);
    if (k < 0 || !n) return NULL;
    set_add(&ps->sets[k], lo, hi);
    n->set = k;
    return n;
}

// Any UTF-8 character of two to four bytes (lead byte, then continuation bytes).
static Node *multibyte_char(Parser *ps) {
    Node *alt = node_new(ps, N_ALT);
    static const int lead[3][2] = {{0xc2, 0xdf}, {0xe0, 0xef}, {0xf0, 0xf4}};
    for (int k = 0; k < 3 && alt; k++) {
        Node *cat = node_new(ps, N_CAT);
        add_kid(ps, cat, byte_range(ps, lead[k][0], lead[k][1]));
        for (int c = 0; c <= k; c++) add_kid(ps, cat, byte_range(ps, 0x80, 0xbf));
        add_kid(ps, alt, cat);
    }
    return ps->failed ? NULL : alt;
}

// A character class over ASCII: the set, and whether it also takes every non-ASCII character (negated classes,
// '.', \D \W \S).
static Node *class_node(Parser *ps, const ByteSet *ascii, int negate) {
    const int k = set_new(ps);
    if (k < 0) return NULL;
    for (int b = 0; b < 128; b++)
        if (set_has(ascii, b) != negate) set_add(&ps->sets[k], b, b);
    Node *one = node_new(ps, N_SET);
    if (!one) return NULL;
    one->set = k;
    if (!negate) return one;
    Node *alt = node_new(ps, N_ALT);
    add_kid(ps, alt, one);
    add_kid(ps, alt, multibyte_char(ps));
    return ps->failed ? NULL : alt;
}

// A literal code point: its UTF-8 bytes in a row.
static Node *literal(Parser *ps, uint32_t cp) {
    unsigned char b[4];
    int n;
    if (cp < 0x80) b[0] = (unsigned char)cp, n = 1;
    else if (cp < 0x800) b[0] = (unsigned char)(0xc0 | cp >> 6), b[1] = (unsigned char)(0x80 | (cp & 63)), n = 2;
    else if (cp < 0x10000)
        b[0] = (unsigned char)(0xe0 | cp >> 12), b[1] = (unsigned char)(0x80 | ((cp >> 6) & 63)),
        b[2] = (unsigned char)(0x80 | (cp & 63)), n = 3;
    else
        b[0] = (unsigned char)(0xf0 | cp >> 18), b[1] = (unsigned char)(0x80 | ((cp >> 12) & 63)),
        b[2] = (unsigned char)(0x80 | ((cp >> 6) & 63)), b[3] = (unsigned char)(0x80 | (cp & 63)), n = 4;
    if (n == 1) return byte_range(ps, b[0], b[0]);
    Node *cat = node_new(ps, N_CAT);
    for (int i = 0; i < n; i++) add_kid(ps, cat, byte_range(ps, b[i], b[i]));
    return ps->failed ? NULL : cat;
}

// The next UTF-8 code point of the pattern.
static uint32_t next_cp(Parser *ps) {
    const unsigned char c = *ps->p++;
    if (c < 0x80) return c;
    int n = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : c >= 0xc0 ? 1 : -1;
    if (n < 0 || ps->end - ps->p < n) return fail(ps, "invalid UTF-8"), 0;
    uint32_t cp = c & (0x3f >> n);
    for (int i = 0; i < n; i++) cp = cp << 6 | (*ps->p++ & 63);
    return cp;
}

static int hex_digits(Parser *ps, int n, uint32_t *out) {
    *out = 0;
    for (int i = 0; i < n; i++) {
        if (ps->p >= ps->end) return fail(ps, "incomplete hexadecimal escape"), -1;
        const int c = *ps->p++;
        const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (v < 0) return fail(ps, "bad hexadecimal digit '%c'", c), -1;
        *out = *out << 4 | (uint32_t)v;
    }
    return 0;
}

// After a backslash: a class escape fills cls / *negate and returns 1; a literal sets *cp and returns 0; -1 on error.
static int escape(Parser *ps, ByteSet *cls, int *negate, uint32_t *cp) {
    if (ps->p >= ps->end) return fail(ps, "a trailing backslash"), -1;
    const int c = *ps->p++;
    memset(cls, 0, sizeof *cls);
    *negate = c == 'D' || c == 'W' || c == 'S';
    switch (c) {
    case 'd': case 'D': set_add(cls, '0', '9'); return 1;
    case 'w': case 'W': set_add(cls, '0', '9'); set_add(cls, 'a', 'z'); set_add(cls, 'A', 'Z'); set_add(cls, '_', '_');
        return 1;
    case 's': case 'S': set_add(cls, ' ', ' '); set_add(cls, '\t', '\r'); return 1;
    case 'n': *cp = '\n'; return 0;
    case 't': *cp = '\t'; return 0;
    case 'r': *cp = '\r'; return 0;
    case 'f': *cp = '\f'; return 0;
    case 'v': *cp = '\v'; return 0;
    case 'a': *cp = '\a'; return 0;
    case 'x': return hex_digits(ps, 2, cp);
    case 'u': return hex_digits(ps, 4, cp);
    case 'U': return hex_digits(ps, 8, cp);
    case 'b': case 'B': case 'A': case 'Z': case 'z': case 'G':
        return fail(ps, "the anchor \\%c is not supported (structured outputs match the whole completion)", c), -1;
    default:
        if (c >= '0' && c <= '9') return fail(ps, "backreferences (\\%c) are not supported", c), -1;
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return fail(ps, "unknown escape \\%c", c), -1;
        ps->p--;
        *cp = next_cp(ps);
        return ps->failed ? -1 : 0;
    }
}

static Node *parse_class(Parser *ps) {   // after '['
    ByteSet s = {{0}};
    int negate = 0, first = 1;
    if (ps->p < ps->end && *ps->p == '^') negate = 1, ps->p++;
    for (;;) {
        if (ps->p >= ps->end) return fail(ps, "an unterminated character class"), NULL;
        if (*ps->p == ']' && !first) {
            ps->p++;
            break;
        }
        first = 0;
        uint32_t lo;
        if (*ps->p == '\\') {
            ps->p++;
            ByteSet cls;
            int neg;
            const int r = escape(ps, &cls, &neg, &lo);
            if (r < 0) return NULL;
            if (r == 1) {
                if (neg) return fail(ps, "\\D, \\W and \\S inside a class are not supported"), NULL;
                for (int i = 0; i < 4; i++) s.bits[i] |= cls.bits[i];
                continue;
            }
        } else {
            lo = next_cp(ps);
        }
        uint32_t hi = lo;
        if (ps->p + 1 < ps->end && *ps->p == '-' && ps->p[1] != ']') {
            ps->p++;
            if (*ps->p == '\\') {
                ps->p++;
                ByteSet cls;
                int neg;
                if (escape(ps, &cls, &neg, &hi) != 0) return ps->failed ? NULL : (fail(ps, "a class in a range"), NULL);
            } else {
                hi = next_cp(ps);
            }
        }
        if (ps->failed) return NULL;
        if (lo >= 0x80 || hi >= 0x80)
            return fail(ps, "non-ASCII characters in a class are not supported (write them as alternatives)"), NULL;
        if (hi < lo) return fail(ps, "a bad range in a class"), NULL;
        set_add(&s, (int)lo, (int)hi);
    }
    return class_node(ps, &s, negate);
}

static Node *parse_alt(Parser *ps);

static Node *parse_atom(Parser *ps) {
    const unsigned char c = *ps->p;
    if (c == '(') {
        ps->p++;
        if (ps->p < ps->end && *ps->p == '?') {
            if (ps->end - ps->p >= 2 && ps->p[1] == ':') ps->p += 2;
            else return fail(ps, "only (?:...) groups are supported (no lookarounds, named groups or flags)"), NULL;
        }
        Node *inner = parse_alt(ps);
        if (!inner) return NULL;
        if (ps->p >= ps->end || *ps->p != ')') return fail(ps, "a missing ')'"), NULL;
        ps->p++;
        return inner;
    }
    if (c == '[') {
        ps->p++;
        return parse_class(ps);
    }
    if (c == '.') {
        ps->p++;
        ByteSet nl = {{0}};
        set_add(&nl, '\n', '\n');
        return class_node(ps, &nl, 1);
    }
    if (c == '\\') {
        ps->p++;
        ByteSet cls;
        int neg;
        uint32_t cp;
        const int r = escape(ps, &cls, &neg, &cp);
        if (r < 0) return NULL;
        return r == 1 ? class_node(ps, &cls, neg) : literal(ps, cp);
    }
    if (c == '*' || c == '+' || c == '?') return fail(ps, "'%c' repeats nothing", c), NULL;
    return literal(ps, next_cp(ps));
}

// {n}, {n,}, {n,m} at ps->p; 0 when it is not a quantifier (then '{' is a literal, as in Python).
static int parse_braces(Parser *ps, int *min, int *max) {
    const unsigned char *q = ps->p + 1;
    long a = -1, b;
    if (q < ps->end && *q >= '0' && *q <= '9') {
        a = 0;
        while (q < ps->end && *q >= '0' && *q <= '9') a = a * 10 + (*q++ - '0'), a = a > 100000 ? 100000 : a;
    }
    b = a;
    if (q < ps->end && *q == ',') {
        q++;
        b = -1;
        if (q < ps->end && *q >= '0' && *q <= '9') {
            b = 0;
            while (q < ps->end && *q >= '0' && *q <= '9') b = b * 10 + (*q++ - '0'), b = b > 100000 ? 100000 : b;
        }
        if (a < 0) a = 0;
    }
    if (a < 0 || q >= ps->end || *q != '}') return 0;
    ps->p = q + 1;
    *min = (int)a;
    *max = (int)b;
    return 1;
}

static Node *parse_repeat(Parser *ps) {
    Node *atom = parse_atom(ps);
    while (atom && ps->p < ps->end) {
        int min, max;
        const unsigned char c = *ps->p;
        if (c == '*') min = 0, max = -1, ps->p++;
        else if (c == '+') min = 1, max = -1, ps->p++;
        else if (c == '?') min = 0, max = 1, ps->p++;
        else if (c == '{' && parse_braces(ps, &min, &max)) {
        } else break;
        if (max >= 0 && max < min) return fail(ps, "a repeat {%d,%d} with its maximum below its minimum", min, max), NULL;
        if (min > MAX_REPEAT || max > MAX_REPEAT)
            return fail(ps, "repeats above %d are not supported", MAX_REPEAT), NULL;
        if (ps->p < ps->end && *ps->p == '?') ps->p++;   // lazy: the same language
        else if (ps->p < ps->end && *ps->p == '+') return fail(ps, "possessive quantifiers are not supported"), NULL;
        Node *rep = node_new(ps, N_REP);
        if (!rep || add_kid(ps, rep, atom) != 0) return NULL;
        rep->min = min;
        rep->max = max;
        atom = rep;
    }
    return atom;
}

static Node *parse_cat(Parser *ps) {
    Node *cat = node_new(ps, N_CAT);
    while (cat && ps->p < ps->end && *ps->p != '|' && *ps->p != ')') {
        if (*ps->p == '^' && ps->p == ps->start) {   // a fullmatch is anchored: ^ at the start changes nothing
            ps->p++;
            continue;
        }
        if (*ps->p == '$' && ps->p + 1 == ps->end) {
            ps->p++;
            continue;
        }
        if (*ps->p == '^' || *ps->p == '$') return fail(ps, "'%c' inside the pattern is not supported", *ps->p), NULL;
        if (add_kid(ps, cat, parse_repeat(ps)) != 0) return NULL;
    }
    return ps->failed ? NULL : cat;
}

static Node *parse_alt(Parser *ps) {
    Node *alt = node_new(ps, N_ALT);
    if (add_kid(ps, alt, parse_cat(ps)) != 0) return NULL;
    while (ps->p < ps->end && *ps->p == '|') {
        ps->p++;
        if (add_kid(ps, alt, parse_cat(ps)) != 0) return NULL;
    }
    return alt;
}

// ---- NFA ------------------------------------------------------------------------------------------------------

typedef struct {
    int set;          // >= 0: on a byte of this set, go to out; -1: epsilon moves to eps[]
    int out;
    int *eps, n_eps, cap_eps;
} NState;

typedef struct {
    NState *s;
    int n, cap;
    int failed;
} Nfa;

static int nfa_new(Nfa *a, int set) {
    if (a->failed) return -1;
    if (a->n == MAX_NFA_STATES) return a->failed = 1, -1;
    if (a->n == a->cap) {
        int cap = a->cap ? 2 * a->cap : 256;
        NState *s = realloc(a->s, (size_t)cap * sizeof *s);
        if (!s) return a->failed = 1, -1;
        a->s = s;
        a->cap = cap;
    }
    memset(&a->s[a->n], 0, sizeof a->s[0]);
    a->s[a->n].set = set;
    a->s[a->n].out = -1;
    return a->n++;
}

static void nfa_eps(Nfa *a, int from, int to) {
    if (a->failed || from < 0 || to < 0) return;
    NState *s = &a->s[from];
    if (s->n_eps == s->cap_eps) {
        int cap = s->cap_eps ? 2 * s->cap_eps : 2;
        int *e = realloc(s->eps, (size_t)cap * sizeof *e);
        if (!e) {
            a->failed = 1;
            return;
        }
        s->eps = e;
        s->cap_eps = cap;
    }
    s->eps[s->n_eps++] = to;
}

// Thompson fragment of node: *s -> ... -> *e (e an epsilon state with no moves yet).
static void compile(Nfa *a, const Node *n, int *s, int *e) {
    *s = *e = -1;
    if (a->failed) return;
    switch (n->kind) {
    case N_SET:
        *s = nfa_new(a, n->set);
        *e = nfa_new(a, -1);
        if (!a->failed) a->s[*s].out = *e;
        return;
    case N_CAT: {
        *s = *e = nfa_new(a, -1);
        for (int i = 0; i < n->n_kids && !a->failed; i++) {
            int ks, ke;
            compile(a, n->kids[i], &ks, &ke);
            nfa_eps(a, *e, ks);
            *e = ke;
        }
        return;
    }
    case N_ALT:
        *s = nfa_new(a, -1);
        *e = nfa_new(a, -1);
        for (int i = 0; i < n->n_kids && !a->failed; i++) {
            int ks, ke;
            compile(a, n->kids[i], &ks, &ke);
            nfa_eps(a, *s, ks);
            nfa_eps(a, ke, *e);
        }
        return;
    case N_REP: {
        *s = *e = nfa_new(a, -1);
        for (int i = 0; i < n->min && !a->failed; i++) {
            int ks, ke;
            compile(a, n->kids[0], &ks, &ke);
            nfa_eps(a, *e, ks);
            *e = ke;
        }
        if (n->max < 0) {   // then any number more: a loop through one more copy
            int ks, ke;
            const int loop = nfa_new(a, -1), out = nfa_new(a, -1);
            compile(a, n->kids[0], &ks, &ke);
            nfa_eps(a, *e, loop);
            nfa_eps(a, loop, ks);
            nfa_eps(a, loop, out);
            nfa_eps(a, ke, loop);
            *e = out;
        } else if (n->max > n->min) {   // up to max - min more, each one optional
            const int out = nfa_new(a, -1);
            for (int i = n->min; i < n->max && !a->failed; i++) {
                int ks, ke;
                compile(a, n->kids[0], &ks, &ke);
                nfa_eps(a, *e, ks);
                nfa_eps(a, *e, out);
                *e = ke;
            }
            nfa_eps(a, *e, out);
            *e = out;
        }
        return;
    }
    }
}

// ---- DFA ------------------------------------------------------------------------------------------------------

struct Guide {
    int n_states, n_classes;
    uint8_t byte_class[256];
    int *trans;              // (n_states, n_classes): next state, -1 dead
    unsigned char *accept;   // (n_states)
    const Tokenizer *tok;
    int V;
    int32_t eos[16];
    int n_eos;
    int32_t **allowed;       // (n_states) each state's mask: the ids it allows, or (ban[s]) the ids it does not; states
    int *n_allowed;          // with equal masks share one array (owned by the first, owner[s] == s)
    unsigned char *ban;
    int *owner;
    uint64_t *mask_hash;
    int max_allowed;
};

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

// The epsilon closure of the states in set (n of them), written back into set (sorted, no repeats); returns its size.
static int closure(const Nfa *a, int *set, int n, int *stack, unsigned *mark, unsigned stamp) {
    int top = 0, out = 0;
    for (int i = 0; i < n; i++)
        if (mark[set[i]] != stamp) mark[set[i]] = stamp, stack[top++] = set[i];
    while (top > 0) {
        const int x = stack[--top];
        set[out++] = x;
        for (int k = 0; k < a->s[x].n_eps; k++) {
            const int y = a->s[x].eps[k];
            if (mark[y] != stamp) mark[y] = stamp, stack[top++] = y;
        }
    }
    qsort(set, (size_t)out, sizeof *set, cmp_int);
    return out;
}

typedef struct {
    int *pool;       // every DFA state's NFA set back to back
    size_t n_pool, cap_pool;
    size_t *off;     // (cap) start of state i in pool
    int *len;
    int n, cap;
    int *hash;       // open addressing, (hash_cap) DFA ids or -1
    int hash_cap;
} StateTable;

static uint64_t set_hash(const int *s, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint64_t)s[i]) * 1099511628211ull;
    return h;
}

// The DFA id of NFA set s (n), made when new (*made = 1). -1 when out of memory or past GUIDED_MAX_STATES.
static int state_id(StateTable *t, const int *s, int n, int *made) {
    *made = 0;
    uint64_t h = set_hash(s, n);
    for (size_t i = h % (uint64_t)t->hash_cap;; i = (i + 1) % (size_t)t->hash_cap) {
        const int id = t->hash[i];
        if (id < 0) break;
        if (t->len[id] == n && memcmp(t->pool + t->off[id], s, (size_t)n * sizeof *s) == 0) return id;
    }
    if (t->n == GUIDED_MAX_STATES) return -1;
    if (t->n == t->cap) {
        int cap = t->cap ? 2 * t->cap : 64;
        size_t *off = realloc(t->off, (size_t)cap * sizeof *off);
        if (off) t->off = off;
        int *len = realloc(t->len, (size_t)cap * sizeof *len);
        if (len) t->len = len;
        if (!off || !len) return -1;
        t->cap = cap;
    }
    if (t->n_pool + (size_t)n > t->cap_pool) {
        size_t cap = t->cap_pool ? 2 * t->cap_pool : 4096;
        while (cap < t->n_pool + (size_t)n) cap *= 2;
        int *p = realloc(t->pool, cap * sizeof *p);
        if (!p) return -1;
        t->pool = p;
        t->cap_pool = cap;
    }
    memcpy(t->pool + t->n_pool, s, (size_t)n * sizeof *s);
    t->off[t->n] = t->n_pool;
    t->len[t->n] = n;
    t->n_pool += (size_t)n;
    size_t i = h % (uint64_t)t->hash_cap;
    while (t->hash[i] >= 0) i = (i + 1) % (size_t)t->hash_cap;
    t->hash[i] = t->n;
    *made = 1;
    return t->n++;
}

// Subset construction from the NFA (start, accepting state) over byte classes; then dead states (no way to a match)
// are cut off. Returns 0 or -1 with a message.
static int build_dfa(Guide *g, const Nfa *a, const ByteSet *sets, int n_sets, int start, int accept, char *err,
                     size_t err_len) {
    // Byte classes: bytes that every set treats alike.
    memset(g->byte_class, 0, sizeof g->byte_class);
    int n_classes = 1;
    for (int k = 0; k < n_sets; k++) {
        int remap[512];
        for (int i = 0; i < 512; i++) remap[i] = -1;
        int next = 0;
        for (int b = 0; b < 256; b++) {
            const int key = g->byte_class[b] * 2 + set_has(&sets[k], b);
            if (remap[key] < 0) remap[key] = next++;
            g->byte_class[b] = (uint8_t)remap[key];
        }
        n_classes = next;
    }
    g->n_classes = n_classes;
    int rep[256];   // a byte of each class
    for (int b = 255; b >= 0; b--) rep[g->byte_class[b]] = b;

    StateTable t = {.hash_cap = 2 * GUIDED_MAX_STATES + 1};
    int *set = malloc((size_t)a->n * sizeof *set), *stack = malloc((size_t)a->n * sizeof *stack);
    unsigned *mark = calloc((size_t)a->n, sizeof *mark);
    t.hash = malloc((size_t)t.hash_cap * sizeof *t.hash);
    int *trans = NULL, rc = -1;
    size_t trans_cap = 0;
    unsigned stamp = 0;
    if (!set || !stack || !mark || !t.hash) goto oom;
    for (int i = 0; i < t.hash_cap; i++) t.hash[i] = -1;
    set[0] = start;
    int n = closure(a, set, 1, stack, mark, ++stamp), made;
    if (state_id(&t, set, n, &made) < 0) goto oom;
    for (int d = 0; d < t.n; d++) {
        if ((size_t)(d + 1) * (size_t)n_classes > trans_cap) {
            size_t cap = trans_cap ? 2 * trans_cap : (size_t)n_classes * 64;
            int *tr = realloc(trans, cap * sizeof *tr);
            if (!tr) goto oom;
            trans = tr;
            trans_cap = cap;
        }
        for (int c = 0; c < n_classes; c++) {
            n = 0;
            const int *src = t.pool + t.off[d];
            for (int i = 0; i < t.len[d]; i++) {
                const NState *x = &a->s[src[i]];
                if (x->set >= 0 && set_has(&sets[x->set], rep[c])) set[n++] = x->out;
            }
            int id = -1;
            if (n > 0) {
                n = closure(a, set, n, stack, mark, ++stamp);
                if ((id = state_id(&t, set, n, &made)) < 0) {
                    if (t.n == GUIDED_MAX_STATES)
                        snprintf(err, err_len, "the regex needs more than %d automaton states (simplify it, e.g. "
                                 "smaller repeat counts)", GUIDED_MAX_STATES);
                    else
                        snprintf(err, err_len, "out of memory building the regex automaton");
                    goto out;
                }
            }
            trans[(size_t)d * n_classes + c] = id;
        }
    }
    // Accepting states, then the states from which an accepting one can be reached (iterate to a fixed point).
    if (t.n < 1) goto oom;
    g->n_states = t.n;
    g->accept = calloc((size_t)t.n, 1);
    unsigned char *live = calloc((size_t)t.n, 1);
    if (!g->accept || !live) {
        free(live);
        goto oom;
    }
    for (int d = 0; d < t.n; d++) {
        const int *s = t.pool + t.off[d];
        for (int i = 0; i < t.len[d]; i++) g->accept[d] |= s[i] == accept;
        live[d] = g->accept[d];
    }
    for (int changed = 1; changed;) {
        changed = 0;
        for (int d = 0; d < t.n; d++)
            for (int c = 0; c < n_classes && !live[d]; c++) {
                const int to = trans[(size_t)d * n_classes + c];
                if (to >= 0 && live[to]) live[d] = 1, changed = 1;
            }
    }
    for (size_t i = 0; i < (size_t)t.n * n_classes; i++)
        if (trans[i] >= 0 && !live[trans[i]]) trans[i] = -1;
    const int start_live = live[0];
    free(live);
    if (!start_live) {
        snprintf(err, err_len, "no text matches this regex");
        goto out;
    }
    g->trans = trans;
    trans = NULL;
    rc = 0;
    goto out;
oom:
    snprintf(err, err_len, "out of memory building the regex automaton");
out:
    free(trans);
    free(set);
    free(stack);
    free(mark);
    free(t.pool);
    free(t.off);
    free(t.len);
    free(t.hash);
    return rc;
}

// ---- tokens ---------------------------------------------------------------------------------------------------

static int run_bytes(const Guide *g, int s, const char *b, size_t n) {
    for (size_t i = 0; i < n && s >= 0; i++) s = g->trans[(size_t)s * g->n_classes + g->byte_class[(unsigned char)b[i]]];
    return s;
}

static int is_eos(const Guide *g, int32_t id) {
    for (int i = 0; i < g->n_eos; i++)
        if (g->eos[i] == id) return 1;
    return 0;
}

int guide_start(const Guide *g) { (void)g; return 0; }
int guide_num_states(const Guide *g) { return g->n_states; }

int guide_advance(const Guide *g, int s, int32_t id) {
    if (s < 0 || s >= g->n_states || is_eos(g, id)) return -1;
    const char *b;
    size_t n;
    if (tokenizer_token_bytes(g->tok, id, &b, &n) != 0 || n == 0) return -1;
    return run_bytes(g, s, b, n);
}

int guide_max_mask(const Guide *g) { return g->max_allowed > g->n_eos ? g->max_allowed : g->n_eos; }
int guide_accepting(const Guide *g, int s) { return s >= 0 && s < g->n_states && g->accept[s]; }
int guide_text(const Guide *g, int s, const char *text, size_t n) {
    return s < 0 || s >= g->n_states ? -1 : run_bytes(g, s, text, n);
}

int guide_state_after(const Guide *g, const int32_t *ids, int n) {
    int s = 0;
    for (int i = 0; i < n && s >= 0; i++) s = guide_advance(g, s, ids[i]);
    return s;
}

void guide_mask(const Guide *g, int s, const int32_t **ids, int *n, int *ban) {
    if (s < 0 || s >= g->n_states) {
        *ids = g->eos;
        *n = g->n_eos;
        *ban = 0;
        return;
    }
    *ids = g->allowed[s];
    *n = g->n_allowed[s];
    *ban = g->ban[s];
}

// Every state's allowed ids: each id's bytes run from the state (the automaton's tables are small; V x states steps).
static int make_masks(Guide *g) {
    for (int s = 0; s < g->n_states; s++) {
        int cap = 256, k = 0;
        int32_t *out = malloc((size_t)cap * sizeof *out);
        if (!out) return -1;
        for (int32_t id = 0; id < g->V; id++) {
            int ok;
            if (is_eos(g, id)) {
                ok = g->accept[s];
            } else {
                const char *b;
                size_t len;
                ok = tokenizer_token_bytes(g->tok, id, &b, &len) == 0 && len > 0 && run_bytes(g, s, b, len) >= 0;
            }
            if (!ok) continue;
            if (k == cap) {
                int32_t *o = realloc(out, (size_t)(cap *= 2) * sizeof *o);
                if (!o) {
                    free(out);
                    return -1;
                }
                out = o;
            }
            out[k++] = id;
        }
        if (k > g->V / 2) {   // the complement is the shorter list
            int32_t *not = malloc((size_t)(g->V - k > 0 ? g->V - k : 1) * sizeof *not);
            if (!not) {
                free(out);
                return -1;
            }
            int m = 0;
            for (int32_t id = 0, j = 0; id < g->V; id++) {
                if (j < k && out[j] == id) j++;
                else not[m++] = id;
            }
            free(out);
            out = not;
            k = m;
            g->ban[s] = 1;
        }
        // States that differ only in how far along a repeat they are have equal masks: keep one copy.
        uint64_t h = 1469598103934665603ull ^ g->ban[s];
        for (int j = 0; j < k; j++) h = (h ^ (uint64_t)(uint32_t)out[j]) * 1099511628211ull;
        g->mask_hash[s] = h;
        g->owner[s] = s;
        for (int t = 0; t < s; t++)
            if (g->owner[t] == t && g->mask_hash[t] == h && g->n_allowed[t] == k && g->ban[t] == g->ban[s] &&
                memcmp(g->allowed[t], out, (size_t)k * sizeof *out) == 0) {
                free(out);
                out = g->allowed[t];
                g->owner[s] = t;
                break;
            }
        g->allowed[s] = out;
        g->n_allowed[s] = k;
        if (k > g->max_allowed) g->max_allowed = k;
    }
    return 0;
}

// ---- set-up ---------------------------------------------------------------------------------------------------

static void free_nodes(Node *n) {
    while (n) {
        Node *next = n->next_alloc;
        free(n->kids);
        free(n);
        n = next;
    }
}

int guide_create(Guide **out, const char *pattern, size_t len, const Tokenizer *tok, int V, const int32_t *eos,
                 int n_eos, char *err, size_t err_len) {
    *out = NULL;
    const char *probe;
    size_t probe_len;
    if (!tok || tokenizer_token_bytes(tok, 0, &probe, &probe_len) == -2) {
        snprintf(err, err_len, "structured outputs need a byte-level tokenizer (GPT-2, Llama 3, Qwen style); this "
                 "model's tokenizer spells tokens differently by position");
        return -1;
    }
    Parser ps = {.p = (const unsigned char *)pattern, .end = (const unsigned char *)pattern + len,
                 .start = (const unsigned char *)pattern, .err = err, .err_len = err_len};
    Node *root = parse_alt(&ps);
    if (root && ps.p < ps.end) fail(&ps, "an unmatched ')'");
    Nfa a = {0};
    Guide *g = NULL;
    int rc = -1;
    if (ps.failed || !root) goto done;
    int s, e;
    compile(&a, root, &s, &e);
    if (a.failed) {
        snprintf(err, err_len, "the regex is too large (more than %d automaton pieces) or memory ran out",
                 MAX_NFA_STATES);
        goto done;
    }
    if (!(g = calloc(1, sizeof *g))) goto done;
    g->tok = tok;
    g->V = V;
    for (int i = 0; i < n_eos && g->n_eos < 16; i++) g->eos[g->n_eos++] = eos[i];
    if (build_dfa(g, &a, ps.sets, ps.n_sets, s, e, err, err_len) != 0) goto done;
    g->allowed = calloc((size_t)g->n_states, sizeof *g->allowed);
    g->n_allowed = calloc((size_t)g->n_states, sizeof *g->n_allowed);
    g->ban = calloc((size_t)g->n_states, 1);
    g->owner = calloc((size_t)g->n_states, sizeof *g->owner);
    g->mask_hash = calloc((size_t)g->n_states, sizeof *g->mask_hash);
    if (!g->allowed || !g->n_allowed || !g->ban || !g->owner || !g->mask_hash || make_masks(g) != 0) {
        snprintf(err, err_len, "out of memory for the structured-output masks");
        goto done;
    }
    *out = g;
    g = NULL;
    rc = 0;
done:
    guide_free(g);
    for (int i = 0; i < a.n; i++) free(a.s[i].eps);
    free(a.s);
    free(ps.sets);
    free_nodes(ps.nodes);
    return rc;
}

char *guide_choice_regex(const char *const *choices, const size_t *lens, int n, size_t *len) {
    size_t cap = 1;
    for (int i = 0; i < n; i++) cap += 2 * lens[i] + 1;
    char *re = malloc(cap);
    if (!re) return NULL;
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        if (i) re[k++] = '|';
        for (size_t j = 0; j < lens[i]; j++) {   // every ASCII character but letters, digits and '_' escaped
            const unsigned char c = (unsigned char)choices[i][j];
            if (c < 0x80 && !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'))
                re[k++] = '\\';
            re[k++] = (char)c;
        }
    }
    re[k] = '\0';
    *len = k;
    return re;
}

void guide_free(Guide *g) {
    if (!g) return;
    for (int s = 0; g->allowed && s < g->n_states; s++)
        if (g->owner && g->owner[s] == s) free(g->allowed[s]);
    free(g->allowed);
    free(g->n_allowed);
    free(g->ban);
    free(g->owner);
    free(g->mask_hash);
    free(g->trans);
    free(g->accept);
    free(g);
}
