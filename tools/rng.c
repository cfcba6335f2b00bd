/* Counter-based RNG (splitmix64 finalizer over a keyed counter): see rng.h. */
#include "rng.h"

#include <math.h>

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t ft_rng_bits(uint64_t seed, uint64_t stream, uint64_t i)
{
    uint64_t key = mix64(seed * 0x9e3779b97f4a7c15ull + stream * 0xd1b54a32d192ed03ull + 1);
    return mix64(key + (i + 1) * 0x9e3779b97f4a7c15ull);
}

double ft_rng_uniform(uint64_t seed, uint64_t stream, uint64_t i)
{
    return ((double)(ft_rng_bits(seed, stream, i) >> 11) + 0.5) * 0x1.0p-53;
}

static void normal_pair(uint64_t seed, uint64_t stream, uint64_t j, double *a, double *b)
{
    double u1 = ft_rng_uniform(seed, stream, 2 * j);
    double u2 = ft_rng_uniform(seed, stream, 2 * j + 1);
    double r = sqrt(-2.0 * log(u1));
    double th = 6.283185307179586 * u2;
    *a = r * cos(th);
    *b = r * sin(th);
}

double ft_rng_normal(uint64_t seed, uint64_t stream, uint64_t i)
{
    double a, b;
    normal_pair(seed, stream, i / 2, &a, &b);
    return (i & 1) ? b : a;
}

void ft_rng_normal_fill(uint64_t seed, uint64_t stream, uint64_t first, double std, float *out,
                        int64_t n)
{
    int64_t k = 0;
    if (n > 0 && (first & 1)) {
        out[k++] = (float)(std * ft_rng_normal(seed, stream, first));
    }
    for (; k + 1 < n; k += 2) {
        double a, b;
        normal_pair(seed, stream, (first + (uint64_t)k) / 2, &a, &b);
        out[k] = (float)(std * a);
        out[k + 1] = (float)(std * b);
    }
    if (k < n)
        out[k] = (float)(std * ft_rng_normal(seed, stream, first + (uint64_t)k));
}
