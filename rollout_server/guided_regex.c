// rollout_server/guided_regex.c — structured outputs: the pattern's NFA (guided_regex_nfa.c) made deterministic
// (subset construction over byte classes, dead states pruned), then every state's token mask (see guided_regex.h).
#include "rollout_server/guided_regex.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/guided_regex_internal.h"

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
            const int key = g->byte_class[b] * 2 + byteset_has(&sets[k], b);
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
                if (x->set >= 0 && byteset_has(&sets[x->set], rep[c])) set[n++] = x->out;
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
    Nfa a;
    ByteSet *sets;
    int n_sets, s, e;
    if (guided_nfa_build(pattern, len, &a, &sets, &n_sets, &s, &e, err, err_len) != 0) return -1;
    Guide *g = calloc(1, sizeof *g);
    int rc = -1;
    if (!g) {
        snprintf(err, err_len, "out of memory");
        goto done;
    }
    g->tok = tok;
    g->V = V;
    for (int i = 0; i < n_eos && g->n_eos < 16; i++) g->eos[g->n_eos++] = eos[i];
    if (build_dfa(g, &a, sets, n_sets, s, e, err, err_len) != 0) goto done;
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
    guided_nfa_free(&a, sets);
    return rc;
}

int guide_regex_escapes(unsigned char c) {
    return c < 0x80 && !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_');
}

char *guide_choice_regex(const char *const *choices, const size_t *lens, int n, size_t *len) {
    size_t cap = 1;
    for (int i = 0; i < n; i++) cap += 2 * lens[i] + 1;
    char *re = malloc(cap);
    if (!re) return NULL;
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        if (i) re[k++] = '|';
        for (size_t j = 0; j < lens[i]; j++) {
            if (guide_regex_escapes((unsigned char)choices[i][j])) re[k++] = '\\';
            re[k++] = choices[i][j];
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
