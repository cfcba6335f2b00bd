/*
 * The two storage dtypes in device code: a float32 or bfloat16 element read
 * as float, and a float stored back (bf16 rounded to nearest even once).
 */
#ifndef FG_CUDA_STORAGE_CUH
#define FG_CUDA_STORAGE_CUH

#include <cuda_bf16.h>

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v); /* round to nearest even; NaN stays NaN */
}

#endif
