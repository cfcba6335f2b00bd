"""The checks every front end applies to its arrays before a pointer reaches the C
library: shapes, dtype kinds and mask values. They read shapes (tuples) and dtype
kinds (NumPy's one-letter ``kind``: "f" float, "i"/"u" integer, "b" bool, "V"
ml_dtypes' bfloat16), so NumPy arrays, torch tensors and JAX's abstract values
(at trace time) go through the same code. Failures raise FusedGRPOError
(FG_ERR_SHAPE_MISMATCH) naming the argument, its shape or dtype and what was
expected.
"""
from __future__ import annotations

import numpy as np

from ._lib import FusedGRPOError

__all__ = ["check_head", "check_floating", "check_real", "check_tokens", "check_mask_values",
           "check_batch"]

_FLOAT_KINDS = "fV"    # float, or ml_dtypes' bfloat16
_TOKEN_KINDS = "iu"    # a float token id would be truncated: refused
_MASK_KINDS = "biuf"   # bool, 0/1 integers, or floats exactly 0.0 / 1.0
_REAL_KINDS = "fiuV"   # per-token values: floats or integers, converted to float32


def _fail(message):
    raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", message)


def check_head(hidden_shape, weight_shape, bias_shape=None, hidden_kind="f", weight_kind="f",
               bias_kind="f"):
    """(B, T, H, V) of the LM head: hidden [B, T, H], weight [V, H], bias [V]."""
    hidden_shape, weight_shape = tuple(hidden_shape), tuple(weight_shape)
    if len(hidden_shape) != 3:
        _fail(f"hidden must be [B, T, H], got shape {hidden_shape}")
    if len(weight_shape) != 2:
        _fail(f"weight must be [V, H], got shape {weight_shape}")
    B, T, H = hidden_shape
    V = weight_shape[0]
    if weight_shape[1] != H:
        _fail(f"weight has {weight_shape[1]} columns, hidden has H = {H}")
    if bias_shape is not None and tuple(bias_shape) != (V,):
        _fail(f"bias has shape {tuple(bias_shape)}, expected {(V,)}")
    for name, kind in (("hidden", hidden_kind), ("weight", weight_kind),
                       ("bias", None if bias_shape is None else bias_kind)):
        if kind is not None:
            check_floating(name, kind)
    return B, T, H, V


def check_floating(name, dtype_or_kind):
    """An LM-head operand or logits: floating point (float32 or bfloat16 storage;
    other floats are converted where a front end says so). Complex, bool,
    integer, object and structured arrays are refused: a conversion would drop
    an imaginary part or read a flag or an id as a value. A dtype (not only its
    kind) tells ml_dtypes' bfloat16 from other kind-"V" dtypes."""
    if not _kind_in(dtype_or_kind, _FLOAT_KINDS):
        _fail(f"{name} must be a floating-point array (float32 or bfloat16), got dtype "
              f"{_describe(dtype_or_kind)}")


def check_real(name, dtype_or_kind):
    """A per-token or per-sequence input (advantages, log-probs, ratios, the
    derivatives of a caller's loss): real numbers, floats or integers, as every
    front end converts them to float32. Complex, bool, object and string
    arrays are refused."""
    if not _kind_in(dtype_or_kind, _REAL_KINDS):
        _fail(f"{name} must be a real-valued array, got dtype kind {_kind(dtype_or_kind)!r}")


def check_tokens(token_shape, token_kind, mask_shape, mask_kind, B, T):
    """token_ids and mask [B, T]: integer ids; a bool, integer or float mask."""
    token_kind, mask_kind = _kind(token_kind), _kind(mask_kind)
    if tuple(token_shape) != (B, T):
        _fail(f"token_ids has shape {tuple(token_shape)}, expected {(B, T)}")
    if token_kind not in _TOKEN_KINDS:
        _fail(f"token_ids must be integers, got dtype kind {token_kind!r} (a float id is not "
              "rounded)")
    if tuple(mask_shape) != (B, T):
        _fail(f"mask has shape {tuple(mask_shape)}, expected {(B, T)}")
    if mask_kind not in _MASK_KINDS:
        _fail(f"mask must be bool or 0/1 numbers, got dtype kind {mask_kind!r}")


def check_mask_values(mask: np.ndarray):
    """A mask's values are 0 or 1 (False / True): 0.5, 2 or NaN would otherwise be
    read as "real token" by the C library's nonzero test."""
    if mask.dtype == np.bool_ or mask.size == 0:
        return
    bad = (mask != 0) & (mask != 1)
    if bad.any():
        _fail(f"mask must hold only 0 and 1, got {mask[bad].reshape(-1)[0]!r}")


def check_batch(B, T, advantages_shape, old_logp=None, ref_logp=None, is_ratio=None,
                sampling_logp=None, kinds=None) -> bool:
    """The per-sequence and per-token inputs: advantages [B] (or [B, 1]), old_logp,
    ref_logp, sampling_logp [B, T], is_ratio [B, T] or per sequence [B] / [B, 1].
    The optional ones are shapes or None; ``kinds`` maps a name to its dtype kind.
    Returns whether is_ratio is per sequence."""
    if tuple(advantages_shape) not in ((B,), (B, 1)):
        _fail(f"advantages has shape {tuple(advantages_shape)}, expected {(B,)}")
    for name, shape in (("old_logp", old_logp), ("ref_logp", ref_logp),
                        ("sampling_logp", sampling_logp)):
        if shape is not None and tuple(shape) != (B, T):
            _fail(f"{name} has shape {tuple(shape)}, expected {(B, T)}")
    per_seq = False
    if is_ratio is not None:
        shape = tuple(is_ratio)
        per_seq = shape in ((B,), (B, 1)) and shape != (B, T)
        if not per_seq and shape != (B, T):
            _fail(f"is_ratio has shape {shape}, expected {(B, T)} or {(B,)}")
    for name, kind in (kinds or {}).items():
        check_real(name, kind)
    return per_seq


def _kind_in(dtype_or_kind, kinds: str) -> bool:
    """Whether a dtype's kind is one of `kinds`. Kind "V" is ml_dtypes'
    bfloat16 only: a dtype says so by its name (a structured dtype is "V"
    too); a lone kind "V" is taken as bfloat16."""
    kind = _kind(dtype_or_kind)
    if kind == "V" and not _is_kind(dtype_or_kind):
        return "V" in kinds and np.dtype(dtype_or_kind).name == "bfloat16"
    return kind in kinds


def _describe(dtype_or_kind) -> str:
    if _is_kind(dtype_or_kind):
        return f"kind {dtype_or_kind!r}"
    return f"{np.dtype(dtype_or_kind).name} (kind {_kind(dtype_or_kind)!r})"


def _is_kind(dtype_or_kind) -> bool:
    return isinstance(dtype_or_kind, str) and len(dtype_or_kind) == 1


def _kind(dtype_or_kind) -> str:
    if _is_kind(dtype_or_kind):
        return dtype_or_kind
    return np.dtype(dtype_or_kind).kind
