"""fusedgrpo.cross_entropy.linear_cross_entropy without a process group (the
whole vocabulary on one process): verl's fused-kernel signature against a
float64 torch reference (log_softmax of the logits / temperature, entropy
-sum(p log p)), forward and the backward through both outputs, on odd sizes
(H = 29, V = 101) in verl's layouts: packed [N, H], [B, T, H], and Megatron's
[S, 1, H] with labels [1, S]; reductions; refusals. Its vocab-parallel calls
run in test_torch_distributed.py (2 gloo ranks)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fusedgrpo import FusedGRPOError  # noqa: E402
from fusedgrpo.cross_entropy import linear_cross_entropy  # noqa: E402
from tolerance import relative_error  # noqa: E402

H, V = 29, 101
# normwise against float64; worst measured: log-probs 1.3e-7, entropy 3.7e-7,
# grad_hidden 5.7e-7, grad_weight 5.8e-7
TOL = 3e-6


def _problem(seed, shape, labels_shape=None, reduction="none"):
    rng = np.random.default_rng(seed)

    def f32(*s, scale=1.0):
        return torch.from_numpy(np.asarray(rng.standard_normal(s) * scale, np.float32))
    labels_shape = shape if labels_shape is None else labels_shape
    return dict(hidden=f32(*shape, H), weight=f32(V, H, scale=2.0 / np.sqrt(H)),
                labels=torch.from_numpy(rng.integers(0, V, size=labels_shape)),
                c_logp=f32(*(labels_shape if reduction == "none" else ())),
                c_entropy=f32(*labels_shape))


def _run(p, temperature, reduction, *, float64=False):
    """(log_probs, entropy, grad_hidden, grad_weight) of fusedgrpo, or of the
    float64 reference, for the loss sum(c_logp * log_probs) + sum(c_entropy * entropy)."""
    dt = torch.float64 if float64 else torch.float32
    h = p["hidden"].detach().to(dt, copy=True).requires_grad_()
    w = p["weight"].detach().to(dt, copy=True).requires_grad_()
    if float64:
        ls = torch.log_softmax(h.reshape(-1, H) @ w.T / temperature, dim=-1)
        lp = ls.gather(-1, p["labels"].reshape(-1, 1)).reshape(p["labels"].shape)
        ent = -(ls.exp() * ls).sum(-1).reshape(p["labels"].shape)
        r = reduction.lower()
        lp = lp.sum() if r == "sum" else lp.mean() if r == "mean" else lp
    else:
        lp, ent = linear_cross_entropy(h, w, p["labels"], temperature, reduction)
    ((lp * p["c_logp"].to(dt)).sum() + (ent * p["c_entropy"].to(dt)).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


CASES = {  # name: (hidden's token shape, labels' shape or None: the same, temperature, reduction)
    "packed": ((37,), None, 0.7, "none"),
    "btH": ((3, 13), None, 1.0, "none"),
    "megatron_s1h": ((19, 1), (1, 19), 1.3, "none"),
    "sum": ((37,), None, 0.9, "sum"),
    "mean": ((3, 13), None, 0.9, "Mean"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case):
    shape, labels_shape, temperature, reduction = CASES[case]
    p = _problem(1500 + list(CASES).index(case), shape, labels_shape,
                 "none" if reduction == "none" else "sum")
    got = _run(p, temperature, reduction)
    want = _run(p, temperature, reduction, float64=True)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert got[1].shape == p["labels"].shape  # entropy per token in every reduction
    assert got[0].shape == (p["labels"].shape if reduction == "none" else ())
    assert got[2].shape == p["hidden"].shape
    for name, g, w in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), got, want):
        err = relative_error(g.double().numpy(), w.numpy())
        assert err <= TOL, f"{case}: {name} relative error {err:.3g} > {TOL:g}"


def test_backward_through_entropy_alone():
    """verl's entropy bonus without a log-prob term: only entropy's gradient flows."""
    p = _problem(1510, (23,))
    h = p["hidden"].clone().requires_grad_()
    _, ent = linear_cross_entropy(h, p["weight"], p["labels"], 1.0)
    (ent * p["c_entropy"]).sum().backward()
    ref = dict(p, c_logp=torch.zeros_like(p["c_logp"]))
    want = _run(ref, 1.0, "none", float64=True)[2]
    assert relative_error(h.grad.double().numpy(), want.numpy()) <= TOL


def test_refusals():
    p = _problem(1511, (5,))
    args = (p["hidden"], p["weight"], p["labels"])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(*args, 1.0, "max")
    with pytest.raises(FusedGRPOError, match="token rows"):
        linear_cross_entropy(p["hidden"], p["weight"], p["labels"][:4])
    with pytest.raises(ValueError, match="without a process_group"):
        linear_cross_entropy(*args, sequence_parallel=True)
    with pytest.raises(FusedGRPOError) as e:
        linear_cross_entropy(p["hidden"], p["weight"], p["labels"] + V)
    assert e.value.status == "FG_ERR_TOKEN_OUT_OF_RANGE"
