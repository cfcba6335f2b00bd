"""fusedgrpo.jax's sharded loss across 2 processes: jax.distributed on
127.0.0.1, CPU collectives over gloo, each process single-threaded with 2 host
devices. The test starts the processes itself (jax_distributed_worker.py, which
lists the meshes and cases) and asserts on what each reports:

- every case equals the single-process call (the unsharded loss on the whole
  weight and batch): loss, log-probs and entropies within 1e-5 relative,
  gradients within 1e-4; V = 301 over 2 vocab shards (uneven: 151 + 150, or a
  weight padded to 302 rows with vocab_size = 301, whose padding row gets a
  zero gradient); dapo, grpo (sequence, beta), cispo (beta, is_ratio), vespo
  (sequence), bnpo (entropy bonus), luspo (sequence) on vocab, batch and
  vocab x batch meshes;
- the vocab shards (one per process) hold the same log-prob bits;
- a process holding a bad token id or NaN input makes both raise the same
  status; the mesh then runs the next call as before.
The join timeout is a failure guard only: a run takes about 15 s here.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")
import fusedgrpo.jax as fgj  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "jax_distributed_worker.py")
NPROC = 2
GUARD_SECONDS = 300  # only against a hang; a passing run never waits on it
TOL_LOSS, TOL_LOGP, TOL_GRAD = 1e-5, 1e-5, 1e-4


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    # 2 host devices a process (conftest.py asks for 4 in this one), one thread
    # for XLA's own work and the library's OpenMP
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=2 "
                        "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    env["OMP_NUM_THREADS"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    if fgj.backend() != "ffi":
        pytest.skip("vocab sharding needs the FFI handler")
    try:
        jax.config.jax_cpu_collectives_implementation  # noqa: B018 - present since jax 0.4.3x
    except AttributeError:
        pytest.skip(f"jax {jax.__version__} has no CPU collectives (gloo)")
    tmp = tmp_path_factory.mktemp("jax_distributed")
    port = str(_free_port())
    procs, logs = [], []
    for pid in range(NPROC):
        log = open(tmp / f"worker{pid}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, str(pid), str(NPROC), port, str(tmp / f"out{pid}.json")],
            stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=HERE))
    hung = False
    for p in procs:
        try:
            p.wait(timeout=GUARD_SECONDS)
        except subprocess.TimeoutExpired:
            hung = True
    for p in procs:  # only our own children, by their handles
        if p.poll() is None:
            p.kill()
            p.wait()
    tails = []
    for pid, log in enumerate(logs):
        log.seek(0)
        lines = [ln for ln in log.read().splitlines() if not ln.startswith(("I0", "W0"))]
        tails.append(f"--- worker {pid} (exit {procs[pid].returncode}):\n" + "\n".join(lines[-30:]))
        log.close()
    detail = "\n".join(tails)
    assert not hung, f"a worker was still running after {GUARD_SECONDS} s:\n{detail}"
    assert all(p.returncode == 0 for p in procs), detail
    out = []
    for pid in range(NPROC):
        with open(tmp / f"out{pid}.json") as f:
            out.append(json.load(f))
    return out


def test_sharded_equals_single_process(reports):
    worst = {}
    for rep in reports:
        for case, e in rep["cases"].items():
            where = f"process {rep['process']}, {case}: {e}"
            assert e["loss"] <= TOL_LOSS, where
            assert e["logp"] <= TOL_LOGP and e["entropy"] <= TOL_LOGP, where
            assert all(e[k] <= TOL_LOSS for k in e if k.startswith("metric_")), where
            assert all(e[k] <= TOL_GRAD for k in ("grad_hidden", "grad_weight", "grad_bias")), where
            assert all(e[k] == 0 for k in e if k.endswith("_padding")), where
            for k, v in e.items():
                if k not in ("seconds", "loss_value", "logp_sha") and not k.endswith("_padding"):
                    worst[k] = max(worst.get(k, 0.0), v)
    print("worst relative errors vs one process:",
          ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
    names = set(reports[0]["cases"])
    assert any(n.startswith("vocab/") for n in names) and any("batch" in n for n in names)


def test_vocab_shards_hold_the_same_bits(reports):
    """The merge is exact: on the vocab-only mesh each process holds the whole
    log-probs, and the two copies are the same bits."""
    for case in reports[0]["cases"]:
        if case.startswith("vocab/"):
            shas = {rep["cases"][case]["logp_sha"] for rep in reports}
            assert len(shas) == 1, f"{case}: the processes' log-probs differ"


@pytest.mark.parametrize("case,status", [
    ("vocab/bad_token", "FG_ERR_TOKEN_OUT_OF_RANGE"),
    ("vocab/nan_hidden", "FG_ERR_NONFINITE_INPUT"),
    ("batch/bad_token", "FG_ERR_TOKEN_OUT_OF_RANGE"),
    ("vocab_batch/nan_hidden", "FG_ERR_NONFINITE_INPUT"),
])
def test_a_bad_process_makes_every_process_raise(reports, case, status):
    for rep in reports:
        msg = rep["failures"][case]
        assert f"fusedgrpo: {status}" in msg, f"process {rep['process']}: {msg}"
    # the process that held the bad input names it
    assert any("token_ids[" in r["failures"][case] or "hidden[" in r["failures"][case]
               for r in reports), [r["failures"][case] for r in reports]


def test_the_mesh_works_after_the_failures(reports):
    for rep in reports:
        first = rep["cases"]["vocab/dapo_token"]
        again = rep["cases"]["vocab/dapo_token/after_failures"]
        assert again["loss_value"] == first["loss_value"]
        assert again["logp_sha"] == first["logp_sha"]
