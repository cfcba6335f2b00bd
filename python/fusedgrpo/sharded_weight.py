"""The LM head's weight where a data-parallel framework shards it.

fusedgrpo's ops take the whole head, ``[V, H]`` (and ``[V]``), as plain
tensors. Under FSDP and DeepSpeed ZeRO-3 the head's parameters hold a shard
between its calls, and the framework gathers them around the head module's
own forward and reduces their gradient from hooks it registers there. So
the fused head runs *as that forward*: ``call_in_head(head, fn, hidden)``
calls the module (FSDP2, FSDP1 and ZeRO-3 hooks fire: gather before, reshard
after, gradient reduction and, for a backward that reads the weight again,
the re-gather), with ``fn(weight, bias, hidden)`` in place of its forward.

``whole_head`` (which ``call_in_head`` applies too) checks or gathers the
head as it was read: a DTensor (FSDP2 outside the head's forward, tensor
parallel) is gathered with a gradient that averages over its mesh, DDP's
convention, which TRL's normalisation assumes; a ZeRO-3 placeholder, FSDP1's
flat shard or a freed unsharded view (what a read outside the head's
forward finds) is refused with FusedGRPOError naming what to do.
"""
from __future__ import annotations

import torch

from ._lib import FusedGRPOError

__all__ = ["call_in_head", "whole_head"]

_REFUSED = "FG_ERR_UNSUPPORTED"


def _wrapped(head: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward computes the head: FSDP1 wraps it and calls
    the inner one from its own forward, after gathering its parameters."""
    while isinstance(getattr(head, "_fsdp_wrapped_module", None), torch.nn.Module):
        head = head._fsdp_wrapped_module
    return head


def call_in_head(head: torch.nn.Module, fn, *tensors):
    """``fn(weight, bias, *tensors)`` run as the forward of ``head`` (the
    model's ``get_output_embeddings()``, wrappers included), so that the
    framework's hooks see the head used as its own forward uses it. The
    tensors are the call's inputs (the hooks may cast them, and key the
    head's gradient reduction on their backward); weight and bias reach
    ``fn`` through ``whole_head``. Returns what ``fn`` returns."""
    inner = _wrapped(head)
    own = inner.__dict__.get("forward")  # an instance override (TRL's fp32 head) is kept

    def restore():
        if own is None:
            inner.__dict__.pop("forward", None)
        else:
            inner.forward = own

    def forward(*args):
        restore()  # before fn: the head called again inside fn is itself
        weight, bias = whole_head(inner.weight, getattr(inner, "bias", None))
        return fn(weight, bias, *args)

    inner.forward = forward
    try:
        return head(*tensors)
    finally:
        restore()


def whole_head(weight, bias=None, *, leaves_forward=False):
    """(weight [V, H], bias [V] or None) as plain tensors of the whole head.
    A DTensor is gathered (its gradient averaged over the mesh: ``_gathered``);
    a shard that cannot be gathered here is refused (``_refuse_shard``), and
    with ``leaves_forward`` (the head handed out of the model's forward, to
    be used after it returns) any ZeRO-3 parameter: ZeRO-3 gathers one read
    inside the forward, but releases it when the forward returns."""
    weight = _gathered(weight)
    _refuse_shard(weight, "weight", 2, leaves_forward)
    if bias is not None:
        bias = _gathered(bias)
        _refuse_shard(bias, "bias", 1, leaves_forward)
        if bias.shape[0] != weight.shape[0]:
            raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH",
                                 f"the LM head's bias has {bias.shape[0]} rows, its weight "
                                 f"{weight.shape[0]}: a shard of one of them?")
    return weight, bias


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4: not public yet
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)


def _gathered(t):
    """A DTensor's whole value. Its gradient comes back as Partial("avg") on
    every mesh dimension: each rank's gradient is its own data's, and the
    shard's gradient is their mean (what FSDP's reduce-scatter and DDP's
    allreduce give; on a dimension whose ranks share the data, tensor
    parallel, the mean of equal values). The default (Replicate) would keep
    each rank's own part unaveraged."""
    if not (torch.distributed.is_available() and _is_dtensor(t)):
        return t
    try:
        from torch.distributed.tensor import Partial
    except ImportError:  # torch 2.4: not public yet
        from torch.distributed._tensor.placement_types import _Partial as Partial
    return t.full_tensor(grad_placements=[Partial("avg")] * t.device_mesh.ndim)


def _refuse_shard(t, name: str, dim: int, leaves_forward: bool) -> None:
    if getattr(t, "ds_id", None) is not None and (leaves_forward or _zero3_partitioned(t)):
        raise FusedGRPOError(_REFUSED, (
            f"the LM head's {name} is a DeepSpeed ZeRO-3 parameter, a partitioned placeholder "
            "outside the forward that gathers it: call the model with fusedgrpo_head= "
            "(fusedgrpo.trl.add_fusedgrpo_lm_head), which runs the loss inside the head's "
            "forward, or gather it with deepspeed.zero.GatheredParameters for the call and its "
            "backward"))
    if getattr(t, "_fsdp_flattened", False) and t.dim() != dim:
        raise FusedGRPOError(_REFUSED, (
            f"the LM head's {name} is FSDP1's flat 1-D shard of shape {tuple(t.shape)} (read "
            "outside the head's forward): call the model with fusedgrpo_head= (fusedgrpo.trl."
            "add_fusedgrpo_lm_head), or wrap the head in the root unit (an auto_wrap_policy of "
            "the decoder layers only: transformer_auto_wrap_policy / ModuleWrapPolicy({the "
            "decoder layer class})), or use FSDP2 (fully_shard)"))
    if t.dim() != dim:
        raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", (
            f"the LM head's {name} has shape {tuple(t.shape)}, expected {dim}-D: a shard of a "
            "data-parallel framework? Run the head through fusedgrpo_head= "
            "(fusedgrpo.trl.add_fusedgrpo_lm_head)"))
    if t.numel() > 0 and t.untyped_storage().size() == 0:
        raise FusedGRPOError(_REFUSED, (
            f"the LM head's {name} has no storage: FSDP's unsharded view, freed outside the "
            "head's forward. Call the model with fusedgrpo_head= "
            "(fusedgrpo.trl.add_fusedgrpo_lm_head), which runs inside it, or (FSDP1) wrap the "
            "head in the root unit (an auto_wrap_policy of the decoder layers only: "
            "transformer_auto_wrap_policy / ModuleWrapPolicy({the decoder layer class}))"))


def _zero3_partitioned(t) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return t.ds_status != ZeroParamStatus.AVAILABLE
