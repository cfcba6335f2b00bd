/*
 * fuzz_api: the argument checks and the numerics of fg_linear_grpo (fused and
 * materialized) and fg_logits_grpo, driven by bytes.
 *
 * The input decodes into: the entry point, dtypes, B, T, H, V, a loss config
 * (valid or with a bad value from a palette), token ids (some out of range),
 * a mask, optional inputs, NaN/Inf injections, up to four corruptions of view
 * fields (rows, cols, ld, len, dtype, vocab_start/total) taken from a palette
 * of hostile values, which outputs are requested, the execution options of
 * the call (fg_exec: threads 1/2, memory budget, and a caller workspace that
 * is sized by the planner, too small, or misaligned) and the context's
 * (finite check, a vocab-sharding communicator that is the identity or fails
 * on its k-th call).
 *
 * Honesty rule: every buffer is allocated exactly as large as its view says
 * (so a read past it is the library's fault), unless the view's byte count
 * overflows (then a 64-byte buffer: the library must refuse the view). A view
 * that is valid but larger than 1 Mi elements skips the input.
 *
 * Properties (abort() with a message when violated):
 *  1. no crash, no sanitizer report, every call returns a status in range;
 *  2. on any status != FG_OK, every output byte (loss, metrics, logp,
 *     entropy, every gradient buffer with 64 bytes of slack, and the logits
 *     when grad_logits aliases them) is untouched, and fg_last_error is not
 *     empty. Exceptions, where the header allows writes before the failure is
 *     known: FG_ERR_NONFINITE_INPUT whose message says "results are invalid"
 *     (non-finite logits found during the computation, finite check off or
 *     finite inputs overflowing), and FG_ERR_COMMUNICATOR when the fuzzed
 *     communicator failed (a collective call's reductions run after its
 *     outputs start);
 *  3. on FG_OK: fg_last_error is "", slack and row padding (ld > cols) of
 *     every output are untouched, masked logp/entropy are 0, masked rows of
 *     grad_hidden/grad_logits are 0;
 *  4. "tame" inputs (bounded values, no NaN, no sharding, valid config)
 *     must succeed, give finite outputs, and match the float64 oracle.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "fusedgrpo.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define SENT 0xA5
#define SLACK 64
#define MAX_ELEMS ((int64_t)1 << 20)

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_api: PROPERTY VIOLATED: %s (%s)\n", what, detail ? detail : "");
    fflush(stderr);
    abort();
}

/* ------------------------------------------------------------ byte reader */

typedef struct reader {
    const uint8_t *p;
    size_t n, i;
    uint64_t rng; /* bulk values once the bytes run out, seeded by the input */
} reader;

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static unsigned u8(reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }
static unsigned u16(reader *r) { return u8(r) | u8(r) << 8; }
static double bulk_unit(reader *r) { return (double)(splitmix(&r->rng) >> 11) / 9007199254740992.0; }

/* ------------------------------------------------------------ palettes */

static const int64_t BAD_I64[] = {0,
                                  -1,
                                  1,
                                  2,
                                  INT64_MAX,
                                  INT64_MIN,
                                  INT64_MAX / 2,
                                  INT64_MAX / 4 + 1,
                                  (int64_t)1 << 31,
                                  (int64_t)1 << 32,
                                  -((int64_t)1 << 32),
                                  (int64_t)1 << 62,
                                  3037000500, /* sqrt(2^63) */
                                  4611686018427387904 / 3};
#define NBAD (sizeof BAD_I64 / sizeof BAD_I64[0])

static int64_t bad_value(reader *r, int64_t orig)
{
    unsigned k = u8(r) % (NBAD + 3);
    /* wrapping arithmetic: orig may itself be a palette value */
    if (k == NBAD)
        return (int64_t)((uint64_t)orig - 1);
    if (k == NBAD + 1)
        return (int64_t)((uint64_t)orig + 1);
    if (k == NBAD + 2)
        return (int64_t)(2 * (uint64_t)orig + 1);
    return BAD_I64[k];
}

static const double BAD_F64[] = {0.0, -0.0, -1.0, NAN, INFINITY, -INFINITY, 1e-320, 1e308, -1e308, 5e-324};

/* ------------------------------------------------------------ state */

enum { V_HID, V_WT, V_LOG, V_GH, V_GW, V_GL, V_MATS };
enum { IN_HID, IN_WT, IN_BIAS, IN_LOG, IN_ADV, IN_OLD, IN_REF, IN_ISR, IN_COUNT };

typedef struct comm_state {
    int fail_at; /* -1: never */
    int calls;
    int failed;
} comm_state;

static int comm_fn(void *user, float *buf, int64_t count, fg_reduce_op op)
{
    comm_state *c = user;
    (void)buf;
    (void)op;
    if (count < 0)
        die("allreduce count < 0", NULL);
    if (c->fail_at >= 0 && c->calls++ == c->fail_at) {
        c->failed = 1;
        return -1;
    }
    return 0; /* one shard: the identity */
}

/* Every output either entry point can write; the call gets the fields of its
 * own output struct (fg_linear_outputs / fg_logits_outputs) and loss and
 * metrics are copied back, bytes and all, for the checks. */
typedef struct any_outputs {
    double loss;
    fg_metrics metrics;
    float *logp, *entropy;
    fg_matrix grad_hidden, grad_weight, grad_logits;
    fg_vector grad_bias;
} any_outputs;

static comm_state g_comm;
static fg_context *g_ctx[2]; /* [0]: no communicator, [1]: g_comm */
static fg_context *g_ref;    /* the seam's reference backend */

/* A context on the seam's reference backend: the driver's device path (the
 * one a CUDA context takes: staging, per-chunk copies), on host memory. */
static fg_context *get_ref_ctx(void)
{
    if (!g_ref) {
        fg_context_options o;
        fg_context_options_init(&o);
        o.threads = 1;
        o.backend = FG_BACKEND_REFERENCE;
        if (fg_context_create(&o, &g_ref) != FG_OK)
            die("fg_context_create (reference backend) failed", NULL);
    }
    return g_ref;
}

static fg_context *get_ctx(int with_comm)
{
    if (!g_ctx[with_comm]) {
        fg_context_options o;
        fg_context_options_init(&o);
        o.threads = 1;
        if (with_comm) {
            o.comm.allreduce = comm_fn;
            o.comm.user = &g_comm;
        }
        if (fg_context_create(&o, &g_ctx[with_comm]) != FG_OK)
            die("fg_context_create failed", NULL);
    }
    return g_ctx[with_comm];
}

/* Element count a matrix view spans, -1 when the view is invalid or its byte
 * count overflows (the library must refuse it), -2 when valid but too big. */
static int64_t span(const fg_matrix *m)
{
    if (m->rows <= 0 || m->cols <= 0 || m->ld < m->cols)
        return -1;
    if (m->dtype != FG_DTYPE_F32 && m->dtype != FG_DTYPE_BF16)
        return -1;
    int64_t e;
    if (__builtin_mul_overflow(m->rows - 1, m->ld, &e) || __builtin_add_overflow(e, m->cols, &e) ||
        e > INT64_MAX / 4)
        return -1;
    if (e > MAX_ELEMS)
        return -2;
    return e;
}

static size_t esize(fg_dtype t) { return t == FG_DTYPE_BF16 ? 2 : 4; }

static float load(const void *p, fg_dtype t, int64_t i)
{
    return t == FG_DTYPE_BF16 ? fg_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void store(void *p, fg_dtype t, int64_t i, float x)
{
    if (t == FG_DTYPE_BF16)
        ((uint16_t *)p)[i] = fg_f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

static int all_bytes(const void *p, size_t n, unsigned char v)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != v)
            return 0;
    return 1;
}

typedef struct buf {
    unsigned char *p;
    size_t bytes; /* what the view spans (0: an invalid view's dummy) */
    size_t alloc; /* bytes + SLACK for outputs */
} buf;

static int alloc_matrix(fg_matrix *m, buf *b, int is_output)
{
    int64_t e = span(m);
    if (e == -2)
        return -1;
    const size_t es = (m->dtype == FG_DTYPE_BF16) ? 2 : 4;
    b->bytes = e > 0 ? (size_t)e * es : 0;
    b->alloc = (e > 0 ? b->bytes : 64) + (is_output ? SLACK : 0);
    b->p = malloc(b->alloc);
    if (!b->p)
        return -1;
    memset(b->p, SENT, b->alloc);
    m->data = b->p;
    return 0;
}

/* Is output byte range [off, off+len) inside a row's columns of view m? */
static int padding_untouched(const fg_matrix *m, const buf *b)
{
    if (!b->p)
        return 1;
    if (!all_bytes(b->p + b->bytes, b->alloc - b->bytes, SENT))
        return 0;
    const size_t es = esize(m->dtype);
    for (int64_t r = 0; r + 1 < m->rows; r++) {
        const unsigned char *pad = b->p + ((size_t)r * (size_t)m->ld + (size_t)m->cols) * es;
        if (!all_bytes(pad, (size_t)(m->ld - m->cols) * es, SENT))
            return 0;
    }
    return 1;
}

/* ------------------------------------------------------------ comparison */

static double g_worst[8];

static void cmp_scalar(const char *what, double a, double b, double scale, double tol, int slot)
{
    double e = fabs(a - b) / (scale > 1e-30 ? scale : 1e-30);
    if (!(e <= tol)) {
        char msg[200];
        snprintf(msg, sizeof msg, "%s: library %.9g oracle %.9g err %.3g > %.3g", what, a, b, e, tol);
        die("tame input disagrees with the oracle", msg);
    }
    if (e > g_worst[slot])
        g_worst[slot] = e;
}

/* max|a - b| over a [rows, cols] f32/bf16 matrix (stride ld) against a
 * contiguous double b, relative to max(max|b|, floor). */
static void cmp_matrix(const char *what, const void *a, fg_dtype at, int64_t rows, int64_t cols,
                       int64_t ld, const double *b, double floor, double tol, int slot)
{
    double mx = 0, err = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            double x = load(a, at, r * ld + c), y = b[r * cols + c];
            if (getenv("FUZZ_API_VERBOSE"))
                fprintf(stderr, "  %s[%lld,%lld] lib %.9g oracle %.9g\n", what, (long long)r,
                        (long long)c, x, y);
            if (!isfinite(x))
                die("tame input gave a non-finite output", what);
            mx = fmax(mx, fabs(y));
            err = fmax(err, fabs(x - y));
        }
    cmp_scalar(what, err, 0.0, fmax(mx, floor), tol, slot);
}

/* Where the CPU multiplies bf16 natively, dlogits are rounded to bf16
 * (relative error <= 2^-9 each) before the gradient GEMMs, so a gradient
 * element's error is bounded by 2^-9 times the sum of its terms' magnitudes,
 * which cancellation can make much larger than the element. This returns the
 * largest such sum: which 0: grad_hidden[n,k] = sum_v dl[n,v] w[v,k];
 * 1: grad_weight[v,k] = sum_n dl[n,v] h[n,k]; 2: grad_bias[v] = sum_n dl[n,v]. */
static double bf16_term_sum(int which, const double *dl, const double *h, const double *w,
                            int64_t N, int64_t V, int64_t H)
{
    double best = 0;
    const int64_t rows = which == 0 ? N : V, cols = which == 2 ? 1 : H;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            double sum = 0;
            if (which == 0)
                for (int64_t v = 0; v < V; v++) sum += fabs(dl[r * V + v] * w[v * H + c]);
            else
                for (int64_t n = 0; n < N; n++)
                    sum += fabs(dl[n * V + r]) * (which == 1 ? fabs(h[n * H + c]) : 1.0);
            best = fmax(best, sum);
        }
    return best;
}

/* ------------------------------------------------------------ the harness */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader R = {data, size, 0, 0x5EED};
    for (size_t i = 0; i < size; i++)
        R.rng = R.rng * 1099511628211ull ^ data[i];
    /* One LM-head input in eight (by the input's hash, so the corpus decodes
     * as before) runs on the reference backend, where it can: see below. */
    const int ref_pick = (R.rng >> 61) == 0;
    reader *r = &R;

    /* ---- choices */
    const unsigned f0 = u8(r), f1 = u8(r), f2 = u8(r);
    const int path = f0 % 3; /* 0 fused, 1 materialized, 2 logits */
    const fg_dtype in_t = (f0 >> 2) & 1 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    const fg_dtype gl_t = (f0 >> 3) & 1 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    int tame = !((f0 >> 4) & 1);
    const int check_finite = !((f0 >> 5) & 1) || tame;
    const int threads = 1 + ((f0 >> 6) & 1);
    const int round_logits = (f0 >> 7) & 1;
    const int want_logp = f1 & 1, want_ent = (f1 >> 1) & 1, want_gh = (f1 >> 2) & 1,
              want_gw = (f1 >> 3) & 1, want_gb = (f1 >> 4) & 1, want_gl = (f1 >> 5) & 1,
              in_place = (f1 >> 6) & 1, use_bias = (f1 >> 7) & 1;
    const int have_old = f2 & 1, have_ref = (f2 >> 1) & 1, is_mode = (f2 >> 2) % 3,
              comm_mode = (f2 >> 4) % 4; /* 0,1: none, 2: identity, 3: fails */
    const unsigned budget_k = (f2 >> 6) & 3;
    static const size_t BUDGETS[4] = {0, 1, 4096 * 3, 65536};

    int64_t B = 1 + u8(r) % 4, T = 1 + u8(r) % 6;
    const int64_t H = 1 + u8(r) % 9;
    int64_t V = 1 + (u8(r) & 1 ? u16(r) % 600 : u8(r) % 40);
    const unsigned bt_bad = u8(r);
    if (bt_bad % 16 == 0) { /* a bad B or T from the palette */
        int64_t *p = (bt_bad & 16) ? &B : &T;
        *p = bad_value(r, *p);
        tame = 0;
    }
    int64_t N;
    int n_ok = 1;
    if (B <= 0 || T <= 0) {
        N = 1;
        n_ok = 0;
    } else if ((uint64_t)B > UINT64_MAX / 8 / (uint64_t)T) {
        /* B*T*sizeof(int64_t) overflows: refused (FG_ERR_SIZE_OVERFLOW) before
         * any array is read. A smaller but huge B*T is a valid claim about
         * arrays we cannot allocate: the library would read them. */
        N = 1;
        n_ok = 0;
    } else if (B * T > 4096) {
        return 0; /* a valid batch too big to allocate here */
    } else {
        N = B * T;
    }
    const int64_t A = n_ok ? N : 1; /* batch array lengths */

    /* ---- config */
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = (fg_loss_type)(u8(r) % FG_LOSS_TYPE_COUNT);
    cfg.importance_sampling_level = (fg_is_level)(u8(r) & 1);
    cfg.temperature = 0.5 + 3.5 * (u8(r) / 255.0);
    cfg.epsilon_low = u8(r) / 255.0;
    cfg.epsilon_high = u8(r) & 1 ? -1.0 : (u8(r) / 64.0);
    cfg.delta = u8(r) & 1 ? 0.0 : 1.0 + 2.0 * (u8(r) / 255.0);
    cfg.beta = u8(r) & 1 ? 0.0 : u8(r) / 255.0;
    cfg.max_completion_length = u8(r) % 12;
    cfg.num_items_in_batch = u8(r) & 1 ? -1.0 : (double)(1 + u8(r) % 8) * 0.75; /* > 0 */
    cfg.sapo_temperature_pos = 0.5 + 1.5 * (u8(r) / 255.0);
    cfg.sapo_temperature_neg = 0.5 + 1.5 * (u8(r) / 255.0);
    cfg.use_bias_correction_kl = u8(r) & 1;
    cfg.entropy_coef = u8(r) & 1 ? 0.0 : (u8(r) / 127.5 - 1.0);
    if (cfg.beta != 0 && !have_ref && u8(r) % 4 != 0)
        cfg.beta = 0; /* mostly valid: beta != 0 needs ref_logp */
    const unsigned cfg_bad = u8(r);
    int cfg_extreme = 0; /* a finite but huge / tiny value: results may overflow */
    if (cfg_bad % 8 == 0) { /* one hostile config value */
        tame = 0;
        const unsigned which = u8(r) % 14;
        const double bad = BAD_F64[u8(r) % (sizeof BAD_F64 / sizeof BAD_F64[0])];
        cfg_extreme = isfinite(bad) && bad != 0.0 && (fabs(bad) > 1e6 || fabs(bad) < 1e-6);
        switch (which) {
        case 0: cfg.loss_type = (fg_loss_type)(int)bad_value(r, cfg.loss_type); break;
        case 1: cfg.importance_sampling_level = (fg_is_level)(int)bad_value(r, 1); break;
        case 2: cfg.temperature = bad; break;
        case 3: cfg.epsilon_low = bad; break;
        case 4: cfg.epsilon_high = bad; break;
        case 5: cfg.delta = bad; break;
        case 6: cfg.beta = bad; break;
        case 7: cfg.max_completion_length = bad_value(r, cfg.max_completion_length); break;
        case 8: cfg.num_items_in_batch = bad; break;
        case 9: cfg.sapo_temperature_pos = bad; break;
        case 10: cfg.sapo_temperature_neg = bad; break;
        case 11: cfg.entropy_coef = bad; break;
        case 12: cfg.temperature = 1e-3; cfg_extreme = 1; break; /* valid but extreme: */
        case 13: cfg.temperature = 1e3; cfg_extreme = 1; break;  /* the k3 KL may overflow */
        }
    }

    /* ---- sharding */
    int64_t vocab_start = 0, vocab_total = 0;
    if (comm_mode >= 2 && path != 2) {
        if (comm_mode == 3)
            tame = 0;
        vocab_total = V + u8(r) % 8;
        vocab_start = u8(r) % (vocab_total - V + 1);
        g_comm.fail_at = comm_mode == 3 ? (int)(u8(r) % 6) : -1;
    } else {
        g_comm.fail_at = -1;
    }
    g_comm.calls = 0;
    g_comm.failed = 0;

    /* ---- views (before corruption) */
    const unsigned pads = u8(r);
    fg_matrix mats[V_MATS];
    mats[V_HID] = (fg_matrix){NULL, in_t, N, H, H + (pads & 3)};
    mats[V_WT] = (fg_matrix){NULL, in_t, V, H, H + ((pads >> 2) & 3)};
    mats[V_LOG] = (fg_matrix){NULL, in_t, N, V, V + ((pads >> 4) & 3)};
    mats[V_GH] = (fg_matrix){NULL, FG_DTYPE_F32, N, H, H + ((pads >> 6) & 1)};
    mats[V_GW] = (fg_matrix){NULL, FG_DTYPE_F32, V, H, H + ((pads >> 7) & 1)};
    mats[V_GL] = (fg_matrix){NULL, gl_t, N, V, V + (u8(r) & 3)};
    fg_vector bias = {NULL, in_t, V}, gb = {NULL, FG_DTYPE_F32, V};
    int corrupt_ids = 0;

    const unsigned nc_byte = u8(r) % 16, ncorrupt = nc_byte < 11 ? 0 : nc_byte - 10;
    for (unsigned k = 0; k < ncorrupt && k < 4; k++) {
        tame = 0;
        const unsigned what = u8(r) % 24;
        if (what < 18) {
            fg_matrix *m = &mats[what / 3];
            int64_t *f = what % 3 == 0 ? &m->rows : what % 3 == 1 ? &m->cols : &m->ld;
            *f = bad_value(r, *f);
        } else if (what == 18) {
            bias.len = bad_value(r, bias.len);
        } else if (what == 19) {
            gb.len = bad_value(r, gb.len);
        } else if (what == 20) {
            const unsigned t = u8(r);
            fg_dtype d = (fg_dtype)(t % 3 == 2 ? 7 : t % 3);
            if ((t >> 2) % 4 == 0) mats[V_WT].dtype = d;
            else if ((t >> 2) % 4 == 1) bias.dtype = d;
            else if ((t >> 2) % 4 == 2) mats[V_GH].dtype = d;
            else mats[V_GW].dtype = d;
        } else if (what == 21) {
            vocab_start = bad_value(r, vocab_start);
        } else if (what == 22) {
            vocab_total = bad_value(r, vocab_total);
        } else {
            corrupt_ids = 1 + (int)(u8(r) % 4);
        }
    }

    /* ---- allocation, exactly as large as each view says */
    int rc = 0;
    buf bufs[V_MATS];
    memset(bufs, 0, sizeof bufs);
    buf bias_b = {0}, gb_b = {0};
    const int is_lin = path != 2;
    const int use_mat[V_MATS] = {is_lin, is_lin, !is_lin, is_lin && want_gh, is_lin && want_gw,
                                 !is_lin && want_gl && !in_place};
    for (int k = 0; k < V_MATS && rc == 0; k++)
        if (use_mat[k])
            rc = alloc_matrix(&mats[k], &bufs[k], k >= V_GH);
    if (rc == 0 && is_lin && use_bias) {
        int64_t e = (bias.len <= 0 || bias.len > INT64_MAX / 4) ? -1 : bias.len;
        if (e > MAX_ELEMS) rc = -1;
        else {
            bias_b.bytes = e > 0 ? (size_t)e * (bias.dtype == FG_DTYPE_BF16 ? 2 : 4) : 0;
            bias_b.alloc = e > 0 ? bias_b.bytes : 64;
            bias_b.p = malloc(bias_b.alloc);
            bias.data = bias_b.p;
        }
    }
    if (rc == 0 && is_lin && want_gb) {
        int64_t e = (gb.len <= 0 || gb.len > INT64_MAX / 4) ? -1 : gb.len;
        if (e > MAX_ELEMS) rc = -1;
        else {
            gb_b.bytes = e > 0 ? (size_t)e * 4 : 0;
            gb_b.alloc = (e > 0 ? gb_b.bytes : 64) + SLACK;
            gb_b.p = malloc(gb_b.alloc);
            memset(gb_b.p, SENT, gb_b.alloc);
            gb.data = gb_b.p;
        }
    }
    int64_t *tok = malloc((size_t)A * sizeof *tok);
    uint8_t *mask = malloc((size_t)A);
    float *adv = malloc((size_t)(n_ok ? B : 1) * sizeof(float));
    float *old = malloc((size_t)A * sizeof(float)), *ref = malloc((size_t)A * sizeof(float));
    float *isr = malloc((size_t)A * sizeof(float));
    float *o_logp = malloc((size_t)A * sizeof(float) + SLACK);
    float *o_ent = malloc((size_t)A * sizeof(float) + SLACK);
    unsigned char *log_copy = NULL;
    void *workspace = NULL; /* fg_exec.workspace, when the input asks for one */
    fg_oracle_result orc;
    memset(&orc, 0, sizeof orc);
    double *dh = NULL, *dw = NULL, *db = NULL, *dl = NULL;
    int64_t *stok = NULL;
    if (rc != 0 || !tok || !mask || !adv || !old || !ref || !isr || !o_logp || !o_ent)
        goto done;

    /* ---- values */
    /* Global id range, and where this process's vocab rows start. With the
     * identity communicator this process is the only shard, so a token held
     * by "another shard" would get logp = -inf: unmasked ids are drawn inside
     * the local shard, and the result equals the unsharded loss over the
     * local vocabulary with ids shifted by vocab_start (the oracle's input). */
    const int64_t id_range = vocab_total > 0 ? vocab_total : V;
    /* The library's local vocabulary is the weight's row count, which a
     * corruption may have changed. */
    const int64_t V_lib = is_lin && mats[V_WT].rows >= 1 && mats[V_WT].rows <= id_range ? mats[V_WT].rows : V;
    const int shard_ok = vocab_start >= 0 && vocab_start <= id_range - V_lib;
    const int64_t id_lo = shard_ok ? vocab_start : 0;
    const unsigned mask_mode = u8(r);
    for (int64_t n = 0; n < A; n++) {
        mask[n] = mask_mode % 4 == 0 ? 1 : (mask_mode % 4 == 1 ? 0 : bulk_unit(r) < 0.7);
        if (mask[n] && mask_mode % 8 == 7) mask[n] = 0x80; /* any nonzero is "unmasked" */
        tok[n] = id_lo + (int64_t)(bulk_unit(r) * (double)(vocab_total > 0 ? V_lib : V));
        if (!mask[n] && bulk_unit(r) < 0.3)
            tok[n] = bulk_unit(r) < 0.5 ? -5 : INT64_MAX; /* never read */
        old[n] = (float)(-30.0 * bulk_unit(r));
        ref[n] = (float)(-30.0 * bulk_unit(r));
        isr[n] = (float)(4.0 * bulk_unit(r));
        if (!mask[n]) old[n] = ref[n] = isr[n] = NAN; /* never read */
    }
    if (is_mode == 2)
        for (int64_t b = 0; b < (n_ok ? B : 1); b++) isr[b] = (float)(4.0 * bulk_unit(r));
    for (int64_t b = 0; b < (n_ok ? B : 1); b++) adv[b] = (float)(20.0 * bulk_unit(r) - 10.0);
    for (int k = 0; k < corrupt_ids; k++) {
        static const int64_t BAD_ID[] = {-1, INT64_MIN, INT64_MAX};
        int64_t n = (int64_t)(bulk_unit(r) * (double)A);
        unsigned c = u8(r) % 5;
        tok[n] = c < 3 ? BAD_ID[c] : c == 3 ? id_range : (int64_t)((uint64_t)id_range + 1000);
    }
    const unsigned extreme = u8(r);
    const double scale = (!tame && extreme % 4 == 0) ? pow(10.0, (double)(extreme % 40)) : 1.0;
    for (int k = 0; k < V_MATS; k++) {
        if (!use_mat[k] || k >= V_GH || bufs[k].bytes == 0)
            continue;
        fg_matrix *m = &mats[k];
        const double amp = (k == V_LOG ? 16.0 : 1.0) * scale;
        for (int64_t row = 0; row < m->rows; row++)
            for (int64_t c = 0; c < m->ld; c++) {
                int64_t i = row * m->ld + c;
                if ((size_t)i * esize(m->dtype) >= bufs[k].bytes)
                    break;
                store(m->data, m->dtype, i, c < m->cols ? (float)(amp * (2 * bulk_unit(r) - 1)) : NAN);
            }
    }
    if (bias_b.bytes)
        for (int64_t i = 0; i < bias.len; i++)
            store(bias.data, bias.dtype, i, (float)(scale * (2 * bulk_unit(r) - 1)));

    /* ---- NaN / Inf injections */
    const unsigned ninj = u8(r) % 8 < 6 ? 0 : 1 + u8(r) % 3;
    int injected = 0;
    for (unsigned k = 0; k < ninj; k++) {
        const unsigned t = u8(r);
        const float x = t % 3 == 0 ? NAN : t % 3 == 1 ? INFINITY : -INFINITY;
        const unsigned tgt = (t / 3) % IN_COUNT;
        const double u = bulk_unit(r);
        injected = 1;
        tame = 0;
        switch (tgt) {
        case IN_HID: case IN_WT: case IN_LOG: {
            const int vk = tgt == IN_HID ? V_HID : tgt == IN_WT ? V_WT : V_LOG;
            if (use_mat[vk] && bufs[vk].bytes)
                store(mats[vk].data, mats[vk].dtype,
                      (int64_t)(u * (double)(bufs[vk].bytes / esize(mats[vk].dtype))), x);
            break;
        }
        case IN_BIAS:
            if (bias_b.bytes) store(bias.data, bias.dtype, (int64_t)(u * (double)bias.len), x);
            break;
        case IN_ADV: adv[(int64_t)(u * (double)(n_ok ? B : 1))] = x; break;
        case IN_OLD: old[(int64_t)(u * (double)A)] = x; break;
        case IN_REF: ref[(int64_t)(u * (double)A)] = x; break;
        case IN_ISR: isr[(int64_t)(u * (double)A)] = x; break;
        }
    }
    if (!tame && extreme % 4 == 0 && scale > 1.0) injected = 1; /* may overflow to Inf */
    /* Known finding F1 (docs/ROBUSTNESS.md): a positive temperature below
     * 1/FLT_MAX passes validation, 1/temperature overflows float and the call
     * fails late (FG_ERR_NONFINITE_INPUT, outputs written). Remove this line
     * once fg_validate_config refuses such temperatures. */
    if (cfg.temperature < 1e-30)
        injected = 1;
    if (tame && cfg.beta != 0 && !have_ref)
        tame = 0;
    if (tame && round_logits && path == 0)
        tame = 0; /* refused: a materialized-only option */
    if (tame && !n_ok)
        tame = 0;
    if (tame && round_logits && in_t == FG_DTYPE_BF16 && path == 1)
        tame = 0; /* logits rounded to bf16 on purpose: not the oracle's function */

    /* The oracle's d loss/d logp is a central finite difference: at a kink of
     * the clipped objective (ratio exactly on a clip bound or on delta, e.g.
     * on-policy ratio 1 with epsilon 0 or delta 1) it gives the mean of the
     * one-sided slopes, while the library follows torch (clamp passes the
     * gradient on the closed interval, min splits ties). Keep tame inputs off
     * the kinks that on-policy ratios sit on. */
    if (tame) {
        if (cfg.epsilon_low == 0) cfg.epsilon_low = 1.0 / 256;
        if (cfg.epsilon_high == 0) cfg.epsilon_high = 1.0 / 64;
        if (cfg.delta == 1.0) cfg.delta = 1.0 + 1.0 / 128;
    }

    /* ---- the call */
    fg_batch batch = {B, T, tok, mask, adv, have_old ? old : NULL, have_ref ? ref : NULL,
                      is_mode ? isr : NULL, is_mode == 2, NULL};
    any_outputs out;
    memset(&out.loss, SENT, sizeof out.loss);
    memset(&out.metrics, SENT, sizeof out.metrics);
    out.logp = want_logp ? o_logp : NULL;
    out.entropy = want_ent ? o_ent : NULL;
    memset(o_logp, SENT, (size_t)A * sizeof(float) + SLACK);
    memset(o_ent, SENT, (size_t)A * sizeof(float) + SLACK);
    memset(&out.grad_hidden, 0, sizeof out.grad_hidden);
    memset(&out.grad_weight, 0, sizeof out.grad_weight);
    memset(&out.grad_bias, 0, sizeof out.grad_bias);
    memset(&out.grad_logits, 0, sizeof out.grad_logits);
    if (use_mat[V_GH]) out.grad_hidden = mats[V_GH];
    if (use_mat[V_GW]) out.grad_weight = mats[V_GW];
    if (is_lin && want_gb) out.grad_bias = gb;
    const int aliased = !is_lin && want_gl && in_place;
    if (use_mat[V_GL]) out.grad_logits = mats[V_GL];
    if (aliased) out.grad_logits = mats[V_LOG];
    /* The caller workspace (fg_exec.workspace). This byte once chose a
     * misuse the output types now forbid (one entry point's gradients given
     * to the other); it is read at the same place so the corpus decodes as
     * before. 1: misaligned; 2: exactly what the planner says (linear) or
     * 1 MiB (logits); 3: one page. */
    const unsigned ws_mode = u8(r) % 16;
    if (ws_mode == 1 || ws_mode == 3)
        tame = 0;
    if (!is_lin && use_mat[V_LOG] && bufs[V_LOG].bytes) {
        log_copy = malloc(bufs[V_LOG].bytes);
        if (!log_copy) goto done;
        memcpy(log_copy, bufs[V_LOG].p, bufs[V_LOG].bytes);
    }

    fg_exec exec;
    fg_exec_init(&exec);
    exec.threads = threads;
    exec.memory_budget = BUDGETS[budget_k];
    if (tame && budget_k == 1)
        tame = 0; /* a 1-byte budget is refused for the fused path */

    fg_status st;
    fg_linear_inputs in;
    in.hidden = mats[V_HID];
    in.weight = mats[V_WT];
    in.bias = use_bias ? bias : (fg_vector){NULL, in_t, 0};
    in.vocab_start = vocab_start;
    in.vocab_total = vocab_total;
    /* Gradient filtering (fused): off, auto, or a threshold in (0, 1]. Its
     * gradients are approximate, so the oracle's comparison is off with it. */
    const unsigned filter_k = u8(r) % 4;
    const double filter_eps = path != 0 || filter_k < 2 ? 0.0
                              : filter_k == 2            ? FG_FILTER_EPS_AUTO
                                                         : ldexp(1.0, -(int)(u8(r) % 24));
    if (filter_eps != 0)
        tame = 0;
    const fg_linear_options lo = {path == 0 ? FG_IMPL_FUSED : FG_IMPL_MATERIALIZED, round_logits,
                                  filter_eps};
    /* The reference backend runs unsharded LM-head calls without filtering
     * and without a communicator (the rest is the CPU's only, for now). */
    const int sharded = vocab_total > 0 || vocab_start != 0;
    const int use_ref = ref_pick && is_lin && !sharded && filter_eps == 0;
    fg_context *ctx = use_ref ? get_ref_ctx() : get_ctx(sharded ? 1 : 0);
    fg_context_set_check_finite(ctx, check_finite);
    fg_linear_outputs lin_out = {out.loss,        out.metrics,     out.logp,     out.entropy,
                                 out.grad_hidden, out.grad_weight, out.grad_bias, 0};
    fg_logits_outputs log_out = {out.loss, out.metrics, out.logp, out.entropy, out.grad_logits};
    if (ws_mode == 1) {
        workspace = malloc(4096 + 128);
        if (!workspace) goto done;
        exec.workspace = (unsigned char *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63) + 8;
        exec.workspace_bytes = 4096;
    } else if (ws_mode == 3 || (ws_mode == 2 && !is_lin)) {
        const size_t bytes = ws_mode == 3 ? 4096 : (size_t)1 << 20;
        workspace = aligned_alloc(64, bytes);
        if (!workspace) goto done;
        exec.workspace = workspace;
        exec.workspace_bytes = bytes;
    } else if (ws_mode == 2) {
        /* The planner's working_bytes for this call and exec. A sharded call
         * plans without agreeing with the other shards (no collective), and
         * the identity communicator agrees on the same chunks. A refused plan
         * leaves the call on the context's arena. */
        fg_linear_plan_info plan;
        if (fg_linear_grpo_plan(ctx, &lo, &cfg, &in, &batch, &lin_out, &exec, &plan) == FG_OK &&
            plan.working_bytes > 0) {
            workspace = aligned_alloc(64, (plan.working_bytes + 63) & ~(size_t)63);
            if (!workspace) goto done;
            exec.workspace = workspace;
            exec.workspace_bytes = plan.working_bytes;
        }
        if (g_comm.calls != 0)
            die("the plan query called the communicator", NULL);
    }
    if (is_lin) {
        st = fg_linear_grpo(ctx, &lo, &cfg, &in, &batch, &lin_out, &exec);
        out.loss = lin_out.loss;
        out.metrics = lin_out.metrics;
    } else {
        st = fg_logits_grpo(ctx, &cfg, &mats[V_LOG], &batch, &log_out, &exec);
        out.loss = log_out.loss;
        out.metrics = log_out.metrics;
    }

    /* ---- properties */
    char detail[700];
    snprintf(detail, sizeof detail, "path %d%s status %s: %s", path,
             use_ref ? " (reference backend)" : "", fg_status_name(st), fg_last_error(ctx));
    if (getenv("FUZZ_API_VERBOSE"))
        fprintf(stderr,
                "fuzz_api: %s B=%lld T=%lld H=%lld V=%lld tame=%d dtype %d temp %g check %d "
                "round %d bias %d ld h/w/l %lld/%lld/%lld scale %g budget %zu threads %d "
                "f0 %02x f1 %02x f2 %02x ncorrupt %u ninj %u mask_mode %u\n",
                detail, (long long)B, (long long)T, (long long)H, (long long)V, tame, (int)in_t,
                cfg.temperature, check_finite, round_logits, use_bias, (long long)mats[V_HID].ld,
                (long long)mats[V_WT].ld, (long long)mats[V_LOG].ld, scale, BUDGETS[budget_k],
                threads, f0, f1, f2, ncorrupt, ninj, mask_mode);
    if (getenv("FUZZ_API_VERBOSE")) {
        fprintf(stderr,
                "  cfg: type %d level %d temp %.17g eps %.17g/%.17g delta %.17g beta %.17g "
                "maxlen %lld items %.17g sapo %.17g/%.17g biascorr %d ent %.17g; old %d ref %d "
                "is %d vocab %lld/%lld\n",
                (int)cfg.loss_type, (int)cfg.importance_sampling_level, cfg.temperature,
                cfg.epsilon_low, cfg.epsilon_high, cfg.delta, cfg.beta,
                (long long)cfg.max_completion_length, cfg.num_items_in_batch,
                cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, cfg.use_bias_correction_kl,
                cfg.entropy_coef, have_old, have_ref, is_mode, (long long)vocab_start,
                (long long)vocab_total);
        for (int64_t n = 0; n < A; n++)
            fprintf(stderr, "  n %lld mask %d tok %lld old %g ref %g isr %g adv %g\n", (long long)n,
                    mask[n], (long long)tok[n], old[n], ref[n], isr[n],
                    n_ok && n < B ? adv[n] : 0.0f);
    }
    if ((int)st < 0 || st >= FG_STATUS_COUNT)
        die("status out of range", detail);
    if (st != FG_OK) {
        if (fg_last_error(ctx)[0] == '\0')
            die("empty fg_last_error after a failure", detail);
        const int late_ok = (st == FG_ERR_NONFINITE_INPUT &&
                             strstr(fg_last_error(ctx), "results are invalid")) ||
                            (st == FG_ERR_COMMUNICATOR && g_comm.failed);
        if (late_ok) {
            if (!injected && !g_comm.failed && check_finite)
                die("late non-finite failure without a non-finite input", detail);
        } else {
            int ok = all_bytes(&out.loss, sizeof out.loss, SENT) &&
                     all_bytes(&out.metrics, sizeof out.metrics, SENT) &&
                     all_bytes(o_logp, (size_t)A * sizeof(float) + SLACK, SENT) &&
                     all_bytes(o_ent, (size_t)A * sizeof(float) + SLACK, SENT);
            /* The one documented exception (fusedgrpo.h "Conventions"): a
             * fused loss call that overwrites its gradients and finds an
             * overflow in a later chunk may leave grad_hidden and grad_weight
             * partly written. Everything else stays untouched. */
            const int partial_ok = st == FG_ERR_OVERFLOW && path == 0;
            for (int k = V_GH; k < V_MATS; k++)
                if (bufs[k].p && !(partial_ok && (k == V_GH || k == V_GW)))
                    ok = ok && all_bytes(bufs[k].p, bufs[k].alloc, SENT);
            if (gb_b.p) ok = ok && all_bytes(gb_b.p, gb_b.alloc, SENT);
            if (log_copy) ok = ok && memcmp(log_copy, bufs[V_LOG].p, bufs[V_LOG].bytes) == 0;
            if (!ok)
                die("an output was written by a failing call", detail);
        }
        if (tame && st != FG_ERR_BUDGET_TOO_SMALL)
            die("a tame input was refused", detail);
        goto done;
    }

    /* FG_OK */
    if (fg_last_error(ctx)[0] != '\0')
        die("fg_last_error not empty after success", detail);
    if (!n_ok)
        die("an invalid B or T was accepted", detail);
    if (!all_bytes((unsigned char *)o_logp + (size_t)A * sizeof(float), SLACK, SENT) ||
        !all_bytes((unsigned char *)o_ent + (size_t)A * sizeof(float), SLACK, SENT))
        die("logp/entropy written beyond [B*T]", detail);
    for (int k = V_GH; k < V_MATS; k++)
        if (bufs[k].p && !padding_untouched(&mats[k], &bufs[k]))
            die("an output's row padding or slack was written", detail);
    if (gb_b.p && !all_bytes(gb_b.p + gb_b.bytes, SLACK, SENT))
        die("grad_bias written beyond V", detail);
    for (int64_t n = 0; n < N; n++) {
        if (mask[n]) continue;
        if ((want_logp && o_logp[n] != 0.0f) || (want_ent && o_ent[n] != 0.0f))
            die("masked logp/entropy not 0", detail);
        const fg_matrix *g = is_lin ? (use_mat[V_GH] ? &out.grad_hidden : NULL)
                                    : (out.grad_logits.data ? &out.grad_logits : NULL);
        if (g)
            for (int64_t c = 0; c < g->cols; c++)
                if (load(g->data, g->dtype, n * g->ld + c) != 0.0f)
                    die("masked gradient row not 0", detail);
    }
    /* No non-finite input, no huge value: a success must be finite. */
    if (!injected && !cfg_extreme) {
        const char *bad = NULL;
        if (!isfinite(out.loss)) bad = "loss";
        else if (!isfinite(out.metrics.kl) || !isfinite(out.metrics.entropy)) bad = "metrics";
        for (int64_t n = 0; n < N && !bad; n++)
            if ((want_logp && !isfinite(o_logp[n])) || (want_ent && !isfinite(o_ent[n])))
                bad = "logp/entropy";
        for (int k = V_GH; k < V_MATS && !bad; k++) {
            const fg_matrix *g = k == V_GH ? &out.grad_hidden : k == V_GW ? &out.grad_weight
                                                                           : &out.grad_logits;
            if (!g->data || (k == V_GL && is_lin)) continue;
            for (int64_t row = 0; row < g->rows; row++)
                for (int64_t c = 0; c < g->cols; c++)
                    if (!isfinite(load(g->data, g->dtype, row * g->ld + c)))
                        bad = k == V_GH ? "grad_hidden" : k == V_GW ? "grad_weight" : "grad_logits";
        }
        if (out.grad_bias.data && !bad)
            for (int64_t v = 0; v < out.grad_bias.len; v++)
                if (!isfinite(((const float *)out.grad_bias.data)[v]))
                    bad = "grad_bias";
        if (bad) {
            char d2[1000];
            snprintf(d2, sizeof d2, "%s; %s non-finite; loss %g type %d level %d temp %g eps %g/%g "
                     "delta %g beta %g ent_coef %g sapo %g/%g old %d ref %d is %d",
                     detail, bad, out.loss, (int)cfg.loss_type, (int)cfg.importance_sampling_level,
                     cfg.temperature, cfg.epsilon_low, cfg.epsilon_high, cfg.delta, cfg.beta,
                     cfg.entropy_coef, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg,
                     have_old, have_ref, is_mode);
            die("FG_OK with a non-finite result from finite, bounded inputs", d2);
        }
    }
    if (!tame)
        goto done;

    /* ---- tame: finite, and equal to the oracle */
    if (!isfinite(out.loss))
        die("tame input: loss not finite", detail);
    {
        dl = malloc((size_t)N * (size_t)(is_lin ? H : V) * sizeof(double));
        if (!dl) goto done;
        int orc_rc;
        if (is_lin) {
            dh = dl;
            dw = malloc((size_t)V * (size_t)H * sizeof(double));
            db = use_bias ? malloc((size_t)V * sizeof(double)) : NULL;
            if (!dw || (use_bias && !db)) goto done;
            const fg_matrix *h = &mats[V_HID], *w = &mats[V_WT];
            for (int64_t n = 0; n < N; n++)
                for (int64_t c = 0; c < H; c++) dh[n * H + c] = load(h->data, h->dtype, n * h->ld + c);
            for (int64_t v = 0; v < V; v++)
                for (int64_t c = 0; c < H; c++) dw[v * H + c] = load(w->data, w->dtype, v * w->ld + c);
            if (db)
                for (int64_t v = 0; v < V; v++) db[v] = load(bias.data, bias.dtype, v);
            fg_batch ob = batch; /* ids relative to the local shard */
            if (id_lo) {
                stok = malloc((size_t)A * sizeof *stok);
                if (!stok) goto done;
                for (int64_t n = 0; n < A; n++) stok[n] = mask[n] ? tok[n] - id_lo : 0;
                ob.token_ids = stok;
            }
            orc_rc = fg_oracle_linear(&cfg, &ob, dh, dw, db, H, V, &orc);
        } else {
            const fg_matrix *l = &mats[V_LOG];
            for (int64_t n = 0; n < N; n++)
                for (int64_t c = 0; c < V; c++)
                    dl[n * V + c] = load(log_copy, l->dtype, n * l->ld + c);
            orc_rc = fg_oracle_logits(&cfg, &batch, dl, V, &orc);
        }
        if (orc_rc != 0)
            die("the oracle refused a tame input the library accepted", detail);
        const double ls = fg_oracle_loss_scale(&cfg, &batch, orc.logp, orc.entropy);
        /* Loss: relative to its own scale, plus the first-order effect of
         * float-level log-prob errors (2e-5 * max(1, |logp|) per token, the
         * logp tolerance below) through d loss / d logp: with V = 1 the
         * oracle's logp is exactly 0 while the library's is ~1e-7, and a
         * capped ratio times |A| = 10 turns that into ~1e-5 of loss. */
        double dl_floor = 0;
        for (int64_t n = 0; n < N; n++)
            if (mask[n])
                dl_floor += fabs(orc.dlogp[n]) * 2e-5 * fmax(1.0, fabs(orc.logp[n]));
        if (fabs(out.loss - orc.loss) > dl_floor)
            cmp_scalar("loss", out.loss, orc.loss, fmax(fabs(orc.loss), fmax(ls, 1e-2)), 2e-4, 0);
        for (int64_t n = 0; n < N; n++) {
            if (!mask[n]) continue;
            if (want_logp) cmp_scalar("logp", o_logp[n], orc.logp[n], fmax(fabs(orc.logp[n]), 1.0), 2e-5, 1);
            if (want_ent) cmp_scalar("entropy", o_ent[n], orc.entropy[n], fmax(fabs(orc.entropy[n]), 1.0), 2e-5, 2);
        }
        /* Gradient floor: a gradient that is ~0 against the loss's own scale. */
        /* Gradient floor: ~0 against the loss's own scale, or against the
         * total |d loss / d logp| + |d loss / d entropy| (over temperature)
         * that every gradient element is a sum of parts of (a V = 1 row has
         * an exactly zero gradient in double and ~1e-7 relative noise in
         * float). */
        double G = 0;
        for (int64_t n = 0; n < N; n++)
            if (mask[n]) G += (fabs(orc.dlogp[n]) + fabs(orc.dentropy[n])) / cfg.temperature;
        const double gf = fmax(fmax(1e-3 * ls, 1e-4), 1e-3 * G);
        const double gtol = in_t == FG_DTYPE_BF16 ? 1e-2 : 2e-3; /* bf16 dlogits on bf16 CPUs */
        if (is_lin) {
            /* bf16: the floor also admits twice the bf16-dlogits rounding bound. */
            double gf_h = gf, gf_w = gf, gf_b = gf;
            if (in_t == FG_DTYPE_BF16) {
                gf_h = fmax(gf, 0x1p-8 * bf16_term_sum(0, orc.grad_logits, dh, dw, N, V, H) / gtol);
                gf_w = fmax(gf, 0x1p-8 * bf16_term_sum(1, orc.grad_logits, dh, dw, N, V, H) / gtol);
                gf_b = fmax(gf, 0x1p-8 * bf16_term_sum(2, orc.grad_logits, dh, dw, N, V, H) / gtol);
            }
            if (use_mat[V_GH]) cmp_matrix("grad_hidden", out.grad_hidden.data, FG_DTYPE_F32, N, H, out.grad_hidden.ld, orc.grad_hidden, gf_h, gtol, 3);
            if (use_mat[V_GW]) cmp_matrix("grad_weight", out.grad_weight.data, FG_DTYPE_F32, V, H, out.grad_weight.ld, orc.grad_weight, gf_w, gtol, 4);
            if (want_gb) { /* Σ over tokens of d loss/d logits, with or without a bias */
                double *zb = calloc((size_t)V, sizeof(double));
                if (!zb) goto done;
                for (int64_t n = 0; n < N; n++)
                    for (int64_t v = 0; v < V; v++) zb[v] += orc.grad_logits[n * V + v];
                cmp_matrix("grad_bias", out.grad_bias.data, FG_DTYPE_F32, 1, V, V, zb, gf_b, gtol, 5);
                free(zb);
            }
        } else if (out.grad_logits.data) {
            const double tol = out.grad_logits.dtype == FG_DTYPE_BF16 ? 1e-2 : gtol;
            cmp_matrix("grad_logits", out.grad_logits.data, out.grad_logits.dtype, N, V, out.grad_logits.ld, orc.grad_logits, gf, tol, 6);
        }
    }

done:
    fg_oracle_result_free(&orc);
    free(stok);
    free(dl);
    free(dw);
    free(db);
    free(log_copy);
    free(workspace);
    for (int k = 0; k < V_MATS; k++) free(bufs[k].p);
    free(bias_b.p);
    free(gb_b.p);
    free(tok);
    free(mask);
    free(adv);
    free(old);
    free(ref);
    free(isr);
    free(o_logp);
    free(o_ent);
    return 0;
}
