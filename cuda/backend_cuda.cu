/*
 * The CUDA backend: backend.h's ops on device memory, through the row
 * kernels (row_stats.h), the cuBLASLt products (gemm_cublaslt.h) and the
 * small chunk kernels (chunk_ops.h). Built as libfusedgrpo_cuda.so, which
 * the core loads at run time (fg_context_create with FG_BACKEND_CUDA); only
 * fg_backend_cuda_create is exported.
 *
 * State: the caller's stream (NULL: the legacy default stream), its device
 * (for NULL: the device current at create; every op makes it current and
 * restores the caller's afterwards, so a thread that switched devices
 * between calls still runs on the context's), a cuBLASLt handle and the
 * cuBLASLt workspace.
 *
 * The ops table (ABI 6): caps FG_BACKEND_ASYNC | FG_BACKEND_THREAD_INVARIANT
 * | FG_BACKEND_FILTER_IN_PLACE (the work runs on the stream whatever c->workers says; FG_BACKEND_FIXED_ROW_BITS
 * is not claimed: cuBLASLt picks its algorithm, and so a logit's summation
 * order, from the chunk's row count), align 256, logits_block_rows 0 (GEMM 1
 * takes any row count), fast_chunk_rows 1024 (on an H200 at V = 151936,
 * H = 4096 the three products ran 8% below full speed in chunks of 1024 rows
 * and 25% below at 512), compute_dtype = the inputs' dtype (the products
 * multiply bf16 on tensor cores, float32 in true float32). Optional ops:
 * shard_stats, dhidden and put_grad_hidden (the communicator hook and the
 * phase API); derivs (the loss's g and e on the device from the driver's
 * plan: loss_derivs.h, src/core/loss_token.h's formulas, so that a call
 * needs no host wait per chunk); filter (gradient filtering: the dropped
 * entries of dlogits zeroed in place, the products then dense over them;
 * chunk_ops.h); no stats_backward (a host backend's fusion), no chunk_slow.
 *
 * Every op reads and writes the per-row arrays (zmax, lsum, entropy, logp,
 * g, e) at c->X[i] for the chunk's rows i = 0..m-1 and row_check at
 * *c->row_check, through the pointers it is given: the driver hands each
 * chunk a copy of the call whose pointers are that chunk's slice of
 * [n_active] arrays (ABI 5), and the ops never assume where they point.
 *
 * Decisions:
 *  - The cuBLASLt workspace (fg_cuda_gemm_workspace_hint(), 32 MiB) is the
 *    backend's own, allocated once in create (so a context that cannot get it
 *    fails there, not in a call) and freed in destroy. call_scratch_bytes
 *    returns its size, which the plan reports (gemm_scratch_bytes) outside
 *    the call's budgeted workspace; the driver carves nothing for it.
 *  - Memory is stream-ordered (cudaMallocAsync / cudaFreeAsync on the stream:
 *    no host synchronization), or cudaMalloc / cudaFree on a device without
 *    memory pools. Sizes are rounded up to whole 256-byte units, as the
 *    reference does.
 *  - Every op runs asynchronously on the stream; to_host's bytes are there
 *    after wait(). to_device returns once the host buffer may be reused: a
 *    copy from pageable memory is staged before cudaMemcpyAsync returns; from
 *    pinned (or managed) memory the op synchronizes the stream.
 *  - supports also checks that each tensor of the call is memory this device
 *    can address (device memory of this device, managed, or mapped pinned
 *    memory), and to_host / to_device check their device side (the caller's
 *    token arrays, logp, entropy go through them), so that a host pointer is
 *    refused with FG_ERR_UNSUPPORTED and its name instead of faulting a
 *    kernel (a fault would end the CUDA context).
 *  - grads obeys `first` exactly, gw_sum or not (backend.h): the driver says
 *    when the sums start.
 *  - filter leaves kept_idx, kept_nnz and kept_tgt alone: its per-row
 *    scratch (threshold, kept count) is the backend's own chunk_scratch, 8
 *    bytes a row, so that it needs none of the CPU's kept-id workspace; it
 *    zeroes the dropped entries in place and adds to *kept_count on the
 *    device the chunk's kept entries (V for a row keeping more than
 *    kept_cap, which is left as it is).
 *  - A filtered chunk's grads is one CUDA graph of its own (filtered_graph):
 *    a kernel decides from the filter's counts whether the chunk is sparse
 *    enough (sparse_products.h), and a conditional node runs either the
 *    sparse products over the kept entries or the cuBLASLt products over
 *    the zeroed dlogits. The choice needs no host wait; the graph is built
 *    and instantiated per chunk (tens of microseconds, unmeasured). Inside a
 *    caller's stream capture (a device-reported call under torch.cuda.graph)
 *    the same node joins the caller's graph (filtered_in_capture; CUDA then
 *    forbids cloning that graph, embedding it as a child or instantiating
 *    it twice at once). A driver older than CUDA 12.8 (no else branch)
 *    runs every chunk dense, and chunk_scratch then asks for no sparse
 *    scratch; a chunk whose graph cannot be made runs dense (unless
 *    FUSEDGRPO_CUDA_STRICT=1 makes that fail the call).
 *  - derivs takes the plan by value into its kernel (its arrays are the
 *    driver's device copies) and is compiled without FMA contraction, as
 *    the host's loss math is (loss_derivs.h).
 *  - grad_bias: backward adds each chunk's stored dlogits into gb_sum one row
 *    at a time, in row order (row_stats.h), so its bits do not depend on the
 *    chunking; finish stores gb_sum (the driver seeded it with the caller's
 *    values when accumulating), rounded once for bf16.
 *  - One definition of each piece: grads runs dhidden then put_grad_hidden,
 *    and shard_stats runs the stats op's forward kernel with another output.
 *  - Kernels never fault on values read from device memory: row indices out
 *    of range are skipped or give NaN rows (chunk_ops.h), token ids out of
 *    range are recorded in the row check (row_stats.h).
 *
 * Every op checks its arguments first and reports failures as an fg_status
 * with a message: launch errors and CUDA errors as FG_ERR_BACKEND with the
 * CUDA error's name and string, allocation failures as FG_ERR_OUT_OF_MEMORY.
 */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <type_traits>

#include "backend.h"
#include "chunk_ops.h"
#include "fail.h"
#include "gemm_cublaslt.h"
#include "loss_derivs.h"
#include "report.h"
#include "report_kernels.h"
#include "row_stats.h"
#include "shard_stats.h"
#include "sparse_products.h"

/* The seam's structs are the kernels' structs, byte for byte. */
static_assert(sizeof(fg_cuda_scan) == sizeof(fg_backend_scan), "scan layout");
static_assert(offsetof(fg_cuda_scan, top_bits) == offsetof(fg_backend_scan, top_bits), "scan");
static_assert(offsetof(fg_cuda_scan, pad) == offsetof(fg_backend_scan, pad), "scan");
static_assert(offsetof(fg_cuda_scan, top_row) == offsetof(fg_backend_scan, top_row), "scan");
static_assert(offsetof(fg_cuda_scan, bad_row) == offsetof(fg_backend_scan, bad_row), "scan");
static_assert(offsetof(fg_cuda_scan, bad_col) == offsetof(fg_backend_scan, bad_col), "scan");
static_assert(sizeof(fg_cuda_row_check) == sizeof(int), "row_check is 1 int");
static_assert(FG_BACKEND_ROW_NONE == FG_CUDA_ROW_NONE, "the same 'no bad row'");

typedef struct cuda_backend {
    cudaStream_t stream;
    int device;
    int pools; /* the device has stream-ordered memory pools */
    cublasLtHandle_t lt;
    void *workspace; /* cuBLASLt's, workspace_bytes */
    size_t workspace_bytes;
    fg_cuda_scan *scan; /* one scan's result on the device, copied out by scan */
    cudaStream_t side;  /* captures the filtered products' graph; never runs work */
    int conditional;    /* the driver runs conditional graph nodes with an else
                           branch (CUDA 12.8): filtered chunks may run sparse */
    int strict;         /* FUSEDGRPO_CUDA_STRICT=1: a filtered chunk's graph that
                           cannot be made fails the call (else: that chunk dense) */
} cuda_backend;

static cuda_backend *state(void *be) { return static_cast<cuda_backend *>(be); }

static fg_status cuda_fail(fg_status st, const char *what, cudaError_t err, char *msg,
                           size_t msg_size)
{
    return fail(st, msg, msg_size, "CUDA: %s: %s (%s)", what, cudaGetErrorName(err),
                cudaGetErrorString(err));
}

/* The backend's device made current for one op, the caller's restored after.
 * A non-sticky error that an earlier runtime call of the caller's left is
 * cleared first, so that the op's launch checks report its own. */
class device_scope {
  public:
    explicit device_scope(int device)
    {
        (void)cudaGetLastError();
        if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != device)
            switched_ = cudaSetDevice(device) == cudaSuccess;
        (void)cudaGetLastError(); /* a failed switch shows in the op's own calls */
    }
    ~device_scope()
    {
        if (switched_)
            (void)cudaSetDevice(prev_);
    }
    device_scope(const device_scope &) = delete;
    device_scope &operator=(const device_scope &) = delete;

  private:
    int prev_ = -1;
    bool switched_ = false;
};

static fg_cuda_gemm gemm_of(const cuda_backend *s)
{
    fg_cuda_gemm g = {s->lt, s->stream, s->workspace, s->workspace_bytes};
    return g;
}

static fg_cuda_row_stats stats_of(const fg_backend_call *c)
{
    fg_cuda_row_stats st = {c->zmax, c->lsum, c->entropy, c->logp};
    return st;
}

/* ---- lifetime and memory ------------------------------------------------------- */

static void cuda_destroy(void *be)
{
    cuda_backend *s = state(be);
    if (!s)
        return;
    {
        device_scope scope(s->device);
        /* cuBLASLt may still be using the workspace on the stream. The whole
         * device is waited for: the caller may have destroyed the stream. */
        (void)cudaDeviceSynchronize();
        if (s->workspace)
            (void)cudaFree(s->workspace);
        if (s->scan)
            (void)cudaFree(s->scan);
        if (s->lt)
            (void)cublasLtDestroy(s->lt);
        if (s->side)
            (void)cudaStreamDestroy(s->side);
        (void)cudaGetLastError();
    }
    free(s);
}

static fg_status cuda_alloc(void *be, size_t bytes, void **ptr, char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    if (!s || !ptr)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "alloc: backend and ptr are required");
    *ptr = NULL;
    if (bytes > SIZE_MAX - 255)
        return fail(FG_ERR_OUT_OF_MEMORY, msg, msg_size, "alloc: %zu bytes", bytes);
    const size_t n = bytes == 0 ? 256 : (bytes + 255) / 256 * 256; /* whole 256-byte units */
    device_scope scope(s->device);
    const cudaError_t err = s->pools ? cudaMallocAsync(ptr, n, s->stream) : cudaMalloc(ptr, n);
    if (err != cudaSuccess) {
        (void)cudaGetLastError(); /* an allocation failure is not sticky: clear it */
        *ptr = NULL;
        return fail(FG_ERR_OUT_OF_MEMORY, msg, msg_size,
                    "CUDA: allocating %zu bytes of device memory: %s (%s)", n,
                    cudaGetErrorName(err), cudaGetErrorString(err));
    }
    /* The CUDA programming guide promises 256-byte alignment; the interface
     * relies on it, so a surprise is refused rather than misaligned. */
    if ((uintptr_t)*ptr % 256 != 0) {
        (void)(s->pools ? cudaFreeAsync(*ptr, s->stream) : cudaFree(*ptr));
        *ptr = NULL;
        return fail(FG_ERR_BACKEND, msg, msg_size,
                    "CUDA: the allocator returned memory not aligned to 256 bytes");
    }
    return FG_OK;
}

static void cuda_release(void *be, void *ptr)
{
    cuda_backend *s = state(be);
    if (!s || !ptr)
        return;
    device_scope scope(s->device);
    (void)(s->pools ? cudaFreeAsync(ptr, s->stream) : cudaFree(ptr));
    (void)cudaGetLastError();
}

/* Whether p (if given) is memory the backend's kernels can use at that
 * address: device memory of this device, managed memory, or mapped pinned
 * memory. Anything else would fault a kernel, which ends the CUDA context. */
static fg_status check_pointer(const cuda_backend *s, const char *name, const void *p, char *msg,
                               size_t msg_size)
{
    if (!p)
        return FG_OK;
    /* A pure query, made in relaxed capture mode so that a call captured in
     * a CUDA graph (a device-reported one) may make it in any mode. */
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    cudaPointerAttributes a;
    const cudaError_t err = cudaPointerGetAttributes(&a, p);
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return cuda_fail(FG_ERR_UNSUPPORTED, name, err, msg, msg_size);
    }
    if (a.type == cudaMemoryTypeDevice && a.device != s->device)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "%s is memory of CUDA device %d; this context runs on device %d", name,
                    a.device, s->device);
    /* Pinned host memory is addressable when mapped at the same address (UVA). */
    if (a.type == cudaMemoryTypeUnregistered ||
        (a.type == cudaMemoryTypeHost && a.devicePointer != p))
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "%s is host memory that CUDA device %d cannot address: a CUDA context "
                    "takes device (or managed) memory",
                    name, s->device);
    return FG_OK;
}

static fg_status cuda_to_host(void *be, void *host, const void *src, size_t bytes, char *msg,
                              size_t msg_size)
{
    cuda_backend *s = state(be);
    if (!s || ((!host || !src) && bytes))
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "to_host: NULL pointer");
    if (bytes == 0)
        return FG_OK;
    device_scope scope(s->device);
    /* The driver copies the caller's token arrays with this op: a host
     * pointer there is refused by name, not a failed copy. */
    const fg_status st = check_pointer(s, "a tensor read by the host (token ids, mask, "
                                          "advantages, log-probs)", src, msg, msg_size);
    if (st != FG_OK)
        return st;
    const cudaError_t err =
        cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, s->stream);
    if (err != cudaSuccess)
        return cuda_fail(FG_ERR_BACKEND, "copying device memory to the host", err, msg,
                         msg_size);
    return FG_OK;
}

/* Whether a host buffer is pageable: then cudaMemcpyAsync stages it before
 * returning. Unknown counts as not pageable (the caller synchronizes). */
static bool pageable(const void *host)
{
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, host) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeUnregistered;
}

static fg_status cuda_to_device(void *be, void *dst, const void *host, size_t bytes, char *msg,
                                size_t msg_size)
{
    cuda_backend *s = state(be);
    if (!s || ((!dst || !host) && bytes))
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "to_device: NULL pointer");
    if (bytes == 0)
        return FG_OK;
    device_scope scope(s->device);
    /* The driver writes the caller's logp and entropy with this op. */
    const fg_status st = check_pointer(s, "an output written from the host (logp, entropy)",
                                       dst, msg, msg_size);
    if (st != FG_OK)
        return st;
    cudaError_t err = cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, s->stream);
    /* From pinned memory the copy may still be reading the buffer. */
    if (err == cudaSuccess && !pageable(host))
        err = cudaStreamSynchronize(s->stream);
    if (err != cudaSuccess)
        return cuda_fail(FG_ERR_BACKEND, "copying host memory to the device", err, msg,
                         msg_size);
    return FG_OK;
}

static fg_status cuda_fill_zero(void *be, void *dst, size_t bytes, char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    if (!s || (!dst && bytes))
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "fill_zero: NULL pointer");
    if (bytes == 0)
        return FG_OK;
    device_scope scope(s->device);
    const cudaError_t err = cudaMemsetAsync(dst, 0, bytes, s->stream);
    if (err != cudaSuccess)
        return cuda_fail(FG_ERR_BACKEND, "zeroing device memory", err, msg, msg_size);
    return FG_OK;
}

/* A kernel's fault surfaces here (sticky: the CUDA context is then unusable). */
static fg_status cuda_wait(void *be, char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    if (!s)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "wait: backend is NULL");
    device_scope scope(s->device);
    const cudaError_t err = cudaStreamSynchronize(s->stream);
    if (err != cudaSuccess)
        return cuda_fail(FG_ERR_BACKEND, "waiting for the stream", err, msg, msg_size);
    return FG_OK;
}

/* ---- planning ---------------------------------------------------------------------- */

/* The workspace the backend holds (allocated in create), counted, not carved. */
static size_t cuda_call_scratch_bytes(void *be, const fg_backend_call *c)
{
    (void)c;
    const cuda_backend *s = state(be);
    return s ? s->workspace_bytes : 0;
}

static const char *dtype_name(fg_dtype t)
{
    return t == FG_DTYPE_F32 ? "float32" : t == FG_DTYPE_BF16 ? "bfloat16" : "unknown";
}

/* The products multiply in the inputs' dtype: bf16 on tensor cores with
 * float32 accumulation, float32 in true float32 (gemm_cublaslt.h). */
static fg_dtype cuda_compute_dtype(void *be, fg_dtype in_t)
{
    (void)be;
    return in_t;
}

/* Filtering's scratch for chunks of at most `rows` rows: the filter's
 * per-row threshold and count (chunk_ops.h's fg_cuda_filter_row), then the
 * sparse products' (sparse_products.h). */
static size_t filter_rows_bytes(int64_t rows)
{
    return ((size_t)rows * sizeof(fg_cuda_filter_row) + 255) / 256 * 256;
}

/* Chunks of m rows and a last one of `last`: the row kernels' launch limit
 * (checked here, before any output is written). The row work needs no
 * scratch: the bias column sums add the rows in order (row_stats.h). With
 * filtering (filter_eps > 0), the filter's rows and the sparse products'
 * scratch for the larger of the two chunks. */
static fg_status cuda_chunk_scratch(void *be, const fg_backend_call *c, int64_t m, int64_t last,
                                    size_t *bytes, char *msg, size_t msg_size)
{
    if (!be || !c || !bytes)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "chunk_scratch: NULL argument");
    *bytes = 0;
    if (m < 0 || last < 0)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "chunk_scratch: chunks of %lld rows, a last one of %lld", (long long)m,
                    (long long)last);
    const int64_t rows = m > last ? m : last;
    if (rows > FG_CUDA_ROW_LIMIT)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "the CUDA backend: chunks of %lld rows (at most %lld)", (long long)rows,
                    (long long)FG_CUDA_ROW_LIMIT);
    if (!(c->filter_eps > 0) || rows == 0)
        return FG_OK;
    size_t sparse = 0; /* none where the sizes pass int32: those chunks run dense */
    if (state(be)->conditional && rows < INT_MAX && c->V < INT_MAX && c->H < INT_MAX) {
        device_scope scope(state(be)->device);
        const fg_status st = fg_cuda_sparse_bytes(rows, c->V, &sparse, msg, msg_size);
        if (st != FG_OK)
            return st;
    }
    *bytes = filter_rows_bytes(rows) + sparse;
    return FG_OK;
}

/* The call as planned: dtypes, the chunk size, the mask where grad_hidden is
 * wanted, the kernels' launch limits, and memory this device can address. */
static fg_status cuda_supports(void *be, const fg_backend_call *c, char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    if (!s || !c)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "supports: NULL argument");
    if (c->in_t != FG_DTYPE_F32 && c->in_t != FG_DTYPE_BF16)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size, "the CUDA backend: inputs of dtype %d",
                    (int)c->in_t);
    if (!(c->logit_t == FG_DTYPE_F32 || c->logit_t == c->in_t))
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "the CUDA backend: %s logits for %s inputs (float32, or the inputs' dtype)",
                    dtype_name(c->logit_t), dtype_name(c->in_t));
    /* dlogits and hbuf hold the products' operand dtype, compute_dtype(in_t):
     * the backward products multiply dlogits with the weight / hidden rows in
     * one dtype (gemm_cublaslt.h). */
    const fg_dtype cmp_t = cuda_compute_dtype(be, c->in_t);
    if (c->dlogit_t != cmp_t)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "the CUDA backend: %s dlogits and gathered rows for %s inputs (its compute "
                    "dtype is %s)",
                    dtype_name(c->dlogit_t), dtype_name(c->in_t), dtype_name(cmp_t));
    if (c->hidden.dtype != c->in_t || c->weight.dtype != c->in_t ||
        (c->bias.data && c->bias.dtype != c->in_t))
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "the CUDA backend: hidden, weight and bias in one dtype (%s)",
                    dtype_name(c->in_t));
    const fg_dtype grads[3] = {c->grad_hidden.dtype, c->grad_weight.dtype, c->grad_bias.dtype};
    const bool wanted[3] = {c->grad_hidden.data != NULL, c->grad_weight.data != NULL,
                            c->grad_bias.data != NULL};
    for (int i = 0; i < 3; i++)
        if (wanted[i] && grads[i] != FG_DTYPE_F32 &&
            !(grads[i] == FG_DTYPE_BF16 && c->in_t == FG_DTYPE_BF16))
            return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                        "the CUDA backend: %s gradients for %s inputs", dtype_name(grads[i]),
                        dtype_name(c->in_t));
    /* The chunk size as planned: at least a row when a token is unmasked,
     * and within the row kernels' launch (rows numbered in int). */
    if (c->chunk_rows < 0 || (c->n_active > 0 && c->chunk_rows < 1))
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "the CUDA backend: chunks of %lld rows for %lld unmasked tokens",
                    (long long)c->chunk_rows, (long long)c->n_active);
    if (c->chunk_rows > FG_CUDA_ROW_LIMIT)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "the CUDA backend: chunks of %lld rows (at most %lld)",
                    (long long)c->chunk_rows, (long long)FG_CUDA_ROW_LIMIT);
    /* finish and the scan run one block per token row (N) or vocab row (V). */
    if (c->N > INT_MAX || c->V > INT_MAX)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "the CUDA backend: %lld token rows and %lld vocab rows (at most %d each)",
                    (long long)c->N, (long long)c->V, INT_MAX);
    /* finish zeroes grad_hidden's rows at masked tokens: it reads the mask. */
    if (c->grad_hidden.data && !c->mask)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "the CUDA backend: grad_hidden without the mask (its rows at masked tokens "
                    "are zeroed from it)");
    if (c->grad_hidden.data && c->grad_hidden.rows < c->N)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "the CUDA backend: grad_hidden has %lld rows, the mask %lld",
                    (long long)c->grad_hidden.rows, (long long)c->N);
    device_scope scope(s->device);
    /* The mask is read on the device only by finish, for grad_hidden. */
    const struct {
        const char *name;
        const void *p;
    } tensors[7] = {{"hidden", c->hidden.data},
                    {"weight", c->weight.data},
                    {"bias", c->bias.data},
                    {"mask", c->grad_hidden.data ? c->mask : NULL},
                    {"grad_hidden", c->grad_hidden.data},
                    {"grad_weight", c->grad_weight.data},
                    {"grad_bias", c->grad_bias.data}};
    for (const auto &t : tensors) {
        const fg_status st = check_pointer(s, t.name, t.p, msg, msg_size);
        if (st != FG_OK)
            return st;
    }
    return FG_OK;
}

/* ---- the scan ---------------------------------------------------------------------- */

static fg_status cuda_scan(void *be, const fg_matrix *x, const uint8_t *mask,
                           fg_backend_scan *out, char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    if (!s || !x || !out)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "scan: NULL argument");
    device_scope scope(s->device);
    /* The scan runs before the plan's supports checks the call's tensors:
     * memory the device cannot address is refused here, never read. */
    fg_status st = check_pointer(s, "a scanned input (hidden, weight or bias)", x->data, msg,
                                 msg_size);
    if (st == FG_OK)
        st = check_pointer(s, "mask", mask, msg, msg_size);
    if (st != FG_OK)
        return st;
    /* Into the backend's own slot, then to the host (backend.h: out is host
     * memory, there when the op returns). */
    st = fg_cuda_scan_matrix(x->data, x->dtype, x->rows, x->cols, x->ld, mask, s->scan, s->stream,
                             msg, msg_size);
    if (st != FG_OK)
        return st;
    cudaError_t err = cudaMemcpyAsync(out, s->scan, sizeof *s->scan, cudaMemcpyDeviceToHost,
                                      s->stream);
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(s->stream);
    if (err != cudaSuccess)
        return cuda_fail(FG_ERR_BACKEND, "scan: copying the result to the host", err, msg,
                         msg_size);
    return FG_OK;
}

/* ---- the chunk ops --------------------------------------------------------------------- */

/* Rows [r0, r0 + m) of the active list: 0 < m <= chunk_rows, inside n_active. */
static fg_status check_chunk(const cuda_backend *s, const fg_backend_call *c, int64_t r0,
                             int64_t m, const char *op, char *msg, size_t msg_size)
{
    if (!s || !c)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "%s: NULL argument", op);
    if (m < 1 || m > c->chunk_rows || r0 < 0 || r0 > c->n_active - m)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "%s: rows [%lld, %lld + %lld) of %lld active rows, chunks of %lld", op,
                    (long long)r0, (long long)r0, (long long)m, (long long)c->n_active,
                    (long long)c->chunk_rows);
    if (!c->rows || !c->targets)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "%s: rows and targets are required",
                    op);
    return FG_OK;
}

/* hbuf = hidden[rows]; logits = hbuf · Wᵀ (GEMM 1); + bias. */
static fg_status cuda_logits(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                             size_t msg_size)
{
    cuda_backend *s = state(be);
    fg_status st = check_chunk(s, c, r0, m, "logits", msg, msg_size);
    if (st != FG_OK)
        return st;
    device_scope scope(s->device);
    /* hbuf [m, H] of in_t, row stride H: GEMM 3 reads it again. */
    st = fg_cuda_gather_rows(c->hidden.data, c->in_t, c->hidden.rows, c->hidden.ld, c->rows + r0,
                             c->mask, m, c->H, c->hbuf, c->H, s->stream, msg, msg_size);
    if (st != FG_OK)
        return st;
    const fg_cuda_gemm g = gemm_of(s);
    st = fg_cuda_gemm_logits(&g, c->in_t, m, c->V, c->H, c->hbuf, c->H, c->weight.data,
                             c->weight.ld, c->logits, c->logit_t, c->V, msg, msg_size);
    if (st != FG_OK || !c->bias.data)
        return st;
    return fg_cuda_add_bias(c->logits, c->logit_t, m, c->V, c->V, c->bias.data, c->bias.dtype,
                            s->stream, msg, msg_size);
}

/* zmax, lsum, entropy, logp of the chunk's rows; the lowest row whose target
 * is outside [0, V) into row_check (one int). */
static fg_status cuda_stats(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                            size_t msg_size)
{
    cuda_backend *s = state(be);
    fg_status st = check_chunk(s, c, r0, m, "stats", msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!c->row_check)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "stats: row_check is required");
    device_scope scope(s->device);
    return fg_cuda_row_stats_forward(c->logits, c->logit_t, m, c->V, c->V, c->inv_temp,
                                     c->targets + r0, stats_of(c),
                                     reinterpret_cast<fg_cuda_row_check *>(c->row_check),
                                     s->stream, msg, msg_size);
}

/* dlogits from the statistics and g, e; gb_sum += the stored dlogits, row by
 * row in order (row_stats.h). */
static fg_status cuda_backward(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                               char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    fg_status st = check_chunk(s, c, r0, m, "backward", msg, msg_size);
    if (st != FG_OK)
        return st;
    /* In place, each element is read and written by one thread, which needs
     * the same element size (row_stats.h). */
    if (c->dlogits == c->logits && c->dlogit_t != c->logit_t)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "backward: dlogits (%s) in place of logits (%s) of another dtype",
                    dtype_name(c->dlogit_t), dtype_name(c->logit_t));
    device_scope scope(s->device);
    return fg_cuda_row_backward(c->logits, c->logit_t, c->V, c->dlogits, c->dlogit_t, c->V, m,
                                c->V, c->inv_temp, c->targets + r0, stats_of(c), c->g, c->e,
                                c->gb_sum, s->stream, msg, msg_size);
}

/* The loss's g and e of the chunk's rows from their logp and entropy, on the
 * device (loss_derivs.h): g[i], e[i] of token rows[r0 + i]. */
static fg_status cuda_derivs(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                             const struct fg_loss_plan *plan, char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    fg_status st = check_chunk(s, c, r0, m, "derivs", msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!plan)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "derivs: the loss plan is required");
    device_scope scope(s->device);
    return fg_cuda_loss_derivs(plan, c->rows + r0, m, c->logp, c->entropy, c->g, c->e,
                               s->stream, msg, msg_size);
}

/* ---- device-reported calls (report_kernels.h) ---- */

/* Every array the report ops read or write, addressable by the device (a
 * host pointer would fault the context: it is refused instead). */
static fg_status check_report_memory(const cuda_backend *s, const fg_loss_plan *plan,
                                     const fg_report_batch *r, fg_device_report *rep, char *msg,
                                     size_t msg_size)
{
    const struct {
        const char *name;
        const void *p;
    } arrays[] = {{"the report", rep},          {"token_ids", plan->token_ids},
                  {"mask", plan->mask},         {"advantages", plan->adv},
                  {"old_logp", plan->old},      {"ref_logp", plan->ref},
                  {"is_ratio", plan->is_ratio}, {"sampling_logp", plan->sampling},
                  {"grad_logp", r->grad_logp},  {"grad_entropy", r->grad_entropy}};
    for (const auto &a : arrays) {
        const fg_status st = check_pointer(s, a.name, a.p, msg, msg_size);
        if (st != FG_OK)
            return st;
    }
    return rep ? FG_OK : fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "report: the record is NULL");
}

static fg_status cuda_report_batch(void *be, const fg_backend_call *c,
                                   const struct fg_loss_plan *plan, const fg_report_batch *r,
                                   fg_device_report *rep, char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    device_scope scope(s->device);
    fg_status st = check_report_memory(s, plan, r, rep, msg, msg_size);
    if (st != FG_OK)
        return st;
    return fg_cuda_report_batch(plan, r, const_cast<int64_t *>(c->rows),
                                const_cast<int64_t *>(c->targets), rep, s->stream, msg, msg_size);
}

static fg_status cuda_report_prepare(void *be, const fg_backend_call *c,
                                     const struct fg_loss_plan *plan, const fg_backend_tokens *t,
                                     char *msg, size_t msg_size)
{
    (void)c;
    cuda_backend *s = state(be);
    device_scope scope(s->device);
    return fg_cuda_report_prepare(plan, t->logp, t->entropy, s->stream, msg, msg_size);
}

static fg_status cuda_report_scan(void *be, const fg_matrix *x, const uint8_t *mask, int stage,
                                  fg_device_report *rep, char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    device_scope scope(s->device);
    fg_status st = check_pointer(s, "the scanned input", x->data, msg, msg_size);
    if (st == FG_OK)
        st = check_pointer(s, "mask", mask, msg, msg_size);
    if (st != FG_OK)
        return st;
    return fg_cuda_report_scan(x->data, x->dtype, x->rows, x->cols, x->ld, mask, stage, rep,
                               s->stream, msg, msg_size);
}

static fg_status cuda_report_tokens(void *be, const fg_backend_call *c,
                                    const struct fg_loss_plan *plan, const fg_report_batch *r,
                                    const fg_backend_tokens *t, fg_device_report *rep, char *msg,
                                    size_t msg_size)
{
    (void)c;
    cuda_backend *s = state(be);
    device_scope scope(s->device);
    fg_status st = check_pointer(s, "logp", t->logp_out, msg, msg_size);
    if (st == FG_OK)
        st = check_pointer(s, "entropy", t->entropy_out, msg, msg_size);
    if (st != FG_OK)
        return st;
    return fg_cuda_report_tokens(plan, r, t, rep, s->stream, msg, msg_size);
}

/* Gradient filtering of the chunk's dlogits (rows 0..m-1, targets
 * targets[r0 + i]): the dropped entries zeroed in place, or the chunk left
 * dense; *kept_count += the entries the products use (chunk_ops.h). The
 * per-row scratch is chunk_scratch's. */
static fg_status cuda_filter(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                             char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    fg_status st = check_chunk(s, c, r0, m, "filter", msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!(c->filter_eps > 0))
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "filter: filter_eps = %g (the op runs with filter_eps > 0)", c->filter_eps);
    if (!c->dlogits || !c->kept_count || !c->scratch)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "filter: dlogits, kept_count and the scratch chunk_scratch asked for "
                    "(%zu bytes a row) are required",
                    sizeof(fg_cuda_filter_row));
    device_scope scope(s->device);
    return fg_cuda_filter_rows(c->dlogits, c->dlogit_t, m, c->V, c->V, c->targets + r0,
                               c->filter_eps, c->kept_cap,
                               static_cast<fg_cuda_filter_row *>(c->scratch), c->kept_count,
                               s->stream, msg, msg_size);
}

/* Where fg_shard_put_local (src/core/shard_stats.c) writes token i's statistics
 * in a layout of `count` tokens: max at buf[i], z_tok at buf[count + i], the
 * shard's own m, S, D at buf[fg_shard_local_offset(count) + k·count + i],
 * k = 0, 1, 2 (shard_stats.h's layout, whose offsets are used here; the
 * kernel writes each slot as fg_shard_put_local would). */
static fg_cuda_shard_slots shard_slots(float *buf, int64_t count, const int64_t *index)
{
    float *own = buf + fg_shard_local_offset(count);
    fg_cuda_shard_slots o = {buf, buf + count, own, own + count, own + 2 * count, index, count};
    return o;
}

/* Each row's own statistics over this shard's vocab rows and its target's
 * scaled logit (−inf outside [0, V)) into `out` at row i, or at token
 * c->rows[r0 + i] when by_token: the stats op's forward kernel, the same
 * max, sum and dot. */
static fg_status cuda_shard_stats(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                  float *out, int64_t count, int by_token, char *msg,
                                  size_t msg_size)
{
    cuda_backend *s = state(be);
    fg_status st = check_chunk(s, c, r0, m, "shard_stats", msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!out || !c->logits)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "shard_stats: out and the logits are required");
    /* fg_shard_floats(count) floats, counted in int64. */
    if (count < (by_token ? 1 : m) || count > (INT64_MAX - 1) / 16)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "shard_stats: a layout of %lld tokens for %lld rows%s", (long long)count,
                    (long long)m, by_token ? " by token" : "");
    device_scope scope(s->device);
    /* The phase API's stats array may be the caller's: a host pointer is
     * refused, never faulted on. */
    if ((st = check_pointer(s, "the shard statistics", out, msg, msg_size)) != FG_OK)
        return st;
    return fg_cuda_row_stats_shard(c->logits, c->logit_t, m, c->V, c->V, c->inv_temp,
                                   c->targets + r0,
                                   shard_slots(out, count, by_token ? c->rows + r0 : NULL),
                                   s->stream, msg, msg_size);
}

/* GEMM 2 with cuBLASLt on `stream`: ghbuf [m, H] float32 = dlogits [m, V] · W [V, H]. */
static fg_status gemm_grad_hidden(const cuda_backend *s, const fg_backend_call *c, int64_t m,
                                  cudaStream_t stream, char *msg, size_t msg_size)
{
    fg_cuda_gemm g = gemm_of(s);
    g.stream = stream;
    return fg_cuda_gemm_grad_hidden(&g, c->dlogit_t, m, c->V, c->H, c->dlogits, c->V,
                                    c->weight.data, c->weight.ld, c->ghbuf, FG_DTYPE_F32, c->H,
                                    0.0f, msg, msg_size);
}

/* GEMM 2 alone (the communicator hook's shares). */
static fg_status cuda_dhidden(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                              size_t msg_size)
{
    cuda_backend *s = state(be);
    fg_status st = check_chunk(s, c, r0, m, "dhidden", msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!c->ghbuf)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "dhidden: ghbuf is required");
    device_scope scope(s->device);
    return gemm_grad_hidden(s, c, m, s->stream, msg, msg_size);
}

/* ghbuf's float32 rows into grad_hidden's rows c->rows[r0 + i], rounded once
 * to a bf16 grad_hidden. */
static fg_status cuda_put_grad_hidden(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                      char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    fg_status st = check_chunk(s, c, r0, m, "put_grad_hidden", msg, msg_size);
    if (st != FG_OK)
        return st;
    const fg_matrix *gh = &c->grad_hidden;
    if (!gh->data) /* not wanted: nothing to put (the reference's contract) */
        return FG_OK;
    if (!c->ghbuf)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "put_grad_hidden: ghbuf is required");
    device_scope scope(s->device);
    return fg_cuda_scatter_rows(c->ghbuf, c->H, c->rows + r0, m, c->H, gh->data, gh->dtype,
                                gh->rows, gh->ld, s->stream, msg, msg_size);
}

/* GEMMs 2 and 3 with cuBLASLt on `stream`: ghbuf [m, H] = dlogits · W when
 * grad_hidden is wanted; gw_sum or grad_weight [V, H] (+)= dlogitsᵀ · hbuf
 * when grad_weight is, overwritten when `first`. */
static fg_status dense_products(const cuda_backend *s, const fg_backend_call *c, int64_t m,
                                int first, cudaStream_t stream, char *msg, size_t msg_size)
{
    fg_status st = c->grad_hidden.data ? gemm_grad_hidden(s, c, m, stream, msg, msg_size) : FG_OK;
    if (st != FG_OK || !c->grad_weight.data)
        return st;
    fg_cuda_gemm g = gemm_of(s);
    g.stream = stream;
    void *out = c->gw_sum ? static_cast<void *>(c->gw_sum) : c->grad_weight.data;
    const fg_dtype out_t = c->gw_sum ? FG_DTYPE_F32 : c->grad_weight.dtype;
    const int64_t ld = c->gw_sum ? c->H : c->grad_weight.ld;
    /* out [V, H] (+)= dlogits [m, V]ᵀ · hbuf [m, H] */
    return fg_cuda_gemm_grad_weight(&g, c->dlogit_t, m, c->V, c->H, c->dlogits, c->V, c->hbuf,
                                    c->H, out, out_t, ld, first ? 0.0f : 1.0f, msg, msg_size);
}

/* The same products over the filter's kept entries (sparse_products.h). */
static fg_status sparse_products(const fg_backend_call *c, int64_t r0, int64_t m, int first,
                                 const fg_cuda_sparse *sp, cudaStream_t stream, char *msg,
                                 size_t msg_size)
{
    const fg_cuda_filter_row *rows = static_cast<const fg_cuda_filter_row *>(c->scratch);
    fg_status st = fg_cuda_sparse_compact(c->dlogits, c->dlogit_t, m, c->V, c->targets + r0,
                                          rows, sp, stream, msg, msg_size);
    if (st == FG_OK && c->grad_hidden.data)
        st = fg_cuda_sparse_dhidden(sp, m, c->weight.data, c->weight.dtype, c->weight.ld, c->H,
                                    c->ghbuf, c->H, stream, msg, msg_size);
    if (st != FG_OK || !c->grad_weight.data)
        return st;
    float *out = c->gw_sum ? c->gw_sum : static_cast<float *>(c->grad_weight.data);
    const int64_t ld = c->gw_sum ? c->H : c->grad_weight.ld;
    return fg_cuda_sparse_dweight(sp, m, c->hbuf, c->dlogit_t, c->H, c->H, out, ld, first, stream,
                                  msg, msg_size);
}

/* A filtered chunk's sparse scratch (after the filter's rows in chunk_scratch's
 * bytes), when its products can run sparse: float32 sums of grad_weight,
 * int32 sizes. */
static bool sparse_scratch(const cuda_backend *s, const fg_backend_call *c, fg_cuda_sparse *sp)
{
    if (!s->conditional || !(c->filter_eps > 0) || !c->scratch || c->chunk_rows < 1 ||
        c->chunk_rows >= INT_MAX || c->V >= INT_MAX || c->H >= INT_MAX)
        return false;
    if (c->grad_weight.data && !c->gw_sum && c->grad_weight.dtype != FG_DTYPE_F32)
        return false;
    const fg_status st = fg_cuda_sparse_carve(
        sp, static_cast<unsigned char *>(c->scratch) + filter_rows_bytes(c->chunk_rows),
        c->chunk_rows, c->V, NULL, 0);
    (void)cudaGetLastError();
    return st == FG_OK;
}

/* A conditional handle of `graph` whose value is 0 (dense) at every launch
 * until decide sets it. */
static cudaError_t conditional_handle(cudaGraphConditionalHandle *handle, cudaGraph_t graph)
{
    return cudaGraphConditionalHandleCreate(handle, graph, 0, cudaGraphCondAssignDefault);
}

/* Work queued on the side stream, captured into `graph` (its roots). */
template <typename Work>
static fg_status capture_into(const cuda_backend *s, cudaGraph_t graph, const char *what,
                              Work work, char *msg, size_t msg_size)
{
    cudaError_t err = cudaStreamBeginCaptureToGraph(s->side, graph, NULL, NULL, 0,
                                                    cudaStreamCaptureModeRelaxed);
    if (err != cudaSuccess)
        return cuda_fail(FG_ERR_BACKEND, what, err, msg, msg_size);
    const fg_status st = work();
    cudaGraph_t captured = NULL;
    err = cudaStreamEndCapture(s->side, &captured);
    if (st != FG_OK)
        return st;
    return err == cudaSuccess ? FG_OK : cuda_fail(FG_ERR_BACKEND, what, err, msg, msg_size);
}

/* The filtered chunk's two branches as graphs of their own: [0] the sparse
 * products, [1] the dense ones (NULL where not made). */
static fg_status capture_branches(const cuda_backend *s, const fg_backend_call *c, int64_t r0,
                                  int64_t m, int first, const fg_cuda_sparse *sp,
                                  cudaGraph_t branch[2], char *msg, size_t msg_size)
{
    for (int k = 0; k < 2; k++) {
        const cudaError_t err = cudaGraphCreate(&branch[k], 0);
        if (err != cudaSuccess) {
            branch[k] = NULL;
            return cuda_fail(FG_ERR_BACKEND, "creating a filtered products' graph", err, msg,
                             msg_size);
        }
        const fg_status st =
            k == 0 ? capture_into(s, branch[k], "capturing the sparse products", [&] {
                return sparse_products(c, r0, m, first, sp, s->side, msg, msg_size);
            }, msg, msg_size)
                   : capture_into(s, branch[k], "capturing the dense products", [&] {
                return dense_products(s, c, m, first, s->side, msg, msg_size);
            }, msg, msg_size);
        if (st != FG_OK)
            return st;
    }
    return FG_OK;
}

/* In `graph`, after `deps`: a conditional node on `handle` whose bodies run
 * branch[0] (the condition set: sparse) or branch[1] (dense), each as a
 * child graph (a copy). */
static fg_status add_choice(cudaGraph_t graph, cudaGraphConditionalHandle handle,
                            const cudaGraphNode_t *deps, const cudaGraphEdgeData *edges,
                            size_t n, cudaGraph_t branch[2], cudaGraphNode_t *node, char *msg,
                            size_t msg_size)
{
    cudaGraphNodeParams p = {};
    p.type = cudaGraphNodeTypeConditional;
    p.conditional.handle = handle;
    p.conditional.type = cudaGraphCondTypeIf;
    p.conditional.size = 2; /* [0] when the condition is set, [1] (else) when not */
    cudaError_t err = cudaGraphAddNode(node, graph, deps, edges, n, &p);
    if (err != cudaSuccess)
        return cuda_fail(FG_ERR_BACKEND, "adding the conditional node (CUDA 12.8 or later)", err,
                         msg, msg_size);
    for (int k = 0; k < 2; k++) {
        cudaGraphNode_t child = NULL;
        if ((err = cudaGraphAddChildGraphNode(&child, p.conditional.phGraph_out[k], NULL, 0,
                                              branch[k])) != cudaSuccess)
            return cuda_fail(FG_ERR_BACKEND, "filling the conditional node's branches", err, msg,
                             msg_size);
    }
    return FG_OK;
}

static void destroy_branches(cudaGraph_t branch[2])
{
    for (int k = 0; k < 2; k++)
        if (branch[k])
            (void)cudaGraphDestroy(branch[k]);
}

/* The filtered chunk's products as a graph of their own, instantiated:
 * decide, then the conditional node choosing the branch on the device from
 * the filter's counts. */
static fg_status filtered_graph(const cuda_backend *s, const fg_backend_call *c, int64_t r0,
                                int64_t m, int first, const fg_cuda_sparse *sp,
                                cudaGraphExec_t *exec, char *msg, size_t msg_size)
{
    const fg_cuda_filter_row *rows = static_cast<const fg_cuda_filter_row *>(c->scratch);
    cudaGraph_t branch[2] = {NULL, NULL}, graph = NULL;
    fg_status st = capture_branches(s, c, r0, m, first, sp, branch, msg, msg_size);
    cudaError_t err = cudaSuccess;
    if (st == FG_OK && (err = cudaGraphCreate(&graph, 0)) != cudaSuccess) {
        graph = NULL;
        st = cuda_fail(FG_ERR_BACKEND, "creating the filtered products' graph", err, msg,
                       msg_size);
    }
    cudaGraphConditionalHandle handle = 0;
    if (st == FG_OK && (err = conditional_handle(&handle, graph)) != cudaSuccess)
        st = cuda_fail(FG_ERR_BACKEND, "the graph's conditional handle", err, msg, msg_size);
    if (st == FG_OK)
        st = capture_into(s, graph, "capturing the sparse products' choice", [&] {
            return fg_cuda_sparse_decide(rows, m, c->kept_cap, sp, 1, handle, s->side, msg,
                                         msg_size);
        }, msg, msg_size);
    cudaGraphNode_t decide = NULL, node = NULL;
    size_t nodes = 0;
    if (st == FG_OK &&
        ((err = cudaGraphGetNodes(graph, NULL, &nodes)) != cudaSuccess || nodes != 1 ||
         (err = cudaGraphGetNodes(graph, &decide, &nodes)) != cudaSuccess))
        st = err != cudaSuccess
                 ? cuda_fail(FG_ERR_BACKEND, "the choice's graph node", err, msg, msg_size)
                 : fail(FG_ERR_BACKEND, msg, msg_size,
                        "CUDA: the sparse products' choice captured as %zu graph nodes", nodes);
    if (st == FG_OK)
        st = add_choice(graph, handle, &decide, NULL, 1, branch, &node, msg, msg_size);
    if (st == FG_OK && (err = cudaGraphInstantiate(exec, graph, 0)) != cudaSuccess)
        st = cuda_fail(FG_ERR_BACKEND, "instantiating the filtered products' graph", err, msg,
                       msg_size);
    if (graph)
        (void)cudaGraphDestroy(graph);
    destroy_branches(branch);
    (void)cudaGetLastError();
    return st;
}

/* The same inside a caller's capture of the stream (a device-reported call
 * under torch.cuda.graph): decide captured on the stream, the conditional
 * node added to the caller's graph after it, and the stream's capture made
 * to continue from that node. The branches and the handle come first:
 * until decide is captured nothing of this chunk's is in the caller's
 * graph (*touched stays 0, and the caller may run the dense products
 * instead); a failure after that leaves the caller's graph incomplete, and
 * the call's status says so. A graph holding a conditional node cannot be
 * cloned, embedded as a child graph or instantiated twice at once (CUDA). */
static fg_status filtered_in_capture(const cuda_backend *s, const fg_backend_call *c, int64_t r0,
                                     int64_t m, int first, const fg_cuda_sparse *sp,
                                     bool *touched, char *msg, size_t msg_size)
{
    const fg_cuda_filter_row *rows = static_cast<const fg_cuda_filter_row *>(c->scratch);
    cudaGraph_t branch[2] = {NULL, NULL}, graph = NULL;
    *touched = false;
    fg_status st = capture_branches(s, c, r0, m, first, sp, branch, msg, msg_size);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaSuccess;
    if (st == FG_OK &&
        ((err = cudaStreamGetCaptureInfo(s->stream, &status, NULL, &graph)) != cudaSuccess ||
         status != cudaStreamCaptureStatusActive))
        st = err != cudaSuccess ? cuda_fail(FG_ERR_BACKEND, "the stream's capture", err, msg,
                                            msg_size)
                                : fail(FG_ERR_BACKEND, msg, msg_size,
                                       "CUDA: the stream's capture is not active");
    cudaGraphConditionalHandle handle = 0;
    if (st == FG_OK && (err = conditional_handle(&handle, graph)) != cudaSuccess)
        st = cuda_fail(FG_ERR_BACKEND, "the capture's conditional handle", err, msg, msg_size);
    if (st == FG_OK) {
        *touched = true;
        st = fg_cuda_sparse_decide(rows, m, c->kept_cap, sp, 1, handle, s->stream, msg,
                                   msg_size);
    }
    const cudaGraphNode_t *deps = NULL;
    const cudaGraphEdgeData *edges = NULL;
    size_t n = 0;
    if (st == FG_OK && (err = cudaStreamGetCaptureInfo(s->stream, &status, NULL, NULL, &deps,
                                                       &edges, &n)) != cudaSuccess)
        st = cuda_fail(FG_ERR_BACKEND, "the capture's dependencies", err, msg, msg_size);
    cudaGraphNode_t node = NULL;
    if (st == FG_OK)
        st = add_choice(graph, handle, deps, edges, n, branch, &node, msg, msg_size);
    if (st == FG_OK && (err = cudaStreamUpdateCaptureDependencies(
                            s->stream, &node, NULL, 1, cudaStreamSetCaptureDependencies)) !=
                           cudaSuccess)
        st = cuda_fail(FG_ERR_BACKEND, "continuing the capture after the conditional node", err,
                       msg, msg_size);
    destroy_branches(branch);
    return st;
}

/* The filtered chunk's products, sparse or dense as chosen on the device:
 * filtered_graph launched, or inside a caller's capture filtered_in_capture.
 * *done = 0 where neither could be set up and nothing reached the stream (a
 * graph that could not be made, for want of memory or of a driver feature):
 * the caller runs this chunk's dense products, unless FUSEDGRPO_CUDA_STRICT=1
 * makes that a failure of the call. */
static fg_status filtered_products(const cuda_backend *s, const fg_backend_call *c, int64_t r0,
                                   int64_t m, int first, const fg_cuda_sparse *sp, bool *done,
                                   char *msg, size_t msg_size)
{
    *done = false;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaStreamIsCapturing(s->stream, &capturing);
    if (err != cudaSuccess)
        return cuda_fail(FG_ERR_BACKEND, "the stream's capture status", err, msg, msg_size);
    if (capturing != cudaStreamCaptureStatusNone && capturing != cudaStreamCaptureStatusActive)
        return FG_OK; /* an invalidated capture: the dense products report it */
    fg_status st;
    bool touched = false;
    if (capturing == cudaStreamCaptureStatusActive) {
        st = filtered_in_capture(s, c, r0, m, first, sp, &touched, msg, msg_size);
    } else {
        cudaGraphExec_t exec = NULL;
        st = filtered_graph(s, c, r0, m, first, sp, &exec, msg, msg_size);
        if (st == FG_OK) {
            touched = true;
            err = cudaGraphLaunch(exec, s->stream);
            (void)cudaGraphExecDestroy(exec); /* freed once the launch completes */
            if (err != cudaSuccess)
                st = cuda_fail(FG_ERR_BACKEND, "launching the filtered products' graph", err,
                               msg, msg_size);
        }
    }
    if (st == FG_OK || touched || s->strict) {
        *done = true;
        return st;
    }
    (void)cudaGetLastError();
    if (msg && msg_size)
        msg[0] = '\0';
    return FG_OK;
}

/* GEMM 2 into ghbuf then grad_hidden's rows (put_grad_hidden); GEMM 3 into
 * gw_sum or grad_weight, overwritten when `first`, else added to. A
 * filtered chunk runs them sparse or dense as its kept entries say, chosen
 * on the device: filtered_graph's launch, or inside a caller's capture of
 * the stream, filtered_in_capture's node. */
static fg_status cuda_grads(void *be, const fg_backend_call *c, int64_t r0, int64_t m, int first,
                            char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    fg_status st = check_chunk(s, c, r0, m, "grads", msg, msg_size);
    if (st != FG_OK)
        return st;
    if (c->grad_hidden.data && !c->ghbuf)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "grads: ghbuf is required");
    if (!c->grad_hidden.data && !c->grad_weight.data)
        return FG_OK;
    device_scope scope(s->device);
    fg_cuda_sparse sp;
    bool done = false;
    if (sparse_scratch(s, c, &sp) &&
        (st = filtered_products(s, c, r0, m, first, &sp, &done, msg, msg_size)) != FG_OK)
        return st;
    if (!done && (st = dense_products(s, c, m, first, s->stream, msg, msg_size)) != FG_OK)
        return st;
    return cuda_put_grad_hidden(be, c, r0, m, msg, msg_size);
}

/* After the chunks: grad_weight from gw_sum (or zero), grad_bias = gb_sum,
 * zero grad_hidden rows at masked tokens. */
static fg_status cuda_finish(void *be, const fg_backend_call *c, char *msg, size_t msg_size)
{
    cuda_backend *s = state(be);
    if (!s || !c)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "finish: NULL argument");
    const fg_matrix *gh = &c->grad_hidden;
    if (gh->data && !c->mask)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "finish: grad_hidden is wanted but the mask is NULL");
    if (gh->data && gh->rows < c->N)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "finish: grad_hidden has %lld rows, the mask %lld", (long long)gh->rows,
                    (long long)c->N);
    if (c->grad_bias.data && !c->gb_sum)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "finish: grad_bias is wanted but gb_sum is NULL");
    device_scope scope(s->device);
    fg_status st = FG_OK;
    const fg_matrix *gw = &c->grad_weight;
    if (gw->data && c->n_active == 0 && !c->accumulate)
        st = fg_cuda_zero_rows(gw->data, gw->dtype, c->V, c->H, gw->ld, NULL, s->stream, msg,
                               msg_size);
    else if (gw->data && c->n_active > 0 && c->gw_sum) /* no chunk: gw_sum was never written */
        st = fg_cuda_store_sums(c->gw_sum, c->H, gw->data, gw->dtype, gw->ld, c->V, c->H,
                                c->accumulate, s->stream, msg, msg_size);
    if (st != FG_OK)
        return st;
    /* The driver seeded gb_sum (the caller's values when accumulating). */
    if (c->grad_bias.data &&
        (st = fg_cuda_store_sums(c->gb_sum, c->V, c->grad_bias.data, c->grad_bias.dtype, c->V, 1,
                                 c->V, 0, s->stream, msg, msg_size)) != FG_OK)
        return st;
    if (gh->data && c->N > 0)
        st = fg_cuda_zero_rows(gh->data, gh->dtype, c->N, c->H, gh->ld, c->mask, s->stream, msg,
                               msg_size);
    return st;
}

/* ---- the ops table and the entry point ------------------------------------------------- */

static fg_backend_ops make_ops(void)
{
    fg_backend_ops o = {};
    o.abi = FG_BACKEND_ABI;
    o.name = "cuda";
    o.caps = FG_BACKEND_ASYNC | FG_BACKEND_THREAD_INVARIANT | FG_BACKEND_FILTER_IN_PLACE;
    o.align = 256;
    o.logits_block_rows = 0;
    o.fast_chunk_rows = 1024;
    o.destroy = cuda_destroy;
    o.alloc = cuda_alloc;
    o.release = cuda_release;
    o.to_host = cuda_to_host;
    o.to_device = cuda_to_device;
    o.fill_zero = cuda_fill_zero;
    o.wait = cuda_wait;
    o.compute_dtype = cuda_compute_dtype;
    o.call_scratch_bytes = cuda_call_scratch_bytes;
    o.chunk_scratch = cuda_chunk_scratch;
    o.chunk_slow = NULL;
    o.supports = cuda_supports;
    o.scan = cuda_scan;
    o.logits = cuda_logits;
    o.stats = cuda_stats;
    o.backward = cuda_backward;
    o.grads = cuda_grads;
    o.finish = cuda_finish;
    o.stats_backward = NULL;
    o.shard_stats = cuda_shard_stats;
    o.dhidden = cuda_dhidden;
    o.put_grad_hidden = cuda_put_grad_hidden;
    o.filter = cuda_filter;
    o.derivs = cuda_derivs;
    o.report_batch = cuda_report_batch;
    o.report_prepare = cuda_report_prepare;
    o.report_scan = cuda_report_scan;
    o.report_tokens = cuda_report_tokens;
    return o;
}

static const fg_backend_ops cuda_ops = make_ops();

/* The cuBLASLt handle and workspace, made on the backend's device. */
static fg_status cuda_open(cuda_backend *s, char *msg, size_t msg_size)
{
    device_scope scope(s->device);
    if (cudaDeviceGetAttribute(&s->pools, cudaDevAttrMemoryPoolsSupported, s->device) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        s->pools = 0;
    }
    const cublasStatus_t ls = cublasLtCreate(&s->lt);
    if (ls != CUBLAS_STATUS_SUCCESS) {
        s->lt = NULL;
        return fail(FG_ERR_BACKEND, msg, msg_size, "cuBLASLt: creating the handle: %s",
                    cublasLtGetStatusName(ls));
    }
    s->workspace_bytes = fg_cuda_gemm_workspace_hint();
    const cudaError_t err = cudaMalloc(&s->workspace, s->workspace_bytes);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        s->workspace = NULL;
        return fail(FG_ERR_OUT_OF_MEMORY, msg, msg_size,
                    "CUDA: allocating the cuBLASLt workspace (%zu bytes) on device %d: %s (%s)",
                    s->workspace_bytes, s->device, cudaGetErrorName(err),
                    cudaGetErrorString(err));
    }
    const cudaError_t serr = cudaMalloc(&s->scan, sizeof *s->scan);
    if (serr != cudaSuccess) {
        (void)cudaGetLastError();
        s->scan = NULL;
        return cuda_fail(FG_ERR_OUT_OF_MEMORY, "allocating the scan's result", serr, msg,
                         msg_size);
    }
    int driver = 0;
    s->conditional = cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12080;
    (void)cudaGetLastError();
    const char *strict = getenv("FUSEDGRPO_CUDA_STRICT");
    s->strict = strict && strcmp(strict, "1") == 0;
    const cudaError_t cerr = cudaStreamCreateWithFlags(&s->side, cudaStreamNonBlocking);
    if (cerr != cudaSuccess) {
        (void)cudaGetLastError();
        s->side = NULL;
        return cuda_fail(FG_ERR_BACKEND, "creating the capture stream", cerr, msg, msg_size);
    }
    return FG_OK;
}

/* An empty kernel, built for the same architectures as every kernel of the
 * backend (cuda/CMakeLists.txt): whether the device can load it says whether
 * the build covers the device, by a binary image or by PTX it can compile. */
__global__ void arch_probe_kernel() {}

#ifndef FG_CUDA_ARCHS
#define FG_CUDA_ARCHS "(unknown)"
#endif

/* FG_ERR_UNSUPPORTED, naming the device's architecture and the build's, when
 * no kernel of this build runs on `device`; checked at context creation, so
 * that no call meets a missing image mid-way. */
static fg_status check_device_arch(int device, char *msg, size_t msg_size)
{
    cudaError_t probe;
    {
        device_scope on(device);
        cudaFuncAttributes attr;
        probe = cudaFuncGetAttributes(&attr, arch_probe_kernel);
        (void)cudaGetLastError();
    }
    if (probe == cudaSuccess)
        return FG_OK;
    int major = 0, minor = 0;
    (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    cudaDeviceProp prop;
    const char *name = cudaGetDeviceProperties(&prop, device) == cudaSuccess ? prop.name : "?";
    (void)cudaGetLastError();
    if (probe == cudaErrorUnsupportedPtxVersion)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "CUDA: device %d (%s, sm_%d%d) has a driver too old for this "
                    "libfusedgrpo_cuda.so's PTX (built for %s): update the driver, or build "
                    "with -DCMAKE_CUDA_ARCHITECTURES=%d%d-real (%s)",
                    device, name, major, minor, FG_CUDA_ARCHS, major, minor,
                    cudaGetErrorName(probe));
    if (probe == cudaErrorNoKernelImageForDevice || probe == cudaErrorInvalidDeviceFunction)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "CUDA: device %d (%s) is sm_%d%d, which this libfusedgrpo_cuda.so was not "
                    "built for (CMAKE_CUDA_ARCHITECTURES %s: images for those, PTX for the "
                    "'-virtual' ones); rebuild with -DCMAKE_CUDA_ARCHITECTURES=%d%d-real (%s)",
                    device, name, major, minor, FG_CUDA_ARCHS, major, minor,
                    cudaGetErrorName(probe));
    return cuda_fail(FG_ERR_BACKEND, "loading the backend's kernels", probe, msg, msg_size);
}

extern "C" __attribute__((visibility("default"))) fg_status
fg_backend_cuda_create(void *stream, fg_device *out, char *msg, size_t msg_size)
{
    if (!out)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "fg_backend_cuda_create: out is NULL");
    out->ops = NULL;
    out->state = NULL;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        return err != cudaSuccess
                   ? cuda_fail(FG_ERR_UNSUPPORTED, "no usable CUDA device", err, msg, msg_size)
                   : fail(FG_ERR_UNSUPPORTED, msg, msg_size, "CUDA: no device");
    }
    cuda_backend *s = static_cast<cuda_backend *>(calloc(1, sizeof *s));
    if (!s)
        return fail(FG_ERR_OUT_OF_MEMORY, msg, msg_size, "cannot allocate the CUDA backend");
    s->stream = static_cast<cudaStream_t>(stream);
    fg_status st = FG_OK;
    /* The stream's device (a caller's stream need not be on the current
     * device), else the current one. */
    if (!s->stream || cudaStreamGetDevice(s->stream, &s->device) != cudaSuccess) {
        (void)cudaGetLastError();
        if ((err = cudaGetDevice(&s->device)) != cudaSuccess)
            st = cuda_fail(FG_ERR_BACKEND, "the current device", err, msg, msg_size);
    }
    if (st == FG_OK)
        st = check_device_arch(s->device, msg, msg_size);
    if (st == FG_OK)
        st = cuda_open(s, msg, msg_size);
    if (st != FG_OK) {
        cuda_destroy(s);
        return st;
    }
    out->ops = &cuda_ops;
    out->state = s;
    return FG_OK;
}

/* The entry point has the type the loader casts it to. */
static_assert(std::is_same<decltype(&fg_backend_cuda_create), fg_backend_create_fn>::value,
              "fg_backend_cuda_create matches fg_backend_create_fn");
