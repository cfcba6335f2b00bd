/* Pre-faulted anonymous mappings: see bigbuf.h. */
#define _GNU_SOURCE
#include "bigbuf.h"

#include <sys/mman.h>

void *ft_big_alloc(size_t bytes)
{
    if (bytes == 0)
        return NULL;
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void ft_big_free(void *p, size_t bytes)
{
    if (p != NULL && bytes != 0)
        munmap(p, bytes);
}
