/*
 * Kernel-vs-reference differences over arrays of mixed element types.
 * max_rel is max|a - b| / max|b| (a norm-wise relative error): elementwise
 * |a-b|/|b| explodes on the near-zero entries every gradient has, so it
 * would gate on noise rather than on bugs.
 */
#ifndef FT_COMPARE_H
#define FT_COMPARE_H

#include <stdint.h>

typedef enum ft_view_kind { FT_VIEW_F32 = 0, FT_VIEW_BF16, FT_VIEW_F64 } ft_view_kind;

typedef struct ft_view {
    const void *p; /* NULL: absent */
    ft_view_kind kind;
} ft_view;

typedef struct ft_diff {
    double max_abs;    /* NaN when either side has a NaN/Inf          */
    double max_ref;    /* max |reference|                             */
    double max_rel;    /* max_abs / max_ref (0/0 = 0, x/0 = inf)      */
    int64_t argmax;    /* index of max_abs (or of the first non-finite) */
    int64_t nonfinite; /* entries where either side is not finite     */
} ft_diff;

ft_view ft_view_make(const void *p, ft_view_kind kind);
double ft_view_get(ft_view v, int64_t i);
ft_diff ft_compare(ft_view kernel, ft_view ref, int64_t n);

#endif
