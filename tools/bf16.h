/*
 * Inline bfloat16 <-> float32 for bulk conversions in the tool. Same rounding
 * as the library's fg_f32_to_bf16 (round to nearest even, NaN stays NaN);
 * inline because the tool converts whole weight matrices and a call per
 * element into the library would dominate.
 */
#ifndef FT_BF16_H
#define FT_BF16_H

#include <stdint.h>
#include <string.h>

static inline uint16_t ft_f32_to_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN, sign kept */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ft_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

#endif
