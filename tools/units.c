/* Strict number parsing for the config: see config.h for why. */
#define _POSIX_C_SOURCE 200809L
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

int ft_parse_int64(const char *s, int64_t *out)
{
    char *end = NULL;
    errno = 0;
    long long v = s && *s && !isspace((unsigned char)*s) ? strtoll(s, &end, 10) : 0;
    if (end == NULL || end == s || *end != '\0' || errno != 0)
        return -1;
    *out = (int64_t)v;
    return 0;
}

int ft_parse_double(const char *s, double *out)
{
    /* strtod also reads hex floats, "inf" and "nan": only plain decimals here. */
    if (s == NULL || *s == '\0' || strspn(s, "0123456789.eE+-") != strlen(s))
        return -1;
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || !isfinite(v) || errno == ERANGE)
        return -1;
    *out = v;
    return 0;
}

int ft_parse_bool(const char *s, int *out)
{
    static const char *const words[8] = {"false", "no", "off", "0", "true", "yes", "on", "1"};
    for (int i = 0; i < 8 && s; i++)
        if (strcasecmp(s, words[i]) == 0) {
            *out = i >= 4;
            return 0;
        }
    return -1;
}

int ft_parse_bytes(const char *s, uint64_t *out)
{
    static const char prefixes[] = "kmgt";
    char num[64], *end = NULL;
    double v, scale = -1;
    if (s == NULL)
        return -1;
    strtod(s, &end); /* the number ends where strtod stops; it must still be a plain decimal */
    const size_t len = (size_t)(end - s);
    if (len == 0 || len >= sizeof num)
        return -1;
    memcpy(num, s, len);
    num[len] = '\0';
    const char *unit = end + strspn(end, " "); /* "12 MiB" reads like "12MiB" */
    const char *k = *unit ? strchr(prefixes, tolower((unsigned char)*unit)) : NULL;
    const int power = k ? (int)(k - prefixes) + 1 : 0;
    if (*unit == '\0' || strcasecmp(unit, "b") == 0)
        scale = 1;
    else if (k && (unit[1] == '\0' || strcasecmp(unit + 1, "ib") == 0))
        scale = ldexp(1.0, 10 * power);
    else if (k && strcasecmp(unit + 1, "b") == 0)
        scale = pow(1000.0, power);
    if (ft_parse_double(num, &v) != 0 || v < 0 || scale < 0 || !(v * scale < 9.2e18) ||
        v * scale != floor(v * scale))
        return -1; /* not a number, an unknown unit, fractional bytes or beyond int64 */
    *out = (uint64_t)(v * scale);
    return 0;
}

void ft_format_bytes(uint64_t bytes, char *buf, size_t n)
{
    static const char *const names[] = {"KiB", "MiB", "GiB", "TiB"};
    int unit = 0;
    while (unit < 4 && bytes != 0 && bytes % ((uint64_t)1 << (10 * (unit + 1))) == 0)
        unit++;
    if (unit == 0)
        snprintf(buf, n, "%llu", (unsigned long long)bytes);
    else
        snprintf(buf, n, "%llu%s", (unsigned long long)(bytes >> (10 * unit)), names[unit - 1]);
}
