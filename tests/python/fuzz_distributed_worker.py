"""One rank of test_fuzz_front_ends.py's 2-rank gloo group (run as a script):

    python fuzz_distributed_worker.py RANK WORLD PORT CASES_FILE OUT_FILE

CASES_FILE is a JSON list of cases, the same on both ranks, run in order. In a
case one rank (``bad_rank``) calls fusedgrpo.torch_distributed's loss with one
argument broken (``bad``: an unknown keyword, a NumPy hidden, a wrong shape, a
bool option, ...) while the other calls it correctly; each rank records what
it raised and how long that took. After every case both ranks make a good
call, whose loss is recorded too: a rank left waiting, or ranks pairing up
across calls, shows there. The gloo group's timeout is 30 s, so a rank that
waits fails its case instead of hanging. OUT_FILE gets a JSON list of
{case, outcome, seconds, good_loss}.
"""
import datetime
import json
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import fusedgrpo
import fusedgrpo.torch_distributed as fgd

B, T, H, V = 2, 3, 5, 11


def problem():
    g = torch.Generator().manual_seed(3)
    return dict(hidden=torch.randn(B, T, H, generator=g),
                weight=torch.randn(V, H, generator=g),
                token_ids=torch.randint(0, V, (B, T), generator=g),
                mask=torch.ones(B, T, dtype=torch.bool),
                advantages=torch.randn(B, generator=g))


def good_call(p, rank, world):
    """(args, kwargs) of this rank's call: its rows of the vocab-split weight."""
    start, rows = fgd.vocab_shard_range(V, world, rank)
    return ([p["hidden"], p["weight"][start:start + rows], p["token_ids"], p["mask"],
             p["advantages"]], dict(vocab_start=start, vocab_size=V))


def broken(p, rank, world, bad):
    """(args, kwargs) of this rank's call with one argument broken as ``bad`` says."""
    args, kw = good_call(p, rank, world)
    if bad == "unknown_keyword":
        kw["bta"] = 0.1
    elif bad == "numpy_hidden":
        args[0] = p["hidden"].numpy()
    elif bad == "items_two_elements":
        kw["num_items_in_batch"] = torch.tensor([3.0, 4.0])
    elif bad == "token_ids_shape":
        args[2] = p["token_ids"][:, :-1]
    elif bad == "bool_beta":
        kw["beta"] = True
    elif bad == "filter_eps_sentinel":
        kw["filter_eps"] = -1
    elif bad == "fractional_vocab_start":
        kw["vocab_start"] += 0.5
    elif bad == "missing_advantages":
        args = args[:4]
    elif bad == "float64_hidden":
        args[0] = p["hidden"].double()
    elif bad == "half_mask":
        args[3] = torch.full((B, T), 0.5)
    elif bad == "token_out_of_range":
        ids = p["token_ids"].clone()
        ids[0, 0] = V + 4
        args[2] = ids
    elif bad == "nan_hidden":
        h = p["hidden"].clone()
        h[1, 2, 3] = float("nan")
        args[0] = h
    elif bad == "bad_loss_type":
        kw["loss_type"] = "ppo"
    else:
        raise ValueError(bad)
    return args, kw


def loss_of(args, kw):
    return float(fgd.fused_linear_grpo_loss(*args, **kw)[0])


def main():
    rank, world, port, cases_file, out_file = sys.argv[1:6]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    p = problem()
    good = good_call(p, rank, world)
    results = []
    for case in json.load(open(cases_file)):
        args, kw = broken(p, rank, world, case["bad"]) if rank == case["bad_rank"] else good
        t0 = time.monotonic()
        try:
            outcome = {"returned": loss_of(args, kw)}
        except fusedgrpo.FusedGRPOError as e:
            outcome = {"raised": "FusedGRPOError", "status": e.status}
        except Exception as e:  # noqa: BLE001: the type is what is recorded
            outcome = {"raised": type(e).__name__, "message": str(e)[:300]}
        seconds = time.monotonic() - t0
        try:
            good_loss = loss_of(*good)
        except Exception as e:  # noqa: BLE001
            good_loss = f"{type(e).__name__}: {str(e)[:300]}"
        results.append(dict(case=case, outcome=outcome, seconds=seconds, good_loss=good_loss))
    json.dump(results, open(out_file, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
