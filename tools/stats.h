/* Clocks, sample summaries and the process's memory counters for bench. */
#ifndef FT_STATS_H
#define FT_STATS_H

#include <stdint.h>

double ft_now(void); /* monotonic seconds */

typedef struct ft_summary {
    double mean, p50, p90, min, max;
} ft_summary;

/* Summary of n >= 1 samples (percentiles by linear interpolation between
 * order statistics, as numpy.percentile's default). Sorts a copy. */
ft_summary ft_summarize(const double *x, int64_t n);

/* A "VmHWM"/"VmRSS"-style field of /proc/self/status in bytes; -1 if absent. */
int64_t ft_proc_status_bytes(const char *field);

#endif
