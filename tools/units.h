/*
 * Strict text -> number parsing for the config and the command line.
 * strtoll/strtod alone accept trailing junk, leading spaces and "nan"; a
 * config typo must be an error, so every parser here consumes the whole
 * string and rejects non-finite values.
 */
#ifndef FT_UNITS_H
#define FT_UNITS_H

#include <stddef.h>
#include <stdint.h>

/* Whole string is a decimal integer (optional sign). 0 on success, -1 otherwise. */
int ft_parse_int64(const char *s, int64_t *out);
/* Whole string is a finite floating-point number. */
int ft_parse_double(const char *s, double *out);
/* true/false, yes/no, on/off, 1/0 (case-insensitive). */
int ft_parse_bool(const char *s, int *out);
/* A byte count: "4096", "128MiB", "1.5GiB", "2G", "500MB". KiB/MiB/GiB/TiB and
 * the bare K/M/G/T are powers of 1024; KB/MB/GB/TB are powers of 1000. The
 * result must be a whole number of bytes below 2^63. */
int ft_parse_bytes(const char *s, uint64_t *out);
/* The shortest exact spelling: "128MiB" when divisible, else plain digits. */
void ft_format_bytes(uint64_t bytes, char *buf, size_t n);
/* A human approximation for tables: "1.50 GiB". */
void ft_format_bytes_human(double bytes, char *buf, size_t n);

#endif
