// XLA FFI handlers (CPU, and CUDA) for fusedgrpo: thin C++ shims over the C library.
//
// Built with the Python package (python/jax_ffi.cmake, when jax is present at
// build time) against the headers of jax.ffi.include_dir() and
// include/fusedgrpo.h into fusedgrpo/libfusedgrpo_jax_ffi.so, linked to the
// package's libfusedgrpo.so.0 ($ORIGIN rpath). fusedgrpo/jax.py loads it and
// registers each handler below as a custom-call target (api_version 4 / typed
// FFI). Each handler is one local C call; the reductions between the phases
// of a vocab-sharded call are jax.py's (lax.pmax / lax.psum under shard_map),
// so they run wherever XLA's collectives run, across processes too.
//
//   fusedgrpo_linear_grpo      fg_linear_grpo: loss, metrics, logp, entropy, gradients
//   fusedgrpo_shard_stats      (a) fg_linear_shard_stats
//   fusedgrpo_shard_rescale    (b) fg_shard_stats_rescale
//   fusedgrpo_shard_finish         fg_shard_stats_finish: logp, entropy
//   fusedgrpo_loss_from_logp   (c) fg_grpo_loss_from_logp
//   fusedgrpo_shard_backward   (d) fg_linear_shard_backward
//   fusedgrpo_check            raises the status the shards agreed on
// and, for the CUDA platform (see "device handlers" below):
//   fusedgrpo_linear_grpo_cuda                 fg_linear_grpo on device buffers
//   fusedgrpo_linear_logprobs_cuda             fg_linear_logprobs
//   fusedgrpo_linear_logprobs_backward_cuda    fg_linear_logprobs_backward
//
// Operands (optional ones are zero-sized when absent; see each binding):
//   hidden [B,T,H] f32|bf16, weight [Vb,H] (same dtype), bias [Vb] | [0],
//   token_ids [B,T] s32|s64, mask [B,T] u8|pred|s8, advantages [B] f32,
//   old_logp / ref_logp / sampling_logp [B,T] | [0], is_ratio [B,T] | [B] | [0] f32,
//   scalars f32[2] = (num_items_in_batch, entropy_coef): run-time values, so the
//     sharded front end can feed global normalizers; num_items_in_batch is read
//     only where the attribute num_items_given is 1 (ApplyScalars);
//   shard s32[4] = (vocab_start, rows, key, devices) | [0]: the weight's first `rows`
//     rows are vocab rows [vocab_start, vocab_start + rows) of vocab_total (the
//     rest is padding that never enters a call; its gradient rows are 0); key
//     names the shard on its mesh of `devices` (see Errors). [0]: every row,
//     unsharded.
//   stats f32[FG_SHARD_STATS_FLOATS(B*T)]; status f32[] (a fg_status as a float).
// Attributes: a dictionary per call, the names jax.py gives (_loss_attrs,
// _head_attrs): the loss config as the bytes of the fg_loss_config that
// fusedgrpo._options built and checked (config: u8[sizeof(fg_loss_config)];
// the ctypes struct is checked against this library's layout at import) with
// num_items_given (s64: whether scalars holds a num_items_in_batch), the
// head (impl; filter_eps, temperature: f64; vocab_total: s64) and the call's
// fg_exec (threads, memory_budget: s64).
//
// Errors. fusedgrpo_linear_grpo called plainly (soft_fail = 0, one device)
// returns the library's failure as an FFI error: jax raises JaxRuntimeError
// "fusedgrpo: FG_ERR_...: <message>". Under shard_map no shard may raise on its
// own: the others would wait for it in the next collective (across processes,
// until a transport timeout). So there every handler fails softly: it writes its
// status into its status output (for (a), the stats' status slot, which the MAX
// spreads over the vocab shards, fusedgrpo.h), zeros into its other outputs,
// and keeps the library's message under the shard's key. Later phases pass a
// failed status on without working. jax.py MAX-reduces the status over the
// whole mesh after the call's last collective and fusedgrpo_check then raises
// it on every shard, with this shard's own message if the failure was its own.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <dlfcn.h>

#include <type_traits>

#include "fusedgrpo.h"
#include "xla/ffi/api/ffi.h"
#ifdef FG_JAX_FFI_CUDA_H
#include <cuda.h>  // only to check the driver declarations below (nothing linked)
#endif

namespace ffi = xla::ffi;
using Buf = ffi::AnyBuffer;
using Out = ffi::Result<ffi::AnyBuffer>;

namespace {

// ------------------------------------------------------------ call totals

std::mutex g_totals_mutex;
double g_totals[3];

void AddCallTotals(const fg_context *ctx) {
    fg_memory_stats ms;
    if (fg_get_memory_stats(ctx, &ms) != FG_OK)
        return;
    std::lock_guard<std::mutex> lock(g_totals_mutex);
    g_totals[0] += 1;
    g_totals[1] += ms.call_seconds;
    g_totals[2] += ms.gemm_seconds;
}

// ------------------------------------------------------------ context pool

// XLA may run custom calls on several threads at once (one per host device);
// a context serves one at a time, so calls take one from a pool and put it
// back. Threads and budget are per call (fg_exec): any context serves any call.
// A device context is bound to its stream (fg_context_options.stream) and
// keeps its device workspace between calls, so the pool holds a free list per
// (backend, stream): a call takes a context of its own stream, made for it on
// first use, and a thread that finds every context of its stream busy (several
// threads on one stream) gets a new one. The CPU's list is (FG_BACKEND_CPU,
// NULL). A stream is assumed to outlive the process's calls on it (XLA's
// streams live as long as its client); its contexts are never destroyed.
using PoolKey = std::pair<int, void *>;  // (fg_backend, stream)
std::mutex g_pool_mu;
std::map<PoolKey, std::vector<fg_context *>> g_pool;

fg_status CreateContext(fg_backend backend, void *stream, fg_context **out) {
    if (backend == FG_BACKEND_CPU)
        return fg_context_create(nullptr, out);
    fg_context_options opts;
    fg_context_options_init(&opts);
    opts.backend = backend;
    opts.stream = stream;
    return fg_context_create(&opts, out);
}

struct PooledContext {
    fg_context *ctx = nullptr;
    fg_status status = FG_OK;
    std::string why;  // a failed create's message (fg_context_create_error)
    PoolKey key;
    explicit PooledContext(fg_backend backend = FG_BACKEND_CPU, void *stream = nullptr)
        : key((int)backend, stream) {
        {
            std::lock_guard<std::mutex> lock(g_pool_mu);
            auto &free = g_pool[key];
            if (!free.empty()) {
                ctx = free.back();
                free.pop_back();
                return;
            }
        }
        status = CreateContext(backend, stream, &ctx);  // a failed one leaves ctx NULL
        if (status != FG_OK)
            why = fg_context_create_error();
    }
    ~PooledContext() {
        if (!ctx)
            return;
        AddCallTotals(ctx);
        std::lock_guard<std::mutex> lock(g_pool_mu);
        g_pool[key].push_back(ctx);
    }
    PooledContext(const PooledContext &) = delete;
    PooledContext &operator=(const PooledContext &) = delete;
};

// ------------------------------------------------------------ failures

// A failed step: its status and message ("" while ok).
struct Failure {
    fg_status st = FG_OK;
    std::string msg;
    bool relayed = false;  // an earlier phase's failure (maybe another shard's), passed on
    bool Set(fg_status s, std::string m) {  // false, so checks can `return f->Set(...)`
        st = s;
        msg = std::move(m);
        return false;
    }
    bool SetFrom(fg_status s, const fg_context *ctx) { return Set(s, fg_last_error(ctx)); }
    bool ok() const { return st == FG_OK; }
};

std::string Message(fg_status st, const std::string &msg) {
    const char *name = fg_status_name(st);
    std::string s = msg.rfind(name, 0) == 0 ? msg : std::string(name) + ": " + msg;
    return "fusedgrpo: " + s;
}

ffi::Error Raise(const Failure &f) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, Message(f.st, f.msg));
}

// A soft failure's message, by shard key, for fusedgrpo_check. Only the
// first failure of a shard's call is kept (the later phases only pass it on);
// phase (a) (or the one-call handler) starts the shard's call and forgets the
// last one's. The check runs after every shard's first phase (it reads their
// MAX-reduced status), so the records it sees are this call's.
std::mutex g_fail_mu;
std::map<int32_t, Failure> g_failures;

void Forget(int32_t key) {
    std::lock_guard<std::mutex> lock(g_fail_mu);
    g_failures.erase(key);
}

void Remember(int32_t key, const Failure &f) {
    std::lock_guard<std::mutex> lock(g_fail_mu);
    g_failures.emplace(key, f);  // keeps an earlier one
}

// The failure behind `st` as this process knows it: the shard's own first, then
// one of another shard of the mesh that this process holds, then the shard's
// record of a failure passed on to it (ok: none here). *own: the shard's record.
Failure Cause(int32_t key, int32_t devices, fg_status st, Failure *own) {
    std::lock_guard<std::mutex> lock(g_fail_mu);
    auto it = g_failures.find(key);
    if (it != g_failures.end())
        *own = it->second;
    if (own->st == st && !own->relayed)
        return *own;
    for (const auto &kv : g_failures)
        if (kv.first >= 0 && kv.first < devices && kv.second.st == st && !kv.second.relayed) {
            Failure f = kv.second;
            f.msg += " (on shard " + std::to_string(kv.first) + " of the mesh)";
            return f;
        }
    return own->st == st ? *own : Failure();
}

void Zero(Out &b) { std::memset(b->untyped_data(), 0, b->size_bytes()); }

float *F32(Out &b) { return static_cast<float *>(b->untyped_data()); }

// Writes a soft failure: status output, zeroed results, the kept message.
void SoftFail(const Failure &f, int32_t key, float *status, std::initializer_list<Out *> zero) {
    for (Out *b : zero)
        Zero(*b);
    *status = (float)f.st;
    Remember(key, f);
}

// A status that arrived as a float (a slot or an operand, after a MAX).
fg_status StatusOf(float v) {
    if (v >= 1.0f && v < (float)FG_STATUS_COUNT && v == std::floor(v))
        return (fg_status)(int)v;
    return v == 0.0f ? FG_OK : FG_ERR_COMMUNICATOR;
}

// ------------------------------------------------------------ operands

template <typename T>
bool GetAttr(const ffi::Dictionary &d, const char *name, T *out, Failure *f) {
    auto v = d.get<T>(name);
    if (v.has_error())
        return f->Set(FG_ERR_UNSUPPORTED, std::string("attribute '") + name + "': " +
                                              v.error().message());
    *out = *v;
    return true;
}

bool GetString(const ffi::Dictionary &d, const char *name, std::string *out, Failure *f) {
    std::string_view s;
    if (!GetAttr(d, name, &s, f))
        return false;
    *out = std::string(s);
    return true;
}

struct Shard {
    int64_t start = 0, rows = -1;  // rows < 0: every row of the weight
    int32_t key = -1, devices = 0; // the shard's index on its mesh, the mesh's size
};

bool DecodeShard(const Buf &b, Shard *s, Failure *f) {
    if (b.element_count() == 0)
        return true;
    if (b.element_type() != ffi::DataType::S32 || b.element_count() != 4)
        return f->Set(FG_ERR_SHAPE_MISMATCH,
                      "shard must be s32[4] (vocab_start, rows, key, devices)");
    const int32_t *v = static_cast<const int32_t *>(b.untyped_data());
    s->start = v[0];
    s->rows = v[1];
    s->key = v[2];
    s->devices = v[3];
    return true;
}

struct Tokens {
    std::vector<int64_t> ids64;  // int32 ids widened for the C API
    fg_tokens t{};
};

bool DecodeTokens(const Buf &ids, const Buf &mask, Tokens *tk, Failure *f) {
    auto d = ids.dimensions();
    if (d.size() != 2 || mask.element_count() != ids.element_count())
        return f->Set(FG_ERR_SHAPE_MISMATCH, "token_ids and mask must be [B,T]");
    const int64_t N = d[0] * d[1];
    tk->t.batch = d[0];
    tk->t.seq_len = d[1];
    if (ids.element_type() == ffi::DataType::S64) {
        tk->t.token_ids = static_cast<const int64_t *>(ids.untyped_data());
    } else if (ids.element_type() == ffi::DataType::S32) {
        const int32_t *src = static_cast<const int32_t *>(ids.untyped_data());
        tk->ids64.assign(src, src + N);
        tk->t.token_ids = tk->ids64.data();
    } else {
        return f->Set(FG_ERR_SHAPE_MISMATCH, "token_ids must be int32 or int64");
    }
    const auto mt = mask.element_type();
    if (mt != ffi::DataType::U8 && mt != ffi::DataType::PRED && mt != ffi::DataType::S8)
        return f->Set(FG_ERR_SHAPE_MISMATCH, "mask must be uint8 or bool");
    tk->t.mask = static_cast<const uint8_t *>(mask.untyped_data());
    return true;
}

// The LM head: hidden, this shard's weight rows and bias, and its place in the vocabulary.
struct Head {
    fg_linear_inputs in{};
    fg_dtype dt = FG_DTYPE_F32;
    int64_t N = 0, H = 0, rows_buf = 0;  // rows_buf: the weight buffer's rows (>= in.weight.rows)
};

bool DecodeHead(const Buf &hidden, const Buf &weight, const Buf &bias, const Shard &sh,
                int64_t vocab_total, Head *h, Failure *f) {
    auto hd = hidden.dimensions();
    auto wd = weight.dimensions();
    if (hd.size() != 3 || wd.size() != 2)
        return f->Set(FG_ERR_SHAPE_MISMATCH, "hidden must be [B,T,H] and weight [V,H]");
    if (hidden.element_type() == ffi::DataType::F32)
        h->dt = FG_DTYPE_F32;
    else if (hidden.element_type() == ffi::DataType::BF16)
        h->dt = FG_DTYPE_BF16;
    else
        return f->Set(FG_ERR_UNSUPPORTED, "hidden must be float32 or bfloat16");
    if (weight.element_type() != hidden.element_type() ||
        (bias.element_count() && bias.element_type() != hidden.element_type()))
        return f->Set(FG_ERR_SHAPE_MISMATCH, "hidden, weight and bias must share one dtype");
    h->N = hd[0] * hd[1];
    h->H = hd[2];
    h->rows_buf = wd[0];
    const int64_t rows = sh.rows < 0 ? wd[0] : sh.rows;
    if (rows < 1 || rows > wd[0])
        return f->Set(FG_ERR_SHAPE_MISMATCH, "shard rows " + std::to_string(rows) +
                                                 " outside [1, " + std::to_string(wd[0]) + "]");
    h->in.hidden = fg_matrix_make(hidden.untyped_data(), h->dt, h->N, h->H);
    h->in.weight = fg_matrix_make(weight.untyped_data(), h->dt, rows, h->H);
    h->in.bias = fg_vector_make(bias.element_count() ? bias.untyped_data() : nullptr, h->dt, rows);
    h->in.vocab_start = sh.start;
    h->in.vocab_total = vocab_total;
    return true;
}

// The call's fg_exec: threads (<= 0: OpenMP's default) and budget (0: the library's).
bool DecodeExec(const ffi::Dictionary &a, fg_exec *ex, Failure *f) {
    int64_t threads, budget;
    if (!GetAttr(a, "threads", &threads, f) || !GetAttr(a, "memory_budget", &budget, f))
        return false;
    if (budget < 0)
        return f->Set(FG_ERR_INVALID_SIZE, "memory_budget must be >= 0 bytes (0: the default)");
    fg_exec_init(ex);
    ex->threads = (int)threads;
    ex->memory_budget = (size_t)budget;
    return true;
}

bool DecodeHeadAttrs(const ffi::Dictionary &a, fg_linear_options *lo, fg_exec *ex,
                     Failure *f) {
    std::string impl;
    double filter_eps;
    if (!GetString(a, "impl", &impl, f) || !GetAttr(a, "filter_eps", &filter_eps, f))
        return false;
    *lo = {FG_IMPL_FUSED, 0, filter_eps};
    if (impl == "materialized")
        lo->impl = FG_IMPL_MATERIALIZED;
    else if (impl != "fused")
        return f->Set(FG_ERR_UNSUPPORTED, "unknown impl '" + impl + "'");
    return DecodeExec(a, ex, f);
}

// The loss config: the fg_loss_config's bytes that fusedgrpo._options built and
// checked (attribute "config", u8[sizeof(fg_loss_config)]), with the run-time
// num_items_in_batch and entropy_coef of `scalars` in place of its own.
bool DecodeConfigBytes(const ffi::Dictionary &a, fg_loss_config *cfg, Failure *f) {
    ffi::Span<const uint8_t> bytes;
    if (!GetAttr(a, "config", &bytes, f))
        return false;
    if (bytes.size() != sizeof *cfg)
        return f->Set(FG_ERR_UNSUPPORTED, "attribute 'config' has " +
                                              std::to_string(bytes.size()) +
                                              " bytes, fg_loss_config " +
                                              std::to_string(sizeof *cfg));
    std::memcpy(cfg, bytes.begin(), sizeof *cfg);
    return true;
}

bool ScalarsSized(const Buf &scalars, Failure *f) {
    if (scalars.element_type() != ffi::DataType::F32 || scalars.element_count() != 2)
        return f->Set(FG_ERR_SHAPE_MISMATCH, "scalars must be f32[2]");
    return true;
}

// The run-time options of `scalars` (num_items_in_batch, entropy_coef: maybe
// traced values, which no front end has seen) into the config. Whether
// num_items_in_batch is given is the static attribute "num_items_given", never
// a value of the operand: given, scalars[0] must be a finite number > 0, as the
// front ends check a concrete one, so no value (-1 included) takes the meaning
// of the library's FG_NUM_ITEMS_UNMASKED; not given, the config holds
// FG_NUM_ITEMS_UNMASKED and scalars[0] is not read. entropy_coef has no
// sentinel; the library checks that it is finite.
bool ApplyScalars(const ffi::Dictionary &a, const float sc[2], fg_loss_config *cfg, Failure *f) {
    int64_t given = 0;
    if (!GetAttr(a, "num_items_given", &given, f))
        return false;
    cfg->num_items_in_batch = FG_NUM_ITEMS_UNMASKED;
    if (given) {
        const double items = sc[0];
        if (!(std::isfinite(items) && items > 0)) {
            char v[32];
            std::snprintf(v, sizeof v, "%.9g", items);
            return f->Set(FG_ERR_BAD_HYPERPARAMETER,
                          std::string("num_items_in_batch must be a finite number > 0 (or None: "
                                      "the unmasked token count), got ") + v);
        }
        cfg->num_items_in_batch = items;
    }
    cfg->entropy_coef = sc[1];
    return true;
}

bool DecodeLossConfig(const ffi::Dictionary &a, const Buf &scalars, fg_loss_config *cfg,
                      Failure *f) {
    return DecodeConfigBytes(a, cfg, f) && ScalarsSized(scalars, f) &&
           ApplyScalars(a, static_cast<const float *>(scalars.untyped_data()), cfg, f);
}

const float *F32In(const Buf &b) { return static_cast<const float *>(b.untyped_data()); }

const float *OptF32(const Buf &b) {
    return b.element_count() ? static_cast<const float *>(b.untyped_data()) : nullptr;
}

// The per-sequence side of a batch (the token side comes from Tokens).
bool DecodeBatch(const Tokens &tk, const Buf &adv, const Buf &old_logp, const Buf &ref_logp,
                 const Buf &is_ratio, const Buf &sampling_logp, fg_batch *bt, Failure *f) {
    const int64_t B = tk.t.batch, N = B * tk.t.seq_len;
    if ((int64_t)adv.element_count() != B || adv.element_type() != ffi::DataType::F32)
        return f->Set(FG_ERR_SHAPE_MISMATCH, "advantages must be float32 [B]");
    std::memset(bt, 0, sizeof *bt);
    bt->batch = B;
    bt->seq_len = tk.t.seq_len;
    bt->token_ids = tk.t.token_ids;
    bt->mask = tk.t.mask;
    bt->advantages = static_cast<const float *>(adv.untyped_data());
    bt->old_logp = OptF32(old_logp);
    bt->ref_logp = OptF32(ref_logp);
    bt->is_ratio = OptF32(is_ratio);
    bt->sampling_logp = OptF32(sampling_logp);
    const int64_t ni = (int64_t)is_ratio.element_count();
    bt->is_ratio_per_sequence = ni == B && ni != N;
    return true;
}

// Gradient views in the dtype JAX allocated them in (bf16 for bf16 inputs where
// jax.py asks for it: no float32 copy to allocate and cast), over a shard's
// `rows` used rows; the padding rows past them are zeroed.
fg_dtype DtypeOf(Out &b) {
    return b->element_type() == ffi::DataType::BF16 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
}

void GradViews(const Head &h, Out &gh, Out &gw, Out &gb, fg_matrix *mh, fg_matrix *mw,
               fg_vector *vb) {
    const int64_t rows = h.in.weight.rows;
    if (gh->element_count())
        *mh = fg_matrix_make(gh->untyped_data(), DtypeOf(gh), h.N, h.H);
    if (gw->element_count()) {
        *mw = fg_matrix_make(gw->untyped_data(), DtypeOf(gw), rows, h.H);
        const size_t row_bytes = gw->size_bytes() / (size_t)h.rows_buf;
        std::memset(static_cast<char *>(gw->untyped_data()) + rows * row_bytes, 0,
                    (size_t)(h.rows_buf - rows) * row_bytes);
    }
    if (gb->element_count()) {
        *vb = fg_vector_make(gb->untyped_data(), DtypeOf(gb), rows);
        const size_t el = gb->size_bytes() / (size_t)h.rows_buf;
        std::memset(static_cast<char *>(gb->untyped_data()) + rows * el, 0,
                    (size_t)(h.rows_buf - rows) * el);
    }
}

void WriteMetrics(const fg_metrics &m, float *out) {
    const double v[10] = {m.kl, m.entropy, m.clip_ratio_low, m.clip_ratio_high,
                          m.clip_ratio_region, m.cispo_clip_ratio, m.clip_ratio_low_min,
                          m.clip_ratio_high_max, m.vespo_phi_seq_mean, m.policy_loss};
    for (int i = 0; i < 10; i++)
        out[i] = (float)v[i];
}

bool StatsSized(const Tokens &tk, const Buf &stats, Failure *f) {
    const int64_t n = FG_SHARD_STATS_FLOATS(tk.t.batch * tk.t.seq_len);
    if (stats.element_type() != ffi::DataType::F32 || (int64_t)stats.element_count() != n)
        return f->Set(FG_ERR_SHAPE_MISMATCH, "stats must be f32[13*B*T + 1]");
    return true;
}

// In place when XLA aliased the operand to the result; else a copy first.
float *StatsOut(const Buf &in, Out &out) {
    if (out->untyped_data() != in.untyped_data())
        std::memcpy(out->untyped_data(), in.untyped_data(), out->size_bytes());
    return F32(out);
}

// ------------------------------------------------------------ fusedgrpo_linear_grpo

// The one-call loss: one device, or a shard of the batch axis only.
bool LinearGrpo(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask, Buf advantages,
                Buf old_logp, Buf ref_logp, Buf is_ratio, Buf sampling_logp, Buf scalars,
                const Shard &sh, Out &loss, Out &metrics, Out &logp, Out &entropy, Out &gh,
                Out &gw, Out &gb,
                const ffi::Dictionary &attrs, Failure *f) {
    Tokens tk;
    Head h;
    fg_batch bt;
    fg_loss_config cfg;
    fg_linear_options lo;
    fg_exec ex;
    if (!DecodeTokens(token_ids, mask, &tk, f) || !DecodeHead(hidden, weight, bias, sh, 0, &h, f) ||
        !DecodeBatch(tk, advantages, old_logp, ref_logp, is_ratio, sampling_logp, &bt, f) ||
        !DecodeLossConfig(attrs, scalars, &cfg, f) || !DecodeHeadAttrs(attrs, &lo, &ex, f))
        return false;
    fg_linear_outputs out;
    std::memset(&out, 0, sizeof out);
    out.logp = F32(logp);
    out.entropy = F32(entropy);
    GradViews(h, gh, gw, gb, &out.grad_hidden, &out.grad_weight, &out.grad_bias);
    PooledContext pc;
    if (pc.status != FG_OK)
        return f->Set(pc.status, pc.why);
    const fg_status st = fg_linear_grpo(pc.ctx, &lo, &cfg, &h.in, &bt, &out, &ex);
    if (st != FG_OK)
        return f->SetFrom(st, pc.ctx);
    *F32(loss) = (float)out.loss;
    WriteMetrics(out.metrics, F32(metrics));
    return true;
}

ffi::Error LinearGrpoImpl(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask,
                          Buf advantages, Buf old_logp, Buf ref_logp, Buf is_ratio,
                          Buf sampling_logp, Buf scalars, Buf shard, Out loss, Out metrics,
                          Out logp, Out entropy, Out gh, Out gw, Out gb, Out status,
                          ffi::Dictionary attrs) {
    Failure f;
    Shard sh;
    int64_t soft = 0;
    if (DecodeShard(shard, &sh, &f) && GetAttr(attrs, "soft_fail", &soft, &f)) {
        Forget(sh.key);  // a new call on this shard
        LinearGrpo(hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp,
                   is_ratio, sampling_logp, scalars, sh, loss, metrics, logp, entropy, gh, gw,
                   gb, attrs, &f);
    }
    *F32(status) = 0.0f;
    if (f.ok())
        return ffi::Error::Success();
    if (!soft)
        return Raise(f);
    SoftFail(f, sh.key, F32(status), {&loss, &metrics, &logp, &entropy, &gh, &gw, &gb});
    return ffi::Error::Success();
}

// ------------------------------------------------------------ the phases

// The head's operands and attributes of phases (a) and (d).
bool DecodeShardHead(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask, const Shard &sh,
                     const ffi::Dictionary &attrs, Tokens *tk, Head *h, fg_linear_options *lo,
                     fg_exec *ex, double *temperature, Failure *f) {
    int64_t vocab_total = 0;
    return DecodeTokens(token_ids, mask, tk, f) &&
           GetAttr(attrs, "vocab_total", &vocab_total, f) &&
           DecodeHead(hidden, weight, bias, sh, vocab_total, h, f) &&
           DecodeHeadAttrs(attrs, lo, ex, f) && GetAttr(attrs, "temperature", temperature, f);
}

// (a): this shard's row statistics.
bool ShardStats(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask, const Shard &sh,
                Out &stats, const ffi::Dictionary &attrs, Failure *f) {
    Tokens tk;
    Head h;
    fg_linear_options lo;
    fg_exec ex;
    double temperature = 1.0;
    if (!DecodeShardHead(hidden, weight, bias, token_ids, mask, sh, attrs, &tk, &h, &lo, &ex,
                         &temperature, f))
        return false;
    if ((int64_t)stats->element_count() != FG_SHARD_STATS_FLOATS(h.N))
        return f->Set(FG_ERR_SHAPE_MISMATCH, "stats must be f32[13*B*T + 1]");
    PooledContext pc;
    if (pc.status != FG_OK)
        return f->Set(pc.status, pc.why);
    const fg_status st =
        fg_linear_shard_stats(pc.ctx, &lo, temperature, &h.in, &tk.t, F32(stats), &ex);
    return st == FG_OK || f->SetFrom(st, pc.ctx);
}

// A failure of (a) goes into the stats' status slot (the MAX range's last
// float), which the caller's MAX spreads over the vocab shards.
ffi::Error ShardStatsImpl(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask, Buf shard,
                          Out stats, ffi::Dictionary attrs) {
    Failure f;
    Shard sh;
    if (DecodeShard(shard, &sh, &f)) {
        Forget(sh.key);  // a new call on this shard
        ShardStats(hidden, weight, bias, token_ids, mask, sh, stats, attrs, &f);
    }
    if (!f.ok()) {
        float slot;
        SoftFail(f, sh.key, &slot, {&stats});
        const int64_t N = (int64_t)(stats->element_count() - 1) / 13;
        F32(stats)[FG_SHARD_STATS_STATUS(N)] = slot;
    }
    return ffi::Error::Success();
}

// The operands of (b) and finish; a wrong shape is the same on every shard, so
// it may raise at once.
bool DecodeStatsStep(Buf token_ids, Buf mask, Buf stats, Buf shard, Shard *sh, Tokens *tk,
                     Failure *f) {
    return DecodeShard(shard, sh, f) && DecodeTokens(token_ids, mask, tk, f) &&
           StatsSized(*tk, stats, f);
}

// (b), after the MAX: the sums rescaled as exact limbs (in place). A status in
// the slot (a shard's failed (a)) stays there for the next steps.
ffi::Error ShardRescaleImpl(Buf token_ids, Buf mask, Buf stats_in, Buf shard, Out stats) {
    Failure f;
    Shard sh;
    Tokens tk;
    if (!DecodeStatsStep(token_ids, mask, stats_in, shard, &sh, &tk, &f))
        return Raise(f);
    float *s = StatsOut(stats_in, stats);
    float *slot = &s[FG_SHARD_STATS_STATUS(tk.t.batch * tk.t.seq_len)];
    f.relayed = *slot != 0.0f;
    PooledContext pc;
    const fg_status st = pc.status != FG_OK ? pc.status : fg_shard_stats_rescale(pc.ctx, &tk.t, s);
    if (st != FG_OK) {
        f.SetFrom(st, pc.ctx);
        SoftFail(f, sh.key, slot, {});
    }
    return ffi::Error::Success();
}

// After the SUM: logp and entropy; the merged statistics kept in stats (in place).
ffi::Error ShardFinishImpl(Buf token_ids, Buf mask, Buf stats_in, Buf shard, Out stats,
                           Out logp, Out entropy) {
    Failure f;
    Shard sh;
    Tokens tk;
    if (!DecodeStatsStep(token_ids, mask, stats_in, shard, &sh, &tk, &f))
        return Raise(f);
    float *s = StatsOut(stats_in, stats);
    float *slot = &s[FG_SHARD_STATS_STATUS(tk.t.batch * tk.t.seq_len)];
    f.relayed = *slot != 0.0f;
    PooledContext pc;
    const fg_status st =
        pc.status != FG_OK ? pc.status
                           : fg_shard_stats_finish(pc.ctx, &tk.t, s, F32(logp), F32(entropy));
    if (st != FG_OK) {
        f.SetFrom(st, pc.ctx);
        SoftFail(f, sh.key, slot, {&logp, &entropy});
    }
    return ffi::Error::Success();
}

// A status from an earlier phase: nothing to do but pass it on (Remember keeps
// that phase's message).
bool Upstream(const Buf &status_in, Failure *f) {
    const fg_status st = StatusOf(*static_cast<const float *>(status_in.untyped_data()));
    f->relayed = st != FG_OK;
    return st == FG_OK || f->Set(st, "an earlier phase failed");
}

// (c): the loss, its metrics and d loss/d logp, d loss/d entropy from the merged
// logp and entropy (the same bits on every vocab shard: the same results).
bool LossFromLogp(Buf token_ids, Buf mask, Buf advantages, Buf old_logp, Buf ref_logp,
                  Buf is_ratio, Buf sampling_logp, Buf scalars, Buf logp, Buf entropy, Out &loss,
                  Out &metrics, Out &grad_logp, Out &grad_entropy, const ffi::Dictionary &attrs,
                  Failure *f) {
    Tokens tk;
    fg_batch bt;
    fg_loss_config cfg;
    fg_exec ex;
    if (!DecodeTokens(token_ids, mask, &tk, f) ||
        !DecodeBatch(tk, advantages, old_logp, ref_logp, is_ratio, sampling_logp, &bt, f) ||
        !DecodeLossConfig(attrs, scalars, &cfg, f) || !DecodeExec(attrs, &ex, f))
        return false;
    fg_logp_outputs out;
    std::memset(&out, 0, sizeof out);
    out.grad_logp = grad_logp->element_count() ? F32(grad_logp) : nullptr;
    out.grad_entropy = grad_entropy->element_count() ? F32(grad_entropy) : nullptr;
    PooledContext pc;
    if (pc.status != FG_OK)
        return f->Set(pc.status, pc.why);
    const fg_status st =
        fg_grpo_loss_from_logp(pc.ctx, &cfg, &bt, F32In(logp), F32In(entropy), &out, &ex);
    if (st != FG_OK)
        return f->SetFrom(st, pc.ctx);
    *F32(loss) = (float)out.loss;
    WriteMetrics(out.metrics, F32(metrics));
    return true;
}

ffi::Error LossFromLogpImpl(Buf token_ids, Buf mask, Buf advantages, Buf old_logp, Buf ref_logp,
                            Buf is_ratio, Buf sampling_logp, Buf scalars, Buf logp, Buf entropy,
                            Buf status_in, Buf shard, Out loss, Out metrics, Out grad_logp,
                            Out grad_entropy, Out status, ffi::Dictionary attrs) {
    Failure f;
    Shard sh;
    if (DecodeShard(shard, &sh, &f) && Upstream(status_in, &f))
        LossFromLogp(token_ids, mask, advantages, old_logp, ref_logp, is_ratio, sampling_logp,
                     scalars, logp, entropy, loss, metrics, grad_logp, grad_entropy, attrs, &f);
    *F32(status) = 0.0f;
    if (!f.ok())
        SoftFail(f, sh.key, F32(status), {&loss, &metrics, &grad_logp, &grad_entropy});
    return ffi::Error::Success();
}

// (d): this shard's share of grad_hidden (the caller sums it over the vocab
// shards) and its own grad_weight, grad_bias rows.
bool ShardBackward(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask, const Shard &sh,
                   Buf stats, Buf grad_logp, Buf grad_entropy, Out &gh, Out &gw, Out &gb,
                   const ffi::Dictionary &attrs, Failure *f) {
    Tokens tk;
    Head h;
    fg_linear_options lo;
    fg_exec ex;
    double temperature = 1.0;
    if (!DecodeShardHead(hidden, weight, bias, token_ids, mask, sh, attrs, &tk, &h, &lo, &ex,
                         &temperature, f) ||
        !StatsSized(tk, stats, f))
        return false;
    fg_linear_grads g;
    std::memset(&g, 0, sizeof g);
    GradViews(h, gh, gw, gb, &g.grad_hidden, &g.grad_weight, &g.grad_bias);
    PooledContext pc;
    if (pc.status != FG_OK)
        return f->Set(pc.status, pc.why);
    const fg_status st = fg_linear_shard_backward(pc.ctx, &lo, temperature, &h.in, &tk.t,
                                                  F32In(stats), F32In(grad_logp),
                                                  F32In(grad_entropy), &g, &ex);
    return st == FG_OK || f->SetFrom(st, pc.ctx);
}

ffi::Error ShardBackwardImpl(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask, Buf shard,
                             Buf stats, Buf grad_logp, Buf grad_entropy, Buf status_in, Out gh,
                             Out gw, Out gb, Out status, ffi::Dictionary attrs) {
    Failure f;
    Shard sh;
    if (DecodeShard(shard, &sh, &f) && Upstream(status_in, &f))
        ShardBackward(hidden, weight, bias, token_ids, mask, sh, stats, grad_logp, grad_entropy,
                      gh, gw, gb, attrs, &f);
    *F32(status) = 0.0f;
    if (!f.ok())
        SoftFail(f, sh.key, F32(status), {&gh, &gw, &gb});
    return ffi::Error::Success();
}

// Raises the status every shard holds (MAX-reduced over the mesh by jax.py,
// after the call's last collective): every shard raises the same status.
// Its further operands are the call's results, returned in place (aliased),
// so XLA runs it after everything that produced them and nothing that reads
// them can skip it.
ffi::Error CheckImpl(Buf status, Buf shard, ffi::RemainingArgs results, ffi::RemainingRets outs) {
    Failure f;
    Shard sh;
    if (!DecodeShard(shard, &sh, &f))
        return Raise(f);
    if (results.size() != outs.size())
        return Raise(
            Failure{FG_ERR_SHAPE_MISMATCH, "fusedgrpo_check: results and outputs differ", false});
    for (size_t i = 0; i < results.size(); i++) {  // aliased: the same buffers, unless XLA copied
        auto in = results.get<Buf>(i);
        auto out = outs.get<Buf>(i);
        if (in.has_error() || out.has_error())
            return Raise(
                Failure{FG_ERR_SHAPE_MISMATCH, "fusedgrpo_check: a result is not a buffer", false});
        if ((*out)->untyped_data() != in->untyped_data())
            std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
    const fg_status st = StatusOf(*static_cast<const float *>(status.untyped_data()));
    if (st == FG_OK)
        return ffi::Error::Success();
    Failure own;
    const Failure cause = Cause(sh.key, sh.devices, st, &own);
    if (!cause.ok())
        return Raise(cause);
    std::string msg = "another shard of this call failed with it (its process reports the cause)";
    if (!own.ok())
        msg += "; this shard: " + Message(own.st, own.msg);
    f.Set(st, msg + "; every shard raises it");
    return Raise(f);
}

// ------------------------------------------------------------ device handlers
//
// fusedgrpo_linear_grpo_cuda, fusedgrpo_linear_logprobs_cuda and
// fusedgrpo_linear_logprobs_backward_cuda: the one-call loss and the head's
// log-probs (forward, backward) on a GPU. Every operand and result is device
// memory. The C call runs on a context created with FG_BACKEND_CUDA on the
// call's stream (the pool above: one free list per stream), whose backend
// (libfusedgrpo_cuda.so) makes every CUDA call of the work: kernels, cuBLASLt,
// the staging of the token arrays and its waits. Its scratch is device memory
// that the context reserves on its first call and keeps for the next ones
// (fg_exec.workspace stays NULL: XLA's scratch allocator would need the plan's
// size before the call), taken from the CUDA memory pool, outside XLA's own
// allocator (which holds 75% of the device by default).
//
// Around the call, three kinds of host numbers cross between host and device,
// and the C API moves none of them: the run-time scalars (num_items_in_batch,
// entropy_coef: host doubles of fg_loss_config) are read from their device
// operand before it, and the loss, metrics and status (host numbers of
// fg_linear_outputs) go into their device results after it. Decision: the
// handler copies these 2 + 12 floats itself through the CUDA driver API
// (libcuda.so.1, opened with dlopen on the first device call; nothing linked):
//  - XLA allocates every result of a GPU custom call in device memory and the
//    FFI has no copy of its own, so some CUDA call has to write them;
//  - the copies go on the call's stream after the C call, which has already
//    waited for its own work (the loss is a host number only at its end), so
//    they add no wait; the scalars' read adds one, just before the C call's
//    first step, which waits for the stream anyway;
//  - a host callback instead (the handler leaves loss and metrics in a side
//    table that a jax.pure_callback reads) needs a second custom call per
//    loss, a table keyed by call that holds under vmap and concurrent
//    devices, and device-host round trips of its own: more code, more waits;
//  - the driver, not libcudart: libcuda.so.1 has kept its soname and these
//    entry points for every CUDA version, every process running JAX on a GPU
//    already has it loaded, and it serves whichever runtime version jaxlib and
//    libfusedgrpo_cuda.so were built with, where a libcudart would have to
//    match one of them (.so.12, .so.13). The handler library itself links no
//    CUDA, so it loads, and its CPU handlers run, where there is none.
// The source of a host-to-device copy is pageable memory (the handler's
// stack): the driver stages it before cuMemcpyHtoDAsync returns, so it may go
// out of scope at once. The handlers never carry XLA's command-buffer trait:
// the C call waits for the stream on the host, which a CUDA graph cannot hold.
//
// Operands are fusedgrpo_linear_grpo's, except that token_ids are the C API's
// int64 ids, s64 [B,T] or s32 [B,T,2] (each id's two 32-bit words, low first:
// the little-endian int64 layout, which jax.py builds on the device without
// x64 mode), since the handler cannot widen int32 ids that it cannot read;
// shard is [0] and soft_fail 0 (the vocab-sharded phases are host-only). A
// failure raises (JaxRuntimeError "fusedgrpo: FG_ERR_...: ...").
//
// The same bodies run over the C library's reference backend on host memory
// (Fg*OnReference, copies by memcpy, registered by tests for the CPU), so that
// a machine without a GPU exercises the device code path through XLA
// (tests/python/test_jax_cuda.py).

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "s32 [B,T,2] token ids are read as little-endian int64");

namespace cu {  // the few driver entry points the device handlers use

#ifdef FG_JAX_FFI_CUDA_H
using Result = CUresult;
using DevicePtr = CUdeviceptr;
using Stream = CUstream;
using Context = CUcontext;
#else  // the same ABI: an enum returned as int, a 64-bit address, opaque handles
using Result = int;
using DevicePtr = unsigned long long;
using Stream = void *;
using Context = void *;
#endif
static_assert(sizeof(DevicePtr) == 8 && sizeof(Stream) == sizeof(void *), "64-bit CUDA ABI");

using StreamGetCtxFn = Result (*)(Stream, Context *);
using CtxPushFn = Result (*)(Context);
using CtxPopFn = Result (*)(Context *);
using HtoDFn = Result (*)(DevicePtr, const void *, size_t, Stream);
using DtoHFn = Result (*)(void *, DevicePtr, size_t, Stream);
using SyncFn = Result (*)(Stream);
using ErrorNameFn = Result (*)(Result, const char **);

#ifdef FG_JAX_FFI_CUDA_H  // the declarations above, checked against cuda.h where it is found
static_assert(std::is_same<StreamGetCtxFn, decltype(&::cuStreamGetCtx)>::value, "cuStreamGetCtx");
static_assert(std::is_same<CtxPushFn, decltype(&::cuCtxPushCurrent)>::value, "cuCtxPushCurrent");
static_assert(std::is_same<CtxPopFn, decltype(&::cuCtxPopCurrent)>::value, "cuCtxPopCurrent");
static_assert(std::is_same<HtoDFn, decltype(&::cuMemcpyHtoDAsync)>::value, "cuMemcpyHtoDAsync");
static_assert(std::is_same<DtoHFn, decltype(&::cuMemcpyDtoHAsync)>::value, "cuMemcpyDtoHAsync");
static_assert(std::is_same<SyncFn, decltype(&::cuStreamSynchronize)>::value, "cuStreamSynchronize");
static_assert(std::is_same<ErrorNameFn, decltype(&::cuGetErrorName)>::value, "cuGetErrorName");
#endif

struct Api {
    StreamGetCtxFn stream_get_ctx = nullptr;
    CtxPushFn ctx_push = nullptr;
    CtxPopFn ctx_pop = nullptr;
    HtoDFn htod = nullptr;
    DtoHFn dtoh = nullptr;
    SyncFn sync = nullptr;
    ErrorNameFn error_name = nullptr;
    std::string error;  // why the driver is not usable; "" when it is
};

template <typename Fn>
bool Symbol(void *lib, const char *name, Fn *out, std::string *error) {
    *out = reinterpret_cast<Fn>(dlsym(lib, name));
    if (!*out)
        *error = std::string("the CUDA driver libcuda.so.1 has no ") + name;
    return *out != nullptr;
}

// The exported names are cuda.h's expansions (the _v2 entry points).
Api Load() {
    Api a;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  // kept open: the process's driver
    if (!lib) {
        const char *why = dlerror();
        a.error = std::string("cannot load the CUDA driver libcuda.so.1: ") + (why ? why : "?");
        return a;
    }
    if (Symbol(lib, "cuStreamGetCtx", &a.stream_get_ctx, &a.error) &&
        Symbol(lib, "cuCtxPushCurrent_v2", &a.ctx_push, &a.error) &&
        Symbol(lib, "cuCtxPopCurrent_v2", &a.ctx_pop, &a.error) &&
        Symbol(lib, "cuMemcpyHtoDAsync_v2", &a.htod, &a.error) &&
        Symbol(lib, "cuMemcpyDtoHAsync_v2", &a.dtoh, &a.error) &&
        Symbol(lib, "cuStreamSynchronize", &a.sync, &a.error))
        Symbol(lib, "cuGetErrorName", &a.error_name, &a.error);
    return a;
}

const Api &Driver() {
    static const Api api = Load();  // once, thread-safe
    return api;
}

std::string Name(const Api &a, Result r) {
    const char *name = nullptr;
    if (a.error_name)
        a.error_name(r, &name);
    return name ? name : "CUresult " + std::to_string((int)r);
}

// One copy on `stream`, in the stream's own CUDA context (made current for
// it: XLA's calling thread need not have it current). to_host also waits for
// it, so the host bytes are there on return.
bool Copy(bool to_device, void *stream, void *dst, const void *src, size_t bytes, Failure *f) {
    const Api &a = Driver();
    if (!a.error.empty())
        return f->Set(FG_ERR_UNSUPPORTED, a.error);
    Stream s = static_cast<Stream>(stream);
    Context ctx = nullptr;
    const char *what = "cuStreamGetCtx";
    Result r = a.stream_get_ctx(s, &ctx);
    if ((int)r == 0) {
        what = "cuCtxPushCurrent";
        r = a.ctx_push(ctx);
    }
    if ((int)r != 0)
        return f->Set(FG_ERR_BACKEND, std::string(what) + ": " + Name(a, r));
    if (to_device) {
        what = "cuMemcpyHtoDAsync";
        r = a.htod((DevicePtr)(uintptr_t)dst, src, bytes, s);
    } else {
        what = "cuMemcpyDtoHAsync";
        r = a.dtoh(dst, (DevicePtr)(uintptr_t)src, bytes, s);
        if ((int)r == 0) {
            what = "cuStreamSynchronize";
            r = a.sync(s);
        }
    }
    Context popped = nullptr;
    const Result rp = a.ctx_pop(&popped);
    if ((int)r == 0 && (int)rp != 0) {
        what = "cuCtxPopCurrent";
        r = rp;
    }
    return (int)r == 0 || f->Set(FG_ERR_BACKEND, std::string(what) + ": " + Name(a, r));
}

}  // namespace cu

// Where a device handler's memory lives: the backend of its contexts, and the
// copies of the host numbers (the host buffer may be reused when they return).
struct DeviceMemory {
    fg_backend backend;
    const char *name;
    bool (*to_host)(void *stream, void *host, const void *dev, size_t bytes, Failure *f);
    bool (*to_device)(void *stream, void *dev, const void *host, size_t bytes, Failure *f);
};

bool CudaToHost(void *stream, void *host, const void *dev, size_t bytes, Failure *f) {
    return cu::Copy(false, stream, host, dev, bytes, f);
}

bool CudaToDevice(void *stream, void *dev, const void *host, size_t bytes, Failure *f) {
    return cu::Copy(true, stream, dev, host, bytes, f);
}

bool HostCopy(void *, void *dst, const void *src, size_t bytes, Failure *) {
    std::memcpy(dst, src, bytes);
    return true;
}

const DeviceMemory kCuda = {FG_BACKEND_CUDA, "CUDA", CudaToHost, CudaToDevice};
const DeviceMemory kReference = {FG_BACKEND_REFERENCE, "reference", HostCopy, HostCopy};

// The pooled context of a device call, or false with why there is none (the
// library's message of the failed create: which library it looked for where,
// or that no device was found).
bool DeviceContext(const DeviceMemory &mem, const PooledContext &pc, Failure *f) {
    if (pc.status == FG_OK)
        return true;
    return f->Set(pc.status, std::string("cannot create a context on the ") + mem.name +
                                 " backend: " + pc.why);
}

// token_ids s64 [B,T] or s32 [B,T,2] (the words of int64 ids, low first) and
// mask [B,T]: their addresses only, nothing read.
bool DecodeDeviceTokens(const Buf &ids, const Buf &mask, fg_tokens *t, Failure *f) {
    auto md = mask.dimensions();
    auto d = ids.dimensions();
    if (md.size() != 2)
        return f->Set(FG_ERR_SHAPE_MISMATCH, "mask must be [B,T]");
    const bool bt = d.size() >= 2 && d[0] == md[0] && d[1] == md[1];
    const bool s64 = bt && d.size() == 2 && ids.element_type() == ffi::DataType::S64;
    const bool words = bt && d.size() == 3 && d[2] == 2 && ids.element_type() == ffi::DataType::S32;
    if (!s64 && !words)
        return f->Set(FG_ERR_SHAPE_MISMATCH, "token_ids on a device must be int64 [B,T], or "
                                             "int32 [B,T,2]: the int64 ids' words, low first");
    const auto mt = mask.element_type();
    if (mt != ffi::DataType::U8 && mt != ffi::DataType::PRED && mt != ffi::DataType::S8)
        return f->Set(FG_ERR_SHAPE_MISMATCH, "mask must be uint8 or bool");
    t->batch = md[0];
    t->seq_len = md[1];
    t->token_ids = static_cast<const int64_t *>(ids.untyped_data());
    t->mask = static_cast<const uint8_t *>(mask.untyped_data());
    return true;
}

// Gradient views over whole buffers (no shard: no padding rows to zero).
void DeviceGradViews(const Head &h, Out &gh, Out &gw, Out &gb, fg_matrix *mh, fg_matrix *mw,
                     fg_vector *vb) {
    if (gh->element_count())
        *mh = fg_matrix_make(gh->untyped_data(), DtypeOf(gh), h.N, h.H);
    if (gw->element_count())
        *mw = fg_matrix_make(gw->untyped_data(), DtypeOf(gw), h.in.weight.rows, h.H);
    if (gb->element_count())
        *vb = fg_vector_make(gb->untyped_data(), DtypeOf(gb), h.in.weight.rows);
}

bool F32Sized(Out &b, int64_t n, const char *what, Failure *f) {
    if (b->element_type() != ffi::DataType::F32 || (int64_t)b->element_count() != n)
        return f->Set(FG_ERR_SHAPE_MISMATCH,
                      std::string(what) + " must be f32[" + std::to_string(n) + "]");
    return true;
}

bool F32Sized(const Buf &b, int64_t n, const char *what, Failure *f) {
    if (b.element_type() != ffi::DataType::F32 || (int64_t)b.element_count() != n)
        return f->Set(FG_ERR_SHAPE_MISMATCH,
                      std::string(what) + " must be f32[" + std::to_string(n) + "]");
    return true;
}

// A device call is one whole call: no shard of a vocab-sharded mesh, no soft failure.
bool WholeCall(const Buf &shard, const ffi::Dictionary &attrs, Failure *f) {
    int64_t soft = 0;
    if (!GetAttr(attrs, "soft_fail", &soft, f))
        return false;
    if (shard.element_count() != 0 || soft != 0)
        return f->Set(FG_ERR_UNSUPPORTED, "the calls of a sharded loss (shard_map) run on CPU "
                                          "devices only");
    return true;
}

// The head, its attributes and the tokens of a device call.
bool DecodeDeviceHead(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask,
                      const ffi::Dictionary &attrs, Tokens *tk, Head *h, fg_linear_options *lo,
                      fg_exec *ex, Failure *f) {
    return DecodeDeviceTokens(token_ids, mask, &tk->t, f) &&
           DecodeHead(hidden, weight, bias, Shard(), 0, h, f) && DecodeHeadAttrs(attrs, lo, ex, f);
}

bool LinearGrpoDevice(const DeviceMemory &mem, void *stream, Buf hidden, Buf weight, Buf bias,
                      Buf token_ids, Buf mask, Buf advantages, Buf old_logp, Buf ref_logp,
                      Buf is_ratio, Buf sampling_logp, Buf scalars, Buf shard, Out &loss,
                      Out &metrics, Out &logp, Out &entropy, Out &gh, Out &gw, Out &gb,
                      Out &status, const ffi::Dictionary &attrs, Failure *f) {
    Tokens tk;
    Head h;
    fg_batch bt;
    fg_loss_config cfg;
    fg_linear_options lo;
    fg_exec ex;
    if (!WholeCall(shard, attrs, f) ||
        !DecodeDeviceHead(hidden, weight, bias, token_ids, mask, attrs, &tk, &h, &lo, &ex, f) ||
        !DecodeBatch(tk, advantages, old_logp, ref_logp, is_ratio, sampling_logp, &bt, f) ||
        !DecodeConfigBytes(attrs, &cfg, f) || !ScalarsSized(scalars, f) ||
        !F32Sized(loss, 1, "loss", f) || !F32Sized(metrics, 10, "metrics", f) ||
        !F32Sized(status, 1, "status", f) || !F32Sized(logp, h.N, "logp", f) ||
        !F32Sized(entropy, h.N, "entropy", f))
        return false;
    float sc[2];  // num_items_in_batch (read where given: ApplyScalars), entropy_coef
    if (!mem.to_host(stream, sc, scalars.untyped_data(), sizeof sc, f) ||
        !ApplyScalars(attrs, sc, &cfg, f))
        return false;
    fg_linear_outputs out;
    std::memset(&out, 0, sizeof out);
    out.logp = F32(logp);
    out.entropy = F32(entropy);
    DeviceGradViews(h, gh, gw, gb, &out.grad_hidden, &out.grad_weight, &out.grad_bias);
    PooledContext pc(mem.backend, stream);
    if (!DeviceContext(mem, pc, f))
        return false;
    const fg_status st = fg_linear_grpo(pc.ctx, &lo, &cfg, &h.in, &bt, &out, &ex);
    if (st != FG_OK)
        return f->SetFrom(st, pc.ctx);
    const float host_loss = (float)out.loss, host_status = 0.0f;
    float host_metrics[10];
    WriteMetrics(out.metrics, host_metrics);
    return mem.to_device(stream, loss->untyped_data(), &host_loss, sizeof host_loss, f) &&
           mem.to_device(stream, metrics->untyped_data(), host_metrics, sizeof host_metrics, f) &&
           mem.to_device(stream, status->untyped_data(), &host_status, sizeof host_status, f);
}

ffi::Error LinearGrpoOn(const DeviceMemory &mem, void *stream, Buf hidden, Buf weight, Buf bias,
                        Buf token_ids, Buf mask, Buf advantages, Buf old_logp, Buf ref_logp,
                        Buf is_ratio, Buf sampling_logp, Buf scalars, Buf shard, Out loss,
                        Out metrics, Out logp, Out entropy, Out gh, Out gw, Out gb, Out status,
                        ffi::Dictionary attrs) {
    Failure f;
    if (LinearGrpoDevice(mem, stream, hidden, weight, bias, token_ids, mask, advantages, old_logp,
                         ref_logp, is_ratio, sampling_logp, scalars, shard, loss, metrics, logp,
                         entropy, gh, gw, gb, status, attrs, &f))
        return ffi::Error::Success();
    return Raise(f);
}

// fg_linear_logprobs: logp, entropy [B,T] (entropy [0]: not wanted).
bool LogprobsDevice(const DeviceMemory &mem, void *stream, Buf hidden, Buf weight, Buf bias,
                    Buf token_ids, Buf mask, Out &logp, Out &entropy,
                    const ffi::Dictionary &attrs, Failure *f) {
    Tokens tk;
    Head h;
    fg_linear_options lo;
    fg_exec ex;
    double temperature = 1.0;
    if (!DecodeDeviceHead(hidden, weight, bias, token_ids, mask, attrs, &tk, &h, &lo, &ex, f) ||
        !GetAttr(attrs, "temperature", &temperature, f) || !F32Sized(logp, h.N, "logp", f) ||
        (entropy->element_count() && !F32Sized(entropy, h.N, "entropy", f)))
        return false;
    PooledContext pc(mem.backend, stream);
    if (!DeviceContext(mem, pc, f))
        return false;
    const fg_status st =
        fg_linear_logprobs(pc.ctx, &lo, temperature, &h.in, &tk.t, F32(logp),
                           entropy->element_count() ? F32(entropy) : nullptr, &ex);
    return st == FG_OK || f->SetFrom(st, pc.ctx);
}

ffi::Error LogprobsOn(const DeviceMemory &mem, void *stream, Buf hidden, Buf weight, Buf bias,
                      Buf token_ids, Buf mask, Out logp, Out entropy, ffi::Dictionary attrs) {
    Failure f;
    if (LogprobsDevice(mem, stream, hidden, weight, bias, token_ids, mask, logp, entropy, attrs,
                       &f))
        return ffi::Error::Success();
    return Raise(f);
}

// fg_linear_logprobs_backward: grad_logp, grad_entropy [B,T] (grad_entropy
// [0]: 0) into grad_hidden [B,T,H], grad_weight [V,H], grad_bias [V] | [0].
bool LogprobsBackwardDevice(const DeviceMemory &mem, void *stream, Buf hidden, Buf weight,
                            Buf bias, Buf token_ids, Buf mask, Buf grad_logp, Buf grad_entropy,
                            Out &gh, Out &gw, Out &gb, const ffi::Dictionary &attrs, Failure *f) {
    Tokens tk;
    Head h;
    fg_linear_options lo;
    fg_exec ex;
    double temperature = 1.0;
    if (!DecodeDeviceHead(hidden, weight, bias, token_ids, mask, attrs, &tk, &h, &lo, &ex, f) ||
        !GetAttr(attrs, "temperature", &temperature, f) ||
        !F32Sized(grad_logp, h.N, "grad_logp", f) ||
        (grad_entropy.element_count() && !F32Sized(grad_entropy, h.N, "grad_entropy", f)))
        return false;
    fg_linear_grads g;
    std::memset(&g, 0, sizeof g);
    DeviceGradViews(h, gh, gw, gb, &g.grad_hidden, &g.grad_weight, &g.grad_bias);
    PooledContext pc(mem.backend, stream);
    if (!DeviceContext(mem, pc, f))
        return false;
    const fg_status st =
        fg_linear_logprobs_backward(pc.ctx, &lo, temperature, &h.in, &tk.t, F32In(grad_logp),
                                    OptF32(grad_entropy), &g, &ex);
    return st == FG_OK || f->SetFrom(st, pc.ctx);
}

ffi::Error LogprobsBackwardOn(const DeviceMemory &mem, void *stream, Buf hidden, Buf weight,
                              Buf bias, Buf token_ids, Buf mask, Buf grad_logp, Buf grad_entropy,
                              Out gh, Out gw, Out gb, ffi::Dictionary attrs) {
    Failure f;
    if (LogprobsBackwardDevice(mem, stream, hidden, weight, bias, token_ids, mask, grad_logp,
                               grad_entropy, gh, gw, gb, attrs, &f))
        return ffi::Error::Success();
    return Raise(f);
}

// The handlers' entry points: on the CUDA platform with the call's stream, and
// over the reference backend (host memory, no stream) for tests on the CPU.
ffi::Error LinearGrpoCudaImpl(void *stream, Buf hidden, Buf weight, Buf bias, Buf token_ids,
                              Buf mask, Buf advantages, Buf old_logp, Buf ref_logp, Buf is_ratio,
                              Buf sampling_logp, Buf scalars, Buf shard, Out loss, Out metrics,
                              Out logp, Out entropy, Out gh, Out gw, Out gb, Out status,
                              ffi::Dictionary attrs) {
    return LinearGrpoOn(kCuda, stream, hidden, weight, bias, token_ids, mask, advantages,
                        old_logp, ref_logp, is_ratio, sampling_logp, scalars, shard, loss,
                        metrics, logp, entropy, gh, gw, gb, status, attrs);
}

ffi::Error LinearGrpoOnReferenceImpl(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask,
                                     Buf advantages, Buf old_logp, Buf ref_logp, Buf is_ratio,
                                     Buf sampling_logp, Buf scalars, Buf shard, Out loss,
                                     Out metrics, Out logp, Out entropy, Out gh, Out gw, Out gb,
                                     Out status, ffi::Dictionary attrs) {
    return LinearGrpoOn(kReference, nullptr, hidden, weight, bias, token_ids, mask, advantages,
                        old_logp, ref_logp, is_ratio, sampling_logp, scalars, shard, loss,
                        metrics, logp, entropy, gh, gw, gb, status, attrs);
}

ffi::Error LogprobsCudaImpl(void *stream, Buf hidden, Buf weight, Buf bias, Buf token_ids,
                            Buf mask, Out logp, Out entropy, ffi::Dictionary attrs) {
    return LogprobsOn(kCuda, stream, hidden, weight, bias, token_ids, mask, logp, entropy, attrs);
}

ffi::Error LogprobsOnReferenceImpl(Buf hidden, Buf weight, Buf bias, Buf token_ids, Buf mask,
                                   Out logp, Out entropy, ffi::Dictionary attrs) {
    return LogprobsOn(kReference, nullptr, hidden, weight, bias, token_ids, mask, logp, entropy,
                      attrs);
}

ffi::Error LogprobsBackwardCudaImpl(void *stream, Buf hidden, Buf weight, Buf bias,
                                    Buf token_ids, Buf mask, Buf grad_logp, Buf grad_entropy,
                                    Out gh, Out gw, Out gb, ffi::Dictionary attrs) {
    return LogprobsBackwardOn(kCuda, stream, hidden, weight, bias, token_ids, mask, grad_logp,
                              grad_entropy, gh, gw, gb, attrs);
}

ffi::Error LogprobsBackwardOnReferenceImpl(Buf hidden, Buf weight, Buf bias, Buf token_ids,
                                           Buf mask, Buf grad_logp, Buf grad_entropy, Out gh,
                                           Out gw, Out gb, ffi::Dictionary attrs) {
    return LogprobsBackwardOn(kReference, nullptr, hidden, weight, bias, token_ids, mask,
                              grad_logp, grad_entropy, gh, gw, gb, attrs);
}

// The operand lists of the device handlers, after the stream (if any).
template <typename B>
auto BindLinearGrpo(B b) {
    return std::move(b).template Arg<Buf>()  // hidden
        .template Arg<Buf>()        // weight
        .template Arg<Buf>()        // bias
        .template Arg<Buf>()        // token_ids: s64 [B,T] | s32 [B,T,2]
        .template Arg<Buf>()        // mask
        .template Arg<Buf>()        // advantages
        .template Arg<Buf>()        // old_logp
        .template Arg<Buf>()        // ref_logp
        .template Arg<Buf>()        // is_ratio
        .template Arg<Buf>()        // sampling_logp
        .template Arg<Buf>()        // scalars
        .template Arg<Buf>()        // shard ([0])
        .template Ret<Buf>()        // loss
        .template Ret<Buf>()        // metrics
        .template Ret<Buf>()        // logp
        .template Ret<Buf>()        // entropy
        .template Ret<Buf>()        // grad_hidden
        .template Ret<Buf>()        // grad_weight
        .template Ret<Buf>()        // grad_bias
        .template Ret<Buf>()        // status (0)
        .Attrs();
}

template <typename B>
auto BindLogprobs(B b) {
    return std::move(b).template Arg<Buf>()  // hidden
        .template Arg<Buf>()        // weight
        .template Arg<Buf>()        // bias
        .template Arg<Buf>()        // token_ids: s64 [B,T] | s32 [B,T,2]
        .template Arg<Buf>()        // mask
        .template Ret<Buf>()        // logp
        .template Ret<Buf>()        // entropy
        .Attrs();
}

template <typename B>
auto BindLogprobsBackward(B b) {
    return std::move(b).template Arg<Buf>()  // hidden
        .template Arg<Buf>()        // weight
        .template Arg<Buf>()        // bias
        .template Arg<Buf>()        // token_ids: s64 [B,T] | s32 [B,T,2]
        .template Arg<Buf>()        // mask
        .template Arg<Buf>()        // grad_logp
        .template Arg<Buf>()        // grad_entropy
        .template Ret<Buf>()        // grad_hidden [B,T,H] f32
        .template Ret<Buf>()        // grad_weight [V,H] f32
        .template Ret<Buf>()        // grad_bias [V] | [0] f32
        .Attrs();
}

}  // namespace

// Time spent inside the C library by every call of these handlers so far:
// out[0] calls, out[1] seconds in the library, out[2] of those in GEMMs.
// jax.py reads it (call_totals()) to tell front-end overhead from C time.
extern "C" void FgJaxCallTotals(double *out) {
    std::lock_guard<std::mutex> lock(g_totals_mutex);
    out[0] = g_totals[0];
    out[1] = g_totals[1];
    out[2] = g_totals[2];
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FgLinearGrpo, LinearGrpoImpl,
                              ffi::Ffi::Bind()
                                  .Arg<Buf>()  // hidden
                                  .Arg<Buf>()  // weight
                                  .Arg<Buf>()  // bias
                                  .Arg<Buf>()  // token_ids
                                  .Arg<Buf>()  // mask
                                  .Arg<Buf>()  // advantages
                                  .Arg<Buf>()  // old_logp
                                  .Arg<Buf>()  // ref_logp
                                  .Arg<Buf>()  // is_ratio
                                  .Arg<Buf>()  // sampling_logp
                                  .Arg<Buf>()  // scalars
                                  .Arg<Buf>()  // shard
                                  .Ret<Buf>()  // loss
                                  .Ret<Buf>()  // metrics
                                  .Ret<Buf>()  // logp
                                  .Ret<Buf>()  // entropy
                                  .Ret<Buf>()  // grad_hidden
                                  .Ret<Buf>()  // grad_weight
                                  .Ret<Buf>()  // grad_bias
                                  .Ret<Buf>()  // status
                                  .Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FgShardStats, ShardStatsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<Buf>()  // hidden
                                  .Arg<Buf>()  // weight
                                  .Arg<Buf>()  // bias
                                  .Arg<Buf>()  // token_ids
                                  .Arg<Buf>()  // mask
                                  .Arg<Buf>()  // shard
                                  .Ret<Buf>()  // stats
                                  .Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FgShardRescale, ShardRescaleImpl,
                              ffi::Ffi::Bind()
                                  .Arg<Buf>()  // token_ids
                                  .Arg<Buf>()  // mask
                                  .Arg<Buf>()  // stats (after the MAX)
                                  .Arg<Buf>()  // shard
                                  .Ret<Buf>());  // stats (aliases the operand)

XLA_FFI_DEFINE_HANDLER_SYMBOL(FgShardFinish, ShardFinishImpl,
                              ffi::Ffi::Bind()
                                  .Arg<Buf>()    // token_ids
                                  .Arg<Buf>()    // mask
                                  .Arg<Buf>()    // stats (after the SUM)
                                  .Arg<Buf>()    // shard
                                  .Ret<Buf>()    // stats (aliases the operand)
                                  .Ret<Buf>()    // logp
                                  .Ret<Buf>());  // entropy

XLA_FFI_DEFINE_HANDLER_SYMBOL(FgLossFromLogp, LossFromLogpImpl,
                              ffi::Ffi::Bind()
                                  .Arg<Buf>()  // token_ids
                                  .Arg<Buf>()  // mask
                                  .Arg<Buf>()  // advantages
                                  .Arg<Buf>()  // old_logp
                                  .Arg<Buf>()  // ref_logp
                                  .Arg<Buf>()  // is_ratio
                                  .Arg<Buf>()  // sampling_logp
                                  .Arg<Buf>()  // scalars
                                  .Arg<Buf>()  // logp
                                  .Arg<Buf>()  // entropy
                                  .Arg<Buf>()  // status_in
                                  .Arg<Buf>()  // shard
                                  .Ret<Buf>()  // loss
                                  .Ret<Buf>()  // metrics
                                  .Ret<Buf>()  // grad_logp
                                  .Ret<Buf>()  // grad_entropy
                                  .Ret<Buf>()  // status
                                  .Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FgShardBackward, ShardBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<Buf>()  // hidden
                                  .Arg<Buf>()  // weight
                                  .Arg<Buf>()  // bias
                                  .Arg<Buf>()  // token_ids
                                  .Arg<Buf>()  // mask
                                  .Arg<Buf>()  // shard
                                  .Arg<Buf>()  // stats (after finish)
                                  .Arg<Buf>()  // grad_logp
                                  .Arg<Buf>()  // grad_entropy
                                  .Arg<Buf>()  // status_in
                                  .Ret<Buf>()  // grad_hidden (this shard's share)
                                  .Ret<Buf>()  // grad_weight
                                  .Ret<Buf>()  // grad_bias
                                  .Ret<Buf>()  // status
                                  .Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FgCheck, CheckImpl,
                              ffi::Ffi::Bind()
                                  .Arg<Buf>()  // status (MAX over the mesh)
                                  .Arg<Buf>()  // shard
                                  .RemainingArgs()    // the call's results
                                  .RemainingRets());  // ... the same (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(FgLinearGrpoCuda, LinearGrpoCudaImpl,
                              BindLinearGrpo(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void *>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FgLinearLogprobsCuda, LogprobsCudaImpl,
                              BindLogprobs(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void *>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FgLinearLogprobsBackwardCuda, LogprobsBackwardCudaImpl,
    BindLogprobsBackward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void *>>()));

// The device handlers' bodies over the reference backend on host memory, for
// the CPU platform (tests only: jax.py registers them on request).
XLA_FFI_DEFINE_HANDLER_SYMBOL(FgLinearGrpoOnReference, LinearGrpoOnReferenceImpl,
                              BindLinearGrpo(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FgLinearLogprobsOnReference, LogprobsOnReferenceImpl,
                              BindLogprobs(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FgLinearLogprobsBackwardOnReference,
                              LogprobsBackwardOnReferenceImpl,
                              BindLogprobsBackward(ffi::Ffi::Bind()));
