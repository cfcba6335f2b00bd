/*
 * The CUDA test and bench programs' check of a runtime call: a failure
 * prints the call and CUDA's message and ends the program (these are test
 * programs; the library itself never exits).
 */
#ifndef FG_CUDA_OK_H
#define FG_CUDA_OK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        const cudaError_t err_ = (call);                                                           \
        if (err_ != cudaSuccess) {                                                                 \
            printf("FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_));  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#endif
