"""What fusedgrpo.torch and fusedgrpo.torch_distributed share: their tensors
checked (fusedgrpo._inputs: shapes, dtypes, mask values; here: devices) and
turned into the operands and raw addresses of the C calls, the gradients'
dtypes, and the gradients their backwards hand to autograd (fresh tensors,
first order only)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _inputs, _lib, grad_storage_dtypes
from ._lib import FusedGRPOError

_DT = {torch.float32: _lib.DTYPE_F32, torch.bfloat16: _lib.DTYPE_BF16}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_id(dtype: torch.dtype) -> int:
    return _DT[dtype]


def kind(t: Optional[Tensor]) -> Optional[str]:
    """The NumPy dtype kind of a tensor's dtype (fusedgrpo._inputs reads kinds)."""
    if t is None:
        return None
    dt = t.dtype
    if dt == torch.bool:
        return "b"
    if dt.is_floating_point:
        return "f"
    if dt.is_complex:
        return "c"
    return "i"


def check_devices(**tensors) -> torch.device:
    """Every tensor on one device, the CPU or one CUDA device (the C library's
    CUDA backend), which it returns: a tensor elsewhere (or on 'meta', which
    has no data) would hand the library a pointer to something else."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type not in ("cpu", "cuda"):
            raise FusedGRPOError("FG_ERR_UNSUPPORTED", f"{name} is on device '{t.device}'; "
                                 "fusedgrpo.torch computes on 'cpu' or a CUDA device")
        if device is None:
            device = t.device
        elif t.device != device:
            raise FusedGRPOError("FG_ERR_UNSUPPORTED", f"{name} is on device '{t.device}', "
                                 f"the other tensors on '{device}': every tensor must be on "
                                 "one device")
    return device if device is not None else torch.device("cpu")


def call_context(device: torch.device, reported: bool = False):
    """The C context for tensors on `device`: None (the thread's CPU context),
    or the thread's CUDA context on the device's current stream, so that the
    call is ordered with torch's work there and uses no stream of its own.
    reported: a device-reported call (no host wait: it may be captured)."""
    if device.type != "cuda":
        return None
    if torch.cuda.is_current_stream_capturing() and not reported:
        # The C call waits for the stream on the host (the token arrays, the
        # NaN scan, each chunk's log-probs): a capture could only fail later,
        # with a less clear error.
        raise FusedGRPOError("FG_ERR_UNSUPPORTED", "fusedgrpo's op cannot be captured in a CUDA "
                             "graph: its C call reads the token arrays, the NaN scan and each "
                             "chunk's log-probs on the host; call it outside the capture, or "
                             "with device_report=True")
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        return _lib.device_context("cuda", stream)


def check_mask_device(m: Tensor):
    """check_mask_values for a mask on a CUDA device: one reduction there and
    one read of its flag (a synchronization), never a copy of the mask."""
    if m.dtype == torch.bool or m.numel() == 0:
        return
    bad = (m != 0) & (m != 1)
    if bool(bad.any()):
        _inputs.check_mask_values(m[bad].reshape(-1)[:1].float().cpu().numpy())


def rows(t: Tensor, lead: int):
    """(tensor, ld): t as a [rows, cols] matrix with unit column stride, rows the
    first `lead` axes; copies only when one row stride cannot describe it."""
    cols = t.shape[-1]
    st = t.stride()
    ok = st[-1] == 1 or cols == 1
    ld, inner = None, None
    for i in reversed(range(lead)):
        if not ok or t.shape[i] == 1:
            continue
        if st[i] <= 0:
            ok = False
        elif inner is None:
            ld, inner = st[i], (st[i], t.shape[i])
        elif st[i] != inner[0] * inner[1]:
            ok = False
        else:
            inner = (st[i], t.shape[i])
    if ld is None:
        ld = cols
    if ok and ld >= cols:
        return t, int(ld)
    t = t.contiguous()
    return t, int(cols)


def compute_dtype(t: Tensor, name: str) -> Tensor:
    """t in the dtype the C call computes in: float32 and bfloat16 as they are,
    float16 widened to float32; float64 refused (the op computes in float32 or
    bfloat16, so float64 inputs would lose their precision silently and
    torch.autograd.gradcheck would fail at its default tolerances)."""
    if t.dtype in _DT:
        return t
    if t.dtype == torch.float16:
        return t.to(torch.float32)
    raise FusedGRPOError("FG_ERR_UNSUPPORTED", f"{name} has dtype {t.dtype}; fusedgrpo computes "
                         "in float32 and bfloat16 only: pass float32 (or bfloat16) tensors")


def tracing() -> bool:
    """Whether this runs under a trace (torch.compile's dynamo, or a make_fx /
    AOTAutograd trace of fake, functional or proxy tensors) rather than eagerly."""
    if torch.compiler.is_compiling():
        return True
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode
    except ImportError:  # older torch: no proxy-mode query, take the safe path
        return True
    return get_proxy_mode() is not None


def is_eager_tensor(t: Tensor) -> bool:
    """A plain tensor with data, outside any tracing (fake, functional or proxy)."""
    if type(t) is not Tensor or t.requires_grad or t.numel() != 1:
        return False
    return not tracing()


def graph_kept() -> bool:
    """Whether the backward now running keeps its graph (retain_graph=True,
    create_graph=True), so that the saved tensors can be read by a later
    backward. True where torch cannot say."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if keep_graph is None:
        return True
    try:
        return bool(keep_graph())
    except RuntimeError:  # not inside a backward
        return True


# A double backward through a fused op: differentiating the gradients its
# backward returned.
DOUBLE_BACKWARD = ("fusedgrpo: a double backward through a fused op is not supported: its "
                   "gradients are computed by the C library (the loss's in the forward, "
                   "linear_logprobs' by fg_linear_logprobs_backward) and are not differentiable "
                   "themselves (create_graph=True gives them no second-order term)")


class _FirstOrderOnly(torch.autograd.Function):
    """compute()'s tensors (a backward's gradients), recorded as a node whose
    backward raises: differentiating them is a double backward through the op."""

    @staticmethod
    def forward(ctx, compute, *anchors):
        return compute()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD)


def first_order_only(compute, *anchors):
    """compute() (a tuple of gradients, None or fresh tensors) as a backward
    hands them to autograd. Under create_graph=True (grad mode on in the
    backward) they hang on a node that raises when differentiated, itself
    attached to `anchors` (the op's saved inputs or outputs and the incoming
    gradients): any path of a second derivative that runs through the op
    raises, whatever else is in the graph, instead of silently missing the
    op's second-order term."""
    if (torch.is_grad_enabled() and not tracing()
            and any(isinstance(a, Tensor) and a.requires_grad for a in anchors)):
        return _FirstOrderOnly.apply(compute, *anchors)
    return compute()


def loss_gradients(g_loss: Tensor, saved, dtypes, anchors=()) -> tuple:
    """The gradients a forward computed and saved (a [0] tensor: not computed,
    None), scaled by backward's incoming gradient g_loss and cast to `dtypes`.
    Each backward hands autograd tensors of its own, which the caller may
    edit, zero and reuse (w.grad.mul_(0.5), grad.zero_()) without touching
    the saved ones: with a retained graph every backward returns the same
    values. When g_loss is exactly 1 (loss.backward()) in eager mode, a
    backward that frees the graph hands over the saved tensors themselves
    (nothing reads them again; grad_weight alone is V x H) and one that
    keeps it (retain_graph=True) hands over copies. Traced (torch.compile),
    it always scales into new tensors and never reads g_loss. Differentiating
    the result (create_graph=True) raises: see first_order_only, whose anchors
    are g_loss, saved and ``anchors`` (the op's inputs, where the saved
    gradients are not outputs of the op's node and so carry no graph)."""
    if tracing():
        return tuple(None if s.numel() == 0 else (s * g_loss).to(dt)
                     for s, dt in zip(saved, dtypes))
    unit = is_eager_tensor(g_loss) and float(g_loss) == 1.0

    def compute(copy):
        out = []
        for s, dt in zip(saved, dtypes):
            if s.numel() == 0:
                out.append(None)
            elif not unit:
                out.append((s * g_loss).to(dt))
            else:
                g = s.to(dt)
                out.append(g.clone() if copy and g is s else g)
        return tuple(out)

    if torch.is_grad_enabled():  # create_graph=True
        return first_order_only(lambda: compute(copy=True), g_loss, *saved, *anchors)
    return compute(copy=graph_kept())


def grad_dtypes(compute: torch.dtype) -> tuple:
    """The dtypes the C call writes grad_hidden, grad_weight, grad_bias in
    (fusedgrpo.grad_storage_dtypes)."""
    return tuple(_TORCH_DTYPES[n] for n in grad_storage_dtypes(compute == torch.bfloat16))


def ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def check_shapes(hidden, weight, token_ids, mask, bias):
    """(B, T, H, V) of the LM head's tensors, their shapes and dtypes checked
    (fusedgrpo._inputs); fake tensors too, at trace time."""
    B, T, H, V = _inputs.check_head(hidden.shape, weight.shape,
                                    None if bias is None else bias.shape,
                                    kind(hidden), kind(weight), kind(bias))
    _inputs.check_tokens(token_ids.shape, kind(token_ids), mask.shape, kind(mask), B, T)
    return B, T, H, V


def check_batch_shapes(B, T, advantages, old_logp, ref_logp, is_ratio, sampling_logp) -> bool:
    """The loss's per-sequence and per-token tensors' shapes and dtypes checked;
    whether is_ratio is per sequence."""
    arrays = dict(old_logp=old_logp, ref_logp=ref_logp, is_ratio=is_ratio,
                  sampling_logp=sampling_logp)
    return _inputs.check_batch(
        B, T, advantages.shape, **{k: None if t is None else t.shape for k, t in arrays.items()},
        kinds={k: kind(t) for k, t in (("advantages", advantages), *arrays.items())
               if t is not None})


def head_args(hidden, weight, token_ids, mask, bias, reported: bool = False):
    """The LM-head operands as the C calls take them, checked first (devices,
    shapes, dtypes, mask values; kept alive by the caller), and the keyword
    arguments of _lib's calls pointing at them. reported: a device-reported
    call, which reads no value on the host: a mask's 0/1 check is skipped
    (nonzero counts as a token, as the C API's mask)."""
    device = check_devices(hidden=hidden, weight=weight, token_ids=token_ids, mask=mask, bias=bias)
    B, T, H, V = check_shapes(hidden, weight, token_ids, mask, bias)
    h = compute_dtype(hidden.detach(), "hidden")
    w = compute_dtype(weight.detach(), "weight")
    if w.dtype != h.dtype:
        raise FusedGRPOError("FG_ERR_SHAPE_MISMATCH", f"weight dtype {weight.dtype} differs from "
                             f"hidden dtype {hidden.dtype}")
    h, ldh = rows(h, 2)
    w, ldw = rows(w, 1)
    b = None if bias is None else compute_dtype(bias.detach(), "bias").to(w.dtype).contiguous()
    tok = token_ids.detach().to(torch.int64).contiguous()
    m = mask.detach()
    if reported:
        pass
    elif device.type == "cuda":
        check_mask_device(m)
    elif m.dtype != torch.bool:
        _inputs.check_mask_values(m.numpy() if m.dtype != torch.bfloat16 else m.float().numpy())
    if m.dtype == torch.bool and m.is_contiguous():
        m = m.view(torch.uint8)
    elif m.dtype != torch.uint8 or not m.is_contiguous():
        m = (m != 0).to(torch.uint8).contiguous()
    keep = (h, w, b, tok, m)
    req = dict(B=B, T=T, H=H, V=V, dtype=_DT[h.dtype], hidden=ptr(h), ld_hidden=ldh,
               weight=ptr(w), ld_weight=ldw, bias=ptr(b), token_ids=ptr(tok), mask=ptr(m))
    return keep, req


def batch_tensors(B, T, advantages, old_logp, ref_logp, is_ratio, sampling_logp):
    """The loss's per-sequence and per-token inputs, checked (devices, shapes,
    dtypes), as float32 contiguous tensors: (advantages [B], old_logp,
    ref_logp, is_ratio [B, T] or [B], sampling_logp, is_ratio per sequence)."""
    arrays = dict(advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                  is_ratio=is_ratio, sampling_logp=sampling_logp)
    check_devices(**arrays)
    per_seq = check_batch_shapes(B, T, advantages, old_logp, ref_logp, is_ratio, sampling_logp)
    f32 = {k: None if t is None else t.detach().to(torch.float32).contiguous()
           for k, t in arrays.items()}
    isr = f32["is_ratio"]
    return (f32["advantages"].reshape(B), f32["old_logp"], f32["ref_logp"],
            None if isr is None else isr.reshape(B) if per_seq else isr, f32["sampling_logp"],
            per_seq)
