"""The torch front end on the library's backends behind the per-chunk seam.

- The seam's reference backend on host memory, in place of the CPU context:
  the op's C calls then take the path a CUDA context takes (token arrays
  staged, the loss math on the host per chunk, the backend's chunk work),
  on any machine. Against the CPU backend on the same inputs.
- CUDA tensors (skipped without a CUDA device): the op, the module and the
  log-probs through the CUDA backend against the CPU op on the same inputs,
  every loss type at both levels, f32 (TF32 off) and bf16.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedgrpo._lib as fl  # noqa: E402
import fusedgrpo._torch_inputs as ti  # noqa: E402
import fusedgrpo.torch as fgt  # noqa: E402
from grpo_reference import make_inputs  # noqa: E402

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]


def _tensors(seed, device="cpu", dtype=torch.float32, **kw):
    inp = make_inputs(np.random.default_rng(seed), B=3, T=7, H=24, V=67, **kw)
    t = {k: (torch.from_numpy(np.ascontiguousarray(v)).to(device) if v is not None else None)
         for k, v in inp.items()}
    for k in ("hidden", "weight", "bias"):
        if t[k] is not None:
            t[k] = t[k].to(dtype)
    return t


def _loss_and_grads(t, **options):
    h = t["hidden"].clone().requires_grad_()
    w = t["weight"].clone().requires_grad_()
    b = t["bias"].clone().requires_grad_() if t["bias"] is not None else None
    loss, metrics, logp, ent = fgt.fused_linear_grpo_loss(
        h, w, t["token_ids"], t["mask"], t["advantages"], b, t.get("old_logp"),
        t.get("ref_logp"), **options)
    loss.backward()
    return (loss.detach().cpu().double(), {k: v.cpu().double() for k, v in metrics.items()},
            logp.cpu(), ent.cpu(), h.grad.cpu().float(), w.grad.cpu().float(),
            None if b is None else b.grad.cpu().float())


def _close(a, b, rtol, what):
    a, b = a.double(), b.double()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


@pytest.fixture
def reference_backend(monkeypatch):
    """CPU tensors through the reference backend's context."""
    monkeypatch.setattr(ti, "call_context", lambda device: fl.device_context("reference"))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_reference_backend_matches_cpu(loss_type, level, reference_backend, monkeypatch):
    t = _tensors(hash((loss_type, level)) % 1000)
    opts = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                temperature=0.8, memory_budget=None)
    got = _loss_and_grads(t, **opts)
    monkeypatch.setattr(ti, "call_context", lambda device: None)
    want = _loss_and_grads(t, **opts)
    assert abs(got[0] - want[0]) <= 2e-6 * max(1.0, abs(want[0].item()))
    for k in want[1]:
        assert abs(got[1][k] - want[1][k]) <= 2e-6 * max(1.0, abs(want[1][k].item())), k
    _close(got[2], want[2], 2e-6, "logp")
    _close(got[3], want[3], 2e-6, "entropy")
    for i, name in ((4, "grad_hidden"), (5, "grad_weight"), (6, "grad_bias")):
        _close(got[i], want[i], 5e-6, name)


def test_reference_backend_refuses_like_cpu(reference_backend):
    t = _tensors(5)
    t["token_ids"][0, 0] = 67  # unmasked (make_inputs keeps token 0 of every row)
    with pytest.raises(fl.FusedGRPOError) as e:
        _loss_and_grads(t)
    assert e.value.status == "FG_ERR_TOKEN_OUT_OF_RANGE"


def test_reference_backend_logprobs(reference_backend, monkeypatch):
    t = _tensors(9)
    h = t["hidden"].clone().requires_grad_()
    logp, ent = fgt.linear_logprobs(h, t["weight"], t["token_ids"], t["mask"], t["bias"],
                                    temperature=0.9, return_entropy=True)
    (logp.sum() + 0.5 * ent.sum()).backward()
    got = (logp.detach(), ent.detach(), h.grad.clone())
    monkeypatch.setattr(ti, "call_context", lambda device: None)
    h.grad = None
    logp, ent = fgt.linear_logprobs(h, t["weight"], t["token_ids"], t["mask"], t["bias"],
                                    temperature=0.9, return_entropy=True)
    (logp.sum() + 0.5 * ent.sum()).backward()
    _close(got[0], logp.detach(), 2e-6, "logp")
    _close(got[1], ent.detach(), 2e-6, "entropy")
    _close(got[2], h.grad, 5e-6, "grad_hidden")


# ------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_cuda_matches_cpu(loss_type, level, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    seed = hash((loss_type, level)) % 1000
    opts = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                temperature=0.8)
    want = _loss_and_grads(_tensors(seed, "cpu", dtype), **opts)
    # The least budget the CUDA call runs with, in doublings: chunks of a few rows.
    budget = 1 << 12
    while True:
        try:
            got = _loss_and_grads(_tensors(seed, "cuda", dtype), memory_budget=budget, **opts)
            break
        except fl.FusedGRPOError as e:
            if e.status != "FG_ERR_BUDGET_TOO_SMALL" or budget > 1 << 30:
                raise
            budget *= 2
    f32 = dtype == torch.float32
    # bf16: tensor-core products with dlogits rounded to bf16 (the CPU rounds
    # them only where it has bf16 GEMM kernels): about 2^-9 relative.
    assert abs(got[0] - want[0]) <= (1e-5 if f32 else 1e-3) * max(1.0, abs(want[0].item()))
    _close(got[2], want[2], 1e-5 if f32 else 1e-3, "logp")
    _close(got[3], want[3], 1e-5 if f32 else 1e-3, "entropy")
    for i, name in ((4, "grad_hidden"), (5, "grad_weight"), (6, "grad_bias")):
        _close(got[i], want[i], 1e-4 if f32 else 1e-2, name)


@cuda
def test_cuda_refuses_bad_token_and_nan():
    t = _tensors(3, "cuda")
    t["token_ids"][0, 0] = 67
    with pytest.raises(fl.FusedGRPOError) as e:
        _loss_and_grads(t)
    assert e.value.status == "FG_ERR_TOKEN_OUT_OF_RANGE"
    t = _tensors(3, "cuda")
    t["hidden"][0, 0, 0] = float("nan")
    with pytest.raises(fl.FusedGRPOError) as e:
        _loss_and_grads(t)
    assert e.value.status == "FG_ERR_NONFINITE_INPUT"


@cuda
def test_cuda_mixed_devices_refused():
    t = _tensors(4, "cuda")
    t["advantages"] = t["advantages"].cpu()
    with pytest.raises(fl.FusedGRPOError) as e:
        _loss_and_grads(t)
    assert "one device" in str(e.value)
