"""PyTorch front end: ``fusedgrpo::linear_grpo`` (a ``torch.library.custom_op``
with a fake kernel and autograd) and ``FusedLinearGRPOLoss``, an ``nn.Module``
that mirrors Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (same constructor
arguments, same ``forward`` arguments, returns ``(loss, metrics)``).

CPU or CUDA tensors (all on one device; CUDA through the library's CUDA
backend, on torch's current stream), float32 or bfloat16 (float16 is widened to float32; float64 is
refused: the op computes in float32 and bfloat16, so torch.autograd.gradcheck
needs float32 inputs and a float32 tolerance). Every tensor's device, shape and
dtype is checked before the C call (fusedgrpo._inputs, as the NumPy API).
One C call computes the loss and all gradients in the forward (like Liger);
backward scales the saved gradients by the incoming gradient and casts them to
the input dtype, into tensors of the caller's own (for an incoming gradient of
exactly 1, the saved ones when the backward frees the graph, copies when
retain_graph keeps it; _torch_inputs.loss_gradients). Those gradients are not
differentiable: a double backward (differentiating them after
create_graph=True) raises RuntimeError, through any of the fused ops.

Every option is checked as the caller gave it (a bool is not a number, 2 is
not a bool) before the op, under torch.compile as eagerly: a compiled call
refuses with the eager call's error when it runs (_call_options).

Differences from Liger, by design (docs/LOSS_SPEC.md, which follows TRL 1.16,
is the contract; python/README.md lists where Liger departs from TRL):
- ``metrics`` is ``(kl, clip_ratio)`` when beta != 0 else ``(clip_ratio,)`` like
  Liger, clip_ratio per loss type as Liger reports it: the region fraction
  (clipped types), ``ratio > epsilon_high and A > 0`` (cispo), 0 (sapo,
  vespo). At the sequence level it is a mean over sequences (TRL) where Liger
  weights sequences by their tokens; with ``delta`` it tests the clamped ratio
  (TRL's coef_1) where Liger tests the unclamped one. Pass
  ``return_metrics_dict=True`` for every metric by name.
- "luspo" at token level follows the spec (mean over b of sum_t m*L); Liger
  also weights masked positions there. They agree at sequence level.
- ``chunk_size`` other than Liger's default raises ValueError (chunking is
  planned from ``memory_budget``).
- Sequence-level "cispo"/"sapo"/"vespo" are allowed, as in TRL (Liger refuses them).
"""
from __future__ import annotations

import ctypes
import inspect
import numbers
import warnings
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from . import _lib, _options
from . import _torch_inputs as _ti
from ._lib import FusedGRPOError, METRIC_NAMES
# verl's fused-kernel signature (log-probs and entropy of labels), whole or
# vocab-parallel over a process group (fusedgrpo/cross_entropy.py)
from .cross_entropy import linear_cross_entropy

# Inductor's CUDA graphs (torch.compile mode="reduce-overhead") must leave the
# ops out of a capture: their C call reads the token arrays, the NaN scan and
# each chunk's log-probs on the host (_torch_inputs.call_context refuses a
# capture). A torch without the tag gets no tags.
_OP_TAGS = ({"tags": (torch.Tag.cudagraph_unsafe,)}
            if hasattr(torch.Tag, "cudagraph_unsafe")
            and "tags" in inspect.signature(torch.library.custom_op).parameters else {})

__all__ = ["linear_grpo", "linear_grpo_reported", "FusedLinearGRPOLoss", "fused_linear_grpo_loss",
           "linear_logprobs", "linear_cross_entropy", "raise_device_errors", "METRIC_NAMES"]

# The op's schema: the tensors positional (torch.library custom ops take no
# keyword-only tensors), the loss options of fusedgrpo._options and this
# call's execution options keyword-only.
_SCHEMA_TYPES = {str: "str", float: "float", int: "SymInt", bool: "bool"}


def _schema_option(o) -> str:
    t = _SCHEMA_TYPES[o.type] + ("?" if o.default is None else "")
    default = f'"{o.default}"' if isinstance(o.default, str) else repr(o.default)
    return f"{t} {o.name}={default}"


_LINEAR_GRPO_SCHEMA = (
    "(Tensor hidden, Tensor weight, Tensor token_ids, Tensor mask, Tensor advantages, "
    "Tensor? bias=None, Tensor? old_logp=None, Tensor? ref_logp=None, Tensor? is_ratio=None, "
    "Tensor? sampling_logp=None, *, "
    + ", ".join(_schema_option(o) for o in _options.LOSS_OPTIONS.values())
    + ", bool compute_grad_hidden=True, bool compute_grad_weight=True, "
    "bool compute_grad_bias=True, str impl=\"fused\", SymInt? threads=None, "
    "SymInt? memory_budget=None, float filter_eps=0.0) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


# CPU and CUDA tensors run the same kernel. On CUDA the library's CUDA backend
# runs on torch's current stream (fusedgrpo.h, FG_BACKEND_CUDA); the C call
# reads the token arrays back to the host and every token's log-prob once, so
# it synchronizes with the stream: twice before any output (the token arrays;
# the NaN scan), once for every token's statistics after the chunks, once at
# the end (with the finite check off, once a chunk instead of the third: the
# host then checks each chunk's tokens before its products); loss and
# metrics come back as host numbers.
# A float mask is checked on the device (one more read of a flag).
@torch.library.custom_op("fusedgrpo::linear_grpo", mutates_args=(), device_types=("cpu", "cuda"),
                         schema=_LINEAR_GRPO_SCHEMA, **_OP_TAGS)
def linear_grpo(hidden, weight, token_ids, mask, advantages, bias=None, old_logp=None,
                ref_logp=None, is_ratio=None, sampling_logp=None, *, compute_grad_hidden=True,
                compute_grad_weight=True, compute_grad_bias=True, impl="fused", threads=None,
                memory_budget=None, filter_eps=0.0, **options):
    """One C call: (loss [], metrics [len(METRIC_NAMES)] (METRIC_NAMES order), logp [B, T],
    entropy [B, T], grad_hidden [B, T, H], grad_weight [V, H], grad_bias [V]),
    float32, the gradients in bfloat16 for bfloat16 inputs (fusedgrpo.grad_storage_dtypes);
    a gradient not computed (compute_grad_* False, or no bias) is
    an empty [0] tensor. The tensors are positional (torch.library custom ops
    take no keyword-only tensors; of them only hidden, weight and bias get
    gradients), the options keyword-only: LOSS_SPEC.md's loss options, None
    meaning the spec's default, and this call's execution options, threads
    (None: OpenMP's default) and memory_budget (bytes, None: the backend's
    default, 256 MiB on the CPU and 2 GiB on CUDA), and
    filter_eps (gradient filtering; -1.0 is "auto", _lib.filter_eps_value).
    The options' values are checked here, before the C call; their types,
    which the schema has converted by now, are checked by the front ends on
    the caller's values (fused_linear_grpo_loss)."""
    return _run_linear_grpo(hidden, weight, token_ids, mask, advantages, bias, old_logp,
                            ref_logp, is_ratio, sampling_logp, compute_grad_hidden,
                            compute_grad_weight, compute_grad_bias, impl, threads,
                            memory_budget, filter_eps, options, reported=False)


def _run_linear_grpo(hidden, weight, token_ids, mask, advantages, bias, old_logp, ref_logp,
                     is_ratio, sampling_logp, compute_grad_hidden, compute_grad_weight,
                     compute_grad_bias, impl, threads, memory_budget, filter_eps, options, *,
                     reported):
    """The C call of linear_grpo (reported False) or linear_grpo_reported."""
    cfg = _options.loss_config(options)
    ex = _options.make_exec(threads, memory_budget)
    dev = _ti.check_devices(hidden=hidden, weight=weight, token_ids=token_ids, mask=mask,
                            advantages=advantages, bias=bias, old_logp=old_logp,
                            ref_logp=ref_logp, is_ratio=is_ratio, sampling_logp=sampling_logp)
    ctx = _reported_context(dev) if reported else _ti.call_context(dev)
    keep, req = _ti.head_args(hidden, weight, token_ids, mask, bias, reported=reported)
    B, T, H, V = (req[k] for k in "BTHV")
    adv, old, ref, isr, samp, per_seq = _ti.batch_tensors(B, T, advantages, old_logp, ref_logp,
                                                         is_ratio, sampling_logp)
    f32 = torch.float32
    logp = torch.empty((B, T), dtype=f32, device=dev)
    ent = torch.empty((B, T), dtype=f32, device=dev)
    gdt = _ti.grad_dtypes(keep[0].dtype)
    gh = torch.empty((B, T, H) if compute_grad_hidden else (0,), dtype=gdt[0], device=dev)
    gw = torch.empty((V, H) if compute_grad_weight else (0,), dtype=gdt[1], device=dev)
    gb = torch.empty((V,) if (compute_grad_bias and bias is not None) else (0,), dtype=gdt[2],
                     device=dev)
    report = None
    if reported:
        report = torch.empty(_REPORT_BYTES, dtype=torch.uint8, device=dev)
        ex.device_report = report.data_ptr()
    p = _ti.ptr
    loss, metrics = _lib.linear_call(
        cfg, impl, ex, ctx=ctx, **req, advantages=p(adv), old_logp=p(old),
        ref_logp=p(ref),
        is_ratio=p(isr), is_ratio_per_sequence=per_seq, sampling_logp=p(samp), logp=p(logp),
        entropy=p(ent), grad_hidden=p(gh), grad_weight=p(gw), grad_bias=p(gb),
        grad_dtypes=tuple(_ti.dtype_id(d) for d in gdt), filter_eps=filter_eps)
    # A reported call's work may still be queued: its temporaries go back to
    # torch's allocator, which reuses them in the stream's order only.
    del keep
    if not reported:
        return (torch.tensor(loss, dtype=f32, device=dev),
                torch.tensor([metrics[n] for n in METRIC_NAMES], dtype=f32, device=dev), logp,
                ent, gh, gw, gb)
    _note_report(report)
    f64 = report.view(torch.float64)  # the record's doubles, read on the device
    return (f64[_REPORT_LOSS].to(f32),
            f64[_REPORT_METRICS:_REPORT_METRICS + len(METRIC_NAMES)].to(f32), logp, ent, gh,
            gw, gb, report)


@linear_grpo.register_fake
def _linear_grpo_fake(hidden, weight, token_ids, mask, advantages, bias=None, old_logp=None,
                      ref_logp=None, is_ratio=None, sampling_logp=None, *,
                      compute_grad_hidden=True, compute_grad_weight=True,
                      compute_grad_bias=True, impl="fused", threads=None, memory_budget=None,
                      filter_eps=0.0, **options):
    # A traced call refuses the tensors the eager one does (the mask's values
    # aside, which a trace cannot see), and a tensor on 'meta' among CPU ones
    # dispatches here, not to the CPU kernel. The options are not checked
    # here: the front end checks them as the caller gave them (the schema has
    # converted them by now; see _call_options), and the kernel checks their
    # values when it runs.
    _ti.check_devices(hidden=hidden, weight=weight, token_ids=token_ids, mask=mask,
                      advantages=advantages, bias=bias, old_logp=old_logp, ref_logp=ref_logp,
                      is_ratio=is_ratio, sampling_logp=sampling_logp)
    B, T, H, V = _ti.check_shapes(hidden, weight, token_ids, mask, bias)
    _ti.check_batch_shapes(B, T, advantages, old_logp, ref_logp, is_ratio, sampling_logp)
    f32 = torch.float32
    e = hidden.new_empty
    gdt = _ti.grad_dtypes(torch.bfloat16 if hidden.dtype == torch.bfloat16 else f32)
    return (e((), dtype=f32), e((len(METRIC_NAMES),), dtype=f32), e((B, T), dtype=f32),
            e((B, T), dtype=f32),
            e((B, T, H) if compute_grad_hidden else (0,), dtype=gdt[0]),
            e((V, H) if compute_grad_weight else (0,), dtype=gdt[1]),
            e((V,) if (compute_grad_bias and bias is not None) else (0,), dtype=gdt[2]))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    _, _, _, _, gh, gw, gb = output
    hidden, weight, bias = inputs[0], inputs[1], inputs[5]
    ctx.save_for_backward(gh, gw, gb)
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.set_materialize_grads(False)


def _backward(ctx, g_loss, g_metrics, g_logp, g_ent, g_gh, g_gw, g_gb):
    # Only the loss is differentiable: logp, entropy and metrics are reported
    # values, and the op's gradient outputs are gradients (gradients flowing
    # into any of them are not supported and are dropped).
    gh, gw, gb = ctx.saved_tensors
    dh = dw = db = None
    if g_loss is not None:
        # Fresh tensors from every backward (retained graphs, edited .grad),
        # the saved ones handed over as they are where nothing reads them
        # again; differentiating them (create_graph=True) raises.
        dh, dw, db = _ti.loss_gradients(g_loss, (gh, gw, gb), ctx.dtypes)
    # One gradient per positional input: hidden, weight, token_ids, mask,
    # advantages, bias, old_logp, ref_logp, is_ratio, sampling_logp (keyword-only
    # ones take none).
    return dh, dw, None, None, None, db, None, None, None, None


linear_grpo.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------ device-reported calls
#
# fusedgrpo.h "Device-reported calls": with fg_exec.device_report the C call
# makes no host synchronisation, so the op can be captured in a CUDA graph
# (torch.cuda.graph, torch.compile(mode="reduce-overhead")): the checks of
# values run on the device into a record (a uint8 tensor the op returns),
# the loss and metrics are read from that record on the device, and
# raise_device_errors() raises the first failure after the stream has run.

_REPORT_BYTES = ctypes.sizeof(_lib.fg_device_report)
_REPORT_LOSS = _lib.fg_device_report.loss.offset // 8
_REPORT_METRICS = _lib.fg_device_report.metrics.offset // 8
_PENDING_MAX = 256
# Records to check: the eager calls' since the last raise_device_errors, and
# every record made inside a CUDA graph capture (each replay writes it again;
# holding it keeps the graph's memory for it from being reused).
_reports = {"eager": [], "graphs": [], "reference_on_cpu": False}

_LINEAR_GRPO_REPORTED_SCHEMA = _LINEAR_GRPO_SCHEMA.replace(
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _reported_context(dev: torch.device):
    """The C context of a device-reported call: CUDA's on the current stream
    (capturable), or for tests on CPU tensors the reference backend
    (_device_path_on_cpu)."""
    if dev.type == "cuda":
        return _ti.call_context(dev, reported=True)
    if _reports["reference_on_cpu"]:
        return _lib.device_context("reference")
    raise FusedGRPOError("FG_ERR_UNSUPPORTED", "device_report: CUDA tensors only (a CPU call "
                         "checks on the host and never waits for a device)")


def _note_report(report: Tensor):
    """Keeps a record for raise_device_errors. Past _PENDING_MAX unchecked
    eager records the oldest is checked now (a synchronisation) rather than
    dropped unread."""
    if report.is_cuda and torch.cuda.is_current_stream_capturing():
        _reports["graphs"].append(report)
        return
    pending = _reports["eager"]
    pending.append(report)
    if len(pending) > _PENDING_MAX:
        _check_reports([pending.pop(0)])


def _check_reports(reports):
    for r in reports:
        status, message = _lib.device_report_status(r.cpu().numpy().tobytes())
        if status != "FG_OK":
            raise FusedGRPOError(status, message)


def raise_device_errors():
    """Raises FusedGRPOError for the first failure that a device-reported
    call (device_report=True) recorded: of the eager calls since the last
    call to this, and of every call captured in a CUDA graph (after each
    replay). Reads each record on the host: a synchronisation with the
    streams that wrote them, so call it once a step, after the step."""
    pending, _reports["eager"] = _reports["eager"], []
    _check_reports(pending + _reports["graphs"])


def forget_graph_reports():
    """Stops checking the records of the CUDA graphs captured so far (when
    those graphs are destroyed)."""
    _reports["graphs"] = []


def _device_path_on_cpu(on: bool = True):
    """For tests on machines without a GPU: device-reported calls on CPU
    tensors run over the C library's reference backend (host memory, slow),
    its device path and report ops. on=False: refused again."""
    _reports["reference_on_cpu"] = bool(on)


@torch.library.custom_op("fusedgrpo::linear_grpo_reported", mutates_args=(),
                         device_types=("cpu", "cuda"), schema=_LINEAR_GRPO_REPORTED_SCHEMA)
def linear_grpo_reported(hidden, weight, token_ids, mask, advantages, bias=None, old_logp=None,
                         ref_logp=None, is_ratio=None, sampling_logp=None, *,
                         compute_grad_hidden=True, compute_grad_weight=True,
                         compute_grad_bias=True, impl="fused", threads=None,
                         memory_budget=None, filter_eps=0.0, **options):
    """linear_grpo as a device-reported call: the same outputs, the loss and
    metrics read from the record on the device, and the record itself
    ([sizeof(fg_device_report)] uint8) last. Capturable in a CUDA graph:
    no cudagraph_unsafe tag. Its failures surface at raise_device_errors()."""
    return _run_linear_grpo(hidden, weight, token_ids, mask, advantages, bias, old_logp,
                            ref_logp, is_ratio, sampling_logp, compute_grad_hidden,
                            compute_grad_weight, compute_grad_bias, impl, threads,
                            memory_budget, filter_eps, options, reported=True)


@linear_grpo_reported.register_fake
def _(hidden, weight, token_ids, mask, advantages, bias=None, old_logp=None, ref_logp=None,
      is_ratio=None, sampling_logp=None, **kwargs):
    out = _linear_grpo_fake(hidden, weight, token_ids, mask, advantages, bias, old_logp,
                            ref_logp, is_ratio, sampling_logp, **kwargs)
    return (*out, hidden.new_empty((_REPORT_BYTES,), dtype=torch.uint8))


def _setup_reported(ctx, inputs, keyword_only_inputs, output):
    _setup_context(ctx, inputs, keyword_only_inputs, output[:7])


def _backward_reported(ctx, g_loss, g_metrics, g_logp, g_ent, g_gh, g_gw, g_gb, g_report):
    return _backward(ctx, g_loss, g_metrics, g_logp, g_ent, g_gh, g_gw, g_gb)


linear_grpo_reported.register_autograd(_backward_reported, setup_context=_setup_reported)


# ------------------------------------------------ options, checked as the caller gave them
#
# The op's schema types its options (float, SymInt, bool, str), so the op sees
# them converted: True as 1.0, 2 as True. The front end checks the caller's
# own values before the op, eagerly and under torch.compile alike.
#
# Eagerly, every check raises before the op is called. torch.compile (dynamo)
# runs the same checks while it traces the front end, on the values it traces
# with: constants (literals, module attributes, a compiled function's
# arguments, on which it guards, so that other values retrace and are checked
# again) or, for a compiled function's int or float argument that changed
# between calls, a symbolic number. An exception raised while tracing with
# fullgraph=True surfaces as dynamo's own error, so a refused traced call
# puts _refused in the graph instead, which raises the eager call's error
# (the same FusedGRPOError or TypeError) when the graph runs, before the
# fused op. The one check that needs the value itself, the range of a float
# option given a number (math.isfinite, which dynamo cannot evaluate on a
# symbolic number), runs in the op, on the value, when the graph runs: the
# same check, the same status (an int argument reads as a float there).


def _is_number(value) -> bool:
    """A real number that is not a bool (dynamo: constant or symbolic)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _check_call_options(options, impl, threads, memory_budget, filter_eps, *, traced):
    """Every option of a call checked as the caller gave it, in one order
    (eager's and the trace's): the loss options (an unknown name raises
    TypeError), threads, memory_budget, filter_eps, impl. Returns filter_eps
    as the op takes it (FILTER_EPS_AUTO: -1.0). traced: a float option given a
    number is left to the op (see above)."""
    _options.loss_options_of(options)
    for o in _options.LOSS_OPTIONS.values():
        if o.name in options and not (traced and o.type is float
                                      and _is_number(options[o.name])):
            o.check(o.name, options[o.name])
    _options.check_threads(threads)
    _options.check_memory_budget(memory_budget)
    fe = _lib.filter_eps_value(filter_eps)
    _lib.check_impl(impl)
    return -1.0 if fe is _lib.FILTER_EPS_AUTO else fe


@torch.library.custom_op("fusedgrpo::refused", mutates_args=(), **_OP_TAGS)
def _refused(token_ids: Tensor, kind: str, status: str, message: str) -> Tensor:
    """A traced call whose options were refused while tracing: raises what the
    eager call raises (kind "TypeError": TypeError(message), else
    FusedGRPOError(status, message)) when the graph runs. Its output feeds the
    fused op, which therefore never runs."""
    if kind == "TypeError":
        raise TypeError(message)
    raise FusedGRPOError(status, message)


@_refused.register_fake
def _(token_ids, kind, status, message):
    return torch.empty_like(token_ids)


def _call_options(token_ids, options, impl, threads, memory_budget, filter_eps):
    """(token_ids, options, impl, threads, memory_budget, filter_eps) for the op:
    the options checked (see above; eagerly a refusal raises here), the bool
    option as a bool, filter_eps as a float. A call refused under torch.compile
    gets token_ids through _refused and the default options."""
    if not torch.compiler.is_compiling():
        fe = _check_call_options(options, impl, threads, memory_budget, filter_eps,
                                 traced=False)
    else:
        refusal = None
        try:
            fe = _check_call_options(options, impl, threads, memory_budget, filter_eps,
                                     traced=True)
        except FusedGRPOError as e:
            refusal = ("FusedGRPOError", e.status, e.message)
        except TypeError as e:
            refusal = ("TypeError", "", str(e))
        if refusal is not None:
            return _refused(token_ids, *refusal), {}, "fused", None, None, 0.0
    options = {k: (True if v else False) if _options.LOSS_OPTIONS[k].type is bool else v
               for k, v in options.items()}
    return token_ids, options, impl, threads, memory_budget, fe


@_options.with_loss_options
def fused_linear_grpo_loss(hidden, weight, token_ids, mask, advantages, bias=None,
                           old_logp=None, ref_logp=None, is_ratio=None, sampling_logp=None, *,
                           impl="fused", threads=None, memory_budget=None, filter_eps=0.0,
                           device_report=False, **options):
    """Functional form: (loss, metrics dict of 0-dim tensors, logp, entropy); the
    loss is differentiable w.r.t. hidden, weight and bias. Only the gradients of
    the tensors that require one (with grad mode on) are computed. The loss
    options (keyword-only) are fusedgrpo.OPTION_NAMES; num_items_in_batch may be
    a 0-dim tensor. filter_eps: gradient filtering, 0 (off), "auto" or a
    threshold (fused_linear_grpo). Every option is checked as given (a bool is
    not a number), under torch.compile too, where a refused call raises the
    same error when the compiled function runs.

    The backward hands autograd fresh gradient tensors each time (a retained
    graph can be backwarded again; .grad may be edited in place): a scaled
    copy, or for an incoming gradient of exactly 1 the saved gradients
    themselves when the backward frees the graph, copies when it keeps it
    (retain_graph=True). The gradients are first order only: differentiating
    them (a double backward, create_graph=True) raises RuntimeError.

    device_report=True (CUDA tensors): a device-reported call
    (linear_grpo_reported): no host synchronisation, so the call can be
    captured in a CUDA graph (torch.cuda.graph, torch.compile(
    mode="reduce-overhead")); its checks run on the device and
    raise_device_errors() raises the first failure after the step. Of a
    refused call every output is unspecified. fusedgrpo.h "Device-reported
    calls" lists what it runs (every loss) and how it differs (the a-priori
    overflow bounds become checks of the gradients after the fact; a mask's
    values are not checked for 0/1: nonzero is a token)."""
    if not isinstance(device_report, bool):
        raise TypeError(f"device_report must be a bool, got {device_report!r}")
    if isinstance(options.get("num_items_in_batch"), Tensor):
        options["num_items_in_batch"] = float(options["num_items_in_batch"])
    token_ids, options, impl, threads, memory_budget, filter_eps = _call_options(
        token_ids, options, impl, threads, memory_budget, filter_eps)
    grad_on = torch.is_grad_enabled()
    op = linear_grpo_reported if device_report else linear_grpo
    loss, metrics, logp, ent, *_ = op(
        hidden, weight, token_ids, mask, advantages, bias, old_logp, ref_logp, is_ratio,
        sampling_logp, compute_grad_hidden=grad_on and hidden.requires_grad,
        compute_grad_weight=grad_on and weight.requires_grad,
        compute_grad_bias=grad_on and bias is not None and bias.requires_grad, impl=impl,
        threads=threads, memory_budget=memory_budget, filter_eps=filter_eps, **options)
    return loss, {n: metrics[i] for i, n in enumerate(METRIC_NAMES)}, logp, ent


# ------------------------------------------------------- log-probs of the head

@torch.library.custom_op("fusedgrpo::linear_logprobs", mutates_args=(),
                         device_types=("cpu", "cuda"), **_OP_TAGS)
def _logprobs_op(hidden: Tensor, weight: Tensor, token_ids: Tensor, mask: Tensor,
                 bias: Optional[Tensor] = None, *, temperature: float = 1.0, impl: str = "fused",
                 threads: Optional[int] = None,
                 memory_budget: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """fg_linear_logprobs: (logp [B, T], entropy [B, T]) float32, 0 where masked."""
    temperature = _options.LOSS_OPTIONS["temperature"].check("temperature", temperature)
    ex = _options.make_exec(threads, memory_budget)
    keep, req = _ti.head_args(hidden, weight, token_ids, mask, bias)
    p = _ti.ptr
    B, T = req["B"], req["T"]
    dev = hidden.device
    logp = torch.empty((B, T), dtype=torch.float32, device=dev)
    ent = torch.empty((B, T), dtype=torch.float32, device=dev)
    _lib.logprobs_call(impl, ex, temperature, **req, logp=p(logp), entropy=p(ent),
                       ctx=_ti.call_context(dev))
    del keep
    return logp, ent


@_logprobs_op.register_fake
def _(hidden, weight, token_ids, mask, bias=None, **options):
    _ti.check_devices(hidden=hidden, weight=weight, token_ids=token_ids, mask=mask, bias=bias)
    B, T, _, _ = _ti.check_shapes(hidden, weight, token_ids, mask, bias)
    return (hidden.new_empty((B, T), dtype=torch.float32),
            hidden.new_empty((B, T), dtype=torch.float32))


@torch.library.custom_op("fusedgrpo::linear_logprobs_backward", mutates_args=(),
                         device_types=("cpu", "cuda"), **_OP_TAGS)
def _logprobs_backward_op(hidden: Tensor, weight: Tensor, token_ids: Tensor, mask: Tensor,
                          grad_logp: Tensor, grad_entropy: Optional[Tensor] = None,
                          bias: Optional[Tensor] = None, *, temperature: float = 1.0,
                          compute_grad_hidden: bool = True, compute_grad_weight: bool = True,
                          compute_grad_bias: bool = True, impl: str = "fused",
                          threads: Optional[int] = None,
                          memory_budget: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """fg_linear_logprobs_backward: (grad_hidden [B, T, H], grad_weight [V, H],
    grad_bias [V]) of a loss with these dL/dlogp and dL/dentropy; the inputs'
    dtype for bf16 inputs (fusedgrpo.grad_storage_dtypes); an unwanted one is an empty [0]."""
    temperature = _options.LOSS_OPTIONS["temperature"].check("temperature", temperature)
    ex = _options.make_exec(threads, memory_budget)
    keep, req = _ti.head_args(hidden, weight, token_ids, mask, bias)
    p = _ti.ptr
    B, T, H, V = (req[k] for k in "BTHV")
    _ti.check_devices(hidden=hidden, grad_logp=grad_logp, grad_entropy=grad_entropy)
    dev = hidden.device
    for name, t in (("grad_logp", grad_logp), ("grad_entropy", grad_entropy)):
        if t is not None and tuple(t.shape) != (B, T):
            raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", f"{name} has shape {tuple(t.shape)}, "
                                 f"expected {(B, T)}")
    gdt = _ti.grad_dtypes(keep[0].dtype)
    gh = torch.empty((B, T, H) if compute_grad_hidden else (0,), dtype=gdt[0], device=dev)
    gw = torch.empty((V, H) if compute_grad_weight else (0,), dtype=gdt[1], device=dev)
    gb = torch.empty((V,) if (compute_grad_bias and bias is not None) else (0,), dtype=gdt[2],
                     device=dev)
    g = grad_logp.detach().to(torch.float32).contiguous()
    ge = None if grad_entropy is None else grad_entropy.detach().to(torch.float32).contiguous()
    _lib.logprobs_backward_call(impl, ex, temperature, **req, grad_logp=p(g),
                                grad_entropy=p(ge), grad_hidden=p(gh), grad_weight=p(gw),
                                grad_bias=p(gb), grad_dtypes=tuple(_ti.dtype_id(d) for d in gdt),
                                ctx=_ti.call_context(dev))
    del keep
    return gh, gw, gb


@_logprobs_backward_op.register_fake
def _(hidden, weight, token_ids, mask, grad_logp, grad_entropy=None, bias=None, *,
      compute_grad_hidden=True, compute_grad_weight=True, compute_grad_bias=True, **options):
    _ti.check_devices(hidden=hidden, weight=weight, token_ids=token_ids, mask=mask,
                      grad_logp=grad_logp, grad_entropy=grad_entropy, bias=bias)
    B, T, H, V = _ti.check_shapes(hidden, weight, token_ids, mask, bias)
    gdt = _ti.grad_dtypes(torch.bfloat16 if hidden.dtype == torch.bfloat16 else torch.float32)
    e = hidden.new_empty
    return (e((B, T, H) if compute_grad_hidden else (0,), dtype=gdt[0]),
            e((V, H) if compute_grad_weight else (0,), dtype=gdt[1]),
            e((V,) if (compute_grad_bias and bias is not None) else (0,), dtype=gdt[2]))


def _logprobs_setup(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, token_ids, mask, bias = inputs
    ctx.save_for_backward(hidden, weight, token_ids, mask, bias)
    ctx.options = dict(keyword_only_inputs)
    ctx.needs = (hidden.requires_grad, weight.requires_grad,
                 bias is not None and bias.requires_grad)
    ctx.set_materialize_grads(False)


def _logprobs_backward(ctx, g_logp, g_ent):
    hidden, weight, token_ids, mask, bias = ctx.saved_tensors
    if g_logp is None and g_ent is None:
        return None, None, None, None, None

    def compute():
        g = g_logp
        if g is None:
            g = torch.zeros(hidden.shape[:2], dtype=torch.float32, device=hidden.device)
        gh, gw, gb = _logprobs_backward_op(
            hidden, weight, token_ids, mask, g, g_ent, bias,
            temperature=ctx.options.get("temperature", 1.0),
            compute_grad_hidden=ctx.needs[0], compute_grad_weight=ctx.needs[1],
            compute_grad_bias=ctx.needs[2], impl=ctx.options.get("impl", "fused"),
            threads=ctx.options.get("threads"), memory_budget=ctx.options.get("memory_budget"))
        return (gh.to(hidden.dtype) if ctx.needs[0] else None,
                gw.to(weight.dtype) if ctx.needs[1] else None,
                gb.to(bias.dtype) if ctx.needs[2] else None)

    # The C backward's gradients are first order only: differentiating them
    # (create_graph=True) raises.
    dh, dw, db = _ti.first_order_only(compute, g_logp, g_ent, hidden, weight, bias)
    return dh, dw, None, None, db


_logprobs_op.register_autograd(_logprobs_backward, setup_context=_logprobs_setup)


def linear_logprobs(hidden, weight, token_ids, mask=None, bias=None, *, temperature=1.0,
                    return_entropy=False, impl="fused", threads=None, memory_budget=None):
    """Log-probs of token_ids (and entropies, return_entropy=True) under the LM
    head softmax((hidden . weight^T + bias) / temperature), fused: the
    [B, T, V] logits never exist. Differentiable w.r.t. hidden, weight and bias
    through fg_linear_logprobs_backward (the logits recomputed, 4 GEMM-sized
    products with the forward), for any loss built on logp and entropy, like
    TRL's chunked LM-head kernel; under no_grad, one forward-only C call.
    The gradients are first order only: a double backward raises RuntimeError.
    hidden [B, T, H], weight [V, H], token_ids / mask [B, T] (mask None: all).
    Returns logp [B, T] float32 (0 where masked), or (logp, entropy)."""
    if mask is None:
        mask = torch.ones(token_ids.shape, dtype=torch.bool, device=token_ids.device)
    # temperature, impl, threads and memory_budget checked as given (see
    # _call_options; under torch.compile too)
    token_ids, options, impl, threads, memory_budget, _ = _call_options(
        token_ids, {"temperature": temperature}, impl, threads, memory_budget, 0.0)
    logp, ent = _logprobs_op(hidden, weight, token_ids, mask, bias,
                             temperature=options.get("temperature", 1.0), impl=impl,
                             threads=threads, memory_budget=memory_budget)
    return (logp, ent) if return_entropy else logp


# Liger's default for the constructor argument fusedgrpo cannot honour
# otherwise (liger_kernel 0.8: LigerFusedLinearGRPOLoss.__init__).
_LIGER_CHUNK_SIZE = 1


def _refuse_unsupported(*, compiled, chunk_size):
    """Refuses the Liger arguments fusedgrpo has no counterpart for, unless their
    value changes nothing (every other argument is honoured by the module)."""
    if not isinstance(compiled, bool):
        raise TypeError(f"compiled must be True or False, got {compiled!r}")
    if chunk_size != _LIGER_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size={chunk_size!r}: fusedgrpo does not chunk by sequences; the C library "
            "plans its chunks (token rows) from a memory budget in bytes. Pass memory_budget= "
            "instead (default 256 MiB on the CPU, 2 GiB on CUDA; fusedgrpo.fused_linear_grpo_plan reports the chunks a "
            "budget gives)")


class FusedLinearGRPOLoss(torch.nn.Module):
    """Fused LM head + GRPO loss, a drop-in for Liger's LigerFusedLinearGRPOLoss.

    forward(_input [B, T, H], lin_weight [V, H], selected_token_ids [B, T],
    attention_mask [B, T], advantages [B], bias=None, ref_per_token_logps=None,
    old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
    vllm_is_ratio=None, num_items_in_batch=None) -> (loss, metrics).

    Liger's constructor arguments with no counterpart here are refused unless
    they change nothing (see _refuse_unsupported): ``chunk_size`` only at its
    default (fusedgrpo chunks by bytes of ``memory_budget``, not by sequences).
    ``compiled`` takes either value: it says whether Liger torch.compiles its
    per-chunk loss, and the C kernel computes the same thing either way. Extra
    keyword-only arguments: entropy_coef, impl ("fused" / "materialized"),
    memory_budget (bytes), threads, filter_eps (gradient filtering: 0 off, "auto",
    or a threshold; fusedgrpo.fused_linear_grpo), return_metrics_dict,
    device_report (fused_linear_grpo_loss's: the loss call capturable in a
    CUDA graph, its failures raised by raise_device_errors()).

    ``metrics`` is Liger's tuple: ``(kl, clip_ratio)``, ``(clip_ratio,)`` when
    beta == 0, where clip_ratio is, per loss type as Liger reports it, the
    region clip fraction (grpo, bnpo, dr_grpo, dapo, luspo), ``ratio >
    epsilon_high and A > 0`` (cispo), and 0 (sapo, vespo: no clipping). Where
    Liger departs from TRL 1.16 these follow TRL (python/README.md).
    """

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True,
                 chunk_size: int = 1, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                 loss_type: str = "dapo", max_completion_length: Optional[int] = None,
                 importance_sampling_level: str = "token", sapo_temperature_pos: float = 1.0,
                 sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: Optional[float] = None, use_bias_correction_kl: bool = False,
                 vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
                 vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0, *,
                 entropy_coef: float = 0.0, impl: str = "fused",
                 memory_budget: Optional[int] = None, threads: Optional[int] = None,
                 filter_eps=0.0, return_metrics_dict: bool = False,
                 device_report: bool = False):
        super().__init__()
        if not isinstance(device_report, bool):
            raise TypeError(f"device_report must be a bool, got {device_report!r}")
        _refuse_unsupported(compiled=compiled, chunk_size=chunk_size)
        # every option's range now, as a call would check it
        _options.loss_config(dict(
            beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, loss_type=loss_type,
            max_completion_length=max_completion_length,
            importance_sampling_level=importance_sampling_level,
            sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
            temperature=temperature, delta=delta, use_bias_correction_kl=use_bias_correction_kl,
            vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
            vespo_lambda_neg=vespo_lambda_neg, entropy_coef=entropy_coef))
        _options.make_exec(threads, memory_budget)
        _lib.filter_eps_value(filter_eps)
        _lib.check_impl(impl)
        self.beta = beta
        self.use_ref_model = use_ref_model
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.temperature = temperature
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.vespo_k_pos = vespo_k_pos
        self.vespo_lambda_pos = vespo_lambda_pos
        self.vespo_k_neg = vespo_k_neg
        self.vespo_lambda_neg = vespo_lambda_neg
        self.entropy_coef = entropy_coef
        self.impl = impl
        self.memory_budget = memory_budget
        self.threads = threads
        self.filter_eps = filter_eps  # as given: each call checks every option as given
        self.return_metrics_dict = return_metrics_dict
        self.device_report = device_report

    def _loss_fn(self, *args, **kwargs):
        """The functional loss this module calls (fusedgrpo.torch_distributed's
        module puts its vocab-parallel one here)."""
        return fused_linear_grpo_loss(*args, **kwargs)

    def _ref_logps(self, ref_input, ref_weight, ref_bias, selected_token_ids, attention_mask,
                   advantages):
        with torch.no_grad():
            _, _, logp, _ = self._loss_fn(
                ref_input.detach(), ref_weight.detach(), selected_token_ids, attention_mask,
                advantages, None if ref_bias is None else ref_bias.detach(),
                temperature=self.temperature, impl=self.impl, threads=self.threads,
                memory_budget=self.memory_budget)
        return logp

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages,
                bias=None, ref_per_token_logps=None, old_per_token_logps=None, ref_input=None,
                ref_weight=None, ref_bias=None, vllm_is_ratio=None, num_items_in_batch=None):
        beta = self.beta
        # beta as given (a bool, None or string is refused by the loss call,
        # as every option); a number 0 turns the KL off
        kl_off = _is_number(beta) and beta == 0
        ref = ref_per_token_logps
        if ref is not None and ref_input is not None:
            warnings.warn("Using ref_per_token_logps; ref_input, ref_weight and ref_bias are "
                          "ignored since the reference log-probs are given", UserWarning,
                          stacklevel=2)
        if not kl_off:
            if ref is None and self.use_ref_model:
                if ref_input is None:
                    raise ValueError("If use_ref_model is True, ref_per_token_logps or ref_input "
                                     "must be provided")
                ref = self._ref_logps(ref_input, ref_weight if ref_weight is not None
                                      else lin_weight, ref_bias, selected_token_ids,
                                      attention_mask, advantages)
            if ref is None and _is_number(beta):
                # Liger/TRL: ref = stop_gradient(logp): KL == 0 with zero gradient.
                beta_eff = 0.0
            else:
                beta_eff = beta
        else:
            beta_eff = 0.0
            ref = None
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            max_len = None  # the spec's default (T); Liger asserts instead
        else:
            max_len = self.max_completion_length
        loss, metrics, _, _ = self._loss_fn(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias,
            old_per_token_logps, ref, vllm_is_ratio, beta=beta_eff,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, delta=self.delta,
            temperature=self.temperature, loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            max_completion_length=max_len, num_items_in_batch=num_items_in_batch,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
            use_bias_correction_kl=self.use_bias_correction_kl,
            vespo_k_pos=self.vespo_k_pos, vespo_lambda_pos=self.vespo_lambda_pos,
            vespo_k_neg=self.vespo_k_neg, vespo_lambda_neg=self.vespo_lambda_neg,
            entropy_coef=self.entropy_coef, impl=self.impl, threads=self.threads,
            memory_budget=self.memory_budget, filter_eps=self.filter_eps,
            **({"device_report": True} if self.device_report else {}))
        if self.return_metrics_dict:
            return loss, metrics
        out = []
        if not kl_off:
            out.append(metrics["kl"])
        # Liger's one clip metric per loss type (0 for sapo and vespo, which
        # do not clip; the C library reports 0 for the others there)
        out.append(metrics["cispo_clip_ratio"] if self.loss_type == "cispo"
                   else metrics["clip_ratio_region"])
        return loss, tuple(out)
