/* Where a command's problem comes from: a directory of .npy files to replay
 * (problem_io.h) or the config's synthetic batch (synth.h). */
#ifndef FT_PROBLEM_SOURCE_H
#define FT_PROBLEM_SOURCE_H

#include "problem.h"

/* The config's problem: replayed from dir (whose files win over the
 * config's shape keys; cfg is updated), else created for the config's shape
 * and, unless `empty`, filled with the synthetic batch. Checks the config. */
int ft_problem_make(const char *dir, ft_config *cfg, int empty, ft_problem *p, char *err, size_t errlen);

#endif
