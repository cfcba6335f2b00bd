/*
 * The tool's configuration: one struct, one table of known keys.
 *
 * Every key lives in exactly one table row (name, type, offset into
 * ft_config, default, range, help). That single table drives the YAML loader,
 * `--set key=value`, the defaults, `fusedgrpo config` printing and the
 * re-serialisation that bench uses to hand its config to child processes, so
 * a new knob is one line and can never be parsed by one path and ignored by
 * another.
 */
#ifndef FT_CONFIG_H
#define FT_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Enumerations stored as int. The loss/level/dtype values are the library's
 * fg_loss_type / fg_is_level / fg_dtype values (same order, checked in the
 * runner) so that this file needs no library symbols and can be unit-tested
 * on its own. */
enum { FT_DTYPE_F32 = 0, FT_DTYPE_BF16 = 1 };
enum { FT_IMPL_BASELINE = 0, FT_IMPL_LOGITS = 1, FT_IMPL_FUSED = 2, FT_IMPL_COUNT = 3 };
enum { FT_REF_AUTO = 0, FT_REF_ORACLE = 1, FT_REF_BASELINE = 2 };
enum { FT_ISR_NONE = 0, FT_ISR_TOKEN = 1, FT_ISR_SEQUENCE = 2 };
/* memory_budget "min": the smallest budget the library's planner
 * (fg_linear_grpo_plan) gives for the run, one token row a chunk. */
#define FT_BUDGET_MIN UINT64_MAX

typedef struct ft_config {
    /* problem shape and storage */
    int64_t batch, seq_len, hidden, vocab;
    int dtype;
    int impl;
    int round_logits;
    uint64_t memory_budget; /* 0: the library default; FT_BUDGET_MIN: the planner's smallest */
    int64_t threads;        /* 0: the OpenMP default */
    int check_finite;

    /* loss options (LOSS_SPEC.md); "auto" is stored as NaN / -1 */
    int loss_type;
    int importance_sampling_level;
    double temperature, epsilon_low, epsilon_high, delta, beta;
    int64_t max_completion_length;
    double num_items_in_batch;
    double sapo_temperature_pos, sapo_temperature_neg;
    int use_bias_correction_kl;
    double entropy_coef;

    /* which optional inputs exist, and how the synthetic batch looks */
    int use_bias, use_old_logp, use_ref_logp, is_ratio;
    uint64_t seed;
    double logit_scale, mask_min_frac, old_logp_noise, ref_logp_noise;

    /* timing */
    int64_t warmup, steps, roofline_reps;

    /* gradcheck */
    int reference;
    double oracle_limit;
    double tol_loss, tol_logp, tol_entropy, tol_grad_rel;
} ft_config;

/* Names of the enum keys' values, in enum order (for messages and tables). */
const char *ft_impl_name(int impl);
const char *ft_dtype_name(int dtype);
const char *ft_loss_type_name(int loss_type);
int ft_impl_parse(const char *name, int *out);

/* The table's defaults (cannot fail: the defaults are checked by a test). */
void ft_config_defaults(ft_config *cfg);

/* Loads a flat YAML mapping `key: value` from a file / from memory. Unknown
 * keys, duplicates, nested values and ill-typed values are refused with
 * "ORIGIN:LINE: key 'k': why" in err. Keys absent from the file keep their
 * current value. 0 on success, -1 on error. */
int ft_config_load_file(ft_config *cfg, const char *path, char *err, size_t errlen);
int ft_config_load_string(ft_config *cfg, const char *text, size_t len,
                          const char *origin, char *err, size_t errlen);

/* One assignment "key=value" (the --set form). */
int ft_config_set_assignment(ft_config *cfg, const char *assignment, char *err,
                             size_t errlen);
/* One key: origin and line (<= 0: none) only shape the error message. */
int ft_config_set(ft_config *cfg, const char *key, const char *value, const char *origin,
                  long line, char *err, size_t errlen);

/* Cross-key consistency (e.g. beta != 0 needs use_ref_logp). */
int ft_config_check(const ft_config *cfg, char *err, size_t errlen);

/* Text of one key's value, exactly as ft_config_set reads it back. */
int ft_config_format(const ft_config *cfg, const char *key, char *buf, size_t n);
/* The whole config as YAML, with each key's help as a comment when verbose. */
void ft_config_print(const ft_config *cfg, FILE *out, int verbose);

size_t ft_config_key_count(void);
const char *ft_config_key_name(size_t i);
const char *ft_config_key_help(size_t i);
int ft_config_key_is_numeric(const char *key);
int ft_config_key_allows_auto(const char *key); /* "auto"/"off" (and an empty value) accepted */

#endif
