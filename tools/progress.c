/* TTY-only progress bar: see progress.h. */
#define _POSIX_C_SOURCE 200809L
#include "progress.h"

#include "stats.h"

#include <stdio.h>
#include <unistd.h>

void ft_progress_start(ft_progress *p, const char *label, int64_t total)
{
    p->enabled = isatty(STDERR_FILENO);
    snprintf(p->label, sizeof p->label, "%s", label);
    p->total = total > 0 ? total : 1;
    p->last_draw = -1.0;
    ft_progress_update(p, 0, -1);
}

void ft_progress_update(ft_progress *p, int64_t done, double last_s)
{
    enum { WIDTH = 30 };
    if (!p->enabled)
        return;
    double now = ft_now();
    if (done != 0 && done != p->total && now - p->last_draw < 0.1)
        return;
    p->last_draw = now;
    int fill = (int)(WIDTH * done / p->total);
    char bar[WIDTH + 1];
    for (int i = 0; i < WIDTH; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[WIDTH] = '\0';
    if (last_s >= 0)
        fprintf(stderr, "\r%-20s [%s] %lld/%lld  %.3g s/step ", p->label, bar, (long long)done,
                (long long)p->total, last_s);
    else
        fprintf(stderr, "\r%-20s [%s] %lld/%lld ", p->label, bar, (long long)done,
                (long long)p->total);
    fflush(stderr);
}

void ft_progress_finish(ft_progress *p)
{
    if (!p->enabled)
        return;
    fputs("\r\033[K", stderr); /* clear the line: the table follows on stdout */
    fflush(stderr);
}
