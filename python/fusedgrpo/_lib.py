"""ctypes bindings of include/fusedgrpo.h and the pointer-level call used by every
front end (NumPy, PyTorch). Nothing here copies a big array: callers hand in
raw pointers plus row strides; see ``linear_call`` and ``logits_call``.
"""
from __future__ import annotations

import ctypes
import inspect
import os
import threading
from ctypes import (POINTER, Structure, c_char_p, c_double, c_int, c_int64, c_size_t, c_uint16,
                    c_void_p, c_float, CFUNCTYPE)

__all__ = ["FusedGRPOError", "library_path", "lib", "LOSS_TYPES", "LEVELS", "METRIC_NAMES"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
LEVELS = ("token", "sequence")
METRIC_NAMES = ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region",
                "cispo_clip_ratio")
DTYPE_F32 = 0
DTYPE_BF16 = 1
IMPLS = {"fused": 0, "materialized": 1}


class FusedGRPOError(ValueError):
    """A call into the C library failed. ``status`` is the C status name
    (e.g. "FG_ERR_SHAPE_MISMATCH"), ``code`` its value, ``message`` the
    library's own message (fg_last_error)."""

    def __init__(self, status: str, message: str, code: int = -1):
        text = message if message.startswith(status) else f"{status}: {message}"
        super().__init__(text)
        self.status = status
        self.code = code
        self.message = message


# ------------------------------------------------------------------ structs

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
                ("entropy_coef", c_double)]


class fg_batch(Structure):
    _fields_ = [("batch", c_int64), ("seq_len", c_int64), ("token_ids", c_void_p),
                ("mask", c_void_p), ("advantages", c_void_p), ("old_logp", c_void_p),
                ("ref_logp", c_void_p), ("is_ratio", c_void_p), ("is_ratio_per_sequence", c_int)]


class fg_metrics(Structure):
    _fields_ = [(n, c_double) for n in METRIC_NAMES]


class fg_outputs(Structure):
    _fields_ = [("loss", c_double), ("metrics", fg_metrics), ("logp", c_void_p),
                ("entropy", c_void_p), ("grad_hidden", fg_matrix), ("grad_weight", fg_matrix),
                ("grad_bias", fg_vector), ("grad_logits", fg_matrix)]


ALLREDUCE_FN = CFUNCTYPE(c_int, c_void_p, POINTER(c_float), c_int64, c_int)


class fg_communicator(Structure):
    _fields_ = [("allreduce", c_void_p), ("user", c_void_p)]


class fg_context_options(Structure):
    _fields_ = [("backend", c_int), ("threads", c_int), ("memory_budget", c_size_t),
                ("check_finite", c_int), ("stream", c_void_p), ("comm", fg_communicator)]


class fg_memory_stats(Structure):
    _fields_ = [("current_bytes", c_size_t), ("peak_bytes", c_size_t), ("budget_bytes", c_size_t),
                ("chunk_rows", c_int64), ("chunks", c_int64), ("gemm_flops", c_int64),
                ("gemm_seconds", c_double), ("call_seconds", c_double)]


class fg_linear_inputs(Structure):
    _fields_ = [("hidden", fg_matrix), ("weight", fg_matrix), ("bias", fg_vector),
                ("vocab_start", c_int64), ("vocab_total", c_int64)]


class fg_linear_options(Structure):
    _fields_ = [("impl", c_int), ("round_logits_to_input_dtype", c_int)]


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
    lib = ctypes.CDLL(library_path(), mode=ctypes.RTLD_GLOBAL)
    P = POINTER
    sig = {
        "fg_status_name": (c_char_p, [c_int]),
        "fg_last_error": (c_char_p, [c_void_p]),
        "fg_loss_config_init": (None, [P(fg_loss_config)]),
        "fg_context_options_init": (None, [P(fg_context_options)]),
        "fg_context_create": (c_int, [P(fg_context_options), P(c_void_p)]),
        "fg_context_destroy": (None, [c_void_p]),
        "fg_context_set_threads": (c_int, [c_void_p, c_int]),
        "fg_context_set_memory_budget": (c_int, [c_void_p, c_size_t]),
        "fg_get_memory_stats": (c_int, [c_void_p, P(fg_memory_stats)]),
        "fg_reset_peak_memory": (None, [c_void_p]),
        "fg_release_workspace": (None, [c_void_p]),
        "fg_linear_grpo": (c_int, [c_void_p, P(fg_linear_options), P(fg_loss_config),
                                   P(fg_linear_inputs), P(fg_batch), P(fg_outputs)]),
        "fg_logits_grpo": (c_int, [c_void_p, P(fg_loss_config), P(fg_matrix), P(fg_batch),
                                   P(fg_outputs)]),
        "fg_f32_to_bf16": (c_uint16, [c_float]),
        "fg_bf16_to_f32": (c_float, [c_uint16]),
        "fg_abi_sizeof": (c_size_t, [c_char_p]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
    _check_abi(lib)
    return lib


# Every struct the library reads or writes through a pointer from here. A
# ctypes copy smaller than the C struct lets the library write past a Python
# buffer (heap corruption that surfaces later, in the garbage collector), so a
# mismatch refuses to load.
ABI_STRUCTS = (fg_matrix, fg_vector, fg_loss_config, fg_batch, fg_metrics, fg_outputs,
               fg_communicator, fg_context_options, fg_memory_stats, fg_linear_inputs,
               fg_linear_options)


def _check_abi(lib):
    bad = []
    for st in ABI_STRUCTS:
        c_size = lib.fg_abi_sizeof(st.__name__.encode())
        if c_size != ctypes.sizeof(st):
            bad.append(f"{st.__name__}: library {c_size} bytes, binding {ctypes.sizeof(st)}")
    if bad:
        raise ImportError("fusedgrpo: the ctypes structs do not match libfusedgrpo at "
                          f"{library_path()} ({'; '.join(bad)}); rebuild or reinstall both")


lib = _load()


def status_name(code: int) -> str:
    return lib.fg_status_name(code).decode()


# ------------------------------------------------------------------ contexts

class Context:
    """One fg_context plus the lock that serializes its use (a context is used
    by one thread at a time)."""

    def __init__(self, threads: int = 0, memory_budget: int = 0, check_finite: bool = True,
                 comm: fg_communicator | None = None):
        opts = fg_context_options()
        lib.fg_context_options_init(ctypes.byref(opts))
        opts.threads = int(threads or 0)
        opts.memory_budget = int(memory_budget or 0)
        opts.check_finite = 1 if check_finite else 0
        if comm is not None:
            opts.comm = comm
        h = c_void_p()
        st = lib.fg_context_create(ctypes.byref(opts), ctypes.byref(h))
        if st != 0:
            raise FusedGRPOError(status_name(st), "fg_context_create failed", st)
        self.handle = h
        self.lock = threading.Lock()

    def check(self, st: int):
        if st != 0:
            msg = lib.fg_last_error(self.handle)
            raise FusedGRPOError(status_name(st), msg.decode(errors="replace") if msg else "", st)

    def memory_stats(self) -> dict:
        s = fg_memory_stats()
        with self.lock:
            self.check(lib.fg_get_memory_stats(self.handle, ctypes.byref(s)))
        return {n: getattr(s, n) for n, _ in fg_memory_stats._fields_}

    def __del__(self):
        h = getattr(self, "handle", None)
        if h is not None and lib is not None:
            lib.fg_context_destroy(h)
            self.handle = None


_contexts: dict = {}
_contexts_lock = threading.Lock()


def get_context(threads=None, memory_budget=None) -> Context:
    """The module-level cached context for (threads, memory_budget)."""
    key = (int(threads or 0), int(memory_budget or 0))
    with _contexts_lock:
        c = _contexts.get(key)
        if c is None:
            c = _contexts[key] = Context(*key)
        return c


# ------------------------------------------------------------------ config

def make_config(*, loss_type="dapo", importance_sampling_level="token", beta=0.0,
                epsilon_low=0.2, epsilon_high=None, delta=None, temperature=1.0,
                max_completion_length=None, num_items_in_batch=None, sapo_temperature_pos=1.0,
                sapo_temperature_neg=1.05, use_bias_correction_kl=False,
                entropy_coef=0.0) -> fg_loss_config:
    cfg = fg_loss_config()
    lib.fg_loss_config_init(ctypes.byref(cfg))
    try:
        cfg.loss_type = LOSS_TYPES.index(loss_type)
    except ValueError:
        raise FusedGRPOError("FG_ERR_UNKNOWN_LOSS_TYPE",
                             f"unknown loss_type {loss_type!r}; one of {LOSS_TYPES}", 8) from None
    try:
        cfg.importance_sampling_level = LEVELS.index(importance_sampling_level)
    except ValueError:
        raise FusedGRPOError("FG_ERR_UNKNOWN_LEVEL",
                             f"unknown importance_sampling_level {importance_sampling_level!r}; "
                             f"one of {LEVELS}", 9) from None
    cfg.temperature = float(temperature)
    cfg.epsilon_low = float(epsilon_low)
    cfg.epsilon_high = -1.0 if epsilon_high is None else float(epsilon_high)
    if delta is not None and not float(delta) > 0:
        raise FusedGRPOError("FG_ERR_BAD_HYPERPARAMETER", f"delta must be > 0, got {delta}", 10)
    cfg.delta = 0.0 if delta is None else float(delta)
    cfg.beta = float(beta)
    cfg.max_completion_length = 0 if max_completion_length is None else int(max_completion_length)
    cfg.num_items_in_batch = -1.0 if num_items_in_batch is None else float(num_items_in_batch)
    cfg.sapo_temperature_pos = float(sapo_temperature_pos)
    cfg.sapo_temperature_neg = float(sapo_temperature_neg)
    cfg.use_bias_correction_kl = 1 if use_bias_correction_kl else 0
    cfg.entropy_coef = float(entropy_coef)
    return cfg


# The keyword arguments of make_config: the front ends pick these out of their
# own arguments, so a new loss option is forwarded without touching them.
LOSS_OPTIONS = tuple(inspect.signature(make_config).parameters)


def loss_options(arguments: dict) -> dict:
    """The make_config keywords among a front end's arguments (its locals())."""
    return {k: arguments[k] for k in LOSS_OPTIONS if k in arguments}


# ------------------------------------------------------------------ calls

def _mat(ptr, dtype, rows, cols, ld):
    return fg_matrix(ptr or None, dtype, rows, cols, ld)


def linear_call(ctx: Context, cfg: fg_loss_config, impl: str, *, B, T, H, V, dtype,
                hidden, ld_hidden, weight, ld_weight, bias, token_ids, mask, advantages,
                old_logp, ref_logp, is_ratio, is_ratio_per_sequence, logp, entropy,
                grad_hidden, grad_weight, grad_bias, vocab_start=0, vocab_total=0,
                stats=False):
    """fg_linear_grpo on raw addresses (ints; 0 = absent). Returns (loss, metrics)."""
    try:
        impl_id = IMPLS[impl]
    except KeyError:
        raise FusedGRPOError("FG_ERR_UNSUPPORTED", f"unknown impl {impl!r}; one of "
                             f"{tuple(IMPLS)}", 12) from None
    o = fg_linear_options(impl_id, 0)
    inp = fg_linear_inputs(_mat(hidden, dtype, B * T, H, ld_hidden),
                           _mat(weight, dtype, V, H, ld_weight),
                           fg_vector(bias or None, dtype, V), vocab_start, vocab_total)
    bt = fg_batch(B, T, token_ids, mask, advantages, old_logp or None, ref_logp or None,
                  is_ratio or None, 1 if is_ratio_per_sequence else 0)
    out = fg_outputs()
    out.logp = logp or None
    out.entropy = entropy or None
    out.grad_hidden = _mat(grad_hidden, DTYPE_F32, B * T, H, H)
    out.grad_weight = _mat(grad_weight, DTYPE_F32, V, H, H)
    out.grad_bias = fg_vector(grad_bias or None, DTYPE_F32, V)
    with ctx.lock:
        st = lib.fg_linear_grpo(ctx.handle, ctypes.byref(o), ctypes.byref(cfg), ctypes.byref(inp),
                                ctypes.byref(bt), ctypes.byref(out))
        ctx.check(st)
    m = out.metrics
    return out.loss, {n: getattr(m, n) for n in METRIC_NAMES}


def logits_call(ctx: Context, cfg: fg_loss_config, *, B, T, V, dtype, logits, ld_logits,
                token_ids, mask, advantages, old_logp, ref_logp, is_ratio,
                is_ratio_per_sequence, logp, entropy, grad_logits, ld_grad_logits, grad_dtype):
    bt = fg_batch(B, T, token_ids, mask, advantages, old_logp or None, ref_logp or None,
                  is_ratio or None, 1 if is_ratio_per_sequence else 0)
    lg = _mat(logits, dtype, B * T, V, ld_logits)
    out = fg_outputs()
    out.logp = logp or None
    out.entropy = entropy or None
    out.grad_logits = _mat(grad_logits, grad_dtype, B * T, V, ld_grad_logits)
    with ctx.lock:
        st = lib.fg_logits_grpo(ctx.handle, ctypes.byref(cfg), ctypes.byref(lg), ctypes.byref(bt),
                                ctypes.byref(out))
        ctx.check(st)
    m = out.metrics
    return out.loss, {n: getattr(m, n) for n in METRIC_NAMES}
