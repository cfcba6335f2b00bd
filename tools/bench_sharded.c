/*
 * `fusedgrpo bench` under mpirun (see sharded.h): vocab_shards x data_shards
 * ranks, each impl timed in this process (MPI forbids the fork bench uses
 * elsewhere). A step is the library call and the data-parallel end; its time
 * is the slowest rank's. Traffic is the payload each rank hands to
 * MPI_Allreduce per step (a ring allreduce puts about twice that on the wire).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "problem_source.h"
#include "sharded.h"

#ifdef FT_HAVE_MPI
#include <mpi.h>
#define WTIME() MPI_Wtime()
#else
#include <omp.h>
#define WTIME() omp_get_wtime()
#endif

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Warm-up, then the timed steps: median, min and max of the slowest rank's times. */
static int time_impl(ft_shards *s, ft_runner *r, const ft_config *cfg, double *t, cJSON *j)
{
    const int64_t n = cfg->steps, warm = cfg->warmup;
    for (int64_t i = 0; i < warm + n; i++) {
        ft_sharded_max(s, 0.0); /* every rank starts together */
        const double t0 = WTIME();
        if (ft_sharded_step(s, r, 0) != 0)
            return -1;
        const double dt = ft_sharded_max(s, WTIME() - t0);
        if (i >= warm)
            t[i - warm] = dt;
    }
    qsort(t, (size_t)n, sizeof *t, cmp);
    double hook, data, calls;
    ft_sharded_traffic(s, &hook, &data, &calls);
    cJSON_AddNumberToObject(j, "steps", (double)n);
    cJSON_AddNumberToObject(j, "step_s_p50", n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]));
    cJSON_AddNumberToObject(j, "step_s_min", t[0]);
    cJSON_AddNumberToObject(j, "step_s_max", t[n - 1]);
    cJSON_AddNumberToObject(j, "hook_bytes_per_rank", hook);
    cJSON_AddNumberToObject(j, "data_bytes_per_rank", data);
    cJSON_AddNumberToObject(j, "reductions_per_rank", calls);
    cJSON_AddNumberToObject(j, "loss", r->loss_value);
    return 0;
}

int ft_bench_sharded(const ft_config *cfg0, const char *inputs, const int *impls, int nimpl,
                     const char *json)
{
    ft_config cfg = *cfg0;
    char err[1024];
    ft_shards *s = NULL;
    if (ft_sharded_init(&s, &cfg, err, sizeof err) != 0) {
        fprintf(stderr, "fusedgrpo bench: %s\n", err);
        ft_sharded_finish(s);
        return FT_EXIT_USAGE;
    }
    const int root = ft_sharded_rank(s) == 0;
    FILE *jf = root && json ? fopen(json, "w") : NULL;
    int status = FT_EXIT_OK;
    if (root && json && !jf) {
        fprintf(stderr, "fusedgrpo bench: cannot write %s: %s\n", json, strerror(errno));
        status = FT_EXIT_USAGE;
    }
    ft_problem p = {0};
    if (status == FT_EXIT_OK && ft_problem_make(inputs, &cfg, 0, &p, err, sizeof err) != 0) {
        fprintf(stderr, "fusedgrpo bench: rank %d: %s\n", ft_sharded_rank(s), err);
        status = FT_EXIT_USAGE;
    }
    if (root && status == FT_EXIT_OK)
        printf("%-9s %-9s %-7s %9s %10s %10s %10s %14s %14s %11s\n", "impl", "dtype", "ranks",
               "tokens", "p50_s", "min_s", "max_s", "hook_MiB/rank", "data_MiB/rank",
               "reductions");
    for (int i = 0; i < nimpl && status == FT_EXIT_OK; i++) {
        if (impls[i] == FT_IMPL_LOGITS)
            continue; /* no vocab-sharded form */
        ft_runner r;
        double *t = malloc((size_t)cfg.steps * sizeof *t);
        cJSON *j = ft_config_json(&cfg);
        cJSON_AddStringToObject(j, "command", "bench");
        cJSON_AddStringToObject(j, "impl", ft_impl_name(impls[i]));
        if (!t || ft_runner_init(&r, &cfg, &p, impls[i], 0) != 0 || time_impl(s, &r, &cfg, t, j) != 0) {
            fprintf(stderr, "fusedgrpo bench: rank %d: %s\n", ft_sharded_rank(s),
                    t ? r.err : "out of memory");
            status = FT_EXIT_FAIL;
        } else if (root) {
            const double mib = 1024.0 * 1024.0;
            printf("%-9s %-9s %3lldx%-3lld %9lld %10.4f %10.4f %10.4f %14.3f %14.3f %11.0f\n",
                   ft_impl_name(impls[i]), ft_dtype_name(cfg.dtype), (long long)cfg.vocab_shards,
                   (long long)cfg.data_shards, (long long)ft_problem_unmasked(&p),
                   cJSON_GetObjectItem(j, "step_s_p50")->valuedouble,
                   cJSON_GetObjectItem(j, "step_s_min")->valuedouble,
                   cJSON_GetObjectItem(j, "step_s_max")->valuedouble,
                   cJSON_GetObjectItem(j, "hook_bytes_per_rank")->valuedouble / mib,
                   cJSON_GetObjectItem(j, "data_bytes_per_rank")->valuedouble / mib,
                   cJSON_GetObjectItem(j, "reductions_per_rank")->valuedouble);
        }
        if (root && ft_json_write_line(jf, j) != 0) {
            fprintf(stderr, "fusedgrpo bench: cannot write %s: %s\n", json, strerror(errno));
            status = FT_EXIT_USAGE;
        } else if (!root)
            cJSON_Delete(j);
        ft_runner_free(&r);
        free(t);
    }
    if (jf && fclose(jf) != 0 && status != FT_EXIT_USAGE) {
        fprintf(stderr, "fusedgrpo bench: cannot write %s: %s\n", json, strerror(errno));
        status = FT_EXIT_USAGE;
    }
    ft_problem_destroy(&p);
    ft_sharded_finish(s);
    return status;
}
