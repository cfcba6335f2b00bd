/* Config -> JSON object, driven by the key table: see config_json.h. */
#include "config_json.h"

#include "units.h"

#include <string.h>

void ft_config_json(ft_json *j, const char *key, const ft_config *cfg)
{
    ft_json_object_begin(j, key);
    for (size_t i = 0; i < ft_config_key_count(); i++) {
        const char *k = ft_config_key_name(i);
        char val[128];
        double d;
        int b;
        ft_config_format(cfg, k, val, sizeof val);
        uint64_t bytes = 0;
        if (strcmp(k, "memory_budget") == 0 && ft_parse_bytes(val, &bytes) == 0)
            ft_json_num(j, k, (double)bytes);
        else if (ft_config_key_is_numeric(k) && ft_parse_double(val, &d) == 0)
            ft_json_num(j, k, d);
        else if ((strcmp(val, "true") == 0 || strcmp(val, "false") == 0) && ft_parse_bool(val, &b) == 0)
            ft_json_bool(j, k, b);
        else
            ft_json_str(j, k, val);
    }
    ft_json_object_end(j);
}
