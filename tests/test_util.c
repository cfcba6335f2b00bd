#define TU_CONTEXT_CREATE_ITSELF
#include "test_util.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"

long tu_passed = 0;
long tu_failed = 0;

/* ------------------------------------------------------------ tolerances */

#define TU_MAX_TOLERANCES 256

typedef struct tol_record {
    char name[80];
    double tol;
    double worst;
    long checks;
    char worst_case[160];
} tol_record;

static tol_record tol_table[TU_MAX_TOLERANCES];
static int tol_count;

static tol_record *tol_find(const char *name) {
    for (int i = 0; i < tol_count; i++)
        if (strcmp(tol_table[i].name, name) == 0) return &tol_table[i];
    return NULL;
}

double tu_tol_worst(const char *name) {
    const tol_record *r = tol_find(name);
    return r ? r->worst : 0.0;
}

void tu_tol_check(const char *name, double err, double tol, const char *file, int line,
                  const char *fmt, ...) {
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (isnan(err)) err = INFINITY;
    tol_record *r = tol_find(name);
    if (!r) {
        if (tol_count == TU_MAX_TOLERANCES) {
            tu_failed++;
            fprintf(stderr, "FAIL %s:%d: more than %d tolerance names\n", file, line,
                    TU_MAX_TOLERANCES);
            return;
        }
        r = &tol_table[tol_count++];
        memset(r, 0, sizeof *r);
        snprintf(r->name, sizeof r->name, "%s", name);
        r->tol = tol;
    }
    if (r->tol != tol) {
        tu_failed++;
        fprintf(stderr, "FAIL %s:%d: tolerance '%s' used with %.3g and %.3g\n", file, line, name,
                r->tol, tol);
    }
    r->checks++;
    if (r->checks == 1 || err > r->worst) { /* errors are >= 0: worst starts at 0 */
        r->worst = err;
        snprintf(r->worst_case, sizeof r->worst_case, "%s", what);
    }
    if (err <= tol) {
        tu_passed++;
    } else {
        tu_failed++;
        fprintf(stderr, "FAIL %s:%d: %s: %s: error %.3g > tolerance %.3g\n", file, line, name, what,
                err, tol);
        fflush(stderr);
    }
}

/* The table: a ratio tol / worst above 10 means the tolerance would let
 * errors 10x larger than this run's through. Where a tolerance is the
 * maximum over two CPU kinds (bf16 GEMMs differ between AVX-512 BF16 and
 * AVX2 CPUs, see the comments at the tolerances), the other kind's worst is
 * the binding one and the ratio printed here may exceed 10. */
static void tol_print_table(void) {
    if (tol_count == 0) return;
    printf("\n%-46s %9s %11s %9s  %s\n", "tolerance", "tol", "worst", "tol/worst",
           "worst case");
    for (int i = 0; i < tol_count; i++) {
        const tol_record *r = &tol_table[i];
        char ratio[32];
        if (r->worst > 0 && r->tol / r->worst > 1e6)
            snprintf(ratio, sizeof ratio, ">1e6 !");
        else if (r->worst > 0)
            snprintf(ratio, sizeof ratio, "%.1f%s", r->tol / r->worst,
                     r->tol / r->worst > 10.0 ? " !" : "");
        else
            snprintf(ratio, sizeof ratio, "%s", r->tol > 0 ? "inf !" : "exact");
        printf("%-46s %9.2e %11.3e %9s  %s\n", r->name, r->tol, r->worst, ratio, r->worst_case);
    }
    printf("(! : tol > 10x the worst measured on this CPU)\n");
}

int tu_finish(void) {
    tol_print_table();
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
    cfg->vespo_k_pos = 2.0;
    cfg->vespo_lambda_pos = 3.0;
    cfg->vespo_k_neg = 3.0;
    cfg->vespo_lambda_neg = 2.0;
    cfg->off_policy_mask_threshold = INFINITY;
    cfg->top_entropy_quantile = 1.0;
}

const char *tu_loss_name(int t) {
    static const char *names[] = {"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"};
    return t >= 0 && t < 8 ? names[t] : "?";
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

void *tu_xmalloc_aligned(size_t n) {
    void *p = aligned_alloc(64, (n + 63) & ~(size_t)63); /* size a multiple of the alignment */
    if (!p) {
        fprintf(stderr, "out of memory (%zu aligned bytes)\n", n);
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
    tb->sampling_logp = tu_xmalloc((size_t)N * sizeof(float));
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
    /* the sampler's log-probs, without drawing from rng (the streams of the
     * existing tests stay as they were) */
    for (int64_t n = 0; n < N; n++) {
        const uint64_t h = (uint64_t)(n + 1) * 0x9E3779B97F4A7C15ull;
        const double u = (double)(h >> 11) * (1.0 / 9007199254740992.0); /* [0, 1) */
        tb->sampling_logp[n] = !tb->mask[n] ? 1e4f
                               : n % 5 == 4 ? NAN
                                            : (float)(tb->old_logp[n] + 0.5 * (u - 0.5));
    }
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
    v->sampling_logp = tb->have_sampling ? tb->sampling_logp : NULL;
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
    free(tb->sampling_logp);
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

/* -------------------------------------------------------------- problems */

void tu_problem_make(tu_problem *p, int64_t B, int64_t T, int64_t H, int64_t V, fg_dtype dtype,
                     int with_bias, uint64_t seed) {
    tu_problem_make_opts(p, B, T, H, V, dtype, with_bias, seed, NULL);
}

void tu_problem_make_opts(tu_problem *p, int64_t B, int64_t T, int64_t H, int64_t V,
                          fg_dtype dtype, int with_bias, uint64_t seed,
                          const tu_problem_opts *opts) {
    tu_problem_opts o;
    memset(&o, 0, sizeof o);
    if (opts) o = *opts;
    const double hs = o.hidden_scale > 0 ? o.hidden_scale : 1.0;
    const double ws = o.weight_scale > 0 ? o.weight_scale : 3.0 / sqrt((double)H);
    const double bs = o.bias_scale > 0 ? o.bias_scale : 0.5;
    memset(p, 0, sizeof *p);
    p->B = B;
    p->T = T;
    p->N = B * T;
    p->H = H;
    p->V = V;
    p->dtype = dtype;
    p->ldh = H + (o.hidden_pad > 0 ? o.hidden_pad : 0);
    p->ldw = H + (o.weight_pad > 0 ? o.weight_pad : 0);
    tu_rng_seed(&p->rng, seed);
    const int64_t N = p->N;
    p->hidden = tu_xmalloc(sizeof(double) * (size_t)(N * H));
    p->weight = tu_xmalloc(sizeof(double) * (size_t)(V * H));
    double *bias = tu_xmalloc(sizeof(double) * (size_t)V);
    for (int64_t i = 0; i < N * H; i++) p->hidden[i] = hs * tu_normal(&p->rng);
    for (int64_t i = 0; i < V * H; i++) p->weight[i] = ws * tu_normal(&p->rng);
    /* drawn with or without a bias: the batch below is the same either way */
    for (int64_t i = 0; i < V; i++) bias[i] = bs * tu_normal(&p->rng);
    p->hidden_s = tu_store_matrix(p->hidden, N, H, p->ldh, dtype);
    p->weight_s = tu_store_matrix(p->weight, V, H, p->ldw, dtype);
    if (with_bias) {
        p->bias = bias;
        p->bias_s = tu_store_matrix(p->bias, 1, V, V, dtype);
    } else {
        free(bias);
    }
    if (!p->hidden_s || !p->weight_s || (with_bias && !p->bias_s)) {
        fprintf(stderr, "out of memory storing a %lldx%lldx%lld problem\n", (long long)N,
                (long long)H, (long long)V);
        exit(2);
    }
    tu_batch_make(&p->tb, B, T, V, o.mask_pattern, &p->rng);
}

void tu_problem_restore(tu_problem *p) {
    free(p->hidden_s);
    free(p->weight_s);
    free(p->bias_s);
    p->hidden_s = tu_store_matrix(p->hidden, p->N, p->H, p->ldh, p->dtype);
    p->weight_s = tu_store_matrix(p->weight, p->V, p->H, p->ldw, p->dtype);
    p->bias_s = p->bias ? tu_store_matrix(p->bias, 1, p->V, p->V, p->dtype) : NULL;
    if (!p->hidden_s || !p->weight_s || (p->bias && !p->bias_s)) {
        fprintf(stderr, "out of memory storing a problem again\n");
        exit(2);
    }
}

fg_linear_inputs tu_problem_inputs(const tu_problem *p) {
    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.hidden = (fg_matrix){p->hidden_s, p->dtype, p->N, p->H, p->ldh};
    in.weight = (fg_matrix){p->weight_s, p->dtype, p->V, p->H, p->ldw};
    in.bias = fg_vector_make(p->bias_s, p->dtype, p->bias_s ? p->V : 0);
    return in;
}

fg_linear_inputs tu_problem_shard_inputs(const tu_problem *p, int64_t v0, int64_t v1) {
    fg_linear_inputs in = tu_problem_inputs(p);
    const size_t es = tu_dtype_size(p->dtype);
    in.weight.data = (unsigned char *)p->weight_s + (size_t)v0 * (size_t)p->ldw * es;
    in.weight.rows = v1 - v0;
    if (p->bias_s)
        in.bias = fg_vector_make((unsigned char *)p->bias_s + (size_t)v0 * es, p->dtype, v1 - v0);
    in.vocab_start = v0;
    in.vocab_total = p->V;
    return in;
}

int tu_problem_fill_logp(tu_problem *p, double temperature, double s_old, double s_ref) {
    fg_loss_config plain;
    tu_config_defaults(&plain);
    plain.temperature = temperature;
    tu_batch b = p->tb; /* the same arrays, viewed without old / ref / is_ratio */
    b.have_old = b.have_ref = 0;
    b.is_mode = 0;
    fg_oracle_result r;
    if (fg_oracle_linear(&plain, tu_batch_view(&b), p->hidden, p->weight, p->bias, p->H, p->V,
                         &r) != 0)
        return -1;
    p->tb.have_old = p->tb.have_ref = 1;
    p->tb.is_mode = 1;
    tu_batch_fill_logp(&p->tb, r.logp, s_old, s_ref, &p->rng);
    fg_oracle_result_free(&r);
    return 0;
}

double *tu_problem_logits(const tu_problem *p) {
    double *z = tu_xmalloc(sizeof(double) * (size_t)(p->N * p->V));
    for (int64_t n = 0; n < p->N; n++)
        for (int64_t v = 0; v < p->V; v++) {
            double acc = p->bias ? p->bias[v] : 0.0;
            for (int64_t h = 0; h < p->H; h++)
                acc += p->hidden[n * p->H + h] * p->weight[v * p->H + h];
            z[n * p->V + v] = acc;
        }
    return z;
}

void tu_problem_free(tu_problem *p) {
    free(p->hidden);
    free(p->weight);
    free(p->bias);
    free(p->hidden_s);
    free(p->weight_s);
    free(p->bias_s);
    tu_batch_free(&p->tb);
    memset(p, 0, sizeof *p);
}

/* -------------------------------------------------------- linear outputs */

void tu_linear_outs_make(tu_linear_outs *o, int64_t N, int64_t H, int64_t V, int with_grad_bias) {
    memset(o, 0, sizeof *o);
    o->N = N;
    o->H = H;
    o->V = V;
    o->logp = tu_xmalloc(sizeof(float) * (size_t)N);
    o->entropy = tu_xmalloc(sizeof(float) * (size_t)N);
    o->grad_hidden = tu_xmalloc(sizeof(float) * (size_t)(N * H));
    o->grad_weight = tu_xmalloc(sizeof(float) * (size_t)(V * H));
    o->out.logp = o->logp;
    o->out.entropy = o->entropy;
    o->out.grad_hidden = fg_matrix_make(o->grad_hidden, FG_DTYPE_F32, N, H);
    o->out.grad_weight = fg_matrix_make(o->grad_weight, FG_DTYPE_F32, V, H);
    if (with_grad_bias) {
        o->grad_bias = tu_xmalloc(sizeof(float) * (size_t)V);
        o->out.grad_bias = fg_vector_make(o->grad_bias, FG_DTYPE_F32, V);
    }
}

void tu_linear_outs_fill(tu_linear_outs *o, unsigned char v) {
    memset(&o->out.loss, v, sizeof o->out.loss);
    memset(&o->out.metrics, v, sizeof o->out.metrics);
    memset(o->logp, v, sizeof(float) * (size_t)o->N);
    memset(o->entropy, v, sizeof(float) * (size_t)o->N);
    memset(o->grad_hidden, v, sizeof(float) * (size_t)(o->N * o->H));
    memset(o->grad_weight, v, sizeof(float) * (size_t)(o->V * o->H));
    if (o->grad_bias) memset(o->grad_bias, v, sizeof(float) * (size_t)o->V);
}

int tu_linear_outs_are(const tu_linear_outs *o, unsigned char v) {
    return tu_bytes_are(&o->out.loss, sizeof o->out.loss, v) &&
           tu_bytes_are(&o->out.metrics, sizeof o->out.metrics, v) &&
           tu_bytes_are(o->logp, sizeof(float) * (size_t)o->N, v) &&
           tu_bytes_are(o->entropy, sizeof(float) * (size_t)o->N, v) &&
           tu_bytes_are(o->grad_hidden, sizeof(float) * (size_t)(o->N * o->H), v) &&
           tu_bytes_are(o->grad_weight, sizeof(float) * (size_t)(o->V * o->H), v) &&
           (!o->grad_bias || tu_bytes_are(o->grad_bias, sizeof(float) * (size_t)o->V, v));
}

int tu_linear_outs_same(const tu_linear_outs *a, const tu_linear_outs *b) {
    if (a->N != b->N || a->H != b->H || a->V != b->V || !a->grad_bias != !b->grad_bias) return 0;
    return memcmp(&a->out.loss, &b->out.loss, sizeof a->out.loss) == 0 &&
           memcmp(&a->out.metrics, &b->out.metrics, sizeof a->out.metrics) == 0 &&
           memcmp(a->logp, b->logp, sizeof(float) * (size_t)a->N) == 0 &&
           memcmp(a->entropy, b->entropy, sizeof(float) * (size_t)a->N) == 0 &&
           memcmp(a->grad_hidden, b->grad_hidden, sizeof(float) * (size_t)(a->N * a->H)) == 0 &&
           memcmp(a->grad_weight, b->grad_weight, sizeof(float) * (size_t)(a->V * a->H)) == 0 &&
           (!a->grad_bias || memcmp(a->grad_bias, b->grad_bias, sizeof(float) * (size_t)a->V) == 0);
}

void tu_linear_outs_free(tu_linear_outs *o) {
    free(o->logp);
    free(o->entropy);
    free(o->grad_hidden);
    free(o->grad_weight);
    free(o->grad_bias);
    memset(o, 0, sizeof *o);
}

int tu_bf16_gemms_native(void)
{
    static int answer = -1;
    if (answer >= 0)
        return answer;
    uint16_t hidden[8] = {0}, weight[4 * 8] = {0};
    int64_t token = 0;
    uint8_t mask = 1;
    float adv = 0.0f;
    fg_batch b = {1, 1, &token, &mask, &adv, NULL, NULL, NULL, 0, NULL};
    fg_linear_inputs in = {fg_matrix_make(hidden, FG_DTYPE_BF16, 1, 8),
                           fg_matrix_make(weight, FG_DTYPE_BF16, 4, 8), {NULL, FG_DTYPE_BF16, 0}, 0, 0};
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    fg_linear_plan_info plan;
    fg_context *ctx = NULL;
    if (tu_context_create(NULL, &ctx) != FG_OK || /* the backend the test runs on */
        fg_linear_grpo_plan(ctx, NULL, &cfg, &in, &b, &out, NULL, &plan) != FG_OK) {
        fprintf(stderr, "tu_bf16_gemms_native: %s\n", ctx ? fg_last_error(ctx) : "no context");
        abort();
    }
    fg_context_destroy(ctx);
    answer = plan.gemm_dtype == FG_DTYPE_BF16;
    return answer;
}

double tu_rel_l2f(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int tu_on_reference(void)
{
    const char *b = getenv("FG_TEST_BACKEND");
    return b && strcmp(b, "reference") == 0;
}

fg_status tu_context_create(const fg_context_options *opts, fg_context **out)
{
    fg_context_options o;
    if (opts)
        o = *opts;
    else
        fg_context_options_init(&o);
    if (tu_on_reference() && o.backend == FG_BACKEND_CPU)
        o.backend = FG_BACKEND_REFERENCE;
    return fg_context_create(&o, out);
}

fg_status tu_host_context_create(fg_context **out) { return fg_context_create(NULL, out); }
