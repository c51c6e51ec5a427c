// trainer/train_config.c — reading options from flags and from a JSON config file (rules in train_config.h).
// Every value goes through one JSON setter: a flag's text is first turned into the JSON value of the
// option's type, so a flag and a file key are checked by the same code.
#include <errno.h>
#include <stdarg.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "shared/json_read.h"
#include "trainer/train_config_internal.h"
#include "shared/err.h"

// ---- did-you-mean -----------------------------------------------------------------------------------

static size_t edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return 64;
    size_t row[64];
    for (size_t j = 0; j <= lb; j++) row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
            size_t v = diag + cost;
            if (row[j] + 1 < v) v = row[j] + 1;
            if (row[j - 1] + 1 < v) v = row[j - 1] + 1;
            row[j] = v;
            diag = up;
        }
    }
    return row[lb];
}

// The closest known key when it is close enough to be a typo, else NULL.
static const char *suggest_key(const char *key) {
    const char *best = NULL;
    size_t best_d = (size_t)-1, len = strlen(key);
    for (size_t i = 0; i < train_options_count; i++) {
        size_t d = edit_distance(key, train_options[i].key);
        if (d < best_d) best_d = d, best = train_options[i].key;
    }
    size_t limit = len < 6 ? 1 : (len < 12 ? 2 : 3);
    return best_d <= limit ? best : NULL;
}

static const char *suggest_choice(const OptionSpec *o, const char *v) {
    const char *best = NULL;
    size_t best_d = 3;
    for (int i = 0; o->choice(i); i++) {
        size_t d = edit_distance(v, o->choice(i));
        if (d < best_d) best_d = d, best = o->choice(i);
    }
    return best;
}

// ---- setting one option from JSON -------------------------------------------------------------------

// Message prefix naming where a value came from.
typedef struct {
    const char *path;    // config file, or NULL for the command line
} Source;

static int is_flag_src(const Source *s) { return s->path == NULL; }

static void flag_name(const char *key, char *buf, size_t cap) {
    snprintf(buf, cap, "--%s", key);
    for (char *p = buf + 2; *p; p++)
        if (*p == '_') *p = '-';
}

#define SRC_FMT "%s%s"
#define SRC_ARGS(src) (src)->path ? (src)->path : "", (src)->path ? ": " : ""

static int fail_type(const Source *src, const OptionSpec *o, const char *what, char *err, size_t err_len) {
    err_fail(err, err_len, SRC_FMT "%s: expected %s", SRC_ARGS(src), o->key, what);
    return -1;
}

static int set_string(char **dst, const char *s) {
    char *d = s ? strdup(s) : NULL;
    if (s && !d) return -1;
    free(*dst);
    *dst = d;
    return 0;
}

static int set_from_json(TrainConfig *cfg, const OptionSpec *o, const json_t *v, const Source *src, char *err,
                         size_t err_len) {
    char *base = (char *)cfg;
    if (o->flags & OPTF_FLAG_ONLY) {
        err_fail(err, err_len, SRC_FMT "%s: only valid on the command line", SRC_ARGS(src), o->key);
        return -1;
    }
    if ((o->flags & OPTF_NULLABLE) && json_is_null(v)) {
        switch (o->type) {
        case OPT_INT: case OPT_BOOL: *(int *)(base + o->off) = (int)o->null_value; return 0;
        case OPT_LONG: *(long *)(base + o->off) = (long)o->null_value; return 0;
        case OPT_F64: *(double *)(base + o->off) = o->null_value; return 0;
        default: break;
        }
    }
    if (o->flags & OPTF_GRPO) {
        // Type check first, so the message is the same for every key; then the GRPO module sets it.
        int ok = 1;
        switch (o->type) {
        case OPT_INT: ok = json_is_integer(v); break;
        case OPT_F64: ok = json_is_number(v); break;
        case OPT_OPT_F64: ok = json_is_number(v) || json_is_null(v); break;
        case OPT_BOOL: ok = json_is_boolean(v); break;
        case OPT_ENUM: ok = json_is_string(v) || (json_is_boolean(v) && strcmp(o->key, "scale_rewards") == 0); break;
        default: break;
        }
        if (!ok) {
            const char *what = o->type == OPT_INT ? "an integer" : o->type == OPT_F64 ? "a number"
                             : o->type == OPT_OPT_F64 ? "a number or null" : o->type == OPT_BOOL ? "true or false"
                             : "a string";
            return fail_type(src, o, what, err, err_len);
        }
        char gerr[512];
        int rc = grpo_options_set_json(&cfg->grpo, o->key, v, gerr, sizeof gerr);
        if (rc == 1) return 0;
        if (rc == 0) snprintf(gerr, sizeof gerr, "%s: not known to the GRPO options (internal table mismatch)",
                              o->key);
        if (o->type == OPT_ENUM && json_is_string(v)) {
            const char *s = suggest_choice(o, json_string_value(v));
            if (s) {
                size_t l = strlen(gerr);
                snprintf(gerr + l, sizeof gerr - l, " (did you mean '%s'?)", s);
            }
        }
        err_fail(err, err_len, SRC_FMT "%s", SRC_ARGS(src), gerr);
        return -1;
    }
    switch (o->type) {
    case OPT_INT:
    case OPT_LONG: {
        if (!json_is_integer(v)) return fail_type(src, o, "an integer", err, err_len);
        json_int_t x = json_integer_value(v);
        if (o->type == OPT_INT && (x < -2147483647LL || x > 2147483647LL)) {
            err_fail(err, err_len, SRC_FMT "%s: %lld is out of range", SRC_ARGS(src), o->key, (long long)x);
            return -1;
        }
        if (o->type == OPT_INT) *(int *)(base + o->off) = (int)x;
        else *(long *)(base + o->off) = (long)x;
        return 0;
    }
    case OPT_F64:
        if (!json_is_number(v)) return fail_type(src, o, "a number", err, err_len);
        *(double *)(base + o->off) = json_number_value(v);
        return 0;
    case OPT_OPT_F64:
        if (json_is_null(v)) {
            *(int *)(base + o->aux_off) = 0;
            return 0;
        }
        if (!json_is_number(v)) return fail_type(src, o, "a number or null", err, err_len);
        *(double *)(base + o->off) = json_number_value(v);
        *(int *)(base + o->aux_off) = 1;
        return 0;
    case OPT_BOOL:
        if (!json_is_boolean(v)) return fail_type(src, o, "true or false", err, err_len);
        *(int *)(base + o->off) = json_is_true(v);
        return 0;
    case OPT_STR:
        if (json_is_null(v)) return set_string((char **)(base + o->off), NULL);
        if (!json_is_string(v)) return fail_type(src, o, "a string", err, err_len);
        if (set_string((char **)(base + o->off), json_string_value(v)) != 0) goto oom;
        return 0;
    case OPT_ENUM: {
        if (!json_is_string(v)) return fail_type(src, o, "a string", err, err_len);
        const char *s = json_string_value(v);
        for (int i = 0; o->choice(i); i++) {
            if (strcmp(s, o->choice(i)) == 0) {
                *(int *)(base + o->off) = i;
                return 0;
            }
        }
        char list[256] = "";
        size_t used = 0;
        for (int i = 0; o->choice(i) && used < sizeof list; i++)
            used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", o->choice(i));
        const char *sug = suggest_choice(o, s);
        err_fail(err, err_len, SRC_FMT "%s: unknown value '%s' (one of: %s)%s%s%s", SRC_ARGS(src), o->key, s, list,
                sug ? " — did you mean '" : "", sug ? sug : "", sug ? "'?" : "");
        return -1;
    }
    case OPT_STRLIST:
    case OPT_CSV: {
        // A JSON list of strings, or one string of comma-separated items; null clears.
        json_t *items = NULL;
        if (json_is_null(v)) {
            items = json_array();
        } else if (json_is_array(v)) {
            items = json_incref((json_t *)v);
        } else if (json_is_string(v)) {
            items = json_array();
            const char *s = json_string_value(v);
            while (items && *s) {
                const char *c = strchr(s, ',');
                size_t n = c ? (size_t)(c - s) : strlen(s);
                while (n && (*s == ' ')) s++, n--;
                while (n && s[n - 1] == ' ') n--;
                if (n) json_array_append_new(items, json_stringn(s, n));
                s += (c ? (size_t)(c - s) + 1 : strlen(s));
            }
        } else {
            return fail_type(src, o, "a list of strings", err, err_len);
        }
        if (!items) goto oom;
        size_t n = json_array_size(items), total = 0;
        for (size_t k = 0; k < n; k++) {
            const json_t *it = json_array_get(items, k);
            if (!json_is_string(it) || !json_string_length(it)) {
                json_decref(items);
                err_fail(err, err_len, SRC_FMT "%s: item %zu must be a non-empty string", SRC_ARGS(src), o->key, k);
                return -1;
            }
            total += json_string_length(it) + 1;
        }
        if (o->type == OPT_CSV) {
            char *joined = n ? malloc(total) : NULL;
            if (n && !joined) {
                json_decref(items);
                goto oom;
            }
            size_t used = 0;
            for (size_t k = 0; k < n; k++)
                used += (size_t)sprintf(joined + used, "%s%s", k ? "," : "",
                                        json_string_value(json_array_get(items, k)));
            free(*(char **)(base + o->off));
            *(char **)(base + o->off) = joined;
        } else {
            char **list = calloc(n ? n : 1, sizeof *list);
            for (size_t k = 0; list && k < n; k++)
                if (!(list[k] = strdup(json_string_value(json_array_get(items, k))))) {
                    for (size_t j = 0; j < k; j++) free(list[j]);
                    free(list);
                    list = NULL;
                }
            if (!list) {
                json_decref(items);
                goto oom;
            }
            char **old = *(char ***)(base + o->off);
            size_t old_n = *(size_t *)(base + o->aux_off);
            for (size_t j = 0; j < old_n; j++) free(old[j]);
            free(old);
            *(char ***)(base + o->off) = list;
            *(size_t *)(base + o->aux_off) = n;
        }
        json_decref(items);
        return 0;
    }
    case OPT_F64LIST: {
        double **dst = (double **)(base + o->off);
        size_t *cnt = (size_t *)(base + o->aux_off);
        if (json_is_null(v)) {
            free(*dst);
            *dst = NULL, *cnt = 0;
            return 0;
        }
        if (!json_is_array(v) || json_array_size(v) == 0)
            return fail_type(src, o, "a non-empty list of numbers", err, err_len);
        size_t n = json_array_size(v);
        double *l = malloc(n * sizeof *l);
        if (!l) goto oom;
        for (size_t k = 0; k < n; k++) {
            const json_t *it = json_array_get(v, k);
            if (!json_is_number(it)) {
                free(l);
                err_fail(err, err_len, SRC_FMT "%s: item %zu is not a number", SRC_ARGS(src), o->key, k);
                return -1;
            }
            l[k] = json_number_value(it);
        }
        free(*dst);
        *dst = l, *cnt = n;
        return 0;
    }
    }
    return -1;
oom:
    err_fail(err, err_len, "%s: out of memory", o->key);
    return -1;
}

static int note_ignored(TrainConfig *cfg, const char *key) {
    for (size_t i = 0; i < cfg->n_ignored; i++)
        if (strcmp(cfg->ignored[i], key) == 0) return 0;
    char **n = realloc(cfg->ignored, (cfg->n_ignored + 1) * sizeof *n);
    if (!n) return -1;
    cfg->ignored = n;
    if (!(cfg->ignored[cfg->n_ignored] = strdup(key))) return -1;
    cfg->n_ignored++;
    return 0;
}

// SFTConfig's loss_type values on the GRPO loss_type key: "nll" is the sft loss (recorded, and refused in grpo mode
// by train_config_finalize); "dft" is not implemented. 1: handled (0 returned in *rc), 0: a GRPO value.
static int sft_loss_type(TrainConfig *cfg, const json_t *v, const Source *src, int *rc, char *err, size_t err_len) {
    if (!json_is_string(v)) return 0;
    const char *s = json_string_value(v);
    if (strcmp(s, "nll") == 0) {
        cfg->loss_type_nll = 1;
        *rc = 0;
        return 1;
    }
    if (strcmp(s, "dft") == 0) {
        *rc = err_fail(err, err_len, SRC_FMT "loss_type: \"dft\" (SFTConfig's dynamic fine-tuning loss) is not "
                       "implemented; mode sft trains with \"nll\" (its default)", SRC_ARGS(src));
        return 1;
    }
    return 0;
}

// Looks a key up and sets it: a tandem option, or a TRL key of train_config_trl.c's table (accepted and noted in
// cfg->ignored, or refused naming what to do), or the unknown-key message.
static int set_key(TrainConfig *cfg, const char *key, const json_t *v, const Source *src, char *err, size_t err_len) {
    const OptionSpec *o = train_option_find(key);
    int rc;
    if (o && strcmp(o->key, "loss_type") == 0 && sft_loss_type(cfg, v, src, &rc, err, err_len)) return rc;
    if (o && strcmp(o->key, "loss_type") == 0) cfg->loss_type_nll = 0;
    if (o) return set_from_json(cfg, o, v, src, err, err_len);
    const TrlKey *k = trl_key_find(key);
    if (k) {
        if (trl_key_accepts(k, v)) return note_ignored(cfg, key);
        char *given = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
        err_fail(err, err_len, SRC_FMT "%s: %s is not supported by tandem (accepted: %s): %s", SRC_ARGS(src), key,
                 given ? given : "this value", k->values, k->why);
        free(given);
        return -1;
    }
    const char *sug = suggest_key(key);
    if (is_flag_src(src)) {
        char flag[128], sflag[128];
        flag_name(key, flag, sizeof flag);
        if (sug) flag_name(sug, sflag, sizeof sflag);
        err_fail(err, err_len, "unknown flag %s%s%s%s", flag, sug ? " (did you mean " : "", sug ? sflag : "",
                sug ? "?)" : "");
    } else {
        err_fail(err, err_len, "%s: unknown key '%s'%s%s%s", src->path, key, sug ? " (did you mean '" : "",
                sug ? sug : "", sug ? "'?)" : "");
    }
    return -1;
}

// ---- flags: text -> JSON value ----------------------------------------------------------------------

static int parse_bool_text(const char *s, int *out) {
    static const char *const t[] = {"true", "1", "yes", "on", NULL}, *const f[] = {"false", "0", "no", "off", NULL};
    for (int i = 0; t[i]; i++)
        if (strcasecmp(s, t[i]) == 0) return *out = 1, 0;
    for (int i = 0; f[i]; i++)
        if (strcasecmp(s, f[i]) == 0) return *out = 0, 0;
    return -1;
}

static int is_none_text(const char *s) { return strcasecmp(s, "none") == 0 || strcasecmp(s, "null") == 0; }

// Strict number parsing: the whole text, finite.
static int parse_double_text(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno == ERANGE || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

static int parse_int_text(const char *s, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno == ERANGE) return -1;
    *out = v;
    return 0;
}

// Converts a flag's text into the JSON value of the option's type. NULL with a message when it does not fit.
static json_t *text_to_json(const OptionSpec *o, const char *text, char *err, size_t err_len) {
    char flag[128];
    flag_name(o->key, flag, sizeof flag);
    if ((o->flags & OPTF_NULLABLE) && is_none_text(text)) return json_null();
    switch (o->type) {
    case OPT_INT:
    case OPT_LONG: {
        long long x;
        if (parse_int_text(text, &x) == 0) return json_integer(x);
        err_fail(err, err_len, "%s (%s): expected an integer, got \"%s\"", o->key, flag, text);
        return NULL;
    }
    case OPT_F64:
    case OPT_OPT_F64: {
        double x;
        if (o->type == OPT_OPT_F64 && is_none_text(text)) return json_null();
        if (parse_double_text(text, &x) == 0) return json_real(x);
        err_fail(err, err_len, "%s (%s): expected a number%s, got \"%s\"", o->key, flag,
                o->type == OPT_OPT_F64 ? " or none" : "", text);
        return NULL;
    }
    case OPT_BOOL: {
        int b;
        if (parse_bool_text(text, &b) == 0) return json_boolean(b);
        err_fail(err, err_len, "%s (%s): expected true or false, got \"%s\"", o->key, flag, text);
        return NULL;
    }
    case OPT_ENUM: {
        int b;
        if (strcmp(o->key, "scale_rewards") == 0 && parse_bool_text(text, &b) == 0) return json_boolean(b);
        return json_string(text);
    }
    case OPT_STR:
        if (is_none_text(text)) return json_null();
        return json_string(text);
    case OPT_STRLIST:
    case OPT_CSV:
        if (is_none_text(text)) return json_null();
        return json_string(text);
    case OPT_F64LIST: {
        if (is_none_text(text)) return json_null();
        json_t *arr = json_array();
        const char *s = text;
        while (arr) {
            const char *c = strchr(s, ',');
            size_t n = c ? (size_t)(c - s) : strlen(s);
            char num[64];
            double x;
            if (n == 0 || n >= sizeof num) goto bad;
            memcpy(num, s, n);
            num[n] = '\0';
            if (parse_double_text(num, &x) != 0) goto bad;
            json_array_append_new(arr, json_real(x));
            if (!c) break;
            s = c + 1;
        }
        return arr;
    bad:
        json_decref(arr);
        err_fail(err, err_len, "%s (%s): expected comma-separated numbers, got \"%s\"", o->key, flag, text);
        return NULL;
    }
    }
    return NULL;
}

int train_config_set(TrainConfig *cfg, const char *key_in, const char *value, char *err, size_t err_len) {
    char key[128];
    snprintf(key, sizeof key, "%s", key_in);
    for (char *p = key; *p; p++)
        if (*p == '-') *p = '_';
    Source src = {NULL};
    const OptionSpec *o = train_option_find(key);
    if (!o) {
        // Unknown, or a TRL key tandem ignores or refuses: read the text as JSON when it is JSON
        // ("false", "0.6", "null"), so it compares with TRL's default; else as a string.
        json_t *v = json_read_buffer(value, strlen(value), JSON_DECODE_ANY, NULL);
        if (!v) v = json_string(value);
        int rc = set_key(cfg, key, v, &src, err, err_len);
        json_decref(v);
        return rc;
    }
    json_t *v = text_to_json(o, value, err, err_len);
    if (!v) return -1;
    int rc = set_from_json(cfg, o, v, &src, err, err_len);
    json_decref(v);
    if (rc != 0 && err && strncmp(err, o->key, strlen(o->key)) == 0 && err[strlen(o->key)] == ':') {
        // Messages from the JSON setter name the key; add the flag spelling for command-line users.
        char flag[128], tmp[1024];
        flag_name(o->key, flag, sizeof flag);
        snprintf(tmp, sizeof tmp, "%s", err);
        err_fail(err, err_len, "%s (%s)%s", o->key, flag, tmp + strlen(o->key));
    }
    return rc;
}

void problems_add(Problems *p, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (p->used < sizeof p->text) {
        if (p->n) p->used += (size_t)snprintf(p->text + p->used, sizeof p->text - p->used, "\n  ");
        if (p->used < sizeof p->text) {
            int w = vsnprintf(p->text + p->used, sizeof p->text - p->used, fmt, ap);
            p->used += w > 0 ? (size_t)w : 0;
        }
        if (p->used > sizeof p->text - 1) p->used = sizeof p->text - 1;
    }
    va_end(ap);
    p->n++;
}

int problems_report(const Problems *p, char *err, size_t err_len) {
    if (p->n == 0) return 0;
    if (p->n == 1) return err_fail(err, err_len, "%s", p->text);
    return err_fail(err, err_len, "%d problems:\n  %s", p->n, p->text);
}

// Applies every key of a JSON object, each problem added to probs (one run lists every problem of a file).
static void apply_json_into(TrainConfig *cfg, const char *text, size_t len, const char *path, Problems *probs) {
    const char *name = path ? path : "config";
    json_error_t je;
    json_t *root = json_read_buffer(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        problems_add(probs, "%s: invalid JSON at line %d column %d: %s", name, je.line, je.column, je.text);
        return;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        problems_add(probs, "%s: the config must be a JSON object of option keys", name);
        return;
    }
    Source src = {name};
    const char *key;
    json_t *v;
    // Key order does not matter: the one order-sensitive pair (the deprecated vllm_importance_sampling_cap
    // over vllm_importance_sampling_clip_max) is resolved inside grpo_options_set_json, as TRL does.
    json_object_foreach(root, key, v) {
        char kerr[2048];
        if (set_key(cfg, key, v, &src, kerr, sizeof kerr) != 0) problems_add(probs, "%s", kerr);
    }
    json_decref(root);
}

int train_config_apply_json(TrainConfig *cfg, const char *text, size_t len, const char *path, char *err,
                            size_t err_len) {
    Problems probs = {0};
    apply_json_into(cfg, text, len, path, &probs);
    return problems_report(&probs, err, err_len);
}

static void load_file_into(TrainConfig *cfg, const char *path, Problems *probs) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        problems_add(probs, "config: cannot open %s: %s", path, strerror(errno));
        return;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    char chunk[8192];
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (len + n > cap) {
            cap = (len + n) * 2;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                problems_add(probs, "config: out of memory reading %s", path);
                return;
            }
            buf = nb;
        }
        memcpy(buf + len, chunk, n);
        len += n;
    }
    int rd_err = ferror(f);
    fclose(f);
    if (rd_err) {
        free(buf);
        problems_add(probs, "config: read error on %s", path);
        return;
    }
    apply_json_into(cfg, buf ? buf : "", len, path, probs);
    free(buf);
    if (set_string(&cfg->config_file, path) != 0) problems_add(probs, "config: out of memory");
}

int train_config_load_file(TrainConfig *cfg, const char *path, char *err, size_t err_len) {
    Problems probs = {0};
    load_file_into(cfg, path, &probs);
    return problems_report(&probs, err, err_len);
}

// ---- command line -----------------------------------------------------------------------------------

// Splits "--name=value" / "--name". *key gets the snake_case name (buf), *value the inline value or NULL.
static int split_flag(const char *arg, char *buf, size_t cap, const char **value) {
    const char *name = arg + 2, *eq = strchr(name, '=');
    size_t n = eq ? (size_t)(eq - name) : strlen(name);
    if (n == 0 || n >= cap) return -1;
    memcpy(buf, name, n);
    buf[n] = '\0';
    for (char *p = buf; *p; p++)
        if (*p == '-') *p = '_';
    *value = eq ? eq + 1 : NULL;
    return 0;
}

int train_config_parse_args(TrainConfig *cfg, int argc, char *const *argv, char *err, size_t err_len) {
    Problems probs = {0};
    char perr[PROBLEMS_TEXT];
    // Pass 1: --help, --version and --config, so the file is applied before any flag whatever the order.
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) return TRAIN_CONFIG_HELP;
        if (strcmp(a, "--version") == 0) return TRAIN_CONFIG_VERSION;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--config") == 0 || strncmp(a, "--config=", 9) == 0) {
            const char *path = a[8] == '=' ? a + 9 : (i + 1 < argc ? argv[++i] : NULL);
            if (!path || !path[0]) problems_add(&probs, "config (--config): needs a file path");
            else load_file_into(cfg, path, &probs);
        }
    }
    // Pass 2: every other flag; each problem is collected, so one run lists them all.
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0 || strcmp(a, "--") == 0) {
            problems_add(&probs, "unexpected argument '%s' (options are --name value or --name=value)", a);
            continue;
        }
        char key[128];
        const char *value;
        if (split_flag(a, key, sizeof key, &value) != 0) {
            problems_add(&probs, "malformed flag '%s'", a);
            continue;
        }
        if (strcmp(key, "config") == 0) {
            if (!value) i++;
            continue;
        }
        const OptionSpec *o = train_option_find(key);
        if (!value) {
            int b;
            if (o && o->type == OPT_BOOL) {
                // A bare boolean flag means true; an explicit true/false may follow it.
                value = (i + 1 < argc && parse_bool_text(argv[i + 1], &b) == 0) ? argv[++i] : "true";
            } else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                value = argv[++i];
            } else if (o) {
                char flag[128];
                flag_name(o->key, flag, sizeof flag);
                problems_add(&probs, "%s (%s): needs a value", o->key, flag);
                continue;
            } else {
                value = "";
            }
        }
        if (train_config_set(cfg, key, value, perr, sizeof perr) != 0) problems_add(&probs, "%s", perr);
    }
    return problems_report(&probs, err, err_len);
}
