/* check.h: the C tests' one assertion: CHECK(cond, printf-style message)
 * counts a pass or prints the failure and counts it; main() reports both
 * counts and fails when any check failed. */
#ifndef ZERO_TEST_CHECK_H
#define ZERO_TEST_CHECK_H

#include <stdio.h>

static int passed, failed;

#define CHECK(cond, ...)                                                     \
    do {                                                                     \
        if (cond) {                                                          \
            passed++;                                                        \
        } else {                                                             \
            failed++;                                                        \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);             \
            fprintf(stderr, __VA_ARGS__);                                    \
            fprintf(stderr, "\n");                                           \
        }                                                                    \
    } while (0)

#endif /* ZERO_TEST_CHECK_H */
