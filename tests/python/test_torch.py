"""The PyTorch front end: custom op + nn.Module, against the float64 reference,
against Liger-Kernel's LigerFusedLinearGRPOLoss, opcheck, gradcheck, compile."""
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedgrpo.torch as fgt  # noqa: E402
from grpo_reference import make_inputs, reference  # noqa: E402

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"]


def _t(inp):
    return {k: (torch.from_numpy(np.ascontiguousarray(v)) if v is not None else None)
            for k, v in inp.items()}


def _run_module(mod, t, dtype=torch.float32, with_bias=True, **fw):
    h = t["hidden"].to(dtype).requires_grad_()
    w = t["weight"].to(dtype).requires_grad_()
    b = t["bias"].to(dtype).requires_grad_() if (with_bias and t["bias"] is not None) else None
    loss, metrics = mod(h, w, t["token_ids"], t["mask"].long(), t["advantages"], b,
                        ref_per_token_logps=t.get("ref_logp"),
                        old_per_token_logps=t.get("old_logp"), **fw)
    loss.backward()
    return loss, metrics, h.grad, w.grad, None if b is None else b.grad


def _close(a, b, name, rtol=1e-3, atol_frac=2e-4):
    a = np.asarray(a.detach().to(torch.float64) if torch.is_tensor(a) else a, np.float64)
    b = np.asarray(b.detach().to(torch.float64) if torch.is_tensor(b) else b, np.float64)
    scale = max(np.abs(b).max(), 1e-3)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol_frac * scale + 1e-7, err_msg=name)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_module_matches_reference(loss_type, level):
    rng = np.random.default_rng(zlib.crc32(f"{loss_type}{level}".encode()))
    inp = make_inputs(rng, B=3, T=6, H=20, V=37)
    eh = 1.2 if loss_type == "cispo" else 0.25
    cfg = dict(beta=0.07, epsilon_low=0.2, epsilon_high=eh, loss_type=loss_type,
               importance_sampling_level=level, temperature=0.9, max_completion_length=8,
               delta=1.4 if loss_type in ("grpo", "dapo") else None)
    mod = fgt.FusedLinearGRPOLoss(**cfg, entropy_coef=0.01, return_metrics_dict=True)
    loss, metrics, gh, gw, gb = _run_module(mod, _t(inp))
    want = reference(**inp, **cfg, entropy_coef=0.01)
    assert loss.item() == pytest.approx(want["loss"], rel=2e-4, abs=1e-6)
    for k, v in want["metrics"].items():
        assert metrics[k].item() == pytest.approx(v, rel=1e-4, abs=1e-6), k
    _close(gh, want["grad_hidden"], "grad_hidden")
    _close(gw, want["grad_weight"], "grad_weight")
    _close(gb, want["grad_bias"], "grad_bias")


def test_bfloat16_grads_in_input_dtype():
    rng = np.random.default_rng(3)
    inp = make_inputs(rng, B=2, T=5, H=24, V=41)
    mod = fgt.FusedLinearGRPOLoss(beta=0.04, loss_type="dapo")
    loss, metrics, gh, gw, gb = _run_module(mod, _t(inp), dtype=torch.bfloat16)
    assert gh.dtype == gw.dtype == gb.dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and len(metrics) == 2
    rounded = {k: (torch.from_numpy(inp[k]).to(torch.bfloat16).float().numpy()
                   if k in ("hidden", "weight", "bias") else v) for k, v in inp.items()}
    want = reference(**rounded, beta=0.04, epsilon_high=0.2)
    assert loss.item() == pytest.approx(want["loss"], rel=1e-3, abs=1e-5)
    _close(gw, want["grad_weight"], "grad_weight", rtol=2e-2, atol_frac=1e-2)
    _close(gh, want["grad_hidden"], "grad_hidden", rtol=2e-2, atol_frac=1e-2)


def test_grad_output_scaling_and_frozen_weight():
    rng = np.random.default_rng(4)
    t = _t(make_inputs(rng, B=2, T=4, H=8, V=13))
    mod = fgt.FusedLinearGRPOLoss(beta=0.0, loss_type="grpo")
    h = t["hidden"].clone().requires_grad_()
    w = t["weight"].clone()  # frozen LM head: no grad_weight GEMM
    loss, _ = mod(h, w, t["token_ids"], t["mask"], t["advantages"],
                  old_per_token_logps=t["old_logp"])
    (3.0 * loss).backward()
    h2 = t["hidden"].clone().requires_grad_()
    loss2, _ = mod(h2, w, t["token_ids"], t["mask"], t["advantages"],
                   old_per_token_logps=t["old_logp"])
    loss2.backward()
    torch.testing.assert_close(h.grad, 3.0 * h2.grad)
    assert w.grad is None


def test_ref_input_path_equals_ref_logps():
    rng = np.random.default_rng(5)
    inp = make_inputs(rng, B=2, T=4, H=8, V=13, bad_masked_ids=False)
    t = _t(inp)
    ref_w = t["weight"] * 0.9
    mod = fgt.FusedLinearGRPOLoss(beta=0.1, loss_type="bnpo")
    with torch.no_grad():
        _, _, ref_lp, _ = fgt.fused_linear_grpo_loss(t["hidden"], ref_w, t["token_ids"],
                                                      t["mask"], t["advantages"])
    a = mod(t["hidden"], t["weight"], t["token_ids"], t["mask"], t["advantages"],
            ref_per_token_logps=ref_lp)
    b = mod(t["hidden"], t["weight"], t["token_ids"], t["mask"], t["advantages"],
            ref_input=t["hidden"], ref_weight=ref_w)
    assert a[0].item() == b[0].item()
    assert a[1][0].item() == b[1][0].item()
    with pytest.raises(ValueError):
        mod(t["hidden"], t["weight"], t["token_ids"], t["mask"], t["advantages"])


def test_errors_surface_as_fusedgrpo_error():
    import fusedgrpo
    rng = np.random.default_rng(6)
    t = _t(make_inputs(rng, B=2, T=3, H=4, V=5))
    tok = t["token_ids"].clone()
    tok[0, 0] = 99
    with pytest.raises(fusedgrpo.FusedGRPOError) as e:
        fgt.FusedLinearGRPOLoss(beta=0.0)(t["hidden"], t["weight"], tok,
                                          torch.ones_like(t["mask"]), t["advantages"])
    assert e.value.status == "FG_ERR_TOKEN_OUT_OF_RANGE"


# ---------------------------------------------------------------- torch.library

def _op_args(t, requires_grad=True, dtype=torch.float32):
    h = t["hidden"].to(dtype).requires_grad_(requires_grad)
    w = t["weight"].to(dtype).requires_grad_(requires_grad)
    b = t["bias"].to(dtype).requires_grad_(requires_grad)
    return (h, w, t["token_ids"], t["mask"], t["advantages"], b, t["old_logp"], t["ref_logp"],
            None, "grpo", "token", 0.05, 0.2, 0.28, 0.0, 1.0, 0, -1.0, 1.0, 1.05, False, 0.0,
            requires_grad, requires_grad, requires_grad, "fused", 0, 0)


def test_opcheck():
    rng = np.random.default_rng(7)
    t = _t(make_inputs(rng, B=2, T=3, H=8, V=11))
    torch.library.opcheck(torch.ops.fusedgrpo.linear_grpo.default, _op_args(t))
    torch.library.opcheck(torch.ops.fusedgrpo.linear_grpo.default, _op_args(t, False))


def test_gradcheck_float64_wrapper():
    """torch.autograd.gradcheck in float64. Honest caveat: the kernel computes in
    float32 inside (float64 inputs are rounded to float32), so the numerical
    Jacobian carries float32 round-off amplified by 1/eps: we use eps=1e-3 and
    loose tolerances. The strict float64 check is the next test (the pure
    reference gradchecked exactly and compared to the kernel)."""
    rng = np.random.default_rng(8)
    t = _t(make_inputs(rng, B=2, T=3, H=5, V=7))
    t64 = {k: (v.double() if v is not None and v.is_floating_point() else v)
           for k, v in t.items()}

    def f(h, w, b):
        loss, _, _, _ = fgt.fused_linear_grpo_loss(h, w, t["token_ids"], t["mask"],
                                                   t["advantages"], b, t["old_logp"],
                                                   t["ref_logp"], beta=0.05, loss_type="grpo",
                                                   entropy_coef=0.02)
        return loss.double()

    args = tuple(t64[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    assert torch.autograd.gradcheck(f, args, eps=1e-3, atol=2e-3, rtol=2e-2)


def _torch_reference_loss(h, w, b, tok, mask, adv, old, ref, beta, temperature, entropy_coef):
    """TRL's grpo formulas in plain torch (materialized logits) for gradcheck."""
    logits = (h @ w.T + b) / temperature
    lsm = torch.log_softmax(logits, -1)
    m = mask.to(h.dtype)
    logp = torch.gather(lsm, -1, tok.clamp(0, w.shape[0] - 1)[..., None])[..., 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    ratio = torch.exp(logp - old)
    A = adv[:, None].to(h.dtype)
    L = -torch.min(ratio * A, torch.clamp(ratio, 0.8, 1.2) * A)
    d = ref - logp
    L = L + beta * (torch.exp(d) - d - 1)
    loss = ((L * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    return loss - entropy_coef * (ent * m).sum() / m.sum().clamp(min=1)


def test_gradcheck_pure_reference_and_compare():
    rng = np.random.default_rng(9)
    t = _t(make_inputs(rng, B=2, T=3, H=5, V=7, bad_masked_ids=False))
    t64 = {k: (v.double() if v is not None and v.is_floating_point() else v)
           for k, v in t.items()}
    args = tuple(t64[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    rest = (t["token_ids"], t["mask"], t["advantages"], t64["old_logp"], t64["ref_logp"], 0.05,
            0.9, 0.02)
    assert torch.autograd.gradcheck(lambda h, w, b: _torch_reference_loss(h, w, b, *rest), args)
    ref_loss = _torch_reference_loss(*args, *rest)
    ref_grads = torch.autograd.grad(ref_loss, args)
    h, w, b = (t[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    loss, _, _, _ = fgt.fused_linear_grpo_loss(h, w, t["token_ids"], t["mask"], t["advantages"],
                                               b, t["old_logp"], t["ref_logp"], beta=0.05,
                                               loss_type="grpo", temperature=0.9,
                                               entropy_coef=0.02)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-7)
    for got, want in zip((h.grad, w.grad, b.grad), ref_grads):
        _close(got, want, "grad", rtol=1e-4, atol_frac=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile(backend):
    rng = np.random.default_rng(10)
    t = _t(make_inputs(rng, B=2, T=4, H=8, V=13))
    mod = fgt.FusedLinearGRPOLoss(beta=0.05, loss_type="dapo")

    def step(h, w, b):
        loss, metrics = mod(h, w, t["token_ids"], t["mask"], t["advantages"], b,
                            ref_per_token_logps=t["ref_logp"],
                            old_per_token_logps=t["old_logp"])
        return loss * 2.0 + 0.0 * metrics[0]

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    outs = []
    for fn in (step, compiled):
        args = [t[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
        fn(*args).backward()
        outs.append([a.grad for a in args])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- Liger

def _liger():
    pytest.importorskip("liger_kernel")
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as e:  # triton / CUDA import problems
        pytest.skip(f"liger_kernel unusable here: {e}")
    return LigerFusedLinearGRPOLoss


# (loss_type, level, extra config) where Liger's semantics coincide with the spec.
LIGER_CASES = [
    ("grpo", "token", {}),
    ("grpo", "sequence", {}),
    ("bnpo", "token", {"delta": 1.3}),
    ("dr_grpo", "token", {"max_completion_length": 7}),
    ("dapo", "token", {"use_bias_correction_kl": True}),
    ("dapo", "sequence", {"epsilon_high": 0.28}),
    ("luspo", "sequence", {"beta": 0.0}),
    ("cispo", "token", {"epsilon_high": 1.1}),
    ("sapo", "token", {"sapo_temperature_neg": 1.5}),
]


@pytest.mark.parametrize("case", LIGER_CASES, ids=[f"{a}-{b}" for a, b, _ in LIGER_CASES])
def test_against_liger(case):
    Liger = _liger()
    loss_type, level, extra = case
    rng = np.random.default_rng(zlib.crc32(f"liger{loss_type}{level}".encode()))
    inp = make_inputs(rng, B=3, T=5, H=16, V=37, bad_masked_ids=False)
    # LUSPO: Liger (like TRL) also weights masked positions; with a per-sequence
    # loss (sequence level, no KL, per-sequence is_ratio) that weighting coincides.
    is_shape = (3,) if loss_type == "luspo" else (3, 5)
    inp["is_ratio"] = rng.uniform(0.7, 1.3, is_shape).astype(np.float32)
    t = _t(inp)
    cfg = {**dict(beta=0.08, epsilon_low=0.2, epsilon_high=0.2, loss_type=loss_type,
                  importance_sampling_level=level, temperature=0.8), **extra}
    outs = []
    for cls, kw in ((fgt.FusedLinearGRPOLoss, {}), (Liger, {"compiled": False})):
        mod = cls(**cfg, **kw)
        outs.append(_run_module(mod, t, vllm_is_ratio=t["is_ratio"],
                                num_items_in_batch=11 if loss_type == "dapo" else None))
    (la, ma, *ga), (lb, mb, *gb) = outs
    assert la.item() == pytest.approx(lb.item(), rel=1e-5, abs=1e-6)
    assert len(ma) == len(mb)
    if cfg["beta"] != 0:
        assert ma[0].item() == pytest.approx(mb[0].item(), rel=1e-5, abs=1e-6)  # kl
    if loss_type not in ("cispo", "sapo"):  # Liger's clip metric differs there (see module doc)
        assert ma[-1].item() == pytest.approx(mb[-1].item(), abs=1e-6)
    for x, y, n in zip(ga, gb, ("grad_hidden", "grad_weight", "grad_bias")):
        _close(x, y, n, rtol=1e-4, atol_frac=1e-5)
