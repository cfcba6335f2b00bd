/* The subcommands of the `fusedgrpo` program. Each takes argv with argv[0]
 * the subcommand's name and returns the process exit status. */
#ifndef FT_COMMANDS_H
#define FT_COMMANDS_H

int ft_cmd_gradcheck(int argc, char **argv);
int ft_cmd_bench(int argc, char **argv);
int ft_cmd_config(int argc, char **argv);

/* Exit statuses shared by the subcommands. */
enum { FT_EXIT_OK = 0, FT_EXIT_FAIL = 1, FT_EXIT_USAGE = 2 };

#endif
