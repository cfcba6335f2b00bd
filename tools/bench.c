/*
 * `fusedgrpo bench`: baseline, logits and fused on the same inputs. Prints a
 * table and optionally writes JSON lines, one per impl and point of a sweep
 * over one key (bench/plot_bench.py draws them, not this program).
 *
 * Each impl is measured in a forked child of its own: peak RSS (VmHWM) only
 * ever grows and freed memory stays in the allocator, so one process per
 * impl is the only sound way to get each impl's own peak. fork, not exec:
 * the child inherits the shared input mapping and the config as they are.
 * libgomp is not fork-safe (a child hangs in its first parallel region if
 * the parent ever ran one), so this process never runs OpenMP code: it
 * parses, forks and prints, and the synthetic inputs are made in a child too.
 */
#define _GNU_SOURCE
#include "bench.h"

#include "commands.h"
#include "problem_source.h"
#include "sharded.h"
#include "synth.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_SWEEP 64

static const char USAGE[] =
    "usage: fusedgrpo bench [--config FILE]... [--set key=value]... [options]\n"
    "  Times impls on one seeded batch (or --inputs DIR), each in its own process: the\n"
    "  cold step, mean/p50/p90 over `steps`, counted and RSS peak memory, GFLOP/s and\n"
    "  the roofline (the step's GEMMs alone, at full shape and in the fused chunks) and\n"
    "  the machine's GEMM rate (a 2048-cube product in the step's compute dtype).\n"
    "options:\n"
    "  --impls LIST       comma-separated subset of baseline,logits,fused (default: all)\n"
    "  --sweep KEY=V1,V2  repeat for each value of KEY (e.g. seq_len=512,1024,2048)\n"
    "  --json FILE        one JSON line per impl and sweep point (plot: bench/plot_bench.py)\n"
    "  --inputs DIR       a captured batch instead of the synthetic one (its shape wins)\n"
    "  --interleave       exactly two impls (A,B) in one process, their steps taking turns\n"
    "                     (A B, B A, ...): each pair's time ratio A/B (median, min, max), which a\n"
    "                     machine whose speed drifts cannot skew; peak RSS is then not per impl;\n"
    "                     one impl twice (baseline,baseline) is the A/A control: the ratios'\n"
    "                     spread when both sides do the same work\n"
    "  Under mpirun with --set vocab_shards=V,data_shards=D (V x D ranks): fused and baseline\n"
    "  sharded over the ranks: step time (the slowest rank's), payload bytes per rank.\n";

/* Runs fn(arg, out) in a child process; out (bytes long, read and written by
 * fn) comes back through shared memory. Returns fn's status (0 or 1), or -1
 * with the reason in why when the child could not run or died. */
static int isolate(int (*fn)(void *arg, void *out), void *arg, void *out, size_t bytes, char *why,
                   size_t whylen)
{
    void *shared = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED)
        return ft_error(why, whylen, "cannot map a result page: %s", strerror(errno));
    memcpy(shared, out, bytes);
    fflush(NULL); /* buffered output must not be written twice */
    const pid_t pid = fork();
    const int fork_errno = errno;
    if (pid == 0)
        _exit(fn(arg, shared) == 0 ? 0 : 1);
    int status = 0;
    while (pid > 0 && waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    memcpy(out, shared, bytes);
    munmap(shared, bytes);
    if (pid < 0)
        snprintf(why, whylen, "cannot start a child process: %s", strerror(fork_errno));
    else if (WIFSIGNALED(status))
        snprintf(why, whylen, "child killed by signal %d%s", WTERMSIG(status),
                 WTERMSIG(status) == 9 ? " (out of memory?)" : "");
    else
        return WEXITSTATUS(status) == 0 ? 0 : 1;
    return -1;
}

#define MSG 1024

static int fill(void *job, void *err)
{
    const ft_bench_job *j = job;
    return ft_synth_fill(j->p, j->cfg, err, MSG);
}

typedef struct sweep {
    char key[64], text[4096];
    const char *values[MAX_SWEEP]; /* into text */
    int n;
} sweep;

/* A comma-separated subset of the impls, each through the config's own parser.
 * With twice_ok (--interleave) an impl may be given twice: "baseline,baseline"
 * is the A/A control, the pair ratios' spread when nothing differs. */
static int parse_impls(const char *list, const ft_config *cfg, int twice_ok, int *impls, int *n)
{
    char buf[256], err[512];
    unsigned seen = 0;
    ft_config c = *cfg;
    snprintf(buf, sizeof buf, "%s", list ? list : "baseline,logits,fused");
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        const int bad = ft_config_set(&c, "impl", tok, "--impls", 0, err, sizeof err) != 0;
        const char *why = bad                                 ? err
                          : *n == FT_IMPL_COUNT                 ? "--impls: too many impls"
                          : !twice_ok && (seen & 1u << c.impl) ? "--impls: an impl given twice (only with --interleave)"
                                                                : NULL;
        if (why) {
            fprintf(stderr, "fusedgrpo bench: %s\n", why);
            return -1;
        }
        seen |= 1u << c.impl;
        impls[(*n)++] = c.impl;
    }
    if (*n == 0)
        fprintf(stderr, "fusedgrpo bench: --impls '%s' names no impl (baseline, logits, fused)\n",
                list);
    return *n > 0 ? 0 : -1;
}

/* KEY=V1,V2,... (without --sweep: seq_len at its configured value). Every
 * value is checked now rather than after an hour of measurements. */
static int parse_sweep(const char *spec, const ft_config *cfg, sweep *sw)
{
    char self[96] = "seq_len=", err[512];
    if (spec == NULL)
        ft_config_format(cfg, "seq_len", self + 8, sizeof self - 8);
    spec = spec ? spec : self;
    const char *eq = strchr(spec, '=');
    if (eq == NULL || eq == spec || (size_t)(eq - spec) >= sizeof sw->key) {
        fprintf(stderr, "fusedgrpo bench: --sweep expects KEY=V1,V2,..., got '%s'\n", spec);
        return -1;
    }
    snprintf(sw->key, (size_t)(eq - spec) + 1, "%s", spec);
    snprintf(sw->text, sizeof sw->text, "%s", eq + 1);
    sw->n = 0;
    for (char *save = NULL, *tok = strtok_r(sw->text, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        ft_config c = *cfg;
        if (sw->n == MAX_SWEEP || ft_config_set(&c, sw->key, tok, "--sweep", 0, err, sizeof err) != 0 ||
            ft_config_check(&c, err, sizeof err) != 0) {
            fprintf(stderr, "fusedgrpo bench: %s\n", sw->n == MAX_SWEEP ? "--sweep: too many values" : err);
            return -1;
        }
        sw->values[sw->n++] = tok;
    }
    if (sw->n == 0)
        fprintf(stderr, "fusedgrpo bench: --sweep '%s' gives %s no value\n", spec, sw->key);
    return sw->n > 0 ? 0 : -1;
}

/* ---------------------------------------------------------------- outputs */

/* A number of the result; NaN when absent or null (JSON's NaN). */
static double get(const cJSON *j, const char *key)
{
    const cJSON *it = cJSON_GetObjectItem(j, key);
    return cJSON_IsNumber(it) ? it->valuedouble : NAN;
}

/* Gradient filtering's share of dlogits kept, for the row's annotation. */
static const char *kept_note(double frac)
{
    static char buf[64];
    snprintf(buf, sizeof buf, "; filtering kept %.3g%% of dlogits", 100.0 * frac);
    return buf;
}

/* The fused plan's later chunks where they are shorter than its first. */
static const char *later_note(const cJSON *j)
{
    static char buf[64];
    const double first = get(j, "fused_chunk_rows"), later = get(j, "fused_later_chunk_rows");
    buf[0] = 0;
    if (later > 0 && later != first)
        snprintf(buf, sizeof buf, " (%.0f after the first)", later);
    return buf;
}

static void print_row(const cJSON *j, const char *val)
{
    const char *impl = cJSON_GetStringValue(cJSON_GetObjectItem(j, "impl"));
    const char *dtype = cJSON_GetStringValue(cJSON_GetObjectItem(j, "dtype"));
    const cJSON *error = cJSON_GetObjectItem(j, "error");
    if (!cJSON_IsTrue(cJSON_GetObjectItem(j, "ok"))) {
        printf("%-9s %-9s %9s  FAILED: %s\n", impl, dtype, val, error ? cJSON_GetStringValue(error) : "?");
        return;
    }
    printf("%-9s %-9s %9s %9.0f %10.4g %10.4g %10.4g %10.4g %9.1f %8.1f%% %13.2f %13.2f\n", impl, dtype, val,
           get(j, "unmasked_tokens"), get(j, "cold_s"), get(j, "step_s_mean"), get(j, "step_s_p50"),
           get(j, "step_s_p90"), get(j, "gflops"), 100.0 * get(j, "roofline_ratio"),
           get(j, "peak_work_bytes") / 0x1p20, get(j, "rss_work_bytes") / 0x1p20);
    if (strcmp(impl, "logits") == 0)
        printf("%10s(fg_logits_grpo alone %.4g s of the step; the rest is the tool's GEMMs)\n", "",
               get(j, "kernel_s_mean"));
    else
        printf("%10s(the library's GEMMs %.4g s of its %.4g s call, %.0f-row chunks x %.0f%s%s)\n", "",
               get(j, "gemm_s_mean"), get(j, "call_s_mean"), get(j, "chunk_rows"), get(j, "chunks"),
               strcmp(impl, "fused") == 0 && get(j, "chunk_rows") == get(j, "fused_chunk_rows")
                   ? later_note(j) : "", /* the plan query has no filtering: its chunks may differ */
               get(j, "dlogits_kept_frac") < 1 ? kept_note(get(j, "dlogits_kept_frac")) : "");
    if (get(j, "roofline_s") != 0) /* roofline_reps 0: not measured */
        printf("%10s(bare GEMMs: %.4g s at full shape, %.4g s in the fused path's %.0f-row chunks%s;\n"
               "%10s full shape %.1f GFLOP/s, a 2048-cube product %.1f GFLOP/s on this machine)\n", "",
               get(j, "roofline_s"), get(j, "chunked_gemm_s"), get(j, "fused_chunk_rows"), later_note(j),
               "", get(j, "roofline_gflops"), get(j, "peak_gemm_gflops"));
    if (cJSON_GetObjectItem(j, "paired_with"))
        printf("%10s(interleaved with %s: this step's time / its, per pair: median %.4f [%.4f, %.4f])\n", "",
               cJSON_GetStringValue(cJSON_GetObjectItem(j, "paired_with")), get(j, "pair_ratio_p50"),
               get(j, "pair_ratio_min"), get(j, "pair_ratio_max"));
    if (error) /* a measured run with a non-fatal note (e.g. the roofline failed) */
        printf("          note: %s\n", cJSON_GetStringValue(error));
}

/* The child's figures (or why there are none) with the sweep point and the config it ran. */
static cJSON *result(const char *text, const char *why, const ft_config *cfg, int impl, const char *key,
                     const char *val)
{
    cJSON *j = why ? NULL : cJSON_Parse(text);
    if (j == NULL) {
        j = cJSON_CreateObject();
        cJSON_AddBoolToObject(j, "ok", 0);
        cJSON_AddStringToObject(j, "error", why ? why : "the child's result is not JSON");
    }
    ft_config c = *cfg;
    c.impl = impl;
    cJSON_AddStringToObject(j, "command", "bench");
    cJSON_AddStringToObject(j, "impl", ft_impl_name(impl));
    cJSON_AddStringToObject(j, "sweep_key", key);
    cJSON_AddStringToObject(j, "sweep_value", val);
    cJSON_AddStringToObject(j, "dtype", ft_dtype_name(cfg->dtype));
    cJSON_AddNumberToObject(j, "batch", (double)cfg->batch);
    cJSON_AddNumberToObject(j, "seq_len", (double)cfg->seq_len);
    cJSON_AddNumberToObject(j, "hidden", (double)cfg->hidden);
    cJSON_AddNumberToObject(j, "vocab", (double)cfg->vocab);
    cJSON_AddItemToObject(j, "config", ft_config_json(&c));
    return j;
}

/* ---------------------------------------------------------------- the command */

int ft_cmd_bench(int argc, char **argv)
{
    ft_cli cli;
    const unsigned opts = FT_OPT_JSON | FT_OPT_INPUTS | FT_OPT_IMPLS | FT_OPT_SWEEP | FT_OPT_INTERLEAVE;
    int rc = ft_cli_parse(&cli, argc, argv, opts, USAGE);
    if (rc != 0)
        return rc > 0 ? FT_EXIT_OK : FT_EXIT_USAGE;
    int impls[FT_IMPL_COUNT], nimpl;
    sweep sw;
    if (parse_impls(cli.impls, &cli.cfg, cli.interleave, impls, &nimpl) != 0 ||
        parse_sweep(cli.sweep, &cli.cfg, &sw) != 0)
        return FT_EXIT_USAGE;
    if (cli.interleave && nimpl != 2) {
        fprintf(stderr, "fusedgrpo bench: --interleave takes exactly two impls (--impls A,B)\n");
        return FT_EXIT_USAGE;
    }
    if (ft_sharded_wanted(&cli.cfg)) { /* under mpirun: no fork, no sweep, no turns */
        if (cli.interleave) {
            fprintf(stderr, "fusedgrpo bench: --interleave does not run sharded\n");
            return FT_EXIT_USAGE;
        }
        return ft_bench_sharded(&cli.cfg, cli.inputs, impls, nimpl, cli.json);
    }
    FILE *jf = NULL;
    if (cli.json && (jf = fopen(cli.json, "w")) == NULL) {
        fprintf(stderr, "fusedgrpo bench: cannot write %s: %s\n", cli.json, strerror(errno));
        return FT_EXIT_USAGE;
    }
    int status = FT_EXIT_OK;
    for (int v = 0; v < sw.n && status != FT_EXIT_USAGE; v++) {
        char err[MSG];
        ft_config cfg = cli.cfg;
        ft_problem p = {0};
        ft_bench_job fill_job = {&cfg, &p, 0, {0, 0}};
        ft_config_set(&cfg, sw.key, sw.values[v], "--sweep", 0, err, sizeof err);
        if (ft_problem_make(cli.inputs, &cfg, 1, &p, err, sizeof err) != 0 ||
            (!cli.inputs && isolate(fill, &fill_job, err, MSG, err, MSG) != 0)) {
            fprintf(stderr, "fusedgrpo bench: %s\n", err);
            ft_problem_destroy(&p);
            status = FT_EXIT_USAGE;
            break;
        }
        char val[128]; /* as the config spells it; with --inputs, as the files define it */
        ft_config_format(&cfg, sw.key, val, sizeof val);
        if (v == 0)
            printf("%-9s %-9s %9s %9s %10s %10s %10s %10s %9s %9s %13s %13s\n", "impl", "dtype", sw.key,
                   "tokens", "cold_s", "mean_s", "p50_s", "p90_s", "GFLOP/s", "roofline", "peak_work_MiB",
                   "rss_work_MiB");
        /* One child per impl, or with --interleave one child for the pair;
         * each child writes a JSON line per impl it ran. */
        const int per_child = cli.interleave ? 2 : 1;
        for (int i = 0; i < nimpl; i += per_child) {
            ft_bench_job job = {&cfg, &p, impls[i], {impls[i], impls[i + per_child - 1]}};
            static char text[FT_BENCH_RESULT_BYTES];
            text[0] = '\0';
            const int died = isolate(cli.interleave ? ft_bench_measure_interleaved : ft_bench_measure, &job,
                                     text, sizeof text, err, sizeof err) < 0;
            char *line = text;
            for (int k = 0; k < per_child; k++) {
                char *nl = strchr(line, '\n');
                if (nl)
                    *nl = '\0';
                cJSON *j = result(line, died ? err : NULL, &cfg, impls[i + k], sw.key, val);
                line = nl ? nl + 1 : line + strlen(line);
                print_row(j, val);
                fflush(stdout);
                if (!cJSON_IsTrue(cJSON_GetObjectItem(j, "ok")) && status == FT_EXIT_OK)
                    status = FT_EXIT_FAIL;
                if (ft_json_write_line(jf, j) != 0 && status != FT_EXIT_USAGE) { /* jf NULL: no --json */
                    fprintf(stderr, "fusedgrpo bench: cannot write %s: %s\n", cli.json,
                            strerror(errno));
                    status = FT_EXIT_USAGE;
                }
            }
        }
        ft_problem_destroy(&p);
    }
    if (jf && fclose(jf) != 0 && status != FT_EXIT_USAGE) {
        fprintf(stderr, "fusedgrpo bench: cannot write %s: %s\n", cli.json, strerror(errno));
        status = FT_EXIT_USAGE;
    }
    return status;
}
