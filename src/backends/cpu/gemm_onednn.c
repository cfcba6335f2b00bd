/* oneDNN matmul wrapper: primitive cache, fixed blocks and the bf16 tile path
 * (see gemm_onednn.h). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime(CLOCK_THREAD_CPUTIME_ID) */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <oneapi/dnnl/dnnl.h>

#include "bf16.h"
#include "gemm_onednn.h"
#include "internal.h"
#include "row_kernels.h"
#include "workspace.h"

/* A converted weight tile holds at least this many weight rows, whatever the
 * caller's tile_bytes (the driver sizes tiles from its chunk, see
 * linear_grpo.c). */
#define TILE_MIN_ROWS 4

enum { MEM_A, MEM_B, MEM_C, MEM_BIAS, MEM_SCRATCH, MEM_COUNT };

/* One block shape's primitive, made for one thread. */
typedef struct gemm_slot {
    fg_gemm_shape shape;
    dnnl_primitive_t prim;
    /* Memory objects without a buffer, one set per worker thread, made in
     * fg_gemm_prepare; a run only sets their data handles, so nothing is
     * allocated once outputs are being written. */
    dnnl_memory_t (*mem)[MEM_COUNT];
    int workers;
    dnnl_memory_desc_t a_md, b_md, c_md, bias_md, scratch_md;
    size_t scratch_bytes;
    uint64_t last_use;
} gemm_slot;

struct fg_gemm_cache {
    dnnl_engine_t engine;
    dnnl_stream_t *streams; /* one per worker thread */
    int workers;
    int native_bf16;
    int avx2_kernels; /* oneDNN runs at most AVX2 here: restride_f32 applies */
    gemm_slot slots[FG_GEMM_CACHE_SLOTS];
    uint64_t clock;
};

static dnnl_data_type_t dt(fg_dtype t) { return t == FG_DTYPE_BF16 ? dnnl_bf16 : dnnl_f32; }

static int same_shape(const fg_gemm_shape *a, const fg_gemm_shape *b)
{
    return a->M == b->M && a->N == b->N && a->K == b->K && a->a_type == b->a_type &&
           a->b_type == b->b_type && a->c_type == b->c_type && a->a_rs == b->a_rs &&
           a->a_cs == b->a_cs && a->b_rs == b->b_rs && a->b_cs == b->b_cs && a->c_ld == b->c_ld &&
           a->accumulate == b->accumulate && a->has_bias == b->has_bias;
}

static void slot_free(gemm_slot *slot)
{
    for (int w = 0; w < slot->workers; w++)
        for (int i = 0; i < MEM_COUNT; i++)
            if (slot->mem[w][i])
                dnnl_memory_destroy(slot->mem[w][i]);
    free(slot->mem);
    if (slot->prim)
        dnnl_primitive_destroy(slot->prim);
    memset(slot, 0, sizeof *slot);
}

enum { CREATE_OK = 0, CREATE_UNIMPLEMENTED, CREATE_FAILED };

/* Builds the primitive for s, for one thread: blocks run side by side, each
 * on one thread, so that a block's bits never depend on the thread count.
 * CREATE_OK, CREATE_UNIMPLEMENTED when oneDNN has no kernel for it on this
 * CPU, CREATE_FAILED on any other failure (memory). */
static int create_primitive(fg_gemm_cache *c, const fg_gemm_shape *s, gemm_slot *slot)
{
    dnnl_dims_t a_dims = {s->M, s->K}, a_str = {s->a_rs, s->a_cs};
    dnnl_dims_t b_dims = {s->K, s->N}, b_str = {s->b_rs, s->b_cs};
    dnnl_dims_t c_dims = {s->M, s->N}, c_str = {s->c_ld, 1};
    dnnl_dims_t bias_dims = {1, s->N}, bias_str = {s->N, 1};
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_matmul_desc_t md;
    int bad = CREATE_FAILED;
    const int saved_threads = omp_get_max_threads();
    if (dnnl_memory_desc_init_by_strides(&slot->a_md, 2, a_dims, dt(s->a_type), a_str) ||
        dnnl_memory_desc_init_by_strides(&slot->b_md, 2, b_dims, dt(s->b_type), b_str) ||
        dnnl_memory_desc_init_by_strides(&slot->c_md, 2, c_dims, dt(s->c_type), c_str) ||
        dnnl_memory_desc_init_by_strides(&slot->bias_md, 2, bias_dims, dt(s->b_type), bias_str))
        goto done;
    if (dnnl_matmul_desc_init(&md, &slot->a_md, &slot->b_md, s->has_bias ? &slot->bias_md : NULL,
                              &slot->c_md))
        goto done;
    if (dnnl_primitive_attr_create(&attr) ||
        dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user))
        goto done;
    if (s->accumulate && (dnnl_post_ops_create(&po) || dnnl_post_ops_append_sum(po, 1.0f) ||
                          dnnl_primitive_attr_set_post_ops(attr, po)))
        goto done;
    /* oneDNN sizes its thread split, its scratchpad and its kernels from the
     * OpenMP thread count, read when the descriptor AND when the primitive
     * are made: both must see one thread. */
    omp_set_num_threads(1);
    if (fg_fault_hit())
        goto done;
    const dnnl_status_t pd_st = dnnl_primitive_desc_create(&pd, &md, attr, c->engine, NULL);
    if (pd_st != dnnl_success) {
        pd = NULL;
        bad = pd_st == dnnl_unimplemented ? CREATE_UNIMPLEMENTED : CREATE_FAILED;
        goto done;
    }
    const dnnl_memory_desc_t *sp = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    slot->scratch_bytes = sp ? dnnl_memory_desc_get_size(sp) : 0;
    if (sp)
        slot->scratch_md = *sp;
    if (fg_fault_hit() || dnnl_primitive_create(&slot->prim, pd))
        goto done;
    slot->shape = *s;
    bad = CREATE_OK;
done:
    omp_set_num_threads(saved_threads);
    if (pd)
        dnnl_primitive_desc_destroy(pd);
    if (po)
        dnnl_post_ops_destroy(po);
    if (attr)
        dnnl_primitive_attr_destroy(attr);
    if (bad)
        slot_free(slot);
    return bad;
}

/* Makes sure the slot and the cache have `workers` memory-object sets and
 * streams. Returns nonzero on an allocation or oneDNN failure. */
static int ensure_workers(fg_gemm_cache *c, gemm_slot *slot, int workers)
{
    if (c->workers < workers) {
        dnnl_stream_t *st = fg_fault_hit() ? NULL : realloc(c->streams, (size_t)workers * sizeof *st);
        if (!st)
            return 1;
        c->streams = st;
        for (; c->workers < workers; c->workers++)
            if (fg_fault_hit() || dnnl_stream_create(&c->streams[c->workers], c->engine,
                                                     dnnl_stream_default_flags) != dnnl_success)
                return 1;
    }
    if (slot->workers >= workers)
        return 0;
    dnnl_memory_t(*mem)[MEM_COUNT] =
        fg_fault_hit() ? NULL : realloc(slot->mem, (size_t)workers * sizeof *mem);
    if (!mem)
        return 1;
    slot->mem = mem;
    const dnnl_memory_desc_t *mds[MEM_COUNT] = {&slot->a_md, &slot->b_md, &slot->c_md,
                                                slot->shape.has_bias ? &slot->bias_md : NULL,
                                                slot->scratch_bytes ? &slot->scratch_md : NULL};
    for (; slot->workers < workers; slot->workers++) {
        memset(mem[slot->workers], 0, sizeof mem[slot->workers]);
        for (int i = 0; i < MEM_COUNT; i++)
            if (mds[i] && (fg_fault_hit() || dnnl_memory_create(&mem[slot->workers][i], mds[i],
                                                                c->engine, DNNL_MEMORY_NONE))) {
                slot->workers++; /* freed by slot_free with the rest */
                return 1;
            }
    }
    return 0;
}

/* ------------------------------------------- bf16 products: worth taking? */

/* Where oneDNN has bf16 matmul kernels, they are not always the faster
 * product: the fused bf16 step (T = 2048, H = 1024, V = 151936) ran in 0.55
 * of the f32 step's time on an AMD Zen 4 (bench/bf16_products_ab.c,
 * docs/BENCHMARKS.md) and 1.66x it on an Intel Xeon (family 6 model 207, no
 * AMX: 142.5 against 220.5 GFLOP/s), oneDNN 2.6 on both. So the ISA does not decide; a measurement
 * does: the logits block's product (FG_BLOCK_LOGITS_M x FG_BLOCK_LOGITS_N, K =
 * 1024) in bf16 and in f32 on the calling thread, PROBE_REPS times each in
 * turns, the fastest of each kept, timed in the thread's CPU time: another
 * process taking the core between two reads (ranks oversubscribing a
 * machine) does not count, where wall time let ranks of one job choose
 * differently. bf16 products are taken only where they take at most
 * BF16_WINS of the f32 time: they round dlogits to bf16 for the gradient
 * products, f32 products on widened bf16 tiles do not, so accuracy goes to
 * f32 unless bf16 clearly wins. Once per process (the CPU does not change;
 * every context of a process then multiplies alike). FUSEDGRPO_BF16_PRODUCTS
 * = native or f32 decides instead, read at each context's creation: the same
 * bits across processes on a CPU near the line. A build with fault injection
 * does not measure (its tests count fault points per creation), and a
 * measurement that fails for memory keeps bf16 products, uncached. */
#ifndef FG_FAULT_INJECTION
#define PROBE_K 1024
#define PROBE_REPS 5
#define BF16_WINS 0.9

static double thread_cpu_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static fg_gemm_shape probe_shape(fg_dtype t)
{
    fg_gemm_shape s;
    memset(&s, 0, sizeof s);
    s.M = FG_BLOCK_LOGITS_M;
    s.N = FG_BLOCK_LOGITS_N;
    s.K = PROBE_K;
    s.a_type = s.b_type = t;
    s.c_type = FG_DTYPE_F32;
    s.a_rs = PROBE_K; /* hidden rows */
    s.a_cs = 1;
    s.b_rs = 1; /* the weight's rows are B's columns */
    s.b_cs = PROBE_K;
    s.c_ld = FG_BLOCK_LOGITS_N;
    return s;
}

/* The fastest of PROBE_REPS runs of the bf16 and the f32 probe products, in
 * turns (secs[0]: bf16, secs[1]: f32). Nonzero on a failure. */
static int time_probe_products(fg_gemm_cache *c, double secs[2])
{
    const fg_gemm_shape shapes[2] = {probe_shape(FG_DTYPE_BF16), probe_shape(FG_DTYPE_F32)};
    const size_t a_elems = (size_t)FG_BLOCK_LOGITS_M * PROBE_K;
    const size_t b_elems = (size_t)FG_BLOCK_LOGITS_N * PROBE_K;
    fg_gemm_scratch need = {0, 0};
    fg_error err;
    for (int i = 0; i < 2; i++)
        if (fg_gemm_prepare(c, &shapes[i], 1, &need, &err) != FG_OK)
            return 1;
    const size_t scratch_bytes = fg_ws_round(fg_gemm_scratch_bytes(&need, 1) + FG_ALIGN);
    float *a32 = malloc(a_elems * sizeof(float)), *b32 = malloc(b_elems * sizeof(float));
    uint16_t *a16 = malloc(a_elems * 2), *b16 = malloc(b_elems * 2);
    float *cbuf = malloc((size_t)FG_BLOCK_LOGITS_M * FG_BLOCK_LOGITS_N * sizeof(float));
    void *scratch = aligned_alloc(FG_ALIGN, scratch_bytes);
    int bad = !a32 || !b32 || !a16 || !b16 || !cbuf || !scratch;
    if (!bad) {
        /* values of a real call's scale: a zero or denormal operand could
         * take another path through a kernel */
        for (size_t i = 0; i < a_elems; i++)
            a16[i] = fg_bf16_store(a32[i] = (float)((int)(i % 7) - 3) * 0.25f);
        for (size_t i = 0; i < b_elems; i++)
            b16[i] = fg_bf16_store(b32[i] = (float)((int)(i % 5) - 2) * 0.03125f);
        secs[0] = secs[1] = 1e300;
        for (int r = 0; r < PROBE_REPS && !bad; r++)
            for (int i = 0; i < 2 && !bad; i++) {
                const int bf = shapes[i].a_type == FG_DTYPE_BF16;
                const double t0 = thread_cpu_seconds();
                bad = fg_gemm_run(c, &shapes[i], bf ? (void *)a16 : a32, bf ? (void *)b16 : b32,
                                  cbuf, NULL, scratch, 1, NULL, &err) != FG_OK;
                const double t = thread_cpu_seconds() - t0;
                if (t < secs[i])
                    secs[i] = t;
            }
    }
    free(a32);
    free(b32);
    free(a16);
    free(b16);
    free(cbuf);
    free(scratch);
    return bad;
}
#endif

static int bf16_products_chosen(fg_gemm_cache *c)
{
    const char *force = getenv("FUSEDGRPO_BF16_PRODUCTS");
    if (force && !strcmp(force, "native"))
        return 1;
    if (force && !strcmp(force, "f32"))
        return 0;
#ifdef FG_FAULT_INJECTION
    (void)c;
    return 1;
#else
    static int chosen = -1; /* -1: not measured yet in this process */
    int answer;
#pragma omp critical(fg_bf16_products)
    {
        if (chosen < 0) {
            double secs[2];
            c->native_bf16 = 1; /* the probe's bf16 product runs natively */
            if (!time_probe_products(c, secs))
                chosen = secs[0] <= BF16_WINS * secs[1];
        }
        answer = chosen < 0 ? 1 : chosen;
    }
    return answer;
#endif
}

fg_status fg_gemm_cache_create(fg_gemm_cache **out)
{
    *out = NULL;
    fg_gemm_cache *c = fg_fault_hit() ? NULL : calloc(1, sizeof *c);
    if (!c)
        return FG_ERR_OUT_OF_MEMORY;
    if (fg_fault_hit() || dnnl_engine_create(&c->engine, dnnl_cpu, 0) != dnnl_success) {
        free(c);
        return FG_ERR_BACKEND;
    }
    /* Probe once: does this CPU have oneDNN bf16 matmul kernels? */
    fg_gemm_shape probe = {16, 16, 16, FG_DTYPE_BF16, FG_DTYPE_BF16, FG_DTYPE_F32,
                           16, 1, 16, 1, 16, 0, 0, 0, 0, 0, 0, 0};
    gemm_slot tmp;
    memset(&tmp, 0, sizeof tmp);
    const int probed = create_primitive(c, &probe, &tmp);
    slot_free(&tmp);
    if (probed == CREATE_FAILED) { /* not an answer: a CPU's path never hangs on an OOM */
        dnnl_engine_destroy(c->engine);
        free(c);
        return FG_ERR_OUT_OF_MEMORY;
    }
    c->avx2_kernels = (dnnl_get_effective_cpu_isa() & ~dnnl_cpu_isa_avx2) == 0;
    c->native_bf16 = probed == CREATE_OK && bf16_products_chosen(c);
    *out = c;
    return FG_OK;
}

void fg_gemm_cache_destroy(fg_gemm_cache *c)
{
    if (!c)
        return;
    for (int i = 0; i < FG_GEMM_CACHE_SLOTS; i++)
        slot_free(&c->slots[i]);
    for (int w = 0; w < c->workers; w++)
        dnnl_stream_destroy(c->streams[w]);
    free(c->streams);
    dnnl_engine_destroy(c->engine);
    free(c);
}

int fg_gemm_native_bf16(const fg_gemm_cache *c) { return c->native_bf16; }

/* An f32 product that runs on f32 copies of the weight, tile by tile, at
 * tile_ld's stride: a split-K (grad_hidden) product whose blocks oneDNN runs
 * with its no-copy kernels (M < fg_gemm_fast_rows of the block's columns),
 * which read B in place, when B's rows lie a multiple of 4 KiB apart (H =
 * 1024, 2048, 4096): a column of B then falls on one cache set. Measured on
 * AVX2 (bench/block_probe.c, one thread, m = 188, n = 1024, K = 8192): 38.7
 * GFLOP/s a core in place, 70.4 at a stride of 1040; the copy reads the
 * weight once more, as the bf16 tile path's conversion does. Only where
 * oneDNN runs AVX2 kernels: AVX-512's choose by other rules, unmeasured.
 * Measured on 2 cores only: a tile's two K pieces give two blocks at a time,
 * where more cores would want more. */
static int restride_f32(const fg_gemm_cache *c, const fg_gemm_shape *s)
{
    if (!c->avx2_kernels || s->a_type != FG_DTYPE_F32 || s->b_type != FG_DTYPE_F32 ||
        s->c_type != FG_DTYPE_F32 || s->split_k <= 0 || s->b_cs != 1 || s->b_rs % 1024 != 0 ||
        s->tile_bytes == 0)
        return 0;
    const int64_t bn = s->block_n > 0 && s->block_n < s->N ? s->block_n : s->N;
    /* and only where a tile holds two K pieces: a tile's product is then two
     * blocks or more, as many as the workers here (fewer rows, from a short
     * chunk's smaller tiles, would run one block at a time where the weight
     * read in place gives 4 to share) */
    const size_t two_pieces = (size_t)2 * FG_GEMM_MIN_PIECE_K * (size_t)s->N * sizeof(float);
    return s->M < fg_gemm_fast_rows(bn) && s->tile_bytes >= two_pieces;
}

static int is_native(const fg_gemm_cache *c, const fg_gemm_shape *s)
{
    if (s->a_type != s->b_type)
        return 0;
    if (s->a_type == FG_DTYPE_BF16 || s->c_type == FG_DTYPE_BF16)
        return c->native_bf16;
    return !restride_f32(c, s);
}

/* ---------------------------------------------------------- native path */

static gemm_slot *find_slot(fg_gemm_cache *c, const fg_gemm_shape *s)
{
    for (int i = 0; i < FG_GEMM_CACHE_SLOTS; i++) {
        gemm_slot *slot = &c->slots[i];
        if (slot->prim && same_shape(&slot->shape, s)) {
            slot->last_use = ++c->clock;
            return slot;
        }
    }
    return NULL;
}

static fg_status slot_prepare(fg_gemm_cache *c, const fg_gemm_shape *s, int workers, gemm_slot **out,
                              fg_error *err)
{
    gemm_slot *slot = find_slot(c, s);
    if (!slot) { /* evict the least recently used slot */
        slot = &c->slots[0];
        for (int i = 1; i < FG_GEMM_CACHE_SLOTS; i++)
            if (c->slots[i].last_use < slot->last_use)
                slot = &c->slots[i];
        slot_free(slot);
        if (create_primitive(c, s, slot))
            return fg_fail(err, FG_ERR_BACKEND,
                           "oneDNN could not create a matmul for M=%lld N=%lld K=%lld",
                           (long long)s->M, (long long)s->N, (long long)s->K);
        slot->last_use = ++c->clock;
    }
    if (ensure_workers(c, slot, workers)) {
        slot_free(slot); /* a half-made worker set must not be found again */
        return fg_fail(err, FG_ERR_OUT_OF_MEMORY, "cannot make oneDNN memory objects and streams");
    }
    *out = slot;
    return FG_OK;
}

/* A product cut into fixed blocks of bm x bn of C, as the shape asks. The
 * blocks do not depend on the thread count, and each runs on one thread with
 * its whole K, so C's bits do not either (oneDNN's own thread split may cut K
 * and sum partial products in an order set by the thread count). Every worker
 * has its own scratchpad. Row blocks are of two kinds, full (bm rows) and
 * last (the rest); each kind has a primitive per column kind (full, last).
 *
 * With fixed_blocks (gemm_onednn.h) every block is a whole bm-row one: A's
 * rows past the last whole block are copied once into a zero-padded
 * [bm, a_rs] scratch shared by the workers, and every block writes a
 * [bm, bn] tile of C of its worker's own, at a stride of bn, whose real rows
 * are then copied to C. Every primitive call then has the same M, N (the
 * last column block's is fixed by N), K, strides and dtypes in every product
 * of these N and K, whatever M.
 *
 * With split_k (gemm_onednn.h), K may be cut into kp pieces: the first (the
 * longest, K - (kp-1)·kb) writes C as the product asks, each later one (kb
 * long) a partial [bm, bn] of its own in the shared scratch; the partials are
 * then added to C in piece order, so each element's sum runs in the same
 * order for any thread count. Blocks are numbered piece by piece:
 * t = q·tm·tn + i·tn + j. The scratch is laid out as [padded A][partials]
 * [worker 0]...[worker n-1]. */
enum { ROWS_FULL, ROWS_LAST };

typedef struct blocking {
    int64_t bm, bn, tm, tn; /* blocks: rows, columns, block rows and columns */
    int64_t kp, kb;         /* K pieces (1: whole K), a later piece's K  */
    int fixed;              /* fixed_blocks: every block bm rows, C through a tile */
    gemm_slot *slot[2][2][2]; /* [row kind][last block column][later piece]; NULL: none */
    size_t native_bytes;    /* one worker's oneDNN scratchpad, rounded   */
    size_t apad_bytes;      /* the padded A rows (fixed blocks), shared, rounded */
    size_t partial_bytes;   /* the later pieces' partials, shared, rounded */
    size_t per_worker;      /* one worker's scratch: oneDNN's + C's tile (fixed blocks) */
    int workers;            /* memory-object sets prepared: min(threads, blocks) */
} blocking;

/* The shape of a block of the given kinds; 0 when the product has none. */
static int block_shape(const fg_gemm_shape *s, const blocking *b, int kind, int last_col, int later,
                       fg_gemm_shape *u)
{
    *u = *s;
    if (later && b->kp < 2)
        return 0;
    if (b->kp > 1) { /* a later piece writes its own [bm, bn] partial */
        u->K = later ? b->kb : s->K - (b->kp - 1) * b->kb;
        if (later) {
            u->c_ld = b->bn;
            u->accumulate = 0;
            u->has_bias = 0;
        }
    }
    u->N = last_col ? s->N - (b->tn - 1) * b->bn : b->bn;
    if (b->fixed) { /* one row kind: whole blocks into a worker's tile */
        u->M = b->bm;
        u->c_ld = b->bn;
        return kind == ROWS_FULL;
    }
    if (kind == ROWS_FULL) {
        u->M = b->bm;
        return b->tm > 1;
    }
    u->M = s->M - (b->tm - 1) * b->bm;
    return b->tm > 0;
}

static fg_status blocked_prepare(fg_gemm_cache *c, const fg_gemm_shape *s, int threads, blocking *b,
                                 fg_error *err)
{
    memset(b, 0, sizeof *b);
    b->fixed = s->fixed_blocks && s->block_m > 0;
    if (b->fixed && (s->accumulate || s->split_k > 0 || s->a_cs != 1 || s->a_rs < s->K))
        return fg_fail(err, FG_ERR_BACKEND, "internal: fixed blocks take a row-major A, the "
                                            "whole K and no accumulation");
    const int split = s->split_k > 0 && s->c_type == FG_DTYPE_F32;
    b->bm = b->fixed || (s->block_m > 0 && s->block_m < s->M) ? s->block_m : s->M;
    if (split && b->bm < s->M) /* M / block_m blocks of about equal rows (>= block_m
                                  but the last, shorter by up to one row per block) */
        b->bm = (s->M + s->M / b->bm - 1) / (s->M / b->bm);
    b->bn = s->block_n > 0 && s->block_n < s->N ? s->block_n : s->N;
    b->tm = (s->M + b->bm - 1) / b->bm;
    b->tn = (s->N + b->bn - 1) / b->bn;
    b->kp = 1;
    /* Too few blocks to share: on AVX2, halve the columns first, while a
     * block's rows still take oneDNN's packed kernels (fg_gemm_fast_rows),
     * then cut K. Fewer K pieces hold fewer partials: a 410-row chunk's
     * grad_hidden at H = 2048 held 3 of [410, 2048] (10 MB), as 2 x 2 blocks
     * of 1024 columns it holds 2 of [410, 1024] (3.4 MB), room the budget's
     * chunks take (at H = 4096, 5 chunks rather than 6). One thread's block rates
     * (bench/block_probe.c) were the same within that probe's spread (73-77
     * GFLOP/s either way, two rounds). At H = 1024 the halved block (512
     * columns) would need 542 rows in every block row: unchanged. AVX-512's
     * kernel choice follows other rules, unmeasured: unchanged there. */
    if (split && c->avx2_kernels) {
        const int64_t last_rows = s->M - (b->tm - 1) * b->bm;
        const int64_t rows = last_rows < b->bm ? last_rows : b->bm;
        while (b->tm * b->tn < s->split_k && b->bn > 1) {
            const int64_t bn = (b->bn + 1) / 2, tn = (s->N + bn - 1) / bn, last = s->N - (tn - 1) * bn;
            if (rows < fg_gemm_fast_rows(last < bn ? last : bn)) /* every block still packed */
                break;
            b->bn = bn;
            b->tn = tn;
        }
    }
    if (split && b->tm * b->tn > 0 && b->tm * b->tn < s->split_k) {
        const int64_t want = (s->split_k + b->tm * b->tn - 1) / (b->tm * b->tn);
        const int64_t most = s->K / FG_GEMM_MIN_PIECE_K;
        b->kp = want < most ? want : most > 1 ? most : 1;
        b->kb = s->K / b->kp;
    }
    b->workers = threads < 1 ? 1 : threads;
    if ((int64_t)b->workers > b->tm * b->tn * b->kp)
        b->workers = (int)(b->tm * b->tn * b->kp);
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 2; j++)
            for (int q = 0; q < 2; q++) {
                fg_gemm_shape u;
                if (!block_shape(s, b, k, j, q, &u))
                    continue;
                fg_status st = slot_prepare(c, &u, b->workers, &b->slot[k][j][q], err);
                if (st != FG_OK)
                    return st;
                const size_t sb = fg_ws_round(b->slot[k][j][q]->scratch_bytes);
                b->native_bytes = sb > b->native_bytes ? sb : b->native_bytes;
            }
    /* The shapes were found or made in turn: look them up again in case a
     * later one evicted an earlier one (only with a tiny cache). */
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 2; j++)
            for (int q = 0; q < 2; q++) {
                fg_gemm_shape u;
                if (block_shape(s, b, k, j, q, &u) && find_slot(c, &u) != b->slot[k][j][q])
                    return fg_fail(err, FG_ERR_BACKEND, "internal: GEMM cache too small");
            }
    b->partial_bytes =
        fg_ws_round((size_t)((b->kp - 1) * b->tm * b->tn * b->bm * b->bn) * sizeof(float));
    if (b->fixed) {
        if (s->M % b->bm)
            b->apad_bytes = fg_ws_round((size_t)(b->bm * s->a_rs) * fg_dtype_size(s->a_type));
        b->per_worker =
            b->native_bytes + fg_ws_round((size_t)(b->bm * b->bn) * fg_dtype_size(s->c_type));
    } else {
        b->per_worker = b->native_bytes;
    }
    return FG_OK;
}

/* Copies `rows` x `cols` elements of `es` bytes; element (r, k) of src at
 * r*s_rs + k*s_cs, of dst at r*d_rs + k. */
static void copy_block(unsigned char *dst, int64_t d_rs, const unsigned char *src, int64_t s_rs,
                       int64_t s_cs, int64_t rows, int64_t cols, size_t es)
{
    for (int64_t r = 0; r < rows; r++) {
        unsigned char *d = dst + (size_t)(r * d_rs) * es;
        const unsigned char *sr = src + (size_t)(r * s_rs) * es;
        if (s_cs == 1)
            memcpy(d, sr, (size_t)cols * es);
        else
            for (int64_t k = 0; k < cols; k++)
                memcpy(d + (size_t)k * es, sr + (size_t)(k * s_cs) * es, es);
    }
}

/* Runs block t on worker w; `scratch` as blocked_prepare lays it out, the
 * padded A rows (if any) already filled. */
static int run_block(fg_gemm_cache *c, const fg_gemm_shape *s, const blocking *b,
                     int64_t t, int w, const void *A, const void *B, void *C, const void *bias,
                     unsigned char *scratch)
{
    const int64_t body = b->tm * b->tn, q = t / body;
    t -= q * body;
    /* fixed blocks run a column's blocks one after another: its weight block
     * (1008 rows x K) is then read from memory once, not once a block row */
    const int64_t i = b->fixed ? t % b->tm : t / b->tn, j = b->fixed ? t / b->tm : t % b->tn;
    const int kind = b->fixed || i < b->tm - 1 ? ROWS_FULL : ROWS_LAST;
    const gemm_slot *slot = b->slot[kind][j == b->tn - 1][q > 0];
    const size_t ea = fg_dtype_size(s->a_type), eb = fg_dtype_size(s->b_type),
                 ec = fg_dtype_size(s->c_type);
    const int64_t r0 = i * b->bm, c0 = j * b->bn, nb = slot->shape.N;
    const int64_t rows = s->M - r0 < b->bm ? s->M - r0 : b->bm;
    unsigned char *const mine =
        scratch ? scratch + b->apad_bytes + b->partial_bytes + (size_t)w * b->per_worker : NULL;
    /* Piece q's K starts after the first piece and q - 1 later ones. */
    const int64_t k0 = q > 0 ? s->K - (b->kp - q) * b->kb : 0;
    unsigned char *a = (unsigned char *)A + (size_t)(r0 * s->a_rs + k0 * s->a_cs) * ea;
    unsigned char *cc = (unsigned char *)C + (size_t)(r0 * s->c_ld + c0) * ec;
    if (q > 0)
        cc = scratch + b->apad_bytes + (size_t)(((q - 1) * body + t) * b->bm * b->bn) * sizeof(float);
    if (b->fixed) { /* a whole block: the padded copy of A's last rows, C in the tile */
        if (rows < b->bm)
            a = scratch;
        cc = mine + b->native_bytes;
    }
    void *const handle[MEM_COUNT] = {a, (unsigned char *)B + (size_t)(c0 * s->b_cs + k0 * s->b_rs) * eb, cc,
                                     bias ? (unsigned char *)bias + (size_t)c0 * eb : NULL,
                                     b->native_bytes ? mine : NULL};
    static const int arg_of[MEM_COUNT] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST,
                                          DNNL_ARG_BIAS, DNNL_ARG_SCRATCHPAD};
    dnnl_exec_arg_t args[MEM_COUNT];
    int nargs = 0;
    for (int k = 0; k < MEM_COUNT; k++) {
        dnnl_memory_t m = slot->mem[w][k];
        if (!m)
            continue;
        if (dnnl_memory_set_data_handle(m, handle[k]) != dnnl_success)
            return 1;
        args[nargs++] = (dnnl_exec_arg_t){arg_of[k], m};
    }
    if (dnnl_primitive_execute(slot->prim, c->streams[w], nargs, args) != dnnl_success ||
        dnnl_stream_wait(c->streams[w]) != dnnl_success)
        return 1;
    if (b->fixed) /* the real rows to C */
        copy_block((unsigned char *)C + (size_t)(r0 * s->c_ld + c0) * ec, s->c_ld, cc, b->bn, 1,
                   rows, nb, ec);
    return 0;
}

static fg_status native_run(fg_gemm_cache *c, const fg_gemm_shape *s, const void *A, const void *B,
                            void *C, const void *bias, void *scratch, int workers,
                            fg_gemm_stats *stats, fg_error *err)
{
    blocking b;
    fg_status st = blocked_prepare(c, s, workers, &b, err); /* cache hits unless evicted */
    if (st != FG_OK)
        return st;
    const double t0 = omp_get_wtime();
    int failed = 0;
    const int64_t blocks = b.tm * b.tn * b.kp;
    workers = workers < b.workers ? workers : b.workers;
    workers = workers < 1 ? 1 : workers;
    if (b.apad_bytes) { /* A's rows past the last whole block, zero-padded to a whole one */
        const size_t ea = fg_dtype_size(s->a_type);
        const int64_t r0 = (b.tm - 1) * b.bm;
        unsigned char *apad = scratch;
        memset(apad, 0, (size_t)(b.bm * s->a_rs) * ea);
        copy_block(apad, s->a_rs, (const unsigned char *)A + (size_t)(r0 * s->a_rs) * ea, s->a_rs,
                   1, s->M - r0, s->K, ea);
    }
#pragma omp parallel num_threads(workers) reduction(| : failed)
    {
        /* Each block is one thread's work: oneDNN reads its thread count
         * from this ICV when it runs, as when the primitive was made. */
        omp_set_num_threads(1);
        const int w = omp_get_thread_num();
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < blocks; t++)
            failed |= run_block(c, s, &b, t, w, A, B, C, bias, scratch);
    }
    /* The later pieces' partials into C, in piece order, row by row. */
    if (b.kp > 1 && !failed) {
        const float *partials = (const float *)((unsigned char *)scratch + b.apad_bytes);
#pragma omp parallel for schedule(static) num_threads(workers)
        for (int64_t r = 0; r < s->M; r++) {
            const int64_t i = r / b.bm;
            float *crow = (float *)C + (size_t)(r * s->c_ld);
            for (int64_t q = 1; q < b.kp; q++)
                for (int64_t j = 0; j < b.tn; j++) {
                    const float *p = partials +
                                     (size_t)((((q - 1) * b.tm + i) * b.tn + j) * b.bm * b.bn) +
                                     (size_t)((r - i * b.bm) * b.bn);
                    const int64_t n0 = j * b.bn, n = s->N - n0 < b.bn ? s->N - n0 : b.bn;
                    for (int64_t k = 0; k < n; k++)
                        crow[n0 + k] += p[k];
                }
        }
    }
    if (failed)
        return fg_fail(err, FG_ERR_BACKEND, "oneDNN matmul failed (M=%lld N=%lld K=%lld)",
                       (long long)s->M, (long long)s->N, (long long)s->K);
    if (stats) {
        stats->seconds += omp_get_wtime() - t0;
        stats->flops += 2 * (b.fixed ? b.tm * b.bm : s->M) * s->N * s->K; /* padded rows too */
    }
    return FG_OK;
}

/* ---------------------------------------------------------- tile path */

/* A tiled product: B's weight rows are converted to f32 `rows` at a time.
 * When B's columns are the contiguous runs (B = Wᵀ, the logits GEMM) the tile
 * runs along N; when B's rows are (B = W, the grad_hidden GEMM) along K. */
typedef struct tiling {
    int along_n;
    int64_t len, rows, tiles; /* tiled dimension, rows per tile, tile count */
    int64_t ld;               /* floats between a tile's rows (tile_ld) */
    size_t btile_bytes, ctile_bytes, bias_bytes; /* shared by the workers */
    size_t native_shared, native_per_worker; /* the tiles' blocked products */
} tiling;

/* A converted tile's row stride for rows of n floats: whole 64-byte lines,
 * an odd number of them. A stride of a power of two (n = 1024, 2048, 4096)
 * maps a column of the tile onto one cache set, and oneDNN's no-copy kernels
 * then run a grad_hidden block (C = dlogits · W, m rows < fg_gemm_fast_rows)
 * at half speed: measured on AVX2, m = 188, n = 1024, K = 8192: 38.7 GFLOP/s
 * a core at a stride of 1024 floats, 70.4 at 1040 (bench/block_probe.c).
 * The stride changes no kernel choice (nocopy_checker_avx2 reads m, n and k
 * only) and so no bits. */
static int64_t tile_ld(int64_t n)
{
    int64_t lines = (n + 15) / 16;
    lines += (lines & 1) ? 0 : 1;
    return lines * 16;
}

static fg_gemm_shape tile_shape(const fg_gemm_shape *s, const tiling *t, int64_t rows, int first)
{
    fg_gemm_shape u = *s;
    u.a_type = u.b_type = u.c_type = FG_DTYPE_F32;
    if (t->along_n) {
        u.N = rows;
        u.b_rs = 1;
        u.b_cs = t->ld;
        if (s->c_type == FG_DTYPE_BF16)
            u.c_ld = rows;
    } else {
        u.K = rows;
        u.b_rs = t->ld;
        u.b_cs = 1;
        u.accumulate = s->accumulate || !first;
        u.has_bias = s->has_bias && first;
    }
    return u;
}

static fg_status tile_plan(fg_gemm_cache *c, const fg_gemm_shape *s, int threads, tiling *t,
                           fg_error *err)
{
    if (s->a_type != FG_DTYPE_F32)
        return fg_fail(err, FG_ERR_BACKEND, "internal: the bf16 tile path needs an f32 A operand");
    memset(t, 0, sizeof *t);
    /* Fixed blocks need the whole K in every call (fg_gemm_shape.fixed_blocks):
     * their tiles are cut along N even where B's two strides tie (H = 1). */
    t->along_n = s->b_cs > s->b_rs || s->fixed_blocks;
    if (!t->along_n && s->c_type == FG_DTYPE_BF16)
        return fg_fail(err, FG_ERR_BACKEND, "internal: bf16 C needs an N-tiled product");
    const int64_t other = t->along_n ? s->K : s->N;
    t->len = t->along_n ? s->N : s->K;
    t->ld = tile_ld(other); /* rows are counted unpadded: the rows, so the blocks, do not
                               depend on the stride (and 8192 weight rows at n = 1024 stay
                               4 K pieces of 2048) */
    int64_t rows = (int64_t)(s->tile_bytes / ((size_t)other * sizeof(float)));
    rows = rows < TILE_MIN_ROWS ? TILE_MIN_ROWS : rows;
    if (t->along_n && s->block_n > 0) /* tiles of whole column blocks, at least one: a block
        then lies at the same columns, and is the same product, in every call whatever the tile
        size (the chunk's), and no tile ends in a block narrower than the product's last */
        rows = rows < s->block_n ? s->block_n : rows / s->block_n * s->block_n;
    t->rows = rows < t->len ? rows : t->len;
    t->tiles = (t->len + t->rows - 1) / t->rows;
    t->btile_bytes = fg_ws_round((size_t)t->rows * (size_t)t->ld * sizeof(float));
    if (t->along_n && s->c_type == FG_DTYPE_BF16)
        t->ctile_bytes = fg_ws_round((size_t)s->M * (size_t)t->rows * sizeof(float));
    if (s->has_bias)
        t->bias_bytes = fg_ws_round((size_t)(t->along_n ? t->rows : s->N) * sizeof(float));
    const int64_t last = t->len - (t->tiles - 1) * t->rows;
    for (int k = 0; k < 4; k++) { /* full and last tile, first and later */
        int64_t r = (k & 1) ? last : t->rows;
        blocking b;
        fg_gemm_shape u = tile_shape(s, t, r, k < 2);
        fg_status st = blocked_prepare(c, &u, threads, &b, err);
        if (st != FG_OK)
            return st;
        if (b.per_worker > t->native_per_worker)
            t->native_per_worker = b.per_worker;
        if (b.apad_bytes + b.partial_bytes > t->native_shared)
            t->native_shared = b.apad_bytes + b.partial_bytes;
    }
    return FG_OK;
}

/* dst[j * ld + i] = src row r0 + j, element i, for `rows` rows of `len`
 * elements: weight row (r0 + j) is element (i * elem_stride + (r0 + j) *
 * row_stride). */
static void convert_rows(float *dst, int64_t ld, const void *src, fg_dtype t, int64_t r0,
                         int64_t rows, int64_t len, int64_t row_stride, int64_t elem_stride, int nt)
{
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t j = 0; j < rows; j++) {
        const size_t base = (size_t)(r0 + j) * (size_t)row_stride;
        float *d = dst + (size_t)j * (size_t)ld;
        if (t == FG_DTYPE_BF16) {
            fg_bf16_to_f32_strided(d, (const uint16_t *)src + base, len, elem_stride);
        } else {
            const float *sp = (const float *)src + base;
            if (elem_stride == 1)
                memcpy(d, sp, (size_t)len * sizeof(float));
            else
                for (int64_t i = 0; i < len; i++)
                    d[i] = sp[(size_t)i * (size_t)elem_stride];
        }
    }
}

static fg_status tile_run(fg_gemm_cache *c, const fg_gemm_shape *s, const void *A, const void *B,
                          void *C, const void *bias, void *scratch, int workers,
                          fg_gemm_stats *stats, fg_error *err)
{
    tiling t;
    fg_status st = tile_plan(c, s, workers, &t, err);
    if (st != FG_OK)
        return st;
    unsigned char *sp = scratch;
    float *btile = (float *)sp;
    float *ctile = (float *)(sp + t.btile_bytes);
    float *btmp = (float *)(sp + t.btile_bytes + t.ctile_bytes);
    void *native_scratch = sp + t.btile_bytes + t.ctile_bytes + t.bias_bytes;
    const int nt = workers < 1 ? 1 : workers;
    const size_t a_es = fg_dtype_size(s->a_type), c_es = fg_dtype_size(s->c_type);
    if (!t.along_n && s->has_bias)
        convert_rows(btmp, s->N, bias, s->b_type, 0, 1, s->N, 0, 1, 1);
    for (int64_t k = 0; k < t.tiles && st == FG_OK; k++) {
        const int64_t r0 = k * t.rows, rows = t.len - r0 < t.rows ? t.len - r0 : t.rows;
        fg_gemm_shape u = tile_shape(s, &t, rows, k == 0);
        if (t.along_n) {
            /* B column n = weight row n: element (kk, n) at kk*b_rs + n*b_cs. */
            convert_rows(btile, t.ld, B, s->b_type, r0, rows, s->K, s->b_cs, s->b_rs, nt);
            if (s->has_bias)
                convert_rows(btmp, rows, (const unsigned char *)bias + (size_t)r0 * fg_dtype_size(s->b_type),
                             s->b_type, 0, 1, rows, 0, 1, 1);
            void *cdst = s->c_type == FG_DTYPE_BF16 ? (void *)ctile
                                                    : (unsigned char *)C + (size_t)r0 * c_es;
            st = native_run(c, &u, A, btile, cdst, btmp, native_scratch, workers, stats, err);
            if (st == FG_OK && s->c_type == FG_DTYPE_BF16) {
#pragma omp parallel for schedule(static) num_threads(nt)
                for (int64_t m = 0; m < s->M; m++) {
                    uint16_t *crow = (uint16_t *)C + (size_t)m * (size_t)s->c_ld + r0;
                    for (int64_t j = 0; j < rows; j++)
                        crow[j] = fg_bf16_store(ctile[(size_t)m * (size_t)rows + j]);
                }
            }
        } else {
            /* B row kk = weight row kk: element (kk, n) at kk*b_rs + n*b_cs. */
            convert_rows(btile, t.ld, B, s->b_type, r0, rows, s->N, s->b_rs, s->b_cs, nt);
            const void *a_tile = (const unsigned char *)A + (size_t)r0 * (size_t)s->a_cs * a_es;
            st = native_run(c, &u, a_tile, btile, C, btmp, native_scratch, workers, stats, err);
        }
    }
    return st;
}

/* ---------------------------------------------------------- public */

int fg_gemm_tiled(const fg_gemm_cache *c, const fg_gemm_shape *s) { return !is_native(c, s); }

int64_t fg_gemm_fast_rows(int64_t n)
{
    const double room = 0.0038 - 1.0 / (double)(n > 0 ? n : 1);
    if (room <= 0)
        return INT64_MAX;
    int64_t m = (int64_t)(1.0 / room);
    while (1.0 / (double)m + 1.0 / (double)n >= 0.0038) /* the first m past the rule */
        m++;
    return m;
}

fg_status fg_gemm_prepare(fg_gemm_cache *c, const fg_gemm_shape *s, int threads,
                          fg_gemm_scratch *need, fg_error *err)
{
    fg_gemm_scratch n = {0, 0};
    if (is_native(c, s)) {
        blocking b;
        fg_status st = blocked_prepare(c, s, threads, &b, err);
        if (st != FG_OK)
            return st;
        n.shared = b.apad_bytes + b.partial_bytes;
        n.per_worker = b.per_worker;
    } else {
        tiling t;
        fg_status st = tile_plan(c, s, threads, &t, err);
        if (st != FG_OK)
            return st;
        n.shared = t.btile_bytes + t.ctile_bytes + t.bias_bytes + t.native_shared;
        n.per_worker = t.native_per_worker;
    }
    if (need) {
        need->shared = n.shared > need->shared ? n.shared : need->shared;
        need->per_worker = n.per_worker > need->per_worker ? n.per_worker : need->per_worker;
    }
    return FG_OK;
}

size_t fg_gemm_scratch_bytes(const fg_gemm_scratch *need, int workers)
{
    return fg_ws_round(need->shared) + (size_t)(workers < 1 ? 1 : workers) * need->per_worker;
}

fg_status fg_gemm_run(fg_gemm_cache *c, const fg_gemm_shape *s, const void *A, const void *B,
                      void *C, const void *bias, void *scratch, int workers,
                      fg_gemm_stats *stats, fg_error *err)
{
    if (fg_fault_exec_hit()) /* test builds only: a product that fails mid-call */
        return fg_fail(err, FG_ERR_BACKEND, "a GEMM failed to run (injected test fault)");
    if (is_native(c, s))
        return native_run(c, s, A, B, C, bias, scratch, workers, stats, err);
    return tile_run(c, s, A, B, C, bias, scratch, workers, stats, err);
}
