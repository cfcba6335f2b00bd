/* Struct sizes for foreign-function bindings (fg_abi_sizeof in fusedgrpo.h).
 * The Python package restates the public structs with ctypes; it compares
 * each against this table when it loads and refuses to run on a mismatch. */
#include <string.h>

#include "fusedgrpo.h"

#define FG_ABI_ENTRY(t) {#t, sizeof(t)}

static const struct {
    const char *name;
    size_t size;
} abi_table[] = {
    FG_ABI_ENTRY(fg_matrix),          FG_ABI_ENTRY(fg_vector),
    FG_ABI_ENTRY(fg_loss_config),     FG_ABI_ENTRY(fg_batch),
    FG_ABI_ENTRY(fg_metrics),         FG_ABI_ENTRY(fg_outputs),
    FG_ABI_ENTRY(fg_communicator),    FG_ABI_ENTRY(fg_context_options),
    FG_ABI_ENTRY(fg_memory_stats),    FG_ABI_ENTRY(fg_linear_inputs),
    FG_ABI_ENTRY(fg_linear_options),  FG_ABI_ENTRY(fg_linear_plan_info),
};

size_t fg_abi_sizeof(const char *type_name)
{
    if (!type_name)
        return 0;
    for (size_t i = 0; i < sizeof abi_table / sizeof abi_table[0]; i++)
        if (strcmp(abi_table[i].name, type_name) == 0)
            return abi_table[i].size;
    return 0;
}
