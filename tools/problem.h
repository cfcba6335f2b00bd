/*
 * One batch of inputs (the "problem"), laid out in a single shared-memory
 * arena. bench builds the problem once and hands the arena's file
 * descriptor to each child process, which maps it read-only: every impl
 * sees byte-identical inputs, none pays for generating them, the children's
 * memory peaks stay separate, and a library that wrote into its inputs
 * would fault instead of silently corrupting the next impl's run.
 */
#ifndef FT_PROBLEM_H
#define FT_PROBLEM_H

#include <stddef.h>
#include <stdint.h>

typedef struct ft_problem_shape {
    int64_t batch, seq_len, hidden, vocab;
    int dtype; /* FT_DTYPE_*: storage of hidden, weight, bias */
    int has_bias, has_old, has_ref;
    int is_ratio; /* FT_ISR_* */
} ft_problem_shape;

typedef struct ft_problem {
    ft_problem_shape s;
    void *hidden;       /* [B*T, H] dtype */
    void *weight;       /* [V, H] dtype   */
    void *bias;         /* [V] dtype or NULL */
    int64_t *token_ids; /* [B, T]; -1 at masked positions in synthetic batches */
    uint8_t *mask;      /* [B, T] */
    float *advantages;  /* [B] */
    float *old_logp;    /* [B, T] or NULL */
    float *ref_logp;    /* [B, T] or NULL */
    float *is_ratio;    /* [B, T], [B] or NULL */
    /* the arena */
    int fd;
    void *base;
    size_t bytes;
    int read_only;
} ft_problem;

/* A writable, zeroed, populated arena for the shape. */
int ft_problem_create(const ft_problem_shape *s, ft_problem *p, char *err, size_t errlen);
/* Maps an arena created by another process (read-only, populated). */
int ft_problem_map_fd(int fd, ft_problem *p, char *err, size_t errlen);
void ft_problem_destroy(ft_problem *p);

int64_t ft_problem_tokens(const ft_problem *p);   /* B*T */
int64_t ft_problem_unmasked(const ft_problem *p); /* tokens with mask != 0 */
size_t ft_dtype_size(int dtype);
/* hidden/weight/bias element i as float, whatever the storage dtype. */
float ft_load(const void *data, int dtype, int64_t i);
void ft_store(void *data, int dtype, int64_t i, float v);

#endif
