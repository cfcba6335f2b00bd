/* Replayed or synthetic inputs: see inputs.h. */
#include "inputs.h"

#include "problem_io.h"
#include "synth.h"

int ft_inputs_make(const char *dir, ft_config *cfg, ft_problem *p, char *err, size_t errlen)
{
    if (dir != NULL) {
        if (ft_problem_load_dir(dir, cfg, p, err, errlen) != 0)
            return -1;
        if (ft_config_check(cfg, err, errlen) != 0) {
            ft_problem_destroy(p);
            return -1;
        }
        return 0;
    }
    if (ft_config_check(cfg, err, errlen) != 0)
        return -1;
    ft_problem_shape s;
    ft_synth_shape(cfg, &s);
    if (ft_problem_create(&s, p, err, errlen) != 0)
        return -1;
    if (ft_synth_fill(p, cfg, err, errlen) != 0) {
        ft_problem_destroy(p);
        return -1;
    }
    return 0;
}
