/* Streaming JSON writer: see json.h. */
#include "json.h"

#include <math.h>

void ft_json_init(ft_json *j, FILE *f)
{
    j->f = f;
    j->depth = 0;
    j->first[0] = 1;
}

static void put_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p == '\n')
            fputs("\\n", f);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

static void prefix(ft_json *j, const char *key)
{
    if (!j->first[j->depth])
        fputs(", ", j->f);
    j->first[j->depth] = 0;
    if (key) {
        put_string(j->f, key);
        fputs(": ", j->f);
    }
}

static void open_(ft_json *j, const char *key, char c)
{
    prefix(j, key);
    fputc(c, j->f);
    if (j->depth + 1 < FT_JSON_MAX_DEPTH)
        j->depth++;
    j->first[j->depth] = 1;
}

static void close_(ft_json *j, char c)
{
    fputc(c, j->f);
    if (j->depth > 0)
        j->depth--;
    if (j->depth == 0)
        fputc('\n', j->f); /* one top-level value per line: JSON lines */
}

void ft_json_object_begin(ft_json *j, const char *key) { open_(j, key, '{'); }
void ft_json_object_end(ft_json *j) { close_(j, '}'); }
void ft_json_array_begin(ft_json *j, const char *key) { open_(j, key, '['); }
void ft_json_array_end(ft_json *j) { close_(j, ']'); }

void ft_json_num(ft_json *j, const char *key, double v)
{
    prefix(j, key);
    if (isfinite(v))
        fprintf(j->f, "%.17g", v);
    else
        fputs("null", j->f);
}

void ft_json_int(ft_json *j, const char *key, int64_t v)
{
    prefix(j, key);
    fprintf(j->f, "%lld", (long long)v);
}

void ft_json_str(ft_json *j, const char *key, const char *v)
{
    prefix(j, key);
    put_string(j->f, v ? v : "");
}

void ft_json_bool(ft_json *j, const char *key, int v)
{
    prefix(j, key);
    fputs(v ? "true" : "false", j->f);
}
