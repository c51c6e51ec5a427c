// trainer/output_dir.c — see trainer/output_dir.h.
#include "trainer/output_dir.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "trainer/remove_tree.h"

// 1 when name (in dir) is a file of a tandem-train run: metrics.jsonl with records, checkpoint-N, checkpoint-N.tmp.
static int is_run_file(const char *dir, const char *name) {
    if (strcmp(name, "metrics.jsonl") == 0) {
        char path[PATH_MAX];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, name);
        return stat(path, &st) == 0 && st.st_size > 0;
    }
    if (strncmp(name, "checkpoint-", 11) != 0 || !isdigit((unsigned char)name[11])) return 0;
    const char *p = name + 11;
    while (isdigit((unsigned char)*p)) p++;
    return *p == '\0' || strcmp(p, ".tmp") == 0;
}

// metrics.jsonl first, then the checkpoints by step (checkpoint-9 before checkpoint-10).
static int cmp_run_file(const void *a, const void *b) {
    const char *x = *(char *const *)a, *y = *(char *const *)b;
    int xm = strcmp(x, "metrics.jsonl") == 0, ym = strcmp(y, "metrics.jsonl") == 0;
    if (xm != ym) return ym - xm;
    if (xm) return 0;
    long sx = strtol(x + 11, NULL, 10), sy = strtol(y + 11, NULL, 10);
    return sx != sy ? (sx > sy) - (sx < sy) : strcmp(x, y);
}

// "a, b, c" of the first `shown` names, then "and N more" (into buf).
static void list_names(char **names, size_t n, size_t shown, char *buf, size_t cap) {
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && i < shown && used < cap; i++)
        used += (size_t)snprintf(buf + used, cap - used, "%s%s", i ? ", " : "", names[i]);
    if (n > shown && used < cap) snprintf(buf + used, cap - used, " and %zu more", n - shown);
}

// The resume folder lies inside dir (both exist): overwrite would delete what the run resumes from.
static int resume_inside(const char *dir, const char *resume) {
    char d[PATH_MAX], r[PATH_MAX];
    if (!realpath(dir, d) || !realpath(resume, r)) return 0;
    size_t n = strlen(d);
    return strncmp(r, d, n) == 0 && (r[n] == '/' || r[n] == '\0' || (n == 1 && d[0] == '/'));
}

int output_dir_prepare(const char *dir, const char *resume, int overwrite, char *removed, size_t removed_len,
                       char *err, size_t err_len) {
    if (removed_len) removed[0] = '\0';
    if (resume && overwrite && strcmp(resume, "latest") != 0 && resume_inside(dir, resume)) {
        snprintf(err, err_len, "--resume %s lies inside --output-dir %s, which --overwrite-output-dir would clear "
                 "first: drop --overwrite-output-dir to continue that run, or write to another --output-dir", resume, dir);
        return -1;
    }
    if (resume) return 0;
    DIR *d = opendir(dir);
    if (!d) return 0;  // created later, with its parents
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d))) {
        if (!is_run_file(dir, e->d_name)) continue;
        if (n == cap) {
            char **grown = realloc(names, (cap = cap ? 2 * cap : 16) * sizeof *names);
            if (!grown) {
                rc = -1;
                break;
            }
            names = grown;
        }
        if (!(names[n] = strdup(e->d_name))) {
            rc = -1;
            break;
        }
        n++;
    }
    closedir(d);
    if (rc != 0) {
        snprintf(err, err_len, "out of memory listing --output-dir %s", dir);
    } else if (n > 0) {
        qsort(names, n, sizeof *names, cmp_run_file);
        char listed[512];
        list_names(names, n, 6, listed, sizeof listed);
        if (!overwrite) {
            snprintf(err, err_len, "--output-dir %s holds an earlier run (%s): continue it with --resume latest, "
                     "delete those files with --overwrite-output-dir, or give another --output-dir", dir, listed);
            rc = -1;
        }
        for (size_t i = 0; overwrite && i < n && rc == 0; i++) {
            char path[PATH_MAX], rerr[PATH_MAX + 64];
            snprintf(path, sizeof path, "%s/%s", dir, names[i]);
            if (remove_tree(path, rerr, sizeof rerr) != 0) {
                snprintf(err, err_len, "--overwrite-output-dir: %s", rerr);
                rc = -1;
            }
        }
        if (overwrite && rc == 0) list_names(names, n, 6, removed, removed_len);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    return rc;
}
