"""fusedgrpo: the GRPO policy loss of LLM RL fused with the LM head.

NumPy front end of the C library (libfusedgrpo, through ctypes). The numerical
contract is LOSS_SPEC.md (TRL / Liger-Kernel conventions). Optional front ends:
``fusedgrpo.torch`` (PyTorch custom op + nn.Module) and ``fusedgrpo.jax``
(XLA FFI custom call).

Storage dtypes: float32, or bfloat16. bfloat16 data is passed either as numpy
``uint16`` bit patterns (or ml_dtypes ``bfloat16`` arrays), which are always
taken as bf16 whatever ``dtype`` says, or as float arrays together with
``dtype="bfloat16"``, which are rounded to bf16 (nearest even) first.
Gradients come back in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import _inputs, _lib, _options
from ._lib import FusedGRPOError, METRIC_NAMES, library_path, include_dir
from ._options import LOSS_TYPES, LEVELS, OPTION_NAMES

__version__ = "0.1.0"
__all__ = ["fused_linear_grpo", "fused_linear_grpo_plan", "logits_grpo", "GRPOResult",
           "FusedGRPOError", "LOSS_TYPES", "LEVELS", "METRIC_NAMES", "OPTION_NAMES",
           "f32_to_bf16_bits",
           "bf16_bits_to_f32", "memory_stats", "reset_peak_memory", "release_workspace",
           "bf16_gemms_native", "fused_linear_logprobs", "fused_linear_logprobs_backward",
           "library_path", "include_dir", "__version__"]


@dataclass
class GRPOResult:
    loss: float
    logp: np.ndarray
    entropy: np.ndarray
    metrics: dict
    grad_hidden: Optional[np.ndarray] = None
    grad_weight: Optional[np.ndarray] = None
    grad_bias: Optional[np.ndarray] = None
    grad_logits: Optional[np.ndarray] = None
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------ bf16

_CHUNK = 1 << 22


def f32_to_bf16_bits(x) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN.
    Works in bounded chunks so a big weight needs no full-size temporaries."""
    x = np.asarray(x)
    out = np.empty(x.shape, dtype=np.uint16)
    src = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    dst = out.reshape(-1)
    for s in range(0, src.size, _CHUNK):
        u = src[s:s + _CHUNK].view(np.uint32)
        r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        if nan.any():
            r[nan] = (u[nan] >> np.uint32(16)) | np.uint32(0x40)
        dst[s:s + _CHUNK] = r
    return out


def bf16_bits_to_f32(x) -> np.ndarray:
    """bfloat16 bit patterns (uint16 or ml_dtypes.bfloat16) -> float32."""
    x = np.asarray(x)
    if x.dtype != np.uint16:
        x = x.view(np.uint16) if x.dtype.itemsize == 2 else x.astype(np.uint16)
    return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _is_bf16_dtype(dt) -> bool:  # ml_dtypes.bfloat16 (kind 'V'), without importing it
    return dt.kind == "V" and dt.name == "bfloat16"


def _is_bf16_storage(a) -> bool:
    return isinstance(a, np.ndarray) and (a.dtype == np.uint16 or _is_bf16_dtype(a.dtype))


def _dtype_id(dtype, *arrays) -> int:
    if any(_is_bf16_storage(a) for a in arrays if a is not None):
        return _lib.DTYPE_BF16
    if dtype in ("float32", np.float32, "f32", None):
        return _lib.DTYPE_F32
    if dtype in ("bfloat16", "bf16"):
        return _lib.DTYPE_BF16
    raise FusedGRPOError("FG_ERR_UNSUPPORTED", f"dtype must be 'float32' or 'bfloat16', got "
                         f"{dtype!r}")


def _float_kind(a):
    """What fusedgrpo._inputs.check_floating reads of an operand: its dtype, a
    bf16 bit array (uint16) counting as floating point."""
    a = np.asarray(a)
    return np.dtype(np.float32) if _is_bf16_storage(a) else a.dtype


def _storage(a, dt: int, name: str) -> np.ndarray:
    """An array whose last axis is contiguous, in the storage dtype (no copy when it
    already is)."""
    a = np.asarray(a)
    if dt == _lib.DTYPE_BF16:
        if _is_bf16_dtype(a.dtype):
            a = a.view(np.uint16)
        elif a.dtype != np.uint16:
            return f32_to_bf16_bits(a)
    elif a.dtype != np.float32:
        if a.dtype == np.uint16 or _is_bf16_dtype(a.dtype):
            raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH",
                                 f"{name} is bfloat16 but another input is float32")
        a = a.astype(np.float32)
    if a.ndim and (a.strides[-1] != a.itemsize):
        a = np.ascontiguousarray(a)
    return a


def _rows_view(a: np.ndarray, lead: int):
    """(array, ld) for `a` seen as a row-major [rows, cols] matrix with unit column
    stride, the first `lead` axes flattened into rows. No copy when the leading
    axes can be expressed with one positive row stride ld >= cols."""
    item = a.itemsize
    cols = a.shape[-1]
    ok = a.strides[-1] == item or cols == 1
    ld = None
    inner = None  # (stride, extent) of the inner non-trivial leading axis
    for i in reversed(range(lead)):
        if not ok or a.shape[i] == 1:
            continue
        s = a.strides[i]
        if s <= 0 or s % item:
            ok = False
        elif inner is None:
            ld = s // item
            inner = (s, a.shape[i])
        elif s != inner[0] * inner[1]:
            ok = False
        else:
            inner = (s, a.shape[i])
    if ld is None:
        ld = cols
    if ok and ld >= cols:
        return a, int(ld)
    a = np.ascontiguousarray(a)
    return a, int(cols)


def _vec(a, dtype, shape, name):
    if a is None:
        return None
    a = np.asarray(a)
    _inputs.check_real(name, a.dtype)  # before a conversion drops an imaginary part
    a = np.ascontiguousarray(a, dtype=dtype)
    if a.shape != shape:
        raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", f"{name} has shape {a.shape}, expected "
                             f"{shape}")
    return a


def _token_arrays(token_ids, mask, B, T):
    """token_ids (int64) and mask (uint8) [B, T], contiguous, as the C call reads them."""
    tok = np.asarray(token_ids)
    m = np.asarray(mask)
    _inputs.check_tokens(tok.shape, tok.dtype, m.shape, m.dtype, B, T)
    _inputs.check_mask_values(m)
    tok = np.ascontiguousarray(tok, dtype=np.int64)
    if m.dtype == np.bool_ and m.flags.c_contiguous:
        m = m.view(np.uint8)
    elif m.dtype != np.uint8 or not m.flags.c_contiguous:
        m = np.ascontiguousarray(m != 0, dtype=np.uint8)
    return tok, m


def _batch_arrays(token_ids, mask, advantages, old_logp, ref_logp, is_ratio, B, T,
                  sampling_logp=None):
    tok, m = _token_arrays(token_ids, mask, B, T)
    arrays = dict(advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                  is_ratio=is_ratio, sampling_logp=sampling_logp)
    arrays = {k: None if a is None else np.asarray(a) for k, a in arrays.items()}
    per_seq = _inputs.check_batch(
        B, T, arrays["advantages"].shape,
        **{k: None if a is None else a.shape for k, a in arrays.items() if k != "advantages"},
        kinds={k: a.dtype for k, a in arrays.items() if a is not None})
    f32 = {k: None if a is None else np.ascontiguousarray(a, dtype=np.float32)
           for k, a in arrays.items()}
    adv = f32["advantages"].reshape(B)
    isr = f32["is_ratio"]
    if per_seq:
        isr = isr.reshape(B)
    return tok, m, adv, f32["old_logp"], f32["ref_logp"], isr, per_seq, f32["sampling_logp"]


def _ptr(a) -> int:
    return 0 if a is None else a.ctypes.data


def _linear_operands(hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp,
                     is_ratio, dtype, sampling_logp=None):
    """(operands, request): the LM-head inputs and the batch in storage form,
    which the caller keeps alive through the C call, and the keyword arguments
    of _lib.linear_call / _lib.linear_plan that point at them."""
    head, request = _head_operands(hidden, weight, bias, token_ids, mask, dtype)
    B, T = request["B"], request["T"]
    _, _, adv, old, ref, isr, per_seq, samp = _batch_arrays(
        head[3], head[4], advantages, old_logp, ref_logp, is_ratio, B, T, sampling_logp)
    request.update(advantages=_ptr(adv), old_logp=_ptr(old), ref_logp=_ptr(ref),
                   is_ratio=_ptr(isr), is_ratio_per_sequence=per_seq, sampling_logp=_ptr(samp))
    return head + (adv, old, ref, isr, samp), request


@_options.with_loss_options
def fused_linear_grpo(hidden, weight, token_ids, mask, advantages, old_logp=None, ref_logp=None,
                      *, bias=None, is_ratio=None, sampling_logp=None, dtype="float32",
                      memory_budget=None, threads=None, impl="fused", compute_grad=True,
                      grad_dtype="float32", filter_eps=0.0, **options) -> GRPOResult:
    """The GRPO loss of LOSS_SPEC.md from LM-head inputs, forward and backward.

    hidden [B, T, H], weight [V, H], bias [V] (optional), token_ids / mask [B, T],
    advantages [B], old_logp / ref_logp [B, T], is_ratio [B, T] or [B],
    sampling_logp [B, T] (the sampler's log-probs, read by the off-policy mask;
    NaN marks an unscored token). The loss options are TRL 1.16 GRPOConfig's
    (docs/LOSS_SPEC.md), keyword-only, fusedgrpo.OPTION_NAMES (the table of
    fusedgrpo._options: default, range, what None means; off_policy_mask_threshold
    None is off).
    ``impl`` is "fused" (bounded working memory, ``memory_budget`` bytes, default
    256 MiB) or "materialized" (the plain baseline). ``threads``: OpenMP threads
    of this call (default: OpenMP's). ``compute_grad=False`` skips the two
    gradient GEMMs (loss, logp, entropy and metrics only).
    ``grad_dtype="bfloat16"`` (bf16 inputs only) has the library write the
    gradients in bf16, summed in float32 and rounded once (fusedgrpo.h); they
    come back as float32 arrays holding those bf16 values.
    ``filter_eps`` (fused): gradient filtering, 0 off (default), "auto" or a
    threshold: the backward products drop each row's d loss/d logits entries
    below filter_eps times its largest (docs/LOSS_SPEC.md "Gradient
    filtering"); loss, logp, entropy, metrics and grad_bias are unaffected.
    Returns a GRPOResult (grad_bias None without a bias).
    """
    cfg = _options.loss_config(options)
    ex = _options.make_exec(threads, memory_budget)
    gdt = _grad_dtype_id(grad_dtype)
    filter_eps = _lib.filter_eps_value(filter_eps)
    operands, request = _linear_operands(hidden, weight, bias, token_ids, mask, advantages,
                                         old_logp, ref_logp, is_ratio, dtype, sampling_logp)
    B, T, H, V = (request[k] for k in "BTHV")
    has_bias = operands[2] is not None
    logp = np.empty((B, T), np.float32)
    ent = np.empty((B, T), np.float32)
    gnp = np.uint16 if gdt == _lib.DTYPE_BF16 else np.float32
    gh = np.empty((B, T, H), gnp) if compute_grad else None
    gw = np.empty((V, H), gnp) if compute_grad else None
    gb = np.empty((V,), gnp) if (compute_grad and has_bias) else None
    loss, metrics = _lib.linear_call(
        cfg, impl, ex, **request, logp=_ptr(logp),
        entropy=_ptr(ent), grad_hidden=_ptr(gh), grad_weight=_ptr(gw), grad_bias=_ptr(gb),
        grad_dtypes=(gdt, gdt, gdt), filter_eps=filter_eps)
    if gdt == _lib.DTYPE_BF16:
        gh, gw, gb = (None if g is None else bf16_bits_to_f32(g) for g in (gh, gw, gb))
    return GRPOResult(loss=loss, logp=logp, entropy=ent, metrics=metrics, grad_hidden=gh,
                      grad_weight=gw, grad_bias=gb)


def _grad_dtype_id(grad_dtype) -> int:
    try:
        name = grad_dtype if isinstance(grad_dtype, str) else np.dtype(grad_dtype).name
    except TypeError:
        name = None
    if name == "float32":
        return _lib.DTYPE_F32
    if name == "bfloat16":
        return _lib.DTYPE_BF16
    raise FusedGRPOError("FG_ERR_UNSUPPORTED", f"grad_dtype must be 'float32' or 'bfloat16', "
                         f"got {grad_dtype!r}")


@_options.with_loss_options
def fused_linear_grpo_plan(hidden, weight, token_ids, mask, advantages, old_logp=None,
                           ref_logp=None, *, bias=None, is_ratio=None, sampling_logp=None,
                           dtype="float32", memory_budget=None, threads=None, impl="fused",
                           compute_grad=True, grad_dtype="float32", filter_eps=0.0,
                           **options) -> dict:
    """What ``fused_linear_grpo`` with the same arguments would hold, without
    running it (the C planner, fg_linear_grpo_plan): a dict with chunk_rows
    (the first chunk's rows, the largest), later_chunk_rows (each later
    chunk's, the last maybe fewer), chunks, working_bytes (the workspace the call holds, which memory_stats()
    then reports as peak_bytes), fixed_bytes, chunk_bytes, gemm_scratch_bytes,
    min_budget_bytes (the smallest memory_budget the call runs with), gemm_dtype
    and grad_weight_sum_bytes (a bf16 grad_weight's float32 sums). A budget
    below that raises FusedGRPOError (FG_ERR_BUDGET_TOO_SMALL) whose ``.plan``
    is that dict."""
    cfg = _options.loss_config(options)
    ex = _options.make_exec(threads, memory_budget)
    gdt = _grad_dtype_id(grad_dtype)
    filter_eps = _lib.filter_eps_value(filter_eps)
    operands, request = _linear_operands(hidden, weight, bias, token_ids, mask, advantages,
                                         old_logp, ref_logp, is_ratio, dtype, sampling_logp)
    has_bias = operands[2] is not None
    return _lib.linear_plan(cfg, impl, ex,
                            want_grad_hidden=compute_grad, want_grad_weight=compute_grad,
                            want_grad_bias=compute_grad and has_bias,
                            grad_dtypes=(gdt, gdt, gdt), filter_eps=filter_eps, **request)


@_options.with_loss_options
def logits_grpo(logits, token_ids, mask, advantages, old_logp=None, ref_logp=None, *,
                is_ratio=None, sampling_logp=None, dtype="float32", threads=None,
                compute_grad=True, inplace=False, **options) -> GRPOResult:
    """The same loss from logits [B, T, V] the caller already holds.

    ``grad_logits`` ([B, T, V], d loss / d logits) comes back in float32, or with
    ``inplace=True`` is written over ``logits`` itself (which must then be a
    writable float32 / uint16-bf16 array whose last axis is contiguous, sharing
    no memory with the other arguments) and returned as that same array. The C
    call writes it directly where one row stride describes the array (any
    contiguous array, a slice of the vocabulary axis); other views, such as
    TRL's ``logits[:, -C:]`` or a reversed axis, are computed in a contiguous
    copy that is then written back into them. A refused call leaves the logits
    unchanged.
    """
    cfg = _options.loss_config(options)
    ex = _options.make_exec(threads)
    dt = _dtype_id(dtype, logits)
    if inplace:  # the caller's memory, seen in the storage dtype
        _inplace_target(logits, dt, dict(token_ids=token_ids, mask=mask, advantages=advantages,
                                         old_logp=old_logp, ref_logp=ref_logp, is_ratio=is_ratio,
                                         sampling_logp=sampling_logp))
        lg = logits.view(np.uint16) if _is_bf16_dtype(logits.dtype) else logits
    else:
        _inputs.check_floating("logits", _float_kind(logits))
        lg = _storage(logits, dt, "logits")
    if lg.ndim != 3:
        raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", f"logits must be [B, T, V], got shape "
                             f"{lg.shape}")
    B, T, V = lg.shape
    caller_view = lg
    lg, ldl = _rows_view(lg, 2)
    tok, m, adv, old, ref, isr, per_seq, samp = _batch_arrays(
        token_ids, mask, advantages, old_logp, ref_logp, is_ratio, B, T, sampling_logp)
    logp = np.empty((B, T), np.float32)
    ent = np.empty((B, T), np.float32)
    if not compute_grad:
        g, ldg, gdt = None, V, _lib.DTYPE_F32
    elif inplace:  # over the logits (or their contiguous copy, written back below)
        g, ldg, gdt = lg, ldl, dt
    else:
        g, ldg, gdt = np.empty((B, T, V), np.float32), V, _lib.DTYPE_F32
    loss, metrics = _lib.logits_call(
        cfg, ex, B=B, T=T, V=V, dtype=dt, logits=_ptr(lg), ld_logits=ldl,
        token_ids=_ptr(tok), mask=_ptr(m), advantages=_ptr(adv), old_logp=_ptr(old),
        ref_logp=_ptr(ref), is_ratio=_ptr(isr), is_ratio_per_sequence=per_seq,
        sampling_logp=_ptr(samp), logp=_ptr(logp), entropy=_ptr(ent),
        grad_logits=_ptr(g), ld_grad_logits=ldg, grad_dtype=gdt)
    if inplace and compute_grad:
        if lg is not caller_view:
            np.copyto(caller_view, lg)
        g = logits
    return GRPOResult(loss=loss, logp=logp, entropy=ent, metrics=metrics, grad_logits=g)


def _inplace_target(logits, dt: int, others: dict):
    """logits_grpo(inplace=True)'s checks of the caller's array, before anything
    runs: already in the storage dtype (a conversion would be a copy the
    gradient never reaches), writable, last axis contiguous, no two elements
    in one place (the gradient of each written there), and no memory shared
    with another argument (by address range, as the C library checks its
    outputs)."""
    storage = (np.float32,) if dt == _lib.DTYPE_F32 else (np.uint16,)
    ok = isinstance(logits, np.ndarray) and (logits.dtype in storage or (
        dt == _lib.DTYPE_BF16 and _is_bf16_dtype(logits.dtype)))
    if not ok or (logits.ndim and logits.shape[-1] > 1
                  and logits.strides[-1] != logits.itemsize):
        raise FusedGRPOError("FG_ERR_UNSUPPORTED", "inplace=True needs logits already in the "
                             "storage dtype with a contiguous last axis")
    if not logits.flags.writeable:
        raise FusedGRPOError("FG_ERR_UNSUPPORTED", "inplace=True needs writable logits")
    if logits.ndim == 3 and _overlaps_itself(logits):
        raise FusedGRPOError("FG_ERR_ALIASED_OUTPUT", "inplace=True needs logits whose "
                             f"elements do not overlap (strides {logits.strides})")
    for name, a in others.items():
        if isinstance(a, np.ndarray) and np.may_share_memory(logits, a):
            raise FusedGRPOError("FG_ERR_ALIASED_OUTPUT", f"grad_logits (inplace=True: the "
                                 f"logits) shares memory with {name}")


def _overlaps_itself(a: np.ndarray) -> bool:
    """Whether two rows of a [B, T, V] array (last axis contiguous) may share
    memory: its rows, nested by |stride|, must each lie past the last."""
    row = a.shape[-1] * a.itemsize
    extent = row
    for n, s in sorted(((n, abs(s)) for n, s in zip(a.shape[:2], a.strides[:2]) if n > 1),
                       key=lambda ns: ns[1]):
        if s < extent:
            return True
        extent = s * (n - 1) + extent
    return False


def _head_operands(hidden, weight, bias, token_ids, mask, dtype):
    """(operands, request): the LM-head inputs and the tokens in storage form
    (kept alive by the caller) and the keyword arguments of the C calls that
    point at them (mask None: every token)."""
    dt = _dtype_id(dtype, hidden, weight, bias)
    kinds = [None if a is None else _float_kind(a) for a in (hidden, weight, bias)]
    for name, kind in zip(("hidden", "weight", "bias"), kinds):
        if kind is not None:  # before a conversion drops an imaginary part
            _inputs.check_floating(name, kind)
    h = _storage(hidden, dt, "hidden")
    w = _storage(weight, dt, "weight")
    b = None if bias is None else np.ascontiguousarray(_storage(bias, dt, "bias"))
    B, T, H, V = _inputs.check_head(h.shape, w.shape, None if b is None else b.shape)
    h, ldh = _rows_view(h, 2)
    w, ldw = _rows_view(w, 1)
    tok, m = _token_arrays(token_ids, np.ones((B, T), np.uint8) if mask is None else mask, B, T)
    request = dict(B=B, T=T, H=H, V=V, dtype=dt, hidden=_ptr(h), ld_hidden=ldh, weight=_ptr(w),
                   ld_weight=ldw, bias=_ptr(b), token_ids=_ptr(tok), mask=_ptr(m))
    return (h, w, b, tok, m), request


def fused_linear_logprobs(hidden, weight, token_ids, mask=None, *, bias=None, temperature=1.0,
                          return_entropy=False, dtype="float32", impl="fused",
                          memory_budget=None, threads=None):
    """Log-probs of the chosen tokens, and their entropies if asked, from the
    LM head alone (fg_linear_logprobs): no loss, no gradient; for the old and
    reference policies' passes. hidden [B, T, H], weight [V, H], bias [V]?,
    token_ids / mask [B, T] (mask None: every token). Returns logp [B, T]
    float32 (0 where masked), or (logp, entropy)."""
    temperature = _options.LOSS_OPTIONS["temperature"].check("temperature", temperature)
    ex = _options.make_exec(threads, memory_budget)
    operands, request = _head_operands(hidden, weight, bias, token_ids, mask, dtype)
    B, T = request["B"], request["T"]
    logp = np.empty((B, T), np.float32)
    ent = np.empty((B, T), np.float32) if return_entropy else None
    _lib.logprobs_call(impl, ex, temperature, **request,
                       logp=_ptr(logp), entropy=_ptr(ent))
    return (logp, ent) if return_entropy else logp


def fused_linear_logprobs_backward(hidden, weight, token_ids, grad_logp, mask=None, *,
                                   grad_entropy=None, bias=None, temperature=1.0,
                                   grad_weight_out=None, grad_bias_out=None, dtype="float32",
                                   impl="fused", memory_budget=None, threads=None) -> dict:
    """The gradient of a caller's loss L(logp, entropy) with respect to the LM
    head's inputs (fg_linear_logprobs_backward), given grad_logp = dL/dlogp and
    grad_entropy = dL/dentropy per token ([B, T]; entropy None: 0); the logits
    are recomputed. grad_weight_out / grad_bias_out (float32 arrays): add this
    gradient to them (micro-batches) instead of returning new ones. Returns a
    dict of grad_hidden [B, T, H], grad_weight [V, H], grad_bias [V] (None
    without a bias), float32."""
    temperature = _options.LOSS_OPTIONS["temperature"].check("temperature", temperature)
    ex = _options.make_exec(threads, memory_budget)
    operands, request = _head_operands(hidden, weight, bias, token_ids, mask, dtype)
    B, T, H, V = (request[k] for k in "BTHV")
    g = _vec(grad_logp, np.float32, (B, T), "grad_logp")
    ge = _vec(grad_entropy, np.float32, (B, T), "grad_entropy")
    accumulate = grad_weight_out is not None or grad_bias_out is not None
    if accumulate and (grad_weight_out is None or (bias is not None and grad_bias_out is None)):
        raise FusedGRPOError("FG_ERR_UNSUPPORTED", "accumulating needs grad_weight_out and, with "
                             "a bias, grad_bias_out")
    for a, shape, name in ((grad_weight_out, (V, H), "grad_weight_out"),
                           (grad_bias_out, (V,), "grad_bias_out")):
        if a is not None and (not isinstance(a, np.ndarray) or a.dtype != np.float32
                              or a.shape != shape or not a.flags.c_contiguous
                              or not a.flags.writeable):
            raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", f"{name} must be a writable "
                                 f"contiguous float32 array of shape {shape}")
    _check_not_aliased(dict(grad_weight_out=grad_weight_out, grad_bias_out=grad_bias_out),
                       dict(hidden=hidden, weight=weight, bias=bias, token_ids=token_ids,
                            grad_logp=grad_logp, mask=mask, grad_entropy=grad_entropy))
    gh = np.empty((B, T, H), np.float32)
    gw = grad_weight_out if grad_weight_out is not None else np.empty((V, H), np.float32)
    gb = None
    if bias is not None:
        gb = grad_bias_out if grad_bias_out is not None else np.empty((V,), np.float32)
    f32 = _lib.DTYPE_F32
    _lib.logprobs_backward_call(impl, ex, temperature,
                                **request, grad_logp=_ptr(g), grad_entropy=_ptr(ge),
                                grad_hidden=_ptr(gh), grad_weight=_ptr(gw), grad_bias=_ptr(gb),
                                grad_dtypes=(f32, f32, f32), accumulate=accumulate)
    return dict(grad_hidden=gh, grad_weight=gw, grad_bias=gb)


def _check_not_aliased(outputs: dict, inputs: dict):
    """FG_ERR_ALIASED_OUTPUT when a caller's output array shares memory (by
    address range, as the C library checks) with an argument it reads or with
    another output: the call sums into it while it still reads them. Checked on
    the caller's own arrays, which a conversion may have copied before the C
    call sees them."""
    named = [(n, a) for n, a in outputs.items() if a is not None]
    for i, (name, out) in enumerate(named):
        for other, a in list(inputs.items()) + named[i + 1:]:
            if isinstance(a, np.ndarray) and np.may_share_memory(out, a):
                raise FusedGRPOError("FG_ERR_ALIASED_OUTPUT", f"{name} shares memory with "
                                     f"{other}: an output may not overlap an input or another "
                                     "output")


def grad_storage_dtypes(bf16_inputs: bool) -> tuple:
    """The dtypes ("float32" / "bfloat16") in which the torch and JAX front ends
    have the C call write grad_hidden, grad_weight and grad_bias: for bf16
    inputs the inputs' bf16 (no float32 copy to allocate and cast), grad_weight
    in bf16 only where this CPU's GEMMs multiply bf16 natively (else float32);
    float32 otherwise."""
    if not bf16_inputs:
        return ("float32",) * 3
    return ("bfloat16", "bfloat16" if bf16_gemms_native() else "float32", "bfloat16")


_bf16_native = None


def bf16_gemms_native() -> bool:
    """Whether this CPU's GEMMs multiply bf16 natively (the planner's
    gemm_dtype for bf16 inputs): then a bf16 grad_weight can be written
    directly (fusedgrpo.h); elsewhere it comes back in float32. Cached."""
    global _bf16_native
    if _bf16_native is None:
        plan = fused_linear_grpo_plan(np.zeros((1, 1, 8), np.float32),
                                      np.zeros((4, 8), np.float32), np.zeros((1, 1), np.int64),
                                      np.ones((1, 1), bool), np.zeros(1, np.float32),
                                      dtype="bfloat16")
        _bf16_native = plan["gemm_dtype"] == _lib.DTYPE_BF16
    return _bf16_native


def memory_stats() -> dict:
    """fg_get_memory_stats of the calling thread's context (each thread has its
    own): the working memory it holds now and held at its peak, and the
    budget, chunking and timing of its last call."""
    return _lib.thread_context().memory_stats()


def reset_peak_memory():
    """Restart memory_stats()'s peak_bytes from what the calling thread's
    context holds now."""
    _lib.thread_context().reset_peak_memory()


def release_workspace():
    """Free the workspace the calling thread's context keeps between calls (its
    next call allocates it again)."""
    _lib.thread_context().release_workspace()
