/*
 * What a bench child measures and hands back to its parent through a pipe.
 * Parent and child are the same executable, so the struct goes over the
 * pipe as raw bytes.
 */
#ifndef FT_BENCH_H
#define FT_BENCH_H

#include <stdint.h>

#include <stdio.h>

#include "cli.h"
#include "problem.h"

typedef struct ft_bench_result {
    int ok;
    char error[1024];
    int impl;
    int64_t tokens, unmasked, steps;
    double cold_s;                          /* the first step, reported apart */
    double step_mean, step_p50, step_p90, step_min, step_max;
    double kernel_mean;                     /* logits impl: fg_logits_grpo alone */
    double gemm_mean, call_mean;            /* baseline/fused: the library's own timing of
                                               its GEMMs and of the whole call, per step */
    double lib_peak_bytes;                  /* fg_get_memory_stats().peak_bytes */
    double tool_bytes;                      /* logits impl: logits buffer + GEMM scratch */
    double peak_work_bytes;                 /* lib_peak + tool */
    double rss_base_bytes;                  /* VmRSS when the child started */
    double rss_peak_bytes;                  /* VmHWM after the timed steps */
    double input_bytes, output_bytes;
    double rss_work_bytes;                  /* VmHWM - inputs - outputs */
    int64_t chunk_rows, chunks, lib_gemm_flops;
    double flops;                           /* 3 * 2 * unmasked * H * V per step */
    double gflops;                          /* flops / step_p50 */
    double roofline_s;                      /* fg_time_bare_gemms at the same shape */
    double roofline_ratio;                  /* roofline_s / step_p50 */
    double loss;                            /* the last step's loss, a sanity value */
} ft_bench_result;

#define FT_BENCH_MAX_SWEEP 64

/* The child side: measure one impl on the arena of cli->problem_fd. */
int ft_bench_child(ft_cli *cli);

/* The parent side: run impl in a child on p; res->ok = 0 with a reason on failure. */
void ft_bench_spawn(const ft_config *cfg, const ft_problem *p, int impl, ft_bench_result *res);

/* Reporting (bench_report.c). */
void ft_bench_print_header(const char *sweep_key);
void ft_bench_print_row(const ft_config *cfg, const char *sweep_value, const ft_bench_result *r);
void ft_bench_json_line(FILE *f, const ft_config *cfg, const char *sweep_key, const char *sweep_value,
                        const ft_bench_result *r);
/* res[v][i]: sweep value v, impl impls[i]. */
int ft_bench_plot(const char *path, const ft_config *cfg, const char *key, char (*values)[64],
                  int nvalues, const int *impls, int nimpl, ft_bench_result (*res)[FT_IMPL_COUNT]);

#endif
