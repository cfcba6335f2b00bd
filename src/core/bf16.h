/* bfloat16 <-> float32, inline for the row kernels. Round to nearest even;
 * NaN stays a (quiet) NaN instead of rounding into Inf. */
#ifndef FG_BF16_H
#define FG_BF16_H

#include <stdint.h>
#include <string.h>

static inline float fg_bf16_load(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t fg_bf16_store(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
