/*
 * expf for the row kernels, written so that loops over it vectorize without
 * -ffast-math: no branches, no libm call, no errno. Cephes-style: range
 * reduction by ln 2 in two parts, a degree-5 minimax polynomial, and the
 * exponent assembled in the integer bits. Max error about 1 ulp on the range
 * the kernels use (x <= 0). NaN in, NaN out; x below -87.3 gives exactly 0 so
 * an underflowing probability is 0, never a denormal or garbage.
 */
#ifndef FG_FAST_EXP_H
#define FG_FAST_EXP_H

#include <stdint.h>

static inline float fg_expf(float x)
{
    const float hi = 88.0f, lo = -87.33654475f;
    float xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc; /* NaN fails both compares and stays NaN */
    /* n = round(x / ln2): the 1.5*2^23 shift rounds to nearest under IEEE
     * arithmetic (this is why no -ffast-math may touch this file). */
    const float shift = 12582912.0f;
    union {
        int32_t i;
        float f;
    } t, scale;
    t.f = xc * 1.44269504088896341f + shift;
    float n = t.f - shift;
    /* The low mantissa bits of t hold n: integer arithmetic only, so NaN
     * input never reaches a float-to-int conversion (undefined behaviour). */
    int32_t ni = t.i - 0x4B400000;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    scale.i = (int32_t)((uint32_t)(ni + 127) << 23);
    y = y * scale.f;
    return x < lo ? 0.0f : y;
}

#endif
