/*
 * A dependency-free SVG line chart: side-by-side panels sharing one x axis
 * (bench --plot draws step time and peak memory against the swept key).
 * Linear axes from zero, "nice" 1-2-5 ticks, one colour per series and a
 * legend. Points with a non-finite y are skipped (a failed run).
 */
#ifndef FT_SVG_PLOT_H
#define FT_SVG_PLOT_H

#include <stddef.h>

typedef struct ft_series {
    const char *name;
    int n;
    const double *x;
    const double *y;
} ft_series;

typedef struct ft_panel {
    const char *title;
    const char *ylabel;
    const ft_series *series;
    int nseries;
} ft_panel;

int ft_svg_write(const char *path, const char *title, const char *xlabel, const ft_panel *panels,
                 int npanels, char *err, size_t errlen);

#endif
