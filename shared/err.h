// shared/err.h — the error-message convention of library code: functions take (char *err, size_t err_len),
// return -1 (or NULL) on failure and leave a sentence in err that says what failed; binaries decide what to do.
#ifndef TANDEM_SHARED_ERR_H
#define TANDEM_SHARED_ERR_H

#include <stddef.h>

// Writes a printf-style message into err (nothing when err is NULL or err_len is 0) and returns -1, so that a
// failing function can `return err_fail(err, err_len, "cannot open %s: %s", path, strerror(errno));`.
int err_fail(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
