/*
 * Gradient filtering (fg_linear_options.filter_eps): the two backward
 * products of a chunk on the entries of dlogits that matter.
 *
 * On a sampled distribution most of a row's dlogits = g·(onehot − p) −
 * e·p·(log p + H) are tiny: their p is. Tiles of them are not (a probe
 * measured 95-99% of 16 x 256 tiles holding some p > 1e-5 on SmolLM2's own
 * completions), so the filter works per entry:
 *
 *   keep (i, v)  iff  |dlogits[i, v]| > eps · max_u |dlogits[i, u]|   or v is row i's token,
 *                 or row i keeps more than cap entries by that rule (a flat
 *                 distribution: the whole row, its exact gradient)
 *   select:   idx[i, 0..nnz_i) = the kept vocab ids of row i, ascending     [count, cap]
 *   compact:  dlogits[i, j] = dlogits[i, idx[i, j]]  (in place, j <= idx)   [count, nnz_i]
 *   dhidden:  grad_hidden[i] = Σ_j dlogits[i, j] · W[idx[i, j]]              [count, H]
 *   dweight:  grad_weight[v] (+)= Σ_i dlogits[i, j(i, v)] · hbuf[i]          [V, H]
 *
 * The rule is per row, so the kept set does not depend on how the rows are
 * chunked. A chunk with a row keeping more than `cap` runs its products
 * dense (the GEMMs are faster than a sparse product there): select says so,
 * zero_dropped sets the other rows' dropped entries to 0 in place, and the
 * GEMMs sum the kept entries. Each sparse sum runs in a fixed order (j for
 * grad_hidden, rows for grad_weight), one thread per output row: bits do not
 * depend on the thread count.
 */
#ifndef FG_GRAD_FILTER_H
#define FG_GRAD_FILTER_H

#include "internal.h"

typedef struct fg_kept {
    void *d;          /* the chunk's dlogits rows (compacted in place by compact) */
    fg_dtype d_t;
    int64_t d_ld;
    int64_t count, V; /* rows; vocab entries of a row                              */
    const int64_t *target; /* [count] row i's token in this shard's rows, or -1   */
    int32_t *idx;     /* [count, cap] kept vocab ids, ascending                    */
    int64_t cap;
    int32_t *nnz;     /* [count] kept entries of each row; -1: more than cap (the
                         row keeps every entry)                                    */
} fg_kept;

/* Kept entries a row may have for the chunk to run sparse: V/8 (see
 * grad_filter.c). */
int64_t fg_kept_cap(int64_t V);

/* Fills idx and nnz; returns the entries the rule keeps (V for a row keeping
 * more than cap) and in *dense_rows the rows keeping more than cap (then the
 * chunk's products run dense, after zero_dropped). dlogits are untouched. */
int64_t fg_filter_select(int threads, fg_kept *k, double eps, int64_t *dense_rows);

/* Sets the dropped entries of every row keeping at most cap to 0, in place
 * (a chunk whose products run dense). */
void fg_filter_zero_dropped(int threads, fg_kept *k);

/* Moves each row's kept values to its first nnz_i entries. */
void fg_filter_compact(int threads, fg_kept *k);

/* gh[i, :] = Σ_j d[i, j] · w[idx[i, j], :] for the compacted rows. */
void fg_kept_dhidden(int threads, const fg_kept *k, const void *w, fg_dtype w_t, int64_t w_ld,
                     int64_t H, float *gh, int64_t gh_ld);

/* gw[v, :] = (add ? gw[v, :] : 0) + Σ_i d[i, j(i, v)] · h[i, :] for every v
 * of [0, V), rows i in order. */
void fg_kept_dweight(int threads, const fg_kept *k, const void *h, fg_dtype h_t, int64_t h_ld,
                     int64_t H, float *gw, int64_t gw_ld, int add);

#endif
