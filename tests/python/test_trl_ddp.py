"""fusedgrpo.trl.FusedGRPOTrainer under data parallelism: 2 processes on CPU
started by ``accelerate launch --cpu --num_processes 2 --mpirun_hostfile H``
(accelerate starts CPU processes through mpirun: OpenMPI, which
scripts/setup.sh installs; accelerate then runs DDP over gloo, MULTI_CPU), or
by torchrun where mpirun is missing, 2 training steps of each case, next to trl.GRPOTrainer
in the same processes from the same seed (trl_ddp_worker.py). Both sample the
same completions (ragged: the eos embedding is scaled so some end early), so
every logged value must agree: loss, grad_norm (DDP's mean of the gradients:
a wrong num_items_in_batch scaling shows there), kl, entropy, clip ratios,
reward, token counts. The run takes ~30 s; a 120 s timeout guards a hang."""
from __future__ import annotations

import json
import math
import os
import shutil
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
from tiny_llama import save_tiny_llama  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_ddp_worker.py")
TIMEOUT_S = 120.0
V = 97
COMPARED = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean", "reward", "num_tokens", "completions/mean_length")


@pytest.fixture(scope="module")
def ddp_logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl_ddp")
    save_tiny_llama(d / "model", V, eos_scale=6.0)  # test_trl.py's model, ragged completions
    out = d / "logs.json"
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fusedgrpo.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               FUSEDGRPO_LIBRARY=_lib.library_path(),
               PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    if shutil.which("mpirun"):
        hosts = d / "hostfile"
        hosts.write_text("localhost slots=2\n")
        # OpenMPI refuses root (CI's containers) without this consent.
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--mpirun_hostfile", str(hosts), WORKER, str(d / "model"), str(out)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", WORKER, str(d / "model"), str(out)]
    try:
        run = subprocess.run(cmd, env=env, cwd=d, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the launcher still running after {TIMEOUT_S} s:\n{(e.stderr or '')[-3000:]}")
    assert run.returncode == 0, f"the launch failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["dapo", "grpo_sequence_ga2"])
def test_fused_trainer_matches_trl_under_ddp(ddp_logs, case):
    assert ddp_logs["world_size"] == 2
    trl_logs, fg_logs = ddp_logs[case]["trl"], ddp_logs[case]["fusedgrpo"]
    steps = [r for r in trl_logs if "loss" in r]
    assert len(steps) == 2 and len([r for r in fg_logs if "loss" in r]) == 2
    # ragged completions: the token normalisers differ from B * T
    assert any(r["completions/mean_length"] < 8 for r in steps), steps
    for want, got in zip(steps, [r for r in fg_logs if "loss" in r]):
        for k in COMPARED:
            if k not in want:
                continue
            a, b = got[k], want[k]
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (case, want["step"], k, a, b)
