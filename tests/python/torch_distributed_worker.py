"""One rank of test_torch_distributed.py's process groups (run as a script):

    python torch_distributed_worker.py RANK WORLD PORT JOBS_FILE OUT_DIR

Joins a gloo group on tcp://127.0.0.1:PORT, runs every job of JOBS_FILE (a
torch.save'd list, the same on every rank, run in order) on its share of the
job's problem, and saves {job name: result} to OUT_DIR/rank<RANK>.pt. A job:
  name, kind ("loss" | "module" | "logprobs" | "agreed"), problem (the whole batch and
  head), vocab_shards (the rest of the world splits the batch, DDP averaging
  the gradients over the data group), options (the loss's), and optionally
  break_rank / break_what ("token", "nan", "beta", "shape", "advantages",
  "nan_grad_logp": what that rank gets wrong) and masked_data_row (a data row
  whose sequences are all masked).
A result holds the rank's outputs and gradients, or the FusedGRPOError it
raised (status, message, seconds from the call to the raise), and how many
device contexts the job's calls asked for.

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
    shard = dict(vocab_start=v0, vocab_size=V, process_group=grid.vocab_group)
    options = dict(job.get("options", {}))
    if grid.data_shards > 1 and options.get("loss_type", "dapo") in TOKEN_NORMALISED:
        options["num_items_in_batch"] = items
    return p, shard, options


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


STEPS = {"loss": loss_step, "module": module_step, "logprobs": logprobs_step,
         "agreed": agreed_step}


def run_job(job, grid):
    p, shard, options = local_problem(job, grid)
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
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
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
