/*
 * One impl's measurements, in a process of its own so that its memory peak
 * (VmHWM) is not mixed with another impl's. Inputs come from the parent's
 * shared arena (mapped read-only and pre-faulted); outputs are allocated once
 * and pre-faulted, so no timed step pays first-touch page faults.
 *
 * The first step is timed alone (cold: workspace allocation, oneDNN kernel
 * generation); `warmup` counts it, and `steps` timed steps follow.
 */
#define _POSIX_C_SOURCE 200809L
#include "bench.h"

#include "progress.h"
#include "runner.h"
#include "stats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void send_result(int fd, const ft_bench_result *r)
{
    const char *p = (const char *)r;
    size_t left = sizeof *r;
    while (left > 0) {
        ssize_t n = write(fd, p, left);
        if (n <= 0)
            return; /* the parent reports a short result */
        p += n;
        left -= (size_t)n;
    }
}

static int measure(ft_cli *cli, ft_bench_result *res)
{
    ft_config *cfg = &cli->cfg;
    if (ft_impl_parse(cli->child_impl, &res->impl) != 0) {
        snprintf(res->error, sizeof res->error, "unknown impl '%s'", cli->child_impl);
        return -1;
    }
    res->rss_base_bytes = (double)ft_proc_status_bytes("VmRSS");
    ft_problem p;
    if (ft_problem_map_fd(cli->problem_fd, &p, res->error, sizeof res->error) != 0)
        return -1;
    const int64_t H = p.s.hidden, V = p.s.vocab;
    res->tokens = ft_problem_tokens(&p);
    res->unmasked = ft_problem_unmasked(&p);
    res->input_bytes = (double)p.bytes;

    ft_runner r;
    int rc = -1;
    double *times = malloc((size_t)cfg->steps * sizeof *times);
    double *ktimes = malloc((size_t)cfg->steps * sizeof *ktimes);
    if (times == NULL || ktimes == NULL) {
        snprintf(res->error, sizeof res->error, "out of memory");
        goto out_problem;
    }
    if (ft_runner_init(&r, cfg, &p, res->impl, 1) != 0) {
        snprintf(res->error, sizeof res->error, "%s", r.err);
        goto out;
    }
    res->output_bytes = (double)r.output_bytes;

    ft_progress bar;
    char label[64];
    snprintf(label, sizeof label, "%s", ft_impl_name(res->impl));
    int64_t warm = cfg->warmup > 1 ? cfg->warmup : 1;
    ft_progress_start(&bar, label, warm + cfg->steps);
    for (int64_t i = 0; i < warm; i++) {
        double t0 = ft_now();
        if (ft_runner_step(&r) != 0)
            goto step_failed;
        double dt = ft_now() - t0;
        if (i == 0)
            res->cold_s = dt;
        ft_progress_update(&bar, i + 1, dt);
    }
    double gemm_sum = 0, call_sum = 0;
    for (int64_t i = 0; i < cfg->steps; i++) {
        double t0 = ft_now();
        if (ft_runner_step(&r) != 0)
            goto step_failed;
        times[i] = ft_now() - t0;
        ktimes[i] = r.kernel_s;
        fg_memory_stats step_ms;
        if (fg_get_memory_stats(r.ctx, &step_ms) == FG_OK) {
            gemm_sum += step_ms.gemm_seconds;
            call_sum += step_ms.call_seconds;
        }
        ft_progress_update(&bar, warm + i + 1, times[i]);
    }
    ft_progress_finish(&bar);

    /* Peak memory before the roofline, whose own buffers would count. */
    res->rss_peak_bytes = (double)ft_proc_status_bytes("VmHWM");
    res->rss_work_bytes = res->rss_peak_bytes - res->input_bytes - res->output_bytes;
    fg_memory_stats ms;
    memset(&ms, 0, sizeof ms);
    fg_get_memory_stats(r.ctx, &ms);
    res->lib_peak_bytes = (double)ms.peak_bytes;
    res->tool_bytes = (double)ft_runner_tool_bytes(&r);
    res->peak_work_bytes = res->lib_peak_bytes + res->tool_bytes;
    res->chunk_rows = ms.chunk_rows;
    res->chunks = ms.chunks;
    res->lib_gemm_flops = ms.gemm_flops;

    ft_summary s = ft_summarize(times, cfg->steps);
    res->steps = cfg->steps;
    res->step_mean = s.mean;
    res->step_p50 = s.p50;
    res->step_p90 = s.p90;
    res->step_min = s.min;
    res->step_max = s.max;
    res->kernel_mean = res->impl == FT_IMPL_LOGITS ? ft_summarize(ktimes, cfg->steps).mean : 0.0;
    res->gemm_mean = res->impl == FT_IMPL_LOGITS ? 0.0 : gemm_sum / (double)cfg->steps;
    res->call_mean = res->impl == FT_IMPL_LOGITS ? 0.0 : call_sum / (double)cfg->steps;
    res->loss = r.loss_value;
    res->flops = 6.0 * (double)res->unmasked * (double)H * (double)V;
    res->gflops = res->step_p50 > 0 ? res->flops / res->step_p50 / 1e9 : 0.0;

    /* The roofline allocates GEMM buffers of its own: drop ours first so the
     * child never holds both (at the headline shape that would not fit). */
    ft_runner_release_buffers(&r);
    res->roofline_s = 0;
    res->roofline_ratio = 0;
    if (cfg->roofline_reps > 0 && res->unmasked > 0) {
        /* Fused: the chunk the library picks under its budget; the others
         * issue one GEMM over every token. */
        int64_t rows = res->impl == FT_IMPL_FUSED ? 0 : res->unmasked;
        fg_dtype dt = p.s.dtype == FT_DTYPE_BF16 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
        fg_status st = fg_time_bare_gemms(r.ctx, dt, res->unmasked, H, V, rows,
                                          (int)cfg->roofline_reps, &res->roofline_s);
        if (st != FG_OK) { /* the timings stand; only the roofline is missing */
            char msg[900];
            ft_describe_status(r.ctx, st, msg, sizeof msg);
            snprintf(res->error, sizeof res->error, "no roofline: fg_time_bare_gemms: %s", msg);
            res->roofline_s = res->roofline_ratio = NAN;
        } else {
            res->roofline_ratio = res->step_p50 > 0 ? res->roofline_s / res->step_p50 : 0.0;
        }
    }
    rc = 0;
    goto out;
step_failed:
    ft_progress_finish(&bar);
    snprintf(res->error, sizeof res->error, "%s", r.err);
out:
    ft_runner_free(&r);
out_problem:
    free(times);
    free(ktimes);
    ft_problem_destroy(&p);
    return rc;
}

int ft_bench_child(ft_cli *cli)
{
    ft_bench_result res;
    memset(&res, 0, sizeof res);
    if (cli->problem_fd < 0 || cli->result_fd < 0) {
        fprintf(stderr, "fusedgrpo bench --child needs --problem-fd and --result-fd\n");
        return 2;
    }
    res.ok = measure(cli, &res) == 0;
    send_result(cli->result_fd, &res);
    close(cli->result_fd);
    return res.ok ? 0 : 1;
}
