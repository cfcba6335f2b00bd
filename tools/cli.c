/* Shared option parsing: see cli.h. */
#include "cli.h"

#include "units.h"

#include <stdio.h>
#include <string.h>

typedef struct opt_def {
    const char *name;
    unsigned flag; /* 0: always allowed */
    size_t offset; /* const char * field of ft_cli, or (size_t)-1 */
} opt_def;

#define STR(f) offsetof(ft_cli, f)
#define NOFIELD ((size_t)-1)

static const opt_def OPTS[] = {
    {"--json", FT_OPT_JSON, STR(json)},
    {"--inputs", FT_OPT_INPUTS, STR(inputs)},
    {"--dump", FT_OPT_DUMP, STR(dump)},
    {"--save-inputs", FT_OPT_SAVE_INPUTS, STR(save_inputs)},
    {"--plot", FT_OPT_PLOT, STR(plot)},
    {"--impls", FT_OPT_IMPLS, STR(impls)},
    {"--sweep", FT_OPT_SWEEP, STR(sweep)},
    {"--child", FT_OPT_CHILD, STR(child_impl)},
    {"--problem-fd", FT_OPT_CHILD, NOFIELD},
    {"--result-fd", FT_OPT_CHILD, NOFIELD},
    {"--config", 0, NOFIELD},
    {"--set", 0, NOFIELD},
};

/* "--opt value" or "--opt=value": returns the value, advancing *i. */
static const char *take_value(int argc, char **argv, int *i, const char *name)
{
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (a[n] == '=')
        return a + n + 1;
    if (*i + 1 >= argc)
        return NULL;
    return argv[++*i];
}

static int parse_fd(const char *s, int *out)
{
    int64_t v;
    if (ft_parse_int64(s, &v) != 0 || v < 0 || v > 1 << 20)
        return -1;
    *out = (int)v;
    return 0;
}

int ft_cli_parse(ft_cli *cli, int argc, char **argv, unsigned allowed, const char *usage)
{
    memset(cli, 0, sizeof *cli);
    cli->problem_fd = cli->result_fd = -1;
    ft_config_defaults(&cli->cfg);
    const char *cmd = argv[0];
    char err[1024];

    /* Pass 1: everything but --set, files applied in order. Pass 2: --set. */
    for (int pass = 1; pass <= 2; pass++) {
        for (int i = 1; i < argc; i++) {
            const char *a = argv[i];
            if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
                fputs(usage, stdout);
                return 1;
            }
            if (strcmp(a, "-q") == 0 || strcmp(a, "--quiet") == 0) {
                cli->quiet = 1;
                continue;
            }
            if ((allowed & FT_OPT_KEYS) && strcmp(a, "--keys") == 0) {
                cli->keys = 1;
                continue;
            }
            const opt_def *o = NULL;
            for (size_t k = 0; k < sizeof OPTS / sizeof OPTS[0]; k++) {
                size_t n = strlen(OPTS[k].name);
                if (strncmp(a, OPTS[k].name, n) == 0 && (a[n] == '\0' || a[n] == '='))
                    o = &OPTS[k];
            }
            if (strcmp(a, "-c") == 0)
                for (size_t k = 0; k < sizeof OPTS / sizeof OPTS[0]; k++)
                    if (strcmp(OPTS[k].name, "--config") == 0)
                        o = &OPTS[k];
            if (o == NULL || (o->flag && !(allowed & o->flag))) {
                fprintf(stderr, "fusedgrpo %s: unknown option '%s' (try --help)\n", cmd, a);
                return -1;
            }
            const char *v = take_value(argc, argv, &i, strcmp(a, "-c") == 0 ? "-c" : o->name);
            if (v == NULL) {
                fprintf(stderr, "fusedgrpo %s: %s needs a value\n", cmd, o->name);
                return -1;
            }
            if (strcmp(o->name, "--set") == 0) {
                if (pass == 2 && ft_config_set_assignment(&cli->cfg, v, err, sizeof err) != 0) {
                    fprintf(stderr, "fusedgrpo %s: %s\n", cmd, err);
                    return -1;
                }
            } else if (pass == 2) {
                continue;
            } else if (strcmp(o->name, "--config") == 0) {
                if (ft_config_load_file(&cli->cfg, v, err, sizeof err) != 0) {
                    fprintf(stderr, "fusedgrpo %s: %s\n", cmd, err);
                    return -1;
                }
            } else if (strcmp(o->name, "--problem-fd") == 0 || strcmp(o->name, "--result-fd") == 0) {
                int *fd = o->name[2] == 'p' ? &cli->problem_fd : &cli->result_fd;
                if (parse_fd(v, fd) != 0) {
                    fprintf(stderr, "fusedgrpo %s: bad %s '%s'\n", cmd, o->name, v);
                    return -1;
                }
            } else {
                *(const char **)((char *)cli + o->offset) = v;
            }
        }
    }
    return 0;
}
