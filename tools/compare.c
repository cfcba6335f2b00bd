/* Max-abs / norm-relative differences: see compare.h. */
#include "compare.h"

#include "bf16.h"

#include <math.h>

ft_view ft_view_make(const void *p, ft_view_kind kind)
{
    ft_view v = {p, kind};
    return v;
}

double ft_view_get(ft_view v, int64_t i)
{
    switch (v.kind) {
    case FT_VIEW_F32:
        return ((const float *)v.p)[i];
    case FT_VIEW_BF16:
        return ft_bf16_to_f32(((const uint16_t *)v.p)[i]);
    case FT_VIEW_F64:
        return ((const double *)v.p)[i];
    }
    return NAN;
}

ft_diff ft_compare(ft_view kernel, ft_view ref, int64_t n)
{
    ft_diff d = {0, 0, 0, -1, 0};
    for (int64_t i = 0; i < n; i++) {
        double a = ft_view_get(kernel, i), b = ft_view_get(ref, i);
        if (!isfinite(a) || !isfinite(b)) {
            if (d.nonfinite++ == 0)
                d.argmax = i;
            continue;
        }
        double e = fabs(a - b);
        if (e > d.max_abs) {
            d.max_abs = e;
            if (d.nonfinite == 0)
                d.argmax = i;
        }
        if (fabs(b) > d.max_ref)
            d.max_ref = fabs(b);
    }
    if (d.nonfinite > 0)
        d.max_abs = NAN; /* NaN fails every gate: `NaN <= tol` is false */
    d.max_rel = d.max_ref > 0 ? d.max_abs / d.max_ref : (d.max_abs == 0 ? 0 : INFINITY);
    if (d.nonfinite > 0)
        d.max_rel = NAN;
    return d;
}
