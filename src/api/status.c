/* Small public helpers: status names and messages (fg_fail), enum parsing,
 * config defaults, views. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "bf16.h"
#include "error.h"
#include "internal.h"

static const char *const status_names[FG_STATUS_COUNT] = {
    "FG_OK",
    "FG_ERR_NULL_ARGUMENT",
    "FG_ERR_INVALID_SIZE",
    "FG_ERR_SIZE_OVERFLOW",
    "FG_ERR_SHAPE_MISMATCH",
    "FG_ERR_TOKEN_OUT_OF_RANGE",
    "FG_ERR_MISSING_REF_LOGP",
    "FG_ERR_BAD_TEMPERATURE",
    "FG_ERR_UNKNOWN_LOSS_TYPE",
    "FG_ERR_UNKNOWN_LEVEL",
    "FG_ERR_BAD_HYPERPARAMETER",
    "FG_ERR_NONFINITE_INPUT",
    "FG_ERR_UNSUPPORTED",
    "FG_ERR_BUDGET_TOO_SMALL",
    "FG_ERR_OUT_OF_MEMORY",
    "FG_ERR_BACKEND",
    "FG_ERR_COMMUNICATOR",
    "FG_ERR_OVERFLOW",
    "FG_ERR_ALIASED_OUTPUT",
};

const char *fg_status_name(fg_status status)
{
    if ((int)status < 0 || status >= FG_STATUS_COUNT)
        return "FG_ERR_UNKNOWN_STATUS";
    return status_names[status];
}

fg_status fg_fail(fg_error *err, fg_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(err->msg, sizeof err->msg, "%s: ", fg_status_name(status));
    if (n > 0 && (size_t)n < sizeof err->msg)
        vsnprintf(err->msg + n, sizeof err->msg - (size_t)n, fmt, ap);
    va_end(ap);
    return status;
}

static const char *const loss_names[FG_LOSS_TYPE_COUNT] = {
    "grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"};
static const char *const level_names[FG_LEVEL_COUNT] = {"token", "sequence"};

const char *fg_loss_type_name(fg_loss_type t)
{
    return ((int)t >= 0 && t < FG_LOSS_TYPE_COUNT) ? loss_names[t] : NULL;
}

const char *fg_is_level_name(fg_is_level l)
{
    return ((int)l >= 0 && l < FG_LEVEL_COUNT) ? level_names[l] : NULL;
}

fg_status fg_loss_type_parse(const char *name, fg_loss_type *out)
{
    if (!name || !out)
        return FG_ERR_NULL_ARGUMENT;
    for (int i = 0; i < FG_LOSS_TYPE_COUNT; i++)
        if (strcmp(name, loss_names[i]) == 0) {
            *out = (fg_loss_type)i;
            return FG_OK;
        }
    return FG_ERR_UNKNOWN_LOSS_TYPE;
}

fg_status fg_is_level_parse(const char *name, fg_is_level *out)
{
    if (!name || !out)
        return FG_ERR_NULL_ARGUMENT;
    for (int i = 0; i < FG_LEVEL_COUNT; i++)
        if (strcmp(name, level_names[i]) == 0) {
            *out = (fg_is_level)i;
            return FG_OK;
        }
    return FG_ERR_UNKNOWN_LEVEL;
}

void fg_loss_config_init(fg_loss_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->loss_type = FG_LOSS_DAPO;
    cfg->importance_sampling_level = FG_LEVEL_TOKEN;
    cfg->temperature = 1.0;
    cfg->epsilon_low = 0.2;
    cfg->epsilon_high = FG_EPSILON_HIGH_SAME_AS_LOW;
    cfg->delta = FG_DELTA_OFF;
    cfg->beta = 0.0;
    cfg->max_completion_length = FG_MAX_COMPLETION_LENGTH_T;
    cfg->num_items_in_batch = FG_NUM_ITEMS_UNMASKED;
    cfg->sapo_temperature_pos = 1.0;
    cfg->sapo_temperature_neg = 1.05;
    cfg->use_bias_correction_kl = 0;
    cfg->entropy_coef = 0.0;
    cfg->vespo_k_pos = 2.0;
    cfg->vespo_lambda_pos = 3.0;
    cfg->vespo_k_neg = 3.0;
    cfg->vespo_lambda_neg = 2.0;
    cfg->off_policy_mask_threshold = INFINITY; /* off */
    cfg->top_entropy_quantile = 1.0;           /* off */
}

fg_matrix fg_matrix_make(void *data, fg_dtype dtype, int64_t rows, int64_t cols)
{
    fg_matrix m = {data, dtype, rows, cols, cols};
    return m;
}

fg_vector fg_vector_make(void *data, fg_dtype dtype, int64_t len)
{
    fg_vector v = {data, dtype, len};
    return v;
}

uint16_t fg_f32_to_bf16(float x) { return fg_bf16_store(x); }
float fg_bf16_to_f32(uint16_t x) { return fg_bf16_load(x); }
