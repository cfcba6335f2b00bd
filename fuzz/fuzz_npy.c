/*
 * fuzz_npy: the .npy reader of the tool (tools/npy.c).
 *
 * Properties (abort() with a message when violated):
 *  1. ft_npy_parse_header / ft_npy_parse never crash or read out of bounds;
 *  2. a failure leaves a non-empty, NUL-terminated message;
 *  3. a success is self-consistent: version 1..3, dtype and rank in range,
 *     count = product of the shape, data_bytes = count * element size,
 *     data_offset + data_bytes = the input length, data points into the input
 *     (every data byte is read once, so ASan checks the bounds);
 *  4. ft_npy_read on the same bytes written to a file agrees with the
 *     in-memory parser (same verdict, same header, same data);
 *  5. a parsed array written back with ft_npy_write reads back identical.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "npy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_npy: PROPERTY VIOLATED: %s (%s)\n", what, detail ? detail : "");
    fflush(stderr);
    abort();
}

static void check_err(const char *err)
{
    if (memchr(err, '\0', 512) == NULL)
        die("error message not NUL-terminated", NULL);
    if (err[0] == '\0')
        die("empty error message on failure", NULL);
}

static char path_in[256], path_out[256];

static void remove_files(void)
{
    remove(path_in);
    remove(path_out);
}

static void init_paths(void)
{
    if (path_in[0])
        return;
    atexit(remove_files);
    const char *dir = getenv("TMPDIR");
    if (!dir || !*dir)
        dir = "/tmp";
    snprintf(path_in, sizeof path_in, "%s/fuzz_npy_in_%ld.npy", dir, (long)getpid());
    snprintf(path_out, sizeof path_out, "%s/fuzz_npy_out_%ld.npy", dir, (long)getpid());
}

static int same_header(const ft_npy_header *a, const ft_npy_header *b)
{
    if (a->major != b->major || a->minor != b->minor || a->dtype != b->dtype ||
        a->ndim != b->ndim || a->count != b->count || a->data_bytes != b->data_bytes ||
        a->data_offset != b->data_offset)
        return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return 0;
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512];
    ft_npy_header h;
    ft_npy a;
    init_paths();

    memset(err, 0, sizeof err);
    const int rh = ft_npy_parse_header(data, size, &h, err, sizeof err);
    if (rh != 0)
        check_err(err);
    memset(err, 0, sizeof err);
    const int rc = ft_npy_parse(data, size, &a, err, sizeof err);
    if (rc != 0) {
        check_err(err);
    } else {
        if (rh != 0)
            die("ft_npy_parse accepted what ft_npy_parse_header refused", NULL);
        if (!same_header(&h, &a.h))
            die("ft_npy_parse and ft_npy_parse_header disagree", NULL);
        if (a.h.major < 1 || a.h.major > 3 || a.h.minor != 0)
            die("accepted an unsupported version", NULL);
        if ((unsigned)a.h.dtype >= FT_NPY_DTYPE_COUNT || a.h.ndim < 0 || a.h.ndim > FT_NPY_MAX_DIMS)
            die("dtype or rank out of range", NULL);
        int64_t count = 1;
        for (int i = 0; i < a.h.ndim; i++) {
            if (a.h.shape[i] < 0)
                die("negative dimension", NULL);
            count *= a.h.shape[i]; /* cannot overflow: the parser checked */
        }
        if (count != a.h.count || a.h.data_bytes != (size_t)count * ft_npy_dtype_size(a.h.dtype))
            die("count or data_bytes inconsistent with the shape", NULL);
        if (a.h.data_offset + a.h.data_bytes != size)
            die("data does not end at the end of the input", NULL);
        if ((const uint8_t *)a.data != data + a.h.data_offset)
            die("data does not point at data_offset", NULL);
        unsigned sum = 0;
        for (size_t i = 0; i < a.h.data_bytes; i++)
            sum += ((const unsigned char *)a.data)[i];
        (void)sum;
    }

    /* The file reader must agree with the memory parser. */
    FILE *f = fopen(path_in, "wb");
    if (!f)
        return 0;
    int wrote = size == 0 || fwrite(data, 1, size, f) == size;
    if (fclose(f) != 0 || !wrote)
        return 0;
    ft_npy b;
    memset(err, 0, sizeof err);
    const int rr = ft_npy_read(path_in, &b, err, sizeof err);
    if ((rr == 0) != (rc == 0)) {
        char d[600];
        snprintf(d, sizeof d, "memory %d, file %d: %s", rc, rr, err);
        die("ft_npy_read and ft_npy_parse disagree", d);
    }
    if (rr != 0) {
        check_err(err);
        return 0;
    }
    if (!same_header(&a.h, &b.h) || memcmp(a.data, b.data, a.h.data_bytes) != 0)
        die("ft_npy_read and ft_npy_parse give different arrays", NULL);
    ft_npy_free(&b);

    /* Round trip through the writer. */
    memset(err, 0, sizeof err);
    if (ft_npy_write(path_out, a.h.dtype, a.h.ndim, a.h.shape, a.data, err, sizeof err) != 0)
        die("ft_npy_write refused a parsed array", err);
    ft_npy c;
    if (ft_npy_read(path_out, &c, err, sizeof err) != 0)
        die("cannot read back what ft_npy_write wrote", err);
    if (c.h.dtype != a.h.dtype || c.h.ndim != a.h.ndim || c.h.count != a.h.count ||
        memcmp(c.h.shape, a.h.shape, (size_t)a.h.ndim * sizeof(int64_t)) != 0 ||
        memcmp(c.data, a.data, a.h.data_bytes) != 0)
        die("write/read round trip changed the array", NULL);
    if (c.h.data_offset % 64 != 0)
        die("ft_npy_write did not align the data to 64 bytes", NULL);
    ft_npy_free(&c);
    return 0;
}
