// trainer/remove_tree.h — `rm -rf` for what tandem-train itself wrote: an unfinished checkpoint, checkpoints
// beyond save_total_limit, an earlier run's files under --overwrite-output-dir.
#ifndef TANDEM_TRAINER_REMOVE_TREE_H
#define TANDEM_TRAINER_REMOVE_TREE_H

#include <stddef.h>

// Removes path: a file, a symbolic link (never what it points to) or a folder with everything in it. A path
// that does not exist is fine. Returns 0, or -1 with a message naming what could not be removed (err may be
// NULL); it goes on with the rest after a failure.
int remove_tree(const char *path, char *err, size_t err_len);

#endif
