"""The LM head's log-probs alone (fg_linear_logprobs) and the backward of a
caller's loss through them (fg_linear_logprobs_backward), through the NumPy and
PyTorch front ends, against a float64 reference written here: log_softmax of
(hidden . W^T + b) / temperature, its entropy, and the chain rule of a random
loss sum(c1 * logp + c2 * entropy) by torch.autograd in float64.

Odd shapes (B = 3, T = 7, H = 45, V = 1013, ragged mask, a fully masked
sequence), float32 and bfloat16 (the reference sees the rounded inputs), fused
over several chunks and materialized, temperature 0.7.
"""
import numpy as np
import pytest

import fusedgrpo as fg
from tolerance import assert_close

B, T, H, V = 3, 7, 45, 1013


def _problem(seed, dtype):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((B, T, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) * 0.3).astype(np.float32)
    b = (rng.standard_normal(V) * 0.1).astype(np.float32)
    if dtype == "bfloat16":  # the reference sees the rounded values
        h, w, b = (fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(x)) for x in (h, w, b))
    tok = rng.integers(0, V, (B, T))
    mask = rng.random((B, T)) > 0.25
    mask[1] = False  # a fully masked sequence
    tok[~mask] = V + 5  # never read
    c1 = rng.standard_normal((B, T)).astype(np.float32)
    c2 = (0.1 * rng.standard_normal((B, T))).astype(np.float32)
    return h, w, b, tok, mask, c1, c2


def _reference(h, w, b, tok, mask, c1, c2, temperature):
    """logp, entropy and the gradients of sum(m * (c1 logp + c2 entropy)), float64."""
    torch = pytest.importorskip("torch")
    hr, wr, br = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (h, w, b))
    z = (hr @ wr.T + br) / temperature
    ls = torch.log_softmax(z, -1)
    t = torch.tensor(np.where(mask, tok, 0))
    m = torch.tensor(mask, dtype=torch.float64)
    lp = ls.gather(-1, t[..., None])[..., 0] * m
    ent = -(ls.exp() * ls).sum(-1) * m
    loss = (torch.tensor(c1, dtype=torch.float64) * lp
            + torch.tensor(c2, dtype=torch.float64) * ent).sum()
    loss.backward()
    return (lp.detach().numpy(), ent.detach().numpy(), hr.grad.numpy(), wr.grad.numpy(),
            br.grad.numpy())


def _smallest(run):
    """The smallest budget run(budget) succeeds with, to 1 KiB, found by
    bisection from the call's own FG_ERR_BUDGET_TOO_SMALL (no CPU's scratch
    sizes assumed)."""
    lo, hi = 1024, 64 << 20  # lo fails, hi runs
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        try:
            run(mid)
            hi = mid
        except fg.FusedGRPOError as e:
            assert e.status == "FG_ERR_BUDGET_TOO_SMALL", e
            lo = mid
    return hi


def _budgets(h, w, b, tok, mask, dtype):
    """The smallest budget of each NumPy log-prob call (forward, backward): each
    then runs in chunks of a few token rows, whatever this CPU's GEMM scratch."""
    g = np.ones((B, T), np.float32)
    fwd = _smallest(lambda m: fg.fused_linear_logprobs(
        h, w, tok, mask, bias=b, dtype=dtype, return_entropy=True, memory_budget=m))
    bwd = _smallest(lambda m: fg.fused_linear_logprobs_backward(
        h, w, tok, g, mask, bias=b, dtype=dtype, memory_budget=m))
    return fwd, bwd


@pytest.mark.parametrize("impl", ["fused", "materialized"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_numpy_logprobs_and_backward(dtype, impl):
    h, w, b, tok, mask, c1, c2 = _problem(11, dtype)
    lp_ref, ent_ref, gh_ref, gw_ref, gb_ref = _reference(h, w, b, tok, mask, c1, c2, 0.7)
    fwd, bwd = _budgets(h, w, b, tok, mask, dtype) if impl == "fused" else (None, None)
    kw = dict(bias=b, temperature=0.7, dtype=dtype, impl=impl)
    fg.release_workspace()  # the counted peak is then this call's alone
    fg.reset_peak_memory()
    lp, ent = fg.fused_linear_logprobs(h, w, tok, mask, return_entropy=True, memory_budget=fwd,
                                       **kw)
    if impl == "fused":
        assert fg.memory_stats()["chunks"] > 1
        assert fg.memory_stats()["peak_bytes"] <= fwd
    pre = "f32" if dtype == "float32" else "bf16"
    assert_close(f"{pre}/logp", lp, lp_ref)
    assert_close(f"{pre}/entropy", ent, ent_ref)
    assert np.all(lp[~mask] == 0) and np.all(ent[~mask] == 0)
    g = fg.fused_linear_logprobs_backward(h, w, tok, c1, mask, grad_entropy=c2,
                                          memory_budget=bwd, **kw)
    if impl == "fused":
        assert fg.memory_stats()["chunks"] > 1
    assert_close(f"{pre}/grad_hidden", g["grad_hidden"], gh_ref)
    assert_close(f"{pre}/grad_weight", g["grad_weight"], gw_ref)
    assert_close(f"{pre}/grad_bias", g["grad_bias"], gb_ref)
    assert np.all(g["grad_hidden"][~mask] == 0)


def test_numpy_backward_accumulates():
    h, w, b, tok, mask, c1, c2 = _problem(12, "float32")
    one = fg.fused_linear_logprobs_backward(h, w, tok, c1, mask, grad_entropy=c2, bias=b)
    gw = np.zeros((V, H), np.float32)
    gb = np.zeros(V, np.float32)
    halves = [(slice(0, 2), c1[:2], c2[:2]), (slice(2, 3), c1[2:], c2[2:])]
    for sl, a1, a2 in halves:  # two micro-batches of sequences add into one buffer
        fg.fused_linear_logprobs_backward(h[sl], w, tok[sl], a1, mask[sl], grad_entropy=a2,
                                          bias=b, grad_weight_out=gw, grad_bias_out=gb)
    assert_close("chunking/grad_weight", gw, one["grad_weight"])
    assert np.linalg.norm(gb - one["grad_bias"]) <= 1e-6 * np.linalg.norm(one["grad_bias"])


def test_numpy_bad_arguments():
    h, w, b, tok, mask, c1, _ = _problem(13, "float32")
    with pytest.raises(fg.FusedGRPOError, match="FG_ERR_BAD_TEMPERATURE"):
        fg.fused_linear_logprobs(h, w, tok, mask, temperature=0.0)
    bad = tok.copy()
    bad[0, 0] = V
    m = mask.copy()
    m[0, 0] = True
    with pytest.raises(fg.FusedGRPOError, match="FG_ERR_TOKEN_OUT_OF_RANGE"):
        fg.fused_linear_logprobs(h, w, bad, m)
    g = c1.copy()
    g[0, 0] = np.nan
    with pytest.raises(fg.FusedGRPOError, match="FG_ERR_NONFINITE_INPUT"):
        fg.fused_linear_logprobs_backward(h, w, np.where(m, tok, 0), g, m)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_linear_logprobs_is_differentiable(dtype):
    torch = pytest.importorskip("torch")
    from fusedgrpo.torch import linear_logprobs

    h, w, b, tok, mask, c1, c2 = _problem(14, dtype)
    lp_ref, ent_ref, gh_ref, gw_ref, gb_ref = _reference(h, w, b, tok, mask, c1, c2, 0.7)
    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    hx, wx, bx = (torch.tensor(x).to(tdt).requires_grad_() for x in (h, w, b))
    t, m = torch.tensor(tok), torch.tensor(mask)

    def backward(budget):  # the torch backward (bf16 gradients for bf16 inputs)
        xs = [torch.tensor(x).to(tdt).requires_grad_() for x in (h, w, b)]
        linear_logprobs(xs[0], xs[1], t, m, xs[2], memory_budget=budget).sum().backward()

    budget = _smallest(backward)
    budget += budget // 8
    lp, ent = linear_logprobs(hx, wx, torch.tensor(tok), torch.tensor(mask), bx, temperature=0.7,
                              return_entropy=True, memory_budget=budget)
    (lp * torch.tensor(c1) + ent * torch.tensor(c2)).sum().backward()
    pre = "f32" if dtype == "float32" else "bf16_out"
    assert hx.grad.dtype == tdt and wx.grad.dtype == tdt
    assert_close("f32/logp" if dtype == "float32" else "bf16/logp", lp, lp_ref)
    assert_close(f"{pre}/grad_hidden", hx.grad, gh_ref)
    assert_close(f"{pre}/grad_weight", wx.grad, gw_ref)
    with torch.no_grad():  # the old / reference passes: forward only
        lp2 = linear_logprobs(hx, wx, torch.tensor(tok), torch.tensor(mask), bx, temperature=0.7,
                              memory_budget=budget)
    assert torch.equal(lp2, lp.detach())  # the same chunks: the same bits


def test_torch_linear_logprobs_compiles():
    torch = pytest.importorskip("torch")
    from fusedgrpo.torch import linear_logprobs

    h, w, b, tok, mask, c1, _ = _problem(15, "float32")
    hx, wx = torch.tensor(h, requires_grad=True), torch.tensor(w, requires_grad=True)
    t, m, c = torch.tensor(tok), torch.tensor(mask), torch.tensor(c1)

    def f(hh, ww):
        return (linear_logprobs(hh, ww, t, m) * c).sum()

    eager = f(hx, wx)
    eager.backward()
    g_eager = wx.grad.clone()
    wx.grad = None
    compiled = torch.compile(f, fullgraph=True)(hx, wx)
    compiled.backward()
    assert torch.allclose(compiled, eager) and torch.equal(wx.grad, g_eager)
