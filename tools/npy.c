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
    const char *descr; /* without the byte-order character */
    const char *name;
    size_t size;
} DTYPES[FT_NPY_DTYPE_COUNT] = {
    [FT_NPY_BOOL] = {"b1", "bool", 1}, [FT_NPY_I8] = {"i1", "int8", 1},
    [FT_NPY_U8] = {"u1", "uint8", 1},  [FT_NPY_I16] = {"i2", "int16", 2},
    [FT_NPY_U16] = {"u2", "uint16", 2}, [FT_NPY_I32] = {"i4", "int32", 4},
    [FT_NPY_U32] = {"u4", "uint32", 4}, [FT_NPY_I64] = {"i8", "int64", 8},
    [FT_NPY_U64] = {"u8", "uint64", 8}, [FT_NPY_F32] = {"f4", "float32", 4},
    [FT_NPY_F64] = {"f8", "float64", 8},
};

size_t ft_npy_dtype_size(ft_npy_dtype t) { return (unsigned)t < FT_NPY_DTYPE_COUNT ? DTYPES[t].size : 0; }
const char *ft_npy_dtype_name(ft_npy_dtype t)
{
    return (unsigned)t < FT_NPY_DTYPE_COUNT ? DTYPES[t].name : "?";
}
const char *ft_npy_dtype_descr(ft_npy_dtype t)
{
    static const char *const full[FT_NPY_DTYPE_COUNT] = {"|b1", "|i1", "|u1", "<i2", "<u2", "<i4",
                                                         "<u4", "<i8", "<u8", "<f4", "<f8"};
    return (unsigned)t < FT_NPY_DTYPE_COUNT ? full[t] : "?";
}

static int fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

void ft_npy_shape_str(const ft_npy_header *h, char *buf, size_t n)
{
    size_t used = 0;
    used += (size_t)snprintf(buf, n, "(");
    for (int i = 0; i < h->ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", (long long)h->shape[i]);
    if (used < n)
        snprintf(buf + used, n - used, h->ndim == 1 ? ",)" : ")");
}

/* ------------------------------------------------ the header dict literal */

typedef struct cursor {
    const char *p, *end;
} cursor;

static void skip_ws(cursor *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static int eat(cursor *c, char ch)
{
    skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A quoted Python string without escapes into out (NUL-terminated). */
static int parse_string(cursor *c, char *out, size_t n)
{
    skip_ws(c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"'))
        return -1;
    char q = *c->p++;
    size_t len = 0;
    while (c->p < c->end && *c->p != q) {
        unsigned char ch = (unsigned char)*c->p;
        if (ch == '\\' || ch < 0x20 || ch >= 0x7f || len + 1 >= n)
            return -1;
        out[len++] = *c->p++;
    }
    if (c->p >= c->end)
        return -1;
    c->p++;
    out[len] = '\0';
    return 0;
}

static int starts_with_word(cursor *c, const char *w)
{
    skip_ws(c);
    size_t n = strlen(w);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, w, n) != 0)
        return 0;
    c->p += n;
    return 1;
}

static int parse_shape(cursor *c, ft_npy_header *h, char *err, size_t errlen)
{
    if (!eat(c, '('))
        return fail(err, errlen, "'shape' is not a tuple");
    h->ndim = 0;
    int need_comma_for_tuple = 0;
    for (;;) {
        if (eat(c, ')'))
            break;
        skip_ws(c);
        if (c->p >= c->end || *c->p < '0' || *c->p > '9')
            return fail(err, errlen, "'shape' holds something that is not a non-negative integer");
        int64_t v = 0;
        while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
            if (v > (INT64_MAX - 9) / 10)
                return fail(err, errlen, "a dimension in 'shape' is too large");
            v = v * 10 + (*c->p - '0');
            c->p++;
        }
        if (c->p < c->end && *c->p == 'L') /* Python 2 era files */
            c->p++;
        if (h->ndim >= FT_NPY_MAX_DIMS)
            return fail(err, errlen, "'shape' has more than %d dimensions", FT_NPY_MAX_DIMS);
        h->shape[h->ndim++] = v;
        if (eat(c, ',')) {
            need_comma_for_tuple = 0;
            continue;
        }
        need_comma_for_tuple = (h->ndim == 1);
        if (!eat(c, ')'))
            return fail(err, errlen, "'shape' tuple is malformed");
        break;
    }
    if (need_comma_for_tuple)
        return fail(err, errlen, "'shape' is '(n)', an integer, not a tuple (numpy writes '(n,)')");
    return 0;
}

static int parse_descr(const char *d, ft_npy_dtype *out, char *err, size_t errlen)
{
    size_t len = strlen(d);
    if (len < 2)
        return fail(err, errlen, "unsupported dtype '%s'", d);
    char order = d[0];
    const char *code = d + 1;
    for (int t = 0; t < FT_NPY_DTYPE_COUNT; t++) {
        if (strcmp(code, DTYPES[t].descr) != 0)
            continue;
        if (order == '>' && DTYPES[t].size > 1)
            return fail(err, errlen, "big-endian data ('%s') is not supported", d);
        if (order != '<' && order != '|' && order != '=' && order != '>')
            return fail(err, errlen, "unsupported dtype '%s'", d);
        if (order == '|' && DTYPES[t].size > 1)
            return fail(err, errlen, "dtype '%s' lacks a byte order", d);
        *out = (ft_npy_dtype)t;
        return 0;
    }
    return fail(err, errlen,
                "unsupported dtype '%s' (supported: bool, int8/16/32/64, uint8/16/32/64, float32, "
                "float64)",
                d);
}

static int parse_dict(const char *text, size_t len, ft_npy_header *h, char *err, size_t errlen)
{
    cursor c = {text, text + len};
    int have_descr = 0, have_order = 0, have_shape = 0;
    if (!eat(&c, '{'))
        return fail(err, errlen, "header is not a dict literal");
    for (;;) {
        if (eat(&c, '}'))
            break;
        char key[32];
        if (parse_string(&c, key, sizeof key) != 0)
            return fail(err, errlen, "header dict has a malformed key");
        if (!eat(&c, ':'))
            return fail(err, errlen, "header dict: missing ':' after '%s'", key);
        if (strcmp(key, "descr") == 0) {
            char d[32];
            if (have_descr++)
                return fail(err, errlen, "header repeats 'descr'");
            skip_ws(&c);
            if (c.p < c.end && *c.p == '[')
                return fail(err, errlen, "structured dtypes are not supported");
            if (parse_string(&c, d, sizeof d) != 0)
                return fail(err, errlen, "'descr' is not a dtype string");
            if (parse_descr(d, &h->dtype, err, errlen) != 0)
                return -1;
        } else if (strcmp(key, "fortran_order") == 0) {
            if (have_order++)
                return fail(err, errlen, "header repeats 'fortran_order'");
            if (starts_with_word(&c, "True"))
                return fail(err, errlen, "Fortran-order arrays are not supported (save C order)");
            if (!starts_with_word(&c, "False"))
                return fail(err, errlen, "'fortran_order' is not True or False");
        } else if (strcmp(key, "shape") == 0) {
            if (have_shape++)
                return fail(err, errlen, "header repeats 'shape'");
            if (parse_shape(&c, h, err, errlen) != 0)
                return -1;
        } else {
            return fail(err, errlen, "header has an unexpected key '%s'", key);
        }
        if (eat(&c, ','))
            continue;
        if (!eat(&c, '}'))
            return fail(err, errlen, "header dict is malformed after '%s'", key);
        break;
    }
    skip_ws(&c); /* the padding: spaces and the final newline */
    if (c.p != c.end)
        return fail(err, errlen, "header has trailing bytes after the dict");
    if (!have_descr || !have_order || !have_shape)
        return fail(err, errlen, "header lacks '%s'",
                    !have_descr ? "descr" : !have_order ? "fortran_order" : "shape");
    return 0;
}

int ft_npy_parse_header(const void *buf, size_t len, ft_npy_header *out, char *err, size_t errlen)
{
    const unsigned char *b = buf;
    memset(out, 0, sizeof *out);
    if (len < 10 || memcmp(b, "\x93NUMPY", 6) != 0)
        return fail(err, errlen, len < 10 ? "file too short for a .npy header" : "not a .npy file (bad magic)");
    out->major = b[6];
    out->minor = b[7];
    if (out->major < 1 || out->major > 3 || out->minor != 0)
        return fail(err, errlen, "unsupported .npy format version %d.%d", out->major, out->minor);
    size_t prefix = out->major == 1 ? 10 : 12;
    if (len < prefix)
        return fail(err, errlen, "file too short for a .npy header");
    size_t hlen = out->major == 1 ? (size_t)b[8] | (size_t)b[9] << 8
                                  : (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 |
                                        (size_t)b[11] << 24;
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
    size_t esize = ft_npy_dtype_size(out->dtype);
    if ((uint64_t)count > (uint64_t)(INT64_MAX / (int64_t)esize) ||
        (uint64_t)count * esize > (uint64_t)SIZE_MAX)
        return fail(err, errlen, "shape's byte count overflows");
    out->count = count;
    out->data_bytes = (size_t)count * esize;
    out->data_offset = prefix + hlen;
    return 0;
}

static int check_data_len(const ft_npy_header *h, size_t have, char *err, size_t errlen)
{
    char shape[256];
    if (have == h->data_bytes)
        return 0;
    ft_npy_shape_str(h, shape, sizeof shape);
    if (have < h->data_bytes)
        return fail(err, errlen, "truncated: shape %s of %s needs %zu data bytes, found %zu", shape,
                    ft_npy_dtype_name(h->dtype), h->data_bytes, have);
    return fail(err, errlen, "%zu bytes beyond the data that shape %s of %s describes",
                have - h->data_bytes, shape, ft_npy_dtype_name(h->dtype));
}

int ft_npy_parse(const void *buf, size_t len, ft_npy *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (ft_npy_parse_header(buf, len, &out->h, err, errlen) != 0)
        return -1;
    if (check_data_len(&out->h, len - out->h.data_offset, err, errlen) != 0)
        return -1;
    out->data = (unsigned char *)buf + out->h.data_offset;
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
    size_t fsize = (size_t)st.st_size;
    unsigned char pre[12];
    size_t got = fread(pre, 1, sizeof pre, f);
    size_t hlen = 0;
    if (got >= 10 && memcmp(pre, "\x93NUMPY", 6) == 0)
        hlen = pre[6] == 1 ? (size_t)pre[8] | (size_t)pre[9] << 8
                           : got < 12 ? 0 : (size_t)pre[8] | (size_t)pre[9] << 8 |
                                                (size_t)pre[10] << 16 | (size_t)pre[11] << 24;
    if (hlen > MAX_HEADER_LEN)
        hlen = MAX_HEADER_LEN; /* the parser reports it */
    size_t want = 12 + hlen < fsize ? 12 + hlen : fsize;
    unsigned char *head = malloc(want > 0 ? want : 1);
    if (head == NULL) {
        fclose(f);
        return fail(err, errlen, "%s: out of memory", path);
    }
    memcpy(head, pre, got < want ? got : want);
    if (want > got && fread(head + got, 1, want - got, f) != want - got) {
        free(head);
        fclose(f);
        return fail(err, errlen, "%s: read error", path);
    }
    int rc = ft_npy_parse_header(head, want, &out->h, why, sizeof why);
    free(head);
    if (rc == 0 && fsize >= out->h.data_offset)
        rc = check_data_len(&out->h, fsize - out->h.data_offset, why, sizeof why);
    else if (rc == 0)
        rc = fail(why, sizeof why, "truncated header");
    if (rc != 0) {
        fclose(f);
        return fail(err, errlen, "%s: %s", path, why);
    }
    out->data = malloc(out->h.data_bytes > 0 ? out->h.data_bytes : 1);
    if (out->data == NULL) {
        fclose(f);
        return fail(err, errlen, "%s: out of memory for %zu bytes", path, out->h.data_bytes);
    }
    if (fseek(f, (long)out->h.data_offset, SEEK_SET) != 0 ||
        fread(out->data, 1, out->h.data_bytes, f) != out->h.data_bytes) {
        fclose(f);
        ft_npy_free(out);
        return fail(err, errlen, "%s: read error (file changed while reading?)", path);
    }
    fclose(f);
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
    char dict[64 + FT_NPY_MAX_DIMS * 24];
    int n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (",
                     ft_npy_dtype_descr(dtype));
    uint64_t count = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return fail(err, errlen, "%s: negative dimension", path);
        n += snprintf(dict + n, sizeof dict - (size_t)n, "%s%lld", i ? ", " : "", (long long)shape[i]);
        count *= (uint64_t)shape[i];
    }
    n += snprintf(dict + n, sizeof dict - (size_t)n, "%s), }", ndim == 1 ? "," : "");
    /* Pad with spaces and a final newline so the data starts 64-byte aligned. */
    size_t prefix = 10;
    size_t total = prefix + (size_t)n + 1;
    int major = 1;
    if (((total + 63) / 64) * 64 - prefix > 65535) {
        prefix = 12;
        major = 2;
        total = prefix + (size_t)n + 1;
    }
    size_t padded = (total + 63) / 64 * 64;
    size_t hlen = padded - prefix;
    unsigned char head[12 + sizeof dict + 64];
    memcpy(head, "\x93NUMPY", 6);
    head[6] = (unsigned char)major;
    head[7] = 0;
    head[8] = (unsigned char)(hlen & 0xff);
    head[9] = (unsigned char)(hlen >> 8 & 0xff);
    if (major == 2) {
        head[10] = (unsigned char)(hlen >> 16 & 0xff);
        head[11] = (unsigned char)(hlen >> 24 & 0xff);
    }
    memcpy(head + prefix, dict, (size_t)n);
    memset(head + prefix + n, ' ', hlen - (size_t)n - 1);
    head[padded - 1] = '\n';

    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return fail(err, errlen, "%s: cannot create: %s", path, strerror(errno));
    size_t bytes = (size_t)count * ft_npy_dtype_size(dtype);
    int ok = fwrite(head, 1, padded, f) == padded;
    if (ok && bytes > 0)
        ok = fwrite(data, 1, bytes, f) == bytes;
    if (fclose(f) != 0)
        ok = 0;
    if (!ok)
        return fail(err, errlen, "%s: write error: %s", path, strerror(errno));
    return 0;
}
