/* The problem a subcommand works on: replayed from --inputs DIR, or the
 * seeded synthetic batch of the config. Shared by gradcheck and bench. */
#ifndef FT_INPUTS_H
#define FT_INPUTS_H

#include <stddef.h>

#include "config.h"
#include "problem.h"

/* Creates and fills p; with dir != NULL the files win over the config's
 * shape keys (cfg is updated). Checks the config either way. */
int ft_inputs_make(const char *dir, ft_config *cfg, ft_problem *p, char *err, size_t errlen);

#endif
