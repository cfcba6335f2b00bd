/*
 * A small, strict .npy reader/writer (format versions 1.0, 2.0 and 3.0).
 *
 * Only what the tool exchanges with NumPy: little-endian, C order, the
 * numeric dtypes below. Everything else is refused with a message that says
 * why: Fortran order, big-endian, object/structured dtypes, headers that are
 * not a valid dict literal, shapes whose byte count overflows, files shorter
 * or longer than the header says. The parser works on memory so it can be
 * fuzzed without touching the file system (fuzz/fuzz_npy.c).
 */
#ifndef FT_NPY_H
#define FT_NPY_H

#include <stddef.h>
#include <stdint.h>

#define FT_NPY_MAX_DIMS 32

/* bool, int8, uint8, int16, uint16, int32, uint32, int64, uint64, float32, float64 */
typedef enum ft_npy_dtype {
    FT_NPY_BOOL = 0, FT_NPY_I8, FT_NPY_U8, FT_NPY_I16, FT_NPY_U16, FT_NPY_I32, FT_NPY_U32,
    FT_NPY_I64, FT_NPY_U64, FT_NPY_F32, FT_NPY_F64, FT_NPY_DTYPE_COUNT
} ft_npy_dtype;

typedef struct ft_npy_header {
    int major, minor;
    ft_npy_dtype dtype;
    int ndim;
    int64_t shape[FT_NPY_MAX_DIMS];
    int64_t count;      /* product of the shape (1 for 0-d)      */
    size_t data_bytes;  /* count * element size                  */
    size_t data_offset; /* bytes before the data (magic + header) */
} ft_npy_header;

typedef struct ft_npy {
    ft_npy_header h;
    void *data; /* ft_npy_read: owned (ft_npy_free); ft_npy_parse: into the caller's buffer */
} ft_npy;

size_t ft_npy_dtype_size(ft_npy_dtype t);
const char *ft_npy_dtype_name(ft_npy_dtype t); /* "float32" */
/* Shape string like "(2, 9, 24)" for messages. */
void ft_npy_shape_str(const ft_npy_header *h, char *buf, size_t n);

/* The functions below return 0, or -1 with a reason in err. */
/* Parses magic + header from the first len bytes of a file (the data is not looked at). */
int ft_npy_parse_header(const void *buf, size_t len, ft_npy_header *out, char *err, size_t errlen);
/* Parses a whole in-memory file: the header, then checks that exactly
 * data_bytes follow. On success out->data points INTO buf (not copied). */
int ft_npy_parse(const void *buf, size_t len, ft_npy *out, char *err, size_t errlen);
/* Reads a file into a fresh buffer (free with ft_npy_free). Errors name the path. */
int ft_npy_read(const char *path, ft_npy *out, char *err, size_t errlen);
void ft_npy_free(ft_npy *a);
/* Writes data (prod(shape) elements of dtype; ndim 0 is a scalar) as version 1.0. */
int ft_npy_write(const char *path, ft_npy_dtype dtype, int ndim, const int64_t *shape,
                 const void *data, char *err, size_t errlen);

#endif
