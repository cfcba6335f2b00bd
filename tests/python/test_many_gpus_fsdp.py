"""The fused head where the LM head's weight is sharded: FSDP2, FSDP1,
DeepSpeed ZeRO-3 and FusedGRPOTrainer on transformers' FSDP2, 2 processes on
the CPU over gloo, against one process on the whole batch.

One launch (torchrun, fsdp_worker.py) runs every case; this process computes
the reference from the same weights and batch (fsdp_worker.reference). The
model is tests/python/tiny_llama.py's, with a head of its own (the head can
then be a group of its own), or as it is, tied, for the "_tied" cases. Each
rank holds half the sequences (ragged: the halves hold different token
counts), the losses normalised as TRL normalises dapo (global tokens /
world), so the mean of the ranks' losses is the batch's and the framework's
mean of their gradients is the batch's gradient. Per case and pass (the
fused log-probs with a loss of them; the fused GRPO loss in the head's
place), and per step of the trainer:

- the loss within 1e-5 relative, the log-probs within 1e-5;
- EVERY parameter's whole gradient within 1e-4 (normwise relative): a
  gradient left unaveraged, or summed where it is averaged (wrong by a
  factor of the ranks), fails.

The refusals: the head read outside its forward under FSDP1 (its flat 1-D
shard with use_orig_params=True, a freed view with False) and ZeRO-3 (its
parameter handed out of the forward) raise FusedGRPOError naming what to do.
Without deepspeed (DS_BUILD_OPS=0 pip install --no-deps deepspeed, and its
pure-Python dependencies) the ZeRO-3 cases skip, naming the ImportError.
The module takes about 30 s on 2 cores (the launch about 20 s, ZeRO-3
included); a 240 s timeout guards a hang.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("transformers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import fusedgrpo  # noqa: E402
from fusedgrpo import _lib  # noqa: E402
import fsdp_worker as fw  # noqa: E402

WORKER = os.path.abspath(fw.__file__)
TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the worker's results, the one-process reference, the trainer's reference)."""
    d = tmp_path_factory.mktemp("many_gpus")
    fw.save_untied_llama(str(d / "untied"))
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fusedgrpo.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               FUSEDGRPO_LIBRARY=_lib.library_path(),
               PYTHONPATH=os.pathsep.join([package_root, os.path.dirname(WORKER),
                                           os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", WORKER, str(d / "untied"), str(d / "untied"), str(d)]
    # a session of its own: on a timeout the launcher and its workers go together
    launch = subprocess.Popen(cmd, env=env, cwd=d, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = launch.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        stdout, stderr = launch.communicate()
        pytest.fail(f"the launch still running after {TIMEOUT_S} s:\n{(stderr or '')[-4000:]}")
    assert launch.returncode == 0, f"the launch failed:\n{stdout[-2000:]}\n{stderr[-6000:]}"
    results = torch.load(d / "results.pt", weights_only=False)
    refs = {m: fw.reference(fw.model_of(m, str(d / "untied"))) for m in ("untied", "_tied")}
    return results, refs, fw.trainer_reference(str(d / "untied"), str(d / "tr_ref"))


def _case(runs, name):
    out = runs[0][name]
    if "skipped" in out:
        pytest.skip(f"{name}: {out['skipped']}")
    assert "error" not in out, f"{name} raised on the ranks:\n{out['error']}"
    return out


def _close_loss(got, want):
    assert abs(float(got) - float(want)) <= 1e-5 * max(abs(float(want)), 1e-3), (got, want)


def _close_grads(got, want, where):
    assert set(got) == set(want), (where, sorted(set(got) ^ set(want)))
    for n in want:
        num = float((got[n].float() - want[n].float()).norm())
        den = float(want[n].norm())
        assert num <= 1e-4 * max(den, 1e-8), f"{where}: {n}: {num / max(den, 1e-30):.3g} relative"


@pytest.mark.parametrize("name", fw.CASES)
def test_sharded_head_matches_one_process(runs, name):
    out, ref = _case(runs, name), runs[1]["_tied" if name.endswith("_tied") else "untied"]
    torch.testing.assert_close(out["nograd_logp"], ref["nograd_logp"], rtol=1e-5, atol=1e-5)
    for pass_ in ("logprobs", "grpo"):
        (loss, logp, grads), (rloss, rlogp, rgrads) = out[pass_], ref[pass_]
        _close_loss(loss, rloss)
        torch.testing.assert_close(logp, rlogp, rtol=1e-5, atol=1e-5)
        _close_grads(grads, rgrads, f"{name}/{pass_}")


@pytest.mark.parametrize("name,words", [
    ("fsdp1_orig", ["flat 1-D shard", "fusedgrpo_head=", "auto_wrap_policy"]),
    ("fsdp1_flat", ["no storage", "fusedgrpo_head=", "auto_wrap_policy"]),
    ("zero3", ["ZeRO-3", "placeholder", "fusedgrpo_head=", "GatheredParameters"]),
])
def test_head_read_outside_its_forward_is_refused(runs, name, words):
    msg = _case(runs, name)["refused"]
    assert msg is not None, f"{name}: the shard read outside the head's forward was accepted"
    for w in words:
        assert w in msg, (w, msg)


def test_a_wrong_gradient_scale_fails_the_comparison(runs):
    """The check itself: the head's gradient summed over 2 ranks, or left as
    one rank's part, is caught."""
    want = runs[1]["untied"]["grpo"][2]
    for wrong in (2.0, 0.5):
        with pytest.raises(AssertionError):
            _close_grads({**want, "lm_head.weight": want["lm_head.weight"] * wrong}, want, "x")


def test_trainer_two_steps_under_fsdp2_match_one_process(runs):
    steps, ref = _case(runs, "trainer"), runs[2]
    assert len(steps) == len(ref) == 2
    for i, (got, want) in enumerate(zip(steps, ref)):
        _close_loss(got["loss"], want["loss"])
        for k in ("logp", "ref"):
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
        for k in ("kl", "entropy"):
            assert abs(got[k] - want[k]) <= 1e-5 * max(abs(want[k]), 1e-3), (i, k, got[k], want[k])
        _close_grads(got["grads"], want["grads"], f"trainer step {i + 1}")
    assert abs(float(ref[1]["loss"]) - float(ref[0]["loss"])) > 1e-4  # the step moved the weights



# ------------------------------------------------------------ one process

def test_call_in_head_runs_inside_the_heads_call_and_restores_its_forward():
    """fn runs between the head's pre- and post-forward hooks (where FSDP
    and ZeRO-3 gather and release it), and the head's forward is its own
    again after the call, an instance override (TRL's fp32 head) included,
    also when fn raises."""
    from fusedgrpo.sharded_weight import call_in_head

    head = torch.nn.Linear(3, 4)
    seen = []
    head.register_forward_pre_hook(lambda m, a: seen.append("pre"))
    head.register_forward_hook(lambda m, a, o: seen.append("post"))

    def fn(w, b, h):
        seen.append("fn")
        return h @ w.T + b

    h = torch.ones(2, 3)
    torch.testing.assert_close(call_in_head(head, fn, h), head(h))
    assert seen[:3] == ["pre", "fn", "post"] and "forward" not in head.__dict__

    def own(x):
        return x

    head.forward = own
    call_in_head(head, fn, h)
    assert head.forward is own

    def fails(w, b, h):
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        call_in_head(head, fails, h)
    assert head.forward is own


def test_whole_head_refuses_what_it_cannot_gather():
    from fusedgrpo.sharded_weight import whole_head

    flat = torch.zeros(12)
    flat._fsdp_flattened = True  # FSDP1's mark on the parameters it flattens
    with pytest.raises(fusedgrpo.FusedGRPOError, match="flat 1-D shard.*auto_wrap_policy"):
        whole_head(flat)
    freed = torch.zeros(4, 3)
    freed.untyped_storage().resize_(0)  # FSDP's unsharded view between its calls
    with pytest.raises(fusedgrpo.FusedGRPOError, match="no storage"):
        whole_head(freed)
    with pytest.raises(fusedgrpo.FusedGRPOError, match="expected 2-D"):
        whole_head(torch.zeros(12))
    with pytest.raises(fusedgrpo.FusedGRPOError, match="bias has 2 rows"):
        whole_head(torch.zeros(4, 3), torch.zeros(2))
    w, b = torch.zeros(4, 3), torch.zeros(4)
    assert whole_head(w, b)[0] is w and whole_head(w, b)[1] is b
