"""Outputs that share memory with inputs (fusedgrpo.h "Conventions"): the NumPy
front end refuses an output array that overlaps an argument by address range
(a view, a slice, a reshape: not only the same object), and so does the C
library for any caller (here through the ctypes layer, past the NumPy checks);
a refused call writes nothing. logits_grpo(inplace=True) writes the gradient
into the caller's logits whatever view they are (TRL's logits[:, -C:], a
reversed axis), and refuses logits that overlap another argument or
themselves."""
import numpy as np
import pytest

import fusedgrpo as fg
from fusedgrpo import _lib, _options
from tolerance import assert_close

B, T, H, V = 3, 5, 13, 263


def _problem(seed=7):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((B, T, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) * 0.4).astype(np.float32)
    b = (rng.standard_normal(V) * 0.1).astype(np.float32)
    tok = rng.integers(0, V, (B, T))
    mask = rng.random((B, T)) > 0.2
    mask[0, 0] = True
    g = rng.standard_normal((B, T)).astype(np.float32)
    return h, w, b, tok, mask, g


def _reference(h, w, b, tok, mask, g):
    """float64 gradients of sum(mask * g * logp) over hidden, weight, bias."""
    h64, w64 = h.astype(np.float64).reshape(-1, H), w.astype(np.float64)
    z = h64 @ w64.T + b
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.zeros_like(p)
    onehot[np.arange(B * T), tok.reshape(-1)] = 1.0
    dz = (mask * g).reshape(-1, 1) * (onehot - p)
    return (dz @ w64).reshape(B, T, H), dz.T @ h64, dz.sum(0)


def _small_budget(h, w, b, tok, mask, g):
    """A budget of a few token rows a chunk for the backward (found from its
    own FG_ERR_BUDGET_TOO_SMALL: no CPU's GEMM scratch assumed)."""
    lo, hi = 1024, 64 << 20
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        try:
            fg.fused_linear_logprobs_backward(h, w, tok, g, mask, bias=b, memory_budget=mid)
            hi = mid
        except fg.FusedGRPOError as e:
            assert e.status == "FG_ERR_BUDGET_TOO_SMALL", e
            lo = mid
    fg.fused_linear_logprobs_backward(h, w, tok, g, mask, bias=b, memory_budget=hi)
    assert fg.memory_stats()["chunks"] > 1
    return hi


def _refused(status, run, *names):
    with pytest.raises(fg.FusedGRPOError) as e:
        run()
    assert e.value.status == status, e.value
    for n in names:
        assert n in str(e.value), (n, str(e.value))
    return e.value


# ------------------------------------------------ fused_linear_logprobs_backward

def _views_of_the_weight(w):
    """The weight itself and arrays that share its memory without being it."""
    buf = np.empty((V + 1) * H, np.float32)
    buf[H:] = w.reshape(-1)
    w_in_buf = buf[H:].reshape(V, H)
    return {
        "the same array": (w, w),
        "a view": (w, w[:]),
        "a reshape": (w, w.reshape(-1).reshape(V, H)),
        "a slice one row off": (w_in_buf, buf[:V * H].reshape(V, H)),
    }


@pytest.mark.parametrize("case", ["the same array", "a view", "a reshape",
                                  "a slice one row off"])
def test_backward_into_the_weight_it_reads_is_refused(case):
    """The probe's call: accumulating into the weight it is still reading, in
    several chunks, summed into rows not yet read (a wrong gradient, no
    error). Refused, naming both, and the weight is unchanged."""
    h, w, b, tok, mask, g = _problem()
    budget = _small_budget(h, w, b, tok, mask, g)
    weight, out = _views_of_the_weight(w)[case]
    before = weight.copy()
    gb = np.zeros(V, np.float32)
    _refused("FG_ERR_ALIASED_OUTPUT", lambda: fg.fused_linear_logprobs_backward(
        h, weight, tok, g, mask, bias=b, grad_weight_out=out, grad_bias_out=gb,
        memory_budget=budget), "grad_weight_out", "weight")
    np.testing.assert_array_equal(weight, before)
    np.testing.assert_array_equal(gb, 0)


@pytest.mark.parametrize("case", ["grad_bias_out = bias", "grad_weight_out over hidden",
                                  "grad_bias_out over grad_weight_out",
                                  "grad_weight_out over grad_logp"])
def test_backward_outputs_over_other_arguments_are_refused(case):
    h, w, b, tok, mask, g = _problem()
    gw = np.zeros((V, H), np.float32)
    gb = np.zeros(V, np.float32)
    if case == "grad_bias_out = bias":
        gb, names = b, ("grad_bias_out", "bias")
    elif case == "grad_weight_out over hidden":  # hidden's rows at the start of one buffer
        buf = np.zeros(V * H + B * T * H, np.float32)
        buf[:B * T * H] = h.reshape(-1)
        h, gw, names = buf[:B * T * H].reshape(B, T, H), buf[:V * H].reshape(V, H), (
            "grad_weight_out", "hidden")
    elif case == "grad_bias_out over grad_weight_out":
        buf = np.zeros(V * H + V, np.float32)
        gw, gb, names = buf[:V * H].reshape(V, H), buf[V * H - 1:-1], (
            "grad_weight_out", "grad_bias_out")
    else:
        buf = np.zeros(V * H, np.float32)
        buf[:B * T] = g.reshape(-1)
        g, gw, names = buf[:B * T].reshape(B, T), buf.reshape(V, H), (
            "grad_weight_out", "grad_logp")
    snapshot = {k: a.copy() for k, a in dict(h=h, w=w, b=b, g=g, gw=gw, gb=gb).items()}
    _refused("FG_ERR_ALIASED_OUTPUT", lambda: fg.fused_linear_logprobs_backward(
        h, w, tok, g, mask, bias=b, grad_weight_out=gw, grad_bias_out=gb), *names)
    for k, a in dict(h=h, w=w, b=b, g=g, gw=gw, gb=gb).items():
        np.testing.assert_array_equal(a, snapshot[k], err_msg=k)


def test_backward_into_adjacent_slices_of_one_buffer():
    """Touching is not overlapping: the weight and the sums in adjacent slices of
    one buffer run, several chunks, and add the reference's gradient."""
    h, w, b, tok, mask, g = _problem(8)
    budget = _small_budget(h, w, b, tok, mask, g)
    buf = np.empty(2 * V * H + 2 * V, np.float32)
    weight, gw = buf[:V * H].reshape(V, H), buf[V * H:2 * V * H].reshape(V, H)
    bias, gb = buf[2 * V * H:2 * V * H + V], buf[2 * V * H + V:]
    weight[...], bias[...] = w, b
    gw[...], gb[...] = 0.5, -0.25
    out = fg.fused_linear_logprobs_backward(h, weight, tok, g, mask, bias=bias,
                                            grad_weight_out=gw, grad_bias_out=gb,
                                            memory_budget=budget)
    assert fg.memory_stats()["chunks"] > 1
    assert out["grad_weight"] is gw and out["grad_bias"] is gb
    np.testing.assert_array_equal(weight, w)
    gh_ref, gw_ref, gb_ref = _reference(h, w, b, tok, mask, g)
    assert_close("f32/grad_hidden", out["grad_hidden"], gh_ref)
    assert_close("f32/grad_weight", gw - 0.5, gw_ref)
    assert_close("f32/grad_bias", gb + 0.25, gb_ref)


def _addr(a):
    return a.ctypes.data


def test_the_library_refuses_an_aliased_output_past_the_front_end():
    """The C library's own check (every front end and C caller gets it): the
    raw-address call with grad_weight at the weight's address."""
    h, w, b, tok, mask, g = _problem()
    tok64, m8 = np.ascontiguousarray(tok, np.int64), mask.astype(np.uint8)
    before = w.copy()
    gh = np.full((B, T, H), 7.0, np.float32)
    f32 = _lib.DTYPE_F32
    e = _refused("FG_ERR_ALIASED_OUTPUT", lambda: _lib.logprobs_backward_call(
        "fused", _options.make_exec(), 1.0, B=B, T=T, H=H, V=V, dtype=f32, hidden=_addr(h),
        ld_hidden=H, weight=_addr(w), ld_weight=H, bias=_addr(b), token_ids=_addr(tok64),
        mask=_addr(m8), grad_logp=_addr(g), grad_entropy=0, grad_hidden=_addr(gh),
        grad_weight=_addr(w), grad_bias=0, grad_dtypes=(f32, f32, f32), accumulate=True),
        "grad_weight shares memory with the input weight")
    assert e.code == _lib.STATUS_CODES["FG_ERR_ALIASED_OUTPUT"]
    np.testing.assert_array_equal(w, before)
    np.testing.assert_array_equal(gh, 7.0)


def test_the_library_refuses_partly_overlapping_grad_logits():
    """fg_logits_grpo: grad_logits exactly over the logits is the documented
    in-place backward; one row off, it would overwrite rows not yet read."""
    rng = np.random.default_rng(3)
    V2 = 17
    buf = rng.standard_normal((B * T + 1) * V2).astype(np.float32)
    lg = buf[:B * T * V2]
    tok = np.ascontiguousarray(rng.integers(0, V2, (B, T)), np.int64)
    m8 = np.ones((B, T), np.uint8)
    adv = np.array([1.0, -0.5, 0.25], np.float32)
    logp = np.zeros((B, T), np.float32)
    before = buf.copy()
    cfg = _options.loss_config({})
    f32 = _lib.DTYPE_F32
    _refused("FG_ERR_ALIASED_OUTPUT", lambda: _lib.logits_call(
        cfg, _options.make_exec(), B=B, T=T, V=V2, dtype=f32, logits=_addr(lg), ld_logits=V2,
        token_ids=_addr(tok), mask=_addr(m8), advantages=_addr(adv), old_logp=0, ref_logp=0,
        is_ratio=0, is_ratio_per_sequence=False, logp=_addr(logp), entropy=0,
        grad_logits=_addr(lg) + 4 * V2, ld_grad_logits=V2, grad_dtype=f32),
        "grad_logits shares memory with the input logits")
    np.testing.assert_array_equal(buf, before)
    np.testing.assert_array_equal(logp, 0)


# ------------------------------------------------ logits_grpo(inplace=True)

def _logits_problem(seed=5, T_full=9, C=4, V2=31):
    rng = np.random.default_rng(seed)
    full = rng.standard_normal((B, T_full, V2)).astype(np.float32) * 2
    tok = rng.integers(0, V2, (B, C))
    mask = rng.random((B, C)) > 0.2
    mask[:, 0] = True
    adv = rng.standard_normal(B).astype(np.float32)
    return full, dict(token_ids=tok, mask=mask, advantages=adv)


@pytest.mark.parametrize("view", ["last C positions", "reversed batch", "swapped axes",
                                  "every other position"])
def test_inplace_writes_into_the_callers_view(view):
    """TRL's logits[:, -C:] and other views one row stride cannot describe:
    the gradient lands in the caller's memory (and nowhere else), the same
    bits as out of place, and the result is the caller's array."""
    full, batch = _logits_problem(T_full=9 if view != "every other position" else 8)
    C = batch["mask"].shape[1]
    if view == "last C positions":
        v = full[:, -C:]
    elif view == "reversed batch":
        full = full[:, :C].copy()
        v = full[::-1]
    elif view == "swapped axes":  # [C, B, V] storage seen as [B, C, V]
        full = np.ascontiguousarray(full[:, :C].transpose(1, 0, 2))
        v = full.transpose(1, 0, 2)
    else:
        v = full[:, ::2]
    want = fg.logits_grpo(np.ascontiguousarray(v), **batch, beta=0.0, temperature=0.9)
    outside = full.copy()
    got = fg.logits_grpo(v, **batch, beta=0.0, temperature=0.9, inplace=True)
    assert got.grad_logits is v
    np.testing.assert_array_equal(v, want.grad_logits)
    np.testing.assert_array_equal(got.logp, want.logp)
    assert got.loss == want.loss
    touched = np.zeros(full.shape, bool)
    if view == "swapped axes":
        touched.transpose(1, 0, 2)[...] = True
    elif view == "reversed batch":
        touched[...] = True
    elif view == "last C positions":
        touched[:, -C:] = True
    else:
        touched[:, ::2] = True
    np.testing.assert_array_equal(full[~touched], outside[~touched])


def test_inplace_refused_call_leaves_the_view_unchanged():
    full, batch = _logits_problem()
    v = full[:, -4:]
    before = full.copy()
    _refused("FG_ERR_BAD_TEMPERATURE", lambda: fg.logits_grpo(v, **batch, temperature=0.0,
                                                              inplace=True))
    np.testing.assert_array_equal(full, before)


@pytest.mark.parametrize("case", ["advantages in the logits", "mask in the logits",
                                  "overlapping rows"])
def test_inplace_refuses_logits_sharing_memory(case):
    full, batch = _logits_problem()
    v = full[:, -4:]
    names = ("grad_logits",)
    if case == "advantages in the logits":  # the first floats of a row of the view
        batch["advantages"] = full[0, -1, :B]
        names += ("advantages",)
    elif case == "mask in the logits":  # a uint8 mask in the bytes of a row of the view
        batch["mask"] = full.view(np.uint8)[1, -2, :B * 4].reshape(B, 4)
        batch["mask"][...] = 1
        names += ("mask",)
    else:  # rows that overlap: two elements in one place
        v = np.lib.stride_tricks.as_strided(full, (B, 4, 31), (4 * 8, 4 * 2, 4),
                                            writeable=True)
        names = ("overlap",)
    before = full.copy()
    _refused("FG_ERR_ALIASED_OUTPUT", lambda: fg.logits_grpo(v, **batch, inplace=True), *names)
    np.testing.assert_array_equal(full, before)


# ------------------------------------------------ option and argument values

@pytest.mark.parametrize("bad", [True, False, np.bool_(True), -1, -1.0, -0.5, float("nan"),
                                 float("inf"), 2.0, "sometimes", "AUTO", [0.1]])
def test_filter_eps_refuses_bools_sentinels_and_junk(bad):
    """-1 is the C sentinel for "auto", not a spelling of it; True is no 1.0."""
    h, w, b, tok, mask, g = _problem()
    adv = np.ones(B, np.float32)
    _refused("FG_ERR_BAD_HYPERPARAMETER", lambda: _lib.filter_eps_value(bad), "filter_eps")
    _refused("FG_ERR_BAD_HYPERPARAMETER", lambda: fg.fused_linear_grpo(
        h, w, tok, mask, adv, filter_eps=bad), "filter_eps")
    _refused("FG_ERR_BAD_HYPERPARAMETER", lambda: fg.fused_linear_grpo_plan(
        h, w, tok, mask, adv, filter_eps=bad), "filter_eps")


@pytest.mark.parametrize("good,value", [("auto", -1.0), (None, 0.0), (0, 0.0), (-0.0, 0.0),
                                        (1e-3, 1e-3), (1, 1.0), (np.float32(0.5), 0.5)])
def test_filter_eps_accepts_auto_off_and_thresholds(good, value):
    v = _lib.filter_eps_value(good)
    assert v == value and str(v) == str(value) or good == "auto"
    assert _lib.filter_eps_value(v) == v  # a checked value handed on is taken back
    h, w, b, tok, mask, g = _problem()
    fg.fused_linear_grpo(h, w, tok, mask, np.ones(B, np.float32), filter_eps=good)


def test_filter_eps_auto_is_handed_on_but_a_callers_minus_one_is_not():
    auto = _lib.filter_eps_value("auto")
    assert auto == -1.0 and _lib.filter_eps_value(auto) is auto
    h, w, b, tok, mask, g = _problem()
    adv = np.ones(B, np.float32)
    r = fg.fused_linear_grpo(h, w, tok, mask, adv, filter_eps=auto)  # as JAX's callback does
    want = fg.fused_linear_grpo(h, w, tok, mask, adv, filter_eps="auto")
    np.testing.assert_array_equal(r.grad_weight, want.grad_weight)
    _refused("FG_ERR_BAD_HYPERPARAMETER", lambda: fg.fused_linear_grpo(
        h, w, tok, mask, adv, filter_eps=float(auto)))


@pytest.mark.parametrize("value", [5.7, 5.0, True, np.bool_(False), "5", None])
def test_vocab_positions_must_be_integers(value):
    """vocab_start / vocab_size are never truncated by int()."""
    _refused("FG_ERR_SHAPE_MISMATCH", lambda: _lib.vocab_index("vocab_start", value),
             "vocab_start", repr(value))
    h, w, b, tok, mask, g = _problem()
    kw = dict(B=B, T=T, H=H, V=V, dtype=_lib.DTYPE_F32, hidden=_addr(h), ld_hidden=H,
              weight=_addr(w), ld_weight=H, bias=0, token_ids=0, mask=0, advantages=0,
              old_logp=0, ref_logp=0, is_ratio=0, is_ratio_per_sequence=False, logp=0,
              entropy=0, grad_hidden=0, grad_weight=0, grad_bias=0)
    _refused("FG_ERR_SHAPE_MISMATCH", lambda: _lib._linear_request(
        "fused", **kw, vocab_start=value, vocab_total=2 * V), "vocab_start")
    assert _lib.vocab_index("vocab_size", np.int64(7)) == 7


def test_equal_configs_have_equal_bytes():
    """The checked, normalised options: configurations equal as options give
    equal fg_loss_config bytes however they are spelled (the distributed front
    ends compare those bytes across ranks)."""
    base = _options.config_bytes(_options.loss_config({}))
    spellings = [
        {"beta": 0}, {"beta": 0.0}, {"beta": -0.0}, {"beta": np.float64(0)},
        {"epsilon_high": None}, {"delta": None}, {"max_completion_length": None},
        {"use_bias_correction_kl": 0}, {"use_bias_correction_kl": np.bool_(False)},
        {"entropy_coef": -0.0}, {"top_entropy_quantile": 1}, {"epsilon_low": 0.2},
        {"off_policy_mask_threshold": float("inf")}, {"loss_type": "dapo"},
        {"temperature": 1}, {"num_items_in_batch": None},
    ]
    for s in spellings:
        np.testing.assert_array_equal(_options.config_bytes(_options.loss_config(s)), base,
                                      err_msg=str(s))
    a = _options.config_bytes(_options.loss_config({"beta": 0.04, "max_completion_length": 9,
                                                    "use_bias_correction_kl": True}))
    b = _options.config_bytes(_options.loss_config({"beta": np.float64(0.04),
                                                    "max_completion_length": np.int64(9),
                                                    "use_bias_correction_kl": 1}))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, base)


def test_the_aliasing_status_follows_the_older_ones():
    """Found by name from the library (fg_status_name), after the older
    statuses, whose values stay as they were."""
    assert _lib.STATUS_CODES["FG_ERR_ALIASED_OUTPUT"] == _lib.STATUS_CODES["FG_ERR_OVERFLOW"] + 1
    assert _lib.STATUS_CODES["FG_ERR_OVERFLOW"] == 17
