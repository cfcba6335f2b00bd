/*
 * The subcommands of the `fusedgrpo` program and the options they share
 * (main.c). Each subcommand takes argv with argv[0] its name and returns the
 * process exit status. Config sources apply in a fixed order whatever their
 * position: the table's defaults, then every --config FILE in order, then
 * every --set key=value in order, so a --set always wins over a file.
 */
#ifndef FT_COMMANDS_H
#define FT_COMMANDS_H

#include "config.h"

int ft_cmd_gradcheck(int argc, char **argv);
int ft_cmd_bench(int argc, char **argv);

/* Exit statuses shared by the subcommands. */
enum { FT_EXIT_OK = 0, FT_EXIT_FAIL = 1, FT_EXIT_USAGE = 2 };

/* Options a subcommand accepts besides --config/-c, --set and --help. */
enum {
    FT_OPT_JSON = 1 << 0, FT_OPT_INPUTS = 1 << 1, FT_OPT_DUMP = 1 << 2, FT_OPT_SAVE_INPUTS = 1 << 3,
    FT_OPT_IMPLS = 1 << 4, FT_OPT_SWEEP = 1 << 5,
    FT_OPT_KEYS = 1 << 6, /* config --keys */
    FT_OPT_QUIET = 1 << 7, /* -q, --quiet */
    FT_OPT_INTERLEAVE = 1 << 8 /* bench --interleave */
};

typedef struct ft_cli {
    ft_config cfg;
    const char *json, *inputs, *dump, *save_inputs, *impls, *sweep;
    int keys, quiet, interleave;
} ft_cli;

/* Returns 0 to run, 1 after printing help (exit 0), -1 after printing an error (exit 2). */
int ft_cli_parse(ft_cli *cli, int argc, char **argv, unsigned allowed, const char *usage);

#endif
