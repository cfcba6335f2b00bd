/*
 * fuzz_config: the tool's YAML config reader (tools/config.c, config_yaml.c,
 * units.c) and the --set path.
 *
 * The input is split at the first NUL byte: the part before it is a YAML
 * document for ft_config_load_string, the part after it (if any) one
 * `--set` assignment for ft_config_set_assignment.
 *
 * Properties (abort() with a message when violated):
 *  1. no crash, no sanitizer report, no leak;
 *  2. a failure leaves a non-empty, NUL-terminated message and leaves the
 *     config unchanged (the loader parses into a copy);
 *  3. a loaded config round-trips: ft_config_print, loaded again from the
 *     defaults, formats every key identically (the print is the tool's own
 *     serialisation, used to hand configs to bench children), and
 *     ft_config_check gives the same verdict on both.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_config: PROPERTY VIOLATED: %s (%s)\n", what, detail ? detail : "");
    fflush(stderr);
    abort();
}

static void check_err(const char *err, size_t n)
{
    if (memchr(err, '\0', n) == NULL)
        die("error message not NUL-terminated", NULL);
    if (err[0] == '\0')
        die("empty error message on failure", NULL);
}

/* Formats every key; returns the first key that differs, or NULL. */
static const char *first_difference(const ft_config *a, const ft_config *b, char *va, char *vb)
{
    for (size_t i = 0; i < ft_config_key_count(); i++) {
        const char *k = ft_config_key_name(i);
        if (ft_config_format(a, k, va, 128) != 0 || ft_config_format(b, k, vb, 128) != 0)
            die("ft_config_format refused a known key", k);
        if (strcmp(va, vb) != 0)
            return k;
    }
    return NULL;
}

static void round_trip(const ft_config *cfg)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return;
    ft_config_print(cfg, f, 0);
    fclose(f);
    ft_config back;
    ft_config_defaults(&back);
    char err[512] = "";
    if (ft_config_load_string(&back, text, len, "roundtrip", err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", text);
        die("the printed config does not load back", err);
    }
    char va[128], vb[128];
    const char *k = first_difference(cfg, &back, va, vb);
    if (k) {
        char d[400];
        snprintf(d, sizeof d, "key %s: '%s' printed, '%s' read back", k, va, vb);
        die("config round trip changed a value", d);
    }
    char e1[512] = "", e2[512] = "";
    if ((ft_config_check(cfg, e1, sizeof e1) == 0) != (ft_config_check(&back, e2, sizeof e2) == 0))
        die("ft_config_check verdict changed by the round trip", e1);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    const size_t ylen = nul ? (size_t)(nul - data) : size;

    ft_config cfg, before;
    ft_config_defaults(&cfg);
    before = cfg;
    char err[512];
    memset(err, 0, sizeof err);
    /* libyaml reads exactly ylen bytes: hand it a copy so ASan bounds it. */
    char *text = malloc(ylen ? ylen : 1);
    if (!text)
        return 0;
    memcpy(text, data, ylen);
    int rc = ft_config_load_string(&cfg, text, ylen, "fuzz.yaml", err, sizeof err);
    free(text);
    if (rc != 0) {
        check_err(err, sizeof err);
        if (memcmp(&cfg, &before, sizeof cfg) != 0)
            die("a failing load changed the config", err);
    } else {
        char e[512] = "";
        if (ft_config_check(&cfg, e, sizeof e) != 0)
            check_err(e, sizeof e);
        round_trip(&cfg);
    }

    if (nul) {
        const size_t alen = size - ylen - 1;
        char *as = malloc(alen + 1);
        if (!as)
            return 0;
        memcpy(as, nul + 1, alen);
        as[alen] = '\0';
        ft_config c2 = cfg, b2 = cfg;
        memset(err, 0, sizeof err);
        if (ft_config_set_assignment(&c2, as, err, sizeof err) != 0) {
            check_err(err, sizeof err);
            if (memcmp(&c2, &b2, sizeof c2) != 0)
                die("a failing --set changed the config", err);
        } else {
            round_trip(&c2);
        }
        free(as);
    }
    return 0;
}
