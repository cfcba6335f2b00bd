/*
 * gradcheck --dump DIR: the kernel's outputs as .npy, for comparison in
 * NumPy or against another run. loss.npy is a 0-d float64, metrics.npy a [6]
 * float64 in fg_metrics order (kl, entropy, clip_ratio_low, clip_ratio_high,
 * clip_ratio_region, cispo_clip_ratio); logp/entropy [B, T], grad_hidden
 * [B, T, H], grad_weight [V, H], grad_bias [V] (with a bias) or, for the
 * logits impl, grad_logits [B, T, V]; all float32 (bf16 dlogits widened).
 */
#ifndef FT_DUMP_H
#define FT_DUMP_H

#include <stddef.h>

#include "problem.h"
#include "runner.h"

int ft_dump_outputs(const char *dir, const ft_runner *r, const ft_problem *p, char *err, size_t errlen);

#endif
