// tests/unit/check_macros.h — CHECK (count a failure, go on) and REQUIRE (stop the test) for the unit tests that
// share this exact form. Include once, in the test's .c file.
#ifndef TANDEM_TESTS_CHECK_MACROS_H
#define TANDEM_TESTS_CHECK_MACROS_H

#include <stdio.h>
#include <stdlib.h>

static int failures = 0;
#define CHECK(cond, ...)                                                                                       \
    do {                                                                                                       \
        if (!(cond)) {                                                                                         \
            failures++;                                                                                        \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                               \
            fprintf(stderr, __VA_ARGS__);                                                                      \
            fputc('\n', stderr);                                                                               \
        }                                                                                                      \
    } while (0)
#define REQUIRE(cond, ...)                                                                                     \
    do {                                                                                                       \
        if (!(cond)) {                                                                                         \
            fprintf(stderr, "FATAL %s:%d: ", __FILE__, __LINE__);                                              \
            fprintf(stderr, __VA_ARGS__);                                                                      \
            fputc('\n', stderr);                                                                               \
            exit(1);                                                                                           \
        }                                                                                                      \
    } while (0)

#endif
