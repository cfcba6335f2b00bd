#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

long tu_passed = 0;
long tu_failed = 0;

int tu_finish(void) {
    printf("%ld passed, %ld failed\n", tu_passed, tu_failed);
    fflush(stdout);
    return tu_failed > 0 ? 1 : 0;
}

/* ------------------------------------------------------------------ rng */

void tu_rng_seed(tu_rng *r, uint64_t seed) {
    r->s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    (void)tu_next(r);
}

uint64_t tu_next(tu_rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double tu_uniform(tu_rng *r) { return (double)(tu_next(r) >> 11) * (1.0 / 9007199254740992.0); }

double tu_normal(tu_rng *r) {
    double u1 = tu_uniform(r), u2 = tu_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

int64_t tu_randint(tu_rng *r, int64_t n) { return (int64_t)(tu_next(r) % (uint64_t)n); }

/* --------------------------------------------------------------- config */

void tu_config_defaults(fg_loss_config *cfg) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->loss_type = FG_LOSS_DAPO;
    cfg->importance_sampling_level = FG_LEVEL_TOKEN;
    cfg->temperature = 1.0;
    cfg->epsilon_low = 0.2;
    cfg->epsilon_high = -1.0;
    cfg->delta = 0.0;
    cfg->beta = 0.0;
    cfg->max_completion_length = 0;
    cfg->num_items_in_batch = -1.0;
    cfg->sapo_temperature_pos = 1.0;
    cfg->sapo_temperature_neg = 1.05;
    cfg->use_bias_correction_kl = 0;
    cfg->entropy_coef = 0.0;
}

const char *tu_loss_name(int t) {
    static const char *names[] = {"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"};
    return t >= 0 && t < 7 ? names[t] : "?";
}

const char *tu_level_name(int l) { return l == 0 ? "token" : l == 1 ? "sequence" : "?"; }

/* ---------------------------------------------------------------- batch */

void *tu_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

int tu_batch_make(tu_batch *tb, int64_t B, int64_t T, int64_t V, int pattern, tu_rng *rng) {
    memset(tb, 0, sizeof(*tb));
    const int64_t N = B * T;
    tb->B = B;
    tb->T = T;
    tb->token_ids = tu_xmalloc((size_t)N * sizeof(int64_t));
    tb->mask = tu_xmalloc((size_t)N);
    tb->advantages = tu_xmalloc((size_t)B * sizeof(float));
    tb->old_logp = tu_xmalloc((size_t)N * sizeof(float));
    tb->ref_logp = tu_xmalloc((size_t)N * sizeof(float));
    tb->is_ratio = tu_xmalloc((size_t)N * sizeof(float));
    const int64_t empty = B >= 3 ? (int64_t)(pattern % B) : -1;
    const int64_t holey = B >= 2 ? (empty + 1 + B) % B : -1;
    for (int64_t b = 0; b < B; b++) {
        /* ragged lengths: full, all masked, or a random length >= 1 */
        int64_t len = T;
        if (b == empty) len = 0;
        else if (b != 0 && T > 1) len = 1 + tu_randint(rng, T);
        for (int64_t t = 0; t < T; t++) {
            const int64_t n = b * T + t;
            int m = t < len;
            if (b == holey && T >= 4 && t == 1 && len > 2) m = 0; /* a hole */
            tb->mask[n] = (uint8_t)(m ? 1 + (t % 3 == 2 ? 6 : 0) : 0); /* nonzero != 1 too */
            tb->token_ids[n] = m ? tu_randint(rng, V) : ((t & 1) ? -7 : V + 11);
        }
        double a = 0.2 + fabs(tu_normal(rng));
        if (B == 1 ? (tu_next(rng) & 1) : (b & 1)) a = -a;
        tb->advantages[b] = (float)a;
    }
    /* not yet filled: neutral values */
    for (int64_t n = 0; n < N; n++) {
        tb->old_logp[n] = -1.0f;
        tb->ref_logp[n] = -1.0f;
        tb->is_ratio[n] = 1.0f;
    }
    return 0;
}

void tu_batch_fill_logp(tu_batch *tb, const double *logp_true, double s_old, double s_ref,
                        tu_rng *rng) {
    const int64_t N = tb->B * tb->T;
    for (int64_t n = 0; n < N; n++) {
        if (tb->mask[n]) {
            tb->old_logp[n] = (float)(logp_true[n] + s_old * tu_normal(rng));
            tb->ref_logp[n] = (float)(logp_true[n] + s_ref * tu_normal(rng));
            tb->is_ratio[n] = (float)(0.5 + tu_uniform(rng));
        } else {
            /* hostile padding: exp() of these overflows float */
            tb->old_logp[n] = -1e4f;
            tb->ref_logp[n] = 1e4f;
            tb->is_ratio[n] = 1e30f;
        }
    }
    for (int64_t b = 0; b < tb->B; b++) /* per-sequence is_ratio lives in [0, B) */
        if (tb->is_mode == 2) tb->is_ratio[b] = (float)(0.5 + tu_uniform(rng));
}

const fg_batch *tu_batch_view(tu_batch *tb) {
    fg_batch *v = &tb->view;
    memset(v, 0, sizeof(*v));
    v->batch = tb->B;
    v->seq_len = tb->T;
    v->token_ids = tb->token_ids;
    v->mask = tb->mask;
    v->advantages = tb->advantages;
    v->old_logp = tb->have_old ? tb->old_logp : NULL;
    v->ref_logp = tb->have_ref ? tb->ref_logp : NULL;
    v->is_ratio = tb->is_mode ? tb->is_ratio : NULL;
    v->is_ratio_per_sequence = tb->is_mode == 2;
    return v;
}

int64_t tu_batch_unmasked(const tu_batch *tb) {
    int64_t c = 0;
    for (int64_t n = 0; n < tb->B * tb->T; n++) c += tb->mask[n] != 0;
    return c;
}

void tu_batch_free(tu_batch *tb) {
    free(tb->token_ids);
    free(tb->mask);
    free(tb->advantages);
    free(tb->old_logp);
    free(tb->ref_logp);
    free(tb->is_ratio);
    memset(tb, 0, sizeof(*tb));
}

/* -------------------------------------------------------------- storage */

size_t tu_dtype_size(fg_dtype dt) { return dt == FG_DTYPE_BF16 ? 2 : 4; }

double tu_round_to(fg_dtype dt, double x) {
    if (dt == FG_DTYPE_BF16) return (double)fg_bf16_to_f32(fg_f32_to_bf16((float)x));
    return (double)(float)x;
}

void *tu_store_matrix(double *vals, int64_t rows, int64_t cols, int64_t ld, fg_dtype dt) {
    const size_t es = tu_dtype_size(dt);
    void *buf = malloc((size_t)(rows * ld) * es + 1);
    if (!buf) return NULL;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld; c++) {
            const int64_t i = r * ld + c;
            if (dt == FG_DTYPE_BF16) {
                uint16_t *p = buf;
                if (c < cols) {
                    p[i] = fg_f32_to_bf16((float)vals[r * cols + c]);
                    vals[r * cols + c] = (double)fg_bf16_to_f32(p[i]);
                } else {
                    p[i] = 0x7FC0u; /* NaN */
                }
            } else {
                float *p = buf;
                if (c < cols) {
                    p[i] = (float)vals[r * cols + c];
                    vals[r * cols + c] = (double)p[i];
                } else {
                    p[i] = NAN;
                }
            }
        }
    return buf;
}

double tu_load(const void *data, fg_dtype dt, int64_t idx) {
    if (dt == FG_DTYPE_BF16) return (double)fg_bf16_to_f32(((const uint16_t *)data)[idx]);
    return (double)((const float *)data)[idx];
}

/* --------------------------------------------------------------- errors */

double tu_rel_err(double a, double b, double floor) {
    double d = fabs(b) > floor ? fabs(b) : floor;
    double e = fabs(a - b) / d;
    return isnan(e) ? INFINITY : e;
}

double tu_rel_l2(const void *a, fg_dtype dt, int64_t rows, int64_t cols, int64_t lda,
                 const double *b) {
    double num = 0.0, den = 0.0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const double x = tu_load(a, dt, r * lda + c), y = b[r * cols + c];
            num += (x - y) * (x - y);
            den += y * y;
        }
    double e = den > 0 ? sqrt(num / den) : sqrt(num);
    return isnan(e) ? INFINITY : e;
}

double tu_max_rel(const float *a, const double *b, int64_t n, const uint8_t *mask, double floor) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (mask && !mask[i]) continue;
        double e = tu_rel_err((double)a[i], b[i], floor);
        if (e > m) m = e;
    }
    return m;
}

void tu_fill_bytes(void *p, size_t n, unsigned char v) { memset(p, v, n); }

int tu_bytes_are(const void *p, size_t n, unsigned char v) {
    const unsigned char *q = p;
    for (size_t i = 0; i < n; i++)
        if (q[i] != v) return 0;
    return 1;
}

void tu_fill_nan(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = NAN;
}
