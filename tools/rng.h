/*
 * Counter-based random numbers: value i of stream s under seed k is a pure
 * function of (k, s, i). The synthetic batch is therefore identical whatever
 * the thread count or fill order, and any tensor can be generated in
 * parallel blocks without passing generator state around.
 */
#ifndef FT_RNG_H
#define FT_RNG_H

#include <stdint.h>

/* One stream per tensor so that changing one shape leaves the others alone. */
enum {
    FT_STREAM_HIDDEN = 1,
    FT_STREAM_WEIGHT,
    FT_STREAM_BIAS,
    FT_STREAM_MASK,
    FT_STREAM_ADVANTAGES,
    FT_STREAM_TOKENS,
    FT_STREAM_OLD,
    FT_STREAM_REF,
    FT_STREAM_IS_RATIO
};

uint64_t ft_rng_bits(uint64_t seed, uint64_t stream, uint64_t i);
/* Uniform in the open interval (0, 1). */
double ft_rng_uniform(uint64_t seed, uint64_t stream, uint64_t i);
/* Standard normal: values 2j and 2j+1 are the Box-Muller pair of draw j. */
double ft_rng_normal(uint64_t seed, uint64_t stream, uint64_t i);
/* out[k] = std * normal(seed, stream, first + k) for k < n; pairs computed once. */
void ft_rng_normal_fill(uint64_t seed, uint64_t stream, uint64_t first, double std, float *out,
                        int64_t n);

#endif
