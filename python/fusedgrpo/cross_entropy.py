"""verl's fused-kernel signature over fusedgrpo's fused LM head:

    log_probs, entropy = linear_cross_entropy(hidden, weight, labels, temperature=1.0,
                                              reduction="none", process_group=None)

the shape of ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``
(which verl's ``use_fused_kernels`` forwards call inside the model's forward),
so fusedgrpo can take its place. The logits [N, V] never exist.

- hidden [..., H] (packed [N, H], [B, T, H], Megatron's [S, 1, H]: any
  layout whose token rows, flattened in order, match labels flattened);
  weight [V_local, H]; labels [...] of N token ids.
- Returns float32 log_probs and entropy of softmax(hidden . weight^T /
  temperature), shaped as labels (verl's own kernel returns them flat [N];
  its torch reference, and verl's callers, accept labels' shape). Both are
  differentiable w.r.t. hidden and weight, through the C library's backward.
- reduction: "none" (per token), "sum" or "mean" of the log-probs over the N
  tokens, as verl's kernel (entropy stays per token in every case); any other
  value raises ValueError, as verl's does.
- process_group None: the whole vocabulary (fusedgrpo.torch.linear_logprobs).
  A process group: weight is this rank's vocab rows, starting at
  rank x V_local (verl's and Megatron's even split) unless vocab_start is
  given, of vocab_size (default V_local x ranks); the vocab-parallel call of
  fusedgrpo.torch_distributed.linear_logprobs with Megatron's contract
  (tensor_parallel=True): grad_hidden is this rank's own share (verl's
  kernel's and Megatron's: the caller's copy / gather region reduces it) and
  errors are agreed over the group. Its keyword-only options pass through:
  grad_hidden ("partial", "sum"), sequence_parallel (hidden holds this rank's
  N / ranks token rows, gathered inside, its gradient reduce-scattered
  back), error_group, trust_inputs; see torch_distributed's doc.
"""
from __future__ import annotations

from torch import Tensor

from ._lib import FusedGRPOError

__all__ = ["linear_cross_entropy", "REDUCTIONS"]

REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, temperature=1.0,
                         reduction: str = "none", process_group=None, *, vocab_start=None,
                         vocab_size=None, grad_hidden=None, sequence_parallel=False,
                         error_group=None, trust_inputs=False, impl="fused", threads=None,
                         memory_budget=None, dist_process_group=None):
    """(log_probs, entropy) of labels under the LM head, verl's fused-kernel
    call (see the module doc). dist_process_group: verl's keyword for
    process_group (its callers pass it by position)."""
    if dist_process_group is not None:
        if process_group is not None and process_group is not dist_process_group:
            raise TypeError("linear_cross_entropy: process_group and dist_process_group name "
                            "two groups; give one")
        process_group = dist_process_group
    execution = dict(impl=impl, threads=threads, memory_budget=memory_budget)
    if process_group is None:
        _refuse_shard_options(vocab_start=vocab_start, vocab_size=vocab_size,
                              grad_hidden=grad_hidden, sequence_parallel=sequence_parallel,
                              error_group=error_group, trust_inputs=trust_inputs)
        reduction = _reduction(reduction)
        h, tokens = _flat(hidden, labels, 1)
        from . import torch as _fgt  # imported here: fusedgrpo.torch re-exports this function
        logp, ent = _fgt.linear_logprobs(h, weight, tokens, None, None, temperature=temperature,
                                         return_entropy=True, **execution)
        return _outputs(logp, ent, labels, reduction)
    return _vocab_parallel(hidden, weight, labels, temperature, reduction, process_group,
                           dict(vocab_start=vocab_start, vocab_size=vocab_size,
                                grad_hidden=grad_hidden, sequence_parallel=sequence_parallel,
                                error_group=error_group, trust_inputs=trust_inputs), execution)


def _vocab_parallel(hidden, weight, labels, temperature, reduction, group, shard, execution):
    """The call with a process group: its arguments read inside the
    distributed front end's failure path, so that a rank whose arguments are
    bad makes every rank of the group raise instead of leaving them waiting."""
    import torch.distributed as dist

    from . import torch_distributed as _fgd
    par = _fgd._parallel(group, shard["error_group"], True, shard["grad_hidden"],
                         shard["sequence_parallel"], shard["trust_inputs"])
    try:
        reduction = _reduction(reduction)
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        h, tokens = _flat(hidden, labels, ranks if shard["sequence_parallel"] is True else 1)
        rows = int(weight.shape[0])
        start = rank * rows if shard["vocab_start"] is None else shard["vocab_start"]
        total = rows * ranks if shard["vocab_size"] is None else shard["vocab_size"]
    except Exception as e:  # noqa: BLE001 - carried to every rank by _refuse
        _fgd._refuse(e, par)
    logp, ent = _fgd.linear_logprobs(
        h, weight, tokens, None, None, vocab_start=start, vocab_size=total,
        process_group=group, error_group=par.error_group, tensor_parallel=True,
        grad_hidden=par.grad_hidden, sequence_parallel=par.sequence_parallel,
        trust_inputs=par.trust_inputs, temperature=temperature, return_entropy=True, **execution)
    return _outputs(logp, ent, labels, reduction)


def _reduction(reduction) -> str:
    """verl's reduction, case-insensitive as verl reads it; else ValueError."""
    r = reduction.lower() if isinstance(reduction, str) else reduction
    if r not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return r


def _flat(hidden: Tensor, labels: Tensor, shards: int):
    """(hidden [1, N / shards, H], labels [1, N]): the token rows in order, as
    one sequence (a view where the layout allows). Refuses hidden whose token
    rows do not match labels' count (FG_ERR_SHAPE_MISMATCH)."""
    if not (isinstance(hidden, Tensor) and isinstance(labels, Tensor)):
        raise TypeError(f"hidden and labels must be torch tensors, got {type(hidden).__name__} "
                        f"and {type(labels).__name__}")
    if hidden.dim() < 1:
        raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", "hidden must be [..., H], got a scalar")
    rows = hidden.numel() // max(int(hidden.shape[-1]), 1)
    if rows * shards != labels.numel():
        held = "" if shards == 1 else f" (this rank's shard of the sequence, x {shards} ranks)"
        raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", f"hidden {tuple(hidden.shape)} holds "
                             f"{rows} token rows{held}, labels {tuple(labels.shape)} "
                             f"{labels.numel()} tokens")
    return hidden.reshape(1, rows, hidden.shape[-1]), labels.reshape(1, -1)


def _outputs(logp: Tensor, ent: Tensor, labels: Tensor, reduction: str):
    """(log_probs, entropy) shaped as labels, the log-probs reduced."""
    logp = logp.reshape(labels.shape)
    if reduction == "sum":
        logp = logp.sum()
    elif reduction == "mean":
        logp = logp.mean()
    return logp, ent.reshape(labels.shape)


def _refuse_shard_options(**given):
    """Without a process group, the vocab-parallel options mean nothing:
    refused rather than ignored (ValueError)."""
    defaults = dict(vocab_start=None, vocab_size=None, grad_hidden=None, sequence_parallel=False,
                    error_group=None, trust_inputs=False)
    set_ = [k for k, v in given.items() if v is not defaults[k] and v != defaults[k]]
    if set_:
        raise ValueError(f"{', '.join(set_)}: vocab-parallel options, given without a "
                         "process_group (the whole vocabulary on this rank)")
