/*
 * fusedgrpo: the project's command-line tool. One binary, subcommands
 * dispatched from a table; `train` is reserved for the training loop.
 */
#include "commands.h"
#include "fusedgrpo.h"

#include <stdio.h>
#include <string.h>

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command COMMANDS[] = {
    {"gradcheck", ft_cmd_gradcheck, "check loss, log-probs and gradients against a reference"},
    {"bench", ft_cmd_bench, "time and measure memory of baseline, logits and fused"},
    {"config", ft_cmd_config, "print the effective configuration (--keys: all keys)"},
    /* {"train", ...}: reserved */
};

static void usage(FILE *f)
{
    fprintf(f, "usage: fusedgrpo <command> [--config FILE]... [--set key=value]... [options]\n"
               "commands:\n");
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        fprintf(f, "  %-10s %s\n", COMMANDS[i].name, COMMANDS[i].summary);
    fprintf(f, "`fusedgrpo <command> --help` describes a command's options.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? FT_EXIT_USAGE : FT_EXIT_OK;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        printf("fusedgrpo %d.%d.%d\n", FG_VERSION_MAJOR, FG_VERSION_MINOR, FG_VERSION_PATCH);
        return FT_EXIT_OK;
    }
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        if (strcmp(argv[1], COMMANDS[i].name) == 0)
            return COMMANDS[i].run(argc - 1, argv + 1);
    fprintf(stderr, "fusedgrpo: unknown command '%s'%s\n", argv[1],
            strcmp(argv[1], "train") == 0 ? " (reserved, not implemented yet)" : "");
    usage(stderr);
    return FT_EXIT_USAGE;
}
