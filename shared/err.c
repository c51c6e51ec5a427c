// shared/err.c — see shared/err.h.
#include "shared/err.h"

#include <stdarg.h>
#include <stdio.h>

int err_fail(char *err, size_t err_len, const char *fmt, ...) {
    if (err && err_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_len, fmt, ap);
        va_end(ap);
    }
    return -1;
}
