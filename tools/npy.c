/* Strict .npy reading and writing: see npy.h for the contract. */
#define _POSIX_C_SOURCE 200809L
#include "npy.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "npy.c reads and writes little-endian data in place; this host is big-endian"
#endif

/* No real header comes near this; a larger length is a corrupt or hostile file. */
#define MAX_HEADER_LEN (1u << 20)

static const struct {
    const char *code; /* the descr without its byte-order character */
    const char *name;
    size_t size;
} DTYPES[FT_NPY_DTYPE_COUNT] = {
    {"b1", "bool", 1},    {"i1", "int8", 1},    {"u1", "uint8", 1},    {"i2", "int16", 2},
    {"u2", "uint16", 2},  {"i4", "int32", 4},   {"u4", "uint32", 4},   {"i8", "int64", 8},
    {"u8", "uint64", 8},  {"f4", "float32", 4}, {"f8", "float64", 8},
};

size_t ft_npy_dtype_size(ft_npy_dtype t) { return (unsigned)t < FT_NPY_DTYPE_COUNT ? DTYPES[t].size : 0; }
const char *ft_npy_dtype_name(ft_npy_dtype t)
{
    return (unsigned)t < FT_NPY_DTYPE_COUNT ? DTYPES[t].name : "?";
}

static int fail(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (err && errlen)
        vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

void ft_npy_shape_str(const ft_npy_header *h, char *buf, size_t n)
{
    size_t used = (size_t)snprintf(buf, n, "(");
    for (int i = 0; i < h->ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", (long long)h->shape[i]);
    if (used < n)
        snprintf(buf + used, n - used, h->ndim == 1 ? ",)" : ")");
}

/* ------------------------------------------------ the header dict literal */

typedef struct cursor { const char *p, *end; } cursor;

/* Skips whitespace, then consumes `text` if it comes next. */
static int eat(cursor *c, const char *text)
{
    while (c->p < c->end && strchr(" \t\n\r", *c->p) && *c->p)
        c->p++;
    const size_t n = strlen(text);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, text, n) != 0)
        return 0;
    c->p += n;
    return 1;
}

/* A quoted Python string without escapes into out (NUL-terminated). */
static int parse_string(cursor *c, char *out, size_t n)
{
    const char q = eat(c, "'") ? '\'' : eat(c, "\"") ? '"' : 0;
    size_t len = 0;
    for (; q && c->p < c->end && *c->p != q; c->p++) {
        const unsigned char ch = (unsigned char)*c->p;
        if (ch == '\\' || ch < 0x20 || ch >= 0x7f || len + 1 >= n)
            return -1;
        out[len++] = *c->p;
    }
    if (!q || c->p++ >= c->end)
        return -1;
    out[len] = '\0';
    return 0;
}

static int parse_shape(cursor *c, ft_npy_header *h, char *err, size_t errlen)
{
    if (!eat(c, "("))
        return fail(err, errlen, "'shape' is not a tuple");
    int comma = 1; /* "(3)" is an integer in parentheses, "(3,)" a tuple */
    while (!eat(c, ")")) {
        if (c->p >= c->end || *c->p < '0' || *c->p > '9')
            return fail(err, errlen, "'shape' holds something that is not a non-negative integer");
        int64_t v = 0;
        for (; c->p < c->end && *c->p >= '0' && *c->p <= '9'; c->p++) {
            if (v > (INT64_MAX - 9) / 10)
                return fail(err, errlen, "a dimension in 'shape' is too large");
            v = v * 10 + (*c->p - '0');
        }
        c->p += c->p < c->end && *c->p == 'L'; /* Python 2 era files */
        if (h->ndim >= FT_NPY_MAX_DIMS)
            return fail(err, errlen, "'shape' has more than %d dimensions", FT_NPY_MAX_DIMS);
        h->shape[h->ndim++] = v;
        comma = eat(c, ",");
        if (!comma && !eat(c, ")"))
            return fail(err, errlen, "'shape' tuple is malformed");
        if (!comma)
            break;
    }
    if (!comma && h->ndim == 1)
        return fail(err, errlen, "'shape' is '(n)', an integer, not a tuple (numpy writes '(n,)')");
    return 0;
}

static int parse_descr(cursor *c, ft_npy_dtype *out, char *err, size_t errlen)
{
    char d[32];
    if (eat(c, "["))
        return fail(err, errlen, "structured dtypes are not supported");
    if (parse_string(c, d, sizeof d) != 0)
        return fail(err, errlen, "'descr' is not a dtype string");
    for (int t = 0; t < FT_NPY_DTYPE_COUNT && d[0]; t++) {
        if (strcmp(d + 1, DTYPES[t].code) != 0)
            continue;
        if (d[0] == '>' && DTYPES[t].size > 1)
            return fail(err, errlen, "big-endian data ('%s') is not supported", d);
        if (!strchr("<|=>", d[0]))
            break;
        if (d[0] == '|' && DTYPES[t].size > 1)
            return fail(err, errlen, "dtype '%s' lacks a byte order", d);
        *out = (ft_npy_dtype)t;
        return 0;
    }
    return fail(err, errlen, "unsupported dtype '%s' (supported: bool, int8/16/32/64, "
                             "uint8/16/32/64, float32, float64)", d);
}

static int parse_dict(const char *text, size_t len, ft_npy_header *h, char *err, size_t errlen)
{
    static const char *const keys[3] = {"descr", "fortran_order", "shape"};
    cursor c = {text, text + len};
    int seen[3] = {0, 0, 0};
    if (!eat(&c, "{"))
        return fail(err, errlen, "header is not a dict literal");
    while (!eat(&c, "}")) {
        char key[32];
        int k = 0;
        if (parse_string(&c, key, sizeof key) != 0)
            return fail(err, errlen, "header dict has a malformed key");
        if (!eat(&c, ":"))
            return fail(err, errlen, "header dict: missing ':' after '%s'", key);
        while (k < 3 && strcmp(key, keys[k]) != 0)
            k++;
        if (k == 3)
            return fail(err, errlen, "header has an unexpected key '%s'", key);
        if (seen[k]++)
            return fail(err, errlen, "header repeats '%s'", key);
        if (k == 0 && parse_descr(&c, &h->dtype, err, errlen) != 0)
            return -1;
        if (k == 1 && eat(&c, "True"))
            return fail(err, errlen, "Fortran-order arrays are not supported (save C order)");
        if (k == 1 && !eat(&c, "False"))
            return fail(err, errlen, "'fortran_order' is not True or False");
        if (k == 2 && parse_shape(&c, h, err, errlen) != 0)
            return -1;
        if (!eat(&c, ",") && !eat(&c, "}"))
            return fail(err, errlen, "header dict is malformed after '%s'", key);
        if (c.p[-1] == '}')
            break;
    }
    eat(&c, ""); /* the padding: spaces and the final newline */
    if (c.p != c.end)
        return fail(err, errlen, "header has trailing bytes after the dict");
    for (int k = 0; k < 3; k++)
        if (!seen[k])
            return fail(err, errlen, "header lacks '%s'", keys[k]);
    return 0;
}

int ft_npy_parse_header(const void *buf, size_t len, ft_npy_header *out, char *err, size_t errlen)
{
    const unsigned char *b = buf;
    memset(out, 0, sizeof *out);
    if (len < 10 || memcmp(b, "\x93NUMPY", 6) != 0)
        return fail(err, errlen, len < 10 ? "file too short for a .npy header"
                                          : "not a .npy file (bad magic)");
    out->major = b[6];
    out->minor = b[7];
    if (out->major < 1 || out->major > 3 || out->minor != 0)
        return fail(err, errlen, "unsupported .npy format version %d.%d", out->major, out->minor);
    const size_t prefix = out->major == 1 ? 10 : 12;
    if (len < prefix)
        return fail(err, errlen, "file too short for a .npy header");
    const size_t hlen = (size_t)b[8] | (size_t)b[9] << 8 |
                        (out->major == 1 ? 0 : (size_t)b[10] << 16 | (size_t)b[11] << 24);
    if (hlen > MAX_HEADER_LEN)
        return fail(err, errlen, "header length %zu is implausibly large", hlen);
    if (len - prefix < hlen)
        return fail(err, errlen, "truncated header (%zu of %zu bytes)", len - prefix, hlen);
    if (parse_dict((const char *)b + prefix, hlen, out, err, errlen) != 0)
        return -1;
    int64_t count = 1;
    for (int i = 0; i < out->ndim; i++) {
        if (out->shape[i] != 0 && count > INT64_MAX / out->shape[i])
            return fail(err, errlen, "shape overflows");
        count *= out->shape[i];
    }
    const size_t esize = ft_npy_dtype_size(out->dtype);
    if ((uint64_t)count > (uint64_t)(INT64_MAX / (int64_t)esize) ||
        (uint64_t)count * esize > (uint64_t)SIZE_MAX)
        return fail(err, errlen, "shape's byte count overflows");
    out->count = count;
    out->data_bytes = (size_t)count * esize;
    out->data_offset = prefix + hlen;
    return 0;
}

int ft_npy_parse(const void *buf, size_t len, ft_npy *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (ft_npy_parse_header(buf, len, &out->h, err, errlen) != 0)
        return -1;
    const ft_npy_header *h = &out->h;
    const size_t have = len - h->data_offset;
    char shape[256];
    ft_npy_shape_str(h, shape, sizeof shape);
    if (have < h->data_bytes)
        return fail(err, errlen, "truncated: shape %s of %s needs %zu data bytes, found %zu", shape,
                    ft_npy_dtype_name(h->dtype), h->data_bytes, have);
    if (have > h->data_bytes)
        return fail(err, errlen, "%zu bytes beyond the data that shape %s of %s describes",
                    have - h->data_bytes, shape, ft_npy_dtype_name(h->dtype));
    out->data = (unsigned char *)buf + h->data_offset;
    return 0;
}

int ft_npy_read(const char *path, ft_npy *out, char *err, size_t errlen)
{
    char why[320];
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return fail(err, errlen, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return fail(err, errlen, "%s: not a regular file", path);
    }
    /* The whole file, then the memory parser: the two can never disagree. */
    const size_t size = (size_t)st.st_size;
    unsigned char *buf = malloc(size > 0 ? size : 1);
    const char *problem = !buf ? "out of memory" : fread(buf, 1, size, f) != size ? "read error" : NULL;
    fclose(f);
    if (problem == NULL && ft_npy_parse(buf, size, out, why, sizeof why) != 0)
        problem = why;
    if (problem != NULL) {
        fail(err, errlen, "%s: %s", path, problem);
        free(buf);
        return -1;
    }
    memmove(buf, out->data, out->h.data_bytes); /* data first, so ft_npy_free frees it */
    out->data = buf;
    return 0;
}

void ft_npy_free(ft_npy *a)
{
    if (a) {
        free(a->data);
        a->data = NULL;
    }
}

int ft_npy_write(const char *path, ft_npy_dtype dtype, int ndim, const int64_t *shape,
                 const void *data, char *err, size_t errlen)
{
    if ((unsigned)dtype >= FT_NPY_DTYPE_COUNT || ndim < 0 || ndim > FT_NPY_MAX_DIMS)
        return fail(err, errlen, "%s: bad dtype or rank", path);
    /* Version 1.0 (32 dimensions fit its 64 KiB header), padded with spaces
     * and a final newline so the data starts 64-byte aligned. */
    unsigned char head[10 + 96 + FT_NPY_MAX_DIMS * 24 + 64];
    char *dict = (char *)head + 10;
    int n = sprintf(dict, "{'descr': '%c%s', 'fortran_order': False, 'shape': (",
                    DTYPES[dtype].size > 1 ? '<' : '|', DTYPES[dtype].code);
    uint64_t count = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return fail(err, errlen, "%s: negative dimension", path);
        n += sprintf(dict + n, "%s%lld", i ? ", " : "", (long long)shape[i]);
        count *= (uint64_t)shape[i];
    }
    n += sprintf(dict + n, "%s), }", ndim == 1 ? "," : "");
    const size_t padded = (10 + (size_t)n + 1 + 63) / 64 * 64, hlen = padded - 10;
    memset(dict + n, ' ', hlen - (size_t)n - 1);
    head[padded - 1] = '\n';
    memcpy(head, "\x93NUMPY\x01\x00", 8);
    head[8] = (unsigned char)(hlen & 0xff);
    head[9] = (unsigned char)(hlen >> 8);

    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return fail(err, errlen, "%s: cannot create: %s", path, strerror(errno));
    const size_t bytes = (size_t)count * DTYPES[dtype].size;
    int ok = fwrite(head, 1, padded, f) == padded && (bytes == 0 || fwrite(data, 1, bytes, f) == bytes);
    if (fclose(f) != 0 || !ok)
        return fail(err, errlen, "%s: write error: %s", path, strerror(errno));
    return 0;
}
