/*
 * Small helpers every layer of the library may use: alignment, checked size
 * arithmetic, dtype sizes and the test-only fault points. Nothing here is
 * public, and nothing here knows the context.
 */
#ifndef FG_INTERNAL_H
#define FG_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "fusedgrpo.h"

#define FG_ALIGN 64

/* Test-only fault injection, compiled in with -DFG_FAULT_INJECTION (never in
 * a release build). Every allocation the library makes itself (context, GEMM
 * cache, arena, tracked blocks) and every oneDNN object it creates passes a
 * fault point first: fg_fault_hit() returns 1 at the armed one and the
 * allocation then fails as if memory were exhausted. The test drivers
 * (tests/test_alloc_failure.c) declare fg_fault_arm / fg_fault_points
 * themselves: they are not part of the public API.
 *   fg_fault_arm(k): the k-th fault point from now (0-based) fails, the others
 *                    succeed; k < 0 disarms. Resets the counter.
 *   fg_fault_points(): fault points passed since the last fg_fault_arm. */
#ifdef FG_FAULT_INJECTION
int fg_fault_hit(void);
void fg_fault_arm(long k);
long fg_fault_points(void);
/* A second, separate count: GEMM executions (fg_gemm_run), the failures that
 * come mid-call, after outputs are being written (tests/test_shard_faults.c:
 * a vocab shard failing mid-call must stop every shard, none waiting).
 * fg_fault_exec_arm(k): the k-th execution from now fails; k < 0 disarms. */
int fg_fault_exec_hit(void);
void fg_fault_exec_arm(long k);
long fg_fault_exec_points(void);
#else
static inline int fg_fault_hit(void) { return 0; }
static inline int fg_fault_exec_hit(void) { return 0; }
#endif

/* Checked size arithmetic: returns 0 on overflow. */
int fg_mul_size(size_t a, size_t b, size_t *out);
int fg_add_size(size_t a, size_t b, size_t *out);

static inline size_t fg_dtype_size(fg_dtype t) { return t == FG_DTYPE_BF16 ? 2 : 4; }

#endif
