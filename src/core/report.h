/*
 * The checks of a device-reported call (fusedgrpo.h "Device-reported
 * calls"), one token or sequence at a time, for the host's reference
 * backend and a device's kernels alike (FG_HD): each returns the key of
 * what it found, 0 for nothing, and the record keeps the first failure in
 * the order the host's checks run, whatever order the threads run in:
 *
 *   failed = max over the failures of ~key   (0: none; an atomic max)
 *
 * so the smallest key wins. A key is (stage, index, check): stages in the
 * host's order (the batch's values: validate.c; the inputs' scan; each
 * token's statistics and loss math: finish.c; the loss's sums; the
 * gradients after the fact), the index in the order the host walks (a
 * token n = b*T + t, a sequence b, a scanned entry's (row, column)), then
 * the check within it. fg_report_values fills the values the message
 * shows once every check ran; fg_device_report_status (report.c) writes
 * the host's message from the record.
 */
#ifndef FG_REPORT_H
#define FG_REPORT_H

#include <stdint.h>

#include "loss_sequence.h"

enum fg_report_stage {
    FG_REPORT_ADVANTAGES = 1, /* index b                                      */
    FG_REPORT_IS_RATIO_SEQ,   /* index b: a per-sequence is_ratio             */
    FG_REPORT_TOKEN_INPUT,    /* index n, check: enum fg_report_input         */
    FG_REPORT_SAMPLING,       /* index n: sampling_logp infinite              */
    FG_REPORT_SCAN_HIDDEN,    /* index (row, col): NaN or Inf                 */
    FG_REPORT_SCAN_WEIGHT,
    FG_REPORT_SCAN_BIAS,
    FG_REPORT_TOKEN,          /* index n, check: enum fg_report_token         */
    FG_REPORT_SUM,            /* check: enum fg_report_sum                    */
    FG_REPORT_GRAD_HIDDEN,    /* index (row, col): NaN or Inf after the products */
    FG_REPORT_GRAD_WEIGHT,
    FG_REPORT_GRAD_BIAS
};

/* A token's inputs, in validate.c's order. */
enum fg_report_input {
    FG_REPORT_ID,
    FG_REPORT_OLD_LOGP,
    FG_REPORT_REF_LOGP,
    FG_REPORT_IS_RATIO,
    FG_REPORT_GRAD_LOGP, /* the head's kinds: the caller's derivatives */
    FG_REPORT_GRAD_ENTROPY
};

/* A token's checks after its statistics (finish.c's): non-finite statistics
 * (scanned inputs: an overflow; else the finite check was off), then
 * loss_token.h's fg_token_overflow codes shifted by 1. */
enum fg_report_token { FG_REPORT_STATS_OVERFLOW, FG_REPORT_STATS_NONFINITE };
#define FG_REPORT_TOKEN_LOSS(code) (1 + (code)) /* FG_TOKEN_DLOGP ... FG_TOKEN_KL */

/* The loss's sums (finish.c fg_common_evaluate's order). */
enum fg_report_sum { FG_REPORT_LOSS, FG_REPORT_POLICY_LOSS, FG_REPORT_KL, FG_REPORT_ENTROPY,
                     FG_REPORT_PHI };

/* Index bits: 48, a scanned entry's row and column 24 bits each. */
#define FG_REPORT_INDEX_BITS 48
#define FG_REPORT_SIDE_BITS 24
#define FG_REPORT_SIDE_MAX ((int64_t)1 << FG_REPORT_SIDE_BITS)

FG_HD static inline uint64_t fg_report_key(int stage, int64_t index, int check)
{
    return ((uint64_t)stage << 56) | ((uint64_t)index << 8) | (uint64_t)check;
}

FG_HD static inline uint64_t fg_report_entry_key(int stage, int64_t row, int64_t col)
{
    return fg_report_key(stage, (row << FG_REPORT_SIDE_BITS) | col, 0);
}

FG_HD static inline int fg_report_stage_of(uint64_t key) { return (int)(key >> 56); }
FG_HD static inline int64_t fg_report_index_of(uint64_t key)
{
    return (int64_t)((key >> 8) & (((uint64_t)1 << FG_REPORT_INDEX_BITS) - 1));
}
FG_HD static inline int fg_report_check_of(uint64_t key) { return (int)(key & 0xff); }

/* report_tokens' scratch: one segment's sums (loss_sequence.h) per
 * segment of every sequence. */
static inline size_t fg_report_sums_bytes(int64_t B, int64_t T)
{
    return (size_t)B * (size_t)((T + FG_EVAL_SEGMENT - 1) / FG_EVAL_SEGMENT) * sizeof(fg_seq_sums);
}

/* What the checks below read besides the plan (every pointer in the
 * memory the checks run in). */
typedef struct fg_report_batch {
    int64_t vocab;
    const float *grad_logp, *grad_entropy; /* the head's kinds: the caller's */
    int loss;                              /* the plan is a loss's (KIND_LOSS) */
} fg_report_batch;

FG_HD static inline int fg_report_finite(float x) { return isfinite(x) != 0; }

/* Sequence b's values (validate.c's per-sequence loops; the advantages of
 * every sequence come before any per-sequence is_ratio: two stages). */
FG_HD static inline uint64_t fg_report_sequence(const fg_loss_plan *p, const fg_report_batch *r,
                                                int64_t b)
{
    if (!r->loss)
        return 0;
    if (!fg_report_finite(p->adv[b]))
        return fg_report_key(FG_REPORT_ADVANTAGES, b, 0);
    if (p->is_ratio && p->is_per_seq && !fg_report_finite(p->is_ratio[b]))
        return fg_report_key(FG_REPORT_IS_RATIO_SEQ, b, 0);
    return 0;
}

/* Token n's values, unmasked tokens only (validate.c scan_unmasked's
 * order, then the sampler's log-probs in a later pass). */
FG_HD static inline uint64_t fg_report_token_input(const fg_loss_plan *p,
                                                   const fg_report_batch *r, int64_t n)
{
    if (!p->mask[n])
        return 0;
    if (p->token_ids[n] < 0 || p->token_ids[n] >= r->vocab)
        return fg_report_key(FG_REPORT_TOKEN_INPUT, n, FG_REPORT_ID);
    if (!r->loss) {
        if (r->grad_logp && !fg_report_finite(r->grad_logp[n]))
            return fg_report_key(FG_REPORT_TOKEN_INPUT, n, FG_REPORT_GRAD_LOGP);
        if (r->grad_entropy && !fg_report_finite(r->grad_entropy[n]))
            return fg_report_key(FG_REPORT_TOKEN_INPUT, n, FG_REPORT_GRAD_ENTROPY);
        return 0;
    }
    if (p->old && !fg_report_finite(p->old[n]))
        return fg_report_key(FG_REPORT_TOKEN_INPUT, n, FG_REPORT_OLD_LOGP);
    if (p->beta != 0 && !fg_report_finite(p->ref[n]))
        return fg_report_key(FG_REPORT_TOKEN_INPUT, n, FG_REPORT_REF_LOGP);
    if (p->is_ratio && !p->is_per_seq && !fg_report_finite(p->is_ratio[n]))
        return fg_report_key(FG_REPORT_TOKEN_INPUT, n, FG_REPORT_IS_RATIO);
    if (p->sampling && !isinf(p->off_policy_threshold) && isinf(p->sampling[n]))
        return fg_report_key(FG_REPORT_SAMPLING, n, 0);
    return 0;
}

/* Token n's statistics and, for a loss, its loss math (finish.c
 * fg_common_check_tokens), unmasked tokens only; p resolved
 * (fg_loss_plan_resolved). */
FG_HD static inline uint64_t fg_report_token(const fg_loss_plan *p, const fg_report_batch *r,
                                             int64_t n, float zmax, float lsum, float logp,
                                             float entropy, int scanned)
{
    if (!p->mask[n])
        return 0;
    if (!(fg_report_finite(logp) && fg_report_finite(entropy) && fg_report_finite(zmax) &&
          fg_report_finite(lsum)))
        return fg_report_key(FG_REPORT_TOKEN, n,
                             scanned ? FG_REPORT_STATS_OVERFLOW : FG_REPORT_STATS_NONFINITE);
    if (!r->loss)
        return 0;
    float g, e;
    const int code = fg_token_overflow(p, n, logp, entropy, &g, &e);
    return code == FG_TOKEN_FINITE ? 0 : fg_report_key(FG_REPORT_TOKEN, n, FG_REPORT_TOKEN_LOSS(code));
}

/* The loss and metrics' sums, in fg_common_evaluate's order. */
FG_HD static inline uint64_t fg_report_sums(double loss, const fg_metrics *m, double *value)
{
    const double v[5] = {loss, m->policy_loss, m->kl, m->entropy, m->vespo_phi_seq_mean};
    for (int i = 0; i < 5; i++)
        if (!isfinite(v[i])) {
            *value = v[i];
            return fg_report_key(FG_REPORT_SUM, 0, i);
        }
    return 0;
}

/* The values the first failure's message shows, from the memory the checks
 * read (logp and entropy: every token's, [N]); the sums' value was kept
 * when they were checked. */
FG_HD static inline void fg_report_values(const fg_loss_plan *p, const fg_report_batch *r,
                                          const float *logp, const float *entropy,
                                          uint64_t key, double value[2])
{
    const int64_t i = fg_report_index_of(key);
    const int check = fg_report_check_of(key);
    switch (fg_report_stage_of(key)) {
    case FG_REPORT_ADVANTAGES: value[0] = p->adv[i]; break;
    case FG_REPORT_IS_RATIO_SEQ: value[0] = p->is_ratio[i]; break;
    case FG_REPORT_TOKEN_INPUT:
        switch (check) {
        case FG_REPORT_ID: value[0] = (double)p->token_ids[i]; break;
        case FG_REPORT_OLD_LOGP: value[0] = p->old[i]; break;
        case FG_REPORT_REF_LOGP: value[0] = p->ref[i]; break;
        case FG_REPORT_IS_RATIO: value[0] = p->is_ratio[i]; break;
        case FG_REPORT_GRAD_LOGP: value[0] = r->grad_logp[i]; break;
        default: value[0] = r->grad_entropy[i]; break;
        }
        break;
    case FG_REPORT_SAMPLING: value[0] = p->sampling[i]; break;
    case FG_REPORT_TOKEN:
        value[0] = logp[i];
        value[1] = entropy[i];
        break;
    default: break;
    }
}

#endif
