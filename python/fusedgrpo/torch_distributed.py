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
WORLD) and ``error_group`` (default WORLD). Every rank of the vocab group must
make the same call (same tokens, options, and which inputs require a gradient)
and, for ``linear_logprobs``, also run its backward. No ``torch.compile``
support (the process groups are Python objects; the ops are
``torch.autograd.Function``s, so compile graph-breaks around them).

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
            B, T, H, vocab_size, vocab_start, V_local, a hash of the options;
  (a) GEMM 1, all_reduce MAX of 2N+1+4 floats (the 4: a hash of tokens, mask
            and the loss's per-token inputs, and its negation: the ranks agree
            iff its MAX equals its min); (b) all_reduce SUM of 8N floats;
            logp and entropy (the same bits on every rank of the group);
  (c) the loss from logp (fg_grpo_loss_from_logp, on every rank, on the host);
  (d) GEMMs 1-3, all_reduce SUM of N*H+1 floats (grad_hidden and a failure
            flag; 1 float when grad_hidden is not wanted; none under no_grad);
  exit      all_reduce MAX of 3 float64 over the error group.
``linear_logprobs`` makes entry to (b) and exit in its forward, (d) and exit
in its backward. The loss's forward computes the gradients too (like
``fusedgrpo.torch``); its backward scales them, with no communication.

Errors: every rank raises ``FusedGRPOError`` with the same status, and none
waits in a collective. A rank that fails before the call (a bad argument)
says so at entry, and ranks that disagree on the call's shapes or options,
or whose vocab rows do not tile ``[0, vocab_size)``, all see it there
(``FG_ERR_COMMUNICATOR``): the group then makes no further collective. A
rank whose phase (a) fails (a bad token id, NaN input) writes its status into
the statistics' status slot, which the MAX spreads, so every rank's next
phase returns it; ranks that hold different tokens (or advantages, ...) learn
it from the hash in the same MAX (``FG_ERR_COMMUNICATOR``; a failed (a) takes
precedence: a bad token id on one rank is reported as such). A failure in
(d) travels as the flag beside grad_hidden. The exit reduction over
``error_group`` then gives every rank of that group the largest status, so
data-parallel ranks (another vocab group's) raise too instead of waiting in
DDP's allreduce. An error leaves the groups usable.

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
import hashlib
import math
from collections import namedtuple
from typing import Optional

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


# ------------------------------------------------------------------ agreement

class _Agreement:
    """One call's collectives and how a failure travels through them: this
    rank's first failure (status, message), whether it heard of another's,
    and the entry and exit agreements. Every rank of the vocab group makes the
    same collectives in the same order whatever fails, except that a failed
    entry (agreed by all) skips the rest."""

    def __init__(self, process_group, error_group):
        self.group = process_group
        self.error_group = error_group
        self.shards = dist.get_world_size(process_group)
        self.status = 0
        self.message = ""
        self.own = False  # the failure is this rank's own, not one it learned of
        self.heard = False
        if dist.get_rank(process_group) < 0:  # a caller's slip: still join the exit
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
        """A rank that cannot even make its C request (a bad argument) fails
        with the library's status for it, so the others learn of it at entry."""
        if isinstance(e, FusedGRPOError):
            self.fail(e.code, e.message)
        else:
            self.fail(_UNSUPPORTED, f"{type(e).__name__}: {e}")
        self.cause = e

    def reduce(self, t: Tensor, op):
        if _needs_collective(self.shards):
            dist.all_reduce(t, op=op, group=self.group)

    def enter(self, shape: tuple, options_digest: float) -> bool:
        """The entry agreement: every rank's status, shape (B, T, H, vocab_size,
        vocab_start, V_local) and options digest, gathered. False (on every
        rank alike) when some rank failed or they disagree: no phase runs."""
        row = torch.tensor([float(self.status), *shape, options_digest], dtype=torch.float64)
        rows = [row]
        if _needs_collective(self.shards):
            row = row.to(_agreement_device(self.group))
            rows = [torch.empty_like(row) for _ in range(self.shards)]
            dist.all_gather(rows, row, group=self.group)
        table = torch.stack(rows).cpu()
        verdict = _entry_verdict(table)
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
        name = _lib.status_name(status)
        if self.status == status:
            raise FusedGRPOError(name, self.message) from getattr(self, "cause", None)
        who = f"rank {int(-t[2])}" if math.isfinite(t[2]) else "a rank of a vocab group"
        mine = f" (this rank: {self.message})" if self.message else ""
        raise FusedGRPOError(name, f"{who} failed with {name}; every rank raises it{mine}")


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
# The head options every rank of a vocab group must share (vocab_start is
# each rank's own; threads and memory budget do not change the bits).
_AGREED_HEAD_OPTIONS = ("temperature", "impl", "filter_eps")


def _options_digest(head: dict, *more) -> float:
    return _digest(*(head[k] for k in _AGREED_HEAD_OPTIONS), *more)


def _entry_verdict(table: Tensor):
    """(status, message) of a gathered entry table [ranks, 8], or None when
    the ranks agree: statuses, then shapes and options, then the vocab tiling."""
    statuses = table[:, 0]
    if statuses.max() > 0:
        rank = int(statuses.argmax())
        status = int(statuses[rank])
        return status, (f"rank {rank} of the vocab group failed before the call with "
                        f"{_lib.status_name(status)}; every rank raises it")
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
        self.vocab_start = int(vocab_start)
        self.vocab_size = self.v_local if vocab_size is None else int(vocab_size)
        self.options, self.inputs, self.tokens = _lib._head_request(
            impl, filter_eps=_lib.filter_eps_value(filter_eps), **req)
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


# ------------------------------------------------------------------ phases

_HASH_FLOATS = 4  # two 24-bit halves of a 48-bit digest (exact in float32), negated too


def _merged_stats(req: _Request, agree: _Agreement, tokens_digest: float) -> Tensor:
    """(a), MAX, (b), SUM: the statistics buffer merged over the vocab group.
    A rank whose (a) fails puts its status in the slot; every rank's (b) then
    returns it. The tokens' digest rides in front of the MAX range (one
    buffer, one collective): its MAX and the MAX of its negation differ iff
    the ranks hold different tokens."""
    max_count, sum_offset, sum_count, status_index = _lib.shard_stats_ranges(req.N)
    buf = torch.empty(_HASH_FLOATS + _lib.shard_stats_floats(req.N), dtype=_F32,
                      device=req.device)
    halves = divmod(int(tokens_digest), 1 << 24)
    buf[:_HASH_FLOATS] = torch.tensor([*halves, *(-h for h in halves)], dtype=_F32,
                                      device=req.device)
    stats = buf[_HASH_FLOATS:]
    st = req.shard_stats(stats)
    if st != 0:
        agree.check(st, req.ctx)
        stats[:max_count] = -math.inf  # it wrote nothing: no statistics of its own
        stats[status_index] = float(st)
    agree.reduce(buf[:_HASH_FLOATS + max_count], dist.ReduceOp.MAX)
    agree.check(req.rescale(stats), req.ctx, own=False)  # fails only by the slot
    if (buf[:2] != -buf[2:_HASH_FLOATS]).any():
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


def _backward(req: _Request, agree: _Agreement, stats, grad_logp, grad_entropy, want):
    """(d) and the SUM of grad_hidden with a failure flag in its last float:
    (grad_hidden [B, T, H] (whole), grad_weight [V_local, H], grad_bias
    [V_local]); an unwanted one is an empty [0]."""
    want_h, want_w, want_b = want
    dt = req.grad_dtypes
    flat = req.zeros(req.N * req.H + 1 if want_h else 1)
    gh = flat[:-1].view(req.B, req.T, req.H) if want_h else flat[:0]
    gw = torch.empty((req.v_local, req.H) if want_w else (0,), dtype=dt[1], device=req.device)
    gb = torch.empty((req.v_local,) if want_b and req.has_bias else (0,), dtype=dt[2],
                     device=req.device)
    if agree.ok:
        agree.check(req.backward(stats, grad_logp, grad_entropy, gh, gw, gb), req.ctx)
    failed = 0.0 if agree.ok else 1.0
    if failed:
        flat.zero_()  # its share is not a share: the sum is discarded anyway
    flat[-1] = failed
    agree.reduce(flat, dist.ReduceOp.SUM)
    # Another rank failed: this one's sum is no gradient. Its status is that
    # rank's to tell (exit agreement); this one only knows that it happened.
    agree.heard = float(flat[-1]) > failed
    return gh, gw, gb


# ------------------------------------------------------------------ the loss

def _loss_and_grads(req: _Request, agree: _Agreement, batch, cfg, want, tokens_digest):
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
        grads = _backward(req, agree, stats, dlogp.to(req.device), dent.to(req.device), want)
    else:
        grads = (req.zeros(0),) * 3
    metrics = torch.tensor([getattr(out.metrics, n) for n in METRIC_NAMES], dtype=_F32,
                           device=req.device)
    return (torch.tensor(out.loss, dtype=_F32, device=req.device), metrics, logp, ent) + grads


def _run_loss(hidden, weight, bias, arrays, options, group):
    """One vocab-parallel loss call, every collective and both agreements;
    raises on every rank alike."""
    agree = _Agreement(*group)
    req = batch = cfg = None
    digests = (0.0, 0.0)
    try:
        _ti.check_devices(hidden=hidden, weight=weight, bias=bias, **arrays)
        req = _Request(hidden, weight, arrays["token_ids"], arrays["mask"], bias,
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
        cfg = _options.loss_config(options["loss"])
        digests = (_options_digest(options["head"], sorted(options["loss"].items()),
                                   options["want"], str(req.keep[0].dtype)),
                   req.tokens_digest(*keep, per_seq))
    except Exception as e:  # noqa: BLE001 - carried to every rank, re-raised below
        agree.fail_on_exception(e)
    shape = req.shape() if req is not None else (0,) * 6
    outputs = None
    if agree.enter(shape, digests[0]):
        outputs = _loss_and_grads(req, agree, batch, cfg, options["want"], digests[1])
    agree.conclude()
    return outputs


class _LossFunction(torch.autograd.Function):
    """The loss with its gradients computed in forward; backward scales them
    by the incoming gradient of the loss (as fusedgrpo.torch's op)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, arrays, options, group):
        loss, metrics, logp, ent, gh, gw, gb = _run_loss(hidden, weight, bias, arrays, options,
                                                         group)
        ctx.save_for_backward(gh, gw, gb)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(metrics, logp, ent)
        ctx.set_materialize_grads(False)
        return loss, metrics, logp, ent

    @staticmethod
    def backward(ctx, g_loss, g_metrics, g_logp, g_ent):
        gh, gw, gb = ctx.saved_tensors
        if g_loss is None:
            return None, None, None, None, None, None
        # loss.backward() sends 1: the saved gradients as they are (no V x H copy)
        unit = _ti.is_eager_tensor(g_loss) and float(g_loss) == 1.0

        def scaled(g, dt):
            return None if g.numel() == 0 else (g.to(dt) if unit else (g * g_loss).to(dt))

        return (scaled(gh, ctx.dtypes[0]), scaled(gw, ctx.dtypes[1]),
                None if ctx.dtypes[2] is None else scaled(gb, ctx.dtypes[2]), None, None, None)


@_options.with_loss_options
def fused_linear_grpo_loss(hidden, weight, token_ids, mask, advantages, bias=None,
                           old_logp=None, ref_logp=None, is_ratio=None, sampling_logp=None, *,
                           vocab_start=0, vocab_size=None, process_group=None, error_group=None,
                           impl="fused", threads=None, memory_budget=None, filter_eps=0.0,
                           **options):
    """fusedgrpo.torch.fused_linear_grpo_loss with the weight (and bias) split
    by vocab rows over process_group: weight [V_local, H] holds rows
    [vocab_start, vocab_start + V_local) of vocab_size. Returns (loss, metrics
    dict of 0-dim tensors, logp, entropy), the same on every rank of the
    group; the loss is differentiable w.r.t. hidden (its whole gradient),
    weight and bias (this rank's rows). Collective: see the module doc."""
    if isinstance(options.get("num_items_in_batch"), Tensor):
        options["num_items_in_batch"] = float(options["num_items_in_batch"])
    loss_opts = _options.loss_options_of(options)
    temperature = loss_opts.get("temperature", _options.LOSS_OPTIONS["temperature"].default)
    grad_on = torch.is_grad_enabled()
    want = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad)
    options = dict(loss=loss_opts, want=want, head=dict(
        vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature, impl=impl,
        threads=threads, memory_budget=memory_budget, filter_eps=filter_eps))
    arrays = dict(token_ids=token_ids, mask=mask, advantages=advantages, old_logp=old_logp,
                  ref_logp=ref_logp, is_ratio=is_ratio, sampling_logp=sampling_logp)
    loss, metrics, logp, ent = _LossFunction.apply(hidden, weight, bias, arrays, options,
                                                   (process_group, error_group))
    return loss, {n: metrics[i] for i, n in enumerate(METRIC_NAMES)}, logp, ent


class FusedLinearGRPOLoss(_LocalGRPOLoss):
    """fusedgrpo.torch.FusedLinearGRPOLoss (Liger's constructor and forward)
    with a vocab-sharded weight: keyword-only vocab_start, vocab_size,
    process_group, error_group as in fused_linear_grpo_loss. forward's
    lin_weight / bias (and ref_weight / ref_bias) are this rank's rows."""

    def __init__(self, *args, vocab_start: int = 0, vocab_size: Optional[int] = None,
                 process_group=None, error_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size
        self.process_group = process_group
        self.error_group = error_group

    def _loss_fn(self, *args, **kwargs):
        return fused_linear_grpo_loss(*args, vocab_start=self.vocab_start,
                                      vocab_size=self.vocab_size,
                                      process_group=self.process_group,
                                      error_group=self.error_group, **kwargs)


# ------------------------------------------------------------------ log-probs

class _LogprobsFunction(torch.autograd.Function):
    """logp and entropy of the vocab-sharded head; backward runs (d) and the
    SUM of grad_hidden (so every rank of the group must run it)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, mask, head, want, group):
        agree = _Agreement(*group)
        req, digests = None, (0.0, 0.0)
        try:
            req = _Request(hidden, weight, token_ids, mask, bias, **head)
            digests = (_options_digest(head, want, str(req.keep[0].dtype)),
                       req.tokens_digest())
        except Exception as e:  # noqa: BLE001 - carried to every rank, re-raised below
            agree.fail_on_exception(e)
        logp = ent = stats = None
        if agree.enter(req.shape() if req is not None else (0,) * 6, digests[0]):
            stats, logp, ent = _forward(req, agree, digests[1])
        agree.conclude()
        ctx.save_for_backward(hidden, weight, bias, token_ids, mask, stats)
        ctx.head, ctx.group, ctx.want = head, group, want
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, token_ids, mask, stats = ctx.saved_tensors
        nothing = (None,) * 8
        if g_logp is None and g_ent is None:
            return nothing  # every rank alike: the same loss of logp/entropy
        agree = _Agreement(*ctx.group)
        req = _Request(hidden, weight, token_ids, mask, bias, **ctx.head)  # checked in forward
        if g_logp is None:
            g_logp = req.zeros((req.B, req.T))
        g_logp = g_logp.detach().to(_F32).contiguous()
        g_ent = None if g_ent is None else g_ent.detach().to(_F32).contiguous()
        gh, gw, gb = _backward(req, agree, stats, g_logp, g_ent, ctx.want)
        agree.conclude()
        dh = gh.to(hidden.dtype) if ctx.want[0] else None
        dw = gw.to(weight.dtype) if ctx.want[1] else None
        db = gb.to(bias.dtype) if ctx.want[2] else None
        return dh, dw, db, None, None, None, None, None


def linear_logprobs(hidden, weight, token_ids, mask=None, bias=None, *, vocab_start=0,
                    vocab_size=None, process_group=None, error_group=None, temperature=1.0,
                    return_entropy=False, impl="fused", threads=None, memory_budget=None):
    """fusedgrpo.torch.linear_logprobs with the weight (and bias) split by
    vocab rows over process_group (see fused_linear_grpo_loss): logp [B, T]
    float32 (0 where masked) of the whole vocabulary, the same bits on every
    rank, or (logp, entropy). Differentiable w.r.t. hidden, weight and bias:
    every rank of the group must run the backward, of the same loss."""
    if mask is None:
        mask = torch.ones(token_ids.shape, dtype=torch.bool, device=token_ids.device)
    grad_on = torch.is_grad_enabled()
    want = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad)
    head = dict(vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature,
                impl=impl, threads=threads, memory_budget=memory_budget, filter_eps=0.0)
    logp, ent = _LogprobsFunction.apply(hidden, weight, bias, token_ids, mask, head, want,
                                        (process_group, error_group))
    return (logp, ent) if return_entropy else logp


# ------------------------------------------------- local calls, agreed status

def agreed(fn, *args, error_group=None, **kwargs):
    """``fn(*args, **kwargs)`` (a local fusedgrpo call: ``fusedgrpo.torch``'s
    ops on the whole head) with one all_reduce MAX of its status over
    ``error_group`` (default WORLD) after it: a rank whose call raised
    FusedGRPOError makes every rank raise that status, instead of leaving
    them in DDP's gradient allreduce until it times out. Data parallel with
    the whole head on every rank (FusedGRPOTrainer under DDP) needs no more:
    the call itself makes no collective."""
    status, err, out = 0, None, None
    try:
        out = fn(*args, **kwargs)
    except FusedGRPOError as e:
        status, err = e.code, e
    # NCCL reduces device tensors only: the flag lives on this rank's GPU there.
    nccl = dist.get_backend(error_group) == "nccl"
    t = torch.tensor([float(status)], dtype=torch.float64,
                     device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=error_group)
    worst = int(t.item())
    if worst == 0:
        return out
    if err is not None and err.code == worst:
        raise err
    name = _lib.status_name(worst)
    raise FusedGRPOError(name, f"another rank's fusedgrpo call failed with {name}; every rank "
                               "raises it (that rank's message says why)") from err
