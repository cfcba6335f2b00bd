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


# ------------------------------------------------ options under torch.compile
#
# Every option is checked as the caller gave it, under torch.compile as
# eagerly: a compiled call refuses what the eager one refuses, with the same
# exception (FusedGRPOError and its status, or TypeError) and message, when
# it runs; other values retrace and are checked again.

REFUSED_OPTIONS = [
    dict(beta=True, use_bias_correction_kl=2),
    dict(use_bias_correction_kl=2), dict(temperature=True), dict(epsilon_low=False),
    dict(epsilon_high=True), dict(delta=True), dict(num_items_in_batch=True),
    dict(entropy_coef=True), dict(top_entropy_quantile=True),
    dict(off_policy_mask_threshold=True), dict(sapo_temperature_neg=True),
    dict(vespo_lambda_pos=True), dict(max_completion_length=True),
    dict(max_completion_length=2.5), dict(max_completion_length=0), dict(loss_type="nope"),
    dict(loss_type=3), dict(importance_sampling_level="batch"), dict(threads=True),
    dict(threads=0), dict(memory_budget=True), dict(memory_budget=1.5), dict(filter_eps=True),
    dict(filter_eps=-1), dict(filter_eps="always"), dict(impl="chunked"), dict(impl=1),
    dict(beta=-0.5), dict(epsilon_high=float("nan")), dict(temperature=0.0),
    dict(not_an_option=1),
]


def _recompile_limit(n):
    """torch._dynamo's recompile limit raised to n (its name before torch 2.6:
    cache_size_limit)."""
    cfg = torch._dynamo.config
    return cfg.patch(**{"recompile_limit" if hasattr(cfg, "recompile_limit")
                        else "cache_size_limit": n})


def _refusal(fn, *args, **kwargs):
    with pytest.raises((fusedgrpo.FusedGRPOError, TypeError)) as e:
        fn(*args, **kwargs)
    return type(e.value), getattr(e.value, "status", None), str(e.value)


def _options_step(t):
    def step(h, w, **options):
        loss, _, logp, _ = fgt.fused_linear_grpo_loss(
            h, w, t["token_ids"], t["mask"], t["advantages"], t["bias"], t["old_logp"],
            t["ref_logp"], **options)
        return loss, logp
    return step


def test_compiled_options_refused_as_eagerly():
    rng = np.random.default_rng(13)
    t = _t(make_inputs(rng, B=3, T=5, H=7, V=11))
    step = _options_step(t)
    good = dict(beta=0.05, loss_type="grpo", use_bias_correction_kl=True, filter_eps="auto",
                threads=1)
    want = step(t["hidden"], t["weight"], **good)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with _recompile_limit(2 * len(REFUSED_OPTIONS)):  # a trace for each
        for options in [good] + REFUSED_OPTIONS + [good]:
            if options is good:
                for x, y in zip(compiled(t["hidden"], t["weight"], **good), want):
                    assert torch.equal(x, y)
                continue
            assert _refusal(compiled, t["hidden"], t["weight"], **options) == _refusal(
                step, t["hidden"], t["weight"], **options), options
    torch._dynamo.reset()


def test_compiled_option_arguments_are_checked_on_every_call():
    """Options passed to the compiled function: dynamo guards on them (a bool,
    a string) or, once an int or float has changed, traces it as a symbolic
    number whose range the op checks when the graph runs."""
    rng = np.random.default_rng(14)
    t = _t(make_inputs(rng, B=3, T=5, H=5, V=9))

    def fn(h, w, beta, max_completion_length, use_bias_correction_kl):
        return fgt.fused_linear_grpo_loss(
            h, w, t["token_ids"], t["mask"], t["advantages"], t["bias"], t["old_logp"],
            t["ref_logp"], beta=beta, max_completion_length=max_completion_length,
            use_bias_correction_kl=use_bias_correction_kl)[0]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = (t["hidden"], t["weight"])
    with _recompile_limit(64):
        for options in [(0.1, 4, False), (0.2, 5, True), (-0.3, 5, True), (0.2, 0, False),
                        (True, 5, False), (0.25, 6, 2), (0.3, 7, True), (float("inf"), 7, True),
                        (0.35, 3, False)]:
            try:
                want = fn(*args, *options)
            except fusedgrpo.FusedGRPOError:
                assert _refusal(compiled, *args, *options) == _refusal(fn, *args, *options), \
                    options
            else:
                assert compiled(*args, *options).item() == want.item(), options
    torch._dynamo.reset()


def test_compiled_module_and_logprobs_refuse_as_eagerly():
    rng = np.random.default_rng(15)
    t = _t(make_inputs(rng, B=3, T=3, H=5, V=7))
    mod = fgt.FusedLinearGRPOLoss(beta=0.05)
    mod.beta = True  # an attribute set after the constructor's checks

    def module_step(h, w):
        return mod(h, w, t["token_ids"], t["mask"], t["advantages"],
                   ref_per_token_logps=t["ref_logp"])[0]

    def logprobs_step(h, w, **options):
        return fgt.linear_logprobs(h, w, t["token_ids"], t["mask"], **options)

    cases = [(module_step, {}), (logprobs_step, dict(temperature=True)),
             (logprobs_step, dict(temperature=-1.0)), (logprobs_step, dict(impl="chunked")),
             (logprobs_step, dict(threads=True)), (logprobs_step, dict(memory_budget=False))]
    for fn, options in cases:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        eager = _refusal(fn, t["hidden"], t["weight"], **options)
        assert eager[0] is fusedgrpo.FusedGRPOError
        assert _refusal(compiled, t["hidden"], t["weight"], **options) == eager, options
    # good values retrace and run
    mod.beta = 0.05
    torch._dynamo.reset()
    for fn in (module_step, logprobs_step):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(t["hidden"], t["weight"]), fn(t["hidden"], t["weight"]))
    torch._dynamo.reset()


def test_compiled_options_refused_under_inductor():
    """The default backend (Inductor; on the CPU it compiles C++): the probe's
    case and a range refused when the graph runs, then a good call."""
    rng = np.random.default_rng(16)
    t = _t(make_inputs(rng, B=3, T=3, H=5, V=7))
    step = _options_step(t)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for options in (dict(beta=True, use_bias_correction_kl=2), dict(beta=-0.5),
                    dict(filter_eps=-1)):
        assert _refusal(compiled, t["hidden"], t["weight"], **options) == _refusal(
            step, t["hidden"], t["weight"], **options), options
    good = dict(beta=0.05, use_bias_correction_kl=True)
    for x, y in zip(compiled(t["hidden"], t["weight"], **good),
                    step(t["hidden"], t["weight"], **good)):
        assert torch.equal(x, y)
    torch._dynamo.reset()
