// trainer/metrics_trim.c — see trainer/metrics_trim.h.
#include "trainer/metrics_trim.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "shared/json_read.h"
#include "trainer/fsync_tree.h"

// The row's "step", or -1 when line is not a JSON object with a non-negative integer "step".
static int64_t row_step(const char *line, size_t len) {
    json_error_t je;
    json_t *row = json_read_buffer(line, len, 0, &je);
    json_t *step = json_is_object(row) ? json_object_get(row, "step") : NULL;
    int64_t s = json_is_integer(step) && json_integer_value(step) >= 0 ? (int64_t)json_integer_value(step) : -1;
    json_decref(row);
    return s;
}

// Reads path and, with out != NULL, writes the rows to keep to out. Counts into *trim.
static int scan(FILE *in, FILE *out, int64_t last_step, MetricsTrim *trim) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    int rc = 0;
    *trim = (MetricsTrim){0};
    while ((n = getline(&line, &cap, in)) > 0) {
        size_t len = (size_t)n;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
        if (len == 0) continue;  // an empty line is no row
        int64_t step = row_step(line, len);
        if (step < 0) {
            trim->unreadable++;
        } else if (step > last_step) {
            trim->later++;
        } else {
            trim->kept++;
            if (out && (fwrite(line, 1, len, out) != len || fputc('\n', out) == EOF)) rc = -1;
        }
    }
    free(line);
    return ferror(in) ? -1 : rc;
}

int metrics_trim_after_step(const char *path, int64_t last_step, MetricsTrim *trim, char *err, size_t err_len) {
    FILE *in = fopen(path, "rb");
    if (!in) {
        *trim = (MetricsTrim){0};
        if (errno == ENOENT) return 0;
        snprintf(err, err_len, "cannot read %s: %s", path, strerror(errno));
        return -1;
    }
    if (scan(in, NULL, last_step, trim) != 0) {
        snprintf(err, err_len, "cannot read %s: %s", path, strerror(errno));
        fclose(in);
        return -1;
    }
    if (trim->later == 0 && trim->unreadable == 0) {
        fclose(in);
        return 0;
    }
    char tmp[PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *out = fopen(tmp, "wb");
    if (!out) {
        snprintf(err, err_len, "cannot write %s: %s", tmp, strerror(errno));
        fclose(in);
        return -1;
    }
    rewind(in);
    int rc = scan(in, out, last_step, trim);
    fclose(in);
    if (rc == 0 && (fflush(out) != 0 || fsync(fileno(out)) != 0)) rc = -1;
    if (fclose(out) != 0) rc = -1;
    if (rc != 0) {
        snprintf(err, err_len, "cannot write %s: %s", tmp, strerror(errno));
        unlink(tmp);
        return -1;
    }
    if (rename(tmp, path) != 0) {
        snprintf(err, err_len, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return fsync_parent(path, err, err_len);
}
