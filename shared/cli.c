// shared/cli.c — see shared/cli.h.
#include "shared/cli.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"

static const char *value_name(const CliOption *o) {
    if (o->value_name) return o->value_name;
    switch (o->type) {
    case CLI_INT:
    case CLI_LONG: return "N";
    case CLI_DOUBLE: return "FLOAT";
    case CLI_SWITCH: return "";
    default: return "TEXT";
    }
}

// A number as the user would write it back: integers without a fraction, others in %g.
static void number_text(double v, char *buf, size_t len) {
    if (v == floor(v) && fabs(v) < 1e18) snprintf(buf, len, "%.0f", v);
    else snprintf(buf, len, "%g", v);
}

static void default_text(const CliOption *o, const void *defaults, char *buf, size_t len) {
    const char *p = (const char *)defaults + o->offset;
    switch (o->type) {
    case CLI_TEXT: {
        const char *s = *(const char *const *)p;
        snprintf(buf, len, "%s", s && *s ? s : "none");
        break;
    }
    case CLI_INT: snprintf(buf, len, "%d", *(const int *)p); break;
    case CLI_LONG: snprintf(buf, len, "%lld", *(const long long *)p); break;
    case CLI_DOUBLE: number_text(*(const double *)p, buf, len); break;
    case CLI_SWITCH: snprintf(buf, len, "%s", *(const int *)p ? "on" : "off"); break;
    case CLI_LIST: snprintf(buf, len, "none"); break;
    }
}

// Prints text from column `col` on, wrapped at word boundaries before column 118, continuation lines indented
// to column `indent`.
static void print_wrapped(FILE *f, const char *text, int col, int indent) {
    const int width = 118;
    const char *p = text;
    while (*p) {
        while (*p == ' ') p++;
        size_t word = strcspn(p, " ");
        if (col > indent && col + 1 + (int)word > width) {
            fprintf(f, "\n%*s", indent, "");
            col = indent;
        } else if (col > indent) {
            fputc(' ', f);
            col++;
        }
        fprintf(f, "%.*s", (int)word, p);
        col += (int)word;
        p += word;
    }
    fputc('\n', f);
}

void cli_usage(const CliSpec *spec, const void *defaults, FILE *f) {
    fprintf(f, "usage: %s %s\n\n", spec->command, spec->synopsis ? spec->synopsis : "[options]");
    if (spec->description) fprintf(f, "%s\n\n", spec->description);
    const int indent = 31;   // "  " + 28 + " "
    for (int i = 0; i < spec->n_options; i++) {
        const CliOption *o = &spec->options[i];
        char left[96], def[192], line[1200];
        snprintf(left, sizeof left, "%s%s%s", o->flag, o->type == CLI_SWITCH ? "" : " ", value_name(o));
        if (o->required) snprintf(def, sizeof def, "required");
        else {
            char v[160];
            if (o->default_note) snprintf(v, sizeof v, "%s", o->default_note);
            else default_text(o, defaults, v, sizeof v);
            snprintf(def, sizeof def, "%s%s", o->type == CLI_LIST ? "repeatable; default " : "default ", v);
        }
        snprintf(line, sizeof line, "%s (%s)", o->help, def);
        // A long flag with its value name takes a line of its own, so that the help column stays aligned.
        if (strlen(left) > 28) fprintf(f, "  %s\n%*s", left, indent, "");
        else fprintf(f, "  %-28s ", left);
        print_wrapped(f, line, indent, indent);
    }
    fprintf(f, "  %-28s this text\n", "-h, --help");
    fprintf(f, "  %-28s the version, and how this binary was built\n", "--version");
    if (spec->epilog) fprintf(f, "\n%s\n", spec->epilog);
}

// Levenshtein distance of two short strings, capped at 9 (for "did you mean").
static int edit_distance(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    if (na > 63 || nb > 63) return 9;
    int row[64];
    for (size_t j = 0; j <= nb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            diag = up;
            row[j] = best;
        }
    }
    return row[nb] > 9 ? 9 : row[nb];
}

static const CliOption *find(const CliSpec *spec, const char *name, size_t len) {
    for (int i = 0; i < spec->n_options; i++)
        if (strlen(spec->options[i].flag) == len && !strncmp(spec->options[i].flag, name, len)) return &spec->options[i];
    return NULL;
}

static int unknown(const CliSpec *spec, const char *arg, size_t len, char *err, size_t err_len) {
    char name[96];
    snprintf(name, sizeof name, "%.*s", (int)(len < 95 ? len : 95), arg);
    const CliOption *best = NULL;
    int best_d = 3;   // suggest only close misspellings
    for (int i = 0; i < spec->n_options; i++) {
        int d = edit_distance(name, spec->options[i].flag);
        if (d < best_d) best_d = d, best = &spec->options[i];
    }
    if (best)
        return err_fail_code(CLI_ERROR, err, err_len, "%s: unknown option %s; did you mean %s? (see --help)",
                             spec->command, name, best->flag);
    return err_fail_code(CLI_ERROR, err, err_len, "%s: unknown option %s (see --help)", spec->command, name);
}

static int out_of_range(const CliSpec *spec, const CliOption *o, const char *v, char *err, size_t err_len) {
    char lo[32], hi[32], range[96];
    number_text(o->min, lo, sizeof lo);
    number_text(o->max, hi, sizeof hi);
    const char *op = o->min_exclusive ? "<" : "<=";
    if ((o->bounds & CLI_BOUND_MIN) && (o->bounds & CLI_BOUND_MAX)) snprintf(range, sizeof range, "%s %s value <= %s", lo, op, hi);
    else if (o->bounds & CLI_BOUND_MIN) snprintf(range, sizeof range, "value %s %s", o->min_exclusive ? ">" : ">=", lo);
    else snprintf(range, sizeof range, "value <= %s", hi);
    return err_fail_code(CLI_ERROR, err, err_len, "%s: %s %s is out of range (%s; see --help)", spec->command, o->flag, v, range);
}

static int in_range(const CliOption *o, double x) {
    if (o->bounds & CLI_BOUND_MIN) {
        if (o->min_exclusive ? !(x > o->min) : !(x >= o->min)) return 0;
    }
    if ((o->bounds & CLI_BOUND_MAX) && !(x <= o->max)) return 0;
    return 1;
}

static int choice_ok(const char *choices, const char *v) {
    size_t n = strlen(v);
    for (const char *c = choices; *c;) {
        const char *bar = strchr(c, '|');
        size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && !strncmp(c, v, n)) return 1;
        if (!bar) break;
        c = bar + 1;
    }
    return 0;
}

static int take_value(const CliSpec *spec, const CliOption *o, void *opts, const char *v, char *err, size_t err_len) {
    char *p = (char *)opts + o->offset, *end = NULL;
    switch (o->type) {
    case CLI_TEXT:
        if (o->choices && !choice_ok(o->choices, v))
            return err_fail_code(CLI_ERROR, err, err_len, "%s: %s '%s' is not one of %s (see --help)", spec->command, o->flag, v,
                                 o->choices);
        *(const char **)p = v;
        return CLI_OK;
    case CLI_LIST: {
        CliList *l = (CliList *)p;
        if (l->n == CLI_LIST_MAX)
            return err_fail_code(CLI_ERROR, err, err_len, "%s: %s given more than %d times (see --help)", spec->command, o->flag,
                                 CLI_LIST_MAX);
        l->items[l->n++] = v;
        return CLI_OK;
    }
    case CLI_INT:
    case CLI_LONG: {
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (*v && errno == ERANGE && end != v && !*end) return out_of_range(spec, o, v, err, err_len);
        if (errno || end == v || *end)
            return err_fail_code(CLI_ERROR, err, err_len, "%s: %s '%s' is not an integer (see --help)", spec->command, o->flag, v);
        if ((o->type == CLI_INT && (x < INT_MIN || x > INT_MAX)) || !in_range(o, (double)x))
            return out_of_range(spec, o, v, err, err_len);
        if (o->type == CLI_INT) *(int *)p = (int)x;
        else *(long long *)p = x;
        return CLI_OK;
    }
    case CLI_DOUBLE: {
        errno = 0;
        double x = strtod(v, &end);
        if (!*v || end == v || *end || !isfinite(x))
            return err_fail_code(CLI_ERROR, err, err_len, "%s: %s '%s' is not a finite number (see --help)", spec->command,
                                 o->flag, v);
        if (!in_range(o, x)) return out_of_range(spec, o, v, err, err_len);
        *(double *)p = x;
        return CLI_OK;
    }
    case CLI_SWITCH: break;
    }
    return err_fail_code(CLI_ERROR, err, err_len, "%s: %s takes no value (see --help)", spec->command, o->flag);
}

int cli_parse(const CliSpec *spec, void *opts, int argc, char **argv, int *rest, char *err, size_t err_len) {
    unsigned char given[256] = {0};
    if (rest) *rest = argc;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) {
            if (rest) *rest = i + 1;
            break;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return CLI_HELP;
        if (!strcmp(a, "--version")) return CLI_VERSION;
        const char *eq = strncmp(a, "--", 2) ? NULL : strchr(a, '=');
        size_t name_len = eq ? (size_t)(eq - a) : strlen(a);
        const CliOption *o = find(spec, a, name_len);
        if (!o) return unknown(spec, a, name_len, err, err_len);
        int idx = (int)(o - spec->options);
        if (idx < 256) given[idx] = 1;
        if (o->type == CLI_SWITCH) {
            if (eq) return err_fail_code(CLI_ERROR, err, err_len, "%s: %s takes no value (see --help)", spec->command, o->flag);
            *(int *)((char *)opts + o->offset) = 1;
            continue;
        }
        const char *v = eq ? eq + 1 : i + 1 < argc ? argv[++i] : NULL;
        if (!v)
            return err_fail_code(CLI_ERROR, err, err_len, "%s: %s needs a value (%s; see --help)", spec->command, o->flag,
                                 value_name(o));
        if (take_value(spec, o, opts, v, err, err_len) != CLI_OK) return CLI_ERROR;
    }
    for (int i = 0; i < spec->n_options && i < 256; i++)
        if (spec->options[i].required && !given[i])
            return err_fail_code(CLI_ERROR, err, err_len, "%s: %s %s is required (see --help)", spec->command,
                                 spec->options[i].flag, value_name(&spec->options[i]));
    return CLI_OK;
}
