// trainer/make_dirs.h — `mkdir -p` for output folders (the run's --output-dir, checkpoints).
#ifndef TANDEM_TRAINER_MAKE_DIRS_H
#define TANDEM_TRAINER_MAKE_DIRS_H

#include <stddef.h>

// Creates path and every missing parent (mode 0755); an existing folder is fine. Returns 0 or -1 with a
// message naming the folder that could not be made.
int make_dirs(const char *path, char *err, size_t err_len);

#endif
