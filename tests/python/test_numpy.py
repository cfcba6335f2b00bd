"""The NumPy front end against the float64 reference of LOSS_SPEC.md."""
import ctypes
import threading
import tracemalloc
import zlib

import numpy as np
import pytest

import fusedgrpo as fg
from fusedgrpo import _lib
from budgets import several_chunks_budget
from grpo_reference import make_inputs, reference
from tolerance import assert_close, compare_to_reference

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
LEVELS = ["token", "sequence"]

# Option sets: each is (name, input kwargs, config kwargs).
OPTIONS = [
    ("defaults", {}, {}),
    ("on_policy", {"off_policy": False}, {}),
    ("beta_kl", {}, {"beta": 0.1}),
    ("beta_kl_bias_corrected", {}, {"beta": 0.2, "use_bias_correction_kl": True}),
    ("asym_eps_delta", {}, {"epsilon_low": 0.15, "epsilon_high": 0.28, "delta": 1.3}),
    ("is_ratio_tokens", {"is_ratio": "token"}, {}),
    ("is_ratio_seq", {"is_ratio": "seq"}, {"beta": 0.05}),
    ("temperature_entropy", {}, {"temperature": 0.7, "entropy_coef": 0.05}),
    ("normalizers", {"bias": False}, {"max_completion_length": 9, "num_items_in_batch": 17,
                                      "sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.6}),
    # TRL 1.16's options (docs/LOSS_SPEC.md): the off-policy sequence mask fed by
    # the sampler's log-probs (NaN: an unscored token), the high-entropy token
    # mask with the entropy bonus over it, vespo's k / lambda with is_ratio
    ("off_policy_mask", {"sampling": True}, {"off_policy_mask_threshold": 0.0, "beta": 0.05}),
    ("off_policy_mask_on_policy", {"off_policy": False}, {"off_policy_mask_threshold": -0.01}),
    ("entropy_quantile", {}, {"top_entropy_quantile": 0.6, "entropy_coef": 0.05}),
    ("entropy_quantile_low_is", {"is_ratio": "token"}, {"top_entropy_quantile": 0.2,
                                                        "entropy_coef": -0.03}),
    ("vespo_params", {"is_ratio": "seq"}, {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5,
                                           "vespo_k_neg": 2.0, "vespo_lambda_neg": 1.0}),
]


def _inputs(seed, opt_inp, **kw):
    rng = np.random.default_rng(seed)
    opt = dict(opt_inp)
    isr = opt.pop("is_ratio", None)
    sampling = opt.pop("sampling", False)
    inp = make_inputs(rng, **{**opt, **kw})
    B, T = inp["mask"].shape
    if sampling:  # around old_logp; every 5th token unscored (NaN), as vLLM may give
        s = inp["old_logp"] + rng.normal(0, 0.2, (B, T)).astype(np.float32)
        s.reshape(-1)[4::5] = np.nan
        inp["sampling_logp"] = s
    if isr == "token":
        inp["is_ratio"] = rng.uniform(0.5, 1.5, (B, T)).astype(np.float32)
    elif isr == "seq":
        inp["is_ratio"] = rng.uniform(0.5, 1.5, (B,)).astype(np.float32)
    return inp


def check_against_reference(inp, cfg, *, impl="fused", memory_budget=None, threads=None,
                            dtype="float32"):
    got = fg.fused_linear_grpo(**inp, **cfg, impl=impl, memory_budget=memory_budget,
                               threads=threads, dtype=dtype)
    ref_inp = dict(inp)
    if dtype == "bfloat16":  # the reference sees the bf16-rounded inputs
        for k in ("hidden", "weight", "bias"):
            if ref_inp.get(k) is not None:
                ref_inp[k] = fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(ref_inp[k]))
    want = reference(**ref_inp, **cfg)
    compare_to_reference("bf16" if dtype == "bfloat16" else "f32", vars(got), want,
                         f"{cfg} impl={impl}")
    return got, want


@pytest.mark.parametrize("opt", OPTIONS, ids=[o[0] for o in OPTIONS])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_loss_types_levels_options(loss_type, level, opt):
    name, opt_inp, opt_cfg = opt
    seed = zlib.crc32(f"{loss_type}/{level}/{name}".encode())
    inp = _inputs(seed, opt_inp)
    if loss_type == "cispo":
        opt_cfg = {**opt_cfg, "epsilon_high": 1.1}  # an absolute cap on the ratio for CISPO
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, **opt_cfg)
    check_against_reference(inp, cfg)


NEW_OPTIONS = [o for o in OPTIONS if o[0] in ("off_policy_mask", "entropy_quantile",
                                                "entropy_quantile_low_is", "vespo_params")]


@pytest.mark.parametrize("opt", NEW_OPTIONS, ids=[o[0] for o in NEW_OPTIONS])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "vespo"])
def test_trl_options_bf16_fused_chunked(loss_type, level, opt):
    """TRL 1.16's options with bf16 inputs, fused over several chunks (these
    options need every token's log-prob or entropy before the gradient sweep)."""
    name, opt_inp, opt_cfg = opt
    seed = zlib.crc32(f"bf16/{loss_type}/{level}/{name}".encode())
    inp = _inputs(seed, opt_inp, B=3, T=7, H=45, V=1013)
    if loss_type == "cispo":
        opt_cfg = {**opt_cfg, "epsilon_high": 1.1}
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, **opt_cfg)
    with pytest.raises(fg.FusedGRPOError) as e:  # the smallest budget, from the planner
        fg.fused_linear_grpo_plan(**inp, **cfg, dtype="bfloat16", memory_budget=1)
    budget = e.value.plan["min_budget_bytes"]  # one token row a chunk
    got, _ = check_against_reference(inp, cfg, dtype="bfloat16", memory_budget=budget)
    assert fg.memory_stats()["chunks"] > 1


def _rel_l2(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _budget_with_grad_weight_sums(inp, cfg):
    """A budget (found by plan queries, no CPU's scratch sizes assumed) at which
    the call walks several chunks of >= 64 rows with a bf16 grad_weight summed in
    float32 (fusedgrpo.h)."""
    plan = fg.fused_linear_grpo_plan(**inp, **cfg, dtype="bfloat16", grad_dtype="bfloat16")
    b = plan["min_budget_bytes"]
    while b < plan["working_bytes"] + 4 * inp["weight"].size:
        q = fg.fused_linear_grpo_plan(**inp, **cfg, dtype="bfloat16", grad_dtype="bfloat16",
                                      memory_budget=b)
        if q["chunks"] >= 2 and q["grad_weight_sum_bytes"] > 0:
            return b
        b += b // 8
    raise AssertionError(f"no budget gives float32 grad_weight sums over chunks: {plan}")


@pytest.mark.parametrize("budget", ["one_chunk", "float32_sums_over_chunks", "smallest"])
@pytest.mark.parametrize("opt", NEW_OPTIONS, ids=[o[0] for o in NEW_OPTIONS])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", ["dapo", "vespo"])
def test_bf16_gradients_within_twice_rounding(loss_type, level, opt, budget):
    """The bound on bf16 gradient outputs (grad_dtype="bfloat16"): the
    error against the float64 reference is no worse than twice that of rounding
    the same call's float32 gradient to bf16 (relative L2). The documented
    exception, a grad_weight rounded once per chunk (CPUs with bf16 GEMM kernels,
    no room for the float32 sums), is the C test's (test_bf16_grads)."""
    name, opt_inp, opt_cfg = opt
    inp = _inputs(zlib.crc32(f"bf16_out/{loss_type}/{level}/{name}".encode()), opt_inp,
                  B=7, T=61, H=45, V=1013)
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, **opt_cfg)
    if budget == "one_chunk":
        mb = None
    elif budget == "smallest":  # with room for the float32 sums (bf16 GEMM kernels)
        least = fg.fused_linear_grpo_plan(**inp, **cfg, dtype="bfloat16", grad_dtype="bfloat16")
        mb = least["min_budget_bytes"]
        if least["gemm_dtype"] == _lib.DTYPE_BF16:
            mb += 4 * inp["weight"].size + 8192
    else:
        mb = _budget_with_grad_weight_sums(inp, cfg)
    plan = fg.fused_linear_grpo_plan(**inp, **cfg, dtype="bfloat16", grad_dtype="bfloat16",
                                     memory_budget=mb)
    got = fg.fused_linear_grpo(**inp, **cfg, dtype="bfloat16", grad_dtype="bfloat16",
                               memory_budget=mb)
    f32 = fg.fused_linear_grpo(**inp, **cfg, dtype="bfloat16", memory_budget=mb)
    ref_inp = {**inp, **{k: fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(inp[k]))
                         for k in ("hidden", "weight", "bias")}}
    want = reference(**ref_inp, **cfg)
    assert plan["chunks"] == 1 or plan["grad_weight_sum_bytes"] > 0, plan
    for g in ("grad_hidden", "grad_weight", "grad_bias"):
        assert np.array_equal(getattr(got, g), fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(
            getattr(got, g)))), f"{g} holds values that are not bf16"
        e = _rel_l2(getattr(got, g), want[g])
        r = _rel_l2(fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(getattr(f32, g))), want[g])
        # e / r against the acceptance's 2
        assert_close("bf16_out/ratio_to_rounded_f32", e, 0.0, scale=r)


@pytest.mark.parametrize("impl", ["fused", "materialized"])
def test_odd_sizes_prime_vocab_all_masked_sequence(impl):
    # V prime, H not a multiple of 16, one sequence fully masked
    inp = _inputs(7, {}, B=4, T=6, H=37, V=1009, all_masked_row=2)
    for lt in ("grpo", "dapo", "luspo"):
        cfg = dict(loss_type=lt, beta=0.1, entropy_coef=0.01)
        got, _ = check_against_reference(inp, cfg, impl=impl)
        assert np.all(got.grad_hidden[2] == 0)
        assert np.all(got.logp[2] == 0) and np.all(got.entropy[2] == 0)


def test_everything_masked_is_zero_not_nan():
    inp = _inputs(8, {}, B=2, T=3, H=5, V=7)
    inp["mask"][:] = False
    for lt in LOSS_TYPES:
        got = fg.fused_linear_grpo(**inp, loss_type=lt, beta=0.1)
        assert got.loss == 0.0
        assert np.all(got.grad_hidden == 0) and np.all(got.grad_weight == 0)
        # TRL's conventions: the per-sequence min/max of clipped types have no
        # sequence to count (nanmin of nothing: NaN); vespo's weight of an
        # empty sequence is phi(1) = 1; everything else is 0, never NaN.
        special = {"clip_ratio_low_min", "clip_ratio_high_max", "vespo_phi_seq_mean"}
        assert all(v == 0 for k, v in got.metrics.items() if k not in special), got.metrics
        clipped = lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
        for k in ("clip_ratio_low_min", "clip_ratio_high_max"):
            assert np.isnan(got.metrics[k]) if clipped else got.metrics[k] == 0, (lt, k)
        assert got.metrics["vespo_phi_seq_mean"] == (1.0 if lt == "vespo" else 0.0)


def test_chunked_small_budget_matches_one_chunk():
    inp = _inputs(9, {}, B=3, T=40, H=24, V=2053)
    cfg = dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05)
    budget = several_chunks_budget(**inp, **cfg)
    plan = fg.fused_linear_grpo_plan(**inp, **cfg, memory_budget=budget)
    assert plan["chunks"] > 1 and plan["working_bytes"] <= budget, plan

    # In a thread of its own, the call runs on a fresh context (one per thread),
    # so its counted peak is this call's alone: the planned working bytes.
    def chunked():
        results["small"], _ = check_against_reference(inp, cfg, memory_budget=budget)
        results["stats"] = fg.memory_stats()

    results = {}
    worker = threading.Thread(target=chunked)
    worker.start()
    worker.join()
    stats = results["stats"]
    assert stats["budget_bytes"] == budget
    assert (stats["chunk_rows"], stats["chunks"]) == (plan["chunk_rows"], plan["chunks"])
    assert stats["peak_bytes"] == plan["working_bytes"], (stats, plan)
    assert stats["gemm_flops"] > 0 and 0 < stats["gemm_seconds"] <= stats["call_seconds"], stats
    big = fg.fused_linear_grpo(**inp, **cfg)
    assert fg.memory_stats()["chunks"] == 1
    assert_close("chunking/grad_weight", results["small"].grad_weight, big.grad_weight)


def test_plan_min_budget_is_exact():
    """The planner's min_budget_bytes is the smallest budget the call runs with.
    V = 1031: one row's logits alone (4124 bytes) are more than the page the
    budget is rounded to, so no CPU's scratch size leaves room for a second row."""
    inp = _inputs(19, {}, B=2, T=6, H=16, V=1031)
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo_plan(**inp, memory_budget=1024)
    assert e.value.status == "FG_ERR_BUDGET_TOO_SMALL"
    least = e.value.plan["min_budget_bytes"]
    assert least > 1024 and e.value.plan["chunk_rows"] == 0
    plan = fg.fused_linear_grpo_plan(**inp, memory_budget=least)
    assert plan["chunk_rows"] == 1 and plan["min_budget_bytes"] == least
    fg.fused_linear_grpo(**inp, memory_budget=least)
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**inp, memory_budget=least - 1)
    assert e.value.status == "FG_ERR_BUDGET_TOO_SMALL"


BF16_CASES = [("dapo", "token", {"beta": 0.04}),
              ("grpo", "sequence", {"beta": 0.1, "temperature": 0.8}),
              ("cispo", "token", {"epsilon_high": 1.1, "entropy_coef": 0.05}),
              ("sapo", "token", {})]


@pytest.mark.parametrize("impl", ["fused", "materialized"])
@pytest.mark.parametrize("case", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_bfloat16_inputs_against_reference(case, impl):
    loss_type, level, extra = case
    inp = _inputs(zlib.crc32(f"bf16/{loss_type}".encode()), {}, B=2, T=7, H=20, V=61)
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, **extra)
    check_against_reference(inp, cfg, impl=impl, dtype="bfloat16")


def test_bfloat16_storage_forms_agree():
    inp = _inputs(10, {}, B=2, T=7, H=20, V=61)
    cfg = dict(loss_type="dapo", beta=0.04)
    # uint16 bit arrays are taken as bf16 as they are
    bits = {k: fg.f32_to_bf16_bits(inp[k]) for k in ("hidden", "weight", "bias")}
    a = fg.fused_linear_grpo(**{**inp, **bits}, **cfg)
    b = fg.fused_linear_grpo(**inp, **cfg, dtype="bfloat16")
    assert a.loss == b.loss
    np.testing.assert_array_equal(a.grad_weight, b.grad_weight)


def test_bf16_conversion_round_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, -np.inf, 0.0, -0.0,
                  np.finfo(np.float32).max, 1e-40], np.float32)
    bits = fg.f32_to_bf16_bits(x)
    want = [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x7F80, 0x0001]
    assert [int(v) for v in bits] == want
    # the C library's own conversion agrees
    assert [int(_lib.lib.fg_f32_to_bf16(float(v))) for v in x] == want
    assert np.isnan(fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(np.array([np.nan], np.float32))))[0]
    y = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    back = fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(y))
    assert np.max(np.abs(back - y) / np.abs(y)) <= 2**-8


def test_bitwise_identical_for_any_thread_count():
    """fusedgrpo.h: same inputs and budget => the same bits, whatever the thread
    count (threads travel with each call)."""
    inp = _inputs(11, {}, B=2, T=9, H=33, V=101)
    a = fg.fused_linear_grpo(**inp, threads=1)
    for threads in (1, 2, 3):
        b = fg.fused_linear_grpo(**inp, threads=threads)
        assert a.loss == b.loss and a.metrics == b.metrics
        for k in ("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"):
            np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)


def test_threads_calling_at_once_get_the_serial_results():
    """Each Python thread has its own context: concurrent calls neither wait
    for one another nor mix their results."""
    cases = [(_inputs(40 + i, {}, B=2, T=5, H=16, V=97), dict(beta=0.05 * i, threads=1))
             for i in range(4)]
    serial = [fg.fused_linear_grpo(**inp, **cfg) for inp, cfg in cases]
    concurrent = [None] * len(cases)

    def run(i):
        for _ in range(3):
            concurrent[i] = fg.fused_linear_grpo(**cases[i][0], **cases[i][1])

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for a, b in zip(serial, concurrent):
        assert a.loss == b.loss
        np.testing.assert_array_equal(a.grad_weight, b.grad_weight)


def test_non_contiguous_views_match():
    inp = _inputs(12, {}, B=2, T=5, H=16, V=29)
    wide = np.zeros((2, 5, 24), np.float32)
    wide[..., :16] = inp["hidden"]
    wwide = np.zeros((29, 20), np.float32)
    wwide[:, :16] = inp["weight"]
    a = fg.fused_linear_grpo(**inp)
    b = fg.fused_linear_grpo(**{**inp, "hidden": wide[..., :16]})
    assert a.loss == b.loss
    np.testing.assert_array_equal(a.grad_weight, b.grad_weight)
    # oneDNN picks its kernel by the weight's row stride too: not the same bits
    want = reference(**inp)
    c = fg.fused_linear_grpo(**{**inp, "weight": wwide[:, :16]})
    compare_to_reference("f32", vars(c), want, "row-strided weight")
    # Transposed weight (column stride != 1) is copied, and so exactly the same
    d = fg.fused_linear_grpo(**{**inp, "weight": np.asfortranarray(inp["weight"])})
    assert a.loss == d.loss
    np.testing.assert_array_equal(a.grad_weight, d.grad_weight)


NOT_FLOAT = [np.complex64, np.bool_, np.int32, np.int64, np.uint8, object]


@pytest.mark.parametrize("bad", NOT_FLOAT, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", ["hidden", "weight", "bias", "logits"])
def test_non_float_operands_are_refused(name, bad):
    """hidden, weight, bias and logits must be floating point (float32, bf16
    storage, or floats the front end converts): complex (whose imaginary part
    a conversion would drop, with only NumPy's warning), bool, integer and
    object arrays are refused naming the argument, as torch and JAX refuse
    them; uint16 is bf16 storage, not an integer."""
    import warnings
    inp = _inputs(31, {}, B=2, T=3, H=5, V=7)
    if name == "logits":
        logits = (inp["hidden"] @ inp["weight"].T).astype(bad)
        run = lambda: fg.logits_grpo(logits, inp["token_ids"], inp["mask"],  # noqa: E731
                                     inp["advantages"])
    else:
        run = lambda: fg.fused_linear_grpo(**{**inp, name: inp[name].astype(bad)})  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning: refused before any conversion
        with pytest.raises(fg.FusedGRPOError) as e:
            run()
    assert e.value.status == "FG_ERR_SHAPE_MISMATCH" and name in str(e.value), e.value
    assert "floating-point" in str(e.value)


@pytest.mark.parametrize("bad", [np.complex64, np.bool_, object], ids=lambda d: np.dtype(d).name)
def test_non_real_backward_derivatives_are_refused(bad):
    """grad_logp / grad_entropy of fused_linear_logprobs_backward: real numbers,
    as the loss's per-token arrays (advantages, old_logp, ...)."""
    inp = _inputs(32, {}, B=2, T=3, H=5, V=7)
    g = np.ones((2, 3))
    for name in ("grad_logp", "grad_entropy"):
        kw = {"grad_logp": g, "grad_entropy": g, name: g.astype(bad)}
        with pytest.raises(fg.FusedGRPOError) as e:
            fg.fused_linear_logprobs_backward(inp["hidden"], inp["weight"], inp["token_ids"],
                                              mask=inp["mask"], **kw)
        assert e.value.status == "FG_ERR_SHAPE_MISMATCH" and name in str(e.value), e.value


def test_float64_operands_are_converted():
    """float64 hidden / weight / bias / logits are converted to float32 (the
    documented NumPy behaviour): float32 values held in float64 give the
    float32 call's bits."""
    inp = _inputs(33, {}, B=2, T=3, H=5, V=7)
    a = fg.fused_linear_grpo(**inp)
    b = fg.fused_linear_grpo(**{**inp, **{k: inp[k].astype(np.float64)
                                          for k in ("hidden", "weight", "bias")}})
    assert a.loss == b.loss
    np.testing.assert_array_equal(a.grad_weight, b.grad_weight)
    logits = inp["hidden"] @ inp["weight"].T
    c = fg.logits_grpo(logits, inp["token_ids"], inp["mask"], inp["advantages"])
    d = fg.logits_grpo(logits.astype(np.float64), inp["token_ids"], inp["mask"],
                       inp["advantages"])
    np.testing.assert_array_equal(c.grad_logits, d.grad_logits)


def test_compute_grad_false():
    inp = _inputs(13, {}, B=2, T=4, H=8, V=13)
    a = fg.fused_linear_grpo(**inp, compute_grad=False)
    b = fg.fused_linear_grpo(**inp)
    assert a.grad_hidden is None and a.grad_weight is None and a.grad_bias is None
    assert a.loss == b.loss
    np.testing.assert_array_equal(a.logp, b.logp)
    np.testing.assert_array_equal(a.entropy, b.entropy)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_logits_level(loss_type):
    inp = _inputs(14, {}, B=3, T=4, H=12, V=53)
    h, W, bias = inp.pop("hidden"), inp.pop("weight"), inp.pop("bias")
    logits = (h @ W.T + bias).astype(np.float32)
    cfg = dict(loss_type=loss_type, beta=0.1, temperature=0.9, entropy_coef=0.02,
               epsilon_high=1.2 if loss_type == "cispo" else None)
    want = reference(logits, np.eye(53, dtype=np.float32), **inp, **cfg)  # hidden = logits
    got = fg.logits_grpo(logits, **inp, **cfg)
    assert_close("logits/loss", got.loss, want["loss"], loss_type, scale=want["loss_scale"])
    for k in ("logp", "entropy", "grad_logits"):
        assert_close(f"logits/{k}", getattr(got, k), want[k], loss_type)
    # in place: dlogits overwrite the logits
    buf = logits.copy()
    got2 = fg.logits_grpo(buf, **inp, **cfg, inplace=True)
    assert got2.grad_logits is buf
    np.testing.assert_array_equal(buf, got.grad_logits)


def test_errors_carry_status_and_message():
    inp = _inputs(15, {}, B=2, T=3, H=4, V=5)
    bad = dict(inp)
    bad["token_ids"] = inp["token_ids"].copy()
    bad["token_ids"][0, 0] = 5
    bad["mask"] = np.ones_like(inp["mask"])
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**bad)
    assert e.value.status == "FG_ERR_TOKEN_OUT_OF_RANGE" and "token_ids" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**{**inp, "ref_logp": None}, beta=0.1)
    assert e.value.status == "FG_ERR_MISSING_REF_LOGP"
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**inp, temperature=0.0)
    assert e.value.status == "FG_ERR_BAD_TEMPERATURE"
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**inp, loss_type="ppo")
    assert e.value.status == "FG_ERR_UNKNOWN_LOSS_TYPE"
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**inp, importance_sampling_level="batch")
    assert e.value.status == "FG_ERR_UNKNOWN_LEVEL"
    h = inp["hidden"].copy()
    h[0, 0, 0] = np.nan
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**{**inp, "hidden": h})
    assert e.value.status == "FG_ERR_NONFINITE_INPUT"
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**{**inp, "weight": inp["weight"][:, :3]})
    assert e.value.status == "FG_ERR_SHAPE_MISMATCH"
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**inp, memory_budget=1024)
    assert e.value.status == "FG_ERR_BUDGET_TOO_SMALL"
    with pytest.raises(fg.FusedGRPOError) as e:
        fg.fused_linear_grpo(**inp, memory_budget=-1)
    assert e.value.status == "FG_ERR_INVALID_SIZE" and e.value.code == 2


def test_reference_itself_by_finite_differences_of_hidden():
    """Sanity of the test oracle: its grad_hidden / grad_weight match central
    differences of its own loss in float64 (small case)."""
    inp = _inputs(16, {}, B=2, T=3, H=4, V=6)
    cfg = dict(loss_type="grpo", beta=0.1, temperature=0.8, entropy_coef=0.1)
    want = reference(**inp, **cfg)
    h = inp["hidden"].astype(np.float64)
    W = inp["weight"].astype(np.float64)
    eps = 1e-5
    for (arr, key, idx) in ((h, "grad_hidden", (0, 1, 2)), (W, "grad_weight", (3, 1))):
        xp, xm = arr.copy(), arr.copy()
        xp[idx] += eps
        xm[idx] -= eps
        name = "hidden" if key == "grad_hidden" else "weight"
        lp = reference(**{**inp, name: xp}, **cfg)["loss"]
        lm = reference(**{**inp, name: xm}, **cfg)["loss"]
        assert_close("fd/reference", (lp - lm) / (2 * eps), want[key][idx], key)


def test_ml_dtypes_bfloat16_arrays():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    inp = _inputs(17, {}, B=2, T=4, H=8, V=11)
    a = fg.fused_linear_grpo(**inp, dtype="bfloat16")
    b = fg.fused_linear_grpo(**{**inp, **{k: inp[k].astype(ml_dtypes.bfloat16)
                                          for k in ("hidden", "weight", "bias")}})
    assert a.loss == b.loss
    np.testing.assert_array_equal(a.grad_hidden, b.grad_hidden)


def test_contiguous_inputs_are_not_copied():
    """The front end hands the C library pointers to the caller's arrays: the
    Python-side allocations of a call (traced by tracemalloc, which sees NumPy's
    buffers) stay far below the size of its weight, for float32, bf16 bit
    arrays and row-strided views alike. The library's own working memory is
    mmap-ed, outside what is traced."""
    inp = _inputs(18, {}, B=1, T=4, H=256, V=4096)
    weight_bytes = inp["weight"].nbytes  # 4 MiB
    wide = np.zeros((4096, 300), np.float32)
    wide[:, :256] = inp["weight"]
    variants = {"float32": inp,
                "bf16 bits": {**inp, **{k: fg.f32_to_bf16_bits(inp[k])
                                        for k in ("hidden", "weight", "bias")}},
                "row-strided weight": {**inp, "weight": wide[:, :256]}}
    for name, args in variants.items():
        fg.fused_linear_grpo(**args, compute_grad=False)  # the context's first-call setup
        tracemalloc.start()
        try:
            fg.fused_linear_grpo(**args, compute_grad=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < weight_bytes // 16, (name, peak)


def test_ctypes_structs_match_the_library():
    """Every ctypes struct has the C size and every field the C offset (a
    smaller copy once let fg_get_memory_stats write past its buffer), every
    restated struct is checked, and a mismatch refuses to load."""
    restated = {v for v in vars(_lib).values() if isinstance(v, type)
                and issubclass(v, ctypes.Structure) and v is not ctypes.Structure}
    assert restated == set(_lib.ABI_STRUCTS)
    assert _lib.abi_mismatches(_lib.lib, _lib.ABI_STRUCTS) == []
    assert _lib.lib.fg_abi_sizeof(b"no_such_struct") == 0
    assert _lib.lib.fg_abi_offsetof(b"fg_exec", b"no_such_field") == -1

    class shrunk(ctypes.Structure):
        _fields_ = [("current_bytes", ctypes.c_size_t)]
    shrunk.__name__ = "fg_memory_stats"
    with pytest.raises(ImportError, match="fg_memory_stats: library 80 bytes, binding 8"):
        _lib._check_abi(_lib.lib, (shrunk,))

    class swapped(ctypes.Structure):  # the right size, two fields exchanged
        _fields_ = [("memory_budget", ctypes.c_size_t), ("threads", ctypes.c_int),
                    ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_size_t),
                    ("device_report", ctypes.c_void_p)]
    swapped.__name__ = "fg_exec"
    assert ctypes.sizeof(swapped) == ctypes.sizeof(_lib.fg_exec)
    with pytest.raises(ImportError, match="fg_exec.threads: library offset 0, binding 8"):
        _lib._check_abi(_lib.lib, (swapped,))

    class renamed(ctypes.Structure):
        _fields_ = [("thread_count", ctypes.c_int), ("memory_budget", ctypes.c_size_t),
                    ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_size_t),
                    ("device_report", ctypes.c_void_p)]
    renamed.__name__ = "fg_exec"
    with pytest.raises(ImportError, match="fg_exec.thread_count: not in the library"):
        _lib._check_abi(_lib.lib, (renamed,))
