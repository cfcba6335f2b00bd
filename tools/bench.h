/* `fusedgrpo bench`: one impl measured in a child process (bench.c says why).
 * The child writes its figures as one JSON object (bench_measure.c names
 * them), which the parent completes with the sweep point and the config. */
#ifndef FT_BENCH_H
#define FT_BENCH_H

#include "problem.h"

/* Room for the child's JSON text. */
#define FT_BENCH_RESULT_BYTES 65536

/* One impl on a problem. */
typedef struct ft_bench_job {
    const ft_config *cfg;
    ft_problem *p;
    int impl;
    int impls[2]; /* ft_bench_measure_interleaved: A and B */
} ft_bench_job;

/* Runs in the child: job is an ft_bench_job; writes the JSON text of its
 * figures ("ok", "error" when it failed or has a note) to out. 0: ok. */
int ft_bench_measure(void *job, void *out);
/* --interleave: job->impls[0] and [1] in this one process, their steps taking
 * turns (ABBA), each pair's time ratio beside each impl's own figures; peak
 * RSS is not either impl's own then (counted memory still is). Writes two
 * JSON objects, a line each. 0: ok. */
int ft_bench_measure_interleaved(void *job, void *out);

#endif
