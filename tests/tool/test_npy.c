/* .npy: round trips of every dtype and rank, hand-made v1/v2/v3 headers,
 * rejection of malformed files with a reason, and a short deterministic
 * mutation fuzz of the in-memory parser (run it under ASan to make it mean
 * something; the build's sanitizer options decide). */
#define _POSIX_C_SOURCE 200809L
#include "npy.h"
#include "check.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static char tmpdir[512];

static const char *tmp(const char *name)
{
    static char path[700];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    return path;
}

static void test_round_trip(void)
{
    for (int t = 0; t < FT_NPY_DTYPE_COUNT; t++) {
        int64_t shape[3] = {2, 3, 5};
        size_t es = ft_npy_dtype_size((ft_npy_dtype)t);
        unsigned char buf[2 * 3 * 5 * 8];
        for (size_t i = 0; i < sizeof buf; i++)
            buf[i] = (unsigned char)(i * 7 + (size_t)t);
        if (t == FT_NPY_BOOL)
            for (size_t i = 0; i < sizeof buf; i++)
                buf[i] &= 1;
        for (int ndim = 0; ndim <= 3; ndim++) {
            char err[256] = "";
            CHECK(ft_npy_write(tmp("rt.npy"), (ft_npy_dtype)t, ndim, shape, buf, err, sizeof err) == 0);
            ft_npy a;
            CHECK(ft_npy_read(tmp("rt.npy"), &a, err, sizeof err) == 0);
            int64_t count = 1;
            for (int d = 0; d < ndim; d++)
                count *= shape[d];
            CHECK(a.h.dtype == (ft_npy_dtype)t && a.h.ndim == ndim && a.h.count == count);
            CHECK(a.h.data_offset % 64 == 0);
            CHECK(a.data && memcmp(a.data, buf, (size_t)count * es) == 0);
            ft_npy_free(&a);
        }
    }
    /* A zero-size array. */
    int64_t zshape[2] = {0, 4};
    char err[256];
    CHECK(ft_npy_write(tmp("z.npy"), FT_NPY_F32, 2, zshape, NULL, err, sizeof err) == 0);
    ft_npy z;
    CHECK(ft_npy_read(tmp("z.npy"), &z, err, sizeof err) == 0 && z.h.count == 0);
    ft_npy_free(&z);
}

/* Builds a file image: magic, version, header text (padded to 64), data. */
static size_t make(unsigned char *out, int major, const char *dict, size_t data_bytes, int pad)
{
    size_t prefix = major == 1 ? 10 : 12;
    size_t n = strlen(dict);
    size_t hlen = n;
    if (pad)
        hlen = ((prefix + n + 1 + 63) / 64) * 64 - prefix;
    memcpy(out, "\x93NUMPY", 6);
    out[6] = (unsigned char)major;
    out[7] = 0;
    out[8] = (unsigned char)(hlen & 0xff);
    out[9] = (unsigned char)(hlen >> 8);
    if (major != 1) {
        out[10] = 0;
        out[11] = 0;
    }
    memcpy(out + prefix, dict, n);
    if (pad) {
        memset(out + prefix + n, ' ', hlen - n - 1);
        out[prefix + hlen - 1] = '\n';
    }
    for (size_t i = 0; i < data_bytes; i++)
        out[prefix + hlen + i] = (unsigned char)i;
    return prefix + hlen + data_bytes;
}

static void expect_ok(int major, const char *dict, size_t data_bytes, int64_t count)
{
    unsigned char img[4096];
    size_t len = make(img, major, dict, data_bytes, 1);
    ft_npy a;
    char err[256] = "";
    int rc = ft_npy_parse(img, len, &a, err, sizeof err);
    if (rc != 0)
        fprintf(stderr, "  unexpected rejection of %s: %s\n", dict, err);
    CHECK(rc == 0 && a.h.count == count);
}

static void expect_bad_image(const unsigned char *img, size_t len, const char *needle)
{
    ft_npy a;
    char err[256] = "";
    CHECK(ft_npy_parse(img, len, &a, err, sizeof err) != 0);
    fprintf(stderr, "  rejected: %s\n", err);
    CHECK(err[0] != '\0');
    CHECK(needle == NULL || strstr(err, needle) != NULL);
}

static void expect_bad(int major, const char *dict, size_t data_bytes, const char *needle)
{
    unsigned char img[4096];
    size_t len = make(img, major, dict, data_bytes, 1);
    expect_bad_image(img, len, needle);
}

static void test_headers(void)
{
    const char *f4x3 = "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }";
    expect_ok(1, f4x3, 12, 3);
    expect_ok(2, f4x3, 12, 3);
    expect_ok(3, f4x3, 12, 3);
    expect_ok(1, "{\"shape\": (2, 2), \"fortran_order\": False, \"descr\": \"<i8\"}", 32, 4);
    expect_ok(1, "{'descr': '|b1', 'fortran_order': False, 'shape': ()}", 1, 1);
    expect_ok(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (2L, 1L), }", 16, 2);

    expect_bad(1, f4x3, 8, "truncated");
    expect_bad(1, f4x3, 16, "beyond");
    expect_bad(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (3,), }", 12, "Fortran");
    expect_bad(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (3,), }", 12, "big-endian");
    expect_bad(1, "{'descr': '<c8', 'fortran_order': False, 'shape': (3,), }", 24, "unsupported dtype");
    expect_bad(1, "{'descr': '|O', 'fortran_order': False, 'shape': (3,), }", 24, "unsupported dtype");
    expect_bad(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }", 12, "structured");
    expect_bad(1, "{'descr': '<f4', 'shape': (3,), }", 12, "fortran_order");
    expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'x': 1}", 12, "unexpected key");
    expect_bad(1, "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (3,)}", 12, "repeats");
    expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3), }", 12, "not a tuple");
    expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-3,), }", 12, "non-negative");
    expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", 0,
               "overflow");
    expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", 0,
               "too large");
    expect_bad(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), } junk", 12, "trailing");
    expect_bad(1, "{'descr': '<f4, 'fortran_order': False, 'shape': (3,), }", 12, NULL);
    expect_bad(1, "['descr', '<f4']", 12, "dict");
    expect_bad(1, "{'descr': '<f4' 'fortran_order': False, 'shape': (3,), }", 12, NULL);

    unsigned char img[4096];
    size_t len = make(img, 1, f4x3, 12, 1);
    img[0] = 'X';
    expect_bad_image(img, len, "magic");
    len = make(img, 1, f4x3, 12, 1);
    img[6] = 4;
    expect_bad_image(img, len, "version");
    len = make(img, 1, f4x3, 12, 1);
    expect_bad_image(img, 40, "truncated header");
    expect_bad_image(img, 5, "too short");
    len = make(img, 2, f4x3, 12, 1);
    img[11] = 0x7f; /* a 2 GiB header length */
    expect_bad_image(img, len, "implausibly");

    /* The file reader reports the same things, with the path. */
    FILE *f = fopen(tmp("trunc.npy"), "wb");
    len = make(img, 1, f4x3, 12, 1);
    fwrite(img, 1, len - 4, f);
    fclose(f);
    ft_npy a;
    char err[512] = "";
    CHECK(ft_npy_read(tmp("trunc.npy"), &a, err, sizeof err) != 0);
    CHECK(strstr(err, "trunc.npy") && strstr(err, "truncated"));
    fprintf(stderr, "  rejected: %s\n", err);
    f = fopen(tmp("short.npy"), "wb");
    fwrite(img, 1, 7, f);
    fclose(f);
    CHECK(ft_npy_read(tmp("short.npy"), &a, err, sizeof err) != 0);
    fprintf(stderr, "  rejected: %s\n", err);
    CHECK(ft_npy_read(tmp("missing.npy"), &a, err, sizeof err) != 0);
}

/* Random byte flips, truncations and insertions of valid images: the parser
 * must either accept (with a self-consistent header) or refuse with a message. */
static void test_fuzz(void)
{
    uint64_t s = 0x9e3779b97f4a7c15ull;
    const char *dicts[] = {"{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2), }",
                           "{'descr': '|u1', 'fortran_order': False, 'shape': (), }",
                           "{'descr': '<i8', 'fortran_order': False, 'shape': (5,), }"};
    size_t datas[] = {24, 1, 40};
    for (int iter = 0; iter < 20000; iter++) {
        unsigned char img[4096];
        int which = iter % 3;
        size_t len = make(img, 1 + iter % 3, dicts[which], datas[which], 1);
        int edits = 1 + (int)((s >> 60) & 3);
        for (int e = 0; e < edits && len > 0; e++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            size_t pos = (size_t)(s >> 33) % len;
            switch ((s >> 20) & 3) {
            case 0:
                img[pos] = (unsigned char)(s >> 8);
                break;
            case 1:
                len = pos;
                break;
            case 2:
                img[pos] ^= (unsigned char)(1u << ((s >> 12) & 7));
                break;
            default:
                if (len + 1 < sizeof img) {
                    memmove(img + pos + 1, img + pos, len - pos);
                    img[pos] = "(),'0:{} "[(s >> 4) % 9];
                    len++;
                }
            }
        }
        unsigned char *copy = malloc(len ? len : 1); /* exact size so ASan sees overreads */
        memcpy(copy, img, len);
        ft_npy a;
        char err[256] = "";
        if (ft_npy_parse(copy, len, &a, err, sizeof err) == 0) {
            CHECK(a.h.data_offset + a.h.data_bytes == len);
            CHECK(a.h.data_bytes == (size_t)a.h.count * ft_npy_dtype_size(a.h.dtype));
        } else {
            CHECK(err[0] != '\0');
        }
        free(copy);
    }
}

int main(int argc, char **argv)
{
    snprintf(tmpdir, sizeof tmpdir, "%s", argc > 1 ? argv[1] : ".");
    test_round_trip();
    test_headers();
    test_fuzz();
    return TEST_RESULT();
}
