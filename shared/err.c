// shared/err.c — see shared/err.h.
#include "shared/err.h"

#include <stdarg.h>
#include <stdio.h>

void err_vset(char *err, size_t err_len, const char *fmt, va_list ap) {
    if (err && err_len) vsnprintf(err, err_len, fmt, ap);
}

int err_fail(char *err, size_t err_len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    err_vset(err, err_len, fmt, ap);
    va_end(ap);
    return -1;
}

int err_fail_code(int code, char *err, size_t err_len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    err_vset(err, err_len, fmt, ap);
    va_end(ap);
    return code;
}
