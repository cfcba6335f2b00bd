/* --dump DIR: see dump.h. */
#include "dump.h"

#include "npy.h"
#include "problem_io.h"

#include <stdio.h>
#include <stdlib.h>

/* The kernel's outputs as .npy: float32 tensors (dlogits widened), the loss
 * as a 0-d float64 and the metrics as a [6] float64 in fg_metrics order. */
int ft_dump_outputs(const char *dir, const ft_runner *r, const ft_problem *p, char *err, size_t errlen)
{
    const int64_t B = p->s.batch, T = p->s.seq_len, H = p->s.hidden, V = p->s.vocab;
    char path[1024];
    if (ft_make_dir(dir, err, errlen) != 0)
        return -1;
#define OUT(name, type, ndim, shape, data)                                                         \
    do {                                                                                           \
        snprintf(path, sizeof path, "%s/%s.npy", dir, name);                                       \
        if (ft_npy_write(path, type, ndim, shape, data, err, errlen) != 0)                         \
            return -1;                                                                             \
    } while (0)
    int64_t bt[3] = {B, T, H}, vh[2] = {V, H}, btv[3] = {B, T, V}, six = 6;
    double loss = r->loss_value;
    const fg_metrics *m = &r->metrics;
    double metrics[6] = {m->kl, m->entropy, m->clip_ratio_low, m->clip_ratio_high,
                         m->clip_ratio_region, m->cispo_clip_ratio};
    OUT("loss", FT_NPY_F64, 0, bt, &loss);
    OUT("metrics", FT_NPY_F64, 1, &six, metrics);
    OUT("logp", FT_NPY_F32, 2, bt, r->logp);
    OUT("entropy", FT_NPY_F32, 2, bt, r->entropy);
    if (r->impl == FT_IMPL_LOGITS) {
        const float *g = r->logits;
        float *wide = NULL;
        if (p->s.dtype != FT_DTYPE_F32) {
            wide = malloc((size_t)(B * T * V) * sizeof *wide);
            if (wide == NULL) {
                snprintf(err, errlen, "out of memory");
                return -1;
            }
            for (int64_t i = 0; i < B * T * V; i++)
                wide[i] = ft_load(r->logits, p->s.dtype, i);
            g = wide;
        }
        snprintf(path, sizeof path, "%s/grad_logits.npy", dir);
        int rc = ft_npy_write(path, FT_NPY_F32, 3, btv, g, err, errlen);
        free(wide);
        if (rc != 0)
            return -1;
    } else {
        OUT("grad_hidden", FT_NPY_F32, 3, bt, r->grad_hidden);
        OUT("grad_weight", FT_NPY_F32, 2, vh, r->grad_weight);
        if (r->grad_bias)
            OUT("grad_bias", FT_NPY_F32, 1, &V, r->grad_bias);
    }
#undef OUT
    return 0;
}

