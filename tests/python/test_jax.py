"""The JAX front end (XLA FFI custom call) against a pure-JAX baseline with
materialized logits (jax.nn.log_softmax), single device and under shard_map."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import fusedgrpo  # noqa: E402
import fusedgrpo.jax as fgj  # noqa: E402
from budgets import several_chunks_budget  # noqa: E402
from grpo_reference import make_inputs, reference  # noqa: E402
from tolerance import assert_close, compare_to_reference  # noqa: E402

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"]


def jax_baseline(hidden, weight, token_ids, mask, advantages, old_logp=None, ref_logp=None, *,
                 bias=None, is_ratio=None, beta=0.0, epsilon_low=0.2, epsilon_high=None,
                 delta=None, temperature=1.0, loss_type="dapo",
                 importance_sampling_level="token", max_completion_length=None,
                 num_items_in_batch=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                 use_bias_correction_kl=False, entropy_coef=0.0):
    """TRL's formulas in plain JAX: the whole [B, T, V] logits, jax.nn.log_softmax."""
    eh = epsilon_low if epsilon_high is None else epsilon_high
    logits = hidden.astype(jnp.float32) @ weight.astype(jnp.float32).T
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    logits = logits / temperature
    lsm = jax.nn.log_softmax(logits, -1)
    V = weight.shape[0]
    m = mask.astype(jnp.float32)
    B, T = m.shape
    tok = jnp.where(mask != 0, token_ids, 0).clip(0, V - 1)
    logp = jnp.take_along_axis(lsm, tok[..., None], -1)[..., 0]
    ent = -(jnp.exp(lsm) * lsm).sum(-1)
    old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    cnt = m.sum(1)
    lr_tok = logp - old
    if importance_sampling_level == "token":
        lr = lr_tok
    else:
        lr = jnp.broadcast_to(((m * lr_tok).sum(1) / jnp.maximum(cnt, 1.0))[:, None], (B, T))
    ratio = jnp.exp(lr)
    A = advantages.astype(jnp.float32)[:, None]
    if loss_type == "cispo":
        L = -jax.lax.stop_gradient(jnp.minimum(ratio, eh)) * A * logp
    elif loss_type == "sapo":
        tau = jnp.where(A > 0, sapo_temperature_pos, sapo_temperature_neg)
        L = -(4.0 / tau) * jax.nn.sigmoid(tau * (ratio - 1.0)) * A
    else:
        rt = jnp.minimum(ratio, delta) if delta is not None else ratio
        L = -jnp.minimum(rt * A, jnp.clip(ratio, 1 - epsilon_low, 1 + eh) * A)
    if is_ratio is not None:
        L = L * (is_ratio.reshape(B, 1) if is_ratio.ndim == 1 else is_ratio)
    if beta != 0:
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
        if use_bias_correction_kl:
            kl = kl * ratio  # TRL 1.16 multiplies by coef_1, the level's ratio
        L = L + beta * kl
    tot = jnp.maximum(m.sum(), 1.0)
    if loss_type in ("grpo", "sapo"):
        loss = ((m * L).sum(1) / jnp.maximum(cnt, 1.0)).mean()
    elif loss_type == "bnpo":
        loss = (m * L).sum() / tot
    elif loss_type == "dr_grpo":
        loss = (m * L).sum() / (B * (T if max_completion_length is None
                                     else max_completion_length))
    elif loss_type in ("dapo", "cispo"):
        items = tot if num_items_in_batch is None else max(num_items_in_batch, 1.0)
        loss = (m * L).sum() / items
    else:  # luspo
        loss = (m * L).sum(1).mean()
    return loss - entropy_coef * (m * ent).sum() / tot


def _args(inp):
    return (inp["hidden"], inp["weight"], inp["token_ids"], inp["mask"], inp["advantages"],
            inp.get("old_logp"), inp.get("ref_logp"))


def _grads(fn, inp, cfg):
    def f(h, w, b):
        a = _args({**inp, "hidden": h, "weight": w})
        return fn(*a, bias=b, **cfg)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(inp["hidden"], inp["weight"],
                                                             inp["bias"])


def test_backend_is_the_ffi_handler():
    assert fgj.backend() == "ffi"
    # built with the package, next to the library it links ($ORIGIN)
    assert os.path.dirname(fgj.handler_path()) == os.path.dirname(fusedgrpo.library_path())


def test_without_the_handler_import_fails_clearly_unless_callback_asked():
    """A package built without jax has no handler: `import fusedgrpo.jax` says how
    to reinstall; FUSEDGRPO_JAX_BACKEND=callback still imports (pure_callback)."""
    code = textwrap.dedent("""
        import os
        os.environ["FUSEDGRPO_JAX_FFI_LIBRARY"] = "/nonexistent/libfusedgrpo_jax_ffi.so"
        try:
            import fusedgrpo.jax
        except ImportError as e:
            msg = str(e)
        else:
            raise SystemExit("imported without a handler")
        assert "--no-build-isolation" in msg and "FUSEDGRPO_JAX_BACKEND=callback" in msg, msg
        os.environ["FUSEDGRPO_JAX_BACKEND"] = "callback"
        import fusedgrpo.jax as fgj
        assert fgj.backend() == "callback"
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDGRPO_JAX")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_call_totals_count_the_handler_calls():
    rng = np.random.default_rng(11)
    inp = make_inputs(rng, B=2, T=3, H=8, V=11, bad_masked_ids=False)
    before = fgj.call_totals()
    f = jax.jit(jax.grad(lambda h, w: fgj.fused_linear_grpo_loss(
        h, w, inp["token_ids"], inp["mask"], inp["advantages"]), argnums=(0, 1)))
    jax.block_until_ready(f(jnp.asarray(inp["hidden"]), jnp.asarray(inp["weight"])))
    after = fgj.call_totals()
    assert after["calls"] == before["calls"] + 1  # one C call gives the loss and all grads
    assert after["call_seconds"] > before["call_seconds"]
    assert 0 <= after["gemm_seconds"] - before["gemm_seconds"] <= (
        after["call_seconds"] - before["call_seconds"])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_pure_jax_baseline(loss_type, level):
    rng = np.random.default_rng(LOSS_TYPES.index(loss_type) * 2 + (level == "sequence"))
    inp = make_inputs(rng, B=3, T=5, H=16, V=37, bad_masked_ids=False)
    inp["is_ratio"] = rng.uniform(0.7, 1.3, (3, 5)).astype(np.float32)
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.05,
               temperature=0.9, entropy_coef=0.01,
               epsilon_high=1.2 if loss_type == "cispo" else 0.28,
               use_bias_correction_kl=(loss_type == "dapo"))
    isr = jnp.asarray(inp["is_ratio"])
    (l1, g1) = _grads(lambda *a, **k: fgj.fused_linear_grpo_loss(*a, is_ratio=isr, **k), inp,
                      cfg)
    (l2, g2) = _grads(lambda *a, **k: jax_baseline(*a, is_ratio=isr, **k), inp, cfg)
    scale = reference(**inp, **cfg)["loss_scale"]
    assert_close("jax_f32/loss", l1, l2, f"{loss_type}/{level}", scale=scale)
    for a, b, n in zip(g1, g2, ("grad_hidden", "grad_weight", "grad_bias")):
        assert_close(f"jax_f32/{n}", a, b, f"{loss_type}/{level}")


def test_aux_metrics_logp_entropy_and_no_bias():
    rng = np.random.default_rng(1)
    inp = make_inputs(rng, B=2, T=6, H=12, V=29, bias=False)
    cfg = dict(loss_type="bnpo", beta=0.1)
    loss, aux = jax.jit(lambda h, w: fgj.fused_linear_grpo_loss(
        *_args({**inp, "hidden": h, "weight": w}), return_aux=True, **cfg))(inp["hidden"],
                                                                           inp["weight"])
    want = reference(**inp, **cfg)
    g = jax.grad(lambda w: fgj.fused_linear_grpo_loss(*_args({**inp, "weight": w}), **cfg))(
        inp["weight"])
    compare_to_reference("f32", dict(loss=loss, logp=aux["logp"], entropy=aux["entropy"],
                                     metrics=aux["metrics"], grad_weight=g), want)

def test_bfloat16_inputs_grads_in_bf16():
    rng = np.random.default_rng(2)
    inp = make_inputs(rng, B=2, T=4, H=16, V=23)
    hb = jnp.asarray(inp["hidden"], jnp.bfloat16)
    wb = jnp.asarray(inp["weight"], jnp.bfloat16)
    bb = jnp.asarray(inp["bias"], jnp.bfloat16)
    cfg = dict(loss_type="grpo", beta=0.04)
    loss, (gh, gw, gb) = jax.value_and_grad(
        lambda h, w, b: fgj.fused_linear_grpo_loss(*_args({**inp, "hidden": h, "weight": w}),
                                                   bias=b, **cfg), argnums=(0, 1, 2))(hb, wb, bb)
    assert gh.dtype == gw.dtype == gb.dtype == jnp.bfloat16
    rounded = {**inp, "hidden": np.asarray(hb, np.float32), "weight": np.asarray(wb, np.float32),
               "bias": np.asarray(bb, np.float32)}
    want = reference(**rounded, **cfg)
    compare_to_reference("bf16", dict(loss=loss), want)
    assert_close("bf16_out/grad_weight", gw, want["grad_weight"])
    assert_close("bf16_out/grad_hidden", gh, want["grad_hidden"])

def test_errors_surface():
    rng = np.random.default_rng(3)
    inp = make_inputs(rng, B=2, T=3, H=4, V=5)
    tok = np.array(inp["token_ids"])
    tok[:] = 7
    with pytest.raises(Exception, match="FG_ERR_TOKEN_OUT_OF_RANGE"):
        out = jax.jit(lambda h: fgj.fused_linear_grpo_loss(
            h, inp["weight"], tok, np.ones((2, 3), bool), inp["advantages"]))(inp["hidden"])
        jax.block_until_ready(out)
    with pytest.raises(fusedgrpo.FusedGRPOError):
        fgj.fused_linear_grpo_loss(*_args(inp), loss_type="ppo")


def test_memory_budget_reaches_the_library():
    """The budget travels in the call's fg_exec: one below the planner's least
    fails in the handler, the least itself runs."""
    rng = np.random.default_rng(5)
    inp = make_inputs(rng, B=2, T=6, H=16, V=509, bad_masked_ids=False)
    least = fusedgrpo.fused_linear_grpo_plan(**inp)["min_budget_bytes"]
    grad = jax.jit(jax.grad(lambda h, w, budget: fgj.fused_linear_grpo_loss(
        *_args({**inp, "hidden": h, "weight": w}), bias=inp["bias"], memory_budget=budget),
        argnums=(0, 1)), static_argnums=2)
    jax.block_until_ready(grad(inp["hidden"], inp["weight"], least))
    with pytest.raises(Exception, match="FG_ERR_BUDGET_TOO_SMALL"):
        jax.block_until_ready(grad(inp["hidden"], inp["weight"], least - 1))
    with pytest.raises(fusedgrpo.FusedGRPOError, match="FG_ERR_INVALID_SIZE"):
        fgj.fused_linear_grpo_loss(*_args(inp), memory_budget=-1)

def test_pure_callback_fallback_agrees(monkeypatch):
    rng = np.random.default_rng(4)
    inp = make_inputs(rng, B=2, T=5, H=8, V=19)
    cfg = dict(loss_type="dapo", beta=0.1, entropy_coef=0.01)
    l1, g1 = _grads(fgj.fused_linear_grpo_loss, inp, cfg)
    fgj.backend()
    monkeypatch.setitem(fgj._state, "backend", "callback")
    l2, g2 = _grads(fgj.fused_linear_grpo_loss, inp, cfg)
    assert float(l1) == float(l2)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_shard_map_batch_axis(loss_type):
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax starts")
    mesh = Mesh(np.array(jax.devices()[:4]), ("batch",))
    rng = np.random.default_rng(10 + LOSS_TYPES.index(loss_type))
    inp = make_inputs(rng, B=8, T=5, H=16, V=31, all_masked_row=3, bad_masked_ids=False)
    level = "sequence" if loss_type in ("grpo", "luspo") else "token"
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1,
               entropy_coef=0.02, epsilon_high=1.2 if loss_type == "cispo" else None)
    l1, g1 = _grads(lambda *a, **k: fgj.fused_linear_grpo_loss_sharded(mesh, *a, **k), inp, cfg)
    l2, g2 = _grads(jax_baseline, inp, cfg)
    l3, g3 = _grads(fgj.fused_linear_grpo_loss, inp, cfg)
    want = reference(**inp, **cfg)
    assert_close("jax_f32/loss", l1, l2, loss_type, scale=want["loss_scale"])
    assert_close("batch_sharded/loss", l1, l3, loss_type, scale=want["loss_scale"])
    for a, b, c, n in zip(g1, g2, g3, ("grad_hidden", "grad_weight", "grad_bias")):
        assert_close(f"jax_f32/{n}", a, b, loss_type)
        assert_close(f"batch_sharded/{n}", a, c, loss_type)
    # metrics combine over shards into the global masked means
    _, aux = fgj.fused_linear_grpo_loss_sharded(mesh, *_args(inp), bias=inp["bias"],
                                                return_aux=True, **cfg)
    compare_to_reference("f32", dict(metrics=aux["metrics"], logp=aux["logp"],
                                     entropy=aux["entropy"]), want, loss_type)


def test_shard_map_2d_mesh_batch_axis_only():
    """A (batch, model) mesh: sharded over 'batch', replicated over 'model'."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 host devices")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("batch", "model"))
    rng = np.random.default_rng(20)
    inp = make_inputs(rng, B=4, T=3, H=8, V=17, bad_masked_ids=False)
    cfg = dict(loss_type="dapo", beta=0.05)
    l1, g1 = _grads(lambda *a, **k: fgj.fused_linear_grpo_loss_sharded(mesh, *a, **k), inp, cfg)
    l2, g2 = _grads(fgj.fused_linear_grpo_loss, inp, cfg)
    assert_close("batch_sharded/loss", l1, l2, scale=reference(**inp, **cfg)["loss_scale"])
    for a, b, n in zip(g1, g2, ("grad_hidden", "grad_weight", "grad_bias")):
        assert_close(f"batch_sharded/{n}", a, b)


def _mesh(shape, axes):
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax starts")
    if fgj.backend() != "ffi":
        pytest.skip("vocab sharding needs the FFI handler")
    return Mesh(np.array(jax.devices()[:4]).reshape(shape), axes)


@pytest.mark.parametrize("mesh_shape,axes,batch_axis", [
    ((4,), ("vocab",), None),
    ((2, 2), ("batch", "vocab"), "batch"),
])
@pytest.mark.parametrize("loss_type,level", [("grpo", "sequence"), ("dapo", "token"),
                                             ("bnpo", "token"), ("sapo", "token")])
def test_shard_map_vocab_axis(mesh_shape, axes, batch_axis, loss_type, level):
    """Weight split by vocab rows: the phases of fusedgrpo.h on every shard, with
    lax.pmax / lax.psum between them. V = 1025 splits unevenly (the weight is
    padded to 4 x 257 rows; the last shard passes its 254). A small memory
    budget makes each shard's GEMM phases run in several chunks."""
    mesh = _mesh(mesh_shape, axes)
    rng = np.random.default_rng(30 + len(axes))
    inp = make_inputs(rng, B=4, T=24, H=16, V=4 * 257 - 3, all_masked_row=1,
                      bad_masked_ids=False)
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1,
               entropy_coef=0.02, temperature=0.8)
    # Planned for a vocab shard's call on the whole batch: several chunks there;
    # a shard of half the batch needs no more than that call.
    rows = -(-inp["weight"].shape[0] // mesh.shape["vocab"])
    shard = dict(inp, weight=inp["weight"][:rows], bias=inp["bias"][:rows],
                 token_ids=inp["token_ids"] % rows)
    budget = several_chunks_budget(**shard, **cfg, threads=1)
    l1, g1 = _grads(lambda *a, **k: fgj.fused_linear_grpo_loss_sharded(
        mesh, *a, batch_axis=batch_axis, vocab_axis="vocab", threads=1,
        memory_budget=budget, **k), inp, cfg)
    want = reference(**inp, **cfg)
    context = f"{axes} {loss_type}/{level}"
    compare_to_reference("vocab_sharded", dict(loss=l1, grad_hidden=g1[0], grad_weight=g1[1],
                                               grad_bias=g1[2]), want, context)
    _, aux = fgj.fused_linear_grpo_loss_sharded(mesh, *_args(inp), bias=inp["bias"],
                                                batch_axis=batch_axis, vocab_axis="vocab",
                                                return_aux=True, **cfg)
    compare_to_reference("vocab_sharded", dict(metrics=aux["metrics"], logp=aux["logp"],
                                               entropy=aux["entropy"]), want, context)


@pytest.mark.parametrize("mesh_shape,axes,batch_axis,vocab_axis,options", [
    ((4,), ("vocab",), None, "vocab",
     dict(loss_type="dapo", top_entropy_quantile=0.6, off_policy_mask_threshold=0.05)),
    ((2, 2), ("batch", "vocab"), "batch", "vocab",
     dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=1.5, vespo_k_neg=2.5,
          vespo_lambda_neg=1.2, off_policy_mask_threshold=0.05, entropy_coef=0.05)),
    ((4,), ("batch",), "batch", None,
     dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=1.5, vespo_k_neg=2.5,
          vespo_lambda_neg=1.2, off_policy_mask_threshold=0.05, entropy_coef=0.05)),
])
def test_shard_map_takes_every_option(mesh_shape, axes, batch_axis, vocab_axis, options):
    """The options the sharded call shares with the NumPy API reach every shard:
    vespo's k and lambda, the off-policy mask (with sampling_logp), the
    top-entropy quantile (over the vocab axis only: TRL takes it per rank), the
    entropy bonus; through the phases and through the one-call path."""
    mesh = _mesh(mesh_shape, axes)
    rng = np.random.default_rng(40 + len(axes))
    inp = make_inputs(rng, B=4, T=6, H=16, V=4 * 9 - 1, bad_masked_ids=False)
    samp = (inp["old_logp"] + rng.normal(0, 0.3, inp["old_logp"].shape)).astype(np.float32)
    cfg = dict(options, beta=0.1, sampling_logp=samp)
    l1, g1 = _grads(lambda *a, **k: fgj.fused_linear_grpo_loss_sharded(
        mesh, *a, batch_axis=batch_axis, vocab_axis=vocab_axis, threads=1, **k), inp, cfg)
    want = reference(**inp, **cfg)
    context = f"{axes} {options['loss_type']}"
    plain = reference(**inp, beta=0.1, loss_type=options["loss_type"])
    assert abs(want["loss"] - plain["loss"]) > 1e-3  # the options matter here
    # f32: vespo's gamma weight amplifies the log-probs' error (tolerance.py)
    compare_to_reference("f32", dict(loss=l1, grad_hidden=g1[0], grad_weight=g1[1],
                                     grad_bias=g1[2]), want, context)


def test_shard_map_vocab_size_excludes_padding_rows():
    """A weight already padded to a multiple of the shards (as a global array
    sharded over processes must be) with vocab_size = the real vocabulary: the
    padding rows never enter a call, though they would dominate every softmax
    here, and their gradient is exactly 0."""
    mesh = _mesh((4,), ("vocab",))
    rng = np.random.default_rng(40)
    V = 301
    inp = make_inputs(rng, B=3, T=7, H=16, V=V)
    cfg = dict(loss_type="cispo", beta=0.04, epsilon_high=1.2, temperature=0.9)
    padded = {**inp, "weight": np.concatenate([inp["weight"], np.full((3, 16), 50.0, np.float32)]),
              "bias": np.concatenate([inp["bias"], np.full(3, 50.0, np.float32)])}
    l1, g1 = _grads(lambda *a, **k: fgj.fused_linear_grpo_loss_sharded(
        mesh, *a, batch_axis=None, vocab_axis="vocab", vocab_size=V, **k), padded, cfg)
    want = reference(**inp, **cfg)
    compare_to_reference("vocab_sharded", dict(loss=l1, grad_hidden=g1[0],
                                               grad_weight=g1[1][:V], grad_bias=g1[2][:V]), want)
    assert not np.any(np.asarray(g1[1][V:])) and not np.any(np.asarray(g1[2][V:]))
    with pytest.raises(ValueError, match="without vocab rows"):
        fgj.fused_linear_grpo_loss_sharded(mesh, *_args({**inp, "weight": inp["weight"][:5]}),
                                           batch_axis=None, vocab_axis="vocab")


def test_shard_map_vocab_axis_bfloat16():
    """bf16 inputs: grad_hidden's shares are summed in float32 and the gradients
    come back in bf16, as from the unsharded call."""
    mesh = _mesh((2, 2), ("batch", "vocab"))
    rng = np.random.default_rng(41)
    inp = make_inputs(rng, B=4, T=5, H=16, V=203)
    bf = {k: jnp.asarray(inp[k], jnp.bfloat16) for k in ("hidden", "weight", "bias")}
    cfg = dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04)
    loss, (gh, gw, gb) = jax.jit(jax.value_and_grad(
        lambda h, w, b: fgj.fused_linear_grpo_loss_sharded(
            mesh, *_args({**inp, "hidden": h, "weight": w}), bias=b, vocab_axis="vocab", **cfg),
        argnums=(0, 1, 2)))(bf["hidden"], bf["weight"], bf["bias"])
    assert gh.dtype == gw.dtype == gb.dtype == jnp.bfloat16
    rounded = {**inp, **{k: np.asarray(v, np.float32) for k, v in bf.items()}}
    want = reference(**rounded, **cfg)
    compare_to_reference("bf16", dict(loss=loss), want)
    assert_close("bf16_out/grad_hidden", gh, want["grad_hidden"])
    assert_close("bf16_out/grad_weight", gw, want["grad_weight"])


def test_shard_map_errors_raise_on_every_shard():
    """A failure on one shard (NaN in its weight rows, a bad token id in one batch
    shard) travels through the phases as a status; every shard raises it after
    the collectives, with the failing shard's message where this process holds
    it; the mesh then runs the next call as before."""
    mesh = _mesh((2, 2), ("batch", "vocab"))
    rng = np.random.default_rng(42)
    inp = make_inputs(rng, B=4, T=5, H=16, V=101, bad_masked_ids=False)

    def run(i, **kw):
        return _grads(lambda *a, **k: fgj.fused_linear_grpo_loss_sharded(
            mesh, *a, vocab_axis="vocab", **kw, **k), i, dict(loss_type="dapo", beta=0.04))

    loss, _ = run(inp)
    w = inp["weight"].copy()
    w[90, 3] = np.nan  # a row of the second vocab shard
    with pytest.raises(Exception, match=r"FG_ERR_NONFINITE_INPUT: weight\[39, 3\] is NaN"):
        jax.block_until_ready(run({**inp, "weight": w}))
    tok = inp["token_ids"].copy()
    tok[3, 0] = 101  # a sequence of the second batch shard
    with pytest.raises(Exception, match=r"FG_ERR_TOKEN_OUT_OF_RANGE: token_ids\[1, 0\] = 101"):
        jax.block_until_ready(run({**inp, "token_ids": tok}))
    with pytest.raises(Exception, match="FG_ERR_BUDGET_TOO_SMALL"):
        jax.block_until_ready(run(inp, memory_budget=1000))
    again, _ = run(inp)
    assert float(again) == float(loss)
    batch_mesh = _mesh((4,), ("batch",))  # no vocab axis: one soft-failing call per shard
    with pytest.raises(Exception, match="FG_ERR_TOKEN_OUT_OF_RANGE"):
        jax.block_until_ready(_grads(lambda *a, **k: fgj.fused_linear_grpo_loss_sharded(
            batch_mesh, *a, **k), {**inp, "token_ids": tok}, {}))


def test_shard_map_batch_axis_callback_backend(monkeypatch):
    """The pure_callback backend serves the batch axis (one call per shard) and
    refuses the vocab axis."""
    mesh = _mesh((4,), ("batch",))
    rng = np.random.default_rng(43)
    inp = make_inputs(rng, B=4, T=5, H=8, V=19, bad_masked_ids=False)
    cfg = dict(loss_type="bnpo", beta=0.05, entropy_coef=0.01)

    def sharded(*a, **k):
        return fgj.fused_linear_grpo_loss_sharded(mesh, *a, **k)
    l1, g1 = _grads(sharded, inp, cfg)
    monkeypatch.setitem(fgj._state, "backend", "callback")
    l2, g2 = _grads(sharded, inp, cfg)
    assert float(l1) == float(l2)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(NotImplementedError, match="FFI handler"):
        fgj.fused_linear_grpo_loss_sharded(Mesh(np.array(jax.devices()[:4]), ("vocab",)),
                                           *_args(inp), batch_axis=None, vocab_axis="vocab")


def test_linear_logprobs_differentiable():
    """fusedgrpo.jax.linear_logprobs (host callback over fg_linear_logprobs and
    its backward) against jax.nn.log_softmax in float32, under jit."""
    rng = np.random.default_rng(21)
    B, T, H, V = 3, 7, 45, 1013
    h = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((V, H)) * 0.3, jnp.float32)
    b = jnp.asarray(rng.standard_normal(V) * 0.1, jnp.float32)
    tok = jnp.asarray(rng.integers(0, V, (B, T)))
    mask = jnp.asarray(rng.random((B, T)) > 0.2)
    c1 = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)
    c2 = jnp.asarray(rng.standard_normal((B, T)) * 0.1, jnp.float32)

    def ours(h, w, b):
        lp, ent = fgj.linear_logprobs(h, w, tok, mask, b, temperature=0.7, return_entropy=True)
        return (lp * c1 + ent * c2).sum()

    def plain(h, w, b):
        ls = jax.nn.log_softmax((h @ w.T + b) / 0.7, -1)
        lp = jnp.take_along_axis(ls, tok[..., None], -1)[..., 0] * mask
        ent = -(jnp.exp(ls) * ls).sum(-1) * mask
        return (lp * c1 + ent * c2).sum()

    g1 = jax.jit(jax.grad(ours, (0, 1, 2)))(h, w, b)
    g2 = jax.grad(plain, (0, 1, 2))(h, w, b)
    for a, c, n in zip(g1, g2, ("grad_hidden", "grad_weight", "grad_bias")):
        assert_close(f"jax_f32/{n}", a, c)
    gb = jax.grad(ours, (0, 1, 2))(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                   b.astype(jnp.bfloat16))
    assert all(x.dtype == jnp.bfloat16 for x in gb)
