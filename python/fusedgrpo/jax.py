"""JAX front end: the fused loss as an XLA FFI custom call on the CPU.

The handler (``_jax_ffi.cc``, C++ over the C library, written against
``jax.ffi.include_dir()``'s ``xla/ffi/api/ffi.h``) is built with the package
(scikit-build-core / CMake, ``python/jax_ffi.cmake``) when jax is present at
build time, and installed as ``fusedgrpo/libfusedgrpo_jax_ffi.so`` next to
``libfusedgrpo.so.0``. Importing this module loads it and registers it with
``jax.ffi.register_ffi_target``; if the package was built without it, the
import fails with an ImportError that says how to reinstall (jax installed
first, then ``pip install --no-build-isolation .``; see python/README.md).
``FUSEDGRPO_JAX_BACKEND=callback`` (read at import) asks instead for the
``jax.pure_callback`` over the NumPy front end (no handler needed, no vocab
sharding); ``=ffi`` is the default. ``backend()`` says which one is in use.

``fused_linear_grpo_loss`` is a ``jax.custom_vjp``: the forward of a
differentiated call computes the loss and all gradients in one C call (like
Liger), the backward scales them by the incoming cotangent. It works under
``jit``. ``fused_linear_grpo_loss_sharded`` runs it under ``shard_map`` over a
mesh: a batch axis (global normalizers fed at run time, results psum-ed) and/or
a vocab axis (weight rows split; the C library's communicator hook is served
in-process by the handler across the host devices' threads).
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from . import _lib
from ._lib import METRIC_NAMES, FusedGRPOError

__all__ = ["fused_linear_grpo_loss", "fused_linear_grpo_loss_sharded", "linear_logprobs",
           "backend", "call_totals", "handler_path", "METRIC_NAMES", "FusedGRPOError"]

_TARGET = "fusedgrpo_linear_grpo"
_HERE = os.path.dirname(os.path.abspath(__file__))
_HANDLER = "libfusedgrpo_jax_ffi.so"
_BACKENDS = ("ffi", "callback")
_state = {"backend": None, "so": None, "lib": None}


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
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.FgLinearGrpo),
                                    platform="cpu")
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
    """"ffi" (the XLA custom call built with the package, the default) or
    "callback" (jax.pure_callback, when FUSEDGRPO_JAX_BACKEND=callback)."""
    return _state["backend"]


def call_totals() -> dict:
    """Time spent inside the C library by the FFI handler since the process
    started: {"calls", "call_seconds", "gemm_seconds"} (zeros under the
    pure_callback backend, whose calls fusedgrpo.memory_stats() reports).
    A step's wall time minus its call_seconds is the front end's overhead."""
    out = (ctypes.c_double * 3)()
    if _state["lib"] is not None:
        _state["lib"].FgJaxCallTotals(out)
    return {"calls": int(out[0]), "call_seconds": out[1], "gemm_seconds": out[2]}


# ------------------------------------------------------------------ primitive call

class _Static(NamedTuple):
    """The call's static options: XLA FFI attributes (and the pure_callback's
    arguments). Hashable, so it can be custom_vjp's nondiff argument."""
    loss_type: str
    importance_sampling_level: str
    impl: str
    beta: float
    epsilon_low: float
    epsilon_high: float          # < 0: epsilon_low
    delta: float                 # <= 0: off
    temperature: float
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    max_completion_length: int   # <= 0: T
    use_bias_correction_kl: int
    threads: int                 # <= 0: OpenMP's default
    memory_budget: int           # bytes; 0: the library's default
    vocab_shards: int = 1        # set by the sharded wrapper
    vocab_total: int = 0
    filter_eps: float = 0.0      # gradient filtering (-1: auto; _lib.filter_eps_value)


def _static(loss_type="dapo", importance_sampling_level="token", impl="fused", beta=0.0,
            epsilon_low=0.2, epsilon_high=None, delta=None, temperature=1.0,
            sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, max_completion_length=None,
            use_bias_correction_kl=False, threads=None, memory_budget=None,
            filter_eps=0.0) -> _Static:
    if loss_type not in _lib.LOSS_TYPES:
        raise FusedGRPOError("FG_ERR_UNKNOWN_LOSS_TYPE", f"unknown loss_type {loss_type!r}")
    if importance_sampling_level not in _lib.LEVELS:
        raise FusedGRPOError("FG_ERR_UNKNOWN_LEVEL",
                             f"unknown importance_sampling_level {importance_sampling_level!r}")
    if delta is not None and not delta > 0:
        raise FusedGRPOError("FG_ERR_BAD_HYPERPARAMETER", f"delta must be > 0, got {delta}")
    exec_ = _lib.make_exec(threads, memory_budget)  # the NumPy front end's checks
    return _Static(loss_type, importance_sampling_level, impl, float(beta), float(epsilon_low),
                   -1.0 if epsilon_high is None else float(epsilon_high),
                   0.0 if delta is None else float(delta), float(temperature),
                   float(sapo_temperature_pos), float(sapo_temperature_neg),
                   0 if max_completion_length is None else int(max_completion_length),
                   1 if use_bias_correction_kl else 0, exec_.threads, exec_.memory_budget,
                   filter_eps=_lib.filter_eps_value(filter_eps))


def _empty(dtype=jnp.float32):
    return jnp.zeros((0,), dtype)


def _grad_dtypes(dtype):
    """grad_hidden, grad_weight, grad_bias dtypes: bf16 for bf16 inputs (the C
    call writes them, no float32 copy; grad_weight where the CPU has bf16 GEMM
    kernels), else float32."""
    if dtype != jnp.bfloat16:
        return (jnp.float32,) * 3
    import fusedgrpo
    bf = jnp.bfloat16
    return (bf, bf if fusedgrpo.bf16_gemms_native() else jnp.float32, bf)


def _out_types(B, T, H, V, need, dtype=jnp.float32):
    f = jnp.float32
    S = jax.ShapeDtypeStruct
    g = _grad_dtypes(dtype)
    return (S((), f), S((len(METRIC_NAMES),), f), S((B, T), f), S((B, T), f),
            S((B, T, H) if need[0] else (0,), g[0]), S((V, H) if need[1] else (0,), g[1]),
            S((V,) if need[2] else (0,), g[2]))


def _callback_impl(cfg, need, hidden, weight, bias, tok, mask, adv, old, ref, isr, scalars,
                   shard):
    import fusedgrpo as fg
    sc = np.asarray(scalars)
    r = fg.fused_linear_grpo(
        np.asarray(hidden), np.asarray(weight), np.asarray(tok), np.asarray(mask),
        np.asarray(adv), None if old.size == 0 else np.asarray(old),
        None if ref.size == 0 else np.asarray(ref), bias=None if bias.size == 0 else
        np.asarray(bias), is_ratio=None if isr.size == 0 else np.asarray(isr), beta=cfg.beta,
        epsilon_low=cfg.epsilon_low,
        epsilon_high=None if cfg.epsilon_high < 0 else cfg.epsilon_high,
        delta=None if cfg.delta <= 0 else cfg.delta, temperature=cfg.temperature,
        loss_type=cfg.loss_type, importance_sampling_level=cfg.importance_sampling_level,
        max_completion_length=None if cfg.max_completion_length <= 0
        else cfg.max_completion_length,
        num_items_in_batch=None if sc[0] < 0 else float(sc[0]),
        sapo_temperature_pos=cfg.sapo_temperature_pos,
        sapo_temperature_neg=cfg.sapo_temperature_neg,
        use_bias_correction_kl=bool(cfg.use_bias_correction_kl), entropy_coef=float(sc[1]),
        memory_budget=cfg.memory_budget, threads=cfg.threads, impl=cfg.impl,
        compute_grad=any(need), filter_eps=cfg.filter_eps)
    z = np.zeros((0,), np.float32)
    g = _grad_dtypes(hidden.dtype)  # the callback path casts (the FFI path writes them)
    return (np.float32(r.loss), np.array([r.metrics[n] for n in METRIC_NAMES], np.float32),
            r.logp, r.entropy, r.grad_hidden.astype(g[0]) if need[0] else z.astype(g[0]),
            r.grad_weight.astype(g[1]) if need[1] else z.astype(g[1]),
            r.grad_bias.astype(g[2]) if need[2] else z.astype(g[2]))


def _prim(cfg, need, hidden, weight, bias, tok, mask, adv, old, ref, isr, scalars, shard):
    B, T, H = hidden.shape
    V = weight.shape[0]
    has_bias = bias is not None
    need = (need[0], need[1], need[2] and has_bias)
    bias = bias if has_bias else _empty(hidden.dtype)
    old = _empty() if old is None else old.astype(jnp.float32)
    ref = _empty() if ref is None else ref.astype(jnp.float32)
    isr = _empty() if isr is None else isr.astype(jnp.float32)
    if isr.ndim == 2 and isr.shape == (B, 1) and T != 1:
        isr = isr.reshape(B)
    tok = tok if tok.dtype in (jnp.int32, jnp.int64) else tok.astype(jnp.int32)
    mask = mask.astype(jnp.uint8)
    adv = adv.astype(jnp.float32).reshape(B)
    shard = jnp.zeros((2,), jnp.int32) if shard is None else shard.astype(jnp.int32)
    types = _out_types(B, T, H, V, need, hidden.dtype)
    args = (hidden, weight, bias, tok, mask, adv, old, ref, isr, scalars, shard)
    if backend() == "ffi":
        call = jax.ffi.ffi_call(_TARGET, types, vmap_method="sequential")
        return call(*args, loss_type=cfg.loss_type, level=cfg.importance_sampling_level,
                    impl=cfg.impl, beta=np.float64(cfg.beta),
                    epsilon_low=np.float64(cfg.epsilon_low),
                    epsilon_high=np.float64(cfg.epsilon_high), delta=np.float64(cfg.delta),
                    temperature=np.float64(cfg.temperature),
                    sapo_temperature_pos=np.float64(cfg.sapo_temperature_pos),
                    sapo_temperature_neg=np.float64(cfg.sapo_temperature_neg),
                    max_completion_length=np.int64(cfg.max_completion_length),
                    use_bias_correction_kl=np.int64(cfg.use_bias_correction_kl),
                    threads=np.int64(cfg.threads), memory_budget=np.int64(cfg.memory_budget),
                    vocab_shards=np.int64(cfg.vocab_shards),
                    vocab_total=np.int64(cfg.vocab_total),
                    filter_eps=np.float64(cfg.filter_eps))
    if cfg.vocab_shards > 1:
        raise NotImplementedError("fusedgrpo.jax: vocab sharding needs the FFI handler "
                                  "(the pure_callback backend cannot do it)")
    return jax.pure_callback(functools.partial(_callback_impl, cfg, need), types, *args,
                             vmap_method="sequential")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, hidden, weight, bias, batch):
    outs = _prim(cfg, (False, False, False), hidden, weight, bias, *batch)
    return outs[0], tuple(outs[1:4])


def _core_fwd(cfg, hidden, weight, bias, batch):
    outs = _prim(cfg, (True, True, True), hidden, weight, bias, *batch)
    dts = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    shard = batch[-1]
    # Vocab-sharded: every shard holds the whole (all-reduced) grad_hidden, and
    # shard_map's transpose sums the cotangents of the vocab-replicated hidden
    # over the vocab axis: keep it on rank 0 only.
    keep = None if shard is None else (shard[0] == 0).astype(jnp.float32)
    return (outs[0], tuple(outs[1:4])), (outs[4], outs[5], outs[6] if bias is not None else None,
                                         keep, _DtypeBox(dts))


class _DtypeBox:
    """Static dtypes carried through the residuals (a pytree with no leaves)."""

    def __init__(self, dts):
        self.dts = dts


jax.tree_util.register_pytree_node(_DtypeBox, lambda b: ((), b.dts),
                                   lambda dts, _: _DtypeBox(dts))


def _core_bwd(cfg, res, ct):
    gh, gw, gb, keep, box = res
    g = ct[0]
    if keep is not None:
        # Vocab-sharded: the wrapper's loss is the mean of the nv shards' (equal)
        # losses, but each shard's loss depends on every shard's weight rows
        # through the in-kernel all-reduce that JAX cannot see: the gradient for
        # this shard's inputs is that of the whole loss, i.e. nv times its share.
        g = g * cfg.vocab_shards
        gh = gh * keep.astype(gh.dtype)
    dh_t, dw_t, db_t = box.dts
    # in the gradients' own dtype: bf16 stays bf16 (g is 1 from jax.grad: exact)
    dh = (gh * g.astype(gh.dtype)).astype(dh_t)
    dw = (gw * g.astype(gw.dtype)).astype(dw_t)
    db = None if gb is None else (gb * g.astype(gb.dtype)).astype(db_t)
    return dh, dw, db, None


_core.defvjp(_core_fwd, _core_bwd)


def _batch(token_ids, mask, advantages, old_logp, ref_logp, is_ratio, items, entropy_coef,
           shard=None):
    scalars = jnp.stack([jnp.asarray(items, jnp.float32),
                         jnp.asarray(entropy_coef, jnp.float32)])
    return (jnp.asarray(token_ids), jnp.asarray(mask), jnp.asarray(advantages),
            None if old_logp is None else jnp.asarray(old_logp),
            None if ref_logp is None else jnp.asarray(ref_logp),
            None if is_ratio is None else jnp.asarray(is_ratio), scalars, shard)


def _aux(metrics, logp, ent):
    d = {n: metrics[i] for i, n in enumerate(METRIC_NAMES)}
    return {"metrics": d, "logp": logp, "entropy": ent}


def fused_linear_grpo_loss(hidden, weight, token_ids, mask, advantages, old_logp=None,
                           ref_logp=None, *, bias=None, is_ratio=None, beta=0.0,
                           epsilon_low=0.2, epsilon_high=None, delta=None, temperature=1.0,
                           loss_type="dapo", importance_sampling_level="token",
                           max_completion_length=None, num_items_in_batch=None,
                           sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                           use_bias_correction_kl=False, entropy_coef=0.0, impl="fused",
                           memory_budget=None, threads=None, return_aux=False,
                           filter_eps=0.0):
    """The loss of LOSS_SPEC.md from hidden [B, T, H] (float32 or bfloat16), weight
    [V, H] (same dtype), bias [V]; differentiable w.r.t. hidden, weight, bias.
    ``num_items_in_batch`` and ``entropy_coef`` may be traced values.
    ``filter_eps``: gradient filtering, 0 (off), "auto" or a threshold
    (fusedgrpo.fused_linear_grpo). With
    ``return_aux=True`` returns ``(loss, {"metrics": {...}, "logp", "entropy"})``
    (aux is not differentiable)."""
    cfg = _static(loss_type, importance_sampling_level, impl, beta, epsilon_low, epsilon_high,
               delta, temperature, sapo_temperature_pos, sapo_temperature_neg,
               max_completion_length, use_bias_correction_kl, threads, memory_budget,
               filter_eps)
    items = -1.0 if num_items_in_batch is None else num_items_in_batch
    batch = _batch(token_ids, mask, advantages, old_logp, ref_logp, is_ratio, items,
                   entropy_coef)
    loss, (metrics, logp, ent) = _core(cfg, hidden, weight, bias, batch)
    return (loss, _aux(metrics, logp, ent)) if return_aux else loss


def fused_linear_grpo_loss_sharded(mesh, hidden, weight, token_ids, mask, advantages,
                                   old_logp=None, ref_logp=None, *, bias=None, is_ratio=None,
                                   batch_axis="batch", vocab_axis=None, beta=0.0,
                                   epsilon_low=0.2, epsilon_high=None, delta=None,
                                   temperature=1.0, loss_type="dapo",
                                   importance_sampling_level="token",
                                   max_completion_length=None, num_items_in_batch=None,
                                   sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                                   use_bias_correction_kl=False, entropy_coef=0.0,
                                   impl="fused", memory_budget=None, threads=None,
                                   return_aux=False, filter_eps=0.0):
    """The same loss under ``jax.shard_map`` over ``mesh``.

    ``batch_axis`` (or None): sequences are split over it (B must divide
    evenly); each shard runs the kernel on its sequences with the global
    normalizers (token counts, B) computed by psum and fed at run time, and the
    results are psum-ed, so the loss equals the single-device one.
    ``vocab_axis`` (or None): weight and bias are split by vocab rows over it
    (V must divide evenly); the kernel's communicator hook merges the row
    statistics and grad_hidden across the shards of a group in-process (FFI
    handler only: one process, its host devices). Other mesh axes replicate.
    Gradients flow to hidden, weight and bias with their input shardings."""
    from jax.sharding import PartitionSpec as P

    cfg = _static(loss_type, importance_sampling_level, impl, beta, epsilon_low, epsilon_high,
               delta, temperature, sapo_temperature_pos, sapo_temperature_neg,
               max_completion_length, use_bias_correction_kl, threads, memory_budget,
               filter_eps)
    nb = mesh.shape[batch_axis] if batch_axis else 1
    nv = mesh.shape[vocab_axis] if vocab_axis else 1
    B_glob, V_glob = hidden.shape[0], weight.shape[0]
    if B_glob % nb:
        raise ValueError(f"batch {B_glob} does not divide over {nb} shards of {batch_axis!r}")
    if V_glob % nv:
        raise ValueError(f"vocab {V_glob} does not divide over {nv} shards of {vocab_axis!r}")
    if nv > 1:
        if backend() != "ffi":
            raise NotImplementedError("fusedgrpo.jax: vocab sharding needs the FFI handler")
        cfg = cfg._replace(vocab_shards=nv, vocab_total=V_glob)
    bspec = P(batch_axis) if batch_axis else P()
    vspec = P(vocab_axis) if vocab_axis else P()
    names = ["hidden", "weight", "token_ids", "mask", "advantages", "old_logp", "ref_logp",
             "bias", "is_ratio"]
    vals = [hidden, weight, token_ids, mask, advantages, old_logp, ref_logp, bias, is_ratio]
    by_batch = {"hidden", "token_ids", "mask", "advantages", "old_logp", "ref_logp", "is_ratio"}
    present = [(n, v) for n, v in zip(names, vals) if v is not None]
    specs = tuple(bspec if n in by_batch else vspec if n in ("weight", "bias") else P()
                  for n, _ in present)
    user_items = num_items_in_batch

    def psum_b(x):
        return lax.psum(x, batch_axis) if batch_axis else x

    def nan_extreme(x, reduce):  # TRL's nanmin / nanmax over every shard's sequences
        if not batch_axis:
            return x
        fill = jnp.inf if reduce is lax.pmin else -jnp.inf
        r = reduce(jnp.where(jnp.isnan(x), fill, x), batch_axis)
        return jnp.where(jnp.isinf(r), jnp.nan, r)

    def local(*arrs):
        a = dict(zip([n for n, _ in present], arrs))
        m = a["mask"]
        n_loc = jnp.sum(m != 0).astype(jnp.float32)
        n_glob = psum_b(n_loc)
        B_loc = a["hidden"].shape[0]
        n_loc1, n_glob1 = jnp.maximum(n_loc, 1.0), jnp.maximum(n_glob, 1.0)
        if loss_type in ("grpo", "sapo", "luspo", "dr_grpo"):
            s_p = jnp.float32(B_loc / B_glob)
            items = -1.0
        elif loss_type == "bnpo":
            s_p = n_loc1 / n_glob1
            items = -1.0
        else:  # dapo, cispo: one global normalizer
            s_p = jnp.float32(1.0)
            items = n_glob if user_items is None else user_items
        s_p = lax.stop_gradient(s_p)
        c_eff = entropy_coef * n_loc1 / (n_glob1 * s_p)
        shard = None
        if nv > 1:
            group = lax.axis_index(batch_axis) if batch_axis else 0
            shard = jnp.stack([lax.axis_index(vocab_axis), group]).astype(jnp.int32)
        batch = _batch(a["token_ids"], m, a["advantages"], a.get("old_logp"),
                       a.get("ref_logp"), a.get("is_ratio"), items, c_eff, shard)
        loss, (metrics, logp, ent) = _core(cfg, a["hidden"], a["weight"], a.get("bias"), batch)
        loss = psum_b(s_p * loss)
        # METRIC_NAMES: kl, entropy (token means); the clip fractions (token
        # means, or sequence means at the sequence level); the per-sequence
        # min / max; vespo's weight (a sequence mean); the policy loss (as the loss)
        metrics = lax.stop_gradient(metrics)  # metrics carry no gradient (pmin has no rule)
        B_loc_f = jnp.float32(B_loc)
        w_clip = B_loc_f if cfg.importance_sampling_level == "sequence" else n_loc
        d_clip = jnp.float32(B_glob) if cfg.importance_sampling_level == "sequence" else n_glob1
        metrics = jnp.concatenate([
            psum_b(metrics[0:2] * n_loc) / n_glob1,
            psum_b(metrics[2:6] * w_clip) / d_clip,
            nan_extreme(metrics[6:7], lax.pmin), nan_extreme(metrics[7:8], lax.pmax),
            psum_b(metrics[8:9] * B_loc_f) / jnp.float32(B_glob),
            psum_b(s_p * metrics[9:10])])
        if nv > 1:
            loss = loss[None]  # one (equal) value per vocab shard, averaged outside
        return loss, metrics, logp, ent

    lspec = P(vocab_axis) if nv > 1 else P()
    fn = _shard_map(local, mesh, specs, (lspec, P(), bspec, bspec))
    loss, metrics, logp, ent = fn(*[v for _, v in present])
    if nv > 1:
        loss = jnp.mean(loss)
    return (loss, _aux(metrics, logp, ent)) if return_aux else loss


# ------------------------------------------------------- log-probs of the head
#
# Through jax.pure_callback over the NumPy functions (fg_linear_logprobs and
# fg_linear_logprobs_backward), on the CPU; not yet an FFI target: under jit it
# is one host callback per pass, and it does not take part in shard_map
# collectives (issue 13's phase API will).

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _logprobs(temperature, opts, hidden, weight, bias, tok, mask):
    B, T, _ = hidden.shape
    f = jax.ShapeDtypeStruct((B, T), jnp.float32)
    return jax.pure_callback(functools.partial(_logprobs_cb, temperature, dict(opts)), (f, f),
                             hidden, weight, bias, tok, mask)


def _logprobs_fwd(temperature, opts, hidden, weight, bias, tok, mask):
    return _logprobs(temperature, opts, hidden, weight, bias, tok, mask), (hidden, weight, bias,
                                                                           tok, mask)


def _logprobs_bwd(temperature, opts, res, ct):
    hidden, weight, bias, tok, mask = res
    g_lp, g_ent = ct
    S = jax.ShapeDtypeStruct
    shapes = (S(hidden.shape, jnp.float32), S(weight.shape, jnp.float32),
              S(bias.shape, jnp.float32))
    gh, gw, gb = jax.pure_callback(functools.partial(_logprobs_bwd_cb, temperature, dict(opts)),
                                   shapes, hidden, weight, bias, tok, mask,
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
    callback (see the note above)."""
    if mask is None:
        mask = jnp.ones(token_ids.shape, jnp.bool_)
    b = jnp.zeros((0,), hidden.dtype) if bias is None else bias
    opts = tuple(sorted(dict(impl=impl, memory_budget=memory_budget, threads=threads).items()))
    lp, ent = _logprobs(float(temperature), opts, hidden, weight, b, token_ids, mask)
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
