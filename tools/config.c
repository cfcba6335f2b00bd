/* The config key table and everything it drives: see config.h. */
#define _POSIX_C_SOURCE 200809L
#include "config.h"

#include "units.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef enum key_type { K_INT, K_DOUBLE, K_BOOL, K_ENUM, K_BYTES, K_U64 } key_type;

/* A key whose default is derived (epsilon_high = epsilon_low, ...) accepts
 * one of AUTO_WORDS and stores a sentinel: NaN for doubles, -1 for ints. */
#define AUTO_NONE NULL

typedef struct key_def {
    const char *name;
    key_type type;
    size_t offset;
    const char *def;
    double min, max;          /* inclusive range of numeric keys */
    const char *const *names; /* K_ENUM: value names, NULL-terminated */
    const char *auto_word;    /* non-NULL: the key may be "auto"/"off"; printed so */
    const char *help;
} key_def;

static const char *const DTYPES[] = {"float32", "bfloat16", NULL};
static const char *const IMPLS[] = {"baseline", "logits", "fused", NULL};
/* Same order as fg_loss_type / fg_is_level. */
static const char *const LOSS_TYPES[] = {"grpo", "bnpo", "dr_grpo", "dapo",
                                         "luspo", "cispo", "sapo", NULL};
static const char *const LEVELS[] = {"token", "sequence", NULL};
static const char *const IS_RATIO[] = {"none", "token", "sequence", NULL};
static const char *const REFERENCES[] = {"auto", "oracle", "baseline", NULL};

#define OFF(f) offsetof(ft_config, f)
#define BIG 9.0e18

static const key_def KEYS[] = {
    {"batch", K_INT, OFF(batch), "2", 1, BIG, NULL, AUTO_NONE, "B, sequences per batch"},
    {"seq_len", K_INT, OFF(seq_len), "64", 1, BIG, NULL, AUTO_NONE, "T, completion tokens per sequence"},
    {"hidden", K_INT, OFF(hidden), "128", 1, BIG, NULL, AUTO_NONE, "H, hidden size"},
    {"vocab", K_INT, OFF(vocab), "1024", 1, BIG, NULL, AUTO_NONE, "V, vocabulary size"},
    {"dtype", K_ENUM, OFF(dtype), "float32", 0, 0, DTYPES, AUTO_NONE,
     "storage of hidden/weight/bias: float32 | bfloat16"},
    {"impl", K_ENUM, OFF(impl), "fused", 0, 0, IMPLS, AUTO_NONE,
     "baseline (materialized) | logits (fg_logits_grpo on tool-made logits) | fused"},
    {"round_logits", K_BOOL, OFF(round_logits), "false", 0, 0, NULL, AUTO_NONE,
     "baseline only: store logits in the input dtype (bf16) before the softmax"},
    {"memory_budget", K_BYTES, OFF(memory_budget), "0", 0, BIG, NULL, AUTO_NONE,
     "fused working-memory cap in bytes (suffixes KiB/MiB/GiB); 0: library default; "
     "min: the planner's smallest (one token row a chunk)"},
    {"threads", K_INT, OFF(threads), "0", 0, 4096, NULL, AUTO_NONE, "threads; 0: OpenMP default"},
    {"check_finite", K_BOOL, OFF(check_finite), "true", 0, 0, NULL, AUTO_NONE,
     "library scans inputs for NaN/Inf"},

    {"loss_type", K_ENUM, OFF(loss_type), "dapo", 0, 0, LOSS_TYPES, AUTO_NONE,
     "grpo | bnpo | dr_grpo | dapo | luspo | cispo | sapo"},
    {"importance_sampling_level", K_ENUM, OFF(importance_sampling_level), "token", 0, 0, LEVELS,
     AUTO_NONE, "token | sequence (GSPO)"},
    {"temperature", K_DOUBLE, OFF(temperature), "1.0", 1e-300, BIG, NULL, AUTO_NONE,
     "logits are divided by it"},
    {"epsilon_low", K_DOUBLE, OFF(epsilon_low), "0.2", 0, BIG, NULL, AUTO_NONE, "lower clip"},
    {"epsilon_high", K_DOUBLE, OFF(epsilon_high), "auto", 0, BIG, NULL, "auto",
     "upper clip (cispo: ratio cap); auto: epsilon_low"},
    {"delta", K_DOUBLE, OFF(delta), "off", 1e-300, BIG, NULL, "off", "two-sided clip bound, or off"},
    {"beta", K_DOUBLE, OFF(beta), "0.0", -BIG, BIG, NULL, AUTO_NONE, "KL coefficient (needs use_ref_logp)"},
    {"max_completion_length", K_INT, OFF(max_completion_length), "auto", 1, BIG, NULL, "auto",
     "dr_grpo normalizer; auto: seq_len"},
    {"num_items_in_batch", K_DOUBLE, OFF(num_items_in_batch), "auto", 0, BIG, NULL, "auto",
     "dapo/cispo normalizer; auto: unmasked tokens"},
    {"sapo_temperature_pos", K_DOUBLE, OFF(sapo_temperature_pos), "1.0", 1e-300, BIG, NULL, AUTO_NONE,
     "sapo tau for A > 0"},
    {"sapo_temperature_neg", K_DOUBLE, OFF(sapo_temperature_neg), "1.05", 1e-300, BIG, NULL, AUTO_NONE,
     "sapo tau for A <= 0"},
    {"use_bias_correction_kl", K_BOOL, OFF(use_bias_correction_kl), "false", 0, 0, NULL, AUTO_NONE,
     "multiply KL by the token ratio"},
    {"entropy_coef", K_DOUBLE, OFF(entropy_coef), "0.0", -BIG, BIG, NULL, AUTO_NONE,
     "entropy bonus coefficient"},

    {"use_bias", K_BOOL, OFF(use_bias), "false", 0, 0, NULL, AUTO_NONE, "LM head has a bias"},
    {"use_old_logp", K_BOOL, OFF(use_old_logp), "true", 0, 0, NULL, AUTO_NONE,
     "pass old log-probs (false: on-policy)"},
    {"use_ref_logp", K_BOOL, OFF(use_ref_logp), "false", 0, 0, NULL, AUTO_NONE, "pass reference log-probs"},
    {"is_ratio", K_ENUM, OFF(is_ratio), "none", 0, 0, IS_RATIO, AUTO_NONE,
     "sampler importance-sampling correction: none | token | sequence"},
    {"seed", K_U64, OFF(seed), "1", 0, 0, NULL, AUTO_NONE, "seed of the synthetic batch"},
    {"logit_scale", K_DOUBLE, OFF(logit_scale), "2.0", 0, BIG, NULL, AUTO_NONE,
     "std of the synthetic logits (weight ~ N(0, (scale^2)/H))"},
    {"mask_min_frac", K_DOUBLE, OFF(mask_min_frac), "0.5", 0, 1, NULL, AUTO_NONE,
     "each sequence keeps a uniform length in [frac*T, T]"},
    {"old_logp_noise", K_DOUBLE, OFF(old_logp_noise), "0.15", 0, BIG, NULL, AUTO_NONE,
     "std of old_logp - logp (spreads ratios across the clip bounds)"},
    {"ref_logp_noise", K_DOUBLE, OFF(ref_logp_noise), "0.1", 0, BIG, NULL, AUTO_NONE,
     "std of ref_logp - logp"},

    {"warmup", K_INT, OFF(warmup), "1", 0, BIG, NULL, AUTO_NONE,
     "bench: untimed steps, the cold first step included"},
    {"steps", K_INT, OFF(steps), "5", 1, BIG, NULL, AUTO_NONE, "bench: timed steps"},
    {"roofline_reps", K_INT, OFF(roofline_reps), "3", 0, BIG, NULL, AUTO_NONE,
     "bench: repetitions of fg_time_bare_gemms; 0: skip the roofline"},

    {"reference", K_ENUM, OFF(reference), "auto", 0, 0, REFERENCES, AUTO_NONE,
     "gradcheck reference: auto | oracle (float64) | baseline (materialized float32)"},
    {"oracle_limit", K_DOUBLE, OFF(oracle_limit), "2e9", 0, BIG, NULL, AUTO_NONE,
     "reference=auto uses the oracle while N*V*H <= this"},
    {"tol_loss", K_DOUBLE, OFF(tol_loss), "auto", 0, BIG, NULL, "auto",
     "gate: |loss_kernel - loss_ref|; auto: by dtype"},
    {"tol_logp", K_DOUBLE, OFF(tol_logp), "auto", 0, BIG, NULL, "auto",
     "gate: max |logp_kernel - logp_ref|; auto: by dtype"},
    {"tol_entropy", K_DOUBLE, OFF(tol_entropy), "auto", 0, BIG, NULL, "auto",
     "gate: max |entropy_kernel - entropy_ref|; auto: by dtype"},
    {"tol_grad_rel", K_DOUBLE, OFF(tol_grad_rel), "auto", 0, BIG, NULL, "auto",
     "gate: max|a-b|/max|b| of every gradient; auto: by dtype"},
};

#define NKEYS (sizeof KEYS / sizeof KEYS[0])

static const char *const AUTO_WORDS[] = {"auto", "off", "none", "null", "~", "default", NULL};

static const char *enum_name(const char *const *names, int v)
{
    for (int i = 0; names[i]; i++)
        if (i == v)
            return names[i];
    return "?";
}

const char *ft_impl_name(int impl) { return enum_name(IMPLS, impl); }
const char *ft_dtype_name(int dtype) { return enum_name(DTYPES, dtype); }
const char *ft_loss_type_name(int loss_type) { return enum_name(LOSS_TYPES, loss_type); }

int ft_impl_parse(const char *name, int *out)
{
    for (int i = 0; IMPLS[i]; i++)
        if (strcmp(IMPLS[i], name) == 0) {
            *out = i;
            return 0;
        }
    return -1;
}

static const key_def *find_key(const char *name)
{
    for (size_t i = 0; i < NKEYS; i++)
        if (strcmp(KEYS[i].name, name) == 0)
            return &KEYS[i];
    return NULL;
}

static int is_auto_word(const char *s)
{
    for (int i = 0; AUTO_WORDS[i]; i++)
        if (strcasecmp(s, AUTO_WORDS[i]) == 0)
            return 1;
    return *s == '\0';
}

static void set_err(char *err, size_t errlen, const char *origin, long line, const char *fmt, ...)
{
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (err == NULL || errlen == 0)
        return;
    if (origin && line > 0)
        snprintf(err, errlen, "%s:%ld: %s", origin, line, msg);
    else if (origin)
        snprintf(err, errlen, "%s: %s", origin, msg);
    else
        snprintf(err, errlen, "%s", msg);
}

static void enum_choices(const char *const *names, char *buf, size_t n)
{
    buf[0] = '\0';
    for (int i = 0; names[i]; i++) {
        size_t used = strlen(buf);
        snprintf(buf + used, n - used, "%s%s", i ? " | " : "", names[i]);
    }
}

int ft_config_set(ft_config *cfg, const char *key, const char *value, const char *origin,
                  long line, char *err, size_t errlen)
{
    const key_def *k = find_key(key);
    if (k == NULL) {
        set_err(err, errlen, origin, line, "unknown key '%s' (`fusedgrpo config --keys` lists them)",
                key);
        return -1;
    }
    char *field = (char *)cfg + k->offset;
    if (k->auto_word && is_auto_word(value)) {
        if (k->type == K_DOUBLE)
            *(double *)field = NAN;
        else
            *(int64_t *)field = -1;
        return 0;
    }
    switch (k->type) {
    case K_INT: {
        int64_t v;
        if (ft_parse_int64(value, &v) != 0) {
            set_err(err, errlen, origin, line, "key '%s': expected an integer%s, got '%s'", key,
                    k->auto_word ? " or auto" : "", value);
            return -1;
        }
        if ((double)v < k->min || (double)v > k->max) {
            set_err(err, errlen, origin, line, "key '%s': %lld is out of range [%.0f, %.3g]", key,
                    (long long)v, k->min, k->max);
            return -1;
        }
        *(int64_t *)field = v;
        return 0;
    }
    case K_DOUBLE: {
        double v;
        if (ft_parse_double(value, &v) != 0) {
            set_err(err, errlen, origin, line, "key '%s': expected a finite number%s, got '%s'", key,
                    k->auto_word ? (strcmp(k->auto_word, "off") == 0 ? " or off" : " or auto") : "",
                    value);
            return -1;
        }
        if (v < k->min || v > k->max) {
            set_err(err, errlen, origin, line, "key '%s': %g is out of range [%g, %g]", key, v,
                    k->min, k->max);
            return -1;
        }
        *(double *)field = v;
        return 0;
    }
    case K_BOOL: {
        int v;
        if (ft_parse_bool(value, &v) != 0) {
            set_err(err, errlen, origin, line, "key '%s': expected true or false, got '%s'", key,
                    value);
            return -1;
        }
        *(int *)field = v;
        return 0;
    }
    case K_ENUM:
        for (int i = 0; k->names[i]; i++)
            if (strcmp(k->names[i], value) == 0) {
                *(int *)field = i;
                return 0;
            }
        {
            char choices[256];
            enum_choices(k->names, choices, sizeof choices);
            set_err(err, errlen, origin, line, "key '%s': expected one of %s, got '%s'", key,
                    choices, value);
        }
        return -1;
    case K_BYTES: {
        uint64_t v;
        if (strcmp(value, "min") == 0) {
            *(uint64_t *)field = FT_BUDGET_MIN;
            return 0;
        }
        if (ft_parse_bytes(value, &v) != 0) {
            set_err(err, errlen, origin, line,
                    "key '%s': expected a byte count such as 4096 or 128MiB, got '%s'", key, value);
            return -1;
        }
        *(uint64_t *)field = v;
        return 0;
    }
    case K_U64: {
        int64_t v;
        if (ft_parse_int64(value, &v) != 0 || v < 0) {
            set_err(err, errlen, origin, line, "key '%s': expected a non-negative integer, got '%s'",
                    key, value);
            return -1;
        }
        *(uint64_t *)field = (uint64_t)v;
        return 0;
    }
    }
    return -1;
}

void ft_config_defaults(ft_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < NKEYS; i++)
        if (ft_config_set(cfg, KEYS[i].name, KEYS[i].def, "default", 0, NULL, 0) != 0)
            abort(); /* a broken table is a programming error; test_config catches it */
}

int ft_config_set_assignment(ft_config *cfg, const char *assignment, char *err, size_t errlen)
{
    const char *eq = strchr(assignment, '=');
    if (eq == NULL || eq == assignment) {
        set_err(err, errlen, "--set", 0, "expected key=value, got '%s'", assignment);
        return -1;
    }
    char key[128];
    size_t klen = (size_t)(eq - assignment);
    if (klen >= sizeof key) {
        set_err(err, errlen, "--set", 0, "key too long in '%s'", assignment);
        return -1;
    }
    memcpy(key, assignment, klen);
    key[klen] = '\0';
    return ft_config_set(cfg, key, eq + 1, "--set", 0, err, errlen);
}

/* The shortest %g spelling that reads back to the same double, so printed
 * configs say 0.2 rather than 0.20000000000000001 and still round-trip. */
static void format_double(double v, char *buf, size_t n)
{
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            break;
    }
    /* A bare integer would read back as an int-looking value: keep it a float. */
    if (strspn(buf, "-0123456789") == strlen(buf) && strlen(buf) + 2 < n)
        strcat(buf, ".0");
}

int ft_config_format(const ft_config *cfg, const char *key, char *buf, size_t n)
{
    const key_def *k = find_key(key);
    if (k == NULL)
        return -1;
    const char *field = (const char *)cfg + k->offset;
    switch (k->type) {
    case K_INT: {
        int64_t v = *(const int64_t *)field;
        if (k->auto_word && v == -1)
            snprintf(buf, n, "%s", k->auto_word);
        else
            snprintf(buf, n, "%lld", (long long)v);
        return 0;
    }
    case K_DOUBLE: {
        double v = *(const double *)field;
        if (k->auto_word && isnan(v))
            snprintf(buf, n, "%s", k->auto_word);
        else
            format_double(v, buf, n);
        return 0;
    }
    case K_BOOL:
        snprintf(buf, n, "%s", *(const int *)field ? "true" : "false");
        return 0;
    case K_ENUM:
        snprintf(buf, n, "%s", enum_name(k->names, *(const int *)field));
        return 0;
    case K_BYTES:
        if (*(const uint64_t *)field == FT_BUDGET_MIN)
            snprintf(buf, n, "min");
        else
            ft_format_bytes(*(const uint64_t *)field, buf, n);
        return 0;
    case K_U64:
        snprintf(buf, n, "%llu", (unsigned long long)*(const uint64_t *)field);
        return 0;
    }
    return -1;
}

void ft_config_print(const ft_config *cfg, FILE *out, int verbose)
{
    for (size_t i = 0; i < NKEYS; i++) {
        char val[128];
        ft_config_format(cfg, KEYS[i].name, val, sizeof val);
        if (verbose) {
            char kv[192];
            snprintf(kv, sizeof kv, "%s: %s", KEYS[i].name, val);
            fprintf(out, "%-36s # %s\n", kv, KEYS[i].help);
        }
        else
            fprintf(out, "%s: %s\n", KEYS[i].name, val);
    }
}

size_t ft_config_key_count(void) { return NKEYS; }
const char *ft_config_key_name(size_t i) { return i < NKEYS ? KEYS[i].name : NULL; }
const char *ft_config_key_help(size_t i) { return i < NKEYS ? KEYS[i].help : NULL; }

int ft_config_key_allows_auto(const char *key)
{
    const key_def *k = find_key(key);
    return k && k->auto_word != NULL;
}

int ft_config_key_is_numeric(const char *key)
{
    const key_def *k = find_key(key);
    return k && (k->type == K_INT || k->type == K_DOUBLE || k->type == K_BYTES || k->type == K_U64);
}

int ft_config_check(const ft_config *cfg, char *err, size_t errlen)
{
    if (cfg->beta != 0.0 && !cfg->use_ref_logp) {
        set_err(err, errlen, NULL, 0, "beta = %g needs reference log-probs: set use_ref_logp: true",
                cfg->beta);
        return -1;
    }
    if (cfg->oracle_limit < 0) {
        set_err(err, errlen, NULL, 0, "oracle_limit must be >= 0");
        return -1;
    }
    /* N*V*H fits int64 comfortably below this; larger would overflow sizes anyway. */
    double nvh = (double)cfg->batch * (double)cfg->seq_len * (double)cfg->vocab * (double)cfg->hidden;
    if (nvh > 9.0e18) {
        set_err(err, errlen, NULL, 0, "batch*seq_len*hidden*vocab is too large");
        return -1;
    }
    return 0;
}
