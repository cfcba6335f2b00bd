/*
 * The seeded synthetic batch of `gradcheck` and `bench`.
 *
 * Chosen to exercise the loss where it is delicate rather than to look like
 * any particular model: hidden ~ N(0, 1) and weight ~ N(0, logit_scale^2/H)
 * so logits spread a few units; right-padded ragged masks (lengths uniform in
 * [mask_min_frac*T, T], so 0 allows an empty sequence); tokens sampled from
 * the model's own softmax so log-probs are realistic; old/ref log-probs equal
 * the true ones plus Gaussian noise so ratios straddle both clip bounds;
 * advantages ~ N(0, 1) (both signs); masked token ids are -1 because the spec
 * says they are never read. Deterministic in the seed (counter-based RNG).
 */
#ifndef FT_SYNTH_H
#define FT_SYNTH_H

#include <stddef.h>

#include "config.h"
#include "problem.h"

/* The problem's shape for the config (which inputs exist, sizes, dtype). */
void ft_synth_shape(const ft_config *cfg, ft_problem_shape *s);
/* Fills a created problem. Costs one forward GEMM (the true log-probs). */
int ft_synth_fill(ft_problem *p, const ft_config *cfg, char *err, size_t errlen);

#endif
