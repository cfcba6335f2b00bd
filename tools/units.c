/* Strict number parsing: see units.h for why. */
#define _POSIX_C_SOURCE 200809L
#include "units.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

int ft_parse_int64(const char *s, int64_t *out)
{
    if (s == NULL || *s == '\0' || isspace((unsigned char)*s))
        return -1;
    errno = 0;
    char *end = NULL;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0')
        return -1;
    *out = (int64_t)v;
    return 0;
}

int ft_parse_double(const char *s, double *out)
{
    if (s == NULL || *s == '\0' || isspace((unsigned char)*s))
        return -1;
    /* strtod also reads hex floats, "inf" and "nan": only plain decimals here. */
    for (const char *c = s; *c; c++)
        if (!(isdigit((unsigned char)*c) || *c == '.' || *c == 'e' || *c == 'E' ||
              *c == '+' || *c == '-'))
            return -1;
    errno = 0;
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || !isfinite(v) || errno == ERANGE)
        return -1;
    *out = v;
    return 0;
}

int ft_parse_bool(const char *s, int *out)
{
    static const char *const yes[] = {"true", "yes", "on", "1"};
    static const char *const no[] = {"false", "no", "off", "0"};
    if (s == NULL)
        return -1;
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *out = 1;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *out = 0;
            return 0;
        }
    }
    return -1;
}

int ft_parse_bytes(const char *s, uint64_t *out)
{
    static const struct {
        const char *suffix;
        double scale;
    } units[] = {
        {"", 1.0},           {"b", 1.0},
        {"k", 1024.0},       {"kib", 1024.0},       {"kb", 1e3},
        {"m", 1048576.0},    {"mib", 1048576.0},    {"mb", 1e6},
        {"g", 1073741824.0}, {"gib", 1073741824.0}, {"gb", 1e9},
        {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12},
    };
    if (s == NULL || *s == '\0')
        return -1;
    size_t len = strlen(s);
    size_t num_len = 0;
    while (num_len < len && (isdigit((unsigned char)s[num_len]) || s[num_len] == '.' ||
                             ((s[num_len] == 'e' || s[num_len] == 'E') && num_len > 0 &&
                              num_len + 1 < len && isdigit((unsigned char)s[num_len + 1]))))
        num_len++;
    if (num_len == 0 || num_len > 63)
        return -1;
    char num[64];
    memcpy(num, s, num_len);
    num[num_len] = '\0';
    double v;
    if (ft_parse_double(num, &v) != 0 || v < 0)
        return -1;
    const char *suffix = s + num_len;
    while (*suffix == ' ') /* "12 MiB" reads like "12MiB" */
        suffix++;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcasecmp(suffix, units[i].suffix) != 0)
            continue;
        double bytes = v * units[i].scale;
        if (!(bytes < 9.2e18) || bytes != floor(bytes))
            return -1; /* fractional bytes or beyond int64 */
        *out = (uint64_t)bytes;
        return 0;
    }
    return -1;
}

void ft_format_bytes(uint64_t bytes, char *buf, size_t n)
{
    static const char *const names[] = {"TiB", "GiB", "MiB", "KiB"};
    static const int shifts[] = {40, 30, 20, 10};
    for (size_t i = 0; i < 4; i++) {
        uint64_t unit = (uint64_t)1 << shifts[i];
        if (bytes != 0 && bytes % unit == 0) {
            snprintf(buf, n, "%llu%s", (unsigned long long)(bytes / unit), names[i]);
            return;
        }
    }
    snprintf(buf, n, "%llu", (unsigned long long)bytes);
}

void ft_format_bytes_human(double bytes, char *buf, size_t n)
{
    static const char *const names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    size_t i = 0;
    double v = bytes;
    while (fabs(v) >= 1024.0 && i + 1 < sizeof names / sizeof names[0]) {
        v /= 1024.0;
        i++;
    }
    if (i == 0)
        snprintf(buf, n, "%.0f B", v);
    else
        snprintf(buf, n, "%.2f %s", v, names[i]);
}
