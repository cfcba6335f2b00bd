/*
 * Command-line options shared by the subcommands. Config sources apply in a
 * fixed order whatever their position: the table's defaults, then every
 * --config FILE in order, then every --set key=value in order, so a --set
 * always wins over a file.
 */
#ifndef FT_CLI_H
#define FT_CLI_H

#include "config.h"

enum {
    FT_OPT_JSON = 1 << 0,
    FT_OPT_INPUTS = 1 << 1,
    FT_OPT_DUMP = 1 << 2,
    FT_OPT_SAVE_INPUTS = 1 << 3,
    FT_OPT_PLOT = 1 << 4,
    FT_OPT_IMPLS = 1 << 5,
    FT_OPT_SWEEP = 1 << 6,
    FT_OPT_CHILD = 1 << 7,
    FT_OPT_KEYS = 1 << 8
};

typedef struct ft_cli {
    ft_config cfg;
    const char *json, *inputs, *dump, *save_inputs, *plot, *impls, *sweep;
    const char *child_impl; /* bench's hidden child mode */
    int problem_fd, result_fd;
    int keys;  /* config --keys */
    int quiet; /* gradcheck -q: only the verdict */
} ft_cli;

/* argv[0] is the subcommand. Returns 0 to run, 1 after printing help (exit 0),
 * -1 after printing an error (exit 2). */
int ft_cli_parse(ft_cli *cli, int argc, char **argv, unsigned allowed, const char *usage);

#endif
