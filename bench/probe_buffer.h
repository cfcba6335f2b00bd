/*
 * The bench probes' operand buffers (block_probe.c):
 * mapped and pre-faulted, so that no first-touch fault lands in a timing,
 * and filled with small nonzero values, ((i * 7919) % 1000 - 500) * scale.
 */
#ifndef FG_PROBE_BUFFER_H
#define FG_PROBE_BUFFER_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

static float *probe_buffer(size_t n, float scale)
{
    float *p = mmap(NULL, n * 4, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    for (size_t i = 0; i < n; i++)
        p[i] = (float)((int)((i * 7919) % 1000) - 500) * scale;
    return p;
}

#endif
