// shared/version.h — what `--version` prints in both binaries.
#ifndef TANDEM_SHARED_VERSION_H
#define TANDEM_SHARED_VERSION_H

#include <stdio.h>

// "0.11.0": the project version of CMakeLists.txt.
const char *tandem_version(void);
// One line for --version: "<program> <version> (host code -march=..., CUDA backend built|not built)\n" on f.
void tandem_print_version(FILE *f, const char *program);

#endif
