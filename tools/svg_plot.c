/* SVG line charts without dependencies: see svg_plot.h. */
#define _POSIX_C_SOURCE 200809L
#include "svg_plot.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

enum { PANEL_W = 460, PANEL_H = 340, MARGIN_L = 70, MARGIN_R = 20, MARGIN_T = 60, MARGIN_B = 60 };

static const char *const COLORS[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};

/* A 1-2-5 step giving about `target` intervals over span. */
static double nice_step(double span, int target)
{
    double raw = span / target;
    double mag = pow(10.0, floor(log10(raw)));
    double f = raw / mag;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

static void xml_text(FILE *f, const char *s)
{
    for (; *s; s++) {
        if (*s == '<')
            fputs("&lt;", f);
        else if (*s == '>')
            fputs("&gt;", f);
        else if (*s == '&')
            fputs("&amp;", f);
        else
            fputc(*s, f);
    }
}

typedef struct range {
    double lo, hi;
} range;

static range x_range(const ft_panel *panels, int npanels)
{
    range r = {INFINITY, -INFINITY};
    for (int p = 0; p < npanels; p++)
        for (int s = 0; s < panels[p].nseries; s++)
            for (int i = 0; i < panels[p].series[s].n; i++) {
                double x = panels[p].series[s].x[i];
                if (isfinite(x)) {
                    r.lo = fmin(r.lo, x);
                    r.hi = fmax(r.hi, x);
                }
            }
    if (!(r.lo <= r.hi)) {
        r.lo = 0;
        r.hi = 1;
    }
    if (r.hi == r.lo) { /* one sweep point: centre it */
        double pad = r.lo != 0 ? fabs(r.lo) * 0.5 : 1;
        r.lo -= pad;
        r.hi += pad;
    }
    return r;
}

static range y_range(const ft_panel *p)
{
    range r = {0, -INFINITY};
    for (int s = 0; s < p->nseries; s++)
        for (int i = 0; i < p->series[s].n; i++)
            if (isfinite(p->series[s].y[i]))
                r.hi = fmax(r.hi, p->series[s].y[i]);
    if (!(r.hi > 0))
        r.hi = 1;
    double step = nice_step(r.hi, 5);
    r.hi = ceil(r.hi * 1.05 / step) * step;
    return r;
}

static void draw_panel(FILE *f, const ft_panel *p, range xr, double ox, const char *xlabel)
{
    range yr = y_range(p);
    double x0 = ox + MARGIN_L, x1 = ox + PANEL_W - MARGIN_R;
    double y0 = MARGIN_T + PANEL_H - MARGIN_B, y1 = MARGIN_T;
#define PX(x) (x0 + ((x) - xr.lo) / (xr.hi - xr.lo) * (x1 - x0))
#define PY(y) (y0 - ((y) - yr.lo) / (yr.hi - yr.lo) * (y0 - y1))
    fprintf(f, "<rect x='%.1f' y='%.1f' width='%.1f' height='%.1f' fill='none' stroke='#444'/>\n", x0,
            y1, x1 - x0, y0 - y1);
    /* y ticks and grid */
    double ys = nice_step(yr.hi - yr.lo, 5);
    for (double v = yr.lo; v <= yr.hi + ys * 1e-9; v += ys) {
        double y = PY(v);
        fprintf(f, "<line x1='%.1f' y1='%.1f' x2='%.1f' y2='%.1f' stroke='#ddd'/>\n", x0, y, x1, y);
        fprintf(f, "<text x='%.1f' y='%.1f' font-size='11' text-anchor='end'>%g</text>\n", x0 - 5,
                y + 4, v);
    }
    /* x ticks */
    double xs = nice_step(xr.hi - xr.lo, 5);
    for (double v = ceil(xr.lo / xs) * xs; v <= xr.hi + xs * 1e-9; v += xs) {
        double x = PX(v);
        fprintf(f, "<line x1='%.1f' y1='%.1f' x2='%.1f' y2='%.1f' stroke='#444'/>\n", x, y0, x, y0 + 5);
        fprintf(f, "<text x='%.1f' y='%.1f' font-size='11' text-anchor='middle'>%g</text>\n", x,
                y0 + 18, v);
    }
    fprintf(f, "<text x='%.1f' y='%.1f' font-size='13' text-anchor='middle'>", (x0 + x1) / 2, y0 + 40);
    xml_text(f, xlabel);
    fputs("</text>\n", f);
    fprintf(f, "<text x='%.1f' y='%.1f' font-size='13' text-anchor='middle' transform='rotate(-90 %.1f %.1f)'>",
            ox + 18, (y0 + y1) / 2, ox + 18, (y0 + y1) / 2);
    xml_text(f, p->ylabel);
    fputs("</text>\n", f);
    fprintf(f, "<text x='%.1f' y='%.1f' font-size='14' font-weight='bold' text-anchor='middle'>",
            (x0 + x1) / 2, y1 - 10.0);
    xml_text(f, p->title);
    fputs("</text>\n", f);
    /* series */
    for (int s = 0; s < p->nseries; s++) {
        const ft_series *se = &p->series[s];
        const char *c = COLORS[s % (int)(sizeof COLORS / sizeof COLORS[0])];
        fprintf(f, "<polyline fill='none' stroke='%s' stroke-width='2' points='", c);
        for (int i = 0; i < se->n; i++)
            if (isfinite(se->y[i]) && isfinite(se->x[i]))
                fprintf(f, "%.1f,%.1f ", PX(se->x[i]), PY(se->y[i]));
        fputs("'/>\n", f);
        for (int i = 0; i < se->n; i++)
            if (isfinite(se->y[i]) && isfinite(se->x[i]))
                fprintf(f, "<circle cx='%.1f' cy='%.1f' r='3.5' fill='%s'/>\n", PX(se->x[i]),
                        PY(se->y[i]), c);
        /* legend, top-left inside the frame */
        double ly = y1 + 16 + 16.0 * s;
        fprintf(f, "<line x1='%.1f' y1='%.1f' x2='%.1f' y2='%.1f' stroke='%s' stroke-width='2'/>\n",
                x0 + 10, ly - 4, x0 + 30, ly - 4, c);
        fprintf(f, "<text x='%.1f' y='%.1f' font-size='12'>", x0 + 35, ly);
        xml_text(f, se->name);
        fputs("</text>\n", f);
    }
#undef PX
#undef PY
}

int ft_svg_write(const char *path, const char *title, const char *xlabel, const ft_panel *panels,
                 int npanels, char *err, size_t errlen)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        snprintf(err, errlen, "%s: cannot create: %s", path, strerror(errno));
        return -1;
    }
    int w = PANEL_W * npanels, h = PANEL_H + MARGIN_T;
    fprintf(f, "<?xml version='1.0' encoding='UTF-8'?>\n");
    fprintf(f, "<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' viewBox='0 0 %d %d' "
               "font-family='sans-serif'>\n<rect width='100%%' height='100%%' fill='white'/>\n",
            w, h, w, h);
    fprintf(f, "<text x='%d' y='24' font-size='16' font-weight='bold' text-anchor='middle'>", w / 2);
    xml_text(f, title);
    fputs("</text>\n", f);
    range xr = x_range(panels, npanels);
    for (int p = 0; p < npanels; p++)
        draw_panel(f, &panels[p], xr, (double)(p * PANEL_W), xlabel);
    fputs("</svg>\n", f);
    if (fclose(f) != 0) {
        snprintf(err, errlen, "%s: write error", path);
        return -1;
    }
    return 0;
}
