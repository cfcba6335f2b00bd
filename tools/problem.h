/*
 * One batch of inputs (the "problem") in a single shared mapping, and where
 * its contents come from: the seeded synthetic batch (synth.c) or a
 * directory of .npy files (problem_io.c). bench builds it once per sweep
 * point and forks one child per impl: every impl sees byte-identical
 * inputs, none pays for generating them, and each child seals the mapping
 * read-only, so a library that wrote into its inputs would fault instead of
 * silently corrupting the next impl's run.
 */
#ifndef FT_PROBLEM_H
#define FT_PROBLEM_H

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
/* The config's problem: replayed from dir (whose files win over the
 * config's shape keys; cfg is updated), else created for the config's shape
 * and, unless `empty`, filled with the synthetic batch. Checks the config. */
int ft_problem_make(const char *dir, ft_config *cfg, int empty, ft_problem *p, char *err, size_t errlen);
/* Fills a created problem of the config's shape with the synthetic batch (synth.c). */
int ft_synth_fill(ft_problem *p, const ft_config *cfg, char *err, size_t errlen);
/* A problem from DIR's .npy files / every input of p written to DIR (problem_io.c). */
int ft_problem_load_dir(const char *dir, ft_config *cfg, ft_problem *p, char *err, size_t errlen);
int ft_problem_save_dir(const ft_problem *p, const char *dir, char *err, size_t errlen);

int64_t ft_problem_tokens(const ft_problem *p);   /* B*T */
int64_t ft_problem_unmasked(const ft_problem *p); /* tokens with mask != 0 */
size_t ft_dtype_size(int dtype);
/* Element i of a float32 or bfloat16 array as float, and back. */
float ft_load(const void *data, int dtype, int64_t i);
void ft_store(void *data, int dtype, int64_t i, float v);

/* Big buffers whose pages are all resident before any timing starts: a
 * first touch inside a timed step would measure the kernel plus a page-fault
 * storm. Zeroed, page-aligned; NULL on failure or for 0 bytes. */
void *ft_big_alloc(size_t bytes);
void ft_big_free(void *p, size_t bytes);

#endif
