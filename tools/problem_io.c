/* Problems as directories of .npy files: see problem_io.h. */
#define _POSIX_C_SOURCE 200809L
#include "problem_io.h"

#include "npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int ft_make_dir(const char *dir, char *err, size_t errlen)
{
    if (mkdir(dir, 0777) == 0 || errno == EEXIST)
        return 0;
    snprintf(err, errlen, "%s: cannot create directory: %s", dir, strerror(errno));
    return -1;
}

static void path_of(char *buf, size_t n, const char *dir, const char *name)
{
    snprintf(buf, n, "%s/%s.npy", dir, name);
}

static int exists(const char *dir, const char *name)
{
    char path[1024];
    path_of(path, sizeof path, dir, name);
    return access(path, F_OK) == 0;
}

/* Reads DIR/name.npy; required: a missing file is an error. */
static int read_npy(const char *dir, const char *name, ft_npy *a, char *err, size_t errlen)
{
    char path[1024];
    path_of(path, sizeof path, dir, name);
    return ft_npy_read(path, a, err, errlen);
}

static int is_float(const ft_npy *a) { return a->h.dtype == FT_NPY_F32 || a->h.dtype == FT_NPY_F64; }

static double get_f(const ft_npy *a, int64_t i)
{
    return a->h.dtype == FT_NPY_F32 ? ((const float *)a->data)[i] : ((const double *)a->data)[i];
}

static int shape_err(const char *dir, const char *name, const ft_npy *a, const char *want, char *err,
                     size_t errlen)
{
    char s[256];
    ft_npy_shape_str(&a->h, s, sizeof s);
    snprintf(err, errlen, "%s/%s.npy: shape %s (%s), expected %s", dir, name, s,
             ft_npy_dtype_name(a->h.dtype), want);
    return -1;
}

typedef struct loaded {
    ft_npy hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_ratio;
} loaded;

static void free_loaded(loaded *l)
{
    ft_npy *all[] = {&l->hidden, &l->weight, &l->bias, &l->token_ids, &l->mask,
                     &l->advantages, &l->old_logp, &l->ref_logp, &l->is_ratio};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        ft_npy_free(all[i]);
}

/* Reads every file and checks dtypes and shapes against each other. */
static int read_all(const char *dir, loaded *l, ft_problem_shape *s, char *err, size_t errlen)
{
    if (read_npy(dir, "token_ids", &l->token_ids, err, errlen) != 0)
        return -1;
    if (l->token_ids.h.ndim != 2 || (l->token_ids.h.dtype != FT_NPY_I64 && l->token_ids.h.dtype != FT_NPY_I32))
        return shape_err(dir, "token_ids", &l->token_ids, "[B, T] of int64 or int32", err, errlen);
    s->batch = l->token_ids.h.shape[0];
    s->seq_len = l->token_ids.h.shape[1];
    const int64_t B = s->batch, T = s->seq_len;
    if (B < 1 || T < 1)
        return shape_err(dir, "token_ids", &l->token_ids, "B >= 1 and T >= 1", err, errlen);

    if (read_npy(dir, "mask", &l->mask, err, errlen) != 0)
        return -1;
    if (l->mask.h.ndim != 2 || l->mask.h.shape[0] != B || l->mask.h.shape[1] != T ||
        is_float(&l->mask))
        return shape_err(dir, "mask", &l->mask, "[B, T] (as token_ids) of bool or integers", err, errlen);

    if (read_npy(dir, "weight", &l->weight, err, errlen) != 0)
        return -1;
    if (l->weight.h.ndim != 2 || !is_float(&l->weight) || l->weight.h.shape[0] < 1 ||
        l->weight.h.shape[1] < 1)
        return shape_err(dir, "weight", &l->weight, "[V, H] of float32 or float64", err, errlen);
    s->vocab = l->weight.h.shape[0];
    s->hidden = l->weight.h.shape[1];

    if (read_npy(dir, "hidden", &l->hidden, err, errlen) != 0)
        return -1;
    const ft_npy_header *hh = &l->hidden.h;
    int ok3 = hh->ndim == 3 && hh->shape[0] == B && hh->shape[1] == T && hh->shape[2] == s->hidden;
    int ok2 = hh->ndim == 2 && hh->shape[0] == B * T && hh->shape[1] == s->hidden;
    if (!(ok3 || ok2) || !is_float(&l->hidden))
        return shape_err(dir, "hidden", &l->hidden, "[B, T, H] or [B*T, H] of float32/float64", err, errlen);

    if (read_npy(dir, "advantages", &l->advantages, err, errlen) != 0)
        return -1;
    if (l->advantages.h.ndim != 1 || l->advantages.h.shape[0] != B || !is_float(&l->advantages))
        return shape_err(dir, "advantages", &l->advantages, "[B] of float32/float64", err, errlen);

    s->has_bias = exists(dir, "bias");
    if (s->has_bias) {
        if (read_npy(dir, "bias", &l->bias, err, errlen) != 0)
            return -1;
        if (l->bias.h.ndim != 1 || l->bias.h.shape[0] != s->vocab || !is_float(&l->bias))
            return shape_err(dir, "bias", &l->bias, "[V] of float32/float64", err, errlen);
    }
    const char *bt_names[2] = {"old_logp", "ref_logp"};
    ft_npy *bt[2] = {&l->old_logp, &l->ref_logp};
    int *has[2] = {&s->has_old, &s->has_ref};
    for (int i = 0; i < 2; i++) {
        *has[i] = exists(dir, bt_names[i]);
        if (!*has[i])
            continue;
        if (read_npy(dir, bt_names[i], bt[i], err, errlen) != 0)
            return -1;
        if (bt[i]->h.ndim != 2 || bt[i]->h.shape[0] != B || bt[i]->h.shape[1] != T || !is_float(bt[i]))
            return shape_err(dir, bt_names[i], bt[i], "[B, T] of float32/float64", err, errlen);
    }
    s->is_ratio = FT_ISR_NONE;
    if (exists(dir, "is_ratio")) {
        if (read_npy(dir, "is_ratio", &l->is_ratio, err, errlen) != 0)
            return -1;
        const ft_npy_header *ih = &l->is_ratio.h;
        if (is_float(&l->is_ratio) && ih->ndim == 2 && ih->shape[0] == B && ih->shape[1] == T)
            s->is_ratio = FT_ISR_TOKEN;
        else if (is_float(&l->is_ratio) && ih->ndim == 1 && ih->shape[0] == B)
            s->is_ratio = FT_ISR_SEQUENCE;
        else
            return shape_err(dir, "is_ratio", &l->is_ratio, "[B, T] or [B] of float32/float64", err, errlen);
    }
    return 0;
}

static void copy_floats(float *dst, const ft_npy *a)
{
    for (int64_t i = 0; i < a->h.count; i++)
        dst[i] = (float)get_f(a, i);
}

int ft_problem_load_dir(const char *dir, ft_config *cfg, ft_problem *p, char *err, size_t errlen)
{
    loaded l;
    memset(&l, 0, sizeof l);
    ft_problem_shape s;
    memset(&s, 0, sizeof s);
    s.dtype = cfg->dtype;
    if (read_all(dir, &l, &s, err, errlen) != 0 || ft_problem_create(&s, p, err, errlen) != 0) {
        free_loaded(&l);
        return -1;
    }
    const int64_t N = s.batch * s.seq_len;
    for (int64_t i = 0; i < l.hidden.h.count; i++)
        ft_store(p->hidden, s.dtype, i, (float)get_f(&l.hidden, i));
    for (int64_t i = 0; i < l.weight.h.count; i++)
        ft_store(p->weight, s.dtype, i, (float)get_f(&l.weight, i));
    if (p->bias)
        for (int64_t i = 0; i < s.vocab; i++)
            ft_store(p->bias, s.dtype, i, (float)get_f(&l.bias, i));
    for (int64_t i = 0; i < N; i++) {
        p->token_ids[i] = l.token_ids.h.dtype == FT_NPY_I64 ? ((const int64_t *)l.token_ids.data)[i]
                                                            : ((const int32_t *)l.token_ids.data)[i];
        const unsigned char *m = (const unsigned char *)l.mask.data + (size_t)i * ft_npy_dtype_size(l.mask.h.dtype);
        int nz = 0;
        for (size_t b = 0; b < ft_npy_dtype_size(l.mask.h.dtype); b++)
            nz |= m[b] != 0;
        p->mask[i] = (uint8_t)nz;
    }
    copy_floats(p->advantages, &l.advantages);
    if (p->old_logp)
        copy_floats(p->old_logp, &l.old_logp);
    if (p->ref_logp)
        copy_floats(p->ref_logp, &l.ref_logp);
    if (p->is_ratio)
        copy_floats(p->is_ratio, &l.is_ratio);
    free_loaded(&l);

    cfg->batch = s.batch;
    cfg->seq_len = s.seq_len;
    cfg->hidden = s.hidden;
    cfg->vocab = s.vocab;
    cfg->use_bias = s.has_bias;
    cfg->use_old_logp = s.has_old;
    cfg->use_ref_logp = s.has_ref;
    cfg->is_ratio = s.is_ratio;
    return 0;
}

/* Storage-dtype tensor widened to a temporary float32 buffer for saving. */
static int save_wide(const char *dir, const char *name, const void *data, int dtype, int ndim,
                     const int64_t *shape, char *err, size_t errlen)
{
    char path[1024];
    path_of(path, sizeof path, dir, name);
    int64_t count = 1;
    for (int i = 0; i < ndim; i++)
        count *= shape[i];
    if (dtype == FT_DTYPE_F32)
        return ft_npy_write(path, FT_NPY_F32, ndim, shape, data, err, errlen);
    float *tmp = malloc((size_t)(count > 0 ? count : 1) * sizeof *tmp);
    if (tmp == NULL) {
        snprintf(err, errlen, "%s: out of memory", path);
        return -1;
    }
    for (int64_t i = 0; i < count; i++)
        tmp[i] = ft_load(data, dtype, i);
    int rc = ft_npy_write(path, FT_NPY_F32, ndim, shape, tmp, err, errlen);
    free(tmp);
    return rc;
}

static int save(const char *dir, const char *name, ft_npy_dtype t, const void *data, int ndim,
                const int64_t *shape, char *err, size_t errlen)
{
    char path[1024];
    path_of(path, sizeof path, dir, name);
    return ft_npy_write(path, t, ndim, shape, data, err, errlen);
}

int ft_problem_save_dir(const ft_problem *p, const char *dir, char *err, size_t errlen)
{
    const ft_problem_shape *s = &p->s;
    int64_t bth[3] = {s->batch, s->seq_len, s->hidden};
    int64_t vh[2] = {s->vocab, s->hidden};
    int64_t bt[2] = {s->batch, s->seq_len};
    if (ft_make_dir(dir, err, errlen) != 0 ||
        save_wide(dir, "hidden", p->hidden, s->dtype, 3, bth, err, errlen) != 0 ||
        save_wide(dir, "weight", p->weight, s->dtype, 2, vh, err, errlen) != 0 ||
        (p->bias && save_wide(dir, "bias", p->bias, s->dtype, 1, &s->vocab, err, errlen) != 0) ||
        save(dir, "token_ids", FT_NPY_I64, p->token_ids, 2, bt, err, errlen) != 0 ||
        save(dir, "mask", FT_NPY_BOOL, p->mask, 2, bt, err, errlen) != 0 ||
        save(dir, "advantages", FT_NPY_F32, p->advantages, 1, &s->batch, err, errlen) != 0 ||
        (p->old_logp && save(dir, "old_logp", FT_NPY_F32, p->old_logp, 2, bt, err, errlen) != 0) ||
        (p->ref_logp && save(dir, "ref_logp", FT_NPY_F32, p->ref_logp, 2, bt, err, errlen) != 0) ||
        (p->is_ratio && save(dir, "is_ratio", FT_NPY_F32, p->is_ratio,
                             s->is_ratio == FT_ISR_TOKEN ? 2 : 1, bt, err, errlen) != 0))
        return -1;
    /* Stale optional files from an earlier save would change the replay. */
    const char *optional[] = {"bias", "old_logp", "ref_logp", "is_ratio"};
    const void *present[] = {p->bias, p->old_logp, p->ref_logp, p->is_ratio};
    for (int i = 0; i < 4; i++)
        if (!present[i]) {
            char path[1024];
            path_of(path, sizeof path, dir, optional[i]);
            unlink(path);
        }
    return 0;
}
