/* Big buffers and their elements: see buffer.h. */
#define _GNU_SOURCE
#include "buffer.h"

#include "fusedgrpo.h"

#include <sys/mman.h>

size_t ft_dtype_size(int dtype) { return dtype == FG_DTYPE_BF16 ? 2 : 4; }

float ft_load(const void *data, int dtype, int64_t i)
{
    return dtype == FG_DTYPE_BF16 ? fg_bf16_to_f32(((const uint16_t *)data)[i]) : ((const float *)data)[i];
}

void ft_store(void *data, int dtype, int64_t i, float v)
{
    if (dtype == FG_DTYPE_BF16)
        ((uint16_t *)data)[i] = fg_f32_to_bf16(v);
    else
        ((float *)data)[i] = v;
}

void *ft_big_alloc(size_t bytes)
{
    void *p = bytes == 0 ? MAP_FAILED
                         : mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void ft_big_free(void *p, size_t bytes)
{
    if (p != NULL && bytes != 0)
        munmap(p, bytes);
}
