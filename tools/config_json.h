/* The whole config as a JSON object (numbers as numbers, words as strings),
 * so a JSON result records exactly what produced it. */
#ifndef FT_CONFIG_JSON_H
#define FT_CONFIG_JSON_H

#include "config.h"
#include "json.h"

void ft_config_json(ft_json *j, const char *key, const ft_config *cfg);

#endif
