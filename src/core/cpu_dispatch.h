/*
 * Run-time ISA selection for the library's own hot loops (the row kernels and
 * the bf16 conversions; oneDNN dispatches its GEMMs by itself).
 *
 * The default build targets baseline x86-64 so that one binary (a wheel, a
 * distribution package) runs on every x86-64 CPU. FG_CPU_CLONES makes GCC
 * compile a function three times, for x86-64-v4 (AVX-512), x86-64-v3
 * (AVX2 + FMA) and the baseline, and pick one per process through an ifunc
 * resolver at load time. The row kernels' lane structure is explicit (16
 * lanes summed in a fixed order), so the v3 and v4 clones give the same bits;
 * the baseline clone has no FMA and may differ from them by rounding.
 *
 * A -march=native build (CMake FG_NATIVE=ON, which defines FG_NATIVE_BUILD)
 * compiles one version for the build machine, as before. Clang and non-x86
 * targets get one version too.
 */
#ifndef FG_CPU_DISPATCH_H
#define FG_CPU_DISPATCH_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(FG_NATIVE_BUILD)
#define FG_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FG_CPU_CLONES
#endif

#endif
