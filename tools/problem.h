/*
 * One batch of inputs (the "problem") in a single shared mapping, and its
 * lifetime. What fills it depends on this file, never the reverse: the
 * seeded synthetic batch (synth.h), a directory of .npy files
 * (problem_io.h), and the choice between the two (problem_source.h).
 *
 * bench builds it once per sweep point and forks one child per impl: every
 * impl sees byte-identical inputs, none pays for generating them, and each
 * child seals the mapping read-only, so a library that wrote into its inputs
 * would fault instead of silently corrupting the next impl's run.
 */
#ifndef FT_PROBLEM_H
#define FT_PROBLEM_H

#include "buffer.h"
#include "config.h"

typedef struct ft_problem {
    ft_config s;                  /* the config it was made for: shape, dtype, optional inputs */
    void *hidden, *weight, *bias; /* [B*T, H], [V, H], [V] or NULL; in s.dtype */
    int64_t *token_ids;           /* [B, T]; -1 at masked positions in synthetic batches */
    uint8_t *mask;                /* [B, T] */
    float *advantages;            /* [B] */
    float *old_logp, *ref_logp;   /* [B, T] or NULL */
    float *is_ratio;              /* [B, T], [B] or NULL */
    void *base;                   /* the mapping */
    size_t bytes;
} ft_problem;

/* A writable, zeroed, populated, shared mapping for the config's shape. */
int ft_problem_create(const ft_config *cfg, ft_problem *p, char *err, size_t errlen);
void ft_problem_destroy(ft_problem *p);
/* Read-only from now on, every page mapped (so this process's RSS counts it). */
void ft_problem_seal(ft_problem *p);

int64_t ft_problem_tokens(const ft_problem *p);   /* B*T */
int64_t ft_problem_unmasked(const ft_problem *p); /* tokens with mask != 0 */

#endif
