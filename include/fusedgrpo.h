/*
 * fusedgrpo: the GRPO policy loss fused with the LM head.
 *
 * One public header. The numerical contract is docs/LOSS_SPEC.md: every
 * entry point below computes exactly that function and its gradient.
 *
 * Conventions
 *   - N = B * T tokens. Row n of every [B*T, ...] matrix is token (b, t) with
 *     n = b * T + t.
 *   - Matrices are row-major with an explicit row stride `ld` (in elements,
 *     ld >= cols), BLIS style. Vectors are contiguous.
 *   - Storage dtypes: float32, or bfloat16 as raw uint16 bit patterns (round to
 *     nearest even). Every reduction accumulates in float32 or wider.
 *     Gradients are written in float32, or for bfloat16 inputs in bfloat16
 *     if the caller's gradient views say so (fg_linear_outputs), summed in
 *     float32 inside and rounded once: grad_hidden and grad_bias always;
 *     grad_weight in one product (one chunk, or materialized) or in a float32
 *     [V, H] buffer of the workspace that the budget must hold beside the
 *     chunks (fg_linear_plan_info.grad_weight_sum_bytes). On CPUs with bf16
 *     GEMM kernels and on the backends behind the seam (FG_BACKEND_CUDA),
 *     when the budget cannot hold that buffer (on the seam also when it holds
 *     chunks of 1024 rows or more without the buffer, and beside it the
 *     chunks would fall below 1024 rows and to under half), grad_weight is
 *     instead rounded after each chunk's product is added to it (one rounding
 *     per chunk: on Zen 5 2.24x the error of the exact gradient rounded to
 *     bf16 at 95 one-row chunks); a budget above V*H*4 bytes avoids it.
 *     Without bf16 kernels the float32 buffer is required
 *     (FG_ERR_BUDGET_TOO_SMALL otherwise).
 *   - Every buffer is owned by the caller. The library never keeps a pointer to
 *     caller memory after a call returns.
 *   - Every call validates all of its arguments first and writes nothing to any
 *     output unless the checks pass. It returns an fg_status; on failure
 *     fg_last_error(ctx) holds a readable message. Nothing here exits or aborts.
 *   - No output may share memory with an input or with another output: a call
 *     reads its inputs while it writes (chunk by chunk, or summing into
 *     grad_weight), so an output over an input would corrupt what is still to
 *     be read. Each array's bytes are taken as one range, from its first
 *     element's to its last's (a matrix's row padding included); ranges that
 *     meet are refused with FG_ERR_ALIASED_OUTPUT, naming both arguments,
 *     before anything is written. Inputs may share memory with one another.
 *     The one exception: fg_logits_grpo's grad_logits may be the logits
 *     themselves (same data, dtype and ld: an in-place backward). The phase
 *     API's stats, read and written by one argument, are not an alias; the
 *     plan query, which writes nothing, does not check. A caller's workspace
 *     (fg_exec.workspace) is written by the call: it counts as an output.
 *   - No non-finite result is returned as success. Finite inputs whose logits,
 *     loss or gradients would leave the float range are refused with
 *     FG_ERR_OVERFLOW, naming the row or token (b, t) and the quantity: the
 *     logits' bound (H * max|hidden| * max|weight| + max|bias|) / temperature,
 *     and the gradients' bound from the caller's grad_logp/grad_entropy, are
 *     checked with the arguments; a token's loss term, d loss/d logp and
 *     d loss/d entropy once its log-prob is known, before its chunk's
 *     gradient products run (docs/LOSS_SPEC.md "Option ranges and overflow").
 *     A refused call changes no output (loss, metrics, logp, entropy,
 *     grad_bias and a bf16 grad_weight's float32 sums are committed at the
 *     end; an accumulating loss call that walks several chunks and sums into
 *     the caller's grad_weight computes every token's log-prob first where a
 *     token could still be refused: see fg_linear_outputs.accumulate), with
 *     one exception: on FG_ERR_OVERFLOW found in a later chunk of an
 *     fg_linear_grpo call that walks several chunks, grad_hidden, and
 *     grad_weight unless the call accumulates, may hold partial results. On
 *     a device backend (FG_BACKEND_CUDA) a call with fg_exec.device_report
 *     makes no host wait at all ("Device-reported calls", below); without
 *     it most calls run their chunks with no host wait between them: a loss call that computes every token's
 *     log-prob first (the loss needs them, or it accumulates as above)
 *     checks them all between its two sweeps; on scanned inputs, the other
 *     loss calls of several chunks and the head's calls check every token
 *     once, after the chunks, in the same order, with the same statuses
 *     and messages. There a token-level loss whose derivatives the inputs do
 *     not bound (the KL, or inputs too large for the bound) can still be
 *     refused with FG_ERR_OVERFLOW found in any chunk, after which
 *     grad_hidden, and grad_weight unless the call accumulates or sums a
 *     bf16 grad_weight in float32, hold every chunk's results, non-finite
 *     ones included; the other token-level losses and the head's calls only
 *     by a backend fault (a statistic the backend got wrong), after
 *     gradients were written. With
 *     the finite check off (fg_context_set_check_finite) the pass over the
 *     inputs, bounds included, is skipped: non-finite statistics found during
 *     the call are then FG_ERR_NONFINITE_INPUT ("the finite check was off").
 *   - A context is used by one thread at a time. Same inputs and same
 *     budget => bitwise identical results, for any thread count (the GEMMs
 *     run in fixed blocks, one thread each; on one CPU kind: oneDNN's
 *     kernels, and so the bits, differ between AVX2 and AVX-512 CPUs).
 */
#ifndef FUSEDGRPO_H
#define FUSEDGRPO_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with hidden visibility; only this header's API is exported. */
#if defined(FG_BUILDING_LIBRARY) && defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

#define FG_VERSION_MAJOR 0
#define FG_VERSION_MINOR 1
#define FG_VERSION_PATCH 0

/* ------------------------------------------------------------------ status */

typedef enum fg_status {
    FG_OK = 0,
    FG_ERR_NULL_ARGUMENT,      /* a required pointer is NULL                        */
    FG_ERR_INVALID_SIZE,       /* a size is zero or negative, or ld < cols          */
    FG_ERR_SIZE_OVERFLOW,      /* a size whose byte count overflows size_t/int64    */
    FG_ERR_SHAPE_MISMATCH,     /* two arguments disagree on a dimension             */
    FG_ERR_TOKEN_OUT_OF_RANGE, /* an unmasked token id is outside [0, V)            */
    FG_ERR_MISSING_REF_LOGP,   /* beta != 0 but ref_logp is NULL                    */
    FG_ERR_BAD_TEMPERATURE,    /* temperature <= 0 or not finite                    */
    FG_ERR_UNKNOWN_LOSS_TYPE,  /* loss_type not one of fg_loss_type                 */
    FG_ERR_UNKNOWN_LEVEL,      /* importance_sampling_level not one of fg_is_level  */
    FG_ERR_BAD_HYPERPARAMETER, /* another hyper-parameter is out of its domain      */
    FG_ERR_NONFINITE_INPUT,    /* NaN or Inf in an input that is read               */
    FG_ERR_UNSUPPORTED,        /* a valid request this build or backend cannot do   */
    FG_ERR_BUDGET_TOO_SMALL,   /* the memory budget cannot hold even one token row  */
    FG_ERR_OUT_OF_MEMORY,      /* an allocation failed                              */
    FG_ERR_BACKEND,            /* the GEMM backend (oneDNN) reported a failure      */
    FG_ERR_COMMUNICATOR,       /* the communicator's allreduce failed, or the shards
                                  of a collective call disagree on it               */
    FG_ERR_OVERFLOW,           /* finite inputs whose logits, loss or gradients would
                                  leave the float range (docs/LOSS_SPEC.md "Option
                                  ranges and overflow")                             */
    FG_ERR_ALIASED_OUTPUT,     /* an output's memory meets an input's or another
                                  output's ("Conventions")                          */
    FG_STATUS_COUNT
} fg_status;

/* A stable name for a status, e.g. "FG_ERR_SHAPE_MISMATCH". Never NULL. */
const char *fg_status_name(fg_status status);

/* ------------------------------------------------------------------ tensors */

typedef enum fg_dtype {
    FG_DTYPE_F32 = 0,
    FG_DTYPE_BF16 = 1 /* raw uint16 bfloat16 bits */
} fg_dtype;

/* A row-major matrix view: element (r, c) lives at data + (r * ld + c) * size(dtype). */
typedef struct fg_matrix {
    void *data; /* read-only for inputs */
    fg_dtype dtype;
    int64_t rows;
    int64_t cols;
    int64_t ld; /* row stride in elements, >= cols */
} fg_matrix;

/* A contiguous vector. */
typedef struct fg_vector {
    void *data;
    fg_dtype dtype;
    int64_t len;
} fg_vector;

/* Convenience constructors (contiguous: ld = cols). */
fg_matrix fg_matrix_make(void *data, fg_dtype dtype, int64_t rows, int64_t cols);
fg_vector fg_vector_make(void *data, fg_dtype dtype, int64_t len);

/* bfloat16 conversions (round to nearest even; NaN stays NaN). */
uint16_t fg_f32_to_bf16(float x);
float fg_bf16_to_f32(uint16_t x);

/* ------------------------------------------------------------- loss config */

typedef enum fg_loss_type {
    FG_LOSS_GRPO = 0,
    FG_LOSS_BNPO,
    FG_LOSS_DR_GRPO,
    FG_LOSS_DAPO,
    FG_LOSS_LUSPO,
    FG_LOSS_CISPO,
    FG_LOSS_SAPO,
    FG_LOSS_VESPO,
    FG_LOSS_TYPE_COUNT
} fg_loss_type;

typedef enum fg_is_level {
    FG_LEVEL_TOKEN = 0,
    FG_LEVEL_SEQUENCE, /* GSPO */
    FG_LEVEL_COUNT
} fg_is_level;

/* Hyper-parameters, docs/LOSS_SPEC.md names (TRL 1.16's GRPOConfig names).
 * fg_loss_config_init() sets the spec's defaults; the sentinels below stand
 * for the spec's "defaults to ...", each exactly that value: any other value
 * outside an option's range (docs/LOSS_SPEC.md "Option ranges and overflow")
 * is refused with FG_ERR_BAD_HYPERPARAMETER (FG_ERR_BAD_TEMPERATURE for the
 * temperature), never reinterpreted. */
#define FG_EPSILON_HIGH_SAME_AS_LOW (-1.0)  /* epsilon_high: epsilon_low's value   */
#define FG_DELTA_OFF 0.0                     /* delta: no two-sided clip            */
#define FG_MAX_COMPLETION_LENGTH_T 0         /* max_completion_length: T            */
#define FG_NUM_ITEMS_UNMASKED (-1.0)         /* num_items_in_batch: unmasked tokens */
typedef struct fg_loss_config {
    fg_loss_type loss_type;                /* default FG_LOSS_DAPO                       */
    fg_is_level importance_sampling_level; /* default FG_LEVEL_TOKEN                     */
    double temperature;                    /* default 1.0; must be > 0                   */
    double epsilon_low;                    /* >= 0; default 0.2                          */
    double epsilon_high;                   /* >= 0, or FG_EPSILON_HIGH_SAME_AS_LOW (default) */
    double delta;                          /* > 0: two-sided clip; FG_DELTA_OFF (default) */
    double beta;                           /* >= 0; default 0; != 0 needs ref_logp      */
    int64_t max_completion_length;         /* >= 1: dr_grpo's normalizer, or
                                              FG_MAX_COMPLETION_LENGTH_T (default)      */
    double num_items_in_batch;             /* > 0, or FG_NUM_ITEMS_UNMASKED (default)    */
    double sapo_temperature_pos;           /* > 0; default 1.0                           */
    double sapo_temperature_neg;           /* > 0; default 1.05                          */
    int use_bias_correction_kl;            /* default 0                                  */
    double entropy_coef;                   /* finite; default 0                          */
    double vespo_k_pos;                    /* > 0; default 2.0 (vespo's gamma weight, A >= 0) */
    double vespo_lambda_pos;               /* > 0; default 3.0                           */
    double vespo_k_neg;                    /* > 0; default 3.0  (A < 0)                  */
    double vespo_lambda_neg;               /* > 0; default 2.0                           */
    double off_policy_mask_threshold;      /* +INFINITY: off (default); else drop the
                                              policy term of sequences with A < 0 whose
                                              mean (sampling_logp - logp) exceeds it    */
    double top_entropy_quantile;           /* 1: off (default); in [0, 1): the policy
                                              term and the entropy bonus act only on
                                              tokens at or above this quantile of the
                                              batch's entropies                         */
} fg_loss_config;

void fg_loss_config_init(fg_loss_config *cfg);

/* "grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"; "token", "sequence".
 * Return FG_ERR_UNKNOWN_LOSS_TYPE / FG_ERR_UNKNOWN_LEVEL for anything else. */
fg_status fg_loss_type_parse(const char *name, fg_loss_type *out);
fg_status fg_is_level_parse(const char *name, fg_is_level *out);
const char *fg_loss_type_name(fg_loss_type t); /* NULL when out of range */
const char *fg_is_level_name(fg_is_level l);

/* ------------------------------------------------------------------- batch */

/* The per-token side of a batch. All arrays are contiguous, row-major [B, T]. */
typedef struct fg_batch {
    int64_t batch;             /* B >= 1                                               */
    int64_t seq_len;           /* T >= 1                                               */
    const int64_t *token_ids;  /* [B, T]; read only where mask != 0                    */
    const uint8_t *mask;       /* [B, T]; nonzero = real completion token              */
    const float *advantages;   /* [B]                                                  */
    const float *old_logp;     /* [B, T] or NULL (on-policy: old = stop_gradient(logp)) */
    const float *ref_logp;     /* [B, T] or NULL; required when beta != 0              */
    const float *is_ratio;     /* NULL, [B, T], or [B] when is_ratio_per_sequence      */
    int is_ratio_per_sequence;
    const float *sampling_logp; /* [B, T] or NULL (= old_logp): the sampler's log-probs,
                                   read by the off-policy mask only; NaN allowed (a token
                                   the sampler could not score counts 0)               */
} fg_batch;

/* ----------------------------------------------------------------- outputs */

/* TRL 1.16's logged metrics (docs/LOSS_SPEC.md "Metrics"): masked token means
 * over the batch, or means over sequences for per-sequence quantities. A
 * metric that does not apply to the loss type is 0. */
typedef struct fg_metrics {
    double kl;                  /* 0 when beta == 0                                   */
    double entropy;
    double clip_ratio_low;      /* clipped types (grpo, bnpo, dr_grpo, dapo, luspo)   */
    double clip_ratio_high;
    double clip_ratio_region;
    double cispo_clip_ratio;    /* cispo: ratio > epsilon_high and A > 0              */
    double clip_ratio_low_min;  /* clipped types: min over sequences of their low-clip
                                   fraction (NaN when every sequence is masked)       */
    double clip_ratio_high_max; /* max over sequences of their high-clip fraction     */
    double vespo_phi_seq_mean;  /* vespo: mean of the gamma weight over sequences     */
    double policy_loss;         /* the loss without the entropy bonus                 */
} fg_metrics;

/* Caller-owned results of fg_linear_grpo. Any pointer may be NULL (data ==
 * NULL for a matrix) when that result is not wanted; a NULL gradient skips
 * its GEMM. loss and metrics are always written on success. */
typedef struct fg_linear_outputs {
    double loss;
    fg_metrics metrics;
    float *logp;           /* [B, T]; 0 at masked positions                        */
    float *entropy;        /* [B, T]; 0 at masked positions                        */
    fg_matrix grad_hidden; /* [B*T, H] f32 (or bf16 for bf16 inputs); zero rows at
                              masked positions                                    */
    fg_matrix grad_weight; /* [V, H] f32 (or bf16: see "Conventions")              */
    fg_vector grad_bias;   /* [V] f32 (or bf16)                                    */
    int accumulate;        /* 0: grad_weight and grad_bias are overwritten. 1: the
                              call adds its gradient to them (micro-batches,
                              gradient accumulation): the first chunk's GEMM sums
                              into the caller's buffer, so no extra V x H buffer
                              (a bf16 grad_weight with float32 sums: they are
                              added to it in their one rounding pass). A call
                              refused mid-way leaves both as they were: with
                              several chunks summing into the caller's
                              grad_weight, every token's log-prob is computed
                              first, one more logits product per token, unless
                              the inputs alone rule a refusal out (token-level
                              losses with beta = 0; docs/LOSS_SPEC.md "Option
                              ranges and overflow").
                              grad_hidden is always overwritten.                */
} fg_linear_outputs;

/* Caller-owned results of fg_logits_grpo; the same rules. */
typedef struct fg_logits_outputs {
    double loss;
    fg_metrics metrics;
    float *logp;           /* [B, T]; 0 at masked positions                        */
    float *entropy;        /* [B, T]; 0 at masked positions                        */
    fg_matrix grad_logits; /* [B*T, V], f32 or bf16; may alias the logits (same
                              data, dtype and ld) for an in-place backward        */
} fg_logits_outputs;

/* ----------------------------------------------------------------- context */

/* Where a context's calls run. FG_BACKEND_CPU: host memory, oneDNN and
 * OpenMP. The others run fg_linear_grpo, fg_linear_logprobs,
 * fg_linear_logprobs_backward and the phase API ("phases of a vocab-sharded
 * call") through the per-chunk backend seam (docs/ARCHITECTURE.md), with
 * every pointer of those calls in the backend's memory: the inputs, the fg_batch / fg_tokens arrays, grad_logp and
 * grad_entropy, and the outputs (logp, entropy, gradients); loss and
 * metrics are host fields of the outputs struct, as on the CPU. Such a call
 * copies the O(B*T) token arrays to the host and waits for the backend
 * once to check them (and the inputs' NaN/Inf scan) and once at the end;
 * between its chunks it waits only where a chunk's tokens must be checked
 * on the host before its gradient products (with the finite check off, a
 * token-level loss and fg_linear_logprobs_backward; the phase API: once a
 * chunk; see "Conventions"); the
 * loss's per-token derivatives and the [tokens, vocab] and [vocab, hidden]
 * work stay in the backend. One driver runs every backend; what a backend
 * lacks is refused by name (FG_ERR_UNSUPPORTED): the CPU-only entry points
 * (fg_logits_grpo, fg_grpo_loss_from_logp). A communicator's reductions
 * run on host copies of the statistics and of grad_hidden's shares
 * (fg_communicator takes host memory): one wait a chunk.
 *   FG_BACKEND_CUDA: device memory of the current CUDA device, on
 *     fg_context_options.stream (a cudaStream_t; NULL: the default stream);
 *     fg_exec.workspace, when given, is device memory. fg_context_create
 *     loads libfusedgrpo_cuda.so (the path in the environment variable
 *     FUSEDGRPO_CUDA_LIBRARY, else beside libfusedgrpo, else the loader's
 *     search path): FG_ERR_UNSUPPORTED when it is missing or finds no device.
 *   FG_BACKEND_REFERENCE: the seam's plain reference on host memory (loops
 *     in double, slow): the specification the CUDA backend is checked
 *     against, for tests. */
typedef enum fg_backend {
    FG_BACKEND_CPU = 0,
    FG_BACKEND_CUDA = 1,
    FG_BACKEND_REFERENCE = 2
} fg_backend;

/* Reduction hook for a vocab-sharded weight (one shard per process, e.g. MPI
 * or one thread per shard). `allreduce` combines `count` floats elementwise
 * across all shards in place (FG_REDUCE_SUM or FG_REDUCE_MAX), and returns 0
 * on success. With MPI: MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT,
 * op == FG_REDUCE_SUM ? MPI_SUM : MPI_MAX, comm). Any reduction order does:
 * every SUM the library asks for either sums small integers (exact) or
 * grad_hidden, whose bits then follow the communicator's own determinism.
 *
 * With a communicator on the context, fg_linear_grpo, fg_linear_logprobs and
 * fg_linear_logprobs_backward are collective: every shard calls them with the
 * same arguments (its own weight rows), and the library then
 *   1. agrees on the call before any other reduction: every shard's status
 *      after its checks, a hash of shapes, mask, tokens, config and wanted
 *      outputs, and the chunk size (the smallest); a shard that failed its
 *      checks (a bad token id, NaN input, a budget too small) makes every
 *      shard return its status; shards that disagree return
 *      FG_ERR_COMMUNICATOR;
 *   2. per chunk, merges the row statistics (a MAX, then an exact SUM:
 *      docs/LOSS_SPEC.md "Vocab shards") and sums grad_hidden; each reduction
 *      carries a failure flag, so a shard that fails mid-call (a GEMM, memory)
 *      stops every shard at the next reduction;
 *   3. agrees on the outcome at the end: every shard returns the same status.
 * allreduce NULL: one shard, no hook. docs/ARCHITECTURE.md counts the bytes. */
typedef enum fg_reduce_op { FG_REDUCE_SUM = 0, FG_REDUCE_MAX = 1 } fg_reduce_op;
typedef struct fg_communicator {
    int (*allreduce)(void *user, float *buf, int64_t count, fg_reduce_op op);
    void *user;
} fg_communicator;

/* The fused path's working-memory cap when none is set, on the CPU and
 * reference backends. 256 MiB holds
 * 350-410 token rows of V = 151936 logits (H 2048-4096): GEMMs of under ~300
 * rows lose up to half their speed in oneDNN's sgemm on AVX2
 * (docs/BENCHMARKS.md, "What the budget buys"). Any smaller budget works; it
 * trades speed for memory. */
#define FG_DEFAULT_MEMORY_BUDGET ((size_t)256 << 20)

/* The same on FG_BACKEND_CUDA: 2 GiB holds chunks of ~1850 rows of
 * V = 151936 (H = 4096, bf16). On an H200 the fused step ran there at 1.04x
 * the three bare products at T = 8192 and 1.01x at T = 32768, against 1.12x
 * and 1.05x at 1 GiB and 1.17x and 1.15x at 512 MiB (docs/BENCHMARKS.md,
 * "The CUDA backend"): cuBLASLt's products lose speed below ~2000 rows, and
 * GEMM 3 re-reads grad_weight once per chunk. */
#define FG_DEFAULT_CUDA_MEMORY_BUDGET ((size_t)2 << 30)

/* The most threads a context or a call may ask for (fg_context_options.threads,
 * fg_exec.threads): more is refused with FG_ERR_BAD_HYPERPARAMETER before
 * anything runs (OpenMP would try to start them all). */
#define FG_MAX_THREADS 4096

typedef struct fg_context_options {
    fg_backend backend;   /* FG_BACKEND_CPU                                          */
    int threads;          /* <= 0: the OpenMP default; at most FG_MAX_THREADS        */
    size_t memory_budget; /* working-memory cap of the fused path; 0: the default    */
    int check_finite;     /* 1 (default): scan read inputs for NaN/Inf up front, and
                             bound the logits and gradients (FG_ERR_OVERFLOW)        */
    void *stream;         /* FG_BACKEND_CUDA: a cudaStream_t, NULL: the default stream */
    fg_communicator comm; /* vocab-sharding hook; zeroed = single shard              */
} fg_context_options;

typedef struct fg_context fg_context;

void fg_context_options_init(fg_context_options *opts);
/* opts may be NULL for the defaults. */
fg_status fg_context_create(const fg_context_options *opts, fg_context **out);
void fg_context_destroy(fg_context *ctx); /* NULL is fine */

/* Why the calling thread's last fg_context_create failed ("" after one that
 * succeeded): a failed create leaves no context to hold its message, e.g.
 * which path the CUDA backend's library was looked for at, or that no CUDA
 * device was found. Valid until the thread's next fg_context_create. */
const char *fg_context_create_error(void);

/* The message of the last failed call on ctx ("" after a success). */
const char *fg_last_error(const fg_context *ctx);

fg_status fg_context_set_check_finite(fg_context *ctx, int on);

/*
 * Per-call execution options (BLIS's rntm, ggml's cplan): every entry point
 * takes one as its last argument; NULL, or a field left at its zero, means
 * the context's setting. One context then serves calls of any thread count
 * and budget.
 *   workspace: caller memory (64-byte aligned, workspace_bytes long) that
 *   the call uses as its whole working memory instead of the context's
 *   cached arena; the library keeps no pointer to it after the call. The
 *   chunks are planned from the budget as without it (the same plan, the
 *   same bits); size it with the plan query's working_bytes for the same
 *   arguments and exec. A smaller one: FG_ERR_BUDGET_TOO_SMALL, nothing
 *   written.
 */
typedef struct fg_exec {
    int threads;            /* <= 0: the context's (fg_context_options.threads);
                               at most FG_MAX_THREADS                                */
    size_t memory_budget;   /* 0: the context's (fg_context_options.memory_budget) */
    void *workspace;        /* NULL: the context's arena, kept for reuse            */
    size_t workspace_bytes;
    void *device_report;    /* NULL: checks on the host. Else a fg_device_report in
                               the backend's memory: the call makes no host
                               synchronisation ("device-reported calls" below)   */
} fg_exec;

void fg_exec_init(fg_exec *exec); /* all zero: the context's settings */

/*
 * Device-reported calls: fg_exec.device_report on a context whose backend
 * is behind the seam (FG_BACKEND_CUDA, FG_BACKEND_REFERENCE). The call then
 * makes no host synchronisation at all, so that it can be captured in a
 * CUDA graph: it reads no value of its arguments on the host. The checks
 * that need no value (shapes, dtypes, NULLs, aliasing, the budget) still
 * return their status at once; every check of values runs on the device,
 * in the order the host's checks run (the batch's values, the inputs'
 * NaN/Inf scan, each token in order, the loss), and the first failure goes
 * into the record. The call returns FG_OK once its work is enqueued; after
 * the stream has run, the caller copies the record to the host and
 * fg_device_report_status gives the status and message the host's checks
 * would have given. Differences from a host-checked call:
 *   - the loss and metrics go into the record (out->loss and out->metrics
 *     are not written), and the record's dlogits_kept, not the context's
 *     statistics, counts gradient filtering's entries;
 *   - the a-priori bounds on the logits and the gradients from the inputs'
 *     magnitudes are replaced by checks after the fact: non-finite token
 *     statistics, and then NaN/Inf in grad_hidden, grad_weight or grad_bias
 *     (FG_ERR_OVERFLOW naming the output and its first non-finite entry);
 *   - a refused call's outputs are unspecified (it ran to the end);
 *   - every token row is walked, masked ones included (their gradients are
 *     0: a masked row's hidden state is never read, so it may hold NaN);
 *   - the record's memory must not meet an argument.
 * Calls: fg_linear_grpo with any loss; a loss that needs every token's
 * log-prob or entropy first (sequence-level ratios, vespo with old_logp,
 * the off-policy mask, the entropy quantile) computes them in a forward
 * sweep, its per-sequence constants and the quantile's threshold on the
 * device, then the gradients, as a host-checked call does; fg_linear_logprobs and
 * fg_linear_logprobs_backward; fused, without a vocab shard or a
 * communicator, and without accumulating into grad_bias. Others are
 * refused with FG_ERR_UNSUPPORTED.
 */
typedef struct fg_device_report {
    uint64_t failed;     /* 0: no check failed; else the first failure (private)  */
    int64_t seq_len;     /* the call's T, and its vocabulary: the message's       */
    int64_t vocab;
    double value[2];     /* the values the first failure's message shows          */
    double loss;         /* fg_linear_grpo: the loss and the metrics               */
    fg_metrics metrics;
    int64_t dlogits_kept; /* gradient filtering: the entries its rule kept        */
} fg_device_report;

/* The status of a device-reported call from a host copy of its record, and
 * its message into msg (msg_size bytes; "" for FG_OK). */
fg_status fg_device_report_status(const fg_device_report *report, char *msg, size_t msg_size);

/* Working memory is counted by the library's own allocator: every byte the
 * library holds between calls or during one (workspace, GEMM scratchpads,
 * per-token scratch), excluding caller-owned inputs and outputs. */
typedef struct fg_memory_stats {
    size_t current_bytes; /* held now (the workspace is kept for reuse)      */
    size_t peak_bytes;    /* high-water mark since create / last reset; a
                             caller workspace counts while a call uses it  */
    size_t budget_bytes;  /* the fused path's cap in the last call         */
    int64_t chunk_rows;   /* the last call's first chunk's rows (the largest) */
    int64_t chunks;       /* chunks processed by the last call               */
    int64_t gemm_flops;   /* floating-point ops issued to GEMMs, last call   */
    double gemm_seconds;  /* wall time inside GEMMs, last call               */
    double call_seconds;  /* wall time of the whole last call                */
    int64_t dlogits_entries; /* entries of d loss/d logits the last call's
                                backward products could use (rows x V)      */
    int64_t dlogits_kept;    /* of those, the entries the products used: all
                                of them unless gradient filtering dropped
                                some (the entries its rule keeps)           */
} fg_memory_stats;

fg_status fg_get_memory_stats(const fg_context *ctx, fg_memory_stats *out);
void fg_reset_peak_memory(fg_context *ctx);
/* Frees the cached workspace (the next call allocates it again). */
void fg_release_workspace(fg_context *ctx);

/* -------------------------------------------------------------- entry points */

/* LM-head inputs. hidden: [B*T, H]; weight: [V_local, H], same dtype as hidden;
 * bias: [V_local] in the weight's dtype, or data == NULL.
 * Vocab sharding (with ctx comm): this process holds vocab rows
 * [vocab_start, vocab_start + V_local) of a vocabulary of vocab_total; token ids
 * are global. vocab_total <= 0 means unsharded (vocab_start must be 0). */
typedef struct fg_linear_inputs {
    fg_matrix hidden;
    fg_matrix weight;
    fg_vector bias;
    int64_t vocab_start;
    int64_t vocab_total;
} fg_linear_inputs;

typedef enum fg_impl {
    FG_IMPL_FUSED = 0,        /* chunked over tokens, working memory <= budget     */
    FG_IMPL_MATERIALIZED = 1  /* the plain baseline: whole [N, V] logits and dlogits */
} fg_impl;

typedef struct fg_linear_options {
    fg_impl impl;
    /* Materialized only: store the logits in the input dtype (bf16) before the
     * softmax, as frameworks do (the seeds' cast_logits_to_hidden_dtype). */
    int round_logits_to_input_dtype;
    /* Fused only: gradient filtering. The two backward products use only the
     * entries of a row's d loss/d logits above filter_eps times the row's
     * largest |entry| (and always the row's own token); the forward (loss,
     * metrics, logp, entropy) is unaffected, bit for bit, and so is grad_bias.
     * 0: off (every entry, the default). FG_FILTER_EPS_AUTO: the default
     * threshold of the inputs' dtype (fg_filter_eps_auto). A row that would
     * keep more than V/8 entries keeps every one (fg_memory_stats counts the
     * entries kept). How the products run is the backend's: the CPU's run
     * sparse over the kept entries, dense over the zeroed ones in a chunk
     * holding such a row, and not at all filtered where a bf16 grad_weight
     * is not summed in float32 (fg_linear_plan_info.grad_weight_sum_bytes
     * 0: its sparse products write float32); CUDA's choose per chunk on
     * the device, sparse where the chunk keeps at most V/256 entries a row
     * (the rest dense over the zeroed entries; a CUDA graph's conditional
     * node, in a caller's stream capture too). docs/LOSS_SPEC.md "Gradient
     * filtering" gives the error bound. */
    double filter_eps;
} fg_linear_options;

#define FG_FILTER_EPS_AUTO (-1.0)

/* The threshold FG_FILTER_EPS_AUTO stands for, for hidden/weight of dtype. */
double fg_filter_eps_auto(fg_dtype dtype);

/*
 * linear_grpo_forward_backward
 *   z = (hidden · weightᵀ + bias) / temperature        [B*T, V], never whole when fused
 *   in : hidden [B*T, H], weight [V, H], bias [V]?, batch [B, T]
 *   out: loss, metrics, logp [B, T]?, entropy [B, T]?,
 *        grad_hidden [B*T, H]?, grad_weight [V, H]?, grad_bias [V]?
 * opts may be NULL (fused); exec may be NULL (the context's settings).
 */
fg_status fg_linear_grpo(fg_context *ctx, const fg_linear_options *opts,
                         const fg_loss_config *cfg, const fg_linear_inputs *in,
                         const fg_batch *batch, fg_linear_outputs *out, const fg_exec *exec);

/*
 * The planner: what fg_linear_grpo would hold for these exact arguments and
 * exec (budget, threads, workspace), and the least it can run with. Validates the
 * arguments as the call does (without the NaN/Inf scan, and without the
 * aliasing check: the outputs' data only say which results are wanted, so
 * one placeholder may stand for all of them), reads shapes and the
 * mask only, writes no output, and prepares the call's GEMMs (so the call
 * that follows finds them made). Tests, tools and front ends size budgets
 * with it instead of restating the formula.
 *   working_bytes = pages(fixed_bytes + chunk_bytes + gemm_scratch_bytes):
 *   the workspace the call holds, which the counted peak of fg_memory_stats
 *   reports. The fused path keeps it <= the budget.
 * min_budget_bytes (fused): the smallest budget this call runs with (one
 * token row a chunk); 0 for the materialized path, which has no budget.
 * On a backend behind the seam (FG_BACKEND_CUDA) the bytes are the backend's
 * memory: working_bytes = fixed_bytes + chunk_bytes + gemm_scratch_bytes
 * (not page-rounded) is the call's workspace (what an fg_exec.workspace must
 * hold, and what the budget bounds); the host's copies of the token arrays
 * and the GEMM library's own workspace (cuBLASLt's, kept by the context) are
 * outside it.
 * With a budget below it the query returns FG_ERR_BUDGET_TOO_SMALL, with the
 * message the call would give, and still writes info (chunk_rows = 0).
 */
typedef struct fg_linear_plan_info {
    int64_t chunk_rows;        /* token rows of the first chunk, the largest (the
                                  others may hold fewer)                             */
    int64_t chunks;            /* chunks the call walks (per sweep)                     */
    size_t working_bytes;      /* the arena the call holds, whole pages                 */
    size_t fixed_bytes;        /* per-call arrays: targets, sums; on the CPU also the
                                  [B, T] arrays and loss scratch; on a device every
                                  unmasked token's statistics and the loss's
                                  per-sequence constants                             */
    size_t chunk_bytes;        /* one chunk's logits, dlogits, hidden and grad rows     */
    size_t gemm_scratch_bytes; /* the backend's chunk scratch: oneDNN scratchpads (and
                                  converted weight tiles) on the CPU; on CUDA 0, or
                                  8 bytes a row with filter_eps (the filter's)      */
    size_t min_budget_bytes;   /* fused: smallest budget that runs; materialized: 0     */
    fg_dtype gemm_dtype;       /* what the GEMMs multiply for bf16 inputs: FG_DTYPE_BF16
                                  where this CPU has bf16 kernels (dlogits are then
                                  rounded to bf16), else FG_DTYPE_F32 (the weight is
                                  widened in tiles); FG_DTYPE_F32 for f32 inputs       */
    int64_t later_chunk_rows;  /* rows of each chunk after the first (the last may hold
                                  fewer): chunk_rows, or fewer where the first chunk
                                  holds the rows past whole logits blocks          */
    size_t grad_weight_sum_bytes; /* a bf16 grad_weight's float32 sums over the chunks
                                  ([V, H] floats, part of fixed_bytes); 0 when it is
                                  summed chunk by chunk in bf16, or is float32     */
} fg_linear_plan_info;

fg_status fg_linear_grpo_plan(fg_context *ctx, const fg_linear_options *opts,
                              const fg_loss_config *cfg, const fg_linear_inputs *in,
                              const fg_batch *batch, const fg_linear_outputs *out,
                              const fg_exec *exec, fg_linear_plan_info *info);

/*
 * logits_grpo_forward_backward: for callers that already hold the logits.
 *   z = logits / temperature
 *   in : logits [B*T, V] (f32 or bf16), batch [B, T]
 *   out: loss, metrics, logp?, entropy?, grad_logits [B*T, V]? (may alias logits)
 * Its working memory is per-token arrays only (no budget applies).
 */
fg_status fg_logits_grpo(fg_context *ctx, const fg_loss_config *cfg,
                         const fg_matrix *logits, const fg_batch *batch,
                         fg_logits_outputs *out, const fg_exec *exec);

/* ---------------------------------------------------- log-probs of the head */

/*
 * The LM head's log-probs alone, for the passes a training loop makes besides
 * the loss (the old and reference policies) and for any loss this library does
 * not compute (the backward of the caller's own loss through them).
 *   z = (hidden · weightᵀ + bias) / temperature
 *   logp[n] = z[n, token_ids[n]] − logsumexp(z[n, :]),
 *   entropy[n] = −Σ_v p_v log p_v,  p = softmax(z[n, :])
 * at unmasked tokens; 0 at masked ones. Fused: chunks of token rows within the
 * budget, one GEMM per token; the logits are never whole. Vocab sharding and
 * fg_exec as for fg_linear_grpo.
 */

/* The token side of a batch: the first four fields of fg_batch. */
typedef struct fg_tokens {
    int64_t batch;            /* B >= 1                                    */
    int64_t seq_len;          /* T >= 1                                    */
    const int64_t *token_ids; /* [B, T]; read only where mask != 0         */
    const uint8_t *mask;      /* [B, T]; nonzero = a token to score        */
} fg_tokens;

/*
 * linear_logprobs_forward
 *   in : hidden [B*T, H], weight [V, H], bias [V]?, tokens [B, T]
 *   out: logp [B, T]?, entropy [B, T]? (at least one)
 * No advantages, no loss, no gradients; temperature > 0 as in fg_loss_config.
 */
fg_status fg_linear_logprobs(fg_context *ctx, const fg_linear_options *opts, double temperature,
                             const fg_linear_inputs *in, const fg_tokens *tokens, float *logp,
                             float *entropy, const fg_exec *exec);

/* Gradient outputs of fg_linear_logprobs_backward; the rules of fg_linear_outputs. */
typedef struct fg_linear_grads {
    fg_matrix grad_hidden; /* [B*T, H] f32 (or bf16); zero rows at masked positions */
    fg_matrix grad_weight; /* [V, H] f32 (or bf16)                                  */
    fg_vector grad_bias;   /* [V] f32 (or bf16)                                     */
    int accumulate;        /* as fg_linear_outputs.accumulate                      */
} fg_linear_grads;

/*
 * linear_logprobs_backward: the gradient of a caller's loss L(logp, entropy)
 * with respect to the LM head's inputs, given the caller's per-token
 *   grad_logp[n] = ∂L/∂logp[n]  and  grad_entropy[n] = ∂L/∂entropy[n]
 * ([B, T]; read at unmasked tokens only; grad_entropy NULL: 0). The logits are
 * recomputed chunk by chunk (one more GEMM per token than the fused loss: 4 in
 * all with the forward pass), and per vocab entry v of token n
 *   ∂L/∂z[n, v] = grad_logp[n]·(δ_v,tok − p_v) − grad_entropy[n]·p_v·(log p_v + entropy[n])
 * goes through the two gradient GEMMs (divided by the temperature).
 *   in : hidden, weight, bias?, tokens, grad_logp [B, T], grad_entropy [B, T]?
 *   out: grad_hidden [B*T, H]?, grad_weight [V, H]?, grad_bias [V]? (at least one)
 */
fg_status fg_linear_logprobs_backward(fg_context *ctx, const fg_linear_options *opts,
                                      double temperature, const fg_linear_inputs *in,
                                      const fg_tokens *tokens, const float *grad_logp,
                                      const float *grad_entropy, fg_linear_grads *out,
                                      const fg_exec *exec);

/* ------------------------------------------- phases of a vocab-sharded call */

/*
 * For callers whose framework owns the communication (torch.distributed, JAX
 * collectives, MPI): the vocab-sharded loss as local phases, with two
 * reductions of the caller's between them and one after. Each shard s holds
 * vocab rows [vocab_start, vocab_start + V_s) of the weight (fg_linear_inputs);
 * every shard of a row group holds the same tokens. N = B * T.
 *
 *   stats = float[FG_SHARD_STATS_FLOATS(N)], per shard:
 *   (a) fg_linear_shard_stats        this shard's row statistics     GEMM 1
 *       MAX-reduce stats[0 : FG_SHARD_STATS_MAX_COUNT(N)]   over the vocab shards
 *   (b) fg_shard_stats_rescale       its sums rescaled, as exact limbs
 *       SUM-reduce stats[FG_SHARD_STATS_SUM_OFFSET(N) : + FG_SHARD_STATS_SUM_COUNT(N)]
 *       fg_shard_stats_finish        logp, entropy [B, T] (identical bits on every
 *                                    shard, for any reduction order)
 *   (c) fg_grpo_loss_from_logp       loss, metrics, d loss/d logp, d loss/d entropy
 *                                    (or any loss of the caller's own)
 *   (d) fg_linear_shard_backward     grad_hidden's share of this shard, its own
 *                                    grad_weight and grad_bias rows  GEMMs 1-3
 *       SUM-reduce grad_hidden                              over the vocab shards
 *
 * Per token a shard sends 2 floats by MAX and 8 by SUM (the sums as exact
 * integer limbs, docs/LOSS_SPEC.md "Vocab shards"), then H floats of
 * grad_hidden: O(N + N·H) bytes, never O(N·V). The logits are computed twice
 * (in (a) and again in (d)): 4 GEMM-sized products against the one-call hook's
 * 3 (fg_context_options.comm), one third more FLOPs, for not holding a
 * chunk's logits between calls.
 *
 * Failures: stats[FG_SHARD_STATS_STATUS(N)], the MAX range's last float, is
 * 0 after (a) succeeds. A shard whose (a) failed (it writes nothing) sets it
 * to the status it got, as a float, and joins the MAX all the same: (b),
 * fg_shard_stats_finish and (d) on every shard then return that status (the
 * largest, if several failed), so every shard fails the same way and none
 * waits in a reduction. (d)'s own failures are the caller's to carry (e.g. one
 * more float beside grad_hidden's SUM). Data parallelism (shards of the batch)
 * is the caller's too: fg_loss_config.num_items_in_batch takes the global token
 * count (docs/LOSS_SPEC.md "Data parallel").
 *
 * On a context of a backend behind the seam (FG_BACKEND_CUDA) every array of
 * these calls is that backend's memory, the stats included (a framework
 * reduces them where they are, e.g. with NCCL), as are the tokens, logp,
 * entropy, grad_logp, grad_entropy and the gradients. (a) and (d) run their
 * GEMMs there; (b) and fg_shard_stats_finish are O(N) work on the host:
 * they copy the tokens and stats in and write back what they change.
 */
#define FG_SHARD_STATS_FLOATS(n) (13 * (int64_t)(n) + 1)
#define FG_SHARD_STATS_MAX_COUNT(n) (2 * (int64_t)(n) + 1)
#define FG_SHARD_STATS_SUM_OFFSET(n) (2 * (int64_t)(n) + 1)
#define FG_SHARD_STATS_SUM_COUNT(n) (8 * (int64_t)(n))
#define FG_SHARD_STATS_STATUS(n) (2 * (int64_t)(n))

/* (a) in : hidden [N, H], this shard's weight [V_s, H] and bias, tokens [B, T]
 *     out: stats (all of it; masked tokens hold no statistics).
 * Token ids are checked against vocab_total (the whole vocabulary). */
fg_status fg_linear_shard_stats(fg_context *ctx, const fg_linear_options *opts,
                                double temperature, const fg_linear_inputs *in,
                                const fg_tokens *tokens, float *stats, const fg_exec *exec);

/* (b) After the MAX: fills the SUM range from the merged maxima and this
 * shard's own statistics. */
fg_status fg_shard_stats_rescale(fg_context *ctx, const fg_tokens *tokens, float *stats);

/* After the SUM: logp and entropy [B, T] (0 at masked tokens; either may be
 * NULL), and the merged statistics (d) reads, kept in stats. A token no shard
 * holds: FG_ERR_TOKEN_OUT_OF_RANGE. Summed limbs that no SUM of at most 256
 * shards can give (a reduction skipped or done twice): FG_ERR_COMMUNICATOR. */
fg_status fg_shard_stats_finish(fg_context *ctx, const fg_tokens *tokens, float *stats,
                                float *logp, float *entropy);

/* (c) The loss of docs/LOSS_SPEC.md from log-probs and entropies the caller
 * already has: loss, metrics, and per token grad_logp = d loss/d logp and
 * grad_entropy = d loss/d entropy ([B, T], 0 at masked tokens; either may be
 * NULL). batch's token ids are only checked to be >= 0. */
typedef struct fg_logp_outputs {
    double loss;
    fg_metrics metrics;
    float *grad_logp;    /* [B, T] or NULL */
    float *grad_entropy; /* [B, T] or NULL */
} fg_logp_outputs;

fg_status fg_grpo_loss_from_logp(fg_context *ctx, const fg_loss_config *cfg,
                                 const fg_batch *batch, const float *logp, const float *entropy,
                                 fg_logp_outputs *out, const fg_exec *exec);

/* (d) The backward of this shard from the merged statistics (stats after
 * fg_shard_stats_finish) and the loss's grad_logp / grad_entropy ([B, T]):
 * grad_hidden [N, H] is this shard's share (sum it over the shards),
 * grad_weight [V_s, H] and grad_bias [V_s] are this shard's rows, whole.
 * As fg_linear_logprobs_backward otherwise. */
fg_status fg_linear_shard_backward(fg_context *ctx, const fg_linear_options *opts,
                                   double temperature, const fg_linear_inputs *in,
                                   const fg_tokens *tokens, const float *stats,
                                   const float *grad_logp, const float *grad_entropy,
                                   fg_linear_grads *grads, const fg_exec *exec);

/* ------------------------------------------------------------- bindings */

/* Layout of the public structs for foreign-function bindings (ctypes, cffi)
 * that restate them: they check every field against these when they load,
 * so a struct that changes here cannot be misread through a stale copy.
 *   fg_abi_sizeof("fg_linear_outputs"): sizeof, 0 for an unknown name;
 *   fg_abi_offsetof("fg_linear_outputs", "grad_weight"): offsetof, -1 for an
 *   unknown struct or field (nested fields are not named: "metrics" is). */
size_t fg_abi_sizeof(const char *type_name);
int64_t fg_abi_offsetof(const char *type_name, const char *field_name);

#if defined(FG_BUILDING_LIBRARY) && defined(__GNUC__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif

#endif /* FUSEDGRPO_H */
