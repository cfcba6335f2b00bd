"""Every front end takes the same loss options (fusedgrpo.OPTION_NAMES) and its
optional arrays by keyword (python/README.md's convention), and refuses the
same inputs: each option away from its default through NumPy, torch,
torch.distributed (one rank) and JAX against the float64 reference (a front
end that drops or misreads an option fails here), and the refusals of
fusedgrpo._options / fusedgrpo._inputs, which leave every output untouched."""
import zlib

import numpy as np
import pytest

import fusedgrpo as fg
from grpo_reference import make_inputs, reference
from tolerance import assert_close

B, T, H, V = 3, 4, 8, 11

# Per option: a value away from its default, and the other options (and
# inputs) under which that value changes the loss.
AWAY = {
    "loss_type": ("grpo", {}),
    "importance_sampling_level": ("sequence", {}),
    "temperature": (0.7, {}),
    "epsilon_low": (0.05, {}),
    "epsilon_high": (0.05, {}),
    "delta": (1.05, {"loss_type": "grpo"}),
    "beta": (0.3, {}),
    "max_completion_length": (7, {"loss_type": "dr_grpo"}),
    "num_items_in_batch": (3.0, {}),
    "sapo_temperature_pos": (2.0, {"loss_type": "sapo"}),
    "sapo_temperature_neg": (2.0, {"loss_type": "sapo"}),
    "use_bias_correction_kl": (True, {"beta": 0.3, "sampling": True}),
    "entropy_coef": (0.1, {}),
    "vespo_k_pos": (1.0, {"loss_type": "vespo"}),
    "vespo_lambda_pos": (1.5, {"loss_type": "vespo"}),
    "vespo_k_neg": (1.0, {"loss_type": "vespo"}),
    "vespo_lambda_neg": (1.5, {"loss_type": "vespo"}),
    "off_policy_mask_threshold": (0.05, {"sampling": True}),
    "top_entropy_quantile": (0.5, {}),
}


def test_every_option_is_covered():
    assert set(AWAY) == set(fg.OPTION_NAMES)


def _case(name):
    value, context = AWAY[name]
    context = dict(context)
    sampling = context.pop("sampling", False)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    inp = make_inputs(rng, B=B, T=T, H=H, V=V, bad_masked_ids=False)
    if sampling:
        inp["sampling_logp"] = (inp["old_logp"] + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    return inp, {**context, name: value}, context


def _torch_run(inp, options, module="fusedgrpo.torch"):
    """(loss, grad_hidden) of `module`'s fused_linear_grpo_loss (fusedgrpo.torch,
    or fusedgrpo.torch_distributed on a one-rank group)."""
    torch = pytest.importorskip("torch")
    import importlib
    loss_fn = importlib.import_module(module).fused_linear_grpo_loss
    t = {k: None if v is None else torch.from_numpy(np.array(v)) for k, v in inp.items()}
    h = t["hidden"].clone().requires_grad_()
    loss, _, _, _ = loss_fn(
        h, t["weight"], t["token_ids"], t["mask"], t["advantages"], bias=t["bias"],
        old_logp=t["old_logp"], ref_logp=t["ref_logp"], sampling_logp=t.get("sampling_logp"),
        **options)
    loss.backward()
    return float(loss.detach()), h.grad.numpy()


@pytest.fixture(scope="module")
def one_rank_group():
    """A torch.distributed group of this process alone (gloo), for the
    vocab-parallel front end with the whole vocabulary on its one rank."""
    torch = pytest.importorskip("torch")
    import socket
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()  # later tests (the TRL trainer's) see no group


def _jax_run(inp, options):
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp
    import fusedgrpo.jax as fj
    args = {k: None if v is None else jnp.asarray(v) for k, v in inp.items()}

    def f(h):
        return fj.fused_linear_grpo_loss(
            h, args["weight"], args["token_ids"], args["mask"], args["advantages"],
            bias=args["bias"], old_logp=args["old_logp"], ref_logp=args["ref_logp"],
            sampling_logp=args.get("sampling_logp"), **options)
    loss, gh = jax.jit(jax.value_and_grad(f))(args["hidden"])
    return float(loss), np.asarray(gh)


@pytest.mark.parametrize("name", sorted(AWAY))
def test_each_option_reaches_every_front_end(name, one_rank_group):
    inp, options, context = _case(name)
    want = reference(**inp, **options)
    default = reference(**inp, **context)
    # the value matters here: a front end that dropped it would give `default`
    assert abs(want["loss"] - default["loss"]) > 1e-3 * max(1.0, abs(want["loss"])), name
    r = fg.fused_linear_grpo(**inp, **options)  # every array by keyword, as below
    assert_close("f32/loss", r.loss, want["loss"], f"numpy {name}", scale=want["loss_scale"])
    assert_close("f32/grad_hidden", r.grad_hidden, want["grad_hidden"], f"numpy {name}")
    runs = {"torch": lambda: _torch_run(inp, options),
            "torch_distributed": lambda: _torch_run(inp, options, "fusedgrpo.torch_distributed"),
            "jax": lambda: _jax_run(inp, options)}
    for tag, run in runs.items():
        loss, gh = run()
        assert_close("f32/loss", loss, want["loss"], f"{tag} {name}", scale=want["loss_scale"])
        assert_close("f32/grad_hidden", gh, want["grad_hidden"], f"{tag} {name}")


# ------------------------------------------------------------------ refusals

REFUSED = [
    dict(threads=100000), dict(threads=0), dict(threads=2**31 - 1), dict(threads=2.5),
    dict(memory_budget=2**64 + 100), dict(memory_budget=0), dict(memory_budget=-1),
    dict(max_completion_length=2**64 + 1), dict(max_completion_length=0),
    dict(max_completion_length=-4), dict(num_items_in_batch=-5), dict(num_items_in_batch=0),
    dict(epsilon_high=-0.3), dict(epsilon_low=-0.1), dict(temperature=None),
    dict(temperature=0.0), dict(temperature=float("inf")), dict(delta=-1.0),
    dict(beta=float("nan")), dict(top_entropy_quantile=1.5), dict(vespo_k_pos=0.0),
    dict(off_policy_mask_threshold=float("nan")), dict(loss_type="ppo"),
]


def _named(kw):
    (name, value), = kw.items()
    return name, value


@pytest.mark.parametrize("kw", REFUSED, ids=lambda kw: "{}={}".format(*_named(kw)))
def test_out_of_range_options_are_refused_naming_the_option(kw):
    inp = make_inputs(np.random.default_rng(3), B=B, T=T, H=H, V=V)
    name, _ = _named(kw)
    with pytest.raises(fg.FusedGRPOError, match=name):
        fg.fused_linear_grpo(**inp, **kw)
    torch = pytest.importorskip("torch")
    import fusedgrpo.torch as fgt
    t = {k: None if v is None else torch.from_numpy(np.array(v)) for k, v in inp.items()}
    with pytest.raises(fg.FusedGRPOError, match=name):
        fgt.fused_linear_grpo_loss(t["hidden"], t["weight"], t["token_ids"], t["mask"],
                                   t["advantages"], t["bias"], t["old_logp"], t["ref_logp"], **kw)


@pytest.mark.parametrize("bad", [True, False, -1, -1.0, float("nan"), 2.0, "sometimes"],
                         ids=repr)
def test_filter_eps_sentinel_and_bools_are_refused_by_every_front_end(bad):
    """filter_eps, like every option, refuses a bool (True is no 1.0) and the C
    sentinel -1 ("auto" is how to ask for it), in NumPy and in torch's
    functional and module forms (fusedgrpo._lib.filter_eps_value)."""
    inp = make_inputs(np.random.default_rng(10), B=B, T=T, H=H, V=V)
    with pytest.raises(fg.FusedGRPOError, match="FG_ERR_BAD_HYPERPARAMETER.*filter_eps"):
        fg.fused_linear_grpo(**inp, filter_eps=bad)
    torch = pytest.importorskip("torch")
    import fusedgrpo.torch as fgt
    t = {k: None if v is None else torch.from_numpy(np.array(v)) for k, v in inp.items()}
    with pytest.raises(fg.FusedGRPOError, match="FG_ERR_BAD_HYPERPARAMETER.*filter_eps"):
        fgt.fused_linear_grpo_loss(t["hidden"], t["weight"], t["token_ids"], t["mask"],
                                   t["advantages"], t["bias"], t["old_logp"], t["ref_logp"],
                                   filter_eps=bad)
    with pytest.raises(fg.FusedGRPOError, match="FG_ERR_BAD_HYPERPARAMETER.*filter_eps"):
        fgt.FusedLinearGRPOLoss(filter_eps=bad)


def test_filter_eps_auto_reaches_the_library_through_torch():
    """"auto" travels through the torch op's float argument as the C value
    -1.0, which the raw-address layer takes as "auto": with bf16 inputs and a
    peaked softmax the library filters (memory_stats counts fewer entries
    kept), as NumPy's "auto" does, to the same kept count."""
    torch = pytest.importorskip("torch")
    import fusedgrpo.torch as fgt
    rng = np.random.default_rng(11)
    Bf, Tf, Hf, Vf = 2, 7, 33, 1021
    h = rng.standard_normal((Bf, Tf, Hf)).astype(np.float32)
    w = (rng.standard_normal((Vf, Hf)) * 8.0 / np.sqrt(Hf)).astype(np.float32)
    tok = rng.integers(0, Vf, (Bf, Tf))
    mask = np.ones((Bf, Tf), bool)
    adv = np.array([1.0, -0.5], np.float32)
    fg.fused_linear_grpo(h, w, tok, mask, adv, dtype="bfloat16", filter_eps="auto")
    want = fg.memory_stats()
    assert 0 < want["dlogits_kept"] < want["dlogits_entries"], want
    hb = torch.from_numpy(h).to(torch.bfloat16).requires_grad_()
    loss, _, _, _ = fgt.fused_linear_grpo_loss(
        hb, torch.from_numpy(w).to(torch.bfloat16), torch.from_numpy(tok),
        torch.from_numpy(mask), torch.from_numpy(adv), filter_eps="auto")
    got = fg.memory_stats()  # the op ran on this thread's context
    assert (got["dlogits_kept"], got["dlogits_entries"]) == (
        want["dlogits_kept"], want["dlogits_entries"])


def test_grad_dtype_error_names_grad_dtype():
    inp = make_inputs(np.random.default_rng(4), B=B, T=T, H=H, V=V)
    with pytest.raises(fg.FusedGRPOError, match="grad_dtype"):
        fg.fused_linear_grpo(**inp, grad_dtype="float16")


def test_unknown_option_is_a_type_error():
    inp = make_inputs(np.random.default_rng(4), B=B, T=T, H=H, V=V)
    with pytest.raises(TypeError, match="vespo_lamda_pos"):
        fg.fused_linear_grpo(**inp, vespo_lamda_pos=1.0)


@pytest.mark.parametrize("bad", ["float_token", "half_mask", "nan_mask", "two_mask"])
def test_float_token_ids_and_non_binary_masks_are_refused(bad):
    inp = make_inputs(np.random.default_rng(5), B=B, T=T, H=H, V=V, bad_masked_ids=False)
    if bad == "float_token":
        inp["token_ids"] = inp["token_ids"].astype(np.float64) + 0.7
    else:
        m = inp["mask"].astype(np.float32)
        m[0, 0] = {"half_mask": 0.5, "nan_mask": np.nan, "two_mask": 2.0}[bad]
        inp["mask"] = m
    with pytest.raises(fg.FusedGRPOError, match="token_ids" if bad == "float_token" else "mask"):
        fg.fused_linear_grpo(**inp)


def test_refused_accumulation_leaves_the_buffers_untouched():
    inp = make_inputs(np.random.default_rng(6), B=B, T=T, H=H, V=V, bad_masked_ids=False)
    gw = np.random.default_rng(7).standard_normal((V, H)).astype(np.float32)
    gb = np.random.default_rng(8).standard_normal(V).astype(np.float32)
    before = gw.copy(), gb.copy()
    g = np.ones((B, T), np.float32)
    for kw in (dict(threads=100000), dict(memory_budget=2**64), dict(temperature=None),
               dict(mask=np.full((B, T), 0.5, np.float32))):
        args = dict(mask=inp["mask"], bias=inp["bias"], grad_weight_out=gw, grad_bias_out=gb)
        args.update(kw)
        with pytest.raises(fg.FusedGRPOError):
            fg.fused_linear_logprobs_backward(inp["hidden"], inp["weight"], inp["token_ids"], g,
                                              **args)
        assert np.array_equal(gw, before[0]) and np.array_equal(gb, before[1]), kw


def test_overflowing_hidden_row_leaves_the_buffers_untouched():
    """A finite hidden row whose logits overflow: the library refuses the call
    (FG_ERR_OVERFLOW) and the caller's accumulated sum is kept."""
    inp = make_inputs(np.random.default_rng(6), B=B, T=T, H=H, V=V, bad_masked_ids=False)
    inp["hidden"][0, 0] = 1e38
    gw = np.ones((V, H), np.float32)
    with pytest.raises(fg.FusedGRPOError):
        fg.fused_linear_logprobs_backward(inp["hidden"], inp["weight"], inp["token_ids"],
                                          np.ones((B, T), np.float32), inp["mask"],
                                          grad_weight_out=gw)
    assert np.array_equal(gw, np.ones((V, H), np.float32))


# ------------------------------------------------------------------ torch inputs

def _torch_inputs():
    torch = pytest.importorskip("torch")
    inp = make_inputs(np.random.default_rng(9), B=2, T=4, H=8, V=16, bad_masked_ids=False)
    return torch, {k: None if v is None else torch.from_numpy(np.array(v))
                   for k, v in inp.items()}


TORCH_BAD = {
    "old_logp_short": lambda torch, t: dict(old_logp=t["old_logp"][:, 1:].clone()),
    "bias_short": lambda torch, t: dict(bias=torch.zeros(3)),
    "token_ids_short": lambda torch, t: dict(token_ids=t["token_ids"][:, :3].clone()),
    "hidden_2d": lambda torch, t: dict(hidden=t["hidden"][0].clone()),
    "advantages_meta": lambda torch, t: dict(advantages=t["advantages"].to("meta")),
    "old_logp_meta": lambda torch, t: dict(old_logp=t["old_logp"].to("meta")),
    "float_token": lambda torch, t: dict(token_ids=t["token_ids"].double() + 0.7),
    "half_mask": lambda torch, t: dict(mask=torch.full(t["mask"].shape, 0.5)),
    "float64": lambda torch, t: dict(hidden=t["hidden"].double()),
}


@pytest.mark.parametrize("case", sorted(TORCH_BAD))
def test_torch_refuses_before_the_c_call(case):
    torch, t = _torch_inputs()
    import fusedgrpo.torch as fgt
    t.update(TORCH_BAD[case](torch, t))
    with pytest.raises(fg.FusedGRPOError):
        fgt.fused_linear_grpo_loss(t["hidden"], t["weight"], t["token_ids"], t["mask"],
                                   t["advantages"], t["bias"], t["old_logp"], t["ref_logp"])
    if case in ("bias_short", "hidden_2d", "token_ids_short", "float_token", "half_mask"):
        with pytest.raises(fg.FusedGRPOError):
            fgt.linear_logprobs(t["hidden"], t["weight"], t["token_ids"], t["mask"], t["bias"])


def test_torch_double_backward_raises():
    torch, t = _torch_inputs()
    import fusedgrpo.torch as fgt
    h = t["hidden"].clone().requires_grad_()
    loss, _, _, _ = fgt.fused_linear_grpo_loss(h, t["weight"], t["token_ids"], t["mask"],
                                               t["advantages"], t["bias"], t["old_logp"])
    (g,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward|differentiate"):
        torch.autograd.grad(g.sum(), h)


def test_failed_context_says_why(monkeypatch):
    """A context that cannot be made carries the library's reason (the C
    library's fg_context_create_error): here the path the CUDA backend's
    library was looked for at."""
    from fusedgrpo import _lib

    monkeypatch.setenv("FUSEDGRPO_CUDA_LIBRARY", "/nonexistent/libfusedgrpo_cuda_probe.so")
    with pytest.raises(fg.FusedGRPOError) as e:
        _lib.Context(_lib.BACKENDS["cuda"])
    assert e.value.status == "FG_ERR_UNSUPPORTED"
    assert "/nonexistent/libfusedgrpo_cuda_probe.so" in str(e.value)
    _lib.Context(0)  # the CPU still works, and a later create clears the message
    assert _lib.lib.fg_context_create_error() == b""
