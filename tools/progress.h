/*
 * A one-line progress bar on stderr, drawn only when stderr is a terminal so
 * that logs and CI output stay free of carriage-return noise.
 */
#ifndef FT_PROGRESS_H
#define FT_PROGRESS_H

#include <stdint.h>

typedef struct ft_progress {
    int enabled;
    char label[48];
    int64_t total;
    double last_draw; /* redraw at most ~10 times a second */
} ft_progress;

void ft_progress_start(ft_progress *p, const char *label, int64_t total);
/* done of total finished; last_s: the latest step's seconds (< 0: unknown). */
void ft_progress_update(ft_progress *p, int64_t done, double last_s);
void ft_progress_finish(ft_progress *p);

#endif
