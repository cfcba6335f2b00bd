/* `fusedgrpo config`: the effective config (defaults, files, --set) as
 * YAML, or with --keys every known key with its help. The output is a valid
 * config file. */
#include "cli.h"
#include "commands.h"

#include <stdio.h>

static const char USAGE[] =
    "usage: fusedgrpo config [--config FILE]... [--set key=value]... [--keys]\n"
    "  Prints the effective configuration as YAML (a valid config file);\n"
    "  --keys adds each key's meaning as a comment.\n";

int ft_cmd_config(int argc, char **argv)
{
    ft_cli cli;
    int rc = ft_cli_parse(&cli, argc, argv, FT_OPT_KEYS, USAGE);
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
