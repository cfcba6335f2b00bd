"""fusedgrpo.trl.FusedGRPOTrainer against trl.GRPOTrainer (TRL 1.16).

A tiny random Llama (f32 throughout: bf16=False, since TRL's default bf16
autocast rounds the logits to bf16 where fusedgrpo keeps them in float32; tied embeddings, vocabulary 97 of a word-level
tokenizer built here, so nothing is downloaded) and a fixed batch of inputs
(ragged completion masks, advantages of both signs, old / reference /
sampler log-probs drawn around the policy's own). For each case both trainers'
``_compute_loss`` run on the same inputs and the same weights:

- loss within 1e-5 relative (to the loss, or, where advantages of both signs
  make it cancel, to the same loss with |A|);
- every parameter's gradient within 1e-4 (normwise relative);
- every metric TRL logs (kl, entropy, clip ratios and their per-sequence
  min / max, cispo's, vespo's, policy_loss, entropy_coef) equal within 1e-5.

Cases: every loss type at both importance-sampling levels, and
top_entropy_quantile < 1, off_policy_mask_threshold (sampler log-probs with an
unscored NaN token), beta != 0 with the bias-corrected KL, delta, entropy_coef
!= 0 (fixed and adaptive), the vLLM importance-sampling ratio (token and
sequence), gradient accumulation with TRL's num_items_in_batch scaling,
cast_lm_head_to_fp32. The old / reference log-prob pass
(_get_per_token_logps_and_entropies, fg_linear_logprobs) is compared too, and
both run as the LM head module's forward (inside its hooks, where FSDP and
ZeRO-3 gather a sharded head: test_many_gpus_fsdp.py).
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fusedgrpo  # noqa: E402

V = 97
B, P, C = 4, 3, 7  # 2 prompts x 2 generations; prompt and completion lengths


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_llama import save_tiny_llama

    d = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(d, V)
    return str(d)


def _trainer(cls, model_dir, tmp_path, device="cpu", **cfg):
    """A trainer of the tiny model on `device` ("cpu", or "cuda": the model on
    the first CUDA device, as accelerate places it)."""
    from datasets import Dataset
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=B,
                      num_generations=2, max_completion_length=C, report_to=[],
                      use_cpu=device == "cpu", logging_steps=1, bf16=False, **cfg)
    ds = Dataset.from_dict({"prompt": ["t1 t2 t3"] * 4})
    tr = cls(model=model_dir, reward_funcs=lambda completions, **k: [0.0] * len(completions),
             args=args, train_dataset=ds)
    tr.model.train()
    return tr


def _inputs(trainer, seed, *, sampling=False, is_ratio=None):
    """The batch, drawn on the CPU (the same numbers on any device), on the
    trainer's device."""
    dev = trainer.accelerator.device
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, V - 3, (B, P), generator=g).to(dev)
    completion_ids = torch.randint(0, V - 3, (B, C), generator=g).to(dev)
    prompt_mask = torch.ones(B, P, dtype=torch.long, device=dev)
    lens = [C, 3, C - 2, 1]
    completion_mask = torch.tensor([[1 if t < n else 0 for t in range(C)] for n in lens],
                                   device=dev)
    advantages = torch.tensor([0.9, -0.7, 1.3, -1.1], device=dev)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), C)
    inp = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
               completion_mask=completion_mask, advantages=advantages,
               old_per_token_logps=logp + 0.3 * torch.randn(B, C, generator=g).to(dev),
               ref_per_token_logps=logp + 0.25 * torch.randn(B, C, generator=g).to(dev),
               num_items_in_batch=completion_mask.sum() * 2.0)
    if sampling:
        s = inp["old_per_token_logps"] + 0.3 * torch.randn(B, C, generator=g).to(dev)
        s[0, 1] = float("nan")  # a token the sampler could not score
        inp["sampling_per_token_logps"] = s
    if is_ratio == "token":  # 1 at padding, as TRL builds it (exp of a masked difference)
        inp["importance_sampling_ratio"] = torch.exp(
            0.2 * torch.randn(B, C, generator=g).to(dev) * completion_mask)
    elif is_ratio == "sequence":
        inp["importance_sampling_ratio"] = torch.exp(0.2 * torch.randn(B, 1, generator=g).to(dev))
    return inp


def _run(trainer, inputs, ga):
    trainer.current_gradient_accumulation_steps = ga
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
             if p.grad is not None}
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


CASES = [(lt, lvl, {}) for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo",
                                  "vespo") for lvl in ("token", "sequence")] + [
    ("grpo", "token", dict(top_entropy_quantile=0.5, entropy_coef=0.05)),
    ("dapo", "sequence", dict(top_entropy_quantile=0.3)),
    ("dapo", "token", dict(off_policy_mask_threshold=0.0, sampling=True)),
    ("grpo", "sequence", dict(off_policy_mask_threshold=0.05, sampling=True)),
    ("bnpo", "token", dict(use_bias_correction_kl=True, delta=1.2)),
    ("grpo", "sequence", dict(use_bias_correction_kl=True)),
    ("dapo", "token", dict(entropy_coef=0.02, ga=2)),
    ("sapo", "token", dict(entropy_coef=-0.01, ga=2)),
    ("luspo", "token", dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0)),
    ("dapo", "token", dict(vllm_is="token")),
    ("grpo", "sequence", dict(vllm_is="sequence")),
    ("vespo", "token", dict(vllm_is="token", vespo_k_pos=1.5, vespo_lambda_neg=1.0)),
    ("dr_grpo", "token", dict(cast_lm_head_to_fp32=True, beta=0.0)),
]


CASE_IDS = [f"{c[0]}-{c[1]}-{'-'.join(c[2]) or 'base'}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_compute_loss_matches_trl(model_dir, tmp_path, case):
    check_compute_loss(model_dir, tmp_path, case, "cpu")


def check_compute_loss(model_dir, tmp_path, case, device):
    """Both trainers' _compute_loss on `device`, the same inputs and weights:
    loss, gradients and metrics (the module doc's tolerances)."""
    from trl import GRPOTrainer
    from fusedgrpo.trl import FusedGRPOTrainer

    loss_type, level, extra = case
    extra = dict(extra)
    ga = extra.pop("ga", 1)
    sampling = extra.pop("sampling", False)
    vllm_is = extra.pop("vllm_is", None)
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
               epsilon_high=1.1 if loss_type == "cispo" else 0.28)
    cfg.update(extra)
    trainers = [_trainer(cls, model_dir, tmp_path, device, **cfg)
                for cls in (GRPOTrainer, FusedGRPOTrainer)]
    inputs = _inputs(trainers[0], 1000 + CASES.index(case), sampling=sampling, is_ratio=vllm_is)
    results = []
    for tr in trainers:
        if vllm_is:
            tr.use_vllm = True
            tr.vllm_importance_sampling_correction = True
        results.append(_run(tr, inputs, ga))
    (l_ref, g_ref, m_ref), (l_fg, g_fg, m_fg) = results

    assert torch.isfinite(l_ref)
    # Relative to the loss, or where the advantages' signs make it cancel, to
    # the same loss with |A| (the scale of its terms: float32 rounding of the
    # terms, in either trainer, is relative to them, not to their sum).
    t0 = trainers[0]
    state = (t0.entropy_coef, t0._last_world_entropy, t0._entropy_window_stats)
    with torch.no_grad():
        t0.current_gradient_accumulation_steps = ga
        scale = abs(float(t0._compute_loss(
            t0.model, {**inputs, "advantages": inputs["advantages"].abs()})))
    t0.entropy_coef, t0._last_world_entropy, t0._entropy_window_stats = state
    assert abs(float(l_fg) - float(l_ref)) <= 1e-5 * max(abs(float(l_ref)), scale), (
        l_fg, l_ref, scale)
    assert set(g_ref) == set(g_fg)
    for n in g_ref:
        num = float((g_fg[n] - g_ref[n]).norm())
        den = float(g_ref[n].norm())
        assert num <= 1e-4 * max(den, 1e-8), f"{n}: {num / max(den, 1e-30):.3g}"
    assert set(m_ref) == set(m_fg), (sorted(m_ref), sorted(m_fg))
    for k in m_ref:
        for a, b in zip(m_fg[k], m_ref[k]):
            assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5,
                                                                     abs_tol=1e-7), (k, a, b)
    for tr in trainers:  # the adaptive controller's state moved alike
        assert tr.entropy_coef == trainers[0].entropy_coef


def test_old_and_ref_logprob_pass_matches_trl(model_dir, tmp_path):
    check_logprob_pass(model_dir, tmp_path, "cpu")


def check_logprob_pass(model_dir, tmp_path, device):
    """The old- and reference-policy log-prob pass of both trainers on `device`."""
    from trl import GRPOTrainer
    from fusedgrpo.trl import FusedGRPOTrainer

    trs = [_trainer(cls, model_dir, tmp_path, device, beta=0.04, temperature=0.8)
           for cls in (GRPOTrainer, FusedGRPOTrainer)]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V - 3, (B, P + C), generator=g)
    am = torch.ones(B, P + C, dtype=torch.long)
    am[1, P + 3:] = 0
    ids, am = ids.to(trs[0].accelerator.device), am.to(trs[0].accelerator.device)
    outs = []
    for tr in trs:
        with torch.no_grad():  # the policy with entropies, the reference (TRL: logp only)
            for m, ent in ((tr.model, True), (tr.ref_model, False)):
                lp, e, _ = tr._get_per_token_logps_and_entropies(m, ids, am, C,
                                                                 compute_entropy=ent)
                outs.append((lp, e))
    for (a, ea), (b, eb) in zip(outs[2:], outs[:2]):
        np.testing.assert_allclose(a.cpu().numpy(), b.cpu().numpy(), rtol=1e-5, atol=2e-6)
        if eb is not None:
            np.testing.assert_allclose(ea.cpu().numpy(), eb.cpu().numpy(), rtol=1e-5, atol=2e-6)


# ------------------------------------------------------------ execution options

BAD_FILTER_EPS = [True, -1, -1.0, -0.5, 2.0, float("nan"), "sometimes"]


@pytest.mark.parametrize("impl", ["fused", "materialized"])
@pytest.mark.parametrize("filter_eps", BAD_FILTER_EPS, ids=repr)
def test_bad_filter_eps_is_refused_at_init_for_every_impl(model_dir, tmp_path, impl, filter_eps):
    """True is no threshold (not 1.0), -1 no spelling of "auto"; the
    materialized impl (which does not filter) refuses a bad value too."""
    from fusedgrpo.trl import FusedGRPOTrainer

    class Trainer(FusedGRPOTrainer):
        fusedgrpo_impl = impl
        fusedgrpo_filter_eps = filter_eps

    with pytest.raises(fusedgrpo.FusedGRPOError, match="fusedgrpo_filter_eps"):
        _trainer(Trainer, model_dir, tmp_path)


def test_execution_options_set_on_an_instance_are_checked_per_call(model_dir, tmp_path):
    """An instance's fusedgrpo_filter_eps (set after construction) is checked
    at the loss call whatever the impl; a valid one is the fused impl's alone."""
    from fusedgrpo.trl import FusedGRPOTrainer

    tr = _trainer(FusedGRPOTrainer, model_dir, tmp_path, beta=0.04)
    inputs = _inputs(tr, 7)
    tr.fusedgrpo_impl = "materialized"
    tr.fusedgrpo_filter_eps = 1e-3  # valid: the materialized impl's gradients are exact
    loss, _, _ = _run(tr, inputs, 1)
    assert torch.isfinite(loss)
    for bad in (-0.5, True):
        tr.fusedgrpo_filter_eps = bad
        with pytest.raises(fusedgrpo.FusedGRPOError, match="fusedgrpo_filter_eps"):
            _run(tr, inputs, 1)


# ------------------------------------------------------------ where the head runs

def test_loss_and_logprobs_run_as_the_lm_heads_forward(model_dir, tmp_path):
    """The fused loss and the fused log-probs run inside the LM head module's
    call (between its pre- and post-forward hooks, where FSDP and ZeRO-3
    gather a sharded head and key its gradient reduction), once per pass;
    the head's own forward is back afterwards (tests/python/
    test_many_gpus_fsdp.py runs the sharded frameworks)."""
    from fusedgrpo.trl import FusedGRPOTrainer

    tr = _trainer(FusedGRPOTrainer, model_dir, tmp_path, beta=0.04)
    head = tr.model.get_output_embeddings()
    calls = []
    pre = head.register_forward_pre_hook(lambda m, a: calls.append("pre"))
    post = head.register_forward_hook(lambda m, a, o: calls.append(type(o).__name__))
    try:
        inputs = _inputs(tr, 3)  # the old-policy pass: fused log-probs, under no_grad
        assert calls == ["pre", "tuple"], calls
        calls.clear()
        loss, grads, _ = _run(tr, inputs, 1)
        assert calls == ["pre", "tuple"], calls
    finally:
        pre.remove()
        post.remove()
    assert "forward" not in head.__dict__ and torch.isfinite(loss)
    assert grads["lm_head.weight" if "lm_head.weight" in grads else
                 "model.embed_tokens.weight"].abs().sum() > 0
