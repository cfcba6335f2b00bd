/*
 * Big buffers whose pages are all resident before any timing starts.
 * First-touch page faults cost seconds per GiB on the machines we run on,
 * so a gradient buffer touched for the first time inside the first step
 * would make that step measure the kernel plus the page-fault storm.
 * MAP_POPULATE pays that cost once, at allocation.
 */
#ifndef FT_BIGBUF_H
#define FT_BIGBUF_H

#include <stddef.h>

/* Zeroed, populated, page-aligned; NULL on failure. bytes == 0 gives NULL. */
void *ft_big_alloc(size_t bytes);
void ft_big_free(void *p, size_t bytes);

#endif
