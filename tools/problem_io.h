/*
 * A problem as a directory of .npy files, for capturing a real batch and
 * replaying it (--inputs), and for saving the synthetic one (--save-inputs).
 *
 * Files: hidden [B,T,H] (or [B*T,H]), weight [V,H], token_ids [B,T],
 * mask [B,T], advantages [B]; optional bias [V], old_logp [B,T],
 * ref_logp [B,T], is_ratio [B,T] or [B]. Floats may be float32 or float64
 * (NumPy has no bfloat16: with dtype=bfloat16 the values are rounded on
 * load); token_ids int64 or int32; mask bool or any integer type. The shapes
 * define batch, seq_len, hidden and vocab, and which optional files exist
 * decides use_bias / use_old_logp / use_ref_logp / is_ratio.
 */
#ifndef FT_PROBLEM_IO_H
#define FT_PROBLEM_IO_H

#include <stddef.h>

#include "config.h"
#include "problem.h"

/* Loads DIR into a new problem (storage dtype cfg->dtype) and updates the
 * shape/optional-input keys of cfg to match. */
int ft_problem_load_dir(const char *dir, ft_config *cfg, ft_problem *p, char *err, size_t errlen);
/* Writes every input of p to DIR (created if missing) as float32/int64/bool. */
int ft_problem_save_dir(const ft_problem *p, const char *dir, char *err, size_t errlen);

/* mkdir -p for one level; 0 if it exists. */
int ft_make_dir(const char *dir, char *err, size_t errlen);

#endif
