"""One rank of test_torch_distributed.py's process groups (run as a script):

    python torch_distributed_worker.py RANK WORLD PORT JOBS_FILE OUT_DIR

Joins a gloo group on tcp://127.0.0.1:PORT, runs every job of JOBS_FILE (a
torch.save'd list, the same on every rank, run in order) on its share of the
job's problem, and saves {job name: result} to OUT_DIR/rank<RANK>.pt. A job:
  name, kind ("loss" | "module" | "logprobs" | "agreed" | "lce" | "pipeline"),
  problem (the whole batch and head), vocab_shards (the rest of the world
  splits the batch, DDP averaging the gradients over the data group), options
  (the loss's), and optionally tp (the tensor-parallel keywords:
  tensor_parallel, grad_hidden, sequence_parallel, trust_inputs; under
  sequence_parallel each rank gets its piece of hidden's sequence),
  break_rank / break_what ("token", "nan", "beta", "shape", "advantages",
  "nan_grad_logp": what that rank gets wrong) and masked_data_row (a data row
  whose sequences are all masked).
A job of kind "lce" runs fusedgrpo.cross_entropy.linear_cross_entropy over
the vocab group (its problem: hidden [..., H], weight, labels, temperature,
reduction, lce keywords) and the backward of a fixed linear loss of both
outputs; one of kind "pipeline" calls the loss on rank 1 only (the last
pipeline stage, a vocab group of its own, tensor_parallel=True), then both
ranks make one all_reduce over WORLD, which a collective left over from the
loss call (an exit agreement over WORLD) would pair with instead.
A result holds the rank's outputs and gradients, or the FusedGRPOError it
raised (status, message, seconds from the call to the raise), and how many
device contexts the job's calls asked for.

A job of kind "scenario" runs SCENARIOS[job["scenario"]]: a few calls in a
row, where one rank gets an argument wrong (an unknown keyword, a NumPy
hidden, ...) or the ranks spell the same options differently; its result
holds every call's outcome (what it returned, or the exception's type,
status, message and seconds), the last call normally a good one.

FG_TEST_TORCH_DIST_TIMEOUT_S: the gloo group's timeout (default 60 s): a
collective that waits longer raises, so a hang fails its test.

FG_TEST_TORCH_DIST_BACKEND=reference: the CPU tensors go through the
reference backend's context (a device context whose memory is the host's), so
the device path (every phase buffer on the context's device, the loss from
logp on the CPU thread's context) runs without a GPU.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import fusedgrpo._torch_inputs as ti
import fusedgrpo.torch_distributed as fgd
from fusedgrpo import FusedGRPOError, _lib

DEVICE_CONTEXTS = [0]  # device contexts handed out (FG_TEST_TORCH_DIST_BACKEND)


def use_backend(name: str):
    """Every call's context is `name`'s (CPU tensors: the reference backend)."""
    def call_context(device):
        DEVICE_CONTEXTS[0] += 1
        return _lib.device_context(name)
    ti.call_context = call_context

TOKEN_NORMALISED = ("dapo", "cispo", "vespo")  # num_items_in_batch: TRL's global / world


class Head(torch.nn.Module):
    """The LM head's shard as a module, so DDP can average its gradients."""

    def __init__(self, weight, bias, **shard):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.bias = None if bias is None else torch.nn.Parameter(bias)
        self.shard = shard

    def forward(self, hidden, token_ids, mask, advantages, old_logp, ref_logp, options):
        return fgd.fused_linear_grpo_loss(hidden, self.weight, token_ids, mask, advantages,
                                          self.bias, old_logp, ref_logp, **self.shard, **options)


def local_problem(job, grid):
    """This rank's share: its data row's sequences, its vocab rows."""
    p = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in job["problem"].items()}
    B, V = p["hidden"].shape[0], p["weight"].shape[0]
    if job.get("masked_data_row") is not None:
        b0, b1 = _rows(B, grid, job["masked_data_row"])
        p["mask"][b0:b1] = False
    items = float(p["mask"].sum()) / grid.data_shards  # TRL's convention, before the split
    b0, b1 = _rows(B, grid, grid.data_rank)
    for k in ("hidden", "token_ids", "mask", "advantages", "old_logp", "ref_logp", "c_logp",
              "c_entropy"):
        if p.get(k) is not None:
            p[k] = p[k][b0:b1].contiguous()
    v0, rows = fgd.vocab_shard_range(V, grid.vocab_shards, grid.vocab_rank)
    p["weight"] = p["weight"][v0:v0 + rows].contiguous()
    if p.get("bias") is not None:
        p["bias"] = p["bias"][v0:v0 + rows].contiguous()
    shard = dict(vocab_start=v0, vocab_size=V, process_group=grid.vocab_group,
                 **job.get("tp", {}))
    if shard.get("sequence_parallel"):
        p["hidden"] = sequence_piece(p["hidden"], 1, grid)
    options = dict(job.get("options", {}))
    if grid.data_shards > 1 and options.get("loss_type", "dapo") in TOKEN_NORMALISED:
        options["num_items_in_batch"] = items
    return p, shard, options


def sequence_piece(t, dim, grid):
    """This vocab rank's piece of t's sequence axis `dim` (sequence parallel)."""
    n = t.shape[dim] // grid.vocab_shards
    return t.narrow(dim, grid.vocab_rank * n, n).contiguous()


def _rows(B, grid, data_row):
    per = B // grid.data_shards
    return data_row * per, (data_row + 1) * per


def break_input(job, p, options):
    """What the job's break_rank gets wrong."""
    what = job["break_what"]
    first = int(p["mask"].reshape(-1).nonzero()[0])
    b, t = divmod(first, p["mask"].shape[1])
    if what == "token":
        p["token_ids"][b, t] = job["problem"]["weight"].shape[0] + 3
    elif what == "nan":
        p["hidden"][b, t, 5] = float("nan")
    elif what == "beta":
        options["beta"] = options.get("beta", 0.0) + 0.01
    elif what == "nan_grad_logp":  # (d) fails on that rank alone
        p["c_logp"][b, t] = float("nan")
    elif what == "advantages":
        p["advantages"][0] += 0.5
    elif what == "shape":
        for k in ("hidden", "token_ids", "mask", "old_logp", "ref_logp"):
            p[k] = p[k][:, :-1].contiguous()


# Each kind's setup (leaves, modules, DDP: not timed) returns the step itself.

def loss_step(p, shard, options, grid):
    h = p["hidden"].clone().requires_grad_()
    head = Head(p["weight"].clone(), None if p.get("bias") is None else p["bias"].clone(),
                **shard)
    model = head
    if grid.data_shards > 1:
        model = torch.nn.parallel.DistributedDataParallel(head, process_group=grid.data_group)

    def step():
        loss, metrics, logp, ent = model(h, p["token_ids"], p["mask"], p["advantages"],
                                         p.get("old_logp"), p.get("ref_logp"), options)
        loss.backward()
        return dict(loss=loss.detach(), metrics={k: v.detach() for k, v in metrics.items()},
                    logp=logp, entropy=ent, grad_hidden=h.grad, grad_weight=head.weight.grad,
                    grad_bias=None if head.bias is None else head.bias.grad)
    return step


def module_step(p, shard, options, grid):
    """FusedLinearGRPOLoss (Liger's signature) on the vocab-sharded head."""
    h, w, b = leaves(p)
    mod = fgd.FusedLinearGRPOLoss(return_metrics_dict=True, **options, **shard)

    def step():
        loss, metrics = mod(h, w, p["token_ids"], p["mask"].long(), p["advantages"], b,
                            ref_per_token_logps=p["ref_logp"],
                            old_per_token_logps=p["old_logp"])
        loss.backward()
        return dict(loss=loss.detach(), metrics={k: v.detach() for k, v in metrics.items()},
                    grad_hidden=h.grad, grad_weight=w.grad, grad_bias=b.grad)
    return step


def logprobs_step(p, shard, options, grid):
    """linear_logprobs and the backward of a fixed linear loss of logp and entropy."""
    h, w, b = leaves(p)

    def step():
        logp, ent = fgd.linear_logprobs(h, w, p["token_ids"], p["mask"], b,
                                        return_entropy=True, **shard, **options)
        ((logp * p["c_logp"]).sum() + (ent * p["c_entropy"]).sum()).backward()
        return dict(logp=logp.detach(), entropy=ent.detach(), grad_hidden=h.grad,
                    grad_weight=w.grad, grad_bias=b.grad)
    return step


def agreed_step(p, shard, options, grid):
    """The single-process op on the whole head (data parallel, as
    FusedGRPOTrainer under DDP runs it) through fgd.agreed."""
    import fusedgrpo.torch as fgt

    def step():
        loss, metrics, logp, ent = fgd.agreed(
            fgt.fused_linear_grpo_loss, p["hidden"], p["weight"], p["token_ids"], p["mask"],
            p["advantages"], p.get("bias"), p.get("old_logp"), p.get("ref_logp"), **options)
        return dict(loss=loss.detach(), logp=logp, entropy=ent)
    return step


def leaves(p):
    return tuple(p[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))


def lce_step(p, shard, options, grid):
    """linear_cross_entropy over the vocab group (verl's call: positional
    temperature, reduction, process group) and the backward of
    sum(c_logp * log_probs) + sum(c_entropy * entropy) (c_logp a scalar when
    the log-probs are reduced)."""
    from fusedgrpo.cross_entropy import linear_cross_entropy
    h, w = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()

    def step():
        lp, ent = linear_cross_entropy(h, w, p["labels"], p["temperature"], p["reduction"],
                                       shard["process_group"], **p["lce"])
        ((lp * p["c_logp"]).sum() + (ent * p["c_entropy"]).sum()).backward()
        return dict(log_probs=lp.detach(), entropy=ent.detach(), grad_hidden=h.grad,
                    grad_weight=w.grad)
    return step


def lce_problem(job, grid):
    """This rank's share of an "lce" job: its vocab rows (vocab_start passed
    when the job says so: an uneven split), under sequence_parallel its
    piece of the token rows."""
    p = dict(job["problem"])
    V = p["weight"].shape[0]
    v0, rows = fgd.vocab_shard_range(V, grid.vocab_shards, grid.vocab_rank)
    p["weight"] = p["weight"][v0:v0 + rows].contiguous()
    p["lce"] = dict(p.get("lce", {}))
    if job.get("pass_vocab_start"):
        p["lce"].update(vocab_start=v0, vocab_size=V)
    if p["lce"].get("sequence_parallel"):
        p["hidden"] = sequence_piece(p["hidden"], 0, grid)
    return p, dict(process_group=grid.vocab_group), {}


def pipeline_step(p, shard, options, grid):
    """Rank 1 alone calls the loss (its vocab group: itself), with
    tensor_parallel=True: error_group is that group, so the call makes no
    collective with rank 0, a pipeline stage that never calls it. Then one
    all_reduce SUM of 7 over WORLD on both ranks: it meets its counterpart
    (14) only if the loss call left no collective of its own on WORLD."""
    h, w, b = leaves(p)

    def step():
        out = {}
        if dist.get_rank() == 1:
            loss, _, logp, _ = fgd.fused_linear_grpo_loss(
                h, w, p["token_ids"], p["mask"], p["advantages"], b, p["old_logp"],
                p["ref_logp"], tensor_parallel=True, **shard, **options)
            loss.backward()
            out = dict(loss=loss.detach(), logp=logp)
        marker = torch.tensor([7.0])
        dist.all_reduce(marker)
        return dict(out, marker=float(marker))
    return step


STEPS = {"loss": loss_step, "module": module_step, "logprobs": logprobs_step,
         "agreed": agreed_step, "lce": lce_step, "pipeline": pipeline_step}


# ------------------------------------------------------------------ scenarios
# Each takes (p, shard, options, whole, rank) -- this rank's share, the
# job's whole problem, its rank -- and returns the outcomes of its calls.

def outcome(call):
    """{"ok": what call() returned} or the exception it raised: its type's
    name, status (FusedGRPOError's), message, seconds from the call to the raise."""
    t0 = time.monotonic()
    try:
        return dict(ok=call())
    except Exception as e:  # noqa: BLE001 - every type is an outcome here
        return dict(raised=type(e).__name__, status=getattr(e, "status", None),
                    message=f"{e}", seconds=time.monotonic() - t0)


def sharded_loss(p, shard, options, **over):
    """fgd.fused_linear_grpo_loss on this rank's share and its backward;
    `over` replaces arguments (a positional one by name) or adds keywords."""
    h, w, b = leaves(p)
    args = dict(hidden=h, weight=w, token_ids=p["token_ids"], mask=p["mask"],
                advantages=p["advantages"], bias=b, old_logp=p["old_logp"],
                ref_logp=p["ref_logp"])
    drop = over.pop("drop", ())
    for k in list(over):
        if k in args:
            args[k] = over.pop(k)
    positional = [args[k] for k in ("hidden", "weight", "token_ids", "mask", "advantages")
                  if k not in drop]
    loss, metrics, logp, ent = fgd.fused_linear_grpo_loss(
        *positional, bias=args["bias"], old_logp=args["old_logp"], ref_logp=args["ref_logp"],
        **shard, **{**options, **over})
    loss.backward()
    return dict(loss=loss.detach(), metrics={k: v.detach() for k, v in metrics.items()},
                logp=logp, entropy=ent, grad_hidden=h.grad, grad_weight=w.grad,
                grad_bias=b.grad)


def whole_loss(whole, options, **over):
    """fgd.agreed over the single-process op on the whole head and batch."""
    import fusedgrpo.torch as fgt
    q = dict(whole, **{k: over.pop(k) for k in list(over) if k in whole})
    loss, _, logp, _ = fgd.agreed(fgt.fused_linear_grpo_loss, q["hidden"], q["weight"],
                                  q["token_ids"], q["mask"], q["advantages"], q["bias"],
                                  q["old_logp"], q["ref_logp"], **{**options, **over})
    return dict(loss=loss.detach(), logp=logp)


def _on(rank, bad_rank, bad, good=None):
    """bad on bad_rank, good (default: nothing) on the others."""
    return bad if rank == bad_rank else (good or {})


def scenario_unknown_keyword(p, shard, options, whole, rank):
    return [outcome(lambda: sharded_loss(p, shard, options, **_on(rank, 1, dict(bta=0.04)))),
            outcome(lambda: sharded_loss(p, shard, options))]


def scenario_numpy_hidden(p, shard, options, whole, rank):
    return [outcome(lambda: sharded_loss(p, shard, options,
                                         **_on(rank, 0, dict(hidden=p["hidden"].numpy())))),
            outcome(lambda: sharded_loss(p, shard, options))]


def scenario_items_two_elements(p, shard, options, whole, rank):
    items = _on(rank, 1, dict(num_items_in_batch=torch.tensor([20.0, 21.0])),
                dict(num_items_in_batch=20.0))
    return [outcome(lambda: sharded_loss(p, shard, options, **items)),
            outcome(lambda: sharded_loss(p, shard, options))]


def scenario_missing_argument(p, shard, options, whole, rank):
    return [outcome(lambda: sharded_loss(p, shard, options,
                                         **_on(rank, 1, dict(drop=("advantages",))))),
            outcome(lambda: sharded_loss(p, shard, options))]


def scenario_bad_option(p, shard, options, whole, rank):
    return [outcome(lambda: sharded_loss(p, shard, options, **_on(rank, 1, dict(beta=-1.0)))),
            outcome(lambda: sharded_loss(p, shard, options))]


def scenario_different_options(p, shard, options, whole, rank):
    return [outcome(lambda: sharded_loss(p, shard, options,
                                         **_on(rank, 1, dict(epsilon_low=0.3)))),
            outcome(lambda: sharded_loss(p, shard, options))]


def scenario_spelled_differently(p, shard, options, whole, rank):
    """The same configuration, spelled one way on rank 0 and another on rank 1
    (the job's options are the reference's: beta 0.0, dapo, num_items_in_batch 20)."""
    if rank == 0:
        first = dict(beta=0, loss_type="dapo", epsilon_low=0.2, epsilon_high=None,
                     temperature=1, filter_eps=None, threads=1, num_items_in_batch=20)
        second = dict(beta=0.0, use_bias_correction_kl=0, top_entropy_quantile=1,
                      max_completion_length=None, filter_eps=0, memory_budget=1 << 20,
                      num_items_in_batch=torch.tensor(20.0))
    else:
        first = dict(beta=0.0, num_items_in_batch=20.0)
        second = dict(use_bias_correction_kl=False, num_items_in_batch=20.0)
    return [outcome(lambda: sharded_loss(p, shard, {}, **first)),
            outcome(lambda: sharded_loss(p, shard, {}, **second))]


def scenario_filter_eps_true(p, shard, options, whole, rank):
    """True is no threshold (float(True) would be 1.0); rank 0 passes 1.0."""
    return [outcome(lambda: sharded_loss(p, shard, options,
                                         filter_eps=True if rank == 1 else 1.0)),
            outcome(lambda: sharded_loss(p, shard, options))]


def scenario_logprobs_unknown_keyword(p, shard, options, whole, rank):
    def logprobs():
        kw = _on(rank, 0, dict(tempreature=0.8))
        return fgd.linear_logprobs(p["hidden"], p["weight"], p["token_ids"], p["mask"],
                                   p["bias"], **shard, **kw)
    return [outcome(logprobs), outcome(lambda: sharded_loss(p, shard, options))]


def scenario_module_missing_ref(p, shard, options, whole, rank):
    """Liger's module with beta != 0 and use_ref_model: rank 1 passes neither
    the reference log-probs nor ref_input (its forward refuses that before
    any call); rank 0 passes them."""
    def forward():
        h, w, b = leaves(p)
        mod = fgd.FusedLinearGRPOLoss(beta=0.04, loss_type="dapo", **shard)
        ref = None if rank == 1 else p["ref_logp"]
        loss, _ = mod(h, w, p["token_ids"], p["mask"].long(), p["advantages"], b,
                      ref_per_token_logps=ref, old_per_token_logps=p["old_logp"])
        loss.backward()
        return dict(loss=loss.detach())
    return [outcome(forward), outcome(lambda: sharded_loss(p, shard, options))]


def scenario_agreed_type_error(p, shard, options, whole, rank):
    numpy_hidden = _on(rank, 0, dict(hidden=whole["hidden"].numpy()))
    return [outcome(lambda: whole_loss(whole, options, **_on(rank, 1, dict(bta=0.04)))),
            outcome(lambda: whole_loss(whole, options, **numpy_hidden)),
            outcome(lambda: whole_loss(whole, options))]


def scenario_trusted_bad_weight(p, shard, options, whole, rank):
    """trust_inputs=True (the job's tp): rank 1's weight shard is float64,
    which its request refuses; with no entry agreement it joins the phases
    as a failed rank (the weight is the one operand the caller's guarantee
    leaves to each rank)."""
    bad = _on(rank, 1, dict(weight=p["weight"].double().requires_grad_()))
    return [outcome(lambda: sharded_loss(p, shard, options, **bad)),
            outcome(lambda: sharded_loss(p, shard, options))]


SCENARIOS = {k[len("scenario_"):]: v for k, v in dict(globals()).items()
             if k.startswith("scenario_")}


def run_job(job, grid):
    p, shard, options = (lce_problem if job["kind"] == "lce" else local_problem)(job, grid)
    if job["kind"] == "scenario":
        calls = SCENARIOS[job["scenario"]](p, shard, options, job["problem"], dist.get_rank())
        return dict(calls=calls, vocab_rank=grid.vocab_rank, data_rank=grid.data_rank)
    if job.get("break_rank") == dist.get_rank():
        break_input(job, p, options)
    step = STEPS[job["kind"]](p, shard, options, grid)
    t0 = time.monotonic()
    contexts = DEVICE_CONTEXTS[0]
    try:
        out = step()
    except FusedGRPOError as e:
        return dict(status=e.status, message=str(e), seconds=time.monotonic() - t0,
                    device_contexts=DEVICE_CONTEXTS[0] - contexts)
    out["vocab_rank"], out["data_rank"] = grid.vocab_rank, grid.data_rank
    out["device_contexts"] = DEVICE_CONTEXTS[0] - contexts
    return out


def main(argv):
    rank, world, port = (int(a) for a in argv[:3])
    jobs_file, out_dir = argv[3:5]
    torch.set_num_threads(1)
    backend = os.environ.get("FG_TEST_TORCH_DIST_BACKEND")
    if backend:
        use_backend(backend)
    timeout = float(os.environ.get("FG_TEST_TORCH_DIST_TIMEOUT_S", "60"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    jobs = torch.load(jobs_file, weights_only=False)
    grids, results = {}, {}
    for job in jobs:
        k = job["vocab_shards"]
        if k not in grids:  # new_group is collective: every rank, same order
            grids[k] = fgd.make_grid(k)
        try:
            results[job["name"]] = run_job(job, grids[k])
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            results[job["name"]] = dict(exception=traceback.format_exc())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
