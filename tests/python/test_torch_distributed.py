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
    against one process on the CPU as above, also sequence parallel and
    with a partial grad_hidden, and a bad token id and a NaN
    gradient of logp raised alike on both ranks;
  - argument errors on one rank of 2 (an unknown keyword, a NumPy hidden, a
    2-element num_items_in_batch, a missing argument, a bad option, filter_eps
    True, linear_logprobs' unknown keyword, Liger's module without reference
    log-probs, agreed() over a call raising TypeError): the bad rank raises
    its own error, the other a FusedGRPOError naming that rank and why, both
    within seconds, and the next (good) call matches one process (the ranks
    do not pair up across calls); the same options spelled differently
    (beta=0 and 0.0, a default passed on one rank only) agree, different ones
    are still refused;
  - tensor parallel (2 ranks, T = 14): grad_hidden "partial" (the loss, the
    Liger-style module, linear_logprobs), whose sum over the ranks is the
    one-process gradient (each share alone is not, and twice the sum fails
    the bound), sequence parallel (hidden's sequence split over the ranks,
    gathered inside, grad_hidden reduce-scattered back), trust_inputs (the
    loss; a bad token id and a refused weight shard still raise on every
    rank), and error_group the vocab group (a rank whose group is itself
    calls the loss, the other never does, and neither waits);
    linear_cross_entropy over the group (verl's call) against a float64
    torch reference, forward and backward through both outputs: packed
    [N, H] with an uneven vocab split (vocab_start given), [B, T, H],
    reductions "sum" and "MEAN", sequence parallel.
A 60 s join timeout per group guards against a hang (and fails the test);
nothing here passes by waiting for it. The argument errors' group also has a
30 s collective timeout, so a rank left waiting raises rather than hangs.
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


def _problem(seed: int, B: int, T: int = T) -> dict:
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


def _spawn(world: int, jobs: list, tmp_path, join_timeout=JOIN_TIMEOUT_S, **env_extra) -> list:
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
    deadline = time.monotonic() + join_timeout
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
    assert not hung, f"ranks {hung} still running after {join_timeout} s:\n" + "\n".join(text)
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
                 break_what="nan_grad_logp"),
            # tensor parallel: sequence shards gathered into a device buffer,
            # grad_hidden reduce-scattered / left partial on the device
            _job("tp/loss_sequence_parallel", "loss", _problem(1312, 3, T_SP), 2,
                 VOCAB_CASES["grpo_sequence_beta"], tp=dict(sequence_parallel=True)),
            _job("tp/logprobs_partial", "logprobs", p3, 2, dict(temperature=0.8),
                 tp=dict(tensor_parallel=True, trust_inputs=True))]


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


def _grad_hidden_mode(job) -> str:
    """How the job's grad_hidden comes back: its tp keywords with the
    documented defaults (sequence parallel: reduce_scatter; tensor parallel:
    partial; else sum)."""
    tp = job.get("tp", {})
    if "grad_hidden" in tp:
        return tp["grad_hidden"]
    if tp.get("sequence_parallel"):
        return "reduce_scatter"
    return "partial" if tp.get("tensor_parallel") else "sum"


def _row_grad_hidden(row, mode):
    """A data row's whole grad_hidden from its vocab ranks' (as the caller's
    framework would make it): the same on each ("sum"), the sum of the
    shares ("partial"), the sequence pieces in rank order ("reduce_scatter")."""
    if mode == "partial":
        return sum(o["grad_hidden"] for o in row)
    if mode == "reduce_scatter":
        return torch.cat([o["grad_hidden"] for o in row], dim=1)
    return row[0]["grad_hidden"]


def _assembled(rows, mode="sum") -> dict:
    """What the ranks together computed, in the single process's terms: the
    data rows' mean loss (DDP's), their sequences' logp and grad_hidden (each
    row's share of the mean: / rows), the vocab ranks' weight and bias rows."""
    D = len(rows)
    first = [row[0] for row in rows]
    out = {"grad_hidden": torch.cat([_row_grad_hidden(row, mode) for row in rows]) / D,
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
    got = _assembled(rows, _grad_hidden_mode(job))
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

REFERENCE_RUNS = ["vocab/dapo_token_bias", "vocab/grpo_sequence_beta", "vocab/logprobs",
                  "tp/loss_sequence_parallel", "tp/logprobs_partial"]


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


# ------------------------------------------------ argument errors on one rank

ARGUMENT_COLLECTIVE_TIMEOUT_S = 30  # a rank left waiting in a collective raises after it
ARGUMENT_JOIN_TIMEOUT_S = 60.0      # the whole run (a healthy one: a few seconds)
# scenario (torch_distributed_worker.SCENARIOS): (the rank given the bad
# argument, the exception types it may raise, the status the other rank
# raises, a word of the bad rank's message that the other's must hold)
ARGUMENT_ERRORS = {
    "unknown_keyword": (1, ("TypeError",), "FG_ERR_COMMUNICATOR", "bta"),
    "numpy_hidden": (0, ("AttributeError", "FusedGRPOError"), None, "ndarray"),
    "items_two_elements": (1, ("ValueError", "RuntimeError"), "FG_ERR_COMMUNICATOR",
                           "one element"),
    "missing_argument": (1, ("TypeError",), "FG_ERR_COMMUNICATOR", "advantages"),
    "bad_option": (1, ("FusedGRPOError",), "FG_ERR_BAD_HYPERPARAMETER", "beta"),
    "filter_eps_true": (1, ("FusedGRPOError",), "FG_ERR_BAD_HYPERPARAMETER", "filter_eps"),
    "logprobs_unknown_keyword": (0, ("TypeError",), "FG_ERR_COMMUNICATOR", "tempreature"),
    "module_missing_ref": (1, ("ValueError",), "FG_ERR_COMMUNICATOR", "ref_per_token_logps"),
    "agreed_type_error": (1, ("TypeError",), "FG_ERR_COMMUNICATOR", "bta"),
}
SPELLED = dict(beta=0.0, num_items_in_batch=20.0)  # what both spellings mean


def _jobs_arguments() -> list:
    p3 = _problem(1306, 3)
    jobs = [_job(f"args/{n}", "scenario", p3, 2, dict(beta=0.04), scenario=n)
            for n in ARGUMENT_ERRORS]
    jobs.append(_job("args/different_options", "scenario", p3, 2, dict(beta=0.04),
                     scenario="different_options"))
    jobs.append(_job("args/spelled_differently", "scenario", p3, 2, SPELLED,
                     scenario="spelled_differently"))
    return jobs


@pytest.fixture(scope="module")
def argument_group(tmp_path_factory):
    """(jobs by name, results by rank) of 2 ranks whose calls go wrong on one."""
    jobs = _jobs_arguments()
    t0 = time.monotonic()
    results = _spawn(2, jobs, tmp_path_factory.mktemp("arguments"),
                     join_timeout=ARGUMENT_JOIN_TIMEOUT_S,
                     FG_TEST_TORCH_DIST_TIMEOUT_S=str(ARGUMENT_COLLECTIVE_TIMEOUT_S))
    print(f"\n2 ranks, {len(jobs)} argument scenarios: {time.monotonic() - t0:.1f} s")
    return {j["name"]: j for j in jobs}, results


def _calls(results, name) -> list:
    """[rank][call] outcomes of a scenario."""
    return [r[name]["calls"] for r in results]


def _check_good_call(job, results, call: int, options=None):
    """Call `call` of the scenario returned on every rank, and matches one process."""
    name = job["name"]
    outs = [r[name] for r in results]
    for rank, o in enumerate(outs):
        c = o["calls"][call]
        assert "ok" in c, f"{name} call {call}: rank {rank} raised {c}"
    rows = [[dict(o["calls"][call]["ok"], vocab_rank=o["vocab_rank"], data_rank=o["data_rank"])
             for o in outs]]
    _check_same_bits_on_a_row(name, rows)
    _check_against_one_process(dict(job, kind="loss", options=options or job["options"]), rows)


def _check_raised_alike(name, outcomes, bad, bad_types, status, word):
    bad_out = outcomes[bad]
    assert bad_out.get("raised") in bad_types, f"{name}: rank {bad}: {bad_out}"
    assert word in bad_out["message"], bad_out
    for rank, o in enumerate(outcomes):
        assert o.get("raised"), f"{name}: rank {rank} returned"
        assert o["seconds"] < ERROR_SECONDS, f"{name}: rank {rank} took {o['seconds']:.1f} s"
        if rank == bad:
            continue
        assert o["raised"] == "FusedGRPOError", f"{name}: rank {rank}: {o}"
        if status is not None:
            assert o["status"] == status, f"{name}: rank {rank}: {o}"
        # which rank failed, and why
        assert f"rank {bad}" in o["message"] and word in o["message"], o["message"]


@pytest.mark.parametrize("case", list(ARGUMENT_ERRORS))
def test_argument_error_on_one_rank_raises_on_every_rank(argument_group, case):
    """No rank raises before the entry agreement: the bad rank raises its own
    error, the other learns of it there instead of waiting, and the next call
    pairs with the next call (one-process results)."""
    jobs, results = argument_group
    name = f"args/{case}"
    bad, bad_types, status, word = ARGUMENT_ERRORS[case]
    calls = _calls(results, name)
    _check_raised_alike(name, [c[0] for c in calls], bad, bad_types, status, word)
    if case == "agreed_type_error":
        # then a NumPy hidden on rank 0 (AttributeError there), then a good call
        _check_raised_alike(name, [c[1] for c in calls], 0, ("AttributeError",),
                            "FG_ERR_COMMUNICATOR", "ndarray")
        import fusedgrpo.torch as fgt_
        p = jobs[name]["problem"]
        want, _, _, _ = fgt_.fused_linear_grpo_loss(
            p["hidden"], p["weight"], p["token_ids"], p["mask"], p["advantages"], p["bias"],
            p["old_logp"], p["ref_logp"], **jobs[name]["options"])
        for rank, c in enumerate(calls):
            assert "ok" in c[2], f"rank {rank}: {c[2]}"
            assert torch.equal(c[2]["ok"]["loss"], want.detach()), rank
        return
    _check_good_call(jobs[name], results, 1)


def test_same_options_spelled_differently_agree(argument_group):
    """beta=0 and beta=0.0, a default passed on one rank only, a 0-dim tensor
    num_items_in_batch, execution options that do not change the bits."""
    jobs, results = argument_group
    job = jobs["args/spelled_differently"]
    for call in (0, 1):
        _check_good_call(job, results, call, SPELLED)


def test_different_options_are_still_refused(argument_group):
    jobs, results = argument_group
    name = "args/different_options"
    calls = _calls(results, name)
    for rank, c in enumerate(calls):
        o = c[0]
        assert o.get("status") == "FG_ERR_COMMUNICATOR" and "options" in o["message"], \
            f"rank {rank}: {o}"
        assert o["seconds"] < ERROR_SECONDS
    _check_good_call(jobs[name], results, 1)


# ------------------------------------------------ tensor parallel (Megatron's contract)

T_SP = 14          # the sequence-parallel jobs' T: 7 tokens per rank
N_LCE = 41         # linear_cross_entropy's packed token rows (odd; 42 under sequence parallel)
TP = dict(tensor_parallel=True)
TRUSTED = dict(tensor_parallel=True, trust_inputs=True)


def _lce_problem(seed, shape, V_, *, temperature=0.8, reduction="none", **lce) -> dict:
    """hidden [*shape, H], weight [V_, H], labels [*shape], the loss's
    coefficients (a scalar one for reduced log-probs)."""
    rng = np.random.default_rng(seed)

    def f32(*s, scale=1.0):
        return torch.from_numpy(np.asarray(rng.standard_normal(s) * scale, np.float32))
    return dict(hidden=f32(*shape, H), weight=f32(V_, H, scale=2.0 / np.sqrt(H)),
                labels=torch.from_numpy(rng.integers(0, V_, size=shape)),
                c_logp=f32(*(shape if reduction == "none" else ())), c_entropy=f32(*shape),
                temperature=temperature, reduction=reduction, lce=lce)


LCE_JOBS = {  # name: (problem, pass vocab_start: the uneven split of V = 301)
    "packed_uneven": (lambda: _lce_problem(1320, (N_LCE,), V), True),
    "btH_even": (lambda: _lce_problem(1321, (3, T), V - 1, temperature=1.0), False),
    "sum": (lambda: _lce_problem(1322, (N_LCE,), V - 1, reduction="sum"), False),
    "mean_trusted": (lambda: _lce_problem(1323, (2, T), V - 1, reduction="MEAN",
                                          trust_inputs=True), False),
    "sequence_parallel": (lambda: _lce_problem(1324, (N_LCE + 1,), V - 1,
                                               sequence_parallel=True), False),
}


def _jobs_tensor_parallel() -> list:
    p = _problem(1310, 3, T_SP)
    jobs = [
        _job("tp/loss_partial", "loss", p, 2, VOCAB_CASES["grpo_sequence_beta"], tp=TP),
        _job("tp/module_partial", "module", p, 2, dict(beta=0.04, loss_type="dapo"), tp=TP),
        _job("tp/logprobs_partial", "logprobs", p, 2, dict(temperature=0.8),
             tp=dict(grad_hidden="partial")),
        _job("tp/loss_sequence_parallel", "loss", p, 2, VOCAB_CASES["dapo_token_bias"],
             tp=dict(sequence_parallel=True)),
        _job("tp/logprobs_sequence_parallel", "logprobs", p, 2, {},
             tp=dict(sequence_parallel=True, trust_inputs=True)),
        _job("tp/loss_trusted", "loss", p, 2, VOCAB_CASES["cispo_token_beta"], tp=TRUSTED),
        _job("error/tp_trusted_bad_token", "loss", p, 2, dict(beta=0.04), tp=TRUSTED,
             break_rank=1, break_what="token"),
        _job("args/tp_trusted_bad_weight", "scenario", p, 2, dict(beta=0.04), tp=TRUSTED,
             scenario="trusted_bad_weight"),
        _job("args/tp_trusted_bad_weight_sequence_parallel", "scenario", p, 2, dict(beta=0.04),
             tp=dict(sequence_parallel=True, trust_inputs=True), scenario="trusted_bad_weight"),
        _job("tp/pipeline_stage", "pipeline", _problem(1311, 4), 1, DATA_CASES["dapo"]),
    ]
    jobs += [dict(name=f"lce/{n}", kind="lce", problem=make(), vocab_shards=2,
                  pass_vocab_start=start) for n, (make, start) in LCE_JOBS.items()]
    return jobs


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory):
    """(jobs by name, results by rank) of 2 ranks run as one tensor-parallel group."""
    jobs = _jobs_tensor_parallel()
    t0 = time.monotonic()
    results = _spawn(2, jobs, tmp_path_factory.mktemp("tensor_parallel"))
    print(f"\n2 ranks, {len(jobs)} tensor-parallel jobs: {time.monotonic() - t0:.1f} s")
    yield {j["name"]: j for j in jobs}, results
    print("\nworst relative error of linear_cross_entropy against float64: " +
          ", ".join(f"{k[4:]} {v:.2e}" for k, v in sorted(WORST.items())
                    if k.startswith("lce_")))


TP_RUNS = ["tp/loss_partial", "tp/module_partial", "tp/logprobs_partial",
           "tp/loss_sequence_parallel", "tp/logprobs_sequence_parallel", "tp/loss_trusted"]


@pytest.mark.parametrize("name", TP_RUNS)
def test_tensor_parallel_matches_one_process(tp_group, name):
    """Partial grad_hidden summed over the ranks, the sequence pieces of a
    reduce-scattered one side by side: the one-process gradient; the loss,
    log-probs and weight rows as without tensor parallelism."""
    jobs, results = tp_group
    rows = _ranks(results, name)
    assert len(rows) == 1 and len(rows[0]) == 2
    _check_same_bits_on_a_row(name, rows)
    want = _check_against_one_process(jobs[name], rows)
    mode = _grad_hidden_mode(jobs[name])
    if mode == "reduce_scatter":
        T_local = T_SP // 2
        assert all(o["grad_hidden"].shape == (3, T_local, H) for o in rows[0])
    if mode == "partial":
        # each rank's share is its own (not the whole), and a gradient counted
        # once per rank (TP times, what a summed grad_hidden would give the
        # caller's reduction) fails the bound
        whole = want["grad_hidden"].double()
        for o in rows[0]:
            assert relative_error(o["grad_hidden"].double().numpy(), whole.numpy()) > 0.1
        twice = 2 * _row_grad_hidden(rows[0], "partial").double()
        assert relative_error(twice.numpy(), whole.numpy()) > 100 * TOL_GRAD


def test_trusted_bad_token_raises_on_every_rank(tp_group):
    """trust_inputs skips the entry agreement and the tokens' hash; a failed
    phase still reaches every rank through the status slot."""
    _, results = tp_group
    outs = [r["error/tp_trusted_bad_token"] for r in results]
    assert [o.get("status") for o in outs] == ["FG_ERR_TOKEN_OUT_OF_RANGE"] * 2, outs
    assert max(o["seconds"] for o in outs) < ERROR_SECONDS


@pytest.mark.parametrize("case", ["", "_sequence_parallel"])
def test_trusted_bad_weight_shard_joins_as_a_failed_rank(tp_group, case):
    """With no entry agreement, the rank whose weight shard is refused
    (float64) still makes the phases' collectives (and the sequence gather),
    sized from the tokens and hidden: both ranks raise its status within
    seconds, and the next call pairs with the next call."""
    jobs, results = tp_group
    name = f"args/tp_trusted_bad_weight{case}"
    first = [c[0] for c in _calls(results, name)]
    for rank, o in enumerate(first):
        assert o.get("raised") == "FusedGRPOError" and o["status"] == "FG_ERR_UNSUPPORTED", \
            f"rank {rank}: {o}"
        assert o["seconds"] < ERROR_SECONDS
    assert "float64" in first[1]["message"]
    _check_good_call(jobs[name], results, 1)


def test_tensor_parallel_error_group_is_the_vocab_group(tp_group):
    """A pipeline's last stage (rank 1, its own vocab group) calls the loss;
    rank 0 never does. The call's agreements stay within rank 1's group: the
    WORLD all_reduce both make next meets its counterpart on each rank."""
    _, results = tp_group
    outs = [r["tp/pipeline_stage"] for r in results]
    assert [o["marker"] for o in outs] == [14.0, 14.0], outs
    assert "loss" not in outs[0] and torch.isfinite(outs[1]["loss"])


# ------------------------------------------------ linear_cross_entropy, vocab parallel

TOL_LCE = 5e-6     # normwise against float64 (worst measured: 1.3e-6, grad_weight)


def lce_reference(p) -> dict:
    """float64 torch: log_softmax of the whole head's logits / temperature,
    entropy -sum(p log p), the same loss of both, its gradients."""
    h = p["hidden"].double().requires_grad_()
    w = p["weight"].double().requires_grad_()
    logits = h.reshape(-1, h.shape[-1]) @ w.T / p["temperature"]
    ls = torch.log_softmax(logits, dim=-1)
    lp = ls.gather(-1, p["labels"].reshape(-1, 1)).reshape(p["labels"].shape)
    ent = -(ls.exp() * ls).sum(-1).reshape(p["labels"].shape)
    reduction = p["reduction"].lower()
    lp = lp.sum() if reduction == "sum" else lp.mean() if reduction == "mean" else lp
    ((lp * p["c_logp"].double()).sum() + (ent * p["c_entropy"].double()).sum()).backward()
    return dict(log_probs=lp.detach(), entropy=ent.detach(), grad_hidden=h.grad,
                grad_weight=w.grad)


@pytest.mark.parametrize("case", list(LCE_JOBS))
def test_linear_cross_entropy_vocab_parallel_matches_float64(tp_group, case):
    """verl's call with a process group: log_probs and entropy the same bits
    on both ranks; the partial grad_hidden summed (or the sequence pieces side
    by side) and the weight rows against the float64 torch reference."""
    jobs, results = tp_group
    name = f"lce/{case}"
    p = jobs[name]["problem"]
    rows = _ranks(results, name)[0]
    for k in ("log_probs", "entropy"):
        assert torch.equal(rows[0][k], rows[1][k]), f"{name}: {k} differs between ranks"
        assert rows[0][k].dtype == torch.float32
    sp = p["lce"].get("sequence_parallel", False)
    got = dict(log_probs=rows[0]["log_probs"], entropy=rows[0]["entropy"],
               grad_hidden=(torch.cat([o["grad_hidden"] for o in rows]) if sp
                            else sum(o["grad_hidden"] for o in rows)),
               grad_weight=torch.cat([o["grad_weight"] for o in rows]))
    want = lce_reference(p)
    for k, v in want.items():
        assert got[k].shape == v.shape, f"{name}: {k} {tuple(got[k].shape)}"
        _check_close(name, got[k], v, TOL_LCE, f"lce_{k}")


_AUTOGRAD_SCRIPT = r'''
import socket, sys, torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
import fusedgrpo.torch_distributed as fgd
g = torch.Generator().manual_seed(5)
B, T, H, V = 2, 3, 5, 7
h = torch.randn(B, T, H, generator=g, requires_grad=True)
w = torch.randn(V, H, generator=g, requires_grad=True)
ids = torch.randint(0, V, (B, T), generator=g)
m = torch.ones(B, T, dtype=torch.bool)
a = torch.randn(B, generator=g)
ops = {"loss": lambda: fgd.fused_linear_grpo_loss(h, w, ids, m, a)[0],
       "logprobs": lambda: fgd.linear_logprobs(h, w, ids, m).sum()}
for name, op in ops.items():
    first, = torch.autograd.grad(op() + (h ** 2).sum(), h, create_graph=True)
    try:
        torch.autograd.grad(first.sum(), h)
        print(name, "double backward: no error")
    except RuntimeError as e:
        assert "double backward" in str(e), e
    out = op()
    gw_true, = torch.autograd.grad(out, w, retain_graph=True)
    gw_true = gw_true.clone()
    for _ in range(3):  # edited and dropped between backward passes
        out.backward(retain_graph=True)
        if not torch.equal(w.grad, gw_true):
            print(name, "retained graph: a later backward gave another gradient")
        w.grad.mul_(0.5)
        w.grad = None
print("done")
dist.destroy_process_group()
'''


def test_double_backward_raises_and_gradients_are_the_callers():
    """A double backward through the distributed loss or log-probs raises;
    every backward of a retained graph hands over the true gradient, however
    the caller edited the previous one (a world of one)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _AUTOGRAD_SCRIPT], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "done", out.stdout
