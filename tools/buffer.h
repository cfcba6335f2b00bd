/*
 * Big buffers and their elements: the bottom layer of the tool, used by the
 * problem's mapping, the tool's GEMM scratch and the runner's outputs alike.
 */
#ifndef FT_BUFFER_H
#define FT_BUFFER_H

#include <stddef.h>
#include <stdint.h>

size_t ft_dtype_size(int dtype); /* bytes per element of an fg_dtype */
/* Element i of a float32 or bfloat16 array as float, and back. */
float ft_load(const void *data, int dtype, int64_t i);
void ft_store(void *data, int dtype, int64_t i, float v);

/* Big buffers whose pages are all resident before any timing starts: a
 * first touch inside a timed step would measure the kernel plus a page-fault
 * storm. Zeroed, page-aligned; NULL on failure or for 0 bytes. */
void *ft_big_alloc(size_t bytes);
void ft_big_free(void *p, size_t bytes);

#endif
