/* The shared-memory input arena: see problem.h. */
#define _GNU_SOURCE
#include "problem.h"

#include "bf16.h"
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define ARENA_MAGIC "FGPROB01"
#define ALIGN 4096u /* page-aligned tensors: no false sharing of pages, aligned loads */

typedef struct arena_header {
    char magic[8];
    ft_problem_shape s;
    uint64_t bytes;
} arena_header;

size_t ft_dtype_size(int dtype) { return dtype == FT_DTYPE_BF16 ? 2 : 4; }

float ft_load(const void *data, int dtype, int64_t i)
{
    return dtype == FT_DTYPE_BF16 ? ft_bf16_to_f32(((const uint16_t *)data)[i])
                                  : ((const float *)data)[i];
}

void ft_store(void *data, int dtype, int64_t i, float v)
{
    if (dtype == FT_DTYPE_BF16)
        ((uint16_t *)data)[i] = ft_f32_to_bf16(v);
    else
        ((float *)data)[i] = v;
}

static size_t round_up(size_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

/* Offsets of every tensor; returns the total size, 0 on overflow. */
static size_t layout(const ft_problem_shape *s, size_t off[9])
{
    const double limit = 1.0e18;
    double n = (double)s->batch * (double)s->seq_len;
    double es = (double)ft_dtype_size(s->dtype);
    double sizes[9] = {
        n * (double)s->hidden * es,                    /* hidden     */
        (double)s->vocab * (double)s->hidden * es,     /* weight     */
        s->has_bias ? (double)s->vocab * es : 0,       /* bias       */
        n * 8,                                         /* token_ids  */
        n,                                             /* mask       */
        (double)s->batch * 4,                          /* advantages */
        s->has_old ? n * 4 : 0,                        /* old_logp   */
        s->has_ref ? n * 4 : 0,                        /* ref_logp   */
        s->is_ratio == FT_ISR_TOKEN ? n * 4 : s->is_ratio == FT_ISR_SEQUENCE ? (double)s->batch * 4 : 0,
    };
    size_t pos = ALIGN; /* page 0: the header */
    for (int i = 0; i < 9; i++) {
        if (!(sizes[i] < limit))
            return 0;
        off[i] = pos;
        pos += round_up((size_t)sizes[i]);
    }
    return pos;
}

static void bind(ft_problem *p, const size_t off[9])
{
    char *b = p->base;
    p->hidden = b + off[0];
    p->weight = b + off[1];
    p->bias = p->s.has_bias ? b + off[2] : NULL;
    p->token_ids = (int64_t *)(b + off[3]);
    p->mask = (uint8_t *)(b + off[4]);
    p->advantages = (float *)(b + off[5]);
    p->old_logp = p->s.has_old ? (float *)(b + off[6]) : NULL;
    p->ref_logp = p->s.has_ref ? (float *)(b + off[7]) : NULL;
    p->is_ratio = p->s.is_ratio != FT_ISR_NONE ? (float *)(b + off[8]) : NULL;
}

int ft_problem_create(const ft_problem_shape *s, ft_problem *p, char *err, size_t errlen)
{
    memset(p, 0, sizeof *p);
    p->fd = -1;
    p->s = *s;
    size_t off[9];
    size_t bytes = layout(s, off);
    if (bytes == 0) {
        snprintf(err, errlen, "the inputs of this shape are too large to allocate");
        return -1;
    }
    /* Not close-on-exec: bench's children inherit the descriptor. */
    int fd = memfd_create("fusedgrpo-inputs", 0);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
        snprintf(err, errlen, "cannot create a %zu-byte shared input arena: %s", bytes, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (base == MAP_FAILED) {
        snprintf(err, errlen, "cannot map %zu bytes of inputs: %s", bytes, strerror(errno));
        close(fd);
        return -1;
    }
    p->fd = fd;
    p->base = base;
    p->bytes = bytes;
    arena_header *h = base;
    memcpy(h->magic, ARENA_MAGIC, 8);
    h->s = *s;
    h->bytes = bytes;
    bind(p, off);
    return 0;
}

int ft_problem_map_fd(int fd, ft_problem *p, char *err, size_t errlen)
{
    memset(p, 0, sizeof *p);
    p->fd = -1;
    arena_header h;
    if (pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h || memcmp(h.magic, ARENA_MAGIC, 8) != 0) {
        snprintf(err, errlen, "descriptor %d is not an input arena", fd);
        return -1;
    }
    size_t off[9];
    if (layout(&h.s, off) != h.bytes) {
        snprintf(err, errlen, "input arena layout mismatch");
        return -1;
    }
    void *base = mmap(NULL, h.bytes, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (base == MAP_FAILED) {
        snprintf(err, errlen, "cannot map the input arena: %s", strerror(errno));
        return -1;
    }
    p->s = h.s;
    p->fd = fd;
    p->base = base;
    p->bytes = h.bytes;
    p->read_only = 1;
    bind(p, off);
    return 0;
}

void ft_problem_destroy(ft_problem *p)
{
    if (p->base)
        munmap(p->base, p->bytes);
    if (p->fd >= 0)
        close(p->fd);
    memset(p, 0, sizeof *p);
    p->fd = -1;
}

int64_t ft_problem_tokens(const ft_problem *p) { return p->s.batch * p->s.seq_len; }

int64_t ft_problem_unmasked(const ft_problem *p)
{
    int64_t n = 0, total = ft_problem_tokens(p);
    for (int64_t i = 0; i < total; i++)
        n += p->mask[i] != 0;
    return n;
}
