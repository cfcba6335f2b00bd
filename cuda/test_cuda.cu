/* Tests of the CUDA row kernels and the cuBLASLt products.
 *
 * The argument checks run everywhere (they touch no device), the filter's
 * (chunk_ops.h) and the sparse products' (sparse_products.h) among them,
 * with the sparse products' slot count. Without a CUDA
 * device the program then prints "skipped: <reason>" and exits 77. With one:
 * odd sizes, float32 and bfloat16, random data:
 *   - the fast row kernels against the plain reference kernels and both
 *     against a float64 host computation of the same formulas (row_stats.h);
 *     the bias column sums with the bits of a host float32 sum of the stored
 *     dx, rows in order; a vocab shard's own statistics (row_stats_shard)
 *     by row and by index against the forward's and float64;
 *   - the three products against float64 host products;
 *   - a bad token id refused with a status, a NaN/Inf row giving non-finite
 *     statistics (the caller's to check), no device fault.
 * Each check prints its worst error as a fraction of its tolerance.
 *
 * Tolerances, per row, with zscale = 1 + max_v |z_v| and
 * dscale = inv_temp·(|g| + |e|·(1 + |entropy|)) (the size of a row of dx):
 *   stats vs float64:        1e-5 · zscale  (z = x·inv_temp is rounded to
 *                            float, an error of 2^-24·|z| that u = z − zmax keeps)
 *   dx vs float64:           2e-5 · zscale · dscale, plus 2^-8·|dx| when dx is
 *                            bfloat16 (its rounding, half a unit in the last place)
 *   fast vs reference:       4e-6 · zscale for stats (the reference sums in
 *                            double), 1e-6 · dscale for dx, plus 2^-7·|dx| for
 *                            bfloat16 (one unit in the last place)
 *   bias sums vs float64 sum of the stored dx: the bound of recursive float
 *                            summation, (M + 1)·2^-24·(|bias₀| + Σ_r |dx[r, v]|);
 *                            vs a host float32 sum of the stored dx, rows in
 *                            order: the same bits
 *   shard stats: max and z_tok the same bits as the forward's zmax and the
 *                            host's float x·inv_temp; sum and dot vs float64
 *                            1e-5 · zscale · (sum + |dot|)
 *   products:                1e-5 · Σ_k |a_k b_k| (+ 2^-8·|c| for bfloat16 out);
 *                            TF32 (10 mantissa bits) would fail it. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "chunk_ops.h"
#include "sparse_products.h"
#include "gemm_cublaslt.h"
#include "row_stats.h"

static int checks_run, checks_failed;

#include "cuda_ok.h"

/* ---- host helpers ------------------------------------------------------------- */

static uint64_t rng_state;
static double uniform(void) /* [0, 1), splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
}

static float bf16_to_float(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint16_t float_to_bf16(float f) /* round to nearest even, NaN stays NaN */
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static size_t dtype_size(fg_dtype t) { return t == FG_DTYPE_BF16 ? 2 : 4; }
static const char *dtype_name(fg_dtype t) { return t == FG_DTYPE_BF16 ? "bf16" : "f32"; }

/* A matrix in a storage dtype, host and device copies. */
struct Matrix {
    fg_dtype type;
    int64_t rows, cols, ld;
    std::vector<unsigned char> host;
    void *dev;
};

static Matrix matrix_make(fg_dtype type, int64_t rows, int64_t cols, int64_t ld)
{
    Matrix m;
    m.type = type;
    m.rows = rows;
    m.cols = cols;
    m.ld = ld;
    m.host.assign((size_t)(rows * ld) * dtype_size(type), 0xff); /* padding: NaN in both dtypes */
    CUDA_OK(cudaMalloc(&m.dev, m.host.size()));
    return m;
}

static float mat_get(const Matrix &m, int64_t r, int64_t c)
{
    const size_t i = (size_t)(r * m.ld + c);
    if (m.type == FG_DTYPE_BF16) {
        uint16_t h;
        memcpy(&h, &m.host[2 * i], 2);
        return bf16_to_float(h);
    }
    float f;
    memcpy(&f, &m.host[4 * i], 4);
    return f;
}

static void mat_set(Matrix &m, int64_t r, int64_t c, float v)
{
    const size_t i = (size_t)(r * m.ld + c);
    if (m.type == FG_DTYPE_BF16) {
        const uint16_t h = float_to_bf16(v);
        memcpy(&m.host[2 * i], &h, 2);
    } else {
        memcpy(&m.host[4 * i], &v, 4);
    }
}

static void to_device(Matrix &m)
{
    CUDA_OK(cudaMemcpy(m.dev, m.host.data(), m.host.size(), cudaMemcpyHostToDevice));
}
static void to_host(Matrix &m)
{
    CUDA_OK(cudaMemcpy(m.host.data(), m.dev, m.host.size(), cudaMemcpyDeviceToHost));
}

template <typename T> static T *device_copy(const std::vector<T> &v)
{
    T *d;
    CUDA_OK(cudaMalloc(&d, v.size() * sizeof(T)));
    CUDA_OK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

template <typename T> static std::vector<T> host_copy(const T *d, size_t n)
{
    std::vector<T> v(n);
    CUDA_OK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

/* One check: the worst |got − want| / tol over n values (NaN counts as ∞). */
static void check_close(const char *what, size_t n, const std::vector<double> &got,
                        const std::vector<double> &want, const std::vector<double> &tol)
{
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double ratio = fabs(got[i] - want[i]) / tol[i];
        if (isnan(ratio))
            ratio = INFINITY;
        if (ratio > worst) {
            worst = ratio;
            at = i;
        }
    }
    const bool bad = worst > 1;
    checks_run++;
    checks_failed += bad;
    printf("%s %-58s worst err %.3g = %.3f of tol (at %zu: got %.9g want %.9g)\n",
           bad ? "FAIL" : "ok  ", what, fabs(got[at] - want[at]), worst, at, got[at], want[at]);
}

static void check_status(const char *what, fg_status got, fg_status want, const char *msg)
{
    checks_run++;
    const bool bad = got != want;
    checks_failed += bad;
    printf("%s %-58s status %d (want %d): %s\n", bad ? "FAIL" : "ok  ", what, (int)got,
           (int)want, got == FG_OK ? "" : msg);
}

static void check_true(const char *what, bool ok)
{
    checks_run++;
    checks_failed += !ok;
    printf("%s %s\n", ok ? "ok  " : "FAIL", what);
}

/* ---- argument checks: no device needed ---------------------------------------- */

static void test_argument_checks(void)
{
    char msg[256];
    int64_t tok = 0;
    float f = 0;
    fg_cuda_row_stats st = {&f, &f, &f, &f};
    fg_cuda_row_check *check = (fg_cuda_row_check *)&tok;
    check_status("row stats: NULL x", fg_cuda_row_stats_forward(NULL, FG_DTYPE_F32, 1, 1, 1, 1.0f,
                                                               &tok, st, check, 0, msg, sizeof msg),
                 FG_ERR_NULL_ARGUMENT, msg);
    check_status("row stats: V = 0", fg_cuda_row_stats_forward(&f, FG_DTYPE_F32, 1, 0, 1, 1.0f,
                                                              &tok, st, check, 0, msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("row stats: ld < V", fg_cuda_row_stats_forward(&f, FG_DTYPE_F32, 1, 4, 3, 1.0f,
                                                               &tok, st, check, 0, msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("row stats: 1/temperature = 0",
                 fg_cuda_row_stats_forward_ref(&f, FG_DTYPE_F32, 1, 1, 1, 0.0f, &tok, st, check, 0,
                                               msg, sizeof msg),
                 FG_ERR_BAD_TEMPERATURE, msg);
    fg_cuda_shard_slots slots = {&f, &f, &f, &f, &f, NULL, 1};
    check_status("shard stats: fewer slots than rows",
                 fg_cuda_row_stats_shard(&f, FG_DTYPE_F32, 2, 1, 1, 1.0f, &tok, slots, 0, msg,
                                         sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    slots.own_dot = NULL;
    check_status("shard stats: an output missing",
                 fg_cuda_row_stats_shard(&f, FG_DTYPE_F32, 1, 1, 1, 1.0f, &tok, slots, 0, msg,
                                         sizeof msg),
                 FG_ERR_NULL_ARGUMENT, msg);
    check_status("row backward: M over the launch limit",
                 fg_cuda_row_backward(&f, FG_DTYPE_F32, 1, &f, FG_DTYPE_F32, 1,
                                      FG_CUDA_ROW_LIMIT + 1, 1, 1.0f, &tok, st, &f, &f, &f, 0,
                                      msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("row backward: ld_dx < V",
                 fg_cuda_row_backward_ref(&f, FG_DTYPE_F32, 2, &f, FG_DTYPE_F32, 1, 1, 2, 1.0f,
                                          &tok, st, &f, &f, NULL, 0, msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    fg_cuda_gemm g = {(cublasLtHandle_t)&f, 0, NULL, 0};
    check_status("GEMM 1: ld_h < H", fg_cuda_gemm_logits(&g, FG_DTYPE_BF16, 2, 3, 4, &f, 3, &f, 4,
                                                        &f, FG_DTYPE_F32, 3, msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("GEMM 2: M = 0", fg_cuda_gemm_grad_hidden(&g, FG_DTYPE_BF16, 0, 3, 4, &f, 3, &f,
                                                          4, &f, FG_DTYPE_F32, 4, 0.0f, msg,
                                                          sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("GEMM 3: NULL output",
                 fg_cuda_gemm_grad_weight(&g, FG_DTYPE_BF16, 2, 3, 4, &f, 3, &f, 4, NULL,
                                          FG_DTYPE_F32, 4, 1.0f, msg, sizeof msg),
                 FG_ERR_NULL_ARGUMENT, msg);
    check_status("GEMM 1: f32 operands, bf16 output",
                 fg_cuda_gemm_logits(&g, FG_DTYPE_F32, 2, 3, 4, &f, 4, &f, 4, &f, FG_DTYPE_BF16, 3,
                                     msg, sizeof msg),
                 FG_ERR_UNSUPPORTED, msg);
    g.workspace_bytes = 1024;
    check_status("GEMM 3: workspace bytes without workspace",
                 fg_cuda_gemm_grad_weight(&g, FG_DTYPE_BF16, 2, 3, 4, &f, 3, &f, 4, &f,
                                          FG_DTYPE_F32, 4, 1.0f, msg, sizeof msg),
                 FG_ERR_NULL_ARGUMENT, msg);
    /* The filter (chunk_ops.h): refused before any launch. Its kernels are
     * checked against the reference backend by test_cuda_api. */
    fg_cuda_filter_row fr;
    int64_t kept = 0;
    check_status("filter: no row scratch",
                 fg_cuda_filter_rows(&f, FG_DTYPE_F32, 1, 1, 1, &tok, 1e-5, 1, NULL, &kept, 0,
                                     msg, sizeof msg),
                 FG_ERR_NULL_ARGUMENT, msg);
    check_status("filter: eps = 0", fg_cuda_filter_rows(&f, FG_DTYPE_F32, 1, 1, 1, &tok, 0.0, 1,
                                                       &fr, &kept, 0, msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("filter: eps = NaN", fg_cuda_filter_rows(&f, FG_DTYPE_F32, 1, 1, 1, &tok, NAN, 1,
                                                         &fr, &kept, 0, msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("filter: ld < V", fg_cuda_filter_rows(&f, FG_DTYPE_BF16, 1, 4, 3, &tok, 1e-5, 1,
                                                      &fr, &kept, 0, msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("filter: no row", fg_cuda_filter_rows(&f, FG_DTYPE_F32, 0, 1, 1, &tok, 1e-5, 1,
                                                      &fr, &kept, 0, msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("filter: unknown dtype",
                 fg_cuda_filter_rows(&f, (fg_dtype)7, 1, 1, 1, &tok, 1e-5, 1, &fr, &kept, 0, msg,
                                     sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);

    /* The sparse products (sparse_products.h): V/256 slots a row (at least
     * 1), at most 2^30; refused before any launch. Their kernels are checked
     * on a GPU by test_cuda_api. */
    check_true("sparse slots: V/256 a row, at least one, at most 2^30",
               fg_cuda_sparse_entries(37, 151936) == 37 * 593 &&
                   fg_cuda_sparse_entries(5, 100) == 5 &&
                   fg_cuda_sparse_entries(int64_t{1} << 30, 1 << 20) == int64_t{1} << 30);
    int32_t flag = 0;
    fg_cuda_sparse sp = {};
    sp.rows = 4;
    sp.V = 8;
    sp.entries = 4;
    sp.flag = &flag;
    check_status("sparse decide: no scratch",
                 fg_cuda_sparse_decide(&fr, 1, 1, NULL, 0, 0, 0, msg, sizeof msg),
                 FG_ERR_NULL_ARGUMENT, msg);
    check_status("sparse decide: more rows than the scratch holds",
                 fg_cuda_sparse_decide(&fr, 5, 1, &sp, 0, 0, 0, msg, sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("sparse compact: ld < V",
                 fg_cuda_sparse_compact(&f, FG_DTYPE_F32, 1, 7, &tok, &fr, &sp, 0, msg,
                                        sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("sparse dhidden: grad_hidden's stride < H",
                 fg_cuda_sparse_dhidden(&sp, 1, &f, FG_DTYPE_BF16, 4, 4, &f, 3, 0, msg,
                                        sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
    check_status("sparse dweight: unknown dtype",
                 fg_cuda_sparse_dweight(&sp, 1, &f, (fg_dtype)7, 4, 4, &f, 4, 1, 0, msg,
                                        sizeof msg),
                 FG_ERR_INVALID_SIZE, msg);
}

/* ---- row kernels ---------------------------------------------------------------- */

/* float64 statistics of one row of z = x · inv_temp. */
struct HostRow {
    double zmax, lsum, entropy, logp, zscale;
};

static HostRow host_row(const Matrix &x, int64_t r, double inv_temp, int64_t tok)
{
    HostRow h = {-INFINITY, 0, 0, 0, 1};
    for (int64_t v = 0; v < x.cols; v++) {
        const double z = mat_get(x, r, v) * inv_temp;
        h.zmax = fmax(h.zmax, z);
        h.zscale = fmax(h.zscale, 1 + fabs(z));
    }
    double sum = 0, dot = 0;
    for (int64_t v = 0; v < x.cols; v++) {
        const double u = mat_get(x, r, v) * inv_temp - h.zmax, p = exp(u);
        sum += p;
        dot += p * u;
    }
    h.lsum = log(sum);
    h.entropy = h.lsum - dot / sum;
    h.logp = mat_get(x, r, tok) * inv_temp - h.zmax - h.lsum;
    return h;
}

static double host_dlogit(double z, int64_t v, const HostRow &h, double g, double e, int64_t tok,
                          double inv_temp)
{
    const double lp = z - h.zmax - h.lsum, p = exp(lp);
    return inv_temp * (g * ((v == tok ? 1.0 : 0.0) - p) - e * p * (lp + h.entropy));
}

struct DevStats {
    float *buf;
    fg_cuda_row_stats st;
};

static DevStats stats_alloc(int64_t M)
{
    DevStats d;
    CUDA_OK(cudaMalloc(&d.buf, 4 * M * sizeof(float)));
    d.st = {d.buf, d.buf + M, d.buf + 2 * M, d.buf + 3 * M};
    return d;
}

static void test_rows(fg_dtype xt, fg_dtype dt, int64_t M, int64_t V, int64_t ld_x, int64_t ld_dx,
                      float temperature, uint64_t seed)
{
    char name[160], what[200], msg[256];
    snprintf(name, sizeof name, "rows x %s dx %s M %lld V %lld ld %lld/%lld", dtype_name(xt),
             dtype_name(dt), (long long)M, (long long)V, (long long)ld_x, (long long)ld_dx);
    printf("-- %s\n", name);
    rng_state = seed;
    const float inv_temp = 1.0f / temperature;

    Matrix x = matrix_make(xt, M, V, ld_x);
    std::vector<int64_t> tokens(M);
    std::vector<float> g(M), e(M);
    for (int64_t r = 0; r < M; r++) {
        /* Every fifth row sits far from 0 (the cancellation that dot relative
         * to the max avoids); row 1 is flat (entropy log V). */
        const double offset = r % 5 == 0 ? 60.0 : 0.0;
        for (int64_t v = 0; v < V; v++) {
            double val = r == 1 ? 0.5 : offset + 6.0 * (uniform() - 0.5);
            if (v % 97 == 3)
                val += 8.0;
            mat_set(x, r, v, (float)val);
        }
        tokens[r] = (int64_t)(uniform() * (double)V);
        g[r] = (float)(2.0 * uniform() - 1.0);
        e[r] = r % 3 == 0 ? 0.0f : (float)(uniform() - 0.5);
    }
    to_device(x);
    int64_t *d_tokens = device_copy(tokens);
    float *d_g = device_copy(g), *d_e = device_copy(e);
    fg_cuda_row_check *check;
    CUDA_OK(cudaMalloc(&check, sizeof *check));
    DevStats fast = stats_alloc(M), ref = stats_alloc(M);

    fg_status s = fg_cuda_row_check_reset(check, 0, msg, sizeof msg);
    if (s == FG_OK)
        s = fg_cuda_row_stats_forward(x.dev, xt, M, V, ld_x, inv_temp, d_tokens, fast.st, check, 0,
                                      msg, sizeof msg);
    if (s == FG_OK)
        s = fg_cuda_row_stats_forward_ref(x.dev, xt, M, V, ld_x, inv_temp, d_tokens, ref.st,
                                          check, 0, msg, sizeof msg);
    if (s == FG_OK)
        s = fg_cuda_row_check_status(check, 0, 0, msg, sizeof msg);
    check_status("forward (fast and reference) and the row check", s, FG_OK, msg);

    Matrix dx = matrix_make(dt, M, V, ld_dx), dx_ref = matrix_make(dt, M, V, ld_dx);
    to_device(dx); /* all NaN: the padding must stay so */
    to_device(dx_ref);
    const std::vector<float> bias0(V, 0.25f);
    float *bias = device_copy(bias0), *bias_ref = device_copy(bias0);
    /* Both backward kernels read the fast forward's statistics, so that
     * their comparison sees the backward alone. */
    s = fg_cuda_row_backward(x.dev, xt, ld_x, dx.dev, dt, ld_dx, M, V, inv_temp, d_tokens, fast.st,
                             d_g, d_e, bias, 0, msg, sizeof msg);
    if (s == FG_OK)
        s = fg_cuda_row_backward_ref(x.dev, xt, ld_x, dx_ref.dev, dt, ld_dx, M, V, inv_temp,
                                     d_tokens, fast.st, d_g, d_e, bias_ref, 0, msg, sizeof msg);
    check_status("backward (fast and reference)", s, FG_OK, msg);
    CUDA_OK(cudaDeviceSynchronize());
    to_host(dx);
    to_host(dx_ref);
    const std::vector<float> hf = host_copy(fast.buf, 4 * M), hr = host_copy(ref.buf, 4 * M);
    const std::vector<float> hb = host_copy(bias, V), hbr = host_copy(bias_ref, V);

    /* Statistics: [zmax, lsum, entropy, logp] × M. */
    std::vector<HostRow> host(M);
    std::vector<double> want(4 * M), got_f(4 * M), got_r(4 * M), tol(4 * M), tol_pair(4 * M);
    for (int64_t r = 0; r < M; r++) {
        host[r] = host_row(x, r, inv_temp, tokens[r]);
        const double w[4] = {host[r].zmax, host[r].lsum, host[r].entropy, host[r].logp};
        for (int q = 0; q < 4; q++) {
            want[q * M + r] = w[q];
            got_f[q * M + r] = hf[q * M + r];
            got_r[q * M + r] = hr[q * M + r];
            tol[q * M + r] = 1e-5 * host[r].zscale;
            tol_pair[q * M + r] = 4e-6 * host[r].zscale;
        }
    }
    snprintf(what, sizeof what, "stats fast vs float64");
    check_close(what, 4 * M, got_f, want, tol);
    snprintf(what, sizeof what, "stats reference vs float64");
    check_close(what, 4 * M, got_r, want, tol);
    snprintf(what, sizeof what, "stats fast vs reference");
    check_close(what, 4 * M, got_f, got_r, tol_pair);

    /* dx over the V columns, then the padding. */
    const double half_ulp = dt == FG_DTYPE_BF16 ? 0x1p-8 : 0.0;
    std::vector<double> dw(M * V), df(M * V), dr(M * V), dtol(M * V), dtol_pair(M * V);
    std::vector<double> col_abs(V, 0.0), col_sum_f(V, 0.25), col_sum_r(V, 0.25);
    for (int64_t r = 0; r < M; r++) {
        const double dscale = inv_temp * (fabs(g[r]) + fabs(e[r]) * (1 + fabs(host[r].entropy)));
        for (int64_t v = 0; v < V; v++) {
            const size_t i = (size_t)(r * V + v);
            dw[i] = host_dlogit(mat_get(x, r, v) * (double)inv_temp, v, host[r], g[r], e[r],
                                tokens[r], inv_temp);
            df[i] = mat_get(dx, r, v);
            dr[i] = mat_get(dx_ref, r, v);
            dtol[i] = 2e-5 * host[r].zscale * dscale + half_ulp * fabs(dw[i]);
            dtol_pair[i] = 1e-6 * dscale + 2 * half_ulp * fabs(dr[i]);
            col_abs[v] += fabs(df[i]);
            col_sum_f[v] += df[i];
            col_sum_r[v] += dr[i];
        }
    }
    check_close("dx fast vs float64", M * V, df, dw, dtol);
    check_close("dx reference vs float64", M * V, dr, dw, dtol);
    check_close("dx fast vs reference", M * V, df, dr, dtol_pair);
    bool padding_kept = true;
    for (int64_t r = 0; r < M; r++)
        for (int64_t v = V; v < ld_dx; v++)
            padding_kept &= !(mat_get(dx, r, v) == mat_get(dx, r, v)); /* still NaN */
    check_true("dx padding columns untouched", padding_kept);

    if (xt == dt && ld_x == ld_dx) { /* in place: dx over x gives the same bits */
        Matrix inplace = matrix_make(xt, M, V, ld_x);
        CUDA_OK(cudaMemcpy(inplace.dev, x.dev, x.host.size(), cudaMemcpyDeviceToDevice));
        s = fg_cuda_row_backward(inplace.dev, xt, ld_x, inplace.dev, dt, ld_dx, M, V, inv_temp,
                                 d_tokens, fast.st, d_g, d_e, NULL, 0, msg, sizeof msg);
        check_status("backward in place", s, FG_OK, msg);
        to_host(inplace);
        bool same = true;
        for (int64_t r = 0; r < M; r++)
            same &= memcmp(&inplace.host[(size_t)(r * ld_x) * dtype_size(dt)],
                           &dx.host[(size_t)(r * ld_dx) * dtype_size(dt)],
                           (size_t)V * dtype_size(dt)) == 0;
        check_true("dx in place equals dx out of place", same);
        CUDA_OK(cudaFree(inplace.dev));
    }

    std::vector<double> bf(V), br(V), btol(V);
    for (int64_t v = 0; v < V; v++) {
        bf[v] = hb[v];
        br[v] = hbr[v];
        btol[v] = (double)(M + 1) * 0x1p-24 * (col_abs[v] + 0.25);
    }
    check_close("bias sums fast vs float64 sum of its dx", V, bf, col_sum_f, btol);
    check_close("bias sums reference vs float64 sum of its dx", V, br, col_sum_r, btol);
    /* The order: bias₀ + dx[0, v] + dx[1, v] + ..., one float add per row. */
    bool in_order = true, in_order_ref = true;
    for (int64_t v = 0; v < V; v++) {
        float sf = 0.25f, sr = 0.25f;
        for (int64_t r = 0; r < M; r++) {
            sf += mat_get(dx, r, v);
            sr += mat_get(dx_ref, r, v);
        }
        in_order &= memcmp(&sf, &hb[v], sizeof sf) == 0;
        in_order_ref &= memcmp(&sr, &hbr[v], sizeof sr) == 0;
    }
    check_true("bias sums fast: the bits of a float32 sum of its dx, rows in order", in_order);
    check_true("bias sums reference: the bits of a float32 sum of its dx, rows in order",
               in_order_ref);

    /* A vocab shard's own statistics: by row, then by index (reversed, two
     * slots more, which stay as they were). */
    for (int by_index = 0; by_index < 2; by_index++) {
        const int64_t count = by_index ? M + 2 : M;
        std::vector<float> fill(5 * count, 777.0f);
        float *out = device_copy(fill);
        std::vector<int64_t> index(M);
        for (int64_t r = 0; r < M; r++)
            index[r] = M - 1 - r;
        int64_t *d_index = device_copy(index);
        const fg_cuda_shard_slots slots = {out, out + count, out + 2 * count, out + 3 * count,
                                           out + 4 * count, by_index ? d_index : NULL, count};
        s = fg_cuda_row_stats_shard(x.dev, xt, M, V, ld_x, inv_temp, d_tokens, slots, 0, msg,
                                    sizeof msg);
        check_status(by_index ? "shard stats by index" : "shard stats by row", s, FG_OK, msg);
        const std::vector<float> o = host_copy(out, 5 * count);
        bool exact = true, kept = true;
        std::vector<double> s_got, s_want, s_tol;
        for (int64_t r = 0; r < M; r++) {
            const int64_t k = by_index ? index[r] : r;
            const float ztok = mat_get(x, r, tokens[r]) * inv_temp;
            exact &= memcmp(&o[k], &hf[r], 4) == 0 && memcmp(&o[2 * count + k], &hf[r], 4) == 0 &&
                     memcmp(&o[count + k], &ztok, 4) == 0;
            double sum = 0, dot = 0;
            for (int64_t v = 0; v < V; v++) {
                const double u = (double)mat_get(x, r, v) * inv_temp - hf[r], e1 = exp(u);
                sum += e1;
                dot += e1 * u;
            }
            s_got.push_back(o[3 * count + k]);
            s_want.push_back(sum);
            s_got.push_back(o[4 * count + k]);
            s_want.push_back(dot);
            const double t = 1e-5 * host[r].zscale * (sum + fabs(dot));
            s_tol.push_back(t);
            s_tol.push_back(t);
        }
        for (int64_t k = M; k < count; k++)
            for (int q = 0; q < 5; q++)
                kept &= o[q * count + k] == 777.0f;
        check_true("shard stats: max and own max = the forward's zmax, z_tok = x·inv_temp "
                   "(the same bits)", exact);
        check_true("shard stats: slots of no row kept", kept);
        check_close("shard stats: own sum and dot vs float64", s_got.size(), s_got, s_want, s_tol);
        CUDA_OK(cudaFree(out));
        CUDA_OK(cudaFree(d_index));
    }

    CUDA_OK(cudaFree(x.dev));
    CUDA_OK(cudaFree(dx.dev));
    CUDA_OK(cudaFree(dx_ref.dev));
    CUDA_OK(cudaFree(d_tokens));
    CUDA_OK(cudaFree(d_g));
    CUDA_OK(cudaFree(d_e));
    CUDA_OK(cudaFree(check));
    CUDA_OK(cudaFree(fast.buf));
    CUDA_OK(cudaFree(ref.buf));
    CUDA_OK(cudaFree(bias));
    CUDA_OK(cudaFree(bias_ref));
}

/* A bad token id is refused by a status; non-finite logits give non-finite
 * statistics in their rows only (the caller checks them); the device keeps
 * working. */
static void test_row_refusals(fg_dtype xt)
{
    char msg[256], what[160];
    const int64_t M = 37, V = 1031, row0 = 1000;
    printf("-- refusals x %s M %lld V %lld\n", dtype_name(xt), (long long)M, (long long)V);
    rng_state = 7;
    Matrix x = matrix_make(xt, M, V, V);
    std::vector<int64_t> tokens(M);
    for (int64_t r = 0; r < M; r++) {
        for (int64_t v = 0; v < V; v++)
            mat_set(x, r, v, (float)(4.0 * uniform() - 2.0));
        tokens[r] = (int64_t)(uniform() * (double)V);
    }
    mat_set(x, 20, 100, NAN);
    mat_set(x, 25, 3, INFINITY);
    to_device(x);
    tokens[9] = V;
    tokens[30] = -1;
    int64_t *d_tokens = device_copy(tokens);
    fg_cuda_row_check *check;
    CUDA_OK(cudaMalloc(&check, sizeof *check));
    DevStats st = stats_alloc(M);

    for (int use_ref = 0; use_ref < 2; use_ref++) {
        const char *kind = use_ref ? "reference" : "fast";
        for (int fixed_tokens = 0; fixed_tokens < 2; fixed_tokens++) {
            if (fixed_tokens) {
                std::vector<int64_t> ok = tokens;
                ok[9] = ok[30] = 0;
                CUDA_OK(cudaMemcpy(d_tokens, ok.data(), M * sizeof(int64_t),
                                   cudaMemcpyHostToDevice));
            } else {
                CUDA_OK(cudaMemcpy(d_tokens, tokens.data(), M * sizeof(int64_t),
                                   cudaMemcpyHostToDevice));
            }
            msg[0] = '\0';
            fg_status s = fg_cuda_row_check_reset(check, 0, msg, sizeof msg);
            if (s == FG_OK)
                s = (use_ref ? fg_cuda_row_stats_forward_ref : fg_cuda_row_stats_forward)(
                    x.dev, xt, M, V, V, 1.25f, d_tokens, st.st, check, 0, msg, sizeof msg);
            if (s == FG_OK)
                s = fg_cuda_row_check_status(check, row0, 0, msg, sizeof msg);
            const fg_status want = fixed_tokens ? FG_OK : FG_ERR_TOKEN_OUT_OF_RANGE;
            snprintf(what, sizeof what, "%s: %s", kind,
                     fixed_tokens ? "NaN/Inf rows pass the row check" : "bad token ids refused");
            check_status(what, s, want, msg);
            if (!fixed_tokens) {
                const char *row = "row 1009:"; /* the lowest bad row */
                snprintf(what, sizeof what, "%s: the message names %s", kind, row);
                check_true(what, strncmp(msg, row, strlen(row)) == 0);
                continue;
            }
            /* Rows 20 (NaN) and 25 (Inf) have some non-finite statistic, no other row. */
            const std::vector<float> h = host_copy(st.buf, 4 * M);
            bool rows_ok = true;
            for (int64_t r = 0; r < M; r++) {
                bool finite = true;
                for (int q = 0; q < 4; q++)
                    finite &= isfinite(h[q * M + r]) != 0;
                rows_ok &= finite == (r != 20 && r != 25);
            }
            snprintf(what, sizeof what, "%s: non-finite statistics in rows 20 and 25 only", kind);
            check_true(what, rows_ok);
        }
    }
    check_true("no device fault after the refusals", cudaDeviceSynchronize() == cudaSuccess);
    CUDA_OK(cudaFree(x.dev));
    CUDA_OK(cudaFree(d_tokens));
    CUDA_OK(cudaFree(check));
    CUDA_OK(cudaFree(st.buf));
}

/* ---- products --------------------------------------------------------------------- */

static void fill_random(Matrix &m)
{
    for (int64_t r = 0; r < m.rows; r++)
        for (int64_t c = 0; c < m.cols; c++)
            mat_set(m, r, c, (float)(2.0 * uniform() - 1.0));
    to_device(m);
}

/* want[i, j] = Σ_k a(i, k) b(j, k) in float64 with tol from Σ |a b|. */
template <typename A, typename B>
static void host_product(int64_t rows, int64_t cols, int64_t K, A a, B b, fg_dtype out,
                         std::vector<double> &want, std::vector<double> &tol)
{
    want.assign(rows * cols, 0.0);
    tol.assign(rows * cols, 0.0);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            double s = 0, sa = 0;
            for (int64_t k = 0; k < K; k++) {
                const double p = (double)a(i, k) * (double)b(j, k);
                s += p;
                sa += fabs(p);
            }
            want[i * cols + j] = s;
            tol[i * cols + j] = 1e-5 * sa + (out == FG_DTYPE_BF16 ? 0x1p-8 * fabs(s) : 0.0) + 1e-30;
        }
}

static std::vector<double> read_matrix(Matrix &m)
{
    to_host(m);
    std::vector<double> v(m.rows * m.cols);
    for (int64_t r = 0; r < m.rows; r++)
        for (int64_t c = 0; c < m.cols; c++)
            v[r * m.cols + c] = mat_get(m, r, c);
    return v;
}

/* The products of a chunk of M rows that starts at row `first` of h and
 * dlogits (pointers inside the matrices, as the chunk loop passes them). */
static void test_gemm(const fg_cuda_gemm *gemm, fg_dtype in, fg_dtype out, int64_t M, int64_t V,
                      int64_t H, int64_t pad, int64_t first, uint64_t seed)
{
    char what[200], msg[256];
    printf("-- products in %s out %s M %lld V %lld H %lld ld pad %lld, chunk rows %lld..\n",
           dtype_name(in), dtype_name(out), (long long)M, (long long)V, (long long)H,
           (long long)pad, (long long)first);
    rng_state = seed;
    const int64_t rows = first + M;
    Matrix h = matrix_make(in, rows, H, H + pad), w = matrix_make(in, V, H, H + pad);
    Matrix d1 = matrix_make(in, rows, V, V + pad), d2 = matrix_make(in, rows, V, V + pad);
    fill_random(h);
    fill_random(w);
    fill_random(d1);
    fill_random(d2);
    const size_t es = dtype_size(in);
    const void *h_chunk = (const unsigned char *)h.dev + (size_t)(first * h.ld) * es;
    const void *d1_chunk = (const unsigned char *)d1.dev + (size_t)(first * d1.ld) * es;
    const void *d2_chunk = (const unsigned char *)d2.dev + (size_t)(first * d2.ld) * es;
    auto hv = [&](int64_t r, int64_t c) { return mat_get(h, first + r, c); };
    std::vector<double> want, tol;

    /* GEMM 1: logits [M, V] = h · Wᵀ. */
    Matrix z = matrix_make(out, M, V, V + pad);
    fg_status s = fg_cuda_gemm_logits(gemm, in, M, V, H, h_chunk, h.ld, w.dev, w.ld, z.dev, out,
                                      z.ld, msg, sizeof msg);
    check_status("GEMM 1 status", s, FG_OK, msg);
    host_product(M, V, H, hv, [&](int64_t v, int64_t k) { return mat_get(w, v, k); }, out, want,
                 tol);
    snprintf(what, sizeof what, "GEMM 1 logits vs float64");
    check_close(what, M * V, read_matrix(z), want, tol);

    /* GEMM 2: grad_hidden [M, H] = dlogits · W. */
    Matrix gh = matrix_make(out, M, H, H + pad);
    s = fg_cuda_gemm_grad_hidden(gemm, in, M, V, H, d1_chunk, d1.ld, w.dev, w.ld, gh.dev, out,
                                 gh.ld, 0.0f, msg, sizeof msg);
    check_status("GEMM 2 status", s, FG_OK, msg);
    host_product(M, H, V, [&](int64_t r, int64_t v) { return mat_get(d1, first + r, v); },
                 [&](int64_t j, int64_t v) { return mat_get(w, v, j); }, out, want, tol);
    check_close("GEMM 2 grad_hidden vs float64", M * H, read_matrix(gh), want, tol);

    /* GEMM 3: grad_weight [V, H] = d1ᵀ·h (beta 0), then += d2ᵀ·h (beta 1). */
    Matrix gw = matrix_make(out, V, H, H + pad);
    s = fg_cuda_gemm_grad_weight(gemm, in, M, V, H, d1_chunk, d1.ld, h_chunk, h.ld, gw.dev, out,
                                 gw.ld, 0.0f, msg, sizeof msg);
    if (s == FG_OK)
        s = fg_cuda_gemm_grad_weight(gemm, in, M, V, H, d2_chunk, d2.ld, h_chunk, h.ld, gw.dev,
                                     out, gw.ld, 1.0f, msg, sizeof msg);
    check_status("GEMM 3 status (beta 0, then beta 1)", s, FG_OK, msg);
    std::vector<double> want2, tol2;
    auto h_t = [&](int64_t j, int64_t k) { return hv(k, j); };
    host_product(V, H, M, [&](int64_t v, int64_t k) { return mat_get(d1, first + k, v); }, h_t,
                 out, want, tol);
    host_product(V, H, M, [&](int64_t v, int64_t k) { return mat_get(d2, first + k, v); }, h_t,
                 out, want2, tol2);
    /* The sum of both, plus its own rounding when grad_weight is bf16 (tol
     * already holds the rounding of the first product). */
    for (size_t i = 0; i < want.size(); i++) {
        want[i] += want2[i];
        tol[i] += tol2[i] + (out == FG_DTYPE_BF16 ? 0x1p-8 * fabs(want[i]) : 0.0);
    }
    check_close("GEMM 3 grad_weight (two chunks summed) vs float64", V * H, read_matrix(gw),
                want, tol);

    for (Matrix *m : {&h, &w, &d1, &d2, &z, &gh, &gw})
        CUDA_OK(cudaFree(m->dev));
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* every line reaches a log even if a check crashes */
    test_argument_checks();

    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
        printf("skipped: %s\n", err != cudaSuccess ? cudaGetErrorString(err)
                                                   : "no CUDA device is present");
        return checks_failed ? 1 : 77;
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d, %.1f GiB)\n", prop.name, prop.major, prop.minor,
           (double)prop.totalGlobalMem / (1 << 30));

    const fg_dtype types[2] = {FG_DTYPE_F32, FG_DTYPE_BF16};
    uint64_t seed = 1;
    for (fg_dtype xt : types)
        for (fg_dtype dt : types) {
            /* Unaligned rows (the scalar kernels), aligned rows with a narrower
             * last pack, and several row groups and column blocks. */
            test_rows(xt, dt, 37, 1031, 1031, 1031, 0.7f, seed++);
            test_rows(xt, dt, 37, 1031, 1040, 1040, 1.0f, seed++);
            test_rows(xt, dt, 130, 4099, 4104, 4112, 1.3f, seed++);
        }
    test_rows(FG_DTYPE_BF16, FG_DTYPE_BF16, 3, 151936, 151936, 151936, 1.0f, seed++);
    for (fg_dtype xt : types)
        test_row_refusals(xt);

    cublasLtHandle_t lt;
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
        printf("FAIL cublasLtCreate\n");
        return 1;
    }
    fg_cuda_gemm gemm = {lt, 0, NULL, fg_cuda_gemm_workspace_hint()};
    CUDA_OK(cudaMalloc(&gemm.workspace, gemm.workspace_bytes));
    const fg_dtype gemm_types[3][2] = {
        {FG_DTYPE_F32, FG_DTYPE_F32}, {FG_DTYPE_BF16, FG_DTYPE_F32}, {FG_DTYPE_BF16, FG_DTYPE_BF16}};
    for (const auto &t : gemm_types) {
        test_gemm(&gemm, t[0], t[1], 37, 1031, 96, 0, 0, seed++);
        test_gemm(&gemm, t[0], t[1], 37, 1031, 96, 5, 3, seed++);
    }
    test_gemm(&gemm, FG_DTYPE_BF16, FG_DTYPE_F32, 128, 4096, 256, 0, 128, seed++);
    CUDA_OK(cudaFree(gemm.workspace));
    cublasLtDestroy(lt);

    printf("%d checks, %d failed\n", checks_run, checks_failed);
    return checks_failed ? 1 : 0;
}
