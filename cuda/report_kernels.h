/*
 * A device-reported call's work on the GPU (the seam's report_batch,
 * report_scan and report_tokens ops, src/backends/backend.h), through
 * src/core/report.h's checks and loss_sequence.h's constants and loss,
 * compiled for the device. Every array is device memory; `plan` and `r` are
 * host memory passed to the kernels by value. Nothing here waits for the
 * host: each failure goes into rep->failed (report.h), which the caller
 * reads after the stream has run.
 */
#ifndef FG_CUDA_REPORT_KERNELS_H
#define FG_CUDA_REPORT_KERNELS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "backend.h"

/* The batch's values checked, rows[n] = n, targets[n] (the id, -1 where
 * masked or out of range), and for a loss plan its per-sequence constants
 * and batch scalars; the record's sizes. */
fg_status fg_cuda_report_batch(const struct fg_loss_plan *plan, const struct fg_report_batch *r,
                               int64_t *rows, int64_t *targets, fg_device_report *rep,
                               cudaStream_t stream, char *msg, size_t msg_size);

/* Each sequence's constants from every token's logp and entropy ([N]), after
 * a forward sweep (fg_loss_seq_prepare, fg_loss_seq_dratio). */
fg_status fg_cuda_report_prepare(const struct fg_loss_plan *plan, const float *logp,
                                 const float *entropy, cudaStream_t stream, char *msg,
                                 size_t msg_size);

/* x's first NaN/Inf entry (rows r with mask[r] != 0; mask NULL: all) as
 * fg_report_entry_key(stage, row, col). */
fg_status fg_cuda_report_scan(const void *x, fg_dtype type, int64_t rows, int64_t cols,
                              int64_t ld, const uint8_t *mask, int stage, fg_device_report *rep,
                              cudaStream_t stream, char *msg, size_t msg_size);

/* Each token's checks and outputs, the loss and metrics into rep, then the
 * first failure's values. */
fg_status fg_cuda_report_tokens(const struct fg_loss_plan *plan, const struct fg_report_batch *r,
                                const fg_backend_tokens *t, fg_device_report *rep,
                                cudaStream_t stream, char *msg, size_t msg_size);

#endif
