// XLA FFI handler (CPU) for fusedgrpo: a thin C++ shim over the C library.
//
// Built with the Python package (python/jax_ffi.cmake, when jax is present at
// build time) against the headers of jax.ffi.include_dir() and
// include/fusedgrpo.h into fusedgrpo/libfusedgrpo_jax_ffi.so, linked to the
// package's libfusedgrpo.so.0 ($ORIGIN rpath). fusedgrpo/jax.py loads it and
// registers it as the custom-call target "fusedgrpo_linear_grpo" (api_version 4
// / typed FFI).
//
// Operands (optional ones are zero-sized when absent):
//   hidden [B,T,H] f32|bf16, weight [V,H] (same dtype), bias [V] | [0],
//   token_ids [B,T] s32|s64, mask [B,T] u8|pred, advantages [B] f32,
//   old_logp [B,T] | [0], ref_logp [B,T] | [0], is_ratio [B,T] | [B] | [0] f32,
//   scalars f32[2] = (num_items_in_batch (< 0: default), entropy_coef)
//     (runtime values, so the sharded wrapper can feed global normalizers)
// Results (f32): loss [], metrics [10] (METRIC_NAMES), logp [B,T], entropy [B,T],
//   grad_hidden [B,T,H] | [0], grad_weight [V,H] | [0], grad_bias [V] | [0]: f32, or
//   bf16 for bf16 inputs (grad_weight where the CPU has bf16 GEMM kernels).
//   shard s32[2] = (vocab rank, group id) (runtime: lax.axis_index under shard_map)
// Attributes: loss_type, level, impl (strings); beta, epsilon_low, epsilon_high,
//   delta, temperature, sapo_temperature_pos, sapo_temperature_neg (f64);
//   max_completion_length, use_bias_correction_kl, threads, memory_budget,
//   vocab_shards, vocab_total (s64); filter_eps (f64: fg_linear_options.filter_eps,
//   -1 auto). threads (<= 0: OpenMP's default) and
//   memory_budget (bytes, 0: the library's default) go into the call's fg_exec.
//
// Vocab sharding (vocab_shards > 1): weight holds rows [rank*V, rank*V + V) of
// vocab_total; the library's communicator hook is served in-process: the
// vocab_shards calls of one group (XLA runs one per host device, on its own
// thread) meet at a barrier and every rank reduces all ranks' buffers in rank
// order (identical bits everywhere). A barrier that waits longer than
// $FUSEDGRPO_COMM_TIMEOUT seconds (default 300) fails the call instead of hanging.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fusedgrpo.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ------------------------------------------------------------ in-process comm

struct Group {
    std::mutex mu;
    std::condition_variable cv;
    int size = 0;
    int arrived = 0;
    uint64_t generation = 0;
    bool broken = false;
    std::vector<float *> bufs;
    std::vector<int64_t> counts;
};

std::mutex g_groups_mu;
std::map<std::pair<int64_t, int>, Group *> g_groups;  // (group id, size) -> group

Group *GetGroup(int64_t id, int size) {
    std::lock_guard<std::mutex> lock(g_groups_mu);
    Group *&g = g_groups[{id, size}];
    if (!g) {
        g = new Group();  // lives as long as the process
        g->size = size;
        g->bufs.assign(size, nullptr);
        g->counts.assign(size, 0);
    }
    return g;
}

double CommTimeout() {
    const char *e = std::getenv("FUSEDGRPO_COMM_TIMEOUT");
    double t = e ? std::atof(e) : 0.0;
    return t > 0 ? t : 300.0;
}

// Generation barrier; false on timeout (the group is then marked broken).
bool Barrier(Group *g) {
    std::unique_lock<std::mutex> lock(g->mu);
    if (g->broken)
        return false;
    const uint64_t gen = g->generation;
    if (++g->arrived == g->size) {
        g->arrived = 0;
        g->generation++;
        g->cv.notify_all();
        return true;
    }
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::milliseconds((int64_t)(CommTimeout() * 1000));
    while (g->generation == gen && !g->broken) {
        if (g->cv.wait_until(lock, deadline) == std::cv_status::timeout && g->generation == gen) {
            g->broken = true;
            g->cv.notify_all();
            return false;
        }
    }
    return !g->broken;
}

struct CommSlot {
    Group *group = nullptr;
    int rank = 0;
};

int InProcessAllreduce(void *user, float *buf, int64_t count, fg_reduce_op op) {
    CommSlot *slot = static_cast<CommSlot *>(user);
    Group *g = slot->group;
    if (!g)
        return 1;
    g->bufs[slot->rank] = buf;
    g->counts[slot->rank] = count;
    if (!Barrier(g))
        return 1;
    int bad = 0;
    for (int r = 0; r < g->size; r++)
        bad |= g->counts[r] != count;
    std::vector<float> tmp(bad ? 0 : (size_t)count);
    if (!bad)
        for (int64_t i = 0; i < count; i++) {
            float acc = g->bufs[0][i];
            for (int r = 1; r < g->size; r++) {
                float v = g->bufs[r][i];
                acc = op == FG_REDUCE_MAX ? (v > acc ? v : acc) : acc + v;
            }
            tmp[i] = acc;
        }
    if (!Barrier(g))  // everyone has read everyone
        return 1;
    if (!bad)
        std::memcpy(buf, tmp.data(), (size_t)count * sizeof(float));
    if (!Barrier(g))  // nobody reuses bufs[] before all have copied
        return 1;
    return bad;
}

// ------------------------------------------------------------ call totals

std::mutex g_totals_mutex;
double g_totals[3];

void AddCallTotals(double call_seconds, double gemm_seconds) {
    std::lock_guard<std::mutex> lock(g_totals_mutex);
    g_totals[0] += 1;
    g_totals[1] += call_seconds;
    g_totals[2] += gemm_seconds;
}

// ------------------------------------------------------------ context pool

// XLA may run the custom call on several threads at once (one per host
// device); a context serves one at a time, so calls take one from a pool and
// put it back. Threads and budget are per call (fg_exec), so the only split is
// whether the context carries the in-process communicator: a sharded context
// owns the CommSlot its communicator points to.
struct PoolEntry {
    fg_context *ctx = nullptr;
    CommSlot *slot = nullptr;
};
std::mutex g_pool_mu;
std::vector<PoolEntry> g_pool[2];  // [sharded]

struct PooledContext {
    bool sharded;
    PoolEntry e;
    fg_status status = FG_OK;
    explicit PooledContext(bool is_sharded) : sharded(is_sharded) {
        {
            std::lock_guard<std::mutex> lock(g_pool_mu);
            auto &v = g_pool[sharded];
            if (!v.empty()) {
                e = v.back();
                v.pop_back();
                return;
            }
        }
        fg_context_options o;
        fg_context_options_init(&o);
        if (sharded) {
            e.slot = new CommSlot();
            o.comm.allreduce = InProcessAllreduce;
            o.comm.user = e.slot;
        }
        status = fg_context_create(&o, &e.ctx);
    }
    ~PooledContext() {
        if (!e.ctx)
            return;
        if (e.slot)
            e.slot->group = nullptr;
        std::lock_guard<std::mutex> lock(g_pool_mu);
        g_pool[sharded].push_back(e);
    }
};

ffi::Error Fail(fg_status st, const std::string &msg) {
    std::string s = msg;
    const char *name = fg_status_name(st);
    if (s.rfind(name, 0) != 0)
        s = std::string(name) + ": " + s;
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "fusedgrpo: " + s);
}

const float *OptF32(const ffi::AnyBuffer &b) {
    return b.element_count() ? static_cast<const float *>(b.untyped_data()) : nullptr;
}

ffi::Error LinearGrpoImpl(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                          ffi::AnyBuffer token_ids, ffi::AnyBuffer mask,
                          ffi::AnyBuffer advantages, ffi::AnyBuffer old_logp,
                          ffi::AnyBuffer ref_logp, ffi::AnyBuffer is_ratio,
                          ffi::AnyBuffer scalars, ffi::AnyBuffer shard,
                          ffi::Result<ffi::AnyBuffer> loss,
                          ffi::Result<ffi::AnyBuffer> metrics, ffi::Result<ffi::AnyBuffer> logp,
                          ffi::Result<ffi::AnyBuffer> entropy,
                          ffi::Result<ffi::AnyBuffer> grad_hidden,
                          ffi::Result<ffi::AnyBuffer> grad_weight,
                          ffi::Result<ffi::AnyBuffer> grad_bias, std::string_view loss_type,
                          std::string_view level, std::string_view impl, double beta,
                          double epsilon_low, double epsilon_high, double delta,
                          double temperature, double sapo_temperature_pos,
                          double sapo_temperature_neg, int64_t max_completion_length,
                          int64_t use_bias_correction_kl, int64_t threads,
                          int64_t memory_budget, int64_t vocab_shards,
                          int64_t vocab_total, double filter_eps) {
    auto hd = hidden.dimensions();
    auto wd = weight.dimensions();
    if (hd.size() != 3 || wd.size() != 2)
        return Fail(FG_ERR_SHAPE_MISMATCH, "hidden must be [B,T,H] and weight [V,H]");
    const int64_t B = hd[0], T = hd[1], H = hd[2], V = wd[0];
    fg_dtype dt;
    if (hidden.element_type() == ffi::DataType::F32)
        dt = FG_DTYPE_F32;
    else if (hidden.element_type() == ffi::DataType::BF16)
        dt = FG_DTYPE_BF16;
    else
        return Fail(FG_ERR_UNSUPPORTED, "hidden must be float32 or bfloat16");
    if (weight.element_type() != hidden.element_type() ||
        (bias.element_count() && bias.element_type() != hidden.element_type()))
        return Fail(FG_ERR_SHAPE_MISMATCH, "hidden, weight and bias must share one dtype");
    if (scalars.element_type() != ffi::DataType::F32 || scalars.element_count() != 2)
        return Fail(FG_ERR_SHAPE_MISMATCH, "scalars must be f32[2]");
    const int64_t N = B * T;
    if ((int64_t)token_ids.element_count() != N || (int64_t)mask.element_count() != N ||
        (int64_t)advantages.element_count() != B)
        return Fail(FG_ERR_SHAPE_MISMATCH, "token_ids/mask must be [B,T] and advantages [B]");
    if (advantages.element_type() != ffi::DataType::F32)
        return Fail(FG_ERR_SHAPE_MISMATCH, "advantages must be float32");

    // token ids: int64 for the C API
    std::vector<int64_t> tok64;
    const int64_t *tok = nullptr;
    if (token_ids.element_type() == ffi::DataType::S64) {
        tok = static_cast<const int64_t *>(token_ids.untyped_data());
    } else if (token_ids.element_type() == ffi::DataType::S32) {
        const int32_t *src = static_cast<const int32_t *>(token_ids.untyped_data());
        tok64.assign(src, src + N);
        tok = tok64.data();
    } else {
        return Fail(FG_ERR_SHAPE_MISMATCH, "token_ids must be int32 or int64");
    }
    if (mask.element_type() != ffi::DataType::U8 && mask.element_type() != ffi::DataType::PRED &&
        mask.element_type() != ffi::DataType::S8)
        return Fail(FG_ERR_SHAPE_MISMATCH, "mask must be uint8 or bool");

    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    std::string lt(loss_type), lv(level), im(impl);
    if (fg_loss_type_parse(lt.c_str(), &cfg.loss_type) != FG_OK)
        return Fail(FG_ERR_UNKNOWN_LOSS_TYPE, "unknown loss_type '" + lt + "'");
    if (fg_is_level_parse(lv.c_str(), &cfg.importance_sampling_level) != FG_OK)
        return Fail(FG_ERR_UNKNOWN_LEVEL, "unknown importance_sampling_level '" + lv + "'");
    const float *sc = static_cast<const float *>(scalars.untyped_data());
    cfg.temperature = temperature;
    cfg.epsilon_low = epsilon_low;
    cfg.epsilon_high = epsilon_high;
    cfg.delta = delta;
    cfg.beta = beta;
    cfg.max_completion_length = max_completion_length;
    cfg.num_items_in_batch = sc[0];
    cfg.sapo_temperature_pos = sapo_temperature_pos;
    cfg.sapo_temperature_neg = sapo_temperature_neg;
    cfg.use_bias_correction_kl = use_bias_correction_kl != 0;
    cfg.entropy_coef = sc[1];

    fg_linear_options lo = {FG_IMPL_FUSED, 0, filter_eps};
    if (im == "materialized")
        lo.impl = FG_IMPL_MATERIALIZED;
    else if (im != "fused")
        return Fail(FG_ERR_UNSUPPORTED, "unknown impl '" + im + "'");

    fg_linear_inputs in;
    std::memset(&in, 0, sizeof in);
    in.hidden = fg_matrix_make(hidden.untyped_data(), dt, N, H);
    in.weight = fg_matrix_make(weight.untyped_data(), dt, V, H);
    in.bias = fg_vector_make(bias.element_count() ? bias.untyped_data() : nullptr, dt, V);
    int rank = 0;
    int64_t group_id = 0;
    const bool sharded = vocab_shards > 1;
    if (sharded) {
        if (shard.element_type() != ffi::DataType::S32 || shard.element_count() != 2)
            return Fail(FG_ERR_SHAPE_MISMATCH, "shard must be s32[2] (rank, group)");
        const int32_t *sh = static_cast<const int32_t *>(shard.untyped_data());
        rank = sh[0];
        group_id = sh[1];
        if (rank < 0 || rank >= vocab_shards || vocab_total != vocab_shards * V)
            return Fail(FG_ERR_SHAPE_MISMATCH, "vocab shard rank / sizes are inconsistent");
        in.vocab_start = (int64_t)rank * V;
        in.vocab_total = vocab_total;
    }

    fg_batch bt;
    std::memset(&bt, 0, sizeof bt);
    bt.batch = B;
    bt.seq_len = T;
    bt.token_ids = tok;
    bt.mask = static_cast<const uint8_t *>(mask.untyped_data());
    bt.advantages = static_cast<const float *>(advantages.untyped_data());
    bt.old_logp = OptF32(old_logp);
    bt.ref_logp = OptF32(ref_logp);
    bt.is_ratio = OptF32(is_ratio);
    bt.is_ratio_per_sequence = is_ratio.element_count() && (int64_t)is_ratio.element_count() == B &&
                               !((int64_t)is_ratio.element_count() == N);

    fg_linear_outputs out;
    std::memset(&out, 0, sizeof out);
    out.logp = static_cast<float *>(logp->untyped_data());
    out.entropy = static_cast<float *>(entropy->untyped_data());
    // The gradients in the dtype JAX allocated them in: bf16 for bf16 inputs
    // (fusedgrpo.h: no float32 copy to allocate and cast), else f32.
    auto gdt = [](ffi::Result<ffi::AnyBuffer> &b) {
        return b->element_type() == ffi::DataType::BF16 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    };
    if (grad_hidden->element_count())
        out.grad_hidden = fg_matrix_make(grad_hidden->untyped_data(), gdt(grad_hidden), N, H);
    if (grad_weight->element_count())
        out.grad_weight = fg_matrix_make(grad_weight->untyped_data(), gdt(grad_weight), V, H);
    if (grad_bias->element_count())
        out.grad_bias = fg_vector_make(grad_bias->untyped_data(), gdt(grad_bias), V);

    if (memory_budget < 0)
        return Fail(FG_ERR_INVALID_SIZE, "memory_budget must be >= 0 bytes (0: the default)");
    fg_exec exec;
    fg_exec_init(&exec);
    exec.threads = (int)threads;
    exec.memory_budget = (size_t)memory_budget;

    PooledContext pc(sharded);
    if (pc.status != FG_OK || !pc.e.ctx)
        return Fail(pc.status, "fg_context_create failed");
    if (sharded) {
        pc.e.slot->group = GetGroup(group_id, (int)vocab_shards);
        pc.e.slot->rank = rank;
    }
    fg_status st = fg_linear_grpo(pc.e.ctx, &lo, &cfg, &in, &bt, &out, &exec);
    if (st != FG_OK)
        return Fail(st, fg_last_error(pc.e.ctx));
    *static_cast<float *>(loss->untyped_data()) = (float)out.loss;
    float *m = static_cast<float *>(metrics->untyped_data());
    m[0] = (float)out.metrics.kl;
    m[1] = (float)out.metrics.entropy;
    m[2] = (float)out.metrics.clip_ratio_low;
    m[3] = (float)out.metrics.clip_ratio_high;
    m[4] = (float)out.metrics.clip_ratio_region;
    m[5] = (float)out.metrics.cispo_clip_ratio;
    m[6] = (float)out.metrics.clip_ratio_low_min;
    m[7] = (float)out.metrics.clip_ratio_high_max;
    m[8] = (float)out.metrics.vespo_phi_seq_mean;
    m[9] = (float)out.metrics.policy_loss;
    fg_memory_stats ms;
    if (fg_get_memory_stats(pc.e.ctx, &ms) == FG_OK)
        AddCallTotals(ms.call_seconds, ms.gemm_seconds);
    return ffi::Error::Success();
}

}  // namespace

// Time spent inside the C library by every call of this handler so far:
// out[0] calls, out[1] seconds in fg_linear_grpo, out[2] of those in GEMMs.
// jax.py reads it (call_totals()) to tell front-end overhead from C time.
extern "C" void FgJaxCallTotals(double *out) {
    std::lock_guard<std::mutex> lock(g_totals_mutex);
    out[0] = g_totals[0];
    out[1] = g_totals[1];
    out[2] = g_totals[2];
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FgLinearGrpo, LinearGrpoImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // hidden
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // token_ids
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::AnyBuffer>()  // advantages
                                  .Arg<ffi::AnyBuffer>()  // old_logp
                                  .Arg<ffi::AnyBuffer>()  // ref_logp
                                  .Arg<ffi::AnyBuffer>()  // is_ratio
                                  .Arg<ffi::AnyBuffer>()  // scalars
                                  .Arg<ffi::AnyBuffer>()  // shard
                                  .Ret<ffi::AnyBuffer>()  // loss
                                  .Ret<ffi::AnyBuffer>()  // metrics
                                  .Ret<ffi::AnyBuffer>()  // logp
                                  .Ret<ffi::AnyBuffer>()  // entropy
                                  .Ret<ffi::AnyBuffer>()  // grad_hidden
                                  .Ret<ffi::AnyBuffer>()  // grad_weight
                                  .Ret<ffi::AnyBuffer>()  // grad_bias
                                  .Attr<std::string_view>("loss_type")
                                  .Attr<std::string_view>("level")
                                  .Attr<std::string_view>("impl")
                                  .Attr<double>("beta")
                                  .Attr<double>("epsilon_low")
                                  .Attr<double>("epsilon_high")
                                  .Attr<double>("delta")
                                  .Attr<double>("temperature")
                                  .Attr<double>("sapo_temperature_pos")
                                  .Attr<double>("sapo_temperature_neg")
                                  .Attr<int64_t>("max_completion_length")
                                  .Attr<int64_t>("use_bias_correction_kl")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("memory_budget")
                                  .Attr<int64_t>("vocab_shards")
                                  .Attr<int64_t>("vocab_total")
                                  .Attr<double>("filter_eps"));
