// trainer/rewards.c — built-in verifiable rewards (rules and formulas in rewards.h).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "trainer/rewards.h"
#include "shared/err.h"

#include <ctype.h>
#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const reward_builtin_names[REWARD_BUILTIN_COUNT + 1] = {
    [REWARD_ANSWER_MATCH] = "answer_match",   [REWARD_REGEX_FORMAT] = "regex_format",
    [REWARD_THINK_FORMAT] = "think_format",   [REWARD_LENGTH_PENALTY] = "length_penalty",
    [REWARD_SOFT_OVERLONG] = "soft_overlong", [REWARD_BUILTIN_COUNT] = NULL,
};

struct Rewards {
    size_t n;
    RewardBuiltin kind[REWARD_BUILTIN_COUNT];
    RewardOptions opt;
    char *answer_column;       // owned copies, so the caller's option strings may go away
    pcre2_code *regex;         // compiled --format-regex (NULL unless regex_format is selected)
};

int reward_builtin_parse(const char *name) {
    for (int i = 0; name && i < REWARD_BUILTIN_COUNT; i++)
        if (strcmp(name, reward_builtin_names[i]) == 0) return i;
    return -1;
}

void reward_options_default(RewardOptions *o) {
    memset(o, 0, sizeof *o);
    o->answer_column = "answer";
    o->max_completion_length = 512;
    o->length_penalty_coef = 1.0;
}

// ---- small string helpers ---------------------------------------------------------------------------

static char *dup_range(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

// Trims ASCII whitespace in place at both ends of [*b, *e).
static void trim_range(const char **b, const char **e) {
    while (*b < *e && isspace((unsigned char)**b)) (*b)++;
    while (*e > *b && isspace((unsigned char)(*e)[-1])) (*e)--;
}

// Last occurrence of needle in s (NULL when absent).
static const char *find_last(const char *s, const char *needle) {
    const char *last = NULL;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) last = p;
    return last;
}

// p points at '{'. Returns the position of the matching '}' (escaped \{ \} do not count), or NULL.
static const char *match_brace(const char *p) {
    int depth = 0;
    for (; *p; p++) {
        if (*p == '\\' && (p[1] == '{' || p[1] == '}')) { p++; continue; }
        if (*p == '{') depth++;
        else if (*p == '}' && --depth == 0) return p;
    }
    return NULL;
}

static int is_word_char(char c) { return isalnum((unsigned char)c) || c == '_'; }

// ---- number tokens ----------------------------------------------------------------------------------

// Length of a decimal at s: digits with optional thousands groups ("1,234"), optional ".digits", or
// ".digits". with_exponent also takes "e-3". 0 when s does not start a decimal.
static size_t scan_decimal(const char *s, int with_exponent) {
    size_t i = 0;
    while (isdigit((unsigned char)s[i])) i++;
    if (i > 0 && i <= 3) {
        // Thousands groups: a comma followed by exactly three digits and then no further digit.
        while (s[i] == ',' && isdigit((unsigned char)s[i + 1]) && isdigit((unsigned char)s[i + 2]) &&
               isdigit((unsigned char)s[i + 3]) && !isdigit((unsigned char)s[i + 4]))
            i += 4;
    }
    if (s[i] == '.' && isdigit((unsigned char)s[i + 1])) {
        i++;
        while (isdigit((unsigned char)s[i])) i++;
    }
    if (i == 0) return 0;
    if (with_exponent && (s[i] == 'e' || s[i] == 'E')) {
        size_t j = i + 1;
        if (s[j] == '+' || s[j] == '-') j++;
        if (isdigit((unsigned char)s[j])) {
            while (isdigit((unsigned char)s[j])) j++;
            i = j;
        }
    }
    return i;
}

// Value of a decimal of length n at s (commas dropped), through strtod on a clean copy. NaN when it is too
// long to copy (no final answer has 100 digits; NaN then compares unequal to everything).
static double decimal_value(const char *s, size_t n) {
    char buf[128];
    if (n >= sizeof buf) return NAN;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i] != ',') buf[k++] = s[i];
    buf[k] = '\0';
    return strtod(buf, NULL);
}

static size_t frac_command_len(const char *s) {
    if (strncmp(s, "\\frac", 5) == 0) return 5;
    if (strncmp(s, "\\dfrac", 6) == 0 || strncmp(s, "\\tfrac", 6) == 0) return 6;
    return 0;
}

static int parse_signed(const char *s, size_t n, double *out);

// Parses \frac{a}{b} / \frac34 at s (n bytes available). Returns the bytes consumed, or 0.
static size_t parse_frac(const char *s, size_t n, double *out) {
    size_t c = frac_command_len(s);
    if (!c || c >= n) return 0;
    const char *p = s + c;
    double num, den;
    if (*p == '{') {
        const char *e1 = match_brace(p);
        if (!e1 || e1[1] != '{' || (size_t)(e1 - s) >= n) return 0;
        const char *e2 = match_brace(e1 + 1);
        if (!e2 || (size_t)(e2 - s) >= n) return 0;
        if (parse_signed(p + 1, (size_t)(e1 - p - 1), &num) != 0) return 0;
        if (parse_signed(e1 + 2, (size_t)(e2 - e1 - 2), &den) != 0) return 0;
        if (den == 0.0) return 0;
        *out = num / den;
        return (size_t)(e2 + 1 - s);
    }
    // LaTeX's shorthand: \frac34 takes one digit per argument.
    if (c + 2 <= n && isdigit((unsigned char)p[0]) && isdigit((unsigned char)p[1]) && p[1] != '0') {
        *out = (double)(p[0] - '0') / (double)(p[1] - '0');
        return c + 2;
    }
    return 0;
}

// Parses exactly n bytes: sign, then \frac, mixed number, a/b, or a decimal. 0 on success.
static int parse_signed(const char *s, size_t n, double *out) {
    const char *b = s, *e = s + n;
    trim_range(&b, &e);
    // Braces around the whole value ("{5}") carry no meaning.
    while (e - b >= 2 && *b == '{' && match_brace(b) == e - 1) {
        b++, e--;
        trim_range(&b, &e);
    }
    double sign = 1.0;
    while (b < e && (*b == '-' || *b == '+')) {
        if (*b == '-') sign = -sign;
        b++;
        trim_range(&b, &e);
    }
    size_t len = (size_t)(e - b);
    if (len == 0) return -1;
    double v;
    if (parse_frac(b, len, &v) == len) {
        *out = sign * v;
        return 0;
    }
    size_t d = scan_decimal(b, 1);
    if (d == 0) return -1;
    double whole = decimal_value(b, d);
    if (isnan(whole)) return -1;
    if (d == len) {
        *out = sign * whole;
        return 0;
    }
    const char *r = b + d;
    size_t rest = len - d;
    if (*r == '/') {  // a/b with plain decimals on both sides
        size_t d2 = scan_decimal(r + 1, 1);
        if (d2 == 0 || d2 != rest - 1) return -1;
        double den = decimal_value(r + 1, d2);
        if (den == 0.0 || isnan(den)) return -1;
        *out = sign * whole / den;
        return 0;
    }
    // Mixed number "1\frac{1}{2}": only after an integer.
    if (memchr(b, '.', d) == NULL && parse_frac(r, rest, &v) == rest && v >= 0.0) {
        *out = sign * (whole + v);
        return 0;
    }
    return -1;
}

// ---- clean-up of an extracted answer ----------------------------------------------------------------

// Removes every occurrence of `tok` from s in place. When tok ends in a letter, an occurrence followed by
// another letter is kept (so "\left" does not eat "\leftarrow").
static void remove_token(char *s, const char *tok) {
    size_t tl = strlen(tok);
    int word = isalpha((unsigned char)tok[tl - 1]);
    char *w = s;
    for (const char *r = s; *r;) {
        if (strncmp(r, tok, tl) == 0 && !(word && isalpha((unsigned char)r[tl]))) {
            r += tl;
            continue;
        }
        *w++ = *r++;
    }
    *w = '\0';
}

static const char *const text_wrappers[] = {"\\text", "\\textbf", "\\textrm", "\\mathrm", "\\mathbf", "\\mbox", NULL};

// If s (length n) is exactly one "\text{...}"-like group, returns the length of the command name.
static size_t wrapper_at(const char *s) {
    for (int i = 0; text_wrappers[i]; i++) {
        size_t l = strlen(text_wrappers[i]);
        if (strncmp(s, text_wrappers[i], l) == 0 && s[l] == '{') return l;
    }
    return 0;
}

// Cleaned copy of an answer: see reward_parse_number in rewards.h. NULL on out of memory.
static char *clean_answer(const char *in) {
    size_t n = strlen(in);
    char *s = malloc(n + 1);
    if (!s) return NULL;
    // U+2212 MINUS SIGN (e2 88 92) becomes '-' ; the copy can only shrink.
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if ((unsigned char)in[i] == 0xe2 && (unsigned char)in[i + 1] == 0x88 && (unsigned char)in[i + 2] == 0x92) {
            s[k++] = '-';
            i += 2;
        } else {
            s[k++] = in[i];
        }
    }
    s[k] = '\0';
    static const char *const drop[] = {"\\left.", "\\right.", "\\left", "\\right", "\\displaystyle", "\\!",
                                       "\\,", "\\;", "\\:", "\\ ", "{,}", "\\$", "$", "\\%", "%", "^\\circ",
                                       "^{\\circ}", NULL};
    for (int i = 0; drop[i]; i++) remove_token(s, drop[i]);

    const char *b = s, *e = s + strlen(s);
    trim_range(&b, &e);
    // Unwrap one \text{...} spanning everything; otherwise drop trailing \text{...} groups (units).
    for (;;) {
        size_t wl = wrapper_at(b);
        if (wl && match_brace(b + wl) == e - 1) {
            b += wl + 1, e -= 1;
            trim_range(&b, &e);
            continue;
        }
        break;
    }
    for (;;) {
        const char *last = NULL;
        for (const char *p = b; p < e; p++)
            if (*p == '\\' && wrapper_at(p)) last = p;
        if (!last || last == b) break;
        const char *close = match_brace(last + wrapper_at(last));
        if (!close || close != e - 1) break;
        e = last;
        trim_range(&b, &e);
    }
    // "x = 5" -> "5"; a trailing sentence period goes.
    for (const char *p = e; p > b; p--) {
        if (p[-1] == '=') {
            b = p;
            trim_range(&b, &e);
            break;
        }
    }
    while (e > b && e[-1] == '.') {
        e--;
        trim_range(&b, &e);
    }
    memmove(s, b, (size_t)(e - b));
    s[e - b] = '\0';
    return s;
}

int reward_parse_number(const char *text, double *out) {
    char *s = clean_answer(text);
    if (!s) return -1;
    int rc = parse_signed(s, strlen(s), out);
    free(s);
    return rc;
}

// ---- final-answer extraction ------------------------------------------------------------------------

// Content of the last complete \boxed{...} / \fbox{...} (or "\boxed 5") in text: 1 found, 0 none, -1 OOM.
static int extract_boxed(const char *text, char **out) {
    const char *best_p = NULL, *best_b = NULL, *best_e = NULL;
    static const char *const cmds[] = {"\\boxed", "\\fbox", NULL};
    for (int c = 0; cmds[c]; c++) {
        size_t cl = strlen(cmds[c]);
        for (const char *p = strstr(text, cmds[c]); p; p = strstr(p + 1, cmds[c])) {
            const char *a = p + cl, *b = NULL, *e = NULL;
            if (*a == '{') {
                const char *close = match_brace(a);
                if (!close) continue;  // truncated: this one is not a final answer
                b = a + 1, e = close;
            } else if (*a == ' ') {
                b = a + 1;
                e = b;
                while (*e && !isspace((unsigned char)*e) && *e != '$') e++;
                if (e == b) continue;
            } else {
                continue;
            }
            if (!best_p || p > best_p) best_p = p, best_b = b, best_e = e;
        }
    }
    if (!best_b) return 0;
    *out = dup_range(best_b, (size_t)(best_e - best_b));
    return *out ? 1 : -1;
}

// The last number-like token of [s, end): a \frac{..}{..}, or a decimal with optional "/decimal", with
// its minus sign when the '-' stands alone (not "5-3"). Returns 1 with [*tb, *te), 0 when none.
static int last_number_token(const char *s, const char *end, const char **tb, const char **te) {
    int found = 0;
    for (const char *p = s; p < end;) {
        const char *start = p, *stop = NULL;
        double v;
        size_t fl = frac_command_len(p) ? parse_frac(p, (size_t)(end - p), &v) : 0;
        if (fl) {
            stop = p + fl;
        } else if ((isdigit((unsigned char)*p) || (*p == '.' && p + 1 < end && isdigit((unsigned char)p[1]))) &&
                   (p == s || !isdigit((unsigned char)p[-1]))) {
            size_t d = scan_decimal(p, 0);
            stop = p + d;
            if (stop < end && *stop == '/' && stop + 1 < end && isdigit((unsigned char)stop[1]))
                stop += 1 + scan_decimal(stop + 1, 0);
            if (p > s && p[-1] == '.') {  // ".5" is taken whole above; "3.x" fragments are not
                p = stop;
                continue;
            }
        }
        if (!stop || stop > end) {
            p++;
            continue;
        }
        if (start > s && start[-1] == '-') {
            const char *m = start - 1;
            if (m == s || !(is_word_char(m[-1]) || m[-1] == ')' || m[-1] == ']' || m[-1] == '}')) start = m;
        }
        *tb = start, *te = stop;
        found = 1;
        p = stop;
    }
    return found;
}

int reward_extract_answer(const char *text, char **out) {
    *out = NULL;
    if (!text) return 0;
    int rc = extract_boxed(text, out);
    if (rc != 0) return rc;
    const char *h = find_last(text, "####");
    if (h) {
        const char *b = h + 4, *e = b;
        while (*e && *e != '\n') e++;
        trim_range(&b, &e);
        if (b < e) {
            char *line = dup_range(b, (size_t)(e - b));
            if (!line) return -1;
            double v;
            const char *tb, *te;
            // "#### The answer is 42": keep the number when the line is not a number itself.
            if (reward_parse_number(line, &v) != 0 && last_number_token(b, e, &tb, &te)) {
                free(line);
                line = dup_range(tb, (size_t)(te - tb));
                if (!line) return -1;
            }
            *out = line;
            return 1;
        }
    }
    const char *tb, *te;
    if (last_number_token(text, text + strlen(text), &tb, &te)) {
        *out = dup_range(tb, (size_t)(te - tb));
        return *out ? 1 : -1;
    }
    return 0;
}

// ---- the rewards ------------------------------------------------------------------------------------

// Text with all whitespace removed (for the non-numeric comparison).
static void squeeze_spaces(char *s) {
    char *w = s;
    for (const char *r = s; *r; r++)
        if (!isspace((unsigned char)*r)) *w++ = *r;
    *w = '\0';
}

// The reference answer text of a dataset value: a number as is, a solution text reduced like a completion.
// Returns 1 (number in *num), 2 (text in *txt, malloc'd), 0 (no usable reference), -1 OOM.
static int reference_of(const json_t *ref, double *num, char **txt) {
    if (!ref) return 0;
    if (json_is_number(ref)) {
        *num = json_number_value(ref);
        return 1;
    }
    if (!json_is_string(ref)) return 0;
    const char *s = json_string_value(ref);
    if (strstr(s, "####") || strstr(s, "\\boxed") || strstr(s, "\\fbox")) {
        int rc = reward_extract_answer(s, txt);
        if (rc <= 0) return rc;
    } else {
        *txt = strdup(s);
        if (!*txt) return -1;
    }
    return 2;
}

double reward_answer_match(const char *completion, const json_t *reference) {
    double ref_num = 0.0;
    char *ref_txt = NULL, *ans = NULL;
    int kind = reference_of(reference, &ref_num, &ref_txt);
    if (kind <= 0) return NAN;
    int ref_is_num = kind == 1 || reward_parse_number(ref_txt, &ref_num) == 0;
    if (!ref_is_num) {
        char *cr = clean_answer(ref_txt);
        int empty = !cr || (squeeze_spaces(cr), cr[0] == '\0');
        free(cr);
        if (empty) {  // "" (or only markup) is no reference at all
            free(ref_txt);
            return NAN;
        }
    }
    double result = 0.0;
    if (reward_extract_answer(completion, &ans) == 1) {
        double a;
        if (ref_is_num && reward_parse_number(ans, &a) == 0) {
            double scale = fmax(fabs(a), fabs(ref_num));
            result = (a == ref_num || fabs(a - ref_num) <= 1e-9 * scale) ? 1.0 : 0.0;
        } else if (!ref_is_num) {
            char *ca = clean_answer(ans), *cr = clean_answer(ref_txt);
            if (ca && cr) {
                squeeze_spaces(ca);
                squeeze_spaces(cr);
                result = (ca[0] != '\0' && strcmp(ca, cr) == 0) ? 1.0 : 0.0;
            }
            free(ca);
            free(cr);
        }
    }
    free(ans);
    free(ref_txt);
    return result;
}

double reward_think_format(const char *c) {
    // ^<think>(?!.*<think>)(.*?)</think>.*$ with DOTALL, anchored at 0: the text after the opening tag holds
    // no second "<think>" and does hold a "</think>".
    if (!c || strncmp(c, "<think>", 7) != 0) return 0.0;
    const char *rest = c + 7;
    return (strstr(rest, "<think>") == NULL && strstr(rest, "</think>") != NULL) ? 1.0 : 0.0;
}

double reward_soft_overlong(int len, int max_len, int cache) {
    if (len <= max_len - cache) return 0.0;
    if (len <= max_len) return (double)(max_len - cache - len) / (double)cache;
    return -1.0;
}

double reward_length_penalty(int len, int max_len, int target, double coef) {
    int over = len - target;
    if (over <= 0) return 0.0;
    int span = max_len - target;
    return -coef * (double)over / (double)(span > 1 ? span : 1);
}

// ---- the set ----------------------------------------------------------------------------------------

static int validate_options(const Rewards *r, const RewardOptions *o, char *err, size_t err_len) {
    for (size_t i = 0; i < r->n; i++) {
        switch (r->kind[i]) {
        case REWARD_ANSWER_MATCH:
            if (!o->answer_column || !o->answer_column[0]) {
                err_fail(err, err_len, "answer_column: answer_match needs the name of the dataset's answer column");
                return -1;
            }
            break;
        case REWARD_REGEX_FORMAT:
            if (!o->format_regex || !o->format_regex[0]) {
                err_fail(err, err_len, "format_regex: regex_format is selected but no pattern is given");
                return -1;
            }
            break;
        case REWARD_LENGTH_PENALTY:
        case REWARD_SOFT_OVERLONG:
            if (o->max_completion_length <= 0) {
                err_fail(err, err_len, "max_completion_length: must be > 0 for %s (got %d)",
                        reward_builtin_names[r->kind[i]], o->max_completion_length);
                return -1;
            }
            if (r->kind[i] == REWARD_SOFT_OVERLONG &&
                (o->soft_punish_cache <= 0 || o->soft_punish_cache > o->max_completion_length)) {
                err_fail(err, err_len, "soft_punish_cache: soft_overlong needs 0 < soft_punish_cache <= "
                        "max_completion_length (%d); got %d", o->max_completion_length, o->soft_punish_cache);
                return -1;
            }
            if (r->kind[i] == REWARD_LENGTH_PENALTY) {
                if (!(o->length_penalty_coef >= 0.0) || !isfinite(o->length_penalty_coef)) {
                    err_fail(err, err_len, "length_penalty_coef: must be a finite number >= 0 (got %g)",
                            o->length_penalty_coef);
                    return -1;
                }
                if (o->length_penalty_target < 0 || o->length_penalty_target >= o->max_completion_length) {
                    err_fail(err, err_len, "length_penalty_target: must be >= 0 and < max_completion_length (%d); "
                            "got %d", o->max_completion_length, o->length_penalty_target);
                    return -1;
                }
            }
            break;
        default:
            break;
        }
    }
    return 0;
}

int rewards_create(Rewards **out, const char *const *names, size_t n, const RewardOptions *opt, char *err,
                   size_t err_len) {
    *out = NULL;
    Rewards *r = calloc(1, sizeof *r);
    if (!r) {
        err_fail(err, err_len, "rewards: out of memory");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        int k = reward_builtin_parse(names[i]);
        if (k < 0) {
            err_fail(err, err_len, "rewards: unknown built-in reward '%s' (known: answer_match, regex_format, "
                    "think_format, length_penalty, soft_overlong)", names[i] ? names[i] : "(null)");
            rewards_free(r);
            return -1;
        }
        for (size_t j = 0; j < r->n; j++) {
            if (r->kind[j] == (RewardBuiltin)k) {
                err_fail(err, err_len, "rewards: '%s' is listed twice", names[i]);
                rewards_free(r);
                return -1;
            }
        }
        r->kind[r->n++] = (RewardBuiltin)k;
    }
    if (validate_options(r, opt, err, err_len) != 0) {
        rewards_free(r);
        return -1;
    }
    r->opt = *opt;
    r->answer_column = strdup(opt->answer_column ? opt->answer_column : "answer");
    if (!r->answer_column) {
        err_fail(err, err_len, "rewards: out of memory");
        rewards_free(r);
        return -1;
    }
    r->opt.answer_column = r->answer_column;
    r->opt.format_regex = NULL;  // only the compiled form is kept
    for (size_t i = 0; i < r->n; i++) {
        if (r->kind[i] != REWARD_REGEX_FORMAT) continue;
        int ec;
        PCRE2_SIZE eo;
        r->regex = pcre2_compile((PCRE2_SPTR)opt->format_regex, PCRE2_ZERO_TERMINATED,
                                 PCRE2_UTF | PCRE2_MATCH_INVALID_UTF, &ec, &eo, NULL);
        if (!r->regex) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(ec, msg, sizeof msg);
            err_fail(err, err_len, "format_regex: the pattern does not compile at offset %zu: %s", (size_t)eo,
                    (const char *)msg);
            rewards_free(r);
            return -1;
        }
        pcre2_jit_compile(r->regex, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when JIT is missing
    }
    *out = r;
    return 0;
}

void rewards_free(Rewards *r) {
    if (!r) return;
    pcre2_code_free(r->regex);
    free(r->answer_column);
    free(r);
}

size_t rewards_count(const Rewards *r) { return r ? r->n : 0; }

const char *rewards_name(const Rewards *r, size_t i) {
    return (r && i < r->n) ? reward_builtin_names[r->kind[i]] : NULL;
}

int rewards_score(const Rewards *r, const RewardSample *samples, size_t n, double *scores, size_t ld, char *err,
                  size_t err_len) {
    if (!r || (n && (!samples || !scores)) || ld < r->n) {
        err_fail(err, err_len, "rewards_score: bad arguments (ld %zu < %zu rewards, or NULL buffers)", ld,
                r ? r->n : (size_t)0);
        return -1;
    }
    pcre2_match_data *md = NULL;
    if (r->regex) {
        md = pcre2_match_data_create_from_pattern(r->regex, NULL);
        if (!md) {
            err_fail(err, err_len, "rewards_score: out of memory");
            return -1;
        }
    }
    const RewardOptions *o = &r->opt;
    for (size_t i = 0; i < n; i++) {
        const RewardSample *s = &samples[i];
        const char *c = s->completion ? s->completion : "";
        for (size_t f = 0; f < r->n; f++) {
            double v = NAN;
            switch (r->kind[f]) {
            case REWARD_ANSWER_MATCH: {
                const json_t *ref = s->columns ? json_object_get(s->columns, o->answer_column) : NULL;
                v = reward_answer_match(c, ref);
                break;
            }
            case REWARD_REGEX_FORMAT: {
                uint32_t flags = o->format_regex_search ? 0 : (PCRE2_ANCHORED | PCRE2_ENDANCHORED);
                int mrc = pcre2_match(r->regex, (PCRE2_SPTR)c, strlen(c), 0, flags, md, NULL);
                if (mrc >= 0) {
                    v = 1.0;
                } else if (mrc == PCRE2_ERROR_NOMATCH) {
                    v = 0.0;
                } else {
                    PCRE2_UCHAR msg[256];
                    pcre2_get_error_message(mrc, msg, sizeof msg);
                    err_fail(err, err_len, "regex_format: matching completion %zu failed: %s", i,
                            (const char *)msg);
                    pcre2_match_data_free(md);
                    return -1;
                }
                break;
            }
            case REWARD_THINK_FORMAT:
                v = reward_think_format(c);
                break;
            case REWARD_LENGTH_PENALTY:
                v = reward_length_penalty(s->completion_tokens, o->max_completion_length, o->length_penalty_target,
                                          o->length_penalty_coef);
                break;
            case REWARD_SOFT_OVERLONG:
                v = reward_soft_overlong(s->completion_tokens, o->max_completion_length, o->soft_punish_cache);
                break;
            default:
                break;
            }
            scores[i * ld + f] = v;
        }
    }
    pcre2_match_data_free(md);
    return 0;
}
