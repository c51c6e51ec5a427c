// trainer/fsync_tree.h — making what tandem-train wrote survive a power loss, not only a crash of the process.
//
// A rename is atomic, but without fsync the renamed folder can reach the disk before the files in it (or the
// rename itself can be lost): after a power loss a checkpoint-N could hold empty or half-written files. So a
// writer fsyncs every file and folder it wrote, renames, then fsyncs the folder that holds the new name.
#ifndef TANDEM_TRAINER_FSYNC_TREE_H
#define TANDEM_TRAINER_FSYNC_TREE_H

#include <stddef.h>

// fsync of one file or folder. Returns 0, or -1 with a message naming path.
int fsync_path(const char *path, char *err, size_t err_len);
// fsync of every regular file and folder under dir (symbolic links are not followed), then of dir itself.
// Returns 0, or -1 with a message naming the first path that failed.
int fsync_tree(const char *dir, char *err, size_t err_len);
// fsync of the folder that holds path (after path was created, renamed or removed in it).
int fsync_parent(const char *path, char *err, size_t err_len);

#endif
