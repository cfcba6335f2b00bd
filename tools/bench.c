/*
 * `fusedgrpo bench`: baseline, logits and fused on the same inputs, each in
 * a child process of its own (this executable re-run with the hidden
 * --child flag, inheriting the shared input arena's descriptor), so that
 * memory peaks never mix. Prints a table, optionally writes JSON lines and
 * an SVG of a sweep over one key.
 */
#define _GNU_SOURCE
#include "bench.h"

#include "commands.h"
#include "inputs.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_SWEEP FT_BENCH_MAX_SWEEP

static const char USAGE[] =
    "usage: fusedgrpo bench [--config FILE]... [--set key=value]... [options]\n"
    "  Times impls on one seeded batch (or --inputs DIR), each in its own process.\n"
    "  Per impl: the cold first step, mean/p50/p90 step time over `steps` after\n"
    "  `warmup`, counted peak working bytes, peak RSS less inputs and outputs,\n"
    "  GFLOP/s (6*N_unmasked*H*V per step) and roofline (fg_time_bare_gemms) ratio.\n"
    "options:\n"
    "  --impls LIST       comma-separated subset of baseline,logits,fused (default: all)\n"
    "  --sweep KEY=V1,V2  repeat for each value of KEY (e.g. seq_len=512,1024,2048)\n"
    "  --plot FILE.svg    step time and peak memory per impl against the swept key\n"
    "  --json FILE        one JSON line per impl and sweep point\n"
    "  --inputs DIR       a captured batch instead of the synthetic one (no --sweep)\n";

typedef struct sweep {
    char key[64];
    char values[MAX_SWEEP][64];
    int n;
} sweep;

static int parse_impls(const char *list, int *impls, int *n)
{
    *n = 0;
    if (list == NULL) {
        for (int i = 0; i < FT_IMPL_COUNT; i++)
            impls[(*n)++] = i;
        return 0;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int impl;
        if (ft_impl_parse(tok, &impl) != 0) {
            fprintf(stderr, "fusedgrpo bench: --impls: unknown impl '%s' (baseline, logits, fused)\n", tok);
            return -1;
        }
        for (int i = 0; i < *n; i++)
            if (impls[i] == impl) {
                fprintf(stderr, "fusedgrpo bench: --impls: '%s' given twice\n", tok);
                return -1;
            }
        impls[(*n)++] = impl;
    }
    return *n > 0 ? 0 : -1;
}

static int parse_sweep(const char *spec, const ft_config *cfg, sweep *sw)
{
    memset(sw, 0, sizeof *sw);
    if (spec == NULL) {
        snprintf(sw->key, sizeof sw->key, "seq_len");
        ft_config_format(cfg, "seq_len", sw->values[0], sizeof sw->values[0]);
        sw->n = 1;
        return 0;
    }
    const char *eq = strchr(spec, '=');
    if (eq == NULL || eq == spec || (size_t)(eq - spec) >= sizeof sw->key) {
        fprintf(stderr, "fusedgrpo bench: --sweep expects KEY=V1,V2,..., got '%s'\n", spec);
        return -1;
    }
    memcpy(sw->key, spec, (size_t)(eq - spec));
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", eq + 1);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (sw->n == MAX_SWEEP) {
            fprintf(stderr, "fusedgrpo bench: --sweep takes at most %d values\n", MAX_SWEEP);
            return -1;
        }
        snprintf(sw->values[sw->n++], sizeof sw->values[0], "%s", tok);
    }
    /* Validate every value now rather than after an hour of measurements. */
    for (int i = 0; i < sw->n; i++) {
        ft_config c = *cfg;
        char err[512];
        if (ft_config_set(&c, sw->key, sw->values[i], "--sweep", 0, err, sizeof err) != 0 ||
            ft_config_check(&c, err, sizeof err) != 0) {
            fprintf(stderr, "fusedgrpo bench: %s\n", err);
            return -1;
        }
    }
    return sw->n > 0 ? 0 : -1;
}

int ft_cmd_bench(int argc, char **argv)
{
    ft_cli cli;
    int rc = ft_cli_parse(&cli, argc, argv,
                          FT_OPT_JSON | FT_OPT_INPUTS | FT_OPT_PLOT | FT_OPT_IMPLS | FT_OPT_SWEEP |
                              FT_OPT_CHILD,
                          USAGE);
    if (rc != 0)
        return rc > 0 ? FT_EXIT_OK : FT_EXIT_USAGE;
    if (cli.child_impl)
        return ft_bench_child(&cli);

    int impls[FT_IMPL_COUNT], nimpl;
    sweep sw;
    if (parse_impls(cli.impls, impls, &nimpl) != 0 || parse_sweep(cli.sweep, &cli.cfg, &sw) != 0)
        return FT_EXIT_USAGE;
    if (cli.inputs && cli.sweep) {
        fprintf(stderr, "fusedgrpo bench: --sweep and --inputs exclude each other\n");
        return FT_EXIT_USAGE;
    }
    FILE *jf = NULL;
    if (cli.json && (jf = fopen(cli.json, "we")) == NULL) {
        fprintf(stderr, "fusedgrpo bench: cannot write %s: %s\n", cli.json, strerror(errno));
        return FT_EXIT_USAGE;
    }
    ft_bench_result(*res)[FT_IMPL_COUNT] = calloc((size_t)sw.n, sizeof *res);
    if (res == NULL) {
        if (jf)
            fclose(jf);
        return FT_EXIT_USAGE;
    }
    int status = FT_EXIT_OK;
    int tty = isatty(STDERR_FILENO);
    ft_config cfg = cli.cfg;
    for (int v = 0; v < sw.n && status != FT_EXIT_USAGE; v++) {
        char err[1024];
        cfg = cli.cfg;
        ft_config_set(&cfg, sw.key, sw.values[v], "--sweep", 0, err, sizeof err);
        ft_problem p;
        if (tty)
            fprintf(stderr, "preparing inputs (%s=%s)...\r", sw.key, sw.values[v]);
        if (ft_inputs_make(cli.inputs, &cfg, &p, err, sizeof err) != 0) {
            fprintf(stderr, "fusedgrpo bench: %s\n", err);
            status = FT_EXIT_USAGE;
            break;
        }
        if (tty)
            fputs("\r\033[K", stderr);
        if (cli.inputs) /* the files define the shape: report it */
            ft_config_format(&cfg, sw.key, sw.values[v], sizeof sw.values[v]);
        if (v == 0)
            ft_bench_print_header(sw.key);
        for (int i = 0; i < nimpl; i++) {
            ft_bench_spawn(&cfg, &p, impls[i], &res[v][i]);
            ft_bench_print_row(&cfg, sw.values[v], &res[v][i]);
            fflush(stdout);
            if (jf)
                ft_bench_json_line(jf, &cfg, sw.key, sw.values[v], &res[v][i]);
            if (!res[v][i].ok)
                status = FT_EXIT_FAIL;
        }
        ft_problem_destroy(&p);
    }
    if (cli.plot && status != FT_EXIT_USAGE && ft_bench_plot(cli.plot, &cfg, sw.key, sw.values, sw.n, impls, nimpl, res) != 0)
        status = FT_EXIT_USAGE;
    if (jf && fclose(jf) != 0)
        status = FT_EXIT_USAGE;
    free(res);
    return status;
}
