"""JAX front end: the fused loss as XLA FFI custom calls on the CPU (and CUDA GPUs).

The handlers (``_jax_ffi.cc``, C++ over the C library, written against
``jax.ffi.include_dir()``'s ``xla/ffi/api/ffi.h``) are built with the package
(scikit-build-core / CMake, ``python/jax_ffi.cmake``) when jax is present at
build time, and installed as ``fusedgrpo/libfusedgrpo_jax_ffi.so`` next to
``libfusedgrpo.so.0``. Importing this module loads it and registers its targets
with ``jax.ffi.register_ffi_target``; if the package was built without it, the
import fails with an ImportError that says how to reinstall (jax installed
first, then ``pip install --no-build-isolation .``; see python/README.md).
``FUSEDGRPO_JAX_BACKEND=callback`` (read at import) asks instead for the
``jax.pure_callback`` over the NumPy front end (no handler needed, no vocab
sharding); ``=ffi`` is the default. ``backend()`` says which one is in use.

``fused_linear_grpo_loss`` is a ``jax.custom_vjp``: the forward of a
differentiated call computes the loss and all gradients in one C call (like
Liger), the backward scales them by the incoming cotangent. It works under
``jit``.

``fused_linear_grpo_loss_sharded`` runs under ``shard_map`` over a mesh, which
may span processes (``jax.distributed``; CPU collectives over gloo):

- a vocab axis: the weight's rows split over it; each shard runs the phases of
  fusedgrpo.h ("phases of a vocab-sharded call"), every one a plain local FFI
  call, with the reductions between them made by XLA: (a) row statistics,
  ``lax.pmax``, (b) rescale, ``lax.psum``, finish (logp, entropy), (c) the loss
  from logp, (d) the shard's backward, ``lax.psum`` of grad_hidden;
- a batch axis (data parallel): each shard one C call on its sequences (or the
  phases, with a vocab axis too), with the whole batch's normalisers (see the
  function's docstring for TRL's convention);
- errors: no shard raises on its own (the others would wait for it in the next
  collective); a failure travels as a status through the phases, is MAX-reduced
  over the mesh after the call's last collective, and every shard then raises
  it (``fusedgrpo_check``).

Like ``fused_linear_grpo_loss`` it is a ``jax.custom_vjp``: the sharded forward
computes the gradients too, the backward scales them.

On GPU devices (CUDA), ``fused_linear_grpo_loss`` and ``linear_logprobs`` run
the handler's CUDA targets (``*_cuda``: the same C calls on device memory, on
XLA's stream, through the C library's CUDA backend), ``jit`` and ``grad``
included; which targets a call uses is decided when XLA lowers it for its
platform (``lax.platform_dependent``), so arrays on CPU devices of the same
process keep the CPU path. ``fused_linear_grpo_loss_sharded`` stays on CPU
devices (the handler has no CUDA targets for the phase API's calls yet) and
refuses a mesh of GPUs.
"""
from __future__ import annotations

import ctypes
import functools
import math
import numbers
import os
from typing import Any, NamedTuple, Optional

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from . import _inputs, _lib, _options
from ._lib import METRIC_NAMES, FusedGRPOError

__all__ = ["fused_linear_grpo_loss", "fused_linear_grpo_loss_sharded", "linear_logprobs",
           "backend", "call_totals", "handler_path", "METRIC_NAMES", "FusedGRPOError"]

# custom-call target -> the handler's symbol in _jax_ffi.cc
_TARGETS = {
    "fusedgrpo_linear_grpo": "FgLinearGrpo",
    "fusedgrpo_shard_stats": "FgShardStats",
    "fusedgrpo_shard_rescale": "FgShardRescale",
    "fusedgrpo_shard_finish": "FgShardFinish",
    "fusedgrpo_loss_from_logp": "FgLossFromLogp",
    "fusedgrpo_shard_backward": "FgShardBackward",
    "fusedgrpo_check": "FgCheck",
}
# The device handlers (_jax_ffi.cc "device handlers"), registered for the CUDA
# platform: custom-call target -> symbol.
_CUDA_TARGETS = {
    "fusedgrpo_linear_grpo_cuda": "FgLinearGrpoCuda",
    "fusedgrpo_linear_logprobs_cuda": "FgLinearLogprobsCuda",
    "fusedgrpo_linear_logprobs_backward_cuda": "FgLinearLogprobsBackwardCuda",
}
# The same bodies over the C library's reference backend on host memory, for
# the CPU platform: tests only (_device_path_on_cpu).
_REFERENCE_TARGETS = {
    "fusedgrpo_linear_grpo_on_reference": "FgLinearGrpoOnReference",
    "fusedgrpo_linear_logprobs_on_reference": "FgLinearLogprobsOnReference",
    "fusedgrpo_linear_logprobs_backward_on_reference": "FgLinearLogprobsBackwardOnReference",
}
_HERE = os.path.dirname(os.path.abspath(__file__))
_HANDLER = "libfusedgrpo_jax_ffi.so"
_BACKENDS = ("ffi", "callback")
_state = {"backend": None, "so": None, "lib": None, "cuda": False, "gpu": None,
          "reference_on_cpu": False}


def handler_path() -> str:
    """The path of the FFI handler library this module loads (it may not exist:
    a package built without jax has none)."""
    return os.environ.get("FUSEDGRPO_JAX_FFI_LIBRARY") or os.path.join(_HERE, _HANDLER)


def _load_handler():
    so = handler_path()
    if not os.path.isfile(so):
        why = ("FUSEDGRPO_JAX_FFI_LIBRARY names a missing file"
               if os.environ.get("FUSEDGRPO_JAX_FFI_LIBRARY") else
               "this fusedgrpo package was built without jax")
        raise ImportError(
            f"fusedgrpo.jax: the JAX FFI handler is not installed ({so} is missing): {why}. "
            "Install jax first, then reinstall fusedgrpo so that its build sees jax, e.g. "
            "`pip install scikit-build-core && pip install --no-build-isolation .` from the "
            "fusedgrpo source tree (see python/README.md). Or set "
            "FUSEDGRPO_JAX_BACKEND=callback before importing fusedgrpo.jax to use the slower "
            "jax.pure_callback backend instead.")
    try:
        lib = ctypes.CDLL(so)  # resolves fg_* in the libfusedgrpo that _lib loaded globally
        lib.FgJaxCallTotals.argtypes = [ctypes.POINTER(ctypes.c_double)]
        lib.FgJaxCallTotals.restype = None
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
        # The CUDA targets: registering them needs no GPU (nor starts a backend);
        # XLA calls them only where it lowers for CUDA. A handler built before
        # them has none: GPU arrays then fail at XLA's compile (no target).
        if all(hasattr(lib, symbol) for symbol in _CUDA_TARGETS.values()):
            for target, symbol in _CUDA_TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                            platform="CUDA")
            _state["cuda"] = True
    except Exception as e:  # noqa: BLE001 - re-raised with the path and the remedy
        raise ImportError(f"fusedgrpo.jax: cannot load the JAX FFI handler {so}: {e}; "
                          "reinstall fusedgrpo with jax present (python/README.md), or set "
                          "FUSEDGRPO_JAX_BACKEND=callback") from e
    _state["so"], _state["lib"] = so, lib


def _init_backend():
    want = os.environ.get("FUSEDGRPO_JAX_BACKEND") or "ffi"
    if want not in _BACKENDS:
        raise ImportError(f"fusedgrpo.jax: FUSEDGRPO_JAX_BACKEND={want!r}; one of {_BACKENDS}")
    if want == "ffi":
        _load_handler()
    _state["backend"] = want


_init_backend()


def backend() -> str:
    """"ffi" (the XLA custom calls built with the package, the default) or
    "callback" (jax.pure_callback, when FUSEDGRPO_JAX_BACKEND=callback)."""
    return _state["backend"]


def call_totals() -> dict:
    """Time spent inside the C library by the FFI handlers since the process
    started: {"calls", "call_seconds", "gemm_seconds"} (zeros under the
    pure_callback backend, whose calls fusedgrpo.memory_stats() reports).
    A vocab-sharded call counts each of its phases. A step's wall time minus
    its call_seconds is the front end's overhead."""
    out = (ctypes.c_double * 3)()
    if _state["lib"] is not None:
        _state["lib"].FgJaxCallTotals(out)
    return {"calls": int(out[0]), "call_seconds": out[1], "gemm_seconds": out[2]}


# ------------------------------------------------------------------ primitive call

class _Static(NamedTuple):
    """The call's static options: XLA FFI attributes (and the pure_callback's
    arguments). Hashable, so it can be custom_vjp's nondiff argument."""
    options: tuple       # the loss options given, checked: sorted (name, value) pairs
    config: bytes        # their fg_loss_config (fusedgrpo._options), the handler's "config"
    impl: str
    threads: int         # 0: OpenMP's default
    memory_budget: int   # bytes; 0: the library's default
    filter_eps: float    # gradient filtering (-1: auto; _lib.filter_eps_value)
    items_given: bool    # the `scalars` operand holds a num_items_in_batch (else: unset)

    def option(self, name):
        return dict(self.options).get(name, _options.LOSS_OPTIONS[name].default)


# The options that may be traced values: they travel as the run-time `scalars`
# operand (the sharded front end feeds them the whole batch's normalisers).
# Whether num_items_in_batch is given is static (_Static.items_given, the
# handler's attribute "num_items_given"): no value of the operand stands for
# "unset", so a traced -1 (the C library's FG_NUM_ITEMS_UNMASKED) is refused
# by the handler like any value that is not a finite number > 0.
_RUN_TIME = ("num_items_in_batch", "entropy_coef")


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _run_time_value(name, value):
    """A run-time option as the `scalars` operand takes it: a traced real scalar
    as it is (checked at run time by the handler), a concrete one (a Python or
    NumPy number, or a 0-d array) as the float that fusedgrpo._options' check
    returns. A bool, a complex or non-real dtype, or an array that is not a
    scalar is refused (FG_ERR_BAD_HYPERPARAMETER), traced or not."""
    if isinstance(value, (jax.Array, np.ndarray)):
        dtype, shape = np.dtype(value.dtype), np.shape(value)
        if shape != () or dtype.kind not in "iufV":
            raise FusedGRPOError("FG_ERR_BAD_HYPERPARAMETER", f"{name} must be a real scalar "
                                 f"(not a bool), got an array of shape {shape} and dtype {dtype}")
        if _is_traced(value):
            return value
        value = value.item()
    return _options.LOSS_OPTIONS[name].check(name, value)


def _static(options: dict, impl="fused", threads=None, memory_budget=None,
            filter_eps=0.0) -> _Static:
    """The static options, checked as every front end checks them
    (fusedgrpo._options), and the run-time ones: a concrete num_items_in_batch
    or entropy_coef is checked here, a traced one by the handler when it runs."""
    options = _options.loss_options_of(options)
    static = {k: v for k, v in options.items() if k not in _RUN_TIME}
    # the run-time options given (num_items_in_batch None: unset, the library's count)
    given = {k: v for k, v in options.items()
             if k in _RUN_TIME and not (k == "num_items_in_batch" and v is None)}
    checked = {k: _run_time_value(k, v) for k, v in given.items()}
    concrete = {k: v for k, v in checked.items() if not _is_traced(v)}
    _options.loss_config({**static, **concrete})
    _lib.check_impl(impl)
    cfg = _options.loss_config(static)
    ex = _options.make_exec(threads, memory_budget)
    return _Static(tuple(sorted(static.items())), _options.config_bytes(cfg).tobytes(), impl,
                   ex.threads, ex.memory_budget, _lib.filter_eps_value(filter_eps),
                   "num_items_in_batch" in given)


def _exec_attrs(cfg):
    return dict(threads=np.int64(cfg.threads), memory_budget=np.int64(cfg.memory_budget))


def _loss_attrs(cfg):
    """The loss config as FFI attributes (_jax_ffi.cc DecodeLossConfig): its
    bytes, and whether `scalars` holds a num_items_in_batch (ApplyScalars)."""
    return dict(config=np.frombuffer(cfg.config, np.uint8),
                num_items_given=np.int64(cfg.items_given), **_exec_attrs(cfg))


def _head_attrs(cfg, vocab_total=0):
    """The LM head's attributes (DecodeHeadAttrs) for the phases (a) and (d)."""
    return dict(impl=cfg.impl, filter_eps=np.float64(cfg.filter_eps),
                temperature=np.float64(cfg.option("temperature")),
                vocab_total=np.int64(vocab_total),
                **_exec_attrs(cfg))


def _ffi(target, types, *args, aliases=None, **attrs):
    call = jax.ffi.ffi_call(target, types, vmap_method="sequential",
                            input_output_aliases=aliases)
    return call(*args, **attrs)


def _empty(dtype=jnp.float32):
    return jnp.zeros((0,), dtype)


# ------------------------------------------------------------------ devices

# The device handlers' targets by role, per platform of lax.platform_dependent.
_DEVICE_ROLES = {"cuda": {"grpo": "fusedgrpo_linear_grpo_cuda",
                          "logprobs": "fusedgrpo_linear_logprobs_cuda",
                          "logprobs_backward": "fusedgrpo_linear_logprobs_backward_cuda"}}
_ON_REFERENCE = {"grpo": "fusedgrpo_linear_grpo_on_reference",
                 "logprobs": "fusedgrpo_linear_logprobs_on_reference",
                 "logprobs_backward": "fusedgrpo_linear_logprobs_backward_on_reference"}


def _cuda_present() -> bool:
    """Whether this process has CUDA devices: asked at the first call, never at
    import (jax starts its backends then, which must wait for a later
    jax.distributed.initialize)."""
    if _state["gpu"] is None:
        try:
            _state["gpu"] = len(jax.devices("cuda")) > 0
        except RuntimeError:  # no CUDA backend in this jax
            _state["gpu"] = False
    return _state["gpu"]


def _committed_platform(args):
    """The platform ("cpu", "gpu") that the arrays among args are committed to,
    when they are all concrete and one platform holds the committed ones; else
    None (traced values: the lowering decides)."""
    platforms = set()
    for x in jax.tree_util.tree_leaves(args):
        if isinstance(x, jax.core.Tracer):
            return None
        if isinstance(x, jax.Array) and x.committed:
            platforms.update(d.platform for d in x.devices())
    return platforms.pop() if len(platforms) == 1 else None


def _per_platform(host, device, *args):
    """host(*args) where the call runs on a CPU device, device(roles, *args)
    where it runs on a CUDA device (roles: _DEVICE_ROLES["cuda"]). The choice
    is made where XLA lowers the call for its platform (lax.platform_dependent:
    only the chosen branch is lowered), or by the arrays' devices for an eager
    call on committed arrays (platform_dependent would ask the default device).
    Without CUDA devices, the CUDA targets, or the FFI backend, host(*args) as
    always. Both must return tuples of the same arrays."""
    if _state["reference_on_cpu"]:
        return device(_ON_REFERENCE, *args)
    if backend() != "ffi" or not _state["cuda"] or not _cuda_present():
        return host(*args)
    cuda = functools.partial(device, _DEVICE_ROLES["cuda"])
    platform = _committed_platform(args)
    if platform == "cpu":
        return host(*args)
    if platform == "gpu":
        return cuda(*args)
    return lax.platform_dependent(*args, cpu=host, cuda=cuda)


def _int64_ids(tok):
    """Token ids as the device handlers take them, the C API's int64: int64 as
    they are, others as int32 [B, T, 2], each id's low and high 32-bit words
    (the little-endian int64 layout), made on the device: no x64 mode needed,
    and the handler, which cannot read device memory, need not widen them."""
    if tok.dtype.itemsize == 8:  # int64, or uint64 (x64): its bits as int64
        return tok.astype(jnp.int64)
    tok = tok.astype(jnp.int32)
    return jnp.stack([tok, lax.shift_right_arithmetic(tok, jnp.int32(31))], axis=-1)


def _id_dtype(tok):
    """The dtype the handlers take token ids of tok's dtype in: int64 for 64-bit
    ids (uint64 under x64: a value past int64's range turns negative, which the
    library refuses, never a smaller id), int32 for the rest."""
    return jnp.int64 if tok.dtype.itemsize == 8 else jnp.int32


def _mask_bytes(mask):
    """A mask as the handlers read it (one byte per token, nonzero: a token)."""
    return mask if mask.dtype in (jnp.bool_, jnp.uint8, jnp.int8) else mask != 0


def _device_path_on_cpu(on: bool = True):
    """For tests on machines without a GPU: calls that would take the CUDA
    targets take, on the CPU, the same handler bodies over the C library's
    reference backend (host memory, slow) instead: the device path's operands,
    host-number copies and C calls then run through XLA. on=False: back to the
    CPU path. Traces made before the switch keep their path."""
    if on and not _state.get("reference_registered"):
        for target, symbol in _REFERENCE_TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(_state["lib"], symbol)),
                                        platform="cpu")
        _state["reference_registered"] = True
    _state["reference_on_cpu"] = bool(on)


def _grad_dtypes(dtype):
    """grad_hidden, grad_weight, grad_bias dtypes (fusedgrpo.grad_storage_dtypes)."""
    import fusedgrpo
    return tuple(jnp.dtype(n) for n in fusedgrpo.grad_storage_dtypes(dtype == jnp.bfloat16))


def _grad_types(B, T, H, V, need, gdts):
    S = jax.ShapeDtypeStruct
    return (S((B, T, H) if need[0] else (0,), gdts[0]), S((V, H) if need[1] else (0,), gdts[1]),
            S((V,) if need[2] else (0,), gdts[2]))


def _out_types(B, T, H, V, need, gdts):
    f = jnp.float32
    S = jax.ShapeDtypeStruct
    return ((S((), f), S((len(METRIC_NAMES),), f), S((B, T), f), S((B, T), f))
            + _grad_types(B, T, H, V, need, gdts) + (S((), f),))


def _batch_operands(B, T, tok, mask, adv, old, ref, isr, samp):
    """The per-token and per-sequence operands as the handlers read them
    (absent ones zero-sized)."""
    old = _empty() if old is None else old.astype(jnp.float32)
    ref = _empty() if ref is None else ref.astype(jnp.float32)
    isr = _empty() if isr is None else isr.astype(jnp.float32)
    samp = _empty() if samp is None else samp.astype(jnp.float32)
    if isr.ndim == 2 and isr.shape == (B, 1) and T != 1:
        isr = isr.reshape(B)
    tok = tok if tok.dtype in (jnp.int32, jnp.int64) else tok.astype(_id_dtype(tok))
    # nonzero is a real token (the C API's reading); a float mask's 0.5 must not
    # truncate to 0 (a concrete one is refused before: _batch)
    mask = mask if mask.dtype in (jnp.bool_, jnp.uint8) else mask != 0
    return (tok, mask.astype(jnp.uint8), adv.astype(jnp.float32).reshape(B), old, ref, isr,
            samp)


def _callback_impl(cfg, need, gdts, hidden, weight, bias, tok, mask, adv, old, ref, isr, samp,
                   scalars, shard):
    import fusedgrpo as fg

    def opt(a):
        return None if a.size == 0 else np.asarray(a)
    sc = np.asarray(scalars)
    rows = weight.shape[0] if np.size(shard) == 0 else int(np.asarray(shard)[1])
    r = fg.fused_linear_grpo(
        np.asarray(hidden), np.asarray(weight)[:rows], np.asarray(tok), np.asarray(mask),
        np.asarray(adv), opt(old), opt(ref), bias=None if bias.size == 0 else
        np.asarray(bias)[:rows], is_ratio=opt(isr), sampling_logp=opt(samp),
        num_items_in_batch=float(sc[0]) if cfg.items_given else None, entropy_coef=float(sc[1]),
        memory_budget=cfg.memory_budget or None, threads=cfg.threads or None, impl=cfg.impl,
        compute_grad=any(need), filter_eps=cfg.filter_eps, **dict(cfg.options))
    z = np.zeros((0,), np.float32)
    pad = weight.shape[0] - rows  # padding rows past the vocabulary: zero gradient

    def rows_out(g):
        return np.concatenate([g, np.zeros((pad,) + g.shape[1:], g.dtype)]) if pad else g
    # the callback path casts (the FFI path writes the dtypes it is given)
    return (np.float32(r.loss), np.array([r.metrics[n] for n in METRIC_NAMES], np.float32),
            r.logp, r.entropy, r.grad_hidden.astype(gdts[0]) if need[0] else z.astype(gdts[0]),
            rows_out(r.grad_weight).astype(gdts[1]) if need[1] else z.astype(gdts[1]),
            rows_out(r.grad_bias).astype(gdts[2]) if need[2] else z.astype(gdts[2]),
            np.float32(0))


def _prim(cfg, need, hidden, weight, bias, batch, scalars, shard=None, soft=False, gdts=None):
    """One fg_linear_grpo: (loss, metrics, logp, entropy, grad_hidden,
    grad_weight, grad_bias, status). soft: a failure comes back as the status
    (every output zero) instead of raising (the sharded front end's convention)."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    has_bias = bias is not None
    need = (need[0], need[1], need[2] and has_bias)
    gdts = _grad_dtypes(hidden.dtype) if gdts is None else gdts
    bias = bias if has_bias else _empty(hidden.dtype)
    sharded = shard is not None
    shard = jnp.zeros((0,), jnp.int32) if shard is None else shard
    types = _out_types(B, T, H, V, need, gdts)
    args = (hidden, weight, bias) + _batch_operands(B, T, *batch) + (scalars, shard)
    if backend() == "ffi":
        attrs = dict(_loss_attrs(cfg), impl=cfg.impl, filter_eps=np.float64(cfg.filter_eps),
                     soft_fail=np.int64(soft))

        def host(*a):
            return tuple(_ffi("fusedgrpo_linear_grpo", types, *a, **attrs))

        def device(roles, *a):  # the token ids (operand 3) as int64
            return tuple(_ffi(roles["grpo"], types, *a[:3], _int64_ids(a[3]), *a[4:], **attrs))
        if sharded:  # shard_map: CPU devices only (fused_linear_grpo_loss_sharded)
            return host(*args)
        return _per_platform(host, device, *args)
    return jax.pure_callback(functools.partial(_callback_impl, cfg, need, gdts), types, *args,
                             vmap_method="sequential")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, hidden, weight, bias, batch, scalars):
    outs = _prim(cfg, (False, False, False), hidden, weight, bias, batch, scalars)
    return outs[0], tuple(outs[1:4])


def _dtypes(hidden, weight, bias):
    return _DtypeBox((hidden.dtype, weight.dtype, None if bias is None else bias.dtype))


def _core_fwd(cfg, hidden, weight, bias, batch, scalars):
    outs = _prim(cfg, (True, True, True), hidden, weight, bias, batch, scalars)
    return (outs[0], tuple(outs[1:4])), (outs[4], outs[5], outs[6] if bias is not None else None,
                                         _dtypes(hidden, weight, bias))


class _DtypeBox:
    """Static dtypes carried through the residuals (a pytree with no leaves)."""

    def __init__(self, dts):
        self.dts = dts


jax.tree_util.register_pytree_node(_DtypeBox, lambda b: ((), b.dts),
                                   lambda dts, _: _DtypeBox(dts))


def _scaled_grads(res, ct):
    """The backward of a forward that computed the gradients: scaled by the
    loss's cotangent, in the inputs' dtypes."""
    gh, gw, gb, box = res
    g = ct[0]
    dh_t, dw_t, db_t = box.dts
    # in the gradients' own dtype: bf16 stays bf16 (g is 1 from jax.grad: exact)
    dh = (gh * g.astype(gh.dtype)).astype(dh_t)
    dw = (gw * g.astype(gw.dtype)).astype(dw_t)
    db = None if gb is None else (gb * g.astype(gb.dtype)).astype(db_t)
    return dh, dw, db


def _core_bwd(cfg, res, ct):
    return _scaled_grads(res, ct) + (None, None)


_core.defvjp(_core_fwd, _core_bwd)


def _batch(hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_ratio,
           sampling_logp, vocab=None):
    """The batch's arrays, their shapes and dtypes checked at trace time as every
    front end checks them (fusedgrpo._inputs; the values of a traced mask are
    not seen: a nonzero entry counts as a token, as in the C API), the sizes
    (_check_sizes) and concrete token ids beyond int32 (_token_ids). vocab:
    the vocabulary (default: the weight's rows)."""
    arrays = [None if a is None else jnp.asarray(a) for a in
              (mask, advantages, old_logp, ref_logp, is_ratio, sampling_logp)]
    m, adv, old, ref, isr, samp = arrays
    ids = _raw_ids(token_ids)
    B, T, H, V = _inputs.check_head(jnp.shape(hidden), jnp.shape(weight),
                                    None if bias is None else jnp.shape(bias),
                                    *(None if a is None else jnp.asarray(a).dtype
                                      for a in (hidden, weight, bias)))
    _inputs.check_tokens(ids.shape, ids.dtype, m.shape, m.dtype, B, T)
    if not _is_traced(m):
        _inputs.check_mask_values(np.asarray(m))
    named = dict(old_logp=old, ref_logp=ref, is_ratio=isr, sampling_logp=samp)
    _inputs.check_batch(B, T, adv.shape, **{k: None if a is None else a.shape
                                            for k, a in named.items()},
                        kinds={k: a.dtype for k, a in (("advantages", adv), *named.items())
                               if a is not None})
    V = V if vocab is None else vocab
    _check_sizes(B, T, H, V)
    return (jnp.asarray(_token_ids(ids, m, V)),) + tuple(arrays)


def _check_sizes(B, T, H, V):
    """Every size >= 1, which the library requires: refused here, at the call,
    with its status and message (FG_ERR_INVALID_SIZE), as the NumPy front end's
    call refuses it (XLA would run an empty linear_logprobs without a call)."""
    for name, rows, cols in (("hidden", B * T, H), ("weight", V, H)):
        if rows < 1 or cols < 1:
            raise FusedGRPOError("FG_ERR_INVALID_SIZE",
                                 f"{name}: sizes must be >= 1, got [{rows}, {cols}]")


_INT32 = np.iinfo(np.int32)


def _raw_ids(token_ids):
    """token_ids as given, for _token_ids: a JAX array (or tracer) as it is, else
    (a NumPy array, Python ints) as a NumPy array, before JAX converts it."""
    return token_ids if isinstance(token_ids, jax.Array) else np.asarray(token_ids)


def _token_ids(ids, mask, V):
    """The token ids of _raw_ids, safe to hand to JAX. Without x64, JAX holds
    64-bit ids as int32 and cuts their high bits: 2**32 + 3 would run as id 3.
    A concrete id outside int32's range lies outside [0, V) for any vocabulary,
    so, as the NumPy front end's call does, it is refused where the mask holds
    it (FG_ERR_TOKEN_OUT_OF_RANGE, here, at the call) and never read where the
    mask drops it (0 in its place); under a traced mask, -1 takes its place,
    which the library refuses wherever the mask holds it. A JAX array or a
    traced value is as it is: without x64 it holds no 64-bit id (int64 ids
    given to jax.jit as arguments are cut by JAX itself, before this front end
    sees them: pass them with x64 enabled, or as int32)."""
    if isinstance(ids, jax.Array) or jax.config.jax_enable_x64 or ids.dtype.itemsize < 8 \
            or ids.size == 0:
        return ids
    bad = (ids < _INT32.min) | (ids > _INT32.max)
    if not bad.any():
        return ids
    if _is_traced(mask):
        return np.where(bad, -1, ids).astype(np.int32)
    held = bad & (np.asarray(mask) != 0)
    if held.any():
        b, t = np.argwhere(held)[0]
        raise FusedGRPOError("FG_ERR_TOKEN_OUT_OF_RANGE",
                             f"token_ids[{b}, {t}] = {ids[b, t]} is outside [0, {V})")
    return np.where(bad, 0, ids).astype(np.int32)


def _scalars(options):
    """(num_items_in_batch, entropy_coef): the run-time values, as _static
    checked them. Unset, num_items_in_batch's slot holds NaN, which nothing
    reads (_Static.items_given is False)."""
    values = {k: _run_time_value(k, options[k]) for k in _RUN_TIME
              if options.get(k) is not None}
    items = values.get("num_items_in_batch", math.nan)
    coef = values.get("entropy_coef", _options.LOSS_OPTIONS["entropy_coef"].default)
    return jnp.stack([jnp.asarray(items, jnp.float32), jnp.asarray(coef, jnp.float32)])


def _aux(metrics, logp, ent):
    d = {n: metrics[i] for i, n in enumerate(METRIC_NAMES)}
    return {"metrics": d, "logp": logp, "entropy": ent}


@_options.with_loss_options
def fused_linear_grpo_loss(hidden, weight, token_ids, mask, advantages, old_logp=None,
                           ref_logp=None, *, bias=None, is_ratio=None, sampling_logp=None,
                           impl="fused", memory_budget=None, threads=None, return_aux=False,
                           filter_eps=0.0, **options):
    """The loss of LOSS_SPEC.md from hidden [B, T, H] (float32 or bfloat16), weight
    [V, H] (same dtype), bias [V]; differentiable w.r.t. hidden, weight, bias.
    The loss options (keyword-only) are fusedgrpo.OPTION_NAMES, with the NumPy
    API's defaults and checks; ``num_items_in_batch`` and ``entropy_coef`` may
    be traced values (real scalars), which the handler checks when the call
    runs as the NumPy API checks them (num_items_in_batch: a finite number >
    0; only None leaves it unset). sampling_logp [B, T]: the sampler's
    log-probs (the off-policy mask's; fusedgrpo.fused_linear_grpo).
    token_ids: without x64, JAX holds 64-bit ids as int32; a concrete id
    (NumPy array, Python ints) outside int32's range is refused as out of
    range where unmasked (ignored where masked), as by the NumPy API; int64
    ids passed to jax.jit as arguments need x64 (JAX cuts them to int32 itself).
    ``filter_eps``: gradient filtering, 0 (off), "auto" or a threshold
    (fusedgrpo.fused_linear_grpo). With
    ``return_aux=True`` returns ``(loss, {"metrics": {...}, "logp", "entropy"})``
    (aux is not differentiable)."""
    cfg = _static(options, impl, threads, memory_budget, filter_eps)
    batch = _batch(hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp,
                   is_ratio, sampling_logp)
    loss, (metrics, logp, ent) = _core(cfg, hidden, weight, bias, batch, _scalars(options))
    return (loss, _aux(metrics, logp, ent)) if return_aux else loss


# ------------------------------------------------------------------ under shard_map
#
# Per shard of the mesh, inside shard_map: its normalisers (psum over the batch
# axis), its loss and gradients (one C call, or the phases and their
# reductions over the vocab axis), the whole batch's loss and metrics (psum
# over the batch axis), and the status check. The custom_vjp wraps the whole
# shard_map: its forward returns the gradients as sharded arrays, its backward
# scales them.

_INPUTS = ("hidden", "weight", "bias", "token_ids", "mask", "advantages", "old_logp",
           "ref_logp", "is_ratio", "sampling_logp", "scalars")
_BY_BATCH = ("hidden", "token_ids", "mask", "advantages", "old_logp", "ref_logp", "is_ratio",
             "sampling_logp")


class _Plan(NamedTuple):
    """The sharded call's static layout (hashable: custom_vjp's nondiff argument)."""
    cfg: _Static
    mesh: Any
    batch_axis: Optional[str]
    vocab_axis: Optional[str]
    vocab_size: int      # V: token ids lie in [0, V)
    shard_rows: int      # weight rows per vocab shard (the last shard's past V: padding)
    batch_size: int      # B of the whole batch
    names: tuple         # the inputs present, in _INPUTS order
    user_items: bool     # the caller gave num_items_in_batch (cfg.items_given: the calls get one)

    @property
    def nb(self):
        return self.mesh.shape[self.batch_axis] if self.batch_axis else 1

    @property
    def nv(self):
        return self.mesh.shape[self.vocab_axis] if self.vocab_axis else 1


def _psum_b(plan, x):
    return lax.psum(x, plan.batch_axis) if plan.batch_axis else x


def _shard_operand(plan):
    """(vocab_start, rows, key, devices): this shard's vocab rows, its index on the
    mesh and the mesh's size (which key the handlers' error messages)."""
    key = jnp.int32(0)
    for name in plan.mesh.axis_names:
        key = key * plan.mesh.shape[name] + lax.axis_index(name)
    start = (lax.axis_index(plan.vocab_axis) if plan.nv > 1 else 0) * plan.shard_rows
    rows = jnp.minimum(plan.shard_rows, plan.vocab_size - start)
    return jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(rows, jnp.int32),
                      key.astype(jnp.int32), jnp.int32(plan.mesh.size)])


def _normalisers(plan, mask, scalars):
    """This shard's weight s_p in the sum of the shards' losses and its call's
    (num_items_in_batch, entropy_coef), so that the sum is the whole batch's
    loss (fused_linear_grpo_loss_sharded's docstring)."""
    n_loc = jnp.sum(mask != 0).astype(jnp.float32)
    n_glob = _psum_b(plan, n_loc)
    n_loc1, n_glob1 = jnp.maximum(n_loc, 1.0), jnp.maximum(n_glob, 1.0)
    # the caller's num_items_in_batch (NaN: none) goes to every call, which
    # checks it (plan.cfg.items_given) whether or not its loss type reads it
    items, coef = scalars[0], scalars[1]
    normaliser = _options.NORMALISER[plan.cfg.option("loss_type")]
    if normaliser == "sequences":
        s_p = jnp.float32(mask.shape[0] / plan.batch_size)
    elif normaliser == "tokens":
        s_p = n_loc1 / n_glob1
    else:  # num_items_in_batch: one global normaliser, the shards' losses summed
        s_p = jnp.float32(1.0)
        if not plan.user_items:  # the whole batch's count (0 tokens: the library's 1)
            items = n_glob1
    c_eff = coef * n_loc1 / (n_glob1 * s_p)  # the bonus's mean over the whole batch's tokens
    return s_p, n_loc, n_glob1, jnp.stack([items, c_eff])


def _sharded_grad_dtypes(plan, dtype):
    """grad_hidden in float32 where it is summed over the vocab shards, and
    grad_weight / grad_bias where they are summed over the batch shards; the
    backward casts to the inputs' dtypes."""
    g = _grad_dtypes(dtype)
    f = jnp.float32
    return (f if plan.nv > 1 else g[0],) + ((f, f) if plan.nb > 1 else g[1:])


def _one_call(plan, want_grads, a, scalars, shard):
    """No vocab axis: one fg_linear_grpo on this shard's sequences."""
    need = (want_grads,) * 3
    batch = tuple(a.get(n) for n in _BY_BATCH[1:])
    outs = _prim(plan.cfg, need, a["hidden"], a["weight"], a.get("bias"), batch, scalars,
                 shard, soft=True, gdts=_sharded_grad_dtypes(plan, a["hidden"].dtype))
    grads = ()
    if want_grads:
        grads = (outs[4], outs[5]) + ((outs[6],) if "bias" in a else ())
    return outs[:4], grads, outs[7]


def _vocab_phases(plan, want_grads, a, scalars, shard):
    """The phases of fusedgrpo.h on this vocab shard, with their reductions over
    the vocab axis. A failed phase's status travels on (the stats' slot, then
    the status operands of (c) and (d)); the later phases pass it on."""
    cfg, ax = plan.cfg, plan.vocab_axis
    h, w, bias = a["hidden"], a["weight"], a.get("bias")
    B, T, H = h.shape
    N, f32, S = B * T, jnp.float32, jax.ShapeDtypeStruct
    tok, mask, adv, old, ref, isr, samp = _batch_operands(B, T, *(a.get(n)
                                                                  for n in _BY_BATCH[1:]))
    head = (h, w, _empty(h.dtype) if bias is None else bias, tok, mask, shard)
    ha = _head_attrs(cfg, plan.vocab_size)
    k, _, _, slot = _lib.shard_stats_ranges(N)  # MAX range [0, k), its last float the status
    st_t = S((_lib.shard_stats_floats(N),), f32)
    stats = _ffi("fusedgrpo_shard_stats", st_t, *head, **ha)                     # (a)
    stats = jnp.concatenate([lax.pmax(stats[:k], ax), stats[k:]])
    stats = _ffi("fusedgrpo_shard_rescale", st_t, tok, mask, stats, shard, aliases={2: 0})
    stats = jnp.concatenate([stats[:k], lax.psum(stats[k:], ax)])                # (b)
    stats, logp, ent = _ffi("fusedgrpo_shard_finish", (st_t, S((B, T), f32), S((B, T), f32)),
                            tok, mask, stats, shard, aliases={2: 0})
    d_t = S((B, T) if want_grads else (0,), f32)
    loss, metrics, dlogp, dent, status = _ffi(                                   # (c)
        "fusedgrpo_loss_from_logp",
        (S((), f32), S((len(METRIC_NAMES),), f32), d_t, d_t, S((), f32)),
        tok, mask, adv, old, ref, isr, samp, scalars, logp, ent, stats[slot], shard,
        **_loss_attrs(cfg))
    if not want_grads:
        return (loss, metrics, logp, ent), (), status
    need = (True, True, bias is not None)
    gdts = _sharded_grad_dtypes(plan, h.dtype)
    gh, gw, gb, status = _ffi("fusedgrpo_shard_backward",                        # (d)
                              _grad_types(B, T, H, w.shape[0], need, gdts) + (S((), f32),),
                              *head, stats, dlogp, dent, status, **ha)
    grads = (lax.psum(gh, ax), gw) + ((gb,) if bias is not None else ())
    return (loss, metrics, logp, ent), grads, status


def _combined_metrics(plan, metrics, s_p, n_loc, n_glob1, B_loc):
    """The shards' metrics as the whole batch's. METRIC_NAMES: kl, entropy (token
    means); the clip fractions (token means, or sequence means at the sequence
    level); the per-sequence min / max; vespo's weight (a sequence mean); the
    policy loss (as the loss)."""
    if not plan.batch_axis:
        return metrics

    def nan_extreme(x, reduce):  # TRL's nanmin / nanmax over every shard's sequences
        fill = jnp.inf if reduce is lax.pmin else -jnp.inf
        r = reduce(jnp.where(jnp.isnan(x), fill, x), plan.batch_axis)
        return jnp.where(jnp.isinf(r), jnp.nan, r)

    B_glob = jnp.float32(plan.batch_size)
    seq = plan.cfg.option("importance_sampling_level") == "sequence"
    w_clip, d_clip = (jnp.float32(B_loc), B_glob) if seq else (n_loc, n_glob1)
    ps = functools.partial(_psum_b, plan)
    m = dict(zip(METRIC_NAMES, metrics))
    out = {n: ps(m[n] * n_loc) / n_glob1 for n in ("kl", "entropy")}
    out.update({n: ps(m[n] * w_clip) / d_clip for n in (
        "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "cispo_clip_ratio")})
    out["clip_ratio_low_min"] = nan_extreme(m["clip_ratio_low_min"], lax.pmin)
    out["clip_ratio_high_max"] = nan_extreme(m["clip_ratio_high_max"], lax.pmax)
    out["vespo_phi_seq_mean"] = ps(m["vespo_phi_seq_mean"] * jnp.float32(B_loc)) / B_glob
    out["policy_loss"] = ps(s_p * m["policy_loss"])
    return jnp.stack([out[n] for n in METRIC_NAMES])


def _combined_grads(plan, grads, s_p):
    """The whole batch's gradient: each batch shard's weighted by s_p; the
    weight's (and bias's) summed over the batch shards."""
    if plan.nb == 1 or not grads:
        return grads
    gh = grads[0] * s_p.astype(grads[0].dtype)
    return (gh,) + tuple(lax.psum(g * s_p, plan.batch_axis) for g in grads[1:])


def _raise_agreed(plan, status, shard, results):
    """`results`, through fusedgrpo_check: every shard raises the largest status
    of the mesh, after the call's last collective (the check reads the results,
    so XLA runs it after everything that produced them, and returns them in
    place, so nothing downstream can skip it)."""
    if backend() != "ffi":
        return results  # the pure_callback path raises where it fails (one process)
    status = lax.pmax(status, tuple(plan.mesh.axis_names))
    types = tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results)
    return tuple(_ffi("fusedgrpo_check", types, status, shard, *results,
                      aliases={i + 2: i for i in range(len(results))}))


def _local(plan, want_grads, *arrs):
    a = dict(zip(plan.names, arrs))
    shard = _shard_operand(plan)
    s_p, n_loc, n_glob1, scalars = _normalisers(plan, a["mask"], a["scalars"])
    run = _vocab_phases if plan.nv > 1 else _one_call
    (loss, metrics, logp, ent), grads, status = run(plan, want_grads, a, scalars, shard)
    metrics = _combined_metrics(plan, metrics, s_p, n_loc, n_glob1, a["hidden"].shape[0])
    outs = (_psum_b(plan, s_p * loss), metrics, logp, ent) + _combined_grads(plan, grads, s_p)
    return _raise_agreed(plan, status, shard, outs)


def _run_sharded(plan, want_grads, hidden, weight, bias, rest):
    from jax.sharding import PartitionSpec as P
    vals = dict(rest, hidden=hidden, weight=weight, bias=bias)
    bspec = P(plan.batch_axis) if plan.batch_axis else P()
    vspec = P(plan.vocab_axis) if plan.vocab_axis else P()

    def spec(n):
        return bspec if n in _BY_BATCH else vspec if n in ("weight", "bias") else P()
    in_specs = tuple(spec(n) for n in plan.names)
    out_specs = (P(), P(), bspec, bspec)
    if want_grads:
        out_specs += (bspec, vspec) + ((vspec,) if bias is not None else ())
    fn = _shard_map(functools.partial(_local, plan, want_grads), plan.mesh, in_specs, out_specs)
    return fn(*(vals[n] for n in plan.names))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sharded(plan, hidden, weight, bias, rest):
    outs = _run_sharded(plan, False, hidden, weight, bias, rest)
    return outs[0], tuple(outs[1:4])


def _sharded_fwd(plan, hidden, weight, bias, rest):
    outs = _run_sharded(plan, True, hidden, weight, bias, rest)
    gb = outs[6] if bias is not None else None
    return (outs[0], tuple(outs[1:4])), (outs[4], outs[5], gb, _dtypes(hidden, weight, bias))


def _sharded_bwd(plan, res, ct):
    return _scaled_grads(res, ct) + (None,)


_sharded.defvjp(_sharded_fwd, _sharded_bwd)


def _vocab_layout(weight, bias, vocab_size, nv):
    """The weight (and bias) padded to a multiple of the nv vocab shards, and the
    rows per shard. The padding rows, and any past vocab_size, never enter a C
    call (each shard passes its own vocab rows, fusedgrpo.h's V_local): their
    gradient is 0, and jnp.pad's transpose drops the rows added here."""
    rows_in = weight.shape[0]
    if vocab_size is not None and (isinstance(vocab_size, (bool, np.bool_))
                                   or not isinstance(vocab_size, numbers.Integral)):
        raise ValueError(f"vocab_size must be an integer (or None: the weight's rows), got "
                         f"{vocab_size!r}")
    V = rows_in if vocab_size is None else int(vocab_size)
    if not 0 < V <= rows_in:
        raise ValueError(f"vocab_size {V} must lie in [1, weight rows = {rows_in}]")
    pad = -rows_in % nv
    rows = (rows_in + pad) // nv
    if V <= rows * (nv - 1):
        raise ValueError(f"vocab {V} over {nv} shards of {rows} rows leaves a shard without "
                         "vocab rows")
    if pad:
        weight = jnp.pad(weight, ((0, pad), (0, 0)))
        bias = None if bias is None else jnp.pad(bias, (0, pad))
    return weight, bias, V, rows


@_options.with_loss_options
def fused_linear_grpo_loss_sharded(mesh, hidden, weight, token_ids, mask, advantages,
                                   old_logp=None, ref_logp=None, *, bias=None, is_ratio=None,
                                   sampling_logp=None, batch_axis="batch", vocab_axis=None,
                                   vocab_size=None, impl="fused", memory_budget=None,
                                   threads=None, return_aux=False, filter_eps=0.0, **options):
    """The loss of fused_linear_grpo_loss under ``jax.shard_map`` over ``mesh``,
    which may span processes (jax.distributed: every process makes the call
    with global arrays). Returns the whole batch's loss (and aux: metrics, logp
    and entropy [B, T], as the unsharded call's); gradients flow to hidden,
    weight and bias with their shardings.

    ``vocab_axis`` (or None): weight and bias are split by vocab rows over it;
    each shard runs the phases of fusedgrpo.h with lax.pmax / lax.psum between
    them (the merge is exact: every shard gets the same logp bits). A
    vocabulary that does not divide over the shards: the weight is padded with
    rows that never enter a C call (each shard passes its own rows, the last
    one fewer); or pass a weight already padded to a multiple of the shards
    (e.g. a global array sharded over processes) with ``vocab_size`` = the
    real vocabulary: rows past it are excluded and get a zero gradient. Every
    shard must hold at least one vocab row. FFI backend only.

    ``batch_axis`` (or None): the sequences are split over it (B must divide
    evenly); data parallel, the normalisers of the whole batch. TRL's
    convention under DDP (docs/LOSS_SPEC.md "Data parallel"), which the
    shards' C calls follow:
      - dapo, cispo, vespo: ``num_items_in_batch`` = the global unmasked token
        count / the number of data shards, the gradients averaged over them.
        Here each shard's call gets the global count (psum of the shards'
        counts, or your ``num_items_in_batch`` as the whole batch's) and the
        losses are summed: the same;
      - grpo, dr_grpo, sapo, luspo (per-sequence means): exact with equal
        sequences per shard (a shard whose sequences are all masked still
        counts them); the losses are weighted by B_shard / B;
      - bnpo and the entropy bonus: normalised by the shard's own tokens in its
        call, as TRL's are; the losses are then weighted by the shard's share
        of the unmasked tokens (not DDP's plain mean), so the result is the
        whole batch's loss, which TRL's mean over ranks is only when they hold
        equal token counts.
    The gradients are those of this whole-batch loss (grad_weight summed over
    the batch shards by psum, grad_hidden per shard). Metrics: the whole
    batch's means. Other mesh axes replicate.

    Errors (a bad token id, NaN inputs, a budget too small) raise on every
    shard of every process with the same status (jax.errors.JaxRuntimeError
    naming the FG_ERR_ status), after the call's collectives: none waits on a
    shard that failed."""
    platforms = sorted({d.platform for d in mesh.devices.flat})
    if platforms != ["cpu"]:
        raise NotImplementedError(
            f"fusedgrpo.jax: fused_linear_grpo_loss_sharded runs on CPU devices only; this mesh "
            f"holds {', '.join(platforms)} devices. The JAX handler has no CUDA targets for the "
            "vocab-sharded phases (the phase API) yet, so neither shard_map nor the multi-process "
            "call runs on GPUs: on a GPU, call fused_linear_grpo_loss on each device's batch.")
    cfg = _static(options, impl, threads, memory_budget, filter_eps)
    user_items = cfg.items_given
    if _options.NORMALISER[cfg.option("loss_type")] == "num_items_in_batch":
        cfg = cfg._replace(items_given=True)  # the caller's, or the whole batch's count
    nb = mesh.shape[batch_axis] if batch_axis else 1
    nv = mesh.shape[vocab_axis] if vocab_axis else 1
    if hidden.shape[0] % nb:
        raise ValueError(f"batch {hidden.shape[0]} does not divide over {nb} shards of "
                         f"{batch_axis!r}")
    if nv > 1 and backend() != "ffi":
        raise NotImplementedError("fusedgrpo.jax: vocab sharding needs the FFI handler")
    weight, bias, V, rows = _vocab_layout(weight, bias, vocab_size, nv)
    rest = dict(zip(_BY_BATCH[1:], _batch(hidden, weight, bias, token_ids, mask, advantages,
                                          old_logp, ref_logp, is_ratio, sampling_logp, V)),
                scalars=_scalars(options))
    present = {**rest, "hidden": hidden, "weight": weight, "bias": bias}
    plan = _Plan(cfg, mesh, batch_axis, vocab_axis, V, rows, hidden.shape[0],
                 tuple(n for n in _INPUTS if present[n] is not None), user_items)
    loss, (metrics, logp, ent) = _sharded(plan, hidden, weight, bias, rest)
    return (loss, _aux(metrics, logp, ent)) if return_aux else loss


# ------------------------------------------------------- log-probs of the head
#
# On CPU devices through jax.pure_callback over the NumPy functions
# (fg_linear_logprobs and fg_linear_logprobs_backward), not yet an FFI target:
# under jit it is one host callback per pass, and it does not take part in
# shard_map collectives (the phase API's FFI targets would). On CUDA devices
# through the handler's CUDA targets (_per_platform): the same C calls on
# device memory, float32 gradients as the callback's.

def _np(x):
    return None if x is None else np.asarray(x)


def _logprobs_cb(temperature, opts, hidden, weight, bias, tok, mask):
    import fusedgrpo as fg
    lp, ent = fg.fused_linear_logprobs(_np(hidden), _np(weight), _np(tok), _np(mask),
                                       bias=None if bias.size == 0 else _np(bias),
                                       temperature=temperature, return_entropy=True, **opts)
    return lp, ent


def _logprobs_bwd_cb(temperature, opts, hidden, weight, bias, tok, mask, g_lp, g_ent):
    import fusedgrpo as fg
    g = fg.fused_linear_logprobs_backward(_np(hidden), _np(weight), _np(tok), _np(g_lp),
                                          _np(mask), grad_entropy=_np(g_ent),
                                          bias=None if bias.size == 0 else _np(bias),
                                          temperature=temperature, **opts)
    gb = g["grad_bias"] if g["grad_bias"] is not None else np.zeros((0,), np.float32)
    return g["grad_hidden"], g["grad_weight"], gb


def _logprobs_attrs(temperature, opts):
    """The device handlers' attributes (_jax_ffi.cc DecodeHeadAttrs, temperature)."""
    o = dict(opts)
    impl = o.get("impl", "fused")
    _lib.check_impl(impl)
    ex = _options.make_exec(o.get("threads"), o.get("memory_budget"))
    return dict(impl=impl, filter_eps=np.float64(0.0), temperature=np.float64(temperature),
                threads=np.int64(ex.threads), memory_budget=np.int64(ex.memory_budget))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _logprobs(temperature, opts, hidden, weight, bias, tok, mask):
    B, T, _ = hidden.shape
    f = jax.ShapeDtypeStruct((B, T), jnp.float32)

    def host(*a):
        return tuple(jax.pure_callback(functools.partial(_logprobs_cb, temperature, dict(opts)),
                                       (f, f), *a))

    def device(roles, h, w, b, t, m):
        return tuple(_ffi(roles["logprobs"], (f, f), h, w, b, _int64_ids(t), _mask_bytes(m),
                          **_logprobs_attrs(temperature, opts)))
    return _per_platform(host, device, hidden, weight, bias, tok, mask)


def _logprobs_fwd(temperature, opts, hidden, weight, bias, tok, mask):
    return _logprobs(temperature, opts, hidden, weight, bias, tok, mask), (hidden, weight, bias,
                                                                           tok, mask)


def _logprobs_bwd(temperature, opts, res, ct):
    hidden, weight, bias, tok, mask = res
    g_lp, g_ent = ct
    S = jax.ShapeDtypeStruct
    shapes = (S(hidden.shape, jnp.float32), S(weight.shape, jnp.float32),
              S(bias.shape, jnp.float32))

    def host(*a):
        return tuple(jax.pure_callback(functools.partial(_logprobs_bwd_cb, temperature,
                                                         dict(opts)), shapes, *a))

    def device(roles, h, w, b, t, m, gl, ge):
        return tuple(_ffi(roles["logprobs_backward"], shapes, h, w, b, _int64_ids(t),
                          _mask_bytes(m), gl, ge, **_logprobs_attrs(temperature, opts)))
    gh, gw, gb = _per_platform(host, device, hidden, weight, bias, tok, mask,
                               g_lp.astype(jnp.float32), g_ent.astype(jnp.float32))
    return (gh.astype(hidden.dtype), gw.astype(weight.dtype), gb.astype(bias.dtype), None, None)


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd)


def linear_logprobs(hidden, weight, token_ids, mask=None, bias=None, *, temperature=1.0,
                    return_entropy=False, impl="fused", memory_budget=None, threads=None):
    """Log-probs of token_ids (and entropies) under the LM head
    softmax((hidden . weight^T + bias) / temperature), fused, differentiable
    (jax.custom_vjp through fg_linear_logprobs_backward, the logits
    recomputed), for any loss built on them. hidden [B, T, H] float32 or
    bfloat16, weight [V, H], token_ids / mask [B, T] (mask None: all). Returns
    logp [B, T] float32 (0 where masked), or (logp, entropy). Runs as a host
    callback on CPU devices, through the CUDA handlers on GPUs (see the note
    above)."""
    ids = _raw_ids(token_ids)
    mask = jnp.ones(ids.shape, jnp.bool_) if mask is None else jnp.asarray(mask)
    temperature = _options.LOSS_OPTIONS["temperature"].check("temperature", temperature)
    _options.make_exec(threads, memory_budget)
    B, T, H, V = _inputs.check_head(jnp.shape(hidden), jnp.shape(weight),
                                    None if bias is None else jnp.shape(bias))
    _inputs.check_tokens(ids.shape, ids.dtype, mask.shape, mask.dtype, B, T)
    if not _is_traced(mask):
        _inputs.check_mask_values(np.asarray(mask))
    _check_sizes(B, T, H, V)
    tok = jnp.asarray(_token_ids(ids, mask, V))
    b = jnp.zeros((0,), hidden.dtype) if bias is None else bias
    opts = tuple(sorted(dict(impl=impl, memory_budget=memory_budget, threads=threads).items()))
    lp, ent = _logprobs(float(temperature), opts, hidden, weight, b, tok, mask)
    return (lp, ent) if return_entropy else lp


def _shard_map(f, mesh, in_specs, out_specs):
    sm = getattr(jax, "shard_map", None)
    if sm is not None:
        try:
            return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        except TypeError:
            pass
    from jax.experimental.shard_map import shard_map
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
