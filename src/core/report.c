/* A device-reported call's status and message from its record (report.h):
 * the message the host's check of the same failure writes. */
#include <stdarg.h>
#include <stdio.h>

#include "loss_math.h"
#include "loss_token.h"
#include "report.h"

/* The message as fg_fail writes it: "FG_ERR_...: what". */
static fg_status say(fg_status st, char *msg, size_t n, const char *fmt, ...)
{
    if (!msg || n == 0)
        return st;
    const int k = snprintf(msg, n, "%s: ", fg_status_name(st));
    if (k > 0 && (size_t)k < n) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg + k, n - (size_t)k, fmt, ap);
        va_end(ap);
    }
    return st;
}

fg_status fg_device_report_status(const fg_device_report *r, char *msg, size_t n)
{
    if (msg && n > 0)
        msg[0] = '\0';
    if (!r)
        return say(FG_ERR_NULL_ARGUMENT, msg, n, "report is NULL");
    if (r->failed == 0)
        return FG_OK;
    const uint64_t key = ~r->failed;
    const int64_t i = fg_report_index_of(key), T = r->seq_len > 0 ? r->seq_len : 1;
    const long long b = (long long)(i / T), t = (long long)(i % T);
    const long long row = (long long)(i >> FG_REPORT_SIDE_BITS);
    const long long col = (long long)(i & (FG_REPORT_SIDE_MAX - 1));
    const int check = fg_report_check_of(key);
    const double *v = r->value;
    static const char *const inputs[] = {"token_ids", "old_logp", "ref_logp", "is_ratio",
                                         "grad_logp", "grad_entropy"};
    static const char *const scans[] = {"hidden", "weight", "bias"};
    static const char *const grads[] = {"grad_hidden", "grad_weight", "grad_bias"};
    static const char *const token_loss[] = {NULL, "d loss/d logp", "d loss/d entropy",
                                             "the loss term", "the KL"};
    static const char *const sums[] = {"the loss", "policy_loss", "the kl metric",
                                       "the entropy metric", "vespo_phi_seq_mean"};
    const int stage = fg_report_stage_of(key);
    switch (stage) {
    case FG_REPORT_ADVANTAGES:
        return say(FG_ERR_NONFINITE_INPUT, msg, n, "advantages[%lld] is %g", (long long)i, v[0]);
    case FG_REPORT_IS_RATIO_SEQ:
        return say(FG_ERR_NONFINITE_INPUT, msg, n, "is_ratio[%lld] is %g", (long long)i, v[0]);
    case FG_REPORT_TOKEN_INPUT:
        if (check == FG_REPORT_ID)
            return say(FG_ERR_TOKEN_OUT_OF_RANGE, msg, n,
                       "token_ids[%lld, %lld] = %lld is outside [0, %lld)", b, t,
                       (long long)v[0], (long long)r->vocab);
        if (check > FG_REPORT_GRAD_ENTROPY)
            break;
        return say(FG_ERR_NONFINITE_INPUT, msg, n, "%s[%lld, %lld] is %g", inputs[check], b, t,
                   v[0]);
    case FG_REPORT_SAMPLING:
        return say(FG_ERR_NONFINITE_INPUT, msg, n, "sampling_logp[%lld, %lld] is %g", b, t, v[0]);
    case FG_REPORT_SCAN_HIDDEN:
    case FG_REPORT_SCAN_WEIGHT:
        return say(FG_ERR_NONFINITE_INPUT, msg, n, "%s[%lld, %lld] is NaN or Inf",
                   scans[stage - FG_REPORT_SCAN_HIDDEN], row, col);
    case FG_REPORT_SCAN_BIAS:
        return say(FG_ERR_NONFINITE_INPUT, msg, n, "bias[%lld] is NaN or Inf", col);
    case FG_REPORT_TOKEN:
        if (check == FG_REPORT_STATS_OVERFLOW)
            return say(FG_ERR_OVERFLOW, msg, n,
                       "token [%lld, %lld]: its log-prob (%g) or entropy (%g) came out "
                       "non-finite from finite inputs",
                       b, t, v[0], v[1]);
        if (check == FG_REPORT_STATS_NONFINITE)
            return say(FG_ERR_NONFINITE_INPUT, msg, n,
                       "token [%lld, %lld]: the logits came out NaN or Inf (the finite check "
                       "was off: the inputs may hold NaN/Inf); results are invalid",
                       b, t);
        if (check < FG_REPORT_TOKEN_LOSS(FG_TOKEN_DLOGP) ||
            check > FG_REPORT_TOKEN_LOSS(FG_TOKEN_KL))
            break;
        return say(FG_ERR_OVERFLOW, msg, n,
                   "token [%lld, %lld]: %s overflows from finite inputs (log-prob %g, "
                   "entropy %g)",
                   b, t, token_loss[check - 1], v[0], v[1]);
    case FG_REPORT_SUM:
        if (check > FG_REPORT_PHI)
            break;
        return say(FG_ERR_OVERFLOW, msg, n, "%s overflows to %g from finite inputs",
                   sums[check], v[0]);
    case FG_REPORT_GRAD_HIDDEN:
    case FG_REPORT_GRAD_WEIGHT:
        return say(FG_ERR_OVERFLOW, msg, n,
                   "%s[%lld, %lld] is NaN or Inf: the gradient products left the float range "
                   "from finite inputs",
                   grads[stage - FG_REPORT_GRAD_HIDDEN], row, col);
    case FG_REPORT_GRAD_BIAS:
        return say(FG_ERR_OVERFLOW, msg, n,
                   "grad_bias[%lld] is NaN or Inf: the gradient sums left the float range "
                   "from finite inputs",
                   col);
    default: break;
    }
    return say(FG_ERR_INVALID_SIZE, msg, n, "the report holds no failure this library writes");
}
