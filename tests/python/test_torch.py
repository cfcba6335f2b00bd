"""The PyTorch front end: custom op + nn.Module, against the float64 reference,
against Liger-Kernel's LigerFusedLinearGRPOLoss, opcheck, central differences,
torch.compile."""
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedgrpo  # noqa: E402
import fusedgrpo.torch as fgt  # noqa: E402
from budgets import several_chunks_budget  # noqa: E402
from grpo_reference import make_inputs, reference  # noqa: E402
from tolerance import (assert_close, assert_same_fraction, bf16_gemms_native,  # noqa: E402
                       compare_to_reference)

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]


def _t(inp):
    return {k: (torch.from_numpy(np.ascontiguousarray(v)) if v is not None else None)
            for k, v in inp.items()}


def _run_module(mod, t, dtype=torch.float32, with_bias=True, **fw):
    # Leaves of their own (.to of a tensor already in dtype is that tensor):
    # two runs on one t must not accumulate into the same .grad.
    h = t["hidden"].to(dtype, copy=True).requires_grad_()
    w = t["weight"].to(dtype, copy=True).requires_grad_()
    b = (t["bias"].to(dtype, copy=True).requires_grad_()
         if (with_bias and t["bias"] is not None) else None)
    loss, metrics = mod(h, w, t["token_ids"], t["mask"].long(), t["advantages"], b,
                        ref_per_token_logps=t.get("ref_logp"),
                        old_per_token_logps=t.get("old_logp"), **fw)
    loss.backward()
    return loss, metrics, h.grad, w.grad, None if b is None else b.grad


def central_differences(f, args, eps):
    """d f / d args by central differences, element by element (f scalar)."""
    grads = []
    for x in args:
        g = torch.zeros_like(x)
        flat = x.detach().view(-1)
        for i in range(flat.numel()):
            keep = flat[i].item()
            flat[i] = keep + eps
            up = f(*args).item()
            flat[i] = keep - eps
            down = f(*args).item()
            flat[i] = keep
            g.view(-1)[i] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


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
    compare_to_reference("f32", dict(loss=loss, metrics=metrics, grad_hidden=gh,
                                     grad_weight=gw, grad_bias=gb), want, f"{cfg}")
    t = _t(inp)
    _, _, logp, entropy = fgt.fused_linear_grpo_loss(
        t["hidden"], t["weight"], t["token_ids"], t["mask"], t["advantages"], t["bias"],
        t["old_logp"], t["ref_logp"], **cfg, entropy_coef=0.01)
    compare_to_reference("f32", dict(logp=logp, entropy=entropy), want, f"{cfg}")

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
    compare_to_reference("bf16", dict(loss=loss), want)
    assert_close("bf16_out/grad_weight", gw, want["grad_weight"])
    assert_close("bf16_out/grad_hidden", gh, want["grad_hidden"])

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
    assert torch.equal(h.grad, 3.0 * h2.grad)
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


def test_threads_and_memory_budget_reach_the_library():
    rng = np.random.default_rng(12)
    inp = make_inputs(rng, B=2, T=16, H=16, V=1031)
    budget = several_chunks_budget(**inp, beta=0.1, threads=1)
    t = _t(inp)
    args = (t["hidden"], t["weight"], t["token_ids"], t["mask"], t["advantages"], t["bias"],
            t["old_logp"], t["ref_logp"])
    _, _, logp, _ = fgt.fused_linear_grpo_loss(*args, beta=0.1, threads=1,
                                               memory_budget=budget)
    stats = fusedgrpo.memory_stats()  # this thread's context made the call
    assert stats["budget_bytes"] == budget and stats["chunks"] > 1, stats
    _, _, logp_one_chunk, _ = fgt.fused_linear_grpo_loss(*args, beta=0.1, threads=2)
    assert fusedgrpo.memory_stats()["chunks"] == 1
    if bf16_gemms_native():
        assert_close("chunking/logp", logp, logp_one_chunk)
    else:  # AVX2: oneDNN's sgemm rounds a row the same in any M, so the bits agree
        np.testing.assert_array_equal(logp.numpy(), logp_one_chunk.numpy())
    with pytest.raises(fusedgrpo.FusedGRPOError) as e:
        fgt.fused_linear_grpo_loss(*args, beta=0.1, memory_budget=1024)
    assert e.value.status == "FG_ERR_BUDGET_TOO_SMALL"


# ---------------------------------------------------------------- torch.library

def _op_args(t, requires_grad=True, dtype=torch.float32):
    h = t["hidden"].to(dtype).requires_grad_(requires_grad)
    w = t["weight"].to(dtype).requires_grad_(requires_grad)
    b = t["bias"].to(dtype).requires_grad_(requires_grad)
    args = (h, w, t["token_ids"], t["mask"], t["advantages"], b, t["old_logp"], t["ref_logp"])
    kwargs = dict(loss_type="grpo", beta=0.05,
                  epsilon_high=0.28, compute_grad_hidden=requires_grad,
                  compute_grad_weight=requires_grad, compute_grad_bias=requires_grad)
    return args, kwargs


def test_op_signature_is_keyword_only_with_optional_types():
    """Tensors positional (optional ones None by default), every option
    keyword-only with its real type: None, not a sentinel, for a default."""
    schema = str(torch.ops.fusedgrpo.linear_grpo.default._schema)
    tensors, options = schema.split(", *, ")
    assert tensors.endswith("Tensor? bias=None, Tensor? old_logp=None, Tensor? ref_logp=None, "
                            "Tensor? is_ratio=None, Tensor? sampling_logp=None"), schema
    for arg in ('str loss_type="dapo"', "float? epsilon_high=None", "float? delta=None",
                "SymInt? max_completion_length=None", "float? num_items_in_batch=None",
                "SymInt? threads=None", "SymInt? memory_budget=None"):
        assert arg in options, (arg, schema)


def test_opcheck():
    rng = np.random.default_rng(7)
    t = _t(make_inputs(rng, B=2, T=3, H=8, V=11))
    for requires_grad in (True, False):
        args, kwargs = _op_args(t, requires_grad)
        torch.library.opcheck(torch.ops.fusedgrpo.linear_grpo.default, args, kwargs)


def test_library_gradient_by_central_differences():
    """The op's autograd seen from float64 (what torch.autograd.gradcheck checks,
    with its error measured here): the op takes float32 (it refuses float64), so
    f rounds its float64 arguments to float32 and the differences carry float32
    round-off over eps. The strict float64 check is the next test (a plain-torch
    float64 loss, checked by central differences and then compared with the
    library)."""
    rng = np.random.default_rng(8)
    t = _t(make_inputs(rng, B=2, T=3, H=5, V=7))
    t64 = {k: (v.double() if v is not None and v.is_floating_point() else v)
           for k, v in t.items()}

    def f(h, w, b):
        loss, _, _, _ = fgt.fused_linear_grpo_loss(h.float(), w.float(), t["token_ids"],
                                                   t["mask"], t["advantages"], b.float(),
                                                   t["old_logp"], t["ref_logp"], beta=0.05,
                                                   loss_type="grpo", entropy_coef=0.02)
        return loss.double()

    args = tuple(t64[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    analytic = torch.autograd.grad(f(*args), args)
    with torch.no_grad():
        numeric = central_differences(f, args, eps=1e-3)
    for a, n, name in zip(analytic, numeric, ("hidden", "weight", "bias")):
        assert a.dtype == torch.float64
        assert_close("fd/library_float32", n, a, name)


def _torch_reference_loss(h, w, b, tok, mask, adv, old, ref, beta, temperature, entropy_coef):
    """TRL's grpo formulas in plain torch (materialized logits), differentiable in
    float64."""
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


def test_plain_torch_float64_loss_by_central_differences_and_against_the_library():
    rng = np.random.default_rng(9)
    inp = make_inputs(rng, B=2, T=3, H=5, V=7, bad_masked_ids=False)
    t = _t(inp)
    t64 = {k: (v.double() if v is not None and v.is_floating_point() else v)
           for k, v in t.items()}
    args = tuple(t64[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    rest = (t["token_ids"], t["mask"], t["advantages"], t64["old_logp"], t64["ref_logp"], 0.05,
            0.9, 0.02)

    def torch_loss(h, w, b):
        return _torch_reference_loss(h, w, b, *rest)

    ref_loss = torch_loss(*args)
    ref_grads = torch.autograd.grad(ref_loss, args)
    with torch.no_grad():
        numeric = central_differences(torch_loss, args, eps=1e-6)
    for n, g in zip(numeric, ref_grads):
        assert_close("fd/torch_float64", n, g)
    h, w, b = (t[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    loss, _, _, _ = fgt.fused_linear_grpo_loss(h, w, t["token_ids"], t["mask"], t["advantages"],
                                               b, t["old_logp"], t["ref_logp"], beta=0.05,
                                               loss_type="grpo", temperature=0.9,
                                               entropy_coef=0.02)
    loss.backward()
    scale = reference(**inp, beta=0.05, loss_type="grpo", temperature=0.9,
                      entropy_coef=0.02)["loss_scale"]
    assert_close("torch_float64/loss", loss, ref_loss, scale=scale)
    for got, want in zip((h.grad, w.grad, b.grad), ref_grads):
        assert_close("torch_float64/grad", got, want)


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
    for a, b in zip(*outs):  # the same C call, the same scaling: the same bits
        assert torch.equal(a, b)


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
    ("vespo", "token", {"vespo_k_pos": 1.5, "vespo_lambda_neg": 1.0}),
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
    if len(is_shape) == 2:  # 1 at padding, as TRL builds it (vespo sums its log over all T)
        inp["is_ratio"][~inp["mask"]] = 1.0
    t = _t(inp)
    cfg = {**dict(beta=0.08, epsilon_low=0.2, epsilon_high=0.2, loss_type=loss_type,
                  importance_sampling_level=level, temperature=0.8), **extra}
    outs = []
    for cls, kw in ((fgt.FusedLinearGRPOLoss, {}), (Liger, {"compiled": False})):
        mod = cls(**cfg, **kw)
        outs.append(_run_module(mod, t, vllm_is_ratio=t["is_ratio"],
                                num_items_in_batch=11 if loss_type == "dapo" else None))
    (la, ma, *ga), (lb, mb, *gb) = outs
    scale = reference(**inp, **cfg, num_items_in_batch=11 if loss_type == "dapo" else None)[
        "loss_scale"]
    assert_close("liger/loss", la, lb, scale=scale)
    assert len(ma) == len(mb)
    if cfg["beta"] != 0:
        assert_close("liger/metric_kl", ma[0], mb[0])
    # Liger's clip metric per loss type; at the sequence level Liger counts
    # tokens where TRL 1.16 (and fusedgrpo) counts sequences, and with delta
    # it tests the unclamped ratio (python/README.md, "Where Liger departs
    # from TRL").
    if level == "token" and "delta" not in extra:
        assert_same_fraction(ma[-1].item(), mb[-1].item(), "clip_ratio")
    for x, y, n in zip(ga, gb, ("grad_hidden", "grad_weight", "grad_bias")):
        assert_close(f"liger/{n}", x, y)


def test_module_takes_every_liger_constructor_argument_with_its_default():
    import inspect
    Liger = _liger()
    ours = inspect.signature(fgt.FusedLinearGRPOLoss.__init__).parameters
    for name, p in inspect.signature(Liger.__init__).parameters.items():
        assert name in ours, name
        assert ours[name].default == p.default, name
    theirs = inspect.signature(Liger.forward).parameters
    assert list(inspect.signature(fgt.FusedLinearGRPOLoss.forward).parameters) == list(theirs)


def test_liger_arguments_without_a_counterpart_are_refused():
    # Accepted: Liger's defaults, given explicitly, and either value of compiled
    # (whether Liger torch.compiles its chunk loss; the C kernel is the same).
    for kw in (dict(chunk_size=1), dict(compiled=False), dict(compiled=True),
               dict(vespo_k_pos=2.0, vespo_lambda_neg=2.0), dict(loss_type="vespo"),
               dict(vespo_k_pos=3.0)):
        fgt.FusedLinearGRPOLoss(**kw)
    with pytest.raises(ValueError, match="chunk_size=4.*memory_budget="):
        fgt.FusedLinearGRPOLoss(chunk_size=4)
    with pytest.raises(TypeError, match="compiled"):
        fgt.FusedLinearGRPOLoss(compiled="yes")
    with pytest.raises(fusedgrpo.FusedGRPOError, match="unknown impl"):
        fgt.FusedLinearGRPOLoss(impl="chunked")
