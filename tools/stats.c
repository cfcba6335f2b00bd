/* Timing statistics and /proc memory counters: see stats.h. */
#define _POSIX_C_SOURCE 200809L
#include "stats.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double ft_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(const double *sorted, int64_t n, double q)
{
    double pos = q * (double)(n - 1);
    int64_t lo = (int64_t)pos;
    int64_t hi = lo + 1 < n ? lo + 1 : lo;
    double frac = pos - (double)lo;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

ft_summary ft_summarize(const double *x, int64_t n)
{
    ft_summary s = {0, 0, 0, 0, 0};
    if (n <= 0)
        return s;
    double *c = malloc((size_t)n * sizeof *c);
    if (c == NULL)
        return s;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) {
        c[i] = x[i];
        sum += x[i];
    }
    qsort(c, (size_t)n, sizeof *c, cmp_double);
    s.mean = sum / (double)n;
    s.p50 = percentile(c, n, 0.5);
    s.p90 = percentile(c, n, 0.9);
    s.min = c[0];
    s.max = c[n - 1];
    free(c);
    return s;
}

int64_t ft_proc_status_bytes(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (f == NULL)
        return -1;
    char line[256];
    size_t flen = strlen(field);
    int64_t v = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, field, flen) == 0 && line[flen] == ':') {
            long long kb;
            if (sscanf(line + flen + 1, "%lld", &kb) == 1)
                v = (int64_t)kb * 1024;
            break;
        }
    }
    fclose(f);
    return v;
}
