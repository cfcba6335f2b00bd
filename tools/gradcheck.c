/*
 * `fusedgrpo gradcheck`: the configured impl against a reference on one
 * batch, with the config's tolerance gates. Exit 0 when every gate passes,
 * 1 when one fails, 2 on a usage or runtime error. The report is one JSON
 * object (--json); the text on stdout shows the same figures.
 *
 * The reference:
 *   oracle    fg_oracle_linear / fg_oracle_logits in float64 on exactly the
 *             kernel's inputs (bf16 inputs widened exactly; the logits impl's
 *             reference reads the same tool-made logits the kernel read).
 *   baseline  the library in float32 (inputs widened to float32), for shapes
 *             the oracle cannot afford: the materialized path without logit
 *             rounding; for the logits impl, fg_logits_grpo on the kernel's
 *             logits widened to float32.
 * reference: auto picks the oracle while N*V*H <= oracle_limit and the
 * oracle's [N, V] double arrays stay below ~1.2 GB each.
 *
 * max_rel_diff_X is max|kernel - reference| / max|reference| over tensor X,
 * a norm-wise relative error: elementwise |a-b|/|b| explodes on the
 * near-zero entries every gradient has, so it would gate on noise.
 */
#include "commands.h"
#include "fg_oracle.h"
#include "problem_io.h"
#include "problem_source.h"
#include "runner.h"
#include "sharded.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

static const char USAGE[] =
    "usage: fusedgrpo gradcheck [--config FILE]... [--set key=value]... [options]\n"
    "  The configured impl against a reference (the float64 oracle, or the float32\n"
    "  materialized baseline for big shapes), gated. Exit 0: pass; 1: a gate fails; 2: error.\n"
    "  Under mpirun with --set vocab_shards=V,data_shards=D (V x D ranks): the impl runs\n"
    "  sharded over the ranks and the assembled outputs are checked (rank 0 reports).\n"
    "options:\n"
    "  --inputs DIR       replay a captured batch from DIR/*.npy (shapes override the config)\n"
    "  --save-inputs DIR  write the batch used as .npy (replayable with --inputs)\n"
    "  --dump DIR         write the kernel's outputs as .npy\n"
    "  --json FILE        write the report as JSON\n"
    "  -q, --quiet        print only the verdict line\n";

/* ---------------------------------------------------------- the reference */

/* A read-only array of float32, bfloat16 or float64 (f64 = 1); p NULL: absent. */
typedef struct ft_view { const void *p; int dtype, f64; } ft_view;

/* max|kernel - ref| (NaN when either side has a NaN or Inf), max|ref|, their
 * ratio (0/0 = 0, x/0 = inf) and the entries where either side is not finite. */
typedef struct ft_diff { double max_abs, max_ref, max_rel; int64_t nonfinite; } ft_diff;

/* The reference's outputs, as views into its own storage. */
enum { LOGP, ENTROPY, GRAD_LOGITS, GRAD_HIDDEN, GRAD_WEIGHT, GRAD_BIAS, NVIEWS };
typedef struct ft_reference {
    double loss;
    fg_metrics metrics;
    ft_view v[NVIEWS];
    fg_oracle_result oracle;
    ft_problem f32p;
    ft_runner base;
} ft_reference;

#define ORACLE_MAX_NV 1.5e8 /* [N, V] doubles: 1.2 GB per array */

static double get(ft_view v, int64_t i)
{
    return v.f64 ? ((const double *)v.p)[i] : ft_load(v.p, v.dtype, i);
}

static ft_diff compare(ft_view kernel, ft_view ref, int64_t n)
{
    ft_diff d = {0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++) {
        const double a = get(kernel, i), b = get(ref, i);
        if (!isfinite(a) || !isfinite(b)) {
            d.nonfinite++;
            continue;
        }
        d.max_abs = fmax(d.max_abs, fabs(a - b));
        d.max_ref = fmax(d.max_ref, fabs(b));
    }
    d.max_rel = d.max_ref > 0 ? d.max_abs / d.max_ref : (d.max_abs == 0 ? 0 : INFINITY);
    if (d.nonfinite > 0) /* NaN fails every gate: `NaN <= tol` is false */
        d.max_abs = d.max_rel = NAN;
    return d;
}

static double *widen64(const void *src, int dtype, int64_t n)
{
    double *d = malloc((size_t)(n > 0 ? n : 1) * sizeof *d);
    for (int64_t i = 0; d && i < n; i++)
        d[i] = ft_load(src, dtype, i);
    return d;
}

static int run_oracle(ft_reference *ref, const ft_config *cfg, const ft_problem *p, int impl,
                      const void *logits, char *err, size_t errlen)
{
    fg_loss_config loss;
    fg_batch batch;
    ft_loss_config_from(cfg, &loss);
    ft_batch_from(p, &batch);
    const int64_t N = ft_problem_tokens(p), H = p->s.hidden, V = p->s.vocab;
    const int dt = p->s.dtype;
    int rc = -1;
    if (impl == FT_IMPL_LOGITS) {
        double *z = widen64(logits, dt, N * V);
        rc = z ? fg_oracle_logits(&loss, &batch, z, V, &ref->oracle) : -1;
        free(z);
    } else {
        double *h = widen64(p->hidden, dt, N * H), *w = widen64(p->weight, dt, V * H);
        double *b = p->bias ? widen64(p->bias, dt, V) : NULL;
        if (h && w && (b || !p->bias))
            rc = fg_oracle_linear(&loss, &batch, h, w, b, H, V, &ref->oracle);
        free(h);
        free(w);
        free(b);
    }
    if (rc != 0)
        return ft_error(err, errlen, "the float64 oracle refused the batch (bad input or out of memory)");
    const fg_oracle_result *o = &ref->oracle;
    const double *out[NVIEWS] = {o->logp,        o->entropy,     o->grad_logits,
                                 o->grad_hidden, o->grad_weight, o->grad_bias};
    for (int k = 0; k < NVIEWS; k++)
        ref->v[k] = (ft_view){out[k], 0, 1};
    ref->loss = o->loss;
    ref->metrics = o->metrics;
    return 0;
}

/* The library in float32 on a float32 copy of the problem: the materialized
 * path, or fg_logits_grpo on the kernel's logits widened to float32. */
static int run_baseline(ft_reference *ref, const ft_config *cfg, const ft_problem *p, int impl,
                        const void *logits, char *err, size_t errlen)
{
    const ft_problem *src = p;
    const int64_t N = ft_problem_tokens(p), H = p->s.hidden, V = p->s.vocab;
    if (p->s.dtype != FG_DTYPE_F32) {
        ft_config wide = *cfg;
        wide.dtype = FG_DTYPE_F32;
        if (ft_problem_create(&wide, &ref->f32p, err, errlen) != 0)
            return -1;
        const void *from[3] = {p->hidden, p->weight, p->bias};
        float *to[3] = {ref->f32p.hidden, ref->f32p.weight, ref->f32p.bias};
        for (int64_t t = 0, count[3] = {N * H, V * H, p->bias ? V : 0}; t < 3; t++)
            for (int64_t i = 0; i < count[t]; i++)
                to[t][i] = ft_load(from[t], p->s.dtype, i);
        /* The per-token inputs follow the float tensors, in the same layout. */
        const char *tokens = (const char *)p->token_ids;
        memcpy(ref->f32p.token_ids, tokens, p->bytes - (size_t)(tokens - (const char *)p->base));
        src = &ref->f32p;
    }
    ft_config c = *cfg;
    c.round_logits = 0;
    c.dtype = FG_DTYPE_F32;
    ft_runner *b = &ref->base;
    int rc = ft_runner_init(b, &c, src, impl == FT_IMPL_LOGITS ? FT_IMPL_LOGITS : FT_IMPL_BASELINE, 0);
    for (int64_t i = 0; rc == 0 && impl == FT_IMPL_LOGITS && i < N * V; i++)
        ((float *)b->logits)[i] = ft_load(logits, p->s.dtype, i);
    if (rc != 0 || (impl == FT_IMPL_LOGITS ? ft_runner_logits_kernel(b) : ft_runner_step(b)) != 0)
        return ft_error(err, errlen, "baseline reference: %.900s", b->err);
    const void *out[NVIEWS] = {b->logp, b->entropy, b->logits, b->grad_hidden, b->grad_weight, b->grad_bias};
    for (int k = 0; k < NVIEWS; k++)
        ref->v[k] = (ft_view){out[k], FG_DTYPE_F32, 0};
    ref->loss = b->loss_value;
    ref->metrics = b->metrics;
    return 0;
}

static void reference_free(ft_reference *ref)
{
    fg_oracle_result_free(&ref->oracle);
    ft_runner_free(&ref->base);
    ft_problem_destroy(&ref->f32p);
}

/* ---------------------------------------------------------- the report */

/* The gates' tolerances (tol_loss, tol_logp, tol_entropy, tol_grad_rel), by
 * dtype where the config says auto. bf16 inputs are exact in float32, so the
 * forward is float32-accurate; a backward GEMM may round dlogits to bf16
 * (2^-9 ~ 2e-3 relative, as the logits impl's bf16 dlogits are); rounding
 * the logits themselves (round_logits) moves logp by up to |z|*2^-9, a few
 * 1e-2 for logits of a few units. Returns what the auto values are for. */
static const char *tolerances(const ft_config *cfg, double tol[4])
{
    static const double f32[4] = {1e-5, 1e-4, 1e-4, 1e-3}, bf16[4] = {1e-4, 1e-3, 1e-3, 1e-2},
                        rounded[4] = {5e-2, 1e-1, 1e-1, 1.5e-1};
    const int round = cfg->dtype == FG_DTYPE_BF16 && cfg->impl == FT_IMPL_BASELINE && cfg->round_logits;
    const double *by_dtype = cfg->dtype != FG_DTYPE_BF16 ? f32 : round ? rounded : bf16;
    const double set[4] = {cfg->tol_loss, cfg->tol_logp, cfg->tol_entropy, cfg->tol_grad_rel};
    for (int k = 0; k < 4; k++)
        tol[k] = isnan(set[k]) ? by_dtype[k] : set[k];
    return cfg->dtype != FG_DTYPE_BF16 ? "float32" : round ? "bfloat16 with round_logits" : "bfloat16";
}

typedef struct report { cJSON *json, *gates; int pass; } report;

static void num(report *r, const char *key, double v) { cJSON_AddNumberToObject(r->json, key, v); }

/* A gate `value <= tol` (NaN fails); cfg_tol is the config's, NaN when auto. */
static void gate(report *r, const char *metric, const char *tol_key, double value, double tol, double cfg_tol)
{
    cJSON *g = cJSON_CreateObject();
    cJSON_AddStringToObject(g, "metric", metric);
    cJSON_AddStringToObject(g, "tolerance_key", tol_key);
    cJSON_AddNumberToObject(g, "value", value);
    cJSON_AddNumberToObject(g, "tolerance", tol);
    cJSON_AddBoolToObject(g, "auto", isnan(cfg_tol));
    cJSON_AddBoolToObject(g, "pass", value <= tol);
    cJSON_AddItemToArray(r->gates, g);
    r->pass &= value <= tol;
}

static void grad(report *r, const char *name, const void *kernel, int dtype, ft_view ref, int64_t n)
{
    const ft_diff d = compare((ft_view){kernel, dtype, 0}, ref, n);
    static const char *const what[4] = {"max_abs_diff_", "max_rel_diff_", "max_abs_ref_", "nonfinite_"};
    const double v[4] = {d.max_abs, d.max_rel, d.max_ref, (double)d.nonfinite};
    for (int k = 0; k < 4; k++) {
        char key[64];
        snprintf(key, sizeof key, "%s%s", what[k], name);
        num(r, key, v[k]);
    }
}

/* Every figure and gate of the report, in r->json. */
static void compare_all(report *r, const ft_config *cfg, const ft_runner *run, const ft_reference *ref,
                        int ref_kind, double kernel_s, double ref_s)
{
    const ft_problem *p = run->p;
    const int64_t N = ft_problem_tokens(p), H = p->s.hidden, V = p->s.vocab;
    double ma[6], mb[6], m = 0; /* fg_metrics is six doubles; m: the largest difference */
    memcpy(ma, &run->metrics, sizeof ma);
    memcpy(mb, &ref->metrics, sizeof mb);
    for (int i = 0; i < 6; i++) /* NaN stays NaN (fmax alone would drop it) */
        m = isnan(m) || isnan(ma[i] - mb[i]) ? NAN : fmax(m, fabs(ma[i] - mb[i]));
    const ft_diff logp = compare((ft_view){run->logp, FG_DTYPE_F32, 0}, ref->v[LOGP], N);
    const ft_diff ent = compare((ft_view){run->entropy, FG_DTYPE_F32, 0}, ref->v[ENTROPY], N);
    r->json = cJSON_CreateObject();
    r->gates = cJSON_CreateArray();
    r->pass = 1;
    cJSON_AddStringToObject(r->json, "command", "gradcheck");
    cJSON_AddStringToObject(r->json, "impl", ft_impl_name(cfg->impl));
    cJSON_AddStringToObject(r->json, "dtype", ft_dtype_name(cfg->dtype));
    cJSON_AddStringToObject(r->json, "reference", ref_kind == FT_REF_ORACLE ? "oracle" : "baseline");
    num(r, "tokens", (double)N);
    num(r, "unmasked_tokens", (double)ft_problem_unmasked(p));
    num(r, "loss_ref", ref->loss);
    num(r, "loss_kernel", run->loss_value);
    num(r, "abs_diff_loss", fabs(run->loss_value - ref->loss));
    num(r, "logp_max_abs", logp.max_abs);
    num(r, "entropy_max_abs", ent.max_abs);
    num(r, "metrics_max_abs", m);
    double t[4];
    tolerances(cfg, t);
    gate(r, "abs_diff_loss", "tol_loss", fabs(run->loss_value - ref->loss), t[0], cfg->tol_loss);
    gate(r, "logp_max_abs", "tol_logp", logp.max_abs, t[1], cfg->tol_logp);
    gate(r, "entropy_max_abs", "tol_entropy", ent.max_abs, t[2], cfg->tol_entropy);
    if (run->impl == FT_IMPL_LOGITS) {
        grad(r, "dlogits", run->logits, p->s.dtype, ref->v[GRAD_LOGITS], N * V);
    } else {
        grad(r, "dhidden", run->grad_hidden, FG_DTYPE_F32, ref->v[GRAD_HIDDEN], N * H);
        grad(r, "dweight", run->grad_weight, FG_DTYPE_F32, ref->v[GRAD_WEIGHT], V * H);
        if (p->bias)
            grad(r, "dbias", run->grad_bias, FG_DTYPE_F32, ref->v[GRAD_BIAS], V);
    }
    for (const cJSON *it = r->json->child; it; it = it->next)
        if (strncmp(it->string, "max_rel_diff_", 13) == 0)
            gate(r, it->string, "tol_grad_rel", it->valuedouble, t[3], cfg->tol_grad_rel);
    cJSON_AddStringToObject(r->json, "max_rel_definition", "max|kernel - ref| / max|ref| over the tensor");
    num(r, "kernel_s", kernel_s);
    num(r, "reference_s", ref_s);
    cJSON_AddItemToObject(r->json, "gates", r->gates);
    cJSON_AddBoolToObject(r->json, "pass", r->pass);
    cJSON_AddItemToObject(r->json, "config", ft_config_json(cfg));
}

/* The text report: the JSON report's figures, one a line, then the gates. */
static void print_report(const report *r, const ft_config *cfg, const ft_problem *p)
{
    printf("fusedgrpo gradcheck: impl %s, dtype %s%s, B=%lld T=%lld H=%lld V=%lld, "
           "%lld of %lld tokens unmasked\n", ft_impl_name(cfg->impl), ft_dtype_name(cfg->dtype),
           cfg->impl == FT_IMPL_BASELINE && cfg->round_logits ? " (logits rounded to bf16)" : "",
           (long long)p->s.batch, (long long)p->s.seq_len, (long long)p->s.hidden,
           (long long)p->s.vocab, (long long)ft_problem_unmasked(p), (long long)ft_problem_tokens(p));
    printf("loss_type %s, reference %s\n", fg_loss_type_name((fg_loss_type)cfg->loss_type),
           cJSON_GetObjectItem(r->json, "reference")->valuestring);
    for (const cJSON *it = cJSON_GetObjectItem(r->json, "loss_ref"); it; it = it->next)
        if (cJSON_IsNumber(it))
            printf("%-24s %.*e\n", it->string, strncmp(it->string, "loss", 4) ? 3 : 12, it->valuedouble);
    printf("(max_rel_diff = max|kernel - ref| / max|ref| over the whole tensor)\n");
    double t[4];
    printf("gates (tolerances: %s):\n", tolerances(cfg, t));
    for (const cJSON *g = r->gates->child; g; g = g->next)
        printf("  %-22s %.3e <= %-12s %.1e%s  %s\n", cJSON_GetObjectItem(g, "metric")->valuestring,
               cJSON_GetObjectItem(g, "value")->valuedouble,
               cJSON_GetObjectItem(g, "tolerance_key")->valuestring,
               cJSON_GetObjectItem(g, "tolerance")->valuedouble,
               cJSON_IsTrue(cJSON_GetObjectItem(g, "auto")) ? " (auto)" : "",
               cJSON_IsTrue(cJSON_GetObjectItem(g, "pass")) ? "PASS" : "FAIL");
}

/* Runs the kernel and the reference, then compares; the logits impl's
 * reference reads the tool-made logits before the kernel overwrites them. */
static int check(report *rep, ft_runner *run, ft_reference *ref, const ft_config *cfg, const ft_problem *p,
                 ft_shards *shards, char *err, size_t errlen)
{
    const double nv = (double)ft_problem_tokens(p) * (double)p->s.vocab;
    const int oracle_fits = nv * (double)p->s.hidden <= cfg->oracle_limit && nv <= ORACLE_MAX_NV;
    const int auto_kind = oracle_fits ? FT_REF_ORACLE : FT_REF_BASELINE, logits = cfg->impl == FT_IMPL_LOGITS;
    const int ref_kind = cfg->reference != FT_REF_AUTO ? cfg->reference : auto_kind;
    double t0 = omp_get_wtime(), kernel_s, ref_s;
    if (cfg->filter_eps != 0) /* NaN (auto) included */
        return ft_error(err, errlen,
                        "gradcheck checks the exact gradient: set filter_eps: 0 (gradient "
                        "filtering is checked against its own definition by tests/test_filter.c)");
    if (shards && logits)
        return ft_error(err, errlen, "the logits impl has no vocab-sharded form: impl fused or baseline");
    if (ft_runner_init(run, cfg, p, cfg->impl, 0) != 0 ||
        (shards ? ft_sharded_step(shards, run, 1)
                : logits ? ft_runner_materialize_logits(run) : ft_runner_step(run)) != 0)
        return ft_error(err, errlen, "%s", run->err);
    kernel_s = omp_get_wtime() - t0;
    /* The outputs are ours; the library's cached workspace (the whole
     * logits for baseline) need not sit beside the reference's. */
    fg_release_workspace(run->ctx);
    t0 = omp_get_wtime();
    if ((ref_kind == FT_REF_ORACLE ? run_oracle : run_baseline)(ref, cfg, run->p, cfg->impl,
                                                                 logits ? run->logits : NULL, err, errlen))
        return -1;
    ref_s = omp_get_wtime() - t0;
    if (logits && ft_runner_logits_kernel(run) != 0)
        return ft_error(err, errlen, "%s", run->err);
    compare_all(rep, cfg, run, ref, ref_kind, logits ? run->kernel_s : kernel_s, ref_s);
    return 0;
}

int ft_cmd_gradcheck(int argc, char **argv)
{
    ft_cli cli;
    int rc = ft_cli_parse(&cli, argc, argv,
                          FT_OPT_JSON | FT_OPT_INPUTS | FT_OPT_DUMP | FT_OPT_SAVE_INPUTS | FT_OPT_QUIET,
                          USAGE);
    if (rc != 0)
        return rc > 0 ? FT_EXIT_OK : FT_EXIT_USAGE;
    ft_config *cfg = &cli.cfg;
    char err[1024] = "";
    ft_problem p = {0};
    ft_runner run = {0};
    ft_reference ref = {0};
    report rep = {0};
    int status = FT_EXIT_USAGE;
    ft_shards *shards = NULL;
    if (ft_sharded_wanted(cfg) && ft_sharded_init(&shards, cfg, err, sizeof err) != 0) {
        fprintf(stderr, "fusedgrpo gradcheck: %s\n", err);
        ft_sharded_finish(shards);
        return FT_EXIT_USAGE;
    }
    /* Sharded, every rank checks the same assembled outputs; rank 0 reports. */
    const int reporter = !shards || ft_sharded_rank(shards) == 0;
    if (!reporter)
        cli.quiet = 1, cli.json = NULL, cli.dump = NULL, cli.save_inputs = NULL;
    if (ft_problem_make(cli.inputs, cfg, 0, &p, err, sizeof err) == 0 &&
        !(cli.save_inputs && ft_problem_save_dir(&p, cli.save_inputs, err, sizeof err) != 0) &&
        check(&rep, &run, &ref, cfg, &p, shards, err, sizeof err) == 0) {
        if (!reporter) {
            status = rep.pass ? FT_EXIT_OK : FT_EXIT_FAIL;
            cJSON_Delete(rep.json);
            goto done;
        }
        if (!cli.quiet)
            print_report(&rep, cfg, &p);
        char grid[64] = "";
        if (shards)
            snprintf(grid, sizeof grid, " on %lld x %lld ranks (vocab x data)",
                     (long long)cfg->vocab_shards, (long long)cfg->data_shards);
        printf("gradcheck %s %s%s: %s\n", ft_impl_name(cfg->impl), ft_dtype_name(cfg->dtype), grid,
               rep.pass ? "PASS" : "FAIL");
        status = rep.pass ? FT_EXIT_OK : FT_EXIT_FAIL;
        FILE *f = cli.json ? fopen(cli.json, "w") : NULL;
        const int written = ft_json_write_line(f, rep.json) == 0 && (f != NULL) == (cli.json != NULL);
        if ((f && fclose(f) != 0) || !written) {
            snprintf(err, sizeof err, "cannot write %s", cli.json);
            status = FT_EXIT_USAGE;
        }
        if (cli.dump && ft_dump_outputs(cli.dump, &run, err, sizeof err) != 0)
            status = FT_EXIT_USAGE;
    }
    if (status == FT_EXIT_USAGE)
        fprintf(stderr, "fusedgrpo gradcheck: %s\n", err);
done:
    reference_free(&ref);
    ft_runner_free(&run);
    ft_problem_destroy(&p);
    if (shards)
        ft_sharded_finish(shards);
    return status;
}
