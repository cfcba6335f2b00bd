/* Problems and results as directories of .npy files (problem_io.c gives the
 * files' names, shapes and types). */
#ifndef FT_PROBLEM_IO_H
#define FT_PROBLEM_IO_H

#include "problem.h"
#include "runner.h"

/* A problem from DIR's .npy files, whose shape and optional inputs define
 * cfg's (updated) / every input of p written to DIR. */
int ft_problem_load_dir(const char *dir, ft_config *cfg, ft_problem *p, char *err, size_t errlen);
int ft_problem_save_dir(const ft_problem *p, const char *dir, char *err, size_t errlen);
/* The outputs of r's last step written to DIR. */
int ft_dump_outputs(const char *dir, const ft_runner *r, char *err, size_t errlen);

#endif
