/* oneDNN matmul wrapper with a small primitive cache (see gemm_onednn.h). */
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "gemm_onednn.h"

typedef struct gemm_slot {
    fg_gemm_shape shape;
    int threads;
    dnnl_primitive_t prim;
    dnnl_memory_desc_t a_md, b_md, c_md, bias_md;
    size_t scratch_bytes;
    dnnl_memory_desc_t scratch_md;
    uint64_t last_use;
} gemm_slot;

struct fg_gemm_cache {
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    gemm_slot slots[FG_GEMM_CACHE_SLOTS];
    uint64_t clock;
};

static dnnl_data_type_t dt(fg_dtype t) { return t == FG_DTYPE_BF16 ? dnnl_bf16 : dnnl_f32; }

fg_status fg_gemm_cache_create(fg_context *ctx)
{
    struct fg_gemm_cache *c = calloc(1, sizeof *c);
    if (!c)
        return FG_ERR_OUT_OF_MEMORY;
    if (dnnl_engine_create(&c->engine, dnnl_cpu, 0) != dnnl_success) {
        free(c);
        return FG_ERR_BACKEND;
    }
    if (dnnl_stream_create(&c->stream, c->engine, dnnl_stream_default_flags) != dnnl_success) {
        dnnl_engine_destroy(c->engine);
        free(c);
        return FG_ERR_BACKEND;
    }
    ctx->gemm = c;
    return FG_OK;
}

void fg_gemm_cache_destroy(fg_context *ctx)
{
    struct fg_gemm_cache *c = ctx->gemm;
    if (!c)
        return;
    for (int i = 0; i < FG_GEMM_CACHE_SLOTS; i++)
        if (c->slots[i].prim)
            dnnl_primitive_destroy(c->slots[i].prim);
    dnnl_stream_destroy(c->stream);
    dnnl_engine_destroy(c->engine);
    free(c);
    ctx->gemm = NULL;
}

static int same_shape(const fg_gemm_shape *a, const fg_gemm_shape *b)
{
    return a->M == b->M && a->N == b->N && a->K == b->K && a->ab_type == b->ab_type &&
           a->c_type == b->c_type && a->a_rs == b->a_rs && a->a_cs == b->a_cs &&
           a->b_rs == b->b_rs && a->b_cs == b->b_cs && a->c_ld == b->c_ld &&
           a->accumulate == b->accumulate && a->has_bias == b->has_bias;
}

static fg_status create_slot(fg_context *ctx, const fg_gemm_shape *s, gemm_slot *slot)
{
    struct fg_gemm_cache *c = ctx->gemm;
    dnnl_dims_t a_dims = {s->M, s->K}, a_str = {s->a_rs, s->a_cs};
    dnnl_dims_t b_dims = {s->K, s->N}, b_str = {s->b_rs, s->b_cs};
    dnnl_dims_t c_dims = {s->M, s->N}, c_str = {s->c_ld, 1};
    dnnl_dims_t bias_dims = {1, s->N}, bias_str = {s->N, 1};
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_matmul_desc_t md;
    fg_status st = FG_ERR_BACKEND;

    if (dnnl_memory_desc_init_by_strides(&slot->a_md, 2, a_dims, dt(s->ab_type), a_str) ||
        dnnl_memory_desc_init_by_strides(&slot->b_md, 2, b_dims, dt(s->ab_type), b_str) ||
        dnnl_memory_desc_init_by_strides(&slot->c_md, 2, c_dims, dt(s->c_type), c_str) ||
        dnnl_memory_desc_init_by_strides(&slot->bias_md, 2, bias_dims, dt(s->ab_type), bias_str))
        goto done;
    if (dnnl_matmul_desc_init(&md, &slot->a_md, &slot->b_md, s->has_bias ? &slot->bias_md : NULL,
                              &slot->c_md))
        goto done;
    if (dnnl_primitive_attr_create(&attr) ||
        dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user))
        goto done;
    if (s->accumulate) {
        if (dnnl_post_ops_create(&po) || dnnl_post_ops_append_sum(po, 1.0f) ||
            dnnl_primitive_attr_set_post_ops(attr, po))
            goto done;
    }
    if (dnnl_primitive_desc_create(&pd, &md, attr, c->engine, NULL))
        goto done;
    const dnnl_memory_desc_t *sp = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    slot->scratch_bytes = sp ? dnnl_memory_desc_get_size(sp) : 0;
    if (sp)
        slot->scratch_md = *sp;
    if (dnnl_primitive_create(&slot->prim, pd))
        goto done;
    slot->shape = *s;
    slot->threads = fg_threads(ctx);
    st = FG_OK;
done:
    if (pd)
        dnnl_primitive_desc_destroy(pd);
    if (po)
        dnnl_post_ops_destroy(po);
    if (attr)
        dnnl_primitive_attr_destroy(attr);
    if (st != FG_OK)
        slot->prim = NULL;
    return st;
}

static gemm_slot *find_slot(fg_context *ctx, const fg_gemm_shape *s)
{
    struct fg_gemm_cache *c = ctx->gemm;
    const int threads = fg_threads(ctx);
    for (int i = 0; i < FG_GEMM_CACHE_SLOTS; i++) {
        gemm_slot *slot = &c->slots[i];
        if (slot->prim && slot->threads == threads && same_shape(&slot->shape, s)) {
            slot->last_use = ++c->clock;
            return slot;
        }
    }
    return NULL;
}

fg_status fg_gemm_prepare(fg_context *ctx, const fg_gemm_shape *s, size_t *scratch_bytes)
{
    struct fg_gemm_cache *c = ctx->gemm;
    gemm_slot *slot = find_slot(ctx, s);
    if (!slot) {
        /* Evict the least recently used slot. */
        slot = &c->slots[0];
        for (int i = 1; i < FG_GEMM_CACHE_SLOTS; i++)
            if (c->slots[i].last_use < slot->last_use)
                slot = &c->slots[i];
        if (slot->prim)
            dnnl_primitive_destroy(slot->prim);
        memset(slot, 0, sizeof *slot);
        if (create_slot(ctx, s, slot) != FG_OK)
            return fg_fail(ctx, FG_ERR_BACKEND,
                           "oneDNN could not create a matmul for M=%lld N=%lld K=%lld (%s)",
                           (long long)s->M, (long long)s->N, (long long)s->K,
                           s->ab_type == FG_DTYPE_BF16 ? "bf16" : "f32");
        slot->last_use = ++c->clock;
    }
    if (scratch_bytes)
        *scratch_bytes = slot->scratch_bytes;
    return FG_OK;
}

fg_status fg_gemm_run(fg_context *ctx, const fg_gemm_shape *s, const void *A, const void *B,
                      void *C, const void *bias, void *scratch)
{
    struct fg_gemm_cache *c = ctx->gemm;
    gemm_slot *slot = find_slot(ctx, s);
    if (!slot) { /* evicted since prepare: prepare again (no scratch growth: same shape) */
        fg_status st = fg_gemm_prepare(ctx, s, NULL);
        if (st != FG_OK)
            return st;
        slot = find_slot(ctx, s);
    }
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL, mbias = NULL, msp = NULL;
    fg_status st = FG_ERR_BACKEND;
    if (dnnl_memory_create(&ma, &slot->a_md, c->engine, (void *)A) ||
        dnnl_memory_create(&mb, &slot->b_md, c->engine, (void *)B) ||
        dnnl_memory_create(&mc, &slot->c_md, c->engine, C))
        goto done;
    dnnl_exec_arg_t args[5];
    int nargs = 0;
    args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_SRC, ma};
    args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_WEIGHTS, mb};
    args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_DST, mc};
    if (s->has_bias) {
        if (dnnl_memory_create(&mbias, &slot->bias_md, c->engine, (void *)bias))
            goto done;
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, mbias};
    }
    if (slot->scratch_bytes) {
        if (dnnl_memory_create(&msp, &slot->scratch_md, c->engine, scratch))
            goto done;
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, msp};
    }
    if (dnnl_primitive_execute(slot->prim, c->stream, nargs, args) || dnnl_stream_wait(c->stream))
        goto done;
    ctx->last_gemm_flops += 2 * s->M * s->N * s->K;
    st = FG_OK;
done:
    if (ma) dnnl_memory_destroy(ma);
    if (mb) dnnl_memory_destroy(mb);
    if (mc) dnnl_memory_destroy(mc);
    if (mbias) dnnl_memory_destroy(mbias);
    if (msp) dnnl_memory_destroy(msp);
    if (st != FG_OK)
        return fg_fail(ctx, FG_ERR_BACKEND, "oneDNN matmul failed (M=%lld N=%lld K=%lld)",
                       (long long)s->M, (long long)s->N, (long long)s->K);
    return FG_OK;
}
