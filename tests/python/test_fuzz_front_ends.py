"""A bounded, derandomized fuzz of the Python front ends (Hypothesis): generated
shapes (some mismatched), dtypes, devices (torch: 'meta') and option values
(in and out of range). Every call either raises a clean error (FusedGRPOError,
TypeError, ValueError) or returns what the NumPy front end returns for the same
inputs; a refused accumulation leaves its buffers as they were. NumPy and torch
run 100 examples each, JAX (whose calls compile per shape) 40."""
import numpy as np
import pytest

import fusedgrpo as fg

pytest.importorskip("hypothesis")
import hypothesis  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

CLEAN = (fg.FusedGRPOError, TypeError, ValueError)
FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# Per option, values in its range and out of it (None where it means "unset").
OPTION_VALUES = {
    "loss_type": st.sampled_from(fg.LOSS_TYPES + ("ppo", None, 3)),
    "importance_sampling_level": st.sampled_from(fg.LEVELS + ("seq",)),
    "temperature": st.sampled_from([1.0, 0.7, 0.0, -1.0, float("inf"), float("nan"), None, 1e-320]),
    "epsilon_low": st.sampled_from([0.2, 0.0, -0.1, float("nan")]),
    "epsilon_high": st.sampled_from([None, 0.28, -1.0, -0.3, float("inf")]),
    "delta": st.sampled_from([None, 1.5, 0.0, -2.0]),
    "beta": st.sampled_from([0.0, 0.04, -0.1]),
    "max_completion_length": st.sampled_from([None, 1, 7, 0, -4, 2**64 + 1, 2.5, True]),
    "num_items_in_batch": st.sampled_from([None, 3.0, 0.0, -5.0, -1.0]),
    "sapo_temperature_neg": st.sampled_from([1.05, 0.0]),
    "use_bias_correction_kl": st.sampled_from([False, True, 2]),
    "entropy_coef": st.sampled_from([0.0, 0.1, float("inf")]),
    "vespo_lambda_pos": st.sampled_from([3.0, 0.5, 0.0, -1.0]),
    "off_policy_mask_threshold": st.sampled_from([None, 0.05, float("inf"), float("nan")]),
    "top_entropy_quantile": st.sampled_from([1.0, 0.5, 0.0, 1.5, -0.1]),
}
MISMATCH = ("old_logp_T", "bias_V", "token_ids_T", "advantages_B", "hidden_2d",
            "mask_half", "mask_nan", "token_float", "token_out_of_range", "weight_H")


@st.composite
def problems(draw):
    B, T, H, V = (draw(st.integers(1, n)) for n in (3, 4, 6, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    hidden = rng.standard_normal((B, T, H)).astype(draw(st.sampled_from(
        [np.float32, np.float32, np.float32, np.float64, np.float16])))
    inp = dict(hidden=hidden, weight=rng.standard_normal((V, H)).astype(np.float32),
               token_ids=rng.integers(0, V, (B, T)).astype(draw(st.sampled_from(
                   [np.int64, np.int32]))),
               mask=rng.random((B, T)) < 0.8, advantages=rng.standard_normal(B).astype(np.float32),
               old_logp=-rng.random((B, T)).astype(np.float32) if draw(st.booleans()) else None,
               ref_logp=-rng.random((B, T)).astype(np.float32),
               bias=rng.standard_normal(V).astype(np.float32) if draw(st.booleans()) else None)
    bad = draw(st.one_of(st.just(None), st.sampled_from(MISMATCH)))  # half well-formed
    if bad == "old_logp_T":
        inp["old_logp"] = np.zeros((B, T + 1), np.float32)
    elif bad == "bias_V":
        inp["bias"] = np.zeros(V + 2, np.float32)
    elif bad == "token_ids_T":
        inp["token_ids"] = inp["token_ids"][:, :T - 1] if T > 1 else np.zeros((B, 2), np.int64)
    elif bad == "advantages_B":
        inp["advantages"] = np.zeros(B + 1, np.float32)
    elif bad == "hidden_2d":
        inp["hidden"] = inp["hidden"][0]
    elif bad in ("mask_half", "mask_nan"):
        m = inp["mask"].astype(np.float32)
        m[0, 0] = 0.5 if bad == "mask_half" else np.nan
        inp["mask"] = m
    elif bad == "token_float":
        inp["token_ids"] = inp["token_ids"] + 0.5
    elif bad == "token_out_of_range":
        inp["token_ids"] = inp["token_ids"].copy()
        inp["token_ids"][0, 0] = V + 3
        inp["mask"][0, 0] = True
    elif bad == "weight_H":
        inp["weight"] = np.zeros((V, H + 1), np.float32)
    names = draw(st.lists(st.sampled_from(sorted(OPTION_VALUES)), max_size=2, unique=True))
    options = {n: draw(OPTION_VALUES[n]) for n in names}
    options["threads"] = draw(st.sampled_from([None, None, 1, 2, 0, 5000, 2**31 - 1]))
    options["memory_budget"] = draw(st.sampled_from([None, None, 1 << 20, 0, 2**64 + 100]))
    return inp, options, draw(st.sampled_from(["cpu", "cpu", "cpu", "meta"]))


def _numpy(inp, options):
    try:
        return fg.fused_linear_grpo(**inp, **options), None
    except CLEAN as e:
        return None, e


@FUZZ
@given(problems())
def test_torch_agrees_with_numpy_or_refuses(problem):
    torch = pytest.importorskip("torch")
    import fusedgrpo.torch as fgt
    inp, options, device = problem
    r, err = _numpy(inp, options)
    t = {k: None if v is None else torch.from_numpy(np.array(v)) for k, v in inp.items()}
    if device == "meta":
        t["advantages"] = t["advantages"].to("meta")
    try:
        loss, _, logp, _ = fgt.fused_linear_grpo_loss(
            t["hidden"], t["weight"], t["token_ids"], t["mask"], t["advantages"], t["bias"],
            t["old_logp"], t["ref_logp"], **options)
    except CLEAN:
        hypothesis.event("refused")
        return
    hypothesis.event("computed")
    assert device == "cpu", "a 'meta' tensor was accepted"
    assert err is None, f"torch accepted what NumPy refused: {err}"
    np.testing.assert_allclose(float(loss), r.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(logp.numpy(), r.logp)


@FUZZ
@given(problems())
def test_refused_accumulation_changes_nothing(problem):
    inp, options, _ = problem
    V = inp["weight"].shape[0]
    H = inp["weight"].shape[-1]
    gw = np.full((V, H), 0.25, np.float32)
    gb = np.full((V,), 0.5, np.float32)
    exec_options = {k: options[k] for k in ("threads", "memory_budget")}
    try:
        fg.fused_linear_logprobs_backward(
            inp["hidden"], inp["weight"], inp["token_ids"],
            np.ones(inp["token_ids"].shape, np.float32), inp["mask"], bias=inp["bias"],
            temperature=options.get("temperature", 1.0), grad_weight_out=gw,
            grad_bias_out=gb if inp["bias"] is not None else None, **exec_options)
    except CLEAN:
        assert (gw == 0.25).all() and (gb == 0.5).all()


@settings(FUZZ, max_examples=40)
@given(problems())
def test_jax_agrees_with_numpy_or_refuses(problem):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import fusedgrpo.jax as fgj
    inp, options, _ = problem
    r, err = _numpy(inp, options)
    a = {k: None if v is None else jnp.asarray(v) for k, v in inp.items()}
    try:
        loss, aux = fgj.fused_linear_grpo_loss(
            a["hidden"], a["weight"], a["token_ids"], a["mask"], a["advantages"],
            bias=a["bias"], old_logp=a["old_logp"], ref_logp=a["ref_logp"], return_aux=True,
            **options)
        loss = float(loss)  # a failure inside the call surfaces here at the latest
    except CLEAN + (jax.errors.JaxRuntimeError,):
        hypothesis.event("refused")
        return
    hypothesis.event("computed")
    assert err is None, f"JAX accepted what NumPy refused: {err}"
    np.testing.assert_allclose(loss, r.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux["logp"]), r.logp)
