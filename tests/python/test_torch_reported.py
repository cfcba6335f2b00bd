"""Device-reported calls through the torch front end (device_report=True:
fusedgrpo::linear_grpo_reported, raise_device_errors; fusedgrpo.h
"Device-reported calls").

- On any machine, CPU tensors through the C library's reference backend
  (fusedgrpo.torch._device_path_on_cpu: the device path and its report ops,
  host memory): every loss type at both levels against the host-checked CPU
  call (loss, metrics, logp, entropy, the three gradients within the
  reference backend's tolerances of test_device_backends.py), the same
  refusals with the host-checked call's status and message, raised by
  raise_device_errors() and not before; what is refused at once; under
  torch.compile(fullgraph=True).
- CUDA tensors (skipped without a CUDA device): the op captured with
  torch.cuda.graph and replayed with new advantages copied into the captured
  input, against eager host-checked calls; a refusal raised after a replay;
  torch.compile(mode="reduce-overhead") against eager.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedgrpo._lib as fl  # noqa: E402
import fusedgrpo.torch as fgt  # noqa: E402
from grpo_reference import make_inputs  # noqa: E402

LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
# The reference backend against the CPU's (test_device_backends.py REFERENCE_TOL).
TOL = dict(loss=1.5e-5, logp=1.5e-6, grads=4e-5)


@pytest.fixture
def reference_on_cpu():
    fgt.raise_device_errors()  # nothing pending from elsewhere
    fgt._device_path_on_cpu(True)
    yield
    fgt._device_path_on_cpu(False)
    fgt._reports["eager"] = []


def _tensors(seed, device="cpu", **kw):
    inp = make_inputs(np.random.default_rng(seed), B=3, T=7, H=24, V=67, **kw)
    return {k: (torch.from_numpy(np.ascontiguousarray(v)).to(device) if v is not None else None)
            for k, v in inp.items()}


def _run(t, **options):
    h = t["hidden"].clone().requires_grad_()
    w = t["weight"].clone().requires_grad_()
    b = t["bias"].clone().requires_grad_() if t["bias"] is not None else None
    loss, metrics, logp, ent = fgt.fused_linear_grpo_loss(
        h, w, t["token_ids"], t["mask"], t["advantages"], b, t.get("old_logp"),
        t.get("ref_logp"), **options)
    loss.backward()
    return (loss.detach().cpu().double(), {k: v.detach().cpu().double() for k, v in metrics.items()},
            logp.detach().cpu(), ent.detach().cpu(), h.grad.cpu().float(), w.grad.cpu().float(),
            None if b is None else b.grad.cpu().float())


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(got, want, tol=TOL):
    rel = abs(got[0] - want[0]).item() / max(1.0, abs(want[0].item()))
    assert rel <= tol["loss"], f"loss {got[0].item()} vs {want[0].item()}"
    for k in want[1]:
        r = abs(got[1][k] - want[1][k]).item() / max(1.0, abs(want[1][k].item()))
        assert r <= tol["loss"] or (np.isnan(got[1][k].item()) and np.isnan(want[1][k].item())), k
    for i, name in ((2, "logp"), (3, "entropy")):
        assert _rel_l2(got[i], want[i]) <= tol["logp"], name
    for i, name in ((4, "grad_hidden"), (5, "grad_weight"), (6, "grad_bias")):
        if want[i] is not None:
            assert _rel_l2(got[i], want[i]) <= tol["grads"], name


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSSES)
def test_reported_matches_host_checked(reference_on_cpu, loss_type, level):
    t = _tensors(300 + LOSSES.index(loss_type) + 50 * (level == "sequence"))
    opts = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                temperature=0.8, entropy_coef=0.01, memory_budget=1 << 16)  # several chunks
    want = _run(t, **opts)
    got = _run(t, device_report=True, **opts)
    fgt.raise_device_errors()
    _check(got, want)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reported_entropy_quantile(reference_on_cpu, level):
    """The entropy quantile's threshold over every unmasked entropy, after a
    forward sweep (report_prepare)."""
    t = _tensors(77 + (level == "sequence"))
    opts = dict(loss_type="dapo", importance_sampling_level=level, top_entropy_quantile=0.6,
                entropy_coef=0.02, memory_budget=1 << 16)
    want = _run(t, **opts)
    got = _run(t, device_report=True, **opts)
    fgt.raise_device_errors()
    _check(got, want)


def _spoil_id(t):
    t["token_ids"][1, 0] = 67 + 4  # unmasked: make_inputs keeps token 0 of every row


def _spoil_adv(t):
    t["advantages"][2] = float("nan")


def _spoil_old(t):
    t["old_logp"][0, 0] = float("inf")


def _spoil_hidden(t):
    t["hidden"][2, 0, 5] = float("nan")


@pytest.mark.parametrize("spoil", [_spoil_id, _spoil_adv, _spoil_old, _spoil_hidden])
def test_reported_refusals_match(reference_on_cpu, spoil):
    t = _tensors(17)
    spoil(t)
    with pytest.raises(fl.FusedGRPOError) as host:
        _run(t, beta=0.04)
    _run(t, beta=0.04, device_report=True)  # returns: the failure is in the record
    with pytest.raises(fl.FusedGRPOError) as dev:
        fgt.raise_device_errors()
    assert (dev.value.status, str(dev.value)) == (host.value.status, str(host.value))
    fgt.raise_device_errors()  # checked once: nothing pending now


def test_reported_module(reference_on_cpu):
    t = _tensors(29)
    args = (t["token_ids"], t["mask"], t["advantages"], t["bias"], t["ref_logp"],
            t["old_logp"])
    got = fgt.FusedLinearGRPOLoss(beta=0.04, device_report=True, return_metrics_dict=True)(
        t["hidden"], t["weight"], *args)
    fgt.raise_device_errors()
    want = fgt.FusedLinearGRPOLoss(beta=0.04, return_metrics_dict=True)(
        t["hidden"], t["weight"], *args)
    assert abs(got[0].item() - want[0].item()) <= TOL["loss"] * max(1.0, abs(want[0].item()))
    with pytest.raises(TypeError, match="device_report"):
        fgt.FusedLinearGRPOLoss(device_report="yes")


def test_reported_refused_at_once(reference_on_cpu):
    t = _tensors(3)
    with pytest.raises(fl.FusedGRPOError, match="fused path only") as e:
        _run(t, impl="materialized", device_report=True)
    assert e.value.status == "FG_ERR_UNSUPPORTED"
    with pytest.raises(TypeError, match="device_report"):
        _run(t, device_report=1)
    fgt._device_path_on_cpu(False)
    with pytest.raises(fl.FusedGRPOError, match="CUDA tensors only"):
        _run(t, device_report=True)


def test_reported_compiles(reference_on_cpu):
    t = _tensors(23)
    opts = dict(beta=0.04, loss_type="dapo")

    def step(h, w):
        loss, _, _, _ = fgt.fused_linear_grpo_loss(h, w, t["token_ids"], t["mask"],
                                                   t["advantages"], None, t["old_logp"],
                                                   t["ref_logp"], device_report=True, **opts)
        return loss

    compiled = torch.compile(step, fullgraph=True)
    h = t["hidden"].clone().requires_grad_()
    w = t["weight"].clone().requires_grad_()
    loss = compiled(h, w)
    loss.backward()
    fgt.raise_device_errors()
    want = _run(dict(t, bias=None), **opts)
    assert abs(loss.item() - want[0].item()) <= TOL["loss"] * max(1.0, abs(want[0].item()))
    assert _rel_l2(h.grad, want[4]) <= TOL["grads"]


# ------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA_TOL = dict(loss=1e-4, logp=2e-5, grads=2e-4)  # float32, TF32 off (test_device_backends.py)


@cuda
def test_cuda_graph_capture_and_replay():
    torch.backends.cuda.matmul.allow_tf32 = False
    fgt.raise_device_errors()
    t = _tensors(41, "cuda")
    opts = dict(beta=0.04, loss_type="dapo", memory_budget=1 << 20)
    h = t["hidden"].clone().requires_grad_()
    w = t["weight"].clone().requires_grad_()
    adv = t["advantages"].clone()

    def step():
        loss, _, _, _ = fgt.fused_linear_grpo_loss(h, w, t["token_ids"], t["mask"], adv,
                                                   t["bias"], t["old_logp"], t["ref_logp"],
                                                   device_report=True, **opts)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        for _ in range(2):
            h.grad = w.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    h.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    for k, scale in enumerate((1.0, -0.5)):
        adv.copy_(t["advantages"] * scale)
        graph.replay()
        torch.cuda.synchronize()
        fgt.raise_device_errors()
        want = _run(dict(t, advantages=t["advantages"] * scale), **opts)
        got = (static_loss.detach().cpu().double(), want[1], want[2], want[3],
               h.grad.cpu().float(), w.grad.cpu().float(), want[6])
        _check(got, want, CUDA_TOL)
    # A NaN advantage copied into the captured input: the replay's record says so.
    adv[1] = float("nan")
    graph.replay()
    with pytest.raises(fl.FusedGRPOError, match=r"advantages\[1\]"):
        fgt.raise_device_errors()
    fgt.forget_graph_reports()
    del graph


@cuda
def test_cuda_reduce_overhead_matches_eager():
    torch.backends.cuda.matmul.allow_tf32 = False
    t = _tensors(43, "cuda")
    opts = dict(beta=0.0, loss_type="grpo")

    def loss_of(h, w):
        loss, _, _, _ = fgt.fused_linear_grpo_loss(h, w, t["token_ids"], t["mask"],
                                                   t["advantages"], None, t["old_logp"], None,
                                                   device_report=True, **opts)
        return loss

    compiled = torch.compile(loss_of, mode="reduce-overhead", fullgraph=True)
    h = t["hidden"].clone().requires_grad_()
    for _ in range(3):  # recorded, then replayed
        loss = compiled(h, t["weight"])
    torch.cuda.synchronize()
    fgt.raise_device_errors()
    want = _run(dict(t, bias=None, ref_logp=None), **opts)
    assert abs(loss.item() - want[0].item()) <= CUDA_TOL["loss"] * max(1.0, abs(want[0].item()))
    fgt.forget_graph_reports()
