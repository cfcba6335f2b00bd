/*
 * Config files: one flat YAML mapping `key: value`, loaded with libyaml's
 * document API so every error carries the line (the node's mark) of the key
 * it concerns. Values go through ft_config_set, i.e. the same key table and
 * type checks as --set.
 */
#define _POSIX_C_SOURCE 200809L
#include "config.h"

#include <errno.h>
#include <string.h>
#include <yaml.h>

static long line_of(const yaml_node_t *n) { return (long)n->start_mark.line + 1; }

static const char *what(const yaml_node_t *n)
{
    return n->type == YAML_SEQUENCE_NODE ? "a list" : n->type == YAML_MAPPING_NODE ? "a mapping" : "a scalar";
}

/* A scalar's text, with YAML's null spellings mapped to "" for plain scalars
 * (so `epsilon_high: ~` and `epsilon_high:` mean auto, and `batch:` is an
 * error rather than a silent default). */
static const char *text_of(const yaml_node_t *n)
{
    const char *s = (const char *)n->data.scalar.value;
    if (n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
        (strcmp(s, "~") == 0 || strcmp(s, "null") == 0 || strcmp(s, "Null") == 0 || strcmp(s, "NULL") == 0))
        return "";
    return s;
}

/* Applies the mapping at the document's root to cfg. */
static int apply(ft_config *cfg, yaml_document_t *doc, const char *origin, char *err, size_t errlen)
{
    yaml_node_t *root = yaml_document_get_root_node(doc);
    if (root == NULL || (root->type == YAML_SCALAR_NODE && *text_of(root) == '\0'))
        return 0; /* an empty file: nothing to set */
    if (root->type != YAML_MAPPING_NODE)
        return ft_config_fail(err, errlen, origin, line_of(root), "the top level must be a mapping");
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start; p < root->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(doc, p->key), *v = yaml_document_get_node(doc, p->value);
        if (k->type != YAML_SCALAR_NODE)
            return ft_config_fail(err, errlen, origin, line_of(k), "expected a key, found %s", what(k));
        const char *key = (const char *)k->data.scalar.value;
        for (yaml_node_pair_t *q = root->data.mapping.pairs.start; q < p; q++) {
            yaml_node_t *seen = yaml_document_get_node(doc, q->key);
            if (strcmp((const char *)seen->data.scalar.value, key) == 0)
                return ft_config_fail(err, errlen, origin, line_of(k), "key '%s': duplicate (line %ld)", key,
                                      line_of(seen));
        }
        if (v->type != YAML_SCALAR_NODE)
            return ft_config_fail(err, errlen, origin, line_of(k), "key '%s': expected a scalar, found %s",
                                  key, what(v));
        if (ft_config_set(cfg, key, text_of(v), origin, line_of(k), err, errlen) != 0)
            return -1;
    }
    return 0;
}

/* Loads the text's first YAML document into a copy of cfg, so a failing
 * file leaves the config untouched. */
int ft_config_load_string(ft_config *cfg, const char *text, size_t len, const char *origin,
                          char *err, size_t errlen)
{
    yaml_parser_t parser;
    yaml_document_t doc;
    ft_config tmp = *cfg;
    if (!yaml_parser_initialize(&parser))
        return ft_config_fail(err, errlen, origin, 0, "cannot initialise the YAML parser");
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    const int loaded = yaml_parser_load(&parser, &doc);
    const int rc = loaded ? apply(&tmp, &doc, origin, err, errlen)
                          : ft_config_fail(err, errlen, origin, (long)parser.problem_mark.line + 1,
                                           "YAML syntax error: %s%s%s", parser.problem ? parser.problem : "?",
                                           parser.context ? " " : "", parser.context ? parser.context : "");
    if (loaded)
        yaml_document_delete(&doc);
    if (rc == 0)
        *cfg = tmp;
    yaml_parser_delete(&parser);
    return rc;
}

int ft_config_load_file(ft_config *cfg, const char *path, char *err, size_t errlen)
{
    static char text[1 << 16]; /* config files are a few dozen lines */
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return ft_config_fail(err, errlen, path, 0, "cannot open: %s", strerror(errno));
    const size_t len = fread(text, 1, sizeof text, f);
    const int whole = len < sizeof text && !ferror(f);
    fclose(f);
    return whole ? ft_config_load_string(cfg, text, len, path, err, errlen)
                 : ft_config_fail(err, errlen, path, 0, "cannot read it whole (more than 64 KiB?)");
}
