// trainer/make_dirs.c — see trainer/make_dirs.h.
#include "trainer/make_dirs.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

int make_dirs(const char *path, char *err, size_t err_len) {
    char buf[PATH_MAX + 64];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) goto fail;
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) goto fail;
    return 0;
fail:
    snprintf(err, err_len, "cannot create %s: %s", buf, strerror(errno));
    return -1;
}
