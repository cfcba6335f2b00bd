"""fusedgrpo.torch_distributed across processes: the test starts its own gloo
groups (2, 3 and 4 worker processes running torch_distributed_worker.py, one
thread each, on tcp://127.0.0.1:<free port>) and compares what the ranks
return with the single-process fusedgrpo.torch on the whole weight and batch.

Odd sizes (B = 3 or 4, T = 13, H = 37, V = 301: no vocab split is even):
  - vocab-parallel (2 and 3 ranks): loss and logp within 1e-5 relative,
    grad_hidden / grad_weight / grad_bias within 1e-4 (normwise; the loss
    relative to the larger of itself and the loss of its terms' magnitudes,
    grpo_reference's loss_scale, since advantages of both signs make it
    cancel), for eight loss types, token and sequence level, beta != 0, the
    entropy bonus; the Liger-style module; linear_logprobs and the backward
    of a loss of logp and entropy; every rank's loss and logp the same bits;
  - data-parallel under DDP (each rank half the batch, TRL's
    num_items_in_batch = global tokens / world): DDP's mean is the whole
    batch's loss and gradient; also with one rank's sequences all masked;
  - 2 x 2 (vocab x data, DDP over the data group);
  - one rank given a bad token id, NaN hidden states, another beta, another
    T or other advantages, or (linear_logprobs) a NaN gradient of logp, so
    that its backward phase alone fails: every rank raises the same
    FusedGRPOError status, within seconds, and the groups still work
    afterwards;
  - the device path without a GPU (2 ranks, FG_TEST_TORCH_DIST_BACKEND=
    reference: every call on the reference backend's context, whose memory
    is the host's): the loss (forward and backward) and linear_logprobs
    against one process on the CPU as above, and a bad token id and a NaN
    gradient of logp raised alike on both ranks.
A 60 s join timeout per group guards against a hang (and fails the test);
nothing here passes by waiting for it.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import fusedgrpo  # noqa: E402
import fusedgrpo.torch as fgt  # noqa: E402
from fusedgrpo import _lib  # noqa: E402
from grpo_reference import make_inputs, reference  # noqa: E402
from tolerance import relative_error  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_distributed_worker.py")
JOIN_TIMEOUT_S = 60.0  # a failure guard only: a healthy group of jobs takes a few seconds
ERROR_SECONDS = 10.0   # "quickly": from the call to the raise, on every rank
TOL_LOSS = 1e-5        # the sharded ops' bounds against one process
TOL_LOGP = 1e-5
TOL_GRAD = 1e-4
T, H, V = 13, 37, 301
WORST: dict = {}       # name -> worst relative error measured (printed at the end)

VOCAB_CASES = {
    "dapo_token_bias": dict(loss_type="dapo", temperature=0.9),
    "grpo_sequence_beta": dict(loss_type="grpo", importance_sampling_level="sequence",
                               beta=0.04, entropy_coef=0.01),
    "cispo_token_beta": dict(loss_type="cispo", beta=0.04, epsilon_high=0.28),
    "sapo_token_entropy": dict(loss_type="sapo", entropy_coef=0.02, temperature=1.1),
    "bnpo_token_delta": dict(loss_type="bnpo", delta=1.5, beta=0.02),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo_token": dict(loss_type="vespo"),
    "dr_grpo_token": dict(loss_type="dr_grpo", max_completion_length=16, beta=0.02),
}
DATA_CASES = {
    "dapo": dict(loss_type="dapo", beta=0.04),
    "grpo_sequence": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "cispo": dict(loss_type="cispo"),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=T),
}
ERRORS = {  # name: (kind, vocab_shards, rank given the bad input, what, expected status)
    "vocab_bad_token": ("loss", 2, 1, "token", "FG_ERR_TOKEN_OUT_OF_RANGE"),
    "vocab_nan_hidden": ("loss", 2, 0, "nan", "FG_ERR_NONFINITE_INPUT"),
    "vocab_other_beta": ("loss", 2, 1, "beta", "FG_ERR_COMMUNICATOR"),
    "vocab_other_T": ("loss", 2, 0, "shape", "FG_ERR_COMMUNICATOR"),
    "vocab_other_advantages": ("loss", 2, 1, "advantages", "FG_ERR_COMMUNICATOR"),
    "logprobs_bad_token": ("logprobs", 2, 1, "token", "FG_ERR_TOKEN_OUT_OF_RANGE"),
    "logprobs_nan_grad_logp": ("logprobs", 2, 0, "nan_grad_logp", "FG_ERR_NONFINITE_INPUT"),
    "data_bad_token": ("loss", 1, 1, "token", "FG_ERR_TOKEN_OUT_OF_RANGE"),
    "data_nan_hidden": ("loss", 1, 0, "nan", "FG_ERR_NONFINITE_INPUT"),
    # the single-process op through torch_distributed.agreed (FusedGRPOTrainer under DDP)
    "agreed_bad_token": ("agreed", 1, 1, "token", "FG_ERR_TOKEN_OUT_OF_RANGE"),
    "agreed_nan_hidden": ("agreed", 1, 0, "nan", "FG_ERR_NONFINITE_INPUT"),
}


def _problem(seed: int, B: int) -> dict:
    """The whole batch and head as torch tensors (ragged masks, advantages of
    both signs, old / reference log-probs near the policy's own)."""
    rng = np.random.default_rng(seed)
    p = {k: (None if v is None else torch.from_numpy(np.ascontiguousarray(v)))
         for k, v in make_inputs(rng, B=B, T=T, H=H, V=V).items()}
    p["c_logp"] = torch.from_numpy(rng.standard_normal((B, T)).astype(np.float32))
    p["c_entropy"] = torch.from_numpy(rng.standard_normal((B, T)).astype(np.float32))
    return p


# ------------------------------------------------------------------ the groups

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, jobs: list, tmp_path, **env_extra) -> list:
    """Runs the jobs on `world` worker processes (env_extra in their
    environment); their results, by rank."""
    jobs_file = tmp_path / "jobs.pt"
    torch.save(jobs, jobs_file)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fusedgrpo.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", FUSEDGRPO_LIBRARY=_lib.library_path(),
               PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]),
               **env_extra)
    port = _free_port()
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, str(rank), str(world), str(port), str(jobs_file),
             str(tmp_path)], env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in hung:
        procs[r].kill()
        procs[r].wait()
    text = []
    for r, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- rank {r} (exit {procs[r].returncode}):\n{log.read()[-3000:]}")
        log.close()
    assert not hung, f"ranks {hung} still running after {JOIN_TIMEOUT_S} s:\n" + "\n".join(text)
    assert all(p.returncode == 0 for p in procs), "a worker failed:\n" + "\n".join(text)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for res in results:
        for name, out in res.items():
            assert "exception" not in out, f"{name}: {out['exception']}"
    return results


def _job(name, kind, problem, vocab_shards, options=None, **extra):
    return dict(name=name, kind=kind, problem=problem, vocab_shards=vocab_shards,
                options=dict(options or {}), **extra)


def _jobs_world2() -> list:
    p3, p4 = _problem(1301, 3), _problem(1302, 4)
    jobs = [_job(f"vocab/{n}", "loss", _problem(1400 + i, 3), 2, o)
            for i, (n, o) in enumerate(VOCAB_CASES.items())]
    jobs += [_job("vocab/module", "module", p3, 2, dict(beta=0.04, loss_type="dapo")),
             _job("vocab/logprobs", "logprobs", p3, 2, dict(temperature=0.8))]
    jobs += [_job(f"data/{n}", "loss", p4, 1, o) for n, o in DATA_CASES.items()]
    jobs += [_job(f"data_masked/{n}", "loss", p4, 1, DATA_CASES[n], masked_data_row=1)
             for n in ("dapo", "grpo_sequence")]
    jobs += [_job(f"error/{n}", kind, p4 if shards == 1 else p3, shards,
                  dict(beta=0.04) if kind == "loss" else {}, break_rank=rank, break_what=what)
             for n, (kind, shards, rank, what, _) in ERRORS.items()]
    jobs.append(_job("vocab/after_errors", "loss", p3, 2, VOCAB_CASES["grpo_sequence_beta"]))
    return jobs


def _jobs_world3() -> list:
    p3 = _problem(1303, 3)
    return [_job("vocab/dapo_token_bias", "loss", p3, 3, VOCAB_CASES["dapo_token_bias"]),
            _job("vocab/grpo_sequence_beta", "loss", p3, 3,
                 VOCAB_CASES["grpo_sequence_beta"]),
            _job("vocab/logprobs", "logprobs", p3, 3),
            _job("error/vocab_bad_token", "loss", p3, 3, break_rank=2, break_what="token")]


def _jobs_world4() -> list:
    p4 = _problem(1304, 4)
    return [_job("grid/dapo", "loss", p4, 2, DATA_CASES["dapo"]),
            _job("grid/grpo_sequence", "loss", p4, 2, DATA_CASES["grpo_sequence"]),
            _job("grid/masked_row", "loss", p4, 2, DATA_CASES["dapo"], masked_data_row=0),
            _job("error/grid_bad_token", "loss", p4, 2, break_rank=3, break_what="token"),
            _job("error/grid_nan_hidden", "loss", p4, 2, break_rank=0, break_what="nan")]


def _jobs_reference() -> list:
    """The device path's jobs (2 ranks on the reference backend)."""
    p3 = _problem(1305, 3)
    return [_job("vocab/dapo_token_bias", "loss", p3, 2, VOCAB_CASES["dapo_token_bias"]),
            _job("vocab/grpo_sequence_beta", "loss", p3, 2,
                 VOCAB_CASES["grpo_sequence_beta"]),
            _job("vocab/logprobs", "logprobs", p3, 2, dict(temperature=0.8)),
            _job("error/vocab_bad_token", "loss", p3, 2, dict(beta=0.04), break_rank=1,
                 break_what="token"),
            _job("error/logprobs_nan_grad_logp", "logprobs", p3, 2, break_rank=0,
                 break_what="nan_grad_logp")]


@pytest.fixture(scope="module")
def reference_group(tmp_path_factory):
    """(jobs by name, results by rank) of 2 ranks on the reference backend."""
    jobs = _jobs_reference()
    t0 = time.monotonic()
    results = _spawn(2, jobs, tmp_path_factory.mktemp("reference"),
                     FG_TEST_TORCH_DIST_BACKEND="reference")
    print(f"\n2 ranks on the reference backend, {len(jobs)} jobs: "
          f"{time.monotonic() - t0:.1f} s")
    return {j["name"]: j for j in jobs}, results


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """{world: (jobs by name, results by rank)}, each group started once."""
    out = {}
    for world, make in ((2, _jobs_world2), (3, _jobs_world3), (4, _jobs_world4)):
        jobs = make()
        t0 = time.monotonic()
        results = _spawn(world, jobs, tmp_path_factory.mktemp(f"world{world}"))
        print(f"\n{world} ranks, {len(jobs)} jobs: {time.monotonic() - t0:.1f} s")
        out[world] = ({j["name"]: j for j in jobs}, results)
    yield out
    print("\nworst relative error against one process: " +
          ", ".join(f"{k} {v:.2e}" for k, v in sorted(WORST.items())))


# ------------------------------------------------------------------ references

def _whole(job) -> dict:
    """The job's problem as one process sees it (a masked data row applied)."""
    p = dict(job["problem"])
    if job.get("masked_data_row") is not None:
        B = p["mask"].shape[0]
        per = B // 2
        r = job["masked_data_row"]
        p["mask"] = p["mask"].clone()
        p["mask"][r * per:(r + 1) * per] = False
    return p


def _leaves(p):
    return (p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_(),
            p["bias"].clone().requires_grad_())


def _reference(job) -> dict:
    """fusedgrpo.torch on the whole weight and batch."""
    p = _whole(job)
    h, w, b = _leaves(p)
    o = job["options"]
    if job["kind"] == "logprobs":
        logp, ent = fgt.linear_logprobs(h, w, p["token_ids"], p["mask"], b, return_entropy=True,
                                        **o)
        ((logp * p["c_logp"]).sum() + (ent * p["c_entropy"]).sum()).backward()
        return dict(logp=logp.detach(), entropy=ent.detach(), grad_hidden=h.grad,
                    grad_weight=w.grad, grad_bias=b.grad)
    if job["kind"] == "module":
        mod = fgt.FusedLinearGRPOLoss(return_metrics_dict=True, **o)
        loss, metrics = mod(h, w, p["token_ids"], p["mask"].long(), p["advantages"], b,
                            ref_per_token_logps=p["ref_logp"], old_per_token_logps=p["old_logp"])
        logp = None
    else:
        loss, metrics, logp, _ = fgt.fused_linear_grpo_loss(
            h, w, p["token_ids"], p["mask"], p["advantages"], b, p["old_logp"], p["ref_logp"],
            **o)
    loss.backward()
    return dict(loss=loss.detach(), metrics={k: v.detach() for k, v in metrics.items()},
                logp=logp, grad_hidden=h.grad,
                grad_weight=w.grad, grad_bias=b.grad)


def _ranks(results, name):
    """The job's per-rank results as a grid: rows[data_rank][vocab_rank]."""
    outs = [r[name] for r in results]
    rows = {}
    for o in outs:
        rows.setdefault(o["data_rank"], {})[o["vocab_rank"]] = o
    return [[rows[d][v] for v in sorted(rows[d])] for d in sorted(rows)]


def _assembled(rows) -> dict:
    """What the ranks together computed, in the single process's terms: the
    data rows' mean loss (DDP's), their sequences' logp and grad_hidden (each
    row's share of the mean: / rows), the vocab ranks' weight and bias rows."""
    D = len(rows)
    first = [row[0] for row in rows]
    out = {"grad_hidden": torch.cat([o["grad_hidden"] for o in first]) / D,
           "grad_weight": torch.cat([o["grad_weight"] for o in rows[0]]),
           "grad_bias": torch.cat([o["grad_bias"] for o in rows[0]])}
    if "loss" in first[0]:
        out["loss"] = sum(o["loss"].double() for o in first) / D
    for k in ("logp", "entropy"):
        if k in first[0]:
            out[k] = torch.cat([o[k] for o in first])
    return out


def _loss_scale(job) -> float:
    """The float64 reference's loss of the terms' magnitudes (grpo_reference)."""
    p = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in _whole(job).items()}
    return reference(p["hidden"], p["weight"], p["token_ids"], p["mask"], p["advantages"],
                     p["old_logp"], p["ref_logp"], bias=p["bias"], **job["options"])["loss_scale"]


def _check_close(name, got, want, tol, what, scale=None):
    got, want = got.detach().double().numpy(), want.detach().double().numpy()
    if scale is not None:
        scale = max(float(np.max(np.abs(want))), scale)
    err = relative_error(got, want, scale)
    WORST[what] = max(WORST.get(what, 0.0), err)
    assert err <= tol, f"{name}: {what} relative error {err:.3g} > {tol:g}"


def _check_against_one_process(job, rows):
    want = _reference(job)
    got = _assembled(rows)
    name = job["name"]
    if "loss" in got:
        _check_close(name, got["loss"], want["loss"], TOL_LOSS, "loss", _loss_scale(job))
    for k in ("logp", "entropy"):
        if k in got and want.get(k) is not None:
            _check_close(name, got[k], want[k], TOL_LOGP, k)
    for k in ("grad_hidden", "grad_weight", "grad_bias"):
        _check_close(name, got[k], want[k], TOL_GRAD, k)
    return want


def _check_metrics(name, got, want, loss_scale):
    """One data row: the whole batch's metrics, as one process reports them
    (policy_loss cancels like the loss: relative to the same scale)."""
    for k, v in got.items():
        g, w = float(v), float(want[k])
        if k == "policy_loss":
            err = abs(g - w) / max(abs(w), loss_scale)
        else:
            err = 0.0 if g == w or (np.isnan(g) and np.isnan(w)) else abs(g - w) / max(abs(w), 1e-6)
        assert err <= TOL_LOSS, f"{name}: metric {k} {g} vs one process {w}"


def _check_same_bits_on_a_row(name, rows):
    for row in rows:
        for o in row[1:]:
            for k in ("loss", "logp", "entropy"):
                if k in o:
                    assert torch.equal(o[k], row[0][k]), f"{name}: {k} differs between ranks"


# ------------------------------------------------------------------ the tests

VOCAB_RUNS = [(2, c) for c in VOCAB_CASES] + [(3, "dapo_token_bias"),
                                              (3, "grpo_sequence_beta")]


@pytest.mark.parametrize("world,case", VOCAB_RUNS, ids=[f"{w}-{c}" for w, c in VOCAB_RUNS])
def test_vocab_parallel_loss_matches_one_process(groups, world, case):
    jobs, results = groups[world]
    name = f"vocab/{case}"
    rows = _ranks(results, name)
    assert len(rows) == 1 and len(rows[0]) == world
    _check_same_bits_on_a_row(name, rows)
    want = _check_against_one_process(jobs[name], rows)
    _check_metrics(name, rows[0][0]["metrics"], want["metrics"], _loss_scale(jobs[name]))


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_logprobs_and_their_backward(groups, world):
    jobs, results = groups[world]
    rows = _ranks(results, "vocab/logprobs")
    _check_same_bits_on_a_row("vocab/logprobs", rows)
    _check_against_one_process(jobs["vocab/logprobs"], rows)


def test_vocab_parallel_module(groups):
    jobs, results = groups[2]
    rows = _ranks(results, "vocab/module")
    _check_same_bits_on_a_row("vocab/module", rows)
    _check_against_one_process(jobs["vocab/module"], rows)


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_data_parallel_ddp_mean_is_the_whole_batch(groups, case):
    jobs, results = groups[2]
    name = f"data/{case}"
    rows = _ranks(results, name)
    assert [len(r) for r in rows] == [1, 1]
    # DDP leaves every rank the same mean gradient of the weight
    assert torch.equal(rows[0][0]["grad_weight"], rows[1][0]["grad_weight"])
    _check_against_one_process(jobs[name], rows)


@pytest.mark.parametrize("case", ["dapo", "grpo_sequence"])
def test_data_parallel_rank_with_every_sequence_masked(groups, case):
    jobs, results = groups[2]
    name = f"data_masked/{case}"
    rows = _ranks(results, name)
    masked = rows[1][0]
    assert float(masked["loss"]) == 0.0 and not masked["grad_hidden"].any()
    _check_against_one_process(jobs[name], rows)


@pytest.mark.parametrize("case", ["dapo", "grpo_sequence", "masked_row"])
def test_vocab_by_data_grid(groups, case):
    jobs, results = groups[4]
    name = f"grid/{case}"
    rows = _ranks(results, name)
    assert [len(r) for r in rows] == [2, 2]
    _check_same_bits_on_a_row(name, rows)
    _check_against_one_process(jobs[name], rows)


ERROR_RUNS = [(2, n, e[4]) for n, e in ERRORS.items()] + [
    (3, "vocab_bad_token", "FG_ERR_TOKEN_OUT_OF_RANGE"),
    (4, "grid_bad_token", "FG_ERR_TOKEN_OUT_OF_RANGE"),
    (4, "grid_nan_hidden", "FG_ERR_NONFINITE_INPUT")]


@pytest.mark.parametrize("world,case,status", ERROR_RUNS,
                         ids=[f"{w}-{c}" for w, c, _ in ERROR_RUNS])
def test_one_bad_rank_makes_every_rank_raise_the_same_status(groups, world, case, status):
    _, results = groups[world]
    outs = [r[f"error/{case}"] for r in results]
    got = [o.get("status") for o in outs]
    assert got == [status] * world, [o.get("message", "returned") for o in outs]
    slowest = max(o["seconds"] for o in outs)
    assert slowest < ERROR_SECONDS, f"a rank took {slowest:.1f} s to raise"


def test_groups_still_work_after_errors(groups):
    jobs, results = groups[2]
    rows = _ranks(results, "vocab/after_errors")
    _check_same_bits_on_a_row("vocab/after_errors", rows)
    _check_against_one_process(jobs["vocab/after_errors"], rows)


def test_vocab_shard_range_tiles_any_size():
    from fusedgrpo.torch_distributed import vocab_shard_range
    for total in (1, 7, 301):
        for parts in (1, 2, 3, 4):
            if parts > total:
                continue
            ranges = [vocab_shard_range(total, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and sum(n for _, n in ranges) == total
            assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
            assert max(n for _, n in ranges) - min(n for _, n in ranges) <= 1


# ------------------------------------------------ the device path, without a GPU

REFERENCE_RUNS = ["vocab/dapo_token_bias", "vocab/grpo_sequence_beta", "vocab/logprobs"]


@pytest.mark.parametrize("name", REFERENCE_RUNS)
def test_device_path_on_the_reference_backend_matches_one_process(reference_group, name):
    jobs, results = reference_group
    rows = _ranks(results, name)
    assert len(rows) == 1 and len(rows[0]) == 2
    # the calls went through the device context (forward, and linear_logprobs'
    # backward: its own request)
    assert all(o["device_contexts"] >= 1 for o in rows[0]), name
    _check_same_bits_on_a_row(name, rows)
    want = _check_against_one_process(jobs[name], rows)
    if jobs[name]["kind"] == "loss":
        _check_metrics(name, rows[0][0]["metrics"], want["metrics"], _loss_scale(jobs[name]))


@pytest.mark.parametrize("case,status", [("vocab_bad_token", "FG_ERR_TOKEN_OUT_OF_RANGE"),
                                         ("logprobs_nan_grad_logp", "FG_ERR_NONFINITE_INPUT")])
def test_device_path_on_the_reference_backend_raises_alike(reference_group, case, status):
    _, results = reference_group
    outs = [r[f"error/{case}"] for r in results]
    assert [o.get("status") for o in outs] == [status] * 2, \
        [o.get("message", "returned") for o in outs]
    assert all(o["device_contexts"] >= 1 for o in outs)
    assert max(o["seconds"] for o in outs) < ERROR_SECONDS
