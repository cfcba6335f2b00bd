"""fusedgrpo.torch_distributed's device path in one process: a group of one
rank holding the whole vocabulary, so its ops must give what fusedgrpo.torch's
single-device op gives on the same tensors.

Two worlds (module-scoped, one after the other: one default group a process):
  - nccl: CUDA tensors, NCCL (skipped, with the reason, without a CUDA device
    or without NCCL): every phase buffer on the GPU, the loss from logp on the
    host;
  - gloo-reference: CPU tensors through the reference backend's context (a
    device context whose memory is the host's), so that this file checks the
    same route on any machine.
Each call runs twice: as a group of one rank runs it (no collective but the
exit's, which a group of one skips too) and with every collective made all
the same (torch_distributed._needs_collective patched), so that the NCCL
reductions run on the device tensors they are given.

Checked: the loss (forward and backward: loss, metrics, logp, entropy,
grad_hidden, grad_weight, grad_bias) and linear_logprobs with the backward of
a loss of logp and entropy, float32 and bfloat16, against fusedgrpo.torch on
the same tensors (within 5e-6 normwise for float32's loss, logp and entropy,
2e-5 for its gradients; bfloat16 1e-4 and 5e-3: the group's grad_hidden is
rounded to bfloat16 once, from float32) and against the CPU op
(test_device_backends' bounds: 1e-5 / 1e-4 for float32, 1e-3 / 1e-2 for
bfloat16); a bad token id raises FG_ERR_TOKEN_OUT_OF_RANGE and the group
works afterwards; operands on two devices are refused (CUDA only).
"""
from __future__ import annotations

import datetime

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import fusedgrpo._lib as fl  # noqa: E402
import fusedgrpo._torch_inputs as ti  # noqa: E402
import fusedgrpo.torch as fgt  # noqa: E402
import fusedgrpo.torch_distributed as fgd  # noqa: E402
from grpo_reference import make_inputs  # noqa: E402

B, T, H, V = 3, 13, 37, 301
CPU_CONTEXT = ti.call_context  # the CPU's for CPU tensors (None)
LOSS_CASES = {
    "dapo_token": dict(loss_type="dapo", temperature=0.9, beta=0.04),
    "grpo_sequence_entropy": dict(loss_type="grpo", importance_sampling_level="sequence",
                                  beta=0.04, entropy_coef=0.01),
}
# (loss, logp and entropy, gradients): normwise relative
SAME_DEVICE = {torch.float32: (5e-6, 5e-6, 2e-5), torch.bfloat16: (1e-4, 1e-4, 5e-3)}
AGAINST_CPU = {torch.float32: (1e-5, 1e-5, 1e-4), torch.bfloat16: (1e-3, 1e-3, 1e-2)}


def _skip_reason(kind: str):
    if not dist.is_available():
        return "torch.distributed is not available"
    if kind == "nccl":
        if not torch.cuda.is_available():
            return "no CUDA device"
        if not dist.is_nccl_available():
            return "torch.distributed has no NCCL"
    elif not dist.is_gloo_available():
        return "torch.distributed has no gloo"
    return None


@pytest.fixture(scope="module", params=["nccl", "gloo-reference"])
def world(request, tmp_path_factory):
    """(kind, device) of a default group of one rank, on a FileStore."""
    kind = request.param
    reason = _skip_reason(kind)
    if reason:
        pytest.skip(reason)
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    store = tmp_path_factory.mktemp(kind.replace("-", "_")) / "store"
    device = torch.device("cpu")
    if kind == "nccl":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(kind.split("-")[0], init_method=f"file://{store}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield kind, device
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=["one_rank", "collectives"])
def on_device(world, request, monkeypatch):
    """The world's device, its calls on the device context (the reference
    backend's for gloo-reference), collectives made or not; restore() puts
    the CPU's context back for the CPU op."""
    kind, device = world
    if kind == "gloo-reference":
        monkeypatch.setattr(ti, "call_context", lambda dev: fl.device_context("reference"))
    if request.param == "collectives":
        monkeypatch.setattr(fgd, "_needs_collective", lambda ranks: True)

    def restore():
        monkeypatch.setattr(ti, "call_context", CPU_CONTEXT)
    return device, restore


def _tensors(seed, device, dtype):
    inp = make_inputs(np.random.default_rng(seed), B=B, T=T, H=H, V=V)
    t = {k: (torch.from_numpy(np.ascontiguousarray(v)).to(device) if v is not None else None)
         for k, v in inp.items()}
    for k in ("hidden", "weight", "bias"):
        t[k] = t[k].to(dtype)
    rng = np.random.default_rng(seed + 1)
    for k in ("c_logp", "c_entropy"):
        t[k] = torch.from_numpy(rng.standard_normal((B, T)).astype(np.float32)).to(device)
    return t


def _leaves(t):
    return tuple(t[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))


def _loss(fn, t, **options):
    h, w, b = _leaves(t)
    loss, metrics, logp, ent = fn(h, w, t["token_ids"], t["mask"], t["advantages"], b,
                                  t["old_logp"], t["ref_logp"], **options)
    loss.backward()
    return dict(loss=loss.detach(), metrics={k: v.detach() for k, v in metrics.items()},
                logp=logp, entropy=ent, grad_hidden=h.grad, grad_weight=w.grad, grad_bias=b.grad)


def _logprobs(fn, t, **options):
    h, w, b = _leaves(t)
    logp, ent = fn(h, w, t["token_ids"], t["mask"], b, return_entropy=True, **options)
    ((logp * t["c_logp"]).sum() + (ent * t["c_entropy"]).sum()).backward()
    return dict(logp=logp.detach(), entropy=ent.detach(), grad_hidden=h.grad, grad_weight=w.grad,
                grad_bias=b.grad)


def _sharded(fn):
    """fn with the whole vocabulary on this one rank."""
    def call(*args, **kw):
        return fn(*args, vocab_start=0, vocab_size=V, **kw)
    return call


def _close(got, want, tol, what):
    a, b = got.detach().cpu().double(), want.detach().cpu().double()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def _compare(got, want, tols, what, device):
    t_loss, t_logp, t_grad = tols
    for k, v in got.items():
        if k == "metrics":
            for m, g in v.items():
                g, w = float(g), float(want[k][m])
                if not (g == w or (np.isnan(g) and np.isnan(w))):
                    assert abs(g - w) <= t_loss * max(1.0, abs(w)), f"{what}: metric {m} {g} vs {w}"
            continue
        assert v.device == device, f"{what}: {k} on {v.device}, not {device}"
        if k == "loss":
            assert abs(float(v) - float(want[k])) <= t_loss * max(1.0, abs(float(want[k]))), \
                f"{what}: loss {float(v)} vs {float(want[k])}"
        else:
            _close(v, want[k], t_logp if k in ("logp", "entropy") else t_grad, f"{what}: {k}")


def _cpu_copy(t):
    return {k: v.cpu() for k, v in t.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_of_one_rank_matches_the_single_device_op(on_device, case, dtype):
    device, restore = on_device
    t = _tensors(100 + list(LOSS_CASES).index(case), device, dtype)
    opts = LOSS_CASES[case]
    got = _loss(_sharded(fgd.fused_linear_grpo_loss), t, **opts)
    _compare(got, _loss(fgt.fused_linear_grpo_loss, t, **opts), SAME_DEVICE[dtype],
             "against the single-device op", device)
    restore()
    want = _loss(fgt.fused_linear_grpo_loss, _cpu_copy(t), **opts)
    _compare(got, want, AGAINST_CPU[dtype], "against the CPU op", device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_logprobs_of_one_rank_match_the_single_device_op(on_device, dtype):
    device, restore = on_device
    t = _tensors(77, device, dtype)
    got = _logprobs(_sharded(fgd.linear_logprobs), t, temperature=0.8)
    _compare(got, _logprobs(fgt.linear_logprobs, t, temperature=0.8), SAME_DEVICE[dtype],
             "against the single-device op", device)
    restore()
    want = _logprobs(fgt.linear_logprobs, _cpu_copy(t), temperature=0.8)
    _compare(got, want, AGAINST_CPU[dtype], "against the CPU op", device)


def test_bad_token_raises_and_the_group_still_works(on_device):
    device, _ = on_device
    t = _tensors(5, device, torch.float32)
    good = _loss(_sharded(fgd.fused_linear_grpo_loss), t, beta=0.04)
    bad = dict(t, token_ids=t["token_ids"].clone())
    bad["token_ids"][0, 0] = V + 3  # unmasked: make_inputs keeps token 0 of every row
    with pytest.raises(fl.FusedGRPOError) as e:
        _loss(_sharded(fgd.fused_linear_grpo_loss), bad, beta=0.04)
    assert e.value.status == "FG_ERR_TOKEN_OUT_OF_RANGE"
    again = _loss(_sharded(fgd.fused_linear_grpo_loss), t, beta=0.04)
    _compare(again, good, (1e-6, 1e-6, 1e-6), "after the error", device)


def test_operands_on_two_devices_are_refused(on_device):
    device, _ = on_device
    if device.type != "cuda":
        pytest.skip("CPU tensors only: nothing to put on another device")
    t = _tensors(6, device, torch.float32)
    t["advantages"] = t["advantages"].cpu()
    with pytest.raises(fl.FusedGRPOError) as e:
        _loss(_sharded(fgd.fused_linear_grpo_loss), t)
    assert "one device" in str(e.value)
