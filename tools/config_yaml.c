/*
 * Config files: a flat YAML mapping `key: value`, read with libyaml's event
 * parser so every error carries the line (libyaml's marks) of the key it
 * concerns. Values go through ft_config_set, i.e. the same key table and
 * type checks as --set.
 */
#define _POSIX_C_SOURCE 200809L
#include "config.h"

#include <errno.h>
#include <stdarg.h>
#include <string.h>
#include <yaml.h>

#define MAX_KEYS 256 /* more than the table holds; only bounds duplicate tracking */

static void set_err(char *err, size_t errlen, const char *origin, long line, const char *fmt, ...)
{
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (err == NULL || errlen == 0)
        return;
    if (line > 0)
        snprintf(err, errlen, "%s:%ld: %s", origin, line, msg);
    else
        snprintf(err, errlen, "%s: %s", origin, msg);
}

static int known(const char *key)
{
    for (size_t i = 0; i < ft_config_key_count(); i++)
        if (strcmp(ft_config_key_name(i), key) == 0)
            return 1;
    return 0;
}


/* A scalar's text, with YAML's null spellings mapped to "" for plain scalars
 * (so `epsilon_high: ~` and `epsilon_high:` mean auto, and `batch:` is a
 * "missing value" error rather than a silent default). */
static const char *scalar_text(const yaml_event_t *ev)
{
    const char *s = (const char *)ev->data.scalar.value;
    if (ev->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
        (strcmp(s, "~") == 0 || strcmp(s, "null") == 0 || strcmp(s, "Null") == 0 ||
         strcmp(s, "NULL") == 0))
        return "";
    return s;
}

static long mark_line(const yaml_mark_t *m) { return (long)m->line + 1; }

static const char *event_what(yaml_event_type_t t)
{
    switch (t) {
    case YAML_SEQUENCE_START_EVENT:
        return "a list";
    case YAML_MAPPING_START_EVENT:
        return "a mapping";
    case YAML_ALIAS_EVENT:
        return "an alias";
    default:
        return "something unexpected";
    }
}

typedef struct seen_key {
    char name[64];
    long line;
} seen_key;

static int load_parser(ft_config *cfg, yaml_parser_t *parser, const char *origin, char *err,
                       size_t errlen)
{
    /* States of the tiny grammar: stream > document > one flat mapping. */
    enum { S_STREAM, S_DOC, S_TOP, S_KEY, S_VALUE, S_AFTER_MAP, S_END } state = S_STREAM;
    seen_key seen[MAX_KEYS];
    size_t nseen = 0;
    char key[64] = "";
    long key_line = 0;
    int docs = 0;
    int rc = -1;

    for (;;) {
        yaml_event_t ev;
        if (!yaml_parser_parse(parser, &ev)) {
            set_err(err, errlen, origin, mark_line(&parser->problem_mark), "YAML syntax error: %s%s%s",
                    parser->problem ? parser->problem : "unknown", parser->context ? " " : "",
                    parser->context ? parser->context : "");
            return -1;
        }
        long line = mark_line(&ev.start_mark);
        yaml_event_type_t t = ev.type;
        int ok = 1;
        switch (state) {
        case S_STREAM:
            if (t == YAML_STREAM_START_EVENT)
                state = S_DOC;
            break;
        case S_DOC:
            if (t == YAML_DOCUMENT_START_EVENT) {
                if (++docs > 1) {
                    set_err(err, errlen, origin, line, "only one YAML document is allowed");
                    ok = 0;
                }
                state = S_TOP;
            } else if (t == YAML_STREAM_END_EVENT) {
                state = S_END;
            }
            break;
        case S_TOP:
            if (t == YAML_MAPPING_START_EVENT) {
                state = S_KEY;
            } else if (t == YAML_SCALAR_EVENT && scalar_text(&ev)[0] == '\0') {
                state = S_AFTER_MAP; /* an empty document: nothing to set */
            } else {
                set_err(err, errlen, origin, line, "the top level must be a mapping of key: value");
                ok = 0;
            }
            break;
        case S_KEY:
            if (t == YAML_MAPPING_END_EVENT) {
                state = S_AFTER_MAP;
            } else if (t == YAML_SCALAR_EVENT) {
                const char *k = (const char *)ev.data.scalar.value;
                if (strlen(k) >= sizeof key) {
                    set_err(err, errlen, origin, line, "unknown key '%.40s...'", k);
                    ok = 0;
                    break;
                }
                snprintf(key, sizeof key, "%s", k);
                key_line = line;
                for (size_t i = 0; i < nseen && ok; i++)
                    if (strcmp(seen[i].name, key) == 0) {
                        set_err(err, errlen, origin, line, "key '%s': duplicate (first set on line %ld)",
                                key, seen[i].line);
                        ok = 0;
                    }
                state = S_VALUE;
            } else {
                set_err(err, errlen, origin, line, "expected a key, found %s", event_what(t));
                ok = 0;
            }
            break;
        case S_VALUE:
            if (t == YAML_SCALAR_EVENT) {
                const char *v = scalar_text(&ev);
                if (*v == '\0' && known(key) && !ft_config_key_allows_auto(key)) {
                    set_err(err, errlen, origin, key_line, "key '%s': missing value", key);
                    ok = 0;
                } else if (ft_config_set(cfg, key, v, origin, key_line, err, errlen) != 0) {
                    ok = 0;
                } else if (nseen < MAX_KEYS) {
                    snprintf(seen[nseen].name, sizeof seen[nseen].name, "%s", key);
                    seen[nseen++].line = key_line;
                }
                state = S_KEY;
            } else {
                /* Unknown beats "not a scalar": say the more useful thing. */
                if (!known(key))
                    ft_config_set(cfg, key, "", origin, key_line, err, errlen);
                else
                    set_err(err, errlen, origin, key_line, "key '%s': expected a scalar value, found %s",
                            key, event_what(t));
                ok = 0;
            }
            break;
        case S_AFTER_MAP:
            if (t == YAML_DOCUMENT_END_EVENT)
                state = S_DOC;
            break;
        case S_END:
            break;
        }
        yaml_event_delete(&ev);
        if (!ok)
            return -1;
        if (t == YAML_STREAM_END_EVENT) {
            rc = 0;
            break;
        }
    }
    return rc;
}

int ft_config_load_string(ft_config *cfg, const char *text, size_t len, const char *origin,
                          char *err, size_t errlen)
{
    yaml_parser_t parser;
    if (!yaml_parser_initialize(&parser)) {
        set_err(err, errlen, origin, 0, "cannot initialise the YAML parser");
        return -1;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    /* Parse into a copy so a failing file leaves the config untouched. */
    ft_config tmp = *cfg;
    int rc = load_parser(&tmp, &parser, origin, err, errlen);
    yaml_parser_delete(&parser);
    if (rc == 0)
        *cfg = tmp;
    return rc;
}

int ft_config_load_file(ft_config *cfg, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        set_err(err, errlen, path, 0, "cannot open: %s", strerror(errno));
        return -1;
    }
    yaml_parser_t parser;
    if (!yaml_parser_initialize(&parser)) {
        fclose(f);
        set_err(err, errlen, path, 0, "cannot initialise the YAML parser");
        return -1;
    }
    yaml_parser_set_input_file(&parser, f);
    ft_config tmp = *cfg;
    int rc = load_parser(&tmp, &parser, path, err, errlen);
    yaml_parser_delete(&parser);
    fclose(f);
    if (rc == 0)
        *cfg = tmp;
    return rc;
}
