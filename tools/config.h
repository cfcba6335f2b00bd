/*
 * The tool's configuration: one struct, one table of known keys.
 *
 * Every key lives in exactly one table row (name, type, offset into
 * ft_config, default, range, help). That table drives the YAML loader,
 * `--set key=value`, the defaults, `fusedgrpo config` and the JSON copy of
 * the config in every report, so a new knob is one line and can never be
 * parsed by one path and ignored by another.
 */
#ifndef FT_CONFIG_H
#define FT_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fusedgrpo.h"

/* Enumerations stored as int. dtype holds fg_dtype values, loss_type and
 * importance_sampling_level the library's fg_loss_type / fg_is_level, whose
 * names come from the library's own name functions. */
enum { FT_IMPL_BASELINE = 0, FT_IMPL_LOGITS = 1, FT_IMPL_FUSED = 2, FT_IMPL_COUNT = 3 };
enum { FT_REF_AUTO = 0, FT_REF_ORACLE = 1, FT_REF_BASELINE = 2 };
enum { FT_ISR_NONE = 0, FT_ISR_TOKEN = 1, FT_ISR_SEQUENCE = 2 };
/* memory_budget "min": the smallest budget the library's planner
 * (fg_linear_grpo_plan) gives for the run, one token row a chunk. */
#define FT_BUDGET_MIN UINT64_MAX

/* Key by key as in the table (config.c); "auto" is stored as NaN / -1. */
typedef struct ft_config {
    int64_t batch, seq_len, hidden, vocab;
    int dtype, impl, round_logits;
    uint64_t memory_budget; /* 0: the library default; FT_BUDGET_MIN: the planner's smallest */
    double filter_eps;      /* NaN: auto (FG_FILTER_EPS_AUTO) */
    int64_t threads;        /* 0: the OpenMP default */
    int check_finite;
    int64_t vocab_shards, data_shards; /* MPI ranks (sharded.h); 1 x 1: one process */
    int loss_type, importance_sampling_level;
    double temperature, epsilon_low, epsilon_high, delta, beta;
    int64_t max_completion_length;
    double num_items_in_batch, sapo_temperature_pos, sapo_temperature_neg;
    int use_bias_correction_kl;
    double entropy_coef;
    double vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg;
    double off_policy_mask_threshold; /* NaN: off */
    double top_entropy_quantile;
    int use_bias, use_old_logp, use_ref_logp, is_ratio;
    int64_t seed;
    double logit_scale, mask_min_frac, old_logp_noise, ref_logp_noise;
    int64_t warmup, steps, roofline_reps;
    int reference;
    double oracle_limit, tol_loss, tol_logp, tol_entropy, tol_grad_rel;
} ft_config;

/* Names of the enum keys' values ("?" when out of range). */
const char *ft_impl_name(int impl);
const char *ft_dtype_name(int dtype);

/* The table's defaults (cannot fail: the defaults are checked by a test). */
void ft_config_defaults(ft_config *cfg);

/* The functions below return 0, or -1 with a message in err. */
/* Loads a flat YAML mapping `key: value` from a file / from memory
 * (config_yaml.c). Unknown keys, duplicates, nested values and ill-typed
 * values are refused with "ORIGIN:LINE: key 'k': why"; a failed load
 * changes nothing. */
int ft_config_load_file(ft_config *cfg, const char *path, char *err, size_t errlen);
int ft_config_load_string(ft_config *cfg, const char *text, size_t len, const char *origin, char *err,
                          size_t errlen);
/* One assignment "key=value" (the --set form). */
int ft_config_set_assignment(ft_config *cfg, const char *assignment, char *err, size_t errlen);
/* One key: origin and line (<= 0: none) only shape the error message. */
int ft_config_set(ft_config *cfg, const char *key, const char *value, const char *origin, long line,
                  char *err, size_t errlen);
/* Cross-key consistency (e.g. beta != 0 needs use_ref_logp). */
int ft_config_check(const ft_config *cfg, char *err, size_t errlen);
/* Writes "ORIGIN:LINE: message" (or "ORIGIN: message") to err and returns -1;
 * ft_error writes the message alone (every error path of the tool: return ft_error(...)). */
#if defined(__GNUC__)
#define FT_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define FT_PRINTF(f, a)
#endif
int ft_config_fail(char *err, size_t errlen, const char *origin, long line, const char *fmt, ...)
    FT_PRINTF(5, 6);
int ft_error(char *err, size_t errlen, const char *fmt, ...) FT_PRINTF(3, 4);

/* Text of one key's value, exactly as ft_config_set reads it back. */
int ft_config_format(const ft_config *cfg, const char *key, char *buf, size_t n);
/* The whole config as YAML, with each key's help as a comment when verbose. */
void ft_config_print(const ft_config *cfg, FILE *out, int verbose);

/* JSON results (config_json.c, with cJSON): the whole config as a JSON object
 * (numbers as numbers, words as strings), so a result records exactly what
 * produced it; and one JSON value written as one line (f NULL: nowhere),
 * then deleted. 0, or -1 on a write error. */
struct cJSON *ft_config_json(const ft_config *cfg);
int ft_json_write_line(FILE *f, struct cJSON *obj);

size_t ft_config_key_count(void);
const char *ft_config_key_name(size_t i);

/* Strict text -> number parsing (units.c): a config typo must be an error,
 * so each consumes the whole string (0, or -1 with out untouched): decimal
 * integers; plain decimal doubles (no hex, inf or nan); true/false, yes/no,
 * on/off, 1/0; byte counts "4096", "128MiB", "1.5GiB", "2G", "500MB" (K, M,
 * G, T with or without iB: powers of 1024; KB..TB: of 1000), whole, < 2^63. */
int ft_parse_int64(const char *s, int64_t *out);
int ft_parse_double(const char *s, double *out);
int ft_parse_bool(const char *s, int *out);
int ft_parse_bytes(const char *s, uint64_t *out);
/* The shortest exact spelling: "128MiB" when divisible, else plain digits. */
void ft_format_bytes(uint64_t bytes, char *buf, size_t n);

#endif
