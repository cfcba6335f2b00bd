/*
 * `fusedgrpo gradcheck`: the configured impl against a reference on one
 * batch, with the config's tolerance gates. Exit 0 when every gate passes,
 * 1 when one fails, 2 on a usage or runtime error.
 *
 * max_rel_diff_X is max|kernel - reference| / max|reference| over tensor X
 * (norm-wise; see compare.h for why not elementwise).
 */
#include "cli.h"
#include "commands.h"
#include "compare.h"
#include "config_json.h"
#include "dump.h"
#include "inputs.h"
#include "json.h"
#include "problem_io.h"
#include "reference.h"
#include "runner.h"
#include "stats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char USAGE[] =
    "usage: fusedgrpo gradcheck [--config FILE]... [--set key=value]... [options]\n"
    "  Runs the configured impl (baseline | logits | fused) and a reference (float64\n"
    "  oracle, or the float32 materialized baseline for big shapes) on one batch and\n"
    "  gates the differences. Exit 0: all gates pass; 1: a gate fails; 2: error.\n"
    "options:\n"
    "  --inputs DIR       replay a captured batch from DIR/*.npy (shapes override the config)\n"
    "  --save-inputs DIR  write the batch used as .npy (replayable with --inputs)\n"
    "  --dump DIR         write the kernel's outputs as .npy\n"
    "  --json FILE        write the report as JSON\n"
    "  -q, --quiet        print only the verdict line\n";

/* Tolerances by dtype when a gate is `auto`. bf16 inputs are exact in
 * float32, so the forward is float32-accurate; a backward GEMM may round
 * dlogits to bf16 (2^-9 ~ 2e-3 relative, as the logits impl's bf16 dlogits
 * are); rounding the logits themselves (round_logits) moves logp by up to
 * |z|*2^-9, a few 1e-2 for logits of a few units. */
typedef struct tolerances {
    double loss, logp, entropy, grad_rel;
    const char *why;
} tolerances;

static tolerances resolve_tolerances(const ft_config *cfg)
{
    tolerances t = {1e-5, 1e-4, 1e-4, 1e-3, "float32"};
    if (cfg->dtype == FT_DTYPE_BF16) {
        t = (tolerances){1e-4, 1e-3, 1e-3, 1e-2, "bfloat16"};
        if (cfg->impl == FT_IMPL_BASELINE && cfg->round_logits)
            t = (tolerances){5e-2, 1e-1, 1e-1, 1.5e-1, "bfloat16 with round_logits"};
    }
    if (!isnan(cfg->tol_loss))
        t.loss = cfg->tol_loss;
    if (!isnan(cfg->tol_logp))
        t.logp = cfg->tol_logp;
    if (!isnan(cfg->tol_entropy))
        t.entropy = cfg->tol_entropy;
    if (!isnan(cfg->tol_grad_rel))
        t.grad_rel = cfg->tol_grad_rel;
    return t;
}

typedef struct gate {
    char metric[48];
    const char *tol_key;
    double value, tol;
    int is_auto, pass;
} gate;

typedef struct grad_diff {
    const char *name; /* dlogits, dhidden, dweight, dbias */
    ft_diff d;
} grad_diff;

typedef struct report {
    double loss_kernel, loss_ref, abs_diff_loss, kernel_s, ref_s;
    ft_diff logp, entropy;
    double metrics_max_abs;
    grad_diff grads[4];
    int ngrads;
    gate gates[8];
    int ngates;
    int pass;
} report;

static void add_gate(report *r, const char *metric, const char *tol_key, double value, double tol,
                     double cfg_value)
{
    gate *g = &r->gates[r->ngates++];
    snprintf(g->metric, sizeof g->metric, "%s", metric);
    g->tol_key = tol_key;
    g->value = value;
    g->tol = tol;
    g->is_auto = isnan(cfg_value);
    g->pass = value <= tol; /* NaN fails */
    if (!g->pass)
        r->pass = 0;
}

static double metrics_diff(const fg_metrics *a, const fg_metrics *b)
{
    double d[6] = {a->kl - b->kl,
                   a->entropy - b->entropy,
                   a->clip_ratio_low - b->clip_ratio_low,
                   a->clip_ratio_high - b->clip_ratio_high,
                   a->clip_ratio_region - b->clip_ratio_region,
                   a->cispo_clip_ratio - b->cispo_clip_ratio};
    double m = 0;
    for (int i = 0; i < 6; i++)
        m = isnan(d[i]) || isnan(m) ? NAN : fmax(m, fabs(d[i]));
    return m;
}

static void compare_all(report *rep, const ft_config *cfg, const ft_problem *p, const ft_runner *run,
                        const ft_reference *ref)
{
    const int64_t N = ft_problem_tokens(p), H = p->s.hidden, V = p->s.vocab;
    rep->loss_kernel = run->loss_value;
    rep->loss_ref = ref->loss;
    rep->abs_diff_loss = fabs(run->loss_value - ref->loss);
    rep->logp = ft_compare(ft_view_make(run->logp, FT_VIEW_F32), ref->logp, N);
    rep->entropy = ft_compare(ft_view_make(run->entropy, FT_VIEW_F32), ref->entropy, N);
    rep->metrics_max_abs = metrics_diff(&run->metrics, &ref->metrics);
    if (run->impl == FT_IMPL_LOGITS) {
        ft_view k = ft_view_make(run->logits, p->s.dtype == FT_DTYPE_BF16 ? FT_VIEW_BF16 : FT_VIEW_F32);
        rep->grads[rep->ngrads++] = (grad_diff){"dlogits", ft_compare(k, ref->grad_logits, N * V)};
    } else {
        rep->grads[rep->ngrads++] = (grad_diff){
            "dhidden", ft_compare(ft_view_make(run->grad_hidden, FT_VIEW_F32), ref->grad_hidden, N * H)};
        rep->grads[rep->ngrads++] = (grad_diff){
            "dweight", ft_compare(ft_view_make(run->grad_weight, FT_VIEW_F32), ref->grad_weight, V * H)};
        if (p->bias)
            rep->grads[rep->ngrads++] = (grad_diff){
                "dbias", ft_compare(ft_view_make(run->grad_bias, FT_VIEW_F32), ref->grad_bias, V)};
    }
    tolerances t = resolve_tolerances(cfg);
    rep->pass = 1;
    add_gate(rep, "abs_diff_loss", "tol_loss", rep->abs_diff_loss, t.loss, cfg->tol_loss);
    add_gate(rep, "logp_max_abs", "tol_logp", rep->logp.max_abs, t.logp, cfg->tol_logp);
    add_gate(rep, "entropy_max_abs", "tol_entropy", rep->entropy.max_abs, t.entropy, cfg->tol_entropy);
    for (int i = 0; i < rep->ngrads; i++) {
        char m[48];
        snprintf(m, sizeof m, "max_rel_diff_%s", rep->grads[i].name);
        add_gate(rep, m, "tol_grad_rel", rep->grads[i].d.max_rel, t.grad_rel, cfg->tol_grad_rel);
    }
}

static const char *ref_name(int kind)
{
    return kind == FT_REF_ORACLE ? "oracle (float64)" : "baseline (materialized float32)";
}

static void print_report(const report *r, const ft_config *cfg, const ft_problem *p, int ref_kind,
                         int quiet)
{
    if (!quiet) {
        printf("fusedgrpo gradcheck: impl %s, dtype %s%s, B=%lld T=%lld H=%lld V=%lld, "
               "%lld of %lld tokens unmasked\n",
               ft_impl_name(cfg->impl), ft_dtype_name(cfg->dtype),
               cfg->impl == FT_IMPL_BASELINE && cfg->round_logits ? " (logits rounded to bf16)" : "",
               (long long)p->s.batch, (long long)p->s.seq_len, (long long)p->s.hidden,
               (long long)p->s.vocab, (long long)ft_problem_unmasked(p), (long long)ft_problem_tokens(p));
        printf("loss_type %s, reference %s\n", ft_loss_type_name(cfg->loss_type), ref_name(ref_kind));
        printf("%-24s %.12e\n", "loss_ref", r->loss_ref);
        printf("%-24s %.12e\n", "loss_kernel", r->loss_kernel);
        printf("%-24s %.3e\n", "abs_diff_loss", r->abs_diff_loss);
        printf("%-24s %.3e\n", "logp_max_abs", r->logp.max_abs);
        printf("%-24s %.3e\n", "entropy_max_abs", r->entropy.max_abs);
        printf("%-24s %.3e\n", "metrics_max_abs", r->metrics_max_abs);
        for (int i = 0; i < r->ngrads; i++) {
            char k[48];
            snprintf(k, sizeof k, "max_abs_diff_%s", r->grads[i].name);
            printf("%-24s %.3e\n", k, r->grads[i].d.max_abs);
            snprintf(k, sizeof k, "max_rel_diff_%s", r->grads[i].name);
            printf("%-24s %.3e   (max|ref| %.3e)\n", k, r->grads[i].d.max_rel, r->grads[i].d.max_ref);
            if (r->grads[i].d.nonfinite)
                printf("%-24s %lld non-finite entries, first at %lld\n", "", 
                       (long long)r->grads[i].d.nonfinite, (long long)r->grads[i].d.argmax);
        }
        printf("(max_rel_diff = max|kernel - ref| / max|ref| over the whole tensor)\n");
        printf("%-24s %.3f s (kernel), %.3f s (reference)\n", "time", r->kernel_s, r->ref_s);
        printf("gates (tolerances: %s):\n", resolve_tolerances(cfg).why);
        for (int i = 0; i < r->ngates; i++) {
            const gate *g = &r->gates[i];
            printf("  %-22s %.3e <= %-12s %.1e%s  %s\n", g->metric, g->value, g->tol_key, g->tol,
                   g->is_auto ? " (auto)" : "", g->pass ? "PASS" : "FAIL");
        }
    }
    printf("gradcheck %s %s: %s\n", ft_impl_name(cfg->impl), ft_dtype_name(cfg->dtype),
           r->pass ? "PASS" : "FAIL");
}

static void json_diff(ft_json *j, const char *name, const ft_diff *d)
{
    char k[64];
    snprintf(k, sizeof k, "max_abs_diff_%s", name);
    ft_json_num(j, k, d->max_abs);
    snprintf(k, sizeof k, "max_rel_diff_%s", name);
    ft_json_num(j, k, d->max_rel);
    snprintf(k, sizeof k, "max_abs_ref_%s", name);
    ft_json_num(j, k, d->max_ref);
    snprintf(k, sizeof k, "nonfinite_%s", name);
    ft_json_int(j, k, d->nonfinite);
}

static int write_json(const char *path, const report *r, const ft_config *cfg, const ft_problem *p,
                      int ref_kind)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        fprintf(stderr, "fusedgrpo gradcheck: cannot write %s\n", path);
        return -1;
    }
    ft_json j;
    ft_json_init(&j, f);
    ft_json_object_begin(&j, NULL);
    ft_json_str(&j, "command", "gradcheck");
    ft_json_str(&j, "impl", ft_impl_name(cfg->impl));
    ft_json_str(&j, "dtype", ft_dtype_name(cfg->dtype));
    ft_json_str(&j, "reference", ref_kind == FT_REF_ORACLE ? "oracle" : "baseline");
    ft_json_int(&j, "tokens", ft_problem_tokens(p));
    ft_json_int(&j, "unmasked_tokens", ft_problem_unmasked(p));
    ft_json_num(&j, "loss_ref", r->loss_ref);
    ft_json_num(&j, "loss_kernel", r->loss_kernel);
    ft_json_num(&j, "abs_diff_loss", r->abs_diff_loss);
    ft_json_num(&j, "logp_max_abs", r->logp.max_abs);
    ft_json_num(&j, "entropy_max_abs", r->entropy.max_abs);
    ft_json_num(&j, "metrics_max_abs", r->metrics_max_abs);
    for (int i = 0; i < r->ngrads; i++)
        json_diff(&j, r->grads[i].name, &r->grads[i].d);
    ft_json_str(&j, "max_rel_definition", "max|kernel - ref| / max|ref| over the tensor");
    ft_json_num(&j, "kernel_s", r->kernel_s);
    ft_json_num(&j, "reference_s", r->ref_s);
    ft_json_array_begin(&j, "gates");
    for (int i = 0; i < r->ngates; i++) {
        ft_json_object_begin(&j, NULL);
        ft_json_str(&j, "metric", r->gates[i].metric);
        ft_json_str(&j, "tolerance_key", r->gates[i].tol_key);
        ft_json_num(&j, "value", r->gates[i].value);
        ft_json_num(&j, "tolerance", r->gates[i].tol);
        ft_json_bool(&j, "auto", r->gates[i].is_auto);
        ft_json_bool(&j, "pass", r->gates[i].pass);
        ft_json_object_end(&j);
    }
    ft_json_array_end(&j);
    ft_json_bool(&j, "pass", r->pass);
    ft_config_json(&j, "config", cfg);
    ft_json_object_end(&j);
    return fclose(f) == 0 ? 0 : -1;
}

int ft_cmd_gradcheck(int argc, char **argv)
{
    ft_cli cli;
    int rc = ft_cli_parse(&cli, argc, argv,
                          FT_OPT_JSON | FT_OPT_INPUTS | FT_OPT_DUMP | FT_OPT_SAVE_INPUTS, USAGE);
    if (rc != 0)
        return rc > 0 ? FT_EXIT_OK : FT_EXIT_USAGE;
    ft_config *cfg = &cli.cfg;
    char err[1024];
    ft_problem p;
    if (ft_inputs_make(cli.inputs, cfg, &p, err, sizeof err) != 0) {
        fprintf(stderr, "fusedgrpo gradcheck: %s\n", err);
        return FT_EXIT_USAGE;
    }
    int status = FT_EXIT_USAGE;
    ft_runner run;
    ft_reference ref;
    memset(&ref, 0, sizeof ref);
    int have_ref = 0;
    report rep;
    memset(&rep, 0, sizeof rep);
    int ref_kind = ft_reference_pick(cfg, &p);

    if (cli.save_inputs && ft_problem_save_dir(&p, cli.save_inputs, err, sizeof err) != 0) {
        fprintf(stderr, "fusedgrpo gradcheck: %s\n", err);
        goto done_problem;
    }
    if (ft_runner_init(&run, cfg, &p, cfg->impl, 0) != 0) {
        fprintf(stderr, "fusedgrpo gradcheck: %s\n", run.err);
        goto done;
    }
    double t0 = ft_now();
    if (cfg->impl == FT_IMPL_LOGITS) {
        /* The reference reads the logits before the kernel overwrites them in place. */
        if (ft_runner_materialize_logits(&run) != 0) {
            fprintf(stderr, "fusedgrpo gradcheck: %s\n", run.err);
            goto done;
        }
        t0 = ft_now();
        have_ref = 1;
        if (ft_reference_run(&ref, ref_kind, cfg, &p, cfg->impl, run.logits, err, sizeof err) != 0) {
            fprintf(stderr, "fusedgrpo gradcheck: %s\n", err);
            goto done;
        }
        rep.ref_s = ft_now() - t0;
        if (ft_runner_logits_kernel(&run) != 0) {
            fprintf(stderr, "fusedgrpo gradcheck: %s\n", run.err);
            goto done;
        }
        rep.kernel_s = run.kernel_s;
    } else {
        if (ft_runner_step(&run) != 0) {
            fprintf(stderr, "fusedgrpo gradcheck: %s\n", run.err);
            goto done;
        }
        rep.kernel_s = ft_now() - t0;
        /* The outputs are ours; the library's cached workspace (the whole
         * logits for baseline) need not sit beside the reference's. */
        fg_release_workspace(run.ctx);
        t0 = ft_now();
        have_ref = 1;
        if (ft_reference_run(&ref, ref_kind, cfg, &p, cfg->impl, NULL, err, sizeof err) != 0) {
            fprintf(stderr, "fusedgrpo gradcheck: %s\n", err);
            goto done;
        }
        rep.ref_s = ft_now() - t0;
    }
    compare_all(&rep, cfg, &p, &run, &ref);
    print_report(&rep, cfg, &p, ref_kind, cli.quiet);
    status = rep.pass ? FT_EXIT_OK : FT_EXIT_FAIL;
    if (cli.json && write_json(cli.json, &rep, cfg, &p, ref_kind) != 0)
        status = FT_EXIT_USAGE;
    if (cli.dump && ft_dump_outputs(cli.dump, &run, &p, err, sizeof err) != 0) {
        fprintf(stderr, "fusedgrpo gradcheck: %s\n", err);
        status = FT_EXIT_USAGE;
    }
done:
    if (have_ref)
        ft_reference_free(&ref);
    ft_runner_free(&run);
done_problem:
    ft_problem_destroy(&p);
    return status;
}
