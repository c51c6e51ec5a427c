// rollout_server/guided_regex_nfa.c — structured outputs' pattern parsed into a tree, then a Thompson NFA over
// bytes (guided_regex_internal.h; the syntax in guided_regex.h).
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/guided_regex_internal.h"
#include "shared/err.h"

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
    err_vset(msg, sizeof msg, fmt, ap);
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
        if (byteset_has(ascii, b) != negate) set_add(&ps->sets[k], b, b);
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

static void free_nodes(Node *n) {
    while (n) {
        Node *next = n->next_alloc;
        free(n->kids);
        free(n);
        n = next;
    }
}

void guided_nfa_free(Nfa *a, ByteSet *sets) {
    for (int i = 0; i < a->n; i++) free(a->s[i].eps);
    free(a->s);
    memset(a, 0, sizeof *a);
    free(sets);
}

int guided_nfa_build(const char *pattern, size_t len, Nfa *a, ByteSet **sets, int *n_sets, int *start, int *accept,
                     char *err, size_t err_len) {
    memset(a, 0, sizeof *a);
    *sets = NULL;
    *n_sets = 0;
    Parser ps = {.p = (const unsigned char *)pattern, .end = (const unsigned char *)pattern + len,
                 .start = (const unsigned char *)pattern, .err = err, .err_len = err_len};
    Node *root = parse_alt(&ps);
    if (root && ps.p < ps.end) fail(&ps, "an unmatched ')'");
    int rc = -1;
    if (!ps.failed && root) {
        compile(a, root, start, accept);
        if (a->failed)
            snprintf(err, err_len, "the regex is too large (more than %d automaton pieces) or memory ran out",
                     MAX_NFA_STATES);
        else
            rc = 0;
    }
    free_nodes(ps.nodes);
    if (rc != 0) {
        guided_nfa_free(a, ps.sets);
        return -1;
    }
    *sets = ps.sets;
    *n_sets = ps.n_sets;
    return 0;
}
