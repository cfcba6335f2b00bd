"""Gradient filtering (filter_eps) through every front end.

The C test (tests/test_filter.c) checks the filtered gradient against its
float64 definition. Here: each front end passes the option through to that
one C call, so
  - NumPy: the forward (loss, metrics, logp, entropy) and grad_bias are bitwise
    the unfiltered call's, grad_hidden / grad_weight stay within the measured
    filtering error of the exact ones, memory_stats() counts the kept entries;
    "auto" is off for float32 (bitwise the unfiltered call) and on for bf16;
    the materialized path and bad thresholds are refused;
  - PyTorch (functional and the Liger-style module) and JAX (FFI and
    pure_callback backends) give the NumPy call's gradients bit for bit.
Odd sizes, a peaked softmax (logits of std ~8), ragged mask, beta != 0.
"""
import numpy as np
import pytest

import fusedgrpo as fg

B, T, H, V = 3, 9, 41, 1019


def _problem(dtype="float32", seed=3):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((B, T, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) * 8.0 / np.sqrt(H)).astype(np.float32)
    b = (rng.standard_normal(V) * 0.5).astype(np.float32)
    if dtype == "bfloat16":
        h, w, b = (fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(x)) for x in (h, w, b))
    tok = rng.integers(0, V, (B, T))
    mask = rng.random((B, T)) > 0.2
    mask[:, 0] = True
    adv = rng.standard_normal(B).astype(np.float32)
    old = (-rng.random((B, T)) * 3).astype(np.float32)
    ref = old + (0.1 * rng.standard_normal((B, T))).astype(np.float32)
    return dict(hidden=h, weight=w, bias=b, token_ids=tok, mask=mask, advantages=adv,
                old_logp=old, ref_logp=ref)


OPTS = dict(beta=0.04, entropy_coef=0.01, loss_type="dapo")


def _run(p, **kw):
    r = fg.fused_linear_grpo(p["hidden"], p["weight"], p["token_ids"], p["mask"],
                             p["advantages"], p["old_logp"], p["ref_logp"], bias=p["bias"],
                             **OPTS, **kw)
    return r, fg.memory_stats()


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _same_forward(a, b):
    assert a.loss == b.loss and a.metrics == b.metrics
    np.testing.assert_array_equal(a.logp, b.logp)
    np.testing.assert_array_equal(a.entropy, b.entropy)
    np.testing.assert_array_equal(a.grad_bias, b.grad_bias)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("smallest", [False, True])
def test_numpy_filtered(dtype, smallest):
    p = _problem(dtype)
    budget = None
    if smallest:  # one token row a chunk
        budget = fg.fused_linear_grpo_plan(
            p["hidden"], p["weight"], p["token_ids"], p["mask"], p["advantages"], p["old_logp"],
            p["ref_logp"], bias=p["bias"], dtype=dtype, filter_eps=1e-4,
            **OPTS)["min_budget_bytes"]
    exact, st0 = _run(p, dtype=dtype, memory_budget=budget)
    assert st0["dlogits_kept"] == st0["dlogits_entries"] == int(p["mask"].sum()) * V
    for eps, bound in ((1e-4, 3e-4), (1e-2, 1.5e-2)):
        r, st = _run(p, dtype=dtype, memory_budget=budget, filter_eps=eps)
        assert st["chunks"] == (int(p["mask"].sum()) if smallest else 1)
        _same_forward(r, exact)
        kept = st["dlogits_kept"] / st["dlogits_entries"]
        assert kept < 0.1, f"eps {eps}: {kept:.3f} of the entries kept"
        # What the filter drops, measured 2026-11-25 (AVX2), worst of both
        # dtypes: grad_hidden 1.03e-4 / 4.2e-3, grad_weight 7.9e-5 / 4.6e-3 at
        # eps 1e-4 / 1e-2.
        assert _rel(r.grad_hidden, exact.grad_hidden) < bound
        assert _rel(r.grad_weight, exact.grad_weight) < bound


def test_numpy_auto():
    p = _problem("float32")
    exact, _ = _run(p)
    auto, st = _run(p, filter_eps="auto")  # float32: off
    assert st["dlogits_kept"] == st["dlogits_entries"]
    np.testing.assert_array_equal(auto.grad_hidden, exact.grad_hidden)
    np.testing.assert_array_equal(auto.grad_weight, exact.grad_weight)
    pb = _problem("bfloat16")
    exact_b, _ = _run(pb, dtype="bfloat16")
    auto_b, st = _run(pb, dtype="bfloat16", filter_eps="auto")
    assert st["dlogits_kept"] < st["dlogits_entries"]
    _same_forward(auto_b, exact_b)


def test_numpy_refused():
    p = _problem()
    for bad in (-0.5, 2.0, float("nan")):
        with pytest.raises(fg.FusedGRPOError, match="FG_ERR_BAD_HYPERPARAMETER"):
            _run(p, filter_eps=bad)
    with pytest.raises(fg.FusedGRPOError, match="FG_ERR_BAD_HYPERPARAMETER"):
        _run(p, filter_eps="sometimes")
    with pytest.raises(fg.FusedGRPOError, match="FG_ERR_UNSUPPORTED"):
        _run(p, impl="materialized", filter_eps=1e-3)


def test_torch_same_bits():
    torch = pytest.importorskip("torch")
    from fusedgrpo.torch import FusedLinearGRPOLoss, fused_linear_grpo_loss
    p = _problem()
    want, _ = _run(p, filter_eps=1e-3)
    t = {k: torch.tensor(v) for k, v in p.items()}
    h, w, b = (t[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    loss, _, _, _ = fused_linear_grpo_loss(h, w, t["token_ids"], t["mask"], t["advantages"], b,
                                           t["old_logp"], t["ref_logp"], filter_eps=1e-3, **OPTS)
    loss.backward()
    np.testing.assert_array_equal(h.grad.numpy(), want.grad_hidden)
    np.testing.assert_array_equal(w.grad.numpy(), want.grad_weight)
    mod = FusedLinearGRPOLoss(beta=OPTS["beta"], loss_type="dapo", entropy_coef=0.01,
                              filter_eps=1e-3)
    w2 = t["weight"].clone().requires_grad_()
    out = mod(t["hidden"], w2, t["token_ids"], t["mask"], t["advantages"], t["bias"],
              ref_per_token_logps=t["ref_logp"], old_per_token_logps=t["old_logp"])
    out[0].backward()
    np.testing.assert_array_equal(w2.grad.numpy(), want.grad_weight)


@pytest.mark.parametrize("backend", ["ffi", "callback"])
def test_jax_same_bits(backend, monkeypatch):
    jax = pytest.importorskip("jax")
    import fusedgrpo.jax as fgj
    if backend == "ffi" and fgj.backend() != "ffi":
        pytest.skip("the FFI handler is not built")
    fgj.backend()
    monkeypatch.setitem(fgj._state, "backend", backend)
    p = _problem()
    want, _ = _run(p, filter_eps=1e-3)

    def loss(h, w, b):
        return fgj.fused_linear_grpo_loss(h, w, p["token_ids"], p["mask"], p["advantages"],
                                          p["old_logp"], p["ref_logp"], bias=b, filter_eps=1e-3,
                                          **OPTS)

    gh, gw, _ = jax.grad(loss, argnums=(0, 1, 2))(p["hidden"], p["weight"], p["bias"])
    np.testing.assert_array_equal(np.asarray(gh), want.grad_hidden)
    np.testing.assert_array_equal(np.asarray(gw), want.grad_weight)
