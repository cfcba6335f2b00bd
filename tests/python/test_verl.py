"""verl's own fused-kernel forward with fusedgrpo in its kernel's place.

verl (0.9.1) computes log-probs and entropy inside the model's forward when
``use_fused_kernels`` is on: ``verl.models.transformers.monkey_patch.
patch_forward_with_backends`` sets the model class's forward to
``verl.models.transformers.dense_common.forward_with_triton_backend``, which
calls ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy(hidden,
lm_head.weight, labels, temperature, "none")`` (looked up at each call). Here
that attribute is fusedgrpo.cross_entropy.linear_cross_entropy, on a small
random Llama on the CPU, against verl's torch backend
(``forward_with_torch_backend``: verl's FusedLinearForPPO, logits
materialised): log_probs, entropy, and the gradients of the LM head and of
the backbone (through grad_hidden) of the same loss of both outputs.

Needs verl importable: ``pip install --no-deps verl==0.9.1`` plus what its
package import needs on the CPU (ray, tensordict, protobuf, pyvers,
omegaconf; torch and transformers as they are), which scripts/python_test.sh
installs into build/verl-site (FG_VERL_SITE names another folder); skipped
otherwise, with the import error as the reason.
"""
from __future__ import annotations

import os
import sys

import pytest

# scripts/python_test.sh installs verl and its CPU import's needs into a
# folder of their own; appended, so this environment's packages come first
_SITE = os.environ.get("FG_VERL_SITE") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "verl-site")
if os.path.isdir(_SITE) and _SITE not in sys.path:
    sys.path.append(_SITE)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

try:
    import verl.utils.kernel.linear_cross_entropy as verl_kernel
    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    VERL_MISSING = None
except Exception as e:  # noqa: BLE001 - any import failure is the skip's reason
    VERL_MISSING = f"verl's fused-kernel path does not import: {type(e).__name__}: {e}"

pytestmark = pytest.mark.skipif(VERL_MISSING is not None, reason=VERL_MISSING or "")

from fusedgrpo.cross_entropy import linear_cross_entropy  # noqa: E402
from tolerance import relative_error  # noqa: E402

V = 101
# normwise, fusedgrpo against verl's torch backend (both float32); worst
# measured: log_probs 7.6e-8, entropy 1.1e-7, gradients 1.8e-7
TOL = 1e-6


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits of a few units: entropies and log-probs of real spread
        model.lm_head.weight.mul_(4.0)
    return model


def _run(model, backend, input_ids, coef, monkeypatch):
    """verl's forward for `backend` ("torch": its reference; "triton": its
    kernel's call, here fusedgrpo's): (log_probs, entropy, gradients)."""
    # patch_forward_with_backends sets the class's forward: undone after the test
    monkeypatch.setattr(type(model), "forward", type(model).forward)
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
    model.zero_grad()
    out = model(input_ids=input_ids, return_dict=True, temperature=0.7)
    ((out.log_probs * coef[0]).sum() + (out.entropy * coef[1]).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if n in ("lm_head.weight", "model.norm.weight", "model.embed_tokens.weight")}
    return out.log_probs.detach(), out.entropy.detach(), grads


@pytest.mark.parametrize("shape", [(2, 11), (1, 23)], ids=["batch", "packed"])
def test_verl_forward_with_fusedgrpo_kernel_matches_verl_torch_backend(shape, monkeypatch):
    model = _model()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, V, shape, generator=g)
    coef = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    want = _run(model, "torch", input_ids, coef, monkeypatch)

    calls = []

    def fused(*args, **kwargs):
        calls.append(args[4] if len(args) > 4 else kwargs.get("reduction"))
        return linear_cross_entropy(*args, **kwargs)
    monkeypatch.setattr(verl_kernel, "linear_cross_entropy", fused)
    got = _run(model, "triton", input_ids, coef, monkeypatch)
    assert calls == ["none"], calls  # verl's forward called fusedgrpo, once

    for name, a, b in (("log_probs", got[0], want[0]), ("entropy", got[1], want[1]),
                       *((f"grad {n}", got[2][n], want[2][n]) for n in want[2])):
        assert a.shape == b.shape, f"{name}: {tuple(a.shape)} vs {tuple(b.shape)}"
        err = relative_error(a.double().numpy(), b.double().numpy())
        assert err <= TOL, f"{name}: relative error {err:.3g} > {TOL:g}"
