/*
 * fusedgrpo: the project's command-line tool. One binary, subcommands
 * dispatched from a table; `train` is reserved for the training loop. Here
 * too: the option parsing they share (commands.h) and `config`, which prints
 * the effective config (defaults, files, --set) as YAML, a valid config file.
 */
#include "commands.h"

#include <stdio.h>
#include <string.h>

/* flag 0: every subcommand; offset: the option's field of ft_cli, a const char *
 * value or (is_switch) an int. */
typedef struct opt_def { const char *name; unsigned flag; size_t offset; int is_switch; } opt_def;

#define CONFIG_OR_SET ((size_t)-1)
#define VALUE(name, flag, field) {name, flag, offsetof(ft_cli, field), 0}

static const opt_def OPTS[] = {
    VALUE("--json", FT_OPT_JSON, json),     VALUE("--inputs", FT_OPT_INPUTS, inputs),
    VALUE("--dump", FT_OPT_DUMP, dump),     VALUE("--save-inputs", FT_OPT_SAVE_INPUTS, save_inputs),
    VALUE("--impls", FT_OPT_IMPLS, impls),  VALUE("--sweep", FT_OPT_SWEEP, sweep),
    {"--keys", FT_OPT_KEYS, offsetof(ft_cli, keys), 1},
    {"--interleave", FT_OPT_INTERLEAVE, offsetof(ft_cli, interleave), 1},
    {"-q", FT_OPT_QUIET, offsetof(ft_cli, quiet), 1}, {"--quiet", FT_OPT_QUIET, offsetof(ft_cli, quiet), 1},
    {"--config", 0, CONFIG_OR_SET, 0},      {"-c", 0, CONFIG_OR_SET, 0}, {"--set", 0, CONFIG_OR_SET, 0},
};

int ft_cli_parse(ft_cli *cli, int argc, char **argv, unsigned allowed, const char *usage)
{
    memset(cli, 0, sizeof *cli);
    ft_config_defaults(&cli->cfg);
    char err[1024];
    /* Pass 1: everything but --set, files applied in order. Pass 2: --set. */
    for (int pass = 1; pass <= 2; pass++) {
        for (int i = 1; i < argc; i++) {
            const char *a = argv[i];
            const opt_def *o = NULL;
            size_t n = 0;
            if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
                fputs(usage, stdout);
                return 1;
            }
            for (size_t k = 0; k < sizeof OPTS / sizeof OPTS[0] && o == NULL; k++) {
                n = strlen(OPTS[k].name);
                if (strncmp(a, OPTS[k].name, n) == 0 && (a[n] == '\0' || (a[n] == '=' && !OPTS[k].is_switch)))
                    o = &OPTS[k];
            }
            if (o == NULL || (o->flag && !(allowed & o->flag))) {
                fprintf(stderr, "fusedgrpo %s: unknown option '%s' (try --help)\n", argv[0], a);
                return -1;
            }
            if (o->is_switch) {
                *(int *)((char *)cli + o->offset) = 1;
                continue;
            }
            /* "--opt value" or "--opt=value" */
            const char *v = a[n] == '=' ? a + n + 1 : i + 1 < argc ? argv[++i] : NULL;
            const int is_set = strcmp(o->name, "--set") == 0;
            if (v == NULL) {
                fprintf(stderr, "fusedgrpo %s: %s needs a value\n", argv[0], o->name);
                return -1;
            }
            if (pass == (is_set ? 2 : 1) && o->offset == CONFIG_OR_SET &&
                (is_set ? ft_config_set_assignment(&cli->cfg, v, err, sizeof err)
                        : ft_config_load_file(&cli->cfg, v, err, sizeof err)) != 0) {
                fprintf(stderr, "fusedgrpo %s: %s\n", argv[0], err);
                return -1;
            }
            if (pass == 1 && o->offset != CONFIG_OR_SET)
                *(const char **)((char *)cli + o->offset) = v;
        }
    }
    return 0;
}

static int cmd_config(int argc, char **argv)
{
    static const char usage[] =
        "usage: fusedgrpo config [--config FILE]... [--set key=value]... [--keys]\n"
        "  Prints the effective configuration as YAML (a valid config file);\n"
        "  --keys adds each key's meaning as a comment.\n";
    ft_cli cli;
    int rc = ft_cli_parse(&cli, argc, argv, FT_OPT_KEYS, usage);
    if (rc != 0)
        return rc > 0 ? FT_EXIT_OK : FT_EXIT_USAGE;
    char err[512];
    if (ft_config_check(&cli.cfg, err, sizeof err) != 0) {
        fprintf(stderr, "fusedgrpo config: %s\n", err);
        return FT_EXIT_USAGE;
    }
    ft_config_print(&cli.cfg, stdout, cli.keys);
    return FT_EXIT_OK;
}

typedef struct command { const char *name; int (*run)(int argc, char **argv); const char *summary; } command;

static const command COMMANDS[] = {
    {"gradcheck", ft_cmd_gradcheck, "check loss, log-probs and gradients against a reference"},
    {"bench", ft_cmd_bench, "time and measure memory of baseline, logits and fused"},
    {"config", cmd_config, "print the effective configuration (--keys: all keys)"},
    /* {"train", ...}: reserved */
};

static int usage(FILE *f, int status)
{
    fprintf(f, "usage: fusedgrpo <command> [--config FILE]... [--set key=value]... [options]\ncommands:\n");
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        fprintf(f, "  %-10s %s\n", COMMANDS[i].name, COMMANDS[i].summary);
    fprintf(f, "`fusedgrpo <command> --help` describes a command's options.\n");
    return status;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return usage(stderr, FT_EXIT_USAGE);
    if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "help") == 0)
        return usage(stdout, FT_EXIT_OK);
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        printf("fusedgrpo %d.%d.%d\n", FG_VERSION_MAJOR, FG_VERSION_MINOR, FG_VERSION_PATCH);
        return FT_EXIT_OK;
    }
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        if (strcmp(argv[1], COMMANDS[i].name) == 0)
            return COMMANDS[i].run(argc - 1, argv + 1);
    fprintf(stderr, "fusedgrpo: unknown command '%s'%s\n", argv[1],
            strcmp(argv[1], "train") == 0 ? " (reserved, not implemented yet)" : "");
    return usage(stderr, FT_EXIT_USAGE);
}
