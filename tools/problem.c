/* The input mapping and its lifetime: see problem.h. */
#define _GNU_SOURCE
#include "problem.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define ALIGN 4096u /* page-aligned tensors: aligned loads, no shared pages */

static size_t round_up(size_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

int ft_problem_create(const ft_config *cfg, ft_problem *p, char *err, size_t errlen)
{
    memset(p, 0, sizeof *p);
    p->s = *cfg;
    const ft_config *s = cfg;
    const double n = (double)s->batch * (double)s->seq_len, es = (double)ft_dtype_size(s->dtype);
    const double sizes[9] = {
        n * (double)s->hidden * es,                /* hidden     */
        (double)s->vocab * (double)s->hidden * es, /* weight     */
        s->use_bias ? (double)s->vocab * es : 0,   /* bias       */
        n * 8, n, (double)s->batch * 4,            /* token_ids, mask, advantages */
        s->use_old_logp ? n * 4 : 0, s->use_ref_logp ? n * 4 : 0,
        s->is_ratio == FT_ISR_TOKEN ? n * 4 : s->is_ratio == FT_ISR_SEQUENCE ? (double)s->batch * 4 : 0,
    };
    size_t off[9], pos = 0;
    for (int i = 0; i < 9; i++) {
        if (!(sizes[i] < 1.0e18))
            return ft_error(err, errlen, "the inputs of this shape are too large to allocate");
        off[i] = pos;
        pos += round_up((size_t)sizes[i]);
    }
    /* Shared, so that bench's forked children see what a child generated. */
    void *base = mmap(NULL, pos, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (base == MAP_FAILED)
        return ft_error(err, errlen, "cannot map %zu bytes of inputs: %s", pos, strerror(errno));
    char *b = p->base = base;
    p->bytes = pos;
    p->hidden = b + off[0];
    p->weight = b + off[1];
    p->bias = s->use_bias ? b + off[2] : NULL;
    p->token_ids = (int64_t *)(b + off[3]);
    p->mask = (uint8_t *)(b + off[4]);
    p->advantages = (float *)(b + off[5]);
    p->old_logp = s->use_old_logp ? (float *)(b + off[6]) : NULL;
    p->ref_logp = s->use_ref_logp ? (float *)(b + off[7]) : NULL;
    p->is_ratio = s->is_ratio != FT_ISR_NONE ? (float *)(b + off[8]) : NULL;
    return 0;
}

void ft_problem_destroy(ft_problem *p)
{
    if (p->base)
        munmap(p->base, p->bytes);
    memset(p, 0, sizeof *p);
}

void ft_problem_seal(ft_problem *p)
{
    mprotect(p->base, p->bytes, PROT_READ);
    volatile unsigned char sink = 0;
    for (size_t i = 0; i < p->bytes; i += ALIGN)
        sink ^= ((const unsigned char *)p->base)[i];
    (void)sink;
}

int64_t ft_problem_tokens(const ft_problem *p) { return p->s.batch * p->s.seq_len; }

int64_t ft_problem_unmasked(const ft_problem *p)
{
    int64_t n = 0, total = ft_problem_tokens(p);
    for (int64_t i = 0; i < total; i++)
        n += p->mask[i] != 0;
    return n;
}
