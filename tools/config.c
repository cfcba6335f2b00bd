/* The config key table and everything it drives: see config.h. */
#define _POSIX_C_SOURCE 200809L
#include "config.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef enum key_type { K_INT, K_DOUBLE, K_BOOL, K_ENUM, K_BYTES } key_type;

typedef struct key_def {
    const char *name;
    key_type type;
    size_t offset;
    const char *def;
    double min, max;                  /* inclusive range of numeric keys */
    const char *const *names;         /* K_ENUM: the tool's value names, NULL-terminated */
    const char *(*lib_name)(int v);   /* K_ENUM: or the library's names (NULL past the end) */
    const char *auto_word;            /* non-NULL: the key may be "auto"/"off"; printed so.
                                         It stores a sentinel: NaN for doubles, -1 for ints */
    const char *help;
} key_def;

/* dtype names in fg_dtype order. */
static const char *const DTYPES[] = {"float32", "bfloat16", NULL};
static const char *const IMPLS[] = {"baseline", "logits", "fused", NULL};
static const char *const IS_RATIO[] = {"none", "token", "sequence", NULL};
static const char *const REFERENCES[] = {"auto", "oracle", "baseline", NULL};
static const char *loss_name(int v) { return fg_loss_type_name((fg_loss_type)v); }
static const char *level_name(int v) { return fg_is_level_name((fg_is_level)v); }

#define OFF(f) offsetof(ft_config, f)
#define BIG 9.0e18
#define NUM(name, type, def, min, max, help) {#name, type, OFF(name), def, min, max, NULL, NULL, NULL, help}
#define AUTO(name, type, def, min, max, word, help)                                                    \
    {#name, type, OFF(name), def, min, max, NULL, NULL, word, help}
#define BOOL(name, def, help) {#name, K_BOOL, OFF(name), def, 0, 0, NULL, NULL, NULL, help}
#define ENUM(name, def, names, fn, help) {#name, K_ENUM, OFF(name), def, 0, 0, names, fn, NULL, help}

static const key_def KEYS[] = {
    NUM(batch, K_INT, "2", 1, BIG, "B, sequences per batch"),
    NUM(seq_len, K_INT, "64", 1, BIG, "T, completion tokens per sequence"),
    NUM(hidden, K_INT, "128", 1, BIG, "H, hidden size"),
    NUM(vocab, K_INT, "1024", 1, BIG, "V, vocabulary size"),
    ENUM(dtype, "float32", DTYPES, NULL, "storage of hidden/weight/bias: float32 | bfloat16"),
    ENUM(impl, "fused", IMPLS, NULL,
         "baseline (materialized) | logits (fg_logits_grpo on tool-made logits) | fused"),
    BOOL(round_logits, "false", "baseline only: store logits in the input dtype (bf16) before the softmax"),
    NUM(memory_budget, K_BYTES, "0", 0, BIG,
        "fused working-memory cap in bytes (suffixes KiB/MiB/GiB); 0: library default; "
        "min: the planner's smallest (one token row a chunk)"),
    AUTO(filter_eps, K_DOUBLE, "0", 0, 1, "auto",
         "fused only: gradient filtering threshold (relative to a row's largest |dlogit|); 0: off; "
         "auto: the dtype's default"),
    NUM(threads, K_INT, "0", 0, FG_MAX_THREADS, "threads; 0: OpenMP default"),
    BOOL(check_finite, "true", "library scans inputs for NaN/Inf"),
    NUM(vocab_shards, K_INT, "1", 1, 256,
        "ranks that split the vocabulary (run under mpirun; ranks = vocab_shards x data_shards)"),
    NUM(data_shards, K_INT, "1", 1, 65536,
        "rows of ranks that split the batch, their gradients averaged as DDP does (under mpirun)"),

    ENUM(loss_type, "dapo", NULL, loss_name,
         "grpo | bnpo | dr_grpo | dapo | luspo | cispo | sapo | vespo"),
    ENUM(importance_sampling_level, "token", NULL, level_name, "token | sequence (GSPO)"),
    NUM(temperature, K_DOUBLE, "1.0", 1e-300, BIG, "logits are divided by it"),
    NUM(epsilon_low, K_DOUBLE, "0.2", 0, BIG, "lower clip"),
    AUTO(epsilon_high, K_DOUBLE, "auto", 0, BIG, "auto", "upper clip (cispo: ratio cap); auto: epsilon_low"),
    AUTO(delta, K_DOUBLE, "off", 1e-300, BIG, "off", "two-sided clip bound, or off"),
    NUM(beta, K_DOUBLE, "0.0", 0, BIG, "KL coefficient (needs use_ref_logp)"),
    AUTO(max_completion_length, K_INT, "auto", 1, BIG, "auto", "dr_grpo normalizer; auto: seq_len"),
    AUTO(num_items_in_batch, K_DOUBLE, "auto", 1e-300, BIG, "auto",
         "dapo/cispo normalizer; auto: unmasked tokens"),
    NUM(sapo_temperature_pos, K_DOUBLE, "1.0", 1e-300, BIG, "sapo tau for A > 0"),
    NUM(sapo_temperature_neg, K_DOUBLE, "1.05", 1e-300, BIG, "sapo tau for A <= 0"),
    BOOL(use_bias_correction_kl, "false", "multiply KL by the level's ratio"),
    NUM(entropy_coef, K_DOUBLE, "0.0", -BIG, BIG, "entropy bonus coefficient"),
    NUM(vespo_k_pos, K_DOUBLE, "2.0", 1e-300, BIG, "vespo gamma weight k for A >= 0"),
    NUM(vespo_lambda_pos, K_DOUBLE, "3.0", 1e-300, BIG, "vespo gamma weight lambda for A >= 0"),
    NUM(vespo_k_neg, K_DOUBLE, "3.0", 1e-300, BIG, "vespo gamma weight k for A < 0"),
    NUM(vespo_lambda_neg, K_DOUBLE, "2.0", 1e-300, BIG, "vespo gamma weight lambda for A < 0"),
    AUTO(off_policy_mask_threshold, K_DOUBLE, "off", -BIG, BIG, "off",
         "drop A < 0 sequences whose mean (old - logp) exceeds it, or off"),
    NUM(top_entropy_quantile, K_DOUBLE, "1.0", 0, 1,
        "policy loss and entropy bonus on tokens at or above this entropy quantile; 1: all"),

    BOOL(use_bias, "false", "LM head has a bias"),
    BOOL(use_old_logp, "true", "pass old log-probs (false: on-policy)"),
    BOOL(use_ref_logp, "false", "pass reference log-probs"),
    ENUM(is_ratio, "none", IS_RATIO, NULL, "sampler importance-sampling correction: none | token | sequence"),
    NUM(seed, K_INT, "1", 0, BIG, "seed of the synthetic batch"),
    NUM(logit_scale, K_DOUBLE, "2.0", 0, BIG, "std of the synthetic logits (weight ~ N(0, (scale^2)/H))"),
    NUM(mask_min_frac, K_DOUBLE, "0.5", 0, 1, "each sequence keeps a uniform length in [frac*T, T]"),
    NUM(old_logp_noise, K_DOUBLE, "0.15", 0, BIG,
        "std of old_logp - logp (spreads ratios across the clip bounds)"),
    NUM(ref_logp_noise, K_DOUBLE, "0.1", 0, BIG, "std of ref_logp - logp"),

    NUM(warmup, K_INT, "1", 0, BIG, "bench: untimed steps, the cold first step included"),
    NUM(steps, K_INT, "5", 1, BIG, "bench: timed steps"),
    NUM(roofline_reps, K_INT, "3", 0, BIG,
        "bench: repetitions of the bare-GEMM roofline (median); 0: skip it"),

    ENUM(reference, "auto", REFERENCES, NULL,
         "gradcheck reference: auto | oracle (float64) | baseline (materialized float32)"),
    NUM(oracle_limit, K_DOUBLE, "2e9", 0, BIG, "reference=auto uses the oracle while N*V*H <= this"),
    AUTO(tol_loss, K_DOUBLE, "auto", 0, BIG, "auto", "gate: |loss_kernel - loss_ref|; auto: by dtype"),
    AUTO(tol_logp, K_DOUBLE, "auto", 0, BIG, "auto", "gate: max |logp_kernel - logp_ref|; auto: by dtype"),
    AUTO(tol_entropy, K_DOUBLE, "auto", 0, BIG, "auto",
         "gate: max |entropy_kernel - entropy_ref|; auto: by dtype"),
    AUTO(tol_grad_rel, K_DOUBLE, "auto", 0, BIG, "auto",
         "gate: max|a-b|/max|b| of every gradient; auto: by dtype"),
};

#define NKEYS (sizeof KEYS / sizeof KEYS[0])

/* Words that mean "derived" for a key with an auto_word (YAML's nulls arrive as ""). */
static const char *const AUTO_WORDS[] = {"auto", "off", "none", "null", "~", "default", ""};

/* names[v], or NULL past the end of the NULL-terminated list. */
static const char *name_in(const char *const *names, int v)
{
    for (int i = 0; names[i]; i++)
        if (i == v)
            return names[i];
    return NULL;
}

static const char *value_name(const key_def *k, int v)
{
    return k->lib_name ? k->lib_name(v) : name_in(k->names, v);
}
const char *ft_impl_name(int impl) { return name_in(IMPLS, impl) ? name_in(IMPLS, impl) : "?"; }
const char *ft_dtype_name(int dtype) { return name_in(DTYPES, dtype) ? name_in(DTYPES, dtype) : "?"; }

static const key_def *find_key(const char *name)
{
    for (size_t i = 0; i < NKEYS; i++)
        if (strcmp(KEYS[i].name, name) == 0)
            return &KEYS[i];
    return NULL;
}

int ft_error(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (err != NULL && errlen > 0)
        vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

int ft_config_fail(char *err, size_t errlen, const char *origin, long line, const char *fmt, ...)
{
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (origin && line > 0)
        return ft_error(err, errlen, "%s:%ld: %s", origin, line, msg);
    return ft_error(err, errlen, "%s%s%s", origin ? origin : "", origin ? ": " : "", msg);
}

int ft_config_set(ft_config *cfg, const char *key, const char *value, const char *origin,
                  long line, char *err, size_t errlen)
{
#define FAIL(...) ft_config_fail(err, errlen, origin, line, __VA_ARGS__)
    const key_def *k = find_key(key);
    if (k == NULL)
        return FAIL("unknown key '%s' (`fusedgrpo config --keys` lists them)", key);
    char *field = (char *)cfg + k->offset;
    for (size_t w = 0; k->auto_word && w < sizeof AUTO_WORDS / sizeof AUTO_WORDS[0]; w++)
        if (strcasecmp(value, AUTO_WORDS[w]) == 0) {
            if (k->type == K_DOUBLE)
                *(double *)field = NAN;
            else
                *(int64_t *)field = -1;
            return 0;
        }
    const char *or_auto = !k->auto_word ? "" : strcmp(k->auto_word, "off") == 0 ? " or off" : " or auto";
    int64_t i;
    double d;
    uint64_t u;
    switch (k->type) {
    case K_INT:
        if (ft_parse_int64(value, &i) != 0)
            return FAIL("key '%s': expected an integer%s, got '%s'", key, or_auto, value);
        if ((double)i < k->min || (double)i > k->max)
            return FAIL("key '%s': %lld is out of range [%.0f, %.3g]", key, (long long)i, k->min, k->max);
        *(int64_t *)field = i;
        return 0;
    case K_DOUBLE:
        if (ft_parse_double(value, &d) != 0)
            return FAIL("key '%s': expected a finite number%s, got '%s'", key, or_auto, value);
        if (d < k->min || d > k->max)
            return FAIL("key '%s': %g is out of range [%g, %g]", key, d, k->min, k->max);
        *(double *)field = d;
        return 0;
    case K_BOOL:
        if (ft_parse_bool(value, (int *)field) != 0)
            return FAIL("key '%s': expected true or false, got '%s'", key, value);
        return 0;
    case K_ENUM: {
        char choices[256] = "";
        for (int v = 0; value_name(k, v); v++) {
            if (strcmp(value_name(k, v), value) == 0) {
                *(int *)field = v;
                return 0;
            }
            size_t used = strlen(choices);
            snprintf(choices + used, sizeof choices - used, "%s%s", v ? " | " : "", value_name(k, v));
        }
        return FAIL("key '%s': expected one of %s, got '%s'", key, choices, value);
    }
    case K_BYTES:
        if (strcmp(value, "min") != 0 && ft_parse_bytes(value, &u) != 0)
            return FAIL("key '%s': expected a byte count such as 4096 or 128MiB, got '%s'", key, value);
        *(uint64_t *)field = strcmp(value, "min") == 0 ? FT_BUDGET_MIN : u;
        return 0;
    }
    return -1;
#undef FAIL
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
    char key[128];
    const size_t klen = eq ? (size_t)(eq - assignment) : 0;
    if (klen == 0 || klen >= sizeof key)
        return ft_config_fail(err, errlen, "--set", 0, "expected key=value, got '%s'", assignment);
    memcpy(key, assignment, klen);
    key[klen] = '\0';
    return ft_config_set(cfg, key, eq + 1, "--set", 0, err, errlen);
}

int ft_config_format(const ft_config *cfg, const char *key, char *buf, size_t n)
{
    const key_def *k = find_key(key);
    if (k == NULL)
        return -1;
    const char *field = (const char *)cfg + k->offset;
    switch (k->type) {
    case K_INT:
        if (k->auto_word && *(const int64_t *)field == -1)
            snprintf(buf, n, "%s", k->auto_word);
        else
            snprintf(buf, n, "%lld", (long long)*(const int64_t *)field);
        return 0;
    case K_DOUBLE:
        if (k->auto_word && isnan(*(const double *)field)) {
            snprintf(buf, n, "%s", k->auto_word);
            return 0;
        }
        /* The shortest %g that reads back to the same double (0.2, not
         * 0.20000000000000001), kept a float when it looks like an int. */
        for (int prec = 1; prec <= 17; prec++)
            if (snprintf(buf, n, "%.*g", prec, *(const double *)field) > 0 &&
                strtod(buf, NULL) == *(const double *)field)
                break;
        if (strspn(buf, "-0123456789") == strlen(buf) && strlen(buf) + 2 < n)
            strcat(buf, ".0");
        return 0;
    case K_BOOL:
        snprintf(buf, n, "%s", *(const int *)field ? "true" : "false");
        return 0;
    case K_ENUM:
        snprintf(buf, n, "%s", value_name(k, *(const int *)field) ? value_name(k, *(const int *)field) : "?");
        return 0;
    case K_BYTES:
        ft_format_bytes(*(const uint64_t *)field, buf, n);
        if (*(const uint64_t *)field == FT_BUDGET_MIN)
            snprintf(buf, n, "min");
        return 0;
    }
    return -1;
}

void ft_config_print(const ft_config *cfg, FILE *out, int verbose)
{
    for (size_t i = 0; i < NKEYS; i++) {
        char val[128], kv[192];
        ft_config_format(cfg, KEYS[i].name, val, sizeof val);
        snprintf(kv, sizeof kv, "%s: %s", KEYS[i].name, val);
        fprintf(out, "%-*s%s%s\n", verbose ? 36 : 0, kv, verbose ? " # " : "", verbose ? KEYS[i].help : "");
    }
}

size_t ft_config_key_count(void) { return NKEYS; }
const char *ft_config_key_name(size_t i) { return i < NKEYS ? KEYS[i].name : NULL; }

int ft_config_check(const ft_config *cfg, char *err, size_t errlen)
{
    if (cfg->beta != 0.0 && !cfg->use_ref_logp)
        return ft_config_fail(err, errlen, NULL, 0,
                              "beta = %g needs reference log-probs: set use_ref_logp: true", cfg->beta);
    /* N*V*H fits int64 comfortably below this; larger would overflow sizes anyway. */
    if ((double)cfg->batch * (double)cfg->seq_len * (double)cfg->vocab * (double)cfg->hidden > 9.0e18)
        return ft_config_fail(err, errlen, NULL, 0, "batch*seq_len*hidden*vocab is too large");
    return 0;
}
