/*
 * Problems and results as directories of .npy files: a captured batch to
 * replay (--inputs), the synthetic one saved (--save-inputs), the outputs
 * (--dump). Inputs: hidden [B,T,H] or [B*T,H], weight [V,H], token_ids [B,T]
 * (int64/int32), mask [B,T] (bool or any integer), advantages [B]; optional
 * bias [V], old_logp and ref_logp [B,T], is_ratio [B,T] or [B]. Floats are
 * float32/float64 (NumPy has no bfloat16: rounded on load when dtype says
 * so). The files define the shape and which optional inputs are used.
 * Outputs (float32, bf16 dlogits widened): loss (0-d float64), metrics ([6]
 * float64 in fg_metrics order), logp/entropy [B,T], grad_hidden [B,T,H],
 * grad_weight [V,H], grad_bias [V], or for the logits impl grad_logits [B,T,V].
 */
#define _POSIX_C_SOURCE 200809L
#include "problem_io.h"

#include "npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The input files, in the order they are read and checked. */
enum { TOKEN_IDS, MASK, WEIGHT, HIDDEN, ADVANTAGES, BIAS, OLD_LOGP, REF_LOGP, IS_RATIO, NFILES };
static const char *const NAMES[NFILES] = {"token_ids", "mask", "weight", "hidden", "advantages",
                                          "bias", "old_logp", "ref_logp", "is_ratio"};
static const char *const EXPECTED[NFILES] = {
    "[B, T] of int64 or int32, B, T >= 1", "[B, T] (as token_ids) of bool or integers",
    "[V, H] of float32 or float64", "[B, T, H] or [B*T, H] of float32/float64",
    "[B] of float32/float64", "[V] of float32/float64", "[B, T] of float32/float64",
    "[B, T] of float32/float64", "[B, T] or [B] of float32/float64"};

static int is_float(const ft_npy *a) { return a->h.dtype == FT_NPY_F32 || a->h.dtype == FT_NPY_F64; }

static double get_f(const ft_npy *a, int64_t i)
{
    return a->h.dtype == FT_NPY_F32 ? ((const float *)a->data)[i] : ((const double *)a->data)[i];
}

/* The array has exactly these dimensions (ndim of d0, d1, d2). */
static int dims(const ft_npy *a, int ndim, int64_t d0, int64_t d1, int64_t d2)
{
    const int64_t d[3] = {d0, d1, d2};
    for (int i = 0; i < ndim && a->h.ndim == ndim; i++)
        if (a->h.shape[i] != d[i])
            return 0;
    return a->h.ndim == ndim;
}

int ft_problem_load_dir(const char *dir, ft_config *cfg, ft_problem *p, char *err, size_t errlen)
{
    ft_npy f[NFILES];
    char path[1024];
    int rc = 0;
    memset(f, 0, sizeof f);
    for (int i = 0; i < NFILES && rc == 0; i++) { /* the optional files when present */
        snprintf(path, sizeof path, "%s/%s.npy", dir, NAMES[i]);
        if (i < BIAS || access(path, F_OK) == 0)
            rc = ft_npy_read(path, &f[i], err, errlen);
    }
    const ft_npy_header *t = &f[TOKEN_IDS].h, *w = &f[WEIGHT].h;
    const int64_t B = t->shape[0], T = t->shape[1], V = w->shape[0], H = w->shape[1];
    const int ok[NFILES] = {
        (t->dtype == FT_NPY_I64 || t->dtype == FT_NPY_I32) && t->ndim == 2 && B >= 1 && T >= 1,
        !is_float(&f[MASK]) && dims(&f[MASK], 2, B, T, 0),
        is_float(&f[WEIGHT]) && w->ndim == 2 && V >= 1 && H >= 1,
        is_float(&f[HIDDEN]) && (dims(&f[HIDDEN], 3, B, T, H) || dims(&f[HIDDEN], 2, B * T, H, 0)),
        is_float(&f[ADVANTAGES]) && dims(&f[ADVANTAGES], 1, B, 0, 0),
        is_float(&f[BIAS]) && dims(&f[BIAS], 1, V, 0, 0),
        is_float(&f[OLD_LOGP]) && dims(&f[OLD_LOGP], 2, B, T, 0),
        is_float(&f[REF_LOGP]) && dims(&f[REF_LOGP], 2, B, T, 0),
        is_float(&f[IS_RATIO]) && (dims(&f[IS_RATIO], 2, B, T, 0) || dims(&f[IS_RATIO], 1, B, 0, 0)),
    };
    for (int i = 0; i < NFILES && rc == 0; i++)
        if (f[i].data != NULL && !ok[i]) {
            char shape[256];
            ft_npy_shape_str(&f[i].h, shape, sizeof shape);
            rc = ft_error(err, errlen, "%s/%s.npy: shape %s (%s), expected %s", dir, NAMES[i], shape,
                          ft_npy_dtype_name(f[i].h.dtype), EXPECTED[i]);
        }
    if (rc == 0) { /* the files define the shape and which optional inputs exist */
        cfg->batch = B;
        cfg->seq_len = T;
        cfg->hidden = H;
        cfg->vocab = V;
        cfg->use_bias = f[BIAS].data != NULL;
        cfg->use_old_logp = f[OLD_LOGP].data != NULL;
        cfg->use_ref_logp = f[REF_LOGP].data != NULL;
        cfg->is_ratio = !f[IS_RATIO].data        ? FT_ISR_NONE
                        : f[IS_RATIO].h.ndim == 2 ? FT_ISR_TOKEN
                                                  : FT_ISR_SEQUENCE;
        rc = ft_problem_create(cfg, p, err, errlen);
    }
    if (rc == 0) {
        /* The float inputs, in the problem's storage (widened or rounded). */
        void *const dst[NFILES] = {[HIDDEN] = p->hidden, [WEIGHT] = p->weight, [BIAS] = p->bias,
                                   [ADVANTAGES] = p->advantages, [OLD_LOGP] = p->old_logp,
                                   [REF_LOGP] = p->ref_logp, [IS_RATIO] = p->is_ratio};
        for (int i = 0; i < NFILES; i++)
            for (int64_t k = 0; dst[i] && k < f[i].h.count; k++)
                ft_store(dst[i], i == HIDDEN || i == WEIGHT || i == BIAS ? cfg->dtype : FG_DTYPE_F32, k,
                         (float)get_f(&f[i], k));
        const size_t mask_size = ft_npy_dtype_size(f[MASK].h.dtype);
        for (int64_t i = 0; i < B * T; i++) {
            p->token_ids[i] = t->dtype == FT_NPY_I64 ? ((const int64_t *)f[TOKEN_IDS].data)[i]
                                                     : ((const int32_t *)f[TOKEN_IDS].data)[i];
            for (size_t b = 0; b < mask_size; b++) /* any nonzero byte: bool or any integer */
                p->mask[i] |= ((const unsigned char *)f[MASK].data)[(size_t)i * mask_size + b] != 0;
        }
    }
    for (int i = 0; i < NFILES; i++)
        ft_npy_free(&f[i]);
    return rc;
}

/* One .npy file to write: data in `from` (FG_DTYPE_BF16: widened to float32);
 * data NULL: absent, and a file of that name left from an earlier write goes. */
typedef struct out_file {
    const char *name;
    ft_npy_dtype type;
    const void *data;
    int from, ndim;
    const int64_t *shape;
} out_file;

static int write_all(const char *dir, const out_file *f, int n, char *err, size_t errlen)
{
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return ft_error(err, errlen, "%s: cannot create directory: %s", dir, strerror(errno));
    for (int k = 0; k < n; k++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s.npy", dir, f[k].name);
        if (f[k].data == NULL) {
            unlink(path);
            continue;
        }
        int64_t count = 1;
        for (int i = 0; i < f[k].ndim; i++)
            count *= f[k].shape[i];
        float *wide = f[k].from == FG_DTYPE_BF16 ? malloc((size_t)(count > 0 ? count : 1) * 4) : NULL;
        if (f[k].from == FG_DTYPE_BF16 && wide == NULL)
            return ft_error(err, errlen, "%s: out of memory", path);
        for (int64_t i = 0; wide && i < count; i++)
            wide[i] = ft_load(f[k].data, FG_DTYPE_BF16, i);
        const void *data = wide ? wide : f[k].data;
        const int rc = ft_npy_write(path, f[k].type, f[k].ndim, f[k].shape, data, err, errlen);
        free(wide);
        if (rc != 0)
            return -1;
    }
    return 0;
}

int ft_problem_save_dir(const ft_problem *p, const char *dir, char *err, size_t errlen)
{
    const ft_config *s = &p->s;
    const int64_t bth[3] = {s->batch, s->seq_len, s->hidden}, vh[2] = {s->vocab, s->hidden};
    const int F = FG_DTYPE_F32, dt = s->dtype;
    const out_file f[] = {
        {"hidden", FT_NPY_F32, p->hidden, dt, 3, bth}, {"weight", FT_NPY_F32, p->weight, dt, 2, vh},
        {"bias", FT_NPY_F32, p->bias, dt, 1, &s->vocab}, {"token_ids", FT_NPY_I64, p->token_ids, F, 2, bth},
        {"mask", FT_NPY_BOOL, p->mask, F, 2, bth}, {"advantages", FT_NPY_F32, p->advantages, F, 1, bth},
        {"old_logp", FT_NPY_F32, p->old_logp, F, 2, bth}, {"ref_logp", FT_NPY_F32, p->ref_logp, F, 2, bth},
        {"is_ratio", FT_NPY_F32, p->is_ratio, F, s->is_ratio == FT_ISR_TOKEN ? 2 : 1, bth},
    };
    return write_all(dir, f, sizeof f / sizeof f[0], err, errlen);
}

int ft_dump_outputs(const char *dir, const ft_runner *r, char *err, size_t errlen)
{
    const ft_config *s = &r->p->s;
    const int64_t bth[3] = {s->batch, s->seq_len, s->hidden}, vh[2] = {s->vocab, s->hidden};
    const int64_t btv[3] = {s->batch, s->seq_len, s->vocab}, six = 6;
    const fg_metrics *m = &r->metrics;
    const double metrics[6] = {m->kl, m->entropy, m->clip_ratio_low, m->clip_ratio_high,
                               m->clip_ratio_region, m->cispo_clip_ratio};
    const int F = FG_DTYPE_F32;
    const out_file f[] = {
        {"loss", FT_NPY_F64, &r->loss_value, F, 0, bth}, {"metrics", FT_NPY_F64, metrics, F, 1, &six},
        {"logp", FT_NPY_F32, r->logp, F, 2, bth}, {"entropy", FT_NPY_F32, r->entropy, F, 2, bth},
        {"grad_logits", FT_NPY_F32, r->impl == FT_IMPL_LOGITS ? r->logits : NULL, s->dtype, 3, btv},
        {"grad_hidden", FT_NPY_F32, r->grad_hidden, F, 3, bth},
        {"grad_weight", FT_NPY_F32, r->grad_weight, F, 2, vh},
        {"grad_bias", FT_NPY_F32, r->grad_bias, F, 1, &s->vocab},
    };
    return write_all(dir, f, sizeof f / sizeof f[0], err, errlen);
}
