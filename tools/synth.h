/* The seeded synthetic batch of `gradcheck` and `bench` (synth.c says how it
 * is drawn and why). */
#ifndef FT_SYNTH_H
#define FT_SYNTH_H

#include "problem.h"

/* Fills a created problem of the config's shape with the synthetic batch. */
int ft_synth_fill(ft_problem *p, const ft_config *cfg, char *err, size_t errlen);

#endif
