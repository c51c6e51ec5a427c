// shared/err.h — the error-message convention of library code: functions take (char *err, size_t err_len),
// return -1 (or NULL) on failure and leave a sentence in err that says what failed; binaries decide what to do.
#ifndef TANDEM_SHARED_ERR_H
#define TANDEM_SHARED_ERR_H

#include <stdarg.h>
#include <stddef.h>

// Writes a printf-style message into err (nothing when err is NULL or err_len is 0) and returns -1, so that a
// failing function can `return err_fail(err, err_len, "cannot open %s: %s", path, strerror(errno));`.
int err_fail(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
// The same for a library whose errors are codes: writes the message and returns `code` (COMM_ERR_INVALID,
// CONFIG_ERR_INVALID, ST_ERR_IO, ...).
int err_fail_code(int code, char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
// va_list form, for a library's own wrapper (the tokenizer's tok_set_err).
void err_vset(char *err, size_t err_len, const char *fmt, va_list ap);

#endif
