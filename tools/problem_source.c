/* A command's problem, replayed or synthesized: see problem_source.h. */
#include "problem_source.h"

#include "problem_io.h"
#include "synth.h"

int ft_problem_make(const char *dir, ft_config *cfg, int empty, ft_problem *p, char *err, size_t errlen)
{
    if (dir ? ft_problem_load_dir(dir, cfg, p, err, errlen) != 0
            : ft_config_check(cfg, err, errlen) != 0 || ft_problem_create(cfg, p, err, errlen) != 0)
        return -1;
    if (dir ? ft_config_check(cfg, err, errlen) != 0 : !empty && ft_synth_fill(p, cfg, err, errlen) != 0) {
        ft_problem_destroy(p);
        return -1;
    }
    return 0;
}
