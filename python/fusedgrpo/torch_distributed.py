"""Vocab-parallel PyTorch front end over a ``torch.distributed`` process group.

The LM head's weight is split by vocab rows over the ranks of a process group
(the *vocab group*); each rank holds rows ``[vocab_start, vocab_start + V_local)``
of a vocabulary of ``vocab_size`` and the same tokens and hidden states. The C
library's phase API (fusedgrpo.h, "phases of a vocab-sharded call") computes
everything local; torch.distributed does the communication, with generic
collectives only (any backend: gloo on the CPU, NCCL on CUDA devices)::

    import torch.distributed as dist
    from fusedgrpo.torch_distributed import fused_linear_grpo_loss, vocab_shard_range
    start, rows = vocab_shard_range(V, dist.get_world_size(), dist.get_rank())
    w = lm_head.weight[start:start + rows]                      # this rank's rows
    loss, metrics, logp, ent = fused_linear_grpo_loss(
        hidden, w, completion_ids, completion_mask, advantages, None, old, ref,
        vocab_start=start, vocab_size=V, beta=0.04)             # every option of fusedgrpo.torch
    loss.backward()    # hidden.grad: whole (summed over the group); w.grad: its rows

``fused_linear_grpo_loss``, ``FusedLinearGRPOLoss`` and ``linear_logprobs``
take the arguments of their namesakes in ``fusedgrpo.torch`` and return the
same things, plus keyword-only ``vocab_start``, ``vocab_size`` (default: the
weight's rows, i.e. unsharded), ``process_group`` (the vocab group; default
WORLD), ``error_group`` (default WORLD; the vocab group under tensor
parallel) and the tensor-parallel options below. Every rank of the vocab
group must make the same call (same tokens, options, and which inputs
require a gradient) and, for ``linear_logprobs``, also run its backward. No
``torch.compile`` support (the process groups are Python objects; the ops
are ``torch.autograd.Function``s, so compile graph-breaks around them).

Tensor parallel (Megatron's LM head split by vocab rows over the TP group,
as verl and NeMo RL train it): ``tensor_parallel=True`` takes Megatron's
contract, where the framework reduces the hidden states' gradient itself in
the backward of its copy / gather region:
  - ``grad_hidden`` (how hidden's gradient comes back): "partial", the
    default under tensor_parallel: this rank's own share (dlogits of its
    vocab rows . its weight rows); the shares' sum over the group is the
    gradient, so returning the sum would count it TP times. "sum": the
    whole gradient on every rank (one all_reduce; the default without
    tensor_parallel, for a head run for itself). "reduce_scatter": with
    sequence_parallel only;
  - ``sequence_parallel=True`` (implies tensor parallel): hidden is this
    rank's shard of the sequence, [B, T / ranks, H] (rank r holding
    positions [r T / ranks, (r + 1) T / ranks)), token_ids, mask and the
    per-token inputs the whole [B, T] on every rank; the shards are
    all_gathered along T inside (after the entry agreement) and grad_hidden
    comes back reduce-scattered: this rank's [B, T / ranks, H] piece of the
    whole gradient (grad_hidden="reduce_scatter", its only value). For
    Megatron's [T, B, H] layout, transpose to [B, T, H] (or, B = 1 as
    verl's packed sequences, pass it as it is through linear_cross_entropy);
  - ``error_group`` defaults to the vocab group: the other pipeline stages
    never make this call, and an exit agreement over WORLD would wait for
    them (or pair with one of their collectives). A data-parallel replica
    then learns of a failure only through its own framework; pass
    error_group=torch.distributed.group.WORLD (or the model-parallel
    group) to reach it;
  - ``trust_inputs=True`` (any mode; every rank alike): the caller
    guarantees that every rank of the group makes the same call (shapes,
    dtypes, options, tokens, mask and per-token inputs, trust_inputs
    itself), its weight rows tiling [0, vocab_size). Skipped: the entry
    agreement (an all_gather read on the host) and the tokens' agreement
    (tokens, mask and per-token inputs copied to the host and hashed, the
    hashes compared on the host), each a host sync on a device. Kept:
    a failed phase on any rank (a bad token id, a non-finite input, a
    failed backward) reaches every rank through the status slot and the
    flag, and the exit agreement makes every rank raise the same status.
    A call refused before its request is built (a bad option or keyword,
    alike on every rank by the guarantee) raises at once on each rank, with
    no collective made. A rank whose request is refused (a bad operand:
    say its weight or bias shard, the operands left to each rank) joins
    the phases as a failed rank, sized from token_ids and hidden, so every
    rank raises its status (its reason stays on that rank: the others name
    the status only). A broken guarantee: different tokens, mask or
    per-token inputs give wrong log-probs and loss silently (what the hash
    caught); different shapes, dtypes, options or trust_inputs make the
    ranks' collectives differ (gloo fails on a size mismatch or at the
    group's timeout, NCCL may wait until its watchdog's timeout); a rank
    whose arguments cannot even be sized (token_ids or hidden not a
    tensor) raises at once and the others wait in their first collective
    until the group's timeout.
The options digest of the entry covers grad_hidden and sequence_parallel,
so ranks that differ there are refused like any other option.

Devices: the operands (hidden, weight, bias, tokens, mask and the loss's
per-token inputs) on one device, the CPU or one CUDA device (the C library's
CUDA backend, on torch's current stream, as ``fusedgrpo.torch``). The phases'
buffers (the statistics, logp, entropy, the gradients) live there and are
reduced there (NCCL reduces device tensors only); (c) is host-only work, O(N):
it runs on the CPU over host copies of logp, entropy and the batch arrays, and
its grad_logp / grad_entropy go back to the device. The agreements' few
floats live on the current CUDA device where their group's backend is NCCL
alone, else on the CPU.

Collectives of one call, for N = B*T tokens:
  entry     all_gather over the vocab group of 8 float64 per rank: a status,
            B, T, H, vocab_size, vocab_start, V_local, a hash of the checked
            options (the fg_loss_config, impl, filter_eps, the temperature,
            which gradients, the dtype: beta=0 and beta=0.0 are the same
            options, and so is a default passed or left out); where a rank's
            status is a failure, one more all_gather of 240 bytes per rank
            (each failed rank's reason);
  (a) GEMM 1, all_reduce MAX of 2N+1+4 floats (the 4: a hash of tokens, mask
            and the loss's per-token inputs, and its negation: the ranks agree
            iff its MAX equals its min); (b) all_reduce SUM of 8N floats;
            logp and entropy (the same bits on every rank of the group);
  (c) the loss from logp (fg_grpo_loss_from_logp, on every rank, on the host);
  (d) GEMMs 1-3, all_reduce SUM of N*H+1 floats (grad_hidden and a failure
            flag; 1 float when grad_hidden is not wanted or "partial";
            under sequence_parallel a reduce_scatter of N*H + ranks floats,
            each rank receiving its N*H/ranks and the flag; none under
            no_grad);
  exit      all_reduce MAX of 3 float64 over the error group.
Under sequence_parallel, an all_gather of hidden's shards (N*H/ranks per
rank) follows entry; under trust_inputs there is no entry all_gather and the
MAX carries no hash. ``linear_logprobs`` makes entry to (b) and exit in its
forward, (d) and exit in its backward. The loss's forward computes the
gradients too (like ``fusedgrpo.torch``); its backward scales them, with no
communication.

Errors: every rank raises, and none waits in a collective: ``FusedGRPOError``
with the same status, except on a rank whose own argument was bad. A rank that
fails before the call (a bad argument, whatever the exception: an unknown
keyword's TypeError, a NumPy hidden, a bad option's FusedGRPOError; no rank
raises before the entry agreement) says so at entry: it raises its own
exception, the others FusedGRPOError with its status (FG_ERR_COMMUNICATOR for
an exception of another type) naming that rank and its reason. Ranks that
disagree on the call's shapes or options, or whose vocab rows do not tile
``[0, vocab_size)``, all see it there (``FG_ERR_COMMUNICATOR``): the group
then makes no further collective. A rank whose phase (a) fails (a bad token
id, NaN input) writes its status into the statistics' status slot, which the
MAX spreads, so every rank's next phase returns it; ranks that hold different
tokens (or advantages, ...) learn it from the hash in the same MAX
(``FG_ERR_COMMUNICATOR``; a failed (a) takes precedence: a bad token id on one
rank is reported as such). A failure in (d) travels as the flag beside
grad_hidden. The exit reduction over ``error_group`` then gives every rank of
that group the largest status, so data-parallel ranks (another vocab group's)
raise too instead of waiting in DDP's allreduce. An error leaves the groups
usable.

Data parallel (DDP, TRL's normalisation, docs/LOSS_SPEC.md "Data parallel"):
each data rank passes its own sequences; DDP averages the gradients over the
data ranks, which gives the whole batch's gradient when the loss's
normalisers are global:
  - dapo, cispo, vespo: ``num_items_in_batch`` = the global number of
    unmasked tokens / the number of data ranks (what TRL passes);
  - grpo, dr_grpo, sapo, luspo: per-sequence means over the rank's sequences:
    the whole batch's when every rank holds the same number of sequences (a
    rank whose sequences are all masked still counts them);
  - bnpo, the entropy bonus and the entropy quantile use the rank's own
    tokens, as TRL's do under DDP.
grad_hidden is the rank's own (the backbone's parameters get DDP's mean).
A 2-D grid (vocab x data; ``make_grid``): the loss's collectives run on the
vocab group (this row), DDP runs on the data group (this column: the ranks
holding the same vocab rows), and ``error_group`` stays WORLD so a failure
anywhere reaches every rank. Data parallel only (the whole head on every
rank): a vocab group of one rank (``make_grid(1)``); it makes no vocab
collective, only the exit reduction.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import inspect
import math
import numbers
from collections import namedtuple
from typing import Optional

import numpy as np

import torch
import torch.distributed as dist
from torch import Tensor

from . import _lib, _options
from . import _torch_inputs as _ti
from ._lib import METRIC_NAMES, FusedGRPOError, lib
from .torch import FusedLinearGRPOLoss as _LocalGRPOLoss

__all__ = ["fused_linear_grpo_loss", "FusedLinearGRPOLoss", "linear_logprobs",
           "vocab_shard_range", "make_grid", "Grid", "METRIC_NAMES", "agreed"]

_COMMUNICATOR = _lib.STATUS_CODES["FG_ERR_COMMUNICATOR"]
_UNSUPPORTED = _lib.STATUS_CODES["FG_ERR_UNSUPPORTED"]
_F32 = torch.float32


# ------------------------------------------------------------------ layout

def vocab_shard_range(vocab_size: int, shards: int, index: int) -> tuple:
    """(vocab_start, rows) of shard `index` of `shards`: as even as can be, the
    first vocab_size % shards shards one row longer (mpi/'s fg_mpi_split)."""
    base, extra = divmod(int(vocab_size), int(shards))
    return index * base + min(index, extra), base + (1 if index < extra else 0)


Grid = namedtuple("Grid", "vocab_group data_group vocab_rank vocab_shards data_rank data_shards")


def make_grid(vocab_shards: int) -> Grid:
    """The default group's ranks as rows of `vocab_shards` ranks, mpi/'s grid:
    world rank r is vocab rank r % vocab_shards of data row r // vocab_shards.
    vocab_group: this rank's row (split the vocabulary); data_group: its column
    (the ranks holding the same vocab rows: DDP's group). Collective over the
    default group (torch.distributed.new_group is)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if vocab_shards < 1 or world % vocab_shards:
        raise ValueError(f"vocab_shards={vocab_shards} does not divide the world size {world}")
    rows = world // vocab_shards
    vocab_group = data_group = None
    for row in range(rows):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(row * vocab_shards, (row + 1) * vocab_shards)))
        if rank // vocab_shards == row:
            vocab_group = g
    for col in range(vocab_shards):
        g = dist.new_group(list(range(col, world, vocab_shards)))
        if rank % vocab_shards == col:
            data_group = g
    return Grid(vocab_group, data_group, rank % vocab_shards, vocab_shards,
                rank // vocab_shards, rows)


# ------------------------------------------------------------------ tensor parallel

GRAD_HIDDEN = ("sum", "partial", "reduce_scatter")

_Parallel = namedtuple("_Parallel", "process_group error_group tensor_parallel grad_hidden "
                                    "sequence_parallel trust_inputs")


def _parallel(process_group=None, error_group=None, tensor_parallel=False, grad_hidden=None,
              sequence_parallel=False, trust_inputs=False, **_other) -> _Parallel:
    """How one call runs over its groups, with the defaults filled in. Never
    raises (a bad value is _check_parallel's to refuse, inside the call, so
    that every rank hears of it). Tensor parallel (tensor_parallel=True, or
    sequence_parallel=True) is Megatron's contract: grad_hidden is each rank's
    own share, which the caller's framework reduces in the backward of its
    copy / gather region, and error_group is the vocab (TP) group, because the
    other pipeline stages and data-parallel replicas never make this call.
    Otherwise the defaults are those of a vocab-parallel head run for itself:
    grad_hidden summed over the group, error_group WORLD (DDP's replicas raise
    too)."""
    tp = tensor_parallel is True or sequence_parallel is True
    if error_group is None and tp:
        error_group = process_group
    if grad_hidden is None:
        grad_hidden = "reduce_scatter" if sequence_parallel is True else "partial" if tp else "sum"
    return _Parallel(process_group, error_group, tensor_parallel, grad_hidden, sequence_parallel,
                     trust_inputs)


def _check_parallel(par: _Parallel):
    """Refuses a tensor-parallel option outside its values (ValueError);
    called before the request, so that a trusted call refused here raises
    at once on every rank (see _refuse)."""
    for name in ("tensor_parallel", "sequence_parallel", "trust_inputs"):
        if not isinstance(getattr(par, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(par, name)!r}")
    if par.grad_hidden not in GRAD_HIDDEN:
        raise ValueError(f"grad_hidden must be one of {GRAD_HIDDEN}, got {par.grad_hidden!r}")
    if par.sequence_parallel and par.grad_hidden != "reduce_scatter":
        raise ValueError(f"sequence_parallel=True: hidden is this rank's shard of the sequence, "
                         f"so its gradient is too: grad_hidden='reduce_scatter' (the default), "
                         f"not {par.grad_hidden!r}")
    if par.grad_hidden == "reduce_scatter" and not par.sequence_parallel:
        raise ValueError("grad_hidden='reduce_scatter' scatters the gradient over the sequence "
                         "shards that sequence_parallel=True gathers: pass both, or 'sum' / "
                         "'partial' for a whole hidden on every rank")


# ------------------------------------------------------------------ agreement

_NO_SHAPE = (0.0,) * 6  # the entry row's shape of a rank whose arguments are bad


class _Agreement:
    """One call's collectives and how a failure travels through them: this
    rank's first failure (status, message), whether it heard of another's,
    and the entry and exit agreements. Every rank of the vocab group makes the
    same collectives in the same order whatever fails, except that a failed
    entry (agreed by all) skips the rest."""

    def __init__(self, par: _Parallel):
        process_group = self.group = par.process_group
        self.error_group = par.error_group
        self.status = 0
        self.message = ""
        self.own = False  # the failure is this rank's own, not one it learned of
        self.heard = False
        self.cause = None  # the exception of this rank's own failure, if one
        try:
            self.shards = dist.get_world_size(process_group)
            member = dist.get_rank(process_group) >= 0
        except Exception as e:  # noqa: BLE001 - not a group: still join the exit
            self.shards = 1
            self.fail_on_exception(e)
            return
        if not member:  # a caller's slip: still join the exit
            self.shards = 1
            self.fail(_UNSUPPORTED, "this rank is not a member of process_group")

    @property
    def ok(self) -> bool:
        return self.status == 0

    def fail(self, status: int, message: str, own: bool = True):
        if self.ok:  # the first failure is the cause; later ones follow from it
            self.status, self.message, self.own = int(status), message, own

    def check(self, status: int, context, own: bool = True):
        """Records a failed C call with the library's message (own=False: a
        status the call returned because another rank failed)."""
        if status != 0:
            msg = lib.fg_last_error(context.handle)
            self.fail(status, msg.decode(errors="replace") if msg else "", own)

    def fail_on_exception(self, e: Exception):
        """A rank that cannot even make its C request (a bad argument, of any
        exception type) fails with the status of it (FG_ERR_COMMUNICATOR for
        an exception other than FusedGRPOError), so the others learn of it at
        entry; conclude raises e itself on this rank."""
        if self.ok:
            self.fail(_status_of(e), _reason_of(e))
            self.cause = e

    def reduce(self, t: Tensor, op):
        if _needs_collective(self.shards):
            dist.all_reduce(t, op=op, group=self.group)

    def enter(self, shape: tuple = _NO_SHAPE, options_digest: float = 0.0) -> bool:
        """The entry agreement: every rank's status, shape (B, T, H, vocab_size,
        vocab_start, V_local) and options digest, gathered. False (on every
        rank alike) when some rank failed or they disagree: no phase runs.
        When some rank failed, a second all_gather (every rank makes it: they
        all see the same table) carries each failed rank's reason."""
        row = torch.tensor([float(self.status), *shape, options_digest], dtype=torch.float64)
        rows = [row]
        if _needs_collective(self.shards):
            row = row.to(_agreement_device(self.group))
            rows = [torch.empty_like(row) for _ in range(self.shards)]
            dist.all_gather(rows, row, group=self.group)
        table = torch.stack(rows).cpu()
        reasons = None
        if table[:, 0].max() > 0:
            reasons = _gather_reasons(self.message if self.own else "", self.group, self.shards)
        verdict = _entry_verdict(table, reasons)
        if verdict is not None:
            self.fail(*verdict, own=False)
        return self.ok

    def conclude(self):
        """The exit agreement over error_group: the largest status of any
        rank; raised on every rank. A rank that only heard of a vocab peer's
        failure (outside error_group) raises FG_ERR_COMMUNICATOR."""
        first = -float(dist.get_rank()) if self.own else -math.inf
        t = torch.tensor([float(self.status), 1.0 if self.heard else 0.0, first],
                         dtype=torch.float64)
        if _needs_collective(dist.get_world_size(self.error_group)):
            t = t.to(_agreement_device(self.error_group))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.error_group)
            t = t.cpu()
        status = int(t[0]) or (_COMMUNICATOR if t[1] > 0 else 0)
        if status == 0:
            return
        if self.own and self.cause is not None and not isinstance(self.cause, FusedGRPOError):
            raise self.cause  # this rank's own argument error, as a local call raises it
        name = _lib.status_name(status)
        if self.status == status:
            raise FusedGRPOError(name, self.message) from self.cause
        # the lowest failing rank, and the largest status of all (two ranks
        # may fail differently: the name is not that rank's own status)
        who = (f"rank {int(-t[2])} (the lowest that failed)" if math.isfinite(t[2])
               else "a rank of a vocab group")
        mine = f" (this rank: {self.message})" if self.message else ""
        raise FusedGRPOError(name, f"{who} failed; every rank raises the largest status, "
                                   f"{name}{mine}")


def _status_of(e: Exception) -> int:
    """The status a rank's exception travels as: FusedGRPOError's own, else
    FG_ERR_COMMUNICATOR (the other ranks' call fails because of this one)."""
    if isinstance(e, FusedGRPOError) and e.code > 0:
        return e.code
    return _COMMUNICATOR


def _reason_of(e: Exception) -> str:
    """Why a rank failed, in words: FusedGRPOError's message, or the
    exception's type and message."""
    if isinstance(e, FusedGRPOError):
        return e.message
    return f"{type(e).__name__}: {e}"


_REASON_BYTES = 240  # of each failed rank's reason, sent to the others


def _gather_reasons(reason: str, group, ranks: int) -> list:
    """Every rank's reason ("" where none) over `group`: one all_gather of
    _REASON_BYTES bytes per rank. Made only where every rank of the group
    knows that one failed (a failure path every rank takes alike)."""
    if not _needs_collective(ranks):
        return [reason]
    data = reason.encode("utf-8", errors="replace")[:_REASON_BYTES]
    buf = torch.zeros(_REASON_BYTES, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    buf = buf.to(_agreement_device(group))
    out = [torch.empty_like(buf) for _ in range(ranks)]
    dist.all_gather(out, buf, group=group)
    return [bytes(o.cpu().tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
            for o in out]


def _needs_collective(ranks: int) -> bool:
    """Whether a group of `ranks` ranks reduces at all: one rank's reduction
    is itself, so a group of one makes none (a test of the collectives on one
    GPU makes them anyway through this)."""
    return ranks > 1


def _agreement_device(group) -> torch.device:
    """Where an agreement's few floats are reduced over `group`: the current
    CUDA device when the group's only backend is NCCL (device tensors only),
    else the CPU (gloo, or a group with a CPU backend beside NCCL)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_SHAPE_FIELDS = ("B", "T", "H", "vocab_size")


def _entry_verdict(table: Tensor, reasons=None):
    """(status, message) of a gathered entry table [ranks, 8], or None when
    the ranks agree: statuses (with the failed rank's reason), then shapes
    and options, then the vocab tiling."""
    statuses = table[:, 0]
    if statuses.max() > 0:
        rank = int(statuses.argmax())
        name = _lib.status_name(int(statuses[rank]))
        why = reasons[rank] if reasons and reasons[rank] else name
        return int(statuses[rank]), (f"rank {rank} of the vocab group failed before the "
                                     f"call ({why}); every rank raises {name}")
    for col, name in zip((1, 2, 3, 4, 7), _SHAPE_FIELDS + ("options",)):
        col = table[:, col]
        if (col != col[0]).any():
            return _COMMUNICATOR, (f"the vocab group's ranks disagree on {name}: "
                                   f"{[int(v) for v in col.tolist()]}")
    shards = [(int(s), int(n)) for s, n in table[:, 5:7].tolist()]
    end = 0
    for start, rows in sorted(shards):
        if start != end:
            break
        end = start + rows
    else:
        if end == int(table[0, 4]):
            return None
    return _COMMUNICATOR, (f"the vocab group's shards (vocab_start, rows) {shards} do not "
                           f"tile [0, {int(table[0, 4])})")


def _digest(*parts) -> float:
    """48 bits of a hash of byte strings / tensors, exact in a float64 (the
    same on every rank: Python's own hash() of str is salted per process)."""
    h = hashlib.blake2b(digest_size=6)
    for p in parts:
        if isinstance(p, Tensor):  # float32 / int64 / uint8 here: NumPy has them
            p = p.detach().cpu().contiguous().numpy().tobytes()
        elif not isinstance(p, bytes):
            p = repr(p).encode()
        h.update(p + b"|")
    return float(int.from_bytes(h.digest(), "little"))


# ------------------------------------------------------------------ the options

def _joins_when_unbound(fn):
    """fn with its arguments bound inside: a call whose arguments do not even
    bind (a missing or doubled argument: TypeError) still joins the entry and
    exit agreements of process_group / error_group as a failed rank (see
    _refuse), so the other ranks raise instead of waiting."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            _refuse(e, _parallel(**kwargs))
        return fn(*args, **kwargs)
    return call


def _refuse(e: Exception, par: _Parallel):
    """A rank whose call failed before its entry agreement (a bad argument, of
    any exception type) makes the call's agreements as a failed rank: the
    entry all_gather with its status and a dummy shape, then the exit; raises
    e on this rank, FusedGRPOError on the others, and no rank waits. Under
    trust_inputs there is no entry agreement to make: the caller guaranteed
    the same call on every rank, so every rank fails alike and raises here."""
    if par.trust_inputs is True:
        raise e
    agree = _Agreement(par)
    agree.fail_on_exception(e)
    agree.enter()
    agree.conclude()
    raise e  # conclude raised already: every rank of error_group saw a status


# ------------------------------------------------------------------ the request

class _Request:
    """This rank's LM-head operands as the phase API takes them (the tensors
    kept alive here), its shard of the vocabulary, the execution options and
    the context of (a), (b), finish and (d): the CPU thread's, or a device
    context (_torch_inputs.call_context) whose buffers are all device memory
    (self.device's tensors; a context of the reference backend takes the
    CPU's, which is how the tests run this path without a GPU)."""

    def __init__(self, hidden, weight, token_ids, mask, bias, *, vocab_start, vocab_size,
                 temperature, impl, threads, memory_budget, filter_eps):
        self.keep, req = _ti.head_args(hidden, weight, token_ids, mask, bias)
        self.ptr = _ti.ptr
        self.B, self.T, self.H, self.v_local = (req[k] for k in "BTHV")
        self.N = self.B * self.T
        self.vocab_start = _lib.vocab_index("vocab_start", vocab_start)
        self.vocab_size = (self.v_local if vocab_size is None
                           else _lib.vocab_index("vocab_size", vocab_size))
        self.filter_eps = _lib.filter_eps_value(filter_eps)
        self.options, self.inputs, self.tokens = _lib._head_request(
            impl, filter_eps=self.filter_eps, **req)
        self.inputs.vocab_start = self.vocab_start
        self.inputs.vocab_total = self.vocab_size
        self.temperature = _options.LOSS_OPTIONS["temperature"].check("temperature", temperature)
        self.exec = _options.make_exec(threads, memory_budget)
        self.device = self.keep[0].device  # head_args checked: one device
        self.ctx = _ti.call_context(self.device) or _lib.thread_context()
        self.has_bias = bias is not None
        # grad_hidden's shares are summed over the group: in float32, rounded
        # (to bf16 inputs' dtype) once, in backward
        self.grad_dtypes = (_F32,) + _ti.grad_dtypes(self.keep[0].dtype)[1:]

    def shape(self) -> tuple:
        return self.B, self.T, self.H, self.vocab_size, self.vocab_start, self.v_local

    def options_digest(self, cfg, want, par: _Parallel) -> float:
        """A digest of the checked, normalised options every rank of the group
        must share, however each spelled them (beta=0 or 0.0, a default
        passed or not): the loss's fg_loss_config (cfg; None: linear_logprobs,
        whose only loss option is the temperature), the head's impl, filter_eps
        and temperature, which gradients are wanted, the operands' dtype, and
        how grad_hidden is reduced (the ranks' collectives depend on it).
        threads and memory_budget are each rank's own (they do not change the
        bits); vocab_start and vocab_size travel in the entry row itself."""
        config = b"" if cfg is None else _options.config_bytes(cfg).tobytes()
        return _digest(config, int(self.options.impl), self.filter_eps, self.temperature,
                       tuple(bool(w) for w in want), str(self.keep[0].dtype),
                       par.grad_hidden, par.sequence_parallel)

    def tokens_digest(self, *more) -> float:
        tok, mask = self.keep[3].cpu(), self.keep[4].cpu()
        scored = torch.where(mask.bool(), tok, torch.full_like(tok, -1))  # masked ids are unread
        return _digest(scored, mask, *more)

    def zeros(self, shape, dtype=_F32) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def shard_stats(self, stats: Tensor) -> int:
        return lib.fg_linear_shard_stats(self.ctx.handle, ctypes.byref(self.options),
                                         self.temperature, ctypes.byref(self.inputs),
                                         ctypes.byref(self.tokens), stats.data_ptr(),
                                         ctypes.byref(self.exec))

    def rescale(self, stats: Tensor) -> int:
        return lib.fg_shard_stats_rescale(self.ctx.handle, ctypes.byref(self.tokens),
                                          stats.data_ptr())

    def finish(self, stats: Tensor, logp: Tensor, entropy: Tensor) -> int:
        return lib.fg_shard_stats_finish(self.ctx.handle, ctypes.byref(self.tokens),
                                         stats.data_ptr(), logp.data_ptr(), entropy.data_ptr())

    def backward(self, stats, grad_logp, grad_entropy, gh, gw, gb) -> int:
        dt = [_lib.DTYPE_BF16 if d == torch.bfloat16 else _lib.DTYPE_F32
              for d in self.grad_dtypes]
        grads = _lib.fg_linear_grads(
            _lib._mat(self.ptr(gh), dt[0], self.N, self.H, self.H),
            _lib._mat(self.ptr(gw), dt[1], self.v_local, self.H, self.H),
            _lib.fg_vector(self.ptr(gb) or None, dt[2], self.v_local), 0)
        return lib.fg_linear_shard_backward(
            self.ctx.handle, ctypes.byref(self.options), self.temperature,
            ctypes.byref(self.inputs), ctypes.byref(self.tokens), stats.data_ptr(),
            grad_logp.data_ptr(), self.ptr(grad_entropy) or None, ctypes.byref(grads),
            ctypes.byref(self.exec))


class _FailedRequest:
    """A trusted call's rank whose request failed (a bad weight shard: the
    one operand the caller's guarantee leaves to each rank), still making the
    call's collectives: sized from token_ids and hidden (which the guarantee
    makes alike on every rank), every phase returns its status, which (a)
    puts in the statistics' status slot, so the others fail as after a bad
    token id instead of waiting in a collective it never joins."""

    def __init__(self, status: int, B: int, T: int, H: int, device, dtype):
        self.status = status
        self.B, self.T, self.H, self.N = B, T, H, B * T
        self.hidden_dtype = dtype  # of the sequence shards it sends (sequence_parallel)
        self.v_local, self.has_bias = 0, False
        self.device = device
        self.ctx = _lib.thread_context()
        self.grad_dtypes = (_F32,) * 3

    def zeros(self, shape, dtype=_F32) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def shard_stats(self, stats):
        return self.status

    rescale = shard_stats

    def finish(self, stats, logp, entropy):
        return self.status

    def backward(self, *args):
        return self.status


def _stand_in(agree: _Agreement, hidden, token_ids):
    """The _FailedRequest of this rank's failed, trusted call, or, when even
    its sizes are unknown (token_ids or hidden not a tensor of the right
    rank), its own exception raised at once: it joins no collective, and the
    others wait in their first one until the group's timeout (the caller's
    guarantee was broken)."""
    try:
        B, T = (int(n) for n in token_ids.shape)
        H = int(hidden.shape[-1])
        device = hidden.device
    except Exception:  # noqa: BLE001 - no size to join with
        raise agree.cause if agree.cause is not None else \
            FusedGRPOError(_lib.status_name(agree.status), agree.message)
    dtype = hidden.dtype if hidden.dtype in (_F32, torch.bfloat16) else _F32
    return _FailedRequest(agree.status, B, T, H, device, dtype)


def _sequence_hidden(hidden, token_ids, shards: int) -> Tensor:
    """The [B, T, H] buffer (the compute dtype, not yet filled) that the
    ranks' sequence shards, hidden [B, T / shards, H] each in rank order, are
    gathered into after the entry agreement. Refuses a shard of another
    shape; its dtype, device and values are checked with the request's."""
    if not (isinstance(hidden, Tensor) and isinstance(token_ids, Tensor)):
        raise TypeError("hidden and token_ids must be torch tensors")
    if hidden.dim() != 3 or token_ids.dim() != 2:
        raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", f"sequence_parallel=True: hidden must be "
                             f"[B, T / ranks, H] and token_ids [B, T], got hidden "
                             f"{tuple(hidden.shape)}, token_ids {tuple(token_ids.shape)}")
    B, T = token_ids.shape
    if hidden.shape[0] != B or hidden.shape[1] * shards != T:
        raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", f"sequence_parallel=True over {shards} "
                             f"ranks: hidden {tuple(hidden.shape)} is not this rank's "
                             f"[B, T / {shards}, H] shard of token_ids {tuple(token_ids.shape)}")
    dtype = _ti.compute_dtype(torch.empty(0, dtype=hidden.dtype), "hidden").dtype
    return torch.empty((B, T, hidden.shape[2]), dtype=dtype, device=hidden.device)


def _gather_sequence(hidden, full: Tensor, agree: _Agreement):
    """The ranks' sequence shards of hidden, all_gathered into full [B, T, H]
    (the buffer the C calls read). A failed rank (hidden unusable) sends
    zeros of the shard's size: the others' call fails anyway, by the status
    slot, and none waits."""
    S = agree.shards
    B, T, H = full.shape
    try:
        local = _ti.compute_dtype(hidden.detach(), "hidden").to(full.dtype).contiguous()
        local = local.view(B, T // S, H)
    except Exception:  # noqa: BLE001 - this rank failed already (its status travels)
        local = torch.zeros((B, T // S, H), dtype=full.dtype, device=full.device)
    if B == 1:  # each rank's shard is a contiguous piece of full: gathered in place
        dist.all_gather(list(full.view(S, T // S, H).unbind(0)), local.view(T // S, H),
                        group=agree.group)
        return
    parts = torch.empty((S, B, T // S, H), dtype=full.dtype, device=full.device)
    dist.all_gather(list(parts.unbind(0)), local, group=agree.group)
    full.view(B, S, T // S, H).copy_(parts.transpose(0, 1))


def _head_operands(hidden, token_ids, par: _Parallel, shards: int):
    """(the [B, T, H] hidden the request reads, this rank's shard to gather
    into it or None): hidden itself, or under sequence_parallel the buffer
    of _sequence_hidden."""
    if not par.sequence_parallel:
        return hidden, None
    return _sequence_hidden(hidden, token_ids, shards), hidden


def _open(agree: _Agreement, req, shape_args, options_digest: float, par: _Parallel, local):
    """The call's entry: the entry agreement (or, trusted, none: a failed
    rank's stand-in request instead) and the sequence gather. Returns the
    request the phases run on, or None (the entry failed on every rank alike:
    no phase runs)."""
    if par.trust_inputs is True:
        if not agree.ok:
            req = _stand_in(agree, *shape_args)
    elif not agree.enter(req.shape() if agree.ok else _NO_SHAPE, options_digest):
        return None
    if par.sequence_parallel and _needs_collective(agree.shards):
        full = req.keep[0] if agree.ok else req.zeros((req.B, req.T, req.H), req.hidden_dtype)
        _gather_sequence(local, full, agree)
    elif par.sequence_parallel and agree.ok:
        req.keep[0].copy_(_ti.compute_dtype(local.detach(), "hidden"))
    return req


# ------------------------------------------------------------------ phases

_HASH_FLOATS = 4  # two 24-bit halves of a 48-bit digest (exact in float32), negated too


def _merged_stats(req: _Request, agree: _Agreement, tokens_digest: float) -> Tensor:
    """(a), MAX, (b), SUM: the statistics buffer merged over the vocab group.
    A rank whose (a) fails puts its status in the slot; every rank's (b) then
    returns it. The tokens' digest rides in front of the MAX range (one
    buffer, one collective): its MAX and the MAX of its negation differ iff
    the ranks hold different tokens. tokens_digest None (trust_inputs): no
    hash is sent, and none is compared (one host sync fewer)."""
    max_count, sum_offset, sum_count, status_index = _lib.shard_stats_ranges(req.N)
    hashed = _HASH_FLOATS if tokens_digest is not None else 0
    buf = torch.empty(hashed + _lib.shard_stats_floats(req.N), dtype=_F32, device=req.device)
    if hashed:
        halves = divmod(int(tokens_digest), 1 << 24)
        buf[:hashed] = torch.tensor([*halves, *(-h for h in halves)], dtype=_F32,
                                    device=req.device)
    stats = buf[hashed:]
    st = req.shard_stats(stats)
    if st != 0:
        agree.check(st, req.ctx)
        stats[:max_count] = -math.inf  # it wrote nothing: no statistics of its own
        stats[status_index] = float(st)
    agree.reduce(buf[:hashed + max_count], dist.ReduceOp.MAX)
    agree.check(req.rescale(stats), req.ctx, own=False)  # fails only by the slot
    if hashed and (buf[:2] != -buf[2:hashed]).any():
        agree.fail(_COMMUNICATOR, "the vocab group's ranks hold different tokens, mask or "
                   "per-token inputs (their hashes differ)", own=False)
    agree.reduce(stats[sum_offset:sum_offset + sum_count], dist.ReduceOp.SUM)
    return stats


def _forward(req: _Request, agree: _Agreement, tokens_digest: float):
    """(stats, logp, entropy): logp and entropy [B, T] of the whole
    vocabulary, the same bits on every rank of the group."""
    stats = _merged_stats(req, agree, tokens_digest)
    logp = req.zeros((req.B, req.T))
    ent = req.zeros((req.B, req.T))
    if agree.ok:
        agree.check(req.finish(stats, logp, ent), req.ctx)
    return stats, logp, ent


def _backward(req: _Request, agree: _Agreement, stats, grad_logp, grad_entropy, want,
              mode: str):
    """(d) and the reduction of grad_hidden over the vocab group, as `mode`
    says (see _reduce_grad_hidden), with a failure flag beside it: (grad_hidden,
    grad_weight [V_local, H], grad_bias [V_local]); an unwanted one is an
    empty [0]."""
    want_h, want_w, want_b = want
    dt = req.grad_dtypes
    flat = req.zeros(req.N * req.H + 1 if want_h else 1)  # the share, then the flag
    gh = flat[:-1].view(req.B, req.T, req.H) if want_h else flat[:0]
    gw = torch.empty((req.v_local, req.H) if want_w else (0,), dtype=dt[1], device=req.device)
    gb = torch.empty((req.v_local,) if want_b and req.has_bias else (0,), dtype=dt[2],
                     device=req.device)
    if agree.ok:
        agree.check(req.backward(stats, grad_logp, grad_entropy, gh, gw, gb), req.ctx)
    failed = 0.0 if agree.ok else 1.0
    if failed:
        flat.zero_()  # its share is not a share: the result is discarded anyway
    flat[-1] = failed
    gh, flags = _reduce_grad_hidden(flat, (req.B, req.T, req.H) if want_h else None, agree,
                                    mode)
    # Another rank failed: this one's gradient is no gradient. Its status is
    # that rank's to tell (exit agreement); this one only knows that it happened.
    agree.heard = flags > failed
    return gh, gw, gb


def _reduce_grad_hidden(flat: Tensor, shape, agree: _Agreement, mode: str):
    """(grad_hidden, the group's SUM of failure flags) from flat = [this
    rank's share of grad_hidden (shape; None: not wanted), its flag]:
      "sum": one all_reduce SUM of the whole (the share and the flag): the
             whole gradient on every rank;
      "partial": the share as it is (the caller's framework sums it), the
             flag alone all_reduced (one float);
      "reduce_scatter": reduce_scatter SUM over the sequence: this rank's
             [B, T / ranks, H] piece of the whole gradient, each piece sent
             with the flag."""
    if mode == "sum":
        agree.reduce(flat, dist.ReduceOp.SUM)
        return _shaped_share(flat, shape), float(flat[-1])
    if mode == "partial":
        flag = flat[-1:].clone()
        agree.reduce(flag, dist.ReduceOp.SUM)
        return _shaped_share(flat, shape), float(flag)
    S = agree.shards
    B, T, H = shape if shape is not None else (0, S, 0)
    piece = B * (T // S) * H
    send = torch.empty((S, piece + 1), dtype=flat.dtype, device=flat.device)
    send[:, :-1].view(S, B, T // S, H).copy_(flat[:-1].view(B, S, T // S, H).transpose(0, 1))
    send[:, -1] = flat[-1]
    out = send[0] if S == 1 else torch.empty(piece + 1, dtype=flat.dtype, device=flat.device)
    if S > 1:
        dist.reduce_scatter_tensor(out, send.view(-1), op=dist.ReduceOp.SUM, group=agree.group)
    gh = out[:-1].view(B, T // S, H) if shape is not None else out[:0]
    return gh, float(out[-1])


def _shaped_share(flat: Tensor, shape):
    return flat[:-1].view(shape) if shape is not None else flat[:0]


# ------------------------------------------------------------------ the loss

def _loss_and_grads(req: _Request, agree: _Agreement, batch, cfg, want, tokens_digest,
                    mode: str):
    """(c) and (d) after the forward phases: (loss, metrics [10], logp, entropy,
    grad_hidden, grad_weight, grad_bias). (c) is host-only: it runs on the CPU
    thread's context over host copies of logp and entropy (batch points at
    host copies of its arrays), and its gradients go to the device for (d);
    on the CPU the copies are the tensors themselves."""
    stats, logp, ent = _forward(req, agree, tokens_digest)
    logp_h, ent_h = logp.cpu(), ent.cpu()
    dlogp = torch.zeros((req.B, req.T), dtype=_F32)
    dent = torch.zeros((req.B, req.T), dtype=_F32)
    out = _lib.fg_logp_outputs()
    out.grad_logp, out.grad_entropy = dlogp.data_ptr(), dent.data_ptr()
    if agree.ok:
        host = _lib.thread_context()
        agree.check(lib.fg_grpo_loss_from_logp(
            host.handle, ctypes.byref(cfg), ctypes.byref(batch), logp_h.data_ptr(),
            ent_h.data_ptr(), ctypes.byref(out), ctypes.byref(req.exec)), host)
    if any(want):
        grads = _backward(req, agree, stats, dlogp.to(req.device), dent.to(req.device), want,
                          mode)
    else:
        grads = (req.zeros(0),) * 3
    metrics = torch.tensor([getattr(out.metrics, n) for n in METRIC_NAMES], dtype=_F32,
                           device=req.device)
    return (torch.tensor(out.loss, dtype=_F32, device=req.device), metrics, logp, ent) + grads


def _run_loss(hidden, weight, bias, arrays, options, par: _Parallel):
    """One vocab-parallel loss call, every collective and both agreements;
    raises on every rank alike."""
    agree = _Agreement(par)
    req = batch = cfg = local = None
    digests = (0.0, None)
    try:
        _ti.check_devices(hidden=hidden, weight=weight, bias=bias, **arrays)
        head_hidden, local = _head_operands(hidden, arrays["token_ids"], par, agree.shards)
        req = _Request(head_hidden, weight, arrays["token_ids"], arrays["mask"], bias,
                       **options["head"])
        adv, old, ref, isr, samp, per_seq = _ti.batch_tensors(
            req.B, req.T, arrays["advantages"], arrays["old_logp"], arrays["ref_logp"],
            arrays["is_ratio"], arrays["sampling_logp"])
        # (c) reads them on the host: copies of a device's (O(B*T)), kept
        # alive here until it has run
        keep = tuple(None if t is None else t.cpu() for t in (adv, old, ref, isr, samp))
        host_tokens = (req.keep[3].cpu(), req.keep[4].cpu())
        p = req.ptr
        batch = _lib._batch(req.B, req.T, p(host_tokens[0]), p(host_tokens[1]),
                            *(p(t) for t in keep[:4]), per_seq, p(keep[4]))
        cfg = _options.loss_config(options["loss"])  # -0.0 made 0.0 by its checks
        if par.trust_inputs is not True:
            digests = (req.options_digest(cfg, options["want"], par),
                       req.tokens_digest(*keep, per_seq))
    except Exception as e:  # noqa: BLE001 - carried to every rank, re-raised below
        agree.fail_on_exception(e)
    outputs = None
    req = _open(agree, req, (hidden, arrays["token_ids"]), digests[0], par, local)
    if req is not None:
        outputs = _loss_and_grads(req, agree, batch, cfg, options["want"], digests[1],
                                  par.grad_hidden)
    agree.conclude()
    return outputs


class _LossFunction(torch.autograd.Function):
    """The loss with its gradients computed in forward; backward scales them
    by the incoming gradient of the loss (as fusedgrpo.torch's op)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, arrays, options, par):
        loss, metrics, logp, ent, gh, gw, gb = _run_loss(hidden, weight, bias, arrays, options,
                                                         par)
        ctx.save_for_backward(gh, gw, gb, hidden, weight, bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(metrics, logp, ent)
        ctx.set_materialize_grads(False)
        return loss, metrics, logp, ent

    @staticmethod
    def backward(ctx, g_loss, g_metrics, g_logp, g_ent):
        gh, gw, gb, hidden, weight, bias = ctx.saved_tensors
        if g_loss is None:
            return None, None, None, None, None, None
        # fusedgrpo.torch's rules: the caller's own tensors (copied where the
        # graph is kept), and a double backward raises (the inputs anchor it)
        saved = (gh, gw) + (() if ctx.dtypes[2] is None else (gb,))
        dh, dw, *db = _ti.loss_gradients(g_loss, saved, ctx.dtypes[:len(saved)],
                                         anchors=(hidden, weight, bias))
        return dh, dw, (db[0] if db else None), None, None, None


@_options.with_loss_options
@_joins_when_unbound
def fused_linear_grpo_loss(hidden, weight, token_ids, mask, advantages, bias=None,
                           old_logp=None, ref_logp=None, is_ratio=None, sampling_logp=None, *,
                           vocab_start=0, vocab_size=None, process_group=None, error_group=None,
                           tensor_parallel=False, grad_hidden=None, sequence_parallel=False,
                           trust_inputs=False, impl="fused", threads=None, memory_budget=None,
                           filter_eps=0.0, **options):
    """fusedgrpo.torch.fused_linear_grpo_loss with the weight (and bias) split
    by vocab rows over process_group: weight [V_local, H] holds rows
    [vocab_start, vocab_start + V_local) of vocab_size. Returns (loss, metrics
    dict of 0-dim tensors, logp, entropy), the same on every rank of the
    group; the loss is differentiable w.r.t. hidden (its gradient as
    grad_hidden says: see the module doc, "Tensor parallel"), weight and bias
    (this rank's rows). Collective: see the module doc; a bad argument (of
    any exception type) raises on every rank of error_group: that exception
    on this rank, FusedGRPOError on the others."""
    group = _parallel(process_group, error_group, tensor_parallel, grad_hidden,
                      sequence_parallel, trust_inputs)
    try:
        _check_parallel(group)
        if isinstance(options.get("num_items_in_batch"), Tensor):
            options["num_items_in_batch"] = float(options["num_items_in_batch"])
        loss_opts = _options.loss_options_of(options)
        temperature = loss_opts.get("temperature", _options.LOSS_OPTIONS["temperature"].default)
        want = _wanted(hidden, weight, bias)
    except Exception as e:  # noqa: BLE001 - carried to every rank by _refuse
        _refuse(e, group)
    options = dict(loss=loss_opts, want=want, head=dict(
        vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature, impl=impl,
        threads=threads, memory_budget=memory_budget, filter_eps=filter_eps))
    arrays = dict(token_ids=token_ids, mask=mask, advantages=advantages, old_logp=old_logp,
                  ref_logp=ref_logp, is_ratio=is_ratio, sampling_logp=sampling_logp)
    loss, metrics, logp, ent = _LossFunction.apply(hidden, weight, bias, arrays, options, group)
    return loss, {n: metrics[i] for i, n in enumerate(METRIC_NAMES)}, logp, ent


def _wanted(hidden, weight, bias) -> tuple:
    """Which gradients the call computes: of hidden, weight, bias."""
    grad_on = torch.is_grad_enabled()
    return (bool(grad_on and hidden.requires_grad), bool(grad_on and weight.requires_grad),
            bool(grad_on and bias is not None and bias.requires_grad))


class FusedLinearGRPOLoss(_LocalGRPOLoss):
    """fusedgrpo.torch.FusedLinearGRPOLoss (Liger's constructor and forward)
    with a vocab-sharded weight: keyword-only vocab_start, vocab_size,
    process_group, error_group and the tensor-parallel options
    (tensor_parallel, grad_hidden, sequence_parallel, trust_inputs) as in
    fused_linear_grpo_loss. forward's lin_weight / bias (and ref_weight /
    ref_bias) are this rank's rows; under sequence_parallel, _input (and
    ref_input) this rank's shard of the sequence."""

    def __init__(self, *args, vocab_start: int = 0, vocab_size: Optional[int] = None,
                 process_group=None, error_group=None, tensor_parallel: bool = False,
                 grad_hidden: Optional[str] = None, sequence_parallel: bool = False,
                 trust_inputs: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size
        self.process_group = process_group
        self.error_group = error_group
        self.parallel = dict(tensor_parallel=tensor_parallel, grad_hidden=grad_hidden,
                             sequence_parallel=sequence_parallel, trust_inputs=trust_inputs)
        self._calls = 0  # collective calls made so far

    @functools.wraps(_LocalGRPOLoss.forward)
    def forward(self, *args, **kwargs):
        calls = self._calls
        try:
            return super().forward(*args, **kwargs)
        except Exception as e:
            if self._calls != calls:
                raise  # raised by (after) a collective call: on every rank alike
            # before any (Liger's own refusals, arguments that do not bind):
            # the others learn of it in the agreements of the call they make
            _refuse(e, _parallel(self.process_group, self.error_group, **self.parallel))

    def _loss_fn(self, *args, **kwargs):
        self._calls += 1
        return fused_linear_grpo_loss(*args, vocab_start=self.vocab_start,
                                      vocab_size=self.vocab_size,
                                      process_group=self.process_group,
                                      error_group=self.error_group, **self.parallel, **kwargs)


# ------------------------------------------------------------------ log-probs

class _LogprobsFunction(torch.autograd.Function):
    """logp and entropy of the vocab-sharded head; backward runs (d) and the
    reduction of grad_hidden (so every rank of the group must run it)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, mask, head, want, par):
        agree = _Agreement(par)
        req, local, digests = None, None, (0.0, None)
        try:
            head_hidden, local = _head_operands(hidden, token_ids, par, agree.shards)
            req = _Request(head_hidden, weight, token_ids, mask, bias, **head)
            if par.trust_inputs is not True:
                digests = (req.options_digest(None, want, par), req.tokens_digest())
        except Exception as e:  # noqa: BLE001 - carried to every rank, re-raised below
            agree.fail_on_exception(e)
        logp = ent = stats = None
        req = _open(agree, req, (hidden, token_ids), digests[0], par, local)
        if req is not None:
            stats, logp, ent = _forward(req, agree, digests[1])
        agree.conclude()
        # under sequence_parallel the gathered hidden: backward's (d) reads it
        ctx.save_for_backward(req.keep[0] if par.sequence_parallel else hidden, weight, bias,
                              token_ids, mask, stats)
        ctx.head, ctx.par, ctx.want = head, par, want
        ctx.hidden_dtype = hidden.dtype
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, token_ids, mask, stats = ctx.saved_tensors
        nothing = (None,) * 8
        if g_logp is None and g_ent is None:
            return nothing  # every rank alike: the same loss of logp/entropy

        def compute():
            agree = _Agreement(ctx.par)
            req = _Request(hidden, weight, token_ids, mask, bias, **ctx.head)  # checked before
            gl = req.zeros((req.B, req.T)) if g_logp is None else g_logp
            gl = gl.detach().to(_F32).contiguous()
            ge = None if g_ent is None else g_ent.detach().to(_F32).contiguous()
            gh, gw, gb = _backward(req, agree, stats, gl, ge, ctx.want, ctx.par.grad_hidden)
            agree.conclude()
            return (gh.to(ctx.hidden_dtype) if ctx.want[0] else None,
                    gw.to(weight.dtype) if ctx.want[1] else None,
                    gb.to(bias.dtype) if ctx.want[2] else None)

        # a double backward raises (fusedgrpo.torch's rule), whatever is in the graph
        dh, dw, db = _ti.first_order_only(compute, g_logp, g_ent, hidden, weight, bias)
        return dh, dw, db, None, None, None, None, None


@_joins_when_unbound
def linear_logprobs(hidden, weight, token_ids, mask=None, bias=None, *, vocab_start=0,
                    vocab_size=None, process_group=None, error_group=None, temperature=1.0,
                    return_entropy=False, tensor_parallel=False, grad_hidden=None,
                    sequence_parallel=False, trust_inputs=False, impl="fused", threads=None,
                    memory_budget=None):
    """fusedgrpo.torch.linear_logprobs with the weight (and bias) split by
    vocab rows over process_group (see fused_linear_grpo_loss): logp [B, T]
    float32 (0 where masked) of the whole vocabulary, the same bits on every
    rank, or (logp, entropy). Differentiable w.r.t. hidden (as grad_hidden
    says), weight and bias: every rank of the group must run the backward, of
    the same loss. A bad argument raises on every rank, as
    fused_linear_grpo_loss's."""
    group = _parallel(process_group, error_group, tensor_parallel, grad_hidden,
                      sequence_parallel, trust_inputs)
    try:
        _check_parallel(group)
        if mask is None:
            mask = torch.ones(token_ids.shape, dtype=torch.bool, device=token_ids.device)
        want = _wanted(hidden, weight, bias)
    except Exception as e:  # noqa: BLE001 - carried to every rank by _refuse
        _refuse(e, group)
    head = dict(vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature,
                impl=impl, threads=threads, memory_budget=memory_budget, filter_eps=0.0)
    logp, ent = _LogprobsFunction.apply(hidden, weight, bias, token_ids, mask, head, want, group)
    return (logp, ent) if return_entropy else logp


# ------------------------------------------------- local calls, agreed status

def agreed(fn, *args, error_group=None, **kwargs):
    """``fn(*args, **kwargs)`` (a local fusedgrpo call: ``fusedgrpo.torch``'s
    ops on the whole head) with one all_reduce MAX of its status over
    ``error_group`` (default WORLD) after it: a rank whose call raised (any
    exception: FusedGRPOError, or a TypeError of a bad keyword, ...) makes
    every rank raise, instead of leaving them in DDP's gradient allreduce
    until it times out. That rank raises its own exception; the others
    FusedGRPOError with its status (FG_ERR_COMMUNICATOR for another type of
    exception), naming the rank and why (a second collective, made on
    failure only). Data parallel with the whole head on every rank
    (FusedGRPOTrainer under DDP) needs no more: the call itself makes no
    collective."""
    err, out = None, None
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every rank raises, below
        err = e
    status = 0 if err is None else _status_of(err)
    rank = dist.get_rank(error_group)
    t = torch.tensor([float(status), -float(rank) if err is not None else -math.inf],
                     dtype=torch.float64, device=_agreement_device(error_group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=error_group)
    t = t.cpu()
    worst = int(t[0])
    if worst == 0:
        return out
    first = int(-t[1])
    reasons = _gather_reasons("" if err is None else _reason_of(err), error_group,
                              dist.get_world_size(error_group))
    if err is not None and (not isinstance(err, FusedGRPOError) or err.code == worst):
        raise err
    name = _lib.status_name(worst)
    who = f"rank {first}" + ("" if error_group is None else " of error_group")
    why = reasons[first] if 0 <= first < len(reasons) and reasons[first] else name
    raise FusedGRPOError(name, f"{who}'s fusedgrpo call failed ({why}); every rank raises "
                               f"{name}") from err
