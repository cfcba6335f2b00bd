/*
 * The per-chunk seam: what a call needs from the memory its tensors live in,
 * and the chunk work a backend runs there. One driver (linear_grpo.c) walks
 * the chunks over it for every backend and owns everything O(tokens)
 * (validation, the plan, the loss math, the checks, the loss and metrics) on
 * the host, but for the per-token derivatives a backend's derivs op may
 * compute in its memory from the same source (loss_token.h), and in a
 * device-reported call (fusedgrpo.h) the checks of values, the per-sequence
 * constants and the loss, which its report ops run there from the same
 * sources (report.h, loss_sequence.h); a backend owns
 * everything O(chunk x vocab) and O(vocab x hidden) in its own memory:
 *
 *   per chunk of m unmasked tokens (rows [r0, r0 + m) of the active list):
 *     logits    hbuf = hidden[rows]; logits = hbuf · Wᵀ + b          GEMM 1
 *     stats     zmax, lsum, entropy, logp of each row    (reads the logits once)
 *     ── the host reads logp/entropy, runs the loss math, hands back g, e;
 *        or, where no token can be refused, derivs runs it in place ──
 *     backward  dlogits = d loss/d logits from g, e; bias sums  (reads them once)
 *     grads     grad_hidden[rows] = dlogits · W; grad_weight (+)= dlogitsᵀ · hbuf
 *   once, at the end: finish (grad_weight's float32 sums rounded, grad_bias,
 *   the zero rows of grad_hidden at masked tokens)
 *
 * Three backends implement it: the CPU one (backend_cpu.c: oneDNN products
 * in fixed blocks, OpenMP row work, every optional op), the CUDA one
 * (cuda/backend_cuda.cu, a shared library the context loads at run time, so
 * the core never links CUDA), and a plain reference (backend_reference.c):
 * loops in double, the specification of every op, whose memory the driver
 * treats as a device's (every byte through to_host / to_device), so that
 * the device path of the driver runs on machines without a GPU.
 *
 * Memory: every pointer below is the backend's memory (device memory for
 * CUDA), the caller's tensors included; only the host buffers of to_host /
 * to_device are host memory. Ops run in order on the backend's stream and
 * may return before they finish (FG_BACKEND_ASYNC); to_host's bytes are
 * there after wait(). Every op returns an fg_status and, on failure, a
 * message in msg (msg_size bytes); none exits or aborts. An op may refuse
 * memory the backend cannot address (a host pointer handed to CUDA) with
 * FG_ERR_UNSUPPORTED, never fault on it.
 *
 * Capabilities (caps, below) say what the driver may assume; optional ops
 * are NULL where a backend lacks them, and a call that needs one is refused
 * with FG_ERR_UNSUPPORTED naming the op, never run some other way.
 */
#ifndef FG_BACKEND_H
#define FG_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "fusedgrpo.h"

#ifdef __cplusplus
extern "C" {
#endif

struct fg_loss_plan;      /* loss_math.h */
struct fg_report_batch;   /* report.h */

/* The version of this interface; a backend library built against another is
 * refused when the context loads it. 2: a target outside [0, V) is another
 * vocab shard's token; the backward adds no one-hot term for it (the phase
 * API of a vocab-sharded weight). 3: the optional ops of a host backend,
 * hbuf in dlogit_t. 4: one driver for every backend: caps, compute_dtype,
 * chunk_scratch, the chunk-shaping facts, workers / hook / filtering in the
 * call, gb_sum always seeded by the driver, one row_check int, filter's
 * kept count. 5: derivs (the loss's g and e in the backend's memory); on a
 * backend that is not FG_BACKEND_HOST_MEMORY the row statistics and
 * row_check are the chunk's slice of per-token arrays;
 * FG_BACKEND_FILTER_IN_PLACE. 6: device-reported calls (report_batch,
 * report_prepare, report_scan, report_tokens); logits gathers a zero row for a masked
 * token; derivs gives a masked token g = e = 0 when the plan has the mask. */
#define FG_BACKEND_ABI 6

/* Capabilities (fg_backend_ops.caps). */
enum {
    /* The host reads and writes the backend's memory directly: the driver
     * uses its buffers in place and stages nothing (the CPU backend). */
    FG_BACKEND_HOST_MEMORY = 1u << 0,
    /* Ops may return before they finish; to_host's bytes are there after
     * wait() (CUDA). */
    FG_BACKEND_ASYNC = 1u << 1,
    /* A row's logits, statistics and dlogits have the same bits whatever the
     * chunk's size and the row's place in it. */
    FG_BACKEND_FIXED_ROW_BITS = 1u << 2,
    /* Every result has the same bits for any thread count. */
    FG_BACKEND_THREAD_INVARIANT = 1u << 3,
    /* filter keeps its entries in dlogits itself (the dropped ones zeroed,
     * its scratch from chunk_scratch): the driver carves no kept_*
     * workspace but kept_count (CUDA, and the reference, which specifies
     * this form). */
    FG_BACKEND_FILTER_IN_PLACE = 1u << 4
};

/* row_check's "no bad row": 0x7f in every byte, what a byte fill can give. */
#define FG_BACKEND_ROW_NONE 0x7f7f7f7f

/* What a scan of one input found (host memory: the scan op's result). */
typedef struct fg_backend_scan {
    uint32_t top_bits; /* largest |x| as float32 bits (bf16 widened); >= 0x7f800000:
                          some element is NaN or Inf                          */
    uint32_t pad;
    int64_t top_row;   /* its row, the lowest on ties; -1 when no row was scanned */
    int64_t bad_row;   /* the first row (in order) holding a NaN/Inf; -1: none */
    int64_t bad_col;   /* the first such column of that row                    */
} fg_backend_scan;

/* One call as the backend sees it: shapes, dtypes, the caller's tensors and
 * the workspace the driver carved (every pointer in backend memory). */
typedef struct fg_backend_call {
    int64_t N, H, V;            /* B*T token rows, hidden size, vocabulary       */
    int64_t n_active;           /* unmasked tokens                               */
    int64_t chunk_rows;         /* the largest chunk: the buffers' row count     */
    fg_dtype in_t;              /* hidden, weight and bias                       */
    fg_dtype logit_t;           /* the logits chunk                              */
    fg_dtype dlogit_t;          /* d loss/d logits and hbuf: the products' operand
                                   dtype (compute_dtype(in_t))                   */
    float inv_temp;
    int accumulate;             /* add grad_weight and grad_bias to the caller's */
    int workers;                /* threads the products may run on (the scratch
                                   chunk_scratch sized holds that many)          */
    int hook;                   /* the shards merge through a communicator per
                                   chunk: they may walk a smaller, agreed chunk
                                   than each planned alone                      */
    double filter_eps;          /* gradient filtering's threshold; 0: off        */
    int64_t kept_cap;           /* kept entries a row may hold, filtering        */
    /* The caller's tensors (data NULL: not given / not wanted). */
    fg_matrix hidden, weight;
    fg_vector bias;
    const uint8_t *mask;        /* [N] the caller's mask                         */
    fg_matrix grad_hidden, grad_weight;
    fg_vector grad_bias;
    /* The workspace. */
    const int64_t *rows;        /* [n_active] unmasked token indices, ascending  */
    const int64_t *targets;     /* [n_active] their token ids, local to the
                                   weight's rows (id - vocab_start); outside
                                   [0, V): another vocab shard's token        */
    void *logits;               /* [chunk_rows, V] of logit_t, row stride V      */
    void *dlogits;              /* [chunk_rows, V] of dlogit_t (may be logits)    */
    void *hbuf;                 /* [chunk_rows, H] of dlogit_t: the gathered rows */
    float *ghbuf;               /* [chunk_rows, H]: a chunk's grad_hidden rows    */
    float *zmax, *lsum, *entropy, *logp; /* [chunk_rows] row statistics (on a backend
                                   that is not HOST_MEMORY: the chunk's slice of
                                   [n_active] arrays, which the driver reads once
                                   after the chunks when it needs no host wait
                                   per chunk)                                   */
    float *g, *e;               /* [chunk_rows] d loss/d logp, d loss/d entropy   */
    float *gw_sum;              /* [V, H] float32 sums of a bf16 grad_weight over
                                   the chunks, or NULL (summed in place)        */
    float *gb_sum;              /* [V] grad_bias's float32 sums, or NULL (while
                                   planning: non-NULL exactly when wanted). The
                                   driver starts them before the chunks: the
                                   caller's values when accumulating, else 0,
                                   so that float32 micro-batches sum as one call */
    void *scratch;              /* chunk_scratch's bytes                          */
    int *row_check;             /* 1 int: the stats op's lowest chunk row whose
                                   target is outside [0, V), FG_BACKEND_ROW_NONE
                                   when none; set to it by the driver before the
                                   chunk's stats (a slot of its own per chunk
                                   on a backend that is not HOST_MEMORY) and
                                   read after them                            */
    /* Gradient filtering's workspace (filter_eps > 0): [chunk_rows, kept_cap]
     * kept column ids, [chunk_rows] counts and targets (grad_filter.h; NULL
     * on a FG_BACKEND_FILTER_IN_PLACE backend), and
     * kept_count [1]: the entries the rule keeps (V for a row keeping more
     * than kept_cap), which filter adds to chunk by chunk; the driver
     * zeroes it before the chunks and reads it once, at the end, so that
     * choosing dense or sparse never waits for the host. */
    int32_t *kept_idx, *kept_nnz;
    int64_t *kept_tgt, *kept_count;
} fg_backend_call;

/* A device-reported call's tokens after its chunks (report_tokens): every
 * token's statistics ([N], token order), the per-token outputs, and the
 * scratch of the loss's sums (report.h fg_report_sums_bytes). */
typedef struct fg_backend_tokens {
    const float *zmax, *lsum, *entropy, *logp;
    float *logp_out, *entropy_out; /* the caller's [N] (0 at masked tokens), or NULL */
    void *sums;
    int scanned;                   /* the inputs' NaN/Inf scan ran (report_scan) */
} fg_backend_tokens;

/* The loss's derivatives of one token, for stats_backward: g = d loss/d logp
 * and e = d loss/d entropy of the token at c->rows[k] from its log-prob and
 * entropy (the driver's loss math; the backend never sees the loss). */
typedef struct fg_backend_derivs {
    void (*at)(const void *user, int64_t k, float logp, float entropy, float *g, float *e);
    const void *user;
} fg_backend_derivs;

typedef struct fg_backend_ops {
    int abi;          /* FG_BACKEND_ABI                                        */
    const char *name; /* "cpu", "cuda", "reference"                            */
    unsigned caps;    /* FG_BACKEND_HOST_MEMORY, ...                           */
    size_t align;     /* the workspace's pieces start at multiples of this     */
    /* Chunk shaping, facts the planner asks. logits_block_rows: the logits
     * product runs in blocks of this many rows and pads a chunk's last one
     * (the planner then prefers chunks in whole blocks); 0: any size.
     * fast_chunk_rows: chunks of fewer rows run the products measurably
     * slower (a bf16 grad_weight's float32 sums never push the chunks below
     * it and to under half); 0: none. */
    int64_t logits_block_rows;
    int64_t fast_chunk_rows;
    void (*destroy)(void *be);

    /* Memory. alloc: `bytes` of backend memory, aligned to 256 bytes. */
    fg_status (*alloc)(void *be, size_t bytes, void **ptr, char *msg, size_t msg_size);
    void (*release)(void *be, void *ptr);
    /* Enqueues a copy into host memory; the bytes are there after wait(). */
    fg_status (*to_host)(void *be, void *host, const void *src, size_t bytes, char *msg,
                         size_t msg_size);
    /* Copies host memory in; the host buffer may be reused when it returns. */
    fg_status (*to_device)(void *be, void *dst, const void *host, size_t bytes, char *msg,
                           size_t msg_size);
    /* Sets `bytes` bytes at dst to zero. */
    fg_status (*fill_zero)(void *be, void *dst, size_t bytes, char *msg, size_t msg_size);
    /* Waits until every op enqueued so far has finished. */
    fg_status (*wait)(void *be, char *msg, size_t msg_size);

    /* Planning (c: shapes, dtypes, views, workers, hook, filter_eps; gw_sum
     * and gb_sum non-NULL exactly when they will be). The products' operand
     * dtype for inputs of in_t: hbuf and dlogits hold it. */
    fg_dtype (*compute_dtype)(void *be, fg_dtype in_t);
    /* Bytes the backend holds for the context besides the call's workspace
     * (e.g. the GEMM library's workspace: reported, not budgeted). */
    size_t (*call_scratch_bytes)(void *be, const fg_backend_call *c);
    /* Prepares the work of chunks of m rows and of a last one of `last`
     * rows on c->workers threads (so that a failure surfaces before any
     * output is written) and gives the scratch they need in the call's
     * workspace. */
    fg_status (*chunk_scratch)(void *be, const fg_backend_call *c, int64_t m, int64_t last,
                               size_t *bytes, char *msg, size_t msg_size);
    /* Optional: whether chunks of m rows run grad_hidden's product markedly
     * slower per row than longer ones (the planner avoids making them). */
    int (*chunk_slow)(void *be, const fg_backend_call *c, int64_t m);
    /* Whether the backend can run this call as planned (chunk_rows and every
     * view set): 0, or FG_ERR_UNSUPPORTED with a message naming what it
     * lacks. */
    fg_status (*supports)(void *be, const fg_backend_call *c, char *msg, size_t msg_size);

    /* The finite check of an input: rows r with mask[r] != 0 (mask NULL: every
     * row) of x, into *out, HOST memory: the op returns once the result is
     * there (on an asynchronous backend, after the work queued before it;
     * the backend keeps whatever device memory the reduction needs). */
    fg_status (*scan)(void *be, const fg_matrix *x, const uint8_t *mask, fg_backend_scan *out,
                      char *msg, size_t msg_size);

    /* The chunk work; rows [r0, r0 + m) of c->rows, m <= c->chunk_rows. */
    fg_status (*logits)(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                        size_t msg_size);
    /* zmax, lsum, entropy, logp of the chunk's rows i = 0..m-1 (token row
     * c->rows[r0 + i], target c->targets[r0 + i]; definitions in
     * row_kernels.h) into c->zmax[i] ...; the lowest i whose target is
     * outside [0, V) into *row_check (only lowered; its logp is then NaN;
     * zmax, lsum and entropy are the row's all the same). */
    fg_status (*stats)(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                       size_t msg_size);
    /* dlogits from the statistics (zmax, lsum, entropy: the stats op's, or
     * a vocab-sharded call's merged ones the driver wrote there) and c->g,
     * c->e; a target outside [0, V) adds no one-hot term (another shard's
     * token). With gb_sum, its columns summed in: gb_sum[v] += dlogits[r, v]
     * for the chunk's rows r in order, one float32 addition a row, of the
     * stored values: the bits do not depend on the chunking. */
    fg_status (*backward)(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                          size_t msg_size);
    /* GEMM 2 into the grad_hidden rows of the chunk's tokens (rounded once
     * to a bf16 grad_hidden), GEMM 3 into gw_sum or grad_weight: overwritten
     * when `first` (the first chunk, unless the call accumulates straight
     * into grad_weight), else added to. Either product is skipped when its
     * output is NULL. */
    fg_status (*grads)(void *be, const fg_backend_call *c, int64_t r0, int64_t m, int first,
                       char *msg, size_t msg_size);
    /* After every chunk: gw_sum rounded into a bf16 grad_weight (added to it
     * when accumulating), grad_bias = gb_sum (rounded once for bf16; the
     * driver seeded the sums), grad_hidden's rows at masked tokens (mask[r]
     * == 0) zeroed, and grad_weight zeroed when no token is unmasked and the
     * call does not accumulate. */
    fg_status (*finish)(void *be, const fg_backend_call *c, char *msg, size_t msg_size);

    /* Optional ops, NULL where a backend lacks them. */
    /* A fusion, for FG_BACKEND_HOST_MEMORY backends (the derivatives are a
     * host function): stats, then each row's g and e from `derivs` (also
     * into c->g, c->e), then backward: one read of each row of logits while
     * it is in cache. Without it the driver runs stats, the loss math and
     * backward, with the same results. */
    fg_status (*stats_backward)(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                const fg_backend_derivs *derivs, char *msg, size_t msg_size);
    /* Each row's own statistics over this shard's vocab rows (shard_stats.h:
     * the max, the sums, the target's logit or -inf in another shard) into
     * `out` (backend memory), a layout of `count` tokens: at row i, or at
     * token c->rows[r0 + i] when `by_token` (the phase API's [B*T] array).
     * Needed by the communicator hook and the phase API's (a). */
    fg_status (*shard_stats)(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                             float *out, int64_t count, int by_token, char *msg, size_t msg_size);
    /* grads' GEMM 2 in two steps, so that the communicator hook sums each
     * shard's share between them: the product alone into ghbuf's float32
     * rows, then those rows into grad_hidden (rounded once to bf16). Needed
     * by the communicator hook where grad_hidden is wanted. */
    fg_status (*dhidden)(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                         size_t msg_size);
    fg_status (*put_grad_hidden)(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                 char *msg, size_t msg_size);
    /* Gradient filtering (docs/LOSS_SPEC.md), after backward, with
     * c->filter_eps > 0: each row's kept entries of dlogits (the CPU: into
     * the kept_* workspace; FG_BACKEND_FILTER_IN_PLACE: the dropped entries
     * zeroed in dlogits; a row keeping more than kept_cap keeps every
     * entry); where every row keeps few enough, dhidden and grads may run
     * over the kept entries only (the CPU's; CUDA's grads where the chunk
     * keeps few enough too, chosen on the device), else dense over the
     * zeroed ones; the entries kept added to *c->kept_count, on the
     * backend, with no host wait. Needed by filter_eps. */
    fg_status (*filter)(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                        size_t msg_size);
    /* The loss's derivatives in the backend's memory, after stats: c->g[i]
     * and c->e[i] of the chunk's rows (token n = c->rows[r0 + i]) from
     * c->logp[i] and c->entropy[i], through loss_token.h's
     * fg_token_dlogp / fg_token_dentropy on `plan`, whose arrays (the
     * batch's advantages, log-probs and ratios, the caller's derivatives,
     * the per-sequence constants) are in the backend's memory. With it the
     * driver runs most calls with no host wait between their chunks
     * (linear_grpo.c runs_deferred). */
    fg_status (*derivs)(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                        const struct fg_loss_plan *plan, char *msg, size_t msg_size);

    /* Device-reported calls (fusedgrpo.h; report.h's checks, each failure
     * into rep->failed as report.h says), none of which waits for the
     * host. The walk is over every token row (c->n_active = N). */
    /* Before the chunks: each sequence's and each unmasked token's values
     * checked (fg_report_sequence, fg_report_token_input); c->rows[n] = n
     * and c->targets[n] = the id, -1 where masked or out of range (a
     * masked row's dlogits are 0 and keep no entry: no target); the
     * plan's per-sequence constants (loss_sequence.h fg_loss_seq_count, the
     * total summed in sequence order, fg_loss_seq_init) and its batch
     * scalars (total, fg_loss_entropy_weight) into its arrays, and
     * rep->seq_len, rep->vocab. `plan` is over the backend's memory. */
    fg_status (*report_batch)(void *be, const fg_backend_call *c, const struct fg_loss_plan *plan,
                              const struct fg_report_batch *r, fg_device_report *rep, char *msg,
                              size_t msg_size);
    /* Between a forward sweep and the gradient sweep of a loss that needs
     * every token first (fg_loss_needs_all_tokens): each sequence's
     * constants from every token's log-prob and entropy (t->logp,
     * t->entropy, [N]): loss_sequence.h's fg_loss_seq_prepare, then with
     * top_entropy_quantile < 1 the quantile's threshold over the unmasked
     * entropies and the entropy bonus's weight (batch scalars [2] and [1],
     * fg_loss_prepare's values), then at the sequence level
     * fg_loss_seq_dratio, into the plan's arrays. */
    fg_status (*report_prepare)(void *be, const fg_backend_call *c,
                                const struct fg_loss_plan *plan, const fg_backend_tokens *t,
                                char *msg, size_t msg_size);
    /* The finite check of x (rows r with mask[r] != 0; mask NULL: every
     * row): its first NaN/Inf entry in row-major order as
     * fg_report_entry_key(stage, row, col). */
    fg_status (*report_scan)(void *be, const fg_matrix *x, const uint8_t *mask, int stage,
                             fg_device_report *rep, char *msg, size_t msg_size);
    /* After the chunks: each unmasked token's checks (fg_report_token on
     * the resolved plan), the per-token outputs, for a loss the loss and
     * metrics (loss_sequence.h's order) into rep with their check
     * (fg_report_sums), then the first failure's values
     * (fg_report_values). */
    fg_status (*report_tokens)(void *be, const fg_backend_call *c, const struct fg_loss_plan *plan,
                               const struct fg_report_batch *r, const fg_backend_tokens *t,
                               fg_device_report *rep, char *msg, size_t msg_size);
} fg_backend_ops;


/* A backend instance: its ops and its state. */
typedef struct fg_device {
    const fg_backend_ops *ops;
    void *state;
} fg_device;

/* The entry point a backend library exports (FG_BACKEND_ENTRY): a backend
 * on `stream` (a cudaStream_t for CUDA: the stream's device; NULL: the
 * default stream of the current device). */
typedef fg_status (*fg_backend_create_fn)(void *stream, fg_device *out, char *msg,
                                          size_t msg_size);
#define FG_BACKEND_ENTRY "fg_backend_cuda_create"

/* The reference backend (backend_reference.c), and the host synchronisations
 * (waits and copies) the driver has asked of it in this process, for tests. */
fg_status fg_backend_reference_create(void *stream, fg_device *out, char *msg, size_t msg_size);
long fg_backend_reference_syncs(void);

#ifdef __cplusplus
}
#endif

#endif
