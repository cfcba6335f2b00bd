/* bench's outputs: the stdout table, JSON lines and the SVG of a sweep. */
#define _POSIX_C_SOURCE 200809L
#include "bench.h"

#include "config_json.h"
#include "json.h"
#include "svg_plot.h"
#include "units.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void ft_bench_print_header(const char *key)
{
    printf("%-9s %-9s %9s %9s %10s %10s %10s %10s %9s %9s %12s %12s\n", "impl", "dtype", key, "tokens",
           "cold_s", "mean_s", "p50_s", "p90_s", "GFLOP/s", "roofline", "peak_work", "rss_work");
}

void ft_bench_print_row(const ft_config *cfg, const char *val, const ft_bench_result *r)
{
    if (!r->ok) {
        printf("%-9s %-9s %9s  FAILED: %s\n", ft_impl_name(r->impl), ft_dtype_name(cfg->dtype), val,
               r->error);
        return;
    }
    char pw[32], rw[32];
    ft_format_bytes_human(r->peak_work_bytes, pw, sizeof pw);
    ft_format_bytes_human(r->rss_work_bytes, rw, sizeof rw);
    printf("%-9s %-9s %9s %9lld %10.4g %10.4g %10.4g %10.4g %9.1f %8.1f%% %12s %12s\n",
           ft_impl_name(r->impl), ft_dtype_name(cfg->dtype), val, (long long)r->unmasked, r->cold_s,
           r->step_mean, r->step_p50, r->step_p90, r->gflops, 100.0 * r->roofline_ratio, pw, rw);
    if (r->impl == FT_IMPL_LOGITS)
        printf("          (logits: fg_logits_grpo alone %.4g s of the step; the rest is the tool's GEMMs)\n",
               r->kernel_mean);
    else if (r->call_mean > 0)
        printf("          (%s: the library's GEMMs %.4g s of its %.4g s call, %lld-row chunks x %lld)\n",
               ft_impl_name(r->impl), r->gemm_mean, r->call_mean, (long long)r->chunk_rows,
               (long long)r->chunks);
    if (r->error[0]) /* a measured run with a non-fatal note (e.g. the roofline failed) */
        printf("          note: %s\n", r->error);
}

void ft_bench_json_line(FILE *f, const ft_config *cfg, const char *sweep_key, const char *val,
                      const ft_bench_result *r)
{
    ft_json j;
    ft_json_init(&j, f);
    ft_json_object_begin(&j, NULL);
    ft_json_str(&j, "command", "bench");
    ft_json_str(&j, "impl", ft_impl_name(r->impl));
    ft_json_bool(&j, "ok", r->ok);
    if (r->error[0])
        ft_json_str(&j, "error", r->error);
    ft_json_str(&j, "sweep_key", sweep_key);
    ft_json_str(&j, "sweep_value", val);
    ft_json_str(&j, "dtype", ft_dtype_name(cfg->dtype));
    ft_json_int(&j, "batch", cfg->batch);
    ft_json_int(&j, "seq_len", cfg->seq_len);
    ft_json_int(&j, "hidden", cfg->hidden);
    ft_json_int(&j, "vocab", cfg->vocab);
    ft_json_int(&j, "tokens", r->tokens);
    ft_json_int(&j, "unmasked_tokens", r->unmasked);
    ft_json_int(&j, "steps", r->steps);
    ft_json_num(&j, "cold_s", r->cold_s);
    ft_json_num(&j, "step_s_mean", r->step_mean);
    ft_json_num(&j, "step_s_p50", r->step_p50);
    ft_json_num(&j, "step_s_p90", r->step_p90);
    ft_json_num(&j, "step_s_min", r->step_min);
    ft_json_num(&j, "step_s_max", r->step_max);
    if (r->impl == FT_IMPL_LOGITS) {
        ft_json_num(&j, "kernel_s_mean", r->kernel_mean);
    } else {
        ft_json_num(&j, "gemm_s_mean", r->gemm_mean);
        ft_json_num(&j, "call_s_mean", r->call_mean);
    }
    ft_json_num(&j, "peak_work_bytes", r->peak_work_bytes);
    ft_json_num(&j, "lib_peak_bytes", r->lib_peak_bytes);
    ft_json_num(&j, "tool_bytes", r->tool_bytes);
    ft_json_num(&j, "rss_peak_bytes", r->rss_peak_bytes);
    ft_json_num(&j, "rss_base_bytes", r->rss_base_bytes);
    ft_json_num(&j, "input_bytes", r->input_bytes);
    ft_json_num(&j, "output_bytes", r->output_bytes);
    ft_json_num(&j, "rss_work_bytes", r->rss_work_bytes);
    ft_json_int(&j, "chunk_rows", r->chunk_rows);
    ft_json_int(&j, "chunks", r->chunks);
    ft_json_int(&j, "lib_gemm_flops", r->lib_gemm_flops);
    ft_json_num(&j, "flops_per_step", r->flops);
    ft_json_num(&j, "gflops", r->gflops);
    ft_json_num(&j, "roofline_s", r->roofline_s);
    ft_json_num(&j, "roofline_ratio", r->roofline_ratio);
    ft_json_num(&j, "loss", r->loss);
    ft_config c = *cfg;
    c.impl = r->impl; /* the config this child ran */
    ft_config_json(&j, "config", &c);
    ft_json_object_end(&j);
    fflush(f);
}

int ft_bench_plot(const char *path, const ft_config *cfg, const char *key, char (*values)[64],
                  int nvalues, const int *impls, int nimpl, ft_bench_result (*res)[FT_IMPL_COUNT])
{
    double x[FT_BENCH_MAX_SWEEP], t[FT_IMPL_COUNT][FT_BENCH_MAX_SWEEP], m[FT_IMPL_COUNT][FT_BENCH_MAX_SWEEP];
    ft_series ts[FT_IMPL_COUNT], ms[FT_IMPL_COUNT];
    for (int v = 0; v < nvalues; v++) {
        uint64_t b;
        double d;
        x[v] = ft_parse_double(values[v], &d) == 0 ? d
               : ft_parse_bytes(values[v], &b) == 0 ? (double)b
                                                       : (double)v;
    }
    /* Units that keep tick labels short: s/ms/us and KiB/MiB/GiB by the largest value. */
    double tmax = 0, mmax = 0;
    for (int i = 0; i < nimpl; i++)
        for (int v = 0; v < nvalues; v++)
            if (res[v][i].ok) {
                tmax = fmax(tmax, res[v][i].step_p50);
                mmax = fmax(mmax, res[v][i].peak_work_bytes);
            }
    double tscale = tmax >= 1 ? 1 : tmax >= 1e-3 ? 1e3 : 1e6;
    const char *tunit = tmax >= 1 ? "seconds per step" : tmax >= 1e-3 ? "ms per step" : "us per step";
    double mscale = mmax >= 0x1p30 ? 0x1p-30 : mmax >= 0x1p20 ? 0x1p-20 : 0x1p-10;
    const char *munit = mmax >= 0x1p30 ? "GiB" : mmax >= 0x1p20 ? "MiB" : "KiB";
    for (int i = 0; i < nimpl; i++) {
        for (int v = 0; v < nvalues; v++) {
            const ft_bench_result *r = &res[v][i];
            t[i][v] = r->ok ? r->step_p50 * tscale : NAN;
            m[i][v] = r->ok ? r->peak_work_bytes * mscale : NAN;
        }
        ts[i] = (ft_series){ft_impl_name(impls[i]), nvalues, x, t[i]};
        ms[i] = (ft_series){ft_impl_name(impls[i]), nvalues, x, m[i]};
    }
    ft_panel panels[2] = {{"step time (p50)", tunit, ts, nimpl},
                          {"peak working memory (counted)", munit, ms, nimpl}};
    char title[256], err[512];
    snprintf(title, sizeof title, "fusedgrpo bench: B=%lld H=%lld V=%lld %s %s", (long long)cfg->batch,
             (long long)cfg->hidden, (long long)cfg->vocab, ft_dtype_name(cfg->dtype),
             ft_loss_type_name(cfg->loss_type));
    if (ft_svg_write(path, title, key, panels, 2, err, sizeof err) != 0) {
        fprintf(stderr, "fusedgrpo bench: %s\n", err);
        return -1;
    }
    return 0;
}

