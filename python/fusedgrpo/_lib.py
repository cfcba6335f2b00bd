"""ctypes bindings of include/fusedgrpo.h and the pointer-level calls used by the
NumPy and PyTorch front ends. Nothing here copies a big array: callers hand in
raw pointers plus row strides; see ``linear_call``, ``linear_plan`` and
``logits_call``. Each thread has its own fg_context (``thread_context``); the
thread count and memory budget travel with every call in an fg_exec.
"""
from __future__ import annotations

import ctypes
import numbers
import os
import threading
from ctypes import (POINTER, Structure, c_char_p, c_double, c_int, c_int64, c_size_t, c_uint16,
                    c_uint64, c_void_p, c_float)

import numpy as np

__all__ = ["FusedGRPOError", "library_path", "lib", "METRIC_NAMES"]

# fg_metrics' fields, in order (checked against the library's offsets at load)
METRIC_NAMES = ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region",
                "cispo_clip_ratio", "clip_ratio_low_min", "clip_ratio_high_max",
                "vespo_phi_seq_mean", "policy_loss")
DTYPE_F32 = 0
DTYPE_BF16 = 1
IMPLS = {"fused": 0, "materialized": 1}


class FusedGRPOError(ValueError):
    """A call into the C library failed. ``status`` is the C status name
    (e.g. "FG_ERR_SHAPE_MISMATCH"), ``code`` its value, ``message`` the
    library's own message (fg_last_error)."""

    def __init__(self, status: str, message: str, code: int | None = None):
        text = message if message.startswith(status) else f"{status}: {message}"
        super().__init__(text)
        self.status = status
        self.code = STATUS_CODES.get(status, -1) if code is None else code
        self.message = message


# ------------------------------------------------------------------ structs
# Restated from fusedgrpo.h; _check_abi compares every field's offset and
# every size with the library's own (fg_abi_offsetof / fg_abi_sizeof).

class fg_matrix(Structure):
    _fields_ = [("data", c_void_p), ("dtype", c_int), ("rows", c_int64), ("cols", c_int64),
                ("ld", c_int64)]


class fg_vector(Structure):
    _fields_ = [("data", c_void_p), ("dtype", c_int), ("len", c_int64)]


class fg_loss_config(Structure):
    _fields_ = [("loss_type", c_int), ("importance_sampling_level", c_int),
                ("temperature", c_double), ("epsilon_low", c_double), ("epsilon_high", c_double),
                ("delta", c_double), ("beta", c_double), ("max_completion_length", c_int64),
                ("num_items_in_batch", c_double), ("sapo_temperature_pos", c_double),
                ("sapo_temperature_neg", c_double), ("use_bias_correction_kl", c_int),
                ("entropy_coef", c_double), ("vespo_k_pos", c_double),
                ("vespo_lambda_pos", c_double), ("vespo_k_neg", c_double),
                ("vespo_lambda_neg", c_double), ("off_policy_mask_threshold", c_double),
                ("top_entropy_quantile", c_double)]


class fg_batch(Structure):
    _fields_ = [("batch", c_int64), ("seq_len", c_int64), ("token_ids", c_void_p),
                ("mask", c_void_p), ("advantages", c_void_p), ("old_logp", c_void_p),
                ("ref_logp", c_void_p), ("is_ratio", c_void_p), ("is_ratio_per_sequence", c_int),
                ("sampling_logp", c_void_p)]


class fg_metrics(Structure):
    _fields_ = [(n, c_double) for n in METRIC_NAMES]


class fg_linear_outputs(Structure):
    _fields_ = [("loss", c_double), ("metrics", fg_metrics), ("logp", c_void_p),
                ("entropy", c_void_p), ("grad_hidden", fg_matrix), ("grad_weight", fg_matrix),
                ("grad_bias", fg_vector), ("accumulate", c_int)]


class fg_logits_outputs(Structure):
    _fields_ = [("loss", c_double), ("metrics", fg_metrics), ("logp", c_void_p),
                ("entropy", c_void_p), ("grad_logits", fg_matrix)]


class fg_communicator(Structure):
    _fields_ = [("allreduce", c_void_p), ("user", c_void_p)]


class fg_context_options(Structure):
    _fields_ = [("backend", c_int), ("threads", c_int), ("memory_budget", c_size_t),
                ("check_finite", c_int), ("stream", c_void_p), ("comm", fg_communicator)]


class fg_exec(Structure):
    _fields_ = [("threads", c_int), ("memory_budget", c_size_t), ("workspace", c_void_p),
                ("workspace_bytes", c_size_t), ("device_report", c_void_p)]


class fg_memory_stats(Structure):
    _fields_ = [("current_bytes", c_size_t), ("peak_bytes", c_size_t), ("budget_bytes", c_size_t),
                ("chunk_rows", c_int64), ("chunks", c_int64), ("gemm_flops", c_int64),
                ("gemm_seconds", c_double), ("call_seconds", c_double),
                ("dlogits_entries", c_int64), ("dlogits_kept", c_int64)]


class fg_linear_inputs(Structure):
    _fields_ = [("hidden", fg_matrix), ("weight", fg_matrix), ("bias", fg_vector),
                ("vocab_start", c_int64), ("vocab_total", c_int64)]


class fg_linear_options(Structure):
    _fields_ = [("impl", c_int), ("round_logits_to_input_dtype", c_int), ("filter_eps", c_double)]


class _FilterEpsAuto(float):
    """FG_FILTER_EPS_AUTO (-1.0), the C value of ``filter_eps="auto"``, as
    filter_eps_value returns it. A front end that hands its checked value on
    to another (JAX's host callback into the NumPy functions) passes this very
    object, which filter_eps_value takes back; a caller's own -1 is refused."""
    __slots__ = ()

    def __repr__(self):
        return "FILTER_EPS_AUTO"


FILTER_EPS_AUTO = _FilterEpsAuto(-1.0)  # FG_FILTER_EPS_AUTO
_FILTER_EPS_VALID = "'auto', None or 0 (off), or a number in [0, 1]"


def filter_eps_value(filter_eps, name: str = "filter_eps") -> float:
    """fg_linear_options.filter_eps of a caller's ``filter_eps``: "auto" (the
    library's default for the dtype: FILTER_EPS_AUTO), None or 0 (off), or a
    threshold in (0, 1] (docs/LOSS_SPEC.md "Gradient filtering"). Anything
    else raises FusedGRPOError, as every other option does: a bool (True is
    not 1.0), a negative number (-1 is the C sentinel, not a spelling of
    "auto"), NaN, a string other than "auto". The message names ``name``
    (the TRL trainer's attribute is fusedgrpo_filter_eps)."""
    if filter_eps is FILTER_EPS_AUTO:
        return filter_eps
    if isinstance(filter_eps, str):
        if filter_eps != "auto":
            raise FusedGRPOError("FG_ERR_BAD_HYPERPARAMETER",
                                 f"{name} must be {_FILTER_EPS_VALID}, got {filter_eps!r}")
        return FILTER_EPS_AUTO
    if filter_eps is None:
        return 0.0
    if (isinstance(filter_eps, (bool, np.bool_)) or not isinstance(filter_eps, numbers.Real)
            or not 0.0 <= float(filter_eps) <= 1.0):
        raise FusedGRPOError("FG_ERR_BAD_HYPERPARAMETER",
                             f"{name} must be {_FILTER_EPS_VALID}, got {filter_eps!r}")
    return float(filter_eps) + 0.0  # -0.0 is 0.0


def _options_filter_eps(value) -> float:
    """filter_eps_value for the raw-address calls below, which front ends feed
    with the value they checked: FG_FILTER_EPS_AUTO also as a plain -1.0, the
    form it takes through a torch custom op's float argument."""
    if isinstance(value, float) and not isinstance(value, bool) and value == FILTER_EPS_AUTO:
        return FILTER_EPS_AUTO
    return filter_eps_value(value)


def check_impl(impl, name: str = "impl") -> str:
    """impl, one of IMPLS ("fused", "materialized"), or FusedGRPOError
    (FG_ERR_UNSUPPORTED) naming ``name`` (the TRL trainer's fusedgrpo_impl)."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise FusedGRPOError("FG_ERR_UNSUPPORTED",
                             f"unknown {name} {impl!r}; one of {tuple(IMPLS)}")
    return impl


def vocab_index(name: str, value) -> int:
    """A vocabulary position or size (vocab_start, vocab_size) as an int: an
    integer, not a bool, never a float truncated by int() (5.7 is refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH",
                             f"{name} must be an integer, got {value!r}")
    return int(value)


class fg_linear_plan_info(Structure):
    _fields_ = [("chunk_rows", c_int64), ("chunks", c_int64), ("working_bytes", c_size_t),
                ("fixed_bytes", c_size_t), ("chunk_bytes", c_size_t),
                ("gemm_scratch_bytes", c_size_t), ("min_budget_bytes", c_size_t),
                ("gemm_dtype", c_int), ("later_chunk_rows", c_int64),
                ("grad_weight_sum_bytes", c_size_t)]


# Every struct the library reads or writes through a pointer from here. A
# ctypes copy smaller than the C struct lets the library write past a Python
# buffer (heap corruption that surfaces later, in the garbage collector), and
# one with a field at another offset reads or writes the wrong field, so any
# mismatch refuses to load.
class fg_tokens(Structure):
    _fields_ = [("batch", c_int64), ("seq_len", c_int64), ("token_ids", c_void_p),
                ("mask", c_void_p)]


class fg_linear_grads(Structure):
    _fields_ = [("grad_hidden", fg_matrix), ("grad_weight", fg_matrix), ("grad_bias", fg_vector),
                ("accumulate", c_int)]


class fg_logp_outputs(Structure):
    _fields_ = [("loss", c_double), ("metrics", fg_metrics), ("grad_logp", c_void_p),
                ("grad_entropy", c_void_p)]


class fg_device_report(Structure):
    _fields_ = [("failed", c_uint64), ("seq_len", c_int64), ("vocab", c_int64),
                ("value", c_double * 2), ("loss", c_double), ("metrics", fg_metrics),
                ("dlogits_kept", c_int64)]


ABI_STRUCTS = (fg_matrix, fg_vector, fg_loss_config, fg_batch, fg_metrics, fg_linear_outputs,
               fg_logits_outputs, fg_communicator, fg_context_options, fg_exec, fg_memory_stats,
               fg_linear_inputs, fg_linear_options, fg_linear_plan_info, fg_tokens,
               fg_linear_grads, fg_logp_outputs, fg_device_report)


def shard_stats_floats(n: int) -> int:
    """Floats of the phase API's statistics buffer for n = B*T tokens (FG_SHARD_STATS_FLOATS)."""
    return 13 * n + 1


def shard_stats_ranges(n: int):
    """(max_count, sum_offset, sum_count, status_index) of the statistics buffer: the
    MAX-reduced range [0, max_count), the SUM-reduced range, and the status slot
    (fusedgrpo.h, "phases of a vocab-sharded call")."""
    return 2 * n + 1, 2 * n + 1, 8 * n, 2 * n


# ------------------------------------------------------------------ loading

_HERE = os.path.dirname(os.path.abspath(__file__))


def _candidates():
    env = os.environ.get("FUSEDGRPO_LIBRARY")
    if env:
        yield env
        return
    for name in ("libfusedgrpo.so.0", "libfusedgrpo.so"):
        yield os.path.join(_HERE, name)
    # A source checkout: python/fusedgrpo -> <repo>/build
    repo = os.path.dirname(os.path.dirname(_HERE))
    for name in ("libfusedgrpo.so.0", "libfusedgrpo.so"):
        yield os.path.join(repo, "build", name)


def library_path() -> str:
    """The path of the libfusedgrpo shared library this package uses."""
    tried = []
    for p in _candidates():
        if os.path.isfile(p):
            return os.path.abspath(p)
        tried.append(p)
    raise ImportError("fusedgrpo: cannot find libfusedgrpo.so (tried: %s); install the package "
                      "with `pip install .` or set FUSEDGRPO_LIBRARY" % ", ".join(tried))


def include_dir() -> str:
    """A directory holding fusedgrpo.h (for building extensions against the library)."""
    for d in (os.path.join(_HERE, "include"),
              os.path.join(os.path.dirname(os.path.dirname(_HERE)), "include")):
        if os.path.isfile(os.path.join(d, "fusedgrpo.h")):
            return d
    raise FileNotFoundError("fusedgrpo.h not found next to the package")


def _load():
    # RTLD_GLOBAL: extensions loaded later (the JAX FFI handler) resolve fg_* here.
    path = library_path()
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    P = POINTER
    sig = {
        "fg_status_name": (c_char_p, [c_int]),
        "fg_last_error": (c_char_p, [c_void_p]),
        "fg_context_create_error": (c_char_p, []),
        "fg_loss_config_init": (None, [P(fg_loss_config)]),
        "fg_loss_type_name": (c_char_p, [c_int]),
        "fg_is_level_name": (c_char_p, [c_int]),
        "fg_context_options_init": (None, [P(fg_context_options)]),
        "fg_context_create": (c_int, [P(fg_context_options), P(c_void_p)]),
        "fg_context_destroy": (None, [c_void_p]),
        "fg_exec_init": (None, [P(fg_exec)]),
        "fg_get_memory_stats": (c_int, [c_void_p, P(fg_memory_stats)]),
        "fg_reset_peak_memory": (None, [c_void_p]),
        "fg_release_workspace": (None, [c_void_p]),
        "fg_linear_grpo": (c_int, [c_void_p, P(fg_linear_options), P(fg_loss_config),
                                   P(fg_linear_inputs), P(fg_batch), P(fg_linear_outputs),
                                   P(fg_exec)]),
        "fg_linear_grpo_plan": (c_int, [c_void_p, P(fg_linear_options), P(fg_loss_config),
                                        P(fg_linear_inputs), P(fg_batch), P(fg_linear_outputs),
                                        P(fg_exec), P(fg_linear_plan_info)]),
        "fg_logits_grpo": (c_int, [c_void_p, P(fg_loss_config), P(fg_matrix), P(fg_batch),
                                   P(fg_logits_outputs), P(fg_exec)]),
        "fg_linear_logprobs": (c_int, [c_void_p, P(fg_linear_options), c_double,
                                       P(fg_linear_inputs), P(fg_tokens), c_void_p, c_void_p,
                                       P(fg_exec)]),
        "fg_linear_logprobs_backward": (c_int, [c_void_p, P(fg_linear_options), c_double,
                                                P(fg_linear_inputs), P(fg_tokens), c_void_p,
                                                c_void_p, P(fg_linear_grads), P(fg_exec)]),
        "fg_linear_shard_stats": (c_int, [c_void_p, P(fg_linear_options), c_double,
                                          P(fg_linear_inputs), P(fg_tokens), c_void_p,
                                          P(fg_exec)]),
        "fg_shard_stats_rescale": (c_int, [c_void_p, P(fg_tokens), c_void_p]),
        "fg_shard_stats_finish": (c_int, [c_void_p, P(fg_tokens), c_void_p, c_void_p, c_void_p]),
        "fg_grpo_loss_from_logp": (c_int, [c_void_p, P(fg_loss_config), P(fg_batch), c_void_p,
                                           c_void_p, P(fg_logp_outputs), P(fg_exec)]),
        "fg_linear_shard_backward": (c_int, [c_void_p, P(fg_linear_options), c_double,
                                             P(fg_linear_inputs), P(fg_tokens), c_void_p,
                                             c_void_p, c_void_p, P(fg_linear_grads),
                                             P(fg_exec)]),
        "fg_device_report_status": (c_int, [P(fg_device_report), c_char_p, c_size_t]),
        "fg_f32_to_bf16": (c_uint16, [c_float]),
        "fg_bf16_to_f32": (c_float, [c_uint16]),
        "fg_abi_sizeof": (c_size_t, [c_char_p]),
        "fg_abi_offsetof": (c_int64, [c_char_p, c_char_p]),
    }
    missing = [name for name in sig if not hasattr(lib, name)]
    if missing:
        raise ImportError(f"fusedgrpo: libfusedgrpo at {path} lacks {', '.join(missing)}: it is "
                          "from another version than this package; rebuild or reinstall both")
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
    _check_abi(lib, ABI_STRUCTS)
    return lib


def abi_mismatches(lib, structs) -> list:
    """How the ctypes structs differ from the library's: one line per struct whose
    size differs and per field whose offset differs or that the library lacks."""
    bad = []
    for st in structs:
        name = st.__name__.encode()
        c_size = lib.fg_abi_sizeof(name)
        if c_size != ctypes.sizeof(st):
            bad.append(f"{st.__name__}: library {c_size} bytes, binding {ctypes.sizeof(st)}")
        for field, _ in st._fields_:
            c_offset = lib.fg_abi_offsetof(name, field.encode())
            py_offset = getattr(st, field).offset
            if c_offset < 0:
                bad.append(f"{st.__name__}.{field}: not in the library")
            elif c_offset != py_offset:
                bad.append(f"{st.__name__}.{field}: library offset {c_offset}, binding "
                           f"{py_offset}")
    return bad


def _check_abi(lib, structs):
    bad = abi_mismatches(lib, structs)
    if bad:
        raise ImportError("fusedgrpo: the ctypes structs do not match libfusedgrpo at "
                          f"{library_path()} ({'; '.join(bad)}); rebuild or reinstall both")


lib = _load()


def status_name(code: int) -> str:
    return lib.fg_status_name(code).decode()


def _status_codes() -> dict:
    codes = {}
    while (name := status_name(len(codes))) != "FG_ERR_UNKNOWN_STATUS":
        codes[name] = len(codes)
    return codes


STATUS_CODES = _status_codes()  # "FG_ERR_SHAPE_MISMATCH" -> 4


# ------------------------------------------------------------------ contexts

class Context:
    """One fg_context. A context serves one thread at a time; thread_context()
    gives each thread its own."""

    def __init__(self, backend: int = 0, stream: int = 0):
        """backend: BACKENDS' value (0: the CPU); stream: a cudaStream_t as an
        int for BACKENDS["cuda"] (0: the default stream)."""
        opts = fg_context_options()
        lib.fg_context_options_init(ctypes.byref(opts))
        opts.backend = backend
        opts.stream = stream or None
        h = c_void_p()
        st = lib.fg_context_create(ctypes.byref(opts), ctypes.byref(h))
        if st != 0:
            # The library's message ("<STATUS>: why"), e.g. where it looked for the
            # CUDA backend's library.
            why = lib.fg_context_create_error()
            raise FusedGRPOError(status_name(st), why.decode(errors="replace") if why else
                                 "fg_context_create failed")
        self.handle = h

    def check(self, st: int):
        if st != 0:
            msg = lib.fg_last_error(self.handle)
            raise FusedGRPOError(status_name(st), msg.decode(errors="replace") if msg else "")

    def memory_stats(self) -> dict:
        s = fg_memory_stats()
        self.check(lib.fg_get_memory_stats(self.handle, ctypes.byref(s)))
        return {n: getattr(s, n) for n, _ in fg_memory_stats._fields_}

    def reset_peak_memory(self):
        lib.fg_reset_peak_memory(self.handle)

    def release_workspace(self):
        lib.fg_release_workspace(self.handle)

    def __del__(self):
        h = getattr(self, "handle", None)
        if h is not None and lib is not None:
            lib.fg_context_destroy(h)
            self.handle = None


_per_thread = threading.local()


# fg_backend: where a context's calls run (fusedgrpo.h).
BACKENDS = {"cpu": 0, "cuda": 1, "reference": 2}


def thread_context() -> Context:
    """The calling thread's context, made at its first call and destroyed with
    the thread. Threads and budget are per call (make_exec), so one context per
    thread serves every setting, and threads never wait for one another."""
    ctx = getattr(_per_thread, "context", None)
    if ctx is None:
        ctx = _per_thread.context = Context()
    return ctx


def device_context(backend: str, stream: int = 0) -> Context:
    """The calling thread's context on a backend behind the seam (its pointers
    are that backend's memory), one per (backend, stream): a CUDA context is
    bound to the stream it was made with, and to the device current then."""
    cache = getattr(_per_thread, "devices", None)
    if cache is None:
        cache = _per_thread.devices = {}
    key = (backend, stream)
    if key not in cache:
        cache[key] = Context(BACKENDS[backend], stream)
    return cache[key]


# ------------------------------------------------------------------ calls

def _mat(ptr, dtype, rows, cols, ld):
    return fg_matrix(ptr or None, dtype, rows, cols, ld)


def _batch(B, T, token_ids, mask, advantages, old_logp, ref_logp, is_ratio,
           is_ratio_per_sequence, sampling_logp=None):
    return fg_batch(B, T, token_ids, mask, advantages, old_logp or None, ref_logp or None,
                    is_ratio or None, 1 if is_ratio_per_sequence else 0, sampling_logp or None)


def _metrics(m: fg_metrics) -> dict:
    return {n: getattr(m, n) for n in METRIC_NAMES}


def _linear_request(impl, *, B, T, H, V, dtype, hidden, ld_hidden, weight, ld_weight, bias,
                    token_ids, mask, advantages, old_logp, ref_logp, is_ratio,
                    is_ratio_per_sequence, logp, entropy, grad_hidden, grad_weight, grad_bias,
                    vocab_start=0, vocab_total=0, sampling_logp=0, grad_dtypes=None,
                    filter_eps=0.0):
    """(options, inputs, batch, outputs) of fg_linear_grpo on raw addresses.
    grad_dtypes: the DTYPE_* of grad_hidden, grad_weight, grad_bias (default f32);
    filter_eps: a value filter_eps_value returned (FILTER_EPS_AUTO: -1.0)."""
    options = fg_linear_options(IMPLS[check_impl(impl)], 0, _options_filter_eps(filter_eps))
    inputs = fg_linear_inputs(_mat(hidden, dtype, B * T, H, ld_hidden),
                              _mat(weight, dtype, V, H, ld_weight),
                              fg_vector(bias or None, dtype, V),
                              vocab_index("vocab_start", vocab_start),
                              vocab_index("vocab_total", vocab_total))
    batch = _batch(B, T, token_ids, mask, advantages, old_logp, ref_logp, is_ratio,
                   is_ratio_per_sequence, sampling_logp)
    out = fg_linear_outputs()
    out.logp = logp or None
    out.entropy = entropy or None
    gdt = grad_dtypes or (DTYPE_F32, DTYPE_F32, DTYPE_F32)  # hidden, weight, bias
    out.grad_hidden = _mat(grad_hidden, gdt[0], B * T, H, H)
    out.grad_weight = _mat(grad_weight, gdt[1], V, H, H)
    out.grad_bias = fg_vector(grad_bias or None, gdt[2], V)
    return options, inputs, batch, out


def linear_call(cfg: fg_loss_config, impl: str, exec_: fg_exec, ctx: Context = None,
                **arrays):
    """fg_linear_grpo on raw addresses (ints; 0 = absent; see _linear_request)
    on the calling thread's context. Returns (loss, metrics)."""
    options, inputs, batch, out = _linear_request(impl, **arrays)
    ctx = ctx or thread_context()
    ctx.check(lib.fg_linear_grpo(ctx.handle, ctypes.byref(options), ctypes.byref(cfg),
                                 ctypes.byref(inputs), ctypes.byref(batch), ctypes.byref(out),
                                 ctypes.byref(exec_)))
    return out.loss, _metrics(out.metrics)


def device_report_status(raw: bytes):
    """(status name, message) of a device-reported call from its record's
    bytes, copied to the host (fg_device_report_status)."""
    rec = fg_device_report.from_buffer_copy(raw)
    buf = ctypes.create_string_buffer(1024)
    st = lib.fg_device_report_status(ctypes.byref(rec), buf, len(buf))
    return status_name(st), buf.value.decode(errors="replace")


# The planner only looks at which outputs are wanted (a non-NULL address) and
# their shapes; it writes none of them (fusedgrpo.h). This stands in for the
# gradient buffers, which the plan's caller need not allocate.
_PLAN_PLACEHOLDER = (c_float * 1)()


def linear_plan(cfg: fg_loss_config, impl: str, exec_: fg_exec, *, want_grad_hidden: bool,
                want_grad_weight: bool, want_grad_bias: bool, **arrays) -> dict:
    """fg_linear_grpo_plan for the call linear_call would make with these inputs,
    gradients wanted as flagged. Returns fg_linear_plan_info as a dict; a budget
    below min_budget_bytes raises FusedGRPOError with that dict as ``.plan``."""
    wanted = ctypes.addressof(_PLAN_PLACEHOLDER)
    options, inputs, batch, out = _linear_request(
        impl, logp=0, entropy=0, grad_hidden=wanted if want_grad_hidden else 0,
        grad_weight=wanted if want_grad_weight else 0,
        grad_bias=wanted if want_grad_bias else 0, **arrays)
    info = fg_linear_plan_info()
    ctx = thread_context()
    st = lib.fg_linear_grpo_plan(ctx.handle, ctypes.byref(options), ctypes.byref(cfg),
                                 ctypes.byref(inputs), ctypes.byref(batch), ctypes.byref(out),
                                 ctypes.byref(exec_), ctypes.byref(info))
    plan = {n: getattr(info, n) for n, _ in fg_linear_plan_info._fields_}
    try:
        ctx.check(st)
    except FusedGRPOError as e:
        e.plan = plan
        raise
    return plan


def logits_call(cfg: fg_loss_config, exec_: fg_exec, *, B, T, V, dtype, logits, ld_logits,
                token_ids, mask, advantages, old_logp, ref_logp, is_ratio,
                is_ratio_per_sequence, logp, entropy, grad_logits, ld_grad_logits, grad_dtype,
                sampling_logp=0):
    """fg_logits_grpo on raw addresses on the calling thread's context. Returns
    (loss, metrics)."""
    batch = _batch(B, T, token_ids, mask, advantages, old_logp, ref_logp, is_ratio,
                   is_ratio_per_sequence, sampling_logp)
    lg = _mat(logits, dtype, B * T, V, ld_logits)
    out = fg_logits_outputs()
    out.logp = logp or None
    out.entropy = entropy or None
    out.grad_logits = _mat(grad_logits, grad_dtype, B * T, V, ld_grad_logits)
    ctx = thread_context()
    ctx.check(lib.fg_logits_grpo(ctx.handle, ctypes.byref(cfg), ctypes.byref(lg),
                                 ctypes.byref(batch), ctypes.byref(out), ctypes.byref(exec_)))
    return out.loss, _metrics(out.metrics)


def _head_request(impl, *, B, T, H, V, dtype, hidden, ld_hidden, weight, ld_weight, bias,
                  token_ids, mask, filter_eps=0.0):
    """(options, inputs, tokens) of the head-only entry points on raw addresses."""
    options = fg_linear_options(IMPLS[check_impl(impl)], 0, _options_filter_eps(filter_eps))
    inputs = fg_linear_inputs(_mat(hidden, dtype, B * T, H, ld_hidden),
                              _mat(weight, dtype, V, H, ld_weight),
                              fg_vector(bias or None, dtype, V), 0, 0)
    return options, inputs, fg_tokens(B, T, token_ids or None, mask or None)


def logprobs_call(impl: str, exec_: fg_exec, temperature: float, *, logp, entropy, ctx=None,
                  **arrays):
    """fg_linear_logprobs on raw addresses (see _head_request) on the calling
    thread's context: writes logp / entropy [B, T] (0 = not wanted)."""
    options, inputs, tokens = _head_request(impl, **arrays)
    ctx = ctx or thread_context()
    ctx.check(lib.fg_linear_logprobs(ctx.handle, ctypes.byref(options), float(temperature),
                                     ctypes.byref(inputs), ctypes.byref(tokens), logp or None,
                                     entropy or None, ctypes.byref(exec_)))


def logprobs_backward_call(impl: str, exec_: fg_exec, temperature: float, *, grad_logp,
                           grad_entropy, grad_hidden, grad_weight, grad_bias, grad_dtypes,
                           accumulate=False, ctx=None, **arrays):
    """fg_linear_logprobs_backward on raw addresses: the caller's per-token
    dL/dlogp (and dL/dentropy, 0: none) into grad_hidden / grad_weight /
    grad_bias (0: not wanted), in grad_dtypes (DTYPE_* of each)."""
    options, inputs, tokens = _head_request(impl, **arrays)
    B, T, H, V = (arrays[k] for k in "BTHV")
    grads = fg_linear_grads(_mat(grad_hidden, grad_dtypes[0], B * T, H, H),
                            _mat(grad_weight, grad_dtypes[1], V, H, H),
                            fg_vector(grad_bias or None, grad_dtypes[2], V), 1 if accumulate else 0)
    ctx = ctx or thread_context()
    ctx.check(lib.fg_linear_logprobs_backward(
        ctx.handle, ctypes.byref(options), float(temperature), ctypes.byref(inputs),
        ctypes.byref(tokens), grad_logp or None, grad_entropy or None, ctypes.byref(grads),
        ctypes.byref(exec_)))
