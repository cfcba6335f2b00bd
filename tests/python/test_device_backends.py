"""The torch front end on the library's backends behind the per-chunk seam.

- The seam's reference backend on host memory, in place of the CPU context:
  the op's C calls then take the path a CUDA context takes (token arrays
  staged, the loss math on the host per chunk, the backend's chunk work),
  on any machine. Against the CPU backend on the same inputs.
- CUDA tensors (skipped without a CUDA device): the op, the module and the
  log-probs through the CUDA backend against the CPU op on the same inputs,
  every loss type at both levels, f32 (TF32 off) and bf16.
- torch.compile(fullgraph=True) on CUDA tensors against eager (CUDA only; the
  CPU's compile test is test_torch.py's).
- CUDA graph capture (CUDA only): the C call reads statuses on the host
  (cudaStreamSynchronize on the capturing stream), so it cannot be captured;
  an attempt fails with an exception, and afterwards the op works.
- bf16 autocast (CPU, and CUDA when present): TRL's head (bf16 logits) and
  fusedgrpo's (float32 logits of the same bf16 operands) against a float64
  reference; fusedgrpo must be at least as close.
"""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedgrpo._lib as fl  # noqa: E402
import fusedgrpo._torch_inputs as ti  # noqa: E402
import fusedgrpo.torch as fgt  # noqa: E402
from grpo_reference import log_softmax_rows, make_inputs, reference  # noqa: E402

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


def _seed(loss_type, level):
    """A fixed seed per case (Python's hash() of a str is salted per process,
    so a seed drawn from it gave other data on every run)."""
    return 1000 * LOSS_TYPES.index(loss_type) + 100 * (level == "sequence")


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _close(a, b, rtol, what):
    err = _rel_l2(a, b)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


@pytest.fixture
def reference_backend(monkeypatch):
    """CPU tensors through the reference backend's context."""
    monkeypatch.setattr(ti, "call_context", lambda device: fl.device_context("reference"))


def reference_errors(seed, loss_type, level):
    """The torch op on _tensors(seed) through the reference backend's context
    against the CPU context: each quantity's relative error, with the class of
    tolerance that bounds it (REFERENCE_TOL)."""
    t = _tensors(seed)
    opts = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                temperature=0.8, memory_budget=None)
    cpu_context = ti.call_context
    ti.call_context = lambda device: fl.device_context("reference")
    try:
        got = _loss_and_grads(t, **opts)
    finally:
        ti.call_context = cpu_context
    want = _loss_and_grads(t, **opts)

    def rel(a, b):
        return abs(a - b).item() / max(1.0, abs(b.item()))

    errors = {"loss": ("loss", rel(got[0], want[0]))}
    errors.update({"metric " + k: ("loss", rel(got[1][k], want[1][k])) for k in want[1]})
    errors.update({name: ("logp", _rel_l2(got[i], want[i]))
                   for i, name in ((2, "logp"), (3, "entropy"))})
    errors.update({name: ("grads", _rel_l2(got[i], want[i]))
                   for i, name in ((4, "grad_hidden"), (5, "grad_weight"), (6, "grad_bias"))})
    return errors


# Reference backend against the CPU's, both f32 with their own product orders:
# about 4x the worst of 200 seeds a case, every loss type and level, on
# oneDNN's AVX2 and SSE4.1 kernels (AMD EPYC Zen 3; run
# measure_reference_backend_error.py): loss and metrics 3.6e-6 (kl; the loss
# 2.9e-6), logp and entropy 3.5e-7, gradients 8.8e-6 (sapo at sequence level,
# whose weights amplify a log-ratio's error).
REFERENCE_TOL = dict(loss=1.5e-5, logp=1.5e-6, grads=4e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_reference_backend_matches_cpu(loss_type, level):
    for what, (kind, err) in reference_errors(_seed(loss_type, level), loss_type, level).items():
        assert err <= REFERENCE_TOL[kind], f"{what}: relative error {err:.3g} > {REFERENCE_TOL[kind]:g}"


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
    seed = _seed(loss_type, level)
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
    _check_cuda_against_cpu(got, want, dtype == torch.float32)


def _check_cuda_against_cpu(got, want, f32):
    """_loss_and_grads of a CUDA call against the CPU's on the same inputs."""
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


# ------------------------------------------------------ torch.compile on CUDA

@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_torch_compile_matches_eager(dtype):
    """fullgraph=True on CUDA tensors: the op is one node of the graph (its
    fake kernel gives the shapes), and the compiled step makes the C call that
    eager makes, on the same inputs. The loss is scaled so that both take the
    backward's scaling branch (eager hands the saved gradients over unscaled
    only for an incoming gradient of exactly 1)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    t = _tensors(31, "cuda", dtype)

    def step(h, w, b):
        loss, metrics, logp, ent = fgt.fused_linear_grpo_loss(
            h, w, t["token_ids"], t["mask"], t["advantages"], b, t["old_logp"], t["ref_logp"],
            loss_type="grpo", beta=0.04, temperature=0.8)
        return loss * 0.5, metrics["kl"], logp, ent

    compiled = torch.compile(step, fullgraph=True)
    outs = []
    for fn in (step, compiled):
        args = [t[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
        loss, kl, logp, ent = fn(*args)
        loss.backward()
        outs.append([x.detach() for x in (loss, kl, logp, ent)] + [a.grad for a in args])
    torch.cuda.synchronize()
    names = ("loss", "kl", "logp", "entropy", "grad_hidden", "grad_weight", "grad_bias")
    for name, got, want in zip(names, outs[1], outs[0]):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        # The same C call on the same inputs gives the same bits; the margin is
        # for a GEMM algorithm cuBLASLt might pick differently for other
        # addresses (another summation order): float32 rounding, and for bf16
        # gradients one bf16 rounding (2^-8).
        bf16_grad = dtype == torch.bfloat16 and name.startswith("grad")
        _close(got, want, 2.0 ** -8 if bf16_grad else 1e-6, name)


# ------------------------------------------------------ CUDA graph capture

def _capture_attempt(t, stream):
    """The op's forward under torch.cuda.graph on `stream`: the exception the
    attempt ends with. The C call fails at its first host read on a
    capturing stream (cudaStreamSynchronize; on a stream the op has not run on
    yet, already when its C context allocates the cuBLASLt workspace with
    cudaMalloc, refused in capture_error_mode "global"): FusedGRPOError.
    That failure invalidates the capture, so torch's capture_end then raises
    a RuntimeError, which replaces it (the library's error is its
    __context__); either is accepted here. Nothing waits on the capture: a
    CUDA call that a capture forbids returns an error at once, so a failure
    cannot hang."""
    h = t["hidden"].clone().requires_grad_()
    w = t["weight"].clone().requires_grad_()
    graph = torch.cuda.CUDAGraph()
    # The outer stream context puts torch's current stream back however the
    # capture ends (torch's graph context of older releases left the capture
    # stream current when capture_end raised).
    try:
        with torch.cuda.stream(torch.cuda.current_stream()):
            with torch.cuda.graph(graph, stream=stream):
                fgt.fused_linear_grpo_loss(h, w, t["token_ids"], t["mask"], t["advantages"],
                                           t["bias"], t["old_logp"], t["ref_logp"], beta=0.04)
    except (fl.FusedGRPOError, RuntimeError) as e:
        err = e
    else:
        pytest.fail("the op was captured in a CUDA graph: python/README.md says it cannot "
                    "be; update it and this test")
    del graph
    return err


def _chain(err):
    """err and the exceptions it was raised from or while handling."""
    out = []
    while err is not None and err not in out:
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


@cuda
def test_cuda_graph_capture_fails_cleanly():
    """The C call waits for the stream on the host (token ids, the NaN scan,
    each chunk's log-probs for the loss math), which a CUDA graph cannot
    hold: capturing it fails with an exception, on a stream the op has never
    run on and on one it has (warmed up, as torch.cuda.graph asks), and the
    device, torch's current stream and the op are fine afterwards."""
    torch.backends.cuda.matmul.allow_tf32 = False
    want = _loss_and_grads(_tensors(41, "cpu"))
    t = _tensors(41, "cuda")
    fresh, warm = torch.cuda.Stream(), torch.cuda.Stream()
    errors = [_capture_attempt(t, fresh)]
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        warmed = _loss_and_grads(t)
    _check_cuda_against_cpu(warmed, want, True)
    errors.append(_capture_attempt(t, warm))
    for err in errors:  # the op's C call refused, whatever torch raised after it
        assert any(isinstance(e, fl.FusedGRPOError) for e in _chain(err)), \
            " <- ".join(f"{type(e).__name__}: {e}" for e in _chain(err))
    # Nothing is left capturing, and a kernel of torch's runs (a stale CUDA
    # error would fail its launch check).
    assert not torch.cuda.is_current_stream_capturing()
    fresh.synchronize()  # refused on a stream still capturing
    warm.synchronize()
    assert float(torch.ones(8, device="cuda").sum()) == 8.0
    torch.cuda.synchronize()
    _check_cuda_against_cpu(_loss_and_grads(_tensors(41, "cuda")), want, True)
    for s in (fresh, warm):  # the contexts of the capture streams work too
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            got = _loss_and_grads(t)
        torch.cuda.synchronize()
        _check_cuda_against_cpu(got, want, True)


# ------------------------------------------------------ bf16 autocast vs TRL
#
# TRL's default bf16=True runs the step under torch.autocast(bfloat16): TRL's
# head is the model's nn.Linear, whose logits autocast rounds to bf16
# (accelerate then hands them over as float32, and TRL's log-softmax runs in
# float32 on those rounded values). fusedgrpo.trl casts hidden and weight to
# the autocast dtype as that nn.Linear would, then calls the op with autocast
# off: the same bf16 operands, float32 logits. The op itself is not
# autocast-aware (a torch.library.custom_op with no autocast kernel): under
# autocast it gets its tensors as they are, float32 ones computing in float32.

AC_B, AC_T, AC_H, AC_V = 3, 37, 96, 1031
AC_LOSS = dict(loss_type="grpo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28)
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


def _autocast_inputs(seed):
    """Random inputs, logits of a few units (std ~2). hidden and weight are
    float32 values that bf16 holds exactly: a bf16 model's hidden states are
    bf16, and the weight's rounding to bf16 is the same cast in both heads.
    Without that, the operands' rounding (the same in both arms) would add
    one shared error to both and blur the difference under test, the
    logits'. Ragged sequences of 37, 31 and 24 tokens (none so short that a
    few tokens dominate the gradients), and log-ratios to old_logp at least
    0.07 away from the clip edges log(0.8) and log(1.28), so that no token's
    gradient switches on or off with a rounding of its log-prob."""
    B, T, H, V = AC_B, AC_T, AC_H, AC_V
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, B=B, T=T, H=H, V=V, bias=False, off_policy=False,
                      bad_masked_ids=False)
    for k in ("hidden", "weight"):
        inp[k] = torch.from_numpy(inp[k]).to(torch.bfloat16).float().numpy()
    inp["mask"] = np.arange(T)[None, :] < np.array([T, T - 6, T - 13])[:, None]
    inp["token_ids"][~inp["mask"]] = V + 1000  # never read
    z = inp["hidden"].astype(np.float64) @ inp["weight"].astype(np.float64).T
    cur = np.take_along_axis(log_softmax_rows(z), inp["token_ids"].clip(0, V - 1)[..., None],
                             -1)[..., 0]
    d = np.choose(rng.integers(0, 3, (B, T)), [rng.uniform(-0.6, -0.3, (B, T)),
                                                rng.uniform(-0.15, 0.15, (B, T)),
                                                rng.uniform(0.32, 0.6, (B, T))])
    inp["old_logp"] = (cur - d).astype(np.float32)
    return inp


def _trl_head(h, w, tok, autocast=True):
    """TRL 1.16's per-token log-probs: the model's nn.Linear head (under
    autocast: bf16 logits), handed over in float32 (accelerate's
    convert_outputs_to_fp32), then selective_log_softmax's float32 path,
    logit minus logsumexp."""
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = torch.nn.functional.linear(h, w)
    logits = logits.to(h.dtype)
    return logits.gather(-1, tok[..., None])[..., 0] - torch.logsumexp(logits, -1)


def _trl_loss(logp, old, ref, adv, mask):
    """TRL 1.16's GRPOTrainer._compute_loss for AC_LOSS (loss_type "grpo",
    token level, beta != 0)."""
    c = AC_LOSS
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - c["epsilon_low"], 1 + c["epsilon_high"])
    a = adv[:, None]
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    d = ref - logp
    per_token = per_token + c["beta"] * (torch.exp(d) - d - 1)
    m = mask.to(logp.dtype)
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def _ac_tensors(inp, device, dtype=torch.float32):
    t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device)
         for k, v in inp.items() if v is not None}
    for k in ("hidden", "weight", "old_logp", "ref_logp", "advantages"):
        t[k] = t[k].to(dtype)
    t["safe_ids"] = torch.where(t["mask"], t["token_ids"], 0)
    return t


def _trl_arm(t, autocast=True):
    """(loss, logp, grad_hidden, grad_weight) of TRL's head and loss."""
    h = t["hidden"].clone().requires_grad_()
    w = t["weight"].clone().requires_grad_()
    logp = _trl_head(h, w, t["safe_ids"], autocast)
    loss = _trl_loss(logp, t["old_logp"], t["ref_logp"], t["advantages"], t["mask"])
    loss.backward()
    return loss.detach(), logp.detach(), h.grad, w.grad


def _fused_arm(t, trainer_cast):
    """(loss, logp, grad_hidden, grad_weight) of the op, the step under bf16
    autocast: trainer_cast, as fusedgrpo.trl calls it (the operands cast to
    the autocast dtype, autocast off for the call); else the op called under
    autocast with the float32 tensors."""
    h = t["hidden"].clone().requires_grad_()
    w = t["weight"].clone().requires_grad_()
    dev = h.device.type
    with torch.autocast(dev, dtype=torch.bfloat16):
        hh, ww, ctx = h, w, contextlib.nullcontext()
        if trainer_cast:
            dt = torch.get_autocast_dtype(dev)
            hh, ww, ctx = h.to(dt), w.to(dt), torch.autocast(dev, enabled=False)
        with ctx:
            loss, _, logp, _ = fgt.fused_linear_grpo_loss(
                hh, ww, t["token_ids"], t["mask"], t["advantages"], None, t["old_logp"],
                t["ref_logp"], **AC_LOSS)
    loss.backward()
    return loss.detach(), logp.detach(), h.grad, w.grad


def _errors(arm, ref, mask):
    """An arm's errors against the float64 reference, normwise relative (L2):
    the loss relative to the loss of its terms' magnitudes, logp over the
    unmasked tokens."""
    def rel(a, b):
        a = a.detach().cpu().double().numpy() if hasattr(a, "detach") else np.asarray(a)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    loss, logp, gh, gw = arm
    return dict(loss=abs(float(loss) - ref["loss"]) / ref["loss_scale"],
                logp=rel(logp.cpu()[torch.from_numpy(mask)], ref["logp"][mask]),
                grad_hidden=rel(gh, ref["grad_hidden"]), grad_weight=rel(gw, ref["grad_weight"]))


def test_trl_head_float64_matches_reference():
    """The TRL arm itself, in float64 without autocast, is the reference's
    loss: loss and log-probs to float64 rounding, the gradients to the
    reference's central differences (~4e-9 measured)."""
    inp = _autocast_inputs(50)
    ref = reference(inp["hidden"], inp["weight"], inp["token_ids"], inp["mask"],
                    inp["advantages"], inp["old_logp"], inp["ref_logp"], **AC_LOSS)
    err = _errors(_trl_arm(_ac_tensors(inp, "cpu", torch.float64), autocast=False), ref,
                  inp["mask"])
    for k, e in err.items():
        assert e <= 5e-8, (k, e)


@pytest.mark.parametrize("device", DEVICES)
def test_op_under_autocast_gets_float32(device):
    """Under bf16 autocast the op gets float32 tensors as they are (no
    autocast kernel: the dispatcher falls through to the op's own): it
    computes in float32 and returns float32 gradients, as without autocast."""
    t = _tensors(60, device)
    args = (t["hidden"], t["weight"], t["token_ids"], t["mask"], t["advantages"], t["bias"])
    with torch.autocast(device, dtype=torch.bfloat16):
        out = fgt.linear_grpo(*args)
    plain = fgt.linear_grpo(*args)
    assert [o.dtype for o in out] == [torch.float32] * 7
    for i, name in enumerate(("loss", "metrics", "logp", "entropy", "grad_hidden",
                              "grad_weight", "grad_bias")):
        _close(out[i].cpu(), plain[i].cpu(), 1e-6, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [70, 71, 72])
def test_bf16_autocast_at_least_as_close_as_trl(device, seed):
    """TRL's bf16 head and fusedgrpo's, the step under bf16 autocast, against
    float64 (B, T, H, V = 3, 37, 96, 1031): the loss, the per-token log-probs
    and both gradients of fusedgrpo's at least as close as TRL's.

    Both multiply the same bf16 operands with float32 sums; TRL rounds the
    logits to bf16 (half an ulp: up to 2^-8 of a logit), fusedgrpo keeps them
    in float32. The gradients of both are rounded to bf16 on the way out (TRL:
    its bf16 products; fusedgrpo: bf16 inputs' gradients), and on a GPU both
    round dlogits to bf16 for the backward products: those roundings are
    independent draws of the same size in the two arms, so fusedgrpo's
    gradients come out ahead only by TRL's rounded logits. The slack of 1.05
    keeps that comparison from failing on a draw where the shared-size
    roundings dominate (measured here and in a simulation of the GPU's
    roundings: fusedgrpo's gradient errors 0.25-0.75 of TRL's, log-prob and
    loss errors below 1e-3 of TRL's)."""
    inp = _autocast_inputs(seed)
    ref = reference(inp["hidden"], inp["weight"], inp["token_ids"], inp["mask"],
                    inp["advantages"], inp["old_logp"], inp["ref_logp"], **AC_LOSS)
    t = _ac_tensors(inp, device)
    errs = {"trl": _errors(_trl_arm(t), ref, inp["mask"]),
            "fused (as fusedgrpo.trl: bf16 operands)": _errors(_fused_arm(t, True), ref,
                                                               inp["mask"]),
            "fused (the op under autocast: float32)": _errors(_fused_arm(t, False), ref,
                                                              inp["mask"])}
    trl = errs["trl"]
    # TRL's arm did round its logits to bf16 (else this comparison is empty).
    assert trl["logp"] > 1e-5, trl
    for arm, e in errs.items():
        for k in trl:
            assert e[k] <= 1.05 * trl[k], f"{arm}: {k} error {e[k]:.3g} > TRL's {trl[k]:.3g}"
