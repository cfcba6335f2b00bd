"""fusedgrpo.jax on GPU devices: the FFI handler's CUDA targets against the
CPU path on the same inputs.

Two device paths, each compared with the CPU path (the CPU handler, and the
host callback for linear_logprobs) in the same process:
  cuda       the inputs on a CUDA device: jitted loss and gradients through
             fusedgrpo_linear_grpo_cuda, linear_logprobs (and its gradient)
             through the log-prob targets; the CPU path gets the same inputs
             committed to the CPU device. Skipped without a CUDA device (jax
             has none on a CPU-only machine).
  reference  the same handler bodies over the C library's reference backend
             on host memory (fgj._device_path_on_cpu): the device path's
             operands (int64 token words, traced scalars read back, loss and
             metrics written as device results) through XLA on any machine.
Every loss type, token and sequence level, float32 and bfloat16 inputs; a bad
token id refused; shard_map refused on a GPU mesh.

Tolerances (|got - want| <= tol per value, M = max |want| over the array; the
reasoning of cuda/test_cuda_api.cu, whose tolerances these are):
  loss, metrics      1e-4 * (1 + |want|): the same host loss code on float32
                     logp whose logits were summed in another order;
  logp, entropy      2e-5 * (1 + |want|);
  gradients, f32     1e-4 * |want| + 2e-5 * M (true float32 on both, no TF32);
  gradients, bf16    2^-7 * |want| + 2^-7 * M (tensor-core products on bf16
                     dlogits, bf16 outputs rounded on each side).
Each check prints its worst error as a fraction of its tolerance.

Run by pytest, or as a script on a GPU machine (`python3 test_jax_cuda.py`:
the cuda checks, exit 77 with "skipped: <reason>" without a CUDA device).
"""
import os
import sys

import numpy as np

try:
    import pytest
except ImportError:  # the script mode needs no pytest
    pytest = None

if pytest is not None:
    jax = pytest.importorskip("jax")
else:
    import jax
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedgrpo  # noqa: E402
import fusedgrpo.jax as fgj  # noqa: E402
from fusedgrpo import _options  # noqa: E402
from grpo_reference import make_inputs  # noqa: E402

LOSS_TYPES = list(_options.LOSS_TYPES)
LEVELS = ["token", "sequence"]
DTYPES = ["float32", "bfloat16"]
PATHS = ["cuda", "reference"]

TOL_SCALAR = (1e-4, 0.0)   # * (1 + |want|)
TOL_TOKEN = (2e-5, 0.0)    # * (1 + |want|)
TOL_GRAD = {"float32": (1e-4, 2e-5), "bfloat16": (2.0 ** -7, 2.0 ** -7)}  # * |want|, * M


def cuda_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


def why_no_path(path):
    """None when `path` can run here, else why not."""
    if path == "cuda" and not cuda_devices():
        return "no CUDA device (jax has no gpu devices on this machine)"
    return None  # a handler without the CUDA targets fails the checks, not skips them


class DevicePath:
    """Puts inputs where the device path runs and runs a function there; the
    CPU path's inputs go to the CPU device."""

    def __init__(self, path):
        self.path = path
        self.cpu = jax.devices("cpu")[0]
        self.device = cuda_devices()[0] if path == "cuda" else self.cpu

    def put(self, tree, on_device):
        dev = self.device if on_device else self.cpu
        return jax.tree_util.tree_map(lambda x: None if x is None else jax.device_put(x, dev),
                                      tree, is_leaf=lambda x: x is None)

    def run(self, fn, args, on_device):
        """fn(*args) with args on the device path's device (on_device) or the CPU,
        through a fresh jit (no trace shared between the two paths)."""
        args = self.put(args, on_device)
        if self.path == "reference" and on_device:
            fgj._device_path_on_cpu(True)
            try:
                return jax.block_until_ready(jax.jit(lambda *a: fn(*a))(*args))
            finally:
                fgj._device_path_on_cpu(False)
        return jax.block_until_ready(jax.jit(lambda *a: fn(*a))(*args))


def check(name, got, want, tol, scalar_like):
    """Asserts |got - want| <= tol elementwise; returns the worst fraction of it."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{name}: NaN where the CPU has none"
    ok = ~np.isnan(want)
    if not ok.any():
        return 0.0
    rel, abs_of_max = tol
    a = np.abs(want[ok])
    bound = rel * (1.0 + a) if scalar_like else rel * a + abs_of_max * a.max()
    bound = np.maximum(bound, np.finfo(np.float64).tiny)
    frac = float(np.max(np.abs(got[ok] - want[ok]) / bound))
    assert frac <= 1.0, f"{name}: error {frac:.3g} x its tolerance"
    return frac


def inputs(dtype, seed=0, B=3, T=7, H=32, V=257):
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, B=B, T=T, H=H, V=V)
    inp["token_ids"] = inp["token_ids"].astype(np.int32)  # jax without x64
    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    for k in ("hidden", "weight", "bias"):
        inp[k] = np.asarray(jnp.asarray(inp[k], dt))
    return inp


def _loss_fn(loss_type, level):
    def f(h, w, b, tok, mask, adv, old, ref, coef):
        return fgj.fused_linear_grpo_loss(h, w, tok, mask, adv, old, ref, bias=b, beta=0.04,
                                          loss_type=loss_type, importance_sampling_level=level,
                                          entropy_coef=coef, return_aux=True)

    def value_and_grads(*a):
        (loss, aux), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(*a)
        return loss, aux, grads
    return value_and_grads


def check_loss(path, loss_type, level, dtype):
    """Jitted loss, metrics, logp, entropy and gradients (hidden, weight, bias)
    on the device path against the CPU path; entropy_coef is a traced operand
    (the handler reads it back from the device)."""
    dp = DevicePath(path)
    inp = inputs(dtype)
    args = (inp["hidden"], inp["weight"], inp["bias"], inp["token_ids"], inp["mask"],
            inp["advantages"], inp["old_logp"], inp["ref_logp"], np.float32(0.01))
    fn = _loss_fn(loss_type, level)
    want = dp.run(fn, args, on_device=False)
    got = dp.run(fn, args, on_device=True)
    worst = {}
    worst["loss"] = check("loss", got[0], want[0], TOL_SCALAR, True)
    for n in fgj.METRIC_NAMES:
        worst[n] = check(n, got[1]["metrics"][n], want[1]["metrics"][n], TOL_SCALAR, True)
    for n in ("logp", "entropy"):
        worst[n] = check(n, got[1][n], want[1][n], TOL_TOKEN, True)
    for n, g, w in zip(("grad_hidden", "grad_weight", "grad_bias"), got[2], want[2]):
        assert g.dtype == w.dtype, (n, g.dtype, w.dtype)
        worst[n] = check(n, g, w, TOL_GRAD[dtype], False)
    return worst


def check_logprobs(path, dtype):
    """linear_logprobs (logp, entropy) and its gradient on the device path
    against the CPU's host callback."""
    dp = DevicePath(path)
    inp = inputs(dtype, seed=1)

    def fn(h, w, b, tok, mask):
        def total(h, w, b):
            lp, ent = fgj.linear_logprobs(h, w, tok, mask, bias=b, temperature=0.9,
                                          return_entropy=True)
            return (lp * 1.5).sum() - (ent * 0.25).sum(), (lp, ent)
        (_, (lp, ent)), grads = jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True)(h, w, b)
        return lp, ent, grads
    args = (inp["hidden"], inp["weight"], inp["bias"], inp["token_ids"], inp["mask"])
    want = dp.run(fn, args, on_device=False)
    got = dp.run(fn, args, on_device=True)
    worst = {"logp": check("logp", got[0], want[0], TOL_TOKEN, True),
             "entropy": check("entropy", got[1], want[1], TOL_TOKEN, True)}
    for n, g, w in zip(("grad_hidden", "grad_weight", "grad_bias"), got[2], want[2]):
        assert g.dtype == w.dtype, (n, g.dtype, w.dtype)
        worst[n] = check(n, g, w, TOL_GRAD[dtype], False)
    return worst


def check_bad_token(path):
    """An unmasked token id outside [0, V) is refused by the device call as by
    the CPU's: an error naming FG_ERR_TOKEN_OUT_OF_RANGE (the loss, and the log-probs)."""
    dp = DevicePath(path)
    inp = inputs("float32", seed=2)
    V = inp["weight"].shape[0]
    tok = inp["token_ids"].copy()
    tok[0, 0] = V  # position 0 of every sequence is unmasked (make_inputs)
    assert inp["mask"][0, 0]
    loss = _loss_fn("dapo", "token")
    args = (inp["hidden"], inp["weight"], inp["bias"], tok, inp["mask"], inp["advantages"],
            inp["old_logp"], inp["ref_logp"], np.float32(0.0))
    msgs = []
    for on_device in (False, True):
        try:
            dp.run(loss, args, on_device)
        except Exception as e:  # noqa: BLE001 - JaxRuntimeError, or FusedGRPOError eagerly
            msgs.append(str(e))
        else:
            raise AssertionError(f"a token id {V} (V = {V}) was accepted (device: {on_device})")
    for m in msgs:
        assert "FG_ERR_TOKEN_OUT_OF_RANGE" in m, m
    try:
        dp.run(lambda h, w, b, t, m: fgj.linear_logprobs(h, w, t, m, bias=b),
               (inp["hidden"], inp["weight"], inp["bias"], tok, inp["mask"]), True)
    except Exception as e:  # noqa: BLE001
        assert "FG_ERR_TOKEN_OUT_OF_RANGE" in str(e), e
    else:
        raise AssertionError("linear_logprobs accepted a bad token id on the device path")


def check_sharded_refused_on_gpu():
    """shard_map (fused_linear_grpo_loss_sharded) stays on CPU devices: a mesh
    of GPUs is refused with a message that says so."""
    from jax.sharding import Mesh
    inp = inputs("float32")
    mesh = Mesh(np.array(cuda_devices()[:1]), ("batch",))
    try:
        fgj.fused_linear_grpo_loss_sharded(mesh, inp["hidden"], inp["weight"], inp["token_ids"],
                                           inp["mask"], inp["advantages"])
    except NotImplementedError as e:
        assert "CPU devices only" in str(e), e
    else:
        raise AssertionError("fused_linear_grpo_loss_sharded accepted a GPU mesh")


def check_eager_on_device():
    """An un-jitted call on committed GPU arrays takes the CUDA target (the
    arrays' devices decide) and matches the jitted one."""
    dp = DevicePath("cuda")
    inp = dp.put(inputs("float32", seed=3), True)
    a = (inp["hidden"], inp["weight"], inp["token_ids"], inp["mask"], inp["advantages"],
         inp["old_logp"])
    eager = fgj.fused_linear_grpo_loss(*a, bias=inp["bias"])
    jitted = jax.jit(lambda *x: fgj.fused_linear_grpo_loss(*x[:-1], bias=x[-1]))(*a, inp["bias"])
    assert list(eager.devices())[0].platform == "gpu"
    check("eager loss", eager, jitted, TOL_SCALAR, True)


if pytest is not None:
    @pytest.fixture(params=PATHS)
    def path(request):
        why = why_no_path(request.param)
        if why:
            pytest.skip(why)
        if request.param == "cuda":
            assert fgj._state["cuda"], "the handler library has no CUDA targets"
        return request.param

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("level", LEVELS)
    @pytest.mark.parametrize("loss_type", LOSS_TYPES)
    def test_loss_and_grads(path, loss_type, level, dtype):
        check_loss(path, loss_type, level, dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_logprobs(path, dtype):
        check_logprobs(path, dtype)

    def test_bad_token_refused(path):
        check_bad_token(path)

    def test_sharded_refused_on_gpu():
        why = why_no_path("cuda")
        if why:
            pytest.skip(why)
        check_sharded_refused_on_gpu()

    def test_eager_on_device():
        why = why_no_path("cuda")
        if why:
            pytest.skip(why)
        check_eager_on_device()

    def test_cpu_process_keeps_cpu_path():
        """Without CUDA devices nothing changes on the CPU: the calls lower to the
        CPU handler alone (no platform conditional, no CUDA target)."""
        if cuda_devices():
            pytest.skip("this process has CUDA devices")
        inp = inputs("float32")
        text = jax.jit(lambda h, w: fgj.fused_linear_grpo_loss(
            h, w, inp["token_ids"], inp["mask"], inp["advantages"])).lower(
                inp["hidden"], inp["weight"]).as_text()
        assert "fusedgrpo_linear_grpo" in text and "_cuda" not in text and "case" not in text


def main():
    """The cuda checks without pytest; exit 77 when there is no CUDA device."""
    why = why_no_path("cuda")
    if why:
        print(f"skipped: {why}")
        return 77
    if not fgj._state["cuda"]:
        print("FAIL: the handler library has no CUDA targets")
        return 1
    print(f"device: {cuda_devices()[0].device_kind}; handler {fgj.handler_path()}; "
          f"library {fusedgrpo.library_path()}")
    failures = 0
    cases = [(f"loss {t} {lv} {d}", check_loss, ("cuda", t, lv, d))
             for t in LOSS_TYPES for lv in LEVELS for d in DTYPES]
    cases += [(f"logprobs {d}", check_logprobs, ("cuda", d)) for d in DTYPES]
    cases += [("bad token", check_bad_token, ("cuda",)),
              ("sharded refused", check_sharded_refused_on_gpu, ()),
              ("eager", check_eager_on_device, ())]
    for name, fn, args in cases:
        try:
            worst = fn(*args)
        except Exception as e:  # noqa: BLE001 - reported, counted
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            continue
        detail = "" if not worst else "  worst/tol: " + " ".join(
            f"{k} {v:.2g}" for k, v in worst.items())
        print(f"ok   {name}{detail}")
    print(f"{len(cases) - failures} of {len(cases)} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
