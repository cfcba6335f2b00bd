"""What the JAX front end refuses, eagerly and under jax.jit, against the NumPy
front end's refusals of the same input (the same FG_ERR_ status):

- the run-time options num_items_in_batch and entropy_coef: a traced value is
  checked by the handler (or the callback) as a concrete one is in Python, so
  no traced value ever stands for a C sentinel (num_items_in_batch = -1 is
  refused, not read as "unset": that is a separate static flag);
- a bool where a number is expected, and the C sentinels given as values;
- token ids that JAX without x64 would cut to 32 bits (2**32 + 3 would run
  as id 3);
- empty sizes.
Accepted cases are held to the NumPy front end's numbers. Small odd sizes:
B = 3, T = 5, H = 7, V = 11."""
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import fusedgrpo  # noqa: E402
import fusedgrpo.jax as fgj  # noqa: E402
from grpo_reference import make_inputs  # noqa: E402

B, T, H, V = 3, 5, 7, 11
BAD = "FG_ERR_BAD_HYPERPARAMETER"


def _inputs(seed=0, **kw):
    inp = make_inputs(np.random.default_rng(seed), B=B, T=T, H=H, V=V, bias=False,
                      bad_masked_ids=False, **kw)
    del inp["bias"]
    return inp


def _args(inp):
    return (inp["hidden"], inp["weight"], inp["token_ids"], inp["mask"], inp["advantages"],
            inp["old_logp"], inp["ref_logp"])


def _numpy_loss(inp, **options):
    return fusedgrpo.fused_linear_grpo(*_args(inp), compute_grad=False, **options).loss


def _numpy_status(fn):
    """The status the NumPy front end refuses with (None: it accepts)."""
    try:
        fn()
    except fusedgrpo.FusedGRPOError as e:
        return e.status
    return None


def _refused(status, fn):
    """An eager call: a FusedGRPOError with this status, raised in Python."""
    with pytest.raises(fusedgrpo.FusedGRPOError) as e:
        jax.block_until_ready(fn())
    assert e.value.status == status, str(e.value)


def _refused_jit(status, fn):
    """Under jit: at trace time (FusedGRPOError) or at run time (the handler's
    error, which names the status)."""
    with pytest.raises(Exception, match=status):
        jax.block_until_ready(fn())


def _close(got, want):
    np.testing.assert_allclose(float(got), want, rtol=2e-6, atol=1e-7)


# ------------------------------------------------ run-time options under jit

@pytest.mark.parametrize("path", ["ffi", "callback", "device_path"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_traced_num_items_in_batch_is_checked_never_a_sentinel(path, loss_type, monkeypatch):
    """A traced num_items_in_batch of -1 (the C library's 'unset'), or any value
    that is not a finite number > 0, is refused as eager refuses it, through the
    CPU handler, the pure_callback backend and the device handlers' path (over
    the reference backend here). grpo does not read it but still checks it,
    as NumPy does. A traced 7 and an unset one give NumPy's losses."""
    if path == "callback":
        monkeypatch.setitem(fgj._state, "backend", "callback")
    inp = _inputs(1)
    opts = dict(loss_type=loss_type, beta=0.05, entropy_coef=0.03)
    if path == "device_path":
        fgj._device_path_on_cpu(True)
    try:
        with_items = jax.jit(lambda n: fgj.fused_linear_grpo_loss(
            *_args(inp), num_items_in_batch=n, **opts))
        unset = jax.jit(lambda h: fgj.fused_linear_grpo_loss(h, *_args(inp)[1:], **opts))
        for bad in (-1.0, -3.0, 0.0, math.nan, math.inf):
            assert _numpy_status(lambda: _numpy_loss(inp, num_items_in_batch=bad, **opts)) == BAD
            _refused_jit(BAD, lambda: with_items(jnp.float32(bad)))
        _refused_jit(BAD, lambda: with_items(jnp.int32(-1)))
        _close(with_items(jnp.float32(7.0)), _numpy_loss(inp, num_items_in_batch=7.0, **opts))
        _close(with_items(jnp.int32(7)), _numpy_loss(inp, num_items_in_batch=7, **opts))
        _close(unset(inp["hidden"]), _numpy_loss(inp, **opts))
        # entropy_coef travels in the same operand: a traced NaN is refused too
        coef = jax.jit(lambda c: fgj.fused_linear_grpo_loss(*_args(inp), loss_type=loss_type,
                                                            entropy_coef=c))
        _refused_jit(BAD, lambda: coef(jnp.float32(math.nan)))
        _close(coef(jnp.float32(-0.25)), _numpy_loss(inp, loss_type=loss_type,
                                                     entropy_coef=-0.25))
    finally:
        if path == "device_path":
            fgj._device_path_on_cpu(False)
    if path == "ffi":  # eager: refused in Python, before any call
        for bad in (-1.0, -1, 0, math.nan):
            _refused(BAD, lambda: fgj.fused_linear_grpo_loss(*_args(inp),
                                                             num_items_in_batch=bad, **opts))
            _refused(BAD, lambda: fgj.fused_linear_grpo_loss(
                *_args(inp), num_items_in_batch=jnp.float32(bad), **opts))
        _close(fgj.fused_linear_grpo_loss(*_args(inp), num_items_in_batch=jnp.float32(7), **opts),
               _numpy_loss(inp, num_items_in_batch=7.0, **opts))


def _mesh(axis):
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax starts")
    return Mesh(np.array(jax.devices()[:4]), (axis,))


@pytest.mark.parametrize("axis,loss_type", [("batch", "dapo"), ("batch", "bnpo"),
                                            ("vocab", "dapo"), ("vocab", "grpo")])
def test_sharded_traced_num_items_in_batch_is_checked(axis, loss_type):
    """Under shard_map a traced num_items_in_batch of -1 was taken for 'unset'
    (dapo: the global token count) or ignored (grpo, bnpo); now every shard
    refuses it, as the unsharded call does. A traced 7 is the whole batch's
    normaliser (NumPy's loss); an all-masked batch without one gives NumPy's
    0 (the count 0 is the library's 1)."""
    mesh = _mesh(axis)
    kw = dict(batch_axis="batch", vocab_axis=None) if axis == "batch" else dict(
        batch_axis=None, vocab_axis="vocab")
    inp = _inputs(2)
    inp = {**inp, **{k: np.concatenate([inp[k], inp[k][:1]]) for k in (
        "hidden", "token_ids", "mask", "advantages", "old_logp", "ref_logp")}}  # B = 4
    opts = dict(loss_type=loss_type, beta=0.05)
    f = jax.jit(lambda h, n: fgj.fused_linear_grpo_loss_sharded(
        mesh, h, *_args(inp)[1:], num_items_in_batch=n, **kw, **opts))
    _refused_jit(BAD, lambda: f(inp["hidden"], jnp.float32(-1.0)))
    _refused_jit(BAD, lambda: f(inp["hidden"], jnp.float32(0.0)))
    _close(f(inp["hidden"], jnp.float32(7.0)), _numpy_loss(inp, num_items_in_batch=7.0, **opts))
    masked = {**inp, "mask": np.zeros_like(inp["mask"])}
    g = jax.jit(lambda h: fgj.fused_linear_grpo_loss_sharded(mesh, h, *_args(masked)[1:], **kw,
                                                             **opts))
    _close(g(inp["hidden"]), _numpy_loss(masked, **opts))


# ------------------------------------------------ bools and sentinels as values

_OPTION_CASES = [
    dict(entropy_coef=True), dict(num_items_in_batch=True), dict(num_items_in_batch=False),
    dict(num_items_in_batch=-1), dict(epsilon_high=-1), dict(delta=0.0),
    dict(max_completion_length=0), dict(max_completion_length=True), dict(temperature=True),
    dict(beta=True), dict(top_entropy_quantile=True), dict(threads=True),
    dict(memory_budget=True),
]


@pytest.mark.parametrize("options", _OPTION_CASES,
                         ids=lambda o: ",".join(f"{k}={v!r}" for k, v in o.items()))
def test_bools_and_sentinel_values_refused_eager_and_under_jit(options):
    """A bool where a number is expected, or a C sentinel's value given as a
    value, is refused with NumPy's status, eagerly and under jit (the option a
    static Python value there)."""
    inp = _inputs(3)
    want = _numpy_status(lambda: _numpy_loss(inp, **options))
    assert want is not None, options
    _refused(want, lambda: fgj.fused_linear_grpo_loss(*_args(inp), **options))
    _refused_jit(want, lambda: jax.jit(lambda h: fgj.fused_linear_grpo_loss(
        h, *_args(inp)[1:], **options))(inp["hidden"]))


def test_traced_bool_or_array_run_time_options_refused():
    """A traced bool, a complex or a non-scalar num_items_in_batch /
    entropy_coef is refused when traced; so is a concrete JAX bool eagerly.
    The static options (and filter_eps) refuse any traced value."""
    inp = _inputs(4)
    for name, status in (("temperature", "FG_ERR_BAD_TEMPERATURE"), ("epsilon_high", BAD),
                         ("delta", BAD), ("max_completion_length", BAD), ("filter_eps", BAD)):
        _refused(status, lambda: jax.jit(lambda x: fgj.fused_linear_grpo_loss(
            *_args(inp), **{name: x}))(jnp.float32(0.5)))
    for name in ("num_items_in_batch", "entropy_coef"):
        for value in (jnp.asarray(True), jnp.ones((2,), jnp.float32),
                      jnp.asarray(1 + 1j, jnp.complex64)):
            _refused(BAD, lambda: jax.jit(lambda x: fgj.fused_linear_grpo_loss(
                *_args(inp), **{name: x}))(value))
        _refused(BAD, lambda: fgj.fused_linear_grpo_loss(*_args(inp), **{name: jnp.asarray(True)}))


@pytest.mark.parametrize("filter_eps", [True, False, -1, -1.0, math.nan, 2.0])
def test_filter_eps_bool_and_sentinel_refused(filter_eps):
    """filter_eps: a bool, or -1 (the library's 'auto' sentinel: "auto" is the
    way to ask for it), NaN or a number past 1 is refused eagerly and under
    jit, as NumPy refuses it (filter_eps_value); "auto" still runs, through the
    CPU handler and the pure_callback backend, with NumPy's numbers."""
    inp = _inputs(5)
    want = _numpy_status(lambda: _numpy_loss(inp, filter_eps=filter_eps))
    assert want == BAD, want
    _refused(BAD, lambda: fgj.fused_linear_grpo_loss(*_args(inp), filter_eps=filter_eps))
    _refused_jit(BAD, lambda: jax.jit(lambda h: fgj.fused_linear_grpo_loss(
        h, *_args(inp)[1:], filter_eps=filter_eps))(inp["hidden"]))


@pytest.mark.parametrize("backend", ["ffi", "callback"])
def test_filter_eps_auto_runs(backend, monkeypatch):
    monkeypatch.setitem(fgj._state, "backend", backend)
    inp = _inputs(5)
    want = fusedgrpo.fused_linear_grpo(*_args(inp), filter_eps="auto")
    loss, gw = jax.jit(jax.value_and_grad(lambda w: fgj.fused_linear_grpo_loss(
        inp["hidden"], w, *_args(inp)[2:], filter_eps="auto"), argnums=0))(inp["weight"])
    _close(loss, want.loss)
    np.testing.assert_allclose(np.asarray(gw), want.grad_weight, rtol=1e-5, atol=1e-7)


def test_sharded_vocab_size_bool_refused():
    """vocab_size=True was taken as 1."""
    mesh = _mesh("vocab")
    inp = _inputs(6)
    for bad in (True, 11.0):
        with pytest.raises(ValueError, match="vocab_size must be an integer"):
            fgj.fused_linear_grpo_loss_sharded(mesh, *_args(inp), batch_axis=None,
                                               vocab_axis="vocab", vocab_size=bad)


# ------------------------------------------------ token ids without x64

def _huge_ids(inp, where, value=2 ** 32 + 3):
    tok = inp["token_ids"].astype(np.int64).copy()
    tok[where] = value
    return tok


def test_int64_token_ids_beyond_int32_refused_without_x64():
    """Without x64, JAX keeps int64 ids as int32: 2**32 + 3 would run as id 3.
    A concrete id outside int32's range (NumPy array, Python ints) is refused
    where unmasked with NumPy's FG_ERR_TOKEN_OUT_OF_RANGE (eagerly, and under
    jit where it is a constant), and ignored where masked as NumPy ignores it
    (NumPy's loss)."""
    assert not jax.config.jax_enable_x64
    inp = _inputs(7)
    status = "FG_ERR_TOKEN_OUT_OF_RANGE"
    for value in (2 ** 32 + 3, -2 ** 32 + 3, 2 ** 31):
        tok = _huge_ids(inp, (1, 0), value)
        bad = {**inp, "token_ids": tok}
        assert _numpy_status(lambda: _numpy_loss(bad)) == status
        _refused(status, lambda: fgj.fused_linear_grpo_loss(*_args(bad)))
        _refused(status, lambda: fgj.fused_linear_grpo_loss(*_args({**bad,
                                                                   "token_ids": tok.tolist()})))
        _refused_jit(status, lambda: jax.jit(lambda h: fgj.fused_linear_grpo_loss(
            h, *_args(bad)[1:]))(inp["hidden"]))
        _refused(status, lambda: fgj.linear_logprobs(jnp.asarray(inp["hidden"]),
                                                     jnp.asarray(inp["weight"]), tok,
                                                     inp["mask"]))
        _refused_jit(status, lambda: jax.jit(lambda h: fgj.linear_logprobs(
            h, jnp.asarray(inp["weight"]), tok, inp["mask"]))(inp["hidden"]))
        # a traced mask: the library refuses the id where the mask holds it
        _refused_jit(status, lambda: jax.jit(lambda m: fgj.fused_linear_grpo_loss(
            inp["hidden"], inp["weight"], tok, m, inp["advantages"]))(inp["mask"]))
    # masked: ignored, as by NumPy
    masked_at = tuple(int(i[0]) for i in np.nonzero(~inp["mask"]))
    ok = {**inp, "token_ids": _huge_ids(inp, masked_at)}
    _close(fgj.fused_linear_grpo_loss(*_args(ok)), _numpy_loss(ok))
    _close(jax.jit(lambda m: fgj.fused_linear_grpo_loss(
        ok["hidden"], ok["weight"], ok["token_ids"], m, ok["advantages"], ok["old_logp"],
        ok["ref_logp"]))(ok["mask"]), _numpy_loss(ok))
    lp = fgj.linear_logprobs(jnp.asarray(ok["hidden"]), jnp.asarray(ok["weight"]),
                             ok["token_ids"], ok["mask"])
    want = fusedgrpo.fused_linear_logprobs(ok["hidden"], ok["weight"], ok["token_ids"],
                                           ok["mask"])
    np.testing.assert_allclose(np.asarray(lp), want, rtol=2e-6, atol=1e-6)


def test_uint64_token_ids_with_x64_are_not_cut_to_int32():
    """With x64, uint64 ids keep their 64 bits: 2**32 + 3 is refused, not run as 3."""
    inp = _inputs(8)
    tok = _huge_ids(inp, (0, 0)).astype(np.uint64)
    with jax.enable_x64(True):
        _refused_jit("FG_ERR_TOKEN_OUT_OF_RANGE", lambda: fgj.fused_linear_grpo_loss(
            *_args({**inp, "token_ids": jnp.asarray(tok)})))
        good = inp["token_ids"].astype(np.uint64)
        _close(fgj.fused_linear_grpo_loss(*_args({**inp, "token_ids": jnp.asarray(good)})),
               _numpy_loss(inp))


# ------------------------------------------------ empty sizes

@pytest.mark.parametrize("shape", [(B, 0, H, V), (0, T, H, V), (B, T, 0, V), (B, T, H, 0)],
                         ids=["T=0", "B=0", "H=0", "V=0"])
def test_empty_sizes_refused_like_numpy(shape):
    """linear_logprobs with T = 0 returned an empty array where NumPy refuses
    (FG_ERR_INVALID_SIZE); the loss refused only when XLA ran it. Both refuse
    at the call now, eagerly and under jit."""
    b, t, h, v = shape
    hid, w = np.zeros((b, t, h), np.float32), np.zeros((v, h), np.float32)
    tok, m = np.zeros((b, t), np.int32), np.ones((b, t), bool)
    adv = np.zeros((b,), np.float32)
    want = _numpy_status(lambda: fusedgrpo.fused_linear_logprobs(hid, w, tok, m))
    assert want == "FG_ERR_INVALID_SIZE"
    assert _numpy_status(lambda: fusedgrpo.fused_linear_grpo(hid, w, tok, m, adv)) == want
    _refused(want, lambda: fgj.linear_logprobs(jnp.asarray(hid), jnp.asarray(w), tok, m))
    _refused(want, lambda: jax.jit(lambda x: fgj.linear_logprobs(x, jnp.asarray(w), tok, m))(
        jnp.asarray(hid)))
    _refused(want, lambda: fgj.fused_linear_grpo_loss(hid, w, tok, m, adv))
    _refused(want, lambda: jax.jit(lambda x: fgj.fused_linear_grpo_loss(x, w, tok, m, adv))(hid))
