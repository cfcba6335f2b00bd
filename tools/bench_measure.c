/*
 * One impl's measurements, in a child process of its own (bench.c says why).
 * Inputs (the parent's shared mapping, sealed read-only) and outputs are
 * faulted in before any timing. The first step is timed alone (cold_s:
 * workspace allocation, oneDNN kernel generation); `warmup` counts it, and
 * `steps` timed steps follow. Times in seconds, sizes in bytes.
 *
 * Then the roofline: the step's three GEMMs alone through the library's GEMM
 * layer (gemm.h), on the tool's own buffers allocated after the steps (so
 * outside both memory peaks): at full shape over the unmasked tokens as the
 * materialized baseline issues them (roofline_s), and in the fused path's
 * chunk rows as the planner picks them for this call (chunked_gemm_s); and
 * the machine's rate for a 2048-cube product in the step's compute dtype
 * (peak_gemm_gflops), the ceiling the full-shape rate (roofline_gflops) is
 * held against.
 */
#define _POSIX_C_SOURCE 200809L
#include "bench.h"

#include "runner.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void num(cJSON *j, const char *key, double v) { cJSON_AddNumberToObject(j, key, v); }

/* A "VmHWM"/"VmRSS" field of /proc/self/status in bytes; -1 if absent. */
static double proc_status_bytes(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, field, strlen(field)) == 0 && line[strlen(field)] == ':')
            sscanf(line + strlen(field) + 1, "%lld", &kb);
    if (f)
        fclose(f);
    return kb < 0 ? -1.0 : (double)kb * 1024.0;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Percentile q of n samples (sorted in place), interpolated as numpy.percentile's default. */
static double percentile(double *x, int64_t n, double q)
{
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    const double pos = q * (double)(n - 1);
    const int64_t lo = (int64_t)pos, hi = lo + 1 < n ? lo + 1 : lo;
    return x[lo] + (x[hi] - x[lo]) * (pos - (double)lo);
}

/* The three products of a step over `total` token rows, `rows` in the first
 * product and `later` in each after it (the library's chunk layout, whose
 * first chunk is the longest), on buffers for `rows` rows: the median wall
 * time over roofline_reps, after a dry pass that makes the primitives and
 * scratch; NaN with a note on failure. */
static double time_gemms(const ft_config *cfg, const ft_problem *p, int64_t rows, int64_t later,
                         int64_t total, double *bytes_max, char *note, size_t notelen)
{
    const int64_t H = p->s.hidden, V = p->s.vocab, reps = cfg->roofline_reps;
    const int dt = p->s.dtype;
    ft_gemm g;
    if (ft_gemm_init(&g, (int)cfg->threads, rows, note, notelen) != 0)
        return NAN;
    /* As the library's driver: bf16 operands only where oneDNN multiplies
     * bf16 natively, else f32; f32 dlogits overwrite the logits in place. */
    const int cmp = dt == FG_DTYPE_BF16 && g.native_bf16 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    const size_t r = (size_t)rows, h_bytes = r * (size_t)H * ft_dtype_size(cmp), z_bytes = r * (size_t)V * 4,
                 dl_bytes = cmp == FG_DTYPE_F32 ? 0 : r * (size_t)V * 2, gh_bytes = r * (size_t)H * 4,
                 bytes = h_bytes + z_bytes + dl_bytes + gh_bytes + (size_t)V * (size_t)H * 4;
    char *h = ft_big_alloc(bytes);
    double *t = malloc((size_t)reps * sizeof *t), median = NAN;
    int rc = h && t ? 0 : ft_error(g.err.msg, sizeof g.err.msg, "out of memory for %zu bytes", bytes);
    char *z = rc ? NULL : h + h_bytes, *dl = rc || !dl_bytes ? z : z + z_bytes;
    float *gh = rc ? NULL : (float *)(z + z_bytes + dl_bytes);
    float *gw = rc ? NULL : (float *)((char *)gh + gh_bytes);
    for (int64_t i = 0; rc == 0 && i < rows * H; i++)
        ft_store(h, cmp, i, ft_load(p->hidden, dt, i));
    for (int64_t k = -1; k < reps && rc == 0; k++) {
        const double t0 = omp_get_wtime();
        g.dry = k < 0;
        for (int64_t r0 = 0, step = rows; r0 < total && rc == 0; r0 += step, step = later) {
            const int64_t m = total - r0 < step ? total - r0 : step;
            rc = ft_gemm_logits(&g, cmp, h, m, dt, p->weight, p->bias, V, H, FG_DTYPE_F32, z) ||
                 ft_gemm_backward(&g, cmp, dl, h, m, dt, p->weight, V, H, gh, gw, r0 > 0);
        }
        if (k >= 0)
            t[k] = omp_get_wtime() - t0;
    }
    if (rc == 0)
        median = percentile(t, reps, 0.5);
    else
        snprintf(note, notelen, "no roofline: %s", g.err.msg);
    *bytes_max = fmax(*bytes_max, (double)(bytes + ft_gemm_bytes(&g)));
    free(t);
    ft_big_free(h, bytes);
    ft_gemm_free(&g);
    return median;
}

/* The machine's GEMM rate for the step's compute dtype: a PEAK_N-cube product
 * through the library's GEMM layer (its blocks, all threads), median of
 * roofline_reps after a dry pass, in FLOP/s; NaN with a note on failure. The
 * ceiling the step's own products (roofline_s) are held against. */
#define PEAK_N 2048
static double peak_gemm_rate(const ft_config *cfg, const ft_problem *p, double *bytes_max,
                             char *note, size_t notelen)
{
    const int64_t n = PEAK_N, reps = cfg->roofline_reps;
    ft_gemm g;
    if (ft_gemm_init(&g, (int)cfg->threads, 0, note, notelen) != 0)
        return NAN;
    const int cmp = p->s.dtype == FG_DTYPE_BF16 && g.native_bf16 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    const size_t op = (size_t)n * (size_t)n * ft_dtype_size(cmp), bytes = 2 * op + (size_t)n * (size_t)n * 4;
    char *a = ft_big_alloc(bytes);
    double *t = malloc((size_t)reps * sizeof *t), rate = NAN;
    int rc = a && t ? 0 : ft_error(g.err.msg, sizeof g.err.msg, "out of memory for %zu bytes", bytes);
    for (int64_t i = 0; rc == 0 && i < 2 * n * n; i++) /* A then B: small values, no denormals */
        ft_store(a, cmp, i, (float)((i * 7919) % 1000) * 1e-3f - 0.5f);
    for (int64_t k = -1; k < reps && rc == 0; k++) {
        const double t0 = omp_get_wtime();
        g.dry = k < 0;
        rc = ft_gemm_logits(&g, cmp, a, n, cmp, a + op, NULL, n, n, FG_DTYPE_F32, a + 2 * op);
        if (k >= 0)
            t[k] = omp_get_wtime() - t0;
    }
    if (rc == 0)
        rate = 2.0 * (double)n * (double)n * (double)n / percentile(t, reps, 0.5);
    else
        snprintf(note, notelen, "no peak GEMM rate: %s", g.err.msg);
    *bytes_max = fmax(*bytes_max, (double)(bytes + ft_gemm_bytes(&g)));
    free(t);
    ft_big_free(a, bytes);
    ft_gemm_free(&g);
    return rate;
}

/* One impl's steps as they run, so that two impls can take turns (--interleave):
 * step i of `warm + n` (the first is cold_s), the timed ones kept in t. */
typedef struct step_log {
    ft_runner *r;
    cJSON *j;
    int64_t warm, n;
    double *t, mean, kernel, gemm, call;
} step_log;

static int step_log_init(step_log *s, ft_runner *r, cJSON *j, const ft_config *cfg)
{
    *s = (step_log){.r = r, .j = j, .warm = cfg->warmup > 1 ? cfg->warmup : 1, .n = cfg->steps};
    s->t = malloc((size_t)s->n * sizeof *s->t);
    return s->t ? 0 : ft_error(r->err, sizeof r->err, "out of memory");
}

static int step_log_run(step_log *s, int64_t i)
{
    ft_runner *r = s->r;
    const double t0 = omp_get_wtime();
    if (ft_runner_step(r) != 0)
        return -1;
    const double dt = omp_get_wtime() - t0;
    fg_memory_stats ms = {0};
    fg_get_memory_stats(r->ctx, &ms);
    if (i == 0)
        num(s->j, "cold_s", dt);
    if (i >= s->warm) {
        s->t[i - s->warm] = dt;
        s->mean += dt / (double)s->n;
        s->kernel += r->kernel_s / (double)s->n;
        s->gemm += ms.gemm_seconds / (double)s->n;
        s->call += ms.call_seconds / (double)s->n;
    }
    if (isatty(STDERR_FILENO)) /* progress, on a terminal only: logs stay free of it */
        fprintf(stderr, "\r%-9s step %lld/%lld  %.3g s\033[K", ft_impl_name(r->impl), (long long)i + 1,
                (long long)(s->warm + s->n), dt);
    return 0;
}

/* The step and memory figures into s->j (sorts s->t). rss: VmHWM is this
 * impl's own (not when two impls shared the process). */
static void step_log_report(step_log *s, double fixed_bytes, double flops, int rss)
{
    if (isatty(STDERR_FILENO))
        fputs("\r\033[K", stderr);
    cJSON *j = s->j;
    const ft_runner *r = s->r;
    const int logits = r->impl == FT_IMPL_LOGITS;
    const int64_t n = s->n;
    /* The timed steps in the order they ran, before the percentiles sort them:
     * with --interleave, step i of each impl is pair i (drift and order checks). */
    cJSON_AddItemToObject(j, "step_s", cJSON_CreateDoubleArray(s->t, (int)n));
    /* Memory before the roofline, whose own buffers would count. */
    const double hwm = rss ? proc_status_bytes("VmHWM") : NAN, p50 = percentile(s->t, n, 0.5);
    fg_memory_stats ms = {0};
    fg_get_memory_stats(r->ctx, &ms);
    num(j, "steps", (double)n);
    num(j, "step_s_mean", s->mean);
    num(j, "step_s_p50", p50);
    num(j, "step_s_p90", percentile(s->t, n, 0.9));
    num(j, "step_s_min", s->t[0]);
    num(j, "step_s_max", s->t[n - 1]);
    num(j, logits ? "kernel_s_mean" : "gemm_s_mean", logits ? s->kernel : s->gemm); /* the library's own */
    if (!logits)
        num(j, "call_s_mean", s->call);
    num(j, "peak_work_bytes", (double)(ms.peak_bytes + ft_runner_tool_bytes(r))); /* counted + the tool's */
    num(j, "lib_peak_bytes", (double)ms.peak_bytes);
    num(j, "tool_bytes", (double)ft_runner_tool_bytes(r)); /* logits impl: logits + GEMM scratch */
    num(j, "rss_peak_bytes", hwm);
    num(j, "rss_work_bytes", hwm - fixed_bytes); /* VmHWM - inputs - outputs */
    num(j, "chunk_rows", (double)ms.chunk_rows);
    num(j, "chunks", (double)ms.chunks);
    num(j, "lib_gemm_flops", (double)ms.gemm_flops);
    /* Gradient filtering: the share of d loss/d logits the backward products used. */
    num(j, "dlogits_kept_frac",
        ms.dlogits_entries > 0 ? (double)ms.dlogits_kept / (double)ms.dlogits_entries : 1.0);
    num(j, "gflops", p50 > 0 ? flops / p50 / 1e9 : 0.0);
    num(j, "loss", r->loss_value); /* the last step's, a sanity value */
    num(j, "entropy_mean", r->metrics.entropy); /* the batch's: how peaked its softmax is */
}

/* The problem's figures every impl's object starts with; returns the step's FLOPs. */
static double begin(cJSON *j, ft_problem *p)
{
    num(j, "rss_base_bytes", proc_status_bytes("VmRSS"));
    const int64_t n = ft_problem_unmasked(p);
    num(j, "tokens", (double)ft_problem_tokens(p));
    num(j, "unmasked_tokens", (double)n);
    num(j, "input_bytes", (double)p->bytes);
    const double flops = 6.0 * (double)n * (double)p->s.hidden * (double)p->s.vocab;
    num(j, "flops_per_step", flops);
    return flops;
}

/* The roofline figures (bench_measure.c's head) into each of js[0..nj), after
 * every step's buffer is gone; chunk, later: the fused path's first and later
 * chunk rows (chunk <= 0: none). */
static void roofline(const ft_config *cfg, const ft_problem *p, int64_t chunk, int64_t later,
                     double flops, cJSON **js, int nj, char *note, size_t notelen)
{
    const int64_t n = ft_problem_unmasked(p);
    double full = 0, chunked = 0, bytes = 0, peak = 0;
    const int64_t cut = later >= 1 && later <= chunk ? later : chunk; /* buffers hold `chunk` rows */
    if (cfg->roofline_reps > 0 && n > 0) { /* a failure leaves a note */
        full = time_gemms(cfg, p, n, n, n, &bytes, note, notelen);
        chunked = chunk > 0 ? time_gemms(cfg, p, chunk, cut, n, &bytes, note, notelen) : NAN;
        peak = peak_gemm_rate(cfg, p, &bytes, note, notelen);
    }
    for (int i = 0; i < nj; i++) {
        cJSON *j = js[i];
        const cJSON *median = cJSON_GetObjectItem(j, "step_s_p50");
        num(j, "fused_chunk_rows", (double)chunk);
        num(j, "fused_later_chunk_rows", (double)later);
        num(j, "roofline_s", full);
        num(j, "chunked_gemm_s", chunked);
        num(j, "roofline_ratio", median && full > 0 ? full / median->valuedouble : full);
        num(j, "roofline_bytes", bytes); /* the roofline's and peak product's buffers, not the library's */
        num(j, "peak_gemm_gflops", peak / 1e9);
        num(j, "roofline_gflops", full > 0 ? flops / full / 1e9 : 0);
    }
}

/* Appends j's text and a newline to out (FT_BENCH_RESULT_BYTES) and frees j. */
static void emit(cJSON *j, int ok, const char *note, char *out)
{
    cJSON_AddBoolToObject(j, "ok", ok);
    if (note[0])
        cJSON_AddStringToObject(j, "error", note);
    char *text = cJSON_PrintUnformatted(j);
    const size_t used = strlen(out);
    snprintf(out + used, FT_BENCH_RESULT_BYTES - used, "%s\n", text ? text : "{}");
    cJSON_free(text);
    cJSON_Delete(j);
}

int ft_bench_measure(void *arg, void *out)
{
    const ft_bench_job *job = arg;
    const ft_config *cfg = job->cfg;
    ft_problem *p = job->p;
    cJSON *j = cJSON_CreateObject();
    char note[1024] = "";
    ((char *)out)[0] = '\0';
    const double flops = begin(j, p);
    ft_problem_seal(p);
    ft_runner r;
    step_log s = {0};
    int ok = ft_runner_init(&r, cfg, p, job->impl, 1) == 0 && step_log_init(&s, &r, j, cfg) == 0;
    if (ok)
        num(j, "output_bytes", (double)r.output_bytes);
    for (int64_t i = 0; ok && i < s.warm + s.n; i++)
        ok = step_log_run(&s, i) == 0;
    if (ok)
        step_log_report(&s, (double)p->bytes + (double)r.output_bytes, flops, 1);
    else
        snprintf(note, sizeof note, "%s", r.err);
    free(s.t);
    int64_t later = 0;
    const int64_t chunk = ok ? ft_runner_fused_chunk_rows(&r, &later) : 0;
    if (ok && chunk <= 0)
        snprintf(note, sizeof note, "no chunked roofline: %.900s", r.err);
    /* Every buffer goes first: the child never holds a step's memory and the
     * roofline's at once (at the headline shape both would not fit). */
    ft_runner_free(&r);
    if (ok)
        roofline(cfg, p, chunk, later, flops, &j, 1, note, sizeof note);
    emit(j, ok, note, out);
    return ok ? 0 : 1;
}

/* Median, min and max over the pairs of a / b into j (a and b left as they are). */
static void pair_ratios(cJSON *j, const double *a, const double *b, int64_t n)
{
    double *q = malloc((size_t)n * sizeof *q);
    if (q == NULL)
        return;
    for (int64_t i = 0; i < n; i++)
        q[i] = a[i] / b[i];
    num(j, "pair_ratio_p50", percentile(q, n, 0.5)); /* sorts q */
    num(j, "pair_ratio_min", q[0]);
    num(j, "pair_ratio_max", q[n - 1]);
    free(q);
}

int ft_bench_measure_interleaved(void *arg, void *out)
{
    const ft_bench_job *job = arg;
    const ft_config *cfg = job->cfg;
    ft_problem *p = job->p;
    cJSON *js[2];
    char note[1024] = "";
    ft_runner r[2];
    step_log s[2] = {{0}, {0}};
    int ok = 1, made = 0;
    ((char *)out)[0] = '\0';
    ft_problem_seal(p);
    double flops = 0;
    for (int k = 0; k < 2; k++)
        flops = begin(js[k] = cJSON_CreateObject(), p);
    for (; ok && made < 2; made++) {
        ok = ft_runner_init(&r[made], cfg, p, job->impls[made], 1) == 0 &&
             step_log_init(&s[made], &r[made], js[made], cfg) == 0;
        if (!ok)
            snprintf(note, sizeof note, "%s: %s", ft_impl_name(job->impls[made]), r[made].err);
    }
    /* Step i runs A then B when i is even, B then A when odd: a drift of the
     * machine's speed within a pair falls on both alike (ABBA). */
    for (int64_t i = 0; ok && i < s[0].warm + s[0].n; i++)
        for (int q = 0; ok && q < 2; q++) {
            const int k = (int)(i & 1) ^ q;
            ok = step_log_run(&s[k], i) == 0;
            if (!ok)
                snprintf(note, sizeof note, "%s: %s", ft_impl_name(job->impls[k]), r[k].err);
        }
    for (int k = 0; ok && k < 2; k++) {
        cJSON_AddStringToObject(js[k], "paired_with", ft_impl_name(job->impls[1 - k]));
        pair_ratios(js[k], s[k].t, s[1 - k].t, s[k].n); /* before the report sorts the times */
    }
    for (int k = 0; ok && k < 2; k++) {
        num(js[k], "output_bytes", (double)r[k].output_bytes);
        step_log_report(&s[k], (double)p->bytes + (double)r[k].output_bytes, flops, 0);
    }
    int64_t later = 0;
    const int64_t chunk = ok ? ft_runner_fused_chunk_rows(&r[0], &later) : 0;
    if (ok && chunk <= 0)
        snprintf(note, sizeof note, "no chunked roofline: %.900s", r[0].err);
    for (int k = 0; k < made; k++) {
        free(s[k].t);
        ft_runner_free(&r[k]);
    }
    if (ok)
        roofline(cfg, p, chunk, later, flops, js, 2, note, sizeof note);
    for (int k = 0; k < 2; k++)
        emit(js[k], ok, note, out);
    return ok ? 0 : 1;
}
