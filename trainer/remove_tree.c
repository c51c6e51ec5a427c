// trainer/remove_tree.c — see trainer/remove_tree.h.
#include "trainer/remove_tree.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int fail(const char *path, char *err, size_t err_len) {
    if (err && err_len && !err[0]) snprintf(err, err_len, "cannot remove %s: %s", path, strerror(errno));
    return -1;
}

static int remove_entry(const char *path, char *err, size_t err_len) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : fail(path, err, err_len);
    if (!S_ISDIR(st.st_mode)) return unlink(path) == 0 || errno == ENOENT ? 0 : fail(path, err, err_len);
    DIR *d = opendir(path);
    if (!d) return fail(path, err, err_len);
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char child[PATH_MAX];
        if ((size_t)snprintf(child, sizeof child, "%s/%s", path, e->d_name) >= sizeof child) {
            errno = ENAMETOOLONG;
            rc = fail(path, err, err_len);
            continue;
        }
        if (remove_entry(child, err, err_len) != 0) rc = -1;
    }
    closedir(d);
    if (rmdir(path) != 0) rc = fail(path, err, err_len);
    return rc;
}

int remove_tree(const char *path, char *err, size_t err_len) {
    if (err && err_len) err[0] = '\0';
    return remove_entry(path, err, err_len);
}
