// shared/version.c — see shared/version.h. The texts come from CMake (shared/CMakeLists.txt).
#include "shared/version.h"

#ifndef TANDEM_VERSION_TEXT
#define TANDEM_VERSION_TEXT "unknown"
#endif
#ifndef TANDEM_CPU_ARCH_TEXT
#define TANDEM_CPU_ARCH_TEXT "unknown"
#endif

const char *tandem_version(void) { return TANDEM_VERSION_TEXT; }

void tandem_print_version(FILE *f, const char *program) {
#ifdef TANDEM_VERSION_CUDA
    const char *cuda = "built";
#else
    const char *cuda = "not built";
#endif
    fprintf(f, "%s %s (host code -march=%s, CUDA backend %s)\n", program, TANDEM_VERSION_TEXT, TANDEM_CPU_ARCH_TEXT, cuda);
}
