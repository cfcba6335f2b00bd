/*
 * A minimal streaming JSON writer: objects, arrays, numbers, strings. Enough
 * for the gradcheck report and bench's JSON lines, no allocation. Non-finite
 * numbers become null because JSON has no NaN or Infinity.
 */
#ifndef FT_JSON_H
#define FT_JSON_H

#include <stdint.h>
#include <stdio.h>

#define FT_JSON_MAX_DEPTH 8

typedef struct ft_json {
    FILE *f;
    int depth;
    int first[FT_JSON_MAX_DEPTH];
} ft_json;

void ft_json_init(ft_json *j, FILE *f);
void ft_json_object_begin(ft_json *j, const char *key); /* key NULL inside arrays / at top */
void ft_json_object_end(ft_json *j);
void ft_json_array_begin(ft_json *j, const char *key);
void ft_json_array_end(ft_json *j);
void ft_json_num(ft_json *j, const char *key, double v);
void ft_json_int(ft_json *j, const char *key, int64_t v);
void ft_json_str(ft_json *j, const char *key, const char *v);
void ft_json_bool(ft_json *j, const char *key, int v);

#endif
