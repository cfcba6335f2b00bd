/* A minimal assertion macro for the tools' unit tests: report and count,
 * keep going, so one run shows every failing case. */
#ifndef FT_TEST_CHECK_H
#define FT_TEST_CHECK_H

#include <stdio.h>

static int ft_test_failures;

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            ft_test_failures++;                                                \
        }                                                                      \
    } while (0)

#define TEST_RESULT() (ft_test_failures ? (fprintf(stderr, "%d check(s) failed\n", ft_test_failures), 1) : 0)

#endif
