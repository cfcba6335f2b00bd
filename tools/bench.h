/* `fusedgrpo bench`: one impl measured in a child process (bench.c says why).
 * The child writes its figures as one JSON object (bench_measure.c names
 * them), which the parent completes with the sweep point and the config. */
#ifndef FT_BENCH_H
#define FT_BENCH_H

#include "problem.h"

/* Room for the child's JSON text. */
#define FT_BENCH_RESULT_BYTES 65536

/* One impl on a problem. */
typedef struct ft_bench_job { const ft_config *cfg; ft_problem *p; int impl; } ft_bench_job;

/* Runs in the child: job is an ft_bench_job; writes the JSON text of its
 * figures ("ok", "error" when it failed or has a note) to out. 0: ok. */
int ft_bench_measure(void *job, void *out);

#endif
