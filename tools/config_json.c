/* Config -> JSON, driven by the key table, and JSON lines: see config.h. */
#include <cjson/cJSON.h>

#include "config.h"

#include <string.h>

cJSON *ft_config_json(const ft_config *cfg)
{
    cJSON *o = cJSON_CreateObject();
    for (size_t i = 0; i < ft_config_key_count(); i++) {
        const char *k = ft_config_key_name(i);
        char val[128];
        double d;
        uint64_t bytes;
        ft_config_format(cfg, k, val, sizeof val);
        if (ft_parse_bytes(val, &bytes) == 0) /* whole numbers, and memory_budget: 128MiB */
            cJSON_AddNumberToObject(o, k, (double)bytes);
        else if (ft_parse_double(val, &d) == 0)
            cJSON_AddNumberToObject(o, k, d);
        else if (strcmp(val, "true") == 0 || strcmp(val, "false") == 0)
            cJSON_AddBoolToObject(o, k, val[0] == 't');
        else
            cJSON_AddStringToObject(o, k, val);
    }
    return o;
}

int ft_json_write_line(FILE *f, cJSON *obj)
{
    char *text = f ? cJSON_PrintUnformatted(obj) : NULL; /* NaN and Inf print as null */
    int rc = !f || (text && fprintf(f, "%s\n", text) > 0 && fflush(f) == 0) ? 0 : -1;
    cJSON_free(text);
    cJSON_Delete(obj);
    return rc;
}
