"""fusedgrpo.trl.FusedGRPOTrainer against trl.GRPOTrainer with the model on a
CUDA device: the parity test of test_trl.py (the same tiny random Llama,
inputs, cases and tolerances: loss within 1e-5, every parameter's gradient
within 1e-4, every metric within 1e-5), with both trainers on the first CUDA
device, float32 and TF32 off, so that TRL's side (cuBLAS products, its Triton
log-prob kernels) and fusedgrpo's (the library's CUDA backend, on torch's
current stream) both compute in true float32. Skipped without a CUDA device,
and without TRL (with transformers, accelerate and datasets).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")

from test_trl import V, CASE_IDS, CASES, check_compute_loss, check_logprob_pass  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_llama import save_tiny_llama

    d = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(d, V)
    return str(d)


@pytest.fixture(autouse=True)
def true_float32():
    """TF32 off for the test (cuBLAS and cuDNN), restored after it."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_compute_loss_matches_trl_cuda(model_dir, tmp_path, case):
    check_compute_loss(model_dir, tmp_path, case, "cuda")


def test_old_and_ref_logprob_pass_matches_trl_cuda(model_dir, tmp_path):
    check_logprob_pass(model_dir, tmp_path, "cuda")
