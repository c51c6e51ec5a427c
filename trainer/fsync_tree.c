// trainer/fsync_tree.c — see trainer/fsync_tree.h.
#include "trainer/fsync_tree.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int fsync_path(const char *path, char *err, size_t err_len) {
    // O_RDONLY is enough: fsync flushes the inode's data and metadata whatever the descriptor's mode.
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, err_len, "cannot open %s to flush it to disk: %s", path, strerror(errno));
        return -1;
    }
    int rc = 0;
    // EINVAL: a file system that cannot sync this kind of file (some FUSE and network mounts for folders);
    // nothing more can be done for it there.
    if (fsync(fd) != 0 && errno != EINVAL) {
        snprintf(err, err_len, "cannot flush %s to disk: %s", path, strerror(errno));
        rc = -1;
    }
    close(fd);
    return rc;
}

int fsync_tree(const char *dir, char *err, size_t err_len) {
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, err_len, "cannot list %s to flush it to disk: %s", dir, strerror(errno));
        return -1;
    }
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char child[PATH_MAX];
        if ((size_t)snprintf(child, sizeof child, "%s/%s", dir, e->d_name) >= sizeof child) {
            snprintf(err, err_len, "cannot flush %s/%s to disk: path too long", dir, e->d_name);
            rc = -1;
            break;
        }
        struct stat st;
        if (lstat(child, &st) != 0) {
            snprintf(err, err_len, "cannot flush %s to disk: %s", child, strerror(errno));
            rc = -1;
        } else if (S_ISDIR(st.st_mode)) {
            rc = fsync_tree(child, err, err_len);
        } else if (S_ISREG(st.st_mode)) {
            rc = fsync_path(child, err, err_len);
        }
    }
    closedir(d);
    return rc == 0 ? fsync_path(dir, err, err_len) : rc;
}

int fsync_parent(const char *path, char *err, size_t err_len) {
    char parent[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash) return fsync_path(".", err, err_len);
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    if (n >= sizeof parent) {
        snprintf(err, err_len, "cannot flush the folder of %s to disk: path too long", path);
        return -1;
    }
    memcpy(parent, path, n);
    parent[n] = '\0';
    return fsync_path(parent, err, err_len);
}
