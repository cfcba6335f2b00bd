/*
 * test_api: the small things of the public API. Status names, loss type and
 * level names and parsers, config, option and fg_exec defaults, bf16
 * conversions (round to nearest even, NaN stays NaN), context life cycle, the
 * refused CUDA backend, memory-stats plumbing, and the struct layout table for
 * bindings (fg_abi_sizeof / fg_abi_offsetof against sizeof / offsetof).
 */
#define _POSIX_C_SOURCE 200809L /* setenv: a failed create's message names the path */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static void test_status_names(void) {
    const char *seen[FG_STATUS_COUNT];
    for (int s = 0; s < FG_STATUS_COUNT; s++) {
        const char *n = fg_status_name((fg_status)s);
        seen[s] = n;
        CHECK(n != NULL && strncmp(n, "FG_", 3) == 0, "status %d name '%s'", s, n ? n : "(null)");
        for (int p = 0; p < s && n; p++)
            CHECK(seen[p] == NULL || strcmp(seen[p], n) != 0, "statuses %d and %d share '%s'", p,
                  s, n);
    }
    CHECK(strcmp(fg_status_name(FG_OK), "FG_OK") == 0, "FG_OK name '%s'", fg_status_name(FG_OK));
    CHECK(strcmp(fg_status_name(FG_ERR_SHAPE_MISMATCH), "FG_ERR_SHAPE_MISMATCH") == 0,
          "FG_ERR_SHAPE_MISMATCH name '%s'", fg_status_name(FG_ERR_SHAPE_MISMATCH));
    CHECK(strcmp(fg_status_name(FG_ERR_BUDGET_TOO_SMALL), "FG_ERR_BUDGET_TOO_SMALL") == 0,
          "FG_ERR_BUDGET_TOO_SMALL name '%s'", fg_status_name(FG_ERR_BUDGET_TOO_SMALL));
    CHECK(fg_status_name(FG_STATUS_COUNT) != NULL, "%s", "out-of-range status name is NULL");
    CHECK(fg_status_name((fg_status)999) != NULL, "%s", "status 999 name is NULL");
}

static void test_names(void) {
    static const char *lt_names[] = {"grpo",  "bnpo", "dr_grpo", "dapo",
                                     "luspo", "cispo", "sapo",   "vespo"};
    for (int t = 0; t < FG_LOSS_TYPE_COUNT; t++) {
        const char *n = fg_loss_type_name((fg_loss_type)t);
        CHECK(n && strcmp(n, lt_names[t]) == 0, "loss type %d name '%s' want '%s'", t,
              n ? n : "(null)", lt_names[t]);
        fg_loss_type out = (fg_loss_type)99;
        fg_status s = fg_loss_type_parse(lt_names[t], &out);
        CHECK(s == FG_OK && out == (fg_loss_type)t, "parse '%s': %s -> %d", lt_names[t],
              fg_status_name(s), (int)out);
        if (n) {
            s = fg_loss_type_parse(n, &out);
            CHECK(s == FG_OK && out == (fg_loss_type)t, "round trip '%s'", n);
        }
    }
    CHECK(fg_loss_type_name(FG_LOSS_TYPE_COUNT) == NULL, "%s", "name of FG_LOSS_TYPE_COUNT not NULL");
    CHECK(fg_loss_type_name((fg_loss_type)99) == NULL, "%s", "name of loss type 99 not NULL");
    fg_loss_type lt;
    const char *bad_lt[] = {"foo", "", "dapo ", "grpo2", "token"};
    for (size_t i = 0; i < sizeof bad_lt / sizeof bad_lt[0]; i++) {
        fg_status s = fg_loss_type_parse(bad_lt[i], &lt);
        CHECK(s == FG_ERR_UNKNOWN_LOSS_TYPE, "parse loss type '%s' -> %s", bad_lt[i],
              fg_status_name(s));
    }
    CHECK(fg_loss_type_parse(NULL, &lt) != FG_OK, "%s", "parse(NULL) accepted");

    static const char *lv_names[] = {"token", "sequence"};
    for (int l = 0; l < FG_LEVEL_COUNT; l++) {
        const char *n = fg_is_level_name((fg_is_level)l);
        CHECK(n && strcmp(n, lv_names[l]) == 0, "level %d name '%s'", l, n ? n : "(null)");
        fg_is_level out = (fg_is_level)99;
        fg_status s = fg_is_level_parse(lv_names[l], &out);
        CHECK(s == FG_OK && out == (fg_is_level)l, "parse level '%s': %s", lv_names[l],
              fg_status_name(s));
    }
    fg_is_level lv;
    const char *bad_lv[] = {"foo", "", "dapo", "tokens"};
    for (size_t i = 0; i < sizeof bad_lv / sizeof bad_lv[0]; i++) {
        fg_status s = fg_is_level_parse(bad_lv[i], &lv);
        CHECK(s == FG_ERR_UNKNOWN_LEVEL, "parse level '%s' -> %s", bad_lv[i], fg_status_name(s));
    }
    CHECK(fg_is_level_parse(NULL, &lv) != FG_OK, "%s", "level parse(NULL) accepted");
}

static void test_config_defaults(void) {
    fg_loss_config c, want;
    memset(&c, 0x5A, sizeof c);
    fg_loss_config_init(&c);
    tu_config_defaults(&want);
    CHECK(c.loss_type == FG_LOSS_DAPO, "loss_type %d", (int)c.loss_type);
    CHECK(c.importance_sampling_level == FG_LEVEL_TOKEN, "level %d", (int)c.importance_sampling_level);
    CHECK(c.temperature == 1.0, "temperature %g", c.temperature);
    CHECK(c.epsilon_low == 0.2, "epsilon_low %g", c.epsilon_low);
    CHECK(c.epsilon_high < 0, "epsilon_high %g (want the < 0 sentinel)", c.epsilon_high);
    CHECK(c.delta <= 0, "delta %g (want off)", c.delta);
    CHECK(c.beta == 0.0, "beta %g", c.beta);
    CHECK(c.max_completion_length <= 0, "max_completion_length %lld",
          (long long)c.max_completion_length);
    CHECK(c.num_items_in_batch < 0, "num_items_in_batch %g", c.num_items_in_batch);
    CHECK(c.sapo_temperature_pos == 1.0, "sapo_temperature_pos %g", c.sapo_temperature_pos);
    CHECK(c.sapo_temperature_neg == 1.05, "sapo_temperature_neg %g", c.sapo_temperature_neg);
    CHECK(c.use_bias_correction_kl == 0, "use_bias_correction_kl %d", c.use_bias_correction_kl);
    CHECK(c.entropy_coef == 0.0, "entropy_coef %g", c.entropy_coef);
    (void)want;

    fg_context_options o;
    memset(&o, 0x5A, sizeof o);
    fg_context_options_init(&o);
    CHECK(o.backend == FG_BACKEND_CPU, "backend %d", (int)o.backend);
    CHECK(o.check_finite == 1, "check_finite %d", o.check_finite);
    CHECK(o.stream == NULL, "%s", "stream not NULL");
    CHECK(o.comm.allreduce == NULL && o.comm.user == NULL, "%s", "comm not zeroed");
    CHECK(o.memory_budget == 0 || o.memory_budget == FG_DEFAULT_MEMORY_BUDGET, "memory_budget %zu",
          o.memory_budget);
}

static void test_bf16(void) {
    struct {
        uint32_t f32;
        uint16_t bf16;
    } cases[] = {
        {0x3F800000u, 0x3F80}, /* 1.0                                      */
        {0x3F808000u, 0x3F80}, /* 1 + 2^-8: exact half, tie to even (down)  */
        {0x3F818000u, 0x3F82}, /* 1 + 3*2^-8: exact half, tie to even (up)  */
        {0x3F808001u, 0x3F81}, /* just above half: up                       */
        {0x3F807FFFu, 0x3F80}, /* just below half: down                     */
        {0xC0000000u, 0xC000}, /* -2                                        */
        {0xBF818000u, 0xBF82}, /* negative tie to even                      */
        {0x00000000u, 0x0000}, /* +0                                        */
        {0x80000000u, 0x8000}, /* -0                                        */
        {0x7F800000u, 0x7F80}, /* +Inf                                      */
        {0xFF800000u, 0xFF80}, /* -Inf                                      */
        {0x7F7FFFFFu, 0x7F80}, /* FLT_MAX rounds to +Inf                     */
        {0x00018000u, 0x0002}, /* subnormal tie to even (up)                */
        {0x40490FDBu, 0x4049}, /* pi                                        */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        float f;
        memcpy(&f, &cases[i].f32, 4);
        uint16_t got = fg_f32_to_bf16(f);
        CHECK(got == cases[i].bf16, "bf16(0x%08X) = 0x%04X want 0x%04X", cases[i].f32, got,
              cases[i].bf16);
    }
    /* NaN stays NaN, including signalling patterns that truncate to Inf */
    const uint32_t nans[] = {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0x7F80FFFFu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        float f;
        memcpy(&f, &nans[i], 4);
        uint16_t b = fg_f32_to_bf16(f);
        CHECK((b & 0x7F80) == 0x7F80 && (b & 0x7F) != 0, "bf16(NaN 0x%08X) = 0x%04X not NaN",
              nans[i], b);
        CHECK(isnan(fg_bf16_to_f32(b)), "bf16 NaN 0x%04X does not widen to NaN", b);
    }
    /* every non-NaN bf16 value widens exactly and rounds back to itself */
    int bad = 0;
    for (uint32_t u = 0; u < 65536u; u++) {
        const uint16_t b = (uint16_t)u;
        const float f = fg_bf16_to_f32(b);
        uint32_t bits;
        memcpy(&bits, &f, 4);
        if ((b & 0x7F80) == 0x7F80 && (b & 0x7F)) continue;
        if (bits != (uint32_t)b << 16 || fg_f32_to_bf16(f) != b) bad++;
    }
    CHECK(bad == 0, "%d bf16 values do not round-trip", bad);
}

static void test_context(void) {
    fg_context *ctx = NULL;
    fg_status s = fg_context_create(NULL, &ctx);
    CHECK(s == FG_OK && ctx != NULL, "create(NULL opts): %s", fg_status_name(s));
    if (ctx) {
        CHECK(fg_last_error(ctx) != NULL, "%s", "last_error NULL");
        fg_memory_stats st;
        memset(&st, 0, sizeof st);
        s = fg_get_memory_stats(ctx, &st);
        /* no call has run yet: the budget a call would run with */
        CHECK(s == FG_OK && st.budget_bytes == FG_DEFAULT_MEMORY_BUDGET, "default budget %zu (%s)",
              st.budget_bytes, fg_status_name(s));
        CHECK(st.chunks == 0 && st.chunk_rows == 0 && st.gemm_flops == 0,
              "fresh context: last-call figures %lld chunks %lld rows %lld flops",
              (long long)st.chunks, (long long)st.chunk_rows, (long long)st.gemm_flops);
        CHECK(fg_context_set_check_finite(ctx, 0) == FG_OK, "%s", "set_check_finite(0)");
        CHECK(fg_context_set_check_finite(NULL, 0) == FG_ERR_NULL_ARGUMENT, "%s",
              "set_check_finite(NULL) accepted");
        CHECK(fg_get_memory_stats(ctx, NULL) != FG_OK, "%s", "get_memory_stats(ctx, NULL) ok");
        fg_reset_peak_memory(ctx);
        fg_release_workspace(ctx);
        fg_get_memory_stats(ctx, &st);
        CHECK(st.current_bytes < 4096, "current bytes %zu after release on a fresh context",
              st.current_bytes);
        fg_context_destroy(ctx);
    }
    fg_context_destroy(NULL);
    CHECK(fg_context_create(NULL, NULL) == FG_ERR_NULL_ARGUMENT, "%s", "create(NULL, NULL)");

    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = 2;
    o.memory_budget = 1 << 20;
    ctx = NULL;
    s = fg_context_create(&o, &ctx);
    CHECK(s == FG_OK && ctx, "create with options: %s", fg_status_name(s));
    if (ctx) {
        fg_memory_stats st;
        fg_get_memory_stats(ctx, &st);
        CHECK(st.budget_bytes == 1 << 20, "budget from options %zu", st.budget_bytes);
    }
    fg_context_destroy(ctx);

    fg_context_options_init(&o);
    o.backend = FG_BACKEND_CUDA;
    ctx = NULL;
    s = fg_context_create(&o, &ctx);
    /* FG_OK only where libfusedgrpo_cuda.so loads and finds a device. */
    CHECK(s == FG_ERR_UNSUPPORTED || (s == FG_OK && ctx), "CUDA backend: %s", fg_status_name(s));
    printf("test_api: a CUDA context: %s (%s)\n", fg_status_name(s), fg_context_create_error());
    CHECK((s == FG_OK) == (fg_context_create_error()[0] == '\0'),
          "a create that %s has the message \"%s\"", s == FG_OK ? "succeeded" : "failed",
          fg_context_create_error());
    if (s == FG_OK) fg_context_destroy(ctx);
    /* A failed create says why: the library's path it tried, the option. */
    {
        const char *saved = getenv("FUSEDGRPO_CUDA_LIBRARY");
        char keep[4096] = "";
        if (saved)
            snprintf(keep, sizeof keep, "%s", saved);
        setenv("FUSEDGRPO_CUDA_LIBRARY", "/nonexistent/libfusedgrpo_cuda_test.so", 1);
        ctx = NULL;
        s = fg_context_create(&o, &ctx);
        CHECK(s == FG_ERR_UNSUPPORTED && !ctx &&
                  strstr(fg_context_create_error(), "/nonexistent/libfusedgrpo_cuda_test.so"),
              "CUDA backend from a missing library: %s, \"%s\"", fg_status_name(s),
              fg_context_create_error());
        if (saved)
            setenv("FUSEDGRPO_CUDA_LIBRARY", keep, 1);
        else
            unsetenv("FUSEDGRPO_CUDA_LIBRARY");
        fg_context_options bad;
        fg_context_options_init(&bad);
        bad.threads = FG_MAX_THREADS + 1;
        s = fg_context_create(&bad, &ctx);
        CHECK(s == FG_ERR_BAD_HYPERPARAMETER && strstr(fg_context_create_error(), "FG_MAX_THREADS"),
              "threads above the cap: %s, \"%s\"", fg_status_name(s), fg_context_create_error());
        s = fg_context_create(NULL, &ctx);
        CHECK(s == FG_OK && fg_context_create_error()[0] == '\0',
              "a create after a failed one: %s, message \"%s\"", fg_status_name(s),
              fg_context_create_error());
        fg_context_destroy(ctx);
    }
    fg_context_options_init(&o);
    o.backend = FG_BACKEND_REFERENCE;
    ctx = NULL;
    s = fg_context_create(&o, &ctx);
    CHECK(s == FG_OK && ctx, "reference backend: %s", fg_status_name(s));
    fg_context_destroy(ctx);
    fg_context_options_init(&o);
    o.backend = (fg_backend)7;
    ctx = NULL;
    s = fg_context_create(&o, &ctx);
    CHECK(s != FG_OK, "backend 7: %s", fg_status_name(s));
    if (s == FG_OK) fg_context_destroy(ctx);
}

static void test_exec_defaults(void) {
    fg_exec e;
    memset(&e, 0x5A, sizeof e);
    fg_exec_init(&e);
    CHECK(e.threads == 0 && e.memory_budget == 0 && e.workspace == NULL &&
              e.workspace_bytes == 0,
          "fg_exec_init: threads %d budget %zu workspace %p bytes %zu", e.threads,
          e.memory_budget, e.workspace, e.workspace_bytes);
    fg_exec_init(NULL); /* must not crash */
}

/* fg_abi_sizeof / fg_abi_offsetof agree with the compiler's layout of the
 * header the tests are built with, and refuse names they do not know. */
static void test_abi(void) {
#define ABI_SIZE(T) CHECK(fg_abi_sizeof(#T) == sizeof(T), "sizeof %s: %zu vs %zu", #T, \
                          fg_abi_sizeof(#T), sizeof(T))
    ABI_SIZE(fg_matrix);
    ABI_SIZE(fg_vector);
    ABI_SIZE(fg_loss_config);
    ABI_SIZE(fg_batch);
    ABI_SIZE(fg_metrics);
    ABI_SIZE(fg_linear_outputs);
    ABI_SIZE(fg_logits_outputs);
    ABI_SIZE(fg_communicator);
    ABI_SIZE(fg_context_options);
    ABI_SIZE(fg_exec);
    ABI_SIZE(fg_memory_stats);
    ABI_SIZE(fg_linear_inputs);
    ABI_SIZE(fg_linear_options);
    ABI_SIZE(fg_linear_plan_info);
#undef ABI_SIZE
#define ABI_OFF(T, f) CHECK(fg_abi_offsetof(#T, #f) == (int64_t)offsetof(T, f), \
                            "offsetof %s.%s: %lld vs %zu", #T, #f,             \
                            (long long)fg_abi_offsetof(#T, #f), offsetof(T, f))
    /* the first field, a middle one and the last one of the structs that
     * cross the API by value or are written by the library */
    ABI_OFF(fg_linear_outputs, loss);
    ABI_OFF(fg_linear_outputs, metrics);
    ABI_OFF(fg_linear_outputs, grad_weight);
    ABI_OFF(fg_linear_outputs, grad_bias);
    ABI_OFF(fg_logits_outputs, entropy);
    ABI_OFF(fg_logits_outputs, grad_logits);
    ABI_OFF(fg_exec, threads);
    ABI_OFF(fg_exec, memory_budget);
    ABI_OFF(fg_exec, workspace);
    ABI_OFF(fg_exec, workspace_bytes);
    ABI_OFF(fg_memory_stats, budget_bytes);
    ABI_OFF(fg_memory_stats, call_seconds);
    ABI_OFF(fg_batch, is_ratio_per_sequence);
    ABI_OFF(fg_loss_config, entropy_coef);
    ABI_OFF(fg_context_options, comm);
    ABI_OFF(fg_linear_inputs, vocab_total);
    ABI_OFF(fg_linear_plan_info, min_budget_bytes);
    ABI_OFF(fg_matrix, ld);
#undef ABI_OFF
    CHECK(fg_abi_sizeof("fg_outputs") == 0, "%s", "the old fg_outputs still has a size");
    CHECK(fg_abi_sizeof("no_such_struct") == 0, "%s", "unknown struct has a size");
    CHECK(fg_abi_sizeof(NULL) == 0, "%s", "NULL struct name has a size");
    CHECK(fg_abi_offsetof("fg_exec", "no_such_field") == -1, "%s", "unknown field has an offset");
    CHECK(fg_abi_offsetof("no_such_struct", "threads") == -1, "%s",
          "unknown struct has an offset");
    CHECK(fg_abi_offsetof("fg_linear_outputs", "grad_logits") == -1, "%s",
          "fg_linear_outputs.grad_logits has an offset");
    CHECK(fg_abi_offsetof("fg_linear_outputs", "kl") == -1, "%s",
          "a nested field (metrics.kl) is named");
    CHECK(fg_abi_offsetof(NULL, "loss") == -1 && fg_abi_offsetof("fg_exec", NULL) == -1, "%s",
          "NULL names have an offset");
}

static void test_views(void) {
    float buf[12];
    fg_matrix m = fg_matrix_make(buf, FG_DTYPE_F32, 3, 4);
    CHECK(m.data == buf && m.rows == 3 && m.cols == 4 && m.ld == 4 && m.dtype == FG_DTYPE_F32,
          "matrix_make %lld %lld %lld", (long long)m.rows, (long long)m.cols, (long long)m.ld);
    fg_vector v = fg_vector_make(buf, FG_DTYPE_BF16, 5);
    CHECK(v.data == buf && v.len == 5 && v.dtype == FG_DTYPE_BF16, "vector_make %lld",
          (long long)v.len);
}

int main(void) {
    test_status_names();
    test_names();
    test_config_defaults();
    test_bf16();
    test_context();
    test_exec_defaults();
    test_abi();
    test_views();
    return tu_finish();
}
