/* Struct layouts for foreign-function bindings (fg_abi_sizeof and
 * fg_abi_offsetof in fusedgrpo.h). The Python package restates the public
 * structs with ctypes; it compares every field's offset and every struct's
 * size against this table when it loads and refuses to run on a mismatch.
 * Each struct lists its fields once, here, in declaration order. */
#include <stddef.h>
#include <string.h>

#include "fusedgrpo.h"

#define FIELDS_fg_matrix(X, T) X(T, data) X(T, dtype) X(T, rows) X(T, cols) X(T, ld)
#define FIELDS_fg_vector(X, T) X(T, data) X(T, dtype) X(T, len)
#define FIELDS_fg_loss_config(X, T)                                                                \
    X(T, loss_type) X(T, importance_sampling_level) X(T, temperature) X(T, epsilon_low)           \
    X(T, epsilon_high) X(T, delta) X(T, beta) X(T, max_completion_length)                         \
    X(T, num_items_in_batch) X(T, sapo_temperature_pos) X(T, sapo_temperature_neg)                \
    X(T, use_bias_correction_kl) X(T, entropy_coef) X(T, vespo_k_pos) X(T, vespo_lambda_pos)      \
    X(T, vespo_k_neg) X(T, vespo_lambda_neg) X(T, off_policy_mask_threshold)                      \
    X(T, top_entropy_quantile)
#define FIELDS_fg_batch(X, T)                                                                      \
    X(T, batch) X(T, seq_len) X(T, token_ids) X(T, mask) X(T, advantages) X(T, old_logp)          \
    X(T, ref_logp) X(T, is_ratio) X(T, is_ratio_per_sequence) X(T, sampling_logp)
#define FIELDS_fg_metrics(X, T)                                                                    \
    X(T, kl) X(T, entropy) X(T, clip_ratio_low) X(T, clip_ratio_high) X(T, clip_ratio_region)     \
    X(T, cispo_clip_ratio) X(T, clip_ratio_low_min) X(T, clip_ratio_high_max)                     \
    X(T, vespo_phi_seq_mean) X(T, policy_loss)
#define FIELDS_fg_linear_outputs(X, T)                                                             \
    X(T, loss) X(T, metrics) X(T, logp) X(T, entropy) X(T, grad_hidden) X(T, grad_weight)         \
    X(T, grad_bias) X(T, accumulate)
#define FIELDS_fg_logits_outputs(X, T)                                                             \
    X(T, loss) X(T, metrics) X(T, logp) X(T, entropy) X(T, grad_logits)
#define FIELDS_fg_communicator(X, T) X(T, allreduce) X(T, user)
#define FIELDS_fg_context_options(X, T)                                                            \
    X(T, backend) X(T, threads) X(T, memory_budget) X(T, check_finite) X(T, stream) X(T, comm)
#define FIELDS_fg_exec(X, T)                                                                       \
    X(T, threads) X(T, memory_budget) X(T, workspace) X(T, workspace_bytes) X(T, device_report)
#define FIELDS_fg_memory_stats(X, T)                                                               \
    X(T, current_bytes) X(T, peak_bytes) X(T, budget_bytes) X(T, chunk_rows) X(T, chunks)         \
    X(T, gemm_flops) X(T, gemm_seconds) X(T, call_seconds) X(T, dlogits_entries) X(T, dlogits_kept)
#define FIELDS_fg_linear_inputs(X, T)                                                              \
    X(T, hidden) X(T, weight) X(T, bias) X(T, vocab_start) X(T, vocab_total)
#define FIELDS_fg_linear_options(X, T) X(T, impl) X(T, round_logits_to_input_dtype) X(T, filter_eps)
#define FIELDS_fg_linear_plan_info(X, T)                                                           \
    X(T, chunk_rows) X(T, chunks) X(T, working_bytes) X(T, fixed_bytes) X(T, chunk_bytes)         \
    X(T, gemm_scratch_bytes) X(T, min_budget_bytes) X(T, gemm_dtype) X(T, later_chunk_rows)     \
    X(T, grad_weight_sum_bytes)

#define FIELDS_fg_tokens(X, T) X(T, batch) X(T, seq_len) X(T, token_ids) X(T, mask)
#define FIELDS_fg_linear_grads(X, T)                                                               \
    X(T, grad_hidden) X(T, grad_weight) X(T, grad_bias) X(T, accumulate)

#define FIELDS_fg_logp_outputs(X, T) X(T, loss) X(T, metrics) X(T, grad_logp) X(T, grad_entropy)
#define FIELDS_fg_device_report(X, T)                                                              \
    X(T, failed) X(T, seq_len) X(T, vocab) X(T, value) X(T, loss) X(T, metrics) X(T, dlogits_kept)

#define STRUCTS(S)                                                                                 \
    S(fg_matrix) S(fg_vector) S(fg_loss_config) S(fg_batch) S(fg_metrics) S(fg_linear_outputs)    \
    S(fg_logits_outputs) S(fg_communicator) S(fg_context_options) S(fg_exec) S(fg_memory_stats)   \
    S(fg_linear_inputs) S(fg_linear_options) S(fg_linear_plan_info) S(fg_tokens)                  \
    S(fg_linear_grads) S(fg_logp_outputs) S(fg_device_report)

typedef struct abi_field {
    const char *type, *field;
    size_t offset;
} abi_field;

#define FIELD_ROW(T, f) {#T, #f, offsetof(T, f)},
#define STRUCT_FIELDS(T) FIELDS_##T(FIELD_ROW, T)
static const abi_field abi_fields[] = {STRUCTS(STRUCT_FIELDS)};

#define SIZE_ROW(T) {#T, sizeof(T)},
static const struct {
    const char *name;
    size_t size;
} abi_sizes[] = {STRUCTS(SIZE_ROW)};

size_t fg_abi_sizeof(const char *type_name)
{
    if (!type_name)
        return 0;
    for (size_t i = 0; i < sizeof abi_sizes / sizeof abi_sizes[0]; i++)
        if (strcmp(abi_sizes[i].name, type_name) == 0)
            return abi_sizes[i].size;
    return 0;
}

int64_t fg_abi_offsetof(const char *type_name, const char *field_name)
{
    if (!type_name || !field_name)
        return -1;
    for (size_t i = 0; i < sizeof abi_fields / sizeof abi_fields[0]; i++)
        if (strcmp(abi_fields[i].type, type_name) == 0 &&
            strcmp(abi_fields[i].field, field_name) == 0)
            return (int64_t)abi_fields[i].offset;
    return -1;
}
